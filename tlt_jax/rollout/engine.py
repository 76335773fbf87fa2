"""The rollout engine: bucketed, jitted decode with live-row compaction, growing caches and, with
a drafter, speculative decoding chosen per segment.

A request is split into chunks of at most ``max_batch`` prompts. Each chunk is prefilled at
(batch bucket, prompt-length bucket) into a KV cache of the smallest *length bucket* that holds
the prompts, then decoded by jitted ``lax.while_loop`` *segments*. A segment runs until every row
is finished, the live rows fit the next smaller batch bucket, a live row is about to outgrow the
cache, or (if set) after ``segment_steps`` steps. The host then gathers the live rows into the
smaller batch bucket (compaction) and/or re-lays the cache into the next length bucket (growth),
chooses the strategy of the next segment, and continues.

Strategies: without a drafter every segment is vanilla. With a drafter and one ``spec`` every
segment is speculative with that strategy. With ``strategies`` the engine is *adaptive*: vanilla
plus those strategies are the arms of a tuner (``tuner.py``, BEG-MAB by default) per batch
bucket, SD only where ``batch <= sd_max_batch``, and rows switch between vanilla and SD at
segment boundaries.

The engine is three rooms: ``steps.py`` (the pure jitted step functions), ``pool.py`` (the
compiled executables, keyed by kind, buckets and strategy group) and ``scheduler.py`` (the host
loop). This module holds the configuration, input checks and the public API.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer
from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout.interface import Rollout, check_prompts, collect_mask, is_integer, on_device
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.sampling import SamplerArgs, SamplingParams
from tlt_jax.rollout.scheduler import (ChunkResult, Request, Scheduler, Strategy,
                                      segment_lengths)
from tlt_jax.rollout.speculative import SpecConfig
from tlt_jax.rollout.stats import (RolloutStats, last_seconds, mean_accept_len, saved_seconds,
                                  tail_seconds)
from tlt_jax.rollout.steps import DecodeState, StepFunctions, group_name, make_groups, strategy_name
from tlt_jax.rollout.suffix import SuffixConfig, check_suffix_spec
from tlt_jax.rollout.tuner import Tuner, TunerConfig, fixed_arm, make_tuner
from tlt_jax.utils import FieldError, compile_count, require_positive_ints

__all__ = ["DecodeState", "EngineConfig", "RolloutEngine", "RolloutResult"]

VERIFY_MODES = ("rejection", "coupled")


def _as_spec(value, where: str) -> SpecConfig:
  """A ``SpecConfig`` from itself, a dict of its fields, or a (depth, topk, verify_tokens) triple."""
  if isinstance(value, SpecConfig):
    return value
  if isinstance(value, dict) or hasattr(value, "to_dict"):
    return SpecConfig(**dict(value))
  if isinstance(value, (tuple, list)) and len(value) == 3:
    return SpecConfig(*value)
  raise ValueError(f"{where} must be a SpecConfig, a dict of its fields or a (depth, topk, "
                   f"verify_tokens) triple, got {value!r}")


def _spec_tuple(value, field: str) -> tuple[SpecConfig, ...]:
  """``EngineConfig.<field>`` as a tuple of distinct ``SpecConfig`` (``FieldError`` otherwise)."""
  if isinstance(value, (SpecConfig, str)) or not isinstance(value, (tuple, list)):
    raise FieldError("EngineConfig", field, f"must be a tuple of SpecConfig, got {value!r}")
  specs = tuple(_as_spec(s, f"EngineConfig.{field}[{i}]") for i, s in enumerate(value))
  if len(set(specs)) != len(specs):
    raise FieldError("EngineConfig", field, f"has duplicates: {specs}")
  return specs


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shapes and strategies of the rollout engine. Buckets default to powers of two up to
  the maxima."""

  max_batch: int = 8
  max_prompt_len: int = 128
  max_new_tokens: int = 256
  batch_buckets: tuple[int, ...] | None = None
  prefill_buckets: tuple[int, ...] | None = None
  compaction: bool = True
  max_stop_ids: int = 8
  pad_token_id: int = 0
  spec: SpecConfig | None = None  # one speculative strategy for every segment (needs a drafter)
  # The adaptive engine: vanilla plus these strategies, chosen per segment by the tuner.
  strategies: tuple[SpecConfig, ...] = ()
  # The suffix drafter's strategies (``RolloutEngine(suffix=...)``), arms beside ``strategies``:
  # chains, or trees of topk branches under the root sharing verify_tokens - 1 draft slots
  # (``suffix.check_suffix_spec``). Empty with a suffix drafter: one chain of its depth.
  suffix_strategies: tuple[SpecConfig, ...] = ()
  # Buckets above this always decode vanilla. The paper uses 32 (GPUs); 8 is from measurement on
  # CPU, where SD never beat vanilla above batch 8 (docs/benchmarks.md) and every SD arm offered
  # at a big bucket costs exploration there.
  sd_max_batch: int = 8
  verify_budget: int = 0  # > 0: a strategy serves bucket b only if b * verify_tokens <= this
  segment_steps: int | None = None  # most steps per segment (0: unbounded; None: 32 if adaptive)
  tuner: TunerConfig | None = None  # None: TunerConfig() (BEG-MAB) when adaptive
  # "rejection": lossless rejection sampling; "coupled": drafter-invariant Gumbel-max sampling
  # (SD emits exactly vanilla sampling's tokens for a seed, at a slightly lower acceptance)
  verify: str = "rejection"
  # KV-cache length buckets below the capacity ``cache_len`` (which is always the last bucket):
  # None = 128, 256, 512, ... (a power of two within 25% of the capacity is left out); () = a
  # single cache of the full capacity (decode steps then pay for the capacity, not the lengths).
  kv_buckets: tuple[int, ...] | None = None
  # Speculative steps report draft vs verify time, read by host callbacks at the phase
  # boundaries (one host round trip per phase: leave off when measuring throughput).
  time_phases: bool = False

  def __post_init__(self):
    if self.spec is not None and not isinstance(self.spec, SpecConfig):
      object.__setattr__(self, "spec", _as_spec(self.spec, "EngineConfig.spec"))
    strategies = _spec_tuple(self.strategies, "strategies")
    object.__setattr__(self, "strategies", strategies)
    suffix = _spec_tuple(self.suffix_strategies, "suffix_strategies")
    for i, spec in enumerate(suffix):
      check_suffix_spec(spec, f"EngineConfig.suffix_strategies[{i}]")
    object.__setattr__(self, "suffix_strategies", suffix)
    if (strategies or suffix) and self.spec is not None:
      raise ValueError("set either EngineConfig.spec (one fixed strategy) or "
                       "EngineConfig.strategies / suffix_strategies (the adaptive engine), not both")
    if self.verify not in VERIFY_MODES:
      raise FieldError("EngineConfig", "verify",
                       f"must be one of {VERIFY_MODES}, got {self.verify!r}")
    tuner = TunerConfig() if self.tuner is None else self.tuner
    if not isinstance(tuner, TunerConfig):
      try:
        tuner = TunerConfig(**dict(tuner))
      except (TypeError, ValueError) as e:
        raise FieldError("EngineConfig", "tuner", f"must be a TunerConfig or a dict of its fields: "
                         f"{e}") from None
    object.__setattr__(self, "tuner", tuner)
    if self.segment_steps is None:
      object.__setattr__(self, "segment_steps", 32 if strategies or suffix else 0)
    for name in ("segment_steps", "verify_budget"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise FieldError("EngineConfig", name, f"must be an int >= 0 (0: no limit), got {value!r}")
    require_positive_ints(self, "max_batch", "max_prompt_len", "max_new_tokens", "max_stop_ids",
                          "sd_max_batch")
    defaults = (("batch_buckets", self.max_batch, bk.powers_of_two_up_to(self.max_batch)),
                ("prefill_buckets", self.max_prompt_len,
                 bk.powers_of_two_up_to(self.max_prompt_len, start=min(16, self.max_prompt_len))))
    for name, limit, default in defaults:
      value = getattr(self, name)
      value = default if value is None else tuple(int(v) for v in value)
      if not value or list(value) != sorted(set(value)) or value[0] <= 0 or value[-1] != limit:
        raise ValueError(
            f"EngineConfig.{name} must be strictly increasing positive sizes ending at {limit}, "
            f"got {value!r}")
      object.__setattr__(self, name, value)
    if self.kv_buckets is not None:
      value = tuple(self.kv_buckets)
      if (any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0 for v in value)
          or list(value) != sorted(set(value))):
        raise FieldError("EngineConfig", "kv_buckets", f"must be strictly increasing positive ints "
                         f"(or None for the default ladder), got {self.kv_buckets!r}")
      object.__setattr__(self, "kv_buckets", tuple(int(v) for v in value))

  @property
  def adaptive(self) -> bool:
    """Whether strategies are chosen per segment (vanilla is then always one of them)."""
    return bool(self.strategies or self.suffix_strategies)

  @property
  def draft_specs(self) -> tuple[SpecConfig, ...]:
    """The strategies the learned (or n-gram) drafter drafts."""
    return self.strategies or ((self.spec,) if self.spec is not None else ())

  @property
  def specs(self) -> tuple[SpecConfig, ...]:
    """Every speculative strategy this engine may run (the suffix drafter's last)."""
    return self.draft_specs + self.suffix_strategies

  def options(self, batch: int, kind: str = "learned") -> list[tuple[str, SpecConfig | None]]:
    """``(drafter kind, spec)`` of what may decode a ``batch`` bucket: vanilla (``("vanilla",
    None)``) first, then the drafter's strategies (drafted by ``kind``), then the suffix
    drafter's; the adaptive engine offers a strategy only where it ``serves`` the bucket."""
    if not self.adaptive:
      return [("vanilla", None)] if self.spec is None else [(kind, self.spec)]
    return [("vanilla", None)] + [(k, s) for k, group in ((kind, self.strategies),
                                                          ("suffix", self.suffix_strategies))
                                  for s in group if self.serves(s, batch)]

  def serves(self, spec: SpecConfig, batch: int) -> bool:
    """Whether the adaptive engine may decode a ``batch`` bucket with ``spec``."""
    return batch <= self.sd_max_batch and (
        not self.verify_budget or batch * spec.verify_tokens <= self.verify_budget)

  def check_fixed_tuner(self, ngram: bool = False) -> None:
    """Raises ``ValueError`` when a ``kind="fixed"`` tuner leaves a bucket with a choice unmapped
    or maps it to an arm not offered there (so the mistake shows before anything compiles)."""
    if not self.adaptive or self.tuner.kind != "fixed":
      return
    for b in self.batch_buckets:
      names = [strategy_name(s, k) for k, s in self.options(b, "ngram" if ngram else "learned")]
      if len(names) > 1:
        fixed_arm(self.tuner.fixed, b, names)

  @property
  def slack(self) -> int:
    """Extra slots past the longest sequence that a speculative step may write into."""
    return max((s.verify_tokens + s.depth * (s.topk + 1) + 2 for s in self.specs), default=0)

  @property
  def pending_width(self) -> int:
    """Most tokens one step of any strategy can emit (the drafter's pending window)."""
    return max((s.max_emit for s in self.specs), default=1)

  @property
  def cache_len(self) -> int:
    """KV-cache slots per row: the longest prompt plus the longest completion (plus slack)."""
    return self.max_prompt_len + self.max_new_tokens + self.slack

  @property
  def step_slots(self) -> int:
    """Cache slots past a live row's committed length that one decode step may write."""
    return self.slack if self.specs else 1

  @property
  def kv_lengths(self) -> tuple[int, ...]:
    """The KV-cache length buckets, ending at the capacity ``cache_len``. The adaptive engine's
    default ladder also holds vanilla's capacity (the longest prompt plus the longest completion,
    without the speculative slack), so rows that vanilla decodes to the end never attend over
    the slack."""
    cap = self.cache_len
    if self.kv_buckets is None:
      below = bk.powers_of_two_up_to(cap, start=min(128, cap))[:-1]
      if below and cap < 1.25 * below[-1]:  # e.g. 4096 next to a capacity of 4128: one is enough
        below = below[:-1]
      plain = self.max_prompt_len + self.max_new_tokens
      if self.adaptive and plain < cap and plain not in below:
        below = tuple(sorted(below + (plain,)))
    else:
      below = tuple(v for v in self.kv_buckets if v < cap)
    return below + (cap,)

  def prefill_kv_len(self, prompt_bucket: int) -> int:
    """The cache length a chunk prefilled at ``prompt_bucket`` starts with."""
    return bk.bucket_for(prompt_bucket + self.step_slots, self.kv_lengths)

  def tokens_len(self, kv_len: int) -> int:
    """Width of the generated-token buffers that go with a cache of ``kv_len`` slots (a row never
    has more generated tokens than cache slots)."""
    return min(kv_len, self.max_new_tokens + (self.pending_width if self.specs else 0))


