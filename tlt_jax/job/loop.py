"""The job's RL loop: held-out evaluation at the start, then each step followed by its hooks
(the drafter's selective save, a periodic held-out evaluation, the checkpoint, the metrics row
and the console line), then the final evaluation; a clean stop on a signal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from typing import Callable

import numpy as np

from tlt_jax.checkpoint import Checkpointer
from tlt_jax.job.build import Job
from tlt_jax.job.console import resume_hint, run_summary, say, step_line
from tlt_jax.job.run_dir import MetricsLog
from tlt_jax.job.signals import Interrupted, StopSignals
from tlt_jax.rl.rewards import task_scorer
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rl.update import NonFiniteUpdateError
from tlt_jax.utils import progress_bar


def _evaluate(trainer: GRPOTrainer) -> dict[str, float]:
  """The held-out figures at the trainer's step: ``eval_accuracy`` (greedy),
  ``eval_sampled_reward`` and, with ``eval_pass_k``, ``eval_pass_at_<k>``."""
  t0 = time.perf_counter()
  config = trainer.config
  n, k = config.eval_problems, config.eval_pass_k
  m = min(config.eval_pass_problems, config.eval_problems)
  out = {}
  rows = 2 * n + k * m
  with progress_bar(rows, f"held-out evaluation at step {trainer.step_count}", "row") as bar:
    out["eval_accuracy"] = trainer.evaluate(progress=lambda done, _: bar.update(done - bar.n))
    out["eval_sampled_reward"] = trainer.evaluate(
        temperature=config.temperature, progress=lambda done, _: bar.update(n + done - bar.n))
    if k:
      out[f"eval_pass_at_{k}"] = float(np.mean(trainer.pass_at(
          k, m, progress=lambda done, _: bar.update(2 * n + done - bar.n))))
  passed = f", pass@{k} {out[f'eval_pass_at_{k}']:.3f} ({m} problems)" if k else ""
  say(f"held-out at step {trainer.step_count} ({n} problems, {time.perf_counter() - t0:.0f}s): "
      f"greedy accuracy {out['eval_accuracy']:.3f}, sampled reward "
      f"{out['eval_sampled_reward']:.3f}{passed}")
  return out


def every(n: int) -> Callable[[int], bool]:
  """A hook's ``due`` for every ``n`` steps (0: never)."""
  return lambda step: bool(n) and step % n == 0


def evaluation_due(config: TrainerConfig, step: int) -> bool:
  """Whether step ``step`` (just taken) is followed by a periodic held-out evaluation: every
  ``eval_every`` steps, but not after the last one (the final evaluation covers it)."""
  return every(config.eval_every)(step) and step < config.steps


def checkpoint_due(job: Job, step: int) -> bool:
  """Whether step ``step`` (just taken) is checkpointed: every ``checkpoint_every`` steps (0:
  never in between), and always the last one."""
  return every(job.checkpoint_every)(step) or step == job.trainer.steps


def _interrupted(e: KeyboardInterrupt, doing: str, checkpointer: Checkpointer,
                 job: Job) -> Interrupted:
  """A stop at once (a second signal, or a plain KeyboardInterrupt) in the RL phase: where it
  hit, what is saved, and the command that goes on from there."""
  latest = checkpointer.latest_step()
  where = (f"the last checkpoint is step {latest}" if latest is not None
           else "no checkpoint was written yet, so the run starts over with its config")
  return Interrupted(getattr(e, "exit_code", 130) - 128,
                     f"interrupted {doing}; {where}; {resume_hint(job)}")


def _nonfinite_advice(e: NonFiniteUpdateError, checkpointer: Checkpointer,
                      job: Job) -> NonFiniteUpdateError:
  """A non-finite update, with what to do about it: the command that resumes from the last
  checkpoint (or runs again, before the first) with a setting that avoids it."""
  latest = checkpointer.latest_step()
  then = (f"resume from step {latest}: {resume_hint(job)}" if latest is not None else
          "run the job again (no checkpoint was written yet, so it starts over)")
  return NonFiniteUpdateError(
      f"{e}; nothing non-finite was saved. To go on, {then} and add "
      "--config.trainer.on_nonfinite=skip (drops such updates) or a lower "
      "--config.trainer.learning_rate")


