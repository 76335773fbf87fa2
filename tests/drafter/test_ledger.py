"""The drafter's ledger: bootstrap grant, steps bought from SD's savings, totals, resume."""

from __future__ import annotations

import json
import random

import pytest

from tlt_jax.drafter.ledger import DrafterLedger, run_line, step_line


def play(ledger: DrafterLedger, inputs, rl_step_s: float | None = None) -> list[tuple[int, int]]:
  """Runs RL steps: each credits its saving, takes the grant and spends it at its step cost
  (and, with ``rl_step_s``, then tells the ledger the RL step's seconds)."""
  grants = []
  for saved_s, step_s in inputs:
    ledger.credit(saved_s)
    steps, bootstrap = ledger.grant()
    ledger.spend(steps, bootstrap, steps * step_s, other_s=0.001 if steps else 0.0,
                 saved_s=saved_s)
    if rl_step_s is not None:
      ledger.allow(rl_step_s)
    grants.append((steps, bootstrap))
  return grants


def test_a_bootstrap_in_time_spends_its_share_of_the_steps_and_stops_once_sd_paid():
  # drafter steps of 10 ms, RL steps of 1 s, a 3 % share: 30 ms a step buys ~3 steps (the
  # first RL step none: nothing measured the RL step yet; the second one step, which measures)
  ledger = DrafterLedger(savings_share=0.5, bootstrap_steps=40, max_steps=8, bootstrap_share=0.03)
  grants = play(ledger, [(None, 0.01)] * 8, rl_step_s=1.0)
  assert grants[:3] == [(0, 0), (1, 1), (4, 4)] and all(b <= 3 for _, b in grants[3:])
  spent = ledger.drafter_s  # never more than the share of the RL steps' seconds, over the run
  assert 0.03 * 6 < spent <= 0.03 * 8
  assert all(s == b for s, b in grants)  # nothing earned: SD saved nothing
  # SD pays back what the drafter cost: the bootstrap's balance stops growing
  ledger.credit(spent + 0.1)
  balance = ledger.bootstrap_balance_s
  ledger.allow(1.0)
  assert ledger.paid() and ledger.bootstrap_balance_s == balance
  # a share of 0 grants no bootstrap at all; None keeps the up-front grant
  assert play(DrafterLedger(0.5, 40, 8, bootstrap_share=0.0), [(None, 0.01)] * 3, 1.0) == \
      [(0, 0)] * 3
  assert play(DrafterLedger(0.5, 40, 8), [(None, 0.01)] * 2, 1.0) == [(8, 8), (8, 8)]


def test_bootstrap_is_granted_up_front_and_bounded():
  ledger = DrafterLedger(savings_share=0.5, bootstrap_steps=20, max_steps=8)
  grants = play(ledger, [(None, 0.01)] * 6)  # SD never ran: nothing saved
  assert grants == [(8, 8), (8, 8), (4, 4), (0, 0), (0, 0), (0, 0)]
  assert ledger.totals()["bootstrap_steps"] == 20 and ledger.totals()["steps"] == 20


def test_savings_buy_steps_at_the_measured_cost_and_losses_are_debited():
  ledger = DrafterLedger(savings_share=0.5, bootstrap_steps=1, max_steps=8)
  play(ledger, [(0.0, 0.01)])  # the bootstrap step measures the cost: 10 ms a step
  ledger.credit(0.1)  # half of it, 0.05 s, buys 5 steps
  steps, bootstrap = ledger.grant()
  assert (steps, bootstrap) == (5, 0)
  ledger.spend(steps, bootstrap, 0.05)
  assert ledger.balance_s == pytest.approx(0.0, abs=1e-9)
  ledger.credit(-0.2)  # SD cost time (probes): the debt is paid before anything is bought
  ledger.credit(0.3)
  assert ledger.grant() == (5, 0)
  ledger.credit(10.0)
  assert ledger.grant() == (8, 0)  # at most max_steps a step


def test_bootstrap_and_earned_steps_together_stay_within_max_steps():
  ledger = DrafterLedger(savings_share=0.5, bootstrap_steps=12, max_steps=8)
  play(ledger, [(None, 0.01)])  # 8 bootstrap steps measure the cost: 10 ms a step
  ledger.credit(1.0)  # 0.5 s would buy 50 steps
  assert ledger.grant() == (8, 4)  # the 4 bootstrap steps left, and 4 earned


