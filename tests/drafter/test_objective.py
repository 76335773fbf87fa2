"""The EAGLE drafter objective, target-aligned batches and the jitted train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter.objective import (drafter_loss, eagle_loss, make_batch_from_sequences,
                                   make_eval_step, make_optimizer, make_train_step, pack_sequences,
                                   split_drafter)
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import load_drafter, save_drafter
from tlt_jax.utils import compile_count
from tests.helpers import sharp_random_model

CONFIG = ModelConfig.tiny(vocab_size=32)
PROMPT_LEN = 4


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(CONFIG, seed=1)


def sample_sequences(model, prompts: np.ndarray, length: int, seed: int) -> np.ndarray:
  """Ancestral samples of ``model`` continuing ``prompts`` to ``length`` tokens, in one jit."""
  graphdef, params = nnx.split(model)
  prompt_len = prompts.shape[1]

  @jax.jit
  def run(params, ids, key):
    m = nnx.merge(graphdef, params)

    def body(t, ids):
      tok = jax.random.categorical(jax.random.fold_in(key, t), m(ids)[:, t - 1])
      return ids.at[:, t].set(jnp.where(t >= prompt_len, tok, ids[:, t]))

    return jax.lax.fori_loop(1, length, body, ids)

  ids = jnp.zeros((prompts.shape[0], length), jnp.int32).at[:, :prompt_len].set(prompts)
  return np.asarray(run(params, ids, jax.random.key(seed)))


@pytest.fixture(scope="module")
def own_sequences(target):
  prompts = np.random.default_rng(0).integers(3, CONFIG.vocab_size, (16, PROMPT_LEN))
  return sample_sequences(target, prompts, 36, seed=0).tolist()


def numpy_eagle_loss(pred_h, pred_z, next_h, next_z, mask, ce_weight=0.1):
  d = np.abs(pred_h - next_h)
  smooth_l1 = np.where(d < 1.0, 0.5 * d * d, d - 0.5).mean(-1)
  p = np.exp(next_z - next_z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  log_q = pred_z - pred_z.max(-1, keepdims=True)
  log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
  ce = -(p * log_q).sum(-1)
  n = mask.sum()
  top1 = ((pred_z.argmax(-1) == next_z.argmax(-1)) * mask).sum() / n
  return (smooth_l1 * mask).sum() / n + ce_weight * (ce * mask).sum() / n, top1


def test_loss_matches_numpy_reference_on_a_hand_built_case():
  pred_h = np.array([[[0.2, -1.5, 3.0], [0.0, 0.5, -0.25]],
                     [[1.0, 1.0, 1.0], [9.0, 9.0, 9.0]]], np.float32)  # [2, 2, 3]
  next_h = np.array([[[0.0, 0.5, 0.5], [0.1, 0.4, -2.0]],
                     [[1.0, 0.0, 3.0], [0.0, 0.0, 0.0]]], np.float32)
  pred_z = np.array([[[2.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]],
                     [[-1.0, 3.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]]], np.float32)
  next_z = np.array([[[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, -2.0, 1.0]],
                     [[0.0, 4.0, 0.0, 1.0], [0.0, 0.0, 7.0, 0.0]]], np.float32)
  mask = np.array([[1.0, 1.0], [1.0, 0.0]], np.float32)  # the wild last position is padding
  loss, metrics = eagle_loss(*map(jnp.asarray, (pred_h, pred_z, next_h, next_z, mask)))
  want_loss, want_top1 = numpy_eagle_loss(pred_h, pred_z, next_h, next_z, mask)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["top1"]), want_top1)
  assert float(metrics["num_tokens"]) == 3.0


def test_batch_is_aligned_with_the_target(target, own_sequences):
  seqs = [own_sequences[0][:20], own_sequences[1][:9]]
  batch = make_batch_from_sequences(target, seqs, 24, prompt_lens=[PROMPT_LEN, PROMPT_LEN])
  graphdef, params = nnx.split(target)
  forward = jax.jit(lambda p, ids: nnx.merge(graphdef, p).forward(ids, return_hidden=True)[:2])
  z, h = (np.asarray(x[0]) for x in forward(params, jnp.asarray([seqs[0]])))
  np.testing.assert_array_equal(batch.tokens[0, :19], seqs[0][1:])
  np.testing.assert_allclose(batch.features[0, :20], h, atol=1e-5)
  np.testing.assert_allclose(batch.next_features[0, :19], h[1:], atol=1e-5)
  np.testing.assert_allclose(batch.next_logits[0, :19], z[1:], atol=1e-4)
  # Trained positions: from the last prompt token up to the second-to-last sequence token.
  want = np.zeros((2, 24))
  want[0, PROMPT_LEN - 1:19] = 1
  want[1, PROMPT_LEN - 1:8] = 1
  np.testing.assert_array_equal(batch.mask, want)


def test_packed_rows_give_the_same_loss_as_one_row_per_sequence(target, own_sequences):
  seqs = [s[:n] for s, n in zip(own_sequences, [36, 9, 20, 14, 30, 6])]
  assert all(len(g) >= 1 for g in pack_sequences([len(s) for s in seqs], 40))
  plain = make_batch_from_sequences(target, seqs, 40, prompt_lens=[PROMPT_LEN] * 6)
  packed = make_batch_from_sequences(target, seqs, 40, prompt_lens=[PROMPT_LEN] * 6, pack=True)
  assert packed.num_rows < plain.num_rows and packed.mask.sum() == plain.mask.sum()
  drafter = Drafter.create(CONFIG, seed=3)
  evaluate = make_eval_step(drafter, target)
  params, target_params = split_drafter(drafter)[1], nnx.state(target)
  a, b = evaluate(params, target_params, plain), evaluate(params, target_params, packed)
  for key in ("loss", "top1", "num_tokens"):
    np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=2e-5)


def test_drafter_loss_recomputes_missing_target_logits(target, own_sequences):
  batch = make_batch_from_sequences(target, own_sequences[:4], 36, prompt_lens=[PROMPT_LEN] * 4)
  drafter = Drafter.create(CONFIG, seed=0)
  loss = nnx.jit(lambda d, t, z: drafter_loss(d, t, batch.tokens, batch.features,
                                               batch.next_features, z, batch.mask)[0])
  with_logits, without = loss(drafter, target, batch.next_logits), loss(drafter, target, None)
  np.testing.assert_allclose(float(with_logits), float(without), rtol=1e-5)


def test_training_on_own_sequences_learns_without_recompiling(target, own_sequences, tmp_path):
  batch = make_batch_from_sequences(target, own_sequences, 36, prompt_lens=[PROMPT_LEN] * 16)
  drafter = Drafter.create(CONFIG, seed=0)
  graphdef, params = split_drafter(drafter)
  optimizer = make_optimizer(3e-3)
  opt_state = optimizer.init(params)
  step = make_train_step(graphdef, target, optimizer)
  target_params = nnx.state(target)
  history = []
  for i in range(100):
    if i == 1:
      compiles = compile_count()
    params, opt_state, metrics = step(params, opt_state, target_params, batch)
    history.append(jax.device_get(metrics))
  assert compile_count() == compiles, "the train step recompiled after the first call"
  first, last = history[0], history[-1]
  assert last["loss"] < 0.7 * first["loss"]
  assert last["top1"] > first["top1"] + 0.3, (first["top1"], last["top1"])
  # The target was only read.
  for a, b in zip(jax.tree.leaves(target_params), jax.tree.leaves(nnx.state(target))):
    np.testing.assert_array_equal(a, b)

  trained = nnx.merge(graphdef, params)
  save_drafter(trained, tmp_path / "drafter")
  loaded = load_drafter(tmp_path / "drafter", target.config)
  tokens, features = jnp.asarray(batch.tokens[:2]), jnp.asarray(batch.features[:2])
  np.testing.assert_array_equal(np.asarray(trained.forward(target, tokens, features).logits),
                                np.asarray(loaded.forward(target, tokens, features).logits))


def test_target_is_an_argument_not_a_constant(target, own_sequences):
  batch = make_batch_from_sequences(target, own_sequences[:4], 36)
  drafter = Drafter.from_target_layer(target, layer=-1)
  graphdef, params = split_drafter(drafter)
  evaluate = make_eval_step(graphdef, target)
  other = jax.tree.map(lambda x: x * 1.1, nnx.state(target))
  before = evaluate(params, nnx.state(target), batch)
  compiles = compile_count()
  after = evaluate(params, other, batch)
  assert compile_count() == compiles
  assert float(after["loss"]) != float(before["loss"])
