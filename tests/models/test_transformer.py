"""Transformer forward semantics (KV-cache decode, bf16, tree-verify masks); ModelConfig checks."""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.random_model import random_model
from tlt_jax.models.model_config import ModelConfig, RopeScaling
from tlt_jax.models.transformer import KVCache, Transformer, rope_inv_freq

CONFIG = ModelConfig.tiny()
# A small tree of draft tokens: node i hangs under TREE_PARENTS[i] (-1: the root).
TREE_PARENTS = (-1, 0, 0, 1, 3, 2)


@nnx.jit
def full_logits(model: Transformer, ids):
  """Causal logits without a cache."""
  return model(ids)


@nnx.jit
def masked_logits(model: Transformer, ids, positions, attn_mask):
  """Logits without a cache, at explicit positions under an explicit new-token mask."""
  return model.forward(ids, positions, attn_mask=attn_mask).logits


@nnx.jit
def cached_forward(model: Transformer, ids, cache: KVCache, positions=None, attn_mask=None):
  """Logits and the cache with the new tokens written (lengths unchanged)."""
  out = model.forward(ids, positions, cache=cache, attn_mask=attn_mask)
  return out.logits, out.cache


def test_incremental_decode_matches_full_forward():
  model = random_model(CONFIG, seed=0)
  rng = np.random.RandomState(0)
  sequences = [rng.randint(3, CONFIG.vocab_size, 10), rng.randint(3, CONFIG.vocab_size, 8)]
  prompt_lengths = np.array([4, 2], np.int32)
  prompt = np.zeros((2, 4), np.int32)  # row 1 is padded after its 2 prompt tokens
  for row, (sequence, length) in enumerate(zip(sequences, prompt_lengths)):
    prompt[row, :length] = sequence[:length]
  cache = KVCache.create(CONFIG, batch=2, max_len=16)
  logits, cache = cached_forward(model, jnp.asarray(prompt), cache)
  cache = cache.advance(jnp.asarray(prompt_lengths))
  steps = [logits]
  for step in range(6):
    next_ids = np.array([[seq[length + step]] for seq, length in zip(sequences, prompt_lengths)],
                        np.int32)
    logits, cache = cached_forward(model, jnp.asarray(next_ids), cache)
    cache = cache.advance(1)
    steps.append(logits)
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_lengths + 6)
  padded = np.stack([np.pad(s, (0, 10 - len(s))) for s in sequences])  # causal: padding is unseen
  references = np.asarray(full_logits(model, jnp.asarray(padded)))
  for row, (sequence, length) in enumerate(zip(sequences, prompt_lengths)):
    reference = references[row]
    incremental = np.concatenate(
        [np.asarray(steps[0])[row, :length]] + [np.asarray(s)[row] for s in steps[1:]])
    assert np.abs(reference).max() > 0.5
    np.testing.assert_allclose(incremental, reference[:length + 6], atol=2e-5, rtol=1e-5)


def test_bf16_model_is_close_to_fp32():
  model = random_model(CONFIG, seed=1)
  bf16_config = CONFIG.replace(dtype="bfloat16")
  bf16_model = random_model(bf16_config, seed=1)  # the same draws, stored in bf16
  assert bf16_model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
  ids = jnp.asarray(np.random.RandomState(1).randint(0, CONFIG.vocab_size, (2, 12)))
  reference = np.asarray(full_logits(model, ids))
  logits = full_logits(bf16_model, ids)
  assert logits.dtype == jnp.float32
  error = np.abs(np.asarray(logits) - reference).max()
  assert 0 < error < 0.05 * np.abs(reference).max()
  cache = KVCache.create(bf16_config, batch=2, max_len=16)
  assert cache.k[0].dtype == jnp.bfloat16
  cached, _ = cached_forward(bf16_model, ids, cache)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(logits), atol=0.05)


