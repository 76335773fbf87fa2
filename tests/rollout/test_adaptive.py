"""The adaptive engine: strategies chosen per segment (vanilla included), switching both ways
mid-generation, the shared executable pool, and drafter-invariant ("coupled") verification."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import RoundRobin, mirror_drafter, sharp_random_model
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.ngram import NgramConfig
from tlt_jax.rollout.decode.sampling import SamplerArgs, SamplingParams
from tlt_jax.rollout.host.scheduler import SETTLED_SEGMENTS, segment_lengths
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.host.tuner import TunerConfig, make_tuner

STOPS = (3, 4, 5, 6)
# Two trees of verify width 6 share one executable group; the chain is a group of its own.
STRATEGIES = (SpecConfig(4, 1, 5), SpecConfig(3, 2, 6), SpecConfig(4, 3, 6))
BASE = dict(max_batch=4, max_prompt_len=16, max_new_tokens=40, prefill_buckets=(16,))


def prompts_of(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(7, 32, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models():
  """(target, drafter): a 2-layer target with a random drafter, a 1-layer one with a mirror,
  a 3-layer one with a random EAGLE-3 drafter reading layers 1 and 2."""
  deep = sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=1)
  shallow = sharp_random_model(ModelConfig.tiny(vocab_size=32, num_layers=1), seed=1)
  three = sharp_random_model(ModelConfig.tiny(vocab_size=32, num_layers=3), seed=1)
  return {"random": (deep, Drafter.create(deep.config, seed=5)),
          "mirror": (shallow, mirror_drafter(shallow)),
          "eagle3": (three, Eagle3Drafter.for_target(three, seed=5, feature_layers=(1, 2)))}


def adaptive(target, drafter, tuner=None, **kw):
  cfg = dict(BASE, strategies=STRATEGIES, segment_steps=3)
  cfg.update(kw)
  return RolloutEngine(target, drafter=drafter, config=EngineConfig(**cfg),
                       tuner=tuner if tuner is not None else RoundRobin())


@pytest.fixture(scope="module")
def engines(models):
  """Engines built (and compiled) once per module, by name; sampling parameters and tuners
  change without recompiling, so the tests share them."""
  cache = {}

  def get(name):
    if name not in cache:
      kind, what = name.split("/")
      target, drafter = models[kind]
      if what == "vanilla":
        cache[name] = RolloutEngine(target, config=EngineConfig(**BASE))
      elif what.startswith("adaptive"):  # "adaptive" or "adaptive-coupled"
        cache[name] = adaptive(target, drafter,
                               verify="coupled" if what.endswith("coupled") else "rejection")
      else:  # "chain-coupled" / "tree-coupled"
        spec = STRATEGIES[0] if what.startswith("chain") else STRATEGIES[2]
        cache[name] = RolloutEngine(target, drafter=drafter,
                                    config=EngineConfig(**BASE, spec=spec, verify="coupled"))
    return cache[name]
  return get


# the full tier: switching every segment is the slowest way through; the fast tier switches
# arms in its coupled adaptive case and in notebook 04
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "mirror"])
def test_greedy_with_switching_every_segment_equals_vanilla(engines, kind):
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  vanilla, engine = engines(f"{kind}/vanilla"), engines(f"{kind}/adaptive")
  engine.set_tuner(RoundRobin())
  prompts = prompts_of([9, 2, 14, 5, 7, 1, 11], seed=3)
  got, want = engine.generate(prompts, params), vanilla.generate(prompts, params)
  assert got.tokens == want.tokens
  assert got.finish_reasons == want.finish_reasons
  for a, b in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-4)
  stats = got.stats
  used = {name for per_bucket in stats.arms.values() for name in per_bucket}
  assert used == {"vanilla", "chain d4", "tree d3 k2 v6", "tree d4 k3 v6"}, used
  assert stats.switches > 2 and stats.switch_s > 0  # vanilla -> SD, several times
  assert len({b for b, *_ in stats.segments}) > 1, "rows must move buckets"
  if kind == "mirror":  # a good drafter stays good after catching up
    chain = [a for per_bucket in stats.arms.values() for n, a in per_bucket.items()
             if n == "chain d4"]
    assert sum(a.tokens for a in chain) / sum(a.row_steps for a in chain) > 3.0


@pytest.mark.parametrize("kind", ["random", "eagle3"])
def test_catch_up_rebuilds_the_drafter_state_of_a_full_pass(models, engines, kind):
  """After vanilla segments, the drafter's cache after catch-up equals a drafter pass over the
  whole (prompt + generated) sequence's pairs: fails on any off-by-one in the feature history
  (an EAGLE-3 drafter's features: its target layers and the final hidden state)."""
  target, drafter = models[kind]
  engine = engines(f"{kind}/adaptive")
  pool, cfg = engine.pool, engine.config
  prompts = prompts_of([5, 11, 8], seed=4)  # 3 live rows in the 4-row bucket
  kv_len = cfg.prefill_kv_len(16)
  ids = np.zeros((4, 16), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  lens = np.array([len(p) for p in prompts] + [1], np.int32)
  rows = np.array([0, 1, 2, -1], np.int32)
  args = SamplerArgs.from_params(SamplingParams(max_new_tokens=40, temperature=0.0,
                                                stop_token_ids=()), (), cfg.max_stop_ids)
  weights = engine.weights()
  state, _ = pool.get(("prefill", 4, 16))(weights, ids, lens, rows, rows,
                                            pool.no_history(4), args)
  vanilla = pool.get(("segment", 4, kv_len, pool.stop_at(4), "vanilla"))
  for _ in range(4):  # 4 segments of segment_steps=3 vanilla steps
    state = vanilla(weights, state, args, np.int32(0), np.int32(cfg.segment_steps),
                    np.int32(pool.stop_at(4)))
  lag = np.asarray(state.cache.lengths - state.dcache.lengths)[:3]
  assert (lag > cfg.pending_width).all(), lag  # far behind after 12 vanilla steps
  state = pool.get(("catchup", 4, kv_len))(weights, state)
  dl = np.asarray(state.dcache.lengths)
  lag = (np.asarray(state.cache.lengths) - dl)[:3]
  assert ((lag >= 1) & (lag <= cfg.pending_width)).all(), lag
  gen = np.asarray(state.tokens)
  for b, p in enumerate(prompts):
    seq = np.array(p + gen[b, :int(state.num_generated[b])].tolist())
    # The reference passes run on kv_len tokens, zero-padded after the sequence: target and
    # drafter are causal, so no compared position sees the padding, and the eager ops compile
    # once for that width instead of once per row length (seconds each).
    padded = np.zeros((1, kv_len), np.int32)
    padded[0, :len(seq)] = seq
    hidden = target.forward(jnp.asarray(padded), return_hidden=drafter.target_features).hidden
    cache = drafter.init_cache(1, kv_len)
    out = drafter.forward(target, jnp.asarray(padded[:, 1:]), hidden[:, :-1], cache=cache)
    np.testing.assert_allclose(np.asarray(state.dcache.k[0][b, :dl[b]]),
                               np.asarray(out.cache.k[0][0, :dl[b]]), atol=2e-5)
    # and the pending pairs' features are the target's hidden states at their positions
    first = dl[b] - (len(p) - 1)
    n = int(state.num_generated[b])
    np.testing.assert_allclose(np.asarray(state.feats[b, first:n]),
                               np.asarray(hidden[0, len(p) - 1 + first:len(p) - 1 + n]),
                               atol=2e-5)


SAMPLED = {"plain": dict(temperature=1.0), "topk": dict(temperature=0.7, top_k=5),
           "topp": dict(temperature=0.9, top_p=0.8)}


# the fast tier: trees and the adaptive engine with plain sampling, a chain with top-k (the
# adaptive engine's chain catches the chain's mutant); the full tier: every mode, every sampling
COUPLED_FAST = {("tree", "plain"), ("adaptive", "plain"), ("chain", "topk")}


@pytest.mark.parametrize("mode, sampling", [
    pytest.param(mode, sampling, id=f"{mode}-{sampling}",
                 marks=() if (mode, sampling) in COUPLED_FAST else pytest.mark.slow)
    for sampling in SAMPLED for mode in ("chain", "tree", "adaptive")])
def test_coupled_speculative_emits_vanillas_sampled_tokens(engines, sampling, mode):
  params = SamplingParams(max_new_tokens=40, seed=5, stop_token_ids=STOPS, **SAMPLED[sampling])
  vanilla, engine = engines("mirror/vanilla"), engines(f"mirror/{mode}-coupled")
  prompts = prompts_of([9, 2, 14, 5, 7, 1, 11], seed=6)
  got, want = engine.generate(prompts, params), vanilla.generate(prompts, params)
  assert got.tokens == want.tokens
  for a, b in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-4)
  assert "stop" in got.finish_reasons  # rows stop, many inside accepted drafts
  assert got.stats.mean_accept_len > 1.5  # drafts were really accepted, not just bonuses


@pytest.mark.slow  # the coupled tokens do not depend on the drafter (tested below, fast)
def test_eagle3_adaptive_coupled_emits_vanillas_sampled_tokens(engines):
  """An EAGLE-3 drafter in the adaptive engine (switching vanilla, chain and trees every
  segment) with coupled verification: exactly vanilla's sampled tokens."""
  params = SamplingParams(max_new_tokens=40, seed=5, stop_token_ids=STOPS, temperature=1.0)
  vanilla, engine = engines("eagle3/vanilla"), engines("eagle3/adaptive-coupled")
  engine.set_tuner(RoundRobin())
  prompts = prompts_of([9, 2, 14, 5, 7, 1, 11], seed=6)
  got, want = engine.generate(prompts, params), vanilla.generate(prompts, params)
  assert got.tokens == want.tokens
  for a, b in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-4)
  used = {name for per_bucket in got.stats.arms.values() for name in per_bucket}
  assert {"vanilla", "chain d4"} <= used and got.stats.switches > 2, used
  assert sum(got.stats.accept_hist[1:]) > 0  # some drafts were accepted


