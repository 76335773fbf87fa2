"""Speculative decoding is lossless: greedy is token-identical to vanilla, sampling matches the
target's exact distribution (chi-square), for chain and tree strategies."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import mirror_drafter, sharp_random_model
from tests.stats import chi_square_pvalue
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.ngram import NgramConfig
from tlt_jax.rollout.decode.sampling import SamplingParams, filtered_logprobs
from tlt_jax.rollout.decode.speculative import Draft, SpecConfig, tree_attention

STOPS = (3, 4, 5, 6)
GREEDY_BATCHES = ([5], [3, 12, 7], [9, 2, 14, 5, 7, 1, 11])  # 1, 3 and 7 rows of varied lengths
STRATEGIES = {"chain": SpecConfig(4, 1, 5), "tree-narrow": SpecConfig(5, 2, 4),
              "tree-3": SpecConfig(4, 3, 12)}
BASE = dict(max_batch=2, max_prompt_len=16, max_new_tokens=40, prefill_buckets=(16,))


@pytest.fixture(scope="module")
def targets():
  """(target, drafter) pairs: a 2-layer target with a random drafter (low acceptance), a
  1-layer target with a drafter mirroring its layer (high acceptance), and a 3-layer target with
  a random EAGLE-3 drafter reading two of its layers (its head starting as the target's); and
  Qwen3 targets (per-head q/k norms) with a mirroring and an EAGLE-3 drafter."""
  deep = sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=1)
  shallow = sharp_random_model(ModelConfig.tiny(vocab_size=32, num_layers=1), seed=1)
  three = sharp_random_model(ModelConfig.tiny(vocab_size=32, num_layers=3), seed=1)
  qwen3 = ModelConfig.tiny(vocab_size=32, architecture="qwen3", attention_bias=False)
  shallow3 = sharp_random_model(qwen3.replace(num_layers=1), seed=1)
  three3 = sharp_random_model(qwen3.replace(num_layers=3), seed=1)
  return {"random": (deep, Drafter.create(deep.config, seed=5)),
          "mirror": (shallow, mirror_drafter(shallow)),
          "eagle3": (three, Eagle3Drafter.for_target(three, seed=5, feature_layers=(1, 2))),
          "qwen3-mirror": (shallow3, mirror_drafter(shallow3)),
          "qwen3-eagle3": (three3, Eagle3Drafter.for_target(three3, seed=5,
                                                            feature_layers=(1, 2)))}


@pytest.fixture(scope="module")
def vanilla_results(targets):
  """Vanilla greedy completions per target, computed once for all strategies."""
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  results = {}
  for kind, (target, _) in targets.items():
    engine = RolloutEngine(target, config=EngineConfig(**BASE))
    results[kind] = [engine.generate(prompts_of(lengths, seed=len(lengths)), params)
                     for lengths in GREEDY_BATCHES]
  return results


def prompts_of(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(7, 32, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def spec_engines(targets):
  """``spec_engines(drafter_kind, strategy)``: built once per module (compiling is most of the
  cost; sampling parameters change without recompiling)."""
  cache = {}

  def get(drafter_kind, strategy):
    if (drafter_kind, strategy) not in cache:
      target, drafter = targets[drafter_kind]
      cache[drafter_kind, strategy] = RolloutEngine(
          target, drafter=drafter, config=EngineConfig(**BASE, spec=STRATEGIES[strategy]))
    return cache[drafter_kind, strategy]
  return get


def test_tree_attention_lets_each_node_see_itself_and_every_ancestor():
  """Node 4 sits 3 levels under the root (0 -> 1 -> 3 -> 4; 2 is 1's sibling): it sees the root,
  1, 3 and itself, and nothing of the sibling branch."""
  parent = jnp.array([[0, 0, 0, 1, 3]], jnp.int32)
  draft = Draft(tokens=jnp.zeros((1, 5), jnp.int32), depth=jnp.array([[0, 1, 1, 2, 3]]),
                parent=parent, children=jnp.full((1, 5, 2), -1, jnp.int32), draft_probs=None,
                draft_len=jnp.array([3], jnp.int32))
  want = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
  np.testing.assert_array_equal(np.asarray(tree_attention(draft, 3))[0], np.array(want, bool))


# the fast tier: a chain and the widest tree with a random drafter, and the widest tree with an
# EAGLE-3 drafter over a Qwen3 target (the mirror drafter's sampled and adaptive cases run in the
# fast tier elsewhere)
GREEDY_FAST = {("random", "chain"), ("random", "tree-3"), ("qwen3-eagle3", "tree-3")}


@pytest.mark.parametrize("drafter_kind, strategy", [
    pytest.param(kind, strategy, id=f"{kind}-{strategy}",
                 marks=() if (kind, strategy) in GREEDY_FAST else pytest.mark.slow)
    for kind in ("random", "mirror", "eagle3", "qwen3-mirror", "qwen3-eagle3")
    for strategy in STRATEGIES])
def test_greedy_speculative_equals_vanilla(spec_engines, vanilla_results, drafter_kind, strategy):
  spec = spec_engines(drafter_kind, strategy)
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  for lengths, want in zip(GREEDY_BATCHES, vanilla_results[drafter_kind]):
    got = spec.generate(prompts_of(lengths, seed=len(lengths)), params)
    assert got.tokens == want.tokens
    assert got.finish_reasons == want.finish_reasons
    for a, b in zip(got.logprobs, want.logprobs):
      np.testing.assert_allclose(a, b, atol=1e-4)
  stats_ = got.stats
  assert sum(stats_.accept_hist) > 0 and stats_.mean_accept_len >= 1.0
  if drafter_kind.endswith("mirror"):
    # most drafts accepted, so stop ids were necessarily met inside accepted drafts
    assert stats_.mean_accept_len > 2.5, stats_
    assert "stop" in got.finish_reasons


def test_speculative_engine_does_not_recompile(spec_engines):
  engine = spec_engines("mirror", "tree-narrow")  # shared with the greedy test above
  missing = set(engine.executable_keys()) - set(engine.pool.executables)
  assert engine.precompile() == len(missing)
  assert set(engine.pool.executables) == set(engine.executable_keys())
  for lengths, temperature in (([4, 9], 0.0), ([16, 1, 3], 1.0), ([2, 2, 2, 2, 2], 0.6)):
    result = engine.generate(prompts_of(lengths), SamplingParams(
        max_new_tokens=30, temperature=temperature, top_k=7, stop_token_ids=STOPS))
    assert result.stats.compiles == 0


# ---- sampling: chi-square against the exact joint distribution of the first tokens ---------
# (3 tokens: levels 0-1 only. test_lossless_deep.py covers every level, the bonus after full
# acceptance, stops, compaction and top-k/top-p in the fast suite, with its power check.)

VOCAB, PROMPT, HORIZON, SAMPLES = 8, [1, 5, 2], 3, 32768


@pytest.fixture(scope="module")
def small_vocab():
  target = sharp_random_model(ModelConfig.tiny(vocab_size=VOCAB, num_layers=1), seed=2, scale=3.0)
  qwen3 = sharp_random_model(ModelConfig.tiny(vocab_size=VOCAB, num_layers=1, architecture="qwen3",
                                               attention_bias=False), seed=2, scale=3.0)
  return {"random": (target, Drafter.create(target.config, seed=3)),
          "mirror": (target, mirror_drafter(target)),
          "ngram": (target, NgramConfig(max_ngram=2, min_ngram=1, depth=3)),
          "qwen3-mirror": (qwen3, mirror_drafter(qwen3))}


def exact_joint(target, temperature, top_k, top_p):
  """P(first HORIZON tokens) under the target's filtered sampling distribution, by enumeration."""
  seqs = np.array(list(itertools.product(range(VOCAB), repeat=HORIZON)))
  ids = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], 1)
  logits = target(jnp.asarray(ids))[:, len(PROMPT) - 1:-1]
  logp = np.asarray(filtered_logprobs(logits, jnp.float32(temperature), jnp.int32(top_k),
                                      jnp.float32(top_p)), np.float64)
  joint = np.exp(sum(logp[np.arange(len(seqs)), i, seqs[:, i]] for i in range(HORIZON)))
  return seqs, joint / joint.sum()


