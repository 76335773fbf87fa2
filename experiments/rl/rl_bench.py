"""Shared pieces of the RL experiments (drafter_drift.py, spot_utilization.py, e2e_speedup.py;
the main job's ``train`` and ``config_lib`` for default_learns.py and rollout_share.py).

Not a script: the RL half of ``harness`` (kept apart because the main job's config needs
``ml_collections``, which the accelerator driver must not). It builds the default job
(configs/tiny_grpo.py through ``tlt_jax.job.build.build_job``) with overrides, warm-starts the tiny
policy once and caches it on disk, trains the initial EAGLE drafter offline on the warm policy's
own temperature-1 rollouts (cached too), and makes ``GRPOTrainer`` arms that each own a fresh
copy of the policy and drafter (the policy update and the drafter steps donate their buffers, so
arms must never share arrays).

Every arm rolls out with ``verify="coupled"``: speculative decoding then emits exactly vanilla
sampling's tokens for a seed, whatever the drafter, so all arms follow one policy trajectory.
``record_rollouts`` keeps a digest of each rollout's tokens so that a script can check it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from experiments import harness
# pylint: disable=unused-import  # train: for default_learns.py and rollout_share.py
from experiments.harness import (Drafter, DrafterTrainingConfig, EngineConfig, GRPOTrainer,
                                 RolloutEngine, SpecConfig, hf, load_drafter, save_drafter,
                                 warm_start, warm_up_on_rollouts, write_report)
from tlt_jax import train
from tlt_jax.configs.tiny_grpo import get_config
from tlt_jax.rl.tasks import ArithmeticTask, Problem, extract_answer
from tlt_jax.job import typed_config as config_lib
from tlt_jax.job.build import Job, build_job
from tlt_jax.job.runner import initial_model
from tlt_jax.rl.packing import padded_batch
from tlt_jax.rl.update import make_logprobs_fn

CACHE = pathlib.Path("experiments/out/rl_bench")
PAPER_TABLE6 = {"stale_drafter_accept_len": 4.59, "adapted_drafter_accept_len": 6.53,
                "source": "TLT paper, Table 6 (Qwen2.5-7B, accept length of a drafter trained "
                          "on the initial policy vs one kept adapted)"}


# ------------------------------------------------------------------------------- drift workload


NEW_STYLE_MARK = "="  # the first character of a completion written in the new style


@dataclasses.dataclass(frozen=True)
class FormatShiftTask:
  """Addition whose reward favours a trace style the warm start rarely writes: RL must move the
  policy's output distribution (the drift workload of drafter_drift.py --drift format).

  The old style is ArithmeticTask's trace (`` 3+4+0=07 5+6+0=11 #117``); the new one opens with
  ``=`` and writes each column carry first (``= 0+4+3=07 1+6+5=12 #127``): the same arithmetic in
  a token order a drafter trained on the old style does not expect. The warm start's traces are
  in the new style with probability ``new_style_share``; a correct answer earns 1.0 in the new
  style and ``old_style_reward`` in the old, a wrong one 0."""

  base: ArithmeticTask
  new_style_share: float = 0.08
  old_style_reward: float = 0.0
  name: str = "arithmetic-format-shift"

  @property
  def alphabet(self) -> str:
    return self.base.alphabet

  def digit_probs(self) -> np.ndarray:
    return self.base.digit_probs()

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` problems; each one's trace in the new style with probability new_style_share."""
    problems = self.base.sample(rng, n)
    styles = rng.random(n) < self.new_style_share
    return [new_style(p) if s else p for p, s in zip(problems, styles)]

  def reward(self, problem: Problem, completion: str) -> float:
    """1.0 for a correct answer in the new style, old_style_reward in the old, else 0."""
    correct = self.base.reward(problem, completion)
    if not correct:
      return 0.0
    return 1.0 if is_new_style(completion) else self.old_style_reward


def new_style(problem: Problem) -> Problem:
  """``problem`` with its trace rewritten carry first: ``x+y+c=tt`` -> ``c+y+x=tt``."""
  steps = []
  for chunk in problem.solution.split():
    if chunk.startswith("#"):
      steps.append(chunk)
      continue
    match = re.fullmatch(r"(\d+)([+-])(\d+)\2(\d+)=(\d+)", chunk)
    if match is None or match.group(2) != "+":
      return problem  # subtraction traces stay as they are
    x, _, y, c, total = match.groups()
    steps.append(f"{c}+{y}+{x}={total}")
  return dataclasses.replace(problem, solution=f"{NEW_STYLE_MARK} " + " ".join(steps))


def is_new_style(completion: str) -> bool:
  return completion.startswith(NEW_STYLE_MARK) and extract_answer(completion) is not None


def with_format_shift(job: Job, share: float = 0.08, old_reward: float = 0.0) -> Job:
  """``job`` on the drift workload: its arithmetic task wrapped in FormatShiftTask."""
  task = FormatShiftTask(job.task, new_style_share=share, old_style_reward=old_reward)
  return dataclasses.replace(job, task=task)


def new_style_share(completions: list[str]) -> float:
  """The share of ``completions`` written in the new style."""
  return float(np.mean([is_new_style(c) for c in completions])) if completions else 0.0


# ---------------------------------------------------------------------------------- the job


def job_for(prompts_per_step: int, group_size: int, max_new_tokens: int, learning_rate: float,
            seed: int = 0, **extra: Any) -> Job:
  """The default tiny GRPO job with the sizes of an experiment (``extra``: dotted overrides)."""
  cfg = get_config()
  cfg.seed = seed
  cfg.trainer.prompts_per_step = prompts_per_step
  cfg.trainer.max_new_tokens = max_new_tokens
  cfg.trainer.learning_rate = learning_rate
  cfg.grpo.group_size = group_size
  cfg.rollout.max_batch = prompts_per_step * group_size
  cfg.rollout.verify = "coupled"
  return build_job(harness.apply_overrides(cfg, extra.items()))


def job_config(seed: int, overrides, logdir: str):
  """The default main job's config (configs/tiny_grpo.py) with ``seed``, ``logdir`` and the
  ``(key, value)`` overrides of ``--set`` (``harness.add_set_flag``) applied."""
  cfg = config_lib.load_config_file(harness.TINY_GRPO)
  cfg.seed, cfg.logdir = seed, logdir
  return harness.apply_overrides(cfg, overrides, harness.TINY_GRPO)


def _key(*parts: Any) -> str:
  text = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def warm_policy_dir(job: Job, say=print) -> pathlib.Path:
  """The warm-started policy of ``job`` (model, sft, task, seed) saved as an HF directory; made
  once, then read from the cache."""
  cfg = job.cfg
  parts = [cfg.model.to_dict(), cfg.sft.to_dict(), cfg.task.to_dict(), cfg.seed]
  if isinstance(job.task, FormatShiftTask):  # its warm start sees the new style's share of
    parts.append(job.task.new_style_share)  # traces (the reward plays no part in it)
  key = _key(*parts)
  path = CACHE / f"policy_{key}"
  if (path / "config.json").is_file():
    return path
  t0 = time.perf_counter()
  model = initial_model(job, cfg.seed)
  model, metrics = warm_start(model, job.tokenizer, job.task, job.sft, cfg.seed)
  hf.save_pretrained(model, job.model_config, path)
  (path / "warm_start.json").write_text(json.dumps(
      dict(sft=cfg.sft.to_dict(), seed=cfg.seed, metrics=metrics,
           seconds=round(time.perf_counter() - t0, 1)), indent=2))
  say(f"warm start: {job.sft.steps} steps in {time.perf_counter() - t0:.0f}s, loss "
      f"{metrics.get('loss', float('nan')):.3f} -> {path}")
  return path


def load_policy(path: pathlib.Path):
  """A fresh copy of the cached policy (its own arrays)."""
  model, _ = hf.from_pretrained(path)
  return model


def initial_drafter_dir(job: Job, policy_dir: pathlib.Path, steps: int = 300,
                        prompts: int = 256, row_len: int = 256, batch_rows: int = 8,
                        learning_rate: float = 2e-3, seed: int = 0, say=print) -> pathlib.Path:
  """An EAGLE drafter trained offline, before RL, on the warm policy's own rollouts: ``prompts``
  problems (drawn apart from the RL data) completed at the RL temperature, packed into rows, and
  ``steps`` drafter steps (``tlt_jax.drafter.warmup.warm_up_drafter``). Made once, then read from
  the cache."""
  temperature = job.trainer.temperature
  key = _key(policy_dir.name, steps, prompts, row_len, batch_rows, learning_rate, seed,
             temperature, job.trainer.max_new_tokens)
  path = CACHE / f"drafter_{key}"
  if (path / "train_log.json").is_file():
    return path
  t0 = time.perf_counter()
  policy = load_policy(policy_dir)
  problems = job.task.sample(np.random.default_rng([77_000, seed]), prompts)
  bos = [job.tokenizer.bos_token_id]
  ids = [bos + job.tokenizer.encode(p.prompt) for p in problems]
  engine = RolloutEngine(policy, config=EngineConfig(
      max_batch=64, max_prompt_len=job.engine.max_prompt_len,
      max_new_tokens=job.trainer.max_new_tokens, pad_token_id=job.engine.pad_token_id))
  drafter, log = warm_up_on_rollouts(
      policy, engine, ids, max_new_tokens=job.trainer.max_new_tokens, temperature=temperature,
      sample_seed=seed + 1, steps=steps, row_len=row_len, batch_rows=batch_rows,
      learning_rate=learning_rate, seed=seed)
  save_drafter(drafter, path)
  report = dict(steps=steps, prompts=prompts, rows=log["rows"], row_len=row_len,
                batch_rows=batch_rows, learning_rate=learning_rate, temperature=temperature,
                trained_positions=log["trained_positions"],
                generate_s=round(log["generate_s"] + log["features_s"], 1),  # with features
                total_s=round(time.perf_counter() - t0, 1), train_top1=log["train_top1"],
                mean_completion=log["mean_completion"], log=log["log"])
  (path / "train_log.json").write_text(json.dumps(report, indent=2))
  say(f"initial drafter: {steps} offline steps on {prompts} own rollouts, top-1 "
      f"{report['train_top1']:.3f}, {report['total_s']:.0f}s -> {path}")
  return path


def drafter_report(path: pathlib.Path) -> dict:
  log = json.loads((path / "train_log.json").read_text())
  return {k: v for k, v in log.items() if k != "log"} | {"last_log": log["log"][-1]}


def add_job_args(parser, *, steps: int, out: str) -> None:
  """The arguments every RL experiment shares: the job's sizes, the policy lr, the initial
  drafter's offline steps, the seed, the report's path and the workload (--drift)."""
  parser.add_argument("--steps", type=int, default=steps, help="RL steps")
  parser.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
  parser.add_argument("--group", type=int, default=8, help="samples per prompt")
  parser.add_argument("--max-new", type=int, default=96)
  parser.add_argument("--lr", type=float, default=2e-5, help="policy learning rate (the "
                      "default job's)")
  parser.add_argument("--drafter-steps", type=int, default=300, help="offline steps of the "
                      "initial drafter")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=out)
  parser.add_argument("--drift", default="none", choices=["none", "format"], help="format: the "
                      "drift workload (FormatShiftTask: the reward pays for a trace style the "
                      "warm start writes only --new-style-share of the time)")
  parser.add_argument("--new-style-share", type=float, default=0.08, help="--drift format: "
                      "share of the warm start's traces in the new style")
  parser.add_argument("--old-style-reward", type=float, default=0.0, help="--drift format: "
                      "reward of a correct answer in the old style (the new style earns 1)")


