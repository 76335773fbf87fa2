"""The ``speculators`` ``eagle3`` checkpoint format (what vLLM serves as an EAGLE-3 drafter).

A checkpoint is a directory with ``config.json`` (an ``Eagle3SpeculatorConfig``: the decoder
layer's Llama config, the draft vocabulary size, the target layer ids the drafter reads and the
verifier's name) and ``model.safetensors``: torch ``Linear`` weights ``[out, in]`` (our kernels
transposed), the target's embedding, and, with a reduced vocabulary, ``d2t`` (int64 offsets,
``target id = draft index + d2t[index]``) and ``t2d`` (a bool mask over the target's vocabulary).
The draft vocabulary is in increasing target-id order there; a drafter whose ``vocab_ids`` are in
another order is written with its head rows permuted the same way (the same drafter).

Written and read without torch. :class:`~tlt_jax.models.eagle3.Eagle3Drafter` has the format's
layout, so export is a renaming; an EAGLE-1 ``Drafter`` is refused (no ``eagle3`` checkpoint
computes what it computes), as are checkpoints using options our drafter does not have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.eagle3 import Eagle3Drafter, check_feature_layers, draft_layer_config
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.weights import WeightsError, check_finite
from tlt_jax.utils import read_json_object, replace_dir

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the package version whose layout this follows (tests load it)
# Eagle3SpeculatorConfig options our drafter does not implement, with the value it has.
_FIXED_OPTIONS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
                  "norm_output": False}


class SpeculatorsFormatError(ValueError):
  """A drafter that the format cannot hold, or a checkpoint we cannot read as ours."""


def is_speculators_dir(path: str | Path) -> bool:
  """Whether ``path`` holds a speculators checkpoint (its config names a speculators model)."""
  file = Path(path) / CONFIG_FILE
  if not file.is_file():
    return False
  try:
    return "speculators_model_type" in json.loads(file.read_text())
  except (ValueError, UnicodeDecodeError):
    return False


def _their_name(path: tuple) -> tuple[str, bool]:
  """Our param path -> (speculators tensor name, whether it is a transposed Linear kernel)."""
  names = [str(p) for p in path]
  kernel = names[-1] == "kernel"
  if kernel:
    names[-1] = "weight"
  if names[0] == "layer":
    names = ["layers", "0"] + names[1:]
  elif names[0] == "head":
    names[0] = "lm_head"
  return ".".join(names), kernel


def _refuse_eagle1(drafter: Drafter) -> None:
  if not isinstance(drafter, Eagle3Drafter):
    raise SpeculatorsFormatError(
        f"a drafter={drafter.kind} (EAGLE-1) drafter cannot be written as a speculators "
        "checkpoint: the format holds only EAGLE-3 drafters, and none computes what an EAGLE-1 "
        "drafter does; train one with drafter=eagle3")


def speculators_config(drafter: Eagle3Drafter, verifier_hf_config: dict,
                       verifier_path: str) -> dict[str, Any]:
  """The ``config.json`` of ``drafter`` for the verifier whose HF config is given."""
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  layer = hf.config_to_hf(draft_layer_config(drafter.config))
  for key in ("architectures", "rope_theta", "rope_scaling", "dtype"):
    layer.pop(key, None)
  layer.update(num_hidden_layers=1, pad_token_id=None)
  k = drafter.draft_vocab_size or drafter.config.vocab_size
  return {
      "architectures": ["Eagle3DraftModel"],
      "speculators_model_type": "eagle3",
      "speculators_version": SPECULATORS_VERSION,
      "draft_vocab_size": k,
      "eagle_aux_hidden_state_layer_ids": list(drafter.feature_layers),
      "embed_requires_grad": False,
      **_FIXED_OPTIONS,
      "target_hidden_size": None,
      "tie_word_embeddings": False,
      "dtype": drafter.config.dtype,
      "transformer_layer_config": layer,
      "speculators_config": {
          "algorithm": "eagle3",
          "default_proposal_method": "greedy",
          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens":
                                drafter.ttt_steps, "verifier_accept_k": 1,
                                "accept_tolerance": 0.0}],
          "verifier": {"architectures": list(verifier_hf_config.get("architectures") or []),
                       "name_or_path": verifier_path},
      },
  }


def speculators_tensors(drafter: Eagle3Drafter, embedding: np.ndarray) -> dict[str, np.ndarray]:
  """The checkpoint's tensors: our params renamed (kernels transposed), the target's
  ``embedding [V, H]``, and the vocabulary maps of a reduced vocabulary (sorted by target id)."""
  order = None
  if drafter.vocab_ids is not None:
    order = np.argsort(np.asarray(drafter.vocab_ids))
  tensors: dict[str, np.ndarray] = {}
  for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
    name, kernel = _their_name(path)
    value = np.asarray(var.get_value())
    if kernel:
      value = value.T
    if name == "lm_head.weight" and order is not None:
      value = value[order]
    tensors[name] = np.ascontiguousarray(value)
  tensors["embed_tokens.weight"] = np.ascontiguousarray(embedding)
  if order is not None:
    ids = np.asarray(drafter.vocab_ids, np.int64)[order]
    tensors["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
    t2d = np.zeros(drafter.config.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
  return tensors


def check_fits_verifier(drafter: Drafter, verifier: ModelConfig, where: str = "drafter") -> None:
  """One-line error naming both sides if ``drafter`` was not made for the ``verifier``'s shape."""
  c = drafter.config
  for field in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
    if getattr(c, field) != getattr(verifier, field):
      raise SpeculatorsFormatError(f"{where} has {field}={getattr(c, field)} but the verifier "
                                   f"has {field}={getattr(verifier, field)}: they do not fit")
  if isinstance(drafter, Eagle3Drafter) and max(drafter.feature_layers) > verifier.num_layers:
    raise SpeculatorsFormatError(
        f"{where} reads target layers {list(drafter.feature_layers)} but the verifier has "
        f"{verifier.num_layers} layers")


