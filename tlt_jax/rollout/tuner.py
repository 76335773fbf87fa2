"""Host-side strategy tuner: picks the decoding strategy (arm) for each decode segment.

The engine decodes in segments (a bounded number of steps at one batch-size bucket). At every
segment boundary it calls ``choose(bucket, arms)`` for the strategy of the next segment, and
afterwards ``update(bucket, arm, tokens, seconds)`` with what that segment achieved; the reward is
``tokens / seconds``, where the scheduler's ``seconds`` include the drafter catch-up that a switch
from vanilla ran before the segment. Nothing here touches JAX: the tuner is plain Python and numpy
on the host.

Grouping. The engine offers each batch-size bucket only the strategies whose verify width suits
it (bigger batches get narrower verify), so every bucket is its own group of arms with its own
independent statistics. Vanilla decoding is an arm in every bucket where SD may run, so wherever
speculative decoding does not pay on this hardware, model and batch size, the tuner converges to
vanilla instead of assuming a speedup.

Kinds (``TunerConfig.kind``):

* ``"beg_mab"`` (the TLT paper's Bucketed Epsilon-Greedy MAB). Per bucket, every offered arm that
  has no reward yet is pulled first, in the order offered. After that, with probability
  ``eps_n = max(epsilon_min, epsilon / sqrt(1 + n / n_arms))`` (``n`` = decisions made in the
  bucket so far; without ``decay`` just ``epsilon``) a uniformly random non-greedy arm explores;
  otherwise the greedy arm is exploited: the highest *median* of the arm's last ``window``
  rewards (ties go to the arm offered first). The median ignores the odd segment that was timed
  across a hiccup, and the window lets the choice follow a drifting workload (e.g. a drafter that
  gets better or worse as RL training moves the target).
* ``"ucb1"``. Per bucket, each arm is pulled once, then the arm maximizing
  ``mean + ucb_c * sqrt(2 ln N / n_i)`` is chosen, where ``mean`` is over the arm's window of
  rewards divided by the largest reward ever seen in the bucket (so it lies in [0, 1]), ``N`` is
  the bucket's total pulls and ``n_i`` the arm's total pulls. Deterministic.
* ``"fixed"``. A fixed bucket -> arm mapping (``TunerConfig.fixed``); rewards are only recorded.

A bucket offered a single arm gets it back without any randomness being consumed (and, for
``"fixed"``, without consulting the mapping). ``state_dict`` / ``load_state_dict`` round-trip
through JSON exactly, RNG included, so a restored tuner continues the same choice sequence.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import math
import operator
from typing import Any, Sequence

import numpy as np

from tlt_jax.utils import FieldError, require_positive_ints

KINDS = ("beg_mab", "ucb1", "fixed")
_SUMMARY_BEST = "best"  # the summary's per-bucket key for the best arm; no arm may use this name


@dataclasses.dataclass(frozen=True)
class Arm:
  """A decoding strategy the engine can run: its name and the tokens one target pass verifies."""

  name: str
  verify_width: int  # tokens per target pass (vanilla: 1)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"Arm.name must be a non-empty str, got {self.name!r}")
    if self.name == _SUMMARY_BEST:
      raise ValueError(f"Arm.name {self.name!r} is reserved (Tuner.summary uses it as a key); "
                       "rename the strategy")
    require_positive_ints(self, "verify_width")


@dataclasses.dataclass(frozen=True)
class TunerConfig:
  """How the engine picks a strategy per segment; see the module docstring for each ``kind``."""

  kind: str = "beg_mab"  # "beg_mab" | "ucb1" | "fixed"
  epsilon: float = 0.1  # exploration probability at the start (beg_mab)
  epsilon_min: float = 0.01  # floor of the decayed exploration probability
  decay: bool = True  # eps_n = max(epsilon_min, epsilon / sqrt(1 + n / n_arms))
  window: int = 16  # most recent rewards kept per (bucket, arm)
  ucb_c: float = 1.0  # UCB1 exploration constant
  fixed: tuple = ()  # kind="fixed": ((max_bucket, arm_name), ...), first max_bucket >= bucket wins
  seed: int = 0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise FieldError("TunerConfig", "kind", f"must be one of {', '.join(map(repr, KINDS))}, "
                       f"got {self.kind!r}")
    for name in ("epsilon", "epsilon_min", "ucb_c"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError("TunerConfig", name, f"must be a finite number, got {value!r}")
    if not 0 <= self.epsilon <= 1:
      raise FieldError("TunerConfig", "epsilon", f"must be in [0, 1], got {self.epsilon!r}")
    if not 0 <= self.epsilon_min <= self.epsilon:
      raise FieldError("TunerConfig", "epsilon_min", f"must be in [0, epsilon={self.epsilon!r}], "
                       f"got {self.epsilon_min!r}; lower epsilon_min or raise epsilon")
    if not isinstance(self.decay, bool):
      raise FieldError("TunerConfig", "decay", f"must be a bool, got {self.decay!r}")
    require_positive_ints(self, "window")
    if self.ucb_c < 0:
      raise FieldError("TunerConfig", "ucb_c", f"must be >= 0, got {self.ucb_c!r}")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
      raise FieldError("TunerConfig", "seed", f"must be an int >= 0, got {self.seed!r}")
    object.__setattr__(self, "fixed", _normalize_fixed(self.fixed))
    if self.kind == "fixed" and not self.fixed:
      raise FieldError("TunerConfig", "fixed", "is empty but kind='fixed' needs a mapping: give "
                       "((max_bucket, arm_name), ...), e.g. ((32, 'chain d4'), (256, 'vanilla'))")


def _normalize_fixed(fixed) -> tuple:
  """``fixed`` as a tuple of ``(int, str)`` pairs (a JSON/ml_collections list of lists is fine)."""
  if isinstance(fixed, (str, bytes)) or not isinstance(fixed, collections.abc.Iterable):
    raise FieldError("TunerConfig", "fixed", f"must be a sequence of (max_bucket, arm_name) pairs, "
                     f"got {fixed!r}")
  out = []
  for entry in fixed:
    bad = FieldError("TunerConfig", "fixed", f"entries must be (max_bucket: int >= 1, arm_name: "
                     f"non-empty str) pairs, got {entry!r}")
    if isinstance(entry, (str, bytes)) or not isinstance(entry, collections.abc.Sequence):
      raise bad
    if len(entry) != 2:
      raise bad
    max_bucket, name = entry
    if isinstance(max_bucket, bool) or not isinstance(max_bucket, (int, np.integer)):
      raise bad
    if max_bucket < 1 or not isinstance(name, str) or not name:
      raise bad
    out.append((int(max_bucket), name))
  bounds = [b for b, _ in out]
  if len(set(bounds)) != len(bounds):
    raise FieldError("TunerConfig", "fixed", f"has a repeated max_bucket in {tuple(out)!r}; give "
                     "each max_bucket once")
  return tuple(sorted(out))


class _ArmStats:
  """One (bucket, arm)'s record: total pulls and the window of its most recent rewards."""

  def __init__(self, window: int, pulls: int = 0, rewards: Sequence[float] = ()):
    self.pulls = pulls
    self.rewards = collections.deque((float(r) for r in rewards), maxlen=window)

  def median(self) -> float | None:
    """Median of the windowed rewards, ``None`` before the first reward."""
    return float(np.median(self.rewards)) if self.rewards else None


