"""What a rollout reports: one typed stats object, its data-parallel merge, and the metrics and
console lines made of it.

``RolloutStats`` is filled in by the scheduler as a rollout runs (seconds per phase, counters,
one tally per (batch bucket, arm)), finished by the engine (wall time, throughput, accepted
lengths), and merged over devices by the data-parallel rollout. ``rollout_metrics`` turns one
into the trainer's scalar metrics; ``arm_line`` and ``run_sd_summary`` turn metrics into lines.

Code reads the fields as attributes (``stats.tail_s``); reports that want a record (JSON files,
the benchmarks' tables) take ``to_dict()``, nested tallies and devices as plain dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from tlt_jax.rollout.decode.kinds import draft_sources


@dataclasses.dataclass
class ArmTally:
  """One arm's running tally in one batch bucket: segments decoded, decode steps, tokens
  emitted, live row-steps and seconds (its segments' and their catch-ups'). ``finish`` adds its
  mean tokens per live row-step (its mean accepted length; vanilla: 1) and throughput.

  ``critical_tokens``: the tokens that each chunk's longest row emitted in the arm's segments,
  known once the chunk is done. That row sets how long vanilla decoding takes (one of its tokens
  a step), so these are the vanilla steps the arm's segments stood in for on the rollout's
  critical path. The mean over rows (``tokens / row_steps``) overstates them where short rows
  accept more than the long one, as history drafts do."""

  segments: int = 0
  steps: int = 0
  tokens: int = 0
  row_steps: int = 0
  seconds: float = 0.0
  critical_tokens: int = 0
  mean_accept_len: float | None = None
  tokens_per_s: float | None = None

  def add(self, other: ArmTally) -> None:
    for name in ("segments", "steps", "tokens", "row_steps", "seconds", "critical_tokens"):
      setattr(self, name, getattr(self, name) + getattr(other, name))

  def finish(self) -> None:
    self.mean_accept_len = self.tokens / self.row_steps if self.row_steps else None
    self.tokens_per_s = self.tokens / self.seconds if self.seconds > 0 else None


@dataclasses.dataclass
class DeviceStats:
  """One device of a data-parallel rollout: its ``rows``, ``busy_s`` (its shard's wall time),
  ``idle_s`` (the rest of the rollout, the tail it waited through), ``idle_used_s`` (the part of
  it the ``idle`` hook ran), and its shard's ``tokens``, ``tail_s`` and ``last_s``."""

  rows: int
  busy_s: float
  idle_s: float
  idle_used_s: float
  tokens: int
  tail_s: float
  last_s: float = 0.0


# summed over devices by ``RolloutStats.merge`` (seconds become device-seconds)
_SUMMED = ("prefill_s", "decode_s", "compact_s", "grow_s", "compile_s", "switch_s", "switches",
           "catchups", "decode_steps", "row_steps", "live_row_steps", "grows", "tokens")


@dataclasses.dataclass(eq=False)
class RolloutStats:
  """The per-call statistics of a rollout. ``switches``: changes of arm between two consecutive
  segments of a chunk (vanilla <-> SD and one strategy to another, learned or n-gram drafter
  alike; a chunk's first segment is none); ``catchups``: the learned drafter's catch-ups (one
  per vanilla -> SD switch), whose seconds are ``switch_s``.

  ``segments``: per segment ``(batch bucket, decode steps, seconds, arm)``, with its cache
  length in ``segment_kv_lens``; ``arms``: the tally of each arm per batch bucket
  (``arms[str(bucket)][name]``). ``accept_hist`` (with SD; index i: SD steps that emitted i + 1
  tokens) and ``mean_accept_len`` (None when no speculative step ran, e.g. the tuner chose
  vanilla throughout); ``draft_s``/``verify_s`` with ``EngineConfig.time_phases``; ``tuner``:
  the adaptive engine's tuner summary. A data-parallel rollout adds ``rollout_wall_s``,
  ``devices``, ``idle_overrun_s`` and ``idle`` (see ``DataParallelRollout.generate``).
  """

  prefill_s: float = 0.0
  decode_s: float = 0.0
  compact_s: float = 0.0
  grow_s: float = 0.0
  compile_s: float = 0.0
  switch_s: float = 0.0
  switches: int = 0
  catchups: int = 0
  decode_steps: int = 0
  row_steps: int = 0
  live_row_steps: int = 0
  segments: list[tuple] = dataclasses.field(default_factory=list)
  segment_kv_lens: list[int] = dataclasses.field(default_factory=list)
  grows: int = 0
  cache_bytes_peak: int = 0
  tokens: int = 0
  arms: dict[str, dict[str, ArmTally]] = dataclasses.field(default_factory=dict)
  compiles: int = 0
  wall_s: float = 0.0
  tokens_per_s: float = 0.0
  tail_s: float = 0.0
  last_s: float = 0.0  # ``last_seconds``: while at most an eighth of the rows were live
  accept_hist: Any = None  # a counter array while decoding, a list once finished
  mean_accept_len: float | None = None
  # per draft source (``kinds.draft_sources()``: history, group, prompt, self, none, learned,
  # ngram): speculative row-steps whose accepted path it drafted, and the tokens they emitted
  source_steps: dict[str, int] = dataclasses.field(default_factory=dict)
  source_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
  # speculative decoding's estimated saving against vanilla (``saved_seconds``; negative where SD
  # cost time, e.g. probes); None where nothing could be estimated
  sd_saved_s: float | None = None
  draft_s: float | None = None
  verify_s: float | None = None
  tuner: dict | None = None
  # a data-parallel rollout's
  rollout_wall_s: float | None = None
  devices: list[DeviceStats] | None = None
  idle_overrun_s: float | None = None
  idle: list | None = None
  # a rollout over several processes' (``processes.py``): per process rows, rollout_s, wait_s
  processes: list[dict] | None = None

  def add_sources(self, steps, tokens, names: Sequence[str] | None = None) -> None:
    """Adds per-source counts (arrays indexed like ``names``, default ``kinds.draft_sources()``, or
    dicts) to ``source_steps`` / ``source_tokens``; sources never used are left out."""
    if isinstance(steps, dict):
      names, steps, tokens = list(steps), list(steps.values()), [tokens[n] for n in steps]
    for name, n, t in zip(names or draft_sources(), np.asarray(steps).tolist(),
                          np.asarray(tokens).tolist()):
      if n:
        self.source_steps[name] = self.source_steps.get(name, 0) + int(n)
        self.source_tokens[name] = self.source_tokens.get(name, 0) + int(t)

  def accept_by_source(self) -> dict[str, float]:
    """Mean tokens emitted per speculative row-step, per draft source that drafted any."""
    return {name: self.source_tokens[name] / n for name, n in self.source_steps.items() if n}

  def arm(self, batch: int | str, name: str) -> ArmTally:
    """The running tally ``arms[str(batch)][name]`` (created empty)."""
    return self.arms.setdefault(str(batch), {}).setdefault(name, ArmTally())

  def arm_totals(self, field: str) -> dict[str, Any]:
    """Each arm's tally ``field`` (``"steps"``, ``"seconds"``, ``"tokens"``, ...) summed over the
    batch buckets it decoded."""
    out: dict[str, Any] = {}
    for per_bucket in self.arms.values():
      for name, tally in per_bucket.items():
        out[name] = out.get(name, 0) + getattr(tally, field)
    return out

  def finish_arms(self) -> None:
    """Adds each arm's mean accepted length and throughput to its tally."""
    for per_bucket in self.arms.values():
      for tally in per_bucket.values():
        tally.finish()

  @classmethod
  def merge(cls, shards: list[RolloutStats | None], wall_s: float) -> RolloutStats:
    """One stats object for a data-parallel rollout: counters and seconds summed over devices
    (seconds are then device-seconds), segments and per-arm tallies concatenated/summed (None:
    a device that got no rows). The caller adds what only it knows (``devices``, ...)."""
    merged = cls()
    hist = None
    draft = [s for s in shards if s is not None and s.draft_s is not None]
    for stats in shards:
      if stats is None:
        continue
      for name in _SUMMED:
        setattr(merged, name, getattr(merged, name) + getattr(stats, name))
      merged.cache_bytes_peak = max(merged.cache_bytes_peak, stats.cache_bytes_peak)
      merged.segments += stats.segments
      merged.segment_kv_lens += stats.segment_kv_lens
      for bucket, arms in stats.arms.items():
        for name, tally in arms.items():
          merged.arm(bucket, name).add(tally)
      if stats.accept_hist is not None:
        h = np.asarray(stats.accept_hist)
        hist = h if hist is None else hist + h
      merged.add_sources(stats.source_steps, stats.source_tokens)
    saved = [s.sd_saved_s for s in shards if s is not None and s.sd_saved_s is not None]
    if saved:
      merged.sd_saved_s = float(sum(saved))  # device-seconds
    if draft:
      merged.draft_s = sum(s.draft_s for s in draft)
      merged.verify_s = sum(s.verify_s for s in draft)
    merged.finish_arms()
    if hist is not None:
      merged.accept_hist = hist.tolist()
      merged.mean_accept_len = mean_accept_len(hist)
    merged.wall_s = wall_s
    merged.tokens_per_s = merged.tokens / max(wall_s - merged.compile_s / max(len(shards), 1),
                                              1e-9)
    return merged

  def to_dict(self) -> dict[str, Any]:
    """Every field as plain data (tallies and devices as dicts, arrays as lists), for reports."""
    return _plain(self)


def _plain(value):
  """``value`` with dataclasses as dicts and arrays as lists (recursively)."""
  if dataclasses.is_dataclass(value):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, np.ndarray):
    return value.tolist()
  return value