def prepare(args, **extra: Any) -> tuple[Job, pathlib.Path, pathlib.Path]:
  """The job of ``args`` (see ``add_job_args``; ``extra``: dotted overrides), the warm policy's
  directory and the initial drafter's (both cached)."""
  job = job_for(args.prompts, args.group, args.max_new, args.lr, args.seed, **extra)
  if args.drift == "format":
    job = with_format_shift(job, args.new_style_share, args.old_style_reward)
  policy_dir = warm_policy_dir(job)
  drafter_dir = initial_drafter_dir(job, policy_dir, steps=args.drafter_steps, seed=args.seed)
  return job, policy_dir, drafter_dir


def finish(path: str, report: dict, lines: list[str]) -> None:
  """Prints the trajectory check and the summary ``lines``, then writes the report."""
  print(f"trajectory: {report['trajectory']}")
  for line in lines:
    print(line)
  write_report(path, report)


def fmt(value, spec: str = ".3f") -> str:
  """``value`` formatted, or "-" when it is None (e.g. no speculative step ran)."""
  return "-" if value is None else format(value, spec)


# ---------------------------------------------------------------------------------- arms


def make_arm(job: Job, policy_dir: pathlib.Path, *, drafter: str | pathlib.Path | None = None,
             spec: SpecConfig | None = None, strategies: tuple[SpecConfig, ...] = (),
             training: DrafterTrainingConfig | None = None, mesh: Mesh | None = None,
             rollout_devices: int = 1, seed: int = 0) -> GRPOTrainer:
  """A trainer with its own policy copy and drafter: ``drafter`` None (vanilla), ``"scratch"`` (a
  random one) or a saved drafter's directory; ``spec``/``strategies`` as in EngineConfig.
  Precompiles the rollout and update executables and, with ``training``, the online drafter's
  train/eval steps for every rollout device (``precompile_drafter``: none compiles inside a
  rollout's tail); the seconds each took are in ``trainer.precompile_s``."""
  engine = dataclasses.replace(job.engine, spec=spec, strategies=tuple(strategies),
                               verify="coupled")
  model = None
  if drafter is None:
    engine = dataclasses.replace(engine, spec=None, strategies=())
  elif drafter == "scratch":
    model = Drafter.create(job.model_config, seed=seed + 1)
  else:
    model = load_drafter(drafter, job.model_config)
  trainer = GRPOTrainer(load_policy(policy_dir), job.tokenizer, job.task, engine, job.grpo,
                        job.trainer, mesh=mesh, drafter=model, chat_template=job.chat_template,
                        rollout_devices=rollout_devices, drafter_training=training)
  t0 = time.perf_counter()
  trainer.engine.precompile()
  t1 = time.perf_counter()
  trainer.precompile_update()
  t2 = time.perf_counter()
  devices = trainer.precompile_drafter()
  trainer.precompile_s = dict(engine=round(t1 - t0, 1), update=round(t2 - t1, 1),
                              drafter=round(time.perf_counter() - t2, 1),
                              drafter_devices=devices)
  record_rollouts(trainer)
  return trainer


