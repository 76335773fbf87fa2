"""The cost tuner (``kind="cost"``, the default): chooses by predicted speed relative to vanilla.

Each arm's step cost relative to a vanilla step (calibrated once at ``precompile``, then from the
arms' own long segments) is set against its accepted length (counted, not timed, and pooled over
buckets and over the arms of one drafter, ``Arm.source``, through that drafter's per-token
acceptance). It probes an arm (a short segment of ``probe_steps`` steps) only while the arm could
beat the best one and has not been measured under the current version of its drafter, so
exploration is bounded in time: a useless drafter costs one probe in a whole run.
``observe_drafter(quality, source)`` re-opens the question when that drafter changes (the learned
drafter's weights, a suffix drafter's history), leaving the other drafters' as it was.
Deterministic (no RNG); a bucket settled on vanilla runs long segments (``Decision.max_steps =
0``).
"""

from __future__ import annotations

import collections
import statistics

from tlt_jax.rollout.host.tuner.base import (LONG_SEGMENT, BucketStats, Decision, Tuner, check_bucket,
                                        check_drafter)
from tlt_jax.rollout.decode.kinds import DrafterKind
from tlt_jax.rollout.host.tuner.config import TunerConfig


def accepted_length(alpha: float, depth: int, topk: int = 1) -> float:
  """Expected tokens one speculative step emits per live row when each drafted token is accepted
  with probability ``alpha`` independently: a level of ``topk`` candidates passes with
  ``1 - (1 - alpha) ** topk``, and ``depth`` levels plus the bonus token give
  ``1 + a + a^2 + ... + a^depth``."""
  a = 1.0 - (1.0 - min(max(alpha, 0.0), 1.0)) ** topk
  return float(depth + 1) if a >= 1.0 else (1.0 - a ** (depth + 1)) / (1.0 - a)


def acceptance_from_length(length: float, depth: int, topk: int = 1) -> float:
  """The per-token acceptance ``alpha`` that ``accepted_length`` maps to ``length`` (bisection;
  0 at or below 1 token, 1 at or above ``depth + 1``)."""
  if length <= 1.0:
    return 0.0
  if length >= depth + 1:
    return 1.0
  lo, hi = 0.0, 1.0
  for _ in range(40):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if accepted_length(mid, depth, topk) < length else (lo, mid)
  return (lo + hi) / 2


class _Drafter:
  """What the cost model knows of one drafter (one ``Arm.source``): the versions it has been
  through (``observe_drafter``), the held-out top-1 reported for each that has ended and the
  latest, and per arm of it the recent ``(alpha, version)`` of its segments."""

  def __init__(self, version: int = 0, quality: float | None = None,
               qualities: dict[int, float] | None = None,
               accept: dict[str, collections.deque] | None = None):
    self.version = version
    self.quality = quality
    self.qualities = {} if qualities is None else qualities
    self.accept = {} if accept is None else accept

  def state_dict(self) -> dict:
    return {"quality": self.quality, "version": self.version,
            "qualities": [[v, q] for v, q in self.qualities.items()],
            "accept": {a: [list(x) for x in w] for a, w in self.accept.items()}}

  @classmethod
  def from_state(cls, saved: dict, window: int) -> "_Drafter":
    quality = saved["quality"]
    return cls(int(saved["version"]), None if quality is None else float(quality),
               {int(v): float(q) for v, q in saved["qualities"]},
               {a: collections.deque(((float(x), int(v)) for x, v in w), maxlen=window)
                for a, w in saved["accept"].items()})


