"""Trainer checkpoints on orbax: per-step directories holding a pytree of arrays plus JSON metadata.

Layout: ``<directory>/<step>/state`` (the arrays, orbax ``StandardSave``) and
``<directory>/<step>/metadata`` (a JSON dict: config snapshot, data position, format version...).

Atomicity: orbax writes every step into ``<directory>/<step>.orbax-checkpoint-tmp`` and only
renames it to ``<directory>/<step>`` once all of its files are written (a single directory
``rename``, atomic on POSIX filesystems). Step listing only considers plain integer names, so a
process killed mid-save leaves at most a ``*.orbax-checkpoint-tmp`` directory that no reader
ever sees; the previous step stays loadable. Opening a ``Checkpointer`` starts removing such
leftovers in the background (finished at the latest before its first save), hence: one writing
process per directory. A process crash is covered; durability across a power loss depends on
the filesystem.

Trees are saved as plain nested containers of arrays. Use :func:`state_to_pure_dict` /
:func:`pure_dict_to_state` for ``nnx.State``. Typed PRNG keys (``jax.random.key``) may appear
as leaves: they are stored as their raw ``uint32`` key data and re-wrapped on restore with the
implementation of the matching key in ``like`` (or convert explicitly with :func:`key_to_data`
/ :func:`data_to_key`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

PyTree = Any

_STATE = "state"
_METADATA = "metadata"
_MAX_LISTED = 8


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be read (corrupt, truncated or half-deleted files)."""


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


def _listing(names: list[str]) -> str:
  shown = ", ".join(names[:_MAX_LISTED])
  return shown + (f", ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# ----------------------------------------------------------------------------- checkpointer


class Checkpointer:
  """Saves and restores numbered trainer checkpoints in ``directory``, keeping the newest ``keep``.

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
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=False,  # created on first save, so reading a missing directory has no side effect
        cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save,
    )
    handlers = {_STATE: ocp.StandardCheckpointHandler(), _METADATA: ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def step_dir(self, step: int) -> str:
    """The directory a finished checkpoint of ``step`` lives in."""
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    """Every complete (or, with async saves, in-flight) step, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest step, or ``None`` when the directory holds none (or does not exist)."""
    return self._manager.latest_step()

  def save(self, step: int, state: PyTree, metadata: dict | None = None) -> None:
    """Writes ``state`` (a pytree of arrays) and the JSON-able ``metadata`` as checkpoint ``step``.

    Steps must increase; the oldest checkpoints beyond ``keep`` are deleted afterwards.
    """
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
      raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    step = int(step)
    metadata = dict(metadata or {})
    try:
      json.dumps(metadata)
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint metadata for step {step} is not JSON-serializable: {e}") from e
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
          f"cannot save step {step} in {self.directory}: it is not newer than the latest "
          f"checkpoint {latest}. Resume from the latest step or use a fresh directory.")
    arrays = jax.tree.map(lambda x: key_to_data(x) if _is_key(x) else x, state)
    os.makedirs(self.directory, exist_ok=True)
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(arrays),
                                 _METADATA: ocp.args.JsonSave(metadata)})
    if not self._manager.save(step, args=args):
      raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")

  def restore(self, step: int | None = None, *, like: PyTree) -> tuple[PyTree, dict]:
    """Loads ``step`` (default: the latest) into the structure, shapes and dtypes of ``like``.

    ``like`` may be concrete or abstract (``jax.ShapeDtypeStruct`` leaves, whose shardings are
    honoured). Stored dtypes are cast to ``like``'s. Returns ``(state, metadata)``.
    """
    if self.async_save:
      self.wait()  # never read a step whose files are still being written
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self.directory}; available steps: {steps}")
    path = self.step_dir(step)
    target = jax.tree.map(_abstract_leaf, like)
    try:
      stored = self._manager.item_metadata(step)[_STATE]
    except Exception as e:  # tensorstore / orbax failures surface as assorted exception types
      raise self._unreadable(path, step, e) from e
    if stored is None:
      raise self._unreadable(path, step, FileNotFoundError("no array metadata"))
    self._check_matches(path, getattr(stored, "tree", stored), target)
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target),
                                 _METADATA: ocp.args.JsonRestore()})
    try:
      restored = self._manager.restore(step, args=args)
    except Exception as e:
      raise self._unreadable(path, step, e) from e
    state = jax.tree.map(
        lambda ref, x: data_to_key(x, _abstract_key(ref)[1]) if _is_key(ref) else x,
        like, restored[_STATE])
    return state, dict(restored[_METADATA] or {})

  def wait(self) -> None:
    """Blocks until every pending asynchronous save is on disk (re-raising its error, if any)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's resources."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _unreadable(self, path: str, step: int, e: BaseException) -> CheckpointError:
    others = [s for s in self.all_steps() if s != step]
    hint = (f"Delete it to fall back to an earlier step ({others})." if others
            else "No other checkpoint exists in this directory.")
    return CheckpointError(
        f"checkpoint {path} is unreadable (corrupt or truncated files?): {_first_line(e)}. {hint}")

  @staticmethod
  def _check_matches(path: str, stored_tree: PyTree, target: PyTree) -> None:
    """Raises ``ValueError`` naming the first key or shape where checkpoint and target differ."""
    stored, wanted = _flat(stored_tree), _flat(target)
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
