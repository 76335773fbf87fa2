"""A drafter with a reduced draft vocabulary (its head over K target ids; q = 0 outside them):
the mapping, the loss over the subset, checkpoints, and greedy SD that stays token-identical.

(The sampled law with a reduced vocabulary is tested with the other chi-square cases in
tests/rollout/test_lossless_deep.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import mirror_drafter, sharp_random_model
from tlt_jax.drafter.objective import (drafter_loss, make_batch_from_sequences, make_optimizer,
                                   make_train_step, split_drafter)
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import (Drafter, most_frequent_ids, spread_to_vocab,
                                    token_frequencies)
from tlt_jax.models.drafter_io import load_drafter, save_drafter
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.utils import compile_count

VOCAB = 32
SUBSET = np.array([0, 2, 3, 5, 7, 8, 11, 13, 17, 19, 20, 23, 29, 31])


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(ModelConfig.tiny(vocab_size=VOCAB, num_layers=1), seed=1)


def reduced_mirror(target, ids=SUBSET):
  drafter = mirror_drafter(target)
  drafter.set_draft_vocab(target, ids)
  return drafter


def test_head_starts_as_the_targets_rows_and_maps_back_to_target_ids(target):
  drafter = reduced_mirror(target)
  assert drafter.draft_vocab_size == len(SUBSET)
  hidden = jax.random.normal(jax.random.key(0), (2, 3, target.config.hidden_size))
  full = np.asarray(target.lm_logits(hidden))
  np.testing.assert_allclose(np.asarray(drafter.head(hidden)), full[..., SUBSET], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(drafter.target_logits(target, hidden)),
                             full[..., SUBSET], rtol=1e-5, atol=1e-5)
  index = jnp.array([[0, 3, 13]])
  np.testing.assert_array_equal(np.asarray(drafter.to_target_ids(index)), SUBSET[[[0, 3, 13]]])
  probs = jax.nn.softmax(jnp.arange(len(SUBSET), dtype=jnp.float32))[None]
  spread = np.asarray(spread_to_vocab(probs, jnp.asarray(drafter.vocab_ids), VOCAB))[0]
  assert spread.shape == (VOCAB,)
  np.testing.assert_allclose(spread[SUBSET], np.asarray(probs[0]), rtol=1e-6)
  outside = np.setdiff1d(np.arange(VOCAB), SUBSET)
  assert np.all(spread[outside] == 0)


def test_full_vocab_drafter_is_unchanged_by_the_helpers(target):
  drafter = mirror_drafter(target)
  assert drafter.draft_vocab_size is None
  x = jnp.arange(5)[None]
  np.testing.assert_array_equal(np.asarray(drafter.to_target_ids(x)), np.asarray(x))


@pytest.mark.parametrize("ids", [[], [1, 1, 2], [-1, 3], [VOCAB]])
def test_bad_draft_vocabularies_are_rejected(target, ids):
  with pytest.raises(ValueError, match="distinct target ids"):
    mirror_drafter(target).set_draft_vocab(target, ids)


def test_most_frequent_ids_keeps_the_stop_id_and_breaks_ties_by_id():
  counts = token_frequencies([[5, 5, 5, 2, 2, 9], [9, 9, 1]], 12)
  assert counts[5] == 3 and counts[9] == 3 and counts[2] == 2
  np.testing.assert_array_equal(most_frequent_ids(counts, 3), [2, 5, 9])
  np.testing.assert_array_equal(most_frequent_ids(counts, 3, always=(11,)), [5, 9, 11])


def test_checkpoint_round_trip_keeps_the_subset_and_the_logits(target, tmp_path):
  drafter = reduced_mirror(target)
  save_drafter(drafter, tmp_path / "d")
  loaded = load_drafter(tmp_path / "d", target.config)
  assert loaded.vocab_ids == tuple(int(i) for i in SUBSET)
  tokens = jnp.array([[1, 4, 9]])
  feats = jax.random.normal(jax.random.key(1), (1, 3, target.config.hidden_size))
  np.testing.assert_array_equal(np.asarray(drafter.forward(target, tokens, feats).logits),
                                np.asarray(loaded.forward(target, tokens, feats).logits))


def test_loss_uses_the_targets_distribution_renormalised_over_the_subset(target):
  drafter = reduced_mirror(target)
  rng = np.random.default_rng(0)
  h = target.config.hidden_size
  tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 6)), jnp.int32)
  feats = jnp.asarray(rng.normal(size=(2, 6, h)), jnp.float32)
  next_feats = jnp.asarray(rng.normal(size=(2, 6, h)), jnp.float32)
  mask = jnp.ones((2, 6))
  full_logits = target.lm_logits(next_feats)
  with_full = drafter_loss(drafter, target, tokens, feats, next_feats, full_logits, mask)[1]
  recomputed = drafter_loss(drafter, target, tokens, feats, next_feats, None, mask)[1]
  np.testing.assert_allclose(float(with_full["ce_loss"]), float(recomputed["ce_loss"]),
                             rtol=1e-5)
  # reference: soft CE between softmax(target logits on the subset) and the drafter's head
  pred = np.asarray(drafter.forward(target, tokens, feats).logits, np.float64)
  z = np.asarray(full_logits, np.float64)[..., SUBSET]
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  log_q = pred - pred.max(-1, keepdims=True)
  log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
  np.testing.assert_allclose(float(with_full["ce_loss"]), -(p * log_q).sum(-1).mean(),
                             rtol=1e-4)


def test_training_a_reduced_drafter_learns_without_recompiling(target):
  rng = np.random.default_rng(0)
  engine = RolloutEngine(target, config=EngineConfig(max_batch=16, max_prompt_len=4,
                                                     max_new_tokens=24, prefill_buckets=(4,)))
  prompts = rng.integers(1, VOCAB, (16, 4)).tolist()
  result = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=3))
  seqs = [p + t for p, t in zip(prompts, result.tokens)]
  ids = most_frequent_ids(token_frequencies([t for t in result.tokens], VOCAB), 20)
  batch = make_batch_from_sequences(target, seqs, 28, prompt_lens=[4] * 16, with_logits=False)
  drafter = Drafter.create(target.config, seed=0)
  drafter.set_draft_vocab(target, ids)
  graphdef, params = split_drafter(drafter)
  optimizer = make_optimizer(3e-3)
  opt_state = optimizer.init(params)
  step = make_train_step(graphdef, target, optimizer)
  history = []
  for i in range(60):
    if i == 1:
      compiles = compile_count()
    params, opt_state, metrics = step(params, opt_state, nnx.state(target), batch)
    history.append(jax.device_get(metrics))
  assert compile_count() == compiles
  assert history[-1]["loss"] < 0.7 * history[0]["loss"]
  assert history[-1]["top1"] > history[0]["top1"] + 0.2


GREEDY_BASE = dict(max_batch=4, max_prompt_len=8, max_new_tokens=24, prefill_buckets=(8,),
                   batch_buckets=(4,))
GREEDY_PARAMS = SamplingParams(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def greedy_case(target):
  prompts = np.random.default_rng(2).integers(1, VOCAB, (4, 6)).tolist()
  return prompts, RolloutEngine(target, config=EngineConfig(**GREEDY_BASE)).generate(
      prompts, GREEDY_PARAMS)


@pytest.mark.parametrize("spec", [SpecConfig(4, 1, 5),
                                  pytest.param(SpecConfig(4, 3, 12), marks=pytest.mark.slow)],
                         ids=["chain", "tree"])
def test_greedy_sd_with_a_reduced_vocabulary_equals_vanilla(target, greedy_case, spec):
  """Greedy SD with a reduced draft vocabulary emits vanilla's tokens, including tokens the
  drafter can never propose (they arrive as bonus tokens)."""
  prompts, want = greedy_case
  got = RolloutEngine(target, drafter=reduced_mirror(target),
                      config=EngineConfig(**GREEDY_BASE, spec=spec)).generate(prompts,
                                                                              GREEDY_PARAMS)
  assert got.tokens == want.tokens
  emitted = np.concatenate(want.tokens)
  assert np.isin(emitted, SUBSET, invert=True).any(), "the case must need tokens outside"
  assert got.stats.mean_accept_len > 1.5, got.stats  # the subset still drafts well
