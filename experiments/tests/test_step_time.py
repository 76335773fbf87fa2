"""The step-time model (``experiments/rl/step_time.py``) through its public API; the fuller
checks of its closed forms are in test_scale_model.py beside this file, against
experiments/system/scale_model.py, which uses this module."""

from __future__ import annotations

import pytest

from experiments.rl.step_time import Costs, predict_step, rollout_time, shard_sizes


def test_a_step_is_rollout_update_and_drafter_and_tlt_pays_in_the_tail():
  costs = Costs(buckets=[1, 4, 16], decode_s=[1.0, 2.0, 4.0], sd_step_s=[2.0, 2.0, None],
                accept_len=[4.0, 4.0, None], sd_max_batch=4, prefill_tokens=0)
  assert shard_sizes(10, 4) == [3, 3, 2, 2]
  lengths = [4] * 15 + [100]  # one long row: its tail runs at bucket 1
  assert rollout_time([10] * 16, costs)["seconds"] == pytest.approx(40.0)
  step = predict_step(lengths, costs)
  assert step["vanilla_step_s"] > step["tlt_step_s"] > 0
  assert step["speedup"] == pytest.approx(step["vanilla_step_s"] / step["tlt_step_s"])


def test_sd_runs_at_buckets_up_to_and_including_sd_max_batch():
  costs = Costs(buckets=[1, 4, 16], decode_s=[1.0, 2.0, 4.0], sd_step_s=[2.0, 2.0, 2.0],
                accept_len=[4.0, 4.0, 4.0], sd_max_batch=4, prefill_tokens=0)
  assert [costs.sd_at(b, "sd") for b in (1, 4, 16)] == [True, True, False]
  assert costs.sd_at(4, "tlt") and not costs.sd_at(4, "vanilla")
  # four rows of 8 tokens at bucket 4: 8 / 4 = 2 SD steps of 2 s, against 8 vanilla steps of 2 s
  assert rollout_time([8] * 4, costs, policy="tlt")["seconds"] == pytest.approx(4.0)
  assert rollout_time([8] * 4, costs, policy="vanilla")["seconds"] == pytest.approx(16.0)
