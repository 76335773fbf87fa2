"""Parity measures of two models on the same tokens (``tlt_jax.models.parity``)."""

from __future__ import annotations

import numpy as np
import pytest

from tlt_jax.models.instances import random_model, with_dtype
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.parity import (compare_logprobs, divergence_gaps, first_divergence,
                                   log_softmax, logits_of, logprob_parity, teacher_forced_batch)

CONFIG = ModelConfig.tiny(vocab_size=40)


def test_teacher_forced_batch_cuts_to_the_shortest_prompt():
  batch = teacher_forced_batch([[1, 2, 3, 4], [5, 6, 7]], max_len=8)
  assert batch.tolist() == [[1, 2, 3], [5, 6, 7]] and batch.dtype == np.int32
  assert teacher_forced_batch([[1, 2, 3, 4], [5, 6, 7]], max_len=2).tolist() == [[1, 2], [5, 6]]


def test_compare_logprobs_of_equal_and_shifted_distributions():
  rng = np.random.default_rng(0)
  lp = log_softmax(rng.normal(size=(2, 3, 10)) * 3)
  same = compare_logprobs(lp, lp)
  assert same["positions"] == 6 and same["max_abs_logprob_diff"] == 0 and same["kl_mean"] == 0
  assert same["greedy_agreement"] == 1.0
  flipped = compare_logprobs(lp, lp[..., ::-1])  # another argmax everywhere (no ties)
  assert flipped["greedy_agreement"] < 1.0 and flipped["kl_mean"] > 0
  np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0)


def test_bf16_against_float32_is_close_but_not_equal():
  model = random_model(CONFIG, seed=0, scale=0.5)
  ids = np.array([[1, 2, 3, 4, 5, 6]], np.int32)
  r = logprob_parity(model, with_dtype(model, "bfloat16"), ids)
  assert 0 < r["max_abs_logprob_diff"] < 1.0 and r["greedy_agreement"] >= 0.5
  assert logprob_parity(model, model, ids)["max_abs_logprob_diff"] < 1e-4


def test_first_divergence():
  assert first_divergence([1, 2, 3], [1, 2, 3]) is None
  assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
  assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_divergence_gaps_name_the_row_and_both_logits():
  model = random_model(CONFIG, seed=1, scale=0.5)
  prompts = [[5, 6, 7]]
  seq = list(prompts[0])
  for _ in range(3):  # a greedy continuation, from full forwards
    seq.append(int(logits_of(model, np.array([seq], np.int32))[0, -1].argmax()))
  reference = [seq[3:]]
  other = [[reference[0][0], (reference[0][1] + 1) % 40, 0]]
  assert divergence_gaps(model, prompts, reference, reference, width=6) == []
  (found,) = divergence_gaps(model, prompts, reference, other, width=6)
  assert (found["row"], found["position"]) == (0, 1)
  assert found["gap"] == pytest.approx(found["logit_vanilla_token"] - found["logit_sd_token"])
