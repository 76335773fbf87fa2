"""Small shared utilities: a global XLA compile counter, config checks, progress bars, reports,
JSON files."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import threading
import time

import ml_dtypes
import numpy as np
from jax import monitoring
from tqdm import tqdm  # the text bar: tqdm.auto needs ipywidgets in Jupyter

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Exponent bits of the 2-byte floats: all set means Inf or NaN (checked on the raw bits, which
# is several times faster than np.isfinite on these dtypes).
_EXPONENT_BITS = {np.dtype(ml_dtypes.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}
_lock = threading.Lock()
_compiles = 0
_background_compiles = 0
_registered = False
_thread = threading.local()  # .background: this thread compiles off the critical path


def _on_event(name: str, duration: float, **kwargs) -> None:
  global _compiles, _background_compiles
  if name == _BACKEND_COMPILE_EVENT:
    with _lock:
      if getattr(_thread, "background", False):
        _background_compiles += 1
      else:
        _compiles += 1


MIN_BACKGROUND_CORES = 4  # fewer cores: no background compile beside the steps
BACKGROUND_ENV = "TLT_BACKGROUND_COMPILE"  # "1"/"on" or "0"/"off" overrides the core count
BACKGROUND_NICE = 19  # a background thread's niceness: the lowest priority, so its compiles
# take the cores only when the steps leave them idle


def background_compiles_allowed() -> bool:
  """Whether compiles may run in a background thread beside the RL steps: on a host with at least
  ``MIN_BACKGROUND_CORES`` cores, unless ``$TLT_BACKGROUND_COMPILE`` says "1"/"on" or
  "0"/"off". On fewer cores XLA's compiler threads take the cores the steps use, whatever the
  calling thread's priority: on 2 cores the long-tail job's steps ran 2.4x slower while its SD
  arms compiled (issue 62, docs/benchmarks.md); there the work is left undone instead (the SD arms
  are not offered; a bucket not compiled yet is never compiled, its rows decode in a larger one)."""
  value = os.environ.get(BACKGROUND_ENV, "auto").strip().lower()
  if value in ("1", "on", "true", "yes"):
    return True
  if value in ("0", "off", "false", "no"):
    return False
  if value != "auto":
    raise ValueError(f"${BACKGROUND_ENV}={value!r}: use 1/on, 0/off or auto (background compiles "
                     f"on hosts of {MIN_BACKGROUND_CORES} cores or more)")
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    cores = os.cpu_count() or 1
  return cores >= MIN_BACKGROUND_CORES


def mark_background(on: bool = True) -> None:
  """Counts this thread's compiles as background ones (``background_compile_count``), not in
  ``compile_count``: a thread that compiles executables before anything waits for them. ``on``
  also lowers the thread's scheduling priority to ``BACKGROUND_NICE`` where the OS allows it
  (Linux: per thread), so background compiles never take a core the steps want."""
  _thread.background = on
  if on and not getattr(_thread, "niced", False):
    try:
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
      _thread.niced = True
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
      pass


def in_background() -> bool:
  """Whether this thread's compiles count as background ones (``mark_background``)."""
  return getattr(_thread, "background", False)


def background_compile_count() -> int:
  """Number of XLA backend compilations in threads marked as background (``mark_background``)."""
  compile_count()  # installs the listener
  with _lock:
    return _background_compiles


def compile_count() -> int:
  """Number of XLA backend compilations in this process since the counter was installed, but
  those of background threads (``mark_background``)."""
  global _registered
  with _lock:
    if not _registered:
      monitoring.register_event_duration_secs_listener(_on_event)
      _registered = True
    return _compiles


class FieldError(ValueError):
  """A bad value of one field of a config dataclass; the message reads ``<owner>.<field>
  <problem>``. ``owner``, ``field`` and ``problem`` stay readable, so an entry point that calls
  the field by another name (the job's ``config.rollout.<field>``) says so without rewriting the
  message."""

  def __init__(self, owner: str, field: str, problem: str):
    super().__init__(f"{owner}.{field} {problem}")
    self.owner, self.field, self.problem = owner, field, problem


