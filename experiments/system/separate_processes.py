"""TLT against vanilla as users run them: each arm a separate ``python -m tlt_jax.train``
process, one after the other, alternating, the same seed.

  python -m experiments.system.separate_processes --config configs/tiny_longtail.py \
      --drafter suffix --repeats 2
  python -m experiments.system.separate_processes --config configs/tiny_grpo.py --drafter eagle
  python -m experiments.system.separate_processes --config configs/smollm2_cpu.py \
      --drafter suffix --set trainer.steps=4

A paired harness that runs both arms in one process lets background work (the SD
arms' compile) slow both alike and hides it; here each arm has the machine to itself, as a user
has. Per run: the whole process's wall time, the time from its start to its first RL step's line
(``step    1/``), each step's ``step_s``, ``rollout_s`` and ``update_s`` (metrics.jsonl), and the
train rewards. Reported: per repeat, the arm's median step over the steps after the first, and
the ratios TLT / vanilla of the median step, the rollout, the update, the whole process and the
time to the first step (medians over repeats; below 1: TLT faster), and whether the two arms'
rewards are the same at every step (coupled verification: they must be). ``--set KEY=VALUE``
passes ``--config.KEY=VALUE`` to both arms.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from experiments import harness

OUT = pathlib.Path("docs/results")


def run_arm(config: str, drafter: str, seed: int, sets: list[str], logdir: pathlib.Path) -> dict:
  """One job process; its times and its metrics rows."""
  cmd = [sys.executable, "-m", "tlt_jax.train", f"--config={config}", f"--config.drafter={drafter}",
         f"--config.seed={seed}", f"--config.logdir={logdir}"] + [f"--config.{s}" for s in sets]
  t0 = time.perf_counter()
  first_step = None
  with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
    for line in proc.stdout:
      if first_step is None and line.startswith("step    1/"):
        first_step = time.perf_counter() - t0
    code = proc.wait()
  wall = time.perf_counter() - t0
  if code != 0:
    raise RuntimeError(f"{' '.join(cmd)} exited with {code}")
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  steps = [r for r in rows if "reward" in r]
  return dict(drafter=drafter, wall_s=wall, first_step_line_s=first_step,
              step_s=[r["step_s"] for r in steps], rollout_s=[r["rollout_s"] for r in steps],
              update_s=[r["update_s"] for r in steps], reward=[r["reward"] for r in steps])


def med(values: list[float]) -> float:
  return statistics.median(values[1:] if len(values) > 1 else values)  # the first step apart


def main(argv=None) -> dict:
  p = harness.parser(__doc__)
  p.add_argument("--config", default="configs/tiny_longtail.py")
  p.add_argument("--drafter", default="suffix")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--set", action="append", default=[], help="KEY=VALUE for both arms")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  name = pathlib.Path(a.config).stem
  out = pathlib.Path(a.out or OUT / f"separate_processes_{name}_{a.drafter}.json")
  runs = []
  with tempfile.TemporaryDirectory(prefix="tlt_separate_") as tmp:
    for r in range(a.repeats):
      order = ("none", a.drafter) if r % 2 == 0 else (a.drafter, "none")  # alternating
      for drafter in order:
        print(f"repeat {r + 1}/{a.repeats}: {drafter} ...", flush=True)
        runs.append(dict(run_arm(a.config, drafter, a.seed, a.set,
                                 pathlib.Path(tmp) / f"{r}_{drafter}"), repeat=r))
        harness.write_json(out, dict(config=a.config, drafter=a.drafter, partial=True, runs=runs))
        last = runs[-1]
        print(f"  wall {last['wall_s']:.0f}s, first step line at {last['first_step_line_s']:.0f}s, "
              f"median step {med(last['step_s']):.2f}s", flush=True)
  by = lambda d, r: next(x for x in runs if x["drafter"] == d and x["repeat"] == r)
  ratios = {k: [] for k in ("step", "rollout", "update", "wall", "first_step_line")}
  for r in range(a.repeats):
    tlt, van = by(a.drafter, r), by("none", r)
    for k in ("step", "rollout", "update"):
      ratios[k].append(med(tlt[f"{k}_s"]) / med(van[f"{k}_s"]))
    ratios["wall"].append(tlt["wall_s"] / van["wall_s"])
    ratios["first_step_line"].append(tlt["first_step_line_s"] / van["first_step_line_s"])
  same = all(by(a.drafter, r)["reward"] == by("none", r)["reward"] for r in range(a.repeats))
  report = dict(config=a.config, drafter=a.drafter, seed=a.seed, sets=a.set, runs=runs,
                ratios=ratios, median_ratio={k: statistics.median(v) for k, v in ratios.items()},
                same_rewards=same, **harness.machine("cpu_count", "loadavg_end"))
  print(json.dumps(dict(median_ratio=report["median_ratio"], same_rewards=same), indent=1))
  harness.write_json(out, report)
  print(f"wrote {out}")
  return report


if __name__ == "__main__":
  main()
