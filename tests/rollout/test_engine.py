"""Behaviour of the vanilla rollout engine: buckets, compaction, sampling, compiles, errors."""

import jax
import numpy as np
import pytest

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.rollout.host.buckets import bucket_for
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.sampling import SamplerArgs, SamplingParams
from tests.helpers import sharp_random_model

STOPS = (3, 4, 5, 6)  # frequent enough that rows of a random model stop at very different times


@pytest.fixture(scope="module")
def model():
  return sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=1)


def make_engine(model, **kw):
  cfg = dict(max_batch=4, max_prompt_len=16, max_new_tokens=48, prefill_buckets=(8, 16))
  cfg.update(kw)
  return RolloutEngine(model, config=EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engines(model):
  """``engines(**kw)``: the engine of ``make_engine(model, **kw)``, built once per module.
  Compiling its executables is most of a test's cost, and sampling parameters change without
  recompiling, so the tests that only generate share these (tests about compiling build their
  own engines)."""
  cache = {}

  def get(**kw):
    key = tuple(sorted(kw.items()))
    if key not in cache:
      cache[key] = make_engine(model, **kw)
    return cache[key]
  return get


def prompts_of(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(7, 32, n).tolist() for n in lengths]


# Reference forwards are padded (after the sequence) to one width: the model is causal, so the
# padding changes no logit of the sequence's own positions, and eager op-by-op execution compiles
# its ops once for that shape instead of once per sequence length (seconds each).
REFERENCE_WIDTH = 64  # >= max_prompt_len + max_new_tokens of every engine here


def full_logits(model, seq):
  """Logits at every position of ``seq`` from one uncached forward pass (causal: padding after
  the sequence is never attended to)."""
  assert len(seq) <= REFERENCE_WIDTH
  ids = np.zeros((1, REFERENCE_WIDTH), np.int32)
  ids[0, :len(seq)] = seq
  return np.asarray(model(ids))[0, :len(seq)]


def full_logprobs(model, prompt, completion):
  """Log-probs of ``completion`` given ``prompt`` from one uncached forward pass."""
  logits = full_logits(model, prompt + completion)[len(prompt) - 1:-1]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  return logp[np.arange(len(completion)), completion]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bucketed_decode_equals_static_batch(engines, temperature):
  prompts = prompts_of([3, 9, 14, 5, 7, 2, 11])
  params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=7, stop_token_ids=STOPS)
  bucketed = engines().generate(prompts, params)
  static = engines(compaction=False).generate(prompts, params)
  assert bucketed.tokens == static.tokens
  for a, b in zip(bucketed.logprobs, static.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-5)
  lengths = sorted(len(t) for t in bucketed.tokens)
  assert lengths[0] < lengths[-1], "rows must finish at different times for this test to bite"
  # Compaction really happened: some segment ran in a bucket smaller than the first one.
  buckets = [segment[0] for segment in bucketed.stats.segments]  # (bucket, steps, seconds)
  assert min(buckets) < max(buckets)
  assert bucketed.stats.row_steps < static.stats.row_steps


def test_greedy_tokens_and_logprobs_match_uncached_forward(model, engines):
  prompts = prompts_of([2, 13, 6])
  result = engines().generate(
      prompts, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=()))
  for prompt, toks, lps in zip(prompts, result.tokens, result.logprobs):
    assert len(toks) == 12
    logits = full_logits(model, prompt + toks)
    # each greedy token is the argmax of the full-context logits at the previous position
    np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:-1], -1), toks)
    np.testing.assert_allclose(lps, full_logprobs(model, prompt, toks), atol=1e-4)
  assert result.finish_reasons == ["length"] * 3



def test_prefill_and_a_segment_run_one_at_a_time_decode_as_generate_does(engines):
  """The public pieces (``weights``, ``executable``, ``prefill``) are generate's own: a full
  batch bucket prefilled and decoded by one segment samples the tokens generate does."""
  engine = engines()
  prompts = prompts_of([8, 8, 8, 8], seed=3)
  params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, stop_token_ids=())
  args = SamplerArgs.from_params(params, (), engine.config.max_stop_ids)
  state = engine.prefill(np.array(prompts), [8] * 4, args)
  assert state.cache.max_len == engine.config.prefill_kv_len(8)
  segment = engine.executable(("segment", 4, state.cache.max_len, engine.pool.stop_at(4),
                               "vanilla"))
  state = segment(engine.weights(), state, args, np.int32(0), np.int32(0), np.int32(0))
  ran = np.asarray(state.num_generated)
  assert int(state.counters["steps"]) >= 1 and (ran == ran[0]).all() and ran[0] > 1
  result = engine.generate(prompts, params)
  tokens = np.asarray(state.tokens)
  assert [t[:ran[0]] for t in result.tokens] == [row[:ran[0]].tolist() for row in tokens]

