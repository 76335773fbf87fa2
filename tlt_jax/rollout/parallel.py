"""Data-parallel rollout: one bucketed engine per device, each driven by a host thread of its own.

A request's rows are split into contiguous shards, one per device. Every device has its own
``RolloutEngine`` (executables compiled for that device, weights committed there) and decodes its
shard with its own batch buckets, compaction and cache growth, so a device whose rows finish early
is free while the others still decode: that is the tail the spot trainer uses
(``idle(device_index, stop)`` is called in the freed device's thread and must return when
``stop`` is set, which happens as soon as the last shard finishes).

Why threads over one program per device rather than one SPMD program: an SPMD (``shard_map``)
decode loop keeps every device in lockstep at each host round trip, so the batch bucket, the
compaction and the segment boundaries would be those of the slowest shard, and a finished device
could not run anything else until the whole call returned. JAX dispatch is thread-safe and
releases the GIL while executables run, so one host thread per device is enough to keep every
device busy with a different program. The cost is one executable pool per device (compiled once).

Row ``i`` of the request samples with the keys of row ``i`` whatever shard it lands in
(``generate(row_offset=...)``), so tokens do not depend on the number of devices (exactly with
greedy decoding, vanilla sampling and coupled verification; rejection-sampled SD is lossless in
distribution, and an adaptive tuner's choices depend on thread timing). One device is the plain
engine's behaviour.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import jax
from flax import nnx

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, RolloutResult
from tlt_jax.rollout.engine_config import resolve_engine_config
from tlt_jax.rollout.interface import Rollout
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.offers import SdOffers
from tlt_jax.rollout.scheduler import segment_lengths
from tlt_jax.rollout.suffix import SuffixConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.stats import DeviceStats, RolloutStats
from tlt_jax.rollout.tuner import Tuner, TunerConfig, make_tuner
from tlt_jax.utils import compile_count, in_background, mark_background

__all__ = ["DataParallelRollout", "LockedTuner", "shard_ranges"]


class RolloutCancelled(Exception):
  """Raised in a device's thread to stop its shard when the caller was interrupted."""


class LockedTuner:
  """A tuner shared by the engines of several threads: every call runs under one lock.

  Each method of the tuner that the engines, the rollout and the trainer call is forwarded here by
  name, and each forward takes the lock; a method not listed is not reachable through it (add it
  with ``_locked`` rather than reach past the lock). Reads take the lock as writes do:
  ``summary`` and ``speeds`` read what ``plan``/``update`` write (the cost tuner caches its
  predictions per bucket), and a read beside another thread's write once found a bucket's
  predictions half built. ``tuner`` may be replaced (``DataParallelRollout.set_tuner``)."""

  def __init__(self, tuner: Tuner):
    self.tuner = tuner
    self._lock = threading.RLock()

  @property
  def config(self) -> TunerConfig:
    return self.tuner.config

  def _locked(name: str):  # pylint: disable=no-self-argument  # a class-body helper
    """The method ``name`` of the wrapped tuner, called under the lock."""
    def forward(self, *args, **kwargs):
      with self._lock:
        return getattr(self.tuner, name)(*args, **kwargs)
    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``Tuner.{name}`` under the lock."
    return forward

  plan = _locked("plan")
  update = _locked("update")
  set_costs = _locked("set_costs")
  observe_drafter = _locked("observe_drafter")
  step_cost = _locked("step_cost")
  relative_cost = _locked("relative_cost")
  summary = _locked("summary")
  state_dict = _locked("state_dict")
  load_state_dict = _locked("load_state_dict")
  speeds = _locked("speeds")  # the cost tuner's
  alpha = _locked("alpha")  # the cost tuner's
  del _locked


def shard_ranges(n: int, shards: int) -> list[range]:
  """``n`` rows cut into ``shards`` contiguous ranges whose sizes differ by at most one (the
  first ones are the bigger; some are empty when ``n < shards``)."""
  base, extra = divmod(n, shards)
  out, start = [], 0
  for k in range(shards):
    size = base + (k < extra)
    out.append(range(start, start + size))
    start += size
  return out


