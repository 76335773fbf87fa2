"""JAX's persistent compilation cache for the entry points: a restart loads its executables from
disk instead of compiling them again.

The directory, first found wins: ``--compile_cache=PATH|off``, ``$TLT_COMPILE_CACHE`` (a path, or
``0``/``off``), JAX's own ``$JAX_COMPILATION_CACHE_DIR``, then ``$XDG_CACHE_HOME/tlt_jax/xla``
(``~/.cache/tlt_jax/xla``). Every executable is cached, however small or quick to compile (the
rollout engine has dozens of small ones). Entries are keyed by the program, its compile options
and the jaxlib version, so a stale entry is never used. A loaded entry still counts as one
compile in ``utils.compile_count`` (JAX times the load like a compile).
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

ENV = "TLT_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no", "none")


def default_directory() -> pathlib.Path:
  """``$XDG_CACHE_HOME/tlt_jax/xla``, or ``~/.cache/tlt_jax/xla``."""
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "tlt_jax" / "xla"


def choose(flag: str | None = None) -> str | None:
  """The directory named by ``flag``, else the environment, else the default; None for off."""
  for value in (flag, os.environ.get(ENV), os.environ.get("JAX_COMPILATION_CACHE_DIR")):
    if value is not None and value.strip():
      return None if value.strip().lower() in _OFF else os.path.expanduser(value.strip())
  return str(default_directory())


def _writable(directory: str) -> str | None:
  """None if ``directory`` exists (or could be made) and takes a file; else why not."""
  try:
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe"):
      pass
  except OSError as e:
    return e.strerror or type(e).__name__
  return None


def enable(directory: str | None) -> str | None:
  """Turns the cache on at ``directory`` (None: off); returns the directory in use, or None.

  A directory that cannot be written leaves the cache off with a one-line warning on stderr.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel
  compilation_cache.reset_cache()  # JAX decides on its cache at the first compile, once
  if directory is not None and (why := _writable(directory)):
    print(f"warning: running without a compile cache: cannot write {directory} ({why}); "
          f"--compile_cache=PATH (or {ENV}=PATH) picks another directory, =off silences this",
          file=sys.stderr)
    directory = None
  if directory is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  # JAX caches only programs that took over a second to compile, unless told otherwise
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return directory
