"""Compiling what the RL steps run before the first of them (``precompile``): the policy update's
executables, the online drafter's steps and the rollout's, with progress bars and the console's
line about them (``Precompiled.line``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from tlt_jax.job.console import say
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.utils import BACKGROUND_ENV, MIN_BACKGROUND_CORES, background_compiles_allowed, \
    mark_background, progress_bar


@dataclasses.dataclass(frozen=True)
class Precompiled:
  """What ``precompile`` compiled and how long each part took: the rollout's executables, the
  policy update's, and the drafter's steps for ``drafter_devices`` devices (0: none)."""

  rollout: int
  update: int
  drafter_devices: int
  rollout_s: float
  update_s: float
  drafter_s: float

  def line(self) -> str:
    """The console's line about it."""
    return (f"compiled {self.rollout} rollout executables in {self.rollout_s:.0f}s, "
            f"{self.update} policy-update executables in {self.update_s:.0f}s" +
            (f", the drafter's steps for {self.drafter_devices} device(s) in "
             f"{self.drafter_s:.0f}s" if self.drafter_devices else ""))


def precompile(trainer: GRPOTrainer, progress: bool = False) -> Precompiled:
  """Compiles what the RL steps run, before the first of them: the rollout's executables (and a
  cost tuner's calibration; with it, the speculative arms that the calibration says pay compile
  in a background thread and are offered once they exist, so the first step waits for
  vanilla's alone), the policy update's, and the online drafter's steps, so that the steps
  compile nothing on their critical path and their timings are the steps' own. ``progress``: a
  bar on stderr while the rollout's executables compile (they are most of the time). Returns the
  counts and seconds of each part (the job prints ``line()``)."""
  # the update's and the drafter's first: the rollout's SD arms then compile in a background
  # thread that competes with nothing else that the first step waits for
  t0 = time.perf_counter()
  if getattr(trainer.engine.config, "precompile_scope", "all") == "first_step":
    # the update runs after the first held-out evaluation and rollout: it compiles meanwhile, in a
    # background thread of the lowest priority (an update that comes first compiles what is left);
    # on a host too small for background compiles, in the first step's update
    update, n = 0, len(trainer.policy.executable_keys())
    if background_compiles_allowed():
      threading.Thread(target=_compile_in_background, args=(trainer.precompile_update,),
                       name="update-precompile").start()
      say(f"the policy update's {n} executables compile in the background "
          "(rollout.precompile_scope=first_step)")
    else:
      say(f"the policy update's {n} executables compile in the first step's update "
          "(rollout.precompile_scope=first_step)")
  else:
    with (_progress_of(len(trainer.policy.executable_keys()), "compiling the policy update")
          if progress else contextlib.nullcontext()) as advance:
      update = trainer.precompile_update(advance)
  t1 = time.perf_counter()
  if progress and trainer.online is not None:
    say("compiling the online drafter's train and eval steps ...")
  devices = trainer.precompile_drafter()
  t2 = time.perf_counter()
  bar = (_compile_bar(len(trainer.engine.executable_keys())) if progress
         else contextlib.nullcontext())
  with bar as advance:  # the SD arms compile in the background, offered once they exist
    rollout = trainer.engine.precompile(progress=advance, background=True,
                                        first_rows=trainer.first_request_rows())
  offers = getattr(trainer.engine, "offers", None)
  if offers is not None and offers.skipped and (offers.buckets or offers.prelude):
    say(f"background compiles off on this host (fewer than {MIN_BACKGROUND_CORES} cores: they "
        "would slow the steps): " + ("no SD arm is offered; " if offers.buckets else "") +
        ("rows decode in the batch buckets compiled now; " if offers.prelude else "") +
        f"{BACKGROUND_ENV}=1 turns them on")
  return Precompiled(rollout, update, devices, time.perf_counter() - t2, t1 - t0, t2 - t1)


def _compile_in_background(compile_all) -> None:
  """Runs ``compile_all()`` as background work (its compiles counted as such, at the lowest
  thread priority)."""
  mark_background()
  compile_all()


def _compile_bar(total: int):
  """A progress bar of the rollout's ``total`` executables as they compile (cleared at the end);
  yields the ``progress(done, total)`` that moves it."""
  return _progress_of(total, "compiling rollout executables")


@contextlib.contextmanager
def _progress_of(total: int, what: str):
  """A progress bar of ``total`` executables as ``what`` compiles them (cleared at the end; in a
  log file, lines); yields the ``progress(done, total)`` that moves it."""
  with progress_bar(total, what, "exe") as bar:

    def progress(done, total):
      bar.total = total
      bar.update(done - bar.n)

    yield progress