def train_steps(trainer: GRPOTrainer, job: Job, checkpointer: Checkpointer, log: MetricsLog,
                drafter_ckpt: Checkpointer | None = None, stop: StopSignals | None = None) -> dict:
  """The RL phase: the held-out evaluation at the start, the steps (``Steps.step``) until
  ``trainer.steps`` or a stop signal, then the final evaluation; returns the run's summary.

  A first signal stops after the step in flight, which is saved (``Interrupted``, with the
  command that resumes); a second one stops at once, as does a non-finite update, each saying
  what is saved and how to go on."""
  steps = Steps(trainer, job, checkpointer, log, drafter_ckpt, stop or StopSignals())
  try:
    start = steps.evaluate_at_start()
    with steps.stop.graceful():
      while trainer.step_count < job.trainer.steps and steps.stop.signum is None:
        steps.step()
    stopped = steps.stop.signum is not None and trainer.step_count < job.trainer.steps
    if stopped and steps.saved_step != trainer.step_count:  # the step in flight at the signal
      steps.save()
    if not stopped:
      steps.doing = f"after step {trainer.step_count}, during the final held-out evaluation"
      end = steps.evaluate()
  except NonFiniteUpdateError as e:
    raise _nonfinite_advice(e, checkpointer, job) from None
  except KeyboardInterrupt as e:  # a second signal: at once
    raise _interrupted(e, steps.doing, checkpointer, job) from None
  if stopped:
    raise Interrupted(steps.stop.signum, f"stopped by {signal.Signals(steps.stop.signum).name} "
                      f"after step {trainer.step_count}, saved as "
                      f"{checkpointer.step_dir(trainer.step_count)}; {resume_hint(job)}")
  return run_summary(steps, start, end)


@dataclasses.dataclass(frozen=True)
class Hook:
  """What runs after an RL step: ``run(metrics)`` (which may add to the step's metrics) after
  every step whose number ``due`` accepts."""

  due: Callable[[int], bool]
  run: Callable[[dict], None]


