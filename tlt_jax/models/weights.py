"""The parameter layout and the weight checks that every checkpoint reader shares.

The layout is the map from each Param path of ``Transformer(config)`` to its Hugging Face tensor
name (other formats, such as GGUF, rename those names); :func:`abstract_params` checks the map
against the model. A reader that finds a damaged, incomplete, misshapen or non-finite tensor
raises :class:`WeightsError` with one line naming the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import Transformer
from tlt_jax.utils import nonfinite_count

ParamPath = tuple[str | int, ...]


class WeightsError(ValueError):
  """A checkpoint's weights cannot be used: a damaged, incomplete, misshapen or non-finite file."""


def hf_tensor_names(config: ModelConfig) -> dict[ParamPath, tuple[str, bool]]:
  """Maps each Param path of ``Transformer(config)`` to (HF tensor name, stored transposed?).

  HF linears store ``[out, in]``; our kernels are ``[in, out]``.
  """
  names: dict[ParamPath, tuple[str, bool]] = {
      ("embed_tokens", "embedding"): ("model.embed_tokens.weight", False),
      ("norm", "weight"): ("model.norm.weight", False),
  }
  for i in range(config.num_layers):
    prefix = f"model.layers.{i}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
      names[("layers", i, norm, "weight")] = (f"{prefix}.{norm}.weight", False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      names[("layers", i, "self_attn", proj, "kernel")] = (
          f"{prefix}.self_attn.{proj}.weight", True)
      if config.attention_bias and (proj != "o_proj" or config.o_proj_bias):
        names[("layers", i, "self_attn", proj, "bias")] = (f"{prefix}.self_attn.{proj}.bias", False)
    if config.qk_norm:
      for norm in ("q_norm", "k_norm"):
        names[("layers", i, "self_attn", norm, "weight")] = (f"{prefix}.self_attn.{norm}.weight",
                                                             False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      names[("layers", i, "mlp", proj, "kernel")] = (f"{prefix}.mlp.{proj}.weight", True)
  if not config.tie_word_embeddings:
    names[("lm_head", "kernel")] = ("lm_head.weight", True)
  return names


def abstract_params(config: ModelConfig):
  """(graphdef, flat abstract state) of ``Transformer(config)``, checked against the name map."""
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = nnx.to_flat_state(state)
  names = hf_tensor_names(config)
  model_paths = {path for path, _ in flat}
  if model_paths != set(names):
    unnamed = sorted(map(str, model_paths - set(names)))
    absent = sorted(map(str, set(names) - model_paths))
    raise RuntimeError(f"HF name map is out of sync with Transformer: params without an HF name "
                       f"{unnamed}, HF names without a param {absent}")
  return graphdef, flat, names


def check_finite(array: np.ndarray, file: Path, name: str, what: str = "the model") -> None:
  """Raises ``WeightsError`` naming ``file`` and tensor ``name`` if ``array`` holds NaN or Inf."""
  bad = nonfinite_count(array)
  if bad:
    raise WeightsError(f"{file}: tensor {name!r} holds {bad} NaN/Inf values (of {array.size}); "
                       f"the file is damaged or {what} diverged: download or export it again")
