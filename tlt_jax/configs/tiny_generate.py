"""Generation demo on an embedded tiny model (random weights unless model.path is set).

  python -m tlt_jax.generate --config=configs/tiny_generate.py --config.rollout.max_batch=8
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_prompts = 16

  c.model = ml_collections.ConfigDict()
  c.model.path = ""  # a local HF directory (config.json + *.safetensors); "" = the tiny preset
  c.model.dtype = "float32"
  # the arithmetic's and KV cache's dtype: None (the params'), a dtype, or "auto" (bf16 on an
  # accelerator)
  c.model.compute_dtype = config_dict.placeholder(str)
  c.model.tiny = ml_collections.ConfigDict(dict(
      hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2))

  # precompile=False compiles only the executables the request reaches, on first use (their
  # compile time is left out of tok/s); True compiles every bucket first (one prompt: 2 vs 45)
  c.rollout = ml_collections.ConfigDict(dict(
      max_batch=16, max_prompt_len=32, max_new_tokens=128, compaction=True, precompile=False))

  c.sampling = ml_collections.ConfigDict(dict(
      max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=0))
  return c
