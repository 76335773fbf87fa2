"""experiments/sd/launch_ab.py, the A/B of what cuts a decode step's launches: its smallest run
writes the report the device run will, its k-steps-per-iteration loop emits the engine's own
tokens, its shapes are the jobs' policies and its XLA flags parse.

The loop is the lever under test: a body that ran k - 1 steps, or one step twice, would time a
different program than the engine's and still look faster. So the tokens of k = 4 are held to
those of the engine's own segment executable (greedy; vanilla and the EAGLE chain here, the
suffix chain in the full tier), and the CLI's report (vanilla and suffix, k = 1 and 2, greedy)
to ``same_tokens_as_k1`` and to the exact step count."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.sd import launch_ab
from tlt_jax.rollout import SamplerArgs, SamplingParams

ROOT = pathlib.Path(launch_ab.__file__).resolve().parents[2]  # the repository's root
BATCH = 2


def test_shapes_are_the_long_tail_jobs_policies():
  from tlt_jax.configs import mid_longtail, tiny_longtail  # pylint: disable=import-outside-toplevel
  for shape, module in (("tiny", tiny_longtail), ("mid", mid_longtail)):
    cfg = module.get_config()
    assert {k: cfg.model[k] for k in launch_ab.SHAPES[shape]} == launch_ab.SHAPES[shape], shape
    assert cfg.rollout.max_prompt_len == launch_ab.PROMPT_LEN
    assert cfg.trainer.max_new_tokens == launch_ab.MAX_NEW
  config = launch_ab.model_config("tiny")
  assert (config.vocab_size, config.architecture, config.tie_word_embeddings) == (19, "qwen2", True)


def greedy_args(engine) -> SamplerArgs:
  params = SamplingParams(max_new_tokens=launch_ab.MAX_NEW, temperature=0.0, stop_token_ids=())
  return SamplerArgs.from_params(params, (), engine.config.max_stop_ids)


# suffix: the full tier (the fast tier's CLI run below holds its k = 2 to k = 1's tokens)
@pytest.mark.parametrize("arm", ["vanilla", "chain",
                                 pytest.param("suffix", marks=pytest.mark.slow)])
def test_k_steps_per_iteration_emit_the_engine_segments_tokens(arm):
  engines = launch_ab.build_engines("toy", BATCH)
  name, group = launch_ab.ARMS[arm]
  engine = engines[name]
  args = greedy_args(engine)
  fresh = lambda: launch_ab.prefilled(engine, BATCH, args, seed=0)
  steps = 8
  segment = engine.executable(("segment", BATCH, engine.config.cache_len,
                                engine.pool.stop_at(BATCH), group))
  want = segment(engine.weights(), fresh(), args, np.int32(0), np.int32(steps), np.int32(0))
  assert int(want.counters["steps"]) == steps
  k = 4  # (k = 1 and 2 against each other: the CLI's run below)
  loop = launch_ab.k_step_loop(engine.steps, group, k)
  got = loop(engine.weights(), fresh(), args, np.int32(0), np.int32(steps), np.int32(0))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens), f"{arm} k={k}")
  np.testing.assert_array_equal(np.asarray(got.num_generated), np.asarray(want.num_generated))
  assert int(got.counters["steps"]) == steps, (arm, k)


@pytest.mark.slow  # a subprocess of its own (~15 s): the loop's tokens are the fast tier's check
def test_the_smallest_run_writes_the_devices_report(tmp_path):
  out = tmp_path / "launch_ab.json"
  cmd = [sys.executable, "-m", "experiments.sd.launch_ab", "--shapes", "toy", "--batches",
         str(BATCH), "--arms", "vanilla,suffix", "--ks", "1,2", "--settings", "default",
         "--steps", "2,4", "--repeats", "1", "--temperature", "0", "--out", str(out)]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert [(w["setting"], w["shape"], w["exit"]) for w in report["workers"]] == [
      ("default", "toy", 0)]
  bucket = report["cells"]["default"]["toy"][str(BATCH)]
  for arm in ("vanilla", "suffix"):
    for k in ("1", "2"):
      entry = bucket[arm][k]
      assert entry["steps_run"] == 4 and entry["same_tokens_as_k1"] is True, (arm, k, entry)
      assert entry["ms_per_step_total"] > 0
      assert 0 < entry["hlo"]["min"]["kernels"] <= entry["hlo"]["max"]["kernels"]
      assert entry["hlo"]["iterations"] == 1 / int(k)
    executed = bucket[arm]["1"]["executed"]  # the first setting traces its first k
    assert executed["executed"] > 0, executed
  assert {(r["arm"], r["batch"]) for r in report["summary"]} == {("vanilla", BATCH),
                                                                 ("suffix", BATCH)}


def test_hlo_counts_divide_the_loop_by_its_steps_per_iteration():
  def loop(k):
    def run(x, n):
      def body(c):
        y, i = c
        for _ in range(k):
          y = jax.numpy.tanh(y @ y) + 1.0
        return y, i + k
      return jax.lax.while_loop(lambda c: c[1] < n, body, (x, 0))[0]
    return jax.jit(run).lower(jax.ShapeDtypeStruct((8, 8), "float32"),
                              jax.ShapeDtypeStruct((), "int32")).compile().as_text()
  one, two = launch_ab.hlo_counts(loop(1), 1), launch_ab.hlo_counts(loop(2), 2)
  assert one["iterations"] == 1 and two["iterations"] == 0.5
  assert one["min"] == one["max"] and one["min"]["kernels"] >= 2  # a dot and a fusion at least
  assert two["min"]["kernels"] <= one["min"]["kernels"]  # the condition is shared by 2 steps


def test_every_settings_flags_parse_in_this_jaxlib():
  """A flag XLA does not know stops JAX at start-up: the device's run would lose a worker."""
  procs = {name: subprocess.Popen(
      [sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"],
      env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for name, flags in launch_ab.SETTINGS.items() if flags}
  for name, proc in procs.items():
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "2.0", (name, err[-1000:])
