"""Drafter checkpoints: save/load round trips and the errors of ``load_drafter``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.models.random_model import random_model
from tests.xla_env import subprocess_env
from tlt_jax.job.build import DEFAULT_CONFIG, build_job
from tlt_jax.job.typed_config import load_config_file
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import CONFIG_FILE, PARAMS_FILE, load_drafter, save_drafter
from tlt_jax.models.weights import WeightsError

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


def test_vocab_ids_outside_the_targets_vocabulary_are_refused(tmp_path):
  save_drafter(Drafter.create(CONFIG, draft_vocab_size=4), tmp_path)
  tensors = load_file(str(tmp_path / PARAMS_FILE))
  for bad in ([0, 1, 2, CONFIG.vocab_size], [-1, 0, 1, 2], [0, 1, 1, 2]):
    save_file({**tensors, "vocab_ids": np.asarray(bad, np.int32)}, str(tmp_path / PARAMS_FILE))
    with pytest.raises(WeightsError, match=r"must hold distinct ids in \[0, 32\)"):
      load_drafter(tmp_path)


def test_saved_config_is_the_targets(saved):
  config = json.loads((saved[0] / CONFIG_FILE).read_text())
  assert config["hidden_size"] == CONFIG.hidden_size
  assert config["vocab_size"] == CONFIG.vocab_size


# ----------------------------------------------------------------------------- damaged files


def copy_drafter(source, target):
  """A writable copy of a saved drafter directory."""
  target.mkdir(parents=True)
  for name in (PARAMS_FILE, CONFIG_FILE):
    (target / name).write_bytes((source / name).read_bytes())
  return target


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_tensor_is_named(tmp_path, saved, bad):
  path = copy_drafter(saved[0], tmp_path / "d")
  tensors = load_file(str(path / PARAMS_FILE))
  tensors["layer.mlp.up_proj.kernel"][1, 2] = bad
  save_file(tensors, str(path / PARAMS_FILE))
  with pytest.raises(WeightsError, match=r"drafter\.safetensors: tensor 'layer\.mlp\.up_proj\."
                                         r"kernel' holds 1 NaN/Inf values .*its training"):
    load_drafter(path, CONFIG)


def test_truncated_garbled_and_broken_config_are_one_line_errors(tmp_path, saved):
  data = (saved[0] / PARAMS_FILE).read_bytes()
  for cut in (len(data) - 10, len(data) // 2, 3):
    path = copy_drafter(saved[0], tmp_path / f"cut{cut}")
    (path / PARAMS_FILE).write_bytes(data[:cut])
    with pytest.raises(WeightsError, match=rf"cut{cut}/drafter\.safetensors is not a readable "
                                           r"safetensors file .*truncated"):
      load_drafter(path)
  path = copy_drafter(saved[0], tmp_path / "config")
  (path / CONFIG_FILE).write_text('{"hidden_size": ')
  with pytest.raises(ValueError, match=r"drafter_config\.json is not valid JSON"):
    load_drafter(path)
  config = json.loads((saved[0] / CONFIG_FILE).read_text())
  del config["num_attention_heads"]
  (path / CONFIG_FILE).write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"drafter_config\.json lacks the required key "
                                       r"'num_attention_heads'"):
    load_drafter(path)


def test_train_cli_reports_a_damaged_drafter_in_one_line(tmp_path):
  cfg = load_config_file(DEFAULT_CONFIG)
  cfg.logdir = str(tmp_path / "run")
  policy_config = build_job(cfg).model_config  # the default job's policy
  root = Path(__file__).resolve().parents[2]
  env = subprocess_env()
  drafter_dir = tmp_path / "drafter"
  save_drafter(random_drafter(policy_config), drafter_dir)
  tensors = load_file(str(drafter_dir / PARAMS_FILE))
  tensors["fc.kernel"][0, :4] = np.nan
  save_file(tensors, str(drafter_dir / PARAMS_FILE))
  for damage in ("nan", "truncated"):
    if damage == "truncated":
      data = (drafter_dir / PARAMS_FILE).read_bytes()
      (drafter_dir / PARAMS_FILE).write_bytes(data[:len(data) // 2])
    done = subprocess.run([sys.executable, "-m", "tlt_jax.train", f"--config.logdir={cfg.logdir}",
                           f"--config.drafter={drafter_dir}"], capture_output=True, text=True,
                          timeout=300, cwd=root, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and len(lines) <= 2, done.stderr
    want = ("tensor 'fc.kernel' holds 4 NaN/Inf values" if damage == "nan" else
            "drafter.safetensors is not a readable safetensors file")
    assert want in lines[0] and str(drafter_dir) in lines[0], lines[0]
