"""The step-time model of experiments/system/scale_model.py: closed forms, bucket rounding,
sharding and the growth of TLT's speedup with the devices. Numpy maths: nothing here runs JAX
(the model takes its bucket rounding and sharding from tlt_jax.rollout, whose import loads it)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments.system import scale_model as sm

ROOT = pathlib.Path(__file__).resolve().parents[2]


def costs(**fields) -> "sm.Costs":
  """Buckets 1, 4, 16: vanilla 1, 2, 4 s a step; SD 2 s a step accepting 4 tokens at 1 and 4."""
  base = dict(buckets=[1, 4, 16], decode_s=[1.0, 2.0, 4.0], sd_step_s=[2.0, 2.0, None],
              accept_len=[4.0, 4.0, None], sd_max_batch=4, prefill_tokens=0)
  return sm.Costs(**(base | fields))


def test_rows_of_one_length_take_length_steps_at_their_bucket():
  c = costs()
  assert sm.rollout_time([10] * 16, c)["seconds"] == pytest.approx(10 * 4.0)
  assert sm.rollout_time([10] * 3, c)["seconds"] == pytest.approx(10 * 2.0)  # bucket 4, not 3
  # the prefill emits the first token: one step fewer
  assert sm.rollout_time([10] * 16, costs(prefill_tokens=1))["seconds"] == pytest.approx(9 * 4.0)


def test_bucket_rounding():
  assert [sm.bucket_for(n, [1, 4, 16]) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
  with pytest.raises(ValueError):
    sm.bucket_for(17, [1, 4, 16])
  # 5 live rows of 16: 5 x 10 steps at bucket 16's cost, then the 4 longest at bucket 4's
  c = costs()
  lengths = [10] + [20] * 4
  expected = 10 * 4.0 + 10 * 2.0
  assert sm.rollout_time(lengths, c)["seconds"] == pytest.approx(expected)
  steps = sm.chunk_time(lengths, c)["steps"]
  assert steps == pytest.approx({16: 10.0, 4: 10.0})


def test_sd_at_batch_one_costs_step_over_accept_per_token():
  c = costs(sd_step_s=[3.0, 3.0, None], accept_len=[5.0, 5.0, None])
  assert sm.rollout_time([100], c, policy="tlt")["seconds"] == pytest.approx(100 * 3.0 / 5.0)
  assert sm.rollout_time([100], c, policy="vanilla")["seconds"] == pytest.approx(100.0)
  # switching to SD costs switch_s once
  with_switch = costs(sd_step_s=[3.0, 3.0, None], accept_len=[5.0, 5.0, None], switch_s=0.5)
  assert sm.rollout_time([100], with_switch, policy="tlt")["seconds"] == pytest.approx(60.5)


def test_tlt_takes_the_cheaper_of_vanilla_and_sd_and_sd_forces_it():
  c = costs(sd_step_s=[8.0, 2.0, None])  # SD at bucket 1: 2 s a token, worse than vanilla's 1
  assert sm.rollout_time([40], c, policy="tlt")["seconds"] == pytest.approx(40.0)
  assert sm.rollout_time([40], c, policy="sd")["seconds"] == pytest.approx(40 * 2.0)
  # never above sd_max_batch
  assert not costs(sd_max_batch=1).sd_at(4, "tlt")


def test_chunks_and_shards():
  assert sm.shard_sizes(10, 4) == [3, 3, 2, 2]
  assert sm.shard_sizes(2, 4) == [1, 1, 0, 0]
  c = costs()
  # 20 rows on one device: a chunk of 16 then a chunk of 4, one after the other
  assert sm.rollout_time([5] * 20, c)["seconds"] == pytest.approx(5 * 4.0 + 5 * 2.0)
  # contiguous shards, the rollout waits for the slowest device
  r = sm.rollout_time([1, 1, 50, 1], c, devices=2)
  assert r["device_s"] == pytest.approx([1 * 2.0, 1 * 2.0 + 49 * 1.0])  # 2 rows: bucket 4
  assert r["seconds"] == pytest.approx(51.0) and r["idle_device_s"] == pytest.approx(49.0)


def test_update_and_drafter_costs():
  c = costs(update_fixed_s=1.0, update_s_per_token=0.01, prompt_len=10, drafter_step_s=0.2,
            drafter_serial_steps=8)
  assert sm.update_time([90, 190], c, devices=2) == pytest.approx(1.0 + 0.01 * 300 / 2)
  assert sm.drafter_time(c, 1) == pytest.approx(1.6)  # serial on one device
  assert sm.drafter_time(c, 4) == pytest.approx(0.1)  # half a step in flight
  step = sm.predict_step([90, 190], c, devices=1)
  assert step["tlt_step_s"] == pytest.approx(step["tlt_rollout_s"] + step["update_s"] + 1.6)


def test_speedup_grows_with_devices_on_a_long_tail_at_a_fixed_global_batch():
  rng = np.random.default_rng(0)
  lengths = sm.long_tail_lengths(rng, 512, 300, 0.9, 2000)
  c = sm.calibrate_update(sm.paper_costs(), [lengths], 8, 0.85)
  curve = sm.scale_curve([lengths], c, (1, 4, 16, 64))
  speedups = [r["speedup"] for r in curve]
  assert all(b > a for a, b in zip(speedups, speedups[1:])), speedups
  assert curve[0]["rows_per_device"] == 512 and curve[-1]["rows_per_device"] == 8
  shares = [r["rollout_share_vanilla"] for r in curve]
  assert all(b > a for a, b in zip(shares, shares[1:]))
  # calibrated: rollout is 85 % of vanilla's step at 8 devices
  at8 = sm.predict_step(lengths, c, 8)
  assert at8["rollout_share_vanilla"] == pytest.approx(0.85)


def test_paper_costs_follow_table4():
  c = sm.paper_costs()
  for b, ratio in ((1, 3.62), (32, 2.48)):
    i = c.index(b)
    assert c.decode_s[i] / (c.sd_step_s[i] / c.accept_len[i]) == pytest.approx(ratio)
  assert c.sd_step_s[c.index(64)] is None


def test_the_cli_writes_the_paper_predictions_without_jax(tmp_path):
  out = tmp_path / "scale.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "system" / "scale_model.py"),
                         "--paper-only", "--out", str(out)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(out.read_text())
  assert report["paper_table3"] == {"1": 1.21, "8": 1.76}
  table = report["predictions_paper"]["table3"]
  assert [r["nodes"] for r in table] == [1, 2, 4, 8]
  assert [r["paper_speedup"] for r in table] == [1.21, None, None, 1.76]
  assert "validation" not in report  # --paper-only measures nothing
