"""The main job over 2 processes x 2 devices against 1 process x 4 devices: wall time, each
process's idle time in the rollout, and what the cross-process exchanges cost per step.

  python -m experiments.system.multiprocess_job [--steps 6] [--drafter none|eagle] [--out FILE]

Both runs use the same config and seed (the tiny default, shortened) and must log the same
tokens (``rollout_digest``); the script checks that. Per RL step (medians over the steps after
the first): ``step_s``, ``rollout_s``, ``update_s`` (its gradient all-reduce crosses processes
over gloo in the 2-process run), ``rollout_exchange_s`` (process 0 waiting for process 1's rows
plus the exchange itself), ``process_idle_s/<p>`` (how long process p's devices waited for the
slowest process) and, with the online drafter, ``drafter_sync_s`` (averaging the processes'
drafters). On this machine all processes share its cores: the figures are what the mechanism
costs here, not what a cluster would show.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = {"sft.steps": 100, "trainer.eval_problems": 16, "checkpoint_every": 0}
EAGLE = {"drafter": "eagle", "rollout.verify": "coupled"}


def _run(command: list[str], env: dict) -> float:
  t0 = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}"
             f"{done.stdout[-2000:]}")
  return time.perf_counter() - t0


def rows_of(logdir: pathlib.Path) -> list[dict]:
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  return [r for r in rows if "reward" in r]


def medians(rows: list[dict]) -> dict[str, float]:
  later = rows[1:] or rows
  keys = sorted({k for r in later for k, v in r.items() if isinstance(v, (int, float))
                 and (k.endswith("_s") or k.startswith("process_"))})
  return {k: statistics.median(r[k] for r in later if k in r) for k in keys}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--drafter", choices=("none", "eagle"), default="none")
  parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "multiprocess_job.json"))
  args = parser.parse_args()
  flags = {**BASE, "trainer.steps": args.steps, **(EAGLE if args.drafter == "eagle" else {})}
  flag_args = [f"--config.{k}={v}" for k, v in flags.items()]
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  extra = env.pop("XLA_FLAGS", "")  # kept (e.g. XLA's backend options), devices set per run
  report = {"flags": flags, "runs": {}}
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    one = dict(env, XLA_FLAGS=f"{extra} --xla_force_host_platform_device_count=4".strip())
    env = dict(env, XLA_FLAGS=extra)  # the launcher adds each process's device count
    wall = _run([sys.executable, "-m", "tlt_jax.train", f"--config.logdir={tmp / 'one'}",
                 *flag_args], one)
    report["runs"]["1 process x 4 devices"] = dict(wall_s=wall, **medians(rows_of(tmp / "one")))
    wall = _run([sys.executable, "-m", "tlt_jax.launch", "--processes", "2",
                 "--devices-per-process", "2", "--", f"--config.logdir={tmp / 'two'}",
                 *flag_args], env)
    report["runs"]["2 processes x 2 devices"] = dict(wall_s=wall, **medians(rows_of(tmp / "two")))
    pairs = list(zip(rows_of(tmp / "one"), rows_of(tmp / "two")))
  same = [a["rollout_digest"] == b["rollout_digest"] and a["reward"] == b["reward"]
          for a, b in pairs]
  report["same_tokens_and_rewards_every_step"] = all(same) and len(same) == args.steps
  report["per_step"] = [{"step": a["step"], "same_tokens": a["rollout_digest"] == b["rollout_digest"],
                         "reward": [a["reward"], b["reward"]], "loss": [a["loss"], b["loss"]],
                         "grad_norm": [a["grad_norm"], b["grad_norm"]]} for a, b in pairs]
  one, two = report["runs"].values()
  report["ratios_2x2_over_1x4"] = {k: two[k] / one[k] for k in ("wall_s", "step_s", "rollout_s",
                                                                "update_s") if one.get(k)}
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2))
  print(json.dumps(report, indent=2))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
