"""Hugging Face checkpoint I/O: logits parity with transformers, shards, round trips, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from tests.hf_fixtures import VOCAB_SIZE, make_llama_checkpoint, make_qwen2_checkpoint  # noqa: E402
from tlt_jax.models import hf  # noqa: E402
from tlt_jax.models.weights import WeightsError, hf_tensor_names  # noqa: E402
from tlt_jax.models.model_config import ModelConfig, RopeScaling  # noqa: E402
from tests.models.random_model import random_model  # noqa: E402
from tests.xla_env import subprocess_env  # noqa: E402
from tlt_jax.models.transformer import Transformer  # noqa: E402

TOLERANCE = 1e-4
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def token_batch(batch: int = 2, length: int = 12, vocab: int = VOCAB_SIZE, seed: int = 0):
  """Random token ids ``[batch, length]`` as numpy int32."""
  return np.random.RandomState(seed).randint(0, vocab, (batch, length)).astype(np.int32)


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
  """transformers' logits for ``ids`` as float32 numpy."""
  with torch.no_grad():
    return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


@nnx.jit
def _jitted_logits(model: Transformer, ids):
  return model(ids)


def our_logits(model: Transformer, ids: np.ndarray) -> np.ndarray:
  """Our logits for ``ids`` as numpy (jitted: one compile is far cheaper than eager op-by-op)."""
  return np.asarray(_jitted_logits(model, jnp.asarray(ids)))


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.max(np.abs(a - b)))