def mean_accept_len(hist) -> float | None:
  """Mean tokens emitted per live row per speculative step from ``accept_hist`` (index i: steps
  that emitted i + 1 tokens); None when no speculative step ran (e.g. the tuner chose vanilla
  throughout), not 0.0, which would drag averages over rollouts down."""
  hist = np.asarray(hist)
  return float((hist * np.arange(1, hist.size + 1)).sum() / hist.sum()) if hist.sum() else None


def saved_seconds(arms: dict[str, dict[str, ArmTally]],
                  vanilla_step_s: Callable[[int], float | None]) -> float | None:
  """What speculative decoding saved in a rollout, in seconds, from its per-arm tallies: a
  speculative arm's segments at bucket ``b`` advanced each chunk's longest row by
  ``critical_tokens`` tokens, which vanilla decodes in as many steps of ``vanilla_step_s(b)``
  seconds; the saving is that minus the arm's seconds (catch-ups included), negative where SD
  was slower (a probe, or rows decoded on after the longest one finished). None when no
  speculative arm ran or vanilla's step cost is unknown at every bucket where one did."""
  total, known = 0.0, False
  for bucket, per_bucket in arms.items():
    for name, tally in per_bucket.items():
      if name == "vanilla" or not tally.steps or not tally.row_steps:
        continue
      step_s = vanilla_step_s(int(bucket))
      if step_s is None:
        continue
      total += tally.critical_tokens * step_s - tally.seconds
      known = True
  return total if known else None


