"""EAGLE-style drafter: one trainable decoder layer on top of the target's features.

At position t the drafter reads ``fc(concat(embed(x_{t+1}), h_t))``, where ``h_t`` is the
target's last hidden state (after its final norm) and ``embed`` the target's own embedding; one
decoder layer turns that into a prediction of ``h_{t+1}``, and the target's LM head turns the
prediction into next-token logits. Embedding and LM head stay the target's (frozen, shared), so
the drafter's trainable params are only ``fc`` and ``layer``. It keeps a one-layer KV cache.

Reduced draft vocabulary (EAGLE-3 / FR-Spec): with ``draft_vocab_size=K`` the drafter has a head
of its own over K target token ids (``vocab_ids``, typically the K most frequent tokens of the
target's generations), initialised from the target's LM head rows of those tokens and trained
with the rest. Drafting then costs ``H x K`` per position instead of ``H x V``. Its
distribution ``q`` is zero outside the subset; verification still uses the target's full
distribution, so decoding stays exact (a token outside the subset is simply never drafted).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import (DecoderLayer, KVCache, Transformer, positions_and_mask,
                                        rope_inv_freq)
from tlt_jax.models.weights import WeightsError, check_finite
from tlt_jax.utils import read_json_object

PARAMS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"
VOCAB_IDS_TENSOR = "vocab_ids"
DRAFT_VOCAB_KEY = "draft_vocab_size"
POLICY_KEY = "trained_for_policy"  # in CONFIG_FILE: {"fingerprint": ..., "name": ...}
KIND_KEY = "drafter_kind"  # in CONFIG_FILE: "eagle" (absent in older files) or "eagle3"
EAGLE3_KEYS = ("feature_layers", "ttt_steps")  # in CONFIG_FILE for an eagle3 drafter
_FINGERPRINT_ROWS = 256  # embedding rows sampled (evenly spaced) into a policy's fingerprint


class DrafterOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] float32 via the target's LM head, or [B, T, K] over vocab_ids
  hidden: jax.Array  # [B, T, H] predicted next target feature
  cache: KVCache | None  # the drafter's one-layer cache with the new keys written


class Drafter(nnx.Module):
  """One decoder layer fed with ``fc(concat(embed(token), target_feature))``."""

  kind = "eagle"  # the config's name of this architecture (``drafter=eagle``)

  def __init__(self, target_config: ModelConfig, *, rngs: nnx.Rngs,
               draft_vocab_size: int | None = None):
    self.config = target_config
    h, dt = target_config.hidden_size, target_config.jnp_dtype
    self.fc = nnx.Linear(2 * h, h, use_bias=True, dtype=dt, param_dtype=dt,
                         kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layer = DecoderLayer(target_config, rngs)
    self.head = nnx.data(None)
    # The reduced vocabulary's target ids: static (part of the graph definition, a compile-time
    # constant), so the drafter's state stays trainable params only.
    self.vocab_ids: tuple[int, ...] | None = None
    if draft_vocab_size is not None:
      k = int(draft_vocab_size)
      if not 1 <= k <= target_config.vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {target_config.vocab_size}] (the "
                         f"target's vocabulary), got {draft_vocab_size}")
      self.head = nnx.Linear(h, k, use_bias=False, dtype=dt, param_dtype=dt,
                             kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
      self.vocab_ids = tuple(range(k))

  @classmethod
  def create(cls, target_config: ModelConfig, seed: int = 0,
             draft_vocab_size: int | None = None) -> "Drafter":
    """A randomly initialised drafter sized for ``target_config`` (full or reduced vocab)."""
    return cls(target_config, rngs=nnx.Rngs(seed), draft_vocab_size=draft_vocab_size)

  @property
  def target_features(self) -> bool | tuple[int, ...]:
    """What ``Transformer.forward(return_hidden=...)`` returns for this drafter: True, the
    final-normed last hidden state (an EAGLE-3 drafter names layers)."""
    return True

  @property
  def feature_size(self) -> int:
    """Width of the target features the drafter reads (and the engine and buffer keep)."""
    return self.config.hidden_size

  @property
  def draft_vocab_size(self) -> int | None:
    """K when the drafter has a reduced vocabulary, else None (it drafts over the full one)."""
    return None if self.vocab_ids is None else len(self.vocab_ids)

  def set_draft_vocab(self, target: Transformer, token_ids) -> None:
    """Reduces the drafter's vocabulary to ``token_ids`` (distinct target ids), its head
    initialised from the target's LM head rows of those tokens."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    v = self.config.vocab_size
    if ids.size == 0 or len(np.unique(ids)) != ids.size or ids.min() < 0 or ids.max() >= v:
      raise ValueError(f"draft vocabulary must be distinct target ids in [0, {v}), got "
                       f"{ids.size} ids (distinct: {len(np.unique(ids))}, range "
                       f"{ids.min() if ids.size else None}..{ids.max() if ids.size else None})")
    rows = target_head_rows(target, jnp.asarray(ids, jnp.int32))  # [K, H]
    dt = self.config.jnp_dtype
    self.head = nnx.Linear(self.config.hidden_size, ids.size, use_bias=False, dtype=dt,
                           param_dtype=dt, rngs=nnx.Rngs(0))
    self.head.kernel.set_value(jnp.asarray(rows.T, dt))
    self.vocab_ids = tuple(int(i) for i in ids)

  def to_target_ids(self, index: jax.Array) -> jax.Array:
    """Target token ids of draft-vocabulary indices (the identity for a full-vocab drafter)."""
    if self.vocab_ids is None:
      return index.astype(jnp.int32)
    return jnp.take(jnp.asarray(self.vocab_ids, jnp.int32), index)

  def target_logits(self, target: Transformer, hidden: jax.Array) -> jax.Array:
    """The target's LM head on ``hidden`` over the drafter's vocabulary (float32): the full
    vocabulary, or only the ``vocab_ids`` columns (the training signal of a reduced head)."""
    if self.vocab_ids is None:
      return target.lm_logits(hidden)
    rows = target_head_rows(target, jnp.asarray(self.vocab_ids, jnp.int32))  # [K, H]
    return jnp.einsum("...h,kh->...k", hidden.astype(rows.dtype), rows,
                      preferred_element_type=jnp.float32)

  @classmethod
  def from_target_layer(cls, target: Transformer, layer: int = 0, seed: int = 0) -> "Drafter":
    """A drafter whose decoder layer is a copy of one of the target's layers (fc stays random)."""
    drafter = cls.create(target.config, seed)
    graphdef, _ = nnx.split(drafter.layer)
    drafter.layer = nnx.merge(graphdef, jax.tree.map(jnp.copy, nnx.state(target.layers[layer])))
    return drafter

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty one-layer cache."""
    return KVCache.create(self.config.replace(num_layers=1), batch, max_len)

  def forward(self, target: Transformer, tokens: jax.Array, features: jax.Array,
              positions: jax.Array | None = None, *, cache: KVCache | None = None,
              attn_mask: jax.Array | None = None,
              cache_mask: jax.Array | None = None) -> DrafterOutput:
    """Drafts from ``tokens [B, T]`` (x_{t+1}) and ``features [B, T, H]`` (h_t) at ``positions``.

    Cache semantics are the target's (see ``Transformer.forward``): keys are written at
    ``cache.lengths + t`` and ``lengths`` is left for the caller to advance.
    """
    positions, mask = positions_and_mask(tokens.shape, cache, positions, attn_mask, cache_mask)
    x = self.fc(jnp.concatenate([target.embed(tokens), features.astype(self.config.jnp_dtype)],
                                axis=-1))
    lengths = cache.lengths if cache is not None else None
    kv = (cache.k[0], cache.v[0]) if cache is not None else None
    x, (k, v) = self.layer(x, positions, rope_inv_freq(self.config), mask, kv, lengths)
    new_cache = KVCache((k,), (v,), cache.lengths) if cache is not None else None
    if self.head is None:
      logits = target.lm_logits(x)
    else:  # accumulated in float32, like the target's head
      logits = jnp.einsum("...h,hk->...k", x, self.head.kernel.get_value(),
                          preferred_element_type=jnp.float32)
    return DrafterOutput(logits, x, new_cache)


def target_head_rows(target: Transformer, ids: jax.Array) -> jax.Array:
  """Rows ``[K, H]`` of the target's LM head (the embedding when tied) for token ``ids``."""
  if target.config.tie_word_embeddings:
    return jnp.take(target.embed_tokens.embedding.get_value(), ids, axis=0)
  return jnp.take(target.lm_head.kernel.get_value(), ids, axis=1).T