def assert_same_params(a: Transformer, b: Transformer) -> None:
  """Both models hold exactly the same params (names, dtypes and values)."""
  flat_a = dict(nnx.to_flat_state(nnx.state(a, nnx.Param)))
  flat_b = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
  assert set(flat_a) == set(flat_b)
  for path, var in flat_a.items():
    x, y = np.asarray(var.get_value()), np.asarray(flat_b[path].get_value())
    assert x.dtype == y.dtype, path
    np.testing.assert_array_equal(x, y, err_msg=str(path))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
  """A tiny Qwen2 checkpoint directory and its torch model."""
  path = tmp_path_factory.mktemp("qwen2")
  return path, make_qwen2_checkpoint(path, seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  """A tiny untied Llama checkpoint directory and its torch model."""
  path = tmp_path_factory.mktemp("llama")
  return path, make_llama_checkpoint(path, seed=1)


def copy_checkpoint(source, tmp_path):
  """A writable copy of a checkpoint directory."""
  target = tmp_path / "copy"
  shutil.copytree(source, target)
  return target


def test_qwen2_logits_match_transformers(qwen2_dir):
  path, torch_model = qwen2_dir
  model, config = hf.from_pretrained(path)
  assert config.architecture == "qwen2"
  assert config.tie_word_embeddings and config.attention_bias
  assert (config.num_heads, config.num_kv_heads) == (4, 2)
  assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
  ids = token_batch(batch=3, length=12)
  reference = torch_logits(torch_model, ids)
  assert max_diff(our_logits(model, ids), reference) < TOLERANCE
  assert np.abs(reference).max() > 0.5  # the random weights give non-trivial logits


def test_llama_logits_match_transformers(llama_dir):
  path, torch_model = llama_dir
  model, config = hf.from_pretrained(path)
  assert config.architecture == "llama"
  assert not config.tie_word_embeddings and not config.attention_bias
  assert config.head_dim == 32 and config.eos_token_ids == (2, 3)
  ids = token_batch(batch=2, length=10, seed=1)
  assert max_diff(our_logits(model, ids), torch_logits(torch_model, ids)) < TOLERANCE


def test_a_config_without_tie_word_embeddings_keeps_its_own_head(tmp_path, llama_dir):
  # transformers' Llama and Qwen2 configs default to an untied head: a config.json that omits the
  # key (many do) must still read lm_head.weight, not tie the head to the embedding
  path, torch_model = llama_dir
  copy = copy_checkpoint(path, tmp_path)
  cfg = json.loads((copy / "config.json").read_text())
  del cfg["tie_word_embeddings"]
  (copy / "config.json").write_text(json.dumps(cfg))
  assert not transformers.AutoConfig.from_pretrained(str(copy)).tie_word_embeddings
  model, config = hf.from_pretrained(copy)
  assert not config.tie_word_embeddings
  ids = token_batch(batch=2, length=10, seed=3)
  assert max_diff(our_logits(model, ids), torch_logits(torch_model, ids)) < TOLERANCE


def test_llama3_rope_scaling_matches_transformers(tmp_path):
  torch_model = make_llama_checkpoint(tmp_path, seed=2, rope_scaling=LLAMA3_SCALING)
  model, config = hf.from_pretrained(tmp_path)
  assert config.rope_scaling == RopeScaling(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=16)
  ids = token_batch(batch=2, length=40, seed=2)
  reference = torch_logits(torch_model, ids)
  assert max_diff(our_logits(model, ids), reference) < TOLERANCE
  # The scaling matters at these lengths: the unscaled model is visibly different.
  unscaled = random_model(config.replace(rope_scaling=None))
  nnx.update(unscaled, nnx.state(model))
  assert max_diff(our_logits(unscaled, ids), reference) > 1e-2


def test_sharded_checkpoint_loads_identically(tmp_path, qwen2_dir):
  path, torch_model = qwen2_dir
  torch_model.save_pretrained(str(tmp_path), max_shard_size="40KB")
  assert (tmp_path / hf.WEIGHTS_INDEX_FILE).is_file()
  assert not (tmp_path / hf.WEIGHTS_FILE).exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  sharded, sharded_config = hf.from_pretrained(tmp_path)
  single, single_config = hf.from_pretrained(path)
  assert sharded_config == single_config
  assert_same_params(sharded, single)
  ids = token_batch()
  np.testing.assert_array_equal(our_logits(sharded, ids), our_logits(single, ids))


@pytest.mark.parametrize("config", [
    ModelConfig.tiny(bos_token_id=1, eos_token_id=(2, 3)),
    ModelConfig.tiny(architecture="llama", attention_bias=False, tie_word_embeddings=False,
                     head_dim=16, rope_theta=5e5,
                     rope_scaling=RopeScaling(original_max_position_embeddings=16)),
    ModelConfig.tiny(architecture="llama", attention_bias=True,
                     rope_scaling=RopeScaling(rope_type="linear", factor=4.0)),
], ids=["qwen2_tied", "llama_llama3_untied", "llama_bias_linear"])
def test_save_pretrained_round_trip(tmp_path, config):
  model = random_model(config, seed=3)
  hf.save_pretrained(model, config, tmp_path)
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert type(torch_model).__name__ == hf.ARCHITECTURES[config.architecture]
  ids = token_batch(length=40, vocab=config.vocab_size, seed=3)
  assert max_diff(our_logits(model, ids), torch_logits(torch_model, ids)) < TOLERANCE
  reloaded, reloaded_config = hf.from_pretrained(tmp_path)
  assert reloaded_config == config
  assert_same_params(reloaded, model)
  np.testing.assert_array_equal(our_logits(reloaded, ids), our_logits(model, ids))
  # HF writes back what it read: a second round trip through transformers is exact too
  torch_model.save_pretrained(str(tmp_path / "again"))
  again, again_config = hf.from_pretrained(tmp_path / "again")
  assert again_config.replace(dtype=config.dtype) == config
  assert_same_params(again, model)


def test_bf16_checkpoint_and_dtype_override(tmp_path):
  config = ModelConfig.tiny(dtype="bfloat16")
  model = random_model(config, seed=4)
  hf.save_pretrained(model, config, tmp_path)
  assert load_file(str(tmp_path / hf.WEIGHTS_FILE))["model.norm.weight"].dtype.name == "bfloat16"
  as_bf16, bf16_config = hf.from_pretrained(tmp_path)
  assert bf16_config == config
  assert as_bf16.embed_tokens.embedding[...].dtype == jnp.bfloat16
  assert_same_params(as_bf16, model)
  ids = token_batch(vocab=config.vocab_size, seed=4)
  np.testing.assert_array_equal(our_logits(as_bf16, ids), our_logits(model, ids))
  as_fp32, fp32_config = hf.from_pretrained(tmp_path, dtype="float32")
  assert fp32_config == config.replace(dtype="float32")
  upcast = random_model(fp32_config)
  nnx.update(upcast, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model, nnx.Param)))
  assert_same_params(as_fp32, upcast)  # bf16 values widen exactly


