"""Length-bucketed policy updates: micro-batches cut at a length ladder, their gradients summed
into one optimizer step, must equal the full-length update (loss, metrics, gradients, params),
compile nothing after ``precompile_update``, and shard over a data-parallel mesh."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import (UPDATE_BUCKET_MIN, GRPOTrainer, TrainerConfig, _make_loss_fn,
                                bucket_rows, make_bucketed_update_fns, microbatch,
                                needed_lengths, plan_microbatches, update_buckets)
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.utils import compile_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# prompt_len = 16, max_new_tokens = 24: rows of up to 40 tokens, buckets (16, 32, 40); a budget
# of 64 tokens gives micro-batches of 4, 2 and 1 rows
PROMPT_LEN, NEW_TOKENS, BUDGET = 16, 24, 64


def make_trainer(update_tokens=BUDGET, loss_agg="token-mean", kl_coef=0.0, mesh=None, **kw):
  task = ArithmeticTask(max_digits=3)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
  trainer_kw = dict(steps=2, prompts_per_step=4, max_new_tokens=NEW_TOKENS, minibatches=1,
                    eval_problems=8, update_tokens=update_tokens, learning_rate=1e-3,
                    warmup_steps=0)
  trainer_kw.update(kw)
  return GRPOTrainer(init_model(config, seed=0), tokenizer, task,
                     EngineConfig(max_batch=8, max_prompt_len=PROMPT_LEN,
                                  max_new_tokens=NEW_TOKENS, prefill_buckets=(16,)),
                     grpo.GRPOConfig(group_size=2, loss_agg=loss_agg, kl_coef=kl_coef),
                     TrainerConfig(**trainer_kw), mesh=mesh)


def ragged_batch(trainer, completion_lengths, seed=0):
  """Rows with the given completion lengths (0: an empty completion), prompts of 2-15 tokens,
  mixed-sign advantages and old log-probs around the random policy's, so that some ratios clip."""
  rng = np.random.default_rng(seed)
  n = len(completion_lengths)
  prompts = [[1] + rng.integers(3, 14, int(rng.integers(1, PROMPT_LEN))).tolist()
             for _ in range(n)]
  comps = [rng.integers(3, 14, int(c)).tolist() for c in completion_lengths]
  old = [rng.uniform(-3.6, -2.4, len(c)) for c in comps]
  advantages = rng.normal(0.0, 1.0, n)
  return trainer.make_batch(prompts, comps, old, advantages)


LONG_TAIL = [24, 0, 3, 1, 17, 0, 9, 2]  # very different lengths, two empty completions


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_close_trees(a, b, rtol=1e-5, what=""):
  for x, y in zip(host(a), host(b), strict=True):
    atol = 1e-6 * max(1.0, float(np.max(np.abs(y)))) if y.size else 0.0
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=what)


# ---------------------------------------------------------------------------- the ladder


def test_bucket_ladder_is_powers_of_two_ending_at_the_row_length():
  assert update_buckets(40) == (16, 32, 40)
  assert update_buckets(32 + 1024) == (16, 32, 64, 128, 256, 512, 1024, 1056)
  assert update_buckets(64) == (16, 32, 64)
  assert update_buckets(10) == (10,) and update_buckets(16) == (16,)
  assert update_buckets(40, smallest=32) == (32, 40)
  with pytest.raises(ValueError, match="seq_len"):
    update_buckets(1)


@pytest.mark.parametrize("length, budget, minibatch, devices, rows", [
    (16, 64, 8, 1, 4), (32, 64, 8, 1, 2), (40, 64, 8, 1, 1),  # budget // length
    (16, 8192, 8, 1, 8),  # at most the minibatch
    (40, 64, 8, 2, 2), (32, 96, 8, 2, 2),  # 3 rows -> a multiple of the devices
    (1056, 8192, 64, 8, 8), (1056, 16, 64, 4, 4),  # at least one row per device
    (128, 8192, 64, 1, 64), (256, 8192, 64, 1, 32), (1056, 8192, 64, 1, 7),
])
def test_rows_per_bucket(length, budget, minibatch, devices, rows):
  assert bucket_rows(length, budget, minibatch, devices) == rows


@pytest.mark.parametrize("value", [-1, 1, UPDATE_BUCKET_MIN - 1, True, 64.0, "8192", None])
def test_bad_update_tokens_is_rejected_naming_the_field(value):
  with pytest.raises(ValueError, match=r"TrainerConfig\.update_tokens"):
    TrainerConfig(update_tokens=value)


def test_good_update_tokens_are_accepted():
  for value in (0, UPDATE_BUCKET_MIN, 8192):
    assert TrainerConfig(update_tokens=value).update_tokens == value