@pytest.mark.parametrize("drafter_kind, strategy, temperature, top_k, top_p", [
    pytest.param("random", SpecConfig(3, 1, 4), 1.0, 0, 1.0, marks=pytest.mark.slow),
    pytest.param("mirror", SpecConfig(3, 1, 4), 0.7, 5, 0.9, marks=pytest.mark.slow),
    ("random", SpecConfig(3, 2, 6), 1.0, 0, 0.8),  # the fast tier's tree case
    pytest.param("mirror", SpecConfig(3, 3, 8), 0.7, 5, 0.9, marks=pytest.mark.slow),
    pytest.param("ngram", None, 0.8, 6, 1.0, marks=pytest.mark.slow),
    pytest.param("qwen3-mirror", SpecConfig(3, 2, 6), 0.8, 0, 1.0,  # a Qwen3 target: q/k norms
                 marks=pytest.mark.slow),
], ids=["chain-random", "chain-mirror-topk-topp", "tree-random-topp", "tree-mirror-topk-topp",
        "ngram-topk", "tree-qwen3-mirror"])
def test_sampled_speculative_matches_target_distribution(small_vocab, drafter_kind, strategy,
                                                          temperature, top_k, top_p):
  target, drafter = small_vocab[drafter_kind]
  engine = RolloutEngine(target, drafter=drafter, config=EngineConfig(
      max_batch=1024, max_prompt_len=4, max_new_tokens=HORIZON, prefill_buckets=(4,),
      compaction=False, spec=strategy))
  result = engine.generate([PROMPT] * SAMPLES, SamplingParams(
      max_new_tokens=HORIZON, temperature=temperature, top_k=top_k, top_p=top_p, seed=0,
      stop_token_ids=()))
  seqs, joint = exact_joint(target, temperature, top_k, top_p)
  flat = np.array(result.tokens) @ (VOCAB ** np.arange(HORIZON - 1, -1, -1))
  counts = np.bincount(flat, minlength=VOCAB ** HORIZON)
  assert counts[joint == 0].sum() == 0, "sampled a sequence the filters forbid"
  assert chi_square_pvalue(counts, joint) > 1e-3
  for i in range(HORIZON):  # each position's marginal, where a 1% bias is easiest to see
    marginal = np.bincount(seqs[:, i], weights=joint, minlength=VOCAB)
    assert chi_square_pvalue(np.bincount(np.array(result.tokens)[:, i], minlength=VOCAB),
                             marginal) > 1e-3
  assert result.stats.mean_accept_len > 1.1  # drafts were really accepted, not all rejected


