"""Shared utilities: background threads' priority, progress lines in a log file."""

import io
import os
import threading

import pytest

from tlt_jax import utils


@pytest.mark.skipif(not hasattr(os, "getpriority") or not hasattr(threading, "get_native_id"),
                    reason="per-thread priorities are a Linux feature")
def test_a_background_thread_runs_at_the_lowest_priority_and_the_caller_keeps_its_own():
  """``mark_background`` lowers only its own thread's priority: background compiles take a core
  only when the steps leave it idle."""
  seen = {}

  def work():
    utils.mark_background()
    seen["niceness"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen["background"] = utils.in_background()

  mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
  thread = threading.Thread(target=work)
  thread.start()
  thread.join()
  assert seen == {"niceness": utils.BACKGROUND_NICE, "background": True}
  assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_progress_in_a_log_file_is_whole_lines_with_the_time_left(monkeypatch):
  """Where stderr is not a terminal, progress is lines (no carriage returns): one as it starts,
  then each with the count, the seconds so far and an estimate of what is left."""
  stream = io.StringIO()
  monkeypatch.setattr(utils.sys, "stderr", stream)
  bar = utils.progress_bar(4, "compiling rollout executables", "exe")
  assert isinstance(bar, utils.ProgressLines)
  bar.every = 0.0  # a line at every update
  with bar:
    bar.update(1)
    bar.update(1)
  lines = stream.getvalue().splitlines()
  assert "\r" not in stream.getvalue() and len(lines) == 3
  assert lines[0].startswith("compiling rollout executables: 0/4 exe (")
  assert lines[1].startswith("compiling rollout executables: 1/4 exe (") and "s left)" in lines[1]


def test_background_compiles_need_four_cores_unless_the_environment_says(monkeypatch):
  """``$TLT_BACKGROUND_COMPILE``: on/off force it; auto (or unset) allows background compiles on
  hosts of ``MIN_BACKGROUND_CORES`` cores or more; anything else is an error naming the choices."""
  monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
  monkeypatch.delenv(utils.BACKGROUND_ENV, raising=False)
  assert not utils.background_compiles_allowed()
  monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
  assert utils.background_compiles_allowed()
  for value, allowed in (("0", False), ("off", False), ("1", True), ("ON", True),
                         ("auto", True)):
    monkeypatch.setenv(utils.BACKGROUND_ENV, value)
    assert utils.background_compiles_allowed() == allowed, value
  monkeypatch.setenv(utils.BACKGROUND_ENV, "sometimes")
  with pytest.raises(ValueError, match="TLT_BACKGROUND_COMPILE='sometimes'"):
    utils.background_compiles_allowed()


def test_a_bar_whose_total_comes_later_starts_quietly():
  """A step's rollout bar opens with total 0 (its rows are known once the rollout starts): no
  line until it has something to say, so a log does not get one empty line per step."""
  stream = io.StringIO()
  utils.ProgressLines(0, "step 3: rollout", "row", stream=stream)
  assert stream.getvalue() == ""
  utils.ProgressLines(5, "warm start", "step", stream=stream)
  assert stream.getvalue().startswith("warm start: 0/5 step (")
