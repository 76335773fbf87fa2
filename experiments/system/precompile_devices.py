"""The main job's precompile on 1 and N simulated CPU devices: seconds and memory maps.

  python -m experiments.system.precompile_devices [--config tlt_jax/configs/tiny_longtail.py]
      [--devices 1,4] [--steps 1] [--timeout 1800] [--out FILE.json] [--set key=value ...]

Each device count runs the job as a subprocess (``XLA_FLAGS`` sets the simulated device count,
``--config.rollout_devices`` the rollout's devices) for ``--steps`` RL steps, with no persistent
compile cache, while this process reads ``/proc/PID/maps`` every half second (``--root``: the
checkout that runs, e.g. a worktree of an older commit). Reported per count: the job's own
precompile line (rollout executables and seconds), seconds from launch to
the first step line, the peak and final count of memory maps (the kernel refuses more than
``vm.max_map_count``, 65530 by default), and whether the job finished within ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPILED = re.compile(r"compiled (\d+) rollout executables in (\d+)s")


def map_count(pid: int) -> int | None:
  """The memory maps of process ``pid`` (None once it is gone)."""
  try:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def run_job(config: str, devices: int, steps: int, timeout: float, sets: list[str],
            root: pathlib.Path = ROOT) -> dict:
  """One job on ``devices`` simulated devices; its precompile figures and its memory maps."""
  logdir = tempfile.mkdtemp(prefix=f"precompile_{devices}dev_")
  flags = os.environ.get("XLA_FLAGS", "")
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
  cmd = [sys.executable, "-m", "tlt_jax.train", f"--config={config}",
         f"--config.rollout_devices={devices}", f"--config.trainer.steps={steps}",
         f"--config.logdir={logdir}", "--compile_cache=off"] + [f"--config.{s}" for s in sets]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  out = dict(devices=devices, cmd=" ".join(cmd[1:]), peak_maps=0, first_step_s=None,
             rollout_executables=None, rollout_compile_s=None, lines=[])

  def read():
    for line in proc.stdout:
      out["lines"].append(line.rstrip())
      if (m := COMPILED.search(line)) and out["rollout_executables"] is None:
        out["rollout_executables"], out["rollout_compile_s"] = int(m[1]), int(m[2])
      if line.startswith("step ") and out["first_step_s"] is None:
        out["first_step_s"] = round(time.perf_counter() - t0, 1)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  while proc.poll() is None and time.perf_counter() - t0 < timeout:
    maps = map_count(proc.pid)
    if maps is not None:
      out["peak_maps"] = max(out["peak_maps"], maps)
      out["last_maps"] = maps
    time.sleep(0.5)
  out["timed_out"] = proc.poll() is None
  if out["timed_out"]:
    proc.kill()
  proc.wait()
  reader.join(5)
  out.update(returncode=proc.returncode, wall_s=round(time.perf_counter() - t0, 1))
  out["lines"] = [l for l in out["lines"] if "compiled" in l or l.startswith("step ")
                  or "rror" in l][-12:]
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="tlt_jax/configs/tiny_longtail.py")
  parser.add_argument("--devices", default="1,4")
  parser.add_argument("--steps", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=1800)
  parser.add_argument("--set", action="append", default=[], help="a config override, key=value")
  parser.add_argument("--root", default=str(ROOT),
                      help="the checkout whose tlt_jax runs (e.g. a worktree of an older commit)")
  parser.add_argument("--out")
  args = parser.parse_args()
  results = []
  for n in [int(d) for d in args.devices.split(",")]:
    results.append(run_job(args.config, n, args.steps, args.timeout, args.set,
                           pathlib.Path(args.root)))
    print(json.dumps({k: v for k, v in results[-1].items() if k != "lines"}), flush=True)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
