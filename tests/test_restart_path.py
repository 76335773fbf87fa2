"""The path a user takes after something went wrong: every stop prints advice that
works as printed, and a logdir never mixes two runs' files.

- A stop before the first checkpoint (a double Ctrl-C in step 2 with ``checkpoint_every=0``, or
  Ctrl-C in the warm start) leaves the run's ``config.json``; the printed resume command starts
  the run over with it, and moves the attempt's files (config, metrics, events) to
  ``<logdir>/leftovers-<time>/``, named in a line.
- A new run into a logdir with such leftovers moves them aside the same way.

The fast tests drive the job in this process (signals sent to itself); the full tier's test
stops real command-line runs and runs the advice exactly as printed.
"""

import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.test_train_job import tiny_config, tiny_flags
from tests.xla_env import subprocess_env
from tlt_jax import train
from tlt_jax.job import runner
from tlt_jax.job.run_dir import LEFTOVERS, set_aside_leftovers
from tlt_jax.job.signals import Interrupted
from tlt_jax.rl.trainer import GRPOTrainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
ADVICE = re.compile(r"continue with: (python -m tlt_jax\.train .*--config\.resume=True)")


def files(logdir) -> list[str]:
  """The logdir's entries, the tensorboard events file by its kind, and the set-asides' contents
  (``leftovers/...``)."""
  out = []
  for p in sorted(pathlib.Path(logdir).iterdir()):
    name = "events" if p.name.startswith("events.out.tfevents") else p.name
    if p.name.startswith(LEFTOVERS):
      out += [f"leftovers/{'events' if q.name.startswith('events.out') else q.name}"
              for q in sorted(p.iterdir())]
    else:
      out.append(name)
  return sorted(out)


def steps_logged(logdir) -> list[int]:
  return [json.loads(line)["step"] for line in (pathlib.Path(logdir) / "metrics.jsonl").open()]


def test_a_double_ctrl_c_before_the_first_checkpoint_advises_a_resume_that_starts_over(
    tmp_path, monkeypatch, capsys):
  logdir = tmp_path / "run"
  cfg = tiny_config(logdir, checkpoint_every=0)  # only the last step is saved
  real_step = GRPOTrainer.step

  def ctrl_c_twice_in_step_2(self):
    if self.step_count == 1:  # the first asks to stop after step 2, the second stops at once
      os.kill(os.getpid(), signal.SIGINT)
      os.kill(os.getpid(), signal.SIGINT)
    return real_step(self)

  monkeypatch.setattr(GRPOTrainer, "step", ctrl_c_twice_in_step_2)
  with pytest.raises(Interrupted) as e:
    train.run(cfg)
  monkeypatch.undo()
  assert e.value.exit_code == 130
  assert str(e.value) == (
      "interrupted during step 2; no checkpoint was written yet, so the run starts over with "
      f"its config; continue with: python -m tlt_jax.train --config.logdir={logdir} "
      "--config.resume=True")
  before = files(logdir)
  assert before == ["config.json", "events", "metrics.jsonl"], before
  assert steps_logged(logdir) == [0, 1]

  capsys.readouterr()
  resumed = tiny_config(logdir, resume=True)  # what the advised command does
  summary = train.run(resumed, overrides=[])
  out = capsys.readouterr().out
  assert summary["finished"] and summary["step"] == 2
  assert f"{logdir}'s run stopped before its first checkpoint: it starts over with its saved " \
         "config" in out, out[-2000:]
  aside = next(logdir.glob(f"{LEFTOVERS}*"))
  assert (f"{logdir} held files of an earlier attempt but no checkpoint: moved them to "
          f"{aside}") in out, out[-2000:]
  assert files(logdir) == ["checkpoints", "config.json", "events", "final_model",
                           *[f"leftovers/{name}" for name in before], "metrics.jsonl"]
  assert steps_logged(logdir) == [0, 1, 2, 2]  # one run: never [0, 0, 1, 2, 2]
  assert steps_logged(aside) == [0, 1]


