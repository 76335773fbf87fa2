"""Several processes (hosts) through ``jax.distributed``: start-up, and the host-level exchanges
the main job needs between them.

One process runs per host (or per group of local devices); every process runs the same job on
the same config and seed, so anything computed from the config alone (problems, prompts, rewards,
advantages, the packed update batch) is computed identically everywhere and never sent. What
differs per process is sent with :func:`allgather`: each process's rollout rows and stats, its
tuner's state, its drafter's weights. The exchange goes through the distributed runtime's
key-value store (the coordinator), not through an XLA collective, so it compiles nothing and
waits at most ``timeout_s`` for a peer: a process that stopped or hung gives the others a
:class:`PeerLostError` naming it instead of a silent hang. A process that *dies* is detected
sooner by the runtime's heartbeats (``heartbeat_s``): JAX then ends every other process with a
fatal "another task died" error.

Environment (what :func:`initialize` reads when no argument is given):
``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``; without them JAX's own cluster detection runs (SLURM's ``srun``, TPU pod
slices, Open MPI, Kubernetes). On CPUs the processes' collectives use gloo.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
from typing import Any

import jax

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
DEFAULT_TIMEOUT_S = 600  # a peer's rollout may take this much longer than ours before we give up
DEFAULT_HEARTBEAT_S = 30  # a dead process is noticed by the others within about this long

_state = {"timeout_s": DEFAULT_TIMEOUT_S, "rounds": {}}


class PeerLostError(RuntimeError):
  """Another process did not take part in an exchange in time (it stopped, hung or died)."""


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r} is not an integer (it must be the number of processes "
                     f"or this process's index)") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               heartbeat_s: int = DEFAULT_HEARTBEAT_S, connect_timeout_s: int = 120) -> None:
  """Joins this process to the job's other processes (``jax.distributed.initialize``).

  Arguments left ``None`` come from the environment (module docstring). Must run before anything
  touches a JAX device; ``timeout_s`` bounds every later :func:`allgather`, ``heartbeat_s`` how
  long a dead process goes unnoticed, ``connect_timeout_s`` how long to wait for every process
  to reach the coordinator.
  """
  address = coordinator_address or os.environ.get(ENV_ADDRESS)
  count = num_processes if num_processes is not None else _env_int(ENV_COUNT)
  index = process_id if process_id is not None else _env_int(ENV_ID)
  if count is not None and count < 1:
    raise ValueError(f"the number of processes must be at least 1, got {count} (${ENV_COUNT})")
  if index is not None and count is not None and not 0 <= index < count:
    raise ValueError(f"process id {index} is outside [0, {count}) (${ENV_ID} must be 0 .. "
                     f"${ENV_COUNT} - 1)")
  if address is not None and count is not None and ":" not in address:
    raise ValueError(f"the coordinator address {address!r} needs a port (host:port, "
                     f"${ENV_ADDRESS})")
  # CPU processes exchange their collectives' data over gloo (a no-op for accelerators)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if address is not None and index not in (None, 0):  # process 0 hosts the coordinator
    wait_for_coordinator(address, index, connect_timeout_s)
  # JAX aborts the process (no exception) when the processes do not all meet in time: say why
  # first, so the abort is not the only line a user sees
  warn = threading.Timer(max(0.0, connect_timeout_s - 1.0), _say_not_met,
                         (address, index, count, connect_timeout_s))
  warn.daemon = True
  warn.start()
  try:
    # leaving waits for the other processes at most heartbeat_s (not JAX's 5 minutes), so a
    # process that stops with an error is not held up by a peer that hangs
    jax.distributed.initialize(address, count, index, initialization_timeout=connect_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_s,
                               shutdown_timeout_seconds=heartbeat_s)
  except ValueError as e:  # nothing said how many processes there are, nor where to meet
    raise ValueError(f"cannot start several processes: {e} Set ${ENV_ADDRESS} (host:port of "
                     f"process 0), ${ENV_COUNT} and ${ENV_ID}, run under srun or on a TPU pod "
                     "slice, or use python -m tlt_jax.launch") from None
  except Exception as e:  # pylint: disable=broad-except  # the coordinator was not reached
    if isinstance(e, RuntimeError) and "must be called before any JAX" in str(e):
      # JAX's own check, made before it connects: this process already has its backends
      raise RuntimeError("jax.distributed must start before anything touches a JAX device, but "
                         "this process already did (e.g. jax.devices() at import time); call "
                         "tlt_jax.hosts.initialize() first") from None
    raise PeerLostError(f"process {index} could not join the job's other processes through the "
                        f"coordinator at {address} within {connect_timeout_s}s ({_first(e)}); "
                        "check that every process was started with the same address and "
                        "process count, and that process 0 is running") from None
  finally:
    warn.cancel()
  _state["timeout_s"] = timeout_s


def wait_for_coordinator(address: str, index: int | None, timeout_s: float) -> None:
  """Returns once the coordinator at ``host:port`` accepts connections; raises
  :class:`PeerLostError` after ``timeout_s`` (JAX itself would abort the process, saying only
  that a deadline passed)."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  last = None
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
        return
    except OSError as e:
      last = e
    if time.monotonic() >= deadline:
      raise PeerLostError(
          f"process {index} could not reach the coordinator at {address} within {timeout_s:.0f}s "
          f"({last}): process 0 hosts it, so start process 0 too (with the same "
          f"${ENV_ADDRESS}, ${ENV_COUNT}), or fix the address; a cluster's launcher "
          "(srun, python -m tlt_jax.launch) starts them all")
    time.sleep(0.25)


