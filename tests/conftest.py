"""Shared test setup: keep JAX on the CPU and quiet, compile fast, share compiled work, and pick
the tier.

Two tiers (tests/README.md): ``python -m pytest`` runs the fast tier (every test not marked
``slow``: each mechanism at least once, at small sizes); ``python -m pytest -m ""`` runs all of
them (the full tier), ``-m slow`` only what the fast tier leaves out.

Compiling is most of the suite's time, and the tests check what the programs compute, not how
fast XLA's emitted code runs. So unless ``TLT_TEST_FAST_COMPILE=0`` is set, the tests ask XLA:CPU
for its cheapest backend (optimisation level 0, no fusion emitters): about half the compile time.
The flags go into ``XLA_FLAGS``, which the tests' own subprocesses inherit (they append their
simulated device count to it). A jaxlib that does not know a flag aborts at start-up, so the
flags are tried once in a subprocess first and left out (with a note) if that fails.

One persistent compilation cache serves the whole session: the pytest process that starts first
(xdist's controller, or the only one) makes a fresh directory and names it in
``$TLT_TEST_COMPILE_CACHE``; its workers and every subprocess a test starts inherit it, and the
in-process tests use it too (``$JAX_COMPILATION_CACHE_DIR``). A program built again by another
test, worker or CLI run is loaded, not compiled. XLA keys an entry by the program, its compile
options, the flags and the jaxlib version, so sharing is safe. It is never the user's own cache;
``TLT_TEST_COMPILE_CACHE=/some/dir`` set by hand keeps one across sessions (a warm run) and is
left in place.

The experiments' tests (experiments/tests/, the second of pyproject.toml's ``testpaths``) run
under this same setup: their conftest imports this one.
"""

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

from tests.xla_env import FAST_COMPILE_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Background compiles on, whatever the host's cores (tlt_jax.utils.background_compiles_allowed
# turns them off below 4): the tests exercise the background loops; tests/test_utils.py and
# tests/rollout/test_offers.py check the small-host default with the variable unset or "auto".
os.environ.setdefault("TLT_BACKGROUND_COMPILE", "1")

SESSION_CACHE = "TLT_TEST_COMPILE_CACHE"


def _share_one_compile_cache() -> None:
  if not os.environ.get(SESSION_CACHE):  # the session's first process: the cache is its own
    os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="tlt_jax_test_xla_")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHE], ignore_errors=True)
  directory = os.environ[SESSION_CACHE]
  os.makedirs(directory, exist_ok=True)
  # the entry points' cache (tlt_jax/compile_cache.py) and JAX's own, for in-process tests
  os.environ["TLT_COMPILE_CACHE"] = directory
  os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


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


_share_one_compile_cache()
_with_fast_compile()


# The heaviest files first, measured (tests/README.md): xdist hands out whole files in this order
# (``--dist loadfile --no-loadscope-reorder``), so no worker starts a long file while the other
# is finishing. Files not named keep their collection order after these. Paths are from the
# repository's root: the experiments' test files sit in experiments/tests/. (test_same_seed.py,
# 324 s of the full tier's 2359 s of tests, was not named: it started last and ran ~170 s alone.)
HEAVIEST_FIRST = (
    "tests/test_kill_resume.py", "tests/test_same_seed.py", "tests/test_notebooks.py",
    "tests/test_multiprocess.py", "tests/test_train_job.py", "tests/rollout/test_lossless_deep.py",
    "tests/rollout/test_parallel.py", "tests/rollout/test_adaptive.py", "tests/rl/test_trainer.py",
    "tests/rollout/test_suffix.py", "tests/rollout/test_speculative.py",
    "experiments/tests/test_accelerator_check.py", "experiments/tests/test_experiments.py",
    "tests/rollout/test_kv_buckets.py", "experiments/tests/test_reproduce.py",
    "tests/rl/test_online_drafter.py", "tests/test_hosts.py", "tests/rollout/test_hidden.py",
    "tests/rl/test_ledger_trainer.py", "tests/drafter/test_spot_rounds.py",
)


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable


def pytest_configure(config):  # pylint: disable=unused-argument
  """Stops at once, with the fix, when the torchvision that ``speculators`` pulled in is there:
  built for another torch, it makes every ``import transformers`` fail (the README's test
  command uninstalls it)."""
  if importlib.util.find_spec("torchvision") is None:
    return
  probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True,
                         check=False)
  if probe.returncode:
    import pytest  # pylint: disable=import-outside-toplevel
    raise pytest.UsageError("torchvision is installed but does not import beside this torch "
                            "(speculators pulls a build for another torch), which breaks "
                            "transformers: run `pip uninstall -y torchvision torchaudio`")