def tree_structure(parents: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
  """Depths ``[N]``, the ancestor-or-self mask ``[N, N]`` and each node's root-to-node path."""
  paths = []
  for node, parent in enumerate(parents):
    paths.append((paths[parent] if parent >= 0 else []) + [node])
  depths = np.array([len(path) - 1 for path in paths], np.int32)
  mask = np.zeros((len(parents), len(parents)), bool)
  for node, path in enumerate(paths):
    mask[node, path] = True
  return depths, mask, paths


def path_logits(model: Transformer, prefixes: list[np.ndarray], tree_tokens: np.ndarray,
                paths: list[list[int]]) -> np.ndarray:
  """``[B, N, V]``: the last logit of ``prefix_b + tokens along path(node)``, all in one batch.

  Each sequence is right-padded; causality keeps the padding out of the logit we read.
  """
  rows, last_index = [], []
  width = max(len(p) for p in prefixes) + max(len(p) for p in paths)
  for prefix, tokens in zip(prefixes, tree_tokens):
    for path in paths:
      sequence = np.concatenate([prefix, tokens[path]])
      last_index.append(len(sequence) - 1)
      rows.append(np.pad(sequence, (0, width - len(sequence))))
  logits = np.asarray(full_logits(model, jnp.asarray(np.stack(rows))))
  picked = logits[np.arange(len(rows)), last_index]
  return picked.reshape(len(prefixes), len(paths), -1)


def test_tree_mask_forward_equals_path_forwards_without_cache():
  model = random_model(CONFIG, seed=2)
  depths, mask, paths = tree_structure(TREE_PARENTS)
  tokens = np.random.RandomState(2).randint(0, CONFIG.vocab_size, (1, len(TREE_PARENTS)))
  logits = masked_logits(model, jnp.asarray(tokens), jnp.asarray(depths[None]),
                         jnp.asarray(mask[None]))
  reference = path_logits(model, [np.zeros((0,), np.int64)], tokens, paths)
  np.testing.assert_allclose(np.asarray(logits), reference, atol=2e-5, rtol=1e-5)


def test_tree_mask_forward_equals_path_forwards_with_cache():
  model = random_model(CONFIG, seed=3)
  depths, mask, paths = tree_structure(TREE_PARENTS)
  rng = np.random.RandomState(3)
  prefixes = [rng.randint(0, CONFIG.vocab_size, 5), rng.randint(0, CONFIG.vocab_size, 3)]
  lengths = np.array([len(p) for p in prefixes], np.int32)
  padded = np.stack([np.pad(p, (0, 5 - len(p)), constant_values=7) for p in prefixes])
  cache = KVCache.create(CONFIG, batch=2, max_len=16)
  _, cache = cached_forward(model, jnp.asarray(padded), cache)
  cache = cache.advance(jnp.asarray(lengths))
  tokens = rng.randint(0, CONFIG.vocab_size, (2, len(TREE_PARENTS)))
  positions = lengths[:, None] + depths[None]
  logits, _ = cached_forward(model, jnp.asarray(tokens), cache, jnp.asarray(positions),
                             jnp.asarray(np.broadcast_to(mask, (2,) + mask.shape)))
  reference = path_logits(model, prefixes, tokens, paths)
  np.testing.assert_allclose(np.asarray(logits), reference, atol=2e-5, rtol=1e-5)


def test_attention_bias_reaches_the_output_projection_only_in_llama():
  """HF Llama's attention_bias also biases o_proj; Qwen2's never does (only q/k/v)."""
  for architecture, o_bias in (("qwen2", False), ("llama", True)):
    model = nnx.eval_shape(lambda a=architecture: Transformer(
        CONFIG.replace(architecture=a, attention_bias=True), rngs=nnx.Rngs(0)))
    attn = model.layers[0].self_attn
    assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert (attn.o_proj.bias is not None) == o_bias, architecture


# --- ModelConfig validation ----------------------------------------------------------------

POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "max_position_embeddings")


@pytest.mark.parametrize("field", POSITIVE_FIELDS)
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "8"])
def test_config_size_fields_must_be_positive_ints(field, value):
  with pytest.raises(ValueError, match=rf"ModelConfig\.{field} must be a positive int, "
                                       rf"got {re.escape(repr(value))}"):
    ModelConfig.tiny(**{field: value})


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=4, num_kv_heads=3),
     r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(hidden_size=30), r"hidden_size \(30\) is not divisible by num_heads \(4\)"),
    (dict(hidden_size=36, num_heads=4, head_dim=None), r"head_dim must be even for RoPE, got 9"),
    (dict(head_dim=7), r"head_dim must be even for RoPE, got 7"),
    (dict(dtype="float64"),
     r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'float64'"),
    (dict(architecture="mistral"),
     r"architecture must be one of \['llama', 'qwen2', 'qwen3'\], got 'mistral'"),
    (dict(rope_scaling=RopeScaling(rope_type="yarn")), r"rope_type 'yarn' is not supported"),
])
def test_config_rejects_inconsistent_settings(overrides, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig.tiny(**overrides)


def test_config_derives_and_normalises_fields():
  assert ModelConfig.tiny().head_dim == 8  # hidden_size // num_heads
  assert ModelConfig.tiny(hidden_size=30, head_dim=10).head_dim == 10  # explicit: no divisibility
  config = ModelConfig.tiny(eos_token_id=[2, 5])
  assert config.eos_token_id == (2, 5) and config.eos_token_ids == (2, 5)
  hash(config)  # a jit static
  assert ModelConfig.tiny(eos_token_id=3).eos_token_ids == (3,)
  assert ModelConfig.tiny().eos_token_ids == ()
  assert ModelConfig.tiny(dtype="bfloat16").jnp_dtype == jnp.bfloat16
  assert ModelConfig.tiny(dtype="float16").jnp_dtype == jnp.float16
  ModelConfig.tiny(rope_scaling=RopeScaling(rope_type="linear", factor=2.0))
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig.tiny().replace(num_kv_heads=3)  # replace re-validates


def llama31_scaled_frequencies(dim: int, theta: float, factor: float, low_freq_factor: float,
                               high_freq_factor: float, old_context_len: int) -> np.ndarray:
  """Meta's published ``apply_scaling`` of Llama 3.1, one frequency at a time, in float64."""
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  out = []
  for i in range(0, dim, 2):
    freq = 1.0 / theta ** (i / dim)
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      out.append(freq)
    elif wavelen > low_freq_wavelen:
      out.append(freq / factor)
    else:
      smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def test_llama3_rope_scaling_gives_the_published_llama31_frequencies():
  """Llama 3.1's head_dim 128, theta 5e5, factor 8 over 8192 positions: the high frequencies are
  kept, the low ones divided by 8, and the band between blended as Meta's formula does."""
  config = ModelConfig.tiny(head_dim=128, rope_theta=500000.0, rope_scaling=RopeScaling(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=8192))
  ours = np.asarray(rope_inv_freq(config), np.float64)
  expected = llama31_scaled_frequencies(128, 500000.0, 8.0, 1.0, 4.0, 8192)
  unscaled = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
  kept, divided = expected == unscaled, expected == unscaled / 8
  blended = ~kept & ~divided
  assert kept.sum() and divided.sum() and blended.sum()  # every regime occurs
  assert ours.shape == (64,) and ours[0] == 1.0
  np.testing.assert_allclose(ours, expected, rtol=1e-5)