def test_plan_puts_every_row_once_in_a_bucket_that_holds_it():
  rng = np.random.default_rng(0)
  buckets = update_buckets(1056)
  rows_of = {t: bucket_rows(t, 2048, 64, 2) for t in buckets}
  for _ in range(20):
    lengths = np.minimum(rng.geometric(1 / 60, 64) + 32, 1056) * (rng.random(64) > 0.1)
    plan = plan_microbatches(lengths, buckets, rows_of)
    rows = np.concatenate([r for _, r in plan])
    assert sorted(rows.tolist()) == list(range(64))
    for length, r in plan:
      assert 1 <= len(r) <= rows_of[length] and np.all(lengths[r] <= length)
      # the longest row of each micro-batch needs its bucket: no shorter bucket holds it
      shorter = [b for b in buckets if b < length]
      assert not shorter or lengths[r].max() > shorter[-1]
    assert [t for t, _ in plan] == sorted((t for t, _ in plan), reverse=True)


def test_needed_lengths_are_prompt_plus_completion():
  trainer = make_trainer()
  batch = trainer.make_batch([[1, 5, 6], [1, 7], [1, 4, 4, 4]], [[8, 9, 2], [4], []],
                             [np.zeros(3), np.zeros(1), np.zeros(0)], [1.0, -1.0, 0.5])
  np.testing.assert_array_equal(needed_lengths(batch["mask"]), [6, 3, 0])
  micro = microbatch(batch, np.array([1, 0]), 16, 4, pad_token_id=0)
  assert micro["ids"].shape == (4, 16) and micro["mask"].shape == (4, 15)
  np.testing.assert_array_equal(micro["ids"][1, :6], [1, 5, 6, 8, 9, 2])
  assert micro["mask"][2:].sum() == 0 and np.all(micro["advantages"][2:] == 0)


