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
import os
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Iterator

import jax

from tlt_jax.utils import in_background, mark_background


def default_workers() -> int:
  """Threads that compile at once by default: half the host's cores (XLA's compiler and the
  process's own work share them), at most 8; one (compiles in the caller) on 2 cores, where
  threads measured no gain (the long-tail job's 303 rollout executables: 285 s against 302 s)."""
  return max(1, min(8, (os.cpu_count() or 1) // 2))


class AotCache:
  """Compiled executables by key, each lowered and compiled on its first ``get``."""

  def __init__(self):
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
      compiled = lower().compile()
      seconds = time.perf_counter() - t0
      with self._lock:
        self._executables[key] = compiled
        self.seconds_by_key[key] = seconds
        if in_background():
          self.background_keys.add(key)
        self._key_locks.pop(key, None)
      return compiled

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
