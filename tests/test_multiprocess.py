"""The main job over several processes (``jax.distributed`` on one machine, CPU collectives over
gloo), started with ``python -m tlt_jax.launch``: 2 processes x 2 simulated devices against
1 process x 4 devices, with the same seed.

- The default job: killed mid-run (SIGKILL of process 1), the launcher stops process 0 with a
  line naming the dead one, and ``--config.resume=True`` continues on both; the whole run logs
  the same tokens (``rollout_digest``), rewards and lengths, step for step, as the uninterrupted
  one-process run, and losses within float tolerance (the update's all-reduce sums in another
  order), and ends with the same weights.
  The two-process run's update is FSDP-sharded (``config.fsdp=2``, within each process): the
  same losses as the replicated update, from checkpoints of sharded params and optimizer state.
- ``drafter=eagle``: each process trains its drafter on its own idle devices and rows, the
  drafters are averaged after every step; with coupled verification the tokens are the vanilla
  ones whatever the drafter, so they must equal the one-process run's too.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_train_job import tiny_flags
from tests.xla_env import subprocess_env
from tlt_jax.rl.data import metric_kind

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the main-job tests' tiny sizes, on one-digit sums with a longer warm start, so the rewards
# (and the losses) are not all zero
FLAGS = {**tiny_flags(), "task.max_digits": 1, "sft.steps": 60, "sft.rows": 8,
         "sft.learning_rate": 0.01, "trainer.steps": 4, "trainer.prompts_per_step": 8,
         "grpo.group_size": 4, "checkpoint_every": 2}
EAGLE = {"drafter": "eagle", "drafter_training.rows": 2, "drafter_training.seq_len": 32,
         "rollout.verify": "coupled", "rollout.tuner.kind": "fixed",
         "rollout.tuner.fixed": '((2, "chain d3"), (8, "vanilla"))'}
EXACT = ("reward", "rollout_digest", "len_p50", "len_p90", "len_max", "eval_accuracy",
         "eval_sampled_reward")  # (an accepted length follows the drafter: not with eagle)
CLOSE = ("loss", "grad_norm", "clip_frac")


def args(logdir, flags: dict, *extra) -> list[str]:
  return [f"--config.logdir={logdir}", *[f"--config.{k}={v}" for k, v in flags.items()], *extra]


def one_process(logdir, flags: dict) -> None:
  done = subprocess.run([sys.executable, "-m", "tlt_jax.train", *args(logdir, flags)], cwd=ROOT,
                        env=subprocess_env(4),
                        capture_output=True, text=True, timeout=900, check=False)
  assert done.returncode == 0, done.stderr[-3000:]


def launched(logdir, flags: dict, *extra, kill_at: int | None = None):
  """``python -m tlt_jax.launch --processes 2 --devices-per-process 2``; ``kill_at``: SIGKILL
  process 1 once step ``kill_at`` is logged. Returns (returncode, output, seconds from the kill
  to the launcher's exit)."""
  command = [sys.executable, "-m", "tlt_jax.launch", "--processes", "2", "--devices-per-process",
             "2", "--", *args(logdir, flags, *extra)]
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=subprocess_env())
  lines, killed_at = [], None
  try:
    for line in proc.stdout:
      lines.append(line)
      if kill_at is not None and killed_at is None and line.startswith(f"step {kill_at:4d}/"):
        pids = re.search(r"launch: 2 processes \(pids (\d+), (\d+)\)", "".join(lines))
        os.kill(int(pids[2]), signal.SIGKILL)
        killed_at = time.monotonic()
    proc.wait(timeout=900)
  finally:
    proc.kill()
  waited = None if killed_at is None else time.monotonic() - killed_at
  return proc.returncode, "".join(lines), waited


def step_rows(logdir) -> list[dict]:
  return [json.loads(line) for line in (pathlib.Path(logdir) / "metrics.jsonl").open()]


