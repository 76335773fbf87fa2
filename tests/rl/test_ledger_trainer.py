"""The one-device drafter budget in the RL loop (``serial_budget="ledger"``, the default): the
bootstrap grant, no drafter time once it is spent and SD saves nothing, the engine's drafter and
its tuner told only when the weights change, and the ledger's metrics."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from tests.rl.test_online_drafter import online_trainer
from tlt_jax.drafter.online import DrafterTrainingConfig
from tlt_jax.utils import compile_count

# the bootstrap granted up front (bootstrap_share=None): the grants do not depend on time
LEDGER = DrafterTrainingConfig(rows=4, seq_len=32, serial_steps=2, learning_rate=3e-3,
                               bootstrap_steps=3, bootstrap_share=None)


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module", name="run")
def run_fixture():
  """Four steps of a fixed-spec engine: no tuner, so no vanilla step cost, so no saving is ever
  estimated and the ledger grants the bootstrap steps only."""
  trainer = online_trainer(LEDGER)
  trainer.engine.precompile()
  trainer.precompile_update()
  trainer.precompile_drafter()
  engine_weights, rows, compiles = [], [], []
  for _ in range(4):
    before = compile_count()
    rows.append(trainer.step())
    compiles.append(compile_count() - before)
    engine_weights.append(host(trainer.engine.drafter_params))
  run_fixture.compiles = compiles
  return trainer, rows, engine_weights


def test_the_bootstrap_grant_is_spent_then_the_drafter_costs_nothing(run):
  trainer, rows, _ = run
  assert [m["drafter_serial_steps"] for m in rows] == [2, 1, 0, 0]
  assert [m["drafter_bootstrap_steps"] for m in rows] == [2, 1, 0, 0]
  assert trainer.online.spot.steps == 3
  assert rows[3]["drafter_serial_s"] == 0.0
  assert rows[3]["tlt_drafter_s"] < 0.5 * rows[0]["tlt_drafter_s"]
  for m in rows:
    assert m["tlt_saved_s"] == 0.0 and m["tlt_net_s"] == pytest.approx(-m["tlt_drafter_s"])


def test_unchanged_weights_are_neither_scored_nor_copied_again(run):
  _, rows, weights = run
  # scored: the first drafter, and the weights each training step made (steps 2 and 3 draft
  # with weights trained in the step before); step 4 drafts with step 3's unchanged weights
  assert ["drafter_loss" in m for m in rows] == [True, True, True, False]
  for a, b in zip(weights[2], weights[3]):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(weights[0], weights[1]))


def test_hidden_states_are_not_kept_once_nothing_can_train_on_them(run):
  trainer, _, _ = run
  assert not trainer.online.ledger.can_grant()
  options = trainer.online.rollout_options(9, [[1, 2]], trainer.engine)
  assert options["collect_hidden"] is False


def test_the_ledger_resumes_from_a_checkpoint(run, tmp_path):
  from tlt_jax.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  trainer, _, _ = run
  ckpt = Checkpointer(tmp_path / "ckpt")
  trainer.save(ckpt)
  other = online_trainer(LEDGER)
  other.restore(ckpt)
  assert other.online.host_state() == trainer.online.host_state()
  assert other.online.ledger.totals() == trainer.online.ledger.totals()


def test_no_compiles_during_ledger_steps(run):
  _, rows, _ = run
  # after precompile nothing compiles in any RL step (rollout, advantages on the host, update,
  # drafter steps and their evaluation), with or without drafter steps
  assert all(m["compiles"] == 0 for m in rows)
  assert run_fixture.compiles == [0, 0, 0, 0], run_fixture.compiles


def test_an_unchanged_drafter_is_not_saved_again(run, tmp_path):
  from tlt_jax.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  trainer, _, _ = run
  saves = Checkpointer(tmp_path / "drafter", keep=2, async_save=True)
  try:
    assert trainer.online.selective_save(saves, 5) is not None
    assert trainer.online.selective_save(saves, 6) is None  # no drafter step since
    trainer.online.spot.run(trainer.engine.params, max_steps=1)
    assert trainer.online.selective_save(saves, 7) is not None
    saves.wait()
    assert saves.all_steps() == [5, 7]
  finally:
    saves.close()


def test_the_bootstrap_in_time_is_paid_from_the_steps_the_trainer_reports():
  """The default bootstrap: each RL step's seconds (``online.end_step``) fund the next steps'
  bootstrap. The first step has nothing yet; the second runs one step (it measures the cost);
  with a share of 100 % the third can afford the most a step."""
  trainer = online_trainer(dataclasses.replace(LEDGER, bootstrap_share=1.0))
  trainer.engine.precompile()
  trainer.precompile_update()
  trainer.precompile_drafter()
  rows = [trainer.step() for _ in range(3)]
  assert [m["drafter_bootstrap_steps"] for m in rows] == [0, 1, 2]
  ledger = trainer.online.ledger
  assert ledger.bootstrap_left == 0 and ledger.bootstrap_share == 1.0
  # what the three steps credited, less what the bootstrap spent
  spent = sum(m["drafter_serial_s"] for m in rows)
  assert ledger.bootstrap_balance_s == pytest.approx(
      sum(m["step_s"] for m in rows[:2]) - spent, rel=0.05, abs=0.05)


def test_a_drafter_the_calibration_offers_nowhere_is_neither_fed_nor_trained(monkeypatch):
  """Where the engine's calibration offered none of the learned drafter's arms (a 2-core CPU
  for the default job), hidden states are not kept and no serial step runs, bootstrap included:
  that drafter could never pay them back here."""
  trainer = online_trainer(LEDGER)
  monkeypatch.setattr(trainer.engine, "learned_sd_possible", lambda: False)
  assert trainer.online.rollout_options(0, [[1, 2]], trainer.engine)["collect_hidden"] is False
  rows = [trainer.step() for _ in range(2)]
  assert [m["drafter_serial_steps"] for m in rows] == [0, 0]
  assert trainer.online.spot.steps == 0 and trainer.online.buffer.num_samples == 0
  monkeypatch.setattr(trainer.engine, "learned_sd_possible", lambda: True)  # it may pay again
  assert trainer.step()["drafter_serial_steps"] > 0  # the bootstrap grant, kept meanwhile
