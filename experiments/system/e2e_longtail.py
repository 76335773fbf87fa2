"""The figure and headline of ``accelerator_check.sh --e2e``, from each job's e2e JSON.

Reads the JSONs ``experiments/rl/e2e_default_job.py`` wrote (finished, or partial where a
timeout stopped the run) and shows vanilla's and TLT's per-step seconds for each job.

  python experiments/system/e2e_longtail.py --png OUT.png TINY.json MID.json

For each JSON it prints the steps done, the paired median TLT / vanilla ratios of step and
rollout seconds (steps 2 on, steps in which either arm compiled left out) and the breakdown's
headline (SD's share of decode steps, accepted tokens per SD step, host time per rollout), and it
draws one panel per job: each arm's step seconds per step and their ratio. matplotlib is
imported only here, with the Agg backend; where it is missing the PNG is skipped with a note
(the figures are in the JSONs). Imports neither JAX nor the package: it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys


def load(path: pathlib.Path) -> dict | None:
  """The JSON at ``path``, or None (with a note) where it is missing or unreadable."""
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    print(f"{path}: no figures ({e})")
    return None


def arms_of(report: dict) -> tuple[str, str] | None:
  """(vanilla's arm, the SD arm) of a report, or None before either has a step."""
  arms = report.get("arms") or []
  rows = report.get("steps_metrics") or {}
  if len(arms) < 2 or not rows.get(arms[0]) or not rows.get(arms[1]):
    return None
  return arms[0], arms[1]


def paired(report: dict, key: str) -> tuple[float | None, int]:
  """The median of the SD arm's ``key`` over vanilla's, paired per step, over steps 2 on where no
  arm compiled (all steps where that leaves none), and how many steps it covers."""
  pair = arms_of(report)
  if pair is None:
    return None, 0
  base, sd = (report["steps_metrics"][arm] for arm in pair)
  n = min(len(base), len(sd))
  compiled = report.get("compiled") or [False] * n
  kept = [i for i in range(1, n) if not (i < len(compiled) and compiled[i])] or list(range(n))
  ratios = [sd[i][key] / base[i][key] for i in kept if base[i].get(key) and key in sd[i]]
  return (statistics.median(ratios) if ratios else None), len(ratios)


def fmt(value, spec: str = ".3f") -> str:
  return "-" if value is None else format(value, spec)


def headline(name: str, report: dict) -> str:
  """One job's lines: how far it got, the paired ratios and the breakdown's main figures."""
  pair = arms_of(report)
  steps = len(report["steps_metrics"][pair[0]]) if pair else 0
  state = "partial, at " + str(report.get("stage")) if report.get("partial") else "complete"
  step, n = paired(report, "step_s")
  rollout, _ = paired(report, "rollout_s")
  lines = [f"{name}: {steps} paired steps ({state}); TLT / vanilla paired median over {n}: "
           f"step {fmt(step)}, rollout {fmt(rollout)}"]
  b = report.get("breakdown") or {}
  if b:
    by_bucket = ", ".join(f"{k} {fmt(v.get('sd_share_median'), '.2f')}"
                          for k, v in (b.get("sd_share_by_bucket") or {}).items())
    sources = ", ".join(f"{k} {fmt(v, '.2f')}"
                        for k, v in (b.get("accept_len_by_source_median") or {}).items())
    host = ", ".join(f"{k} {fmt(v, '.4f')}"
                     for k, v in (b.get("host_s_per_rollout_median") or {}).items())
    lines.append(f"  SD share of decode steps {fmt(b.get('sd_share_of_decode_steps_median'))} "
                 f"(by bucket: {by_bucket or '-'}); accepted per SD step "
                 f"{fmt(b.get('mean_accept_len_median'), '.2f')} (by source: {sources or '-'}); "
                 f"host s per rollout {host or '-'}")
    compile_s = {arm: c.get("rollout_compile_s") for arm, c in (b.get("compile") or {}).items()}
    if compile_s:
      lines.append("  rollout compile s: " + ", ".join(f"{k} {fmt(v, '.1f')}"
                                                       for k, v in compile_s.items()))
  return "\n".join(lines)


def plot(reports: dict[str, dict], png: pathlib.Path) -> pathlib.Path | None:
  """Per-step seconds of each job's arms (and their ratio on a second axis), one panel a job;
  None (with a note) where matplotlib is missing or no job has a step."""
  shown = {name: r for name, r in reports.items() if arms_of(r) is not None}
  if not shown:
    print(f"no steps to plot: {png} not written")
    return None
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
    from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(f"matplotlib is not installed: {png} not written (the per-step seconds are in the "
          f"JSONs' steps_metrics)")
    return None
  fig, axes = plt.subplots(1, len(shown), figsize=(6.5 * len(shown), 4.2), squeeze=False)
  for ax, (name, report) in zip(axes[0], shown.items()):
    base, sd = arms_of(report)
    rows = report["steps_metrics"]
    n = min(len(rows[base]), len(rows[sd]))
    x = list(range(1, n + 1))
    for arm, label in ((base, "vanilla"), (sd, f"TLT ({sd})")):
      ax.plot(x, [rows[arm][i]["step_s"] for i in range(n)], marker="o", ms=3, label=label)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("step seconds")
    ax.set_ylim(bottom=0)
    ratio = ax.twinx()
    ratio.plot(x, [rows[sd][i]["step_s"] / rows[base][i]["step_s"] for i in range(n)],
               color="grey", ls="--", lw=1, label="TLT / vanilla")
    ratio.axhline(1.0, color="grey", lw=0.5)
    ratio.set_ylabel("TLT / vanilla")
    step, _ = paired(report, "step_s")
    ax.set_title(f"{name}: paired median TLT / vanilla {fmt(step)}")
    handles = ax.get_legend_handles_labels()
    extra = ratio.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=8, loc="upper right")
  fig.tight_layout()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)
  plt.close(fig)
  return png


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("reports", nargs="+", type=pathlib.Path, help="the jobs' e2e JSONs")
  parser.add_argument("--png", type=pathlib.Path, default=None, help="where to draw the figure")
  a = parser.parse_args(argv)
  reports = {}
  for path in a.reports:
    report = load(path)
    if report is not None:
      name = path.stem[:-len("_e2e")] if path.stem.endswith("_e2e") else path.stem
      reports[name] = report
      print(headline(name, report))
  if a.png is not None:
    done = plot(reports, a.png)
    if done is not None:
      print(f"wrote {done}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
