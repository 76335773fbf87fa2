"""The run's state as one value (``rl/run_state.py``): every part saved and restored by one
call, in the order checkpoints always had; a part that cannot load fails before any part has
changed; and the device rules of a step run once wherever a trainer is built."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from tests.rl.test_trainer import make_trainer
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.rl import run_state, trainer_config
from tlt_jax.rl.run_state import SAVE_ORDER, Part, RunState, StepPart
from tlt_jax.rollout.decode.suffix_history import HistoryConfig
from tlt_jax.rollout.decode.suffix import SuffixConfig


class Recorded(Part):
  """A part that records what it is asked, in ``log``, and owns one metadata entry."""

  def __init__(self, name: str, log: list, fails: bool = False):
    self.name, self.log, self.fails = name, log, fails

  def metadata(self, checkpointer, step):
    self.log.append(("metadata", self.name))
    return {f"{self.name}_entry": step}

  def written(self, checkpointer, step):
    self.log.append(("written", self.name))

  def check(self, saved):
    self.log.append(("check", self.name))
    if self.fails:
      raise ValueError(f"{self.name} does not load")

  def load(self, saved):
    self.log.append(("load", self.name))


def recorded_state(log: list, failing: str | None = None) -> tuple[RunState, list]:
  steps = [3]
  parts = {name: Recorded(name, log, fails=name == failing) for name in SAVE_ORDER
           if name != "step"}
  parts["step"] = StepPart(lambda: steps[0], lambda step: steps.__setitem__(0, step))
  return RunState(parts), steps


def test_one_call_saves_every_part_in_the_checkpoints_order_and_restores_in_the_load_order(
    tmp_path):
  """The metadata's entries come in the order today's checkpoints hold them, after the caller's;
  restoring checks every part before any loads, then loads them drafter before tuner."""
  log = []
  state, steps = recorded_state(log)
  with Checkpointer(tmp_path, keep=2) as checkpointer:
    state.save(checkpointer, {"trainer": {}})
    metadata = checkpointer.read_metadata(3)
    steps[0] = 0
    log.clear()
    assert state.restore(checkpointer) == metadata
  assert list(metadata) == ["trainer", "policy_entry", "tuner_entry", "history_entry",
                            "drafter_entry"]
  present = ["policy", "drafter", "tuner", "history"]  # the drafter's weights before the tuner
  assert log == [("check", n) for n in present] + [("load", n) for n in present]
  assert steps == [3]


def test_a_part_that_does_not_load_leaves_every_part_as_it_was(tmp_path):
  log = []
  state, steps = recorded_state(log, failing="history")
  with Checkpointer(tmp_path, keep=2) as checkpointer:
    state.save(checkpointer)
    steps[0] = 0
    log.clear()
    with pytest.raises(ValueError, match="history does not load"):
      state.restore(checkpointer)
  assert not [entry for entry in log if entry[0] == "load"] and steps == [0]


def test_the_parts_are_the_known_ones_with_policy_and_step_always():
  with pytest.raises(ValueError, match="RunState parts are"):
    RunState({"step": StepPart(lambda: 0, print)})
  with pytest.raises(ValueError, match="RunState parts are"):
    RunState({"policy": Part(), "step": StepPart(lambda: 0, print), "ledger": Part()})


def test_a_trainer_s_checkpoint_keeps_its_layout(tmp_path):
  """The arrays and metadata of a trainer's checkpoint are where they always were: params,
  optimizer state and step at the top of the arrays, and "trainer", the caller's entries and
  "history" in the metadata."""
  trainer = make_trainer(history=HistoryConfig(), suffix=SuffixConfig(depth=3))
  assert trainer.history is not None
  with Checkpointer(tmp_path, keep=2) as checkpointer:
    trainer.save(checkpointer, {"config": {"seed": 0}})
    metadata = checkpointer.read_metadata(0)
  assert list(trainer.checkpoint_state()) == ["params", "opt_state", "step"]
  assert list(metadata)[:2] == ["trainer", "config"] and run_state.HISTORY_KEY in metadata
  assert np.asarray(trainer.checkpoint_state()["step"]).dtype == np.int64


def test_a_trainer_built_alone_checks_its_devices_once(monkeypatch):
  """A library user's trainer (no job) checks the step's device rules itself, each once."""
  calls = count_calls(monkeypatch, trainer_config, "check_update_layout", "check_rollout_devices")
  make_trainer()
  assert calls == {"check_update_layout": 1, "check_rollout_devices": 1}


def count_calls(monkeypatch, module, *names, calls: collections.Counter | None = None
                ) -> collections.Counter:
  """Wraps ``module``'s functions ``names`` to count their calls in ``calls`` (None: a new
  Counter), which it returns."""
  calls = collections.Counter() if calls is None else calls
  for name in names:
    real = getattr(module, name)

    def counted(*args, _real=real, _name=name, **kwargs):
      calls[_name] += 1
      return _real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
  return calls
