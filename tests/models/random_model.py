"""A fast random ``Transformer`` for tests: built abstractly, then filled from numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import Transformer


def random_model(config: ModelConfig, seed: int = 0, scale: float = 0.2) -> Transformer:
  """A model whose params are large enough for mapping or masking errors to show in the logits.

  Norm weights ~ 1 + N(0, 0.1), everything else ~ N(0, scale); much faster on CPU than an
  eager ``init_model``. The same seed gives the same values in any dtype.
  """
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  rng = np.random.RandomState(seed)

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    is_norm = any(getattr(key, "key", None) == "weight" for key in path)
    return jnp.asarray(1.0 + 0.1 * noise if is_norm else scale * noise, leaf.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))