def test_config_from_hf_reads_legacy_rope_fields():
  legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "rope_theta": 123.0, "torch_dtype": "bfloat16",
            "rope_scaling": {"type": "linear", "factor": 2.0}}
  config = hf.config_from_hf(legacy)
  assert config.rope_theta == 123.0 and config.num_kv_heads == 2
  assert config.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
  assert config.dtype == "bfloat16"
  assert hf.config_from_hf(legacy, dtype="float32").dtype == "float32"
  assert hf.config_from_hf(hf.config_to_hf(config)) == config


def test_config_from_hf_reads_qwen25_style_config():
  qwen25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 32,
            "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6,
            "rope_scaling": None, "sliding_window": 4096, "use_sliding_window": False,
            "max_window_layers": 21, "torch_dtype": "bfloat16", "eos_token_id": 7}
  config = hf.config_from_hf(qwen25)
  assert (config.rope_theta, config.rope_scaling, config.attention_bias) == (1e6, None, True)
  assert (config.num_kv_heads, config.head_dim, config.eos_token_ids) == (2, 4, (7,))
  with pytest.raises(ValueError, match="Sliding-window"):
    hf.config_from_hf({**qwen25, "use_sliding_window": True})


def test_unrepresentable_configs_are_rejected(tmp_path):
  with pytest.raises(ValueError, match="attention_bias=False"):
    hf.config_to_hf(ModelConfig.tiny(attention_bias=False))


def test_llama_attention_bias_includes_o_proj(tmp_path):
  """HF Llama's ``attention_bias`` biases q/k/v *and* o; a non-zero o bias must load and match."""
  config = ModelConfig.tiny(architecture="llama", attention_bias=True)
  hf.save_pretrained(random_model(config), config, tmp_path)
  tensors = load_file(str(tmp_path / hf.WEIGHTS_FILE))
  assert "model.layers.1.self_attn.o_proj.bias" in tensors
  tensors["model.layers.1.self_attn.o_proj.bias"] += 0.5
  save_file(tensors, str(tmp_path / hf.WEIGHTS_FILE), metadata={"format": "pt"})
  model, _ = hf.from_pretrained(tmp_path)
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9))
  with torch.no_grad():
    expected = torch_model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=1e-4)


def test_unknown_architecture_is_rejected():
  with pytest.raises(ValueError, match=r"MistralForCausalLM.*Qwen2ForCausalLM.*LlamaForCausalLM"):
    hf.config_from_hf({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})


def test_unsupported_rope_type_is_rejected():
  with pytest.raises(ValueError, match="yarn"):
    hf.config_from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                       "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_config_json(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf.from_pretrained(tmp_path)


def test_broken_or_incomplete_config_json_names_the_file(tmp_path, llama_dir):
  source = llama_dir[0]
  broken = tmp_path / "broken"
  shutil.copytree(source, broken)
  (broken / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"broken/config.json is not valid JSON"):
    hf.from_pretrained(broken)
  incomplete = tmp_path / "incomplete"
  shutil.copytree(source, incomplete)
  cfg = json.loads((source / "config.json").read_text())
  del cfg["hidden_size"]
  (incomplete / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"incomplete/config.json lacks the required key "
                                       r"'hidden_size'"):
    hf.from_pretrained(incomplete)


def test_missing_tensor_is_named(tmp_path, llama_dir):
  path = copy_checkpoint(llama_dir[0], tmp_path)
  tensors = load_file(str(path / hf.WEIGHTS_FILE))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(path / hf.WEIGHTS_FILE), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    hf.from_pretrained(path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, llama_dir):
  path = copy_checkpoint(llama_dir[0], tmp_path)
  tensors = load_file(str(path / hf.WEIGHTS_FILE))
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
  save_file(tensors, str(path / hf.WEIGHTS_FILE), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*"
                                       r"shape \(32, 64\), expected \(64, 64\)"):
    hf.from_pretrained(path)


def test_missing_shard_file_is_named(tmp_path, qwen2_dir):
  qwen2_dir[1].save_pretrained(str(tmp_path), max_shard_size="40KB")
  index = json.loads((tmp_path / hf.WEIGHTS_INDEX_FILE).read_text())
  shard = index["weight_map"]["model.norm.weight"]
  (tmp_path / shard).unlink()
  with pytest.raises(FileNotFoundError, match=shard):
    hf.from_pretrained(tmp_path)


