"""Models: the Qwen2/Llama-family transformer, its config, HF / GGUF checkpoints, tokenizers, drafter.

The names most code needs are importable from here::

  from tlt_jax.models import from_pretrained, load_tokenizer, ModelConfig, Transformer
"""

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import (Drafter, drafter_policy_mismatch, load_drafter,
                                    policy_fingerprint, save_drafter)
from tlt_jax.models.hf import WeightsError, from_pretrained, save_pretrained
from tlt_jax.models.tokenizer import load_tokenizer
from tlt_jax.models.transformer import KVCache, Transformer, init_model

__all__ = ["Drafter", "KVCache", "ModelConfig", "Transformer", "WeightsError",
           "drafter_policy_mismatch", "from_pretrained", "init_model", "load_drafter",
           "load_tokenizer", "policy_fingerprint", "save_drafter", "save_pretrained"]