def test_ctrl_c_in_the_warm_start_says_nothing_was_saved_and_how_to_go_on(tmp_path, monkeypatch):
  logdir = tmp_path / "run"

  def interrupted_warm_start(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # the handler raises in here
    raise AssertionError("the signal did not stop the warm start")

  monkeypatch.setattr(runner, "warm_start", interrupted_warm_start)
  with pytest.raises(Interrupted) as e:
    train.run(tiny_config(logdir))
  assert e.value.exit_code == 130
  assert str(e.value) == (
      "SIGINT received during the warm start: nothing was saved but the run's config.json, so "
      f"the run starts over; continue with: python -m tlt_jax.train --config.logdir={logdir} "
      "--config.resume=True")
  assert files(logdir) == ["config.json"]


def test_a_new_run_sets_an_earlier_attempts_files_aside_and_a_refused_one_moves_nothing(
    tmp_path, capsys, monkeypatch):
  logdir = tmp_path / "run"
  logdir.mkdir()
  (logdir / "metrics.jsonl").write_text('{"step": 0}\n')
  (logdir / "config.json").write_text("{}\n")
  (logdir / "events.out.tfevents.1.host").write_bytes(b"x")
  bad = tiny_config(logdir)
  bad.trainer.steps = -1
  with pytest.raises(Exception, match="steps"):  # refused: the logdir is left as it was
    train.run(bad)
  assert files(logdir) == ["config.json", "events", "metrics.jsonl"]

  def stop(*args, **kwargs):
    raise RuntimeError("stopped once the run had set things up")
  monkeypatch.setattr(runner, "init_model", stop)
  with pytest.raises(RuntimeError, match="stopped once"):
    train.run(tiny_config(logdir))
  aside = next(logdir.glob(f"{LEFTOVERS}*"))
  assert (f"{logdir} held files of an earlier attempt but no checkpoint: moved them to "
          f"{aside}") in capsys.readouterr().out
  assert files(logdir) == ["config.json", "leftovers/config.json", "leftovers/events",
                           "leftovers/metrics.jsonl"]
  assert json.loads((aside / "config.json").read_text()) == {}  # the old one, moved whole
  # a second set-aside gets a directory of its own and leaves the first alone
  second = set_aside_leftovers(logdir)
  assert second is not None and second != aside and sorted(
      p.name for p in second.iterdir()) == ["config.json"]
  assert set_aside_leftovers(logdir) is None  # nothing left to move


def launch(logdir, flags: dict, *, until: str, where: str = "stdout", signals: int = 1,
           timeout: float = 600):
  """Starts the job's command line; once ``until`` shows in its stdout (or its stderr file),
  sends SIGINT (``signals=2``: twice, a double Ctrl-C). Returns (returncode, stdout, stderr)."""
  err_path = pathlib.Path(f"{logdir}.stderr")
  with open(err_path, "w", encoding="utf-8") as err:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_jax.train", f"--config.logdir={logdir}",
         *[f"--config.{k}={v}" for k, v in flags.items()]],
        stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=subprocess_env(1))
    lines, deadline = [], time.time() + timeout
    try:
      if where == "stdout":
        for line in proc.stdout:
          lines.append(line)
          if line.startswith(until) or time.time() > deadline:
            break
      else:
        while until not in err_path.read_text(encoding="utf-8") and time.time() < deadline:
          time.sleep(0.2)
      if signals == 2:
        time.sleep(0.05)  # into the next step
      proc.send_signal(signal.SIGINT)
      if signals == 2:  # the second once the first was handled (two at once may merge into one)
        while "stopping after the step in flight" not in err_path.read_text(encoding="utf-8"):
          assert time.time() < deadline and proc.poll() is None
          time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
      out, _ = proc.communicate(timeout=120)
    finally:
      proc.kill()
  return proc.returncode, "".join(lines) + out, err_path.read_text(encoding="utf-8")


def run_advice(stderr: str, logdir) -> str:
  """Runs the command the last line of ``stderr`` advises, exactly as printed; its stdout."""
  command = ADVICE.search(stderr.strip().splitlines()[-1])
  assert command, stderr[-2000:]
  argv = shlex.split(command[1])
  assert argv[:3] == ["python", "-m", "tlt_jax.train"] and f"--config.logdir={logdir}" in argv
  done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, cwd=ROOT,
                        env=subprocess_env(1), timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.mark.slow
def test_the_command_lines_advice_after_a_stop_before_any_checkpoint_works_as_printed(tmp_path):
  """A real double Ctrl-C in step 2 (no checkpoint: ``checkpoint_every=0``) and a real Ctrl-C in
  the warm start: one line of advice each, which, run as printed, finishes the run with one
  run's files."""
  flags = {**tiny_flags(), "trainer.steps": 40, "checkpoint_every": 0}  # a save: at the end
  logdir = tmp_path / "twice"
  rc, out, err = launch(logdir, flags, until="step    1/40", signals=2)
  assert rc == 130 and "Traceback" not in err, err[-3000:]
  # where the signals land is timing: the first in step 2 (or before it began), the second in it
  # or while the first one's stop saves the last step done; the in-process test above pins
  # the case of both in step 2
  last = err.strip().splitlines()[-1]
  hit = re.fullmatch(
      r"interrupted (during step \d+|after step \d+, before it was logged|after step \d+ was "
      r"saved); (no checkpoint was written yet, so the run starts over with its config|the last "
      rf"checkpoint is step \d+); continue with: python -m tlt_jax\.train "
      rf"--config\.logdir={re.escape(str(logdir))} --config\.resume=True", last)
  assert hit, err[-2000:]
  before = files(logdir)
  out = run_advice(err, logdir)
  if hit[2].startswith("no checkpoint"):
    assert before == ["config.json", "events", "metrics.jsonl"], before
    assert "it starts over with its saved config" in out and "moved them to" in out, out[-2000:]
    assert files(logdir) == ["checkpoints", "config.json", "events", "final_model",
                             *[f"leftovers/{name}" for name in before], "metrics.jsonl"]
  else:
    assert f"resumed from {logdir / 'checkpoints'}" in out, out[-2000:]
  assert steps_logged(logdir) == [*range(41), 40]  # one run's rows: each step once

  logdir = tmp_path / "warm"  # a warm start of some seconds, stopped as soon as it begins
  rc, out, err = launch(logdir, {**flags, "trainer.steps": 3, "sft.steps": 2000},
                        until="warm start", where="stderr")
  assert rc == 130 and "Traceback" not in err, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      "SIGINT received during the warm start: nothing was saved but the run's config.json, so "
      f"the run starts over; continue with: python -m tlt_jax.train --config.logdir={logdir} "
      "--config.resume=True"), err[-2000:]
  assert files(logdir) == ["config.json"]
  out = run_advice(err, logdir)  # the saved config's 2000 warm-start steps, then RL
  assert "warm start: 2000 steps" in out and "moved them to" in out, out[-2000:]
  assert files(logdir) == ["checkpoints", "config.json", "events", "final_model",
                           "leftovers/config.json", "metrics.jsonl"]


