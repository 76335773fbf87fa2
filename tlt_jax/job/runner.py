"""Running the main job: warm start, the GRPO steps with checkpoints and a clean stop on a
signal, held-out evaluations, the final exports, and the console's lines about all of it.

The config has been turned into a ``Job`` (``build.py``) and the run directory opened
(``run_dir.py``) before any of the work here starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from typing import Iterable

import jax
import ml_collections
import numpy as np

from tlt_jax import hosts
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.job.build import Job, build_job, check_top_level, describe, distributed_fields, \
    step_devices, update_devices
from tlt_jax.job.console import describe_rl, resume_hint, say
from tlt_jax.job.loop import train_steps
from tlt_jax.job.precompile import precompile
from tlt_jax.job.run_dir import CHECKPOINTS, DRAFTER_CHECKPOINTS, FINAL_MODEL, MetricsLog, \
    choose_logdir, export_final_drafter, export_final_model, export_final_speculators, open_run, \
    save_run_config, set_aside_leftovers
from tlt_jax.job.signals import Interrupted, StopSignals
from tlt_jax.models.load import from_pretrained
from tlt_jax.models.instances import with_compute_dtype
from tlt_jax.models.drafter_io import drafter_policy_mismatch
from tlt_jax.models.transformer import Transformer, init_model
from tlt_jax.rl.data import held_out_line
from tlt_jax.rl.mesh import make_mesh
from tlt_jax.rl.rewards import task_scorer
from tlt_jax.rl.sft import warm_start
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.utils import progress_bar


def run(cfg: ml_collections.ConfigDict, overrides: Iterable[str] | None = None) -> dict:
  """Runs (or resumes) warm start + GRPO for a config; returns a summary.

  On resume (``cfg.resume``), the run's saved config is used, except the fields named in
  ``overrides`` (``None``: every field where ``cfg`` differs from it). Every check that needs no
  model comes first; a resumed run writes nothing until its checkpoint has been restored.
  SIGINT/SIGTERM during the RL steps stop the run after the step in flight, saved (see
  ``StopSignals``).
  """
  job, latest, devices = _open_job(cfg, overrides)
  cfg, logdir = job.cfg, job.logdir  # the run's config, kept to be saved
  if job.resume and latest >= job.trainer.steps and (logdir / FINAL_MODEL).is_dir():
    return _nothing_to_do(job, logdir, latest)
  if not job.resume and hosts.is_primary():
    if (aside := set_aside_leftovers(logdir)) is not None:  # never two runs' files in one logdir
      say(f"{logdir} held files of an earlier attempt but no checkpoint: moved them to {aside}")
    save_run_config(cfg, logdir)
  mesh = _update_mesh(job.fsdp, devices)
  with StopSignals() as stop:
    t_start = time.perf_counter()
    trainer = set_up_trainer(job, latest, mesh)
    describe_rl(trainer, job)
    summary, log, checkpointer = _restore_and_train(trainer, job, logdir, latest, stop)
    summary["wall_s"] = time.perf_counter() - t_start
    final, extra = export_run(trainer, job, logdir)
    hosts.barrier("exported")  # no process ends before the run's files are complete
  say(f"results: metrics {log.path}, tensorboard --logdir {logdir}, checkpoints "
      f"{checkpointer.directory}, final model {final}{extra}")
  hosts.shutdown()
  return summary


def _open_job(cfg: ml_collections.ConfigDict, overrides: Iterable[str] | None
              ) -> tuple[Job, int | None, list]:
  """The run's ``Job`` (of a copy of ``cfg``; on resume of the saved config with
  ``overrides``), its latest checkpoint step and devices, every check that needs no model done,
  and the config printed. A multi-process run joins the others here, before any other JAX
  call."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # never mutate the caller's config
  check_top_level(cfg)
  logdir = choose_logdir(cfg)
  joining = distributed_fields(cfg)  # the Job's part that is needed before any JAX call
  if joining.distributed:  # several processes, from the environment; before any other JAX call
    hosts.initialize(timeout_s=joining.distributed_timeout_s)
  cfg, latest, note = open_run(cfg, logdir, overrides)
  if note:
    say(note)
  job = build_job(cfg, keys_checked=True)  # the same keys as checked above
  devices = update_devices(job.mesh_devices, job.fsdp)
  job = dataclasses.replace(job, step_devices=step_devices(job, devices))  # the trainer's too
  say(f"config:\n{describe(cfg)}")
  say(held_out_line(job.task, job.trainer.eval_problems))  # whether held-out is training data
  say(f"reward: {task_scorer(job.task)}")  # math_verify or not: rewards differ by install
  return job, latest, devices


