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
plus those strategies are the arms of a tuner (``tuner/``: the cost tuner unless
``EngineConfig.tuner`` names another kind) per batch bucket, SD only where the calibration says
it can pay (``offers.py``; and ``batch <= sd_max_batch`` where that cap is set), and rows switch
between vanilla and SD at segment boundaries.

The engine is four rooms: ``engine_config.py`` (``EngineConfig``, its checks, and
``resolve_engine_config``, which fills in what the drafters imply before the engine is built),
``steps.py`` (the pure jitted step functions), ``pool.py`` (the compiled executables, keyed by
kind, buckets and strategy group) and ``scheduler.py`` (the host loop). This module holds the
input checks and the public API; it reads its resolved config and never rewrites it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from tlt_jax.aot import SharedPrograms
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer
from tlt_jax.rollout.host.calibration import Calibration
from tlt_jax.rollout.host.engine_config import EngineConfig, resolve_engine_config
from tlt_jax.rollout.decode.kinds import DrafterKind, model_free_kind
from tlt_jax.rollout.interface import IdleWork, Rollout, check_prompts, collect_mask, is_integer, on_device
from tlt_jax.rollout.host.offers import SdOffers
from tlt_jax.rollout.host.pool import ExecutablePool
from tlt_jax.rollout.decode.sampling import SamplerArgs, SamplingParams
from tlt_jax.rollout.host.scheduler import ChunkResult, Request, Scheduler, Strategy
from tlt_jax.rollout.host.stats import (RolloutResult, RolloutStats, last_seconds,
    mean_accept_len, saved_seconds, tail_seconds)
from tlt_jax.rollout.decode.steps import DecodeState, StepFunctions, group_name, make_groups, strategy_name
from tlt_jax.rollout.decode.suffix import SuffixConfig
from tlt_jax.rollout.host.tuner import Tuner, make_tuner
from tlt_jax.utils import background_compiles_allowed, compile_count

__all__ = ["DecodeState", "EngineConfig", "RolloutEngine", "RolloutResult"]


