"""Trainer checkpoints on orbax: per-step directories holding a pytree of arrays plus JSON metadata.

Layout: ``<directory>/<step>/state`` (the arrays, orbax ``StandardSave``),
``<directory>/<step>/metadata`` (a JSON dict: config snapshot, data position, format version...)
and ``<directory>/<step>/integrity`` (JSON: the sha256, dtype and shape of every array leaf and
the sha256 of the metadata).

Atomicity: orbax writes every step into ``<directory>/<step>.orbax-checkpoint-tmp`` and only
renames it to ``<directory>/<step>`` once all of its files are written (a single directory
``rename``, atomic on POSIX filesystems). Step listing only considers plain integer names, so a
process killed mid-save leaves at most a ``*.orbax-checkpoint-tmp`` directory that no reader
ever sees; the previous step stays loadable. Opening a ``Checkpointer`` removes such leftovers
(on process 0), hence: one writing process per directory. A process crash is covered;
durability across a power loss depends on the filesystem.

Integrity: ``save`` refuses NaN/inf in floating leaves (:class:`NonFiniteError`; override with
``allow_nonfinite=True``) and records a checksum of every leaf's host bytes. ``restore`` checks
each loaded leaf (in its stored dtype, before any cast to ``like``'s) and the metadata against
them and raises :class:`CheckpointCorruptError` (one line: step directory, first bad key, what to
do) on a mismatch or unreadable files. Checkpoints without checksums restore
with an :class:`UnverifiedCheckpointWarning`. :meth:`Checkpointer.restore_latest_good` walks
back from the newest step, renaming each corrupt one to ``<step>.corrupt`` (outside the step
listing; never deleted by this module) until one verifies. Hashing costs one host copy of the
arrays per save and restore.

Rotation (``keep``): after each completed save, all steps are deleted except the newest
``keep`` ones and the newest *known-good* step. Known good, per ``Checkpointer`` instance: a
step this instance saved whose floating leaves were all finite, or a step it restored with
verified checksums. A step moved aside as corrupt stops being known good. So a run that
restored a good step and then saves non-finite states (``allow_nonfinite=True``) keeps that good
step however many steps follow; unverified (pre-checksum) restores are not known good. With
``async_save`` a save's rotation happens once it is on disk (at the next ``save``, ``wait``,
``restore`` or ``close``).

Console: orbax's log records, and the late errors of a failed read, are silenced by
``tlt_jax.checkpoint.console`` (see there); everything else passes through unchanged.

Trees are saved as plain nested containers of arrays. Use :func:`state_to_pure_dict` /
:func:`pure_dict_to_state` for ``nnx.State``. Typed PRNG keys (``jax.random.key``) may appear
as leaves: they are stored as their raw ``uint32`` key data and re-wrapped on restore with the
implementation of the matching key in ``like`` (or convert explicitly with :func:`key_to_data`
/ :func:`data_to_key`).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from tlt_jax.checkpoint.console import (first_line, key_in_error, listing, note_failed_read,
                                        quiet, root_cause)
from tlt_jax.checkpoint.trees import (PyTree, abstract_key, abstract_leaf, count_nonfinite,
                                      data_to_key, flat_leaves, is_key, key_to_data, leaf_record,
                                      metadata_sha256, path_str)

_STATE = "state"
_METADATA = "metadata"
_INTEGRITY = "integrity"
_INTEGRITY_FORMAT = 1


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


# ----------------------------------------------------------------------------- checkpointer


def _clear_tmp_leftovers(directory: str) -> None:
  """Removes the ``*.orbax-checkpoint-tmp`` directories of saves that crashed, before the
  manager opens ``directory`` (once, on process 0). Not orbax's own clean-up: that one runs in a
  thread, and a process that exits while it runs gets orbax tracebacks at interpreter shutdown."""
  if jax.process_index() == 0 and os.path.isdir(directory):
    for name in ocp.path.step.tmp_checkpoints(directory):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


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
        cleanup_tmp_directories=False,  # ours, done now (orbax's runs in a thread of its own)
        enable_async_checkpointing=async_save,
    )
    _clear_tmp_leftovers(self.directory)
    with quiet():
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

  def read_metadata(self, step: int) -> dict:
    """The JSON metadata saved with ``step`` alone, without reading its arrays (unverified:
    ``restore`` checks it against the step's checksums)."""
    with quiet():
      restored = self._manager.restore(
          int(step), args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()}))
    return dict(restored[_METADATA] or {})

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
    arrays = jax.tree.map(lambda x: key_to_data(x) if is_key(x) else x, state)
    leaves: dict[str, dict] = {}
    finite = True
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
      name = path_str(path)
      if name in leaves:
        raise ValueError(f"cannot save step {step}: two leaves share the key {name!r}")
      bad = count_nonfinite(leaf)
      if bad and not allow_nonfinite:
        raise NonFiniteError(
            f"refusing to save step {step} in {self.directory}: {name} holds {bad} non-finite "
            f"value(s) (NaN/inf) of {np.size(leaf)}. Find the cause or resume from an earlier "
            "step; pass allow_nonfinite=True to save it anyway.")
      finite = finite and not bad
      leaves[name] = leaf_record(leaf)
    integrity = {"format": _INTEGRITY_FORMAT, "leaves": leaves,
                 "metadata_sha256": metadata_sha256(normalized)}
    os.makedirs(self.directory, exist_ok=True)
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(arrays),
                                 _METADATA: ocp.args.JsonSave(metadata),
                                 _INTEGRITY: ocp.args.JsonSave(integrity)})
    with quiet():
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
    with quiet():
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
    with quiet():
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
      with quiet():
        self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # --------------------------------------------------------------------------- internals

  def _settle(self) -> None:
    """Waits for the pending save; marks it known good if it was finite; rotates old steps."""
    pending, self._pending = self._pending, None
    with quiet():
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
    with quiet():
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
    with quiet():
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
    target = jax.tree.map(abstract_leaf, like)
    try:
      stored = self._manager.item_metadata(step)[_STATE]
    except Exception as e:  # tensorstore / orbax failures surface as assorted exception types
      raise self._unreadable(path, step, e, []) from e
    if stored is None:
      raise self._unreadable(path, step, FileNotFoundError("no array metadata"), [])
    stored_flat = flat_leaves(getattr(stored, "tree", stored))
    self._check_matches(path, stored_flat, flat_leaves(target))

    def as_stored(p, want):  # read in the stored dtype: the checksums are of those bytes
      dtype = getattr(stored_flat.get(path_str(p)), "dtype", None) or want.dtype
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
      if is_key(ref):
        return data_to_key(x, abstract_key(ref)[1])
      want = abstract_leaf(ref).dtype
      return x if x.dtype == want else x.astype(want)

    return jax.tree.map(finish, like, restored[_STATE]), metadata, checked

  def _verify(self, path: str, step: int, state: PyTree, metadata: dict, integrity: Any) -> None:
    """Raises :class:`CheckpointCorruptError` at the first leaf not matching its checksum."""
    leaves = integrity.get("leaves") if isinstance(integrity, dict) else None
    if not isinstance(leaves, dict):
      raise self._corrupt(path, step, None, "its integrity record is malformed")
    loaded = flat_leaves(state)
    for name, leaf in loaded.items():
      want = leaves.get(name)
      if want is None:
        raise self._corrupt(path, step, name, f"array {name} has no saved checksum")
      got = leaf_record(leaf)
      if want.get("sha256") is None or got["sha256"] is None:  # sharded over processes
        got, want = got | {"sha256": None}, want | {"sha256": None}
      if got != want:
        raise self._corrupt(path, step, name,
                            f"array {name} does not match the checksum saved with it")
    extra = sorted(set(leaves) - set(loaded))
    if extra:
      raise self._corrupt(path, step, extra[0], f"array {extra[0]} is missing from the data")
    if integrity.get("metadata_sha256") != metadata_sha256(metadata):
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
    note_failed_read(path)
    key = key_in_error(e, names)
    what = f"array {key} is unreadable" if key else "unreadable"
    cause = first_line(root_cause(e))
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
        parts.append(f"missing from the checkpoint: {listing(missing)}")
      if extra:
        parts.append(f"only in the checkpoint: {listing(extra)}")
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
