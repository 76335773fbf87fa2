"""The EAGLE-3 drafter in JAX: the target's feature layers, chained (TTT) steps equal drafting
with a cache, its objective, and its saved form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import sharp_random_model
from tlt_jax.drafter.objective import (batch_loss, make_batch_from_sequences, make_optimizer,
                                       make_train_step, split_drafter)
from tlt_jax.models.drafter_io import load_drafter, save_drafter
from tlt_jax.models.eagle3 import (Eagle3Drafter, check_feature_layers, default_feature_layers,
                                   ttt_logits)
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import positions_and_mask, rope_inv_freq


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(ModelConfig.tiny(num_layers=5, attention_bias=False,
                                             architecture="llama"), seed=1, scale=4.0)


def test_feature_layers_are_the_residual_stream_entering_each_layer(target):
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
  out = target.forward(ids, return_hidden=(0, 2, 5))
  h = target.config.hidden_size
  assert out.hidden.shape == (2, 9, 4 * h)
  positions, mask = positions_and_mask(ids.shape, None, None, None, None)
  x, stream = target.embed(ids), []
  for layer in target.layers:
    stream.append(x)
    x = layer(x, positions, rope_inv_freq(target.config), mask, None, None)[0]
  stream.append(x)
  for k, i in enumerate((0, 2, 5)):
    np.testing.assert_allclose(out.hidden[..., k * h:(k + 1) * h], stream[i], atol=1e-6)
  np.testing.assert_allclose(out.hidden[..., 3 * h:], target.forward(ids, return_hidden=True
                                                                     ).hidden, atol=1e-6)


def test_feature_layer_defaults_and_checks():
  assert default_feature_layers(30) == (2, 15, 27)  # speculators' own default
  assert default_feature_layers(5) == (2,)
  assert default_feature_layers(2) == (1,)
  assert default_feature_layers(8) == (2, 4, 5)
  assert check_feature_layers([0, 8], 8) == (0, 8)  # the embedding and the last layer's output
  for bad in ([], [1, 1], [-1], [9], [3, 1], "x"):
    with pytest.raises(ValueError, match="eagle3 feature layers"):
      check_feature_layers(bad, 8)


def test_chained_steps_equal_drafting_with_a_cache(target):
  """TTT step k at position t = the k-th chained cache step after t (teacher-forced tokens)."""
  drafter = Eagle3Drafter.for_target(target, seed=2, feature_layers=(1, 3))
  t_len, steps = 10, 3
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (1, t_len + 1)), jnp.int32)
  feats = target.forward(ids[:, :-1], return_hidden=drafter.target_features).hidden
  tokens, positions = ids[:, 1:], jnp.arange(t_len)[None]
  chained = ttt_logits(drafter, target, tokens, feats, positions, steps=steps)
  cache = drafter.init_cache(1, 2 * t_len)
  first = drafter.forward(target, tokens, feats, positions, cache=cache)
  np.testing.assert_allclose(first.logits, chained[0], atol=2e-5)
  for t in (0, 4, t_len - steps):
    hidden, c = first.hidden[:, t:t + 1], first.cache
    for k in range(1, steps):
      out = drafter.forward(target, tokens[:, t + k:t + k + 1], hidden,
                            jnp.asarray([[t + k]]), cache=c.with_lengths(jnp.asarray([t + k])))
      np.testing.assert_allclose(out.logits[:, 0], chained[k][:, t], atol=2e-5,
                                 err_msg=f"step {k} at {t}")
      hidden, c = out.hidden, out.cache


def test_ttt_training_lowers_every_steps_loss_and_saves_its_kind(target, tmp_path):
  rng = np.random.default_rng(3)
  seqs = [rng.integers(0, 64, 14).tolist() for _ in range(24)]
  drafter = Eagle3Drafter.for_target(target, seed=4)
  batch = make_batch_from_sequences(target, seqs, 16, prompt_lens=[4] * 24,
                                    features=drafter.target_features)
  assert batch.features.shape[-1] == drafter.feature_size
  graphdef, params = split_drafter(drafter)
  optimizer = make_optimizer(3e-3)
  step = make_train_step(graphdef, target, optimizer)
  opt_state = optimizer.init(params)
  tparams = _params(target)
  first = None
  for _ in range(60):
    params, opt_state, m = step(params, opt_state, tparams, batch)
    first = first or {k: float(v) for k, v in m.items()}
  probs = jax.nn.softmax(drafter.target_logits(target, jnp.asarray(batch.next_features)), -1)
  entropy = -jnp.sum(probs * jnp.log(probs), -1)
  floor = float(jnp.sum(entropy * batch.mask) / batch.mask.sum())  # the CE of a perfect drafter
  assert float(m["loss"]) - floor < 0.2 * (first["loss"] - floor), (floor, first, m)
  assert float(m["top1_last"]) > first["top1_last"] + 0.3
  assert float(m["feature_loss"]) == 0.0
  trained = jax.tree.map(lambda x: x, params)
  save_drafter(_merge(graphdef, trained), tmp_path / "d", policy=target)
  back = load_drafter(tmp_path / "d", target.config)
  assert isinstance(back, Eagle3Drafter) and back.feature_layers == drafter.feature_layers
  a = batch_loss(_merge(graphdef, trained), target, batch)[0]
  b = batch_loss(back, target, batch)[0]
  assert float(a) == float(b)


def test_ttt_loss_masks_steps_that_leave_the_sequence(target):
  """Two sequences packed in one row score like the two alone: no chained step attends to or
  is scored against the other sequence (its last step's cross-entropy is the mix of the two
  alone, weighted by the positions each scores)."""
  from tlt_jax.drafter.objective import ttt_loss  # pylint: disable=import-outside-toplevel
  drafter = Eagle3Drafter.for_target(target, seed=5)
  rng = np.random.default_rng(6)
  seqs = [rng.integers(0, 64, 7).tolist(), rng.integers(0, 64, 8).tolist()]
  packed = make_batch_from_sequences(target, seqs, 16, pack=True, features=drafter.target_features)
  alone = [make_batch_from_sequences(target, [s], 16, features=drafter.target_features)
           for s in seqs]
  assert packed.num_rows == 1
  last = drafter.ttt_steps - 1
  counts = [_step_count(b, last) for b in alone]
  assert _step_count(packed, last) == sum(counts) > 0
  for metric in ("ce_last", "top1_last"):
    each = [float(ttt_loss(drafter, target, b)[1][metric]) for b in alone]
    got = float(ttt_loss(drafter, target, packed)[1][metric])
    np.testing.assert_allclose(got, sum(c * t for c, t in zip(counts, each)) / sum(counts),
                               rtol=1e-5, atol=1e-6, err_msg=metric)


def _step_count(batch, k):
  mask = np.asarray(batch.mask)
  seg = np.asarray(batch.segment_ids)
  shifted = np.concatenate([mask[:, k:], np.zeros_like(mask[:, :k])], 1)
  same = np.concatenate([seg[:, k:], np.zeros_like(seg[:, :k])], 1) == seg
  return float((mask * shifted * same).sum())


def _params(module):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return nnx.state(module, nnx.Param)


def _merge(graphdef, params):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return nnx.merge(graphdef, params)
