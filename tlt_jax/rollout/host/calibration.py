"""What a rollout measured of its decode steps, one object shared by every engine of the rollout.

``Calibration`` holds the step costs that ``RolloutEngine.calibrate`` timed, the segment lengths
they bound (``scheduler.segment_lengths``) and, after a calibrated precompile, the SD arms each
bucket offers (``offers.SdOffers``). A rollout owns one: a one-device engine makes its own, and a
data-parallel rollout hands the same one to each of its engines. The devices are alike, so the
rollout times the first and every device then decodes by the same costs, offers and segment
lengths (each engine's scheduler and ``strategies_for`` read them here), with no engine reaching
into another's state.

The tuner is not held here: it may be replaced (``set_tuner``). Whoever measures hands it in,
and ``measured`` and ``add`` pass it the costs.
"""

from __future__ import annotations

from typing import Any

from tlt_jax.rollout.host.offers import SdOffers
from tlt_jax.rollout.host.scheduler import segment_lengths

__all__ = ["Calibration"]


class Calibration:
  """A rollout's measured step costs, the segment lengths they bound and the offered SD arms.

  Attributes:
    segment_steps: ``EngineConfig.segment_steps``, what a bounded segment runs unmeasured.
    costs: ``({(bucket, strategy name): seconds per step}, seconds of one segment boundary)``,
      None until measured.
    segment_lengths: per bucket, the most steps of a bounded segment (empty: ``segment_steps``).
    offers: the SD arms offered per bucket after a calibrated precompile (None before one).
  """

  def __init__(self, segment_steps: int):
    self.segment_steps = segment_steps
    self.costs: tuple[dict, float] | None = None
    self.segment_lengths: dict[int, int] = {}
    self.offers: SdOffers | None = None

  def measured(self, costs: tuple[dict, float], tuner: Any = None,
               bound_segments: bool = True) -> None:
    """Keeps newly measured ``costs`` and hands them to ``tuner`` (if any); ``bound_segments``:
    the segment lengths follow them too."""
    self.costs = costs
    if tuner is not None:
      tuner.set_costs(*costs)
    if bound_segments:
      self.segment_lengths = segment_lengths(*costs, self.segment_steps)

  def add(self, costs: dict, tuner: Any = None) -> None:
    """A bucket's SD arms are offered: their step ``costs`` join the known ones and ``tuner``'s
    (if any), with the boundary measured before."""
    known, overhead = self.costs
    self.costs = ({**known, **costs}, overhead)
    if tuner is not None:
      tuner.set_costs(costs, overhead)
