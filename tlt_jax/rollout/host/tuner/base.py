"""The tuners' common ground: what an arm and a decision are, and ``Tuner``, the base class that
keeps per-bucket statistics, checks every call and (de)serializes what was learned.

The engine decodes in segments (a bounded number of steps at one batch-size bucket). At every
segment boundary it calls ``plan(bucket, arms)`` for the strategy of the next segment and how many
steps it may run, and afterwards ``update(bucket, arm, tokens, seconds, steps=..., row_steps=...,
switch_s=...)`` with what that segment achieved; the reward is ``tokens / seconds``, where the
scheduler's ``seconds`` include the drafter catch-up that a switch from vanilla ran before the
segment (``switch_s`` of them). Nothing here touches JAX: the tuner is plain Python and numpy on
the host.

Grouping. The engine offers each batch-size bucket only the strategies whose verify width suits
it (bigger batches get narrower verify), so every bucket is its own group of arms with its own
independent statistics. A bucket offered a single arm gets it back at once (no randomness
consumed, no mapping consulted). How a bucket with a choice decides is the kind's
(``_decide``): ``bandits.py`` (BEG-MAB, UCB1, fixed) and ``cost.py`` (the cost model).

State. ``state_dict`` is JSON; ``load_state_dict`` reads the layout of ``STATE_VERSION`` alone
and refuses any other, naming the version it found.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
import operator
import statistics
import threading
from typing import Any, Sequence

import numpy as np

from tlt_jax.rollout.decode.kinds import DrafterKind
from tlt_jax.rollout.host.tuner.config import TunerConfig
from tlt_jax.utils import require_positive_ints

_SUMMARY_BEST = "best"  # the summary's per-bucket key for the best arm; no arm may use this name

# The layout of a saved tuner state that load_state_dict reads, and what the older ones lacked.
# From version 4 on the state says its version (``"version"``); older ones are told by shape.
STATE_VERSION = 4
_OLD_LAYOUTS = {
    1: "its arms carry no step costs (saved before the cost tuner)",
    2: "its arms carry no drafter source (saved before drafters had sources)",
    3: "its arms carry the tokens a target pass verifies, which nothing read",
}


@dataclasses.dataclass(frozen=True)
class Arm:
  """A decoding strategy the engine can run: its name, its draft shape and which drafter drafts
  for it (``source``: arms of one source share what is learned of its acceptance; drafters of
  different sources are judged apart)."""

  name: str
  depth: int = 0  # draft levels (vanilla: 0); the cost model's acceptance prediction uses it
  topk: int = 1  # children per draft node (chains: 1)
  source: str = DrafterKind.LEARNED  # the drafter that drafts for it (vanilla: any)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"Arm.name must be a non-empty str, got {self.name!r}")
    if self.name == _SUMMARY_BEST:
      raise ValueError(f"Arm.name {self.name!r} is reserved (Tuner.summary uses it as a key); "
                       "rename the strategy")
    require_positive_ints(self, "topk")
    if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 0:
      raise ValueError(f"Arm.depth must be an int >= 0, got {self.depth!r}")
    if not isinstance(self.source, str) or not self.source:
      raise ValueError(f"Arm.source must be a non-empty str naming the drafter (e.g. 'learned', "
                       f"'suffix'), got {self.source!r}")

  @property
  def speculative(self) -> bool:
    return self.depth > 0


@dataclasses.dataclass(frozen=True)
class Decision:
  """What ``Tuner.plan`` tells the scheduler: the arm of the next segment and how many steps the
  segment may run (None: ``EngineConfig.segment_steps``; 0: no limit, to the bucket's boundary)."""

  arm: str
  max_steps: int | None = None
  probe: bool = False  # a short segment that measures an arm the tuner is unsure of



LONG_SEGMENT = 8  # decode steps from which a segment's seconds per step are trusted as a cost


class _ArmStats:
  """One (bucket, arm)'s record: total pulls, the window of its most recent rewards and (where
  the scheduler reports steps) of its measured ``(seconds per decode step, steps)``."""

  def __init__(self, window: int, pulls: int = 0, rewards: Sequence[float] = (),
               step_s: Sequence = ()):
    self.pulls = pulls
    self.rewards = collections.deque((float(r) for r in rewards), maxlen=window)
    self.step_s = collections.deque(((float(x), int(n)) for x, n in step_s), maxlen=window)

  def step_cost(self, long_only: bool) -> float | None:
    """Median seconds per step over the window's segments (of >= ``LONG_SEGMENT`` steps only,
    with ``long_only``: short ones are dominated by the boundary); None without any."""
    values = [x for x, n in self.step_s if n >= LONG_SEGMENT or not long_only]
    return float(statistics.median(values)) if values else None

  def median(self) -> float | None:
    """Median of the windowed rewards, ``None`` before the first reward."""
    return float(statistics.median(self.rewards)) if self.rewards else None


class BucketStats:
  """One bucket's record: arms offered so far (in first-offered order), decisions, best reward."""

  def __init__(self):
    self.decisions = 0
    self.arms: dict[str, _ArmStats] = {}
    self.max_reward = 0.0


def check_bucket(bucket) -> int:
  """``bucket`` as an int >= 1, or a ``ValueError`` saying what it was."""
  try:
    value = operator.index(bucket)
  except TypeError:
    value = None
  if value is None or isinstance(bucket, bool) or value < 1:
    raise ValueError(f"bucket must be a positive int (a batch-size bucket), got {bucket!r}")
  return value



def locked(method):
  """``method`` of a tuner, run under the tuner's ``lock`` (``Tuner``: every public method)."""
  @functools.wraps(method)
  def run(self, *args, **kwargs):
    with self.lock:
      return method(self, *args, **kwargs)
  run.locked = True
  return run


def lock_public_methods(cls: type) -> None:
  """Every public method defined in ``cls``'s body runs under the tuner's lock."""
  for name, value in list(vars(cls).items()):
    if not name.startswith("_") and inspect.isfunction(value):
      setattr(cls, name, locked(value))


class Tuner:
  """Base class: per-bucket statistics, validation and (de)serialization; a kind decides
  (``_decide``) and names a bucket's best arm (``_summary_best``).

  A tuner may be shared by the engines of several threads (``DataParallelRollout``): every public
  method, of this class and of every kind, runs under ``lock`` (a re-entrant lock; hold it
  across several calls to run them as one). Reads take it as writes do: ``summary`` and the
  cost kind's ``speeds`` read what ``plan`` and ``update`` write (a read beside another thread's
  write once found a bucket's predictions half built)."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    lock_public_methods(cls)

  def __init__(self, config: TunerConfig):
    self.config = config
    self.lock = threading.RLock()
    self._buckets: dict[int, BucketStats] = {}
    self._meta: dict[str, Arm] = {}  # every arm offered so far, by name
    self._costs: dict[tuple[int, str], float] = {}  # calibrated seconds per step
    self._overhead = 0.0  # calibrated seconds of one segment boundary

  def plan(self, bucket: int, arms: Sequence[Arm]) -> Decision:
    """The arm (one of ``arms``) that should decode the next segment, and how long it may run."""
    bucket, names, stats = self._register(bucket, arms)
    if len(names) == 1:  # nothing to choose or to learn: run to the bucket's boundary
      decision = Decision(names[0], max_steps=0)
    else:
      decision = self._decide(bucket, stats, names)
    stats.decisions += 1
    return decision

  def set_costs(self, step_seconds: dict, overhead_s: float = 0.0) -> None:
    """Measured seconds per decode step of each ``(bucket, arm name)`` and of one segment
    boundary (``RolloutEngine.calibrate``): ``step_cost``'s prior; the ``"cost"`` kind chooses
    by them."""
    for (bucket, arm), seconds in step_seconds.items():
      if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"Tuner.set_costs: seconds per step of {arm!r} at bucket {bucket} "
                         f"must be a finite number > 0, got {seconds!r}")
      self._costs[(check_bucket(bucket), str(arm))] = float(seconds)
    if not overhead_s >= 0 or not math.isfinite(overhead_s):
      raise ValueError(f"Tuner.set_costs: overhead_s must be a finite number >= 0, got "
                       f"{overhead_s!r}")
    self._overhead = float(overhead_s)

  def step_cost(self, bucket: int, arm: str) -> float | None:
    """Seconds per decode step of ``arm`` at ``bucket``: the median of its long segments'
    (boundary taken off), else the calibrated cost, else the median of any of its segments',
    else None."""
    record = self._record(bucket, arm)
    for value in (None if record is None else record.step_cost(True),
                  self._costs.get((bucket, arm)),
                  None if record is None else record.step_cost(False)):
      if value is not None:
        return value
    return None

  def relative_cost(self, bucket: int, arm: str, vanilla: str = "vanilla") -> float | None:
    """Seconds of a step of ``arm`` per second of a ``vanilla`` step at ``bucket``: both arms'
    long segments, else ``arm``'s long segments against vanilla's calibrated step (a real
    segment is rarely faster than the calibration's best, so this errs against ``arm`` until
    vanilla runs long there too), else both calibrated costs (timed together), else any
    segments of both; None when nothing compares them."""
    mine, theirs = self._record(bucket, arm), self._record(bucket, vanilla)
    mine_long = None if mine is None else mine.step_cost(True)
    pairs = [(mine_long, None if theirs is None else theirs.step_cost(True)),
             (mine_long, self._costs.get((bucket, vanilla))),
             (self._costs.get((bucket, arm)), self._costs.get((bucket, vanilla))),
             (None if mine is None else mine.step_cost(False),
              None if theirs is None else theirs.step_cost(False))]
    for a, b in pairs:
      if a is not None and b is not None:
        return a / b
    return None

  def _record(self, bucket: int, arm: str) -> _ArmStats | None:
    stats = self._buckets.get(bucket)
    return None if stats is None else stats.arms.get(arm)

  def observe_drafter(self, quality: float | None = None, source: str = DrafterKind.LEARNED,
                      forget: bool = False) -> None:
    """The drafter of ``source`` changed (the learned one's weights after online training, a
    suffix drafter's history grew); ``quality`` is the held-out top-1 agreement of what drafted
    until now, where known; ``forget``: what its arms measured so far says nothing of it any
    more (a suffix drafter that now has history to draft from), so they are probed afresh. Only
    the ``"cost"`` kind uses it."""
    check_drafter(type(self).__name__, quality, source)

  def _register(self, bucket, arms: Sequence[Arm]) -> tuple[int, list[str], BucketStats]:
    """Validates a ``plan`` call and makes sure the bucket has a record for every offered arm."""
    bucket = check_bucket(bucket)
    arms = list(arms)
    if not arms:
      raise ValueError(f"Tuner.plan got no arms for bucket {bucket}; offer at least 'vanilla'")
    names = []
    for arm in arms:
      if not isinstance(arm, Arm):
        raise TypeError(f"Tuner.plan takes Arm objects, got {arm!r}")
      names.append(arm.name)
    if len(set(names)) != len(names):
      raise ValueError(f"Tuner.plan got repeated arm names for bucket {bucket}: {names}")
    stats = self._buckets.setdefault(bucket, BucketStats())
    for arm in arms:
      if arm.name not in stats.arms:
        stats.arms[arm.name] = _ArmStats(self.config.window)
      self._meta[arm.name] = arm
    return bucket, names, stats

  def _decide(self, bucket: int, stats: BucketStats, names: list[str]) -> Decision:
    """Chooses among ``names`` (>= 2 arms offered at ``bucket``), and how long its segment runs."""
    raise NotImplementedError

  def update(self, bucket: int, arm: str, tokens: int, seconds: float, *,
             steps: int | None = None, row_steps: int | None = None,
             switch_s: float = 0.0, critical_length: float | None = None) -> None:
    """Records that ``arm`` produced ``tokens`` tokens in ``seconds`` seconds in ``bucket``.

    The scheduler also says how many decode ``steps`` the segment ran, the live rows summed over
    them (``row_steps``: a vanilla step emits one token per live row, so ``tokens / row_steps``
    is a speculative arm's mean accepted length), the part of ``seconds`` that was the switch's
    drafter catch-up (``switch_s``) and ``critical_length``: the tokens per step emitted by the
    rows that decide when the rollout ends (those still live at the segment's end; see
    ``scheduler.critical_length``). The ``"cost"`` kind learns acceptance from
    ``critical_length`` where given, else from the mean row."""
    bucket = check_bucket(bucket)
    stats = self._buckets.get(bucket)
    if stats is None or arm not in stats.arms:
      offered = sorted(stats.arms) if stats is not None else []
      raise ValueError(f"Tuner.update: arm {arm!r} was never offered in bucket {bucket} (offered "
                       f"there: {offered}); call plan(bucket, arms) with it first")
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float, np.number)):
      raise ValueError(f"Tuner.update: tokens must be a number >= 0, got {tokens!r}")
    if not tokens >= 0 or not math.isfinite(tokens):
      raise ValueError(f"Tuner.update: tokens must be a finite number >= 0, got {tokens!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.number)):
      raise ValueError(f"Tuner.update: seconds must be a number > 0, got {seconds!r}")
    if not seconds > 0 or not math.isfinite(seconds):
      raise ValueError(f"Tuner.update: seconds must be a finite number > 0, got {seconds!r}")
    reward = float(tokens) / float(seconds)
    if not math.isfinite(reward):
      raise ValueError(f"Tuner.update: reward tokens / seconds = {tokens!r} / {seconds!r} is not "
                       "finite; is seconds in seconds?")
    record = stats.arms[arm]
    record.pulls += 1
    record.rewards.append(reward)
    stats.max_reward = max(stats.max_reward, reward)
    if steps:
      decoding = float(seconds) - float(switch_s)
      record.step_s.append((max(decoding - self._overhead, 0.5 * decoding) / int(steps),
                            int(steps)))
      if critical_length is not None and (isinstance(critical_length, bool) or
                                          not critical_length >= 0 or
                                          not math.isfinite(critical_length)):
        raise ValueError(f"Tuner.update: critical_length must be a finite number >= 0 (tokens "
                         f"per step) or None, got {critical_length!r}")
      if row_steps:
        length = float(tokens) / int(row_steps) if critical_length is None \
            else float(critical_length)
        self._learn(arm, length)

  def _learn(self, arm: str, length: float) -> None:
    """What a segment's accepted length (tokens per row per step) taught (the ``"cost"``
    kind)."""

  def state_dict(self) -> dict:
    """A JSON-serializable snapshot: kind, every bucket's counts and windows, the arms offered
    and the calibrated step costs (a kind adds what it keeps of its own)."""
    buckets = {}
    for bucket, stats in self._buckets.items():
      buckets[str(bucket)] = {
          "decisions": stats.decisions,
          "max_reward": stats.max_reward,
          "arms": [[name, rec.pulls, list(rec.rewards), [list(x) for x in rec.step_s]]
                   for name, rec in stats.arms.items()],
      }
    return {"version": STATE_VERSION, "kind": self.config.kind, "buckets": buckets,
            "meta": [[a.name, a.depth, a.topk, a.source]
                     for a in self._meta.values()],
            "costs": [[b, a, c] for (b, a), c in self._costs.items()], "overhead": self._overhead}

  def load_state_dict(self, state: dict) -> None:
    """Restores a ``state_dict`` snapshot of the same kind and layout, so the choice sequence
    continues; a state of another kind or of an older layout is refused, naming what it is."""
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind != self.config.kind:
      raise ValueError(f"Tuner.load_state_dict: the state was saved by a {kind!r} tuner but this "
                       f"tuner is {self.config.kind!r}; set TunerConfig.kind={kind!r} to resume it")
    check_state_version(state)
    buckets = {}
    for key, saved in state["buckets"].items():
      stats = BucketStats()
      stats.decisions = int(saved["decisions"])
      stats.max_reward = float(saved["max_reward"])
      for name, pulls, rewards, step_s in saved["arms"]:
        stats.arms[name] = _ArmStats(self.config.window, int(pulls), rewards, step_s)
      buckets[check_bucket(int(key))] = stats
    meta = {name: Arm(name, int(depth), int(topk), source)
            for name, depth, topk, source in state["meta"]}
    self._buckets, self._meta = buckets, meta
    self._costs = {(int(b), str(a)): float(c) for b, a, c in state["costs"]}
    self._overhead = float(state["overhead"])

  def summary(self) -> dict:
    """Per bucket: each arm's pulls and windowed median reward, and the best arm by that median."""
    out = {}
    for bucket in sorted(self._buckets):
      stats = self._buckets[bucket]
      entry: dict[str, Any] = {name: {"pulls": rec.pulls, "median_reward": rec.median()}
                               for name, rec in stats.arms.items()}
      entry[_SUMMARY_BEST] = self._summary_best(bucket, stats)
      out[str(bucket)] = entry
    return out

  def _summary_best(self, bucket: int, stats: BucketStats) -> str | None:
    """The arm ``summary`` calls the bucket's best."""
    raise NotImplementedError


lock_public_methods(Tuner)


def check_drafter(owner: str, quality, source) -> None:
  """Raises ``ValueError`` unless ``observe_drafter``'s ``quality`` is None or a top-1 in [0, 1]
  and ``source`` names a drafter."""
  if quality is not None and (isinstance(quality, bool) or
                              not isinstance(quality, (int, float, np.number)) or
                              not math.isfinite(quality) or not 0 <= quality <= 1):
    raise ValueError(f"{owner}.observe_drafter: quality must be in [0, 1] (a top-1 agreement) or "
                     f"None, got {quality!r}")
  if not isinstance(source, str) or not source:
    raise ValueError(f"{owner}.observe_drafter: source must be a non-empty str naming the drafter "
                     f"that changed (an Arm.source such as 'learned' or 'suffix'), got {source!r}")


def state_version(state: dict) -> int:
  """The layout version of a saved tuner state: its ``"version"`` (4 on), else read from its
  shape: 1 without step costs, 2 without drafter sources, 3 otherwise."""
  if "version" in state:
    return state["version"]
  arms = [arm for saved in state.get("buckets", {}).values() for arm in saved.get("arms", [])]
  if "costs" not in state or any(len(arm) < 4 for arm in arms):
    return 1
  cost_model = state.get("cost_model", {"drafters": {}})
  if "meta" not in state or any(len(m) < 5 for m in state["meta"]) or "drafters" not in cost_model:
    return 2
  return 3


def check_state_version(state: dict) -> None:
  """Raises ``ValueError`` naming the version found and the one read, unless ``state`` has the
  layout of ``STATE_VERSION``."""
  found = state_version(state)
  if found != STATE_VERSION:
    what = _OLD_LAYOUTS.get(found, "a layout this tlt_jax does not know")
    raise ValueError(f"Tuner.load_state_dict: the saved tuner state has layout version {found!r} "
                     f"({what}), but this tlt_jax reads version {STATE_VERSION} "
                     "only; resume with the tlt_jax that saved it, or leave the saved state out "
                     "so that the tuner starts afresh")
