"""The held-out curves of SmolLM2 GRPO runs against their no-update control, from the runs' own
metrics.jsonl files.

  python -m experiments.rl.smollm2_curves --run seed0=runs/s0 --run seed1=runs/s1 \
      --control control=runs/c0 --out docs/results/smollm2_cpu_curve.png

Draws greedy accuracy and sampled reward per evaluated step (GRPO solid, the control dashed) and
writes the points beside the PNG as JSON.
"""

from __future__ import annotations

import json
import pathlib

from experiments import harness


def curve(logdir: str) -> dict[str, list]:
  """The held-out evaluations of a run: steps, greedy accuracy, sampled reward."""
  rows = [json.loads(line) for line in (pathlib.Path(logdir) / "metrics.jsonl").open()]
  evals = [r for r in rows if "eval_accuracy" in r]
  return dict(step=[r["step"] for r in evals], greedy=[r["eval_accuracy"] for r in evals],
              sampled=[r["eval_sampled_reward"] for r in evals])


def main(argv=None) -> dict:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  p = harness.parser(__doc__)
  p.add_argument("--run", action="append", default=[], help="NAME=LOGDIR of a GRPO run")
  p.add_argument("--control", action="append", default=[], help="NAME=LOGDIR of a control run")
  p.add_argument("--out", default="docs/results/smollm2_cpu_curve.png")
  a = p.parse_args(argv)
  runs = {n: curve(d) for n, d in (s.split("=", 1) for s in a.run)}
  controls = {n: curve(d) for n, d in (s.split("=", 1) for s in a.control)}
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  for ax, key, title in zip(axes, ("greedy", "sampled"),
                            ("held-out greedy accuracy", "held-out sampled reward (T = 0.7)")):
    for name, c in runs.items():
      ax.plot(c["step"], c[key], "-o", label=f"GRPO {name}")
    for name, c in controls.items():
      ax.plot(c["step"], c[key], "--", color="gray", label=f"no-update {name}")
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle("SmolLM2-135M-Instruct, configs/smollm2_cpu.py, 128 held-out problems, 2-core CPU")
  fig.tight_layout()
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  report = dict(runs=runs, controls=controls)
  harness.write_json(out.with_suffix(".json"), report)
  print(f"wrote {out} and {out.with_suffix('.json')}")
  return report


if __name__ == "__main__":
  main()
