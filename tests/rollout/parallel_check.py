"""Run by test_parallel in a fresh process with 2 simulated CPU devices: the data-parallel
rollout gives the tokens of one device, decodes each shard on its own device, and idle devices
really run work while the others decode (counted)."""

import os

from tests.xla_env import device_count_flags  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = device_count_flags(2)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import threading  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from tests.helpers import sharp_random_model  # pylint: disable=wrong-import-position
from tlt_jax.models.model_config import ModelConfig  # pylint: disable=wrong-import-position
from tlt_jax.models.drafter import Drafter  # pylint: disable=wrong-import-position
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine  # pylint: disable=wrong-import-position
from tlt_jax.rollout.parallel import DataParallelRollout  # pylint: disable=wrong-import-position
from tlt_jax.rollout.decode.sampling import SamplingParams  # pylint: disable=wrong-import-position
from tlt_jax.rollout.decode.speculative import SpecConfig  # pylint: disable=wrong-import-position
from tlt_jax.rollout.decode.suffix import SuffixConfig  # pylint: disable=wrong-import-position
from tlt_jax.utils import compile_count  # pylint: disable=wrong-import-position

assert jax.device_count() == 2, jax.devices()
CACHED = bool(os.environ.get("JAX_COMPILATION_CACHE_DIR"))  # the tests' session cache
devices = jax.devices()
target = sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=2)
drafter = Drafter.create(target.config, seed=3)
base = dict(max_batch=4, max_prompt_len=16, max_new_tokens=24, prefill_buckets=(16,))
rng = np.random.default_rng(0)
prompts = [rng.integers(7, 32, n).tolist() for n in [3, 9, 16, 5, 12, 4, 7, 8]]
stops = (3, 4, 5, 6)

cases = [
    ("vanilla sampled", None, EngineConfig(**base), 1.0),
    ("adaptive coupled sampled", drafter, EngineConfig(
        **base, strategies=(SpecConfig(3, 1, 4), SpecConfig(2, 2, 4)), segment_steps=2,
        verify="coupled"), 1.0),
]
dps = {}
for name, d, cfg, temperature in cases:
  params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5, stop_token_ids=stops)
  one = RolloutEngine(target, d, cfg).generate(prompts, params)
  dp = dps[name] = DataParallelRollout(target, d, cfg, devices=devices)
  many = dp.generate(prompts, params, collect_hidden=d is not None)
  assert many.tokens == one.tokens, (name, many.tokens, one.tokens)
  assert many.finish_reasons == one.finish_reasons, name
  for a, b in zip(many.logprobs, one.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert [s.rows for s in many.stats.devices] == [4, 4], many.stats.devices
  assert many.stats.tokens == sum(len(t) for t in one.tokens)
  # the tail is wall time: one device's tail (the longest), not the sum over devices
  assert many.stats.tail_s in [d.tail_s for d in many.stats.devices], many.stats
  assert many.stats.tail_s <= many.stats.rollout_wall_s, many.stats
  for k, engine in enumerate(dp.engines):  # each shard ran on its own device
    assert engine.pool.executables, (name, k)
    for leaf in jax.tree.leaves(engine.params):
      assert leaf.devices() == {devices[k]}, (name, k, leaf.devices())
  # one compile per program: what the second device ran was rebound from the first's compile
  # (with a persistent cache, an executable loaded from it is not rebound: its device loads its own)
  programs = set().union(*(e.pool.executables.keys() for e in dp.engines))
  held = sum(len(e.pool.executables) for e in dp.engines)
  assert not dp.programs.rebind_errors, dp.programs.rebind_errors
  assert dp.programs.compiles + dp.programs.rebinds == held, (name, dp.programs.compiles, held)
  if not CACHED:
    assert dp.programs.compiles == len(programs), (name, dp.programs.compiles, len(programs))
  if d is not None:
    assert len(many.hidden) == len(prompts) and all(h is not None for h in many.hidden)
    for p, c, h in zip(prompts, many.tokens, many.hidden):
      assert h.shape[0] == len(p) + len(c) - 1
  print(f"{name}: same tokens on 2 devices as on one")

# The suffix drafter over 2 devices: each shard drafts from its own prompts' history, and the
# coupled tokens are one device's.
sfx = SuffixConfig(depth=3, history_len=64)
cfg = EngineConfig(**base, suffix_strategies=(SpecConfig(3, 1, 4),), verify="coupled",
                   tuner=dict(kind="fixed", fixed=((4, "suffix d3"),)))
params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, stop_token_ids=stops)
earlier = RolloutEngine(target, config=EngineConfig(**base)).generate(
    prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, stop_token_ids=stops))