def snapshot(logdir) -> dict:
  """Every file under ``logdir`` with its size and modification time."""
  return {str(p.relative_to(logdir)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in sorted(pathlib.Path(logdir).rglob("*")) if p.is_file()}


def test_a_resume_that_changes_the_models_shape_names_the_flag_before_loading_anything(
    tmp_path, monkeypatch):
  logdir = tmp_path / "run"
  cfg = tiny_config(logdir)
  cfg.trainer.steps = 1
  train.run(cfg)
  before = snapshot(logdir)
  real_init = runner.init_model

  def refuse(*args, **kwargs):
    raise AssertionError("the resume built a model before checking its overrides")

  monkeypatch.setattr(runner, "init_model", refuse)
  for name, value, saved in (("model.hidden_size", 64, 32), ("drafter", "ngram", "none")):
    again = tiny_config(logdir, resume=True)
    section, _, field = name.rpartition(".")
    (again[section] if section else again)[field] = value
    with pytest.raises(Exception) as e:
      train.run(again, overrides=[name])
    assert str(e.value) == (
        f"--config.{name}={value!r} conflicts with the run's saved config ({name}={saved!r}): "
        "its checkpoints hold arrays made for the saved value. "
        f"Drop --config.{name} to resume the run, or start a new run with it in another "
        "--config.logdir")
    assert snapshot(logdir) == before  # refused: nothing written
  monkeypatch.setattr(runner, "init_model", real_init)
  again = tiny_config(logdir, resume=True)  # the advice: the same resume without the override
  again.trainer.steps = 2
  assert train.run(again, overrides=["trainer.steps"])["step"] == 2


@pytest.mark.parametrize("damage", ["garbled", pytest.param("missing", marks=pytest.mark.slow)])
def test_a_damaged_config_json_is_taken_from_the_checkpoint_and_written_again(
    tmp_path, capsys, damage):
  logdir = tmp_path / "run"
  cfg = tiny_config(logdir)
  cfg.trainer.steps = 1
  train.run(cfg)
  good = (logdir / "config.json").read_text()
  if damage == "garbled":
    (logdir / "config.json").write_text('{"trainer": {"steps": 1')  # cut short
  else:
    (logdir / "config.json").unlink()
  capsys.readouterr()
  again = tiny_config(logdir, resume=True)
  again.trainer.steps = 2
  assert train.run(again, overrides=["trainer.steps"])["step"] == 2
  out = capsys.readouterr().out
  assert f"resuming {logdir} with the config in its checkpoint of step 1 (" in out, out[:2000]
  assert "config.json is written again from it once the checkpoint is restored)" in out
  # the checkpoint's config, with the override: the file a clean resume would have written
  assert json.loads((logdir / "config.json").read_text()) == {
      **json.loads(good), "trainer": {**json.loads(good)["trainer"], "steps": 2}}


def test_a_signal_during_a_save_waits_for_the_save_then_stops():
  """``StopSignals.deferred()`` (around every checkpoint save): a signal that would stop the run
  at once is held until the block ends, so a second Ctrl-C never leaves half a checkpoint."""
  from tlt_jax.job.signals import StopSignals  # pylint: disable=import-outside-toplevel
  finished = []
  with StopSignals() as stop:
    with pytest.raises(Interrupted, match="^SIGINT received$") as e:
      with stop.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler has run by now
        finished.append("the save")
    assert e.value.exit_code == 130
  assert finished == ["the save"]


def test_a_second_signal_during_the_steps_stops_at_once_and_the_handlers_come_back():
  """``StopSignals.graceful()`` (around the RL steps): the first SIGTERM only asks for a stop
  after the step in flight (``signum``); a second one raises at once (exit code 128 + 15); on
  leaving, the previous handlers are back."""
  from tlt_jax.job.signals import StopSignals  # pylint: disable=import-outside-toplevel
  before = signal.getsignal(signal.SIGTERM)
  with StopSignals() as stop:
    with pytest.raises(Interrupted, match="^SIGTERM received$") as e:
      with stop.graceful():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler has run by now
        assert stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        raise AssertionError("a second SIGTERM did not stop the steps")
    assert e.value.exit_code == 143
  assert signal.getsignal(signal.SIGTERM) is before
