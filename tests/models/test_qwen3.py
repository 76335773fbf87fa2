"""Qwen3 (dense): logits and greedy parity with transformers' ``Qwen3ForCausalLM``, round trips,
and clear errors for the Qwen3 variants we do not run (mixture of experts, sliding windows)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests import hf_fixtures  # noqa: E402  pylint: disable=wrong-import-position
from tests.models.random_model import random_model  # noqa: E402
from tlt_jax.models import hf  # noqa: E402
from tlt_jax.models.model_config import ModelConfig  # noqa: E402
from tlt_jax.models.transformer import KVCache, Transformer  # noqa: E402
from tlt_jax.models.weights import hf_tensor_names  # noqa: E402

RELATIVE_TOLERANCE = 1e-5
GREEDY_STEPS = 64
PROMPT = [5, 17, 99, 3, 42, 8]
# (kv heads, head_dim, tied, attention_bias); hidden 64 and 4 heads: head_dim 16 is hidden / heads
SHAPES = {
    "gqa_tied": (2, 16, True, False),
    "gqa_untied_head_dim_24": (2, 24, False, False),
    "mqa_untied_head_dim_32_bias": (1, 32, False, True),
    "mha_tied_head_dim_8": (4, 8, True, False),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
  """Torch on one thread: its tiny forwards are ~40x slower when two threads share the CPUs."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


# the fast tier: a non-default head_dim with GQA, and MQA with the attention bias; the full tier
# also the tied shapes (tied heads are read as for Qwen2, whose tests cover them)
FAST_SHAPES = ("gqa_untied_head_dim_24", "mqa_untied_head_dim_32_bias")


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=() if name in FAST_SHAPES else pytest.mark.slow) for name in SHAPES])
def qwen3_dir(request, tmp_path_factory):
  """(directory, torch model, shape) of a random 2-layer HF Qwen3 checkpoint."""
  kv_heads, head_dim, tie, bias = SHAPES[request.param]
  path = tmp_path_factory.mktemp(request.param)
  torch_model = hf_fixtures.make_qwen3_checkpoint(path, seed=len(request.param), tie=tie,
                                                  num_kv_heads=kv_heads, head_dim=head_dim,
                                                  attention_bias=bias)
  return path, torch_model, SHAPES[request.param]


@nnx.jit
def _logits(model: Transformer, ids):
  return model(ids)


@nnx.jit
def _decode(model: Transformer, ids, cache: KVCache):
  """The last position's logits and the cache with ``ids`` committed."""
  out = model.forward(ids, cache=cache)
  return out.logits[:, -1], out.cache.advance(ids.shape[1])


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
  return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def our_greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
  """Greedy tokens through our KV cache: one prefill, then one-token decode steps."""
  cache = KVCache.create(model.config, 1, len(prompt) + steps)
  logits, cache = _decode(model, jnp.asarray([prompt], jnp.int32), cache)
  tokens = []
  for _ in range(steps):
    tokens.append(int(np.argmax(np.asarray(logits[0]))))
    logits, cache = _decode(model, jnp.asarray([[tokens[-1]]], jnp.int32), cache)
  return tokens


def torch_greedy(model, prompt: list[int], steps: int) -> list[int]:
  """transformers' greedy tokens from full forwards (no cache, no early stop at EOS)."""
  ids = list(prompt)
  for _ in range(steps):
    ids.append(int(np.argmax(torch_logits(model, np.array([ids]))[0, -1])))
  return ids[len(prompt):]


def test_logits_and_greedy_tokens_match_transformers(qwen3_dir):
  path, torch_model, (kv_heads, head_dim, tie, bias) = qwen3_dir
  model, config = hf.from_pretrained(path)
  assert (config.architecture, config.qk_norm, config.attention_bias) == ("qwen3", True, bias)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, kv_heads, head_dim)
  assert config.tie_word_embeddings is tie and config.rope_theta == 1e6
  assert model.layers[1].self_attn.k_norm.weight[...].shape == (head_dim,)
  ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 16)).astype(np.int32)
  reference = torch_logits(torch_model, ids)
  error = relative_error(np.asarray(_logits(model, jnp.asarray(ids))), reference)
  print(f"max relative logit error {error:.2e}")
  assert error < RELATIVE_TOLERANCE
  assert np.abs(reference).max() > 0.5  # the random weights give non-trivial logits
  expected = torch_greedy(torch_model, PROMPT, GREEDY_STEPS)
  assert len(set(expected)) > 3  # not one repeated token
  assert our_greedy(model, PROMPT, GREEDY_STEPS) == expected