history = [[t] for t in earlier.tokens]
one = RolloutEngine(target, config=cfg, suffix=sfx).generate(prompts, params, history=history)
many = DataParallelRollout(target, None, cfg, devices=devices, suffix=sfx).generate(
    prompts, params, history=history)
assert many.tokens == earlier.tokens and one.tokens == earlier.tokens
assert many.stats.source_steps == one.stats.source_steps and many.stats.source_steps["history"]
assert many.stats.accept_by_source()["history"] > 3.0, many.stats.accept_by_source()
print("suffix drafter: same tokens on 2 devices, drafted from the history")

# Idle devices work while the others decode: 1 prompt over 2 devices leaves device 1 with no
# rows; its idle hook runs jitted steps on its own device until the last shard is done.
dp = dps["vanilla sampled"]
params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1, stop_token_ids=())
work = jax.jit(lambda x: jnp.tanh(x @ x) * 0.5)
x2 = jax.device_put(jnp.ones((64, 64)), devices[1])
jax.block_until_ready(work(x2))
dp.generate(prompts[:1], params)  # warm-up: every executable this rollout needs
steps_during = {}
shard_seen = []


def idle(k, stop):
  n = 0
  while not stop.is_set():
    jax.block_until_ready(work(x2))
    n += 1
    if n == 5:
      busy_done.set()
  steps_during[k] = n
  return {"steps": n}


busy_done = threading.Event()  # set by the idle device after 5 steps


class Work:  # an ``IdleWork`` (rollout/interface.py) made of two functions
  def __init__(self, shard_done, idle):
    self.shard_done, self.idle = shard_done, idle


def shard_done(k, first, result):
  # holds device 0's shard open until the idle device has worked (the rollout itself takes a few
  # milliseconds here): the idle hook must have been running while a shard was still open
  shard_seen.append((k, first, len(result.tokens)))
  assert busy_done.wait(60), "the idle device never ran"


compiles = compile_count()
out = dp.generate(prompts[:1], params, idle_work=Work(shard_done, idle))
assert compile_count() == compiles, "warmed up: the rollout compiled nothing"
assert shard_seen == [(0, 0, 1)], shard_seen
assert steps_during.get(1, 0) >= 5 and 0 not in steps_during, steps_during
assert out.stats.idle[1] == {"steps": steps_during[1]}
dev = out.stats.devices
assert dev[1].rows == 0 and 0 < dev[1].idle_used_s <= dev[1].idle_s, dev
assert dev[1].idle_s >= 0.9 * out.stats.rollout_wall_s, dev
print(f"idle device ran {steps_during[1]} steps while device 0 decoded; devices: {dev}")

# an error in a shard reaches the caller and stops the idle devices
waiting, stopped = threading.Event(), threading.Event()


def bad_shard_done(k, first, result):
  assert waiting.wait(60)  # the idle device is in its hook
  raise RuntimeError(f"shard {k} failed")


def idle_until(k, stop):
  waiting.set()
  stop.wait(60)
  stopped.set()

try:
  dp.generate(prompts[:1], params, idle_work=Work(bad_shard_done, idle_until))
  raise AssertionError("the shard's error was swallowed")
except RuntimeError as e:
  assert "failed" in str(e), e
assert stopped.is_set()
# The spot trainer end to end: device 1 has no rows, so it trains the drafter (the trainer's
# ``idle_work``, a real SpotTrainer) while device 0 decodes; device 0's shard is held open until the
# drafter has taken 3 steps there, then the stop preempts the run at a step boundary.
import time  # pylint: disable=wrong-import-position,wrong-import-order
from flax import nnx  # pylint: disable=wrong-import-position,wrong-import-order
from tlt_jax.drafter.online import (DrafterTrainingConfig, OnlineDrafter,  # pylint: disable=wrong-import-position
                                       step_metrics)

dp = dps["adaptive coupled sampled"]
online = OnlineDrafter(drafter, nnx.split(target)[0], DrafterTrainingConfig(rows=2, seq_len=16))
params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, stop_token_ids=())
online.add(0, prompts, dp.generate(prompts, params, collect_hidden=True))  # the previous step
spot_work = online.idle_work(1, prompts[:1], dp)


def held_open(k, first_row, result):
  spot_work.shard_done(k, first_row, result)
  deadline = time.time() + 120
  while online.spot.steps < 3 and time.time() < deadline:
    time.sleep(0.01)


out = dp.generate(prompts[:1], params, collect_hidden=True,
                  idle_work=Work(held_open, spot_work.idle))
runs = online.spot_runs()
assert len(runs) == 1 and runs[0]["device"] == 1 and runs[0]["preempted"], runs
assert runs[0]["steps"] >= 3 and online.spot.steps == runs[0]["steps"], runs
assert online.buffer.steps == [0, 1], online.buffer.steps  # the finished shard went in first
for leaf in jax.tree.leaves(online.spot.params):
  assert leaf.devices() == {devices[1]}
