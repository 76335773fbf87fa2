"""Running the main job: warm start, the GRPO steps with checkpoints and a clean stop on a
signal, held-out evaluations, the final exports, and the console's lines about all of it.

The config has been turned into a ``Job`` (``build.py``) and the run directory opened
(``run_dir.py``) before any of the work here starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import signal
import threading
import time
from typing import Iterable

import jax
import ml_collections
import numpy as np

from tlt_jax import hosts
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.drafter import ledger as ledger_lines
from tlt_jax.job.build import Job, build_job, check_top_level, describe, update_devices
from tlt_jax.job.run_dir import CHECKPOINTS, DRAFTER_CHECKPOINTS, FINAL_MODEL, MetricsLog, \
    choose_logdir, export_final_drafter, export_final_model, export_final_speculators, open_run, \
    save_run_config, set_aside_leftovers
from tlt_jax.job.signals import Interrupted, StopSignals
from tlt_jax.job.typed_config import ConfigError, config_error
from tlt_jax.models.load import from_pretrained
from tlt_jax.models.instances import with_compute_dtype
from tlt_jax.models.drafter_io import drafter_policy_mismatch
from tlt_jax.models.transformer import Transformer, init_model
from tlt_jax.rl.rewards import task_scorer
from tlt_jax.rl.sft import warm_start
from tlt_jax.rl.data import held_out_line
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rl.trainer_config import TrainerConfig, check_update_layout
from tlt_jax.rl.mesh import make_mesh
from tlt_jax.rl.update import NonFiniteUpdateError
from tlt_jax.rollout.host import history as history_lib
from tlt_jax.rollout.host.stats import arm_line, run_sd_summary
from tlt_jax.utils import BACKGROUND_ENV, MIN_BACKGROUND_CORES, background_compiles_allowed, \
    mark_background, progress_bar


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
      _say(f"{logdir} held files of an earlier attempt but no checkpoint: moved them to {aside}")
    save_run_config(cfg, logdir)
  mesh = _update_mesh(job.fsdp, devices)
  with StopSignals() as stop:
    t_start = time.perf_counter()
    trainer = set_up_trainer(job, latest, mesh)
    _describe_rl(trainer, job)
    summary, log, checkpointer = _restore_and_train(trainer, job, logdir, latest, stop)
    summary["wall_s"] = time.perf_counter() - t_start
    final, extra = export_run(trainer, job, logdir)
    hosts.barrier("exported")  # no process ends before the run's files are complete
  _say(f"results: metrics {log.path}, tensorboard --logdir {logdir}, checkpoints "
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
  if cfg.distributed:  # several processes, from the environment; before any other JAX call
    hosts.initialize(timeout_s=cfg.get("distributed_timeout_s", hosts.DEFAULT_TIMEOUT_S))
  cfg, latest, note = open_run(cfg, logdir, overrides)
  if note:
    _say(note)
  job = build_job(cfg, keys_checked=True)  # the same keys as checked above
  devices = update_devices(job.mesh_devices, job.fsdp, job.rollout_devices)
  try:
    check_update_layout(job.trainer, job.grpo, len(devices))
  except ValueError as e:
    layout = config_error(e, None, {"TrainerConfig": "trainer", "GRPOConfig": "grpo"})
    raise ConfigError(f"{layout} (config.mesh_devices sets how many)") from None
  _say(f"config:\n{describe(cfg)}")
  _say(held_out_line(job.task, job.trainer.eval_problems))  # whether held-out is training data
  _say(f"reward: {task_scorer(job.task)}")  # math_verify or not: rewards differ by install
  return job, latest, devices


def _nothing_to_do(job: Job, logdir: pathlib.Path, latest: int) -> dict:
  """A resume of a run that has finished its steps and exported its model: says so and where
  its results are, and returns the summary of a run that did nothing."""
  _say(f"nothing to do: {logdir} finished at step {latest} (trainer.steps="
       f"{job.trainer.steps}); raise --config.trainer.steps to train further. Results: "
       f"{logdir / 'metrics.jsonl'}, {logdir / FINAL_MODEL}")
  return dict(history=[], lengths=[], finished=True, step=latest)


def _update_mesh(fsdp: int, devices: list) -> jax.sharding.Mesh:
  """The policy update's mesh over ``devices`` (FSDP where ``fsdp`` > 1), and the console's
  line about the devices."""
  # without FSDP the plain 1-D mesh: the update's program (and rounding) is the unsharded one
  mesh = make_mesh(devices, fsdp) if fsdp > 1 else jax.sharding.Mesh(np.array(devices), ("data",))
  _say(f"devices: {len(devices)} x {devices[0].platform} (" +
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
      _say(f"loading the policy from {job.model_path} ...")
      model = initial_model(job, job.seed)
      _say(f"loaded the policy in {time.perf_counter() - t0:.0f}s")
  if not job.resume or job.drafter_from_policy:
    with _outside_the_steps(job, latest, "during the warm start"):
      model = _warm_start(model, job)
  spec = job.drafter_spec
  if spec.kind == "saved":
    warning = drafter_policy_mismatch(spec.learned, model)  # the policy RL starts from
    if warning:
      _say(f"warning: {warning} (--config.drafter={spec.learned} "
           "--config.drafter_training.online=True)")
  with _outside_the_steps(job, latest, "while building the trainer"):
    return make_trainer(job, model, mesh)


def _describe_rl(trainer: GRPOTrainer, job: Job) -> None:
  """The console's lines about how the RL steps will run: the rollout's devices, the suffix
  drafter's history store, epoch mode, and how the drafter trains online."""
  if len(trainer.rollout_devices) > 1:
    _say(f"rollout: data-parallel over {len(trainer.rollout_devices)} devices (an engine "
         "each)")
  if trainer.history is not None:
    _say(f"drafter: the suffix drafter drafts from every prompt's earlier completions too (the "
         f"newest {job.history.per_prompt} per prompt, {job.history.max_bytes / 2**20:.1f} MiB "
         "at most, saved with every checkpoint)")
  if job.trainer.num_prompts:
    _say(f"data: epoch mode, {job.trainer.num_prompts} fixed problems visited once per epoch, "
         f"{job.trainer.prompts_per_step} per step")
  if trainer.history is not None and (note := history_room_note(job)):
    _say(note)
  if trainer.online is not None:
    _say("drafter: trained online from the rollouts' hidden states ("
         + ("on the devices the tail leaves idle" if len(trainer.rollout_devices) > 1 and
            job.drafter_training.spot else
            _serial_words(job.drafter_training)) + ")")


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
      _say(precompile(trainer, progress=True).line())
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
  _say(f"resumed from {checkpointer.step_dir(trainer.step_count)}")
  if hosts.is_primary():  # only now: a refused resume leaves the run as it was
    save_run_config(cfg, logdir)
  if drafter_ckpt is not None:  # selective saves of the steps this run does again
    dropped = drafter_ckpt.delete_after(trainer.step_count)
    if dropped:
      _say(f"dropped the drafter's selective saves of steps {dropped} (newer than the "
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
  _say(f"warm start: {job.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
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
                     history=job.history)


def history_room_note(job: Job) -> str | None:
  """A note when the history store cannot hold one epoch's completions at full length (then a
  prompt may find its history evicted by the time the next epoch comes back to it)."""
  if not job.trainer.num_prompts:
    return None
  kept = min(job.history.per_prompt, job.grpo.group_size)
  need = job.trainer.num_prompts * (history_lib.PROMPT_BYTES + kept * history_lib.completion_cost(
      job.trainer.max_new_tokens))
  if need <= job.history.max_bytes:
    return None
  return (f"note: history.max_bytes={job.history.max_bytes} holds less than an epoch's "
          f"completions at full length ({need} bytes for {job.trainer.num_prompts} prompts x "
          f"{kept} completions x {job.trainer.max_new_tokens} tokens): a prompt may find its "
          f"history evicted by its next visit; raise --config.history.max_bytes to keep it")


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
  compile nothing on their critical path and their timings are the steps' own. ``progress``: a bar on stderr
  while the rollout's executables compile (they are most of the time). Returns the counts and
  seconds of each part (the job prints ``line()``)."""
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
      _say(f"the policy update's {n} executables compile in the background "
           "(rollout.precompile_scope=first_step)")
    else:
      _say(f"the policy update's {n} executables compile in the first step's update "
           "(rollout.precompile_scope=first_step)")
  else:
    with (_progress_of(len(trainer.policy.executable_keys()), "compiling the policy update")
          if progress else contextlib.nullcontext()) as advance:
      update = trainer.precompile_update(advance)
  t1 = time.perf_counter()
  if progress and trainer.online is not None:
    _say("compiling the online drafter's train and eval steps ...")
  devices = trainer.precompile_drafter()
  t2 = time.perf_counter()
  bar = (_compile_bar(len(trainer.engine.executable_keys())) if progress
         else contextlib.nullcontext())
  with bar as advance:  # the SD arms compile in the background, offered once they exist
    rollout = trainer.engine.precompile(progress=advance, background=True,
                                        first_rows=trainer.first_request_rows())
  offers = getattr(trainer.engine, "offers", None)
  if offers is not None and offers.skipped and (offers.buckets or offers.prelude):
    _say(f"background compiles off on this host (fewer than {MIN_BACKGROUND_CORES} cores: they "
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


def _evaluate(trainer: GRPOTrainer) -> dict[str, float]:
  """The held-out figures at the trainer's step: ``eval_accuracy`` (greedy), ``eval_sampled_reward``
  and, with ``eval_pass_k``, ``eval_pass_at_<k>``."""
  t0 = time.perf_counter()
  cfg = trainer.config
  n, k, m = cfg.eval_problems, cfg.eval_pass_k, min(cfg.eval_pass_problems, cfg.eval_problems)
  out = {}
  rows = 2 * n + k * m
  with progress_bar(rows, f"held-out evaluation at step {trainer.step_count}", "row") as bar:
    out["eval_accuracy"] = trainer.evaluate(progress=lambda done, _: bar.update(done - bar.n))
    out["eval_sampled_reward"] = trainer.evaluate(
        temperature=cfg.temperature, progress=lambda done, _: bar.update(n + done - bar.n))
    if k:
      out[f"eval_pass_at_{k}"] = float(np.mean(trainer.pass_at(
          k, m, progress=lambda done, _: bar.update(2 * n + done - bar.n))))
  passed = f", pass@{k} {out[f'eval_pass_at_{k}']:.3f} ({m} problems)" if k else ""
  _say(f"held-out at step {trainer.step_count} ({n} problems, {time.perf_counter() - t0:.0f}s): "
       f"greedy accuracy {out['eval_accuracy']:.3f}, sampled reward "
       f"{out['eval_sampled_reward']:.3f}{passed}")
  return out


def evaluation_due(config: TrainerConfig, step: int) -> bool:
  """Whether step ``step`` (just taken) is followed by a periodic held-out evaluation: every
  ``eval_every`` steps, but not after the last one (the final evaluation covers it)."""
  return bool(config.eval_every) and step % config.eval_every == 0 and step < config.steps


def checkpoint_due(job: Job, step: int) -> bool:
  """Whether step ``step`` (just taken) is checkpointed: every ``checkpoint_every`` steps (0:
  never in between), and always the last one."""
  every = job.checkpoint_every
  return bool(every and step % every == 0) or step == job.trainer.steps


def _step_line(m: dict, steps: int) -> str:
  """The console's line of a step's metrics ``m`` (of ``steps`` in the run)."""
  return (f"step {m['step']:4d}/{steps} reward {m['reward']:.3f} " +
          ("no update (control)" if m.get("control") else f"loss {m['loss']:+.4f}") +
          f" len p50/p90/max {m['len_p50']:.0f}/{m['len_p90']:.0f}/"
          f"{m['len_max']} rollout {m['rollout_s']:.1f}s = "
          f"{100 * m['rollout_s'] / max(m['step_s'], 1e-9):.0f}% (tail {m['tail_s']:.1f}s, "
          f"last rows {m['last_s']:.1f}s) update {m['update_s']:.1f}s" + _drafter_line(m) +
          (f" | {arms}" if (arms := arm_line(m)) else ""))


def _drafter_line(m: dict) -> str:
  """The console's speculative-decoding and online-drafter figures of a step (if any)."""
  parts = []
  if m.get("mean_accept_len") is not None:
    parts.append(f"accept {m['mean_accept_len']:.2f}")
  if "drafter_loss" in m:
    parts.append(f"drafter loss {m['drafter_loss']:.3f} top1 {m['drafter_top1']:.2f}")
  if "drafter_spot_steps" in m:
    parts.append(f"drafter steps {m['drafter_spot_steps']} spot / "
                 f"{m['drafter_serial_steps']} serial")
  if ledger := ledger_lines.step_line(m):
    parts.append(ledger)
  elif m.get("sd_saved_s") is not None:  # no online drafter: what SD saved against vanilla steps
    parts.append(f"SD saved {m['sd_saved_s']:.2f}s")
  if "history_hit_rate" in m:
    parts.append(f"history hits {m['history_hit_rate']:.0%} of prompts")
  return (" | " + ", ".join(parts)) if parts else ""


def _serial_words(training) -> str:
  """How the drafter trains between rollout and update, for the job's opening lines."""
  if training.serial_budget == "fixed":
    return (f"{training.serial_steps} steps between rollout and update: one rollout device "
            "leaves nothing idle")
  bootstrap = (f"{training.bootstrap_steps} bootstrap steps" if training.bootstrap_share is None
               else f"up to {training.bootstrap_steps} bootstrap steps in "
               f"{training.bootstrap_share:.0%} of each step's time until SD has paid")
  return (f"between rollout and update, paid from what speculative decoding saved (a "
          f"{training.savings_share:.0%} share, after {bootstrap}; at most "
          f"{training.serial_steps} a step): one rollout device leaves nothing idle")


def _resume_hint(job: Job) -> str:
  return (f"continue with: python -m tlt_jax.train --config.logdir={job.logdir} "
          "--config.resume=True")


def _interrupted(e: KeyboardInterrupt, doing: str, checkpointer: Checkpointer,
                 job: Job) -> Interrupted:
  """A stop at once (a second signal, or a plain KeyboardInterrupt) in the RL phase: where it
  hit, what is saved, and the command that goes on from there."""
  latest = checkpointer.latest_step()
  where = (f"the last checkpoint is step {latest}" if latest is not None
           else "no checkpoint was written yet, so the run starts over with its config")
  return Interrupted(getattr(e, "exit_code", 130) - 128,
                     f"interrupted {doing}; {where}; {_resume_hint(job)}")


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
    raise Interrupted(e.exit_code - 128, f"{e} {where}: {kept}; {_resume_hint(job)}") from None


def _nonfinite_advice(e: NonFiniteUpdateError, checkpointer: Checkpointer,
                      job: Job) -> NonFiniteUpdateError:
  """A non-finite update, with what to do about it: the command that resumes from the last
  checkpoint (or runs again, before the first) with a setting that avoids it."""
  latest = checkpointer.latest_step()
  then = (f"resume from step {latest}: {_resume_hint(job)}" if latest is not None else
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
                      f"{checkpointer.step_dir(trainer.step_count)}; {_resume_hint(job)}")
  return _summary(steps, start, end)


@dataclasses.dataclass
class Steps:
  """The RL steps of a run and where their results go: the metrics ``log``, the checkpoints and
  the drafter's selective saves (``drafter_ckpt``, None: none). ``doing`` says what a second
  signal would interrupt (for its message); ``saved_step`` is the step last checkpointed;
  ``history`` and ``lengths`` collect each step's metrics and its rollout's lengths."""

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
    """One RL step, then in this order: the drafter's selective save, a periodic evaluation,
    the checkpoint, the metrics row and the console line."""
    trainer = self.trainer
    self.doing = f"during step {trainer.step_count + 1}"
    with _step_progress(trainer):
      m = trainer.step()
    self.doing = f"after step {trainer.step_count}, before it was logged"
    self.history.append(m)
    self.lengths.extend(trainer.last_lengths.tolist())
    self.save_drafter(m)
    if evaluation_due(self.job.trainer, trainer.step_count):  # before the save, so that a stop
      self.doing = f"after step {trainer.step_count}, during its held-out evaluation"  # in it
      m.update(_evaluate(trainer))
    if checkpoint_due(self.job, trainer.step_count):
      self.save(m)
    self.log.write(m["step"], m)
    _say(_step_line(m, self.job.trainer.steps))

  def save_drafter(self, m: dict) -> None:
    """Every ``drafter_save_every`` steps, the drafter alone, written while training goes on (an
    unchanged drafter is not saved again); ``m`` gets the milliseconds the step waited."""
    step = self.trainer.step_count
    if self.drafter_ckpt is None or step % self.job.drafter_save_every != 0:
      return
    waited = self.trainer.online.selective_save(self.drafter_ckpt, step)
    if waited is not None:
      m["drafter_save_ms"] = 1e3 * waited

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
        _say(f"step {step}: rollout done in {time.perf_counter() - t0:.0f}s, updating the "
             "policy ...")

    trainer.step_progress = tell
    try:
      yield
    finally:
      trainer.step_progress = None


def _summary(steps: Steps, start: dict, end: dict) -> dict:
  """The finished run's summary and its closing lines: the held-out figures at the ``start``
  and the ``end`` (``_evaluate``'s), the train reward of the first and last five steps, where
  the step time went, and the whole run's SD and ledger lines (the steps before a resume too)."""
  history = steps.history
  summary = dict(accuracy_start=start["eval_accuracy"], accuracy_end=end["eval_accuracy"],
                 sampled_start=start["eval_sampled_reward"],
                 sampled_end=end["eval_sampled_reward"], history=history, lengths=steps.lengths,
                 step=steps.trainer.step_count, finished=True)
  passes = sorted(k for k in set(start) & set(end) if k.startswith("eval_pass_at_"))
  for key in passes:
    summary[key[len("eval_"):] + "_start"], summary[key[len("eval_"):] + "_end"] = (
        start[key], end[key])
  if not history:
    return summary
  rollout = sum(m["rollout_s"] for m in history)
  total = sum(m["step_s"] for m in history)
  summary.update(reward_first=float(np.mean([m["reward"] for m in history[:5]])),
                 reward_last=float(np.mean([m["reward"] for m in history[-5:]])),
                 rollout_share=rollout / max(total, 1e-9),
                 tail_share=sum(m["tail_s"] for m in history) / max(total, 1e-9),
                 last_share_of_rollout=sum(m["last_s"] for m in history) / max(rollout, 1e-9))
  control = (" (the no-update control: the params are the warm start's, so the held-out "
             "figures stay where they started)" if steps.job.trainer.control else "")
  passed = "".join(f"; held-out {key[len('eval_'):].replace('_at_', '@')}: {start[key]:.3f} -> "
                   f"{end[key]:.3f}" for key in passes)
  _say(f"held-out sampled reward: {summary['sampled_start']:.3f} -> {summary['sampled_end']:.3f}; "
       f"held-out greedy accuracy: {summary['accuracy_start']:.3f} -> "
       f"{summary['accuracy_end']:.3f}{passed}{control}; train reward "
       f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; rollout "
       f"{100 * summary['rollout_share']:.0f}% of step time (tail "
       f"{100 * summary['tail_share']:.0f}%); the last rows (at most an eighth live) took "
       f"{100 * summary['last_share_of_rollout']:.0f}% of the rollout")
  sd = run_sd_summary(steps.log.rows())  # the whole run's steps, those before a resume too
  if sd:
    _say(sd)
  if ledger := ledger_lines.run_line(steps.log.rows()):
    _say(ledger)
  if (stats := getattr(steps.trainer.engine, "pool_stats", None)) is not None:
    pools = stats()
    pools = pools if isinstance(pools, list) else [pools]
    summary["rollout_executables"] = dict(compiled=sum(p["executables"] for p in pools),
                                          used=sum(p["used"] for p in pools))
    _say(f"rollout executables: {summary['rollout_executables']['used']} of the "
         f"{summary['rollout_executables']['compiled']} compiled were run")
  return summary


def _say(text: str) -> None:
  """A line on the console: process 0's alone when there are several."""
  if hosts.is_primary():
    print(text, flush=True)

