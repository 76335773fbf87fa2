"""Does the default main job learn? GRPO against a no-update control, over several seeds.

  python -m experiments.rl.default_learns [--seeds 0 1 2] [--set trainer.learning_rate=1e-4 ...]
      [--control-seeds 0] [--jobs 4] [--no-control] [--out docs/results/default_learns.json]
      [--plot docs/results/default_job_curve.png]

Each seed runs the default job (configs/tiny_grpo.py through ``tlt_jax.train.run`` on a temp
logdir) twice: with GRPO updates, and as the control, the same job with every update skipped
(``--config.trainer.control=True``: the params stay bit for bit the warm start's). Both arms
share the warm start (same seed) and are evaluated on the same fixed held-out problems; the
control's end evaluation must equal its step-0 one (checked). Writes held-out greedy accuracy,
sampled reward and pass@k (``trainer.eval_pass_k``), start, end and the curve every
``trainer.eval_every`` steps, per arm and seed, with their mean and spread; each seed's GRPO
figures minus its control's (``over_control``); per operand size, the held-out problems the warm
start solved greedily and how many of them the GRPO run still solves (``kept_by_digits``); the
rollout's tail share and the command."""

from __future__ import annotations

import contextlib
from concurrent import futures
import datetime
import io
import json
import multiprocessing
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np

from experiments import harness
from experiments.harness import write_report
from experiments.rl.rl_bench import job_config, train
from tlt_jax.job.build import build_job
from tlt_jax.job.runner import make_trainer
from tlt_jax.models import from_pretrained
from tlt_jax.rl.tasks import carries_out, operand_digits

KEYS = ("accuracy_start", "accuracy_end", "sampled_start", "sampled_end")


def run_arm(cfg, update: bool) -> dict:
  """One job run; ``update=False`` is the no-update control (``trainer.control=True``)."""
  cfg.trainer.control = not update
  t0 = time.perf_counter()
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    summary = train.run(cfg)
  history = summary["history"]
  rollout = sum(m["rollout_s"] for m in history)
  updates = [m for m in history if "clip_fraction" in m]  # none in the control
  out = {k: summary[k] for k in KEYS}
  out.update(
      wall_s=round(time.perf_counter() - t0, 1),
      # the held-out curve: (step, greedy accuracy, sampled reward) at the start, every
      # trainer.eval_every steps and at the end
      curve=[(0, summary["accuracy_start"], summary["sampled_start"])] +
            [(m["step"], m["eval_accuracy"], m["eval_sampled_reward"]) for m in history
             if "eval_accuracy" in m] +
            [(summary["step"], summary["accuracy_end"], summary["sampled_end"])],
      train_reward_first5=summary["reward_first"], train_reward_last5=summary["reward_last"],
      tail_over_rollout=sum(m["tail_s"] for m in history) / max(rollout, 1e-9),
      rollout_over_step=summary["rollout_share"],
      clip_fraction_mean=float(np.mean([m["clip_fraction"] for m in updates])) if updates
      else None,
      approx_kl_max=float(max(m["approx_kl"] for m in updates)) if updates else None,
      len_p50=float(np.percentile(summary["lengths"], 50)),
      len_p99=float(np.percentile(summary["lengths"], 99)),
      len_max=int(max(summary["lengths"])))
  # trainer.eval_pass_k > 0: pass_at_<k>_start / _end, and the curve between
  ends = [k for k in summary if k.startswith("pass_at_") and k.endswith("_end")]
  for base in [k[:-len("_end")] for k in ends]:
    start, end = summary[base + "_start"], summary[base + "_end"]
    out.update({base + "_start": start, base + "_end": end, base + "_curve": (
        [(0, start)] + [(m["step"], m["eval_" + base]) for m in history if "eval_" + base in m] +
        [(summary["step"], end)])})
  return out


