"""EAGLE-style drafter: one trainable decoder layer on top of the target's features.

At position t the drafter reads ``fc(concat(embed(x_{t+1}), h_t))``, where ``h_t`` is the
target's last hidden state (after its final norm) and ``embed`` the target's own embedding; one
decoder layer turns that into a prediction of ``h_{t+1}``, and the target's LM head turns the
prediction into next-token logits. Embedding and LM head stay the target's (frozen, shared), so
the drafter's trainable params are only ``fc`` and ``layer``. It keeps a one-layer KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import (DecoderLayer, KVCache, Transformer, positions_and_mask,
                                        rope_inv_freq)

PARAMS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"


class DrafterOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] float32, through the target's LM head
  hidden: jax.Array  # [B, T, H] predicted next target feature
  cache: KVCache | None  # the drafter's one-layer cache with the new keys written


class Drafter(nnx.Module):
  """One decoder layer fed with ``fc(concat(embed(token), target_feature))``."""

  def __init__(self, target_config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = target_config
    h, dt = target_config.hidden_size, target_config.jnp_dtype
    self.fc = nnx.Linear(2 * h, h, use_bias=True, dtype=dt, param_dtype=dt,
                         kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layer = DecoderLayer(target_config, rngs)

  @classmethod
  def create(cls, target_config: ModelConfig, seed: int = 0) -> "Drafter":
    """A randomly initialised drafter sized for ``target_config``."""
    return cls(target_config, rngs=nnx.Rngs(seed))

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
    return DrafterOutput(target.lm_logits(x), x, new_cache)


def save_drafter(drafter: Drafter, path: str | Path) -> None:
  """Writes the drafter's trainable params (safetensors) and its target config (json)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  flat = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
  tensors = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}
  save_file(tensors, str(path / PARAMS_FILE))
  (path / CONFIG_FILE).write_text(json.dumps(hf.config_to_hf(drafter.config), indent=2))


def load_drafter(path: str | Path, target_config: ModelConfig | None = None) -> Drafter:
  """Reads a drafter saved by ``save_drafter``; checks it fits ``target_config`` if given."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = Path(path)
  for name in (PARAMS_FILE, CONFIG_FILE):
    if not (path / name).is_file():
      raise FileNotFoundError(f"No {name} in {path}: not a drafter saved by save_drafter")
  config = hf.config_from_hf(json.loads((path / CONFIG_FILE).read_text()))
  if target_config is not None:
    for field in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(config, field) != getattr(target_config, field):
        raise ValueError(f"drafter at {path} was made for {field}={getattr(config, field)}, "
                         f"but the target has {field}={getattr(target_config, field)}")
    config = target_config
  drafter = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
  tensors = load_file(str(path / PARAMS_FILE))
  flat = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
  for p, var in flat:
    name = ".".join(map(str, p))
    if name not in tensors:
      raise ValueError(f"drafter checkpoint {path} is missing tensor {name!r}")
    if tensors[name].shape != var.shape:
      raise ValueError(f"drafter tensor {name!r} has shape {tensors[name].shape}, "
                       f"expected {var.shape}")
    var.set_value(jnp.asarray(tensors[name], dtype=var.dtype))
  return drafter