@pytest.mark.slow
def test_rejection_sampling_does_not_reproduce_vanillas_tokens(engines):
  """The coupled test above bites: rejection sampling (lossless in law) draws other tokens."""
  params = SamplingParams(max_new_tokens=40, seed=5, temperature=1.0, stop_token_ids=())
  vanilla, engine = engines("mirror/vanilla"), engines("mirror/adaptive")
  engine.set_tuner(make_tuner(TunerConfig(kind="fixed", fixed=((4, "chain d4"),))))
  prompts = prompts_of([9, 2, 14, 5], seed=6)
  assert engine.generate(prompts, params).tokens != vanilla.generate(prompts, params).tokens


def test_coupled_tokens_do_not_depend_on_the_drafter_or_the_batch(models, engines):
  target, _ = models["mirror"]
  params = SamplingParams(max_new_tokens=30, seed=9, temperature=1.0, stop_token_ids=STOPS)
  prompts = prompts_of([3, 8, 12, 4, 6], seed=2)
  engine = engines("mirror/adaptive-coupled")
  engine.set_tuner(RoundRobin())
  good_run = engine.generate(prompts, params)
  first = good_run.tokens
  good = engine.drafter_params
  try:  # a drafter of random weights: other drafts, other acceptances, the same tokens
    engine.update_params(engine.params, nnx.split(Drafter.create(target.config, seed=3))[1])
    engine.set_tuner(RoundRobin())
    useless = engine.generate(prompts, params)
  finally:
    engine.update_params(engine.params, good)
  ngram = RolloutEngine(target, drafter=NgramConfig(max_ngram=2, depth=4), config=EngineConfig(
      **dict(BASE, max_batch=2), verify="coupled")).generate(prompts, params).tokens
  assert first == useless.tokens == ngram
  # the random drafter really drafted worse
  assert useless.stats.mean_accept_len < good_run.stats.mean_accept_len - 0.5


