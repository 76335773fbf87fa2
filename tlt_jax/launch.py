"""Runs a job as several processes on this machine: the one-command way to run and debug what a
cluster runs.

  python -m tlt_jax.launch --processes 2 --devices-per-process 2 -- [train flags ...]
  python -m tlt_jax.launch --processes 2 --module tlt_jax.train -- --config.drafter=eagle

Starts ``--processes`` copies of ``python -m <module> <flags> --config.distributed=True``, each
with ``JAX_COORDINATOR_ADDRESS`` (a free local port), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` set, as a cluster's launcher would (``hosts.py``); with
``--devices-per-process N`` each simulates N CPU devices (``XLA_FLAGS``; leave it out on a
machine whose processes should use its accelerators, and pick them with
``--visible-devices``). Simulated devices also get the thread pool that one process holding all
of them would have (``PJRT_NPROC``, see ``cpu_pool_size``), so that a launched run computes
bit for bit what one process with ``processes x devices`` CPU devices computes. Process 0's
output is passed through; the others' lines are prefixed with ``[process i]`` (the job prints
from process 0 only, so they show warnings and errors).

When a process fails (a non-zero exit, or killed by a signal) while others still run, the others
are stopped at once (SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher exits with
that process's code, naming it; resume with the same command plus ``--config.resume=True``.
Ctrl-C (or SIGTERM to the launcher) is passed to every process: each finishes its step, they save
one checkpoint together and exit.

On a cluster use its own launcher instead: ``srun python -m tlt_jax.train
--config.distributed=True`` under SLURM (JAX reads the SLURM variables), or the same command on
every worker of a TPU pod slice (``gcloud compute tpus tpu-vm ssh NAME --worker=all --command
...``); see the README.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

NOISE = ("[Gloo] ",)  # gloo's connection lines: one per collective group, nothing to act on


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def cpu_pool_size(base: dict, devices: int) -> int:
  """The size of the intra-op thread pool XLA:CPU gives a process with ``devices`` CPU devices:
  ``max($PJRT_NPROC or $NPROC or this machine's cores, devices)``.

  It matters for more than speed: XLA:CPU cuts a large matrix product (e.g. a weight gradient,
  contracting over every token of a batch) into as many partial sums as that pool suggests, so
  the same program on the same inputs rounds differently in a process with 4 simulated devices
  than in one with 2 (docs/benchmarks.md has a case).
  """
  for name in ("PJRT_NPROC", "NPROC"):
    value = base.get(name, "")
    if value.strip().isdigit():
      return max(int(value), devices)
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return max(cores or 1, devices)


def child_env(base: dict, index: int, count: int, address: str, devices: int | None,
              visible: str | None) -> dict:
  """The environment of process ``index`` of ``count``."""
  env = dict(base, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(count),
             JAX_PROCESS_ID=str(index), PYTHONUNBUFFERED="1")
  if devices is not None:
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count="))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    # the pool of one process with all count x devices devices: the same partial sums, the
    # same bits as that process (cpu_pool_size)
    env["PJRT_NPROC"] = str(cpu_pool_size(base, count * devices))
  if visible is not None:  # e.g. "0,1;2,3": process i sees the i-th group
    groups = visible.split(";")
    env["JAX_LOCAL_DEVICE_IDS"] = groups[index]
  return env


def _pump(stream, index: int, out) -> None:
  prefix = "" if index == 0 else f"[process {index}] "
  for line in iter(stream.readline, ""):
    if line.startswith(NOISE):
      continue
    out.write(prefix + line)
    out.flush()


def _describe(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


def launch(args: list[str], processes: int, module: str = "tlt_jax.train",
           devices_per_process: int | None = None, visible_devices: str | None = None,
           grace_s: float = 10.0, port: int | None = None, env: dict | None = None) -> int:
  """Runs the processes (module docstring); returns the exit code."""
  if processes < 1:
    raise ValueError(f"--processes must be at least 1, got {processes}")
  if devices_per_process is not None and devices_per_process < 1:
    raise ValueError(f"--devices-per-process must be at least 1, got {devices_per_process}")
  if visible_devices is not None and len(visible_devices.split(";")) != processes:
    raise ValueError(f"--visible-devices needs {processes} groups separated by ';' (one per "
                     f"process, e.g. '0,1;2,3'), got {visible_devices!r}")
  address = f"127.0.0.1:{port or free_port()}"
  command = [sys.executable, "-m", module, *args]
  if module == "tlt_jax.train" and not any(a.startswith("--config.distributed") for a in args):
    command.append("--config.distributed=True")
  children, pumps = [], []
  for i in range(processes):
    child = subprocess.Popen(command, env=child_env(env or os.environ, i, processes, address,
                                                    devices_per_process, visible_devices),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # our Ctrl-C reaches them through us
    children.append(child)
    pump = threading.Thread(target=_pump, args=(child.stdout, i, sys.stdout), daemon=True)
    pump.start()
    pumps.append(pump)

  print(f"launch: {processes} processes (pids {', '.join(str(c.pid) for c in children)}), "
        f"coordinator {address}", file=sys.stderr, flush=True)

  forwarded = []

  def forward(signum, _frame):  # every process stops by itself: none of them failed
    forwarded.append(signum)
    for c in children:
      if c.poll() is None:
        c.send_signal(signum)

  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  failed = None
  try:
    while True:
      codes = [c.poll() for c in children]  # every child polled, each round
      if all(code is not None for code in codes):
        break
      for i, code in enumerate(codes):
        if code not in (None, 0) and failed is None and not forwarded:
          failed = (i, code)
      if failed is not None:
        i, code = failed
        print(f"launch: process {i} {_describe(code)} while the others still ran; stopping "
              "them (a run that had started resumes with the same command and "
              "--config.resume=True)", file=sys.stderr, flush=True)
        _stop(children, grace_s)
        break
      time.sleep(0.1)
  finally:
    for s, handler in old.items():
      signal.signal(s, handler)
  for c in children:
    c.wait()
  for pump in pumps:
    pump.join(timeout=5)
  if failed is None:
    failed = next(((i, c.returncode) for i, c in enumerate(children) if c.returncode), None)
  if failed is None:
    return 0
  i, code = failed
  print(f"launch: process {i} {_describe(code)}", file=sys.stderr, flush=True)
  return code if code > 0 else 128 - code


def _stop(children, grace_s: float) -> None:
  for c in children:
    if c.poll() is None:
      c.terminate()
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and any(c.poll() is None for c in children):
    time.sleep(0.1)
  for c in children:
    if c.poll() is None:
      c.kill()


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" in argv:
    cut = argv.index("--")
    ours, rest = argv[:cut], argv[cut + 1:]
  else:
    ours, rest = argv, []
  parser = argparse.ArgumentParser(prog="python -m tlt_jax.launch", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, required=True, help="how many processes")
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="simulated CPU devices per process (XLA_FLAGS)")
  parser.add_argument("--visible-devices", default=None,
                      help="accelerator ids per process, groups separated by ';' (e.g. '0,1;2,3')")
  parser.add_argument("--module", default="tlt_jax.train", help="the module each process runs")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds the others get to stop after one failed, before SIGKILL")
  parser.add_argument("--port", type=int, default=None, help="the coordinator's port (default: "
                      "a free one)")
  opts = parser.parse_args(ours)
  try:
    return launch(rest, opts.processes, opts.module, opts.devices_per_process,
                  opts.visible_devices, opts.grace, opts.port)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
