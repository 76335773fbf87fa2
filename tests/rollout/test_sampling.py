"""The token sampler's filters against a NumPy reference, and its empirical distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout.sampling import SamplerArgs, SamplingParams, filtered_logprobs, row_keys, \
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
