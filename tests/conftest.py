"""Shared test setup: keep JAX on the CPU and quiet, and compile fast.

Compiling is most of the suite's time (one module: 129 XLA compiles, 94 of its 112 seconds), and
the tests check what the programs compute, not how fast XLA's emitted code runs. So unless
``TLT_TEST_FAST_COMPILE=0`` is set, the tests ask XLA:CPU for its cheapest backend (optimisation
level 0, no fusion emitters): about half the compile time. The flags go into ``XLA_FLAGS``, which
the tests' own subprocesses inherit (they append their simulated device count to it). A jaxlib
that does not know a flag aborts at start-up, so the flags are tried once in a subprocess first
and left out (with a note) if that fails.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

from tests.xla_env import FAST_COMPILE_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The entry points keep a persistent compilation cache (tlt_jax/compile_cache.py). The tests' CLI
# subprocesses share one made fresh for this session, never the user's ~/.cache one.
os.environ["TLT_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="tlt_jax_test_xla_")
atexit.register(shutil.rmtree, os.environ["TLT_COMPILE_CACHE"], ignore_errors=True)


def _with_fast_compile() -> None:
  choice = os.environ.get("TLT_TEST_FAST_COMPILE", "1")
  if choice == "0" or FAST_COMPILE_FLAGS in os.environ.get("XLA_FLAGS", ""):
    return
  flags = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAGS).strip()
  probe = subprocess.run(
      [sys.executable, "-c", "import jax; print(int(jax.jit(lambda x: x + 1)(1)))"],
      env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=300, check=False)
  if probe.returncode == 0 and probe.stdout.strip() == "2":
    os.environ["XLA_FLAGS"] = flags
  else:
    print(f"tests/conftest.py: this jaxlib refused {FAST_COMPILE_FLAGS!r}; compiling with XLA's "
          f"defaults (slower). {probe.stderr.strip()[-300:]}", file=sys.stderr)
    os.environ["TLT_TEST_FAST_COMPILE"] = "0"


_with_fast_compile()
