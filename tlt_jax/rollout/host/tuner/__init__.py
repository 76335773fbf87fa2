"""Host-side strategy tuners: pick the decoding strategy (arm) of each decode segment.

Vanilla decoding is an arm in every bucket where SD may run, so wherever speculative decoding does
not pay on this hardware, model and batch size, a tuner converges to vanilla instead of assuming a
speedup. The rooms:

* ``config.py``: ``TunerConfig`` (``kind``: ``"cost"``, the default, ``"beg_mab"``, ``"ucb1"`` or
  ``"fixed"``, and each kind's settings) and ``fixed_arm``;
* ``base.py``: ``Arm``, ``Decision`` and ``Tuner``, the base class (per-bucket statistics, the
  checks of every call, the calibrated step costs, the saved state and its layout version);
* ``bandits.py``: ``BegMab``, ``Ucb1`` and ``FixedMapping``, bandits per bucket;
* ``cost.py``: ``CostModel``, which chooses by calibrated step costs and counted acceptance.

``make_tuner(config)`` builds the kind ``config.kind`` names.
"""

from __future__ import annotations

from tlt_jax.rollout.host.tuner.bandits import BegMab, FixedMapping, Ucb1
from tlt_jax.rollout.host.tuner.base import LONG_SEGMENT, STATE_VERSION, Arm, Decision, Tuner
from tlt_jax.rollout.host.tuner.config import KINDS, TunerConfig, fixed_arm
from tlt_jax.rollout.host.tuner.cost import CostModel, acceptance_from_length, accepted_length

__all__ = ["Arm", "BegMab", "CostModel", "Decision", "FixedMapping", "KINDS", "LONG_SEGMENT",
           "STATE_VERSION", "Tuner", "TunerConfig", "Ucb1", "acceptance_from_length",
           "accepted_length", "fixed_arm", "make_tuner"]

_KIND_TO_CLASS = {"cost": CostModel, "beg_mab": BegMab, "ucb1": Ucb1, "fixed": FixedMapping}


def make_tuner(config: TunerConfig) -> Tuner:
  """Builds the tuner ``config.kind`` names."""
  if not isinstance(config, TunerConfig):
    raise TypeError(f"make_tuner takes a TunerConfig, got {type(config).__name__}")
  return _KIND_TO_CLASS[config.kind](config)
