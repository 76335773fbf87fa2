"""Model instances made without reading a checkpoint: random weights for a config, the same
weights in another dtype, a private copy of a model's arrays.

Checks, benchmarks and tests need models that no file holds (a SmolLM2-shaped model on a machine
without its weights, the bf16 twin of a float32 model, one copy per arm of a comparison). They
are built here, abstractly first (``nnx.eval_shape``), so no throwaway initialisation runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import Transformer


def _abstract(config: ModelConfig):
  """The graph definition and the abstract state of a ``Transformer`` of ``config``."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def random_model(config: ModelConfig, seed: int, scale: float) -> Transformer:
  """A model of ``config`` with random weights drawn on the device: norm weights 1, every other
  array N(0, scale^2) in ``config.dtype``. A large ``scale`` gives peaked next-token
  distributions, so greedy decoding of a random model does not loop on one token."""
  graphdef, abstract = _abstract(config)
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(jax.random.key(seed), len(paths_leaves))
  values = []
  for key, (path, leaf) in zip(keys, paths_leaves):
    is_norm = any(getattr(p, "key", None) == "weight" for p in path)
    values.append(jnp.ones(leaf.shape, leaf.dtype) if is_norm else
                  (scale * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype))
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, values))


def with_dtype(model: Transformer, dtype: str) -> Transformer:
  """``model``'s weights cast into a model whose params and computation are ``dtype``."""
  graphdef, abstract = _abstract(model.config.replace(dtype=dtype))
  cast = jax.tree.map(lambda a, v: jnp.asarray(v, a.dtype), abstract, nnx.state(model))
  return nnx.merge(graphdef, cast)


def with_compute_dtype(model: Transformer, compute_dtype: str | None) -> Transformer:
  """``model``'s params (the same arrays) in a model that computes in ``compute_dtype`` (None:
  the params' dtype); ``model`` itself where that is its own already."""
  config = model.config.replace(compute_dtype=compute_dtype)
  if config == model.config:
    return model
  graphdef, _ = _abstract(config)
  return nnx.merge(graphdef, nnx.state(model))


def copy_module(module: nnx.Module) -> nnx.Module:
  """``module`` with its own copy of every array. Steps that donate their buffers (the policy
  update, the drafter's train step) would otherwise invalidate the arrays of every module that
  shares them."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, jax.tree.map(jnp.array, state))