def record_rollouts(trainer: GRPOTrainer) -> None:
  """Wraps the trainer's engine so that each rollout leaves a digest of its tokens in
  ``trainer.rollout_digests`` (the last rollout's prompts, tokens and log-probs in
  ``trainer.last_rollout``) and, for a data-parallel rollout, its per-device stats and decode
  wall time in ``trainer.rollout_devices_stats``."""
  trainer.rollout_digests, trainer.rollout_devices_stats = [], []
  inner = trainer.engine.generate

  def generate(prompts, params, *args, **kwargs):
    result = inner(prompts, params, *args, **kwargs)
    trainer.last_rollout = (prompts, result.tokens, result.logprobs)
    tokens = hashlib.sha256(json.dumps(result.tokens).encode()).hexdigest()[:16]
    trainer.rollout_digests.append(tokens)
    if result.stats.devices is not None:
      trainer.rollout_devices_stats.append(dict(
          rollout_wall_s=result.stats.rollout_wall_s, wall_s=result.stats.wall_s,
          devices=result.stats.to_dict()["devices"]))
    return result

  trainer.engine.generate = generate


def make_kl_probe(job: Job, policy_dir: pathlib.Path):
  """``kl(trainer) -> float``: KL(policy || warm start) per completion token, estimated on the
  trainer's last rollout (tokens sampled from the policy, their log-probs as sampled, minus the
  warm start's log-probs of the same tokens). One jitted shape: every rollout padded to
  prompts_per_step x group_size rows of max_prompt_len + max_new_tokens."""
  graphdef, warm = nnx.split(load_policy(policy_dir))
  logprobs = jax.jit(make_logprobs_fn(graphdef, job.trainer.temperature))
  length = job.engine.max_prompt_len + job.trainer.max_new_tokens
  rows = job.trainer.prompts_per_step * job.grpo.group_size

  def kl(trainer: GRPOTrainer) -> float:
    prompts, tokens, sampled = trainer.last_rollout
    pad = rows - len(prompts)
    batch = padded_batch(list(prompts) + [[0]] * pad, list(tokens) + [[]] * pad,
                         list(sampled) + [np.zeros(0, np.float32)] * pad, np.zeros(rows),
                         length, job.engine.pad_token_id)
    mine = batch["old_logprobs"]
    theirs = np.asarray(logprobs(warm, {"ids": batch["ids"]}))
    mask = batch["mask"]
    return float(((mine - theirs) * mask).sum() / max(mask.sum(), 1.0))

  return kl


