"""The log-probs a rollout records agree with those the policy update recomputes at the same
params (``rl/agreement.py``): vanilla and speculative rollouts, padded and packed updates; no
token's importance ratio is clipped before any update."""

import numpy as np
import pytest

from tests.rl.test_trainer import make_trainer
from tlt_jax.rl.agreement import agreement, logprob_agreement
from tlt_jax.rollout.decode.ngram import NgramConfig

# The one-token decode through the KV cache and the update's whole-row pass round apart in the
# last bits only. Measured on this tiny random policy: fp32 at most 5e-7; bf16 arithmetic (fp32
# params) mean 9e-7, at most 1.2e-4 (docs/benchmarks.md)
GAP = {None: 1e-5, "bfloat16": 2e-3}


@pytest.mark.parametrize("compute_dtype", [
    None, pytest.param("bfloat16", marks=pytest.mark.slow)], ids=["fp32", "bf16"])  # bf16: full tier
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_vanilla_rollout_logprobs_are_the_updates(layout, compute_dtype):
  kw = dict(update_tokens=64) if layout == "packed" else {}
  got = logprob_agreement(make_trainer(temperature=1.0, compute_dtype=compute_dtype, **kw))
  assert got["tokens"] > 50
  assert got["gap_max"] < GAP[compute_dtype] and got["clipped_share"] == 0.0, got


def test_speculative_rollout_logprobs_are_the_updates():
  """Tokens accepted from a verify pass over several drafted tokens carry that pass's log-probs."""
  trainer = make_trainer(temperature=1.0, drafter=NgramConfig())
  got = logprob_agreement(trainer)
  assert got["gap_max"] < GAP[None] and got["clipped_share"] == 0.0, got


def test_agreement_reads_only_completion_tokens_and_counts_clipped_ratios():
  mask = np.array([[0, 1, 1, 0], [0, 0, 1, 1]], np.float32)
  rollout = np.full((2, 4), -1.0, np.float32)
  update = rollout + np.array([[9, 0.1, -0.3, 9], [9, 9, 0.0, 0.25]], np.float32)
  got = agreement(rollout, update, mask, 0.2, 0.2)
  assert got["tokens"] == 4 and got["gap_max"] == pytest.approx(0.3)
  assert got["gap_mean"] == pytest.approx((0.1 + 0.3 + 0.0 + 0.25) / 4)
  assert got["clipped_share"] == pytest.approx(0.5)  # exp(-0.3) < 0.8, exp(0.25) > 1.2
  with pytest.raises(ValueError, match="no completion tokens"):
    agreement(rollout, update, np.zeros_like(mask), 0.2, 0.2)
