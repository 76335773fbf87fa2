"""Which SD arms each batch bucket offers, decided from cost tables (a CPU's and an H200's), and
the engine's speculative executables compiled off the critical path: an arm is never used before
its executables exist, and nothing compiles once the pool is complete."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.helpers import mirror_drafter, sharp_random_model
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.host.offers import CHUNK, SdOffers, offered_buckets, paying, pays
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.host.scheduler import Strategy
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.host.tuner import TunerConfig, accepted_length, make_tuner
from tlt_jax.utils import FieldError, background_compile_count, compile_count

VANILLA = Strategy("vanilla", "vanilla", 0, None)
SUFFIX = Strategy("suffix d8", "suffix d8", 0, SpecConfig(8, 1, 9), "suffix")
CHAIN = Strategy("chain d4", "chain d4", 0, SpecConfig(4, 1, 5))
BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# Relative step costs (an SD step, drafting included, per vanilla step), measured on the tiny
# long-tail job (docs/benchmarks.md, "The long-tail job"). This 2-core CPU: the suffix arm at
# 3.2 / 3.8 / 6.2 / 4.7x at batch 1 / 2 / 4 / 8 (the engine's calibration) and a 9-token pass
# 1.8x a 1-token one at 16-64 before drafting (pass_cost_cpu_tiny.json), so ~5x with it.
CPU = {1: 3.2, 2: 3.8, 4: 6.2, 8: 4.7, 16: 5.0, 32: 5.0, 64: 5.0}
# The H200 (run 2's calibration at 1-8: 1.41 / 1.61 / 1.52 / 1.69x; pass_cost_h200.json's 9-token
# pass at 16 / 64: 1.38 / 1.33x, 32 between them).
H200 = {1: 1.41, 2: 1.61, 4: 1.52, 8: 1.69, 16: 1.38, 32: 1.36, 64: 1.33}


def table(relative: dict[int, float], vanilla_s: float = 1e-4) -> dict:
  """A cost table in seconds per step: vanilla's step grows with the batch, SD's is
  ``relative[bucket]`` times it."""
  out = {}
  for b, r in relative.items():
    out[(b, "vanilla")] = vanilla_s * (1 + b / 16)
    out[(b, SUFFIX.name)] = out[(b, "vanilla")] * r
  return out


def test_pays_compares_the_emitted_tokens_with_the_relative_cost():
  assert pays(5.0, 8, 1, 0.85) == (accepted_length(0.85, 8) > 5.0)
  assert pays(5.0, 8, 1, 0.85) and not pays(5.5, 8, 1, 0.85)  # 5.12 tokens a step
  assert not pays(9.0, 8, 1, 1.0) and pays(8.9, 8, 1, 1.0)  # at most depth + 1
  assert paying({(1, "vanilla"): 1.0}, 1, [VANILLA, SUFFIX], 0.85) == []  # never measured


def test_on_this_cpu_the_table_keeps_sd_to_the_small_buckets():
  candidates = {b: [VANILLA, SUFFIX] for b in BUCKETS}
  assert offered_buckets(table(CPU), candidates, 0.85) == {1: [SUFFIX.name], 2: [SUFFIX.name]}
  # a sharper prior (every draft accepted: 9 tokens) offers it wherever a step costs < 9
  assert set(offered_buckets(table(CPU), candidates, 1.0)) == set(BUCKETS)


def test_with_the_h200_s_pass_costs_sd_is_offered_up_to_batch_64():
  candidates = {b: [VANILLA, SUFFIX] for b in BUCKETS}
  assert offered_buckets(table(H200), candidates, 0.85) == {b: [SUFFIX.name] for b in BUCKETS}
  # at 0.5 per token a step emits ~2.0 tokens, above every bucket's 1.33-1.69x: still
  # everywhere; at 0.3 (1.43 tokens) it pays at batch 1 (1.41x) and the visit stops at the
  # first bucket where it does not (batch 2, 1.61x), though 16-64 (1.33-1.38x) would pay
  assert set(offered_buckets(table(H200), candidates, 0.5)) == set(BUCKETS)
  assert offered_buckets(table(H200), candidates, 0.3) == {1: [SUFFIX.name]}


def test_the_loop_stops_compiling_at_the_first_bucket_where_nothing_pays():
  """``SdOffers.run`` on the CPU table: it times bucket 1, 2 and 4, compiles the paying arms'
  executables at 1 and 2 alone, and never visits 8 and up."""
  candidates = {b: [VANILLA, SUFFIX, CHAIN] for b in BUCKETS}
  costs = table(CPU)
  for b in BUCKETS:  # the chain (5 tokens at most) costs 6x everywhere: it never pays
    costs[(b, CHAIN.name)] = costs[(b, "vanilla")] * 6.0
  compiled, published = [], []
  offers = SdOffers(candidates, 0.85, published.append)

  def keys_of(b, strategies, calibration_only):
    return [(b, s.name, calibration_only) for s in strategies]

  def compile_keys(keys):
    compiled.extend(keys)
    return len(keys)

  def calibrate(b, strategies):
    assert (b, SUFFIX.name, True) in compiled  # timed only once compiled
    return {(b, s.name): costs[(b, s.name)] for s in strategies}

  assert [s.name for s in offers.offered(1)] == ["vanilla"]  # before the loop: vanilla alone
  offers.run(compile_keys, keys_of, calibrate)
  assert offers.done.is_set() and [v.bucket for v in offers.visited] == [1, 2, 4]
  assert [k for k in compiled if not k[2]] == [(1, SUFFIX.name, False), (2, SUFFIX.name, False)]
  assert not published  # published to the engine at its next look, not from the loop's thread
  assert [s.name for s in offers.offered(2)] == ["vanilla", SUFFIX.name]
  assert [s.name for s in offers.offered(4)] == ["vanilla"]
  assert len(published) == 2 and offers.compiled == len(compiled)
  assert offers.visited[0].relative_costs == pytest.approx({SUFFIX.name: 3.2, CHAIN.name: 6.0})


def test_a_stop_waits_for_one_chunk_of_compiles_at_most():
  """At exit (or a cancel) the loop stops after the chunk of executables in flight: a bucket's 20
  executables are not all compiled first."""
  offers = SdOffers({1: [VANILLA, SUFFIX]}, 0.85)
  compiled = []

  def compile_keys(keys):
    compiled.extend(keys)
    offers.cancel(wait=False)  # the stop arrives while the first chunk compiles
    return len(keys)

  offers.start(compile_keys, lambda b, s, only: list(range(20)), lambda b, s: {})
  assert offers.wait(30)
  assert compiled == list(range(CHUNK)) and not offers.visited


def test_a_failed_loop_says_so_at_the_next_look():
  offers = SdOffers({1: [VANILLA, SUFFIX]}, 0.85)

  def broken(keys):
    raise MemoryError("no room")

  offers.start(broken, lambda *a: [1], lambda *a: {})
  assert offers.wait(30)
  with pytest.raises(RuntimeError, match="compiling the speculative arms failed"):
    offers.offered(1)


def test_sd_prior_acceptance_is_checked():
  with pytest.raises(FieldError, match=r"EngineConfig\.sd_prior_acceptance must be a number in "
                     r"\(0, 1\]"):
    EngineConfig(sd_prior_acceptance=0.0)
  with pytest.raises(FieldError, match=r"EngineConfig\.sd_max_batch"):
    EngineConfig(sd_max_batch=0)
  assert EngineConfig().sd_max_batch is None  # no fixed cap: the calibration decides
  assert EngineConfig(strategies=((4, 1, 5),)).serves(SpecConfig(4, 1, 5), 64)


# ---------------------------------------------------------------- the engine

STOPS = (3, 4, 5, 6)


@pytest.fixture(scope="module")
def model():
  target = sharp_random_model(ModelConfig.tiny(vocab_size=32, num_layers=1), seed=1)
  return target, mirror_drafter(target)


def engine_with_table(model, relative):
  """A cost-tuned adaptive engine (buckets 1, 2, 4) whose SD arms' calibration reads
  ``relative`` (vanilla's step as measured; see test_adaptive.with_cost_table)."""
  from tests.rollout.test_adaptive import with_cost_table  # pylint: disable=import-outside-toplevel
  target, drafter = model
  engine = RolloutEngine(target, drafter=drafter, tuner=make_tuner(TunerConfig()), config=
                         EngineConfig(max_batch=4, max_prompt_len=16, max_new_tokens=40,
                                      prefill_buckets=(16,), kv_buckets=(),
                                      strategies=((4, 1, 5),), segment_steps=3))
  return with_cost_table(engine, relative)


def used_arms(result) -> dict[int, set[str]]:
  return {int(b): set(arms) for b, arms in result.stats.arms.items()}


def test_background_precompile_offers_sd_only_once_its_executables_exist(model):
  """The first rollout waits for vanilla's executables alone and decodes vanilla while the SD
  arm compiles; every executable a segment runs exists before it runs; once the loop is done
  the arm is offered where the table says it pays (bucket 1 of 1, 2, 4), and nothing compiles."""
  engine = engine_with_table(model, {1: 1.5, 2: 1.5, 4: 9.0})
  release = threading.Event()
  compile_keys = engine.pool.compile

  def slow_compile(keys, progress=None):
    if any((k[0] == "segment" and k[4] != "vanilla") or k[0] == "catchup" for k in keys):
      release.wait(120)  # the SD arms' compile waits until the first rollout is done
    return compile_keys(keys, progress)

  engine.pool.compile = slow_compile
  get = engine.pool.get

  def strict_get(key):  # the scheduler runs only executables that exist
    assert engine.pool.executables.lookup(key) is not None, f"{key} ran before it was compiled"
    return get(key)

  engine.scheduler.pool.get = strict_get
  before = background_compile_count()
  try:
    run_while_gated(engine, release, before)
  finally:
    release.set()  # a failure must not leave the loop waiting at exit


def run_while_gated(engine, release, before):
  """The checks of the test above, while the SD arms' compile waits for ``release``."""
  compiled = engine.precompile(background=True)
  base = set(engine.pool.base_keys())
  assert compiled == len(base) and set(engine.pool.executables.keys()) == base
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  prompts = [[7, 9, 11], [8], [12, 13, 14, 15], [9, 9]]
  first = engine.generate(prompts, params)
  assert engine.learned_sd_possible()  # the loop has not finished: its arms may still come
  assert all(arms == {"vanilla"} for arms in used_arms(first).values()), used_arms(first)
  assert first.stats.compiles == 0
  release.set()
  assert engine.offers.wait(300)
  assert background_compile_count() > before  # the SD executables compiled in the thread
  n = compile_count()
  second = engine.generate(prompts, params)
  assert compile_count() == n and second.stats.compiles == 0
  assert [s.name for s in engine.strategies_for(1)] == ["vanilla", "chain d4"]
  assert [s.name for s in engine.strategies_for(2)] == ["vanilla", "chain d4"]
  assert [s.name for s in engine.strategies_for(4)] == ["vanilla"]
  catchups = {k[1] for k in engine.pool.executables.keys() if k[0] == "catchup"}
  assert catchups == {1, 2}  # bucket 4's arm was only timed: its catch-up never compiled
  assert second.tokens == first.tokens  # greedy: SD changes no token
  assert used_arms(second).get(4, {"vanilla"}) == {"vanilla"}


def test_a_foreground_precompile_is_complete_when_it_returns(model):
  engine = engine_with_table(model, {1: 9.0, 2: 1.5, 4: 1.5})  # nothing pays at bucket 1
  assert engine.learned_sd_possible()  # before the calibration: every permitted arm may be
  engine.precompile()
  assert not engine.learned_sd_possible()  # the learned drafter's arm is offered nowhere
  assert engine.offers.done.is_set() and [v.bucket for v in engine.offers.visited] == [1]
  assert all([s.name for s in engine.strategies_for(b)] == ["vanilla"] for b in (1, 2, 4))
  assert engine.precompile() == 0  # again: what it offers stands
  result = engine.generate([[7, 9, 11], [8]], SamplingParams(max_new_tokens=20, seed=3))
  assert result.stats.compiles == 0 and np.all([len(t) > 0 for t in result.tokens])


def test_sd_offers_all_offers_every_permitted_arm_and_times_it(model):
  """``sd_offers="all"``: the whole permitted pool compiles and every arm is offered, timed for
  the tuner, whatever the calibration says (the tuner alone decides)."""
  target, drafter = model
  engine = RolloutEngine(target, drafter=drafter, tuner=make_tuner(TunerConfig()), config=
                         EngineConfig(max_batch=2, max_prompt_len=16, max_new_tokens=40,
                                      prefill_buckets=(16,), kv_buckets=(),
                                      strategies=((4, 1, 5),), sd_offers="all"))
  engine.precompile()
  assert engine.offers is None and set(engine.executable_keys()) <= set(engine.pool.executables)
  assert all(engine.strategies_for(b) == engine.candidates_for(b) for b in (1, 2))
  assert {(b, "chain d4") for b in (1, 2)} <= set(engine.calibration.costs[0])
  with pytest.raises(FieldError, match=r"EngineConfig\.sd_offers must be one of"):
    EngineConfig(sd_offers="some")


def test_the_background_loop_survives_the_weights_being_replaced_and_donated(model):
  """A training step replaces the engine's weights and donates the old buffers while the SD arms
  compile and are timed in the background (the default job's first run failed so: "Buffer has
  been deleted or donated"): the loop times its own copy, made at precompile, and drops it once
  done."""
  import jax  # pylint: disable=import-outside-toplevel
  engine = engine_with_table(model, {1: 1.5, 2: 9.0, 4: 9.0})
  own = jax.tree.map(lambda x: x.copy(), engine.params)  # the engine's weights, ours to delete
  engine.update_params(own)
  release = threading.Event()
  compile_keys = engine.pool.compile

  def gated(keys, progress=None):
    if any(k[0] == "segment" and k[4] != "vanilla" for k in keys):
      release.wait(120)
    return compile_keys(keys, progress)

  engine.pool.compile = gated
  try:
    engine.precompile(background=True)
    assert engine.calibration_weights is not None
    engine.update_params(jax.tree.map(lambda x: x.copy(), own))  # a training step's new weights
    for leaf in jax.tree.leaves(own):  # ... and the old buffers donated
      leaf.delete()
  finally:
    release.set()  # (a failure must not leave the loop waiting at exit)
  assert engine.offers.wait(300)
  assert engine.offers.error is None, engine.offers.error
  assert [s.name for s in engine.strategies_for(1)] == ["vanilla", "chain d4"]
  assert engine.calibration_weights is None
  out = engine.generate([[7, 9, 11], [8]], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                          stop_token_ids=STOPS))
  assert out.stats.compiles == 0


