"""Packed policy updates: each minibatch's sequences packed first-fit decreasing into rows of a
length ladder (block-diagonal causal attention, positions restarting per sequence), the packed
micro-batches' gradients summed into one optimizer step, must equal the full-length update (loss,
metrics, gradients, params), let no sequence see another, compile nothing after
``precompile_update``, and shard over a data-parallel mesh."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from tests.xla_env import subprocess_env

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.packing import (UPDATE_BUCKET_MIN, bucket_rows, needed_lengths, pack_length,
                                pack_rows, packed_microbatches, plan_packs, update_buckets)
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rl.update import make_logprobs_fn, make_loss_fn, make_packed_update_fns, \
    packed_attention_mask
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.utils import compile_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# prompt_len = 16, max_new_tokens = 24: rows of up to 40 tokens, buckets (16, 32, 40); a budget
# of 64 tokens gives micro-batches of 4, 2 and 1 packed rows
PROMPT_LEN, NEW_TOKENS, BUDGET = 16, 24, 64


def make_trainer(update_tokens=BUDGET, loss_agg="token-mean", kl_coef=0.0, mesh=None, **kw):
  task = ArithmeticTask(max_digits=3)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
  # the batch's own old log-probs (ragged_batch's, chosen so that some ratios clip), unless a
  # test asks for the policy's (old_logprobs="policy", the job's default)
  trainer_kw = dict(steps=2, prompts_per_step=4, max_new_tokens=NEW_TOKENS, minibatches=1,
                    eval_problems=8, update_tokens=update_tokens, learning_rate=1e-3,
                    warmup_steps=0, old_logprobs="rollout")
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


def assert_close_trees(a, b, rtol=1e-5, what="", atol=1e-6):
  for x, y in zip(host(a), host(b), strict=True):
    tol = atol * max(1.0, float(np.max(np.abs(y)))) if y.size else 0.0
    np.testing.assert_allclose(x, y, rtol=rtol, atol=tol, err_msg=what)


# Params after Adam steps agree to 1% of one step (lr 1e-3 in these tests): Adam divides each
# gradient by its own size, so where one is as small as Adam's eps (1e-8; e.g. the k-projection
# bias, whose gradient under RoPE is nearly zero at init) the float noise of a different
# summation order (packed vs padded rows) shows in that element's step, by up to ~1e-6.
PARAMS_ATOL = 1e-5


def assert_close_params(got, want):
  assert_close_trees(got, want, what="params", atol=PARAMS_ATOL)


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


# ---------------------------------------------------------------------------- packing


def test_first_fit_decreasing_on_a_small_case():
  # longest first: 9 opens a row, 7 opens one, 5 opens one, 3 fills 7's, 2 joins 5's
  assert pack_rows(np.array([5, 9, 3, 7, 0, 2]), 10) == [[1], [3, 2], [0, 5]]
  assert pack_rows(np.array([0, 0]), 16) == []
  with pytest.raises(ValueError, match="does not fit"):
    pack_rows(np.array([3, 17]), 16)


def test_pack_length_is_the_shortest_bucket_holding_the_longest_row():
  buckets = update_buckets(40)
  assert pack_length(np.array([3, 16, 0]), buckets) == 16
  assert pack_length(np.array([3, 17]), buckets) == 32
  assert pack_length(np.array([40, 1]), buckets) == 40
  assert pack_length(np.array([0, 0]), buckets) == 16  # nothing to train on
  with pytest.raises(ValueError, match="exceeds"):
    pack_length(np.array([41]), buckets)


def test_packing_puts_every_row_once_whole_in_one_packed_row():
  rng = np.random.default_rng(0)
  for _ in range(20):
    lengths = np.minimum(rng.geometric(1 / 60, 64) + 32, 1056) * (rng.random(64) > 0.1)
    length = pack_length(lengths, update_buckets(1056))
    packs = pack_rows(lengths, length)
    placed = [i for pack in packs for i in pack]
    assert sorted(placed) == sorted(np.flatnonzero(lengths).tolist())  # each non-empty once
    assert all(sum(lengths[i] for i in pack) <= length for pack in packs)
    # first fit: no packed row could have taken a later row that opened a new one
    for k, pack in enumerate(packs):
      room = length - sum(lengths[i] for i in pack)
      assert all(lengths[later[0]] > room for later in packs[k + 1:])


def test_plan_packs_fills_whole_micro_batches_longest_first():
  rng = np.random.default_rng(1)
  buckets = update_buckets(1056)
  rows_of = {t: bucket_rows(t, 2048, 64, 1) for t in buckets}
  for _ in range(20):
    lengths = np.minimum(rng.geometric(1 / 60, 64) + 32, 1056) * (rng.random(64) > 0.1)
    plan = plan_packs(lengths, buckets, rows_of)
    sizes = [t for t, _ in plan]
    assert sizes == sorted(set(sizes), reverse=True)  # one round per length, longest first
    assert sizes[0] == pack_length(lengths, buckets)
    placed = [i for _, packs in plan for pack in packs for i in pack]
    assert sorted(placed) == sorted(np.flatnonzero(lengths).tolist())  # each non-empty once
    for k, (t, packs) in enumerate(plan):
      assert len(packs) % rows_of[t] == 0  # whole micro-batches
      rooms = [t - sum(lengths[i] for i in pack) for pack in packs]
      assert min(rooms) >= 0
      # a row left for a shorter length fitted in none of these packed rows
      later = [i for _, ps in plan[k + 1:] for p in ps for i in p]
      assert all(lengths[i] > max(rooms) for i in later)


def test_needed_lengths_are_prompt_plus_completion():
  trainer = make_trainer()
  batch = trainer.make_batch([[1, 5, 6], [1, 7], [1, 4, 4, 4]], [[8, 9, 2], [4], []],
                             [np.zeros(3), np.zeros(1), np.zeros(0)], [1.0, -1.0, 0.5])
  np.testing.assert_array_equal(needed_lengths(batch["mask"]), [6, 3, 0])


def test_packed_micro_batches_lay_sequences_back_to_back():
  """Each sequence lies whole and contiguous in one packed row: its tokens, positions 0..n-1,
  its segment id; per predicted token its mask, old log-probs, advantage and loss weight, and
  no prediction across a boundary; the filler rows are empty."""
  trainer = make_trainer()
  mini = ragged_batch(trainer, LONG_TAIL + [c // 2 for c in LONG_TAIL], seed=1)
  lengths = needed_lengths(mini["mask"])
  length = pack_length(lengths, update_buckets(trainer.seq_len))
  packs = pack_rows(lengths, length)
  micros = packed_microbatches(mini, packs, length, 3, "seq-mean-token-mean", pad_token_id=0)
  assert len(micros) == -(-len(packs) // 3) >= 2 and max(map(len, packs)) >= 2
  packed = {k: np.concatenate([m[k] for m in micros]) for k in micros[0]}
  assert packed["ids"].shape == (3 * len(micros), length)
  assert packed["mask"].shape == (3 * len(micros), length - 1)
  weights = grpo.loss_weights(mini["mask"], "seq-mean-token-mean")
  seen = []
  for r, pack in enumerate(packs):
    at = 0
    for i in pack:
      n = lengths[i]
      where = np.flatnonzero(packed["segments"][r] == i)
      np.testing.assert_array_equal(where, np.arange(at, at + n))  # whole and contiguous
      np.testing.assert_array_equal(packed["ids"][r, at:at + n], mini["ids"][i, :n])
      np.testing.assert_array_equal(packed["positions"][r, at:at + n], np.arange(n))
      for k in ("mask", "old_logprobs"):
        np.testing.assert_array_equal(packed[k][r, at:at + n - 1], mini[k][i, :n - 1])
      np.testing.assert_array_equal(packed["weights"][r, at:at + n - 1], weights[i, :n - 1])
      assert np.all(packed["advantages"][r, at:at + n - 1] == mini["advantages"][i])
      assert at + n - 1 >= length - 1 or packed["mask"][r, at + n - 1] == 0  # the boundary
      seen.append(i)
      at += n
    assert np.all(packed["segments"][r, at:] == -1) and np.all(packed["mask"][r, at:] == 0)
  assert sorted(seen) == np.flatnonzero(lengths).tolist()
  assert np.all(packed["segments"][len(packs):] == -1)  # filler packed rows
  for k in ("mask", "weights", "advantages"):
    assert not packed[k][len(packs):].any()
  np.testing.assert_allclose(packed["weights"].sum(), weights.sum(), rtol=1e-6)
  assert packed_microbatches(mini, [], length, 3, "token-mean") == []


def test_packed_attention_mask_is_block_diagonal_causal():
  segments = np.array([[0, 0, 0, 5, 5, -1]])
  mask = np.asarray(packed_attention_mask(segments))[0]
  want = np.zeros((6, 6), bool)
  for block in ((0, 3), (3, 5), (5, 6)):
    for i in range(*block):
      want[i, block[0]:i + 1] = True
  np.testing.assert_array_equal(mask, want)


def packed_setup(seed=1, size=3, agg="token-mean"):
  trainer = make_trainer(loss_agg=agg)
  mini = ragged_batch(trainer, LONG_TAIL + [c // 2 for c in LONG_TAIL], seed=seed)
  lengths = needed_lengths(mini["mask"])
  length = pack_length(lengths, update_buckets(trainer.seq_len))
  packs = pack_rows(lengths, length)
  return trainer, mini, lengths, packs, packed_microbatches(mini, packs, length, size, agg)


def test_packed_logprobs_equal_each_sequence_alone():
  """Every packed sequence's per-token log-probs equal its padded row's (positions restart at 0,
  it sees only itself); changing one sequence's tokens leaves the others' unchanged."""
  trainer, mini, lengths, packs, micros = packed_setup()
  logprobs = jax.jit(make_logprobs_fn(trainer.policy.graphdef, trainer.config.temperature))
  padded = np.asarray(logprobs(trainer.policy.params, mini))
  packed = np.concatenate([np.asarray(logprobs(trainer.policy.params, m)) for m in micros])
  segments = np.concatenate([m["segments"] for m in micros])
  for r, pack in enumerate(packs):
    at = 0
    for i in pack:
      n = lengths[i]
      np.testing.assert_allclose(packed[r, at:at + n - 1], padded[i, :n - 1], rtol=1e-5,
                                 atol=1e-5, err_msg=f"sequence {i} in packed row {r}")
      at += n
  # a packed row of 3+ sequences: rewrite the middle one's tokens
  r = next(r for r, pack in enumerate(packs) if len(pack) >= 3)
  micro_at, row = divmod(r, len(micros[0]["ids"]))
  micro = {k: v.copy() for k, v in micros[micro_at].items()}
  middle = micro["segments"][row] == packs[r][1]
  micro["ids"][row, middle] = (micro["ids"][row, middle] + 1) % 14 + 3  # other real tokens
  changed = np.asarray(logprobs(trainer.policy.params, micro))[row]
  before = packed[r]
  # predictions within the other sequences (the one from the token before the middle sequence
  # predicts the middle one's first token, across the boundary: never trained on)
  seg = segments[r]
  others = (seg[:-1] == seg[1:]) & (seg[:-1] >= 0) & (seg[:-1] != packs[r][1])
  np.testing.assert_allclose(changed[others], before[others], rtol=1e-6, atol=1e-6)
  assert np.abs(changed[middle[:-1]] - before[middle[:-1]]).max() > 1e-3


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("loss_agg", AGGS)
def test_packed_micro_batches_sum_to_the_full_length_loss_metrics_and_gradient(loss_agg, kl_coef):
  """16 rows of very different lengths (some empty) packed into several micro-batches: the summed
  shares equal the full-length batch's loss, every metric and the gradient."""
  config = grpo.GRPOConfig(group_size=2, loss_agg=loss_agg, kl_coef=kl_coef)
  trainer, batch, lengths, packs, micros = packed_setup(seed=1, size=2, agg=loss_agg)
  assert len(micros) >= 3 and max(map(len, packs)) >= 3 and (lengths == 0).sum() >= 2
  params = trainer.policy.params
  ref_params = None
  if kl_coef:  # a reference policy away from the current one, so the KL term is not zero
    ref_params = jax.tree.map(lambda x: x * 0.9, params)
  loss_fn = make_loss_fn(trainer.policy.graphdef, config, trainer.config.temperature)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      params, ref_params, batch)

  fns = make_packed_update_fns(trainer.policy.graphdef, trainer.policy.optimizer, config,
                               trainer.mesh, temperature=trainer.config.temperature)
  total_tokens = np.float32(batch["mask"].sum())
  acc = fns["zeros"](params)
  for micro in micros:
    acc = fns["accumulate"](params, ref_params, acc, micro, total_tokens)
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
  return host(trainer.policy.params), host(trainer.policy.opt_state), metrics