def export_speculators(drafter: Drafter, verifier_dir: str | Path, out_dir: str | Path) -> Path:
  """Writes ``drafter`` as a speculators ``eagle3`` checkpoint at ``out_dir`` (atomically: a
  complete directory or none, ``utils.replace_dir``) for the HF-format verifier at
  ``verifier_dir``, whose token embedding it reads. Returns ``out_dir``.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  _refuse_eagle1(drafter)
  verifier_dir, out_dir = Path(verifier_dir), Path(out_dir)
  verifier_hf = hf.read_hf_config(verifier_dir)
  check_fits_verifier(drafter, hf.config_from_hf(verifier_hf), "the drafter")
  embedding = _verifier_embedding(verifier_dir, drafter.config)
  config = speculators_config(drafter, verifier_hf, str(verifier_dir.resolve()))
  tensors = speculators_tensors(drafter, embedding.astype(np.dtype(drafter.config.jnp_dtype)))

  def write(tmp: Path) -> None:
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))

  return replace_dir(out_dir, write)


def _verifier_embedding(verifier_dir: Path, config: ModelConfig) -> np.ndarray:
  """The verifier's token embedding ``[V, H]`` read from its safetensors (no whole model)."""
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  name = "model.embed_tokens.weight"
  value = hf.read_tensors(verifier_dir, [name]).get(name)
  if value is None:
    raise WeightsError(f"no {name} in the safetensors files of {verifier_dir}: not an HF-format "
                       "model directory")
  if value.shape != (config.vocab_size, config.hidden_size):
    raise WeightsError(f"{verifier_dir}: {name} has shape {value.shape}, expected "
                       f"{(config.vocab_size, config.hidden_size)}")
  return value


# ------------------------------------------------------------------------------------ import


def _check_options(config: dict, path: Path) -> None:
  if config.get("speculators_model_type") != "eagle3":
    raise SpeculatorsFormatError(
        f"{path / CONFIG_FILE}: speculators_model_type is "
        f"{config.get('speculators_model_type')!r}; only 'eagle3' checkpoints can be loaded")
  for key, ours in _FIXED_OPTIONS.items():
    if bool(config.get(key, False)) != ours:
      raise SpeculatorsFormatError(f"{path / CONFIG_FILE}: {key}={config.get(key)!r} is not "
                                   f"supported (our eagle3 drafter has {key}={ours})")
  layer = config.get("transformer_layer_config")
  if not isinstance(layer, dict):
    raise SpeculatorsFormatError(f"{path / CONFIG_FILE} lacks its transformer_layer_config")
  if layer.get("model_type", "llama") != "llama" or int(layer.get("num_hidden_layers", 1)) != 1:
    raise SpeculatorsFormatError(
        f"{path / CONFIG_FILE}: a {layer.get('num_hidden_layers')}-layer "
        f"{layer.get('model_type')!r} drafter is not supported (ours: one Llama layer)")
  if layer.get("attention_bias") or layer.get("mlp_bias"):
    raise SpeculatorsFormatError(f"{path / CONFIG_FILE}: attention/MLP biases in the drafter "
                                 "layer are not supported")
  hidden = config.get("target_hidden_size")
  if hidden is not None and hidden != layer.get("hidden_size"):
    raise SpeculatorsFormatError(f"{path / CONFIG_FILE}: target_hidden_size={hidden} differs "
                                 f"from the drafter's {layer.get('hidden_size')}; not supported")


