"""Test helpers shared across test modules."""

import jax
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import Transformer, init_model


def sharp_random_model(config: ModelConfig, seed: int = 0, scale: float = 8.0) -> Transformer:
  """A random model whose matrices are scaled up, so its next-token distributions are peaked
  and greedy trajectories vary (a plain 0.02-std init is nearly uniform and loops on one token)."""
  graphdef, state = nnx.split(init_model(config, seed))
  state = jax.tree.map(lambda x: x * scale if x.ndim == 2 else x, state)
  return nnx.merge(graphdef, state)
