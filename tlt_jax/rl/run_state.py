"""The run's state as one value: ``RunState``, whose named parts each say how they save and how
they load, written and read by one checkpoint call.

A part owns some entries of the checkpoint: arrays (``arrays()``, one pytree for the whole step),
JSON metadata (``metadata()``) and files beside the step's arrays (``written()``). Restoring
reads the checkpoint once, lets every part ``check`` it (a part that cannot load raises there,
before any part has changed) and then ``load`` it. The parts of a trainer
(``GRPOTrainer.run_state``):

* ``policy``: the params, the optimizer state and the KL reference (``PolicyUpdate``);
* ``step``: the step count, which is also the data position;
* ``drafter``: the online drafter's weights and optimizer (arrays under ``"drafter"``), its host
  state and buffer checksum (metadata) and its data buffer (a file beside the arrays);
* ``tuner``: what the adaptive engine's tuner learned (metadata ``"tuner"``);
* ``history``: the suffix drafter's ``HistoryStore`` (metadata ``"history"``).

The layout on disk is the one checkpoints had before ``RunState`` existed, so those resume.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from tlt_jax.rollout import HistoryConfig, HistoryStore

TUNER_KEY = "tuner"  # checkpoint metadata: the adaptive rollout tuner's state_dict()
HISTORY_KEY = "history"  # checkpoint metadata: the HistoryStore's state_dict()
# The metadata's entries are written in this order (a checkpoint's JSON as it always was; on
# several processes the tuner's exchange comes before the drafter's on every one of them).
SAVE_ORDER = ("policy", "step", "tuner", "history", "drafter")
# Loaded in this order: the drafter's weights reach the engines (and their tuner hears of
# them) before the tuner's saved state loads; the history store is replaced last.
LOAD_ORDER = ("policy", "step", "drafter", "tuner", "history")


@dataclasses.dataclass(frozen=True)
class Saved:
  """A checkpoint as read back: its ``arrays`` and ``metadata``, its ``step``, the
  ``checkpointer`` it came from (for files beside it) and where problems are reported."""

  arrays: dict
  metadata: dict
  step: int
  checkpointer: Any
  report: Callable[[str], Any]


class Part:
  """One owner of the run's state; each method's default owns nothing of that kind."""

  def arrays(self) -> dict:
    """Its entries of the checkpoint's array tree."""
    return {}

  def metadata(self, checkpointer, step: int) -> dict:
    """Its JSON entries of checkpoint ``step``'s metadata (called before the arrays are saved)."""
    del checkpointer, step
    return {}

  def written(self, checkpointer, step: int) -> None:
    """After checkpoint ``step``'s arrays are saved: writes what lives beside them."""
    del checkpointer, step

  def check(self, saved: Saved) -> None:
    """Reads its part of ``saved`` without changing anything; raises if it does not load."""
    del saved

  def load(self, saved: Saved) -> None:
    """Takes on its part of ``saved``."""
    del saved


class PolicyPart(Part):
  """The policy's params, optimizer state and KL reference (``PolicyUpdate.checkpoint_state``);
  ``loaded()`` hands the engines the restored params."""

  def __init__(self, policy, loaded: Callable[[], None]):
    self.policy, self.loaded = policy, loaded

  def arrays(self) -> dict:
    return self.policy.checkpoint_state()

  def load(self, saved: Saved) -> None:
    self.policy.load_checkpoint_state(saved.arrays)
    self.loaded()


class StepPart(Part):
  """The step count (the data position too): read with ``get``, restored with ``put``."""

  def __init__(self, get: Callable[[], int], put: Callable[[int], None]):
    self.get, self.put = get, put

  def arrays(self) -> dict:
    return {"step": np.asarray(self.get(), np.int64)}

  def load(self, saved: Saved) -> None:
    self.put(saved.step)


class DrafterPart(Part):
  """The online drafter (``OnlineDrafter``): its weights and optimizer, its host state and its
  data buffer, a file beside the step's arrays; ``loaded()`` hands the engines its weights."""

  def __init__(self, online, loaded: Callable[[], None]):
    self.online, self.loaded = online, loaded
    self.write = None  # writes the buffer of the step whose metadata was made

  def arrays(self) -> dict:
    return {"drafter": self.online.checkpoint_state()}

  def metadata(self, checkpointer, step: int) -> dict:
    entries = {}
    self.write = self.online.save_buffer(checkpointer, step, entries)
    return entries

  def written(self, checkpointer, step: int) -> None:
    self.write()

  def load(self, saved: Saved) -> None:
    self.online.restore(saved.arrays["drafter"], saved.checkpointer, saved.step, saved.metadata,
                        saved.report)
    self.loaded()


