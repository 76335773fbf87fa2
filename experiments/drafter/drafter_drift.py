"""Drafter drift over a GRPO run: accepted length per RL step of an adapted, a frozen and a
from-scratch drafter, all decoding the same policy trajectory (the shape of TLT's Table 6).

  python -m experiments.drafter.drafter_drift [--steps 20] [--depth 5] [--lr 2e-5]
      [--drafter-lr 1e-4]
      [--scratch-lr 1e-3] [--out docs/results/drafter_drift.json]

The default job (configs/tiny_grpo.py) with small steps: the tiny policy is warm-started once
(cached under experiments/out/rl_bench/), then an EAGLE drafter is trained offline on that warm
policy's own temperature-1 rollouts (--drafter-steps, cached). Three GRPO trainers then run the
same steps, interleaved step by step, each rolling out with one fixed speculative chain
(--depth) and coupled verification, so that every arm samples exactly the tokens vanilla
sampling would: the same rollouts, rewards and policy updates (checked and reported), only the
drafter differs.

* ``adapted``: the initial drafter, trained online (serial steps between rollout and update on
  this one device, DrafterTrainingConfig, a fresh AdamW at --drafter-lr) on the rollouts'
  hidden states;
* ``frozen``: a copy of the initial drafter, never updated (the stale drafter);
* ``scratch``: a randomly initialised drafter trained online like ``adapted`` but at
  --scratch-lr (a random drafter needs the larger rate; at 1e-3 the adapted one got worse than
  the frozen one in a first run, while the policy barely moved).

``--drift format`` runs the drift workload (``rl_bench.FormatShiftTask``; ``python -m
experiments.reproduce table6`` runs it for Table 6): the warm start writes a carry-first trace
style ``--new-style-share`` of the time and the reward pays only (or mostly: --old-style-reward)
for correct answers in that style, so RL moves the policy's output distribution to a style the
initial drafter rarely saw. Per step the report has ``policy_kl_to_start`` (KL(policy || warm
start) per completion token on the step's rollout: its sampled log-probs minus the warm start's
of the same tokens) and ``new_style_share``; ``critical_path`` holds the adapted drafter's serial
seconds per step against the rollout and step times (one device: its training is on the
critical path).

Per step and arm: ``mean_accept_len`` (tokens per live row per speculative step, at most
depth + 1); ``heldout_loss``/``heldout_top1``: the weights the arm drafted this step's rollout
with, scored (teacher-forced) by this script on the step's fresh rollouts, which they have not
trained on (the same batch and scorer for all three arms). For the online arms the trainer's own
``drafter_loss``/``drafter_top1`` mean the same (held out: the weights that drafted, on the
freshest data, before the step's serial training; their gap to ``heldout_*`` is reported as a
check) and ``drafter_train_loss``/``drafter_train_top1`` are the mean over the step's drafter
training steps (in-sample). How far the policy itself moves is reported as the relative L2
distance of its params from the warm start.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments.rl import rl_bench as rb
from experiments.harness import DrafterTrainingConfig, SpecConfig, make_eval_step

ARMS = ("adapted", "frozen", "scratch")


def main():
  parser = harness.parser(__doc__)
  rb.add_job_args(parser, steps=20, out="docs/results/drafter_drift.json")
  parser.add_argument("--depth", type=int, default=5, help="draft depth of the fixed chain")
  parser.add_argument("--drafter-lr", type=float, default=1e-4, help="online lr of the "
                      "adapted drafter")
  parser.add_argument("--scratch-lr", type=float, default=1e-3, help="online lr of the "
                      "scratch drafter")
  parser.add_argument("--serial-steps", type=int, default=8, help="online drafter steps per "
                      "RL step")
  a = parser.parse_args()
  t_start = time.perf_counter()
  job, policy_dir, drafter_dir = rb.prepare(a)
  spec = SpecConfig(a.depth, 1, a.depth + 1)
  training = DrafterTrainingConfig(learning_rate=a.drafter_lr, serial_steps=a.serial_steps,
                                   serial_budget="fixed", seed=a.seed)
  scratch_training = dataclasses.replace(training, learning_rate=a.scratch_lr)
  t0 = time.perf_counter()
  arms = {
      "adapted": rb.make_arm(job, policy_dir, drafter=drafter_dir, spec=spec, training=training),
      "frozen": rb.make_arm(job, policy_dir, drafter=drafter_dir, spec=spec),
      "scratch": rb.make_arm(job, policy_dir, drafter="scratch", spec=spec,
                             training=scratch_training, seed=a.seed),
  }
  build_s = time.perf_counter() - t0
  print(f"built and compiled {len(arms)} arms in {build_s:.0f}s", flush=True)
  frozen = arms["frozen"]
  frozen_eval = make_eval_step(frozen.engine.drafter_graphdef, frozen.policy.graphdef)
  start = rb.params_vector(arms["adapted"])
  kl_probe = rb.make_kl_probe(job, policy_dir)
  rows = {name: [] for name in ARMS}
  drift, kls, styles = [], [], []
  for step in range(a.steps):
    order = harness.repeat_order(ARMS, step, "rotate")
    # the weights each arm drafts this step's rollout with (the engine's copy, never donated)
    # (copies: the drafter steps and the policy update donate the buffers they were given)
    drafting = {name: jax.tree.map(jnp.copy, arms[name].engine.drafter_params) for name in ARMS}
    target = jax.tree.map(jnp.copy, frozen.engine.params)  # this step's policy (every arm's)
    for name in order:
      rows[name].append(rb.step_row(arms[name].step()))
    # held-out scores: each drafter as it drafted this rollout, on this step's fresh batch
    batch = jax.device_put(arms["adapted"].online.buffer.freshest_batch())
    for name in ARMS:
      m = jax.device_get(frozen_eval(drafting[name], target, batch))
      rows[name][-1].update(heldout_loss=round(float(m["loss"]), 5),
                            heldout_top1=round(float(m["top1"]), 5))
    gap = np.linalg.norm(rb.params_vector(arms["adapted"]) - start) / np.linalg.norm(start)
    drift.append(float(gap))
    kls.append(kl_probe(frozen))  # this step's rollout (the policy before this step's update)
    styles.append(rb.new_style_share([job.tokenizer.decode(t) for t in frozen.last_rollout[1]]))
    row = {n: rows[n][-1] for n in ARMS}
    print(f"step {step + 1:3d} reward {row['adapted']['reward']:.3f}  accept len " +
          "  ".join(f"{n} {rb.fmt(row[n].get('mean_accept_len'), '.2f')}" for n in ARMS) +
          "  held-out top-1 " + "  ".join(f"{n} {row[n]['heldout_top1']:.3f}" for n in ARMS) +
          f"  (adapted in-sample {rb.fmt(row['adapted'].get('drafter_train_top1'))})" +
          f"  policy moved {gap:.2e}  KL {kls[-1]:.3f}  new style {styles[-1]:.2f}  compiles " +
          "/".join(str(row[n]["compiles"]) for n in ARMS), flush=True)
  check = rb.same_trajectory(arms, rows)
  third = max(1, a.steps // 3)
  summary = {}
  for name in ARMS:
    mine = rows[name]
    col = lambda key, part, mine=mine: harness.mean(r.get(key) for r in part(mine))
    first, last = (lambda r: r[:third]), (lambda r: r[-third:])
    summary[name] = dict(accept_len_first_third=col("mean_accept_len", first),
                         accept_len_last_third=col("mean_accept_len", last),
                         accept_len_mean=harness.mean(r.get("mean_accept_len") for r in mine),
                         heldout_top1_first_third=col("heldout_top1", first),
                         heldout_top1_last_third=col("heldout_top1", last),
                         rollout_s_median=harness.median(r["rollout_s"] for r in mine),
                         compiles_during_steps=sum(r["compiles"] for r in mine),
                         precompile_s=arms[name].precompile_s)
    if name != "frozen":
      summary[name].update(
          trainer_heldout_top1_last_third=col("drafter_top1", last),
          train_top1_first_third=col("drafter_train_top1", first),
          train_top1_last_third=col("drafter_train_top1", last),
          # the trainer's held-out top-1 against this script's (same weights, same batch)
          trainer_vs_script_heldout_top1_max_abs_gap=max(
              abs(r["drafter_top1"] - r["heldout_top1"]) for r in mine))
  last = {n: summary[n]["accept_len_last_third"] for n in ARMS}
  adapted_rows = rows["adapted"]
  critical_path = dict(  # one device: the adapted drafter's serial steps sit inside the RL step
      drafter_serial_s_median=harness.median(r.get("drafter_serial_s") for r in adapted_rows),
      rollout_s_median=harness.median(r["rollout_s"] for r in adapted_rows),
      step_s_median=harness.median(r["step_s"] for r in adapted_rows),
      frozen_rollout_s_median=summary["frozen"]["rollout_s_median"])
  workload = ("the default tiny job" if a.drift == "none" else
              f"format shift: a correct answer earns 1 in a carry-first trace style the warm "
              f"start writes {a.new_style_share:.0%} of the time, {a.old_style_reward} in its own")
  mean_all = {n: summary[n]["accept_len_mean"] for n in ARMS}
  report = dict(
      command=" ".join(sys.argv), args=vars(a), spec=dict(depth=a.depth, topk=1,
                                                          verify_tokens=a.depth + 1),
      verify="coupled", job=dict(prompts_per_step=a.prompts, group_size=a.group,
                                 max_new_tokens=a.max_new, policy_lr=a.lr,
                                 task=job.cfg.task.to_dict(), model=job.cfg.model.to_dict()),
      online_drafter=dict(adapted_learning_rate=a.drafter_lr, scratch_learning_rate=a.scratch_lr,
                          serial_steps=a.serial_steps, rows=training.rows,
                          seq_len=training.seq_len),
      initial_drafter=rb.drafter_report(drafter_dir), policy_dir=str(policy_dir),
      build_s=round(build_s, 1), trajectory=check, policy_rel_l2_from_start=drift,
      workload=workload, policy_kl_to_start=kls, new_style_share=styles,
      critical_path=critical_path,
      summary=summary,
      adapted_over_frozen_last_third=last["adapted"] / last["frozen"],
      adapted_over_frozen_mean=mean_all["adapted"] / mean_all["frozen"],
      paper=dict(rb.PAPER_TABLE6, adapted_over_stale=6.53 / 4.59),
      steps={name: rows[name] for name in ARMS},
      wall_s=round(time.perf_counter() - t_start, 1))
  lines = [f"{name:8s} accept len first third {rb.fmt(s['accept_len_first_third'])} last third "
           f"{rb.fmt(s['accept_len_last_third'])}; held-out top-1 "
           f"{rb.fmt(s['heldout_top1_first_third'])} -> {rb.fmt(s['heldout_top1_last_third'])}"
           for name, s in summary.items()]
  lines.append(f"adapted / frozen accept len over the last third: "
               f"{report['adapted_over_frozen_last_third']:.3f} (paper: {6.53 / 4.59:.3f}); "
               f"policy moved {drift[-1]:.2e} (relative L2) in {a.steps} steps")
  rb.finish(a.out, report, lines)


if __name__ == "__main__":
  main()