def _nothing_to_do(job: Job, logdir: pathlib.Path, latest: int) -> dict:
  """A resume of a run that has finished its steps and exported its model: says so and where
  its results are, and returns the summary of a run that did nothing."""
  say(f"nothing to do: {logdir} finished at step {latest} (trainer.steps="
      f"{job.trainer.steps}); raise --config.trainer.steps to train further. Results: "
      f"{logdir / 'metrics.jsonl'}, {logdir / FINAL_MODEL}")
  return dict(history=[], lengths=[], finished=True, step=latest)


def _update_mesh(fsdp: int, devices: list) -> jax.sharding.Mesh:
  """The policy update's mesh over ``devices`` (FSDP where ``fsdp`` > 1), and the console's
  line about the devices."""
  # without FSDP the plain 1-D mesh: the update's program (and rounding) is the unsharded one
  mesh = make_mesh(devices, fsdp) if fsdp > 1 else jax.sharding.Mesh(np.array(devices), ("data",))
  say(f"devices: {len(devices)} x {devices[0].platform} (" +
      (f"policy updates data-parallel over {len(devices) // fsdp} x FSDP over {fsdp}: params "
       f"and optimizer state sharded" if fsdp > 1 else "data-parallel policy updates") + ")" +
      (f", {hosts.process_count()} processes with {len(jax.local_devices())} each"
       if hosts.process_count() > 1 else ""))
  return mesh


def set_up_trainer(job: Job, latest: int | None, mesh: jax.sharding.Mesh) -> GRPOTrainer:
  """The policy (loaded, then warm-started unless the run resumes: its checkpoint holds the
  params) and its trainer on ``mesh``; in between, a warning where the job's saved drafter was
  made for another policy than the one RL starts from, and a fresh EAGLE-3 drafter's head
  started from that policy's (``Job.drafter_from_policy``)."""
  with _outside_the_steps(job, latest, "while loading the policy"):
    if job.model_path is None:
      model = initial_model(job, job.seed)
    else:
      t0 = time.perf_counter()
      say(f"loading the policy from {job.model_path} ...")
      model = initial_model(job, job.seed)
      say(f"loaded the policy in {time.perf_counter() - t0:.0f}s")
  if not job.resume or job.drafter_from_policy:
    with _outside_the_steps(job, latest, "during the warm start"):
      model = _warm_start(model, job)
  spec = job.drafter_spec
  if spec.kind == "saved":
    warning = drafter_policy_mismatch(spec.path, model)  # the policy RL starts from
    if warning:
      say(f"warning: {warning} (--config.drafter={spec.learned} "
          "--config.drafter_training.online=True)")
  with _outside_the_steps(job, latest, "while building the trainer"):
    return make_trainer(job, model, mesh)


def _restore_and_train(trainer: GRPOTrainer, job: Job, logdir: pathlib.Path, latest: int | None,
                       stop: StopSignals) -> tuple[dict, MetricsLog, Checkpointer]:
  """The run's checkpoints, restored on a resume; the compile; then the RL steps (``train_steps``)
  with the metrics log. Returns the steps' summary, the (closed) metrics log and the
  checkpointer."""
  drafter_ckpt = None
  if trainer.online is not None and job.drafter_save_every:
    drafter_ckpt = Checkpointer(logdir / DRAFTER_CHECKPOINTS, keep=2, async_save=True)
  with Checkpointer(logdir / CHECKPOINTS, keep=2) as checkpointer:
    with _outside_the_steps(job, latest, "while restoring and compiling"):
      if job.resume:  # the checkpoint holds the warm-started (and RL-trained) params
        _resume(trainer, checkpointer, drafter_ckpt, job.cfg, logdir)
      say(precompile(trainer, progress=True).line())
    log = MetricsLog(logdir, resume_step=trainer.step_count if job.resume else None,
                     write=hosts.is_primary())
    try:
      summary = train_steps(trainer, job, checkpointer, log, drafter_ckpt, stop)
    finally:
      log.close()
      if drafter_ckpt is not None:
        drafter_ckpt.close()
  return summary, log, checkpointer


