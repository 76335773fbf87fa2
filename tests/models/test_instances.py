"""Models made without a checkpoint (``tlt_jax.models.instances``): random weights of a config,
the same weights in another dtype, a private copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.instances import copy_module, random_model, with_dtype
from tlt_jax.models.model_config import ModelConfig

CONFIG = ModelConfig.tiny(vocab_size=40)


def leaves(model) -> list[np.ndarray]:
  return [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(model))]


def test_random_model_is_seeded_with_unit_norms_and_scaled_matrices():
  a, b = random_model(CONFIG, seed=3, scale=0.5), random_model(CONFIG, seed=3, scale=0.5)
  assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
  other = random_model(CONFIG, seed=4, scale=0.5)
  assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(other)))
  assert np.all(np.asarray(a.norm.weight.get_value()) == 1.0)
  embed = np.asarray(a.embed_tokens.embedding.get_value())
  assert 0.4 < embed.std() < 0.6  # N(0, 0.5^2)
  half = random_model(CONFIG.replace(dtype="bfloat16"), 0, 0.5)
  assert half.embed_tokens.embedding.get_value().dtype == jnp.bfloat16


def test_a_bfloat16_random_model_holds_every_array_in_bfloat16():
  half = random_model(CONFIG.replace(dtype="bfloat16"), seed=0, scale=0.5)
  dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(half))}
  assert dtypes == {"bfloat16"}  # norm weights too: a float32 one would promote the activations


def test_with_dtype_casts_the_same_weights():
  model = random_model(CONFIG, seed=0, scale=0.5)
  half = with_dtype(model, "bfloat16")
  assert half.config.dtype == "bfloat16" and model.config.dtype == "float32"
  for x, y in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(half))):
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.bfloat16), np.float32),
                                  np.asarray(y, np.float32))
  ids = jnp.array([[1, 2, 3]])
  assert half(ids).shape == model(ids).shape


def test_copy_module_owns_its_arrays():
  model = random_model(CONFIG, seed=0, scale=0.5)
  copy = copy_module(model)
  for x, y in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(copy))):
    assert x is not y and np.array_equal(x, y)
  # a donated (deleted) buffer of the copy leaves the original intact
  jax.tree.leaves(nnx.state(copy))[0].delete()
  assert np.isfinite(np.asarray(jax.tree.leaves(nnx.state(model))[0])).all()