@dataclasses.dataclass
class Steps:
  """The RL steps of a run and where their results go: the metrics ``log``, the checkpoints and
  the drafter's selective saves (``drafter_ckpt``, None: none). ``doing`` says what a second
  signal would interrupt (for its message); ``saved_step`` is the step last checkpointed;
  ``history`` and ``lengths`` collect each step's metrics and its rollout's lengths; ``hooks``
  run after each step, in order (None: ``default_hooks``)."""

  trainer: GRPOTrainer
  job: Job
  checkpointer: Checkpointer
  log: MetricsLog
  drafter_ckpt: Checkpointer | None
  stop: StopSignals
  doing: str = "during the held-out evaluation at the start"
  saved_step: int | None = None
  history: list[dict] = dataclasses.field(default_factory=list)
  lengths: list[int] = dataclasses.field(default_factory=list)
  hooks: list[Hook] | None = None

  def __post_init__(self):
    if self.hooks is None:
      self.hooks = self.default_hooks()

  def default_hooks(self) -> list[Hook]:
    """After each step, in this order: the drafter's selective save (every
    ``drafter_save_every`` steps), a periodic held-out evaluation (before the checkpoint, whose
    step row it joins), the checkpoint, then the metrics row and the console line."""
    job, hooks = self.job, []
    if self.drafter_ckpt is not None:
      hooks.append(Hook(every(job.drafter_save_every), self.save_drafter))
    return hooks + [Hook(functools.partial(evaluation_due, job.trainer), self.evaluate_step),
                    Hook(functools.partial(checkpoint_due, job), self.save),
                    Hook(lambda step: True, self.write_row)]

  def evaluate_at_start(self) -> dict[str, float]:
    """The held-out figures before the first RL step: evaluated now on a new run; on a resume,
    read back from step 0's row of the log (NaN where it has none)."""
    if self.trainer.step_count > 0:  # a resume: an earlier run evaluated the start
      earlier = [r for r in self.log.rows() if r.get("step") == 0 and "eval_accuracy" in r]
      return ({k: v for k, v in earlier[0].items() if k.startswith("eval_")} if earlier
              else {"eval_accuracy": float("nan"), "eval_sampled_reward": float("nan")})
    return self.evaluate(reward_scorer=task_scorer(self.job.task))  # saved in the first row

  def evaluate(self, **saved) -> dict[str, float]:
    """The held-out figures at the trainer's step (``_evaluate``), written to that step's row of
    the log (with ``saved``)."""
    figures = _evaluate(self.trainer)
    self.log.write(self.trainer.step_count, {**figures, **saved})
    return figures

  def step(self) -> None:
    """One RL step, then its ``hooks`` that are due."""
    trainer = self.trainer
    self.doing = f"during step {trainer.step_count + 1}"
    with _step_progress(trainer):
      m = trainer.step()
    self.doing = f"after step {trainer.step_count}, before it was logged"
    self.history.append(m)
    self.lengths.extend(trainer.last_lengths.tolist())
    for hook in self.hooks:
      if hook.due(trainer.step_count):
        hook.run(m)

  def save_drafter(self, m: dict) -> None:
    """The drafter alone, written while training goes on (an unchanged drafter is not saved
    again); ``m`` gets the milliseconds the step waited."""
    waited = self.trainer.online.selective_save(self.drafter_ckpt, self.trainer.step_count)
    if waited is not None:
      m["drafter_save_ms"] = 1e3 * waited

  def evaluate_step(self, m: dict) -> None:
    """The held-out figures after the step, into its metrics ``m``."""
    self.doing = f"after step {self.trainer.step_count}, during its held-out evaluation"
    m.update(_evaluate(self.trainer))

  def write_row(self, m: dict) -> None:
    """The step's metrics row and its console line."""
    self.log.write(m["step"], m)
    say(step_line(m, self.job.trainer.steps))

  def save(self, m: dict | None = None) -> None:
    """Checkpoints everything at the trainer's step, blocking; a signal meanwhile waits for the
    save to end (a save is never cut short). ``m``, if given, gets the save's milliseconds."""
    self.doing = f"after step {self.trainer.step_count} was saved"
    t0 = time.perf_counter()
    with self.stop.deferred():
      self.trainer.save(self.checkpointer, {"config": self.job.cfg.to_dict()})
      if m is not None:
        m["checkpoint_save_ms"] = 1e3 * (time.perf_counter() - t0)
      self.saved_step = self.trainer.step_count


SLOW_STEP_S = 10.0  # a step that has run this long says when its policy update begins


@contextlib.contextmanager
def _step_progress(trainer: GRPOTrainer):
  """Progress of the step in flight: a bar (lines in a log file) of its rollout's rows, and a
  line when the policy update begins, where the step has run ``SLOW_STEP_S`` by then (a real
  model's step takes minutes on a CPU; the tiny jobs' say nothing more)."""
  step, t0 = trainer.step_count + 1, time.perf_counter()
  with progress_bar(0, f"step {step}: rollout", "row") as bar:

    def tell(phase: str, done: int, total: int) -> None:
      if phase == "rollout":
        bar.total = total
        bar.update(done - bar.n)
      elif time.perf_counter() - t0 > SLOW_STEP_S:
        say(f"step {step}: rollout done in {time.perf_counter() - t0:.0f}s, updating the "
            "policy ...")

    trainer.step_progress = tell
    try:
      yield
    finally:
      trainer.step_progress = None