# ---------------------------------------------------------------------------- equality


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("loss_agg", AGGS)
def test_micro_batches_sum_to_the_full_length_loss_metrics_and_gradient(loss_agg, kl_coef):
  """16 rows of very different lengths (some empty) in several micro-batches of 3 lengths: the
  summed shares equal the full-length batch's loss, every metric and the gradient."""
  config = grpo.GRPOConfig(group_size=2, loss_agg=loss_agg, kl_coef=kl_coef)
  trainer = make_trainer(loss_agg=loss_agg, kl_coef=kl_coef)
  params = trainer.params
  ref_params = None
  if kl_coef:  # a reference policy away from the current one, so the KL term is not zero
    ref_params = jax.tree.map(lambda x: x * 0.9, params)
  batch = ragged_batch(trainer, LONG_TAIL + [c // 2 for c in LONG_TAIL], seed=1)
  loss_fn = _make_loss_fn(trainer.graphdef, config, trainer.config.temperature)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      params, ref_params, batch)

  fns = make_bucketed_update_fns(trainer.graphdef, trainer.optimizer, config, trainer.mesh,
                                 temperature=trainer.config.temperature)
  mask = batch["mask"]
  totals = {"tokens": np.float32(mask.sum()), "seqs": np.float32((mask.sum(1) > 0).sum())}
  rows_of = {t: bucket_rows(t, BUDGET, 16, 1) for t in update_buckets(trainer.seq_len)}
  plan = plan_microbatches(needed_lengths(mask), update_buckets(trainer.seq_len), rows_of)
  assert len(plan) >= 4 and len({t for t, _ in plan}) == 3, plan
  acc = fns["zeros"](params)
  for length, rows in plan:
    acc = fns["accumulate"](params, ref_params, acc,
                            microbatch(batch, rows, length, rows_of[length]), totals)
  acc_grads, sums = acc

  assert set(sums) == set(metrics) and ("kl_to_ref" in sums) == (kl_coef > 0)
  assert 0 < float(metrics["clip_fraction"]) < 1  # both branches of the clip are exercised
  np.testing.assert_allclose(float(sums["loss"]), float(loss), rtol=1e-5)
  for k in metrics:
    np.testing.assert_allclose(float(sums[k]), float(metrics[k]), rtol=1e-5, atol=1e-7, err_msg=k)
  assert_close_trees(acc_grads, grads, what="gradient")
  assert float(np.abs(host(grads)[0]).max()) > 0


def trained_params(trainer, batches):
  metrics = [trainer.policy_update(b) for b in batches]
  return host(trainer.params), host(trainer.opt_state), metrics


UPDATE_METRICS = ("loss", "pg_loss", "clip_fraction", "ratio_mean", "approx_kl", "kl_to_ref",
                  "grad_norm")


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_trainer_update_equals_the_full_length_update(loss_agg):
  """Two epochs of two minibatches on the same ragged batch, bucketed vs full length (with the
  KL term): the same params, optimizer state and metrics, at a fraction of the tokens."""
  kw = dict(loss_agg=loss_agg, kl_coef=0.1, minibatches=2, epochs=2)
  padded, bucketed = make_trainer(update_tokens=0, **kw), make_trainer(**kw)
  batch = ragged_batch(padded, LONG_TAIL, seed=2)
  want_params, want_opt, want = trained_params(padded, [batch])
  got_params, got_opt, got = trained_params(bucketed, [batch])
  assert_close_trees(got_params, want_params, what="params")
  assert_close_trees(got_opt, want_opt, what="optimizer state")
  for k in UPDATE_METRICS:
    np.testing.assert_allclose(got[0][k], want[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert got[0]["skipped_updates"] == want[0]["skipped_updates"] == 0
  # the same valid tokens, but far fewer padded ones (full length: 4 updates x 4 rows x 40)
  assert got[0]["update_tokens_valid"] == want[0]["update_tokens_valid"]
  assert want[0]["update_tokens_padded"] == 4 * 4 * 40 and want[0]["update_passes"] == 4
  assert got[0]["update_tokens_valid"] <= got[0]["update_tokens_padded"]
  assert got[0]["update_tokens_padded"] < want[0]["update_tokens_padded"]
  assert got[0]["update_passes"] > 4


def test_nonfinite_micro_batch_is_skipped_like_a_full_length_update():
  """A NaN advantage in one row: with "skip" that minibatch's update is dropped, the rest applied,
  exactly as in the full-length update."""
  kw = dict(minibatches=2, on_nonfinite="skip")
  padded, bucketed = make_trainer(update_tokens=0, **kw), make_trainer(**kw)
  batch = ragged_batch(padded, LONG_TAIL, seed=3)
  batch["advantages"][0] = np.nan
  want_params, want_opt, want = trained_params(padded, [batch])
  got_params, got_opt, got = trained_params(bucketed, [batch])
  assert got[0]["skipped_updates"] == want[0]["skipped_updates"] == 1
  assert all(np.all(np.isfinite(x)) for x in got_params)
  assert_close_trees(got_params, want_params, what="params")
  assert_close_trees(got_opt, want_opt, what="optimizer state")


def test_after_precompile_updates_of_any_lengths_compile_nothing():
  trainer = make_trainer(minibatches=2, epochs=2)  # "stop" over 4 updates: the state copy too
  before = compile_count()
  compiled = trainer.precompile_update()
  # one gradient step per bucket (16, 32, 40), the accumulator, the optimizer step, the copy
  assert compiled == 3 + 3 == compile_count() - before
  assert trainer.precompile_update() == 0
  before = compile_count()
  lengths = [LONG_TAIL, [0] * 8, [24] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [12, 0, 0, 24, 0, 5, 0, 0]]
  runs = [trainer.policy_update(ragged_batch(trainer, c, seed=i)) for i, c in enumerate(lengths)]
  assert compile_count() == before, "an update compiled after precompile_update()"
  assert all(np.isfinite(m["loss"]) and m["skipped_updates"] == 0 for m in runs)
  assert runs[1]["update_tokens_valid"] == 0  # nothing to train on: smallest bucket, zero loss
  assert runs[1]["update_tokens_padded"] == 4 * 4 * 16 and runs[1]["loss"] == 0.0


def test_steps_report_update_tokens_and_do_not_recompile():
  """Through trainer.step(): the default budget; the second step compiles nothing."""
  trainer = make_trainer(update_tokens=8192, minibatches=2)
  first = trainer.step()
  before = compile_count()
  second = trainer.step()
  assert compile_count() == before and second["compiles"] == 0
  for m in (first, second):
    assert 0 < m["update_tokens_valid"] <= m["update_tokens_padded"] <= 8 * trainer.seq_len
    assert m["update_passes"] == 2 and np.isfinite(m["loss"])


# ---------------------------------------------------------------------------- two devices


def two_device_check():
  """Run in a fresh process with 2 simulated CPU devices (``XLA_FLAGS`` from the caller): the
  bucketed update on a 2-device mesh equals the full-length one on 1 device, compiling nothing
  after the first update."""
  assert jax.device_count() == 2, jax.devices()
  kw = dict(kl_coef=0.1, loss_agg="seq-mean-token-sum", minibatches=2, epochs=1)
  padded = make_trainer(update_tokens=0, mesh=Mesh(np.array(jax.devices()[:1]), ("data",)), **kw)
  bucketed = make_trainer(mesh=Mesh(np.array(jax.devices()), ("data",)), **kw)
  assert all(r % 2 == 0 for r in bucketed.update_rows.values()), bucketed.update_rows
  batches = [ragged_batch(padded, LONG_TAIL, seed=4), ragged_batch(padded, LONG_TAIL[::-1], seed=5)]
  want_params, want_opt, want = trained_params(padded, batches[:1])
  got_params, got_opt, got = trained_params(bucketed, batches[:1])
  assert_close_trees(got_params, want_params, what="params")
  assert_close_trees(got_opt, want_opt, what="optimizer state")
  for k in UPDATE_METRICS:
    np.testing.assert_allclose(got[0][k], want[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
  before = compile_count()
  bucketed.policy_update(batches[1])
  assert compile_count() == before
  print("2-device bucketed update ok")


def test_two_device_bucketed_update_equals_the_one_device_full_length_update():
  env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin", "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  code = "from tests.rl.test_update_buckets import two_device_check; two_device_check()"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "2-device bucketed update ok" in proc.stdout
