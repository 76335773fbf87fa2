"""The bandit tuners: BEG-MAB (the TLT paper's), UCB1 and a fixed mapping. Each bucket is a
bandit of its own over the arms offered there, rewarded in tokens per second.

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

The bandits keep an RNG (seeded by ``TunerConfig.seed``) in their state, so a restored bandit
continues the same choice sequence.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from tlt_jax.rollout.host.tuner.base import BucketStats, Decision, Tuner
from tlt_jax.rollout.host.tuner.config import TunerConfig, fixed_arm


def _jsonable(value):
  """``value`` with tuples turned into lists and numpy scalars into Python numbers."""
  if isinstance(value, dict):
    return {k: _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


class Bandit(Tuner):
  """A tuner whose buckets are bandits: arms not pulled yet first, in the order offered, then the
  kind's ``_pick``; its RNG is part of its state, and a bucket's best arm has the best median."""

  def __init__(self, config: TunerConfig):
    super().__init__(config)
    self._rng = np.random.default_rng(config.seed)

  def _decide(self, bucket: int, stats: BucketStats, names: list[str]) -> Decision:
    """Chooses among ``names`` (>= 2 arms): unpulled arms first, in order, then ``_pick``."""
    unpulled = [n for n in names if stats.arms[n].pulls == 0]
    return Decision(unpulled[0] if unpulled else self._pick(stats, names))

  def _pick(self, stats: BucketStats, names: list[str]) -> str:
    """Chooses among ``names`` (>= 2 arms, every one pulled at least once)."""
    raise NotImplementedError

  def _best_by_median(self, stats: BucketStats, names: Sequence[str]) -> str | None:
    """The arm of ``names`` with the highest windowed median (first wins ties); ``None`` if none."""
    best, best_value = None, None
    for name in names:
      value = stats.arms[name].median()
      if value is not None and (best_value is None or value > best_value):
        best, best_value = name, value
    return best

  def _summary_best(self, bucket: int, stats: BucketStats) -> str | None:
    return self._best_by_median(stats, list(stats.arms))

  def state_dict(self) -> dict:
    """``Tuner.state_dict`` and the RNG's state."""
    return {**super().state_dict(), "rng": _jsonable(self._rng.bit_generator.state)}

  def load_state_dict(self, state: dict) -> None:
    super().load_state_dict(state)  # the kind and the layout first
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    self._rng = rng


class BegMab(Bandit):
  """Bucketed epsilon-greedy bandit on the median of a sliding window of rewards."""

  def _epsilon(self, decisions: int, n_arms: int) -> float:
    """Exploration probability after ``decisions`` decisions in a bucket offering ``n_arms``."""
    cfg = self.config
    if not cfg.decay:
      return cfg.epsilon
    return max(cfg.epsilon_min, cfg.epsilon / math.sqrt(1.0 + decisions / n_arms))

  def _pick(self, stats: BucketStats, names: list[str]) -> str:
    """Explores a random non-greedy arm with probability eps_n, else exploits the best median."""
    greedy = self._best_by_median(stats, names)
    if self._rng.random() < self._epsilon(stats.decisions, len(names)):
      others = [n for n in names if n != greedy]
      return others[int(self._rng.integers(len(others)))]
    return greedy


class Ucb1(Bandit):
  """UCB1 on window means normalized by the bucket's largest reward; deterministic."""

  def _pick(self, stats: BucketStats, names: list[str]) -> str:
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


class FixedMapping(Bandit):
  """A fixed bucket -> arm mapping from ``TunerConfig.fixed``; rewards are only recorded."""

  def _decide(self, bucket: int, stats: BucketStats, names: list[str]) -> Decision:
    """The arm mapped to ``bucket``; raises if the bucket is unmapped or that arm not offered."""
    return Decision(fixed_arm(self.config.fixed, bucket, names))