def test_the_cache_lengths_only_sd_reaches_compile_with_the_sd_arms(model):
  """The adaptive engine's ladder holds vanilla's capacity (prompt + completion) and, above it,
  the SD slack's. Vanilla's pool stops at the first; the SD arms of a bucket bring the growth
  into the second and, there, vanilla's segments and compactions for that bucket and the smaller
  ones its rows compact into. A rollout whose SD rows grow into it runs nothing uncompiled."""
  from tests.rollout.test_adaptive import with_cost_table  # pylint: disable=import-outside-toplevel
  target, drafter = model
  engine = with_cost_table(RolloutEngine(
      target, drafter=drafter, tuner=make_tuner(TunerConfig(kind="cost")), config=EngineConfig(
          max_batch=2, max_prompt_len=16, max_new_tokens=40, prefill_buckets=(16,),
          strategies=((4, 1, 5),), segment_steps=3)), {1: 1.5, 2: 9.0})
  plain, cap = engine.pool.kv_lengths_used()
  assert plain == 56 and cap > plain and engine.pool.vanilla_lengths() == (plain,)
  base = engine.pool.base_keys()
  assert all(cap not in k[2:] for k in base), [k for k in base if cap in k[2:]]
  engine.precompile()
  compiled = set(engine.pool.executables.keys())
  assert ("grow", 1, plain, cap) in compiled and ("grow", 2, plain, cap) not in compiled
  assert ("segment", 1, cap, 0, "vanilla") in compiled
  assert ("segment", 2, cap, 1, "vanilla") not in compiled  # bucket 2 never decodes SD
  get = engine.pool.get

  def strict_get(key):
    assert engine.pool.executables.lookup(key) is not None, f"{key} ran before it was compiled"
    return get(key)

  engine.pool.get = strict_get
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=())
  long = [[7 + i % 20 for i in range(16)]]  # 16 + 40 > 56 - 15: SD needs the slack's length
  out = engine.generate(long, params)  # bucket 1: SD is offered there
  assert cap in out.stats.segment_kv_lens, out.stats.segment_kv_lens  # SD rows grew into it
  assert out.stats.compiles == 0 and any(n != "vanilla" for *_, n in out.stats.segments)
  assert engine.generate([[8]] * 2, params).stats.compiles == 0  # bucket 2: vanilla's pool


