"""Data-parallel rollout: one bucketed engine per device, each driven by a host thread of its own.

A request's rows are split into contiguous shards, one per device. Every device has its own
``RolloutEngine`` (executables compiled for that device, weights committed there) and decodes its
shard with its own batch buckets, compaction and cache growth, so a device whose rows finish early
is free while the others still decode: that is the tail the spot trainer uses
(``interface.IdleWork``: its ``idle(device_index, stop)`` is called in the freed device's thread
and must return when ``stop`` is set, which happens as soon as the last shard finishes).

Why threads over one program per device rather than one SPMD program: an SPMD (``shard_map``)
decode loop keeps every device in lockstep at each host round trip, so the batch bucket, the
compaction and the segment boundaries would be those of the slowest shard, and a finished device
could not run anything else until the whole call returned. JAX dispatch is thread-safe and
releases the GIL while executables run, so one host thread per device is enough to keep every
device busy with a different program. Each program is compiled once, on the first device, and
rebound to the others (``aot.SharedPrograms``): a load of milliseconds, not a compile.

Row ``i`` of the request samples with the keys of row ``i`` whatever shard it lands in
(``generate(row_offset=...)``), so tokens do not depend on the number of devices (exactly with
greedy decoding, vanilla sampling and coupled verification; rejection-sampled SD is lossless in
distribution, and an adaptive tuner's choices depend on thread timing). One device is the plain
engine's behaviour.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import jax
from flax import nnx

from tlt_jax.aot import SharedPrograms
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer
from tlt_jax.rollout.host import buckets as bk
from tlt_jax.rollout.host.buckets import shard_ranges
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, RolloutResult
from tlt_jax.rollout.host.calibration import Calibration
from tlt_jax.rollout.host.engine_config import resolve_engine_config
from tlt_jax.rollout.interface import IdleWork, Rollout
from tlt_jax.rollout.host.offers import SdOffers
from tlt_jax.rollout.decode.suffix import SuffixConfig
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.host.stats import DeviceStats, RolloutStats
from tlt_jax.rollout.host.tuner import Tuner, make_tuner
from tlt_jax.utils import compile_count, in_background, mark_background

__all__ = ["DataParallelRollout", "shard_config", "shard_ranges"]


class RolloutCancelled(Exception):
  """Raised in a device's thread to stop its shard when the caller was interrupted."""