class TunerPart(Part):
  """What the rollout's tuner learned (``Rollout.tuner_state``), where it has one."""

  def __init__(self, rollout):
    self.rollout = rollout

  def metadata(self, checkpointer, step: int) -> dict:
    tuner = self.rollout.tuner_state()
    return {} if tuner is None else {TUNER_KEY: tuner}

  def load(self, saved: Saved) -> None:
    self.rollout.load_tuner_state(saved.metadata.get(TUNER_KEY), saved.report)


class HistoryPart(Part):
  """The suffix drafter's history store: saved through its ``state_dict``; restored into a new
  store of ``config`` handed to ``put``. A checkpoint without one (saved before the store
  existed, or without a suffix drafter) is reported and the store starts empty; one that does
  not load is a ValueError naming the step, raised before any part has loaded."""

  def __init__(self, store: HistoryStore, config: HistoryConfig,
               put: Callable[[HistoryStore], None]):
    self.store, self.config, self.put = store, config, put
    self.loaded = None  # the store read by ``check``

  def metadata(self, checkpointer, step: int) -> dict:
    return {HISTORY_KEY: self.store.state_dict()}

  def check(self, saved: Saved) -> None:
    history = HistoryStore(self.config)
    entry = saved.metadata.get(HISTORY_KEY)
    if entry is None:
      saved.report(f"the checkpoint of step {saved.step} holds no rollout history (saved before "
                   "the history store existed, or without a suffix drafter): the store starts "
                   "empty")
    else:
      try:
        history.load_state_dict(entry)
      except ValueError as e:
        raise ValueError(f"the checkpoint of step {saved.step} holds a rollout history that does "
                         f"not load: {e}") from None
    self.loaded = history

  def load(self, saved: Saved) -> None:
    self.put(self.loaded)


@dataclasses.dataclass
class RunState:
  """The run's state: its named ``parts`` (``SAVE_ORDER``'s names; ``policy`` and ``step``
  always, the others where the run has them), saved and restored together."""

  parts: dict[str, Part]

  def __post_init__(self):
    unknown = sorted(set(self.parts) - set(SAVE_ORDER))
    if unknown or not {"policy", "step"} <= set(self.parts):
      raise ValueError(f"RunState parts are {list(SAVE_ORDER)} (policy and step always), got "
                       f"{sorted(self.parts)}")

  def ordered(self, order: tuple[str, ...]) -> list[Part]:
    """The parts present, in ``order``."""
    return [self.parts[name] for name in order if name in self.parts]

  @property
  def step(self) -> int:
    return int(self.parts["step"].get())

  def arrays(self) -> dict:
    """The checkpoint's array tree: every part's entries."""
    tree = {}
    for part in self.ordered(SAVE_ORDER):
      tree.update(part.arrays())
    return tree

  def save(self, checkpointer, metadata: dict | None = None) -> None:
    """Saves every part as checkpoint ``step`` of ``checkpointer``, atomically, with
    ``metadata`` (the caller's entries) before the parts' own."""
    step, metadata = self.step, dict(metadata or {})
    for part in self.ordered(SAVE_ORDER):
      metadata.update(part.metadata(checkpointer, step))
    checkpointer.save(step, self.arrays(), metadata)
    for part in self.ordered(SAVE_ORDER):
      part.written(checkpointer, step)

  def restore(self, checkpointer, step: int | None = None, report=print) -> dict:
    """Loads checkpoint ``step``, or by default the newest that passes verification (a corrupt
    newer one is reported through ``report`` and moved aside), into every part; returns its
    metadata. A part that cannot load raises before any part has changed."""
    like = self.arrays()
    if step is None:
      _, arrays, metadata = checkpointer.restore_latest_good(like=like, report=report)
    else:
      arrays, metadata = checkpointer.restore(step, like=like)
    saved = Saved(arrays, metadata, int(arrays["step"]), checkpointer, report)
    for part in self.ordered(LOAD_ORDER):
      part.check(saved)
    for part in self.ordered(LOAD_ORDER):
      part.load(saved)
    return metadata
