"""XLA_FLAGS and the environment for the tests' subprocesses, without importing JAX (scripts set
them before JAX is imported)."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# XLA:CPU's cheapest backend; tests/conftest.py explains why and when it is used
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def device_count_flags(n: int) -> str:
  """``XLA_FLAGS`` for a process with ``n`` simulated CPU devices, keeping this process's flags
  (e.g. the fast-compile ones tests/conftest.py sets)."""
  return (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
  """The environment of a subprocess a test starts: all of this one's (the session's compile
  cache, the fast-compile flags), the repository on ``PYTHONPATH``, JAX on the CPU, ``devices``
  simulated devices when given, then ``extra``."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  if devices is not None:
    env["XLA_FLAGS"] = device_count_flags(devices)
  return {**env, **extra}
