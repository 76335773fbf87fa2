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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import (DecoderLayer, KVCache, Transformer, linear,
                                        positions_and_mask, rope_inv_freq)


class DrafterOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] float32 via the target's LM head, or [B, T, K] over vocab_ids
  hidden: jax.Array  # [B, T, H] predicted next target feature
  cache: KVCache | None  # the drafter's one-layer cache with the new keys written


class Drafter(nnx.Module):
  """One decoder layer fed with ``fc(concat(embed(token), target_feature))``."""

  # What the rest of the code asks of a learned drafter architecture (``learned_kinds``):
  kind = "eagle"  # the config's name of this architecture (``drafter=eagle``)
  # the training objective, by name (``drafter.objective.OBJECTIVES``): "eagle", EAGLE-1's
  # feature and next-token loss; "ttt", EAGLE-3's chained steps
  objective = "eagle"
  # the constructor's keyword fields ``save_drafter`` writes beside the target config, and
  # ``load_drafter`` passes back
  saved_fields: tuple[str, ...] = ()
  # whether the architecture exports as a ``speculators`` checkpoint (vLLM's drafter format)
  speculators_export = False

  def __init__(self, target_config: ModelConfig, *, rngs: nnx.Rngs,
               draft_vocab_size: int | None = None):
    self.config = target_config
    h = target_config.hidden_size
    self.fc = linear(2 * h, h, True, target_config, rngs)
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
      self.head = linear(h, k, False, target_config, rngs)
      self.vocab_ids = tuple(range(k))

  @classmethod
  def create(cls, target_config: ModelConfig, seed: int = 0,
             draft_vocab_size: int | None = None) -> "Drafter":
    """A randomly initialised drafter sized for ``target_config`` (full or reduced vocab)."""
    return cls(target_config, rngs=nnx.Rngs(seed), draft_vocab_size=draft_vocab_size)

  @classmethod
  def fresh(cls, target_config: ModelConfig, seed: int = 0, policy=None) -> "Drafter":
    """A drafter of this architecture to train online from scratch for the policy ``policy``
    (a ``Transformer`` of ``target_config``, or None where it is not built yet); an EAGLE-1
    drafter reads the policy's embedding and head at run time and takes nothing from it."""
    del policy
    return cls.create(target_config, seed=seed)

  @classmethod
  def starts_from_policy(cls) -> bool:
    """Whether ``fresh`` copies part of the policy (so the job builds it after the warm start)."""
    return False

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
    self.head = linear(self.config.hidden_size, ids.size, False, self.config, nnx.Rngs(0))
    self.head.kernel.set_value(jnp.asarray(rows.T, self.config.jnp_dtype))
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
    dt = self.config.jnp_compute_dtype
    return jnp.einsum("...h,kh->...k", hidden.astype(dt), rows.astype(dt),
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
    x = self.fc(jnp.concatenate([target.embed(tokens), features.astype(self.config.jnp_compute_dtype)],
                                axis=-1))
    lengths = cache.lengths if cache is not None else None
    kv = (cache.k[0], cache.v[0]) if cache is not None else None
    x, (k, v) = self.layer(x, positions, rope_inv_freq(self.config), mask, kv, lengths)
    new_cache = KVCache((k,), (v,), cache.lengths) if cache is not None else None
    if self.head is None:
      logits = target.lm_logits(x)
    else:  # accumulated in float32, like the target's head
      logits = jnp.einsum("...h,hk->...k", x,
                          self.head.kernel.get_value().astype(self.config.jnp_compute_dtype),
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