@pytest.mark.slow
def test_after_precompile_an_adaptive_tuned_rollout_compiles_nothing(engines):
  engine = engines("mirror/adaptive")
  # BEG-MAB exploring at every pull: its choices come from its seeded RNG, not from measured
  # speeds (with exploitation, whether it ever left the fastest arm depended on the machine's
  # timings and the test was flaky), so every arm and vanilla<->SD switches are exercised
  engine.set_tuner(make_tuner(TunerConfig(kind="beg_mab", epsilon=1.0, epsilon_min=1.0,
                                          decay=False)))
  engine.precompile()
  assert set(engine.executable_keys()) <= set(engine.pool.executables)
  switches = 0
  for seed in range(3):
    result = engine.generate(prompts_of([9, 2, 14, 5, 7, 1, 11], seed=seed), SamplingParams(
        max_new_tokens=40, temperature=1.0, seed=seed, stop_token_ids=STOPS))
    assert result.stats.compiles == 0
    switches += result.stats.switches
  summary = result.stats.tuner
  pulls = sum(arm["pulls"] for per_bucket in summary.values() for name, arm in per_bucket.items()
              if name != "best")
  assert pulls > 10 and switches > 0, (pulls, switches)  # the tuner was consulted and switched


def test_the_cost_tuner_is_calibrated_at_precompile_and_its_rollouts_compile_nothing(models):
  # its own engine, small enough to precompile whole in the fast tier: two buckets, a chain and
  # a tree (two verify groups), so rows move buckets and arms differ in cost
  # (SD steps of this tiny model cost 5-7 vanilla steps on this CPU, so no arm would pay: the
  # SD steps' costs come from a table where they pay at bucket 1 alone; tests/rollout/
  # test_offers.py has the rest)
  target, drafter = models["mirror"]
  engine = adaptive(target, drafter, tuner=make_tuner(TunerConfig()),  # kind="cost": the default
                    max_batch=2, strategies=STRATEGIES[:2])
  with_cost_table(engine, {1: 1.5, 2: 9.0})
  engine.precompile()
  costs, overhead = engine.calibration.costs
  visited = {v.bucket: v for v in engine.offers.visited}
  assert visited[1].offered and not visited[2].offered, engine.offers.visited
  want = {(b, s.name) for b in engine.offers.buckets for s in engine.candidates_for(b)
          if s.spec is None or visited.get(b) and visited[b].offered}
  assert set(costs) == want and all(c > 0 for c in costs.values()) and overhead >= 0
  for b in engine.config.batch_buckets:
    offered = [s.name for s in engine.strategies_for(b)]
    assert offered == ["vanilla"] + (visited[b].offered if b in visited else []), (b, offered)
  for b, s in want:  # a speculative step costs more than a vanilla step of its bucket
    if s != "vanilla":
      assert costs[(b, s)] > costs[(b, "vanilla")], (b, s, costs)
  assert all(engine.tuner.step_cost(b, "vanilla") is not None for b, _ in want)
  engine.set_tuner()  # a fresh tuner keeps the engine's calibration
  assert {(b, s): c for b, s, c in engine.tuner.state_dict()["costs"]} == costs
  lengths = engine.scheduler.segment_lengths  # bounded segments, measured against the boundary
  assert lengths == segment_lengths(costs, overhead, 3) and set(lengths) == {b for b, _ in want}
  assert all(3 <= n <= 3 * SETTLED_SEGMENTS for n in lengths.values())
  for seed in range(2):
    result = engine.generate(prompts_of([9, 2, 14, 5, 7, 1, 11], seed=seed), SamplingParams(
        max_new_tokens=40, temperature=1.0, seed=seed, stop_token_ids=STOPS))
    assert result.stats.compiles == 0


