"""The GRPO trainer: one RL step is problems -> rollout -> rewards -> group advantages -> update.

One RL step samples ``prompts_per_step`` problems (deterministically from ``(seed, step)``, so
the data position is the step number: fresh problems every step, or with ``num_prompts`` a fixed
prompt set visited once per epoch), completes each ``group_size`` times with the rollout engine,
scores the completions with the task's verifiable reward, and takes ``minibatches`` clipped
policy-gradient steps per epoch. The rooms it calls on:

* ``rollout/`` generates (one device, or data-parallel over several: one interface);
* ``rl/packing.py`` lays the rows out for the update, ``rl/update.py`` owns the params, optimizer
  state and ahead-of-time compiled update steps (``PolicyUpdate``);
* ``drafter/online.py`` is the adaptive drafter's part of the step (its buffer, spot and serial
  training, its checkpoint), present when the drafter trains online;
* ``rollout/decode/suffix_history.py`` keeps the earlier completions of every prompt for a suffix drafter to
  draft from (``Rollout.uses_history``), saved with the checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tlt_jax import checkpoint as ckpt
from tlt_jax.drafter.online import DrafterTrainingConfig, OnlineDrafter, step_metrics
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.tokenizer import Tokenizer
from tlt_jax.models.transformer import Transformer
from tlt_jax.rl import grpo
from tlt_jax.rl.data import EVAL_SEED, encode_prompt, eval_problems, step_problems, tokens_digest
from tlt_jax.rl.packing import padded_batch
from tlt_jax.rl.run_state import DrafterPart, HistoryPart, PolicyPart, RunState, StepPart, \
    TunerPart
from tlt_jax.rl.tasks import EpochSchedule, Problem
from tlt_jax.rl.trainer_config import StepDevices, TrainerConfig
from tlt_jax.rl.update import PolicyUpdate
from tlt_jax.rollout import (EngineConfig, HistoryConfig, HistoryStore, SamplingParams,
                             SuffixConfig, make_rollout, prompt_key, rollout_metrics)


class GRPOTrainer:
  """Owns the rollout engine, the policy update and, when it trains online, the drafter;
  ``step()`` runs one RL step."""

  def __init__(self, model: Transformer, tokenizer: Tokenizer, task, engine_config: EngineConfig,
               grpo_config: grpo.GRPOConfig, config: TrainerConfig, mesh: Mesh | None = None,
               drafter=None, chat_template: bool = False, rollout_devices: int = 1,
               drafter_training: DrafterTrainingConfig | None = None,
               suffix: SuffixConfig | None = None, history: HistoryConfig | None = None,
               checked: StepDevices | None = None):
    """``drafter`` (a ``Drafter``, or a model-free kind's config such as ``NgramConfig``) makes
    rollouts speculative (lossless: speed only); ``suffix`` adds the suffix drafter, which
    drafts from the ``history`` store (kept and checkpointed only when the engine uses it).
    ``chat_template``: prompts go through the tokenizer's chat template (``tasks.chat_prompt``)
    instead of ``<bos> + text``.
    ``rollout_devices``: the mesh's devices that roll out data-parallel (0: all, 1: the first).
    ``drafter_training``: train the drafter online from the rollouts' hidden states
    (docs/library.md, "GRPOTrainer"). ``checked``: the ``StepDevices`` of ``mesh`` and
    ``rollout_devices``, checked already (the job's); None: checked here."""
    self.tokenizer, self.task, self.config, self.grpo_config = tokenizer, task, config, grpo_config
    self.chat_template = chat_template
    self.mesh = mesh or Mesh(np.array(jax.devices()[:1]), ("data",))
    # this process's devices of the mesh (on several hosts each one rolls out on its own)
    devices = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
    shape = (config, grpo_config, self.mesh.size, len(devices), rollout_devices)
    if checked is None:
      StepDevices(*shape)
    elif not checked.fits(*shape):
      raise ValueError(f"GRPOTrainer(checked={checked}) was checked for other configs or devices "
                       f"than the trainer's {shape[2:]}")
    if config.max_new_tokens > engine_config.max_new_tokens:
      raise ValueError(f"TrainerConfig.max_new_tokens={config.max_new_tokens} exceeds "
                       f"EngineConfig.max_new_tokens={engine_config.max_new_tokens}")
    self.rollout_devices = devices[:rollout_devices or len(devices)]
    self.engine = make_rollout(model, drafter, engine_config, self.rollout_devices, suffix=suffix)
    self.history_config = history
    self.history = None  # HistoryStore: the prompts' earlier completions (a suffix drafter's)
    # step_progress(phase, done, total): how far a step is ("rollout": rows done; "update": the
    # policy update begins), for a job's progress lines; None: silent
    self.step_progress: Callable[[str, int, int], Any] | None = None
    if history is not None and self.engine.uses_history:
      self.history = HistoryStore(history)
    self._schedule = None  # EpochSchedule (epoch mode), made when first needed
    self.online = None
    if drafter_training is not None:
      if not isinstance(drafter, Drafter):
        raise ValueError("drafter_training needs a learned (EAGLE) drafter, e.g. "
                         "Drafter.create(model.config); the n-gram drafter has nothing to train")
      self.online = OnlineDrafter(drafter, nnx.split(model)[0], drafter_training)
    graphdef, params = nnx.split(model)
    self.seq_len = engine_config.max_prompt_len + config.max_new_tokens
    self.policy = PolicyUpdate(graphdef, params, config, grpo_config, self.mesh, self.seq_len,
                               engine_config.pad_token_id)
    self._sync_engine()  # before anything compiles: the engine's executables take these arrays
    # the engines decode with copies of the drafter: its train step donates its own arrays
    self._sync_drafter(always=True)
    self.step_count = 0
    self.last_lengths = np.zeros(0, np.int64)  # completion lengths of the latest step

  # the policy's state and update functions live in ``self.policy`` (``rl/update.py``)

  def _sync_engine(self) -> None:
    """Hands the rollout engine(s) the current params as single-device arrays.

    Each rollout device's engine decodes with that device's shard of the replicated params, a
    zero-copy view of the same buffer, so an engine compiles for one device and never sees a mesh
    sharding. (Compiling for the replicated sharding instead would run every decode step
    redundantly on all devices.) The views die with the params they view, which the update
    donates: call this after every update.
    """
    self.engine.update_params(self.policy.rollout_params())


  def _sync_drafter(self, always: bool = False) -> None:
    """Hands the engines a copy of the online drafter's weights (no recompile) when training
    changed them (``always``: in any case), and tells their tuner how good the weights that
    drafted until now were (their held-out top-1)."""
    if self.online is None:
      return
    device = self.rollout_devices[0]
    weights = (self.online.engine_params(device) if always else
               self.online.new_engine_params(device))
    if weights is not None:
      self.engine.update_params(self.policy.rollout_params(), weights)
      self.engine.observe_drafter(self.online.quality)

  def precompile_drafter(self) -> int:
    """Compiles the online drafter's train and eval steps for every rollout device; returns how
    many devices (0 without online drafter training)."""
    return 0 if self.online is None else self.online.precompile_on(self.engine)

  def first_request_rows(self) -> list[int]:
    """The row counts of the rollout requests a run starts with: the held-out evaluation's
    (greedy and sampled; pass@k's) and an RL step's (``RolloutEngine.precompile``'s
    ``first_rows``)."""
    cfg = self.config
    rows = [cfg.eval_problems, cfg.prompts_per_step * self.grpo_config.group_size]
    if cfg.eval_pass_k:
      rows.append(min(cfg.eval_pass_problems, cfg.eval_problems) * cfg.eval_pass_k)
    return rows

  def precompile_update(self, progress=None) -> int:
    """Compiles every executable the policy updates use (``PolicyUpdate.precompile``;
    ``progress(done, total)`` after each); returns
    how many it compiled now (0 once done)."""
    return self.policy.precompile(progress)

  def update_temp_bytes(self) -> dict[str, int | None]:
    """XLA's scratch memory of each update executable compiled so far (``PolicyUpdate``)."""
    return self.policy.temp_bytes()

  # ---- data ---------------------------------------------------------------------------------
  def problems_for(self, step: int) -> list[Problem]:
    """The step's problems: a pure function of (seed, step), so a resumed run sees the same data
    (``step_problems``)."""
    schedule = self.schedule
    if schedule is None:
      return step_problems(self.task, self.config.seed, step, self.config.prompts_per_step)
    return schedule.step_problems(step)

  @property
  def schedule(self) -> EpochSchedule | None:
    """Epoch mode's data order (``TrainerConfig.num_prompts`` > 0), else None; drawn for the
    current ``self.task``."""
    if not self.config.num_prompts:
      return None
    if self._schedule is None or self._schedule.task is not self.task:
      self._schedule = EpochSchedule(self.task, self.config.seed, self.config.num_prompts,
                                     self.config.prompts_per_step)
    return self._schedule

  def encode_prompt(self, problem: Problem) -> list[int]:
    """The prompt's ids (``encode_prompt``)."""
    return encode_prompt(self.tokenizer, problem, self.chat_template)

  def make_batch(self, prompts, completions, logprobs, advantages) -> dict[str, np.ndarray]:
    """The step's padded batch (``packing.padded_batch``) at this trainer's row length."""
    return padded_batch(prompts, completions, logprobs, advantages, self.seq_len,
                        self.engine.config.pad_token_id)

  def sampling_for(self, step: int) -> SamplingParams:
    """How RL step ``step`` samples: the trainer's temperature, a seed of (seed, step)."""
    cfg = self.config
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          seed=(cfg.seed * 1_000_003 + step) % 2**32)

  # ---- one RL step ---------------------------------------------------------------------------
  def step(self) -> dict[str, Any]:
    """Rollout, reward, advantages and policy updates for one step; returns its metrics."""
    cfg, g, online = self.config, self.grpo_config.group_size, self.online
    t0 = time.perf_counter()
    problems = self.problems_for(self.step_count)
    rows = [p for p in problems for _ in range(g)]  # group by group
    prompts = [self.encode_prompt(p) for p in rows]
    self._sync_engine()  # (cheap) in case the params were replaced from outside
    sampling = self.sampling_for(self.step_count)
    options = {} if online is None else online.rollout_options(self.step_count, prompts,
                                                                self.engine)
    earlier = None
    if self.history is not None:  # per row, the earlier completions of its prompt
      earlier = self.history.lookup(prompts[::g], arrays=True)
      options = dict(options, history=[h for h in earlier for _ in range(g)])
    tell = self.step_progress
    result = self.engine.generate(
        prompts, sampling, progress=None if tell is None else
        (lambda done, total: tell("rollout", done, total)), **options)
    t_rollout = time.perf_counter() - t0
    drafter_metrics = {}
    if online is not None:
      drafter_metrics = online.after_rollout(self.step_count, prompts, result, self.engine)
      if jax.process_count() > 1:  # each process trained its own copy: the same one again
        drafter_metrics["drafter_sync_s"] = online.sync_processes()
      self._sync_drafter()
    elif len(self.rollout_devices) > 1:  # the tail's idle device-seconds, with none used
      drafter_metrics = step_metrics(result.stats, [], None, {})
    texts = self.completion_texts(result.tokens)
    rewards = np.array([self.task.reward(p, t) for p, t in zip(rows, texts)], np.float32)
    advantages = grpo.group_advantages(rewards, g, self.grpo_config.normalize_std,
                                       self.grpo_config.eps)  # numpy: nothing compiles
    batch = self.make_batch(prompts, result.tokens, result.logprobs, advantages)
    t1 = time.perf_counter()
    if tell is not None and not cfg.control:
      tell("update", 0, 1)
    out = {"control": True} if cfg.control else self.policy_update(batch)  # control: params kept
    t_update = time.perf_counter() - t1
    self.step_count += 1
    lengths = self.last_lengths = np.array([len(t) for t in result.tokens])
    out.update(step=self.step_count, reward=float(rewards.mean()),
               len_p50=float(np.percentile(lengths, 50)), len_p90=float(np.percentile(lengths, 90)),
               len_p99=float(np.percentile(lengths, 99)), len_max=int(lengths.max()),
               rollout_s=t_rollout, update_s=t_update, step_s=time.perf_counter() - t0,
               tail_s=result.stats.tail_s, last_s=result.stats.last_s,
               compiles=result.stats.compiles,
               rollout_digest=tokens_digest(result.tokens))
    offered = None
    if self.engine.tuner is not None:
      offered = {b: [s.name for s in self.engine.strategies_for(b)]
                 for b in self.engine.config.batch_buckets}
    out.update(rollout_metrics(result.stats, offered))
    out.update(drafter_metrics)
    if self.schedule is not None:
      out["epoch"] = self.schedule.epoch(self.step_count - 1)
    if self.history is not None:  # after a good update: a step that raised leaves it as it was
      out.update(self._remember(prompts, result.tokens, earlier))
    if online is not None:  # the step's seconds: the drafter bootstrap's time budget
      online.end_step(out["step_s"])
    return out

  def _remember(self, prompts, completions, earlier) -> dict[str, float | int]:
    """Adds the step's groups to the history store; returns its metrics: the store's size
    (``history_bytes``, ``history_prompts``) and the share of the step's distinct prompts that
    had an earlier completion to draft from (``history_hit_rate``)."""
    g = self.grpo_config.group_size
    had = {}
    for i, first in enumerate(range(0, len(prompts), g)):
      had.setdefault(prompt_key(prompts[first]), bool(earlier[i]))
    for first in range(0, len(prompts), g):
      self.history.add(prompts[first], completions[first:first + g])
    return dict(history_bytes=self.history.size_bytes, history_prompts=self.history.num_prompts,
                history_hit_rate=sum(had.values()) / len(had))

  def policy_update(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """The step's policy updates (``PolicyUpdate.run``); the engines get the new params, or the
    ones from before the step when it raises ``NonFiniteUpdateError``. A stop at once (a
    ``KeyboardInterrupt``, e.g. a second Ctrl-C) goes on as it is: it may land inside an update
    whose donated params are gone, and nothing decodes after it."""
    try:
      out = self.policy.run(batch, self.step_count)
    except KeyboardInterrupt:
      raise
    except BaseException:
      self._sync_engine()
      raise
    self._sync_engine()
    return out

  # ---- checkpoints ----------------------------------------------------------------------------
  def run_state(self) -> RunState:
    """The run's state as one value (``rl/run_state.py``): the policy and its optimizer, the step,
    the online drafter and its buffer, the tuner, the history store, each where present."""
    parts = {"policy": PolicyPart(self.policy, self._sync_engine),
             "step": StepPart(lambda: self.step_count,
                              lambda step: setattr(self, "step_count", step)),
             "tuner": TunerPart(self.engine)}
    if self.online is not None:
      parts["drafter"] = DrafterPart(self.online, lambda: self._sync_drafter(always=True))
    if self.history is not None:
      parts["history"] = HistoryPart(self.history, self.history_config,
                                     lambda store: setattr(self, "history", store))
    return RunState(parts)

  def checkpoint_state(self) -> dict:
    """The checkpoint's arrays (``RunState.arrays``)."""
    return self.run_state().arrays()

  def save(self, checkpointer: ckpt.Checkpointer, metadata: dict | None = None) -> None:
    """Saves params, optimizer state and the step (the data position is the step) atomically;
    the metadata holds the trainer's config (``"trainer"``), ``metadata``, what the adaptive
    engine's tuner learned (``"tuner"``), if it has one, and the history store (``"history"``),
    if one is kept; the online drafter's data buffer is a file beside the step's arrays
    (``RunState.save``)."""
    self.run_state().save(checkpointer, {"trainer": dataclasses.asdict(self.config),
                                         **(metadata or {})})

  def restore(self, checkpointer: ckpt.Checkpointer, step: int | None = None,
              report=print) -> dict:
    """Loads ``step``, or by default the newest checkpoint that passes verification (a corrupt
    newer one is reported through ``report`` and moved aside), its tuner state into the adaptive
    engine's tuner (``Rollout.load_tuner_state``) and its history store, if one is kept (a
    checkpoint without one, e.g. from before the store existed, is reported and the store starts
    empty); returns its metadata (``RunState.restore``)."""
    return self.run_state().restore(checkpointer, step, report)

  def completion_texts(self, tokens: list[list[int]]) -> list[str]:
    """The completions as the reward reads them: special tokens (the EOS a finished row ends
    with) left out, in training and held-out evaluation alike."""
    return [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]

  def evaluate(self, n: int | None = None, seed: int = EVAL_SEED, temperature: float = 0.0,
               progress=None) -> float:
    """Mean reward on held-out problems (a fixed set, independent of training data): greedy
    accuracy at temperature 0, or the expected reward of the sampling policy otherwise.
    ``progress(rows_done, rows_total)`` is passed to the engine's ``generate``."""
    return float(np.mean(self.held_out(n, seed, temperature, progress)[2]))

  def held_out(self, n: int | None = None, seed: int = EVAL_SEED, temperature: float = 0.0,
               progress=None, samples: int = 1) -> tuple[list[Problem], list[str], list[float]]:
    """What ``evaluate`` averages, problem by problem: the held-out problems, the policy's
    completions (decoded) and their rewards; ``samples`` > 1: that many completions of each
    problem, in a row (each row draws its own tokens)."""
    problems = eval_problems(self.task, n or self.config.eval_problems, seed)
    rows = [p for p in problems for _ in range(samples)]
    self._sync_engine()
    result = self.engine.generate([self.encode_prompt(p) for p in rows], SamplingParams(
        max_new_tokens=self.config.max_new_tokens, temperature=temperature, seed=seed),
        progress=progress)
    texts = self.completion_texts(result.tokens)
    return rows, texts, [self.task.reward(p, t) for p, t in zip(rows, texts)]

  def pass_at(self, k: int, n: int | None = None, seed: int = EVAL_SEED,
              progress=None) -> np.ndarray:
    """Per held-out problem, whether any of ``k`` completions sampled at the trainer's
    temperature earns the full reward (pass@k)."""
    _, _, rewards = self.held_out(n, seed, self.config.temperature, progress, samples=k)
    return np.asarray(rewards).reshape(-1, k).max(axis=1) >= 1.0
