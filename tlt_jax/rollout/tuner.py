"""Host-side strategy tuner: picks the decoding strategy (arm) for each decode segment.

The engine decodes in segments (a bounded number of steps at one batch-size bucket). At every
segment boundary it calls ``plan(bucket, arms)`` for the strategy of the next segment and how many
steps it may run (``choose`` gives the arm alone), and afterwards ``update(bucket, arm, tokens,
seconds, steps=..., row_steps=..., switch_s=...)`` with what that segment achieved; the reward is
``tokens / seconds``, where the scheduler's ``seconds`` include the drafter catch-up that a switch
from vanilla ran before the segment (``switch_s`` of them). Nothing here touches JAX: the tuner is plain Python and numpy
on the host.

Grouping. The engine offers each batch-size bucket only the strategies whose verify width suits
it (bigger batches get narrower verify), so every bucket is its own group of arms with its own
independent statistics. Vanilla decoding is an arm in every bucket where SD may run, so wherever
speculative decoding does not pay on this hardware, model and batch size, the tuner converges to
vanilla instead of assuming a speedup.

Kinds (``TunerConfig.kind``):

* ``"cost"`` (the default; ``CostModel``). Chooses by predicted speed relative to vanilla: each
  arm's step cost relative to a vanilla step (calibrated once at ``precompile``, then from the
  arms' own long segments) against its accepted length (counted, not timed, and pooled over
  buckets and over the arms of one drafter, ``Arm.source``, through that drafter's per-token
  acceptance). It probes an arm (a short segment of ``probe_steps`` steps) only while the arm
  could beat the best one and has not been measured under the current version of its drafter,
  so exploration is bounded in time: a useless drafter costs one probe in a whole run.
  ``observe_drafter(quality, source)`` re-opens the question when that drafter changes (the
  learned drafter's weights, a suffix drafter's history), leaving the other drafters' as it was.
  Deterministic; a bucket settled on vanilla runs long segments (``Decision.max_steps = 0``).
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
import statistics
from typing import Any, Sequence

import numpy as np

from tlt_jax.utils import FieldError, require_positive_ints

KINDS = ("cost", "beg_mab", "ucb1", "fixed")
_SUMMARY_BEST = "best"  # the summary's per-bucket key for the best arm; no arm may use this name


@dataclasses.dataclass(frozen=True)
class Arm:
  """A decoding strategy the engine can run: its name, the tokens one target pass verifies and
  which drafter drafts for it (``source``: arms of one source share what is learned of its
  acceptance; drafters of different sources are judged apart)."""

  name: str
  verify_width: int  # tokens per target pass (vanilla: 1)
  depth: int = 0  # draft levels (vanilla: 0); the cost model's acceptance prediction uses it
  topk: int = 1  # children per draft node (chains: 1)
  source: str = "learned"  # the drafter: "learned" (EAGLE), "ngram", "suffix", ... (vanilla: any)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"Arm.name must be a non-empty str, got {self.name!r}")
    if self.name == _SUMMARY_BEST:
      raise ValueError(f"Arm.name {self.name!r} is reserved (Tuner.summary uses it as a key); "
                       "rename the strategy")
    require_positive_ints(self, "verify_width", "topk")
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


@dataclasses.dataclass(frozen=True)
class TunerConfig:
  """How the engine picks a strategy per segment; see the module docstring for each ``kind``."""

  kind: str = "cost"  # "cost" | "beg_mab" | "ucb1" | "fixed"
  epsilon: float = 0.1  # exploration probability at the start (beg_mab)
  epsilon_min: float = 0.01  # floor of the decayed exploration probability
  decay: bool = True  # eps_n = max(epsilon_min, epsilon / sqrt(1 + n / n_arms))
  window: int = 16  # most recent rewards kept per (bucket, arm)
  ucb_c: float = 1.0  # UCB1 exploration constant
  fixed: tuple = ()  # kind="fixed": ((max_bucket, arm_name), ...), first max_bucket >= bucket wins
  seed: int = 0
  # kind="cost": a probe (a short segment of an arm the tuner is unsure of) runs this many steps
  probe_steps: int = 4
  # kind="cost": optimism added to the drafter's estimated per-token acceptance before an arm is
  # judged hopeless (an arm is probed only if it could beat the best arm with that much more)
  probe_margin: float = 0.1

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
    require_positive_ints(self, "window", "probe_steps")
    if isinstance(self.probe_margin, bool) or not isinstance(self.probe_margin, (int, float)) or \
        not 0 <= self.probe_margin <= 1:
      raise FieldError("TunerConfig", "probe_margin", f"must be a number in [0, 1], got "
                       f"{self.probe_margin!r}")
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
    self._meta: dict[str, Arm] = {}  # every arm offered so far, by name
    self._segment: tuple[int | None, bool] = (None, False)
    self._costs: dict[tuple[int, str], float] = {}  # calibrated seconds per step
    self._overhead = 0.0  # calibrated seconds of one segment boundary

  def choose(self, bucket: int, arms: Sequence[Arm]) -> str:
    """Returns the name of the arm (one of ``arms``) that should decode the next segment."""
    return self.plan(bucket, arms).arm

  def plan(self, bucket: int, arms: Sequence[Arm]) -> Decision:
    """The arm (one of ``arms``) that should decode the next segment, and how long it may run."""
    bucket, names, stats = self._register(bucket, arms)
    self._segment = (None, False)  # (max_steps, probe): what a kind's _decide may set
    if len(names) == 1:  # nothing to choose or to learn: run to the bucket's boundary
      choice, self._segment = names[0], (0, False)
    else:
      choice = self._decide(bucket, stats, names)
    stats.decisions += 1
    return Decision(choice, *self._segment)

  def set_costs(self, step_seconds: dict, overhead_s: float = 0.0) -> None:
    """Measured seconds per decode step of each ``(bucket, arm name)`` and of one segment
    boundary (``RolloutEngine.calibrate``): ``step_cost``'s prior; the ``"cost"`` kind chooses
    by them."""
    for (bucket, arm), seconds in step_seconds.items():
      if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"Tuner.set_costs: seconds per step of {arm!r} at bucket {bucket} "
                         f"must be a finite number > 0, got {seconds!r}")
      self._costs[(_check_bucket(bucket), str(arm))] = float(seconds)
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

  def observe_drafter(self, quality: float | None = None, source: str = "learned",
                      forget: bool = False) -> None:
    """The drafter of ``source`` changed (the learned one's weights after online training, a
    suffix drafter's history grew); ``quality`` is the held-out top-1 agreement of what drafted
    until now, where known; ``forget``: what its arms measured so far says nothing of it any
    more (a suffix drafter that now has history to draft from), so they are probed afresh. Only
    the ``"cost"`` kind uses it."""
    _check_drafter(type(self).__name__, quality, source)

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
    for arm in arms:
      if arm.name not in stats.arms:
        stats.arms[arm.name] = _ArmStats(self.config.window)
      self._meta[arm.name] = arm
    return bucket, names, stats

  def _decide(self, bucket: int, stats: _BucketStats, names: list[str]) -> str:
    """Chooses among ``names`` (>= 2 arms): unpulled arms first, in order, then ``_pick``."""
    unpulled = [n for n in names if stats.arms[n].pulls == 0]
    return unpulled[0] if unpulled else self._pick(stats, names)

  def _pick(self, stats: _BucketStats, names: list[str]) -> str:
    """Chooses among ``names`` (>= 2 arms, every one pulled at least once)."""
    raise NotImplementedError

  def update(self, bucket: int, arm: str, tokens: int, seconds: float, *,
             steps: int | None = None, row_steps: int | None = None,
             switch_s: float = 0.0) -> None:
    """Records that ``arm`` produced ``tokens`` tokens in ``seconds`` seconds in ``bucket``.

    The scheduler also says how many decode ``steps`` the segment ran, the live rows summed over
    them (``row_steps``: a vanilla step emits one token per live row, so ``tokens / row_steps``
    is a speculative arm's accepted length) and the part of ``seconds`` that was the switch's
    drafter catch-up (``switch_s``); the ``"cost"`` kind learns from them."""
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
    if steps:
      decoding = float(seconds) - float(switch_s)
      record.step_s.append((max(decoding - self._overhead, 0.5 * decoding) / int(steps),
                            int(steps)))
      if row_steps:
        self._learn(arm, int(tokens), int(row_steps))

  def _learn(self, arm: str, tokens: int, row_steps: int) -> None:
    """What a segment's accepted length taught (the ``"cost"`` kind)."""

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
          "arms": [[name, rec.pulls, list(rec.rewards), [list(x) for x in rec.step_s]]
                   for name, rec in stats.arms.items()],
      }
    return {"kind": self.config.kind, "rng": _jsonable(self._rng.bit_generator.state),
            "buckets": buckets,
            "meta": [[a.name, a.verify_width, a.depth, a.topk, a.source]
                     for a in self._meta.values()],
            "costs": [[b, a, c] for (b, a), c in self._costs.items()], "overhead": self._overhead}

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
      for name, pulls, rewards, *step_s in saved["arms"]:  # step_s: saved since issue 21
        stats.arms[name] = _ArmStats(self.config.window, int(pulls), rewards,
                                     step_s[0] if step_s else ())
      buckets[_check_bucket(int(key))] = stats
    meta = {}  # a state saved before arms had a source: every drafter was the learned one
    for name, width, depth, topk, *source in state.get("meta", []):
      meta[name] = Arm(name, int(width), int(depth), int(topk), *source)
    self._rng, self._buckets, self._meta = rng, buckets, meta
    self._costs = {(int(b), str(a)): float(c) for b, a, c in state.get("costs", [])}
    self._overhead = float(state.get("overhead", 0.0))

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

  def _summary_best(self, bucket: int, stats: _BucketStats) -> str | None:
    """The arm ``summary`` calls the bucket's best."""
    return self._best_by_median(stats, list(stats.arms))


def _check_drafter(owner: str, quality, source) -> None:
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
    quality = saved.get("quality")
    return cls(int(saved.get("version", 0)), None if quality is None else float(quality),
               {int(v): float(q) for v, q in saved.get("qualities", [])},
               {a: collections.deque(((float(x), int(v)) for x, v in w), maxlen=window)
                for a, w in saved.get("accept", {}).items()})


class CostModel(Tuner):
  """Chooses by predicted speed: measured seconds per step times counted accepted lengths.

  An arm's speed at bucket ``b`` is ``accepted length / seconds per step`` (vanilla: one token
  per live row per step). Seconds per step come from the engine's calibration (``set_costs``:
  every executable timed once at ``precompile``) and then from the arm's own segments at ``b``
  (the median of a window, the segment boundary's overhead taken off). Accepted lengths are
  counted, not timed: each speculative segment's ``tokens / row_steps`` gives the drafter's
  per-token acceptance ``alpha`` (``acceptance_from_length``), pooled over buckets (what one
  bucket learns, every bucket uses) and, for an arm never run, over the other arms of its
  drafter (``Arm.source``: a suffix drafter's acceptance says nothing of the learned drafter's);
  the prediction of an arm is ``accepted_length(alpha, depth, topk)``.

  Exploration is bounded in time. An arm is *probed* (a segment of ``probe_steps`` steps) only
  while it has no acceptance measured under the current drafter and its optimistic speed
  (``alpha + probe_margin``; an unknown drafter: every draft accepted) could beat the best arm.
  So a useless drafter costs one probe: its first measured acceptance makes every arm of it
  hopeless everywhere. ``observe_drafter(quality, source)`` starts a new version of the drafter
  ``source`` alone (each drafter counts its own versions): its arms become unmeasured again, and
  ``quality`` (the held-out top-1 of what drafted since the last call) shifts every older
  measurement of that drafter's arms by how much its top-1 moved since the measurement's
  version, so a drafter that improved is re-probed where it could now pay, and a hopeless one is
  not; the other drafters' measurements stay as they were. A bucket
  whose best arm is vanilla with no other arm within reach runs to its boundary in one segment
  (``Decision.max_steps = 0``). No randomness: the choice sequence is a function of what was
  measured.
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
  def observe_drafter(self, quality: float | None = None, source: str = "learned",
                      forget: bool = False) -> None:
    _check_drafter("CostModel", quality, source)
    self._speeds.clear()
    drafter = self._drafters.setdefault(source, _Drafter())
    if forget:
      drafter.accept.clear()
    if quality is not None:  # it describes what drafted since the last call
      drafter.quality = drafter.qualities[drafter.version] = float(quality)
    drafter.version += 1
    used = {v for window in drafter.accept.values() for _, v in window}
    drafter.qualities = {v: q for v, q in drafter.qualities.items() if v in used}

  def _learn(self, arm: str, tokens: int, row_steps: int) -> None:
    meta = self._meta[arm]
    if meta.speculative:
      alpha = acceptance_from_length(tokens / row_steps, meta.depth, meta.topk)
      drafter = self._drafters.setdefault(meta.source, _Drafter())
      window = drafter.accept.setdefault(arm, collections.deque(maxlen=self.config.window))
      window.append((alpha, drafter.version))

  # ---- predictions -------------------------------------------------------------------------
  def alpha(self, arm: str | None = None, source: str = "learned") -> float | None:
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
    bucket = _check_bucket(bucket)
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
  def _decide(self, bucket: int, stats: _BucketStats, names: list[str]) -> str:
    speeds = {n: v for n, v in self.speeds(bucket).items() if n in names}
    known = [n for n in names if speeds[n]["speed"] is not None]
    if not known:  # no vanilla offered: its first arm, until the others compare to it
      return names[0]
    greedy = max(known, key=lambda n: speeds[n]["speed"])  # ties: the arm offered first
    best = speeds[greedy]["speed"]
    probes = [n for n in names if n != greedy and self._meta[n].speculative
              and not self._fresh(n) and speeds[n]["optimistic"] is not None
              and speeds[n]["optimistic"] > best]
    if probes:
      self._segment = (self.config.probe_steps, True)
      return max(probes, key=lambda n: speeds[n]["optimistic"])
    # an arm predicted within reach whose cost here only the calibration knows: one segment long
    # enough to measure it (the calibration times dummy rows at the shortest cache length)
    judged = {n: v["speed"] if v["speed"] is not None else v["optimistic"]
              for n, v in speeds.items()}  # an arm never measured: at its best case
    close = [n for n in names if n != greedy and judged[n] >= self.CLOSE * best]
    unmeasured = [n for n in close if self._meta[n].speculative
                  and stats.arms[n].step_cost(True) is None]
    if unmeasured:  # (its acceptance first, in a short probe, if the drafter is new to it)
      choice = max(unmeasured, key=lambda n: judged[n])
      self._segment = (LONG_SEGMENT if self._fresh(choice) else self.config.probe_steps, True)
      return choice
    settled = not self._meta[greedy].speculative and not close
    self._segment = (0 if settled else None, False)
    return greedy

  def _summary_best(self, bucket: int, stats: _BucketStats) -> str | None:
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
    saved = state.get("cost_model", {})
    if "drafters" in saved:
      saved = saved["drafters"]
    else:  # saved before drafters had sources: one global version, that of the learned drafter
      saved = {"learned": saved} if saved else {}
    self._drafters = {str(s): _Drafter.from_state(d, self.config.window) for s, d in saved.items()}


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


_KIND_TO_CLASS = {"cost": CostModel, "beg_mab": BegMab, "ucb1": Ucb1, "fixed": FixedMapping}


def make_tuner(config: TunerConfig) -> Tuner:
  """Builds the tuner ``config.kind`` names."""
  if not isinstance(config, TunerConfig):
    raise TypeError(f"make_tuner takes a TunerConfig, got {type(config).__name__}")
  return _KIND_TO_CLASS[config.kind](config)