# ---- precompile_scope="first_step": the first request's executables first, the rest behind ------
FIRST_STEP = dict(max_batch=4, max_prompt_len=16, max_new_tokens=40, prefill_buckets=(8, 16),
                  kv_buckets=(24, 40), strategies=((4, 1, 5),), segment_steps=3,
                  precompile_scope="first_step")  # cache lengths 24, 40, 56: rows grow twice


def vanilla_stops():
  """Sampling whose rows stop at very different times (they compact, where they can)."""
  return SamplingParams(max_new_tokens=40, temperature=1.0, seed=4, stop_token_ids=(3,))


def test_first_step_scope_compiles_what_the_first_requests_start_with_and_defers_the_rest(model):
  """The foreground compiles ``first_keys`` alone (the batch bucket each first request starts in,
  the largest prompt bucket, vanilla's lengths from there); the rest of vanilla's pool compiles
  in the background thread, before the SD arms are timed; once it is in, nothing compiles."""
  from tests.rollout.test_adaptive import with_cost_table  # pylint: disable=import-outside-toplevel
  target, drafter = model
  engine = with_cost_table(RolloutEngine(target, drafter=drafter, tuner=make_tuner(TunerConfig()),
                                         config=EngineConfig(**FIRST_STEP)),
                           {1: 9.0, 2: 9.0, 4: 9.0})  # no arm pays: the loop stops at bucket 1
  first = engine.pool.first_keys([4, 3])
  assert {k[1] for k in first} == {4} and {k[2] for k in first if k[0] == "prefill"} == {16}
  n, bg = compile_count(), background_compile_count()
  assert engine.precompile(background=True, first_rows=[4, 3]) == len(first)
  assert set(first) <= set(engine.pool.executables.keys())
  assert compile_count() - n == len(first)  # nothing else in the foreground
  assert engine.offers.wait(300)
  order = engine.pool.executables.keys()  # in the order they were compiled
  assert set(engine.pool.base_keys()) <= set(order)
  assert background_compile_count() > bg  # compiled in the thread, not on the critical path:
  assert set(engine.pool.base_keys()) - set(first) <= engine.pool.executables.background_keys
  sd = [i for i, k in enumerate(order) if k[0] == "segment" and k[4] != "vanilla"]
  assert sd and min(sd) > max(order.index(k) for k in engine.pool.base_keys())
  n = compile_count()
  result = engine.generate([[7, 9, 11], [8], [12, 13, 14, 15]], vanilla_stops())
  assert compile_count() == n and result.stats.compiles == 0
  with pytest.raises(FieldError, match=r"EngineConfig\.precompile_scope must be one of"):
    EngineConfig(precompile_scope="first")


