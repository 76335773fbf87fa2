"""Trainer checkpoints on orbax: per-step directories holding a pytree of arrays plus JSON metadata.

Layout: ``<directory>/<step>/state`` (the arrays, orbax ``StandardSave``),
``<directory>/<step>/metadata`` (a JSON dict: config snapshot, data position, format version...)
and ``<directory>/<step>/integrity`` (JSON: the sha256, dtype and shape of every array leaf and
the sha256 of the metadata).

Atomicity: orbax writes every step into ``<directory>/<step>.orbax-checkpoint-tmp`` and only
renames it to ``<directory>/<step>`` once all of its files are written (a single directory
``rename``, atomic on POSIX filesystems). Step listing only considers plain integer names, so a
process killed mid-save leaves at most a ``*.orbax-checkpoint-tmp`` directory that no reader
ever sees; the previous step stays loadable. Opening a ``Checkpointer`` starts removing such
leftovers in the background (finished at the latest before its first save), hence: one writing
process per directory. A process crash is covered; durability across a power loss depends on
the filesystem.

Integrity: ``save`` refuses NaN/inf in floating leaves (:class:`NonFiniteError`; override with
``allow_nonfinite=True``) and records a checksum of every leaf's host bytes. ``restore`` checks
each loaded leaf (in its stored dtype, before any cast to ``like``'s) and the metadata against
them and raises :class:`CheckpointCorruptError` (one line: step directory, first bad key, what to
do) on a mismatch or unreadable files. Checkpoints written before checksums existed restore
with an :class:`UnverifiedCheckpointWarning`. :meth:`Checkpointer.restore_latest_good` walks
back from the newest step, renaming each corrupt one to ``<step>.corrupt`` (outside the step
listing; never deleted by this module) until one verifies. Hashing costs one host copy of the
arrays per save and restore (about 0.7 GB/s).

Rotation (``keep``): after each completed save, all steps are deleted except the newest
``keep`` ones and the newest *known-good* step. Known good, per ``Checkpointer`` instance: a
step this instance saved whose floating leaves were all finite, or a step it restored with
verified checksums. A step moved aside as corrupt stops being known good. So a run that
restored a good step and then saves non-finite states (``allow_nonfinite=True``) keeps that good
step however many steps follow; unverified (pre-checksum) restores are not known good. With
``async_save`` a save's rotation happens once it is on disk (at the next ``save``, ``wait``,
``restore`` or ``close``).

Console: orbax logs through absl (INFO per save/restore), and a failed read leaves orbax's
asyncio tasks pending on a closed event loop; tensorstore's completions then raise "Event loop
is closed" and the abandoned coroutines raise again when garbage-collected (thousands of lines
of TensorStore specs, via ``sys.unraisablehook`` and the ``asyncio`` logger, mostly after our
error). This module drops orbax's absl records below WARNING (all of them while inside a
``Checkpointer`` call), those ``asyncio`` records and those unraisable exceptions; everything
else passes through unchanged.

Trees are saved as plain nested containers of arrays. Use :func:`state_to_pure_dict` /
:func:`pure_dict_to_state` for ``nnx.State``. Typed PRNG keys (``jax.random.key``) may appear
as leaves: they are stored as their raw ``uint32`` key data and re-wrapped on restore with the
implementation of the matching key in ``like`` (or convert explicitly with :func:`key_to_data`
/ :func:`data_to_key`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import threading
import traceback
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore
from flax import nnx

from tlt_jax.utils import nonfinite_count

PyTree = Any

_STATE = "state"
_METADATA = "metadata"
_INTEGRITY = "integrity"
_INTEGRITY_FORMAT = 1
_MAX_LISTED = 8


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be read (corrupt, truncated or half-deleted files)."""


class CheckpointCorruptError(CheckpointError):
  """A checkpoint's files are unreadable or its data does not match the checksums saved with it."""

  def __init__(self, message: str, *, path: str = "", step: int | None = None,
               key: str | None = None, reason: str = "") -> None:
    super().__init__(message)
    self.path, self.step, self.key, self.reason = path, step, key, reason


class NonFiniteError(ValueError):
  """``save`` was handed NaN or inf in a floating leaf."""


class UnverifiedCheckpointWarning(UserWarning):
  """A checkpoint without checksums (written before they existed) was restored unchecked."""


# ----------------------------------------------------------------------------- conversions


def state_to_pure_dict(state: nnx.State) -> dict:
  """A plain nested dict of arrays (no ``Variable`` wrappers) from an ``nnx.State``."""
  return state.to_pure_dict()


