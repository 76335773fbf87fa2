"""Ahead-of-time executables: lowered and compiled once per key, then reused.

The rollout's executable pool (one executable per kind and shape bucket), the spot trainer (its
train and eval steps per device) and the trainer's policy update (one executable per update
piece and micro-batch length) all hold compiled executables keyed by what fixes their static
shapes. :class:`AotCache` is that one thing: ``get(key, lower)`` runs ``lower()`` (which returns
a ``jax.stages.Lowered``) and compiles it the first time it sees ``key``; afterwards it returns
the same executable and neither lowers nor compiles.

Threads: a cache may be read and filled from several threads at once (the data-parallel rollout
and the spot trainer dispatch from device threads). Each key compiles once even when two threads
ask for it together: the second waits for the first's executable. Different keys compile in
parallel.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import pickle
import threading
import time
import warnings
from typing import Any, Callable, Hashable, Iterable, Iterator

import jax
import jax.extend.backend
import numpy as np
from jax.experimental import serialize_executable

from tlt_jax.utils import in_background, mark_background


def default_workers() -> int:
  """Threads that compile at once by default: half the host's cores (XLA's compiler and the
  process's own work share them), at most 8; one (compiles in the caller) on 2 cores, where
  threads gave no gain."""
  return max(1, min(8, (os.cpu_count() or 1) // 2))


class _OnDevice(pickle.Unpickler):
  """Reads a serialized one-device executable back, every device it names replaced by ``device``
  and the program loaded with ``device`` as its assignment."""

  def __init__(self, payload: bytes, device: jax.Device):
    super().__init__(io.BytesIO(payload))
    self.device = device
    self.options = jax.extend.backend.get_compile_options(
        1, 1, device_assignment=np.array([[device.id]]))

  def persistent_load(self, pid):
    if pid[0] == "exec":
      return self.device.client.deserialize_executable(pid[1], [self.device], self.options)
    if pid[0] == "device":
      return self.device
    if pid[0] == "client":
      return self.device.client
    raise pickle.UnpicklingError(f"unknown persistent id {pid[0]!r}")


def one_device(compiled: jax.stages.Compiled) -> jax.Device | None:
  """The device a one-device executable runs on; None for a program over several devices."""
  devices = set()
  for sharding in jax.tree.leaves(compiled.input_shardings):
    devices |= set(sharding.device_set)
  return devices.pop() if len(devices) == 1 else None


class NotRebindable(Exception):
  """The executable's serialized form lacks its kernels: it cannot be loaded elsewhere."""


def rebind(compiled: jax.stages.Compiled, device: jax.Device) -> jax.stages.Compiled:
  """``compiled``, a one-device executable, loaded to run on ``device`` (no compile)."""
  payload, in_tree, out_tree = serialize_executable.serialize(compiled)
  if device.platform == "cpu" and b"\x7fELF" not in payload:
    # XLA:CPU re-serializes an executable it loaded from the persistent cache without its
    # object code: a copy loaded from that fails when run ("Function ... not found")
    raise NotRebindable("an XLA:CPU executable loaded from the compilation cache")
  unloaded, args_info, no_kwargs = _OnDevice(payload, device).load()
  return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), out_tree,
                             no_kwargs=no_kwargs)