def test_every_param_comes_from_the_checkpoint(qwen3_dir):
  path, torch_model, _ = qwen3_dir
  model, config = hf.from_pretrained(path)
  theirs = {name: p.detach().numpy() for name, p in torch_model.named_parameters()}
  ours = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  names = hf_tensor_names(config)
  assert set(ours) == set(names)
  assert {hf_name for hf_name, _ in names.values()} == set(theirs)  # q_norm / k_norm included
  for param_path, (hf_name, transposed) in names.items():
    value = np.asarray(ours[param_path][...])
    np.testing.assert_array_equal(value.T if transposed else value, theirs[hf_name])


def assert_same_params(a: Transformer, b: Transformer) -> None:
  flat_a = dict(nnx.to_flat_state(nnx.state(a, nnx.Param)))
  flat_b = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
  assert set(flat_a) == set(flat_b)
  for path, var in flat_a.items():
    np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(flat_b[path][...]), str(path))


@pytest.mark.parametrize("config", [
    ModelConfig.tiny(architecture="qwen3", attention_bias=False, bos_token_id=1, eos_token_id=2),
    ModelConfig.tiny(architecture="qwen3", attention_bias=True, tie_word_embeddings=False,
                     num_kv_heads=1, head_dim=12, rope_theta=1e6),
], ids=["tied", "untied_bias_head_dim_12"])
def test_ours_to_hf_and_back_is_exact(tmp_path, config):
  model = random_model(config, seed=2)
  hf.save_pretrained(model, config, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["architectures"] == ["Qwen3ForCausalLM"] and written["model_type"] == "qwen3"
  assert written["head_dim"] == config.head_dim and written["use_sliding_window"] is False
  reloaded, reloaded_config = hf.from_pretrained(tmp_path)
  assert reloaded_config == config
  assert_same_params(reloaded, model)
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert type(torch_model).__name__ == "Qwen3ForCausalLM"
  ids = np.random.RandomState(3).randint(0, config.vocab_size, (2, 20)).astype(np.int32)
  assert relative_error(np.asarray(_logits(model, jnp.asarray(ids))),
                        torch_logits(torch_model, ids)) < RELATIVE_TOLERANCE
  torch_model.save_pretrained(str(tmp_path / "again"))  # and what transformers writes back
  again, again_config = hf.from_pretrained(tmp_path / "again")
  assert again_config == config
  assert_same_params(again, model)


QWEN3_0P6B_CONFIG = {  # the fields of Qwen/Qwen3-0.6B's config.json (one layer here)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 1, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_config_of_a_released_qwen3_and_hf_head_dim_default():
  config = hf.config_from_hf(QWEN3_0P6B_CONFIG)
  assert (config.architecture, config.qk_norm, config.attention_bias) == ("qwen3", True, False)
  assert (config.head_dim, config.num_heads, config.num_kv_heads) == (128, 16, 8)  # 128 != 64
  assert (config.rope_theta, config.rope_scaling, config.dtype) == (1e6, None, "bfloat16")
  assert config.tie_word_embeddings and config.eos_token_ids == (151645,)
  assert hf.config_from_hf(hf.config_to_hf(config)) == config
  without = {k: v for k, v in QWEN3_0P6B_CONFIG.items() if k != "head_dim"}
  assert hf.config_from_hf(without).head_dim == transformers.Qwen3Config(**without).head_dim


def test_unsupported_qwen3_variants_are_named():
  moe = dict(QWEN3_0P6B_CONFIG, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
  with pytest.raises(ValueError, match=r"Mixture-of-experts model 'Qwen3MoeForCausalLM' is not "
                                       r"supported.*use a dense model: .*Qwen3ForCausalLM"):
    hf.config_from_hf(moe)
  with pytest.raises(ValueError, match="Sliding-window attention is not supported"):
    hf.config_from_hf(dict(QWEN3_0P6B_CONFIG, use_sliding_window=True, sliding_window=4096))
  with pytest.raises(ValueError, match="Sliding-window attention is not supported"):
    hf.config_from_hf(dict(QWEN3_0P6B_CONFIG, num_hidden_layers=2,
                           layer_types=["full_attention", "sliding_attention"]))
  with pytest.raises(ValueError, match=r"qk_norm=False does not fit architecture='qwen3'"):
    ModelConfig.tiny(architecture="qwen3", qk_norm=False)
  with pytest.raises(ValueError, match=r"qk_norm=True does not fit architecture='llama'.*"
                                       r"pass qk_norm=False"):
    ModelConfig.tiny(architecture="llama", qk_norm=True)
  assert not ModelConfig.tiny().qk_norm and ModelConfig.tiny(architecture="qwen3").qk_norm