def load_speculators(path: str | Path, target_config: ModelConfig) -> Eagle3Drafter:
  """Reads a speculators ``eagle3`` checkpoint as an :class:`Eagle3Drafter` for the target
  ``target_config``. A checkpoint made for another target (hidden size, vocabulary, heads, layer
  ids) or malformed raises a one-line ValueError naming both sides."""
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = Path(path)
  for name in (CONFIG_FILE, WEIGHTS_FILE):
    if not (path / name).is_file():
      raise FileNotFoundError(f"No {name} in {path}: not a speculators checkpoint")
  config = read_json_object(path / CONFIG_FILE, "export the drafter again")
  _check_options(config, path)
  layer = config["transformer_layer_config"]
  try:
    theirs = hf.config_from_hf(dict(layer, architectures=["LlamaForCausalLM"]))
  except (KeyError, TypeError, ValueError) as e:
    raise SpeculatorsFormatError(f"{path / CONFIG_FILE}: transformer_layer_config: {e}") from None
  for field in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
    if getattr(theirs, field) != getattr(target_config, field):
      raise SpeculatorsFormatError(
          f"speculators drafter {path} has {field}={getattr(theirs, field)} but the target has "
          f"{field}={getattr(target_config, field)}: it was made for another model")
  ids = config.get("eagle_aux_hidden_state_layer_ids")
  if ids is None:
    raise SpeculatorsFormatError(f"{path / CONFIG_FILE} does not name its target layers "
                                 "(eagle_aux_hidden_state_layer_ids); set them explicitly")
  try:
    ids = check_feature_layers(ids, target_config.num_layers)
  except ValueError as e:
    raise SpeculatorsFormatError(f"speculators drafter {path} reads target layers {ids}, which "
                                 f"the target ({target_config.num_layers} layers) does not fit: "
                                 f"{e}") from None
  k = int(config.get("draft_vocab_size", target_config.vocab_size))
  steps = _speculative_tokens(config)
  dtype_config = target_config.replace(intermediate_size=theirs.intermediate_size)
  drafter = nnx.eval_shape(lambda: Eagle3Drafter(
      dtype_config, rngs=nnx.Rngs(0), feature_layers=ids, ttt_steps=steps,
      draft_vocab_size=None if k == target_config.vocab_size else k))
  file = path / WEIGHTS_FILE
  with hf.open_safetensors(file) as f:
    tensors = {name: hf.read_tensor(f, file, name) for name in f.keys()}
  if k != target_config.vocab_size:
    drafter.vocab_ids = _vocab_ids(tensors, k, target_config.vocab_size, file)
  for p, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
    name, kernel = _their_name(p)
    if name not in tensors:
      raise WeightsError(f"speculators checkpoint {file} is missing tensor {name!r}")
    value = tensors[name].T if kernel else tensors[name]
    if value.shape != var.shape:
      raise WeightsError(f"{file}: tensor {name!r} has shape {tensors[name].shape}, expected "
                         f"{var.shape[::-1] if kernel else var.shape} for this target")
    check_finite(value, file, name, what="its training")
    var.set_value(jnp.asarray(value, dtype=var.dtype))
  return drafter


def _speculative_tokens(config: dict) -> int:
  try:
    methods = config["speculators_config"]["proposal_methods"]
    return max(1, int(methods[0]["speculative_tokens"]))
  except (KeyError, IndexError, TypeError, ValueError):
    return 3


def _vocab_ids(tensors: dict, k: int, vocab: int, file: Path) -> tuple[int, ...]:
  d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
  if d2t is None or t2d is None:
    raise WeightsError(f"{file}: draft_vocab_size={k} < the target's {vocab} needs the d2t and "
                       "t2d vocabulary maps, which are missing")
  if d2t.shape != (k,) or t2d.shape != (vocab,):
    raise WeightsError(f"{file}: d2t has shape {d2t.shape} and t2d {t2d.shape}; expected ({k},) "
                       f"and ({vocab},) (draft and target vocabularies)")
  ids = np.arange(k) + d2t.astype(np.int64)
  if (ids.min() < 0 or ids.max() >= vocab or np.any(np.diff(ids) <= 0)
      or not np.array_equal(np.flatnonzero(t2d.astype(bool)), ids)):
    raise WeightsError(f"{file}: d2t and t2d disagree or do not give {k} increasing target ids "
                       f"in [0, {vocab})")
  return tuple(int(i) for i in ids)
