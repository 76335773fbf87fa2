"""``tlt_jax.hosts`` (the processes' exchanges through the coordinator) and ``tlt_jax.launch``,
with real processes on this machine: what they exchange, and how a peer that stops or dies is
reported within a bounded time instead of a hang."""

import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import pytest

from tlt_jax import hosts, launch
from tlt_jax.rollout.parallel import shard_ranges
from tlt_jax.rollout.processes import process_rows
from tests.xla_env import device_count_flags, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
  return subprocess_env(**extra)


def by_hand(mode: str, count: int = 2, **extra) -> list[subprocess.Popen]:
  """``count`` ``tests.hosts_worker`` processes started without the launcher (as srun would)."""
  address = f"127.0.0.1:{launch.free_port()}"
  return [subprocess.Popen([sys.executable, "-m", "tests.hosts_worker", mode], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(count),
                                    JAX_PROCESS_ID=str(i), **extra)) for i in range(count)]


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 13, 32])
@pytest.mark.parametrize("processes, local", [(2, 2), (3, 1), (2, 3)])
def test_a_process_takes_its_devices_shards_of_the_one_process_split(n, processes, local):
  everyone = shard_ranges(n, processes * local)
  covered = []
  for p in range(processes):
    rows = process_rows(n, processes, local, p)
    covered += list(rows)
    # its own devices split its rows as the one-process rollout split them over all devices
    mine = shard_ranges(len(rows), local)
    assert [len(r) for r in mine] == [len(r) for r in everyone[p * local:(p + 1) * local]]
  assert covered == list(range(n))


def test_two_processes_exchange_in_rounds_and_leave_together():
  procs = by_hand("gather")
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  for out in outs:
    assert "round 1: [{'from': 0}, {'from': 1}]" in out and "round 2: [0, 10]" in out


@pytest.mark.slow
def test_a_silent_peer_is_named_after_the_timeout():
  procs = by_hand("silent", TEST_TIMEOUT_S="3", TEST_HEARTBEAT_S="5")
  t0 = time.monotonic()
  out = procs[0].communicate(timeout=60)[0]
  waited = time.monotonic() - t0
  procs[1].kill()
  # exit 1, or JAX's abort when its shutdown barrier (heartbeat_s) then misses process 1 too
  assert procs[0].returncode != 0, out
  assert "process 0: process 1 did not send its test (exchange 1) within 3s" in out
  assert waited < 30


@pytest.mark.slow  # a test of several processes: the full tier
def test_a_dead_peer_ends_the_others_by_its_missing_heartbeats():
  """Process 1 of 3 dies: JAX ends both others, naming process 1 alone as the one that stopped
  sending heartbeats."""
  procs = by_hand("die", count=3, TEST_HEARTBEAT_S="3")
  t0 = time.monotonic()
  outs = [procs[i].communicate(timeout=90)[0] for i in (0, 2)]
  waited = time.monotonic() - t0
  assert procs[1].wait(timeout=10) == 3
  for proc, out in zip((procs[0], procs[2]), outs):
    # JAX ends it (abort): it neither waits for the 60 s timeout (exit 1) nor exits by itself
    assert proc.returncode not in (0, 1, 3), out[-2000:]
    named = re.findall(r"stopped sending heartbeats\):\n((?:\d+\n)+)", out)
    assert named and all(tasks.split() == ["1"] for tasks in named), out[-2000:]
  assert waited < 45


def _alone(index: int) -> tuple[subprocess.CompletedProcess, float]:
  """Process ``index`` of 2 started alone: the other never comes (5 s to meet)."""
  address = f"127.0.0.1:{launch.free_port()}"
  t0 = time.monotonic()
  done = subprocess.run([sys.executable, "-m", "tests.hosts_worker", "gather"], cwd=ROOT,
                        capture_output=True, text=True, timeout=90, check=False,
                        env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                                 JAX_PROCESS_ID=str(index), TEST_CONNECT_S="5"))
  return done, time.monotonic() - t0


@pytest.mark.slow  # a test of several processes: the full tier
def test_a_process_that_cannot_reach_the_coordinator_says_so_within_the_timeout():
  done, waited = _alone(1)  # process 0 (which hosts the coordinator) never started
  assert done.returncode == 1, done.stderr[-2000:]
  assert "process 1 could not reach the coordinator at 127.0.0.1:" in done.stderr
  assert "within 5s" in done.stderr and "start process 0 too" in done.stderr
  assert waited < 40


@pytest.mark.slow
def test_process_0_whose_peers_never_come_says_why_before_jax_ends_it():
  done, waited = _alone(0)
  assert done.returncode != 0
  assert ("process 0 of 2: the job's processes did not all reach the coordinator" in
          done.stderr), done.stderr[-2000:]
  assert waited < 60


@pytest.mark.slow  # a test of several processes: the full tier
def test_the_launcher_stops_the_others_when_one_dies_and_names_it(capfd):
  t0 = time.monotonic()
  code = launch.launch(["die"], processes=2, module="tests.hosts_worker", grace_s=5,
                       env=_env(TEST_HEARTBEAT_S="60"))
  waited = time.monotonic() - t0
  err = capfd.readouterr().err
  assert code == 3
  assert "launch: process 1 exited with code 3 while the others still ran; stopping them" in err
  assert waited < 45  # process 0 was stopped, not left to its 60 s heartbeat


