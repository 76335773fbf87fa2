"""The main job: warm start + GRPO on the long-tail arithmetic task.

  python -m tlt_jax.train [--config=CONFIG_FILE] [--config.<field>=VALUE ...] [--verbose]

Builds a tiny char-level policy, warm-starts it with supervised steps on correct traces, then
runs GRPO (rollout -> reward -> advantages -> policy update) data-parallel over every local
device. Writes to the logdir: ``config.json`` (the effective config, reused on resume),
``metrics.jsonl`` and tensorboard events, verified orbax checkpoints in ``checkpoints/``, and
the final policy with its tokenizer in ``final_model/`` (usable by ``tlt_jax.generate``).

  --config.logdir=DIR --config.resume=True   continues DIR's run with its saved config; other
                                             --config.<field> flags override it (announced)
  --verbose                                  tracebacks for errors (default: one line)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import time
from typing import Any, Iterable

import jax
import ml_collections
import numpy as np
from flax import nnx

from tlt_jax import config as config_lib
from tlt_jax.checkpoint import Checkpointer, count_nonfinite
from tlt_jax.config import ConfigError, check_keys, section, to_dataclass
from tlt_jax.models import hf
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.sft import SFTConfig, warm_start
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import GRPOTrainer, NonFiniteUpdateError, TrainerConfig, \
    check_update_layout
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.utils import progress_bar

_DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "tiny_grpo.py"
_TOP_LEVEL = {"seed", "logdir", "distributed", "resume", "checkpoint_every", "drafter",
              "mesh_devices", "task", "model", "sft", "grpo", "trainer", "rollout"}
_RUN_FIELDS = {"logdir", "resume"}  # where a run lives, not what it does: never saved/compared
CONFIG_FILE = "config.json"
FINAL_MODEL = "final_model"


# ----------------------------------------------------------------------------- the job's parts


@dataclasses.dataclass(frozen=True)
class Job:
  """Everything the config says, validated before any work starts."""

  cfg: ml_collections.ConfigDict
  logdir: pathlib.Path
  task: ArithmeticTask
  tokenizer: CharTokenizer
  model_config: ModelConfig
  sft: SFTConfig
  grpo: grpo.GRPOConfig
  trainer: TrainerConfig
  engine: EngineConfig
  drafter: Any


def build_job(cfg: ml_collections.ConfigDict) -> Job:
  """Checks every section of ``cfg`` (unknown keys and bad values name the field)."""
  check_keys(cfg, _TOP_LEVEL, "")
  missing = sorted(_TOP_LEVEL - set(cfg.keys()))
  if missing:
    raise ConfigError(f"config lacks the fields {missing}; start from "
                      f"{_DEFAULT_CONFIG} and change what you need")
  drafter = {"none": None, "ngram": NgramConfig()}.get(cfg.drafter, "bad")
  if drafter == "bad":
    raise ConfigError(f"config.drafter must be 'none' or 'ngram', got {cfg.drafter!r}")
  for name in ("checkpoint_every", "mesh_devices", "seed"):
    value = cfg[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ConfigError(f"config.{name} must be an int >= 0, got {value!r}")
  task = to_dataclass(ArithmeticTask, section(cfg, "task"), "task")
  tokenizer = CharTokenizer(task.alphabet)
  model_config = to_dataclass(
      ModelConfig, section(cfg, "model"), "model", vocab_size=tokenizer.vocab_size,
      architecture="qwen2", attention_bias=True, tie_word_embeddings=True,
      max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
      eos_token_id=tokenizer.eos_token_id)
  sft = to_dataclass(SFTConfig, section(cfg, "sft"), "sft")
  grpo_config = to_dataclass(grpo.GRPOConfig, section(cfg, "grpo"), "grpo")
  trainer_config = to_dataclass(TrainerConfig, section(cfg, "trainer"), "trainer", seed=cfg.seed)
  engine_config = to_dataclass(EngineConfig, section(cfg, "rollout"), "rollout",
                               max_new_tokens=trainer_config.max_new_tokens,
                               pad_token_id=tokenizer.pad_token_id)
  return Job(cfg=cfg, logdir=pathlib.Path(cfg.logdir), task=task, tokenizer=tokenizer,
             model_config=model_config, sft=sft, grpo=grpo_config, trainer=trainer_config,
             engine=engine_config, drafter=drafter)


def resume_config(cfg: ml_collections.ConfigDict, saved: ml_collections.ConfigDict,
                  overrides: Iterable[str] | None) -> tuple[ml_collections.ConfigDict, list[str]]:
  """The saved run config with ``overrides`` (dotted names) taken from ``cfg``.

  ``overrides=None`` takes every field of ``cfg`` that differs from the saved one. Returns the
  merged config and one line per override or dropped field, for the console.
  """
  current, stored = config_lib.flatten(cfg), config_lib.flatten(saved)
  if overrides is None:
    overrides = {k for k, v in current.items() if k in stored and _differs(stored[k], v)}
  overrides = set(overrides) - _RUN_FIELDS
  merged = ml_collections.ConfigDict(cfg.to_dict())
  notes = []
  for name, value in stored.items():
    if name in _RUN_FIELDS:
      continue
    if name not in current:
      notes.append(f"  the saved field {name}={value!r} is no longer a config field: ignored")
    elif name in overrides:
      if _differs(value, current[name]):
        notes.append(f"  {name}: {value!r} -> {current[name]!r} (override)")
    else:
      config_lib.set_dotted(merged, name, value)
  return merged, notes


def _differs(a, b) -> bool:
  return json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str)


def describe(cfg: ml_collections.ConfigDict) -> str:
  """The effective config, a line per section."""
  flat = config_lib.flatten(cfg)
  lines = []
  for name in sorted(k for k in cfg.keys() if isinstance(cfg[k], ml_collections.ConfigDict)):
    fields = " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in flat.items()
                      if k.startswith(name + "."))
    lines.append(f"  {name}: {fields}")
  top = " ".join(f"{k}={v!r}" for k, v in flat.items() if "." not in k)
  return "\n".join([f"  {top}", *lines])


class MetricsLog:
  """``metrics.jsonl`` plus tensorboard events; on resume, rows after ``resume_step`` are dropped
  (they belong to steps the resumed run does again)."""

  def __init__(self, logdir: pathlib.Path, resume_step: int | None = None):
    self.path = logdir / "metrics.jsonl"
    if resume_step is not None and self.path.exists():
      kept = []
      for line in self.path.read_text(encoding="utf-8").splitlines():
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line torn by a kill
        if isinstance(row, dict) and row.get("step", 0) <= resume_step:
          kept.append(line)
      tmp = self.path.with_name(self.path.name + ".tmp")
      tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
      tmp.replace(self.path)
    self.jsonl = open(self.path, "a", encoding="utf-8")
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      purge = None if resume_step is None else resume_step + 1
      self.writer = SummaryWriter(str(logdir), purge_step=purge)
    except ImportError:
      self.writer = None

  def write(self, step: int, metrics: dict) -> None:
    self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
    self.jsonl.flush()
    if self.writer is not None:
      for key, value in metrics.items():
        if isinstance(value, (int, float)):
          self.writer.add_scalar(key, value, step)
      self.writer.flush()

  def rows(self) -> list[dict]:
    """Every row written so far (this run's and, on resume, the kept earlier ones)."""
    return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines()]

  def close(self) -> None:
    self.jsonl.close()
    if self.writer is not None:
      self.writer.close()