def pure_dict_to_state(pure: dict, like: nnx.State) -> nnx.State:
  """A copy of ``like`` holding the arrays of ``pure``; ``like`` itself is left untouched."""
  state = jax.tree.map(lambda x: x, like)
  nnx.replace_by_pure_dict(state, pure)
  return state


def key_to_data(key: jax.Array) -> jax.Array:
  """Raw ``uint32`` data of a typed PRNG key (``jax.random.key``), shaped ``key.shape + (n,)``."""
  return jax.random.key_data(key)


def data_to_key(data: jax.Array, impl: str | None = None) -> jax.Array:
  """A typed PRNG key from raw key data; ``impl`` defaults to JAX's default PRNG implementation."""
  return jax.random.wrap_key_data(data, impl=impl)


def _is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _abstract_key(x: Any) -> tuple[jax.ShapeDtypeStruct, str]:
  """Abstract key data and the PRNG implementation of a (possibly abstract) typed key."""
  impls: list = []

  def data(k):
    impls.append(jax.random.key_impl(k))
    return jax.random.key_data(k)

  out = jax.eval_shape(data, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return out, impls[0]


def _abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
  if _is_key(x):
    return _abstract_key(x)[0]
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  value = np.asarray(x)
  return jax.ShapeDtypeStruct(value.shape, value.dtype)


def _path_str(path: tuple) -> str:
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


def _flat(tree: PyTree) -> dict[str, Any]:
  return {_path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ----------------------------------------------------------------------------- integrity


def _host(x: Any) -> np.ndarray | None:
  """The whole array on the host; ``None`` for one sharded over other processes' devices."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not x.is_fully_replicated:
      return None
    x = x.addressable_data(0)  # a full local replica
  return np.ascontiguousarray(np.asarray(jax.device_get(x)))


def _sha256(a: np.ndarray) -> str:
  return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


def _leaf_record(x: Any) -> dict:
  """dtype, shape and sha256 of a leaf (``sha256`` is ``None`` when no process sees all of it)."""
  a = _host(x)
  if a is None:
    return {"dtype": str(x.dtype), "shape": list(x.shape), "sha256": None}
  return {"dtype": str(a.dtype), "shape": list(a.shape), "sha256": _sha256(a)}


def _local_shards(x: Any) -> list[np.ndarray]:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return [np.asarray(s.data) for s in x.addressable_shards]
  return [np.asarray(jax.device_get(x))]


def count_nonfinite(x: Any) -> int:
  """NaN/inf values in a floating leaf (in this process's shards of a multi-process array)."""
  if not jnp.issubdtype(x.dtype if hasattr(x, "dtype") else np.result_type(x), jnp.inexact):
    return 0
  return sum(nonfinite_count(np.asarray(a)) for a in _local_shards(x))


def _metadata_sha256(metadata: dict) -> str:
  return hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- console noise

_NOISY_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(m.__file__)), "")
                    for m in (ocp, tensorstore))
_quiet_lock = threading.Lock()
_quiet_depth = 0
_orbax_failed = False  # once an orbax call failed, stray "Event loop is closed" errors are its
# step directories whose read failed: the reads orbax abandoned there fail later on their own
# ("Future exception was never retrieved"), with tensorstore errors that name the directory
_failed_dirs: set[str] = set()


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


def _install_filters() -> None:
  """Adds the log filters once and (re-)wraps ``sys.unraisablehook`` unless already wrapped."""
  for name, kind in (("absl", _OrbaxAbslFilter), ("asyncio", _OrbaxAsyncioFilter)):
    logger = logging.getLogger(name)
    if not any(isinstance(f, kind) for f in logger.filters):
      logger.addFilter(kind())
  previous = sys.unraisablehook
  if getattr(previous, "_tlt_checkpoint", False):
    return

  def hook(unraisable: Any) -> None:
    try:
      if _is_orbax_unraisable(unraisable):
        return
    except Exception:  # pylint: disable=broad-exception-caught
      pass
    previous(unraisable)

  hook._tlt_checkpoint = True  # type: ignore[attr-defined]
  sys.unraisablehook = hook


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """Silences orbax's logging for the duration; notes failures for the unraisable hook."""
  global _quiet_depth, _orbax_failed
  _install_filters()
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


