"""Drafter checkpoints: save/load round trips and the errors of ``load_drafter``."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.models.random_model import random_model
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import CONFIG_FILE, PARAMS_FILE, Drafter, load_drafter, save_drafter

CONFIG = ModelConfig.tiny(vocab_size=32, num_layers=1)


def random_drafter(config: ModelConfig = CONFIG, seed: int = 0) -> Drafter:
  """A drafter whose params (biases included) are all non-trivial random values."""
  drafter = Drafter.create(config, seed)
  rng = np.random.default_rng(seed)
  for _, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
    var.set_value(jnp.asarray(rng.normal(0, 0.3, var.shape), var.dtype))
  return drafter


def flat_params(drafter: Drafter) -> dict[str, np.ndarray]:
  return {".".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A saved random drafter for ``CONFIG``: (directory, drafter)."""
  path = tmp_path_factory.mktemp("drafter")
  drafter = random_drafter()
  save_drafter(drafter, path)
  return path, drafter


def test_round_trip_restores_every_param_and_the_logits(saved):
  path, drafter = saved
  assert (path / PARAMS_FILE).is_file() and (path / CONFIG_FILE).is_file()
  want = flat_params(drafter)
  assert {"fc.kernel", "fc.bias"} <= set(want) and len(want) > 4
  for target_config in (None, CONFIG):
    loaded = load_drafter(path, target_config)
    assert loaded.config == CONFIG
    got = flat_params(loaded)
    assert set(got) == set(want)
    for name, value in want.items():
      np.testing.assert_array_equal(got[name], value, err_msg=name)
  target = random_model(CONFIG, seed=1)
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 7)))
  features = jnp.asarray(rng.normal(size=(2, 7, CONFIG.hidden_size)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(loaded.forward(target, tokens, features).logits),
                                np.asarray(drafter.forward(target, tokens, features).logits))


def test_load_casts_to_the_target_dtype(saved):
  path, drafter = saved
  loaded = load_drafter(path, CONFIG.replace(dtype="bfloat16"))
  assert loaded.config.dtype == "bfloat16"
  kernel = loaded.fc.kernel.get_value()
  assert kernel.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(kernel, np.float32),
                                np.asarray(drafter.fc.kernel.get_value().astype(jnp.bfloat16),
                                           np.float32))


@pytest.mark.parametrize("missing", [PARAMS_FILE, CONFIG_FILE])
def test_missing_file_is_named(tmp_path, saved, missing):
  for name in (PARAMS_FILE, CONFIG_FILE):
    if name != missing:
      (tmp_path / name).write_bytes((saved[0] / name).read_bytes())
  with pytest.raises(FileNotFoundError, match=f"No {missing} in"):
    load_drafter(tmp_path)


def test_empty_directory_is_not_a_drafter(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a drafter saved by save_drafter"):
    load_drafter(tmp_path / "nowhere")


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 64), ("vocab_size", 48), ("num_heads", 2), ("num_kv_heads", 1),
    ("head_dim", 16),
])
def test_mismatched_target_is_rejected(saved, field, value):
  target_config = CONFIG.replace(**{field: value})
  with pytest.raises(ValueError, match=rf"made for {field}={getattr(CONFIG, field)}, "
                                       rf"but the target has {field}={value}"):
    load_drafter(saved[0], target_config)


def test_other_layer_width_fails_on_the_tensor_shape(saved):
  # intermediate_size is not compared up front: the MLP tensors then disagree in shape
  with pytest.raises(ValueError, match=r"'layer\.mlp\.\w+\.kernel' has shape \(32, 64\)|"
                                       r"'layer\.mlp\.\w+\.kernel' has shape \(64, 32\)"):
    load_drafter(saved[0], CONFIG.replace(intermediate_size=48))


def test_missing_and_misshapen_tensors_are_named(tmp_path, saved):
  path, _ = saved
  (tmp_path / CONFIG_FILE).write_text((path / CONFIG_FILE).read_text())
  tensors = load_file(str(path / PARAMS_FILE))
  without = {k: v for k, v in tensors.items() if k != "fc.bias"}
  save_file(without, str(tmp_path / PARAMS_FILE))
  with pytest.raises(ValueError, match="missing tensor 'fc.bias'"):
    load_drafter(tmp_path)
  save_file({**tensors, "fc.bias": np.zeros((5,), np.float32)}, str(tmp_path / PARAMS_FILE))
  with pytest.raises(ValueError, match=r"'fc.bias' has shape \(5,\), expected \(32,\)"):
    load_drafter(tmp_path)


def test_saved_config_is_the_targets(saved):
  config = json.loads((saved[0] / CONFIG_FILE).read_text())
  assert config["hidden_size"] == CONFIG.hidden_size
  assert config["vocab_size"] == CONFIG.vocab_size
