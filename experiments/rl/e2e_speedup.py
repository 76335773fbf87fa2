"""End-to-end RL step time: TLT (adaptive speculative rollouts + the drafter trained online) vs
vanilla rollouts vs the same speculative rollouts with a frozen drafter, as ratios in one run.

  python -m experiments.rl.e2e_speedup [--steps 20] [--strategies 3,5] [--engine adaptive]
      [--out docs/results/e2e_speedup.json]

The default job (configs/tiny_grpo.py) at a small size on one device: the tiny policy is
warm-started once and an initial EAGLE drafter trained offline on its own rollouts (both cached
under experiments/out/rl_bench/). Up to four GRPO trainers (--arms; default all four) start from
the same weights and seeds:

* ``vanilla``: no drafter;
* ``sd_frozen``: the initial drafter, never updated;
* ``tlt``: the initial drafter trained online (one device: serial drafter steps between rollout
  and update, DrafterTrainingConfig at --drafter-lr) under the default budget, the ledger: paid
  from what SD saved, after a bounded bootstrap grant; its new weights in the engine whenever
  training changed them;
* ``tlt_fixed``: the same with ``serial_budget="fixed"``: --serial-steps every RL step.

Both speculative arms use the same engine: ``--engine adaptive`` (default; TLT's: vanilla plus
the chain strategies of --strategies, chosen per segment and batch bucket by the tuner,
SD only in buckets <= sd_max_batch) or ``fixed`` (every segment the first chain). Every arm
verifies with ``coupled`` sampling, so all arms emit exactly the tokens of vanilla sampling and
follow the same policy trajectory (tokens and rewards checked equal at every step): only speed
differs. The arms step in turn, the order rotating every step, so that load from other
processes falls on all of them; each step's time is compared with vanilla's at the same step
(same tokens) and the medians of those ratios are reported, with the ratios of the arms' median
step and rollout times and the breakdown (rollout / drafter training / update seconds, mean
accepted length). Writes a JSON report and, with matplotlib, a PNG of the reward curves (which
coincide) and step times.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from experiments import harness
from experiments.rl import rl_bench as rb
from experiments.harness import DrafterTrainingConfig, SpecConfig

ARMS = ("vanilla", "sd_frozen", "tlt", "tlt_fixed")


def chains(text: str) -> tuple[SpecConfig, ...]:
  return tuple(SpecConfig(int(d), 1, int(d) + 1) for d in text.split(",") if d)


def accept_len(row: dict) -> float | None:
  """A step's mean accepted length, None when its rollout ran no speculative step (the trainer
  then leaves the key out: e.g. the adaptive tuner chose vanilla for every segment)."""
  return row.get("mean_accept_len")


def summarize(rows: dict, skip: int) -> tuple[dict, range, list[int]]:
  """Per arm: medians of step/rollout/update/drafter seconds over the steps from ``skip`` on,
  the paired ratios to vanilla (per step, then the median; also over the steps where no arm
  compiled) and the ratios of the medians; the mean accepted length over the steps that ran SD."""
  names = list(rows)
  n = len(rows["vanilla"])
  kept = range(skip, n)
  clean = [i for i in kept if all(rows[name][i]["compiles"] == 0 for name in names)]
  van = rows["vanilla"]
  other = lambda r: r["step_s"] - r["rollout_s"] - r["update_s"] - r.get("drafter_serial_s", 0)
  summary = {}
  for name in names:
    mine = rows[name]
    accepts = [accept_len(mine[i]) for i in kept]
    summary[name] = dict(
        step_s_median=harness.median(mine[i]["step_s"] for i in kept),
        rollout_s_median=harness.median(mine[i]["rollout_s"] for i in kept),
        update_s_median=harness.median(mine[i]["update_s"] for i in kept),
        drafter_serial_s_median=harness.median(mine[i].get("drafter_serial_s", 0.0) for i in kept),
        other_s_median=harness.median(other(mine[i]) for i in kept),
        tail_s_median=harness.median(mine[i]["tail_s"] for i in kept),
        mean_accept_len=harness.mean(accepts),
        steps_with_sd=sum(v is not None for v in accepts),
        compiles_during_steps=sum(r["compiles"] for r in mine),
        step_s_max=max(r["step_s"] for r in mine),
        rollout_s_max=max(r["rollout_s"] for r in mine),
        drafter_heldout_top1_mean=harness.mean(mine[i].get("drafter_top1") for i in kept),
        drafter_train_top1_mean=harness.mean(mine[i].get("drafter_train_top1") for i in kept),
        step_vs_vanilla_paired_median=harness.median(mine[i]["step_s"] / van[i]["step_s"]
                                                for i in kept),
        rollout_vs_vanilla_paired_median=harness.median(mine[i]["rollout_s"] / van[i]["rollout_s"]
                                                   for i in kept),
        step_vs_vanilla_paired_median_no_compile_steps=harness.median(
            mine[i]["step_s"] / van[i]["step_s"] for i in clean),
        rollout_vs_vanilla_paired_median_no_compile_steps=harness.median(
            mine[i]["rollout_s"] / van[i]["rollout_s"] for i in clean))
  # accepted length against the frozen drafter's, over the steps where both ran SD (the tuner
  # picks SD per segment and bucket from timings, so the arms' SD steps differ)
  if "tlt" in rows and "sd_frozen" in rows:
    both = [i for i in kept
            if accept_len(rows["tlt"][i]) and accept_len(rows["sd_frozen"][i])]
    summary["tlt"]["accept_len_vs_sd_frozen_paired"] = dict(
        steps=len(both),
        tlt_mean=harness.mean(accept_len(rows["tlt"][i]) for i in both),
        sd_frozen_mean=harness.mean(accept_len(rows["sd_frozen"][i]) for i in both),
        ratio_median=harness.median(accept_len(rows["tlt"][i]) / accept_len(rows["sd_frozen"][i])
                               for i in both))
  for name in names:
    s = summary[name]
    s["step_median_ratio_vs_vanilla"] = s["step_s_median"] / summary["vanilla"]["step_s_median"]
    s["rollout_median_ratio_vs_vanilla"] = (s["rollout_s_median"]
                                            / summary["vanilla"]["rollout_s_median"])
    s["speedup_vs_vanilla"] = 1.0 / s["step_vs_vanilla_paired_median"]
  return summary, kept, clean


def summary_line(name: str, s: dict) -> str:
  """One arm's medians, its paired ratios to vanilla and its accepted length, for the log."""
  return (f"{name:9s} step {s['step_s_median']:.3f}s (x{s['step_vs_vanilla_paired_median']:.2f}"
          f" vanilla, paired) rollout {s['rollout_s_median']:.3f}s (x"
          f"{s['rollout_vs_vanilla_paired_median']:.2f}) update {s['update_s_median']:.3f}s "
          f"drafter {s['drafter_serial_s_median']:.3f}s accept {rb.fmt(s['mean_accept_len'])}")


