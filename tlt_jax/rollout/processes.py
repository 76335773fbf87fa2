"""One rollout over several processes: each process decodes its share of the rows on its own
devices, then every process gets every row.

Any rollout does this where ``make_rollout`` marked it (``Rollout.over_processes``) and JAX runs
more than one process: its ``generate`` calls ``generate_over_processes`` here, which runs the
rollout's own ``generate_here`` on this process's rows; its tuner is saved per process
(``gathered_tuner_state``, ``own_tuner_state``). No wrapper stands between the caller and the
rollout.

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
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.host.buckets import shard_ranges
from tlt_jax.rollout.host.stats import DeviceStats, RolloutResult, RolloutStats

__all__ = ["generate_over_processes", "gathered_tuner_state", "own_tuner_state", "process_rows"]

PER_PROCESS = "per_process"  # the key of the tuner states of every process in a checkpoint


def process_rows(n: int, processes: int, local_devices: int, index: int) -> range:
  """The rows process ``index`` decodes: its devices' shards of ``n`` rows cut over all
  ``processes * local_devices`` devices."""
  shards = shard_ranges(n, processes * local_devices)
  mine = shards[index * local_devices:(index + 1) * local_devices]
  return range(mine[0].start, mine[-1].stop)


def generate_over_processes(rollout, prompts: Sequence[Sequence[int]], params: SamplingParams,
                            progress: Callable[[int, int], Any] | None = None, *,
                            row_offset: int = 0,
                            collect_hidden: bool | float | Sequence[bool] = False,
                            idle_work: Any = None,
                            history: Sequence[Sequence[Sequence[int]]] | None = None
                            ) -> RolloutResult:
  """Every row's completion on every process (module docstring), ``rollout`` (a ``Rollout``)
  decoding this process's rows with its ``generate_here``. ``idle_work.shard_done`` gets the
  index of a shard's first row in the whole request, both its methods the local device index.
  Stats: the processes' merged (``RolloutStats.merge``), ``devices`` every process's devices in
  order (a device's ``idle_s`` counts until the slowest process finished), and ``processes``:
  per process its ``rows``, ``rollout_s`` (its own rows' wall time) and ``wait_s`` (how long it
  then waited for the others and the exchange)."""
  # every process checks every row: a bad one fails everywhere alike, not on its owner alone
  prompts = rollout.check_prompts(prompts)
  history = rollout.check_history(history, len(prompts), observe=False)
  collect = rollout.collect_mask(collect_hidden, len(prompts), params.seed)
  me, count, local_devices = hosts.process_index(), hosts.process_count(), len(rollout.devices)
  rows = process_rows(len(prompts), count, local_devices, me)
  t0 = time.perf_counter()
  local = _empty_result()
  if len(rows):
    options = {} if history is None else {"history": history[rows.start:rows.stop]}
    if idle_work is not None:  # its first rows count in the whole request (row_offset)
      options["idle_work"] = idle_work
    if progress is not None:  # this process's share, as a share of all rows
      options["progress"] = lambda done, _: progress(done * len(prompts) // len(rows),
                                                     len(prompts))
    local = rollout.generate_here(
        prompts[rows.start:rows.stop], params, row_offset=row_offset + rows.start,
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
  stats = _merged([got[3] for got in everyone], [
      len(process_rows(len(prompts), count, local_devices, p)) for p in range(count)], t_all)
  stats.processes[me]["wait_s"] = t_all - t_local
  if rollout.tuner is not None:
    stats.tuner = rollout.tuner.summary()
  return RolloutResult(tokens, logprobs, reasons, stats, hidden)


# ---- the tuner in checkpoints: one per process ----------------------------------------------------
def gathered_tuner_state(mine: dict | None) -> dict | None:
  """Every process's tuner state (``mine``: this process's, each learned from its own devices),
  gathered; the same value on every process (None without a tuner)."""
  everyone = hosts.allgather(mine, "tuner_state")
  if mine is None:
    return None
  return {"kind": mine.get("kind"), PER_PROCESS: everyone}


def own_tuner_state(saved: dict | None, report: Callable[[str], Any] = print) -> dict | None:
  """This process's entry of a saved ``gathered_tuner_state``; a checkpoint of another process
  count gives every process the state of process 0 (reported once), one of a single process
  (no per-process entries) is every process's as it is."""
  if saved is None or PER_PROCESS not in saved:
    return saved
  states = saved[PER_PROCESS]
  me = hosts.process_index()
  if len(states) != hosts.process_count():
    if hosts.is_primary():
      report(f"the checkpoint holds the tuner states of {len(states)} process(es) but this run "
             f"has {hosts.process_count()}: every process starts from process 0's")
    me = 0
  return states[me]


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
