"""Pytrees as the checkpointer stores them: plain containers of arrays keyed by slash paths.

``nnx.State`` converts to and from plain nested dicts; typed PRNG keys are stored as their raw
``uint32`` key data; each leaf's integrity record is its dtype, shape and the sha256 of its host
bytes (``None`` for an array no process sees all of); :func:`count_nonfinite` counts NaN/inf.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.utils import nonfinite_count

PyTree = Any


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


def is_key(x: Any) -> bool:
  """Whether ``x`` (concrete or abstract) is a typed PRNG key."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def abstract_key(x: Any) -> tuple[jax.ShapeDtypeStruct, str]:
  """Abstract key data and the PRNG implementation of a (possibly abstract) typed key."""
  impls: list = []

  def data(k):
    impls.append(jax.random.key_impl(k))
    return jax.random.key_data(k)

  out = jax.eval_shape(data, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return out, impls[0]


def abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
  """The shape, dtype (raw key data for a key) and sharding of a leaf, as a struct."""
  if is_key(x):
    return abstract_key(x)[0]
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  value = np.asarray(x)
  return jax.ShapeDtypeStruct(value.shape, value.dtype)


def path_str(path: tuple) -> str:
  """A leaf's key path as ``"a/0/b"``: the name it is checked and reported by."""
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


def flat_leaves(tree: PyTree) -> dict[str, Any]:
  """The leaves of ``tree`` by their :func:`path_str` names."""
  return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ----------------------------------------------------------------------------- integrity


def _host(x: Any) -> np.ndarray | None:
  """The whole array on the host; ``None`` for one whose parts are on other processes' devices
  alone (a multi-process array whose local shards cover it, e.g. replicated, or FSDP-sharded
  over this process's devices only, is assembled here)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not x.is_fully_replicated:
      whole = np.empty(x.shape, x.dtype)
      seen = np.zeros(x.shape, bool)
      for shard in x.addressable_shards:
        whole[shard.index] = np.asarray(shard.data)
        seen[shard.index] = True
      return np.ascontiguousarray(whole) if seen.all() else None
    x = x.addressable_data(0)  # a full local replica
  return np.ascontiguousarray(np.asarray(jax.device_get(x)))


def _sha256(a: np.ndarray) -> str:
  return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


def leaf_record(x: Any) -> dict:
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


def metadata_sha256(metadata: dict) -> str:
  """The sha256 of the metadata's canonical JSON (sorted keys)."""
  return hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()).hexdigest()