def with_cost_table(engine, relative: dict[int, float]):
  """Makes ``engine``'s calibration of SD arms read a table: vanilla's step as measured, each SD
  arm's ``relative[bucket]`` times it (the executables still compile and run once)."""
  measure = engine.calibrate_bucket

  def table(batch, strategies):
    costs = measure(batch, strategies)
    vanilla = costs[(batch, "vanilla")]
    return {(batch, s.name): vanilla * (1.0 if s.spec is None else relative[batch])
            for s in strategies}

  engine.calibrate_bucket = table
  return engine


def test_pool_compiles_only_what_each_bucket_may_use_and_shares_verify_groups(models):
  target, drafter = models["random"]
  cfg = dict(max_batch=8, max_prompt_len=16, max_new_tokens=40, prefill_buckets=(16,),
             kv_buckets=())
  engine = RolloutEngine(target, drafter=drafter, config=EngineConfig(
      **cfg, strategies=STRATEGIES, sd_max_batch=4, verify_budget=20))
  keys = engine.executable_keys()
  segments = {(k[1], k[4]) for k in keys if k[0] == "segment"}
  # vanilla everywhere; SD only up to sd_max_batch = 4, and the verify-6 trees only where
  # batch * 6 <= 20; the two trees share one group
  assert segments == {(1, "vanilla"), (2, "vanilla"), (4, "vanilla"), (8, "vanilla"),
                      (1, "chain d4"), (2, "chain d4"), (4, "chain d4"),
                      (1, "tree v6"), (2, "tree v6")}
  assert {k[1] for k in keys if k[0] == "catchup"} == {1, 2, 4}
  assert [s.name for s in engine.strategies_for(2)] == [
      "vanilla", "chain d4", "tree d3 k2 v6", "tree d4 k3 v6"]
  assert [s.name for s in engine.strategies_for(8)] == ["vanilla"]
  # A naive pool (every strategy its own engine at every bucket) compiles more executables.
  naive = sum(len(RolloutEngine(target, drafter=drafter, config=EngineConfig(
      **cfg, spec=s)).executable_keys()) for s in STRATEGIES)
  naive += len(RolloutEngine(target, config=EngineConfig(**cfg)).executable_keys())
  assert len(keys) < naive


