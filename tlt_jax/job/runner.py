"""Running the main job: warm start, the GRPO steps with checkpoints and a clean stop on a
signal, held-out evaluations, the final exports, and the console's lines about all of it.

The config has been turned into a ``Job`` (``build.py``) and the run directory opened
(``run_dir.py``) before any of the work here starts.
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Iterable

import jax
import ml_collections
import numpy as np

from tlt_jax import hosts
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.drafter import ledger as ledger_lines
from tlt_jax.job.build import Job, build_job, check_top_level, describe, job_devices
from tlt_jax.job.rollout_config import split_drafter
from tlt_jax.job.run_dir import CHECKPOINTS, DRAFTER_CHECKPOINTS, FINAL_MODEL, MetricsLog, \
    choose_logdir, export_final_drafter, export_final_model, open_run, save_run_config, \
    set_aside_leftovers
from tlt_jax.job.signals import Interrupted, StopSignals
from tlt_jax.models.load import from_pretrained
from tlt_jax.models.drafter import Drafter, drafter_policy_mismatch
from tlt_jax.models.transformer import Transformer, init_model
from tlt_jax.rl import history as history_lib
from tlt_jax.rl.sft import warm_start
from tlt_jax.rl.trainer import GRPOTrainer, TrainerConfig, check_update_layout
from tlt_jax.rl.mesh import make_mesh
from tlt_jax.rl.update import NonFiniteUpdateError
from tlt_jax.rollout.stats import arm_line, run_sd_summary
from tlt_jax.utils import progress_bar


def run(cfg: ml_collections.ConfigDict, overrides: Iterable[str] | None = None) -> dict:
  """Runs (or resumes) warm start + GRPO for a config; returns a summary.

  On resume (``cfg.resume``), the run's saved config is used, except the fields named in
  ``overrides`` (``None``: every field where ``cfg`` differs from it). Every check that needs no
  model comes first; a resumed run writes nothing until its checkpoint has been restored.
  SIGINT/SIGTERM during the RL steps stop the run after the step in flight, saved (see
  ``StopSignals``).
  """
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # never mutate the caller's config
  check_top_level(cfg)
  logdir = choose_logdir(cfg)
  if cfg.distributed:  # several processes, from the environment; before any other JAX call
    hosts.initialize(timeout_s=cfg.get("distributed_timeout_s", hosts.DEFAULT_TIMEOUT_S))
  cfg, latest, note = open_run(cfg, logdir, overrides)
  if note:
    _say(note)
  job = build_job(cfg)
  devices = job_devices(cfg)
  check_update_layout(job.trainer, job.grpo, len(devices))
  _say(f"config:\n{describe(cfg)}")
  if cfg.resume and latest >= job.trainer.steps and (logdir / FINAL_MODEL).is_dir():
    _say(f"nothing to do: {logdir} finished at step {latest} (trainer.steps="
         f"{job.trainer.steps}); raise --config.trainer.steps to train further. Results: "
         f"{logdir / 'metrics.jsonl'}, {logdir / FINAL_MODEL}")
    return dict(history=[], lengths=[], finished=True, step=latest)
  if not cfg.resume and hosts.is_primary():
    if (aside := set_aside_leftovers(logdir)) is not None:  # never two runs' files in one logdir
      _say(f"{logdir} held files of an earlier attempt but no checkpoint: moved them to {aside}")
    save_run_config(cfg, logdir)
  fsdp = cfg.get("fsdp", 1)
  # without FSDP the plain 1-D mesh: the update compiles (and rounds) exactly as it always did
  mesh = make_mesh(devices, fsdp) if fsdp > 1 else jax.sharding.Mesh(np.array(devices), ("data",))
  _say(f"devices: {len(devices)} x {devices[0].platform} (" +
       (f"policy updates data-parallel over {len(devices) // fsdp} x FSDP over {fsdp}: params "
        f"and optimizer state sharded" if fsdp > 1 else "data-parallel policy updates") + ")" +
       (f", {hosts.process_count()} processes with {len(jax.local_devices())} each"
        if hosts.process_count() > 1 else ""))
  with StopSignals() as stop:
    t_start = time.perf_counter()
    with _outside_the_steps(job, latest, "while loading the policy"):
      model = initial_model(job, cfg.seed)
    if not cfg.resume:
      with _outside_the_steps(job, latest, "during the warm start"):
        model = _warm_start(model, job)
    learned = split_drafter(cfg.drafter)[0]
    if isinstance(job.drafter, Drafter) and learned != "eagle":
      warning = drafter_policy_mismatch(learned, model)  # the policy RL starts from
      if warning:
        _say(f"warning: {warning}")
    with _outside_the_steps(job, latest, "while building the trainer"):
      trainer = make_trainer(job, model, mesh)
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
    if trainer.history is not None and (note := _history_room(job)):
      _say(note)
    if trainer.online is not None:
      _say("drafter: trained online from the rollouts' hidden states ("
           + ("on the devices the tail leaves idle" if len(trainer.rollout_devices) > 1 and
              job.drafter_training.spot else
              _serial_words(job.drafter_training)) + ")")
    drafter_ckpt = None
    if trainer.online is not None and job.drafter_save_every:
      drafter_ckpt = Checkpointer(logdir / DRAFTER_CHECKPOINTS, keep=2, async_save=True)
    with Checkpointer(logdir / CHECKPOINTS, keep=2) as checkpointer:
      with _outside_the_steps(job, latest, "while restoring and compiling"):
        if cfg.resume:  # the checkpoint holds the warm-started (and RL-trained) params
          trainer.restore(checkpointer)
          _say(f"resumed from {checkpointer.step_dir(trainer.step_count)}")
          if hosts.is_primary():  # only now: a refused resume leaves the run as it was
            save_run_config(cfg, logdir)
          if drafter_ckpt is not None:  # selective saves of the steps this run does again
            dropped = drafter_ckpt.delete_after(trainer.step_count)
            if dropped:
              _say(f"dropped the drafter's selective saves of steps {dropped} (newer than the "
                   "checkpoint; they are written again as those steps are re-done)")
        _precompile(trainer)
      log = MetricsLog(logdir, resume_step=trainer.step_count if cfg.resume else None,
                       write=hosts.is_primary())
      try:
        summary = _train(trainer, job, checkpointer, log, drafter_ckpt, stop)
      finally:
        log.close()
        if drafter_ckpt is not None:
          drafter_ckpt.close()
    summary["wall_s"] = time.perf_counter() - t_start
    final, extra = logdir / FINAL_MODEL, ""
    with _outside_the_steps(job, trainer.step_count, "while exporting the final model"):
      if hosts.is_primary():  # the params are replicated: process 0 holds them all
        final = export_final_model(trainer, job)
        if trainer.online is not None:
          extra = f", final drafter {export_final_drafter(trainer, job)}"
    hosts.barrier("exported")  # no process ends before the run's files are complete
  _say(f"results: metrics {log.path}, tensorboard --logdir {logdir}, checkpoints "
       f"{checkpointer.directory}, final model {final}{extra}")
  hosts.shutdown()
  return summary



def initial_model(job: Job, seed: int) -> Transformer:
  """The policy before any training: the pretrained checkpoint, or a randomly initialised one."""
  if job.model_path is None:
    return init_model(job.model_config, seed=seed)
  model, _ = from_pretrained(job.model_path, dtype=job.model_config.dtype)
  return model


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
    model, metrics = warm_start(model, job.tokenizer, job.task, job.sft, job.cfg.seed, progress)
  _say(f"warm start: {job.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
       f"loss {metrics.get('loss', float('nan')):.3f}")
  return model


def make_trainer(job: Job, model: Transformer, mesh: jax.sharding.Mesh) -> GRPOTrainer:
  """The job's GRPO trainer for ``model`` (the policy RL starts from) on ``mesh``."""
  return GRPOTrainer(model, job.tokenizer, job.task, job.engine, job.grpo, job.trainer,
                     mesh=mesh, drafter=job.drafter, chat_template=job.chat_template,
                     rollout_devices=job.cfg.get("rollout_devices", 0),
                     drafter_training=job.drafter_training, suffix=job.suffix,
                     history=job.history)


