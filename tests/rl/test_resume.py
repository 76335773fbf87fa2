"""Kill-and-resume: a run SIGKILLed mid-step and resumed reaches the same parameters as an
uninterrupted run with the same seed.

The four runs share a persistent XLA compilation cache (in the test's tmp_path): the reference run
compiles, the others load the same executables instead of compiling them again (most of a tiny
run's time). What they compute is unchanged: a cache entry is keyed by the program itself."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tlt_jax.models import hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--config.task.max_digits=3", "--config.model.hidden_size=32",
        "--config.model.intermediate_size=64", "--config.model.num_layers=1",
        "--config.sft.steps=3", "--config.sft.rows=2", "--config.sft.row_len=64",
        "--config.trainer.steps=4", "--config.trainer.prompts_per_step=4",
        "--config.grpo.group_size=2", "--config.trainer.minibatches=2",
        "--config.trainer.max_new_tokens=24", "--config.trainer.eval_problems=4",
        "--config.rollout.max_batch=8", "--config.rollout.max_prompt_len=16",
        "--config.checkpoint_every=1", "--config.trainer.learning_rate=1e-3"]


def command(logdir, *extra):
  return [sys.executable, "-m", "tlt_jax.train", f"--config.logdir={logdir}", *TINY, *extra]


def env(cache_dir):
  return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
              JAX_COMPILATION_CACHE_DIR=str(cache_dir),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def final_params(logdir):
  model, _ = hf.from_pretrained(pathlib.Path(logdir) / "final_model")
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_parameters(tmp_path):
  cache = tmp_path / "xla_cache"
  reference = tmp_path / "reference"
  done = subprocess.run(command(reference), capture_output=True, text=True, timeout=600,
                        cwd=ROOT, env=env(cache))
  assert done.returncode == 0, done.stderr[-3000:]

  killed = tmp_path / "killed"
  proc = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          cwd=ROOT, env=env(cache))
  step2 = killed / "checkpoints" / "2"
  deadline = time.time() + 600
  while not step2.is_dir() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert step2.is_dir(), "the run never reached its step-2 checkpoint"
  proc.send_signal(signal.SIGKILL)  # mid step 3
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert not (killed / "final_model").exists()

  refuse = subprocess.run(command(killed), capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env(cache))
  assert refuse.returncode != 0 and "--config.resume=True" in refuse.stderr

  resumed = subprocess.run(command(killed, "--config.resume=True"), capture_output=True,
                           text=True, timeout=600, cwd=ROOT, env=env(cache))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stdout
  for a, b in zip(final_params(reference), final_params(killed)):
    np.testing.assert_array_equal(a, b)