def test_stop_token_included_and_reported(engines):
  prompts = prompts_of([4, 8, 12, 3])
  result = engines().generate(
      prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop_token_ids=STOPS))
  assert "stop" in result.finish_reasons
  for toks, reason in zip(result.tokens, result.finish_reasons):
    if reason == "stop":
      assert toks[-1] in STOPS and not set(toks[:-1]) & set(STOPS)
    else:
      assert len(toks) == 40 and not set(toks) & set(STOPS)


def test_a_stop_token_sampled_first_ends_its_row_at_once(engines):
  # the first token comes from the prefill, not from a decode step: a stop id drawn there must
  # end the row with that one token, as it would at any later position
  prompts = prompts_of([4, 8, 12, 3, 6], seed=5)
  engine = engines()
  for temperature in (0.0, 1.0):
    params = dict(max_new_tokens=40, temperature=temperature, seed=3)
    free = engine.generate(prompts, SamplingParams(**params))
    firsts = [t[0] for t in free.tokens]
    stop = firsts[1]  # row 1 (and any other row that starts with it) draws it first
    stopped = engine.generate(prompts, SamplingParams(**params, stop_token_ids=(stop,)))
    for toks, first, reason, free_toks in zip(stopped.tokens, firsts, stopped.finish_reasons,
                                               free.tokens):
      if first == stop:
        assert toks == [stop] and reason == "stop", (toks, reason)
      else:  # the same stream, cut at its first stop (if any)
        cut = free_toks.index(stop) + 1 if stop in free_toks else len(free_toks)
        assert toks == free_toks[:cut]
    assert sum(f != stop for f in firsts) > 0  # other rows went on


def test_rows_compacted_beside_padding_slots_finish_whole(engines, monkeypatch):
  # 3 live rows of 8 move to bucket 4, whose fourth slot is padding (a copy of slot 0's state):
  # the padding must not pass for that row. Built greedy and deterministic: rows 0-2 share a
  # prompt that runs to the length limit, rows 3-7 one whose greedy walk soon meets the stop id,
  # so rows 0-2 finish together in bucket 4, beside a padding copy of row 0 frozen at compaction
  engine, static = engines(max_batch=8), engines(max_batch=8, compaction=False)
  padded = []
  real = engine.scheduler.compact

  def spy(run, live, *args):
    padded.append(bucket_for(live.size, engine.config.batch_buckets) > live.size)
    return real(run, live, *args)

  monkeypatch.setattr(engine.scheduler, "compact", spy)
  long, short = prompts_of([6, 9], seed=3)
  free = engine.generate([long, short], SamplingParams(max_new_tokens=24, temperature=0.0)).tokens
  stop = next(t for t in free[1][1:8] if t not in free[0])  # ends short's rows early, long's never
  params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop,))
  result = engine.generate([long] * 3 + [short] * 5, params)
  cut = free[1][:free[1].index(stop) + 1]
  assert result.tokens == [free[0]] * 3 + [cut] * 5, [len(t) for t in result.tokens]
  assert result.tokens == static.generate([long] * 3 + [short] * 5, params).tokens
  assert padded == [True], padded  # one compaction, 8 -> 4 with a padding slot


def test_row_sample_does_not_depend_on_batch(engines):
  prompts = prompts_of([5, 9, 3, 12, 7, 4])  # 6 prompts -> two chunks with max_batch=4
  params = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=10, top_p=0.9, seed=11,
                          stop_token_ids=STOPS)
  engine = engines()
  together = engine.generate(prompts, params)
  assert len(together.tokens) == 6
  # A row's PRNG stream is keyed by its index in the request, so a request holding only
  # rows 0..2 reproduces them exactly, whatever buckets they ran in.
  first_three = engine.generate(prompts[:3], params)
  assert first_three.tokens == together.tokens[:3]


def test_top_k_one_is_greedy(engines):
  prompts = prompts_of([6, 10])
  engine = engines()
  greedy = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                   stop_token_ids=()))
  top1 = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1,
                                                 seed=5, stop_token_ids=()))
  assert greedy.tokens == top1.tokens
  for lp in top1.logprobs:  # the sampling distribution actually used is a point mass
    np.testing.assert_allclose(lp, 0.0, atol=1e-6)