def _history_room(job: Job) -> str | None:
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


def _precompile(trainer: GRPOTrainer) -> None:
  t0 = time.perf_counter()
  with progress_bar(len(trainer.engine.executable_keys()), "compiling rollout executables",
                    "exe") as bar:

    def progress(done, total):
      bar.total = total
      bar.update(done - bar.n)

    n = trainer.engine.precompile(progress=progress)
  t1 = time.perf_counter()
  m = trainer.precompile_update()
  t2 = time.perf_counter()
  d = trainer.precompile_drafter()
  _say(f"compiled {n} rollout executables in {t1 - t0:.0f}s, {m} policy-update executables in "
       f"{t2 - t1:.0f}s" + (f", the drafter's steps for {d} device(s) in "
                            f"{time.perf_counter() - t2:.0f}s" if d else ""))


def _evaluate(trainer: GRPOTrainer) -> tuple[float, float]:
  t0 = time.perf_counter()
  n = trainer.config.eval_problems
  with progress_bar(2 * n, f"held-out evaluation at step {trainer.step_count}", "row") as bar:
    greedy = trainer.evaluate(progress=lambda done, _: bar.update(done - bar.n))
    sampled = trainer.evaluate(temperature=trainer.config.temperature,
                               progress=lambda done, _: bar.update(n + done - bar.n))
  _say(f"held-out at step {trainer.step_count} ({trainer.config.eval_problems} problems, "
       f"{time.perf_counter() - t0:.0f}s): greedy accuracy {greedy:.3f}, sampled reward "
       f"{sampled:.3f}")
  return greedy, sampled