class SharedPrograms:
  """One compile per program across devices.

  The first device to ask for a key compiles it; every other device gets that executable rebound
  to itself (``rebind``). A program over several devices, or one the backend cannot rebind, is
  compiled for each device that asks. An executable XLA:CPU loaded from the persistent compilation
  cache is not rebound (``NotRebindable``): the next device compiles (or loads) its own, and
  that one is kept for the others."""

  def __init__(self):
    self._compiled: dict[Hashable, jax.stages.Compiled] = {}
    self._key_locks: dict[Hashable, threading.Lock] = {}
    self._lock = threading.Lock()
    self.compiles = 0  # programs compiled here
    self.rebinds = 0  # executables loaded onto another device instead of compiled
    self.rebind_errors: list[str] = []  # why a rebind fell back to a compile

  def has(self, key: Hashable) -> bool:
    with self._lock:
      return key in self._compiled

  def executable(self, key: Hashable, lower: Callable[[], jax.stages.Lowered],
                 device: jax.Device | None) -> jax.stages.Compiled:
    """The executable of ``key`` on ``device``: rebound from another device's compile where one
    exists, else compiled from ``lower()`` (and kept for the other devices)."""
    with self._lock:
      key_lock = self._key_locks.setdefault(key, threading.Lock())
    with key_lock:
      with self._lock:
        first = self._compiled.get(key)
      if first is not None and device is not None and one_device(first) not in (None, device):
        try:
          compiled = rebind(first, device)
          with self._lock:
            self.rebinds += 1
          return compiled
        except NotRebindable:
          with self._lock:
            del self._compiled[key]  # this device's own executable takes its place
        except Exception as e:  # pylint: disable=broad-except  # a compile still gives it
          with self._lock:
            self.rebind_errors.append(f"{key}: {type(e).__name__}: {e}")
            if len(self.rebind_errors) == 1:
              warnings.warn(f"executables cannot be shared across devices here "
                            f"({type(e).__name__}: {e}); each device compiles its own",
                            RuntimeWarning)
      compiled = lower().compile()
      self.add(key, compiled)
      return compiled

  def add(self, key: Hashable, compiled: jax.stages.Compiled) -> None:
    """Keeps ``compiled`` (compiled here or elsewhere) for the other devices to rebind."""
    with self._lock:
      self.compiles += 1
      self._compiled.setdefault(key, compiled)


