"""The rollout's host statistics: SD's estimated saving against vanilla and its merge."""

from __future__ import annotations

import pytest

from tlt_jax.rollout.host.stats import ArmTally, RolloutStats, rollout_metrics, saved_seconds


def tally(seconds, steps, tokens, row_steps, critical=0) -> ArmTally:
  t = ArmTally()
  t.seconds, t.steps, t.tokens, t.row_steps = seconds, steps, tokens, row_steps
  t.critical_tokens = critical
  return t


def test_saved_seconds_counts_the_vanilla_steps_sd_avoided():
  # bucket 4: 10 SD steps advanced the longest row by 30 tokens in 0.05 s; vanilla needs 30
  # steps of 2 ms for them: 0.06 s, so SD saved 0.01 s. Bucket 1: 8 steps, 8 tokens (a useless
  # drafter) in 0.02 s against 8 vanilla steps of 1 ms: -0.012 s.
  arms = {"4": {"vanilla": tally(1.0, 500, 2000, 2000), "chain d3": tally(0.05, 10, 120, 40, 30)},
          "1": {"chain d3": tally(0.02, 8, 8, 8, 8)}, "2": {"vanilla": tally(0.1, 5, 10, 10)}}
  costs = {4: 2e-3, 1: 1e-3}
  assert saved_seconds(arms, costs.get) == pytest.approx(0.01 - 0.012)
  assert saved_seconds(arms, lambda b: None) is None  # vanilla's cost unknown: no estimate
  assert saved_seconds({"2": {"vanilla": tally(0.1, 5, 10, 10)}}, costs.get) is None


def test_saved_seconds_prices_the_longest_row_not_the_mean_row():
  # 10 SD steps over 4 rows: the three short rows accepted 5 tokens a step (history drafts of a
  # repeated trace), the long row 1.5. The mean row (4.1 tokens a step) would claim 0.082 s of
  # vanilla steps; the rollout's end waits on the long row, 15 vanilla steps: SD lost 0.02 s.
  arms = {"4": {"suffix d8": tally(0.05, 10, 165, 40, critical=15)}}
  assert saved_seconds(arms, {4: 2e-3}.get) == pytest.approx(15 * 2e-3 - 0.05)


def test_the_saving_is_summed_over_devices_and_reported():
  a, b = RolloutStats(sd_saved_s=0.25), RolloutStats(sd_saved_s=-0.05)
  merged = RolloutStats.merge([a, None, b, RolloutStats()], wall_s=1.0)
  assert merged.sd_saved_s == pytest.approx(0.2)
  assert rollout_metrics(merged)["sd_saved_s"] == pytest.approx(0.2)
  assert "sd_saved_s" not in rollout_metrics(RolloutStats())


def test_arm_totals_sum_each_arm_over_its_buckets():
  stats = RolloutStats()
  stats.arms = {"4": {"vanilla": tally(1.0, 50, 200, 200), "chain d3": tally(0.5, 10, 120, 40)},
                "1": {"chain d3": tally(0.25, 8, 8, 8)}}
  assert stats.arm_totals("steps") == {"vanilla": 50, "chain d3": 18}
  assert stats.arm_totals("seconds") == {"vanilla": 1.0, "chain d3": 0.75}


def test_last_seconds_count_the_segments_with_at_most_an_eighth_of_the_rows_live():
  from tlt_jax.rollout.host.stats import last_seconds, tail_seconds  # pylint: disable=import-outside-toplevel
  segments = [(64, 10, 1.0, "vanilla"), (32, 5, 0.5, "vanilla"), (16, 5, 0.25, "vanilla"),
              (8, 5, 0.125, "chain d3"), (4, 5, 0.0625, "vanilla"), (1, 40, 2.0, "chain d3")]
  assert last_seconds(segments) == 0.125 + 0.0625 + 2.0
  assert tail_seconds(segments) == 0.25 + 0.125 + 0.0625 + 2.0
  assert last_seconds([]) == 0.0


def test_the_run_s_arm_shares_weigh_each_step_by_its_decode_steps():
  from tlt_jax.rollout.host.stats import run_sd_summary  # pylint: disable=import-outside-toplevel
  history = [{"sd_switches": 0, "arm_share/vanilla": 1.0, "decode_steps": 300},
             {"sd_switches": 2, "arm_share/vanilla": 0.0, "arm_share/chain_d3": 1.0,
              "decode_steps": 100},
             {"eval_reward": 0.5}]  # not an RL step: left out
  assert run_sd_summary(history) == ("SD: vanilla 75% chain_d3 25% of decode steps; "
                                     "2 switches (0.00 s catch-up)")