def _evaluation_due(config: TrainerConfig, step: int) -> bool:
  """Whether step ``step`` (just taken) is followed by a periodic held-out evaluation: every
  ``eval_every`` steps, but not after the last one (the final evaluation covers it)."""
  return bool(config.eval_every) and step % config.eval_every == 0 and step < config.steps


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


def _train(trainer: GRPOTrainer, job: Job, checkpointer: Checkpointer, log: MetricsLog,
           drafter_ckpt: Checkpointer | None = None, stop: StopSignals | None = None) -> dict:
  cfg = job.cfg
  stop = stop or StopSignals()
  start_step = trainer.step_count
  history, lengths = [], []
  saved_step = None
  doing = "during the held-out evaluation at the start"  # what a second signal interrupts
  try:
    if start_step == 0:
      accuracy_start, sampled_start = _evaluate(trainer)
      log.write(0, {"eval_accuracy": accuracy_start, "eval_sampled_reward": sampled_start})
    else:
      earlier = [r for r in log.rows() if r.get("step") == 0 and "eval_accuracy" in r]
      accuracy_start = earlier[0]["eval_accuracy"] if earlier else float("nan")
      sampled_start = earlier[0]["eval_sampled_reward"] if earlier else float("nan")
    with stop.graceful():
      while trainer.step_count < job.trainer.steps and stop.signum is None:
        doing = f"during step {trainer.step_count + 1}"
        m = trainer.step()
        doing = f"after step {trainer.step_count}, before it was logged"
        history.append(m)
        lengths.extend(trainer.last_lengths.tolist())
        if drafter_ckpt is not None and trainer.step_count % job.drafter_save_every == 0:
          # selective async save: the drafter alone, written while training goes on
          waited = trainer.online.selective_save(drafter_ckpt, trainer.step_count)
          if waited is not None:  # (an unchanged drafter is not saved again)
            m["drafter_save_ms"] = 1e3 * waited
        if _evaluation_due(job.trainer, trainer.step_count):  # before the save: a stop in it
          doing = f"after step {trainer.step_count}, during its held-out evaluation"  # redoes both
          m["eval_accuracy"], m["eval_sampled_reward"] = _evaluate(trainer)
        if (cfg.checkpoint_every and trainer.step_count % cfg.checkpoint_every == 0) or \
            trainer.step_count == job.trainer.steps:
          doing = f"after step {trainer.step_count} was saved"  # (a save is never cut short)
          t0 = time.perf_counter()
          with stop.deferred():
            trainer.save(checkpointer, {"config": cfg.to_dict()})  # everything, blocking
            m["checkpoint_save_ms"] = 1e3 * (time.perf_counter() - t0)
            saved_step = trainer.step_count
        log.write(m["step"], m)
        _say(f"step {m['step']:4d}/{job.trainer.steps} reward {m['reward']:.3f} " +
             ("no update (control)" if m.get("control") else f"loss {m['loss']:+.4f}") +
             f" len p50/p90/max {m['len_p50']:.0f}/{m['len_p90']:.0f}/"
             f"{m['len_max']} rollout {m['rollout_s']:.1f}s = "
             f"{100 * m['rollout_s'] / max(m['step_s'], 1e-9):.0f}% (tail {m['tail_s']:.1f}s, "
             f"last rows {m['last_s']:.1f}s) update {m['update_s']:.1f}s" + _drafter_line(m) +
             (f" | {arms}" if (arms := arm_line(m)) else ""))
    stopped = stop.signum is not None and trainer.step_count < job.trainer.steps
    if stopped and saved_step != trainer.step_count:  # the step in flight when the signal came
      doing = f"after step {trainer.step_count} was saved"
      with stop.deferred():
        trainer.save(checkpointer, {"config": cfg.to_dict()})
    if not stopped:
      doing = f"after step {trainer.step_count}, during the final held-out evaluation"
      accuracy_end, sampled_end = _evaluate(trainer)
      log.write(trainer.step_count, {"eval_accuracy": accuracy_end,
                                     "eval_sampled_reward": sampled_end})
  except NonFiniteUpdateError as e:
    latest = checkpointer.latest_step()
    then = (f"resume from step {latest}: {_resume_hint(job)}" if latest is not None else
            "run the job again (no checkpoint was written yet, so it starts over)")
    raise NonFiniteUpdateError(
        f"{e}; nothing non-finite was saved. To go on, {then} and add "
        "--config.trainer.on_nonfinite=skip (drops such updates) or a lower "
        "--config.trainer.learning_rate") from None
  except KeyboardInterrupt as e:  # a second signal: at once
    raise _interrupted(e, doing, checkpointer, job) from None
  if stopped:
    raise Interrupted(stop.signum, f"stopped by {signal.Signals(stop.signum).name} after step "
                      f"{trainer.step_count}, saved as "
                      f"{checkpointer.step_dir(trainer.step_count)}; {_resume_hint(job)}")
  summary = dict(accuracy_start=accuracy_start, accuracy_end=accuracy_end,
                 sampled_start=sampled_start, sampled_end=sampled_end, history=history,
                 lengths=lengths, step=trainer.step_count, finished=True)
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
             "figures stay where they started)" if job.trainer.control else "")
  _say(f"held-out sampled reward: {sampled_start:.3f} -> {sampled_end:.3f}; held-out greedy "
       f"accuracy: {accuracy_start:.3f} -> {accuracy_end:.3f}{control}; train reward "
       f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; rollout "
       f"{100 * summary['rollout_share']:.0f}% of step time (tail "
       f"{100 * summary['tail_share']:.0f}%); the last rows (at most an eighth live) took "
       f"{100 * summary['last_share_of_rollout']:.0f}% of the rollout")
  sd = run_sd_summary(log.rows())  # the whole run's steps, those before a resume too
  if sd:
    _say(sd)
  if ledger := ledger_lines.run_line(log.rows()):
    _say(ledger)
  return summary



def _say(text: str) -> None:
  """A line on the console: process 0's alone when there are several."""
  if hosts.is_primary():
    print(text, flush=True)