def export_final_model(trainer: GRPOTrainer, job: Job) -> pathlib.Path:
  """Writes the policy and its tokenizer to ``<logdir>/final_model`` atomically (a complete new
  directory replaces the old one), refusing non-finite weights."""
  model = nnx.merge(trainer.graphdef, trainer.params)
  for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
    if count_nonfinite(leaf):
      raise FloatingPointError(f"final model not written: {jax.tree_util.keystr(path)} holds "
                               "non-finite values")
  final = job.logdir / FINAL_MODEL
  tmp, old = final.with_name(FINAL_MODEL + ".tmp"), final.with_name(FINAL_MODEL + ".old")
  for leftover in (tmp, old):
    shutil.rmtree(leftover, ignore_errors=True)
  hf.save_pretrained(model, job.model_config, tmp)
  job.tokenizer.save(tmp)
  if final.exists():
    final.rename(old)
  tmp.rename(final)
  shutil.rmtree(old, ignore_errors=True)
  return final


def _say(text: str) -> None:
  print(text, flush=True)


# ----------------------------------------------------------------------------- the run


def run(cfg: ml_collections.ConfigDict, overrides: Iterable[str] | None = None) -> dict:
  """Runs (or resumes) warm start + GRPO for a config; returns a summary.

  On resume (``cfg.resume``), the run's saved config is used, except the fields named in
  ``overrides`` (``None``: every field where ``cfg`` differs from it).
  """
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # never mutate the caller's config
  check_keys(cfg, _TOP_LEVEL, "")
  if not cfg.logdir:
    if cfg.resume:
      raise ConfigError("config.resume=True needs the run's --config.logdir")
    cfg.logdir = time.strftime("runs/%Y%m%d-%H%M%S")
  logdir = pathlib.Path(cfg.logdir)
  if logdir.exists() and not logdir.is_dir():
    raise ConfigError(f"config.logdir {logdir} is a file, not a directory; choose another "
                      "--config.logdir")
  checkpoint_dir = logdir / "checkpoints"
  with Checkpointer(checkpoint_dir, keep=None) as probe:
    latest = probe.latest_step()
  if cfg.resume:
    if latest is None:
      raise ConfigError(f"config.resume=True but {checkpoint_dir} holds no checkpoint; "
                        f"drop --config.resume to start a new run in {logdir}")
    saved_file = logdir / CONFIG_FILE
    if saved_file.exists():
      cfg, notes = resume_config(cfg, config_lib.read_json_config(saved_file), overrides)
      _say(f"resuming {logdir} with its saved config" +
           (", overridden:\n" + "\n".join(notes) if notes else ""))
    else:
      _say(f"resuming {logdir}: no {CONFIG_FILE} there, so the given config is used as is")
  elif latest is not None:
    raise ConfigError(f"{checkpoint_dir} already holds checkpoints (latest step "
                      f"{latest}); pass --config.resume=True to continue that run, or choose "
                      "another --config.logdir")
  job = build_job(cfg)
  _say(f"config:\n{describe(cfg)}")
  logdir.mkdir(parents=True, exist_ok=True)
  saved_cfg = ml_collections.ConfigDict({k: v for k, v in cfg.to_dict().items()
                                         if k not in _RUN_FIELDS})
  config_lib.write_json_config(saved_cfg, logdir / CONFIG_FILE)
  if cfg.resume and latest >= job.trainer.steps and (logdir / FINAL_MODEL).is_dir():
    _say(f"nothing to do: {logdir} finished at step {latest} (trainer.steps="
         f"{job.trainer.steps}); raise --config.trainer.steps to train further. Results: "
         f"{logdir / 'metrics.jsonl'}, {logdir / FINAL_MODEL}")
    return dict(history=[], lengths=[], finished=True, step=latest)

  if cfg.distributed:
    jax.distributed.initialize()  # multi-host: coordinator/process ids from the environment
  devices = jax.devices()
  if cfg.mesh_devices > len(devices):
    raise ConfigError(f"config.mesh_devices={cfg.mesh_devices} but only {len(devices)} devices "
                      "are visible; use 0 for all of them")
  devices = devices[:cfg.mesh_devices or len(devices)]
  check_update_layout(job.trainer, job.grpo, len(devices))
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  _say(f"devices: {len(devices)} x {devices[0].platform} (data-parallel policy updates)")
  t_start = time.perf_counter()
  model = init_model(job.model_config, seed=cfg.seed)
  if not cfg.resume:
    model = _warm_start(model, job)
  trainer = GRPOTrainer(model, job.tokenizer, job.task, job.engine, job.grpo, job.trainer,
                        mesh=mesh, drafter=job.drafter)
  with Checkpointer(checkpoint_dir, keep=2) as checkpointer:
    if cfg.resume:  # the checkpoint holds the warm-started (and RL-trained) params
      trainer.restore(checkpointer)
      _say(f"resumed from {checkpointer.step_dir(trainer.step_count)}")
    _precompile(trainer)
    log = MetricsLog(logdir, resume_step=trainer.step_count if cfg.resume else None)
    try:
      summary = _train(trainer, job, checkpointer, log)
    finally:
      log.close()
  summary["wall_s"] = time.perf_counter() - t_start
  final = export_final_model(trainer, job)
  _say(f"results: metrics {log.path}, tensorboard --logdir {logdir}, checkpoints "
       f"{checkpointer.directory}, final model {final}")
  return summary