def test_ngram_greedy_equals_vanilla(targets, vanilla_results):
  """GRPO-style groups (each prompt repeated) drafted from siblings: identical greedy output."""
  target, _ = targets["random"]
  engine = RolloutEngine(target, drafter=NgramConfig(max_ngram=3, min_ngram=1, depth=5),
                         config=EngineConfig(**BASE))
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  for lengths, want in zip(GREEDY_BATCHES, vanilla_results["random"]):
    prompts = prompts_of(lengths, seed=len(lengths))
    grouped = [p for p in prompts for _ in range(2)]
    got = engine.generate(grouped, params)
    assert got.tokens[::2] == want.tokens and got.tokens[1::2] == want.tokens
  assert got.stats.mean_accept_len > 1.2  # greedy siblings repeat each other: drafts land


def test_bad_spec_configs_are_rejected(targets):
  with pytest.raises(ValueError, match="SpecConfig.verify_tokens must be depth \\+ 1"):
    SpecConfig(depth=4, topk=1, verify_tokens=3)
  with pytest.raises(ValueError, match="SpecConfig.verify_tokens must be in"):
    SpecConfig(depth=2, topk=2, verify_tokens=9)
  with pytest.raises(ValueError, match="SpecConfig.depth"):
    SpecConfig(depth=0)
  target, _ = targets["random"]
  with pytest.raises(ValueError, match="no drafter"):
    RolloutEngine(target, config=EngineConfig(spec=SpecConfig()))


@pytest.mark.slow
def test_phase_timing_reports_draft_and_verify_time(targets, vanilla_results):
  target, drafter = targets["mirror"]
  engine = RolloutEngine(target, drafter=drafter, config=EngineConfig(
      **BASE, spec=STRATEGIES["chain"], time_phases=True))
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  result = engine.generate(prompts_of(GREEDY_BATCHES[1], seed=3), params)
  assert result.tokens == vanilla_results["mirror"][1].tokens  # timing changes nothing
  s = result.stats
  assert s.draft_s > 0 and s.verify_s > 0
  assert s.draft_s + s.verify_s <= s.decode_s
