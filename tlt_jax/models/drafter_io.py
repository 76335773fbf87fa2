"""Saving and loading drafters, and which policy a drafter was trained for.

Our own format (``save_drafter``): ``drafter.safetensors`` (the trainable params, and a reduced
vocabulary's ``vocab_ids``) and ``drafter_config.json`` (the target's HF config, the drafter's
kind and, for an EAGLE-3 drafter, its feature layers and chained steps; the fingerprint of the
policy it was trained for). ``load_drafter`` reads that, or a ``speculators`` ``eagle3``
checkpoint (:mod:`tlt_jax.models.speculators_format`), for either kind of drafter.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from tlt_jax.models import speculators_format
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.learned_kinds import LEARNED, learned_names
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.weights import WeightsError, check_finite
from tlt_jax.utils import read_json_object

PARAMS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"
VOCAB_IDS_TENSOR = "vocab_ids"
DRAFT_VOCAB_KEY = "draft_vocab_size"
POLICY_KEY = "trained_for_policy"  # in CONFIG_FILE: {"fingerprint": ..., "name": ...}
# in CONFIG_FILE: the architecture (``learned_kinds``): "eagle" (absent in older files), "eagle3"
# or a registered one; beside it the class's ``saved_fields`` (eagle3: its feature layers and
# chained steps)
KIND_KEY = "drafter_kind"
_FINGERPRINT_ROWS = 256  # embedding rows sampled (evenly spaced) into a policy's fingerprint


def policy_fingerprint(policy) -> str:
  """A stable sha256 of a policy's weights (a ``Transformer``, its ``nnx.State`` or pure dict).

  Hashes every norm weight and 256 evenly spaced embedding rows, rounded to bfloat16 (so an
  f32 policy and its bf16 cast agree): cheap on any size, and any trained change shows.
  """
  if isinstance(policy, nnx.Module):
    policy = nnx.state(policy, nnx.Param)
  elif not isinstance(policy, nnx.State):
    policy = nnx.State(policy)
  chosen: dict[str, Any] = {}
  for param_path, leaf in nnx.to_flat_state(policy):
    name = ".".join(map(str, param_path))
    value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    if name == "embed_tokens.embedding":
      chosen[name] = value[::max(1, -(-value.shape[0] // _FINGERPRINT_ROWS))]
    elif name.endswith("norm.weight"):
      chosen[name] = value
  if "embed_tokens.embedding" not in chosen:
    raise TypeError(f"policy_fingerprint needs a Transformer or its params, got "
                    f"{type(policy).__name__} without embed_tokens.embedding")
  digest = hashlib.sha256()
  for name in sorted(chosen):
    value = np.asarray(jax.device_get(chosen[name])).astype(ml_dtypes.bfloat16)
    digest.update(f"{name}{value.shape};".encode())
    digest.update(np.ascontiguousarray(value).tobytes())
  return "sha256:" + digest.hexdigest()


def save_drafter(drafter: Drafter, path: str | Path, policy=None,
                 policy_name: str | None = None) -> None:
  """Writes the drafter's trainable params (safetensors) and its target config (json); with
  ``policy`` (the target it was trained for) also that policy's fingerprint and ``policy_name``."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = Path(path)
  flat = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
  tensors = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}
  config = hf.config_to_hf(drafter.config)
  if drafter.vocab_ids is not None:
    tensors[VOCAB_IDS_TENSOR] = np.asarray(drafter.vocab_ids, np.int32)
    config[DRAFT_VOCAB_KEY] = drafter.draft_vocab_size
  config[KIND_KEY] = drafter.kind
  for key in drafter.saved_fields:
    value = getattr(drafter, key)
    config[key] = list(value) if isinstance(value, tuple) else value
  if policy is not None:
    config[POLICY_KEY] = {"fingerprint": policy_fingerprint(policy), "name": policy_name}
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / PARAMS_FILE))
  (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def _read_config(path: Path) -> dict:
  """The parsed drafter config json; a garbled one raises a one-line ValueError."""
  return read_json_object(path / CONFIG_FILE, "save the drafter again")


def drafter_policy(path: str | Path) -> dict | None:
  """The policy record ``{"fingerprint", "name"}`` saved with a drafter, or None if it has none
  (a speculators checkpoint never has one: it names its verifier instead)."""
  if not (Path(path) / CONFIG_FILE).is_file():
    return None
  record = _read_config(Path(path)).get(POLICY_KEY)
  return record if isinstance(record, dict) and record.get("fingerprint") else None


def drafter_policy_mismatch(path: str | Path, policy) -> str | None:
  """A one-line warning if the drafter at ``path`` was trained for another policy than ``policy``.

  None when the fingerprints agree, and for drafters saved without one (before fingerprints
  were recorded, or by ``save_drafter`` without ``policy``): those cannot be checked.
  """
  record = drafter_policy(path)
  if record is None:
    return None
  expected, actual = record["fingerprint"], policy_fingerprint(policy)
  if expected == actual:
    return None
  name = f" ({record['name']})" if record.get("name") else ""
  return (f"drafter {path} was trained for policy {expected[:19]}{name}, not for this one "
          f"({actual[:19]}): decoding stays exact, but expect far fewer accepted drafts; retrain "
          f"it for this policy or fine-tune it online")


def _drafter_class(raw_config: dict, path: Path) -> type:
  """The class of a saved drafter's ``drafter_kind`` (a one-line error for an unknown one)."""
  kind = raw_config.get(KIND_KEY, Drafter.kind)
  if kind not in LEARNED:
    raise ValueError(f"{path / CONFIG_FILE}: {KIND_KEY}={kind!r} is not one of "
                     f"{sorted(learned_names())}; save the drafter again (or register its "
                     "architecture: tlt_jax.models.learned_kinds.register_learned)")
  cls = LEARNED[kind]
  for other in LEARNED.values():  # another architecture's fields: the kind key is wrong
    foreign = [key for key in other.saved_fields
               if key in raw_config and key not in cls.saved_fields]
    if foreign:
      raise ValueError(f"{path / CONFIG_FILE} has {other.kind} keys {foreign} but "
                       f"{KIND_KEY}={kind!r}; save the drafter again")
  return cls


def load_drafter(path: str | Path, target_config: ModelConfig | None = None) -> Drafter:
  """Reads a drafter saved by ``save_drafter``, or a ``speculators`` ``eagle3`` checkpoint (as
  vLLM serves; needs ``target_config``); checks it fits ``target_config`` if given.

  Damaged, incomplete, misshapen or non-finite files raise a one-line ``WeightsError``
  (a ValueError). Whether it was trained for this policy: :func:`drafter_policy_mismatch`.
  """
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = Path(path)
  if speculators_format.is_speculators_dir(path):
    if target_config is None:
      raise ValueError(f"{path} is a speculators checkpoint: load it for a target "
                       "(load_drafter(path, target_config))")
    return speculators_format.load_speculators(path, target_config)
  for name in (PARAMS_FILE, CONFIG_FILE):
    if not (path / name).is_file():
      raise FileNotFoundError(f"No {name} in {path}: not a drafter saved by save_drafter (nor a "
                              "speculators eagle3 checkpoint)")
  raw_config = _read_config(path)
  draft_vocab_size = raw_config.get(DRAFT_VOCAB_KEY)
  try:
    config = hf.config_from_hf(raw_config)
  except KeyError as e:
    raise ValueError(f"{path / CONFIG_FILE} lacks the required key {e.args[0]!r}; save the "
                     "drafter again") from None
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path / CONFIG_FILE}: {e}") from None
  if target_config is not None:
    for field in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(config, field) != getattr(target_config, field):
        raise ValueError(f"drafter at {path} was made for {field}={getattr(config, field)}, "
                         f"but the target has {field}={getattr(target_config, field)}")
    config = target_config
  cls = _drafter_class(raw_config, path)
  drafter = nnx.eval_shape(lambda: cls(
      config, rngs=nnx.Rngs(0), draft_vocab_size=draft_vocab_size,
      **{key: raw_config[key] for key in cls.saved_fields if key in raw_config}))
  file = path / PARAMS_FILE
  with hf.open_safetensors(file) as f:
    tensors = {name: hf.read_tensor(f, file, name) for name in f.keys()}
  if draft_vocab_size is not None:
    ids = tensors.get(VOCAB_IDS_TENSOR)
    if ids is None or ids.shape != (draft_vocab_size,):
      raise WeightsError(f"drafter checkpoint {path} declares {DRAFT_VOCAB_KEY}="
                         f"{draft_vocab_size} but its {VOCAB_IDS_TENSOR!r} tensor is "
                         f"{'missing' if ids is None else f'of shape {ids.shape}'}")
    if ids.min() < 0 or ids.max() >= config.vocab_size or len(np.unique(ids)) != ids.size:
      raise WeightsError(f"drafter checkpoint {path}: {VOCAB_IDS_TENSOR!r} must hold "
                         f"distinct ids in [0, {config.vocab_size})")
    drafter.vocab_ids = tuple(int(i) for i in ids)
  flat = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
  for p, var in flat:
    name = ".".join(map(str, p))
    if name not in tensors:
      raise WeightsError(f"drafter checkpoint {path} is missing tensor {name!r}: it is "
                         "incomplete; save the drafter again")
    if tensors[name].shape != var.shape:
      raise WeightsError(f"{file}: drafter tensor {name!r} has shape {tensors[name].shape}, "
                         f"expected {var.shape}; save the drafter again for this config")
    check_finite(tensors[name], file, name, what="its training")
    var.set_value(jnp.asarray(tensors[name], dtype=var.dtype))
  return drafter