def _warm_start(model, job: Job):
  if job.sft.steps == 0:
    return model
  t0 = time.perf_counter()
  bar = progress_bar(job.sft.steps, "warm start", "step")

  def progress(step, metrics):
    bar.update(1)
    if step % 25 == 0 or step == job.sft.steps:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")

  with bar:
    model, metrics = warm_start(model, job.tokenizer, job.task, job.sft, job.cfg.seed, progress)
  _say(f"warm start: {job.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
       f"loss {metrics.get('loss', float('nan')):.3f}")
  return model


def _precompile(trainer: GRPOTrainer) -> None:
  t0 = time.perf_counter()
  with progress_bar(len(trainer.engine.executable_keys()), "compiling rollout executables",
                    "exe") as bar:

    def progress(done, total):
      bar.total = total
      bar.update(done - bar.n)

    n = trainer.engine.precompile(progress=progress)
  t1 = time.perf_counter()
  m = trainer.precompile_update()
  _say(f"compiled {n} rollout executables in {t1 - t0:.0f}s, {m} policy-update executables in "
       f"{time.perf_counter() - t1:.0f}s")


def _evaluate(trainer: GRPOTrainer) -> tuple[float, float]:
  t0 = time.perf_counter()
  n = trainer.config.eval_problems
  with progress_bar(2 * n, f"held-out evaluation at step {trainer.step_count}", "row") as bar:
    greedy = trainer.evaluate(progress=lambda done, _: bar.update(done - bar.n))
    sampled = trainer.evaluate(temperature=trainer.config.temperature,
                               progress=lambda done, _: bar.update(n + done - bar.n))
  _say(f"held-out at step {trainer.step_count} ({trainer.config.eval_problems} problems, "
       f"{time.perf_counter() - t0:.0f}s): greedy accuracy {greedy:.3f}, sampled reward "
       f"{sampled:.3f}")
  return greedy, sampled