class RolloutEngine(Rollout):
  """Generates completions for a list of prompts with bucketed, jitted decode segments.

  With a ``drafter`` every decode step is a lossless speculative step (``config.spec``); with
  ``config.strategies`` the ``tuner`` (default ``make_tuner(config.tuner)``) chooses the strategy
  per segment. ``self.config`` is ``resolve_engine_config(config, drafter, suffix)``. ``device``:
  where it decodes, its weights placed there (None: where they are); ``programs``: executables
  shared with other devices' engines; ``calibration``: the step costs, segment lengths and SD
  offers shared with them (None: its own). Its public parts: docs/library.md, "RolloutEngine".
  """

  def __init__(self, model: Transformer, drafter: Drafter | Any | None = None,
               config: EngineConfig = EngineConfig(), tuner: Tuner | None = None,
               device: jax.Device | None = None, suffix: SuffixConfig | None = None,
               programs: SharedPrograms | None = None, calibration: Calibration | None = None):
    if suffix is not None and not isinstance(suffix, SuffixConfig):
      raise TypeError(f"RolloutEngine(suffix=...) takes a SuffixConfig, got {suffix!r}")
    config = resolve_engine_config(config, drafter, suffix)  # itself when already resolved
    self.suffix = suffix
    free = model_free_kind(drafter)  # the n-gram drafter's NgramConfig, or a registered kind's
    self.free = drafter if free is not None else None
    if free is not None:  # model-free drafting: no drafter model
      drafter = None
    if drafter is not None and drafter.config.hidden_size != model.config.hidden_size:
      raise ValueError(f"drafter hidden_size {drafter.config.hidden_size} does not match the "
                       f"target's {model.config.hidden_size}")
    features = True if drafter is None else drafter.target_features
    if isinstance(features, tuple) and max(features) > model.config.num_layers:
      raise ValueError(f"the drafter reads target layers {list(features)}, but the target has "
                       f"{model.config.num_layers} layers")
    self.config = config
    self.spec = config.spec
    self.model_config = model.config
    self.graphdef, self.params = nnx.split(model)
    self.drafter_graphdef, self.drafter_params = (nnx.split(drafter) if drafter is not None
                                                  else (None, None))
    kind = DrafterKind.LEARNED if free is None else free.kind
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
                               self.free, self.groups, suffix, features)
    learned = drafter is not None
    self.pool = ExecutablePool(
        self.steps, self.weights,
        groups_for=lambda b: list(dict.fromkeys(s.group for s in self._strategies[b])),
        needs_catchup=lambda b: learned and config.adaptive and any(
            s.learned for s in self._strategies[b]) and len(self._strategies[b]) > 1,
        shared=programs, device=device)
    # ``calibrate``'s step costs once measured, the segment lengths they bound and the SD arms
    # offered per bucket after a calibrated precompile (shared with a data-parallel rollout's
    # other engines)
    self.calibration = (calibration if calibration is not None
                        else Calibration(config.segment_steps))
    self.scheduler = Scheduler(self.pool, self.strategies_for, self.tuner, self.weights, learned,
                               self.calibration)
    self.device = device
    self._calibration_weights = None  # the offers loop's copy of the weights (background)
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

  def set_tuner(self, tuner: Tuner | None = None) -> None:
    """Replaces the adaptive engine's tuner (None: a fresh one from ``config.tuner``)."""
    if not self.config.adaptive:
      raise ValueError("set_tuner: this engine has no EngineConfig.strategies to tune")
    self.tuner = self.scheduler.tuner = tuner if tuner is not None else make_tuner(
        self.config.tuner)
    if tuner is None and self.calibration.costs is not None:  # a fresh tuner keeps the costs
      self.tuner.set_costs(*self.calibration.costs)

  @property
  def offers(self) -> SdOffers | None:
    """The SD arms each bucket offers after a calibrated ``precompile`` (None before one)."""
    return self.calibration.offers

  def strategies_for(self, batch: int) -> list[Strategy]:
    """The strategies that may decode a ``batch`` bucket now (the first is the default): after a
    calibrated ``precompile``, vanilla plus the arms measured to pay there whose executables
    exist (``offers``); else every strategy the config permits there (``candidates_for``)."""
    return self._strategies[batch] if self.offers is None else self.offers.offered(batch)

  def learned_sd_possible(self) -> bool:
    """Whether a strategy the learned drafter drafts is offered at some bucket, or may still be
    (no calibrated offers, or their loop has not finished). False once the calibration offered
    none of its arms anywhere: on this machine that drafter cannot pay even at
    ``sd_prior_acceptance``, so keeping hidden states and training it only costs time."""
    if not any(s.learned for c in self._strategies.values() for s in c):
      return False
    if self.offers is None or not self.offers.done.is_set():
      return True
    return any(s.learned for b in self.config.batch_buckets for s in self.offers.offered(b))

  def candidates_for(self, batch: int) -> list[Strategy]:
    """Every strategy the config permits at a ``batch`` bucket (vanilla first)."""
    return self._strategies[batch]

  # ---- executable pool -------------------------------------------------------------------------
  @property
  def compile_seconds(self) -> float:
    """Seconds compiling on the rollout's critical path (not the background's)."""
    return self.pool.executables.foreground_seconds

  def executable_keys(self) -> list[tuple]:
    """Every executable the engine may need (see ``pool.py`` for the key kinds)."""
    return self.pool.keys()

  def vanilla_keys(self) -> list[tuple]:
    """The executables vanilla decoding may need at every bucket (``ExecutablePool.base_keys``):
    what a calibrated ``precompile`` compiles before the offers loop."""
    return self.pool.base_keys()

  def missing_keys(self, keys: Sequence[tuple]) -> list[tuple]:
    """Those of ``keys`` whose executables this engine does not hold yet."""
    return [k for k in keys if k not in self.pool.executables]

  def compile(self, keys: Sequence[tuple],
              progress: Callable[[int, int], Any] | None = None) -> int:
    """Compiles (or, with programs shared with other devices, rebinds) the executables of
    ``keys`` this engine does not hold yet; returns how many it gained."""
    return self.pool.compile(keys, progress)

  def pool_stats(self) -> dict[str, Any]:
    """The compiled pool: executables per kind and group, compile seconds, memory per
    executable where the backend reports it."""
    return self.pool.stats()

  def precompile(self, progress: Callable[[int, int], Any] | None = None, *,
                 calibrate: bool = True, background: bool = False,
                 first_rows: Sequence[int] | None = None) -> int:
    """Compiles the executables the rollout may run; returns how many were compiled now.

    ``progress(done, total)`` is called after each compile (``total``: that stage's count). With a
    cost tuner and ``calibrate``, SD arms are compiled only where the calibration says they pay
    (``offers.py``); ``background``: those compile in a thread while the rollout decodes, and the
    count is vanilla's (``offers.wait()`` waits for the rest). Otherwise every permitted executable
    is compiled. ``first_rows`` (with ``background``, ``config.precompile_scope="first_step"``
    and the calibrated offers or no SD arm at all): the row counts of the first requests; only
    the vanilla executables they start with compile now
    (``ExecutablePool.first_keys``), the rest of vanilla's in the background thread before the SD
    arms, and until each is in, rollouts decode on the buckets that are compiled. Details:
    docs/library.md, "RolloutEngine".
    """
    # the tuner's own kind (one handed to the engine or set_tuner may differ from config.tuner)
    cost = getattr(getattr(self.tuner, "config", None), "kind", None) == "cost"
    scoped = (first_rows is not None and background
              and self.config.precompile_scope == "first_step")
    vanilla_only = all(len(c) == 1 for c in self._strategies.values())
    if not (calibrate and cost and self.config.sd_offers == "calibrated") and not (
        scoped and vanilla_only):
      compiled = self.pool.precompile(progress)
      if calibrate and cost:  # sd_offers="all": every arm, timed for the tuner
        self._set_calibration(self.calibrate())
      return compiled
    if self.offers is not None:  # precompiled before: what it offers stands
      self.offers.wait()
      return 0
    offers = SdOffers(self._strategies, self.config.sd_prior_acceptance, self.publish_costs)
    if scoped:
      first = self.pool.first_keys(first_rows)
      compiled = self.pool.compile(first, progress)
      # the rest of vanilla's, the largest buckets first (the order a rollout compacts through)
      now = set(first)
      offers.prelude = sorted((k for k in self.pool.base_keys() if k not in now),
                              key=lambda k: -k[1])
      self.pool.defer(offers.prelude)
      # no vanilla calibration up front (it compiles every bucket): the offers loop times
      # vanilla beside the SD arms at each bucket it visits, and publishes both
      self._set_calibration(({}, 0.0))
    else:
      compiled = self.pool.compile(self.pool.base_keys(), progress)
      if background and not background_compiles_allowed():
        self._set_calibration(({}, 0.0))  # no offers loop will run here: nothing to time
      else:
        vanilla = {b: self._strategies[b][:1] for b in offers.buckets}
        self._set_calibration(self.calibrate(strategies=vanilla))
    self.calibration.offers = offers
    # a loop in the background times a copy of the weights, made here: the engine's own may be
    # replaced and their buffers donated (by the policy update) while it runs
    self._calibration_weights = (self._copy_weights() if background and offers.buckets
                                 else None)
    offers.on_done = self.drop_calibration_weights
    return compiled + offers.launch(background, self.pool.compile, self.offer_keys,
                                    self.calibrate_bucket)

  def _set_calibration(self, costs: tuple[dict, float]) -> None:
    """Keeps the measured step costs and hands them to the tuner (if any) and the scheduler."""
    self.calibration.measured(costs, self.tuner)

  def publish_costs(self, costs: dict) -> None:
    """A bucket's SD arms are offered: their step costs join the calibration and the tuner's."""
    self.calibration.add(costs, self.tuner)

  def offer_keys(self, batch: int, strategies: Sequence[Strategy],
                 calibration_only: bool) -> list[tuple]:
    """The executables ``strategies`` need at ``batch`` (see ``ExecutablePool.sd_keys``)."""
    learned = any(s.learned for s in strategies) and self.pool.needs_catchup(batch)
    return self.pool.sd_keys(batch, [s.group for s in strategies], learned, calibration_only)

  def _copy_weights(self):
    """A copy of ``weights()`` on the device (step costs follow shapes, not values)."""
    return jax.tree.map(lambda x: x.copy(), self.weights())

  def calibrate_bucket(self, batch: int, strategies: Sequence[Strategy]) -> dict:
    """``strategies``' step costs at ``batch`` (on the copy of the weights a background loop
    keeps; it is dropped once the loop has visited its last bucket)."""
    return self.calibrate(strategies={batch: strategies}, weights=self._calibration_weights)[0]

  @property
  def calibration_weights(self):
    """The copy of the weights a background offers loop times (None when no loop holds one)."""
    return self._calibration_weights

  def keep_calibration_weights(self) -> None:
    """Keeps a copy of the weights for a background offers loop to time (``calibrate_bucket``):
    the engine's own may be replaced and their buffers donated while it runs."""
    self._calibration_weights = self._copy_weights()

  def drop_calibration_weights(self) -> None:
    """Lets the offers loop's copy of the weights go (its last bucket is timed)."""
    self._calibration_weights = None

  def calibrate(self, steps: int = 8, repeats: int = 5,
                strategies: dict[int, Sequence[Strategy]] | None = None,
                weights=None) -> tuple[dict, float]:
    """Times the decode step of every strategy at every batch bucket where the tuner chooses
    (``strategies``: these per bucket instead; ``weights``: these instead of ``weights()``, of
    the same shapes):
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
    if strategies is None:
      strategies = {b: c for b, c in self._strategies.items() if len(c) > 1}
    weights = self.weights() if weights is None else weights
    costs, overheads = {}, []
    for b in sorted(strategies):
      ids, lens = np.full((b, plen), cfg.pad_token_id, np.int32), np.ones((b,), np.int32)
      for strategy in strategies[b]:
        segment = self.executable(("segment", b, kv_len, pool.stop_at(b), strategy.group))
        fastest = {}  # steps run -> fastest seconds
        for _ in range(repeats):
          for n in (1, 1 + steps):
            state = jax.block_until_ready(self.prefill(ids, lens, args, weights))
            t0 = time.perf_counter()
            state = segment(weights, state, args, np.int32(strategy.choice), np.int32(n),
                            np.int32(pool.stop_at(b)))
            ran = int(jax.device_get(state.counters["steps"]))
            fastest[ran] = min(fastest.get(ran, np.inf), time.perf_counter() - t0)
        if len(fastest) < 2:  # the rows could not run more than one step (a tiny cache)
          continue
        (n1, t1), (nn, tn) = min(fastest.items()), max(fastest.items())
        per_step = max((tn - t1) / (nn - n1), 1e-7)
        costs[(b, strategy.name)] = per_step
        overheads.append(max(t1 - per_step * n1, 0.0))
    return costs, float(np.median(overheads)) if overheads else 0.0

  # ---- the compiled pieces, one at a time (``calibrate``, profilers, tests) ------------------
  def weights(self) -> tuple[nnx.State, nnx.State | None]:
    """What every executable that reads weights takes first: ``(target weights, drafter weights
    or None)``, as ``generate`` passes them now."""
    return (self.params, self.drafter_params)

  def executable(self, key: tuple):
    """The compiled executable of the pool key ``key`` (``pool.py`` lists the kinds), compiled on
    first use and the very one ``generate`` then runs. ``("prefill", batch, prompt bucket)`` is
    called as ``(weights(), ids, prompt_lens, row_id, group_id, history, args)`` and returns
    ``(state, hidden)``; ``("segment", batch, kv_len, stop_at, group)`` as ``(weights(), state,
    args, choice, max_steps, stop_at)`` (``choice``: the strategy's index in its group;
    ``max_steps`` 0: until a boundary; ``stop_at``: live rows at which it ends, 0: none) and
    returns the state, which it donates. Outside ``generate`` a segment
    ends where ``generate`` would stop it (compaction, growth, all rows done), and nothing is
    compacted or grown: the caller reads ``state.counters["steps"]``."""
    return self.pool.get(key)

  def prefill(self, ids, prompt_lens, args: SamplerArgs, weights=None) -> DecodeState:
    """The decode state right after prefill of one batch bucket of (padded) prompts ``ids
    [batch, prompt bucket]`` of lengths ``prompt_lens [batch]``, by the engine's own prefill
    executable: row ``i`` samples with row ``i``'s keys (as row ``i`` of ``generate`` does),
    is in prompt group ``i`` and has no history. Its cache has ``prefill_kv_len(prompt bucket)``
    slots (``state.cache.max_len``), the ``kv_len`` of the segment that decodes it."""
    ids = np.asarray(ids, np.int32)
    batch, plen = ids.shape
    rows = np.arange(batch, dtype=np.int32)
    state, _ = self.executable(("prefill", batch, plen))(
        self.weights() if weights is None else weights, ids, np.asarray(prompt_lens, np.int32),
        rows, rows,
        self.pool.no_history(batch), args)
    return state

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
      self.tuner.observe_drafter(source=DrafterKind.SUFFIX, forget=True)
    self._history_share = share

  def collect_mask(self, collect_hidden, n: int, seed: int) -> np.ndarray | None:
    """Which of ``n`` rows return hidden states (see ``interface.collect_mask``)."""
    return collect_mask(collect_hidden, n, seed, self.steps.drafter_graphdef is not None)

  def generate_here(self, prompts: Sequence[Sequence[int]],
                    params: SamplingParams = SamplingParams(),
                    progress: Callable[[int, int], Any] | None = None, *, row_offset: int = 0,
                    collect_hidden: bool | float | Sequence[bool] = False,
                    idle_work: IdleWork | None = None,
                    history: Sequence[Sequence[Sequence[int]]] | None = None) -> RolloutResult:
    """Completes every prompt; rows finish on a stop id or at ``params.max_new_tokens``.

    ``progress(rows_done, rows_total)`` is called after every decode segment. Row ``i`` samples
    with the keys of row ``i + row_offset``. ``collect_hidden`` (needs a learned drafter) fills
    ``RolloutResult.hidden`` for all rows (True), a seeded fraction (float) or one bool per prompt.
    ``idle_work``: ``DataParallelRollout.generate``'s, on one device: its ``shard_done`` once,
    its ``idle`` never (one device is never idle while another decodes; docs/library.md,
    "RolloutEngine").
    """
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
    compiles0, compile_s0 = compile_count(), self.compile_seconds
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
    if idle_work is not None:
      idle_work.shard_done(0, int(row_offset), result)  # its first row in the whole request
    return result

  def _finish_stats(self, stats: RolloutStats, tokens: list[list[int]], compiles0: int,
                    compile_s0: float, t_start: float) -> None:
    """The totals of a finished ``generate``: compiles, wall time, throughput, the arms' means,
    the tail, accepted lengths (with SD) and the tuner's summary."""
    stats.compile_s = self.compile_seconds - compile_s0
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
