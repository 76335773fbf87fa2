"""KV-length buckets: caches start small and grow as rows get longer, and nothing else changes.

Every engine kind (vanilla, speculative chain and tree, n-gram) must give the same tokens and
log-probs with a ladder of small length buckets (so chunks grow several times) as with one cache
of the full capacity, greedy and sampled; and after ``precompile()`` growing compiles nothing.
"""

import numpy as np
import pytest

from tests.helpers import mirror_drafter, sharp_random_model
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.ngram import NgramConfig
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.speculative import SpecConfig

STOPS = {0.0: (3, 4), 1.0: (3,)}  # rows stop at very different lengths, some early
BASE = dict(max_batch=2, max_prompt_len=16, max_new_tokens=72, prefill_buckets=(16,))
LADDER = (24, 40, 64)  # far below the capacity: every long row grows several times


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=1)


def drafter_for(kind, target):
  return {"vanilla": None, "chain": Drafter.create(target.config, seed=5),
          "tree": mirror_drafter(target), "ngram": NgramConfig(max_ngram=2, min_ngram=1, depth=3)
          }[kind]


def spec_for(kind):
  return {"chain": SpecConfig(3, 1, 4), "tree": SpecConfig(3, 2, 6)}.get(kind)


def prompts(seed=0):
  rng = np.random.default_rng(seed)
  # a repeated prompt gives the n-gram drafter siblings to copy from
  ps = [rng.integers(7, 32, n).tolist() for n in (3, 14, 6, 9, 2, 11)]
  return ps + [ps[1]]


def make(target, kind, kv_buckets, **kw):
  config = EngineConfig(**BASE, spec=spec_for(kind), kv_buckets=kv_buckets, **kw)
  return RolloutEngine(target, drafter=drafter_for(kind, target), config=config)


@pytest.fixture(scope="module")
def engines(target):
  """``engines(kind, kv_buckets)``: built once per module. Compiling is most of the cost, so the
  growth test and the precompile test share the ladder engines (sampling parameters change
  without recompiling)."""
  cache = {}

  def get(kind, kv_buckets):
    if (kind, kv_buckets) not in cache:
      cache[kind, kv_buckets] = make(target, kind, kv_buckets)
    return cache[kind, kv_buckets]
  return get


def generate(engine, temperature):
  params = SamplingParams(max_new_tokens=72, temperature=temperature, seed=13,
                          stop_token_ids=STOPS[temperature])
  return engine.generate(prompts(), params)


@pytest.mark.parametrize("kind", ["vanilla"] + [pytest.param(k, marks=pytest.mark.slow)
                                               for k in ("chain", "tree", "ngram")])
def test_growing_caches_change_nothing(engines, kind):
  """Greedy and sampled, through the same two engines (compiling is most of the cost)."""
  pair = [engines(kind, ()), engines(kind, LADDER)]
  for temperature in (0.0, 1.0):
    full, grown = (generate(e, temperature) for e in pair)
    check_same(pair[1], full, grown)


def check_same(engine, full, grown):
  assert grown.tokens == full.tokens
  assert grown.finish_reasons == full.finish_reasons
  for a, b in zip(grown.logprobs, full.logprobs):
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
  # the small ladder was really used: chunks started small and grew as rows got longer
  assert grown.stats.grows >= 2
  assert len(set(grown.stats.segment_kv_lens)) >= 3
  assert min(grown.stats.segment_kv_lens) <= 40 < engine.config.cache_len
  assert set(full.stats.segment_kv_lens) == {engine.config.cache_len}
  # cache slots attended over, summed over decode steps and rows: fewer than at capacity
  def slot_steps(stats):
    return sum(b * n * kv for (b, n, *_), kv in zip(stats.segments, stats.segment_kv_lens))
  assert slot_steps(grown.stats) < slot_steps(full.stats)
  assert grown.stats.cache_bytes_peak <= full.stats.cache_bytes_peak


def test_without_compaction_a_chunk_keeps_its_batch_while_it_grows(target):
  result = generate(make(target, "vanilla", LADDER, compaction=False), 1.0)
  assert result.stats.grows >= 2
  assert result.stats.compact_s == 0.0  # no chunk was compacted


def test_default_ladder_and_capacity(target):
  config = EngineConfig(max_batch=2, max_prompt_len=32, max_new_tokens=4096)
  # 4096 would sit next to the capacity 4128: one of them is enough
  assert config.kv_lengths == (128, 256, 512, 1024, 2048, 32 + 4096)
  assert EngineConfig(max_prompt_len=32, max_new_tokens=4096 + 2048).kv_lengths[-2:] == (
      4096, 32 + 4096 + 2048)
  assert EngineConfig(max_prompt_len=32, max_new_tokens=32, kv_buckets=()).kv_lengths == (64,)
  # buckets at or above the capacity are dropped; the capacity is always the last one
  assert EngineConfig(max_prompt_len=8, max_new_tokens=8, kv_buckets=(4, 16, 32)).kv_lengths == (
      4, 16)
  # a prompt bucket starts in the smallest cache that holds it and one more step
  assert config.prefill_kv_len(32) == 128
  spec = EngineConfig(max_prompt_len=128, max_new_tokens=512, spec=SpecConfig(4, 1, 5))
  assert spec.prefill_kv_len(128) == 256  # 128 + the speculative step's slack


@pytest.mark.parametrize("bad", [(16, 8), (0, 8), (8, 8), (8.0,), (True,)])
def test_bad_kv_buckets_are_rejected(bad):
  with pytest.raises(ValueError, match="kv_buckets"):
    EngineConfig(kv_buckets=bad)


@pytest.mark.parametrize("kind", ["vanilla", pytest.param("tree", marks=pytest.mark.slow)])
def test_precompiled_pool_covers_every_growth(engines, kind):
  engine = engines(kind, LADDER)  # shared: what the growth test used is compiled already
  config = engine.config
  missing = set(engine.executable_keys()) - set(engine.pool.executables)
  n = engine.precompile()
  pool = engine.pool_stats()
  assert n == len(missing)  # it compiles exactly the executables not there yet
  assert pool["executables"] == len(engine.executable_keys())
  assert set(engine.pool.executables) == set(engine.executable_keys())
  assert pool["by_kind"]["grow"] == len(config.batch_buckets) * (len(pool["kv_lengths"]) - 1)
  assert pool["kv_lengths"][-1] == config.cache_len and pool["compile_s"] > 0
  for seed, temperature in ((0, 1.0), (1, 0.0), (2, 1.0)):
    params = SamplingParams(max_new_tokens=72, temperature=temperature, seed=seed,
                            stop_token_ids=STOPS[temperature])
    result = engine.generate(prompts(seed), params)
    assert result.stats.grows >= 1
    assert result.stats.compiles == 0