class CostModel(Tuner):
  """Chooses by predicted speed, ``accepted length / seconds per step``, per arm and bucket.

  Seconds per step: the calibration (``set_costs``), then the arm's own segments. Accepted lengths
  are counted on the rows the rollout waits for (``critical_length``), turned into the drafter's
  per-token acceptance and pooled over buckets and, for an arm never run, over its drafter's arms.
  An arm is probed only while unmeasured under its drafter's current version (``observe_drafter``)
  and able to beat the best, so a useless drafter costs one probe. Deterministic. Details:
  docs/library.md, "The cost tuner".
  """

  CLOSE = 0.85  # an arm predicted within this fraction of the best one's speed is measured
  # once at the bucket and keeps segments bounded

  def __init__(self, config: TunerConfig):
    super().__init__(config)
    self._drafters: dict[str, _Drafter] = {}  # by Arm.source: what each drafter measured
    self._speeds: dict[int, dict] = {}  # speeds() per bucket until something changes them

  # what changes predictions: every other entry point clears the cache of speeds
  def _register(self, bucket, arms):
    # a new arm, or one offered again with another drafter (source) or shape
    known = dict(self._meta), sum(len(b.arms) for b in self._buckets.values())
    out = super()._register(bucket, arms)
    if (self._meta, sum(len(b.arms) for b in self._buckets.values())) != known:
      self._speeds.clear()
    return out

  def update(self, *args, **kwargs) -> None:
    self._speeds.clear()
    super().update(*args, **kwargs)

  def set_costs(self, step_seconds: dict, overhead_s: float = 0.0) -> None:
    self._speeds.clear()
    super().set_costs(step_seconds, overhead_s)

  # ---- what it is told -------------------------------------------------------------------
  def observe_drafter(self, quality: float | None = None, source: str = DrafterKind.LEARNED,
                      forget: bool = False) -> None:
    check_drafter("CostModel", quality, source)
    self._speeds.clear()
    drafter = self._drafters.setdefault(source, _Drafter())
    if forget:
      drafter.accept.clear()
    if quality is not None:  # it describes what drafted since the last call
      drafter.quality = drafter.qualities[drafter.version] = float(quality)
    drafter.version += 1
    used = {v for window in drafter.accept.values() for _, v in window}
    drafter.qualities = {v: q for v, q in drafter.qualities.items() if v in used}

  def _learn(self, arm: str, length: float) -> None:
    meta = self._meta[arm]
    if meta.speculative:
      alpha = acceptance_from_length(length, meta.depth, meta.topk)
      drafter = self._drafters.setdefault(meta.source, _Drafter())
      window = drafter.accept.setdefault(arm, collections.deque(maxlen=self.config.window))
      window.append((alpha, drafter.version))

  # ---- predictions -------------------------------------------------------------------------
  def alpha(self, arm: str | None = None, source: str = DrafterKind.LEARNED) -> float | None:
    """The per-token acceptance of ``arm``'s drafter as ``arm``'s segments measured it (an arm
    never run: pooled over the arms of its ``Arm.source``; ``arm`` None or never offered: over
    the arms of ``source``), each measurement shifted by how much that drafter's reported top-1
    moved since the version that made it; None before any measurement."""
    if arm in self._meta:
      source = self._meta[arm].source
    drafter = self._drafters.get(source)
    if drafter is None:
      return None
    if drafter.accept.get(arm):
      samples = drafter.accept[arm]
    else:
      samples = [x for window in drafter.accept.values() for x in window]
    if not samples:
      return None
    shifted = []
    for a, version in samples:
      then = drafter.qualities.get(version)
      shifted.append(a + (drafter.quality - then if then is not None else 0.0))
    return float(min(max(statistics.median(shifted), 0.0), 1.0))

  def _fresh(self, arm: str) -> bool:
    """Whether ``arm`` was measured under the current version of its drafter."""
    drafter = self._drafters.get(self._meta[arm].source)
    return drafter is not None and any(v == drafter.version for _, v in drafter.accept.get(arm, ()))

  def _length(self, arm: str, optimistic: bool) -> float | None:
    meta = self._meta[arm]
    if not meta.speculative:
      return 1.0
    alpha = self.alpha(arm)
    if alpha is None:
      return float(meta.depth + 1) if optimistic else None
    if optimistic:
      alpha = min(1.0, alpha + self.config.probe_margin)
    return accepted_length(alpha, meta.depth, meta.topk)

  def speeds(self, bucket: int) -> dict[str, dict[str, float | None]]:
    """Per arm offered at ``bucket``: its step's cost relative to vanilla's, its predicted
    accepted length, and its predicted and optimistic speed relative to vanilla's (vanilla: 1;
    None where unknown)."""
    bucket = check_bucket(bucket)
    stats = self._buckets.get(bucket)
    if stats is None:
      return {}
    if bucket in self._speeds:
      return self._speeds[bucket]
    vanilla = next((n for n in stats.arms if not self._meta[n].speculative), None)
    out = {}  # cached once whole (a half-built entry must never be read)
    for name in stats.arms:
      cost = 1.0 if name == vanilla else (None if vanilla is None else
                                          self.relative_cost(bucket, name, vanilla))
      length, best_case = self._length(name, False), self._length(name, True)
      out[name] = dict(
          relative_cost=cost, accepted=length,
          speed=None if cost is None or length is None else length / cost,
          # an arm whose cost nothing measured yet: as cheap as vanilla
          optimistic=best_case / (1.0 if cost is None else cost))
    self._speeds[bucket] = out
    return out

  # ---- the choice ----------------------------------------------------------------------------
  def _decide(self, bucket: int, stats: BucketStats, names: list[str]) -> Decision:
    speeds = {n: v for n, v in self.speeds(bucket).items() if n in names}
    known = [n for n in names if speeds[n]["speed"] is not None]
    if not known:  # no vanilla offered: its first arm, until the others compare to it
      return Decision(names[0])
    greedy = max(known, key=lambda n: speeds[n]["speed"])  # ties: the arm offered first
    best = speeds[greedy]["speed"]
    probes = [n for n in names if n != greedy and self._meta[n].speculative
              and not self._fresh(n) and speeds[n]["optimistic"] is not None
              and speeds[n]["optimistic"] > best]
    if probes:
      return Decision(max(probes, key=lambda n: speeds[n]["optimistic"]),
                      self.config.probe_steps, probe=True)
    # an arm predicted within reach whose cost here only the calibration knows: one segment long
    # enough to measure it (the calibration times dummy rows at the shortest cache length)
    judged = {n: v["speed"] if v["speed"] is not None else v["optimistic"]
              for n, v in speeds.items()}  # an arm never measured: at its best case
    close = [n for n in names if n != greedy and judged[n] >= self.CLOSE * best]
    unmeasured = [n for n in close if self._meta[n].speculative
                  and stats.arms[n].step_cost(True) is None]
    if unmeasured:  # (its acceptance first, in a short probe, if the drafter is new to it)
      choice = max(unmeasured, key=lambda n: judged[n])
      return Decision(choice, LONG_SEGMENT if self._fresh(choice) else self.config.probe_steps,
                      probe=True)
    settled = not self._meta[greedy].speculative and not close
    return Decision(greedy, 0 if settled else None)  # settled: to the bucket's boundary

  def _summary_best(self, bucket: int, stats: BucketStats) -> str | None:
    speeds = self.speeds(bucket)
    known = [n for n in stats.arms if speeds[n]["speed"] is not None]
    return max(known, key=lambda n: speeds[n]["speed"]) if known else None

  # ---- state --------------------------------------------------------------------------------
  def state_dict(self) -> dict:
    state = super().state_dict()
    state["cost_model"] = {"drafters": {s: d.state_dict() for s, d in self._drafters.items()}}
    return state

  def load_state_dict(self, state: dict) -> None:
    self._speeds.clear()
    super().load_state_dict(state)
    saved = state["cost_model"]["drafters"]
    self._drafters = {str(s): _Drafter.from_state(d, self.config.window) for s, d in saved.items()}