def require_positive_ints(obj, *names: str) -> None:
  """Raises ``FieldError`` naming ``Class.field`` for the first field that is not an int >= 1."""
  for name in names:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise FieldError(type(obj).__name__, name, f"must be a positive int, got {value!r}")


class ProgressLines:
  """Progress as whole lines on a stream: one as it starts where its total is known (a log shows at
  once what began; a step's rollout bar, whose total comes later, stays quiet), then at most one
  per ``every`` seconds, with the time left; what ``progress_bar`` gives where stderr
  is not a terminal (a log file): a bar's carriage returns would make one endless line there. The
  same methods as the tqdm bar the job uses."""

  def __init__(self, total: int, desc: str, unit: str, stream=None, every: float = 10.0,
               disable: bool = False):
    self.total, self.desc, self.unit, self.every = total, desc, unit, every
    self.stream = sys.stderr if stream is None else stream
    self.disable = disable
    self.n = 0
    self._postfix = ""
    self._t0 = self._last = time.perf_counter()
    if total:
      self._write(self._t0)

  def update(self, n: int = 1) -> None:
    """Advances by ``n``; writes a line when ``every`` seconds have passed since the last."""
    self.n += n
    now = time.perf_counter()
    if now - self._last >= self.every:
      self._last = now
      self._write(now)

  def set_postfix(self, **values) -> None:
    self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

  def _write(self, now: float) -> None:
    if self.disable:
      return
    elapsed = now - self._t0
    left = ""
    if self.total and 0 < self.n < self.total:
      left = f", ~{elapsed * (self.total - self.n) / self.n:.0f}s left"
    extra = f", {self._postfix}" if self._postfix else ""
    print(f"{self.desc}: {self.n}/{self.total} {self.unit} ({elapsed:.0f}s{left}{extra})",
          file=self.stream, flush=True)

  def close(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def progress_bar(total: int, desc: str, unit: str):
  """A tqdm bar on stderr, cleared when done; where stderr is not a terminal (a log file), lines
  every 10 s instead (``ProgressLines``); nothing on the processes other than process 0 of a
  multi-process job."""
  import jax  # pylint: disable=import-outside-toplevel
  if not sys.stderr.isatty():
    return ProgressLines(total, desc, unit, disable=jax.process_index() != 0)
  return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
              mininterval=0.5, dynamic_ncols=True, disable=jax.process_index() != 0)


def write_report(path, report: dict) -> pathlib.Path:
  """Writes ``report`` as indented JSON to ``path`` (making its folder) and says where."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2))
  print(f"wrote {path}")
  return path


def read_json_object(path: str | pathlib.Path, advice: str = "") -> dict:
  """The JSON object in the file ``path``; a garbled file, or one holding another JSON value,
  raises a one-line ``ValueError`` naming it (``advice``, if given, says what to do)."""
  path = pathlib.Path(path)
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e})" + (f"; {advice}" if advice else "")
                     ) from None
  if not isinstance(data, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
  return data


def nonfinite_count(array: np.ndarray) -> int:
  """How many entries of a host array are NaN or Inf (0 for integer arrays); one vectorised pass."""
  bits = _EXPONENT_BITS.get(array.dtype)
  if bits is not None:
    return int(np.count_nonzero((array.view(np.uint16) & bits) == bits))
  if not np.issubdtype(array.dtype, np.inexact):
    return 0
  finite = np.isfinite(array)
  return 0 if finite.all() else int(finite.size - np.count_nonzero(finite))


def replace_dir(final: pathlib.Path, write) -> pathlib.Path:
  """Has ``write(tmp)`` fill a fresh sibling directory, then swaps it in for ``final``: a reader
  sees the old complete directory or the new one, never a partial one (a ``write`` that fails
  leaves ``final`` as it was and no sibling behind)."""
  final = pathlib.Path(final)
  tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
  for leftover in (tmp, old):
    shutil.rmtree(leftover, ignore_errors=True)
  try:
    write(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if final.exists():
    final.rename(old)
  tmp.rename(final)
  shutil.rmtree(old, ignore_errors=True)
  return final
