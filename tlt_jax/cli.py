"""The command line shared by the entry points: ``--help``, config flags, one-line errors.

A mistake of the user's (a config value, a file, a prompt) prints ``error: ...`` in a line or
two and exits 2 (config) or 1 (anything else the user can fix); ``--verbose`` shows the
traceback. Ctrl-C exits 130 (SIGTERM 143) with the message the job left (e.g. how to
resume). Compiled executables are kept in a persistent cache (``compile_cache.py``;
``--compile_cache=PATH|off``).
"""

from __future__ import annotations

import pathlib
import re
import sys
import warnings
from typing import Callable

from tlt_jax import compile_cache
from tlt_jax.job import typed_config
from tlt_jax.checkpoint import CheckpointError
from tlt_jax.hosts import PeerLostError

# Errors that come from what the user gave (config, files, data), or from another process of the
# job (named in the message), printed without a traceback.
USER_ERRORS = (ValueError, TypeError, OSError, CheckpointError, FloatingPointError, PeerLostError)
_HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull")


def config_overrides(argv: list[str]) -> list[str]:
  """Dotted names of the fields set by ``--config.<name>=...`` flags in ``argv``."""
  names = []
  for arg in argv:
    for prefix in ("--config.", "--noconfig."):
      if arg.startswith(prefix):
        names.append(arg[len(prefix):].split("=", 1)[0])
  return names


def config_path(argv: list[str], default_config: pathlib.Path) -> pathlib.Path:
  """The config file ``argv`` names (``--config=PATH`` or ``--config PATH``; a ``:arg`` suffix
  dropped), else ``default_config``."""
  path = None
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      path = argv[i + 1]
  return default_config if path is None else pathlib.Path(path.split(":", 1)[0])


def help_text(doc: str, config: pathlib.Path) -> str:
  """Usage, then every field of the config file ``config`` with its value there."""
  lines = [doc.strip(), "",
           "--verbose prints tracebacks; --compile_cache=PATH|off: the persistent XLA compilation "
           f"cache (default ${compile_cache.ENV}, else {compile_cache.default_directory()}).", "",
           f"Config fields of {config} (--config=FILE lists another file's;",
           "set with --config.<field>=VALUE; the file's comments say what each does):"]
  for name, value in typed_config.flatten(typed_config.load_config_file(config)).items():
    lines.append(f"  --config.{name}={value!r}")
  return "\n".join(lines)


def _error(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)


def main(doc: str, run: Callable, default_config: pathlib.Path, argv: list[str],
         extra_flags: Callable[[], dict] | None = None) -> int:
  """Parses ``argv`` and calls ``run(config, overrides=[...], **extra)``; returns the exit code.

  ``extra_flags()`` defines further absl flags and returns ``{run keyword: flag holder}``.
  """
  # pylint: disable=import-outside-toplevel
  from absl import flags, logging
  from ml_collections import config_flags

  path = config_path(argv[1:], default_config)
  if not path.is_file():
    _error(f"no config file at {path} (--config takes the path of an ml_collections file; "
           f"the default is {default_config})")
    return 2
  if any(a in _HELP_FLAGS for a in argv[1:]):
    print(help_text(doc, path))
    return 0
  verbose = flags.DEFINE_bool("verbose", False, "print tracebacks of errors")
  cache_flag = flags.DEFINE_string(
      "compile_cache", None, f"directory of the persistent XLA compilation cache, or off "
      f"(default: ${compile_cache.ENV}, $JAX_COMPILATION_CACHE_DIR, "
      f"{compile_cache.default_directory()})")
  extra = extra_flags() if extra_flags else {}
  try:
    # ml_collections applies the --config.<field> overrides while defining and reading the
    # flag; a misspelled field raises here
    config_flag = config_flags.DEFINE_config_file(
        "config", str(default_config), "ml_collections config file (get_config()).")
    rest = flags.FLAGS(argv)
    config = config_flag.value  # applies the --config.<field> overrides (typos raise here)
  except Exception as e:  # pylint: disable=broad-except  (absl / ml_collections parse errors)
    if "--verbose" in argv:
      raise
    if isinstance(e, flags.UnrecognizedFlagError):
      close = re.search(r"Did you mean: (.+) \?", str(e))
      tip = "; did you mean " + " or ".join(f"--{s.strip()}" for s in close[1].split(",")) + "?" \
          if close else ""
      _error(f"unknown flag --{e.flagname}{tip}\n(--help lists the flags and config fields)")
      return 2
    message = " ".join(str(e).replace("\\'", "'").replace('\\"', '"').replace("\\n", " ").split())
    if len(message) > 1 and message[0] == message[-1] and message[0] in "'\"":
      message = message[1:-1]
    # ml_collections names an unknown field, with a suggestion when one is close ("'stepz'. Did
    # you mean ...") or alone ("'kv_buckets'")
    unknown = isinstance(e, AttributeError) and re.fullmatch(r"'[\w.]+'", message)
    if "Did you mean" in message or unknown:
      message = "no such config field " + message.replace(" Did", ". Did")
    _error(f"bad command line: {message}\n(--help lists the config fields)")
    return 2
  if len(rest) > 1:
    _error(f"unexpected arguments {rest[1:]}; config fields are set as --config.<field>=VALUE")
    return 2
  logging.set_verbosity(logging.WARNING)  # keep orbax's per-save INFO lines off the console
  compile_cache.enable(compile_cache.choose(cache_flag.value))  # before the first compile
  try:
    run(config, overrides=config_overrides(argv),
        **{name: holder.value for name, holder in extra.items()})
  except KeyboardInterrupt as e:
    # a save cut short leaves orbax's coroutines unawaited: no noise after the advice line
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                            category=RuntimeWarning)
    print(f"\n{e or 'interrupted'}", file=sys.stderr)
    return getattr(e, "exit_code", 130)  # 128 + the signal's number (SIGTERM: 143)
  except USER_ERRORS as e:
    if verbose.value:
      raise
    lines = str(e).strip().splitlines() or [type(e).__name__]
    kind = "" if isinstance(e, (typed_config.ConfigError, CheckpointError)) else \
        f"{type(e).__name__}: "
    _error(kind + "\n".join(lines[:3]))
    print("(--verbose shows the traceback)", file=sys.stderr)
    return 2 if isinstance(e, typed_config.ConfigError) else 1
  return 0
