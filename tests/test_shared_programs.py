"""One compile per program across devices (``aot.SharedPrograms``): in a process of 3 simulated CPU
devices, a program compiled for device 0 runs on devices 1 and 2 rebound, not compiled again, and
gives device 0's results there, donation included; a program over several devices is compiled."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.xla_env import subprocess_env

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from tlt_jax.aot import AotCache, SharedPrograms, one_device
    from tlt_jax.utils import compile_count

    devices = jax.devices()
    assert len(devices) == 3, devices

    def step(w, state):  # a decode-like step: the state is donated and comes back updated
      return state + jnp.tanh(state @ w), (state @ w).sum()

    w0 = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    s0 = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    shared = SharedPrograms()
    caches = [AotCache(shared, d) for d in devices]

    def lower(d):
      sharding = jax.sharding.SingleDeviceSharding(d)
      spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      return lambda: jax.jit(step, donate_argnums=1).lower(spec(w0), spec(s0))

    results = []
    for d, cache in zip(devices, caches):
      compiled = cache.get("step", lower(d))
      assert one_device(compiled) == d, (one_device(compiled), d)
      state, total = compiled(jax.device_put(w0, d), jax.device_put(s0, d))
      assert state.devices() == {d} and total.devices() == {d}
      results.append((np.asarray(state), float(total)))
    assert shared.compiles == 1 and shared.rebinds == 2, (shared.compiles, shared.rebinds)
    assert not shared.rebind_errors, shared.rebind_errors
    for state, total in results[1:]:
      np.testing.assert_array_equal(state, results[0][0])
      assert total == results[0][1]
    n = compile_count()
    caches[2].compile_all(["step"], lambda key: lower(devices[2])())  # held: nothing to do
    assert compile_count() == n

    # a program over two devices is never rebound onto one: each cache compiles its own
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    spread = lambda: jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((4, 8), jnp.float32,
                                                                          sharding=rows))
    first = caches[0].get("spread", spread)
    assert one_device(first) is None
    caches[1].get("spread", spread)
    assert shared.compiles == 3 and shared.rebinds == 2, (shared.compiles, shared.rebinds)
    print("shared programs ok")
""")


def test_a_program_compiled_on_one_device_runs_rebound_on_the_others():
  env = subprocess_env(devices=3)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compiled here, not loaded from the session cache
  proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "shared programs ok" in proc.stdout


CACHED = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from tlt_jax.aot import AotCache, SharedPrograms

    def step(w, s):
      return s + jnp.tanh(s @ w) ** 3, -(s ** 2.5).sum()

    w0 = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    s0 = np.abs(np.random.default_rng(1).normal(size=(4, 8))).astype(np.float32)
    shared = SharedPrograms()
    totals = []
    for d in jax.devices():
      spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                            sharding=jax.sharding.SingleDeviceSharding(d))
      compiled = AotCache(shared, d).get("step", lambda: jax.jit(step).lower(spec(w0), spec(s0)))
      totals.append(float(compiled(jax.device_put(w0, d), jax.device_put(s0, d))[1]))
    assert len(set(totals)) == 1, totals
    print("rebinds", shared.rebinds)
""")


def test_an_executable_from_the_persistent_cache_is_not_rebound(tmp_path):
  """XLA:CPU serializes an executable it loaded from the compilation cache without its kernels: a
  rebound copy fails when run ("Function ... not found"). The second run loads device 0's from
  the cache, so device 1 compiles its own and device 2 is rebound from that."""
  runs = []
  for _ in range(2):
    proc = subprocess.run([sys.executable, "-c", CACHED, str(tmp_path / "cache")],
                          env=subprocess_env(devices=3), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs.append(proc.stdout.split()[-1])
  assert runs == ["2", "1"], runs