@pytest.mark.slow  # a test of several processes: the full tier
def test_the_launcher_runs_a_job_that_succeeds(capfd):
  assert launch.launch(["gather"], processes=2, module="tests.hosts_worker", env=_env()) == 0
  out = capfd.readouterr().out
  assert "round 2: [0, 10]" in out and "[process 1] round 2: [0, 10]" in out


# a weight gradient's shape: a product contracting over every token of a batch (2048 here)
_GRADIENT_BITS = """
import hashlib, numpy as np, jax
r = np.random.default_rng(0)
a, b = r.standard_normal((2048, 128), np.float32), r.standard_normal((2048, 64), np.float32)
print(hashlib.sha256(np.asarray(jax.jit(lambda a, b: a.T @ b)(a, b)).tobytes()).hexdigest())
"""


def _gradient_bits(env: dict) -> str:
  done = subprocess.run([sys.executable, "-c", _GRADIENT_BITS], env=env, capture_output=True,
                        text=True, timeout=120, check=True)
  return done.stdout.strip()


@pytest.mark.slow  # a test of several processes: the full tier
def test_a_launched_process_rounds_as_one_process_with_every_device():
  """XLA:CPU splits a long contraction by the size of its thread pool, which grows with the
  simulated devices: the launcher gives each of 2 x 2 processes the pool of 1 x 4, so their
  products have the same bits (on a 2-core machine, without it they differ)."""
  base = {k: v for k, v in _env().items() if k not in ("PJRT_NPROC", "NPROC")}
  one = _gradient_bits(dict(base, XLA_FLAGS=device_count_flags(4)))
  child = launch.child_env(base, 1, 2, "127.0.0.1:1", 2, None)
  assert int(child["PJRT_NPROC"]) == launch.cpu_pool_size(base, 4)
  child.pop("JAX_COORDINATOR_ADDRESS")  # (no jax.distributed needed for one product)
  assert _gradient_bits(child) == one
  # a user's own pool size is kept, raised to the devices if it is smaller
  assert launch.child_env(dict(base, NPROC="16"), 0, 2, "x:1", 2, None)["PJRT_NPROC"] == "16"
  assert launch.child_env(dict(base, PJRT_NPROC="1"), 0, 2, "x:1", 2, None)["PJRT_NPROC"] == "4"


@pytest.mark.parametrize("argv, message", [
    (["--processes", "0", "--", "x"], "--processes must be at least 1"),
    (["--processes", "2", "--devices-per-process", "0"], "--devices-per-process must be at least"),
    (["--processes", "2", "--visible-devices", "0,1"], "--visible-devices needs 2 groups"),
])
def test_the_launcher_refuses_bad_arguments(capfd, argv, message):
  assert launch.main(argv) == 2
  assert message in capfd.readouterr().err


def test_the_cpu_pool_is_at_least_the_devices(monkeypatch):
  """A launched process's XLA:CPU pool is that of one process with every device: the
  environment's ``$PJRT_NPROC`` / ``$NPROC`` or the machine's cores, never fewer than the
  devices (XLA:CPU's own rule, whose partial sums the launched processes must match)."""
  assert launch.cpu_pool_size({"PJRT_NPROC": "1"}, 4) == 4
  assert launch.cpu_pool_size({"NPROC": "16"}, 4) == 16
  assert launch.cpu_pool_size({"PJRT_NPROC": "3", "NPROC": "16"}, 2) == 3
  env = launch.child_env({"PJRT_NPROC": "1"}, 1, 2, "127.0.0.1:1", 4, None)
  assert env["PJRT_NPROC"] == "8" and env["JAX_PROCESS_ID"] == "1"


def test_initialize_refuses_a_process_that_already_touched_a_device():
  jax.devices()
  with pytest.raises(RuntimeError, match="must start before anything touches a JAX device"):
    hosts.initialize()


def test_initialize_says_what_is_wrong_with_the_environment():
  code = ("import os; os.environ['JAX_PLATFORMS']='cpu'\n"
          "from tlt_jax import hosts\n"
          "try:\n  hosts.initialize()\nexcept ValueError as e:\n  print('error:', e)\n")
  for env, message in [({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
                        "$JAX_NUM_PROCESSES='two' is not an integer"),
                       ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2",
                         "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"},
                        "process id 2 is outside [0, 2)"),
                       ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
                         "JAX_COORDINATOR_ADDRESS": "localhost"}, "needs a port"),
                       ({"JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0",
                         "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"},
                        "the number of processes must be at least 1, got 0")]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(clean, PYTHONPATH=str(ROOT), **env), timeout=60, check=False)
    assert message in done.stdout, (env, done.stdout, done.stderr[-500:])


def test_one_process_exchanges_with_itself_alone():
  assert hosts.allgather({"a": 1}, "alone") == [{"a": 1}]
  assert hosts.broadcast(3, "alone") == 3
  hosts.barrier("alone")
  hosts.shutdown()  # a no-op with one process