@dataclasses.dataclass
class RolloutResult:
  """Completions (ids, per-token log-probs, finish reasons) and engine statistics."""

  tokens: list[list[int]]
  logprobs: list[np.ndarray]
  finish_reasons: list[str]  # "stop" (a stop id was sampled; it is included) or "length"
  stats: RolloutStats
  # generate(collect_hidden=...): per row, the target's last-layer hidden states [L - 1, H] at
  # positions 0 .. L - 2 of prompt + completion (L tokens); None for rows not collected
  hidden: list[np.ndarray | None] | None = None


class RolloutEngine(Rollout):
  """Generates completions for a list of prompts with bucketed, jitted decode segments.

  With a ``drafter`` (and ``config.spec``, default ``SpecConfig()``), every decode step is a
  lossless speculative step: draft, verify in one target pass, accept per row. With
  ``config.strategies`` the strategy (vanilla included) is chosen per segment by ``tuner``
  (default: ``make_tuner(config.tuner)``; pass one to share or restore what it learned).

  ``device``: where it decodes; the weights it is given (the model's included) are placed there
  (zero-copy where they already have a full copy there, e.g. a replicated array's shard). None:
  the weights are used where they are.
  """

  def __init__(self, model: Transformer, drafter: Drafter | NgramConfig | None = None,
               config: EngineConfig = EngineConfig(), tuner: Tuner | None = None,
               device: jax.Device | None = None, suffix: SuffixConfig | None = None):
    if suffix is not None and not isinstance(suffix, SuffixConfig):
      raise TypeError(f"RolloutEngine(suffix=...) takes a SuffixConfig, got {suffix!r}")
    if suffix is None and config.suffix_strategies:
      raise FieldError("EngineConfig", "suffix_strategies", "is set but no suffix drafter was "
                       "given; pass suffix=SuffixConfig(...) or leave it empty")
    if suffix is not None and not config.suffix_strategies:
      if config.spec is not None:
        raise FieldError("EngineConfig", "spec", "is one fixed strategy, and a suffix drafter makes "
                         "the engine adaptive; set EngineConfig.strategies instead")
      config = dataclasses.replace(config, suffix_strategies=(suffix.chain(),))
    self.suffix = suffix
    self.ngram = drafter if isinstance(drafter, NgramConfig) else None
    if self.ngram is not None:
      # model-free drafting: chains of tokens copied from the row's group
      chain = SpecConfig(depth=self.ngram.depth, topk=1, verify_tokens=self.ngram.depth + 1)
      if config.spec is not None and config.spec != chain:
        raise FieldError("EngineConfig", "spec", f"{config.spec} does not fit the n-gram drafter; "
                         f"leave it None (it becomes {chain})")
      if any(not s.is_chain for s in config.strategies):
        raise ValueError("the n-gram drafter drafts chains: every EngineConfig.strategies entry "
                         "needs topk=1")
      if not config.adaptive:
        config = dataclasses.replace(config, spec=chain)
      elif not config.strategies:  # the suffix drafter's strategies alone: add the n-gram chain
        config = dataclasses.replace(config, strategies=(chain,))
      drafter = None
    elif drafter is not None and not config.draft_specs:
      if config.adaptive:  # beside the suffix drafter's strategies
        config = dataclasses.replace(config, strategies=(SpecConfig(),))
      else:
        config = dataclasses.replace(config, spec=SpecConfig())
    if config.draft_specs and drafter is None and self.ngram is None:
      field = "strategies" if config.adaptive else "spec"
      raise FieldError("EngineConfig", field, "is set but no drafter was given; pass drafter=... "
                       "or leave it unset for vanilla decoding")
    if drafter is not None and drafter.config.hidden_size != model.config.hidden_size:
      raise ValueError(f"drafter hidden_size {drafter.config.hidden_size} does not match the "
                       f"target's {model.config.hidden_size}")
    config.check_fixed_tuner(self.ngram is not None)
    self.config = config
    self.spec = config.spec
    self.model_config = model.config
    self.graphdef, self.params = nnx.split(model)
    self.drafter_graphdef, self.drafter_params = (nnx.split(drafter) if drafter is not None
                                                  else (None, None))
    kind = "ngram" if self.ngram is not None else "learned"
    self.groups = make_groups(config.draft_specs, kind, config.suffix_strategies)
    self._strategies: dict[int, list[Strategy]] = {}
    for b in config.batch_buckets:
      self._strategies[b] = [
          Strategy(strategy_name(s, k), group_name(s, k),
                   0 if s is None else self.groups[group_name(s, k)].members.index(s), s, k)
          for k, s in config.options(b, kind)]
    self.tuner = (tuner if tuner is not None else make_tuner(config.tuner)) if config.adaptive \
        else None
    self.steps = StepFunctions(model.config, config, self.graphdef, self.drafter_graphdef,
                               self.ngram, self.groups, suffix)
    learned = drafter is not None
    self.pool = ExecutablePool(
        self.steps, self._weights,
        groups_for=lambda b: list(dict.fromkeys(s.group for s in self._strategies[b])),
        needs_catchup=lambda b: learned and config.adaptive and any(
            s.learned for s in self._strategies[b]) and len(self._strategies[b]) > 1)
    self.scheduler = Scheduler(self.pool, self.strategies_for, self.tuner, self._weights, learned)
    self.device = device
    self.calibration: tuple[dict, float] | None = None  # ``calibrate``'s step costs, once measured
    self._history_share = 0.0  # the share of the last request's prompts that had a history
    self.observes_history = True  # False: a data-parallel rollout observes it once for all
    if device is not None:
      self.update_params(self.params, self.drafter_params)

  # ---- weights and strategies ------------------------------------------------------------------
  def update_params(self, params: nnx.State, drafter_params: nnx.State | None = None) -> None:
    """Swaps in new target (and optionally drafter) weights of the same shapes; no recompiles.
    With a ``device`` they are placed there first (``on_device``: the drafter's are copied
    unless they are there already, and used as they are on their own: do not donate them
    afterwards)."""
    if self.device is not None:
      params = on_device(params, self.device)
      drafter_params = None if drafter_params is None else on_device(drafter_params, self.device)
    self.params = params
    if drafter_params is not None:
      self.drafter_params = drafter_params

  @property
  def devices(self) -> list:
    """The one device this engine decodes on (its ``device``, else where its weights are)."""
    if self.device is not None:
      return [self.device]
    return sorted(set().union(*(leaf.devices() for leaf in jax.tree.leaves(self.params))),
                  key=lambda d: d.id)[:1]

  def target_params(self, index: int = 0) -> nnx.State:
    """The target weights this engine decodes with (the one-device case of
    ``DataParallelRollout.target_params``)."""
    if index != 0:
      raise IndexError(f"a RolloutEngine decodes on one device: target_params({index})")
    return self.params

  def _weights(self):
    return (self.params, self.drafter_params)

  def set_tuner(self, tuner: Tuner | None = None) -> None:
    """Replaces the adaptive engine's tuner (None: a fresh one from ``config.tuner``)."""
    if not self.config.adaptive:
      raise ValueError("set_tuner: this engine has no EngineConfig.strategies to tune")
    self.tuner = self.scheduler.tuner = tuner if tuner is not None else make_tuner(
        self.config.tuner)
    if tuner is None and self.calibration is not None:  # a fresh tuner keeps the step costs
      self.tuner.set_costs(*self.calibration)

  def strategies_for(self, batch: int) -> list[Strategy]:
    """The strategies that may decode a ``batch`` bucket (the first is the default)."""
    return self._strategies[batch]

  # ---- executable pool -------------------------------------------------------------------------
  @property
  def _executables(self) -> dict[tuple, Any]:
    return self.pool.executables

  @property
  def _compile_seconds(self) -> float:
    return self.pool.compile_seconds

  def _executable(self, key: tuple):
    return self.pool.get(key)

  def executable_keys(self) -> list[tuple]:
    """Every executable the engine may need (see ``pool.py`` for the key kinds)."""
    return self.pool.keys()

  def pool_stats(self) -> dict[str, Any]:
    """The compiled pool: executables per kind and group, compile seconds, memory per
    executable where the backend reports it."""
    return self.pool.stats()

  def precompile(self, progress: Callable[[int, int], Any] | None = None, *,
                 calibrate: bool = True) -> int:
    """Compiles every bucket's executables now; returns how many were compiled.

    ``progress(done, total)``, if given, is called after each executable compiles, ``total``
    being how many this call compiles (executables compiled earlier are not counted). With a
    tuner that uses a cost model (``TunerConfig(kind="cost")``) and ``calibrate``, the strategies'
    step costs are then measured once (``calibrate``) and handed to it.
    """
    compiled = self.pool.precompile(progress)
    if calibrate and self.tuner is not None and self.config.tuner.kind == "cost":
      self.calibration = self.calibrate()
      self.tuner.set_costs(*self.calibration)
      self.scheduler.segment_lengths = segment_lengths(*self.calibration,
                                                       self.config.segment_steps)
    return compiled

  def calibrate(self, steps: int = 8, repeats: int = 5) -> tuple[dict, float]:
    """Times the decode step of every strategy at every batch bucket where the tuner chooses:
    ``({(bucket, strategy name): seconds per step}, seconds of one segment boundary)``.

    Each bucket's rows are dummy one-token prompts decoded without stop ids at temperature 1 at
    the first cache length; segments of 1 step and of ``1 + steps`` steps are timed ``repeats``
    times each, and the fastest of each (the least disturbed by other work on the host) give the
    step (their difference) and the boundary (dispatch and the host's read of the finished rows,
    what is left of the 1-step segment). Costs follow shapes, not weights: this runs once."""
    cfg, pool = self.config, self.pool
    args = SamplerArgs.from_params(SamplingParams(max_new_tokens=cfg.max_new_tokens), (),
                                   cfg.max_stop_ids)
    plen = cfg.prefill_buckets[0]
    kv_len = cfg.prefill_kv_len(plen)
    costs, overheads = {}, []
    for b in cfg.batch_buckets:
      if len(self._strategies[b]) < 2:
        continue
      prompt = (np.full((b, plen), cfg.pad_token_id, np.int32), np.ones((b,), np.int32),
                np.arange(b, dtype=np.int32), np.arange(b, dtype=np.int32), pool.no_history(b))
      for strategy in self._strategies[b]:
        segment = pool.get(("segment", b, kv_len, pool.stop_at(b), strategy.group))
        fastest = {}  # steps run -> fastest seconds
        for _ in range(repeats):
          for n in (1, 1 + steps):
            state, _ = pool.get(("prefill", b, plen))(self._weights(), *prompt, args)
            state = jax.block_until_ready(state)
            t0 = time.perf_counter()
            state = segment(self._weights(), state, args, np.int32(strategy.choice), np.int32(n))
            ran = int(jax.device_get(state.counters["steps"]))
            fastest[ran] = min(fastest.get(ran, np.inf), time.perf_counter() - t0)
        if len(fastest) < 2:  # the rows could not run more than one step (a tiny cache)
          continue
        (n1, t1), (nn, tn) = min(fastest.items()), max(fastest.items())
        per_step = max((tn - t1) / (nn - n1), 1e-7)
        costs[(b, strategy.name)] = per_step
        overheads.append(max(t1 - per_step * n1, 0.0))
    return costs, float(np.median(overheads)) if overheads else 0.0

  # ---- generate ----------------------------------------------------------------------------
  def check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The prompts as lists of Python ints (see ``interface.check_prompts``)."""
    return check_prompts(prompts, self.model_config.vocab_size, self.config.max_prompt_len)

  @property
  def uses_history(self) -> bool:
    return self.suffix is not None

  def check_history(self, history, n: int, observe: bool = True) -> list[list[np.ndarray]] | None:
    """``generate``'s ``history`` as int32 arrays (None: none, or no suffix drafter to use it);
    raises ``ValueError`` naming the first malformed entry; ``observe``: then
    ``observe_history``. Arrays given as int32 are kept as they are (no copy)."""
    if history is None or self.suffix is None:
      return None
    if isinstance(history, (str, bytes)) or len(history) != n:
      raise ValueError(f"generate: history must hold one list of earlier completions per prompt "
                       f"({n}), got {type(history).__name__} of length "
                       f"{len(history) if hasattr(history, '__len__') else '?'}")
    vocab = self.model_config.vocab_size

    def bad(i, j, completion):
      return ValueError(f"generate: history[{i}][{j}] must be a list of token ids in "
                        f"[0, {vocab}), got {completion!r:.80}")

    out, flat = [], []
    for i, earlier in enumerate(history):
      rows = []
      for j, completion in enumerate(earlier or ()):
        ids = np.asarray(completion)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
          raise bad(i, j, completion)
        rows.append(ids)
      out.append(rows)
      flat += rows
    ids = np.concatenate(flat) if flat else np.zeros(0, np.int32)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):  # one check for all; then which
      i, j = next((i, j) for i, rows in enumerate(out) for j, c in enumerate(rows)
                  if c.size and (c.min() < 0 or c.max() >= vocab))
      raise bad(i, j, history[i][j])
    out = [[c.astype(np.int32, copy=False) for c in rows] for rows in out]
    if observe:
      self.observe_history(out)
    return out

  def observe_history(self, history: Sequence[Sequence[Any]]) -> None:
    """Tells the tuner the suffix drafter changed when the share of prompts that have a history
    moved by more than a quarter since the last request (a new epoch of recurring prompts): its
    acceptance until now says nothing of its acceptance with (or without) history, so the tuner
    forgets it and probes the suffix arms again."""
    share = sum(1 for h in history if h) / max(len(history), 1)
    if self.tuner is not None and abs(share - self._history_share) > 0.25:
      self.tuner.observe_drafter(source="suffix", forget=True)
    self._history_share = share

  def collect_mask(self, collect_hidden, n: int, seed: int) -> np.ndarray | None:
    """Which of ``n`` rows return hidden states (see ``interface.collect_mask``)."""
    return collect_mask(collect_hidden, n, seed, self.steps.drafter_graphdef is not None)

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
               progress: Callable[[int, int], Any] | None = None, *, row_offset: int = 0,
               collect_hidden: bool | float | Sequence[bool] = False,
               shard_done: Callable[[int, int, RolloutResult], Any] | None = None,
               idle: Callable[[int, Any], Any] | None = None,
               history: Sequence[Sequence[Sequence[int]]] | None = None) -> RolloutResult:
    """Completes every prompt; rows finish on a stop id or at ``params.max_new_tokens``.

    ``progress(rows_done, rows_total)``, if given, is called after every decode segment (where
    the host reads the finished rows anyway); the last call has ``rows_done == rows_total``.
    Row ``i`` samples with the keys of row ``i + row_offset`` (a shard of a bigger request passes
    its first row's index there). ``collect_hidden`` (needs a learned drafter) fills
    ``RolloutResult.hidden`` for all rows (True), a seeded random fraction of them (a float) or
    the rows given by one bool per prompt.

    The data-parallel hooks (``DataParallelRollout.generate``) on one device: ``shard_done(0,
    row_offset, result)`` is called once with the whole result before it is returned; ``idle``
    never (no device is left idle while another decodes).
    """
    del idle  # one device: never idle while another decodes
    prompts = self.check_prompts(prompts)
    history = self.check_history(history, len(prompts), observe=self.observes_history)
    if not is_integer(row_offset) or int(row_offset) < 0:
      raise ValueError(f"row_offset must be an int >= 0, got {row_offset!r}")
    collect = self.collect_mask(collect_hidden, len(prompts), params.seed)
    if params.max_new_tokens > self.config.max_new_tokens:
      raise ValueError(
          f"SamplingParams.max_new_tokens={params.max_new_tokens} exceeds "
          f"EngineConfig.max_new_tokens={self.config.max_new_tokens}")
    stop_ids = (self.model_config.eos_token_ids if params.stop_token_ids is None
                else params.stop_token_ids)
    args = SamplerArgs.from_params(params, stop_ids, self.config.max_stop_ids)
    request = Request(prompts, args, stop_ids, int(row_offset), collect, progress, history)
    stats = RolloutStats()
    compiles0, compile_s0 = compile_count(), self._compile_seconds
    self.steps.phase_marks.clear()
    t_start = time.perf_counter()
    rows = ChunkResult([], [], [], [])
    for start in range(0, len(prompts), self.config.max_batch):
      chunk = range(start, min(start + self.config.max_batch, len(prompts)))
      done = self.scheduler.run_chunk(request, chunk, stats)
      rows.tokens += done.tokens
      rows.logprobs += done.logprobs
      rows.reasons += done.reasons
      rows.hidden += done.hidden
    self._finish_stats(stats, rows.tokens, compiles0, compile_s0, t_start)
    result = RolloutResult(rows.tokens, rows.logprobs, rows.reasons, stats,
                           None if collect is None else rows.hidden)
    if shard_done is not None:
      shard_done(0, int(row_offset), result)
    return result

  def _finish_stats(self, stats: RolloutStats, tokens: list[list[int]], compiles0: int,
                    compile_s0: float, t_start: float) -> None:
    """The totals of a finished ``generate``: compiles, wall time, throughput, the arms' means,
    the tail, accepted lengths (with SD) and the tuner's summary."""
    stats.compile_s = self._compile_seconds - compile_s0
    stats.compiles = compile_count() - compiles0
    stats.wall_s = time.perf_counter() - t_start
    stats.tokens = sum(len(t) for t in tokens)
    stats.tokens_per_s = stats.tokens / max(stats.wall_s - stats.compile_s, 1e-9)
    stats.finish_arms()
    stats.tail_s = tail_seconds(stats.segments)
    stats.last_s = last_seconds(stats.segments)
    if self.config.specs:
      # tokens emitted per live row per speculative step (accepted drafts + the bonus token)
      hist = np.asarray(stats.accept_hist if stats.accept_hist is not None
                        else np.zeros(self.config.pending_width))
      stats.accept_hist = hist.tolist()  # index i: SD steps that emitted i + 1 tokens
      stats.mean_accept_len = mean_accept_len(hist)
      if self.config.time_phases:
        marks = self.steps.phase_marks
        spans = {1: 0.0, 2: 0.0}  # phase 1 ends drafting, phase 2 ends verification
        for (p0, t0), (p1, t1) in zip(marks, marks[1:]):
          if p1 == p0 + 1:
            spans[p1] += t1 - t0
        stats.draft_s, stats.verify_s = spans[1], spans[2]
    if self.tuner is not None:
      stats.tuner = self.tuner.summary()
      stats.sd_saved_s = saved_seconds(stats.arms, lambda b: self.tuner.step_cost(b, "vanilla"))