def test_no_recompilation_after_precompile(engines):
  engine = engines()  # shared: the executables other tests used are compiled already
  missing = set(engine.executable_keys()) - set(engine.pool.executables)
  assert engine.precompile() == len(missing)  # it compiles exactly the ones not there yet
  assert set(engine.pool.executables) == set(engine.executable_keys())
  assert engine.precompile() == 0
  for lengths, seed in (([3, 5], 0), ([15, 2, 9], 1), ([1, 7, 16, 4], 2)):
    result = engine.generate(prompts_of(lengths, seed), SamplingParams(
        max_new_tokens=30 - seed, temperature=0.5 + seed, seed=seed, top_p=0.9,
        stop_token_ids=STOPS[:seed + 1]))
    assert result.stats.compiles == 0, result.stats
    assert result.stats.compile_s == 0.0


def test_lazy_compiles_happen_once(model):
  engine = make_engine(model)
  params = SamplingParams(max_new_tokens=20, temperature=1.0, stop_token_ids=STOPS)
  first = engine.generate(prompts_of([4, 6, 8]), params)
  # (<=: JAX may serve an executable another engine already compiled from its own cache)
  assert 0 < first.stats.compiles <= len(engine.pool.executables)
  for lengths, seed in (([5, 7, 3], 1), ([2], 2), ([9, 9, 9, 9], 3), ([5, 7, 3], 1)):
    before = set(engine.pool.executables)
    again = engine.generate(prompts_of(lengths, seed), params)
    # every XLA compile is a new bucket executable: nothing else ever compiles
    assert again.stats.compiles <= len(set(engine.pool.executables) - before)
  assert again.stats.compiles == 0


@pytest.mark.parametrize("bad, match", [
    ([[]], "prompt 0 is empty"),
    ([[1] * 17], "max_prompt_len"),
    ([[1, 2], [99]], "outside the vocabulary"),
    ([], "at least one prompt"),
])
def test_bad_prompts_are_rejected(model, bad, match):
  with pytest.raises(ValueError, match=match):
    make_engine(model).generate(bad, SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("bad, error, match", [
    ([1, 2, 3], TypeError, r"prompts\[0\] is an int: pass a list of prompts, each a list of "
                           r"token ids"),
    (np.array([7, 8, 9]), TypeError, r"prompts\[0\] is an int"),
    ("12+3=", TypeError, r"prompts is a str.*encode text with the tokenizer"),
    (["12+3=", [1, 2]], TypeError, r"prompts\[0\] is a str.*encode text with the tokenizer"),
    ([[1, 2], 7], TypeError, r"prompts\[1\] is an int"),
    (5, TypeError, r"prompts is an int: pass a list of prompts"),
    ([[1, 1.5]], TypeError, r"prompts\[0\]\[1\] is 1.5 \(float\): token ids must be ints"),
    ([[1, 2.0]], TypeError, r"prompts\[0\]\[1\] is 2.0 \(float\)"),
    ([[1], [2, "3"]], TypeError, r"prompts\[1\]\[1\] is '3' \(str\)"),
    ([[True, 2]], TypeError, r"prompts\[0\]\[0\] is True \(bool\)"),
    ([np.array([1.0, 2.0])], TypeError, r"prompts\[0\]\[0\] is .*float"),
    ([[1, [2]]], TypeError, r"prompts\[0\]\[1\] is \[2\] \(list\)"),
])
def test_prompts_that_are_not_lists_of_token_ids_are_rejected(model, bad, error, match):
  with pytest.raises(error, match=match):
    make_engine(model).generate(bad, SamplingParams(max_new_tokens=4))


def test_integer_arrays_and_tuples_are_accepted_as_prompts(model):
  checked = make_engine(model).check_prompts(
      ([np.int32(7), 8], np.array([9, 10], np.int64), (11,), jax.numpy.array([12, 13])))
  assert checked == [[7, 8], [9, 10], [11], [12, 13]]
  assert all(type(t) is int for p in checked for t in p)  # pylint: disable=unidiomatic-typecheck
  assert make_engine(model).check_prompts(np.array([[7, 8], [9, 10]])) == [[7, 8], [9, 10]]


def test_progress_callbacks_count_compiles_and_finished_rows(model):
  engine = make_engine(model, max_batch=2, prefill_buckets=(16,))
  compiled = []
  total = engine.precompile(
      lambda done, n: compiled.append((done, n, len(engine.pool.executables))))
  # called once per executable, after it compiled, with the number this call compiles
  assert total == len(engine.executable_keys()) > 1
  assert compiled == [(i, total, i) for i in range(1, total + 1)]
  assert engine.precompile(lambda *a: compiled.append(a)) == 0 and len(compiled) == total

  calls = []
  result = engine.generate(prompts_of([3, 9, 5]), SamplingParams(
      max_new_tokens=40, temperature=1.0, seed=3, stop_token_ids=STOPS),
      progress=lambda done, n: calls.append((done, n)))
  assert result.stats.compiles == 0
  assert len(calls) == len(result.stats.segments)  # once per segment, no extra syncs
  assert all(n == 3 for _, n in calls) and calls[-1] == (3, 3)
  done = [d for d, _ in calls]
  assert done == sorted(done) and 2 in done  # the first chunk (2 rows) ends before the second


def test_bad_sampling_and_engine_values_are_rejected(model):
  with pytest.raises(ValueError, match="max_new_tokens"):
    make_engine(model).generate([[1, 2]], SamplingParams(max_new_tokens=49))
  with pytest.raises(ValueError, match="max_stop_ids"):
    make_engine(model).generate([[1, 2]], SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(9))))
  with pytest.raises(ValueError, match="SamplingParams.top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="SamplingParams.temperature"):
    SamplingParams(temperature=-1.0)
  with pytest.raises(ValueError, match="EngineConfig.max_batch"):
    EngineConfig(max_batch=0)
  with pytest.raises(ValueError, match="EngineConfig.batch_buckets"):
    EngineConfig(max_batch=8, batch_buckets=(1, 4, 2, 8))
  with pytest.raises(ValueError, match="EngineConfig.prefill_buckets"):
    EngineConfig(max_prompt_len=64, prefill_buckets=(16, 32))


def test_compacted_rows_match_an_uncached_forward(model, engines):
  """An independent reference for compaction: with stop ids ending rows early (so the live rows
  and their KV move to smaller buckets), every row's greedy tokens are the argmax walk of an
  uncached forward over its own context, and every sampled token's log-prob is that forward's."""
  prompts = prompts_of([3, 9, 14, 5, 7, 2, 11, 6], seed=4)
  engine = engines(max_batch=8)
  for temperature in (0.0, 1.0):
    result = engine.generate(prompts, SamplingParams(
        max_new_tokens=40, temperature=temperature, seed=2, stop_token_ids=STOPS))
    assert len({s[0] for s in result.stats.segments}) > 1, "rows must move buckets"
    for prompt, toks, lps in zip(prompts, result.tokens, result.logprobs):
      np.testing.assert_allclose(lps, full_logprobs(model, prompt, toks), atol=1e-4)
      if temperature == 0.0:
        logits = full_logits(model, prompt + toks)
        np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:-1], -1), toks)


