"""Exact sampling distributions of a target model by enumeration, and chi-square helpers for the
losslessness tests of speculative decoding."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from tlt_jax.rollout.decode.sampling import filtered_logprobs


def chi_square_pvalue(counts, probs):
  """Pearson's test of ``counts`` against ``probs``; cells expecting fewer than 5 samples are
  pooled into one."""
  counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
  expected = probs * counts.sum()
  big = expected >= 5
  obs, exp = counts[big], expected[big]
  if (~big).any() and expected[~big].sum() > 0:
    obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
  exp = exp * obs.sum() / exp.sum()  # float rounding only
  return float(stats.chisquare(obs, exp).pvalue)


def prefix_logits(target, prompt, horizon):
  """Every token sequence of length ``horizon - 1`` after ``prompt`` and the target's logits
  for each of its ``horizon`` next tokens (uncached, one jitted pass): ``(prefixes [M, horizon
  - 1], logits [M, horizon, V])`` with ``M = V ** (horizon - 1)``, last position fastest."""
  vocab = target.config.vocab_size
  prefixes = np.array(list(itertools.product(range(vocab), repeat=horizon - 1)), np.int32)
  prefixes = prefixes.reshape(-1, horizon - 1)
  ids = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(prefixes), 1)), prefixes], 1)
  graphdef, state = nnx.split(target)
  run = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[:, len(prompt) - 1:])
  return prefixes, np.asarray(run(state, jnp.asarray(ids)), np.float32)


def exact_logprobs(logits, temperature, top_k=0, top_p=1.0):
  """``logits`` from ``prefix_logits`` as the filtered log-probs the engine samples from."""
  return np.asarray(filtered_logprobs(jnp.asarray(logits), jnp.float32(temperature),
                                      jnp.int32(top_k), jnp.float32(top_p)), np.float64)


def exact_sequences(prefixes, logp, stop_ids=()):
  """The exact law of the first ``horizon`` sampled tokens: every sequence scored with the
  target's filtered next-token log-probs ``logp [M, horizon, V]`` (from ``exact_logprobs``).

  Returns ``(seqs [M * V, horizon], probs [M * V])``. With stop ids, a sequence is cut after its
  first stop id and later positions hold ``V`` ("ended"); equal truncated sequences then repeat,
  and their probabilities add up wherever they are binned together.
  """
  vocab, horizon = logp.shape[-1], logp.shape[1]
  rows = np.arange(len(prefixes))
  head = sum((logp[rows, i, prefixes[:, i]] for i in range(horizon - 1)), np.zeros(len(rows)))
  probs = np.exp(head[:, None] + logp[:, horizon - 1]).ravel()  # last token fastest
  seqs = np.concatenate([np.repeat(prefixes, vocab, 0),
                         np.tile(np.arange(vocab, dtype=np.int32), len(prefixes))[:, None]], 1)
  if stop_ids:
    is_stop = np.isin(seqs, stop_ids)
    after = np.cumsum(is_stop, 1) - is_stop > 0  # strictly after the first stop
    seqs = np.where(after, vocab, seqs)
  return seqs, probs / probs.sum()


def sampled_logprobs_error(tokens, logprobs, logp):
  """Largest gap between the log-probs the engine reported for its tokens and the exact
  filtered log-probs ``logp`` (from ``exact_logprobs``) of those tokens after their prefixes."""
  vocab, horizon = logp.shape[-1], logp.shape[1]
  seqs = padded(tokens, horizon, 0)
  index = seqs[:, :-1] @ (vocab ** np.arange(horizon - 2, -1, -1))
  want = logp[index[:, None], np.arange(horizon)[None], seqs]
  got = padded([np.asarray(l) for l in logprobs], horizon, 0.0, np.float64)
  ended = np.arange(horizon)[None] >= np.array([len(t) for t in tokens])[:, None]
  return float(np.max(np.where(ended, 0.0, np.abs(got - want))))


def padded(rows, horizon, fill, dtype=np.int64):
  """Variable-length rows as ``[N, horizon]``, positions past a row's end set to ``fill``."""
  out = np.full((len(rows), horizon), fill, dtype)
  for r, t in enumerate(rows):
    out[r, :len(t)] = t
  return out


def window_pvalues(samples, seqs, probs, symbols, width):
  """p-values of every window of ``width`` adjacent positions: the sampled joint of the window
  against the exact one. ``symbols`` is the alphabet size (V, or V + 1 with "ended")."""
  out = {}
  horizon = seqs.shape[1]
  weights = symbols ** np.arange(width - 1, -1, -1)
  for i in range(horizon - width + 1):
    exact = np.bincount(seqs[:, i:i + width] @ weights, weights=probs, minlength=symbols ** width)
    counts = np.bincount(samples[:, i:i + width] @ weights, minlength=symbols ** width)
    assert counts[exact <= 0].sum() == 0, f"positions {i}..{i + width - 1}: impossible sample"
    out[(i, width)] = chi_square_pvalue(counts, exact)
  return out
