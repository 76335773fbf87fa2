"""experiments/system/memory_by_precision.py: the memory of params, AdamW moments and KV cache
under each compute dtype, counted from shapes (the package's mixed precision itself is
tests/models/test_mixed_precision.py's)."""

import jax

from experiments.system.memory_by_precision import footprint
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import init_model


def test_memory_by_precision_counts_params_moments_and_cache_from_shapes():
  """A tiny shape: float32 params and moments under either compute dtype, a bf16 KV cache half
  the float32 one."""
  config = ModelConfig.tiny(vocab_size=32)  # 2 layers, hidden 32, 2 KV heads of 8
  fp32 = footprint(config, rows=4, cache_len=16)
  mixed = footprint(config.replace(compute_dtype="bfloat16"), rows=4, cache_len=16)
  params = sum(x.size for x in jax.tree.leaves(init_model(config, seed=0))) * 4
  assert fp32["params"] == mixed["params"] == params and fp32["adamw_moments"] == 2 * params
  assert fp32["kv_cache"] == 2 * 2 * 4 * 16 * 2 * 8 * 4 == 2 * mixed["kv_cache"]