def test_a_shared_group_runs_each_member_strategy(engines):
  """Both trees of the verify-6 group decode through one executable, and each really drafts
  its own tree: forcing one or the other changes acceptance, never the greedy tokens."""
  engine = engines("mirror/adaptive")
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=())
  prompts = prompts_of([9, 2, 14, 5], seed=8)
  accept = {}
  for name in ("tree d3 k2 v6", "tree d4 k3 v6"):
    engine.set_tuner(make_tuner(TunerConfig(kind="fixed", fixed=((4, name),))))
    result = engine.generate(prompts, params)
    assert set(result.stats.arms["4"]) == {name}
    accept[name] = result.stats.accept_hist  # [i]: steps that emitted i + 1 tokens
    if name == "tree d3 k2 v6":
      first = result.tokens
    else:
      assert result.tokens == first
  # the members drafted different trees (a depth-3 tree never emits 5 tokens in a step)
  assert accept["tree d3 k2 v6"] != accept["tree d4 k3 v6"], accept
  assert accept["tree d3 k2 v6"][4] == 0, accept


def test_critical_tokens_follow_the_longest_row_through_every_segment(engines):
  """Over a chunk's segments (arms switching, rows finishing and moving buckets), the tokens
  credited to the critical path add up to the chunk's longest completion, and the speculative
  arms' share of them is what ``saved_seconds`` prices: a mapping from slots to rows that slips,
  or a row other than the longest, breaks the sum."""
  engine = engines("mirror/adaptive")
  # vanilla while 3-4 rows are live, the chain at 1-2: arms switch as rows finish (few compiles)
  engine.set_tuner(make_tuner(TunerConfig(kind="fixed", fixed=((2, "chain d4"), (4, "vanilla")))))
  params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  for seed in (3, 5):
    result = engine.generate(prompts_of([9, 2, 14, 5], seed=seed), params)  # one chunk
    tallies = [t for per_bucket in result.stats.arms.values() for t in per_bucket.values()]
    assert sum(t.critical_tokens for t in tallies) == max(len(t) for t in result.tokens)
    assert len({b for b, *_ in result.stats.segments}) > 1, "rows must move buckets"
    assert all(t.critical_tokens <= t.tokens for t in tallies)
    assert {name for per_bucket in result.stats.arms.values() for name in per_bucket} == {
        "vanilla", "chain d4"}