class _BucketStats:
  """One bucket's record: arms offered so far (in first-offered order), decisions, best reward."""

  def __init__(self):
    self.decisions = 0
    self.arms: dict[str, _ArmStats] = {}
    self.max_reward = 0.0


def _check_bucket(bucket) -> int:
  """``bucket`` as an int >= 1, or a ``ValueError`` saying what it was."""
  try:
    value = operator.index(bucket)
  except TypeError:
    value = None
  if value is None or isinstance(bucket, bool) or value < 1:
    raise ValueError(f"bucket must be a positive int (a batch-size bucket), got {bucket!r}")
  return value


class Tuner:
  """Base class: per-bucket statistics, validation and (de)serialization; subclasses pick arms."""

  def __init__(self, config: TunerConfig):
    self.config = config
    self._rng = np.random.default_rng(config.seed)
    self._buckets: dict[int, _BucketStats] = {}

  def choose(self, bucket: int, arms: Sequence[Arm]) -> str:
    """Returns the name of the arm (one of ``arms``) that should decode the next segment."""
    bucket, names, stats = self._register(bucket, arms)
    choice = names[0] if len(names) == 1 else self._decide(bucket, stats, names)
    stats.decisions += 1
    return choice

  def _register(self, bucket, arms: Sequence[Arm]) -> tuple[int, list[str], _BucketStats]:
    """Validates a ``choose`` call and makes sure the bucket has a record for every offered arm."""
    bucket = _check_bucket(bucket)
    arms = list(arms)
    if not arms:
      raise ValueError(f"Tuner.choose got no arms for bucket {bucket}; offer at least 'vanilla'")
    names = []
    for arm in arms:
      if not isinstance(arm, Arm):
        raise TypeError(f"Tuner.choose takes Arm objects, got {arm!r}")
      names.append(arm.name)
    if len(set(names)) != len(names):
      raise ValueError(f"Tuner.choose got repeated arm names for bucket {bucket}: {names}")
    stats = self._buckets.setdefault(bucket, _BucketStats())
    for name in names:
      if name not in stats.arms:
        stats.arms[name] = _ArmStats(self.config.window)
    return bucket, names, stats

  def _decide(self, bucket: int, stats: _BucketStats, names: list[str]) -> str:
    """Chooses among ``names`` (>= 2 arms): unpulled arms first, in order, then ``_pick``."""
    unpulled = [n for n in names if stats.arms[n].pulls == 0]
    return unpulled[0] if unpulled else self._pick(stats, names)

  def _pick(self, stats: _BucketStats, names: list[str]) -> str:
    """Chooses among ``names`` (>= 2 arms, every one pulled at least once)."""
    raise NotImplementedError

  def update(self, bucket: int, arm: str, tokens: int, seconds: float) -> None:
    """Records that ``arm`` produced ``tokens`` tokens in ``seconds`` seconds in ``bucket``."""
    bucket = _check_bucket(bucket)
    stats = self._buckets.get(bucket)
    if stats is None or arm not in stats.arms:
      offered = sorted(stats.arms) if stats is not None else []
      raise ValueError(f"Tuner.update: arm {arm!r} was never offered in bucket {bucket} (offered "
                       f"there: {offered}); call choose(bucket, arms) with it first")
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

  def _best_by_median(self, stats: _BucketStats, names: Sequence[str]) -> str | None:
    """The arm of ``names`` with the highest windowed median (first wins ties); ``None`` if none."""
    best, best_value = None, None
    for name in names:
      value = stats.arms[name].median()
      if value is not None and (best_value is None or value > best_value):
        best, best_value = name, value
    return best

  def state_dict(self) -> dict:
    """A JSON-serializable snapshot: kind, RNG state and every bucket's counts and windows."""
    buckets = {}
    for bucket, stats in self._buckets.items():
      buckets[str(bucket)] = {
          "decisions": stats.decisions,
          "max_reward": stats.max_reward,
          "arms": [[name, rec.pulls, list(rec.rewards)] for name, rec in stats.arms.items()],
      }
    return {"kind": self.config.kind, "rng": _jsonable(self._rng.bit_generator.state),
            "buckets": buckets}

  def load_state_dict(self, state: dict) -> None:
    """Restores a ``state_dict`` snapshot of the same kind, so the choice sequence continues."""
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind != self.config.kind:
      raise ValueError(f"Tuner.load_state_dict: the state was saved by a {kind!r} tuner but this "
                       f"tuner is {self.config.kind!r}; set TunerConfig.kind={kind!r} to resume it")
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    buckets = {}
    for key, saved in state["buckets"].items():
      stats = _BucketStats()
      stats.decisions = int(saved["decisions"])
      stats.max_reward = float(saved["max_reward"])
      for name, pulls, rewards in saved["arms"]:
        stats.arms[name] = _ArmStats(self.config.window, int(pulls), rewards)
      buckets[_check_bucket(int(key))] = stats
    self._rng, self._buckets = rng, buckets

  def summary(self) -> dict:
    """Per bucket: each arm's pulls and windowed median reward, and the best arm by that median."""
    out = {}
    for bucket in sorted(self._buckets):
      stats = self._buckets[bucket]
      entry: dict[str, Any] = {name: {"pulls": rec.pulls, "median_reward": rec.median()}
                               for name, rec in stats.arms.items()}
      entry[_SUMMARY_BEST] = self._best_by_median(stats, list(stats.arms))
      out[str(bucket)] = entry
    return out