def _say_not_met(address, index, count, timeout_s) -> None:
  print(f"tlt_jax.hosts: process {index} of {count}: the job's processes did not all reach the "
        f"coordinator at {address} within {timeout_s:.0f}s; JAX is about to end this process. "
        "Check that every process was started, with the same address and process count",
        file=sys.stderr, flush=True)


def _first(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def is_primary() -> bool:
  """Process 0: the one that prints, logs metrics and writes shared files."""
  return jax.process_index() == 0


def allgather(value: Any, tag: str) -> list[Any]:
  """Every process's ``value`` (any picklable object: the job's processes trust each other, as
  they do with any pickled state), in process order; with one process, ``[value]``. Every
  process must call it with the same ``tag``s in the same order; raises :class:`PeerLostError`
  when a peer's value does not come within the timeout."""
  count = jax.process_count()
  if count == 1:
    return [value]
  # JAX keeps its distributed client private; orbax (a dependency) hands it out publicly
  from orbax.checkpoint import multihost  # pylint: disable=import-outside-toplevel
  client = multihost.get_jax_distributed_client()
  me = jax.process_index()
  n = _state["rounds"].get(tag, 0)
  _state["rounds"][tag] = n + 1
  client.key_value_set_bytes(f"tlt_jax/{tag}/{n}/{me}", pickle.dumps(value, protocol=5))
  timeout_ms = int(1000 * _state["timeout_s"])
  out = []
  for peer in range(count):
    if peer == me:
      out.append(value)
      continue
    try:
      data = client.blocking_key_value_get_bytes(f"tlt_jax/{tag}/{n}/{peer}", timeout_ms)
    except Exception as e:  # pylint: disable=broad-except  # the runtime's timeout or failure
      raise PeerLostError(
          f"process {me}: process {peer} did not send its {tag} (exchange {n}) within "
          f"{_state['timeout_s']:.0f}s ({_first(e)}); it stopped, hung or died: see its output. "
          "Resume every process with --config.resume=True once all are running") from None
    out.append(pickle.loads(data))
  if n > 0:  # every peer sent round n, so all of them finished reading round n - 1
    try:
      client.key_value_delete(f"tlt_jax/{tag}/{n - 1}/{me}")
    except Exception:  # pylint: disable=broad-except  # only memory on the coordinator
      pass
  return out


def broadcast(value: Any, tag: str) -> Any:
  """Process 0's ``value`` on every process."""
  return allgather(value if is_primary() else None, tag)[0]


def shutdown() -> None:
  """Leaves the job together with the other processes (no-op with one): every process waits
  for the others first, so process 0, which hosts the coordinator, never leaves before them."""
  if jax.process_count() == 1:
    return
  barrier("shutdown")
  jax.distributed.shutdown()


def barrier(tag: str) -> None:
  """Returns once every process got here (or raises :class:`PeerLostError`)."""
  allgather(None, f"barrier/{tag}")
