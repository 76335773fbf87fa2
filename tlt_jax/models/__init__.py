"""Models: the Qwen2/Llama-family transformer, its config, HF / GGUF checkpoints, tokenizers,
drafter.

The names most code needs are importable from here::

  from tlt_jax.models import from_pretrained, load_tokenizer, ModelConfig, Transformer

``from_pretrained`` / ``load_tokenizer`` / ``pretrained_config`` are the loader's
(``models/load.py``), which picks the format reader (``hf.py`` or ``gguf.py``) by the path.
"""

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import (drafter_policy_mismatch, load_drafter, policy_fingerprint,
                                       save_drafter)
from tlt_jax.models.hf import save_pretrained
from tlt_jax.models.load import from_pretrained, load_tokenizer, pretrained_config
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import KVCache, Transformer, init_model
from tlt_jax.models.weights import WeightsError

__all__ = ["Drafter", "KVCache", "ModelConfig", "Transformer", "WeightsError",
           "drafter_policy_mismatch", "from_pretrained", "init_model", "load_drafter",
           "load_tokenizer", "policy_fingerprint", "pretrained_config", "save_drafter",
           "save_pretrained"]
