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

import threading
import time
from typing import Any, Callable, Hashable, Iterable, Iterator

import jax


class AotCache:
  """Compiled executables by key, each lowered and compiled on its first ``get``."""

  def __init__(self):
    self._executables: dict[Hashable, Any] = {}
    self._key_locks: dict[Hashable, threading.Lock] = {}
    self._lock = threading.Lock()  # guards the two dicts and the seconds
    self.seconds_by_key: dict[Hashable, float] = {}  # lowering + compiling, per key

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
        self._key_locks.pop(key, None)
      return compiled

  def lookup(self, key: Hashable) -> jax.stages.Compiled | None:
    """The executable for ``key`` if it was compiled, else None (never compiles)."""
    with self._lock:
      return self._executables.get(key)

  def compile_all(self, keys: Iterable[Hashable],
                  lower_of: Callable[[Hashable], jax.stages.Lowered],
                  progress: Callable[[int, int], Any] | None = None) -> int:
    """Compiles every key of ``keys`` not compiled yet (``lower_of(key)`` lowers it); returns how
    many it compiled now. ``progress(done, total)`` is called after each, ``total`` being how
    many this call compiles."""
    missing = [key for key in dict.fromkeys(keys) if key not in self]
    for done, key in enumerate(missing, 1):
      self.get(key, lambda key=key: lower_of(key))
      if progress is not None:
        progress(done, len(missing))
    return len(missing)

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