m = step_metrics(out.stats, runs, None, {})
assert m["drafter_spot_steps"] == runs[0]["steps"] and m["tail_idle_used_device_s"] > 0, m
assert m["tail_idle_used_device_s"] <= m["tail_idle_device_s"] + 1e-9, m  # used within the tail
assert m["drafter_train_loss"] > 0 and m["spot_overrun_s"] >= 0, m
dp.update_params(dp.engines[0].params, online.engine_params(devices[0]))
for k, engine in enumerate(dp.engines):  # every engine decodes with the new drafter, on its device
  for new, leaf in zip(jax.tree.leaves(online.spot.params), jax.tree.leaves(engine.drafter_params)):
    assert leaf.devices() == {devices[k]}
    np.testing.assert_array_equal(np.asarray(new), np.asarray(leaf))
print(f"spot trainer: {runs[0]['steps']} drafter steps on the idle device, preempted at a step "
      f"boundary")

# The default cost tuner across devices: vanilla's executables on every device first; the SD arms
# in the background, timed on device 0 (here read from a table where they pay at bucket 1 alone)
# and compiled and offered on every device at once; then nothing compiles.
from tlt_jax.rollout.host.tuner import TunerConfig  # pylint: disable=wrong-import-position
from tlt_jax.utils import background_compile_count  # pylint: disable=wrong-import-position

cfg = EngineConfig(**base, strategies=(SpecConfig(3, 1, 4),), verify="coupled",
                   tuner=TunerConfig())
dp_cost = DataParallelRollout(target, drafter, cfg, devices=devices)
measure = dp_cost.engines[0].calibrate_bucket


def table(batch, strategies):
  costs = measure(batch, strategies)
  return {(batch, s.name): costs[(batch, "vanilla")] * (1.5 if batch == 1 else 9.0)
          if s.spec is not None else costs[(batch, s.name)] for s in strategies}


dp_cost.engines[0].calibrate_bucket = table
bg0 = background_compile_count()
dp_cost.precompile(background=True)
assert all(e.offers is dp_cost.engines[0].offers for e in dp_cost.engines)
assert dp_cost.engines[0].offers.wait(300)
assert background_compile_count() > bg0
params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, stop_token_ids=stops)
n = compile_count()
out = dp_cost.generate(prompts, params)
assert compile_count() == n and out.stats.compiles == 0
assert out.tokens == RolloutEngine(target, drafter, cfg).generate(prompts, params).tokens
for engine in dp_cost.engines:
  assert [s.name for s in engine.strategies_for(1)] == ["vanilla", "chain d3"]
  assert [s.name for s in engine.strategies_for(2)] == ["vanilla"]
  assert ("catchup", 1, engine.pool.kv_lengths_used()[0]) in engine.pool.executables
  assert not any(k[0] == "catchup" and k[1] > 1 for k in engine.pool.executables)
programs = set().union(*(e.pool.executables.keys() for e in dp_cost.engines))
assert not dp_cost.programs.rebind_errors, dp_cost.programs.rebind_errors
if not CACHED:  # the second device compiled none of them
  assert dp_cost.programs.compiles == dp_cost.programs.rebinds == len(programs)
print("cost tuner over devices: SD offered where the table pays, on every device, compiled in "
      "the background")

# Ctrl-C during a data-parallel rollout: the interrupt reaches the caller only after every device
# thread has stopped (a thread left inside XLA when the interpreter exits aborts the process:
# "terminate called ... FATAL: exception not rethrown", exit -6 instead of 130). Device 0 decodes
# in segments of 2 steps and stops at its next segment; device 1 (no rows) is in its idle hook,
# which takes a while to notice the stop (a drafter step in flight) and must still be waited for.
import signal  # pylint: disable=wrong-import-position,wrong-import-order

signal.signal(signal.SIGINT, signal.default_int_handler)
idle_returned, segments, completed = threading.Event(), [], []


def interrupt_on_first_segment(done, total):
  segments.append(done)
  if len(segments) == 1:
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def slow_idle(k, stop):
  stop.wait(60)
  time.sleep(0.5)
  idle_returned.set()


params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=9, stop_token_ids=())
try:
  dp.generate(prompts[:1], params, interrupt_on_first_segment,
              idle_work=Work(lambda *a: completed.append(a), slow_idle))
  raise AssertionError("the interrupt was swallowed")
except KeyboardInterrupt:
  alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
assert not alive, f"device threads still running after the interrupt: {alive}"
assert idle_returned.is_set(), "the idle hook was not waited for"
assert not completed, "the interrupted shard decoded to the end instead of stopping"
assert len(segments) == 1, segments
print("Ctrl-C: every device thread stopped before the interrupt went on")
print("parallel rollout ok")