def _resume_hint(job: Job) -> str:
  return (f"continue with: python -m tlt_jax.train --config.logdir={job.logdir} "
          "--config.resume=True")


def _train(trainer: GRPOTrainer, job: Job, checkpointer: Checkpointer, log: MetricsLog) -> dict:
  cfg = job.cfg
  start_step = trainer.step_count
  if start_step == 0:
    accuracy_start, sampled_start = _evaluate(trainer)
    log.write(0, {"eval_accuracy": accuracy_start, "eval_sampled_reward": sampled_start})
  else:
    earlier = [r for r in log.rows() if r.get("step") == 0 and "eval_accuracy" in r]
    accuracy_start = earlier[0]["eval_accuracy"] if earlier else float("nan")
    sampled_start = earlier[0]["eval_sampled_reward"] if earlier else float("nan")
  history, lengths = [], []
  try:
    while trainer.step_count < job.trainer.steps:
      m = trainer.step()
      history.append(m)
      lengths.extend(trainer.last_lengths.tolist())
      log.write(m["step"], m)
      if (cfg.checkpoint_every and trainer.step_count % cfg.checkpoint_every == 0) or \
          trainer.step_count == job.trainer.steps:
        trainer.save(checkpointer, {"config": cfg.to_dict()})
      _say(f"step {m['step']:4d}/{job.trainer.steps} reward {m['reward']:.3f} loss "
           f"{m['loss']:+.4f} len p50/p90/max {m['len_p50']:.0f}/{m['len_p90']:.0f}/"
           f"{m['len_max']} rollout {m['rollout_s']:.1f}s (tail {m['tail_s']:.1f}s) update "
           f"{m['update_s']:.1f}s")
  except NonFiniteUpdateError as e:
    latest = checkpointer.latest_step()
    raise NonFiniteUpdateError(
        f"{e}; nothing non-finite was saved (last checkpoint: step {latest}). Lower "
        "--config.trainer.learning_rate or set --config.trainer.on_nonfinite=skip, then "
        f"{_resume_hint(job)}") from None
  except KeyboardInterrupt:
    latest = checkpointer.latest_step()
    where = (f"the last checkpoint is step {latest}" if latest is not None
             else "no checkpoint was written yet")
    raise KeyboardInterrupt(f"interrupted during step {trainer.step_count + 1}; {where}; "
                            f"{_resume_hint(job)}") from None
  accuracy_end, sampled_end = _evaluate(trainer)
  log.write(trainer.step_count, {"eval_accuracy": accuracy_end,
                                 "eval_sampled_reward": sampled_end})
  summary = dict(accuracy_start=accuracy_start, accuracy_end=accuracy_end,
                 sampled_start=sampled_start, sampled_end=sampled_end, history=history,
                 lengths=lengths, step=trainer.step_count, finished=True)
  if not history:
    return summary
  rollout = sum(m["rollout_s"] for m in history)
  total = sum(m["step_s"] for m in history)
  summary.update(reward_first=float(np.mean([m["reward"] for m in history[:5]])),
                 reward_last=float(np.mean([m["reward"] for m in history[-5:]])),
                 rollout_share=rollout / max(total, 1e-9),
                 tail_share=sum(m["tail_s"] for m in history) / max(total, 1e-9))
  _say(f"held-out sampled reward: {sampled_start:.3f} -> {sampled_end:.3f}; held-out greedy "
       f"accuracy: {accuracy_start:.3f} -> {accuracy_end:.3f}; train reward "
       f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; rollout "
       f"{100 * summary['rollout_share']:.0f}% of step time (tail "
       f"{100 * summary['tail_share']:.0f}%)")
  return summary


if __name__ == "__main__":
  from tlt_jax import cli  # pylint: disable=import-outside-toplevel
  sys.exit(cli.main(__doc__, run, _DEFAULT_CONFIG, sys.argv))