def plot(rows: dict, path: pathlib.Path) -> str | None:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  styles = {"vanilla": ("-", "o", 9), "sd_frozen": ("--", "s", 6), "tlt": (":", "^", 4),
            "tlt_fixed": ("-.", "v", 4)}
  for name, arm_rows in rows.items():
    steps = range(1, len(arm_rows) + 1)
    line, marker, size = styles[name]
    left.plot(steps, [r["reward"] for r in arm_rows], linestyle=line, marker=marker,
              markersize=size, label=name)
    right.plot(steps, [r["step_s"] for r in arm_rows], linestyle=line, marker=marker,
               markersize=5, label=name)
  left.set(xlabel="RL step", ylabel="mean reward", title="reward (coupled verification: "
           "identical in every arm)")
  right.set(xlabel="RL step", ylabel="seconds", title="RL step time", yscale="log")
  for ax in (left, right):
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)


def arm_names(text: str) -> tuple[str, ...]:
  """``--arms``: a comma list of ARMS, vanilla always among them (every ratio is to it)."""
  names = tuple(n.strip() for n in text.split(",") if n.strip())
  unknown = [n for n in names if n not in ARMS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown arm(s) {', '.join(unknown)}: choose from "
                                     f"{', '.join(ARMS)}")
  if "vanilla" not in names:
    raise argparse.ArgumentTypeError("--arms must include vanilla: every ratio is taken "
                                     "against it")
  return tuple(n for n in ARMS if n in names)


