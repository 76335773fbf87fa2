"""Decoder-only transformer (Qwen2 / Qwen3 / Llama families) in Flax NNX.

One forward serves prefill, single-token decode and multi-token (chain or tree) verify:
new tokens are written into a KV cache at per-row offsets ``cache.lengths[b] + t`` and
attend to the row's cached prefix plus the new tokens allowed by ``attn_mask``.
The cache is a plain pytree; the forward never advances ``lengths`` itself, the caller
commits as many positions as it accepts (``KVCache.advance``), which is what
speculative decoding needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from tlt_jax.models.model_config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per-layer keys/values ``[B, S, Hkv, D]`` and the per-row count of committed slots ``[B]``."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @classmethod
  def create(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    """An empty cache of ``max_len`` slots for ``batch`` rows."""
    dtype = dtype or config.jnp_compute_dtype
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(zeros(), zeros(), jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  def advance(self, n: jax.Array) -> "KVCache":
    """Commits ``n`` (scalar or ``[B]``) more slots per row."""
    return KVCache(self.k, self.v, self.lengths + n)

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """The same buffers with other committed lengths."""
    return KVCache(self.k, self.v, lengths)


class ModelOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] float32
  # [B, T, H] last layer, after the final norm (what the LM head sees); with feature layers
  # (``forward(return_hidden=(i, j, ...))``) [B, T, (n + 1) H]: see ``Transformer.forward``
  hidden: jax.Array | None
  cache: KVCache | None  # keys/values of the new tokens written; lengths unchanged


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """Inverse RoPE frequencies ``[head_dim/2]``, with Llama-3 or linear scaling if configured."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  if scaling.rope_type == "linear":
    return inv_freq / scaling.factor
  # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
  old_len = scaling.original_max_position_embeddings
  low_wavelen = old_len / scaling.low_freq_factor
  high_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(in_band, blended, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates ``x [B, T, H, D]`` by ``positions [B, T]`` (HF's half-split convention)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32, as in HF Llama/Qwen2."""

  def __init__(self, dim: int, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


def linear(din: int, dout: int, bias: bool, config: ModelConfig, rngs: nnx.Rngs,
           kernel_init=nnx.initializers.normal(0.02)) -> nnx.Linear:
  """A dense layer whose params are in ``config.dtype`` and whose matmul runs in
  ``config.compute_dtype``."""
  return nnx.Linear(din, dout, use_bias=bias, dtype=config.jnp_compute_dtype,
                    param_dtype=config.jnp_dtype, kernel_init=kernel_init, rngs=rngs)


class Attention(nnx.Module):
  """Grouped-query self-attention over a per-row KV cache."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
    self.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, c.attention_bias, c, rngs)
    self.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, c, rngs)
    self.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, c, rngs)
    self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, c.o_proj_bias, c, rngs)
    if c.qk_norm:  # Qwen3: each head's query and key RMS-normed over head_dim, before RoPE
      self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.jnp_dtype)
      self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.jnp_dtype)
    self.qk_norm = c.qk_norm

  def __call__(self, x, positions, inv_freq, mask, cache_kv, cache_lengths):
    """``mask [B, T, S]`` says which keys each query sees; returns (out, (k, v) to attend)."""
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    if cache_kv is not None:
      write = jax.vmap(lambda buf, new, at: lax.dynamic_update_slice(buf, new, (at, 0, 0)))
      k = write(cache_kv[0], k.astype(cache_kv[0].dtype), cache_lengths)
      v = write(cache_kv[1], v.astype(cache_kv[1].dtype), cache_lengths)
    groups = self.num_heads // self.num_kv_heads
    qg = q.reshape(b, t, self.num_kv_heads, groups, self.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(self.head_dim)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, -1)
    return self.o_proj(out), (k, v)


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    self.gate_proj = linear(c.hidden_size, c.intermediate_size, False, c, rngs)
    self.up_proj = linear(c.hidden_size, c.intermediate_size, False, c, rngs)
    self.down_proj = linear(c.intermediate_size, c.hidden_size, False, c, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm attention + MLP block."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
    self.self_attn = Attention(config, rngs)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
    self.mlp = MLP(config, rngs)

  def __call__(self, x, positions, inv_freq, mask, cache_kv, cache_lengths):
    attn, kv = self.self_attn(self.input_layernorm(x), positions, inv_freq, mask, cache_kv,
                              cache_lengths)
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, kv


def attention_mask(t: int, cache_lengths: jax.Array | None, max_len: int | None,
                   new_mask: jax.Array | None) -> jax.Array:
  """Builds the ``[B, T, S]`` visibility mask: the committed prefix plus ``new_mask`` among new tokens.

  ``new_mask [B, T, T]`` (default causal) says which new tokens each new token sees; without a
  cache, S = T and the mask is ``new_mask`` itself.
  """
  if new_mask is None:
    new_mask = jnp.tril(jnp.ones((t, t), bool))[None]
  if cache_lengths is None:
    return new_mask
  b = cache_lengths.shape[0]
  new_mask = jnp.broadcast_to(new_mask, (b, t, t))
  slot = jnp.arange(max_len)[None, :]  # [1, S]
  rel = slot - cache_lengths[:, None]  # [B, S] index among the new tokens
  in_new = (rel >= 0) & (rel < t)
  seen_new = jnp.take_along_axis(new_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :],
                                                            (b, t, max_len)), axis=2)
  return (rel < 0)[:, None, :] | (in_new[:, None, :] & seen_new)


def positions_and_mask(shape: tuple[int, int], cache: KVCache | None, positions, attn_mask,
                       cache_mask) -> tuple[jax.Array, jax.Array]:
  """Default positions (``cache.lengths + t``, or ``t``) and the ``[B, T, S]`` attention mask."""
  b, t = shape
  if positions is None:
    base = cache.lengths[:, None] if cache is not None else jnp.zeros((b, 1), jnp.int32)
    positions = base + jnp.arange(t, dtype=jnp.int32)[None]
  if cache_mask is not None:
    mask = cache_mask
  else:
    mask = attention_mask(t, cache.lengths if cache is not None else None,
                          cache.max_len if cache is not None else None, attn_mask)
  return positions, jnp.broadcast_to(mask, (b,) + mask.shape[1:])


class Transformer(nnx.Module):
  """Qwen2/Qwen3/Llama-family causal LM: ``model(ids)`` gives logits, ``model.forward`` the rest."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    dt = config.jnp_dtype
    self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size,
                                  dtype=config.jnp_compute_dtype, param_dtype=dt,
                                  embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_layers)])
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
    if not config.tie_word_embeddings:
      self.lm_head = linear(config.hidden_size, config.vocab_size, False, config, rngs)

  def __call__(self, input_ids: jax.Array) -> jax.Array:
    """Causal logits ``[B, T, V]`` (float32) for ``input_ids [B, T]`` without a cache."""
    return self.forward(input_ids).logits

  def embed(self, input_ids: jax.Array) -> jax.Array:
    """Token embeddings ``[..., H]``."""
    return self.embed_tokens(input_ids)

  def lm_logits(self, hidden: jax.Array) -> jax.Array:
    """The LM head on final-normed hidden states, accumulated and returned in float32 (a bf16
    model would otherwise round its logits to bf16, whose ties can flip a greedy argmax)."""
    dt = self.config.jnp_compute_dtype
    hidden = hidden.astype(dt)
    if self.config.tie_word_embeddings:
      return jnp.einsum("...h,vh->...v", hidden, self.embed_tokens.embedding.get_value().astype(dt),
                        preferred_element_type=jnp.float32)
    return jnp.einsum("...h,hv->...v", hidden, self.lm_head.kernel.get_value().astype(dt),
                      preferred_element_type=jnp.float32)

  def forward(self, input_ids: jax.Array, positions: jax.Array | None = None, *,
              cache: KVCache | None = None, attn_mask: jax.Array | None = None,
              cache_mask: jax.Array | None = None,
              return_hidden: bool | tuple[int, ...] = False) -> ModelOutput:
    """Runs ``input_ids [B, T]`` at ``positions [B, T]``, writing their KV at ``cache.lengths + t``.

    ``positions`` default to ``cache.lengths[:, None] + arange(T)`` (or ``arange(T)``);
    ``attn_mask [B, T, T]`` restricts which new tokens see each other (tree verify);
    ``cache_mask [B, T, S]`` instead gives the full visibility over every cache slot (tree drafting,
    where earlier draft levels sit in uncommitted slots).

    ``return_hidden``: True returns the final-normed last hidden state ``[B, T, H]``; a tuple of
    feature layer ids ``(i, j, ...)`` (each in ``[0, num_layers]``) returns ``[B, T, (n + 1) H]``:
    the residual stream entering each listed layer (``num_layers``: after the last layer, before
    the final norm; what vLLM's EAGLE-3 auxiliary hidden states are), then the final-normed last
    hidden state (an EAGLE-3 drafter reads the first ``n H``, its training targets the last H).
    """
    positions, mask = positions_and_mask(input_ids.shape, cache, positions, attn_mask, cache_mask)
    lengths = cache.lengths if cache is not None else None
    inv_freq = rope_inv_freq(self.config)
    x = self.embed(input_ids)
    wanted = return_hidden if isinstance(return_hidden, tuple) else ()
    taps: dict[int, jax.Array] = {}
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      if i in wanted:
        taps[i] = x
      kv = (cache.k[i], cache.v[i]) if cache is not None else None
      x, (k, v) = layer(x, positions, inv_freq, mask, kv, lengths)
      new_k.append(k)
      new_v.append(v)
    taps[len(self.layers)] = x
    hidden = self.norm(x)
    logits = self.lm_logits(hidden)
    new_cache = KVCache(tuple(new_k), tuple(new_v), cache.lengths) if cache is not None else None
    if wanted:
      hidden = jnp.concatenate([taps[i] for i in wanted] + [hidden], axis=-1)
    return ModelOutput(logits, hidden if return_hidden else None, new_cache)


def init_model(config: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised model (normal(0.02) weights, unit norms)."""
  return Transformer(config, rngs=nnx.Rngs(seed))