def shard_config(config: EngineConfig, devices: int) -> EngineConfig:
  """The engine config of one device's shard: a chunk of ``max_batch`` rows gives each device at
  most ``ceil(max_batch / devices)`` of them, so the batch buckets above that are dropped."""
  top = bk.bucket_for(-(-config.max_batch // devices), config.batch_buckets)
  if top == config.max_batch:
    return config
  return dataclasses.replace(config, max_batch=top,
                             batch_buckets=tuple(b for b in config.batch_buckets if b <= top))


class DataParallelRollout(Rollout):
  """Rollouts over several devices: the rows split into one shard per device, each decoded by
  that device's own engine in a host thread of its own (see the module docstring).

  It implements the ``Rollout`` interface (``interface.py``) as ``RolloutEngine`` does, plus
  per-device stats and the ``idle_work`` of ``generate`` in earnest.
  """

  def __init__(self, model: Transformer, drafter: Drafter | Any | None = None,
               config: EngineConfig = EngineConfig(), devices: Sequence[Any] | None = None,
               tuner: Tuner | None = None, suffix: SuffixConfig | None = None):
    self.devices = list(devices) if devices is not None else jax.local_devices()[:1]
    if not self.devices:
      raise ValueError("DataParallelRollout needs at least one device")
    if len(set(self.devices)) != len(self.devices):
      raise ValueError(f"DataParallelRollout: devices repeat in {self.devices}")
    config = shard_config(resolve_engine_config(config, drafter, suffix), len(self.devices))
    shared = None  # one tuner for every device (each call takes its lock: ``Tuner``)
    if config.adaptive:
      shared = tuner if tuner is not None else make_tuner(config.tuner)
    # each engine places the weights it is given on its own device; a program is compiled once,
    # by the first device that needs it, and rebound to the others
    self.programs = SharedPrograms()
    # the step costs, segment lengths and SD offers: timed on the first device, used by all
    self.calibration = Calibration(config.segment_steps)
    self.engines = [RolloutEngine(model, drafter=drafter, config=config, tuner=shared,
                                  device=device, suffix=suffix, programs=self.programs,
                                  calibration=self.calibration)
                    for device in self.devices]
    for engine in self.engines:  # generate observes the whole request's history once
      engine.observes_history = False
    self._tuner = shared

  # ---- the Rollout interface -------------------------------------------------------------------
  @property
  def config(self) -> EngineConfig:
    return self.engines[0].config

  @property
  def uses_history(self) -> bool:
    return self.engines[0].uses_history

  @property
  def tuner(self) -> Tuner | None:
    return self._tuner

  @property
  def drafter_params(self) -> nnx.State | None:
    return self.engines[0].drafter_params

  def set_tuner(self, tuner: Tuner | None = None) -> None:
    """Replaces the shared tuner (None: a fresh one from ``config.tuner``)."""
    if self._tuner is None:
      raise ValueError("set_tuner: this engine has no EngineConfig.strategies to tune")
    self._tuner = tuner if tuner is not None else make_tuner(self.config.tuner)
    for engine in self.engines:
      engine.set_tuner(self._tuner)
    if tuner is None and self.calibration.costs is not None:
      self._tuner.set_costs(*self.calibration.costs)

  @property
  def offers(self) -> SdOffers | None:
    """The SD arms each bucket offers on every device after a calibrated ``precompile``."""
    return self.calibration.offers

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
                 background: bool = False, first_rows: Sequence[int] | None = None) -> int:
    """Compiles every device's pool (one thread per device); returns how many were compiled.
    ``first_rows`` is not used here: every device compiles vanilla's whole set first.
    With a cost tuner, as ``RolloutEngine.precompile`` does on one device: vanilla's executables
    on every device, then the SD arms where the calibration says they pay (``background``: in a
    thread, while the rollout decodes), one bucket at a time on every device, timed on the
    first (the devices are alike; timing every device at once would measure them competing for
    the host) and offered to all at once."""
    del first_rows
    first, shared = self.engines[0], self.calibration
    cost = getattr(getattr(self.tuner, "config", None), "kind", None) == "cost"
    calibrated = cost and self.config.sd_offers == "calibrated"
    if calibrated and shared.offers is not None:  # precompiled before: what it offers stands
      shared.offers.wait()
      return 0
    keys = ((lambda e: e.vanilla_keys()) if calibrated else (lambda e: e.executable_keys()))
    compiled = self._compile_on_every_device(keys, progress)
    if cost and not calibrated:  # sd_offers="all": every arm, timed for the shared tuner (the
      # segments keep EngineConfig.segment_steps here, unlike one engine's: as it always was)
      shared.measured(first.calibrate(), self.tuner, bound_segments=False)
    if not calibrated:
      return compiled
    offers = SdOffers({b: first.candidates_for(b) for b in self.config.batch_buckets},
                      self.config.sd_prior_acceptance,
                      lambda costs: shared.add(costs, self.tuner))
    vanilla = {b: first.candidates_for(b)[:1] for b in offers.buckets}
    calibration = first.calibrate(strategies=vanilla)
    if background:  # the loop times a copy: the engines' weights may be donated meanwhile
      first.keep_calibration_weights()
      offers.on_done = first.drop_calibration_weights
    # every device's scheduler bounds its segments alike, and every device offers the same arms
    shared.measured(calibration, self.tuner)
    shared.offers = offers
    return compiled + offers.launch(
        background, lambda keys: self._compile_on_every_device(lambda _: keys),
        first.offer_keys, first.calibrate_bucket)

  def _compile_on_every_device(self, keys_of: Callable[[RolloutEngine], list],
                               progress: Callable[[int, int], Any] | None = None) -> int:
    """Compiles ``keys_of(engine)`` on the first device, then rebinds those executables to every
    other device (threads, one per device); returns how many executables the devices gained."""
    counts = [0] * len(self.engines)
    done = [0]
    lock = threading.Lock()
    total = sum(len(e.missing_keys(keys_of(e))) for e in self.engines)
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
      counts[k] = self.engines[k].compile(keys_of(self.engines[k]), tick)

    self._run_threads(work, range(1), cancel.set)  # the compiles
    self._run_threads(work, range(1, len(self.engines)), cancel.set)  # the rebinds
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
  def check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    return self.engines[0].check_prompts(prompts)  # the engines share the config and model

  def check_history(self, history, n: int, observe: bool = True):
    return self.engines[0].check_history(history, n, observe)  # one observer for every device

  def collect_mask(self, collect_hidden, n: int, seed: int):
    return self.engines[0].collect_mask(collect_hidden, n, seed)

  def generate_here(self, prompts: Sequence[Sequence[int]],
                    params: SamplingParams = SamplingParams(),
                    progress: Callable[[int, int], Any] | None = None, *, row_offset: int = 0,
                    collect_hidden: bool | float | Sequence[bool] = False,
                    idle_work: IdleWork | None = None,
                    history: Sequence[Sequence[Sequence[int]]] | None = None) -> RolloutResult:
    """Completes every prompt over the devices, with one engine's result (row ``i``'s tokens do not
    depend on the split); ``row_offset``: the first prompt's row in a larger request.

    ``idle_work.shard_done(device_index, first_row, result)`` runs in a device's thread once its
    shard is complete; ``idle_work.idle(device_index, stop)`` then runs there while other devices
    decode, and must return soon after ``stop`` is set (when the last shard completes); its
    return value goes to ``stats.idle``. The merged stats: docs/library.md, "Data-parallel stats".
    """
    prompts = self.check_prompts(prompts)
    history = self.check_history(history, len(prompts))
    collect = self.collect_mask(collect_hidden, len(prompts), params.seed)
    run = _ShardRun(self.engines, prompts, params, progress, row_offset, collect, history,
                    idle_work)
    t0, compiles0 = time.perf_counter(), compile_count()
    try:
      self._run_threads(lambda k: run.work(k, t0), range(len(run.shards)), run.interrupt)
    finally:
      run.stop.set()
    result = run.result(time.perf_counter() - t0)
    # the counter is per process: every thread's engine saw all threads' compiles (and those of
    # the idle hooks, e.g. a drafter step compiled for a new device)
    result.stats.compiles = compile_count() - compiles0
    if self.tuner is not None:
      result.stats.tuner = self.tuner.summary()
    return result


class _ShardRun:
  """One ``DataParallelRollout.generate`` call: each device's shard, decoded in that device's
  thread (``work``), then its idle hook until the last shard is done; ``result`` merges them."""

  def __init__(self, engines, prompts, params, progress, row_offset, collect, history,
               idle_work):
    self.engines, self.prompts, self.params = engines, prompts, params
    self.progress, self.row_offset, self.collect = progress, row_offset, collect
    self.history, self.idle_work = history, idle_work
    self.shards = shard_ranges(len(prompts), len(engines))
    n = len(self.shards)
    self.results: list[RolloutResult | None] = [None] * n
    self.busy = [0.0] * n  # when each shard was complete (from t0)
    self.hook_span = [(0.0, 0.0)] * n  # when each device's idle hook ran (from t0)
    self.idle_out: list[Any] = [None] * n
    self.counts = [0] * n
    self.remaining = sum(1 for s in self.shards if len(s))
    self.lock = threading.Lock()
    self.stop = threading.Event()  # set when the last shard is complete: idle hooks return
    self.cancel = threading.Event()  # set when the caller is interrupted: every shard stops
    if self.remaining == 0:
      self.stop.set()

  def interrupt(self) -> None:
    self.stop.set()  # idle hooks return at their next check
    self.cancel.set()

  def report(self, k: int):
    """Device ``k``'s progress callback, called after every decode segment."""
    def cb(done, _total):
      if self.cancel.is_set():  # a shard stops within one segment
        raise RolloutCancelled("rollout interrupted")
      with self.lock:
        self.counts[k] = done
        if self.progress is not None:
          self.progress(sum(self.counts), len(self.prompts))
    return cb

  def work(self, k: int, t0: float) -> None:
    """Device ``k``'s thread: its shard, ``idle_work.shard_done``, then ``idle_work.idle``."""
    rows = self.shards[k]
    try:
      if len(rows):
        self.results[k] = self.engines[k].generate(
            self.prompts[rows.start:rows.stop], self.params, self.report(k),
            row_offset=self.row_offset + rows.start,
            collect_hidden=False if self.collect is None else self.collect[rows.start:rows.stop],
            history=None if self.history is None else self.history[rows.start:rows.stop])
        if self.idle_work is not None:
          self.idle_work.shard_done(k, self.row_offset + rows.start, self.results[k])
        self.busy[k] = time.perf_counter() - t0  # complete once its hook returned
    finally:
      with self.lock:
        if len(rows):
          self.remaining -= 1
        last = self.remaining == 0
      if last:
        self.stop.set()
    if self.idle_work is not None and not self.stop.is_set():
      t1 = time.perf_counter() - t0
      self.idle_out[k] = self.idle_work.idle(k, self.stop)
      self.hook_span[k] = (t1, time.perf_counter() - t0)

  def result(self, wall: float) -> RolloutResult:
    """The shards' results in row order, with merged and per-device stats."""
    tokens, logprobs, reasons = [], [], []
    hidden = [] if self.collect is not None else None
    for r in self.results:
      if r is None:
        continue
      tokens += r.tokens
      logprobs += r.logprobs
      reasons += r.finish_reasons
      if hidden is not None:
        hidden += r.hidden
    stats = RolloutStats.merge([r.stats if r else None for r in self.results], wall)
    stats.rollout_wall_s = max(self.busy)
    stats.devices = [self.device_stats(k, stats.rollout_wall_s) for k in range(len(self.shards))]
    # the devices decode at once: the rollout's tail is its longest device tail (summing them
    # would count device-seconds, not wall time; the tail's idle devices are in ``idle_s``)
    stats.tail_s = max(d.tail_s for d in stats.devices)
    stats.last_s = max(d.last_s for d in stats.devices)
    # what a hook ran past the last shard's end (a step in flight when stop was set)
    stats.idle_overrun_s = max([0.0] + [end - stats.rollout_wall_s
                                        for start, end in self.hook_span if end > start])
    stats.idle = self.idle_out
    return RolloutResult(tokens, logprobs, reasons, stats, hidden)

  def device_stats(self, k: int, rollout_wall: float) -> DeviceStats:
    """Device ``k``'s rows, busy and idle time; its hook's time inside the tail counts as used."""
    r = self.results[k]
    start, end = self.hook_span[k]
    return DeviceStats(rows=len(self.shards[k]), busy_s=self.busy[k],
                       idle_s=rollout_wall - self.busy[k],
                       idle_used_s=max(0.0, min(end, rollout_wall) - start),
                       tokens=r.stats.tokens if r else 0, tail_s=r.stats.tail_s if r else 0.0,
                       last_s=r.stats.last_s if r else 0.0)
