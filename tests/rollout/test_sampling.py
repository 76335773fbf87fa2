"""The token sampler against a NumPy reference, its empirical distribution, SamplingParams checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout.decode.sampling import SamplerArgs, SamplingParams, filtered_logprobs, row_keys, \
    sample_tokens


def reference_probs(logits, temperature, top_k, top_p):
  x = logits / (temperature if temperature > 0 else 1.0)
  order = np.argsort(-x, kind="stable")
  keep = np.ones_like(x, bool)
  if 0 < top_k < len(x):
    keep[order[top_k:]] = False
  p = np.exp(x - x.max()) * keep
  p /= p.sum()
  if top_p < 1.0:
    sorted_p = p[order]
    before = np.cumsum(sorted_p) - sorted_p
    drop = order[before >= top_p]
    keep[drop] = False
  p = np.exp(x - x.max()) * keep
  return p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (1.5, 5, 0.8), (0.0, 0, 1.0)])
def test_filtered_logprobs_match_reference(temperature, top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(4, 12)).astype(np.float32) * 2
  got = np.exp(np.asarray(filtered_logprobs(jnp.asarray(logits), jnp.float32(temperature),
                                            jnp.int32(top_k), jnp.float32(top_p))))
  for row, expect in zip(got, (reference_probs(l, temperature, top_k, top_p) for l in logits)):
    np.testing.assert_allclose(row, expect, atol=1e-6)


def test_sampler_empirical_distribution_chi_square():
  from scipy import stats  # pylint: disable=import-outside-toplevel
  logits = np.random.default_rng(1).normal(size=(8,)).astype(np.float32)
  params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, seed=0)
  args = SamplerArgs.from_params(params, (), 1)
  n = 40000
  rows = jnp.arange(n, dtype=jnp.int32)
  keys = row_keys(jnp.uint32(0), rows, jnp.zeros_like(rows))
  tokens, _ = jax.jit(sample_tokens)(jnp.broadcast_to(logits, (n, 8)), keys, args)
  counts = np.bincount(np.asarray(tokens), minlength=8)
  expect = reference_probs(logits, 0.8, 6, 0.95) * n
  support = expect > 0
  assert counts[~support].sum() == 0
  assert stats.chisquare(counts[support], expect[support]).pvalue > 1e-3


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int, got 0"),
    (dict(max_new_tokens=-3), "max_new_tokens must be a positive int, got -3"),
    (dict(max_new_tokens=8.0), "max_new_tokens must be a positive int, got 8.0"),
    (dict(temperature=-0.1), r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\], got 1.01"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
    (dict(top_k=2.0), "top_k must be an int"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*32\), got -1"),
    (dict(seed=2**32), r"seed must be an int in \[0, 2\*\*32\), got 4294967296"),
    (dict(seed=1.0), r"seed must be an int in \[0, 2\*\*32\)"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int, got True"),
    (dict(top_k=False), "top_k must be an int, got False"),
    (dict(seed=True), "seed must be an int, got True"),
])
def test_sampling_params_validation(kwargs, message):
  with pytest.raises(ValueError, match=rf"SamplingParams\.{message}"):
    SamplingParams(**kwargs)


def test_sampling_params_accepts_edge_values():
  params = SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, seed=2**32 - 1,
                          stop_token_ids=[np.int64(4), 7])
  assert params.stop_token_ids == (4, 7) and all(type(t) is int for t in params.stop_token_ids)
  hash(params)
  assert SamplingParams(stop_token_ids=[]).stop_token_ids == ()
  assert SamplingParams().stop_token_ids is None  # None: the model's EOS ids
  args = SamplerArgs.from_params(SamplingParams(top_p=1e-9, seed=5), (3, 9), 4)
  np.testing.assert_array_equal(args.stop_ids, [3, 9, -1, -1])
  assert int(args.seed) == 5
  with pytest.raises(ValueError, match="stop_token_ids has 3 ids but the engine allows 2"):
    SamplerArgs.from_params(SamplingParams(), (1, 2, 3), 2)
