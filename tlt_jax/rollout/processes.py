"""A rollout over several processes: each process decodes its share of the rows on its own
devices, then every process gets every row.

Every process runs the same job, so each one calls ``generate`` with the same prompts. The rows
are cut as a one-process rollout over all ``processes x local devices`` devices would cut them
(``shard_ranges``), and process ``p`` takes the contiguous run of shards of its devices; row
``i`` samples with the keys of row ``i`` wherever it lands (``row_offset``), so the tokens do not
depend on the number of processes (exactly with greedy decoding, vanilla sampling and coupled
verification; see ``parallel.py``). The finished rows are then exchanged through the coordinator
(``hosts.allgather``): every process holds the whole result, so rewards, GRPO groups and
advantages are computed everywhere alike and no group is ever split.

What stays local: hidden states for the drafter (a process's drafter data are its own rows'), the
``idle_work`` (run on the process's own devices) and the tuner (one per process,
each learning from its own devices; saved per process, see ``tuner_state``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from tlt_jax import hosts
from tlt_jax.rollout.engine import RolloutResult
from tlt_jax.rollout.interface import IdleWork, Rollout
from tlt_jax.rollout.parallel import shard_ranges
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.host.stats import DeviceStats, RolloutStats

__all__ = ["ProcessShardedRollout", "process_rows"]

PER_PROCESS = "per_process"  # the key of the tuner states of every process in a checkpoint


def process_rows(n: int, processes: int, local_devices: int, index: int) -> range:
  """The rows process ``index`` decodes: its devices' shards of ``n`` rows cut over all
  ``processes * local_devices`` devices."""
  shards = shard_ranges(n, processes * local_devices)
  mine = shards[index * local_devices:(index + 1) * local_devices]
  return range(mine[0].start, mine[-1].stop)


class ProcessShardedRollout(Rollout):
  """``local`` (a ``RolloutEngine`` or ``DataParallelRollout`` on this process's devices) made
  one rollout over every process (module docstring)."""

  def __init__(self, local: Rollout):
    self.local = local

  # ---- the Rollout interface -------------------------------------------------------------------
  @property
  def config(self):
    return self.local.config

  @property
  def devices(self) -> list:
    """This process's devices (the ones its rows decode on)."""
    return self.local.devices

  def executable_keys(self) -> list[tuple]:
    return self.local.executable_keys()

  @property
  def uses_history(self) -> bool:
    return self.local.uses_history

  @property
  def tuner(self):
    return self.local.tuner

  @property
  def drafter_params(self):
    return self.local.drafter_params

  def update_params(self, params, drafter_params=None) -> None:
    self.local.update_params(params, drafter_params)

  def target_params(self, index: int = 0):
    return self.local.target_params(index)

  def strategies_for(self, batch: int):
    return self.local.strategies_for(batch)

  def learned_sd_possible(self) -> bool:
    return self.local.learned_sd_possible()

  def precompile(self, progress: Callable[[int, int], Any] | None = None, *,
                 background: bool = False, first_rows: Sequence[int] | None = None) -> int:
    return self.local.precompile(progress, background=background, first_rows=first_rows)

  def _lead(self):
    return getattr(self.local, "engines", [self.local])[0]

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
               progress: Callable[[int, int], Any] | None = None, *,
               collect_hidden: bool | float | Sequence[bool] = False,
               idle_work: IdleWork | None = None,
               history: Sequence[Sequence[Sequence[int]]] | None = None) -> RolloutResult:
    """Every row's completion on every process (module docstring); ``idle_work.shard_done``
    gets the global index of a shard's first row, both its methods the local device index. Stats: the
    processes' merged (``RolloutStats.merge``), ``devices`` every process's devices in order (a
    device's ``idle_s`` counts until the slowest process finished), and ``processes``: per
    process its ``rows``, ``rollout_s`` (its own rows' wall time) and ``wait_s`` (how long it
    then waited for the others and the exchange)."""
    lead = self._lead()
    # every process checks every row: a bad one fails everywhere alike, not on its owner alone
    prompts = lead.check_prompts(prompts)
    history = lead.check_history(history, len(prompts), observe=False)
    collect = lead.collect_mask(collect_hidden, len(prompts), params.seed)
    me, count = hosts.process_index(), hosts.process_count()
    rows = process_rows(len(prompts), count, len(self.local.devices), me)
    t0 = time.perf_counter()
    local = _empty_result()
    if len(rows):
      options = {} if history is None else {"history": history[rows.start:rows.stop]}
      if idle_work is not None:  # its first rows count in the whole request (row_offset)
        options["idle_work"] = idle_work
      if progress is not None:  # this process's share, as a share of all rows
        options["progress"] = lambda done, _: progress(done * len(prompts) // len(rows),
                                                       len(prompts))
      local = self.local.generate(
          prompts[rows.start:rows.stop], params, row_offset=rows.start,
          collect_hidden=False if collect is None else collect[rows.start:rows.stop], **options)
    t_local = time.perf_counter() - t0
    mine = (local.tokens, local.logprobs, local.finish_reasons, local.stats)
    everyone = hosts.allgather(mine, "rollout")
    t_all = time.perf_counter() - t0
    tokens, logprobs, reasons = [], [], []
    for got in everyone:
      tokens += got[0]
      logprobs += [np.asarray(x) for x in got[1]]
      reasons += got[2]
    hidden = None
    if collect is not None:
      hidden = [None] * rows.start + list(local.hidden or [None] * len(rows)) + \
          [None] * (len(prompts) - rows.stop)
    stats = _merged([got[3] for got in everyone], [len(process_rows(len(prompts), count, len(
        self.local.devices), p)) for p in range(count)], t_all)
    stats.processes[me]["wait_s"] = t_all - t_local
    if self.tuner is not None:
      stats.tuner = self.tuner.summary()
    return RolloutResult(tokens, logprobs, reasons, stats, hidden)

  # ---- the tuner in checkpoints: one per process ------------------------------------------------
  def tuner_state(self) -> dict | None:
    """Every process's tuner state (each learned from its own devices), gathered; the same
    value on every process."""
    mine = self.local.tuner_state()
    everyone = hosts.allgather(mine, "tuner_state")
    if mine is None:
      return None
    return {"kind": mine.get("kind"), PER_PROCESS: everyone}

  def load_tuner_state(self, saved: dict | None, report: Callable[[str], Any] = print) -> None:
    """This process's entry of a saved ``tuner_state``; a checkpoint of another process count
    (or of one process) gives every process the state of process 0."""
    if saved is None or PER_PROCESS not in saved:
      self.local.load_tuner_state(saved, report)
      return
    states = saved[PER_PROCESS]
    me = hosts.process_index()
    if len(states) != hosts.process_count():
      if hosts.is_primary():
        report(f"the checkpoint holds the tuner states of {len(states)} process(es) but this run "
               f"has {hosts.process_count()}: every process starts from process 0's")
      me = 0
    self.local.load_tuner_state(states[me], report)