def test_every_chunk_samples_as_one_batch_would(model, engines):
  """Six prompts over max_batch=4 run as two chunks; every row (both chunks) equals the same
  request decoded as one chunk of 8, and its log-probs are the uncached forward's."""
  prompts = prompts_of([5, 9, 3, 12, 7, 4], seed=6)
  params = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=10, top_p=0.9, seed=11,
                          stop_token_ids=STOPS)
  chunked = engines().generate(prompts, params)  # max_batch=4
  whole = engines(max_batch=8).generate(prompts, params)
  assert chunked.tokens == whole.tokens and chunked.finish_reasons == whole.finish_reasons
  assert len({tuple(t) for t in chunked.tokens}) == 6
  unfiltered = SamplingParams(max_new_tokens=20, temperature=1.0, seed=11, stop_token_ids=STOPS)
  plain = engines().generate(prompts, unfiltered)
  for prompt, toks, lps in zip(prompts, plain.tokens, plain.logprobs):
    np.testing.assert_allclose(lps, full_logprobs(model, prompt, toks), atol=1e-4)


_ON_DEVICE_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from tlt_jax.rollout.interface import on_device
for n in (1, 4):
  mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
  x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, PartitionSpec()))
  for shard in x.addressable_shards:
    y = on_device(x, shard.device)
    assert y.sharding == SingleDeviceSharding(shard.device), (n, shard.device, y.sharding)
    assert y.unsafe_buffer_pointer() == shard.data.unsafe_buffer_pointer(), "copied"
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
other = jax.devices()[1]
z = on_device(jax.device_put(jnp.ones(3), jax.devices()[0]), other)  # elsewhere: copied there
assert z.sharding == SingleDeviceSharding(other)
print("ok")
"""


def test_on_device_hands_each_engine_a_single_device_view_of_its_copy():
  """The engines' weights are single-device arrays on their device, whatever sharding the
  update left them in (a one-device mesh's included: compiling for that sharding made a resumed
  run, whose restored weights are single-device, miss the compile cache), without a copy where
  the device holds a full one."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from tests.xla_env import subprocess_env  # pylint: disable=import-outside-toplevel
  done = subprocess.run([sys.executable, "-c", _ON_DEVICE_CHECK], env=subprocess_env(4),
                        capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
