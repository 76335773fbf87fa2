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
* ``rollout/host/history.py`` keeps the earlier completions of every prompt for a suffix drafter to
  draft from (``Rollout.uses_history``), saved with the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
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
from tlt_jax.rl.packing import UPDATE_BUCKET_MIN, padded_batch
from tlt_jax.rl.tasks import EpochSchedule, Problem, chat_prompt
from tlt_jax.rl.update import PolicyUpdate
from tlt_jax.rollout import (EngineConfig, HistoryConfig, HistoryStore, SamplingParams,
                             SuffixConfig, make_rollout, prompt_key, rollout_metrics)
from tlt_jax.utils import FieldError, require_positive_ints

TUNER_KEY = "tuner"  # checkpoint metadata: the adaptive rollout tuner's state_dict()
HISTORY_KEY = "history"  # checkpoint metadata: the HistoryStore's state_dict()


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """How much to sample and how to update per RL step."""

  steps: int = 20
  prompts_per_step: int = 8
  learning_rate: float = 3e-4
  warmup_steps: int = 2
  grad_clip: float = 1.0
  minibatches: int = 1
  epochs: int = 1
  max_new_tokens: int = 96
  temperature: float = 1.0
  eval_problems: int = 64
  seed: int = 0
  # A non-finite loss, gradient or new param always leaves the params and optimizer state as they
  # were. "stop": the step raises NonFiniteUpdateError with the params from before the step;
  # "skip": the step goes on without that minibatch and reports it in `skipped_updates`.
  # ("stop" with several updates per step holds a device copy of params + optimizer state
  # through the step's updates, to restore them.)
  on_nonfinite: str = "stop"
  # Token budget (rows x length) of one policy-update micro-batch. Each minibatch's sequences
  # (rows with a completion) are packed back to back, first-fit decreasing, into rows of the
  # shortest length of a power-of-two ladder (16, 32, ..., ending at max_prompt_len +
  # max_new_tokens) that holds the longest one; a micro-batch of length T holds
  # update_tokens // T packed rows (at most the minibatch, a multiple of the mesh devices and at
  # least one row per device, so a length above the budget still runs). Their gradients are
  # summed into one optimizer step equal to the full-length update's. Bounds update memory; the
  # cost follows the live lengths. A budget well above a minibatch's real tokens pads its packed
  # rows back up (docs/benchmarks.md). Raise it on accelerators, which want bigger passes.
  # 0: pad every row to the full length and update each minibatch in one pass.
  update_tokens: int = 2048
  # 0: fresh problems every step, drawn from (seed, step). > 0: epoch mode, a fixed set of this
  # many problems (distinct prompts) drawn once from the seed and visited once per epoch in a
  # shuffled order (``tasks.EpochSchedule``); at least prompts_per_step
  num_prompts: int = 0
  # Where the policy loss's old log-probs come from. "policy" (the default): the update's own
  # forward pass over the step's completions with the params that sampled them, before the
  # step's first update: they depend on the params and tokens alone. "rollout": the log-probs the
  # rollout engine computed while sampling (no extra forward pass over the step's tokens), whose
  # last bits depend on how it decoded: a speculative step's verify pass over
  # several tokens rounds otherwise than a one-token decode step, so the tuner's timed choice of
  # arm would change the losses, and the run would not follow its seed alone.
  old_logprobs: str = "policy"
  # The no-update control: the same job (rollouts, rewards, drafter, held-out evaluations) with
  # every policy update skipped, so the params stay bit for bit the warm start's. Its held-out
  # curve is what the RL run's is measured against (held-out evaluation is a function of the
  # params alone: fixed problems, fixed sampling seed).
  control: bool = False
  # Held-out evaluation (greedy accuracy and sampled reward on the eval_problems) every this many
  # steps, into metrics.jsonl and tensorboard beside the step's metrics; 0: at the start and the
  # end only. Each costs two generations over eval_problems.
  eval_every: int = 0
  # pass@k of each held-out evaluation at the trainer's temperature: whether any of eval_pass_k
  # samples of a problem is right, over the first eval_pass_problems held-out problems (0: none)
  eval_pass_k: int = 0
  eval_pass_problems: int = 128

  def __post_init__(self):
    require_positive_ints(self, "steps", "prompts_per_step", "minibatches", "epochs",
                          "max_new_tokens", "eval_problems")
    bad = lambda field, problem: FieldError("TrainerConfig", field, problem)
    if not isinstance(self.control, bool):
      raise bad("control", f"must be True or False, got {self.control!r}")
    every = self.eval_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
      raise bad("eval_every", f"must be an int >= 0 (steps between held-out evaluations; 0: at "
                f"the start and the end only), got {every!r}")
    for name in ("eval_pass_k", "eval_pass_problems"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(name, f"must be an int >= 0, got {value!r}")
    if self.eval_pass_k and not self.eval_pass_problems:
      raise bad("eval_pass_problems", f"must be >= 1 where eval_pass_k={self.eval_pass_k} "
                "(or set eval_pass_k=0: no pass@k)")
    if not (isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < math.inf):
      raise bad("learning_rate", f"must be a finite number > 0, got {self.learning_rate!r}")
    if not self.temperature > 0:
      raise bad("temperature", f"must be > 0 for RL sampling, got {self.temperature!r}")
    if self.warmup_steps < 0:
      raise bad("warmup_steps", f"must be >= 0, got {self.warmup_steps!r}")
    n = self.num_prompts
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise bad("num_prompts", f"must be an int >= 0 (0: fresh problems every step), got {n!r}")
    if 0 < n < self.prompts_per_step:
      raise bad("num_prompts", f"({n}) is fewer than prompts_per_step ({self.prompts_per_step}): "
                f"every step would repeat a prompt; use at least {self.prompts_per_step} (or 0: "
                "fresh problems every step)")
    if self.old_logprobs not in ("policy", "rollout"):
      raise bad("old_logprobs", f"must be 'policy' or 'rollout', got {self.old_logprobs!r}")
    if self.on_nonfinite not in ("stop", "skip"):
      raise bad("on_nonfinite", f"must be 'stop' or 'skip', got {self.on_nonfinite!r}")
    budget = self.update_tokens
    if (not isinstance(budget, int) or isinstance(budget, bool)
        or not (budget == 0 or budget >= UPDATE_BUCKET_MIN)):
      raise bad("update_tokens", f"must be an int >= {UPDATE_BUCKET_MIN} (tokens per update "
                f"micro-batch) or 0 (full-length updates), got {budget!r}")

def check_update_layout(config: TrainerConfig, grpo_config: grpo.GRPOConfig, devices: int) -> None:
  """Raises ``ValueError`` unless a step's rows split into equal minibatches over ``devices``."""
  rows = config.prompts_per_step * grpo_config.group_size
  if rows % config.minibatches or (rows // config.minibatches) % devices:
    raise ValueError(
        f"TrainerConfig.prompts_per_step x GRPOConfig.group_size = {rows} rows must split into "
        f"TrainerConfig.minibatches={config.minibatches} minibatches whose size divides over "
        f"{devices} devices: change those fields or the devices")


def check_rollout_devices(value, available: int | None = None,
                          name: str = "rollout_devices") -> None:
  """Raises ``ValueError`` unless ``value`` (how many devices roll out; 0: all of them) is an int
  >= 0 and, where ``available`` (this process's devices of the mesh) is given, at most that.
  ``name``: what the message calls the value (the job's ``config.rollout_devices``)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{name} must be an int >= 0 (0: every device of the mesh), got {value!r}")
  if available is not None and value > available:
    raise ValueError(f"{name}={value} but the mesh has {available} devices in this process; use "
                     f"0 for all of them")


# the held-out problems' generator seed: another stream than training's (seed, step) draws, which
# makes a held-out set disjoint from training only where the task keeps one (``eval_problems``)
EVAL_SEED = 10_000


def eval_problems(task, n: int, seed: int = EVAL_SEED) -> list[Problem]:
  """The fixed held-out problems ``GRPOTrainer.evaluate`` scores the policy on: the task's own
  ``sample_held_out`` where it has one (a file task's evaluation file or split, which training
  never draws), else ``task.sample``, a draw from the training pool itself (the built-in
  arithmetic task: the same problem may be drawn by both; ``held_out_line`` says which)."""
  rng = np.random.default_rng(seed)
  own = getattr(task, "sample_held_out", None)
  return own(rng, n) if callable(own) else task.sample(rng, n)


def held_out_line(task, n: int) -> str:
  """One line for the run's start: where its ``n`` held-out problems come from, and whether they
  are drawn from the training pool (the task's ``held_out_note`` where it has one)."""
  note = getattr(task, "held_out_note", None)
  if note is None:
    name = getattr(task, "name", type(task).__name__)
    return (f"held-out: {n} problems drawn from the training pool: {name}'s own generator with "
            f"seed {EVAL_SEED} (training's draws: (seed, step)), so a held-out problem can also "
            "be a training one")
  size = getattr(task, "held_out_size", None)
  repeat = f"; {n} evaluated, so some repeat" if size is not None and size < n else ""
  return f"{note}{repeat}"


def step_problems(task, seed: int, step: int, n: int, num_prompts: int = 0) -> list[Problem]:
  """The ``n`` problems of RL step ``step``: a pure function of (seed, step), so a resumed run sees
  the same data. ``num_prompts`` > 0: epoch mode, from a fixed set of that many problems
  (``EpochSchedule``; a trainer keeps one instead of drawing the set again every step)."""
  if num_prompts:
    return EpochSchedule(task, seed, num_prompts, n).step_problems(step)
  return task.sample(np.random.default_rng([seed, step]), n)


def encode_prompt(tokenizer: Tokenizer, problem: Problem, chat_template: bool) -> list[int]:
  """A problem's prompt ids: its chat-formatted text (``chat_template``), else BOS (if the
  tokenizer has one) and its text."""
  if chat_template:
    return tokenizer.encode(chat_prompt(tokenizer, problem.prompt))
  bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
  return bos + tokenizer.encode(problem.prompt)


def tokens_digest(tokens) -> int:
  """A 48-bit fingerprint of a rollout's completions (exact in a float64 metric): equal digests
  say two runs sampled the same tokens, row for row."""
  h = hashlib.sha256()
  for row in tokens:
    h.update(np.asarray(row, np.int64).tobytes())
    h.update(b"|")
  return int(h.hexdigest()[:12], 16)


# What a step's metrics follow (``metric_kind``). "timed": measured seconds or rates. "decided":
# counts and scores that follow decisions made from measured time: the tuner's arm per segment
# (arm shares, switches, accepted lengths, which executables a lazily compiled pool compiles),
# the drafter's budget (the steps the ledger granted or
# that fit in a tail) and so what the drafter learned (its losses and top-1). "exact": the
# policy's trajectory (rewards, lengths, rollout digests, policy losses, held-out evaluations),
# which with rollout.verify="coupled" (the default) follows the config and seed alone: every arm
# emits the tokens vanilla sampling draws. Every checkpoint saves the decisions' state (tuner,
# ledger), so a resumed run decides on from where it stopped.
_TIMED_SUFFIXES = ("_s", "_ms")  # of the name, or of its first part ("process_idle_s/1")
_TIMED_PREFIXES = ("arm_tps/",)
_DECIDED_PREFIXES = ("arm_share/", "arm_steps/", "accept_len/", "accept_share/", "drafter_",
                     "ledger_", "spot_", "tlt_", "tail_idle")
_DECIDED = ("mean_accept_len", "sd_switches", "decode_steps", "compiles", "segments")


def metric_kind(key: str) -> str:
  """"timed", "decided" or "exact": what a step metric ``key`` follows (see above)."""
  if key.split("/", 1)[0].endswith(_TIMED_SUFFIXES) or key.startswith(_TIMED_PREFIXES):
    return "timed"
  if key.startswith(_DECIDED_PREFIXES) or key in _DECIDED:
    return "decided"
  return "exact"


class GRPOTrainer:
  """Owns the rollout engine, the policy update and, when it trains online, the drafter;
  ``step()`` runs one RL step."""

  def __init__(self, model: Transformer, tokenizer: Tokenizer, task, engine_config: EngineConfig,
               grpo_config: grpo.GRPOConfig, config: TrainerConfig, mesh: Mesh | None = None,
               drafter=None, chat_template: bool = False, rollout_devices: int = 1,
               drafter_training: DrafterTrainingConfig | None = None,
               suffix: SuffixConfig | None = None, history: HistoryConfig | None = None):
    """``drafter`` (a ``Drafter``, or a model-free kind's config such as ``NgramConfig``) makes
    rollouts speculative (lossless: speed only); ``suffix`` adds the suffix drafter, which
    drafts from the ``history`` store (kept and checkpointed only when the engine uses it). ``chat_template``: prompts go through the
    tokenizer's chat template (``tasks.chat_prompt``) instead of ``<bos> + text``.
    ``rollout_devices``: the mesh's devices that roll out data-parallel (0: all, 1: the first).
    ``drafter_training``: train the drafter online from the rollouts' hidden states
    (docs/library.md, "GRPOTrainer")."""
    self.tokenizer, self.task, self.config, self.grpo_config = tokenizer, task, config, grpo_config
    self.chat_template = chat_template
    self.mesh = mesh or Mesh(np.array(jax.devices()[:1]), ("data",))
    check_update_layout(config, grpo_config, self.mesh.size)
    if config.max_new_tokens > engine_config.max_new_tokens:
      raise ValueError(f"TrainerConfig.max_new_tokens={config.max_new_tokens} exceeds "
                       f"EngineConfig.max_new_tokens={engine_config.max_new_tokens}")
    # this process's devices of the mesh (on several hosts each one rolls out on its own)
    devices = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
    check_rollout_devices(rollout_devices, len(devices))
    self.rollout_devices = devices[:rollout_devices or len(devices)]
    with_suffix = {} if suffix is None else {"suffix": suffix}
    self.engine = make_rollout(model, drafter, engine_config, self.rollout_devices, **with_suffix)
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
    ones from before the step when it raises ``NonFiniteUpdateError``."""
    try:
      return self.policy.run(batch, self.step_count)
    finally:
      self._sync_engine()

  # ---- checkpoints ----------------------------------------------------------------------------
  def checkpoint_state(self) -> dict:
    state = dict(self.policy.checkpoint_state(), step=np.asarray(self.step_count, np.int64))
    if self.online is not None:
      state["drafter"] = self.online.checkpoint_state()
    return state

  def save(self, checkpointer: ckpt.Checkpointer, metadata: dict | None = None) -> None:
    """Saves params, optimizer state and the step (the data position is the step) atomically;
    the metadata holds what the adaptive engine's tuner learned (``"tuner"``), if it has one,
    and the history store (``"history"``), if one is kept; the online drafter's data buffer is a
    file beside the step's arrays."""
    metadata = {"trainer": dataclasses.asdict(self.config), **(metadata or {})}
    if (tuner := self.engine.tuner_state()) is not None:
      metadata[TUNER_KEY] = tuner
    if self.history is not None:
      metadata[HISTORY_KEY] = self.history.state_dict()
    write_buffer = (None if self.online is None else
                    self.online.save_buffer(checkpointer, self.step_count, metadata))
    checkpointer.save(self.step_count, self.checkpoint_state(), metadata)
    if write_buffer is not None:
      write_buffer()

  def restore(self, checkpointer: ckpt.Checkpointer, step: int | None = None,
              report=print) -> dict:
    """Loads ``step``, or by default the newest checkpoint that passes verification (a corrupt
    newer one is reported through ``report`` and moved aside), its tuner state into the adaptive
    engine's tuner (``Rollout.load_tuner_state``) and its history store, if one is kept (a
    checkpoint without one, e.g. from before the store existed, is reported and the store starts
    empty); returns its metadata."""
    like = self.checkpoint_state()
    if step is None:
      _, state, metadata = checkpointer.restore_latest_good(like=like, report=report)
    else:
      state, metadata = checkpointer.restore(step, like=like)
    history = None  # read first: a history that does not load leaves the trainer as it was
    if self.history is not None:
      history = self._saved_history(metadata.get(HISTORY_KEY), int(state["step"]), report)
    self.policy.load_checkpoint_state(state)
    self.step_count = int(state["step"])
    self._sync_engine()
    if self.online is not None:
      self.online.restore(state["drafter"], checkpointer, self.step_count, metadata, report)
      self._sync_drafter(always=True)
    self.engine.load_tuner_state(metadata.get(TUNER_KEY), report)
    if history is not None:
      self.history = history
    return metadata

  def _saved_history(self, saved: dict | None, step: int, report) -> HistoryStore:
    """The history store of checkpoint ``step``'s metadata entry ``saved``: empty (and reported)
    when there is none; a ValueError naming the step when it does not load."""
    history = HistoryStore(self.history_config)
    if saved is None:
      report(f"the checkpoint of step {step} holds no rollout history (saved before the history "
             "store existed, or without a suffix drafter): the store starts empty")
      return history
    try:
      history.load_state_dict(saved)
    except ValueError as e:
      raise ValueError(f"the checkpoint of step {step} holds a rollout history that does not "
                       f"load: {e}") from None
    return history

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