def tail_seconds(segments) -> float:
  """Decode seconds spent in segments where fewer than half of the first segment's rows were
  live (the rollout's long tail); ``segments``: ``RolloutStats.segments`` of one engine's
  rollout."""
  return _seconds_while(segments, lambda bucket, first: bucket < first / 2)


def last_seconds(segments) -> float:
  """Decode seconds spent in segments with at most an eighth of the first segment's rows live:
  the time the rollout's last rows took (the batch buckets halve, so an eighth is where a bucket
  boundary falls; of 64 rows, the last 8)."""
  return _seconds_while(segments, lambda bucket, first: 8 * bucket <= first)


def _seconds_while(segments, live) -> float:
  """The seconds of the segments whose batch bucket ``live(bucket, first segment's bucket)``."""
  if not segments:
    return 0.0
  first = segments[0][0]
  return float(sum(seconds for bucket, _, seconds, *_ in segments if live(bucket, first)))


# ---- metrics and console lines ----------------------------------------------------------------
def _metric_name(arm: str) -> str:
  """An arm's name as a metric key part: ``"chain d4"`` -> ``"chain_d4"``."""
  return arm.replace(" ", "_")


def rollout_metrics(stats: RolloutStats,
                    offered: dict[int, list[str]] | None = None) -> dict[str, float]:
  """Scalar metrics of a rollout's ``RolloutResult.stats``: its segments and the seconds of its
  prefill, decode segments and compactions (with cache growth), speculative-decoding switches (every
  change of arm between segments) and the catch-up seconds, the mean accepted length (with SD)
  and, where ``offered`` (bucket -> arm names; the adaptive engine's) gives a choice, each arm's
  share of all the rollout's decode steps (``arm_share/<arm>``, with ``decode_steps``) and, per
  such batch bucket, its share of the bucket's decode steps (``arm_steps/<bucket>/<arm>``) and
  tokens per second (``arm_tps/...``)."""
  out = {"sd_switches": int(stats.switches), "sd_switch_s": float(stats.switch_s),
         # where a rollout's time goes: its segments (each ends at a host read, a boundary) and
         # the device's parts; the rest of ``rollout_s`` is the host's
         "segments": len(stats.segments), "prefill_s": float(stats.prefill_s),
         "decode_s": float(stats.decode_s), "compact_s": float(stats.compact_s + stats.grow_s)}
  if stats.mean_accept_len is not None:
    out["mean_accept_len"] = float(stats.mean_accept_len)
  for source, length in stats.accept_by_source().items():  # which drafts paid, and how much
    out[f"accept_len/{source}"] = float(length)
    out[f"accept_share/{source}"] = stats.source_steps[source] / sum(stats.source_steps.values())
  if stats.sd_saved_s is not None:
    out["sd_saved_s"] = float(stats.sd_saved_s)
  for p, proc in enumerate(stats.processes or []):  # several processes: each one's own rows,
    out[f"process_rollout_s/{p}"] = float(proc["rollout_s"])  # and what it idled waiting
    out[f"process_idle_s/{p}"] = float(max(q["rollout_s"] for q in stats.processes) -
                                       proc["rollout_s"])
  if stats.processes:  # this process's wait for the others' rows plus the exchange itself
    out["rollout_exchange_s"] = float(max(q["wait_s"] for q in stats.processes))
  steps_of = stats.arm_totals("steps")  # arm -> decode steps, all buckets together
  shared = dict.fromkeys(n for ns in (offered or {}).values() if len(ns) > 1 for n in ns)
  total = sum(steps_of.values())
  if shared and total:  # no choice anywhere (vanilla, or one fixed strategy): nothing to share
    shared.update(dict.fromkeys(steps_of))  # e.g. vanilla in a bucket too big for SD
    for name in shared:
      out[f"arm_share/{_metric_name(name)}"] = steps_of.get(name, 0) / total
    out["decode_steps"] = int(total)
  for bucket, names in (offered or {}).items():
    ran = stats.arms.get(str(bucket), {})
    steps = sum(arm.steps for arm in ran.values())
    if len(names) < 2 or not steps:
      continue  # no choice there, or the bucket was not decoded in this rollout
    for name in names:
      arm = ran.get(name, ArmTally())
      key = f"{bucket}/{_metric_name(name)}"
      out[f"arm_steps/{key}"] = arm.steps / steps
      if arm.tokens_per_s is not None:
        out[f"arm_tps/{key}"] = float(arm.tokens_per_s)
  return out