def main():
  parser = harness.parser(__doc__)
  rb.add_job_args(parser, steps=20, out="docs/results/e2e_speedup.json")
  parser.add_argument("--arms", type=arm_names, default=ARMS, help="comma list of the arms "
                      f"to run (default: all of {','.join(ARMS)}; vanilla is always needed)")
  parser.add_argument("--engine", default="adaptive", choices=["adaptive", "fixed"])
  parser.add_argument("--strategies", type=chains, default=chains("3,5"),
                      help="chain depths, e.g. 3,5 (fixed: the first)")
  parser.add_argument("--serial-steps", type=int, default=8, help="online drafter steps per "
                      "RL step (tlt)")
  parser.add_argument("--drafter-lr", type=float, default=1e-4, help="online drafter lr (tlt; "
                      "DrafterTrainingConfig's default 1e-3 made the offline-trained drafter "
                      "worse than a frozen copy in drafter_drift.py)")
  parser.add_argument("--skip", type=int, default=1, help="first steps left out of the medians "
                      "(warm-up; every executable, the drafter's steps included, is compiled "
                      "before the timed steps)")
  a = parser.parse_args()
  t_start = time.perf_counter()
  job, policy_dir, drafter_dir = rb.prepare(a)
  sd = (dict(strategies=a.strategies) if a.engine == "adaptive"
        else dict(spec=a.strategies[0]))
  t0 = time.perf_counter()
  names = a.arms

  def make(name: str):
    if name == "vanilla":
      return rb.make_arm(job, policy_dir)
    budget = {"tlt": "ledger", "tlt_fixed": "fixed"}.get(name)  # sd_frozen: never trained
    training = None if budget is None else DrafterTrainingConfig(
        learning_rate=a.drafter_lr, serial_steps=a.serial_steps, serial_budget=budget,
        seed=a.seed)
    return rb.make_arm(job, policy_dir, drafter=drafter_dir, **sd, training=training)

  arms = {name: make(name) for name in names}
  build_s = time.perf_counter() - t0
  print(f"built and compiled {len(arms)} arms in {build_s:.0f}s", flush=True)
  rows = {name: [] for name in names}
  for step in range(a.steps):
    for name in harness.repeat_order(names, step, "rotate"):
      rows[name].append(rb.step_row(arms[name].step()))
    print(f"step {step + 1:3d} reward {rows['vanilla'][-1]['reward']:.3f}  step s " +
          "  ".join(f"{n} {rows[n][-1]['step_s']:.3f}" for n in names) + "  rollout s " +
          "  ".join(f"{n} {rows[n][-1]['rollout_s']:.3f}" for n in names) + "  accept " +
          "  ".join(f"{n} {rb.fmt(accept_len(rows[n][-1]), '.2f')}" for n in names[1:]) +
          "  compiles " + "/".join(str(rows[n][-1]["compiles"]) for n in names), flush=True)
  check = rb.same_trajectory(arms, rows)
  summary, kept, clean = summarize(rows, a.skip)
  tuners = {n: arms[n].engine.tuner.summary() for n in names[1:]
            if arms[n].engine.tuner is not None}
  png = plot(rows, pathlib.Path(a.out).with_suffix(".png"))
  report = dict(
      command=" ".join(sys.argv), args={k: (v if k != "strategies" else [s.depth for s in v])
                                        for k, v in vars(a).items()},
      engine=a.engine, verify="coupled",
      job=dict(prompts_per_step=a.prompts, group_size=a.group, max_new_tokens=a.max_new,
               policy_lr=a.lr, sd_max_batch=job.engine.sd_max_batch,
               segment_steps=job.engine.segment_steps),
      initial_drafter=rb.drafter_report(drafter_dir), build_s=round(build_s, 1),
      trajectory=check, steps_in_medians=len(kept), steps_without_compiles=len(clean),
      summary=summary, tuners=tuners, plot=png,
      precompile_s={name: arms[name].precompile_s for name in names},
      steps=rows, wall_s=round(time.perf_counter() - t_start, 1))
  rb.finish(a.out, report, [summary_line(name, s) for name, s in summary.items()])

if __name__ == "__main__":
  main()