UPDATE_METRICS = ("loss", "pg_loss", "clip_fraction", "ratio_mean", "approx_kl", "kl_to_ref",
                  "grad_norm")


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_trainer_update_equals_the_full_length_update(loss_agg):
  """Two epochs of two minibatches on the same ragged batch, packed vs full length (with the
  KL term): the same params, optimizer state and metrics, at a fraction of the tokens."""
  kw = dict(loss_agg=loss_agg, kl_coef=0.1, minibatches=2, epochs=2)
  padded, packed = make_trainer(update_tokens=0, **kw), make_trainer(**kw)
  batch = ragged_batch(padded, LONG_TAIL, seed=2)
  want_params, want_opt, want = trained_params(padded, [batch])
  got_params, got_opt, got = trained_params(packed, [batch])
  assert_close_params(got_params, want_params)
  assert_close_trees(got_opt, want_opt, what="optimizer state")
  for k in UPDATE_METRICS:
    np.testing.assert_allclose(got[0][k], want[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert got[0]["skipped_updates"] == want[0]["skipped_updates"] == 0
  # the same valid tokens, but far fewer padded ones (full length: 4 updates x 4 rows x 40)
  assert got[0]["update_tokens_valid"] == want[0]["update_tokens_valid"]
  assert want[0]["update_tokens_padded"] == 4 * 4 * 40 and want[0]["update_passes"] == 4
  assert got[0]["update_tokens_valid"] <= got[0]["update_tokens_padded"]
  assert got[0]["update_tokens_padded"] < want[0]["update_tokens_padded"]
  assert got[0]["update_passes"] >= 4


def test_nonfinite_micro_batch_is_skipped_like_a_full_length_update():
  """A NaN advantage in one row: with "skip" that minibatch's update is dropped, the rest applied,
  exactly as in the full-length update."""
  kw = dict(minibatches=2, on_nonfinite="skip")
  padded, packed = make_trainer(update_tokens=0, **kw), make_trainer(**kw)
  batch = ragged_batch(padded, LONG_TAIL, seed=3)
  batch["advantages"][0] = np.nan
  want_params, want_opt, want = trained_params(padded, [batch])
  got_params, got_opt, got = trained_params(packed, [batch])
  assert got[0]["skipped_updates"] == want[0]["skipped_updates"] == 1
  assert all(np.all(np.isfinite(x)) for x in got_params)
  assert_close_params(got_params, want_params)
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
  # nothing to train on: no micro-batch, only the (zero-gradient) optimizer steps, zero loss
  assert runs[1]["update_tokens_valid"] == runs[1]["update_tokens_padded"] == 0
  assert runs[1]["update_passes"] == 0 and runs[1]["loss"] == 0.0
  # 24-token completions: rows of 26-39 tokens, no two in one packed row; those above 32 in rows
  # of 40 (one per micro-batch at a budget of 64), the others in rows of 32 (two per micro-batch)
  assert runs[2]["update_passes"] < 16
  assert runs[2]["update_tokens_valid"] <= runs[2]["update_tokens_padded"]
  # completions of 1-8 tokens: shorter packed rows, fewer tokens run
  assert runs[3]["update_tokens_padded"] < runs[2]["update_tokens_padded"]


def test_steps_report_update_tokens_and_do_not_recompile():
  """Through trainer.step(): the default budget; the second step compiles nothing."""
  trainer = make_trainer(update_tokens=8192, minibatches=2)
  trainer.precompile_update()
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
  packed update on a 2-device mesh equals the full-length one on 1 device, compiling nothing
  after ``precompile_update()``."""
  assert jax.device_count() == 2, jax.devices()
  kw = dict(kl_coef=0.1, loss_agg="seq-mean-token-sum", minibatches=2, epochs=1)
  padded = make_trainer(update_tokens=0, mesh=Mesh(np.array(jax.devices()[:1]), ("data",)), **kw)
  packed = make_trainer(mesh=Mesh(np.array(jax.devices()), ("data",)), **kw)
  assert all(r % 2 == 0 for r in packed.policy.update_rows.values()), packed.policy.update_rows
  batches = [ragged_batch(padded, LONG_TAIL, seed=4), ragged_batch(padded, LONG_TAIL[::-1], seed=5)]
  packed.precompile_update()
  want_params, want_opt, want = trained_params(padded, batches[:1])
  got_params, got_opt, got = trained_params(packed, batches[:1])
  assert_close_params(got_params, want_params)
  assert_close_trees(got_opt, want_opt, what="optimizer state")
  for k in UPDATE_METRICS:
    np.testing.assert_allclose(got[0][k], want[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
  before = compile_count()
  packed.policy_update(batches[1])
  assert compile_count() == before
  print("2-device packed update ok")


@pytest.mark.slow
def test_two_device_packed_update_equals_the_one_device_full_length_update():
  env = subprocess_env(devices=2)
  code = "from tests.rl.test_update_buckets import two_device_check; two_device_check()"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "2-device packed update ok" in proc.stdout


@pytest.mark.parametrize("update_tokens", [BUDGET, 0])
def test_the_policys_old_logprobs_are_its_forward_pass_and_compile_nothing_after_precompile(
    update_tokens):
  """old_logprobs="policy": before a step's first update, the completions' log-probs under the
  params (packed micro-batches, or full-length rows), 0 off the completions; precompiled with
  the rest (one forward pass per packed length), so that no step compiles."""
  trainer = make_trainer(update_tokens=update_tokens, minibatches=2, old_logprobs="policy")
  plain = make_trainer(update_tokens=update_tokens, minibatches=2)
  extra = len(trainer.policy.update_buckets) if update_tokens else 1
  assert trainer.precompile_update() == plain.precompile_update() + extra
  batch = ragged_batch(trainer, LONG_TAIL, seed=4)
  order = np.random.default_rng(0).permutation(len(LONG_TAIL))
  logprobs_of = jax.jit(make_logprobs_fn(trainer.policy.graphdef))
  want = logprobs_of(trainer.policy.params, {"ids": batch["ids"]})
  before = compile_count()
  got = trainer.policy.policy_logprobs(batch, order)
  np.testing.assert_allclose(got, np.where(batch["mask"] > 0, want, 0.0), rtol=1e-5, atol=1e-5)
  assert np.all(got[batch["mask"] == 0] == 0.0) and np.all(got[batch["mask"] > 0] < 0.0)
  # one epoch: the first minibatch's are its update's own (NaN: the loss takes its own)
  first = order[:len(order) // 2]
  lazy = trainer.policy.policy_logprobs(batch, order, first_by_update=True)
  assert np.all(np.isnan(lazy[first][batch["mask"][first] > 0]))
  np.testing.assert_array_equal(np.delete(lazy, first, 0), np.delete(got, first, 0))
  metrics = trainer.policy_update(batch)
  assert compile_count() == before, "a step compiled after precompile_update()"
  assert metrics["skipped_updates"] == 0 and np.isfinite(metrics["loss"])
  # one minibatch: its update's own pass gives the old log-probs, so every ratio is exactly 1
  single = make_trainer(update_tokens=update_tokens, old_logprobs="policy")
  m = single.policy_update(batch)
  assert (m["ratio_mean"], m["clip_fraction"], m["approx_kl"]) == (1.0, 0.0, 0.0), m


def test_with_two_epochs_the_second_pass_scores_against_the_params_before_the_step():
  """old_logprobs="policy" with epochs=2: only a single pass over the rows may take its own
  forward pass as the old log-probs; the second epoch's update runs with params the first one
  moved, so its ratios are no longer 1 (were its old log-probs its own, they would all be)."""
  trainer = make_trainer(old_logprobs="policy", epochs=2)
  batch = ragged_batch(trainer, LONG_TAIL, seed=4)
  metrics = trainer.policy_update(batch)
  assert metrics["skipped_updates"] == 0
  assert metrics["approx_kl"] > 0.0 and metrics["ratio_mean"] != 1.0, metrics
