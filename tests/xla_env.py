"""XLA_FLAGS for the tests, without importing JAX (scripts set them before JAX is imported)."""

import os

# XLA:CPU's cheapest backend; tests/conftest.py explains why and when it is used
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def device_count_flags(n: int) -> str:
  """``XLA_FLAGS`` for a process with ``n`` simulated CPU devices, keeping this process's flags
  (e.g. the fast-compile ones tests/conftest.py sets)."""
  return (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