def _resume(trainer: GRPOTrainer, checkpointer: Checkpointer, drafter_ckpt: Checkpointer | None,
            cfg: ml_collections.ConfigDict, logdir: pathlib.Path) -> None:
  """Restores the run's latest good checkpoint; only then writes the run's config (a refused
  resume leaves the run as it was) and drops the drafter's selective saves of the steps this
  run does again."""
  trainer.restore(checkpointer)
  say(f"resumed from {checkpointer.step_dir(trainer.step_count)}")
  if hosts.is_primary():  # only now: a refused resume leaves the run as it was
    save_run_config(cfg, logdir)
  if drafter_ckpt is not None:  # selective saves of the steps this run does again
    dropped = drafter_ckpt.delete_after(trainer.step_count)
    if dropped:
      say(f"dropped the drafter's selective saves of steps {dropped} (newer than the "
          "checkpoint; they are written again as those steps are re-done)")


def export_run(trainer: GRPOTrainer, job: Job, logdir: pathlib.Path) -> tuple[pathlib.Path, str]:
  """Writes the final model (and the online drafter, and an EAGLE-3 one's speculators export
  for vLLM), from process 0 alone: the params are replicated, so it holds them all. Returns the
  model's directory and the words naming the drafter's ("" without one)."""
  final, extra = logdir / FINAL_MODEL, ""
  with _outside_the_steps(job, trainer.step_count, "while exporting the final model"):
    if hosts.is_primary():  # the params are replicated: process 0 holds them all
      final = export_final_model(trainer, job)
      if trainer.online is not None:
        extra = f", final drafter {export_final_drafter(trainer, job)}"
        served = export_final_speculators(job)  # for vLLM, beside final_model
        extra += (f", for vLLM {served}" if served is not None else
                  " (no speculators/vLLM export: that format holds only EAGLE-3 drafters)")
  return final, extra


def initial_model(job: Job, seed: int) -> Transformer:
  """The policy before any training: the pretrained checkpoint, or a randomly initialised one."""
  if job.model_path is None:
    return init_model(job.model_config, seed=seed)
  model, _ = from_pretrained(job.model_path, dtype=job.model_config.dtype)
  return with_compute_dtype(model, job.model_config.compute_dtype)


def _warm_start(model, job: Job):
  if job.sft.steps == 0:
    return model
  t0 = time.perf_counter()
  bar = progress_bar(job.sft.steps, "warm start", "step")

  def progress(step, metrics):
    bar.update(1)
    if step % 25 == 0 or step == job.sft.steps:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")

  with bar:
    model, metrics = warm_start(model, job.tokenizer, job.task, job.sft, job.seed, progress)
  say(f"warm start: {job.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
      f"loss {metrics.get('loss', float('nan')):.3f}")
  return model


def make_trainer(job: Job, model: Transformer, mesh: jax.sharding.Mesh,
                 drafter=None) -> GRPOTrainer:
  """The job's GRPO trainer for ``model`` (the policy RL starts from) on ``mesh``, drafting with
  ``drafter`` (None: ``job.drafter``, or where ``job.drafter_from_policy`` one built now from
  ``model``)."""
  if drafter is None:
    drafter = (job.drafter_spec.build(job.model_config, job.seed, policy=model)
               if job.drafter_from_policy else job.drafter)
  return GRPOTrainer(model, job.tokenizer, job.task, job.engine, job.grpo, job.trainer,
                     mesh=mesh, drafter=drafter,
                     chat_template=job.chat_template, rollout_devices=job.rollout_devices,
                     drafter_training=job.drafter_training, suffix=job.suffix,
                     history=job.history, checked=job.step_devices)


@contextlib.contextmanager
def _outside_the_steps(job: Job, latest: int | None, where: str):
  """A stop outside the RL steps (a signal while loading, warm-starting, restoring, compiling
  or exporting) says what is saved and how to go on: the run is as its last checkpoint left
  it, or, before the first, it has only its config, which the same resume command starts
  over."""
  try:
    yield
  except Interrupted as e:
    kept = (f"the run is as its checkpoint of step {latest} left it" if latest is not None else
            "nothing was saved but the run's config.json, so the run starts over")
    raise Interrupted(e.exit_code - 128, f"{e} {where}: {kept}; {resume_hint(job)}") from None