class DataParallelRollout(Rollout):
  """Rollouts over several devices: the rows split into one shard per device, each decoded by
  that device's own engine in a host thread of its own (see the module docstring).

  It implements the ``Rollout`` interface (``interface.py``) as ``RolloutEngine`` does, plus
  per-device stats and the ``shard_done``/``idle`` hooks of ``generate`` in earnest.
  """

  def __init__(self, model: Transformer, drafter: Drafter | NgramConfig | None = None,
               config: EngineConfig = EngineConfig(), devices: Sequence[Any] | None = None,
               tuner: Tuner | None = None, suffix: SuffixConfig | None = None):
    self.devices = list(devices) if devices is not None else jax.local_devices()[:1]
    if not self.devices:
      raise ValueError("DataParallelRollout needs at least one device")
    if len(set(self.devices)) != len(self.devices):
      raise ValueError(f"DataParallelRollout: devices repeat in {self.devices}")
    config = resolve_engine_config(config, drafter, suffix)  # once for every engine
    shared = None
    if config.adaptive:
      shared = LockedTuner(tuner if tuner is not None else make_tuner(config.tuner))
    # each engine places the weights it is given on its own device
    self.engines = [RolloutEngine(model, drafter=drafter, config=config, tuner=shared,
                                  device=device, suffix=suffix) for device in self.devices]
    for engine in self.engines:  # generate observes the whole request's history once
      engine.observes_history = False
    self.shared_tuner = shared

  # ---- the Rollout interface -------------------------------------------------------------------
  @property
  def config(self) -> EngineConfig:
    return self.engines[0].config

  @property
  def uses_history(self) -> bool:
    return self.engines[0].uses_history

  @property
  def tuner(self) -> Tuner | None:
    return None if self.shared_tuner is None else self.shared_tuner.tuner

  @property
  def drafter_params(self) -> nnx.State | None:
    return self.engines[0].drafter_params

  def set_tuner(self, tuner: Tuner | None = None) -> None:
    """Replaces the shared tuner (None: a fresh one from ``config.tuner``)."""
    if self.shared_tuner is None:
      raise ValueError("set_tuner: this engine has no EngineConfig.strategies to tune")
    self.shared_tuner.tuner = tuner if tuner is not None else make_tuner(self.config.tuner)
    if tuner is None and self.engines[0].calibration is not None:
      self.shared_tuner.set_costs(*self.engines[0].calibration)

  def strategies_for(self, batch: int):
    return self.engines[0].strategies_for(batch)

  def learned_sd_possible(self) -> bool:
    return self.engines[0].learned_sd_possible()  # the engines share their offers

  def update_params(self, params: nnx.State, drafter_params: nnx.State | None = None) -> None:
    """Gives every device's engine the weights, on its device (zero-copy where ``params`` already
    has a full copy there, e.g. a replicated array's shard). ``drafter_params`` are copied to the
    other devices and used as they are on their own: do not donate them afterwards."""
    for engine in self.engines:
      engine.update_params(params, drafter_params)

  def target_params(self, index: int = 0) -> nnx.State:
    """The target weights device ``index``'s engine decodes with (on that device)."""
    return self.engines[index].params

  def executable_keys(self) -> list[tuple]:
    """Every executable of every device's engine, as ``(device index, key)``."""
    return [(k, key) for k, e in enumerate(self.engines) for key in e.executable_keys()]

  def precompile(self, progress: Callable[[int, int], Any] | None = None, *,
                 background: bool = False) -> int:
    """Compiles every device's pool (one thread per device); returns how many were compiled.
    With a cost tuner, as ``RolloutEngine.precompile`` does on one device: vanilla's executables
    on every device, then the SD arms where the calibration says they pay (``background``: in a
    thread, while the rollout decodes), one bucket at a time on every device, timed on the
    first (the devices are alike; timing every device at once would measure them competing for
    the host) and offered to all at once."""
    first = self.engines[0]
    cost = getattr(getattr(self.shared_tuner, "config", None), "kind", None) == "cost"
    calibrated = cost and self.config.sd_offers == "calibrated"
    if calibrated and first.offers is not None:  # precompiled before: what it offers stands
      first.offers.wait()
      return 0
    keys = ((lambda e: e.pool.base_keys()) if calibrated else (lambda e: e.executable_keys()))
    compiled = self._compile_on_every_device(keys, progress)
    if cost and not calibrated:  # sd_offers="all": every arm, timed for the shared tuner
      first.calibration = first.calibrate()
      self.shared_tuner.set_costs(*first.calibration)
    if not calibrated:
      return compiled
    offers = SdOffers({b: first.candidates_for(b) for b in self.config.batch_buckets},
                      self.config.sd_prior_acceptance,
                      first._publish)  # pylint: disable=protected-access
    vanilla = {b: first.candidates_for(b)[:1] for b in offers.buckets}
    calibration = first.calibrate(strategies=vanilla)
    if background:  # the loop times a copy: the engines' weights may be donated meanwhile
      first._calibration_weights = first._copy_weights()  # pylint: disable=protected-access
      offers.on_done = first._drop_calibration_weights  # pylint: disable=protected-access
    for engine in self.engines:  # every device's scheduler bounds its segments alike
      engine.calibration = calibration
      engine.scheduler.segment_lengths = segment_lengths(*calibration, self.config.segment_steps)
      engine.offers = offers
    self.shared_tuner.set_costs(*calibration)
    return compiled + offers.launch(
        background, lambda keys: self._compile_on_every_device(lambda _: keys),
        first._offer_keys, first._calibrate_bucket)  # pylint: disable=protected-access

  def _compile_on_every_device(self, keys_of: Callable[[RolloutEngine], list],
                               progress: Callable[[int, int], Any] | None = None) -> int:
    """Compiles ``keys_of(engine)`` on every device's engine (one thread per device); returns
    how many executables one device compiled."""
    counts = [0] * len(self.engines)
    done = [0]
    lock = threading.Lock()
    total = sum(len([k for k in keys_of(e) if k not in e.pool.executables])
                for e in self.engines)
    cancel = threading.Event()
    background = in_background()

    def tick(*_):
      if cancel.is_set():
        raise RolloutCancelled("precompile interrupted")
      with lock:
        done[0] += 1
        if progress is not None:
          progress(done[0], total)

    def work(k):
      mark_background(background)  # a background caller's threads compile in the background
      counts[k] = self.engines[k].pool.compile(keys_of(self.engines[k]), tick)

    self._run_threads(work, range(len(self.engines)), cancel.set)
    return sum(counts)

  def pool_stats(self) -> list[dict[str, Any]]:
    return [e.pool_stats() for e in self.engines]

  @staticmethod
  def _run_threads(fn, items, on_interrupt: Callable[[], Any] | None = None) -> None:
    """Runs ``fn(item)`` for every item in a thread of its own; re-raises the first error.

    If the caller is interrupted while waiting (Ctrl-C: KeyboardInterrupt in the main thread),
    ``on_interrupt()`` tells the work to stop and every thread is waited for before the interrupt
    goes on: a thread still inside XLA when the interpreter exits is torn down mid-call, which
    aborts the process ("terminate called ... FATAL: exception not rethrown") instead of exiting.
    """
    errors: list[BaseException] = []

    def guarded(item):
      try:
        fn(item)
      except BaseException as e:  # pylint: disable=broad-except  # re-raised below
        errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in items]
    try:
      for t in threads:  # an interrupt can come while the later ones start (Thread.start
        t.start()  # waits): the started ones are waited for all the same
      for t in threads:
        t.join()
    except BaseException:
      if on_interrupt is not None:
        on_interrupt()
      # the work stops at its next check (see on_interrupt). Not Thread.join: in CPython < 3.12
      # a join interrupted by Ctrl-C can mark a thread that is still running (e.g. compiling
      # inside XLA) as stopped, and every later join then returns at once. A thread is gone when
      # threading.enumerate() no longer lists it.
      while any(t in threading.enumerate() for t in threads):
        time.sleep(0.005)
      raise
    if errors:
      raise errors[0]

  # ---- generate ---------------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
               progress: Callable[[int, int], Any] | None = None, *, row_offset: int = 0,
               collect_hidden: bool | float | Sequence[bool] = False,
               shard_done: Callable[[int, int, RolloutResult], Any] | None = None,
               idle: Callable[[int, threading.Event], Any] | None = None,
               history: Sequence[Sequence[Sequence[int]]] | None = None) -> RolloutResult:
    """Completes every prompt over the devices; the same result as one engine's ``generate``
    (the tokens of row ``i`` do not depend on the split; see the module docstring).
    ``row_offset``: the first prompt is row ``row_offset`` of a larger request (its keys).

    ``shard_done(device_index, first_row, result)`` is called in a device's thread as soon as
    its shard is complete (e.g. to hand its hidden states to the drafter's buffer);
    ``idle(device_index, stop)`` is then called there while other devices still decode (and at
    once for devices that got no rows), and must return soon after ``stop`` is set, which happens
    when the last shard completes. Its return value is kept in ``stats.idle``.

    Stats (``RolloutStats.merge``): counters and seconds summed over devices, ``wall_s`` the
    rollout's wall time, and ``devices`` (``DeviceStats``): per device ``rows``, ``busy_s`` (its
    shard's wall time), ``idle_s`` (the rest of the rollout, the tail it waited through) and
    ``idle_used_s`` (the part of it ``idle`` ran);
    ``idle_overrun_s``: how long the rollout waited past its last shard for ``idle`` hooks to
    return (e.g. a drafter step in flight when ``stop`` was set).
    """
    lead = self.engines[0]
    prompts = lead.check_prompts(prompts)
    history = lead.check_history(history, len(prompts), observe=False)
    if history is not None:
      lead.observe_history(history)
    collect = lead.collect_mask(collect_hidden, len(prompts), params.seed)
    shards = shard_ranges(len(prompts), len(self.engines))
    results: list[RolloutResult | None] = [None] * len(shards)
    busy = [0.0] * len(shards)
    hook_span = [(0.0, 0.0)] * len(shards)  # when each device's idle hook ran (from t0)
    idle_out: list[Any] = [None] * len(shards)
    remaining = [sum(1 for s in shards if len(s))]
    lock = threading.Lock()
    stop = threading.Event()
    if remaining[0] == 0:
      stop.set()
    counts = [0] * len(shards)

    cancel = threading.Event()  # set when the caller is interrupted: every shard stops

    def report(k):
      def cb(done, _total):
        if cancel.is_set():  # called after every decode segment: a shard stops within one
          raise RolloutCancelled("rollout interrupted")
        with lock:
          counts[k] = done
          if progress is not None:
            progress(sum(counts), len(prompts))
      return cb

    t0, compiles0 = time.perf_counter(), compile_count()

    def work(k):
      rows = shards[k]
      try:
        if len(rows):
          mask = False if collect is None else collect[rows.start:rows.stop]
          results[k] = self.engines[k].generate(
              prompts[rows.start:rows.stop], params, report(k),
              row_offset=row_offset + rows.start,
              collect_hidden=mask,
              history=None if history is None else history[rows.start:rows.stop])
          if shard_done is not None:
            shard_done(k, rows.start, results[k])
          busy[k] = time.perf_counter() - t0  # the shard is complete once its hook returned
      finally:
        with lock:
          if len(rows):
            remaining[0] -= 1
          last = remaining[0] == 0
        if last:
          stop.set()
      if idle is not None and not stop.is_set():
        t1 = time.perf_counter() - t0
        idle_out[k] = idle(k, stop)
        hook_span[k] = (t1, time.perf_counter() - t0)

    def interrupted():
      stop.set()  # idle hooks return at their next check
      cancel.set()

    try:
      self._run_threads(work, range(len(shards)), interrupted)
    finally:
      stop.set()
    wall = time.perf_counter() - t0
    rollout_wall = max(busy)
    tokens, logprobs, reasons, hidden = [], [], [], ([] if collect is not None else None)
    for r in results:
      if r is None:
        continue
      tokens += r.tokens
      logprobs += r.logprobs
      reasons += r.finish_reasons
      if hidden is not None:
        hidden += r.hidden
    stats = RolloutStats.merge([r.stats if r else None for r in results], wall)
    stats.rollout_wall_s = rollout_wall
    # the counter is per process: every thread's engine saw all threads' compiles (and those of
    # the idle hooks, e.g. a drafter step compiled for a new device)
    stats.compiles = compile_count() - compiles0
    # a hook's time inside the tail (its device's idle window) counts as used; what it ran past
    # the last shard's end (a drafter step in flight when stop was set) made the rollout wait
    stats.devices = [
        DeviceStats(rows=len(shards[k]), busy_s=busy[k], idle_s=rollout_wall - busy[k],
                    idle_used_s=max(0.0, min(hook_span[k][1], rollout_wall) - hook_span[k][0]),
                    tokens=(results[k].stats.tokens if results[k] else 0),
                    tail_s=(results[k].stats.tail_s if results[k] else 0.0),
                    last_s=(results[k].stats.last_s if results[k] else 0.0))
        for k in range(len(shards))]
    # the devices decode at once: the rollout's tail is its longest device tail (summing them
    # would count device-seconds, not wall time; the tail's idle devices are in ``idle_s``)
    stats.tail_s = max(d.tail_s for d in stats.devices)
    stats.last_s = max(d.last_s for d in stats.devices)
    stats.idle_overrun_s = max([0.0] + [end - rollout_wall for start, end in hook_span
                                        if end > start])
    stats.idle = idle_out
    if self.tuner is not None:
      stats.tuner = self.tuner.summary()
    return RolloutResult(tokens, logprobs, reasons, stats, hidden)