def _shares(shares: dict[str, float]) -> str:
  """``{"vanilla": 0.8, "chain_d3": 0.2}`` -> ``"vanilla 80% chain_d3 20%"``."""
  return " ".join(f"{name} {100 * share:.0f}%" for name, share in shares.items())


def arm_line(metrics: dict) -> str:
  """The step's ``arm_share/*`` metrics for the console, e.g. ``"vanilla 80% chain_d3 20%"``
  (empty without them)."""
  prefix = "arm_share/"
  return _shares({k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)})


def run_sd_summary(history: list[dict]) -> str:
  """A run's speculative decoding in one line from its steps' metrics: each arm's share of the
  decode steps, the mean accepted length over the steps where SD ran, switches and catch-up
  seconds, and the online drafter's steps and held-out top-1 first -> last (empty when no step
  could speculate). Rows without ``sd_switches`` (e.g. evaluations) are not RL steps: skipped."""
  history = [m for m in history if "sd_switches" in m]
  steps: dict[str, float] = {}
  for m in history:
    weight = m.get("decode_steps", 1)
    for key, share in m.items():
      if key.startswith("arm_share/"):
        steps[key[len("arm_share/"):]] = steps.get(key[len("arm_share/"):], 0.0) + share * weight
  accept = [m["mean_accept_len"] for m in history if m.get("mean_accept_len") is not None]
  drafter = [m for m in history if m.get("drafter_top1") is not None or
             m.get("drafter_serial_steps") or m.get("drafter_spot_steps")]  # an online drafter
  if not steps and not accept and not drafter:
    return ""
  parts = []
  total = sum(steps.values())
  if total:
    parts.append(f"{_shares({k: v / total for k, v in steps.items()})} of decode steps")
  if accept:
    parts.append(f"mean accepted length {np.mean(accept):.2f} ({len(accept)} of "
                 f"{len(history)} steps with SD)")
  parts.append(f"{sum(m.get('sd_switches', 0) for m in history)} switches "
               f"({sum(m.get('sd_switch_s', 0.0) for m in history):.2f} s catch-up)")
  if drafter:
    top1 = [m["drafter_top1"] for m in drafter if m.get("drafter_top1") is not None]
    line = (f"drafter {sum(m.get('drafter_spot_steps', 0) for m in history)} spot + "
            f"{sum(m.get('drafter_serial_steps', 0) for m in history)} serial steps "
            f"({sum(m.get('drafter_serial_s', 0.0) for m in history):.2f} s serial)")
    if top1:
      line += f", held-out top-1 {top1[0]:.3f} -> {top1[-1]:.3f}"
    parts.append(line)
  return "SD: " + "; ".join(parts)


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