def _jsonable(value):
  """``value`` with tuples turned into lists and numpy scalars into Python numbers."""
  if isinstance(value, dict):
    return {k: _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


class BegMab(Tuner):
  """Bucketed epsilon-greedy bandit on the median of a sliding window of rewards."""

  def _epsilon(self, decisions: int, n_arms: int) -> float:
    """Exploration probability after ``decisions`` decisions in a bucket offering ``n_arms``."""
    cfg = self.config
    if not cfg.decay:
      return cfg.epsilon
    return max(cfg.epsilon_min, cfg.epsilon / math.sqrt(1.0 + decisions / n_arms))

  def _pick(self, stats: _BucketStats, names: list[str]) -> str:
    """Explores a random non-greedy arm with probability eps_n, else exploits the best median."""
    greedy = self._best_by_median(stats, names)
    if self._rng.random() < self._epsilon(stats.decisions, len(names)):
      others = [n for n in names if n != greedy]
      return others[int(self._rng.integers(len(others)))]
    return greedy


class Ucb1(Tuner):
  """UCB1 on window means normalized by the bucket's largest reward; deterministic."""

  def _pick(self, stats: _BucketStats, names: list[str]) -> str:
    """The arm maximizing normalized window mean + ucb_c * sqrt(2 ln N / n_i)."""
    total = sum(stats.arms[n].pulls for n in names)
    scale = stats.max_reward if stats.max_reward > 0 else 1.0
    best, best_score = None, -math.inf
    for name in names:
      rec = stats.arms[name]
      mean = float(np.mean(rec.rewards)) / scale
      score = mean + self.config.ucb_c * math.sqrt(2.0 * math.log(total) / rec.pulls)
      if score > best_score:
        best, best_score = name, score
    return best


class FixedMapping(Tuner):
  """A fixed bucket -> arm mapping from ``TunerConfig.fixed``; rewards are only recorded."""

  def _decide(self, bucket: int, stats: _BucketStats, names: list[str]) -> str:
    """The arm mapped to ``bucket``; raises if the bucket is unmapped or that arm not offered."""
    return fixed_arm(self.config.fixed, bucket, names)


def fixed_arm(fixed: tuple, bucket: int, names: Sequence[str]) -> str:
  """The arm a ``TunerConfig.fixed`` mapping gives ``bucket`` among the offered ``names``;
  raises ``ValueError`` when the bucket is unmapped or the arm is not offered there."""
  target = next((name for max_bucket, name in fixed if bucket <= max_bucket), None)
  if target is None:
    raise FieldError("TunerConfig", "fixed", f"maps buckets up to {fixed[-1][0]} but the engine "
                     f"asks about bucket {bucket}; add an entry with max_bucket >= {bucket}")
  if target not in names:
    raise FieldError("TunerConfig", "fixed", f"maps bucket {bucket} to {target!r}, which is not "
                     f"offered there; offered arms: {list(names)}")
  return target


_KIND_TO_CLASS = {"beg_mab": BegMab, "ucb1": Ucb1, "fixed": FixedMapping}


def make_tuner(config: TunerConfig) -> Tuner:
  """Builds the tuner ``config.kind`` names."""
  if not isinstance(config, TunerConfig):
    raise TypeError(f"make_tuner takes a TunerConfig, got {type(config).__name__}")
  return _KIND_TO_CLASS[config.kind](config)
