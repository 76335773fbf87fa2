"""Model configuration (`ModelConfig`) of the decoder-only transformers (Qwen2 / Qwen3 / Llama
families)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from tlt_jax.utils import require_positive_ints

ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}
# Architectures whose queries and keys are RMS-normed per head (before RoPE).
QK_NORM_ARCHITECTURES = ("qwen3",)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style RoPE frequency scaling (``rope_type: llama3``) or ``linear`` scaling."""

  rope_type: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape and numerics of a decoder-only transformer; hashable so it can be a jit static."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  # per-head RMSNorm of queries and keys before RoPE; None: what the architecture has (qwen3 only)
  qk_norm: bool | None = None
  max_position_embeddings: int = 4096
  dtype: str = "float32"  # of the params: what the optimizer updates and checkpoints hold
  # of the arithmetic and the KV cache (None: dtype): "bfloat16" over float32 params is mixed
  # precision (float32 master weights, bf16 matmuls)
  compute_dtype: str | None = None
  architecture: str = "llama"
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None

  def __post_init__(self):
    require_positive_ints(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                          "num_heads", "num_kv_heads", "max_position_embeddings")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
          f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(
            f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by num_heads "
            f"({self.num_heads}); set head_dim explicitly")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if self.dtype not in _DTYPES:
      raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
    if self.compute_dtype is not None and self.compute_dtype not in _DTYPES:
      raise ValueError(f"ModelConfig.compute_dtype must be None (the params' dtype) or one of "
                       f"{sorted(_DTYPES)}, got {self.compute_dtype!r}")
    if self.architecture not in ARCHITECTURES:
      raise ValueError(
          f"ModelConfig.architecture must be one of {sorted(ARCHITECTURES)}, got "
          f"{self.architecture!r}")
    self._check_qk_norm()
    if self.rope_scaling is not None and self.rope_scaling.rope_type not in ("llama3", "linear"):
      raise ValueError(
          f"ModelConfig.rope_scaling.rope_type {self.rope_scaling.rope_type!r} is not supported "
          "(supported: 'llama3', 'linear')")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  def _check_qk_norm(self) -> None:
    """Resolves ``qk_norm=None`` to the architecture's; an explicit value must agree with it."""
    has_qk_norm = self.architecture in QK_NORM_ARCHITECTURES
    if self.qk_norm is None:
      object.__setattr__(self, "qk_norm", has_qk_norm)
    elif not isinstance(self.qk_norm, bool):
      raise ValueError(f"ModelConfig.qk_norm must be True, False or None, got {self.qk_norm!r}")
    elif self.qk_norm != has_qk_norm:
      raise ValueError(
          f"ModelConfig.qk_norm={self.qk_norm} does not fit architecture={self.architecture!r}: "
          f"only {', '.join(map(repr, QK_NORM_ARCHITECTURES))} normalizes queries and keys per "
          f"head; pass qk_norm={not self.qk_norm} (or None: the architecture's), or another "
          "architecture")

  @property
  def o_proj_bias(self) -> bool:
    """Whether the attention output projection has a bias: HF Llama's and Qwen3's
    ``attention_bias`` covers q/k/v and o; Qwen2's biases q/k/v only."""
    return self.attention_bias and self.architecture != "qwen2"

  @property
  def jnp_dtype(self) -> Any:
    """The jnp dtype of the params."""
    return _DTYPES[self.dtype]

  @property
  def jnp_compute_dtype(self) -> Any:
    """The jnp dtype of activations, matmul inputs and the KV cache."""
    return _DTYPES[self.compute_dtype or self.dtype]

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """EOS ids as a tuple (possibly empty)."""
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  def replace(self, **kwargs) -> "ModelConfig":
    """A copy with some fields changed (re-validated)."""
    return dataclasses.replace(self, **kwargs)

  @classmethod
  def tiny(cls, **overrides) -> "ModelConfig":
    """A few-thousand-parameter Qwen2-style model for CPU tests and demos."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                attention_bias=True, max_position_embeddings=1024, architecture="qwen2")
    base.update(overrides)
    return cls(**base)
