"""The offline drafter warm-up (tlt_jax.drafter.warmup): it learns the policy's own sequences,
is reproducible per seed, compiles once, and names each bad argument."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import (evaluate_drafter, make_batch_from_sequences, make_eval_step,
                             own_sequences, split_drafter, train_drafter_on_batch,
                             warm_up_drafter, warm_up_on_rollouts)
from tlt_jax.models.drafter import Drafter
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.utils import compile_count
from tests.drafter.test_objective import CONFIG, PROMPT_LEN, sample_sequences
from tests.helpers import sharp_random_model

ROW_LEN = 48


@pytest.fixture(scope="module")
def policy():
  return sharp_random_model(CONFIG, seed=1)


@pytest.fixture(scope="module")
def sequences(policy):
  """24 of the policy's own samples, cut to assorted lengths so that rows pack several."""
  prompts = np.random.default_rng(5).integers(3, CONFIG.vocab_size, (24, PROMPT_LEN))
  full = sample_sequences(policy, prompts, 36, seed=2).tolist()
  lengths = np.random.default_rng(6).integers(PROMPT_LEN + 4, 37, len(full))
  return [s[:n] for s, n in zip(full, lengths)]


def top1(policy, drafter, sequences) -> float:
  """The token-weighted top-1 of ``drafter`` over every row of ``sequences``."""
  batch = make_batch_from_sequences(policy, sequences, ROW_LEN,
                                    prompt_lens=[PROMPT_LEN] * len(sequences), pack=True)
  graphdef, params = split_drafter(drafter)
  return evaluate_drafter(make_eval_step(graphdef, policy), params, nnx.state(policy), batch,
                          4)["top1"]


def test_warm_up_learns_the_policys_own_sequences(policy, sequences):
  fresh = Drafter.create(CONFIG, seed=0)
  before = top1(policy, fresh, sequences)
  drafter, report = warm_up_drafter(policy, sequences, [PROMPT_LEN] * len(sequences), steps=60,
                                    row_len=ROW_LEN, batch_rows=4, learning_rate=1e-2, seed=0,
                                    log_every=20)
  after = top1(policy, drafter, sequences)
  assert after > before + 0.3, (before, after)
  # the report's evaluation is the returned drafter's, over every row
  np.testing.assert_allclose(report["train_top1"], after, rtol=1e-6)
  assert report["rows"] < len(sequences)  # packed
  assert report["trained_positions"] == sum(len(s) - PROMPT_LEN for s in sequences)
  assert [e["step"] for e in report["log"]] == [20, 40, 60]
  assert report["last"]["loss"] < report["log"][0]["loss"]
  assert report["steps"] == 60 and report["seconds"] > 0


def test_same_seed_gives_the_same_params_and_the_callers_drafter_is_left_alone(policy,
                                                                                 sequences):
  prompt_lens = [PROMPT_LEN] * len(sequences)
  given = Drafter.create(CONFIG, seed=3)
  kept = jax.tree.map(np.array, nnx.state(given))
  runs = [warm_up_drafter(policy, sequences, prompt_lens, steps=6, row_len=ROW_LEN,
                          batch_rows=4, seed=seed, drafter=given, evaluate=False)[0]
          for seed in (7, 7, 8)]
  a, b, c = (jax.tree.leaves(nnx.state(d)) for d in runs)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, z) for x, z in zip(a, c)), "the seed draws no rows"
  for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(nnx.state(given))):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(kept), a))


def test_no_step_compiles_after_the_first(policy, sequences):
  compile_count()  # the counter listens from here on
  counts = []
  warm_up_drafter(policy, sequences[:5], [PROMPT_LEN] * 5, steps=8, row_len=ROW_LEN,
                  batch_rows=3, seed=1, log_every=1, evaluate=False,
                  on_log=lambda entry: counts.append(compile_count()))
  assert len(counts) == 8
  assert counts[1:] == [counts[0]] * 7, counts


def test_evaluation_counts_every_token_once_in_fixed_chunks(policy, sequences):
  batch = make_batch_from_sequences(policy, sequences[:10], ROW_LEN,
                                    prompt_lens=[PROMPT_LEN] * 10)  # 10 rows, 4 a chunk: wraps
  drafter = Drafter.create(CONFIG, seed=4)
  graphdef, params = split_drafter(drafter)
  eval_step, target_params = make_eval_step(graphdef, policy), nnx.state(policy)
  whole = jax.device_get(eval_step(params, target_params, batch))
  compiles = compile_count()
  chunked = evaluate_drafter(eval_step, params, target_params, batch, 4)
  assert compile_count() - compiles <= 1  # one chunk shape
  assert chunked["num_tokens"] == float(batch.mask.sum()) == float(whole["num_tokens"])
  for key in ("loss", "top1", "feature_loss", "ce_loss"):
    np.testing.assert_allclose(chunked[key], float(whole[key]), rtol=2e-5)