def _listing(names: list[str]) -> str:
  shown = ", ".join(names[:_MAX_LISTED])
  return shown + (f", ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def _one_line(text: str, limit: int = 300) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _root_cause(e: BaseException) -> BaseException:
  seen: set[int] = set()
  while e.__cause__ is not None and id(e.__cause__) not in seen:
    seen.add(id(e))
    e = e.__cause__
  return e


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {_one_line(text[0]) if text else ''}"


def _key_in_error(e: BaseException, names: list[str]) -> str | None:
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


# ----------------------------------------------------------------------------- checkpointer


class Checkpointer:
  """Saves and restores numbered trainer checkpoints in ``directory`` (rotation: module docstring).

  ``keep=None`` keeps every step. With ``async_save`` a save returns once the arrays are copied
  off the device and the files are written in the background; call :meth:`wait` before relying
  on the step being on disk. Opening a directory clears tmp leftovers of crashed saves.
  """

  def __init__(self, directory: str | os.PathLike, keep: int | None = 3,
               async_save: bool = False) -> None:
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
      raise ValueError(f"Checkpointer.keep must be a positive int or None, got {keep!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.keep = keep
    self.async_save = async_save
    self._good: set[int] = set()  # steps known good (see the module docstring)
    self._pending: tuple[int, bool] | None = None  # (step, finite) of a save not yet settled
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # rotation is ours: it must spare the newest known-good step
        create=False,  # created on first save, so reading a missing directory has no side effect
        cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save,
    )
    with _quiet():
      handlers = {_STATE: ocp.StandardCheckpointHandler(),
                  _METADATA: ocp.JsonCheckpointHandler(), _INTEGRITY: ocp.JsonCheckpointHandler()}
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            item_handlers=handlers)

  def step_dir(self, step: int) -> str:
    """The directory a finished checkpoint of ``step`` lives in."""
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    """Every complete (or, with async saves, in-flight) step, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest step, or ``None`` when the directory holds none (or does not exist)."""
    return self._manager.latest_step()

  def save(self, step: int, state: PyTree, metadata: dict | None = None, *,
           allow_nonfinite: bool = False) -> None:
    """Writes ``state`` (a pytree of arrays) and the JSON-able ``metadata`` as checkpoint ``step``.

    Steps must increase. Raises :class:`NonFiniteError` (nothing written) when a floating leaf
    holds NaN/inf, unless ``allow_nonfinite``. Old steps are then rotated out (module docstring).
    """
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
      raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    step = int(step)
    metadata = dict(metadata or {})
    try:
      normalized = json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint metadata for step {step} is not JSON-serializable: {e}") from e
    if self._pending is not None:
      self._settle()  # the previous async save: on disk (or its error raised) before the next
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
          f"cannot save step {step} in {self.directory}: it is not newer than the latest "
          f"checkpoint {latest}. Resume from the latest step or use a fresh directory.")
    arrays = jax.tree.map(lambda x: key_to_data(x) if _is_key(x) else x, state)
    leaves: dict[str, dict] = {}
    finite = True
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
      name = _path_str(path)
      if name in leaves:
        raise ValueError(f"cannot save step {step}: two leaves share the key {name!r}")
      bad = count_nonfinite(leaf)
      if bad and not allow_nonfinite:
        raise NonFiniteError(
            f"refusing to save step {step} in {self.directory}: {name} holds {bad} non-finite "
            f"value(s) (NaN/inf) of {np.size(leaf)}. Find the cause or resume from an earlier "
            "step; pass allow_nonfinite=True to save it anyway.")
      finite = finite and not bad
      leaves[name] = _leaf_record(leaf)
    integrity = {"format": _INTEGRITY_FORMAT, "leaves": leaves,
                 "metadata_sha256": _metadata_sha256(normalized)}
    os.makedirs(self.directory, exist_ok=True)
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(arrays),
                                 _METADATA: ocp.args.JsonSave(metadata),
                                 _INTEGRITY: ocp.args.JsonSave(integrity)})
    with _quiet():
      saved = self._manager.save(step, args=args)
    if not saved:
      raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
    self._pending = (step, finite)
    if not self.async_save:
      self._settle()

  def restore(self, step: int | None = None, *, like: PyTree) -> tuple[PyTree, dict]:
    """Loads ``step`` (default: the latest) into the structure, shapes and dtypes of ``like``.

    ``like`` may be concrete or abstract (``jax.ShapeDtypeStruct`` leaves, whose shardings are
    honoured). Stored dtypes are cast to ``like``'s after verification. Returns
    ``(state, metadata)``; raises :class:`CheckpointCorruptError` when the files are unreadable
    or do not match their checksums, ``ValueError`` when ``like`` has another structure/shapes.
    """
    if self._pending is not None or self.async_save:
      self.wait()  # never read a step whose files are still being written
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self.directory}; available steps: {steps}")
    with _quiet():
      state, metadata, verified = self._load(int(step), like)
    if verified:
      self._good.add(int(step))
    else:
      warnings.warn(
          f"checkpoint {self.step_dir(step)} has no checksums (written before they existed): "
          "restored without verification. Save a new step to get a verified checkpoint.",
          UnverifiedCheckpointWarning, stacklevel=2)
    return state, metadata

  def restore_latest_good(self, *, like: PyTree, report: Callable[[str], Any] = print
                          ) -> tuple[int, PyTree, dict]:
    """Restores the newest step that reads and verifies; returns ``(step, state, metadata)``.

    Each corrupt step on the way is reported in one line via ``report`` and renamed to
    ``<step>.corrupt`` (out of the step listing, so its number can be saved again). Raises
    ``FileNotFoundError`` when there is no step, :class:`CheckpointError` when none is good, and
    lets ``ValueError`` (``like`` does not match) through without touching anything.
    """
    if self._pending is not None or self.async_save:
      self.wait()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
    failed: list[str] = []
    for step in reversed(steps):
      try:
        state, metadata = self.restore(step, like=like)
      except CheckpointCorruptError as e:
        moved = self._move_aside(step)
        where = f"moved to {moved}" if moved else "could not move it aside"
        older = [s for s in steps if s < step]
        then = f"trying step {older[-1]}" if older else "no older step left"
        report(f"checkpoint {self.step_dir(step)} is corrupt ({e.reason}); {where}; {then}")
        failed.append(f"{step} ({e.reason})")
        continue
      return step, state, metadata
    raise CheckpointError(
        f"no good checkpoint left in {self.directory}: every step failed verification "
        f"({'; '.join(failed)}); the corrupt ones are kept as <step>.corrupt. Start a fresh run "
        "or restore from a backup.")

  def delete_after(self, step: int) -> list[int]:
    """Deletes every step newer than ``step`` (e.g. saves of steps a resumed run does again, so
    they can be saved anew); returns the deleted steps."""
    self.wait()
    newer = [s for s in self.all_steps() if s > step]
    with _quiet():
      for s in newer:
        self._manager.delete(s)
    self._good -= set(newer)
    return newer

  def wait(self) -> None:
    """Blocks until every pending asynchronous save is on disk (re-raising its error, if any)."""
    self._settle()

  def close(self) -> None:
    """Waits for pending saves (rotating old steps out) and releases orbax's resources."""
    try:
      self._settle()
    finally:
      with _quiet():
        # the tmp-directory cleanup started by __init__ runs in a thread of its own; a process
        # that exits while it runs gets orbax tracebacks at interpreter shutdown
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # --------------------------------------------------------------------------- internals

  def _settle(self) -> None:
    """Waits for the pending save; marks it known good if it was finite; rotates old steps."""
    pending, self._pending = self._pending, None
    with _quiet():
      self._manager.wait_until_finished()
    if pending is None:
      return
    step, finite = pending
    if finite and step in self._manager.all_steps():
      self._good.add(step)
    self._rotate()

  def _rotate(self) -> None:
    """Deletes all but the newest ``keep`` steps and the newest known-good step."""
    steps = self.all_steps()
    self._good &= set(steps)
    if self.keep is None:
      return
    spared = set(steps[-self.keep:]) | ({max(self._good)} if self._good else set())
    with _quiet():
      for step in steps:
        if step not in spared:
          self._manager.delete(step)

  def _move_aside(self, step: int) -> str | None:
    """Renames ``<step>`` to an unused ``<step>.corrupt[N]``; ``None`` if the rename failed."""
    source = self.step_dir(step)
    target, n = source + ".corrupt", 1
    while os.path.exists(target):
      target, n = f"{source}.corrupt{n}", n + 1
    self._good.discard(step)
    with _quiet():
      if jax.process_index() == 0:  # one renamer; the others wait for it
        try:
          os.rename(source, target)
        except OSError:
          pass
      if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"tlt_checkpoint_move_aside_{step}")
      self._manager.reload()
    return None if os.path.exists(source) else target

  def _load(self, step: int, like: PyTree) -> tuple[PyTree, dict, bool]:
    """Reads ``step``, verifying it if it has checksums: ``(state, metadata, verified)``."""
    path = self.step_dir(step)
    target = jax.tree.map(_abstract_leaf, like)
    try:
      stored = self._manager.item_metadata(step)[_STATE]
    except Exception as e:  # tensorstore / orbax failures surface as assorted exception types
      raise self._unreadable(path, step, e, []) from e
    if stored is None:
      raise self._unreadable(path, step, FileNotFoundError("no array metadata"), [])
    stored_flat = _flat(getattr(stored, "tree", stored))
    self._check_matches(path, stored_flat, _flat(target))

    def as_stored(p, want):  # read in the stored dtype: the checksums are of those bytes
      dtype = getattr(stored_flat.get(_path_str(p)), "dtype", None) or want.dtype
      return jax.ShapeDtypeStruct(want.shape, dtype, sharding=want.sharding)

    read_target = jax.tree_util.tree_map_with_path(as_stored, target)
    checked = os.path.isdir(os.path.join(path, _INTEGRITY))
    items = {_STATE: ocp.args.StandardRestore(read_target), _METADATA: ocp.args.JsonRestore()}
    if checked:
      items[_INTEGRITY] = ocp.args.JsonRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
      raise self._unreadable(path, step, e, sorted(stored_flat)) from e
    metadata = dict(restored[_METADATA] or {})
    if checked:
      self._verify(path, step, restored[_STATE], metadata, restored[_INTEGRITY])

    def finish(ref, x):
      if _is_key(ref):
        return data_to_key(x, _abstract_key(ref)[1])
      want = _abstract_leaf(ref).dtype
      return x if x.dtype == want else x.astype(want)

    return jax.tree.map(finish, like, restored[_STATE]), metadata, checked

  def _verify(self, path: str, step: int, state: PyTree, metadata: dict, integrity: Any) -> None:
    """Raises :class:`CheckpointCorruptError` at the first leaf not matching its checksum."""
    leaves = integrity.get("leaves") if isinstance(integrity, dict) else None
    if not isinstance(leaves, dict):
      raise self._corrupt(path, step, None, "its integrity record is malformed")
    loaded = _flat(state)
    for name, leaf in loaded.items():
      want = leaves.get(name)
      if want is None:
        raise self._corrupt(path, step, name, f"array {name} has no saved checksum")
      got = _leaf_record(leaf)
      if want.get("sha256") is None or got["sha256"] is None:  # sharded over processes
        got, want = got | {"sha256": None}, want | {"sha256": None}
      if got != want:
        raise self._corrupt(path, step, name,
                            f"array {name} does not match the checksum saved with it")
    extra = sorted(set(leaves) - set(loaded))
    if extra:
      raise self._corrupt(path, step, extra[0], f"array {extra[0]} is missing from the data")
    if integrity.get("metadata_sha256") != _metadata_sha256(metadata):
      raise self._corrupt(path, step, _METADATA,
                          "its metadata does not match the checksum saved with it")

  def _hint(self, step: int) -> str:
    others = [s for s in self.all_steps() if s != step]
    if others:
      return (f"Call restore_latest_good() to move it aside and fall back to an earlier step "
              f"(others: {others}), or delete it.")
    return "No other checkpoint exists in this directory: delete it and start a fresh run."

  def _corrupt(self, path: str, step: int, key: str | None, reason: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {path} is corrupt: {reason} (garbled files). {self._hint(step)}",
        path=path, step=step, key=key, reason=reason)

  def _unreadable(self, path: str, step: int, e: BaseException,
                  names: list[str]) -> CheckpointCorruptError:
    _failed_dirs.add(os.path.join(path, ""))
    key = _key_in_error(e, names)
    what = f"array {key} is unreadable" if key else "unreadable"
    cause = _first_line(_root_cause(e))
    return CheckpointCorruptError(
        f"checkpoint {path} is unreadable (corrupt or truncated files?): {what}: {cause}. "
        f"{self._hint(step)}", path=path, step=step, key=key, reason=what)

  @staticmethod
  def _check_matches(path: str, stored: dict, wanted: dict) -> None:
    """Raises ``ValueError`` naming the first key or shape where checkpoint and target differ."""
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    if missing or extra:
      parts = []
      if missing:
        parts.append(f"missing from the checkpoint: {_listing(missing)}")
      if extra:
        parts.append(f"only in the checkpoint: {_listing(extra)}")
      raise ValueError(
          f"checkpoint at {path} does not have the structure of `like` ({'; '.join(parts)}). "
          "It was written by a different model/optimizer config: restore with a `like` built from "
          "that config, or train into a fresh checkpoint directory.")
    for name, want in wanted.items():
      got = tuple(getattr(stored[name], "shape", None) or ())
      if got != tuple(want.shape):
        raise ValueError(
            f"checkpoint at {path} was written by a different model config: {name} has shape "
            f"{got}, expected {tuple(want.shape)}. Restore with a `like` built from the config "
            "that wrote it, or train into a fresh checkpoint directory.")
