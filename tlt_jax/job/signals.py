"""Stopping a run cleanly on SIGINT (Ctrl-C) and SIGTERM (a preemption)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class StopSignals:
  """SIGINT (Ctrl-C) and SIGTERM (what SLURM and Kubernetes send before preemption) for a run.

  Inside ``graceful()`` (the RL steps) the first signal asks the run to stop after the step in
  flight, which is then checkpointed; a second one stops at once, as either does outside it: an
  ``Interrupted`` (a ``KeyboardInterrupt``) is raised wherever the main thread is, except inside
  ``deferred()`` (a checkpoint being written), whose end it waits for. Handlers are
  installed only from the main thread, and the previous ones come back on exit.
  """

  def __init__(self):
    self.signum: int | None = None  # the signal that asked for a stop, inside graceful()
    self._graceful = False
    self._deferred = False
    self._pending: int | None = None  # a stop at once that waits for the end of deferred()
    self._old: dict = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old.clear()

  @contextlib.contextmanager
  def graceful(self):
    """Within this block a first signal only sets ``signum``."""
    self._graceful = True
    try:
      yield self
    finally:
      self._graceful = False

  @contextlib.contextmanager
  def deferred(self):
    """Within this block (a checkpoint being written) a signal that would stop the run at once
    waits for the block to end: a save is never cut in half by a second Ctrl-C."""
    self._deferred = True
    try:
      yield self
    finally:
      self._deferred = False
    pending, self._pending = self._pending, None
    if pending is not None:
      raise Interrupted(pending, f"{signal.Signals(pending).name} received")

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self._graceful and self.signum is None:
      self.signum = signum
      # os.write, not print: the main thread may be inside a print when the signal lands
      os.write(2, f"\n{name}: stopping after the step in flight, which is then saved (send "
                  f"{name} again to stop at once)\n".encode())
      return
    if self._deferred:
      if self._pending is None:
        self._pending = signum
        os.write(2, f"\n{name}: stopping once the checkpoint being written is complete\n"
                 .encode())
      return
    raise Interrupted(signum, f"{name} received")


class Interrupted(KeyboardInterrupt):
  """The run stopped on a signal; ``exit_code`` is the shell's 128 + signal number."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.exit_code = 128 + int(signum)

