"""``make_rollout``: the one constructor of a rollout, whichever devices and processes it runs on.

A caller (the trainer, a script) hands over the model, the drafter, the engine config and the
devices it may decode on; which class does the work follows from them alone:

* one device: a ``RolloutEngine`` on it;
* several devices: a ``DataParallelRollout``, one engine per device;
* several JAX processes: either of the above over this process's devices, marked to share its
  rows over every process (``Rollout.over_processes``: a process decodes its share of the rows,
  then every process gets every row; ``processes.py``).

All three implement the ``Rollout`` interface (``interface.py``), so the caller never needs to
know which one it holds.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from tlt_jax import hosts
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.interface import Rollout
from tlt_jax.rollout.parallel import DataParallelRollout

__all__ = ["make_rollout"]


def make_rollout(model: Transformer, drafter: Drafter | Any | None = None,
                 config: EngineConfig = EngineConfig(), devices: Sequence[Any] | None = None,
                 **kind_options) -> Rollout:
  """The rollout of ``model`` (drafting with ``drafter``, if any) over ``devices``.

  Args:
    model: the target model.
    drafter: a ``Drafter``, a model-free drafter's config (e.g. ``NgramConfig``) or None.
    config: the engine config (resolved against the drafters by the engines themselves).
    devices: this process's devices to decode on, in shard order (None: the first local one).
    **kind_options: passed to the rollout as they are; today ``suffix`` (a ``SuffixConfig``).

  Returns:
    A ``RolloutEngine`` on one device, a ``DataParallelRollout`` over several, either of them
    sharing the rows over every process when JAX runs more than one.
  """
  devices = list(devices) if devices is not None else jax.local_devices()[:1]
  if not devices:
    raise ValueError("make_rollout needs at least one device")
  if len(devices) > 1:
    rollout = DataParallelRollout(model, drafter, config, devices=devices, **kind_options)
  else:
    rollout = RolloutEngine(model, drafter=drafter, config=config, device=devices[0],
                            **kind_options)
  # each process decodes its share of the rows, then all get all
  rollout.over_processes = hosts.process_count() > 1
  return rollout
