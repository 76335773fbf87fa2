"""Hugging Face checkpoint I/O: ``config.json`` <-> ``ModelConfig`` and safetensors <-> NNX params.

Reads local Qwen2 / Qwen3 (dense) / Llama directories (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``) and writes directories that ``transformers`` loads (``.gguf``
files are read by ``tlt_jax.models.gguf``; ``tlt_jax.models.load`` picks the reader by the path).
Torch is never needed: tensors go through ``safetensors`` with numpy (bf16 via ``ml_dtypes``).
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from tlt_jax.models.model_config import ARCHITECTURES, ModelConfig, RopeScaling
from tlt_jax.models.transformer import Transformer
from tlt_jax.models.weights import ParamPath, WeightsError, abstract_params, check_finite
from tlt_jax.utils import read_json_object

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_ARCHITECTURE_BY_CLASS = {hf_class: name for name, hf_class in ARCHITECTURES.items()}
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "float16": "float16", "half": "float16"}
# Buffers some exporters write next to the weights; they carry nothing we need.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
# HF Qwen3Config's head_dim when config.json omits it (not hidden_size / num_attention_heads).
QWEN3_DEFAULT_HEAD_DIM = 128


# ----------------------------------------------------------------------------- config


def _supported_architectures() -> str:
  return ", ".join(f"{cls} (model_type {name!r})" for name, cls in ARCHITECTURES.items())


def _architecture_from_hf(hf_config: dict) -> str:
  """Our architecture name ('qwen2' / 'qwen3' / 'llama') from HF ``architectures`` or
  ``model_type``."""
  classes = hf_config.get("architectures") or []
  model_type = hf_config.get("model_type")
  found = classes[0] if classes else model_type
  if "moe" in str(found).lower() or hf_config.get("num_experts"):
    raise ValueError(f"Mixture-of-experts model {found!r} is not supported (only dense layers); "
                     f"use a dense model: {_supported_architectures()}")
  for hf_class in classes:
    if hf_class in _ARCHITECTURE_BY_CLASS:
      return _ARCHITECTURE_BY_CLASS[hf_class]
  if not classes and model_type in ARCHITECTURES:
    return model_type
  raise ValueError(f"Unsupported architecture {found!r}; supported: {_supported_architectures()}")


def _rope_from_hf(hf_config: dict) -> tuple[float, RopeScaling | None]:
  """RoPE base and scaling from the legacy (``rope_theta`` + ``rope_scaling``) or the
  transformers-5 (``rope_parameters``) form; the newer form wins where both are present."""
  params = dict(hf_config.get("rope_scaling") or {})
  params.update(hf_config.get("rope_parameters") or {})
  if any(isinstance(value, dict) for value in params.values()):
    raise ValueError(f"Per-layer-type RoPE parameters are not supported: {params}")
  theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
  partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"partial_rotary_factor={partial} is not supported (only full rotary)")
  rope_type = params.get("rope_type", params.get("type")) or "default"
  if rope_type == "default":
    return theta, None
  if "factor" not in params:
    raise ValueError(f"RoPE scaling {rope_type!r} needs a 'factor': {params}")
  if rope_type == "linear":
    return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
  if rope_type == "llama3":
    for key in ("low_freq_factor", "high_freq_factor"):
      if key not in params:
        raise ValueError(f"llama3 RoPE scaling needs {key!r}: {params}")
    original = params.get("original_max_position_embeddings",
                          hf_config.get("original_max_position_embeddings",
                                        hf_config.get("max_position_embeddings")))
    return theta, RopeScaling(rope_type="llama3", factor=float(params["factor"]),
                              low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]),
                              original_max_position_embeddings=int(original))
  raise ValueError(f"RoPE scaling type {rope_type!r} is not supported "
                   "(supported: 'default', 'linear', 'llama3')")


def _dtype_from_hf(hf_config: dict) -> str:
  """Our dtype name from HF ``dtype`` (transformers 5) or ``torch_dtype`` (older); fp32 if unset."""
  raw = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
  name = str(raw).removeprefix("torch.")
  if name == "auto":
    return "float32"
  if name not in _DTYPE_NAMES:
    raise ValueError(f"Unsupported checkpoint dtype {raw!r} (supported: {sorted(_DTYPE_NAMES)})")
  return _DTYPE_NAMES[name]


def config_from_hf(hf_config: dict, dtype: str | None = None) -> ModelConfig:
  """A ``ModelConfig`` from a parsed HF ``config.json``; ``dtype`` overrides the checkpoint's."""
  architecture = _architecture_from_hf(hf_config)
  if hf_config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported (only 'silu')")
  if hf_config.get("mlp_bias", False):
    raise ValueError("mlp_bias=True is not supported")
  layer_types = hf_config.get("layer_types") or []
  if hf_config.get("use_sliding_window", False) or "sliding_attention" in layer_types:
    raise ValueError("Sliding-window attention is not supported (use_sliding_window must be false)")
  rope_theta, rope_scaling = _rope_from_hf(hf_config)
  num_heads = hf_config["num_attention_heads"]
  if architecture == "qwen2":
    attention_bias = True  # HF Qwen2 always has q/k/v biases
  else:
    attention_bias = bool(hf_config.get("attention_bias", False))
  head_dim = hf_config.get("head_dim")
  if head_dim is None and architecture == "qwen3":
    head_dim = QWEN3_DEFAULT_HEAD_DIM
  return ModelConfig(
      vocab_size=hf_config["vocab_size"],
      hidden_size=hf_config["hidden_size"],
      intermediate_size=hf_config["intermediate_size"],
      num_layers=hf_config["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
      head_dim=head_dim,
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
      attention_bias=attention_bias,
      max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
      dtype=dtype if dtype is not None else _dtype_from_hf(hf_config),
      architecture=architecture,
      bos_token_id=hf_config.get("bos_token_id"),
      eos_token_id=hf_config.get("eos_token_id"),
  )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """The HF ``config.json`` dict for ``config``, readable by transformers 5 and 4.x alike."""
  if config.architecture == "qwen2" and not config.attention_bias:
    raise ValueError("HF Qwen2 always has q/k/v biases; a model with attention_bias=False "
                     "must be exported with architecture='llama'")
  rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
  legacy_rope_scaling = None
  scaling = config.rope_scaling
  if scaling is not None:
    legacy_rope_scaling = {"rope_type": scaling.rope_type, "factor": scaling.factor}
    if scaling.rope_type == "llama3":
      legacy_rope_scaling.update(
          low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
          original_max_position_embeddings=scaling.original_max_position_embeddings)
    rope_parameters.update(legacy_rope_scaling)
  eos = list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id
  hf_config: dict[str, Any] = {
      "architectures": [ARCHITECTURES[config.architecture]],
      "model_type": config.architecture,
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_position_embeddings,
      "rms_norm_eps": config.rms_norm_eps,
      "rope_parameters": rope_parameters,
      # transformers 4.x reads these two instead of rope_parameters.
      "rope_theta": config.rope_theta,
      "rope_scaling": legacy_rope_scaling,
      "tie_word_embeddings": config.tie_word_embeddings,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": eos,
      "dtype": config.dtype,
      "attention_dropout": 0.0,
      "use_cache": True,
  }
  if config.architecture == "llama":
    hf_config.update(attention_bias=config.attention_bias, mlp_bias=False)
  else:
    hf_config.update(use_sliding_window=False, sliding_window=None)
  if config.architecture == "qwen3":
    hf_config.update(attention_bias=config.attention_bias)
  return hf_config


def read_hf_config(path: str | Path) -> dict:
  """The parsed ``config.json`` of a local HF model directory."""
  config_path = Path(path) / CONFIG_FILE
  if not config_path.is_file():
    raise FileNotFoundError(f"No {CONFIG_FILE} in {Path(path)} (expected {config_path})")
  return read_json_object(config_path)


# ----------------------------------------------------------------------------- weights


@contextlib.contextmanager
def open_safetensors(file: Path):
  """``safe_open(file)`` for numpy; a truncated or garbled file raises one ``WeightsError``."""
  try:
    handle = safe_open(str(file), framework="np")
  except SafetensorError as e:
    raise WeightsError(f"{file} is not a readable safetensors file ({e}): it is truncated or "
                       "overwritten; download or export it again") from None
  with handle as f:
    yield f


def read_tensor(f, file: Path, name: str) -> np.ndarray:
  """Tensor ``name`` of an open safetensors ``file`` as numpy; damage raises ``WeightsError``."""
  try:
    return f.get_tensor(name)
  except SafetensorError as e:
    raise WeightsError(f"{file}: tensor {name!r} cannot be read ({e}); the file is damaged: "
                       "download or export it again") from None


def _tensor_files(path: Path) -> dict[str, Path]:
  """Which safetensors file holds each tensor: ``model.safetensors`` or the sharded index."""
  single = path / WEIGHTS_FILE
  index_path = path / WEIGHTS_INDEX_FILE
  if single.is_file():
    with open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  if not index_path.is_file():
    raise FileNotFoundError(
        f"No weights in {path}: expected {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}")
  try:
    weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    files = {str(name): path / shard for name, shard in weight_map.items()}
  except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
    raise WeightsError(f"{index_path} is not a valid shard index (a JSON object with a "
                       f"'weight_map' of tensor name -> file; {type(e).__name__}: {e}); "
                       "download or export the checkpoint again") from None
  for name, shard in files.items():
    if not shard.is_file():
      raise FileNotFoundError(
          f"Shard {shard.name} listed in {WEIGHTS_INDEX_FILE} (holding tensor {name!r}) "
          f"is missing from {path}")
  return files


def read_tensors(path: str | Path, names) -> dict[str, np.ndarray]:
  """The tensors ``names`` that the HF directory ``path`` holds (single file or sharded index),
  read without the rest of the model; a name it lacks is simply absent from the result."""
  path = Path(path)
  files = _tensor_files(path)
  by_file: dict[Path, list[str]] = defaultdict(list)
  for name in dict.fromkeys(names):
    if name in files:
      by_file[files[name]].append(name)
  found = {}
  for file, wanted in by_file.items():
    with open_safetensors(file) as f:
      for name in wanted:
        found[name] = read_tensor(f, file, name)
  return found


def _is_harmless_extra(name: str, config: ModelConfig) -> bool:
  """Tensors a checkpoint may carry that the model does not use."""
  if name.endswith(_HARMLESS_SUFFIXES):
    return True
  return name == "lm_head.weight" and config.tie_word_embeddings  # tied: HF ignores it too


def _check_tensor_names(path: Path, tensor_files: dict[str, Path], config: ModelConfig,
                        names: dict[ParamPath, tuple[str, bool]], strict: bool) -> None:
  """Raises if a needed tensor is absent, or (``strict``) if an unknown one is present."""
  missing = [hf_name for hf_name, _ in names.values() if hf_name not in tensor_files]
  if missing:
    more = f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""
    raise WeightsError(f"Checkpoint {path} is missing tensor {missing[0]!r}{more}: it is "
                       "incomplete or not made for its config.json; download or export it again")
  known = {hf_name for hf_name, _ in names.values()}
  unexpected = sorted(name for name in tensor_files
                      if name not in known and not _is_harmless_extra(name, config))
  if strict and unexpected:
    raise ValueError(f"Checkpoint {path} has unexpected tensor {unexpected[0]!r} "
                     f"({len(unexpected)} unexpected in all: {unexpected[:6]}); "
                     "pass strict=False to ignore them")


def from_pretrained(path: str | Path, dtype: str | None = None, *,
                    strict: bool = True) -> tuple[Transformer, ModelConfig]:
  """Loads a local HF Qwen2/Qwen3/Llama directory as a ``Transformer``; ``dtype`` overrides the
  config's.

  (:func:`tlt_jax.models.load.from_pretrained` also takes a ``.gguf`` file.)
  Every param is set from the checkpoint; ``strict`` rejects unknown (non-harmless) tensors.
  A damaged, incomplete, misshapen or non-finite checkpoint raises a one-line ``WeightsError``.
  """
  path = Path(path)
  hf_config = read_hf_config(path)  # its own errors name the file
  try:
    config = config_from_hf(hf_config, dtype=dtype)
  except KeyError as e:
    raise ValueError(f"{path / CONFIG_FILE} lacks the required key {e.args[0]!r}") from None
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path / CONFIG_FILE}: {e}") from None
  tensor_files = _tensor_files(path)
  graphdef, flat, names = abstract_params(config)
  _check_tensor_names(path, tensor_files, config, names, strict)

  variables = dict(flat)
  params_by_file: dict[Path, list[ParamPath]] = defaultdict(list)
  for param_path, (hf_name, _) in names.items():
    params_by_file[tensor_files[hf_name]].append(param_path)
  loaded: set[ParamPath] = set()
  for file, param_paths in params_by_file.items():
    with open_safetensors(file) as f:
      for param_path in param_paths:
        hf_name, transposed = names[param_path]
        variable = variables[param_path]
        hf_shape = tuple(variable.shape)[::-1] if transposed else tuple(variable.shape)
        array = read_tensor(f, file, hf_name)
        if tuple(array.shape) != hf_shape:
          raise WeightsError(f"{file}: tensor {hf_name!r} has shape {tuple(array.shape)}, "
                             f"expected {hf_shape} for {CONFIG_FILE}: the weights and the "
                             "config are of different models; put the matching pair together")
        check_finite(array, file, hf_name)
        variable.set_value(jnp.asarray(array.T if transposed else array, dtype=variable.dtype))
        loaded.add(param_path)
  if loaded != set(variables):  # every param set exactly once: no random weights survive
    raise RuntimeError(f"Params left unset: {sorted(map(str, set(variables) - loaded))}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat)), config


def save_pretrained(model: Transformer, config: ModelConfig, path: str | Path) -> None:
  """Writes ``config.json`` + ``model.safetensors`` (+ ``generation_config.json``) that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""
  path = Path(path)
  hf_config = config_to_hf(config)  # raises before anything is written if not representable
  _, abstract_flat, names = abstract_params(config)
  expected_shapes = {param_path: tuple(v.shape) for param_path, v in abstract_flat}
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  if set(params) != set(names):
    mismatched = sorted(map(str, set(params) ^ set(names)))
    raise ValueError(f"Model params do not match config: {mismatched}")
  tensors: dict[str, np.ndarray] = {}
  for param_path, (hf_name, transposed) in names.items():
    value = np.asarray(params[param_path].get_value()).astype(config.jnp_dtype)
    if value.shape != expected_shapes[param_path]:
      raise ValueError(f"Param {'.'.join(map(str, param_path))} has shape {value.shape}, "
                       f"config expects {expected_shapes[param_path]}")
    tensors[hf_name] = np.ascontiguousarray(value.T if transposed else value)
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
  (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
  generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id")
                if hf_config[key] is not None}
  if generation:
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
