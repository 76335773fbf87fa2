"""Orbax's console output and error texts, kept quiet and to one line.

Orbax logs through absl (INFO per save/restore), and a failed read leaves orbax's asyncio tasks
pending on a closed event loop; tensorstore's completions then raise "Event loop is closed" and
the abandoned coroutines raise again when garbage-collected (thousands of lines of TensorStore
specs, via ``sys.unraisablehook`` and the ``asyncio`` logger, mostly after our error). This
module drops orbax's absl records below WARNING (all of them inside :func:`quiet`, which wraps
every ``Checkpointer`` call into orbax), those ``asyncio`` records and those unraisable
exceptions; everything else passes through unchanged. The message helpers turn orbax's and
tensorstore's long errors into the one-line causes the checkpointer's errors quote.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import traceback
from typing import Any, Iterator

import orbax.checkpoint as ocp
import tensorstore

_MAX_LISTED = 8

# ----------------------------------------------------------------------------- console noise

_NOISY_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(m.__file__)), "")
                    for m in (ocp, tensorstore))
_quiet_lock = threading.Lock()
_quiet_depth = 0
_orbax_failed = False  # once an orbax call failed, stray "Event loop is closed" errors are its
# step directories whose read failed: the reads orbax abandoned there fail later on their own
# ("Future exception was never retrieved"), with tensorstore errors that name the directory
_failed_dirs: set[str] = set()


def note_failed_read(step_dir: str) -> None:
  """Records that a read of ``step_dir`` failed: the reads orbax abandoned there report later."""
  _failed_dirs.add(os.path.join(step_dir, ""))


def _noisy_path(path: str | None) -> bool:
  return bool(path) and path.startswith(_NOISY_DIRS)


def _noisy_exception(exc: BaseException | None) -> bool:
  """Whether ``exc`` (or its cause/context chain) was raised through orbax or tensorstore code."""
  seen: set[int] = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if any(_noisy_path(f.f_code.co_filename) for f, _ in traceback.walk_tb(exc.__traceback__)):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


class _OrbaxAbslFilter(logging.Filter):
  """On the ``absl`` logger: drops orbax's records below WARNING, and all while we are quiet."""

  def filter(self, record: logging.LogRecord) -> bool:
    if not _noisy_path(record.pathname):
      return True
    return record.levelno >= logging.WARNING and _quiet_depth == 0


class _OrbaxAsyncioFilter(logging.Filter):
  """On the ``asyncio`` logger: drops reports about orbax's abandoned tasks and futures."""

  def filter(self, record: logging.LogRecord) -> bool:
    try:
      if record.exc_info and _noisy_exception(record.exc_info[1]):
        return False
      message = record.getMessage()
      return not any(d in message for d in (*_NOISY_DIRS, *_failed_dirs))
    except Exception:  # pylint: disable=broad-exception-caught
      return True


def _is_orbax_unraisable(unraisable: Any) -> bool:
  code = getattr(unraisable.object, "cr_code", None)
  if code is not None and _noisy_path(code.co_filename):
    return True
  exc = unraisable.exc_value
  if _noisy_exception(exc):
    return True
  # tensorstore's completion callbacks into orbax's closed loop: no orbax frame to recognise
  # them by, so they are dropped only inside a Checkpointer call or after one failed
  return ((_orbax_failed or _quiet_depth > 0) and unraisable.object is None
          and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")


def install_filters() -> None:
  """Adds the log filters once and (re-)wraps ``sys.unraisablehook`` unless already wrapped."""
  for name, kind in (("absl", _OrbaxAbslFilter), ("asyncio", _OrbaxAsyncioFilter)):
    logger = logging.getLogger(name)
    if not any(isinstance(f, kind) for f in logger.filters):
      logger.addFilter(kind())
  previous = sys.unraisablehook
  if getattr(previous, "tlt_checkpoint", False):
    return

  def hook(unraisable: Any) -> None:
    try:
      if _is_orbax_unraisable(unraisable):
        return
    except Exception:  # pylint: disable=broad-exception-caught
      pass
    previous(unraisable)

  hook.tlt_checkpoint = True  # type: ignore[attr-defined]  # the mark: never wrapped twice
  sys.unraisablehook = hook


@contextlib.contextmanager
def quiet() -> Iterator[None]:
  """Silences orbax's logging for the duration; notes failures for the unraisable hook."""
  global _quiet_depth, _orbax_failed
  install_filters()
  with _quiet_lock:
    _quiet_depth += 1
  try:
    yield
  except Exception:
    _orbax_failed = True
    raise
  finally:
    with _quiet_lock:
      _quiet_depth -= 1


# ----------------------------------------------------------------------------- messages


def listing(names: list[str]) -> str:
  """The first names, comma-separated, with the count when there are more."""
  shown = ", ".join(names[:_MAX_LISTED])
  return shown + (f", ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def _one_line(text: str, limit: int = 300) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def root_cause(e: BaseException) -> BaseException:
  """The innermost exception of ``e``'s ``__cause__`` chain."""
  seen: set[int] = set()
  while e.__cause__ is not None and id(e.__cause__) not in seen:
    seen.add(id(e))
    e = e.__cause__
  return e


def first_line(e: BaseException) -> str:
  """``"TypeName: first line of the message"``, shortened to one line."""
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {_one_line(text[0]) if text else ''}"


def key_in_error(e: BaseException, names: list[str]) -> str | None:
  """The first of ``names`` that orbax/tensorstore's error text names (as ``"a.b/..."``)."""
  texts, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    texts.append(str(e))
    e = e.__cause__ or e.__context__
  text = " ".join(texts)
  for name in names:
    dotted = re.escape(name.replace("/", "."))
    if re.search(rf'"{dotted}(/|")', text):
      return name
  return None