def test_config_errors_say_what_to_do(models):
  target, drafter = models["random"]
  with pytest.raises(ValueError, match="either EngineConfig.spec"):
    EngineConfig(spec=SpecConfig(), strategies=(SpecConfig(2, 1, 3),))
  with pytest.raises(ValueError, match="no drafter"):
    RolloutEngine(target, config=EngineConfig(strategies=(SpecConfig(2, 1, 3),)))
  with pytest.raises(ValueError, match="verify must be one of"):
    EngineConfig(verify="gumbel")
  with pytest.raises(ValueError, match="duplicates"):
    EngineConfig(strategies=(SpecConfig(2, 1, 3), SpecConfig(2, 1, 3)))
  with pytest.raises(ValueError, match="segment_steps"):
    EngineConfig(segment_steps=-1)
  with pytest.raises(ValueError, match="topk=1"):
    RolloutEngine(target, drafter=NgramConfig(), config=EngineConfig(
        strategies=(SpecConfig(3, 2, 6),)))
  with pytest.raises(ValueError, match="tuner"):
    EngineConfig(strategies=(SpecConfig(2, 1, 3),), tuner=dict(kind="thompson"))
  # strategies and the tuner may come from a config file as plain lists / dicts
  cfg = EngineConfig(strategies=[[2, 1, 3], dict(depth=3, topk=2, verify_tokens=6)],
                     tuner=dict(kind="ucb1"))
  assert cfg.strategies == (SpecConfig(2, 1, 3), SpecConfig(3, 2, 6))
  assert cfg.tuner.kind == "ucb1" and cfg.segment_steps == 32 and cfg.adaptive


@pytest.mark.slow
def test_every_change_of_arm_is_a_switch_with_the_ngram_drafter_too(models):
  """n-gram strategies need no catch-up, yet vanilla -> n-gram, n-gram -> vanilla and one chain
  depth -> another are switches; a chunk's first segment is none (two chunks here)."""
  target, _ = models["mirror"]
  engine = RolloutEngine(target, drafter=NgramConfig(max_ngram=2, depth=4), config=EngineConfig(
      **BASE, strategies=(SpecConfig(4, 1, 5), SpecConfig(2, 1, 3)), segment_steps=3),
      tuner=RoundRobin())  # 3 arms offered in every bucket: every next segment changes arm
  prompts = prompts_of([9, 2, 14, 5, 7, 1, 11], seed=3)  # 7 rows: chunks of 4 and 3
  stats = engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.0,
                                                  stop_token_ids=STOPS)).stats
  names = [name for *_, name in stats.segments]
  assert {"vanilla", "ngram d4", "ngram d2"} <= set(names), names
  assert stats.switches == len(names) - 2 > 0, (stats.switches, names)
  assert stats.catchups == 0 and stats.switch_s == 0.0  # nothing to catch up


