"""The bfloat16 serving path, with bf16 params or with float32 params computing in bf16 (mixed
precision): the model decodes through ``RolloutEngine.generate``, vanilla and speculative (random
EAGLE drafter, chain and tree), without dtype errors; greedy SD is token for token the vanilla
greedy output computed the same way; and bf16 logits stay close to fp32 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.random_model import random_model
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.instances import with_compute_dtype
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.speculative import SpecConfig

VOCAB = 48
CONFIG = ModelConfig.tiny(vocab_size=VOCAB)  # 2 layers, hidden 32, GQA 4/2, tied embeddings
STRATEGIES = {"chain": SpecConfig(depth=3, topk=1, verify_tokens=4),
              "tree": SpecConfig(depth=3, topk=2, verify_tokens=6)}
BASE = dict(max_batch=4, batch_buckets=(4,), max_prompt_len=16, prefill_buckets=(16,),
            max_new_tokens=24, kv_buckets=())  # one prefill + one segment executable per engine
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=())
SAMPLED = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop_token_ids=(5,))


def logits(model, ids) -> np.ndarray:
  """``model``'s logits for ``ids``, from one jitted forward."""
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(ids)))


def prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(3, VOCAB, n).tolist() for n in (5, 9, 16, 3)]


@pytest.fixture(scope="module", params=["bf16", "mixed"])
def target(request):
  """A model with large weights (peaked next-token distributions, so greedy paths vary and
  near-ties, which bf16 rounding may flip between batch shapes, are rare): bf16 params, or
  float32 params computing in bf16."""
  if request.param == "bf16":
    return random_model(CONFIG.replace(dtype="bfloat16"), seed=0, scale=0.5)
  return with_compute_dtype(random_model(CONFIG, seed=0, scale=0.5), "bfloat16")


@pytest.fixture(scope="module")
def engines(target):
  drafter = Drafter.create(target.config, seed=3)
  out = {"vanilla": RolloutEngine(target, config=EngineConfig(**BASE))}
  for name, spec in STRATEGIES.items():
    out[name] = RolloutEngine(target, drafter=drafter, config=EngineConfig(**BASE, spec=spec))
  return out


@pytest.fixture(scope="module")
def vanilla_greedy(engines):
  return engines["vanilla"].generate(prompts(), GREEDY)


def test_bf16_model_and_caches_really_are_bf16(target, engines):
  """Params in the model's dtype (bf16, or float32 under mixed precision); caches, features and
  activations in bf16 either way."""
  want = jnp.dtype(target.config.dtype)
  params = jax.tree.leaves(engines["vanilla"].params)
  assert params and all(p.dtype == want for p in params)
  drafter_params = jax.tree.leaves(engines["chain"].drafter_params)
  assert drafter_params and all(p.dtype == want for p in drafter_params)
  state = engines["tree"].pool.state_spec(4, engines["tree"].config.cache_len)
  assert state.cache.k[0].dtype == jnp.bfloat16 and state.dcache.k[0].dtype == jnp.bfloat16
  assert state.feats.dtype == jnp.bfloat16  # target features the drafter reads
  assert state.logprobs.dtype == jnp.float32  # log-probs are reported in fp32 whatever the model
  assert logits(target, [[3, 4, 5]]).dtype == np.float32  # logits too


def test_vanilla_bf16_decodes(vanilla_greedy):
  result = vanilla_greedy
  assert [len(t) for t in result.tokens] == [24] * 4
  assert all(0 <= t < VOCAB for row in result.tokens for t in row)
  assert len({tuple(t) for t in result.tokens}) == 4  # distinct rows: not stuck on one token
  for lp in result.logprobs:
    assert lp.dtype == np.float32 and np.all(np.isfinite(lp)) and np.all(lp <= 0)


@pytest.mark.parametrize("strategy", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_greedy_speculative_equals_vanilla_in_bf16(engines, vanilla_greedy, strategy):
  """Greedy SD emits the target's argmax after each prefix, so it equals vanilla as long as the
  verify pass (T tokens) rounds each row's logits as the one-token decode does. That holds on the
  CPU here, exact bf16 ties included (they break to the lowest id alike). On a GPU, matmuls of
  other shapes may accumulate in another order, and a near-tie can then flip:
  experiments/system/accelerator_check.py records where and by how much."""
  result = engines[strategy].generate(prompts(), GREEDY)
  assert result.tokens == vanilla_greedy.tokens
  assert result.stats.mean_accept_len >= 1.0
  for got, want in zip(result.logprobs, vanilla_greedy.logprobs):
    # the same tokens; their log-probs come from a T-token verify pass instead of T one-token
    # passes, so in bf16 they agree up to rounding (see test_bf16_logits_close_to_fp32)
    np.testing.assert_allclose(got, want, atol=0.1)


# the tree engine is built (and warmed up) by the greedy test above: both are in the full tier
@pytest.mark.parametrize("strategy", ["vanilla", "chain",
                                      pytest.param("tree", marks=pytest.mark.slow)])
def test_sampled_bf16_decoding_runs(engines, strategy):
  result = engines[strategy].generate(prompts(), SAMPLED)  # same executables, traced params
  assert result.stats.compiles == 0
  for row, lp in zip(result.tokens, result.logprobs):
    assert 1 <= len(row) <= 24 and all(0 <= t < VOCAB for t in row)
    assert lp.dtype == np.float32 and np.all(np.isfinite(lp)) and np.all(lp <= 0)
  if strategy != "vanilla":
    assert result.stats.mean_accept_len >= 1.0


def test_bf16_logits_close_to_fp32():
  """The same weights in fp32 (matmuls at full precision) and in bf16, on 4 x 32 tokens.

  Tolerance: bf16 keeps 8 significant bits, so each rounding (of a weight, of every matmul,
  norm and residual output) is off by up to 2^-9 = 0.2% relative. This model's logits reach
  about 4 (norms ~1, N(0, 0.2^2) weights, hidden 32) and pass through ~10 roundings per layer
  over 2 layers; errors of a few percent of the logit scale, ~0.1, are expected (measured: at
  most 0.14 over seeds 0-2). We allow 0.3 on the log-probs of tokens fp32 gives >= 1e-3, and a
  mean error below 0.03 over the whole vocabulary. A real dtype bug (a cache or feature stored
  in the wrong dtype, fp16-style overflow, positions rounded in bf16) gives errors of order 1,
  or NaNs, instead.
  """
  ids = np.random.default_rng(1).integers(0, VOCAB, (4, 32))
  m32 = random_model(CONFIG, seed=0)
  with jax.default_matmul_precision("highest"):
    lp32 = np.asarray(jax.nn.log_softmax(logits(m32, ids), -1))
  # bf16 params, and (mixed precision) float32 params computing in bf16
  for m16 in (random_model(CONFIG.replace(dtype="bfloat16"), seed=0),
              with_compute_dtype(m32, "bfloat16")):
    lp16 = np.asarray(jax.nn.log_softmax(logits(m16, ids), -1))
    diff = np.abs(lp32 - lp16)
    assert np.all(np.isfinite(lp16))
    assert diff.max() > 0  # the model really computes in bf16
    assert diff[np.exp(lp32) >= 1e-3].max() < 0.3
    assert diff.mean() < 0.03
    assert (lp32.argmax(-1) == lp16.argmax(-1)).mean() >= 0.95
