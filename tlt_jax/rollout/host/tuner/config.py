"""``TunerConfig``: which tuner the adaptive engine uses and its settings, checked once here; and
``fixed_arm``, the arm a ``kind="fixed"`` mapping gives a bucket (the engine checks the mapping
with it before anything compiles)."""

from __future__ import annotations

import collections.abc
import dataclasses
import math
from typing import Sequence

import numpy as np

from tlt_jax.utils import FieldError, require_positive_ints

KINDS = ("cost", "beg_mab", "ucb1", "fixed")


@dataclasses.dataclass(frozen=True)
class TunerConfig:
  """How the engine picks a strategy per segment: ``kind`` names the tuner (``bandits.py``,
  ``cost.py``), the other fields are its settings."""

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

