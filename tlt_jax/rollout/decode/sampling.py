"""Sampling parameters and the jitted token sampler.

Every row draws from its own PRNG stream ``fold_in(fold_in(key(seed), row), position)``, where
``row`` is the prompt's index in the request and ``position`` the index of the generated token,
so a row's sample never depends on its batch, bucket or neighbours.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample a completion. ``temperature == 0`` is greedy; ``top_k <= 0`` and ``top_p >= 1`` disable filtering."""

  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_token_ids: Sequence[int] | None = None  # None: the model's EOS ids; () : never stop early

  def __post_init__(self):
    for name in ("max_new_tokens", "top_k", "seed"):
      if isinstance(getattr(self, name), bool):
        raise ValueError(f"SamplingParams.{name} must be an int, got {getattr(self, name)!r}")
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
      raise ValueError(f"SamplingParams.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.top_k, int):
      raise ValueError(f"SamplingParams.top_k must be an int (<= 0 disables it), got {self.top_k!r}")
    if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
      raise ValueError(f"SamplingParams.seed must be an int in [0, 2**32), got {self.seed!r}")
    if self.stop_token_ids is not None:
      object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerArgs:
  """The traced (non-static) form of ``SamplingParams``: changing them never recompiles."""

  temperature: jax.Array  # f32 scalar
  top_p: jax.Array  # f32 scalar
  top_k: jax.Array  # i32 scalar
  seed: jax.Array  # u32 scalar
  max_new_tokens: jax.Array  # i32 scalar
  stop_ids: jax.Array  # i32 [max_stop_ids], padded with -1

  @classmethod
  def from_params(cls, params: SamplingParams, stop_ids: Sequence[int],
                  max_stop_ids: int) -> "SamplerArgs":
    """Packs ``params`` into host scalars; ``stop_ids`` are padded with -1 to ``max_stop_ids``."""
    if len(stop_ids) > max_stop_ids:
      raise ValueError(
          f"SamplingParams.stop_token_ids has {len(stop_ids)} ids but the engine allows "
          f"{max_stop_ids}; raise EngineConfig.max_stop_ids")
    stop = np.full((max_stop_ids,), -1, np.int32)
    stop[:len(stop_ids)] = stop_ids
    return cls(temperature=np.float32(params.temperature), top_p=np.float32(params.top_p),
               top_k=np.int32(params.top_k), seed=np.uint32(params.seed),
               max_new_tokens=np.int32(params.max_new_tokens), stop_ids=stop)


def filtered_logprobs(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """Log-probs ``[..., V]`` of the distribution actually sampled: tempered, top-k then top-p filtered.

  At temperature 0 this is the untempered model distribution (the greedy token is its argmax).
  Ties at the top-k / top-p boundary are all kept.
  """
  logits = logits.astype(jnp.float32)
  temp = jnp.where(temperature > 0, temperature, 1.0)
  scaled = logits / temp
  vocab = logits.shape[-1]
  need_filter = (top_k > 0) & (top_k < vocab) | (top_p < 1.0)

  def apply_filters(x):
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.clip(jnp.where(top_k > 0, top_k, vocab), 1, vocab)
    kth = jnp.take(desc, k - 1, axis=-1)[..., None]
    desc = jnp.where(desc >= kth, desc, NEG_INF)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (mass_before < top_p) & (desc > NEG_INF)
    threshold = jnp.min(jnp.where(kept, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x >= threshold, x, NEG_INF)

  scaled = jax.lax.cond(need_filter, apply_filters, lambda x: x, scaled)
  return jax.nn.log_softmax(scaled, axis=-1)


def row_keys(seed: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
  """One PRNG key per row: ``fold_in(fold_in(key(seed), row), position)``."""
  base = jax.random.key(seed)
  return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(rows, positions)


def gumbel_noise(keys: jax.Array, vocab: int) -> jax.Array:
  """Standard Gumbel noise ``[B, V]``, one row per key: the noise of a Gumbel-max sample."""
  return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def gumbel_argmax(logp: jax.Array, keys: jax.Array) -> jax.Array:
  """``argmax(logp + Gumbel noise of keys)`` per row: an exact sample of ``softmax(logp [B, V])``.

  Vanilla sampling and drafter-invariant ("coupled") speculative decoding both draw every token
  this way, from the same per-row, per-position keys, which is what makes them emit the same
  tokens.
  """
  return jnp.argmax(logp + gumbel_noise(keys, logp.shape[-1]), axis=-1).astype(jnp.int32)


def sample_tokens(logits: jax.Array, keys: jax.Array, args: SamplerArgs):
  """Samples one token per row from ``logits [B, V]``; returns (tokens [B], logprobs [B])."""
  logp = filtered_logprobs(logits, args.temperature, args.top_k, args.top_p)
  # greedy skips the random draw (a Gumbel sample over the vocabulary per row), so a greedy
  # step costs no PRNG work
  tokens = jax.lax.cond(args.temperature > 0, lambda: gumbel_argmax(logp, keys),
                        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