def spread_to_vocab(probs: jax.Array, vocab_ids: jax.Array | None, vocab_size: int) -> jax.Array:
  """``[..., K]`` probabilities over a draft vocabulary's ``vocab_ids`` as ``[..., V]`` over
  target ids (zero outside the subset); ``vocab_ids=None`` (a full-vocab drafter): unchanged."""
  if vocab_ids is None:
    return probs
  full = jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype)
  return full.at[..., vocab_ids].set(probs)


def token_frequencies(sequences, vocab_size: int) -> np.ndarray:
  """Counts ``[V]`` of each token id over ``sequences`` (lists of ids)."""
  counts = np.zeros(vocab_size, np.int64)
  for seq in sequences:
    np.add.at(counts, np.asarray(seq, np.int64), 1)
  return counts


def most_frequent_ids(counts: np.ndarray, k: int, always=()) -> np.ndarray:
  """The ``k`` most frequent ids (ties by lower id), with ``always`` (e.g. stop ids) included."""
  always = [int(i) for i in always if i is not None]
  order = np.lexsort((np.arange(counts.size), -counts))
  chosen = list(dict.fromkeys(always + [int(i) for i in order]))[:k]
  return np.asarray(sorted(chosen), np.int32)


def policy_fingerprint(policy) -> str:
  """A stable sha256 of a policy's weights (a ``Transformer``, its ``nnx.State`` or pure dict).

  Hashes every norm weight and 256 evenly spaced embedding rows, rounded to bfloat16 (so an
  f32 policy and its bf16 cast agree): cheap on any size, and any trained change shows.
  """
  if isinstance(policy, nnx.Module):
    policy = nnx.state(policy, nnx.Param)
  elif not isinstance(policy, nnx.State):
    policy = nnx.State(policy)
  chosen: dict[str, Any] = {}
  for param_path, leaf in nnx.to_flat_state(policy):
    name = ".".join(map(str, param_path))
    value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    if name == "embed_tokens.embedding":
      chosen[name] = value[::max(1, -(-value.shape[0] // _FINGERPRINT_ROWS))]
    elif name.endswith("norm.weight"):
      chosen[name] = value
  if "embed_tokens.embedding" not in chosen:
    raise TypeError(f"policy_fingerprint needs a Transformer or its params, got "
                    f"{type(policy).__name__} without embed_tokens.embedding")
  digest = hashlib.sha256()
  for name in sorted(chosen):
    value = np.asarray(jax.device_get(chosen[name])).astype(ml_dtypes.bfloat16)
    digest.update(f"{name}{value.shape};".encode())
    digest.update(np.ascontiguousarray(value).tobytes())
  return "sha256:" + digest.hexdigest()


def save_drafter(drafter: Drafter, path: str | Path, policy=None,
                 policy_name: str | None = None) -> None:
  """Writes the drafter's trainable params (safetensors) and its target config (json); with
  ``policy`` (the target it was trained for) also that policy's fingerprint and ``policy_name``."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = Path(path)
  flat = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
  tensors = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}
  config = hf.config_to_hf(drafter.config)
  if drafter.vocab_ids is not None:
    tensors[VOCAB_IDS_TENSOR] = np.asarray(drafter.vocab_ids, np.int32)
    config[DRAFT_VOCAB_KEY] = drafter.draft_vocab_size
  config[KIND_KEY] = drafter.kind
  for key in EAGLE3_KEYS if drafter.kind == "eagle3" else ():
    value = getattr(drafter, key)
    config[key] = list(value) if isinstance(value, tuple) else value
  if policy is not None:
    config[POLICY_KEY] = {"fingerprint": policy_fingerprint(policy), "name": policy_name}
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / PARAMS_FILE))
  (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def _read_config(path: Path) -> dict:
  """The parsed drafter config json; a garbled one raises a one-line ValueError."""
  return read_json_object(path / CONFIG_FILE, "save the drafter again")


def drafter_policy(path: str | Path) -> dict | None:
  """The policy record ``{"fingerprint", "name"}`` saved with a drafter, or None if it has none
  (a speculators checkpoint never has one: it names its verifier instead)."""
  if not (Path(path) / CONFIG_FILE).is_file():
    return None
  record = _read_config(Path(path)).get(POLICY_KEY)
  return record if isinstance(record, dict) and record.get("fingerprint") else None


def drafter_policy_mismatch(path: str | Path, policy) -> str | None:
  """A one-line warning if the drafter at ``path`` was trained for another policy than ``policy``.

  None when the fingerprints agree, and for drafters saved without one (before fingerprints
  were recorded, or by ``save_drafter`` without ``policy``): those cannot be checked.
  """
  record = drafter_policy(path)
  if record is None:
    return None
  expected, actual = record["fingerprint"], policy_fingerprint(policy)
  if expected == actual:
    return None
  name = f" ({record['name']})" if record.get("name") else ""
  return (f"drafter {path} was trained for policy {expected[:19]}{name}, not for this one "
          f"({actual[:19]}): decoding stays exact, but expect far fewer accepted drafts; retrain "
          f"it for this policy or fine-tune it online")


def _drafter_class(raw_config: dict, path: Path) -> type:
  """The class of a saved drafter's ``drafter_kind`` (a one-line error for an unknown one)."""
  from tlt_jax.models.eagle3 import Eagle3Drafter  # pylint: disable=import-outside-toplevel
  kind = raw_config.get(KIND_KEY, Drafter.kind)
  classes = {Drafter.kind: Drafter, Eagle3Drafter.kind: Eagle3Drafter}
  if kind not in classes:
    raise ValueError(f"{path / CONFIG_FILE}: {KIND_KEY}={kind!r} is not one of "
                     f"{sorted(classes)}; save the drafter again")
  if kind == Drafter.kind and any(key in raw_config for key in EAGLE3_KEYS):
    raise ValueError(f"{path / CONFIG_FILE} has eagle3 keys {list(EAGLE3_KEYS)} but "
                     f"{KIND_KEY}={kind!r}; save the drafter again")
  return classes[kind]


def load_drafter(path: str | Path, target_config: ModelConfig | None = None) -> Drafter:
  """Reads a drafter saved by ``save_drafter``, or a ``speculators`` ``eagle3`` checkpoint (as
  vLLM serves; needs ``target_config``); checks it fits ``target_config`` if given.

  Damaged, incomplete, misshapen or non-finite files raise a one-line ``WeightsError``
  (a ValueError). Whether it was trained for this policy: :func:`drafter_policy_mismatch`.
  """
  # pylint: disable=import-outside-toplevel
  from tlt_jax.models import hf
  from tlt_jax.models import speculators_format
  path = Path(path)
  if speculators_format.is_speculators_dir(path):
    if target_config is None:
      raise ValueError(f"{path} is a speculators checkpoint: load it for a target "
                       "(load_drafter(path, target_config))")
    return speculators_format.load_speculators(path, target_config)
  for name in (PARAMS_FILE, CONFIG_FILE):
    if not (path / name).is_file():
      raise FileNotFoundError(f"No {name} in {path}: not a drafter saved by save_drafter (nor a "
                              "speculators eagle3 checkpoint)")
  raw_config = _read_config(path)
  draft_vocab_size = raw_config.get(DRAFT_VOCAB_KEY)
  try:
    config = hf.config_from_hf(raw_config)
  except KeyError as e:
    raise ValueError(f"{path / CONFIG_FILE} lacks the required key {e.args[0]!r}; save the "
                     "drafter again") from None
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path / CONFIG_FILE}: {e}") from None
  if target_config is not None:
    for field in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(config, field) != getattr(target_config, field):
        raise ValueError(f"drafter at {path} was made for {field}={getattr(config, field)}, "
                         f"but the target has {field}={getattr(target_config, field)}")
    config = target_config
  cls = _drafter_class(raw_config, path)
  drafter = nnx.eval_shape(lambda: cls(
      config, rngs=nnx.Rngs(0), draft_vocab_size=draft_vocab_size,
      **{key: raw_config[key] for key in EAGLE3_KEYS if key in raw_config}))
  file = path / PARAMS_FILE
  with hf.open_safetensors(file) as f:
    tensors = {name: hf.read_tensor(f, file, name) for name in f.keys()}
  if draft_vocab_size is not None:
    ids = tensors.get(VOCAB_IDS_TENSOR)
    if ids is None or ids.shape != (draft_vocab_size,):
      raise WeightsError(f"drafter checkpoint {path} declares {DRAFT_VOCAB_KEY}="
                         f"{draft_vocab_size} but its {VOCAB_IDS_TENSOR!r} tensor is "
                         f"{'missing' if ids is None else f'of shape {ids.shape}'}")
    if ids.min() < 0 or ids.max() >= config.vocab_size or len(np.unique(ids)) != ids.size:
      raise WeightsError(f"drafter checkpoint {path}: {VOCAB_IDS_TENSOR!r} must hold "
                         f"distinct ids in [0, {config.vocab_size})")
    drafter.vocab_ids = tuple(int(i) for i in ids)
  flat = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
  for p, var in flat:
    name = ".".join(map(str, p))
    if name not in tensors:
      raise WeightsError(f"drafter checkpoint {path} is missing tensor {name!r}: it is "
                         "incomplete; save the drafter again")
    if tensors[name].shape != var.shape:
      raise WeightsError(f"{file}: drafter tensor {name!r} has shape {tensors[name].shape}, "
                         f"expected {var.shape}; save the drafter again for this config")
    check_finite(tensors[name], file, name, what="its training")
    var.set_value(jnp.asarray(tensors[name], dtype=var.dtype))
  return drafter