class AotCache:
  """Compiled executables by key, each lowered and compiled on its first ``get``.

  With ``shared`` (and the ``device`` this cache's executables run on), a key another device's
  cache compiled already is rebound to ``device`` instead of lowered and compiled again."""

  def __init__(self, shared: SharedPrograms | None = None, device: jax.Device | None = None):
    self.shared = shared
    self.device = device
    self._executables: dict[Hashable, Any] = {}
    self._key_locks: dict[Hashable, threading.Lock] = {}
    self._lock = threading.Lock()  # guards the two dicts and the seconds
    self.seconds_by_key: dict[Hashable, float] = {}  # lowering + compiling, per key
    self.background_keys: set[Hashable] = set()  # compiled in a background thread

  def get(self, key: Hashable, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
    """The executable for ``key``: ``lower()`` compiled on the first call, reused afterwards."""
    with self._lock:
      if key in self._executables:
        return self._executables[key]
      key_lock = self._key_locks.setdefault(key, threading.Lock())
    with key_lock:  # one compile per key; other keys are not held up
      with self._lock:
        if key in self._executables:  # another thread compiled it while this one waited
          return self._executables[key]
      t0 = time.perf_counter()
      compiled = self._build(key, lower)
      seconds = time.perf_counter() - t0
      with self._lock:
        self._executables[key] = compiled
        self.seconds_by_key[key] = seconds
        if in_background():
          self.background_keys.add(key)
        self._key_locks.pop(key, None)
      return compiled

  def _build(self, key: Hashable, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
    if self.shared is None:
      return lower().compile()
    return self.shared.executable(key, lower, self.device)

  def lookup(self, key: Hashable) -> jax.stages.Compiled | None:
    """The executable for ``key`` if it was compiled, else None (never compiles)."""
    with self._lock:
      return self._executables.get(key)

  def compile_all(self, keys: Iterable[Hashable],
                  lower_of: Callable[[Hashable], jax.stages.Lowered],
                  progress: Callable[[int, int], Any] | None = None,
                  workers: int | None = None) -> int:
    """Compiles every key of ``keys`` not compiled yet (``lower_of(key)`` lowers it); returns how
    many it compiled now. ``progress(done, total)`` is called after each, in ``keys``' order,
    ``total`` being how many this call compiles.

    The calling thread lowers the keys one by one (tracing is Python) and hands each lowered
    program to one of ``workers`` threads to compile (XLA compiles outside the GIL), so compiles
    overlap each other and the next key's lowering; the executables are kept in ``keys``' order,
    as a serial loop would keep them. ``workers``: ``default_workers()`` unless given; 1
    compiles in the calling thread. A key another thread asks for meanwhile waits for this call's
    executable (it is not compiled twice); the first failure is raised once the others finish."""
    missing = [key for key in dict.fromkeys(keys) if key not in self]
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    if self.shared is not None and all(self.shared.has(key) for key in missing):
      workers = 1  # every key is a rebind: nothing to lower or compile
    if workers == 1 or len(missing) < 2:
      for done, key in enumerate(missing, 1):
        self.get(key, lambda key=key: lower_of(key))
        if progress is not None:
          progress(done, len(missing))
      return len(missing)
    held = []  # (key, its lock), each held until its executable is in
    with self._lock:
      for key in missing:
        held.append((key, self._key_locks.setdefault(key, threading.Lock())))
    for _, lock in held:
      lock.acquire()
    with self._lock:  # a key another thread compiled before its lock was taken is done
      done_meanwhile = [(key, lock) for key, lock in held if key in self._executables]
    for item in done_meanwhile:
      held.remove(item)
      item[1].release()

    def compile_timed(lowered, lower_s):
      t0 = time.perf_counter()
      return lowered.compile(), lower_s + time.perf_counter() - t0

    try:
      # compile threads count as the caller's (a background caller's compiles stay background)
      with concurrent.futures.ThreadPoolExecutor(workers, "aot-compile",
                                                 initializer=mark_background,
                                                 initargs=(in_background(),)) as pool:
        try:
          futures = []
          for key, _ in held:
            t0 = time.perf_counter()
            lowered = lower_of(key)
            futures.append(pool.submit(compile_timed, lowered, time.perf_counter() - t0))
          for done, ((key, _), future) in enumerate(zip(held, futures), 1):
            compiled, seconds = future.result()  # in keys' order
            if self.shared is not None:
              self.shared.add(key, compiled)
            with self._lock:
              self._executables[key] = compiled
              self.seconds_by_key[key] = seconds
              if in_background():
                self.background_keys.add(key)
            if progress is not None:
              progress(done, len(held))
        except BaseException:
          pool.shutdown(wait=True, cancel_futures=True)  # the running compiles end first
          raise
    finally:
      with self._lock:
        for key, lock in held:
          if self._key_locks.get(key) is lock:
            del self._key_locks[key]
      for _, lock in held:
        lock.release()
    return len(held)

  def temp_bytes(self) -> dict[Hashable, int | None]:
    """XLA's scratch memory (beyond arguments and outputs) of each executable, by key; None where
    the backend won't say."""
    out = {}
    for key, compiled in self.items():
      try:
        out[key] = getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)
      except Exception:  # pylint: disable=broad-except  # not every backend reports it
        out[key] = None
    return out

  @property
  def seconds(self) -> float:
    """Seconds spent lowering and compiling, all keys together."""
    with self._lock:
      return float(sum(self.seconds_by_key.values()))

  @property
  def foreground_seconds(self) -> float:
    """Seconds spent lowering and compiling the keys no background thread compiled."""
    with self._lock:
      return float(sum(s for k, s in self.seconds_by_key.items()
                       if k not in self.background_keys))

  def keys(self) -> list[Hashable]:
    """The compiled keys, in the order they were compiled."""
    with self._lock:
      return list(self._executables)

  def compiling(self) -> list[Hashable]:
    """The keys a compile holds a lock for now (none once every call has returned)."""
    with self._lock:
      return list(self._key_locks)

  def items(self) -> list[tuple[Hashable, Any]]:
    with self._lock:
      return list(self._executables.items())

  def __contains__(self, key: Hashable) -> bool:
    with self._lock:
      return key in self._executables

  def __len__(self) -> int:
    with self._lock:
      return len(self._executables)

  def __iter__(self) -> Iterator[Hashable]:
    return iter(self.keys())