def test_own_sequences_are_prompt_then_completion():
  seen = {}

  def generate(prompts, params):
    seen.update(prompts=prompts, params=params)
    return types.SimpleNamespace(tokens=[[9] * (i + 1) for i in range(len(prompts))])

  rollout = types.SimpleNamespace(generate=generate)
  sequences, prompt_lens = own_sequences(rollout, [[1, 5], [1, 6, 7]], max_new_tokens=12,
                                         temperature=0.5, seed=3)
  assert sequences == [[1, 5, 9], [1, 6, 7, 9, 9]] and prompt_lens == [2, 3]
  assert seen["params"] == SamplingParams(max_new_tokens=12, temperature=0.5, seed=3)
  with pytest.raises(ValueError, match="^prompts must not be empty"):
    own_sequences(rollout, [], max_new_tokens=12)


def test_training_on_a_batch_reports_held_out_before_and_after(policy, sequences):
  """``train_drafter_on_batch`` (what ``warm_up_drafter`` trains with, given ready batches):
  the caller's drafter is left as it was, and the held-out evaluations are of the drafter
  before and after training."""
  prompt_lens = [PROMPT_LEN] * 12
  train, held_out = (make_batch_from_sequences(policy, part, ROW_LEN, prompt_lens=prompt_lens,
                                               pack=True)
                     for part in (sequences[:12], sequences[12:]))
  fresh = Drafter.create(CONFIG, seed=0)
  before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(fresh))]
  drafter, report = train_drafter_on_batch(policy, fresh, train, steps=40, batch_rows=4,
                                           learning_rate=1e-2, log_every=20, evaluate=False,
                                           held_out=held_out)
  for a, b in zip(before, jax.tree.leaves(nnx.state(fresh))):
    np.testing.assert_array_equal(a, b)
  assert report["train"] is None and report["train_top1"] is None
  assert [e["step"] for e in report["log"]] == [20, 40]
  assert report["held_out"]["top1"] > report["held_out_at_init"]["top1"]
  graphdef, params = split_drafter(drafter)
  after = evaluate_drafter(make_eval_step(graphdef, policy), params, nnx.state(policy), held_out,
                           4)
  np.testing.assert_allclose(report["held_out"]["top1"], after["top1"], rtol=1e-6)


def test_warm_up_on_rollouts_trains_on_what_the_rollout_sampled(policy, sequences):
  """The rollout's completions, prompt first, are what the drafter trains on: the same drafter,
  bit for bit, as ``warm_up_drafter`` on those sequences, and a report that says so."""
  prompts = [s[:PROMPT_LEN] for s in sequences]
  seen = {}

  def generate(prompts_, params):
    seen["params"] = params
    return types.SimpleNamespace(tokens=[s[PROMPT_LEN:] for s in sequences])

  rollout = types.SimpleNamespace(generate=generate)
  kwargs = dict(steps=4, row_len=ROW_LEN, batch_rows=4, seed=3, evaluate=False)
  drafter, report = warm_up_on_rollouts(policy, rollout, prompts, max_new_tokens=36,
                                        temperature=0.7, sample_seed=9, **kwargs)
  assert seen["params"] == SamplingParams(max_new_tokens=36, temperature=0.7, seed=9)
  reference, expected = warm_up_drafter(policy, sequences, [PROMPT_LEN] * len(sequences),
                                        **kwargs)
  for a, b in zip(jax.tree.leaves(nnx.state(drafter)), jax.tree.leaves(nnx.state(reference))):
    np.testing.assert_array_equal(a, b)
  assert report["last"] == expected["last"] and report["rows"] == expected["rows"]
  assert (report["prompts"], report["temperature"], report["sample_seed"]) == (24, 0.7, 9)
  assert report["mean_completion"] == np.mean([len(s) - PROMPT_LEN for s in sequences])
  assert report["seconds"] >= report["generate_s"] >= 0


@pytest.mark.parametrize("change, name", [
    (dict(steps=0), "steps"),
    (dict(steps=2.5), "steps"),
    (dict(batch_rows=0), "batch_rows"),
    (dict(log_every=0), "log_every"),
    (dict(row_len=1), "row_len"),
    (dict(row_len=PROMPT_LEN), "row_len"),  # every completion cut off
    (dict(learning_rate=0.0), "learning_rate"),
    (dict(sequences=[]), "sequences"),
    (dict(prompt_lens=[PROMPT_LEN] * 2), "prompt_lens"),
    (dict(sequences=[[1, 2, 3, 4, 5], [1, 2, 3, 4]]), r"sequences\[1\]"),
])
def test_each_bad_argument_is_named(policy, change, name):
  kwargs = dict(sequences=[[1, 2, 3, 4, 5, 6]] * 3, prompt_lens=[PROMPT_LEN] * 3, steps=2,
                row_len=ROW_LEN)
  kwargs.update(change)
  if "sequences" in change and "prompt_lens" not in change:
    kwargs["prompt_lens"] = [PROMPT_LEN] * len(change["sequences"])
  with pytest.raises(ValueError, match=f"^{name} "):
    warm_up_drafter(policy, **kwargs)