def test_the_tuner_is_charged_the_catch_up_of_its_segment(engines, monkeypatch):
  """A fake clock makes every timed span 1 s: a segment's reward is over 2 s when the drafter
  caught up before it (vanilla -> SD), else 1 s, so dropping switch_s from the reward fails."""
  from tlt_jax.rollout.host import scheduler  # pylint: disable=import-outside-toplevel

  clock = iter(range(10**9))
  monkeypatch.setattr(scheduler, "time", type("FakeTime", (), {
      "perf_counter": staticmethod(lambda: float(next(clock)))}))
  engine = engines("random/adaptive")
  tuner = RoundRobin()
  engine.set_tuner(tuner)
  prompts = prompts_of([9, 2, 14, 5], seed=3)  # one chunk
  stats = engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.0,
                                                  stop_token_ids=())).stats
  names = [name for *_, name in stats.segments]
  caught_up = [i > 0 and n != "vanilla" and names[i - 1] == "vanilla" for i, n in enumerate(names)]
  want = [(n, 2.0 if c else 1.0) for n, c in zip(names, caught_up)]
  assert [(arm, seconds) for arm, _, seconds, _ in tuner.updates] == want, (tuner.updates, want)
  for _, _, seconds, measured in tuner.updates:
    assert measured["switch_s"] == seconds - 1.0  # the catch-up's part, said apart
  assert stats.catchups == sum(caught_up) > 0 and stats.switch_s == stats.catchups


def test_segment_lengths_make_a_boundary_a_small_share_of_a_segment():
  costs = {(1, "vanilla"): 1e-4, (1, "d4"): 3e-4, (2, "vanilla"): 1e-3, (4, "vanilla"): 1e-5}
  # a boundary of 10 vanilla steps at bucket 1: 100 steps keep it at 10 %; bucket 2's step costs
  # as much as the boundary: the configured 32 stand; bucket 4's would want 1000: capped at 8 x 32
  assert segment_lengths(costs, 1e-3, 32) == {1: 100, 2: 32, 4: 256}
  assert segment_lengths(costs, 1e-3, 32, share=0.5) == {1: 32, 2: 32, 4: 200}
  assert segment_lengths(costs, 0.0, 32) == {1: 32, 2: 32, 4: 32}
  assert segment_lengths(costs, 1e-3, 0) == {}  # unbounded segments stay unbounded


def test_bounded_segments_run_the_scheduler_s_measured_length(engines):
  engine = engines("mirror/adaptive")
  engine.set_tuner(RoundRobin())  # never settles: every segment is a bounded one
  prompts = prompts_of([9, 2, 14, 5], seed=3)
  params = SamplingParams(max_new_tokens=40, temperature=0.0)
  saved = engine.scheduler.segment_lengths
  try:
    steps = {}
    for lengths in ({}, {b: 7 for b in engine.config.batch_buckets}):
      engine.scheduler.segment_lengths = lengths
      stats = engine.generate(prompts, params).stats
      steps[len(lengths)] = [n for _, n, _, _ in stats.segments]
    assert max(steps[0]) == 3  # EngineConfig.segment_steps
    assert max(steps[len(engine.config.batch_buckets)]) == 7
  finally:
    engine.scheduler.segment_lengths = saved


def test_the_tuner_learns_the_accepted_length_of_the_rows_the_rollout_waits_for(engines):
  """Every tuned speculative segment reports ``critical_length``: the tokens per step of the rows
  still live at its end (the last to finish, in a chunk's last segment), which can be no more
  than a step emits; rows accept differently, so somewhere it differs from the mean row's
  ``tokens / row_steps`` (a scheduler that passes the mean, or nothing, fails)."""
  engine = engines("random/adaptive")
  tuner = RoundRobin()
  engine.set_tuner(tuner)
  # requests of the catch-up test's shapes (one chunk of 4 rows: the executables it compiled;
  # stop ids are an argument, not a shape), whose rows stop apart
  for seed in (3, 5):
    engine.generate(prompts_of([9, 2, 14, 5], seed=seed),
                    SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS))
  sd = [(tokens, m) for arm, tokens, _, m in tuner.updates if arm != "vanilla"]
  assert sd
  widest = max(s.max_emit for s in STRATEGIES)
  for tokens, m in sd:
    assert m["critical_length"] is not None and 0 < m["critical_length"] <= widest, m
  assert any(abs(m["critical_length"] - tokens / m["row_steps"]) > 1e-6 for tokens, m in sd)