def _empty_result() -> RolloutResult:
  return RolloutResult([], [], [], RolloutStats(), [])


def _merged(per_process: list[RolloutStats], rows: list[int], wall_s: float) -> RolloutStats:
  """One process's view of the whole rollout from every process's stats (their devices in
  process order)."""
  stats = RolloutStats.merge(per_process, wall_s)
  walls = [s.rollout_wall_s if s.rollout_wall_s is not None else s.wall_s for s in per_process]
  slowest = max(walls)
  stats.rollout_wall_s = slowest
  devices: list[DeviceStats] = []
  for s, wall, n in zip(per_process, walls, rows):
    if s.devices:  # a process's devices waited for the slowest process too
      devices += [DeviceStats(rows=d.rows, busy_s=d.busy_s, idle_s=d.idle_s + slowest - wall,
                              idle_used_s=d.idle_used_s, tokens=d.tokens, tail_s=d.tail_s,
                              last_s=d.last_s)
                  for d in s.devices]
    else:  # one device: its rows' wall time, then the wait
      devices.append(DeviceStats(rows=n, busy_s=wall, idle_s=slowest - wall, idle_used_s=0.0,
                                 tokens=s.tokens, tail_s=s.tail_s, last_s=s.last_s))
  stats.devices = devices
  stats.tail_s = max(s.tail_s for s in per_process)
  stats.last_s = max(s.last_s for s in per_process)
  overruns = [s.idle_overrun_s for s in per_process if s.idle_overrun_s is not None]
  stats.idle_overrun_s = max(overruns) if overruns else None
  stats.idle = [x for s in per_process for x in (s.idle or [])] or None
  stats.processes = [dict(rows=n, rollout_s=w, wait_s=0.0) for n, w in zip(rows, walls)]
  return stats