def test_a_rollout_decodes_on_compiled_buckets_while_the_rest_is_deferred(model):
  """With every key but ``first_keys`` deferred to a background compile that has not run, a
  rollout compiles nothing: its prompts go to the largest prompt bucket, its rows stay in the
  batch bucket they started in (no compaction into a bucket not compiled yet), and its tokens
  are those of an engine with the whole pool (padding changes no token)."""
  target, _ = model
  # segments of 8 steps at most: some end with rows live, where compaction is considered
  config = EngineConfig(**dict(FIRST_STEP, strategies=(), segment_steps=1))
  prompts = [[7, 9, 11], [8], [12, 13, 14, 15], [9, 9]]
  reference = RolloutEngine(target, config=config).generate(prompts, vanilla_stops())
  assert {b for b, *_ in reference.stats.segments} > {4}  # it compacts: rows end apart
  assert reference.stats.grows >= 2  # and its caches grow twice
  engine = RolloutEngine(target, config=config)
  first = engine.pool.first_keys([4])
  engine.pool.compile(first)
  engine.pool.defer([k for k in engine.pool.keys() if k not in set(first)])
  n = compile_count()
  result = engine.generate(prompts, vanilla_stops())
  assert compile_count() == n and set(engine.pool.executables.keys()) == set(first)
  assert {b for b, *_ in result.stats.segments} == {4}
  assert result.tokens == reference.tokens
  # once the smaller bucket is in, the rows compact into it (bucket 1 stays deferred)
  engine.pool.compile([k for k in engine.pool.keys() if 1 not in k[1:2] and
                       not (k[0] == "compact" and k[2] == 1)])
  again = engine.generate(prompts, vanilla_stops())
  assert {b for b, *_ in again.stats.segments} == {4, 2} and again.tokens == reference.tokens