def assert_same_run(rows, reference) -> None:
  assert [r["step"] for r in rows] == [r["step"] for r in reference]
  for row, ref in zip(rows, reference):
    for key in EXACT:
      assert row.get(key) == ref.get(key), (row["step"], key, row.get(key), ref.get(key))
    for key in CLOSE:
      if key in ref:
        assert row[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (row["step"], key)
  assert any(r.get("loss") for r in reference), "a run whose losses are all 0 shows nothing"


def final_params(logdir) -> list[np.ndarray]:
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  tensors = load_file(pathlib.Path(logdir) / "final_model" / "model.safetensors")
  return [tensors[k] for k in sorted(tensors)]


@pytest.mark.slow
def test_two_processes_killed_and_resumed_reproduce_one_process_on_four_devices(tmp_path):
  one_process(tmp_path / "one", FLAGS)
  reference = step_rows(tmp_path / "one")

  run = tmp_path / "two"  # and its update FSDP-sharded over each process's two devices
  fsdp = {**FLAGS, "fsdp": 2}
  rc, out, waited = launched(run, fsdp, kill_at=3)
  assert rc != 0 and waited is not None
  assert "launch: process 1 was killed by SIGKILL while the others still ran; stopping them" in out
  assert waited < 60, f"process 0 went on for {waited:.0f}s after process 1 died"
  assert (run / "checkpoints" / "2").is_dir() and not (run / "final_model").exists()

  rc, out, _ = launched(run, fsdp, "--config.resume=True")
  assert rc == 0, out[-3000:]
  assert f"resumed from {run / 'checkpoints' / '2'}" in out
  assert out.count("step    4/4") == 1  # process 0 alone speaks
  assert_same_run(step_rows(run), reference)
  for a, b in zip(final_params(run), final_params(tmp_path / "one")):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

  # a layout reproduces itself bit for bit: an uninterrupted 2 x 2 run logs every untimed metric
  # (losses included) and ends with the weights of the killed and resumed one
  rc, out, _ = launched(tmp_path / "two_again", fsdp)
  assert rc == 0, out[-3000:]
  untimed = lambda rows: [{k: v for k, v in r.items() if metric_kind(k) != "timed"} for r in rows]
  assert untimed(step_rows(tmp_path / "two_again")) == untimed(step_rows(run))
  for a, b in zip(final_params(run), final_params(tmp_path / "two_again")):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_two_processes_with_the_online_drafter_sample_what_one_process_samples(tmp_path):
  flags = {**FLAGS, **EAGLE, "trainer.steps": 2, "checkpoint_every": 2, "rollout.max_batch": 4}
  one_process(tmp_path / "one", flags)
  rc, out, _ = launched(tmp_path / "two", flags)
  assert rc == 0, out[-3000:]
  rows = step_rows(tmp_path / "two")
  assert_same_run(rows, step_rows(tmp_path / "one"))
  steps = [r for r in rows if "reward" in r]
  assert all("drafter_sync_s" in r for r in steps)  # the processes' drafters were averaged
  assert sum(r["drafter_spot_steps"] for r in steps) > 0  # trained on the idle devices
  # one buffer file per process beside the arrays, and a drafter that loads
  assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "2").glob("drafter_buffer*")
                ) == ["drafter_buffer.process0.npz", "drafter_buffer.process1.npz"]
  assert (tmp_path / "two" / "final_drafter").is_dir()


def test_an_fsdp_size_that_does_not_divide_the_devices_is_a_config_error(tmp_path):
  from tests.test_train_job import tiny_config  # pylint: disable=import-outside-toplevel
  from tlt_jax.job.build import job_devices  # pylint: disable=import-outside-toplevel
  from tlt_jax.job.typed_config import ConfigError  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(tmp_path, fsdp=3)
  with pytest.raises(ConfigError, match=r"config.fsdp: .*use one of \[1\]"):
    job_devices(cfg)
