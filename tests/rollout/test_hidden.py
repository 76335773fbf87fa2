"""The engine's hidden states as a byproduct (``generate(collect_hidden=...)``) and row offsets.

The hidden states are read from the passes that produced the tokens (prefill, vanilla steps,
verify passes), never a second forward; they must equal the target's own last-layer hidden
states over the finished sequence position for position (an off-by-one fails)."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import RoundRobin, sharp_random_model
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.speculative import SpecConfig

BASE = dict(max_batch=4, max_prompt_len=16, max_new_tokens=24, prefill_buckets=(16,))


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=2)


@pytest.fixture(scope="module")
def engines(target):
  drafter = Drafter.create(target.config, seed=3)
  return {
      "chain": RolloutEngine(target, drafter, EngineConfig(**BASE, spec=SpecConfig(3, 1, 4))),
      "adaptive": RolloutEngine(target, drafter, EngineConfig(
          **BASE, strategies=(SpecConfig(2, 2, 4),), segment_steps=2),
          tuner=RoundRobin()),
      "vanilla": RolloutEngine(target, None, EngineConfig(**BASE)),
  }


def prompts_of(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(7, 32, n).tolist() for n in lengths]


def reference_hidden(target, sequences):
  """The target's own last-layer hidden states over each sequence (one causal pass over the
  sequences padded at the end, which leaves every real position unchanged)."""
  width = max(len(s) for s in sequences)
  ids = np.zeros((len(sequences), width), np.int32)
  for i, s in enumerate(sequences):
    ids[i, :len(s)] = s
  return np.asarray(target.forward(jnp.asarray(ids), return_hidden=True).hidden)


@pytest.mark.parametrize("name,temperature", [
    ("chain", 0.0), pytest.param("adaptive", 1.0, marks=pytest.mark.slow)])
def test_hidden_states_match_the_targets_own_pass(engines, target, name, temperature):
  """Chain SD (every token from a verify pass) and the adaptive engine switching between vanilla
  and a tree every 2 steps (vanilla passes, tree verify passes, catch-ups)."""
  prompts = prompts_of([3, 9, 16, 5, 12], seed=1)  # 5 rows: two chunks, compaction, growth
  result = engines[name].generate(prompts, SamplingParams(
      max_new_tokens=24, temperature=temperature, seed=4, stop_token_ids=(3, 4, 5, 6)),
      collect_hidden=True)
  assert len(result.hidden) == len(prompts)
  lengths = set()
  reference = reference_hidden(target, [p + c for p, c in zip(prompts, result.tokens)])
  for p, c, h, ref in zip(prompts, result.tokens, result.hidden, reference):
    length = len(p) + len(c)
    assert h.shape == (length - 1, target.config.hidden_size)
    np.testing.assert_allclose(h, ref[:length - 1], atol=2e-4, rtol=2e-4)
    lengths.add(len(c))
  assert len(lengths) > 1  # rows finished at different steps (some on the stop id)
  if name == "chain":  # collecting compiles nothing of its own, whatever rows finish when
    engines[name].precompile()
    for seed in (5, 6):
      again = engines[name].generate(prompts[::-1], SamplingParams(
          max_new_tokens=24, temperature=1.0, seed=seed, stop_token_ids=(3, 4, 5, 6)),
          collect_hidden=True)
      assert again.stats.compiles == 0


def test_collect_a_fraction_or_given_rows(engines):
  prompts = prompts_of([4] * 8)
  params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
  half = engines["chain"].generate(prompts, params, collect_hidden=0.5).hidden
  assert sum(h is not None for h in half) == 4
  again = engines["chain"].generate(prompts, params, collect_hidden=0.5).hidden
  assert [h is None for h in half] == [h is None for h in again]  # seeded by params.seed
  picked = [i % 3 == 0 for i in range(8)]
  given = engines["chain"].generate(prompts, params, collect_hidden=picked).hidden
  assert [h is not None for h in given] == picked
  assert engines["chain"].generate(prompts, params).hidden is None


def test_a_collected_fraction_is_drawn_afresh_for_each_seed():
  """``collect_hidden=<fraction>`` picks its rows by the sampling seed: the same rows for one
  seed, other rows for another (the drafter does not train on the same row positions every
  step)."""
  from tlt_jax.rollout.interface import collect_mask  # pylint: disable=import-outside-toplevel
  picks = [tuple(np.flatnonzero(collect_mask(0.25, 16, seed, True))) for seed in range(4)]
  assert all(len(p) == 4 for p in picks)
  assert picks[0] == tuple(np.flatnonzero(collect_mask(0.25, 16, 0, True)))
  assert len(set(picks)) > 1


def test_mean_accept_len_is_none_without_a_speculative_step(engines):
  from tlt_jax.rollout.host.tuner import TunerConfig, make_tuner  # pylint: disable=import-outside-toplevel
  engine = engines["adaptive"]
  engine.set_tuner(make_tuner(TunerConfig(kind="fixed", fixed=((4, "vanilla"),))))
  try:
    stats = engine.generate([[7, 8, 9]], SamplingParams(max_new_tokens=6)).stats
  finally:
    engine.set_tuner(RoundRobin())
  assert stats.mean_accept_len is None  # not 0.0, which would drag averages over steps down


def test_collect_hidden_errors(engines):
  with pytest.raises(ValueError, match="needs a learned drafter"):
    engines["vanilla"].generate([[7, 8]], collect_hidden=True)
  with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
    engines["chain"].generate([[7, 8]], collect_hidden=1.5)
  with pytest.raises(ValueError, match="one per prompt"):
    engines["chain"].generate([[7, 8]], collect_hidden=[True, False])
  with pytest.raises(ValueError, match="row_offset"):
    engines["chain"].generate([[7, 8]], row_offset=-1)


@pytest.mark.parametrize("name", ["vanilla", "chain"])
def test_row_offset_gives_a_shard_the_rows_own_samples(engines, name):
  """A shard generated with row_offset=k samples exactly what rows k.. sample in the whole
  request (vanilla sampling; and SD tokens too where the row's draws are its own)."""
  prompts = prompts_of([5, 7, 3, 9, 6, 4], seed=3)
  params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)
  whole = engines[name].generate(prompts, params).tokens
  part = engines[name].generate(prompts[2:5], params, row_offset=2).tokens
  assert part == whole[2:5]
  unshifted = engines[name].generate(prompts[2:5], params).tokens
  assert unshifted != whole[2:5]  # without the offset the shard would sample other tokens
