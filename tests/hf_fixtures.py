"""Tiny random Hugging Face checkpoints (Qwen2 / Qwen3 / Llama) written with transformers + torch.

Every parameter, norms and biases included, is drawn at random so that a wrong mapping or a
missing transpose shows up in the logits. Import only from tests that have already done
``pytest.importorskip("torch")`` and ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB_SIZE = 128
HIDDEN_SIZE = 64


def randomize_parameters(model: torch.nn.Module, seed: int, scale: float = 0.08) -> None:
  """Redraws every parameter: norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1), the rest ~ N(0, scale)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
      if "norm" in name:
        param.copy_(1.0 + 0.1 * noise)
      elif name.endswith(".bias"):
        param.copy_(0.1 * noise)
      else:
        param.copy_(scale * noise)


def _save(model: torch.nn.Module, path: str | Path, seed: int,
          max_shard_size: str | None) -> torch.nn.Module:
  randomize_parameters(model, seed)
  model.eval()
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(str(path), **kwargs)
  return model


def make_qwen2_checkpoint(path: str | Path, seed: int = 0,
                          max_shard_size: str | None = None, num_layers: int = 2
                          ) -> torch.nn.Module:
  """A 2-layer (or ``num_layers``) fp32 Qwen2 (4 heads / 2 KV heads, tied embeddings, qkv bias) saved to ``path``."""
  torch.manual_seed(seed)
  config = transformers.Qwen2Config(
      vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=num_layers,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1,
      eos_token_id=2, dtype="float32")
  return _save(transformers.Qwen2ForCausalLM(config), path, seed, max_shard_size)


def make_llama_checkpoint(path: str | Path, seed: int = 0, rope_scaling: dict | None = None,
                          max_shard_size: str | None = None, num_layers: int = 2
                          ) -> torch.nn.Module:
  """A 2-layer (or ``num_layers``) fp32 Llama (4 heads / 2 KV heads of dim 32, untied, no bias) saved to ``path``.

  ``rope_scaling`` is an HF dict such as ``{"rope_type": "llama3", "factor": 8.0, ...}``.
  """
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(
      vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=num_layers,
      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
      rope_theta=500000.0 if rope_scaling else 10000.0, rope_scaling=rope_scaling,
      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, bos_token_id=1,
      eos_token_id=[2, 3], dtype="float32")
  return _save(transformers.LlamaForCausalLM(config), path, seed, max_shard_size)


def make_qwen3_checkpoint(path: str | Path, seed: int = 0, num_layers: int = 2,
                          num_kv_heads: int = 2, head_dim: int = 16, tie: bool = True,
                          attention_bias: bool = False) -> torch.nn.Module:
  """A fp32 dense Qwen3 (4 heads of ``head_dim``, q/k norms) saved to ``path``."""
  torch.manual_seed(seed)
  config = transformers.Qwen3Config(
      vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128,
      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=num_kv_heads,
      head_dim=head_dim, max_position_embeddings=256, rope_parameters={
          "rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
      tie_word_embeddings=tie, attention_bias=attention_bias, bos_token_id=1, eos_token_id=2,
      dtype="float32")
  return _save(transformers.Qwen3ForCausalLM(config), path, seed, None)