def test_a_drafter_that_never_pays_stops_costing_time():
  ledger = DrafterLedger(savings_share=0.5, bootstrap_steps=16, max_steps=8)
  grants = play(ledger, [(-0.02, 0.01)] * 10)  # SD probes lost a little every step
  assert sum(s for s, _ in grants) == 16 and grants[2:] == [(0, 0)] * 8


def test_a_step_without_training_debits_only_the_drafter_time_it_took():
  """No drafter step ran (nothing granted): its evaluation and copy seconds are still debited,
  and neither the measured step cost nor the step counts change."""
  ledger = DrafterLedger(savings_share=0.5, bootstrap_steps=1, max_steps=8)
  play(ledger, [(0.0, 0.01)])  # the bootstrap step measures 10 ms a step
  ledger.credit(0.1)  # 0.05 s to spend
  before = ledger.state_dict()
  entry = ledger.spend(0, 0, 0.0, other_s=0.02, saved_s=0.1)
  assert (entry.steps, entry.bootstrap, entry.drafter_s) == (0, 0, 0.02)
  assert entry.net_s == pytest.approx(0.08)
  assert ledger.balance_s == pytest.approx(before["balance_s"] - 0.02)
  assert ledger.drafter_s == pytest.approx(before["drafter_s"] + 0.02)
  assert ledger.step_s == before["step_s"] == pytest.approx(0.01)
  assert (ledger.steps, ledger.bootstrap_left) == (before["steps"], before["bootstrap_left"])
  assert ledger.grant() == (3, 0)  # 0.03 s left buys 3 steps, not the 5 that 0.05 s would


def test_totals_and_lines():
  ledger = DrafterLedger(savings_share=1.0, bootstrap_steps=0, max_steps=8)
  play(ledger, [(0.05, 0.01), (0.05, 0.01)])
  totals = ledger.totals()
  assert totals["saved_s"] == pytest.approx(0.1)
  assert totals["net_s"] == pytest.approx(totals["saved_s"] - totals["drafter_s"])
  m = {"tlt_saved_s": 0.12, "tlt_drafter_s": 0.05, "tlt_net_s": 0.07, "step_s": 1.0}
  assert step_line(m) == "TLT saved 0.12s, drafter 0.05s, net +0.07s"
  assert step_line({}) == "" and run_line([{"loss": 0.0}]) == ""
  line = run_line([m, dict(m, drafter_bootstrap_steps=3)])
  assert "saved ~0.24s" in line and "0.10s on the critical path (3 bootstrap" in line
  assert "net +0.14s (+7.0% of the steps' time)" in line


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_ledger_stopped_at_a_random_step_and_resumed_reproduces_the_uninterrupted_one(seed):
  rng = random.Random(seed)
  inputs = [(rng.choice([None, -0.01, 0.0, 0.02, 0.08]), rng.choice([0.008, 0.01, 0.013]))
            for _ in range(30)]
  share = [None, 0.03][seed % 2]  # the up-front bootstrap and the one in time
  uninterrupted = DrafterLedger(0.5, 24, 8, share)
  expected = play(uninterrupted, inputs, rl_step_s=0.5)
  stop = rng.randrange(1, len(inputs))
  first = DrafterLedger(0.5, 24, 8, share)
  before = play(first, inputs[:stop], rl_step_s=0.5)
  resumed = DrafterLedger(0.5, 24, 8, share)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert before + play(resumed, inputs[stop:], rl_step_s=0.5) == expected
  assert resumed.state_dict() == uninterrupted.state_dict()


def test_bad_values_are_refused():
  with pytest.raises(ValueError, match=r"savings_share must be in \[0, 1\]"):
    DrafterLedger(savings_share=1.5)
  with pytest.raises(ValueError, match=r"bootstrap_share must be in \[0, 1\]"):
    DrafterLedger(bootstrap_share=-0.1)
  with pytest.raises(ValueError, match="step_s must be finite"):
    DrafterLedger(bootstrap_share=0.03).allow(float("inf"))
  with pytest.raises(ValueError, match="bootstrap_steps must be an int >= 0"):
    DrafterLedger(bootstrap_steps=-1)
  with pytest.raises(ValueError, match="saved_s must be finite"):
    DrafterLedger().credit(float("nan"))
  with pytest.raises(ValueError, match="malformed ledger state"):
    DrafterLedger().load_state_dict({"balance_s": 1.0})