def greedy_by_problem(cfg, model_dir) -> list[list]:
  """``[larger operand's digits, final carry, greedy reward]`` of each held-out problem, for the
  policy saved in ``model_dir`` (the run's final_model; the control's is the warm start)."""
  job = build_job(cfg)
  model, _ = from_pretrained(model_dir)
  trainer = make_trainer(job, model, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
  problems, _, rewards = trainer.held_out(temperature=0.0)
  return [[operand_digits(p.prompt), bool(carries_out(p)), float(r)]
          for p, r in zip(problems, rewards)]


def one_run(job: tuple) -> dict:
  """``run_arm`` of ``(seed, update, overrides)`` on a temp logdir (a worker process's task),
  with the final policy's greedy reward per held-out problem."""
  seed, update, overrides = job
  with tempfile.TemporaryDirectory() as logdir:
    cfg = job_config(seed, overrides, logdir)
    r = run_arm(cfg, update)
    r["greedy_by_problem"] = greedy_by_problem(cfg, pathlib.Path(logdir) / "final_model")
  assert abs(np.mean([x[2] for x in r["greedy_by_problem"]]) - r["accuracy_end"]) < 1e-9, r
  return dict(r, seed=seed, arm="grpo" if update else "control")


def paired(runs: list[dict]) -> dict[int, dict[str, dict]]:
  """``{seed: {"grpo": run, "control": run}}`` for the seeds that ran both arms, ascending."""
  out = {}
  for seed in sorted({r["seed"] for r in runs}):
    arms = {r["arm"]: r for r in runs if r["seed"] == seed}
    if set(arms) == {"grpo", "control"}:
      out[seed] = arms
  return out


def kept_by_digits(runs: list[dict]) -> dict:
  """Per operand size, over the seeds with both arms: the held-out problems the warm start (the
  control's policy) solved greedily, and the share of them the GRPO run's policy still solves;
  beside it each arm's greedy accuracy on every problem of that size, the problems newly solved,
  and the noise the change is read against: the binomial standard error of a greedy accuracy
  over that many problems."""
  out = {}
  for arms in paired(runs).values():
    for (digits, _, start), (_, _, end) in zip(arms["control"]["greedy_by_problem"],
                                               arms["grpo"]["greedy_by_problem"]):
      row = out.setdefault(str(digits), dict(problems=0, solved_at_start=0, still_solved=0,
                                             newly_solved=0, start_sum=0.0, end_sum=0.0))
      row["problems"] += 1
      row["start_sum"] += start
      row["end_sum"] += end
      if start >= 1.0:
        row["solved_at_start"] += 1
        row["still_solved"] += int(end >= 1.0)
      else:
        row["newly_solved"] += int(end >= 1.0)
  for row in out.values():
    row["greedy_start"] = row.pop("start_sum") / row["problems"]
    row["greedy_end"] = row.pop("end_sum") / row["problems"]
    row["kept_share"] = (row["still_solved"] / row["solved_at_start"]
                         if row["solved_at_start"] else None)
    p = row["greedy_start"]
    row["stderr"] = float(np.sqrt(max(p * (1 - p), 1e-12) / row["problems"]))
  return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def over_control(runs: list[dict]) -> dict:
  """Per seed with both arms: the GRPO run's end figures minus its control's, on the same
  held-out problems (greedy accuracy, sampled reward, pass@k)."""
  out = {}
  for seed, arms in paired(runs).items():
    ends = [k for k in arms["grpo"] if k.endswith("_end") and k in arms["control"]]
    out[str(seed)] = {k[:-len("_end")]: arms["grpo"][k] - arms["control"][k] for k in ends}
  return out


def spread(values) -> dict:
  """Mean, sample std and range of ``values``."""
  v = np.asarray(values, float)
  return dict(mean=float(v.mean()), std=float(v.std(ddof=1)) if len(v) > 1 else 0.0,
              min=float(v.min()), max=float(v.max()))


def plot_curves(runs: list[dict], path: str, command: str) -> None:
  """Held-out greedy accuracy, sampled reward and (with ``trainer.eval_pass_k``) pass@k against
  the RL step: each seed's GRPO run (solid) and its no-update control (dashed, flat by
  construction), one panel per figure."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  pass_keys = sorted({k for r in runs for k in r if k.startswith("pass_at_")
                      and k.endswith("_curve")})
  panels = [("curve", 1, "held-out greedy accuracy"), ("curve", 2, "held-out sampled reward (T=1)")]
  panels += [(k, 1, f"held-out pass@{k[len('pass_at_'):-len('_curve')]} (T=1)")
             for k in pass_keys]
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), sharex=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  seeds = sorted({r["seed"] for r in runs})
  for r in runs:
    color = colors[seeds.index(r["seed"]) % len(colors)]
    style = dict(color=color, marker="o", ms=3) if r["arm"] == "grpo" else \
        dict(color=color, ls="--", alpha=0.7)
    label = f"seed {r['seed']}, " + ("GRPO" if r["arm"] == "grpo" else "no-update control")
    for ax, (key, column, _) in zip(axes, panels):
      if key in r:
        points = np.array(r[key], float)
        ax.plot(points[:, 0], points[:, column], label=label, **style)
  for ax, (_, _, name) in zip(axes, panels):
    ax.set(xlabel="RL step", ylabel=name)
  axes[-1].legend(fontsize=7)
  fig.suptitle("the default job (python -m tlt_jax.train) against its no-update control",
               fontsize=10)
  fig.text(0.01, 0.01, command, fontsize=6, color="gray")
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  harness.add_set_flag(parser)
  parser.add_argument("--no-control", action="store_true",
                      help="skip the no-update runs (the step-0 evaluation stands in for them)")
  parser.add_argument("--control-seeds", type=int, nargs="*", default=None,
                      help="seeds that also run the no-update control (default: every seed)")
  parser.add_argument("--jobs", type=int, default=1, help="runs at once (processes)")
  parser.add_argument("--out",
                      default=str(harness.ROOT / "docs" / "results" / "default_learns.json"))
  parser.add_argument("--plot", default=None, metavar="PNG",
                      help="also draw the held-out curves of every run (GRPO against the "
                           "control, per seed) into this PNG; with --set trainer.eval_every=N")
  a = parser.parse_args()
  control = a.seeds if a.control_seeds is None else a.control_seeds
  todo = [(seed, True) for seed in a.seeds] + [(seed, False) for seed in control
                                               if not a.no_control]
  runs = []
  with futures.ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
    for r in ex.map(one_run, [(seed, update, a.set) for seed, update in todo]):
      runs.append(r)
      print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()
                        if k != "greedy_by_problem"}), flush=True)
      if r["arm"] == "control":  # no update: the same params, the same fixed held-out problems
        assert (r["accuracy_end"], r["sampled_end"]) == (r["accuracy_start"], r["sampled_start"]), r
  arms = {}
  for arm in ("grpo", "control"):
    rows = [r for r in runs if r["arm"] == arm]
    if rows:
      arms[arm] = {k: spread([r[k] for r in rows]) for k in KEYS + ("tail_over_rollout",)}
      arms[arm]["accuracy_gain"] = spread([r["accuracy_end"] - r["accuracy_start"] for r in rows])
      arms[arm]["sampled_gain"] = spread([r["sampled_end"] - r["sampled_start"] for r in rows])
      for key in sorted({k[:-len("_end")] for r in rows for k in r
                         if k.startswith("pass_at_") and k.endswith("_end")}):
        arms[arm][key + "_gain"] = spread([r[key + "_end"] - r[key + "_start"] for r in rows])
  cfg = job_config(a.seeds[0], a.set, "")
  result = dict(
      date=datetime.date.today().isoformat(),
      command="python " + " ".join([str(pathlib.Path(sys.argv[0]).as_posix())] + sys.argv[1:]),
      config={k: cfg[k].to_dict() for k in ("task", "sft", "grpo", "trainer")},
      control="the same job, seed and held-out problems with every policy update skipped "
              "(trainer.control=True: params unchanged)",
      arms=arms, over_control=over_control(runs), kept_by_digits=kept_by_digits(runs),
      runs=runs)
  write_report(a.out, result)
  if a.plot:
    plot_curves(runs, a.plot, result["command"])
  for digits, row in result["kept_by_digits"].items():
    print(f"{digits} digits: {row['problems']} problems, greedy {row['greedy_start']:.3f} -> "
          f"{row['greedy_end']:.3f} (+- {row['stderr']:.3f}); solved by the warm start "
          f"{row['solved_at_start']}, still solved {row['still_solved']}, newly solved "
          f"{row['newly_solved']}")
  for seed, row in result["over_control"].items():
    print(f"seed {seed} over its control: " +
          ", ".join(f"{k} {v:+.3f}" for k, v in row.items()))
  for arm, s in arms.items():
    print(f"{arm}: greedy {s['accuracy_start']['mean']:.3f} -> {s['accuracy_end']['mean']:.3f} "
          f"(gain {s['accuracy_gain']['mean']:+.3f} +- {s['accuracy_gain']['std']:.3f}), sampled "
          f"{s['sampled_start']['mean']:.3f} -> {s['sampled_end']['mean']:.3f} (gain "
          f"{s['sampled_gain']['mean']:+.3f} +- {s['sampled_gain']['std']:.3f}), tail/rollout "
          f"{s['tail_over_rollout']['mean']:.2f}")


if __name__ == "__main__":
  main()
