"""The job's console: its lines about how the RL steps run, each step's line, the closing summary,
and the command that resumes a stopped run. Process 0 alone prints (``say``).
"""

from __future__ import annotations

import numpy as np

from tlt_jax import hosts
from tlt_jax.drafter import ledger as ledger_lines
from tlt_jax.job.build import Job
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rollout import PROMPT_BYTES, arm_line, completion_cost, run_sd_summary


def describe_rl(trainer: GRPOTrainer, job: Job) -> None:
  """The console's lines about how the RL steps will run: the rollout's devices, the suffix
  drafter's history store, epoch mode, and how the drafter trains online."""
  if len(trainer.rollout_devices) > 1:
    say(f"rollout: data-parallel over {len(trainer.rollout_devices)} devices (an engine "
        "each)")
  if trainer.history is not None:
    say(f"drafter: the suffix drafter drafts from every prompt's earlier completions too (the "
        f"newest {job.history.per_prompt} per prompt, {job.history.max_bytes / 2**20:.1f} MiB "
        "at most, saved with every checkpoint)")
  if job.trainer.num_prompts:
    say(f"data: epoch mode, {job.trainer.num_prompts} fixed problems visited once per epoch, "
        f"{job.trainer.prompts_per_step} per step")
  if trainer.history is not None and (note := history_room_note(job)):
    say(note)
  if trainer.online is not None:
    say("drafter: trained online from the rollouts' hidden states ("
        + ("on the devices the tail leaves idle" if len(trainer.rollout_devices) > 1 and
           job.drafter_training.spot else
           _serial_words(job.drafter_training)) + ")")


def history_room_note(job: Job) -> str | None:
  """A note when the history store cannot hold one epoch's completions at full length (then a
  prompt may find its history evicted by the time the next epoch comes back to it)."""
  if not job.trainer.num_prompts:
    return None
  kept = min(job.history.per_prompt, job.grpo.group_size)
  need = job.trainer.num_prompts * (PROMPT_BYTES + kept * completion_cost(
      job.trainer.max_new_tokens))
  if need <= job.history.max_bytes:
    return None
  return (f"note: history.max_bytes={job.history.max_bytes} holds less than an epoch's "
          f"completions at full length ({need} bytes for {job.trainer.num_prompts} prompts x "
          f"{kept} completions x {job.trainer.max_new_tokens} tokens): a prompt may find its "
          f"history evicted by its next visit; raise --config.history.max_bytes to keep it")


def step_line(m: dict, steps: int) -> str:
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


def resume_hint(job: Job) -> str:
  return (f"continue with: python -m tlt_jax.train --config.logdir={job.logdir} "
          "--config.resume=True")


def run_summary(steps, start: dict, end: dict) -> dict:
  """The finished run's summary and its closing lines, from the loop's ``Steps``: the held-out
  figures at the ``start`` and the ``end``, the train reward of the first and last five steps,
  where the step time went, and the whole run's SD and ledger lines (the steps before a resume
  too)."""
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
  say(f"held-out sampled reward: {summary['sampled_start']:.3f} -> {summary['sampled_end']:.3f}; "
      f"held-out greedy accuracy: {summary['accuracy_start']:.3f} -> "
      f"{summary['accuracy_end']:.3f}{passed}{control}; train reward "
      f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; rollout "
      f"{100 * summary['rollout_share']:.0f}% of step time (tail "
      f"{100 * summary['tail_share']:.0f}%); the last rows (at most an eighth live) took "
      f"{100 * summary['last_share_of_rollout']:.0f}% of the rollout")
  sd = run_sd_summary(steps.log.rows())  # the whole run's steps, those before a resume too
  if sd:
    say(sd)
  if ledger := ledger_lines.run_line(steps.log.rows()):
    say(ledger)
  if (stats := getattr(steps.trainer.engine, "pool_stats", None)) is not None:
    pools = stats()
    pools = pools if isinstance(pools, list) else [pools]
    summary["rollout_executables"] = dict(compiled=sum(p["executables"] for p in pools),
                                          used=sum(p["used"] for p in pools))
    say(f"rollout executables: {summary['rollout_executables']['used']} of the "
        f"{summary['rollout_executables']['compiled']} compiled were run")
  return summary


def say(text: str) -> None:
  """A line on the console: process 0's alone when there are several."""
  if hosts.is_primary():
    print(text, flush=True)
