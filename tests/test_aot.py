"""The ahead-of-time cache: each key lowered and compiled once, then reused."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.aot import AotCache
from tlt_jax.utils import background_compile_count, compile_count, mark_background


def _lowering(calls: list, n: int):
  """A ``lower`` callable for a length-``n`` vector op that records each call in ``calls``."""
  def lower():
    calls.append(n)
    return jax.jit(lambda x: x * 2 + 1).lower(jax.ShapeDtypeStruct((n,), jnp.float32))
  return lower


def test_compiles_once_per_key_and_a_second_get_compiles_nothing():
  cache, calls = AotCache(), []
  first = cache.get(("double", 3), _lowering(calls, 3))
  before = compile_count()
  again = cache.get(("double", 3), _lowering(calls, 3))
  assert again is first and calls == [3]
  assert compile_count() == before  # neither lowered nor compiled again
  np.testing.assert_allclose(first(jnp.arange(3.0)), [1.0, 3.0, 5.0])
  assert ("double", 3) in cache and ("double", 4) not in cache and len(cache) == 1
  assert cache.lookup(("double", 4)) is None and cache.lookup(("double", 3)) is first
  assert cache.seconds >= 0.0 and set(cache.seconds_by_key) == {("double", 3)}


def test_compile_all_counts_only_what_it_compiled_now():
  cache, calls, ticks = AotCache(), [], []
  cache.get(2, _lowering(calls, 2))
  lower_of = lambda n: _lowering(calls, n)()
  tick = lambda done, total: ticks.append((done, total))
  assert cache.compile_all([1, 2, 3, 3], lower_of, tick) == 2
  assert ticks == [(1, 2), (2, 2)] and sorted(calls) == [1, 2, 3]
  assert cache.keys() == [2, 1, 3] and list(cache) == [2, 1, 3] and len(cache) == 3
  assert cache.compile_all([1, 2, 3], lower_of) == 0 and len(calls) == 3
  temp = cache.temp_bytes()
  assert set(temp) == {1, 2, 3}
  assert all(v is None or (isinstance(v, int) and v >= 0) for v in temp.values())


def test_threads_asking_for_one_key_compile_it_once():
  cache, calls = AotCache(), []
  start = threading.Barrier(4)
  got = []

  def ask():
    start.wait()
    got.append(cache.get("k", _lowering(calls, 5)))

  threads = [threading.Thread(target=ask) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert calls == [5] and len(got) == 4 and all(g is got[0] for g in got)


def test_compile_all_in_threads_keeps_keys_order_and_compiles_each_key_once():
  cache, calls, ticks = AotCache(), [], []
  lower_of = lambda n: _lowering(calls, n)()
  keys = [5, 1, 4, 2, 3]
  assert cache.compile_all(keys, lower_of, lambda d, t: ticks.append((d, t)), workers=3) == 5
  assert cache.keys() == keys and calls == keys  # lowered in order, kept in order
  assert ticks == [(i, 5) for i in range(1, 6)]
  for n in keys:
    np.testing.assert_allclose(cache.lookup(n)(jnp.ones(n)), np.full(n, 3.0))
  before = compile_count()
  assert cache.compile_all(keys, lower_of, workers=3) == 0 and compile_count() == before
  assert set(cache.seconds_by_key) == set(keys) and not cache.compiling()


def test_a_get_during_compile_all_waits_for_its_executable():
  cache, calls = AotCache(), []
  started = threading.Event()
  got = []

  def lower_of(n):
    if n == 2:  # the second key: another thread asks for the first while this one lowers
      started.set()
      asker.join(timeout=0.5)  # it must be waiting, not compiling its own
    return _lowering(calls, n)()

  asker = threading.Thread(target=lambda: (started.wait(), got.append(
      cache.get(1, _lowering(calls, 1)))))
  asker.start()
  cache.compile_all([1, 2], lower_of, workers=2)
  asker.join()
  assert calls == [1, 2] and got == [cache.lookup(1)]


def test_a_failed_compile_is_raised_and_frees_its_key():
  cache, calls = AotCache(), []

  def lower_of(n):
    if n == 2:
      raise RuntimeError("lowering 2 failed")
    return _lowering(calls, n)()

  try:
    cache.compile_all([1, 2, 3], lower_of, workers=2)
    raise AssertionError("no error")
  except RuntimeError as e:
    assert "lowering 2 failed" in str(e)
  assert 2 not in cache and not cache.compiling()
  assert cache.get(2, _lowering(calls, 2)) is not None  # nothing left locked
  with np.testing.assert_raises_regex(ValueError, "workers must be >= 1"):
    cache.compile_all([7, 8], lambda n: _lowering(calls, n)(), workers=0)


def test_compile_all_in_a_background_thread_counts_as_background():
  """A background caller's compiles (the rollout's SD arms, compiled while the first step runs)
  are background keys on either path, serial or in compile threads: their seconds are not the
  foreground's, which the console reports as time the steps waited."""
  cache, calls = AotCache(), []
  lower_of = lambda n: _lowering(calls, n)()

  def background():
    mark_background()
    cache.compile_all([11, 12], lower_of, workers=2)  # compile threads
    cache.compile_all([13], lower_of, workers=1)  # in the caller

  thread = threading.Thread(target=background)
  thread.start()
  thread.join()
  cache.compile_all([14], lower_of, workers=1)  # this (foreground) thread
  assert cache.background_keys == {11, 12, 13}
  assert cache.foreground_seconds == cache.seconds_by_key[14] < cache.seconds


def test_compile_threads_count_as_their_callers_compiles():
  """A foreground ``compile_all``'s compiles, run in its compile threads, are in ``compile_count``
  (what the checks that nothing recompiles read); a background caller's are background ones."""
  cache, calls = AotCache(), []
  lower_of = lambda n: _lowering(calls, n)()
  before, background = compile_count(), background_compile_count()
  assert cache.compile_all([21, 22], lower_of, workers=2) == 2
  assert (compile_count() - before, background_compile_count() - background) == (2, 0)

  def compile_in_background():
    mark_background()
    cache.compile_all([23, 24], lower_of, workers=2)

  thread = threading.Thread(target=compile_in_background)
  thread.start()
  thread.join()
  assert (compile_count() - before, background_compile_count() - background) == (2, 2)
  assert calls == [21, 22, 23, 24]