def test_extra_tensors(tmp_path, qwen2_dir):
  path = copy_checkpoint(qwen2_dir[0], tmp_path)
  tensors = load_file(str(path / hf.WEIGHTS_FILE))
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((8,), np.float32)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # harmless when tied
  save_file(tensors, str(path / hf.WEIGHTS_FILE), metadata={"format": "pt"})
  reference, _ = hf.from_pretrained(qwen2_dir[0])
  tolerated, _ = hf.from_pretrained(path)
  assert_same_params(tolerated, reference)  # the extras are ignored, nothing else changes
  tensors["model.layers.7.mlp.up_proj.weight"] = np.ones((2, 2), np.float32)
  save_file(tensors, str(path / hf.WEIGHTS_FILE), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.7\.mlp\.up_proj"):
    hf.from_pretrained(path)
  lenient, _ = hf.from_pretrained(path, strict=False)
  assert_same_params(lenient, reference)


def test_every_param_comes_from_the_checkpoint(qwen2_dir):
  path, torch_model = qwen2_dir
  model, config = hf.from_pretrained(path)
  torch_params = {name: p.detach().numpy() for name, p in torch_model.named_parameters()}
  ours = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  names = hf_tensor_names(config)
  assert set(ours) == set(names)
  for param_path, (hf_name, transposed) in names.items():
    value = np.asarray(ours[param_path][...])
    np.testing.assert_array_equal(value.T if transposed else value, torch_params[hf_name])


# ----------------------------------------------------------------------------- damaged weights


def one_line_error(proc) -> str:
  """The ``error:`` line of a failed entry point run (asserting rc 1 and no traceback)."""
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert lines[0].startswith("error: ") and len(lines) <= 2, proc.stderr[-2000:]
  return lines[0]


def run_generate(path):
  """``python -m tlt_jax.generate --config.model.path=path`` as a user runs it."""
  root = Path(__file__).resolve().parents[2]
  env = subprocess_env()
  return subprocess.run([sys.executable, "-m", "tlt_jax.generate", f"--config.model.path={path}",
                         "--prompt", "1+2=?"], capture_output=True, text=True, timeout=300,
                        cwd=root, env=env)


def overwrite(file, offset: int, data: bytes) -> None:
  """Overwrites ``len(data)`` bytes of ``file`` at ``offset`` in place."""
  with open(file, "r+b") as f:
    f.seek(offset)
    f.write(data)


def data_offset(file, name: str) -> int:
  """Where tensor ``name``'s bytes start in a safetensors file."""
  raw = Path(file).read_bytes()
  header_len = int.from_bytes(raw[:8], "little")
  return 8 + header_len + json.loads(raw[8:8 + header_len])[name]["data_offsets"][0]


def test_nonfinite_count_in_every_float_dtype():
  """The one NaN/Inf counter of loading and checkpointing (utils.nonfinite_count)."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from tlt_jax.utils import nonfinite_count  # pylint: disable=import-outside-toplevel
  for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
    values = np.linspace(-3e4, 3e4, 1000).astype(dtype)
    assert nonfinite_count(values) == 0, dtype
    values[[3, 500]] = np.nan
    values[999] = np.inf
    values[0] = -np.inf
    assert nonfinite_count(values) == 4, dtype
  assert nonfinite_count(np.arange(10, dtype=np.int32)) == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_values_are_named(tmp_path, llama_dir, bad):
  path = copy_checkpoint(llama_dir[0], tmp_path)
  tensors = load_file(str(path / hf.WEIGHTS_FILE))
  tensors["model.layers.1.mlp.down_proj.weight"][5, 7] = bad
  save_file(tensors, str(path / hf.WEIGHTS_FILE), metadata={"format": "pt"})
  with pytest.raises(WeightsError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp"
                                         r"\.down_proj\.weight' holds 1 NaN/Inf values"):
    hf.from_pretrained(path)


def test_nonfinite_bf16_checkpoint_is_caught(tmp_path):
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  config = ModelConfig.tiny(vocab_size=32, num_layers=1, dtype="bfloat16")
  hf.save_pretrained(random_model(config), config, tmp_path)
  tensors = load_file(str(tmp_path / hf.WEIGHTS_FILE))
  assert tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16
  tensors["model.norm.weight"][:3] = np.nan
  save_file(tensors, str(tmp_path / hf.WEIGHTS_FILE), metadata={"format": "pt"})
  with pytest.raises(WeightsError, match=r"'model\.norm\.weight' holds 3 NaN/Inf values"):
    hf.from_pretrained(tmp_path)


def test_overwritten_truncated_and_garbled_files_are_one_line_errors(tmp_path, llama_dir):
  source = llama_dir[0]
  weights = source / hf.WEIGHTS_FILE
  nan = copy_checkpoint(source, tmp_path / "nan")  # a damaged file: 400 bytes overwritten
  overwrite(nan / hf.WEIGHTS_FILE, data_offset(weights, "model.layers.0.mlp.up_proj.weight"),
            b"\xff" * 400)
  with pytest.raises(WeightsError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' holds "
                                         r"100 NaN/Inf values .*download or export it again"):
    hf.from_pretrained(nan)
  data = weights.read_bytes()
  for cut in (len(data) - 100, len(data) // 2, 100, 5, 0):
    cut_dir = copy_checkpoint(source, tmp_path / f"cut{cut}")
    (cut_dir / hf.WEIGHTS_FILE).write_bytes(data[:cut])
    with pytest.raises(WeightsError, match=rf"cut{cut}/copy/model\.safetensors is not a "
                                           r"readable safetensors file .*truncated"):
      hf.from_pretrained(cut_dir)
  garbled = copy_checkpoint(source, tmp_path / "garbled")
  overwrite(garbled / hf.WEIGHTS_FILE, 8, b"\x00garbage" * 50)  # inside the JSON header
  with pytest.raises(WeightsError, match="is not a readable safetensors file"):
    hf.from_pretrained(garbled)


def test_broken_shard_index_is_named(tmp_path, qwen2_dir):
  qwen2_dir[1].save_pretrained(str(tmp_path), max_shard_size="40KB")
  index = tmp_path / hf.WEIGHTS_INDEX_FILE
  index.write_text('{"weight_map": ')
  with pytest.raises(WeightsError, match=r"model\.safetensors\.index\.json is not a valid "
                                         r"shard index"):
    hf.from_pretrained(tmp_path)
  index.write_text('{"metadata": {}}')
  with pytest.raises(WeightsError, match="KeyError: 'weight_map'"):
    hf.from_pretrained(tmp_path)


def test_nonfinite_shard_is_named(tmp_path, qwen2_dir):
  qwen2_dir[1].save_pretrained(str(tmp_path), max_shard_size="40KB")
  index = json.loads((tmp_path / hf.WEIGHTS_INDEX_FILE).read_text())
  shard = tmp_path / index["weight_map"]["model.norm.weight"]
  tensors = load_file(str(shard))
  tensors["model.norm.weight"][0] = np.inf
  save_file(tensors, str(shard), metadata={"format": "pt"})
  with pytest.raises(WeightsError, match=rf"{shard.name}: tensor 'model\.norm\.weight'"):
    hf.from_pretrained(tmp_path)


def test_generate_cli_reports_damaged_weights_in_one_line(tmp_path, llama_dir):
  source = llama_dir[0]
  nan = copy_checkpoint(source, tmp_path / "nan")
  overwrite(nan / hf.WEIGHTS_FILE,
            data_offset(source / hf.WEIGHTS_FILE, "model.layers.1.self_attn.q_proj.weight"),
            b"\xff" * 400)
  line = one_line_error(run_generate(nan))
  assert "'model.layers.1.self_attn.q_proj.weight' holds 100 NaN/Inf values" in line, line
  assert str(nan / hf.WEIGHTS_FILE) in line
  cut = copy_checkpoint(source, tmp_path / "cut")
  data = (source / hf.WEIGHTS_FILE).read_bytes()
  (cut / hf.WEIGHTS_FILE).write_bytes(data[:len(data) // 3])
  line = one_line_error(run_generate(cut))
  assert f"{cut / hf.WEIGHTS_FILE} is not a readable safetensors file" in line, line