def params_vector(trainer: GRPOTrainer) -> np.ndarray:
  return np.concatenate([np.asarray(x, np.float64).ravel()
                         for x in jax.tree.leaves(jax.device_get(trainer.policy.params))])


# mean_accept_len is absent when the rollout ran no speculative step; drafter_loss/top1 are
# held out (the weights that drafted the rollout, on its freshest data, before the step's serial
# training), drafter_train_loss/top1 the mean over the step's drafter steps (in-sample)
STEP_KEYS = ("reward", "rollout_s", "update_s", "step_s", "tail_s", "mean_accept_len",
             "len_p50", "len_max", "loss", "compiles", "drafter_loss", "drafter_top1",
             "drafter_train_loss", "drafter_train_top1", "drafter_spot_steps", "drafter_spot_s",
             "drafter_serial_steps", "drafter_serial_s", "tail_idle_device_s",
             "tail_idle_used_device_s", "spot_overrun_s", "sd_switches")


def step_row(metrics: dict) -> dict:
  out = {}
  for k in STEP_KEYS:
    if k in metrics:
      v = metrics[k]
      out[k] = round(float(v), 5) if isinstance(v, float) else v
  return out


def same_trajectory(arms: dict[str, GRPOTrainer], rows: dict[str, list[dict]]) -> dict:
  """Whether every arm rolled out the same tokens and got the same rewards at every step, and
  how far apart their final params are (max |difference| relative to the largest |param|)."""
  names = list(arms)
  first = names[0]
  tokens = all(arms[n].rollout_digests == arms[first].rollout_digests for n in names)
  rewards = all([r["reward"] for r in rows[n]] == [r["reward"] for r in rows[first]]
                for n in names)
  diverged = {}
  for n in names[1:]:
    mine, ref = arms[n].rollout_digests, arms[first].rollout_digests
    diff = [i + 1 for i, (a, b) in enumerate(zip(mine, ref)) if a != b]
    if diff:
      diverged[n] = diff[0]
  ref = params_vector(arms[first])
  scale = float(np.abs(ref).max())
  params_gap = {n: float(np.abs(params_vector(arms[n]) - ref).max() / scale) for n in names[1:]}
  return dict(identical_tokens=tokens, identical_rewards=rewards,
              first_divergent_step=diverged, final_params_max_rel_gap=params_gap)