def test_a_host_without_background_compiles_offers_vanilla_and_compiles_nothing_more(
    model, monkeypatch):
  """Where background compiles are off (a 2-core host), the offers loop never runs: no SD arm is
  offered, the learned drafter is known to be useless, the deferred buckets stay uncompiled and
  rollouts decode on the compiled ones, compiling nothing."""
  monkeypatch.setenv("TLT_BACKGROUND_COMPILE", "0")
  target, drafter = model
  engine = RolloutEngine(target, drafter=drafter, tuner=make_tuner(TunerConfig()),
                         config=EngineConfig(**FIRST_STEP))
  first = engine.pool.first_keys([4])
  n = background_compile_count()
  assert engine.precompile(background=True, first_rows=[4]) == len(first)
  assert engine.offers.skipped and engine.offers.done.is_set()
  assert not engine.learned_sd_possible()
  assert all([s.name for s in engine.strategies_for(b)] == ["vanilla"] for b in (1, 2, 4))
  n_fg = compile_count()
  result = engine.generate([[7, 9, 11], [8], [12, 13, 14, 15]], vanilla_stops())
  assert compile_count() == n_fg and background_compile_count() == n
  assert set(engine.pool.executables.keys()) == set(first)
  assert {b for b, *_ in result.stats.segments} == {4}
