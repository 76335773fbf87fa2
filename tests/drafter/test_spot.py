"""SpotTrainer: preemptible drafter training on DataBuffer batches (learning, preemption, resume,
no recompiles, threads, a second device)."""

from __future__ import annotations

import itertools
import pathlib
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers import sharp_random_model
from tests.xla_env import subprocess_env
from tlt_jax.drafter.buffer import DataBuffer
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.drafter.objective import layout_rows, target_features
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.utils import compile_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ModelConfig.tiny(vocab_size=32)


def make_target():
  return sharp_random_model(CONFIG, seed=1)


def make_samples(target, count: int = 32, width: int = 48):
  """Random token sequences (12..40 tokens, prompts of 3..7) with the target's own features at
  positions 0 .. L-2, as the rollout engine reports them."""
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, CONFIG.vocab_size, int(n)).tolist() for n in rng.integers(12, 41, count)]
  ids, positions, segments, _ = layout_rows(seqs, width)
  hidden, _ = target_features(target, ids, positions, segments, with_logits=False)
  return seqs, [hidden[r, :len(s) - 1] for r, s in enumerate(seqs)], rng.integers(3, 8, count)


def filled(samples, seed: int) -> DataBuffer:
  """A buffer holding ``samples`` as two RL steps."""
  seqs, hidden, prompt_lens = samples
  buffer = DataBuffer(rows=4, seq_len=32, seed=seed)
  half = len(seqs) // 2
  buffer.add(0, seqs[:half], hidden[:half], prompt_lens[:half].tolist())
  buffer.add(1, seqs[half:], hidden[half:], prompt_lens[half:].tolist())
  return buffer


def updates_applied(opt_state) -> int:
  """The optimizer's own update count (adam's ``count``)."""
  return int(optax.tree_utils.tree_get(opt_state, "count"))


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def target():
  return make_target()


@pytest.fixture(scope="module")
def samples(target):
  return make_samples(target)


def test_spot_training_learns_without_recompiling(target, samples):
  trainer = SpotTrainer(Drafter.create(CONFIG, seed=0), target, filled(samples, seed=0),
                        learning_rate=1e-2)
  target_params = nnx.state(target)
  moved_target = jax.tree.map(lambda x: x * 1.01, target_params)  # new policy weights, same shapes
  before = trainer.evaluate(target_params)  # on the freshest step's samples
  warmup = trainer.run(target_params, max_steps=1)
  assert warmup["steps"] == 1 and trainer.steps == 1
  compiles = compile_count()
  result = trainer.run(target_params, max_steps=30)
  after = trainer.evaluate(target_params)
  assert result["steps"] == 30 and trainer.steps == 31 and not result["preempted"]
  assert result["tokens"] > 30 * 50 and result["loss"] < warmup["loss"]
  # (the soft CE term is bounded below by the target's own entropy; the feature term is not)
  assert after["loss"] < before["loss"] - 0.05, (before, after)
  assert after["feature_loss"] < 0.85 * before["feature_loss"], (before, after)
  assert after["top1"] > before["top1"] + 0.1, (before, after)
  assert after["tokens"] == before["tokens"] > 0
  assert trainer.run(moved_target, max_steps=3)["steps"] == 3
  timed = trainer.run(target_params, max_seconds=0.3)
  assert timed["steps"] >= 1 and timed["seconds"] < 1.5, timed
  assert compile_count() == compiles, "a spot step recompiled after its first run on the device"
  assert updates_applied(trainer.opt_state) == trainer.steps


class StepClock:
  """A stand-in for the spot module's clock in which each training step takes ``step`` seconds."""

  def __init__(self, step: float):
    self.now, self.step = 0.0, step

  def perf_counter(self) -> float:
    return self.now

  def wrap(self, make_step):
    def timed(*key):
      real = make_step(*key)

      def step(*args):
        self.now += self.step
        return real(*args)
      return step
    return timed


@pytest.mark.parametrize("budget, steps", [(0.5, 1), (1.5, 1), (2.0, 2), (2.5, 2), (3.0, 3)])
def test_a_step_starts_only_if_one_more_of_the_last_steps_length_fits_the_budget(
    monkeypatch, target, samples, budget, steps):
  # steps of 1 s: after k steps (k s spent), step k+1 starts only if k + 1 <= budget (the first
  # step always starts: nothing is known of its length yet)
  trainer = SpotTrainer(Drafter.create(CONFIG, seed=0), target, filled(samples, seed=0))
  clock = StepClock(step=1.0)
  monkeypatch.setattr("tlt_jax.drafter.spot.time", clock)
  monkeypatch.setattr(trainer, "step_for", clock.wrap(trainer.step_for))
  out = trainer.run(nnx.state(target), max_seconds=budget, max_steps=10)
  assert out["steps"] == steps and out["seconds"] == steps, (budget, out)


def test_preemption_from_another_thread_loses_no_update(target, samples):
  buffer = filled(samples, seed=1)
  snapshot = buffer.state_dict()
  trainer = SpotTrainer(Drafter.create(CONFIG, seed=0), target, buffer)
  target_params = nnx.state(target)
  graphdef = nnx.graphdef(target)
  other_work = jax.jit(lambda p, ids: nnx.merge(graphdef, p)(ids))  # this thread's own JAX work
  ids = np.arange(16, dtype=np.int32)[None] % CONFIG.vocab_size
  stop, out, copies = threading.Event(), {}, []
  thread = threading.Thread(
      target=lambda: out.update(trainer.run(target_params, stop=stop, max_steps=100_000)))
  thread.start()
  deadline = time.monotonic() + 60
  while trainer.steps < 25 and time.monotonic() < deadline:
    other_work(target_params, ids).block_until_ready()
    if trainer.steps:
      copies.append(trainer.params_copy())
      with pytest.raises(RuntimeError, match="already running"):
        trainer.run(target_params, max_steps=1)
  stop.set()
  thread.join(60)
  assert not thread.is_alive() and out, "the spot run did not stop"
  assert out["preempted"] and out["steps"] == trainer.steps >= 25, (out, trainer.steps)
  assert updates_applied(trainer.opt_state) == trainer.steps
  # copies taken during the run were not donated away; the run went on after the last one
  assert copies and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(copies[-1]))
  assert any(not np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(copies[0]), jax.tree.leaves(trainer.params)))

  # The same number of steps, run straight through from the same buffer state: the same params.
  replay = SpotTrainer(Drafter.create(CONFIG, seed=0), target, DataBuffer.from_state_dict(snapshot))
  assert replay.run(target_params, max_steps=out["steps"])["steps"] == out["steps"]
  assert_trees_equal(replay.params, trainer.params)
  assert_trees_equal(replay.opt_state, trainer.opt_state)
  assert replay.buffer.stats() == buffer.stats()  # exactly as many batches drawn


def test_resume_from_state_dict_continues_identically(target, samples):
  buffer = filled(samples, seed=2)
  target_params = nnx.state(target)
  first = SpotTrainer(Drafter.create(CONFIG, seed=0), target, buffer)
  checks = itertools.count()
  ran = first.run(target_params, stop=lambda: next(checks) >= 5)  # a callable stop
  assert ran["steps"] == 5 and ran["preempted"]
  state, buffer_state = first.state_dict(), buffer.state_dict()
  assert state["steps"] == 5 and all(isinstance(x, np.ndarray)
                                     for x in jax.tree.leaves((state["params"],
                                                               state["opt_state"])))
  first.run(target_params, max_steps=2)

  resumed = SpotTrainer(Drafter.create(CONFIG, seed=9), target,
                        DataBuffer.from_state_dict(buffer_state))
  resumed.load_state_dict(state)
  assert resumed.steps == 5
  resumed.run(target_params, max_steps=2)
  assert resumed.steps == first.steps == 7 == updates_applied(resumed.opt_state)
  assert_trees_equal(resumed.params, first.params)
  assert_trees_equal(resumed.opt_state, first.opt_state)

  other = SpotTrainer(Drafter.create(CONFIG, seed=0, draft_vocab_size=8), target, buffer)
  with pytest.raises(ValueError, match="structure"):
    other.load_state_dict(state)


def test_empty_buffer_and_unbounded_runs():
  target = make_target()
  trainer = SpotTrainer(Drafter.create(CONFIG), target, DataBuffer(rows=2, seq_len=16))
  target_params = nnx.state(target)
  result = trainer.run(target_params, max_steps=5)
  assert result["steps"] == 0 and result["loss"] is None and not result["preempted"]
  assert trainer.steps == 0 and trainer.evaluate(target_params)["tokens"] == 0
  with pytest.raises(ValueError, match="forever"):
    trainer.run(target_params)


def two_device_main():
  """Run in a fresh process with two simulated CPU devices (see the test below)."""
  assert jax.device_count() == 2, jax.devices()
  d0, d1 = jax.devices()
  target = make_target()
  samples = make_samples(target)
  on_d1 = jax.device_put(nnx.state(target), d1)
  trainer = SpotTrainer(Drafter.create(CONFIG, seed=0), target, filled(samples, seed=3))
  assert trainer.run(on_d1, max_steps=2, device=d1)["steps"] == 2
  assert all(x.devices() == {d1} for x in jax.tree.leaves((trainer.params, trainer.opt_state)))
  trainer.evaluate(on_d1)
  compiles = compile_count()
  assert trainer.run(on_d1, max_steps=3)["steps"] == 3  # stays on d1
  trainer.evaluate(on_d1)
  assert compile_count() == compiles, "recompiled on the second device"
  copy = trainer.params_copy(d0)
  assert all(x.devices() == {d0} and x.committed for x in jax.tree.leaves(copy))
  reference = SpotTrainer(Drafter.create(CONFIG, seed=0), target, filled(samples, seed=3))
  reference.run(nnx.state(target), max_steps=5)
  for x, y in zip(jax.tree.leaves(copy), jax.tree.leaves(reference.params), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
  assert trainer.run(nnx.state(target), max_steps=1, device=d0)["steps"] == 1  # moves back
  assert all(x.devices() == {d0} for x in jax.tree.leaves(trainer.params))
  print("two-device spot ok")


def test_runs_on_a_second_device():
  env = subprocess_env(2)
  proc = subprocess.run(
      [sys.executable, "-c", "from tests.drafter.test_spot import two_device_main as m; m()"],
      capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "two-device spot ok" in proc.stdout


def test_an_eagle3_drafter_learns_from_the_engines_collected_features():
  """The rollout engine hands an EAGLE-3 drafter's features ((n + 1) H wide: its target layers
  and the final hidden state) to the buffer; spot training on them learns without recompiling."""
  from tlt_jax.models.eagle3 import Eagle3Drafter  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout.engine import EngineConfig, RolloutEngine  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout.decode.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  target = sharp_random_model(CONFIG.replace(num_layers=3), seed=1)
  drafter = Eagle3Drafter.for_target(target, seed=0, feature_layers=(1, 2))
  engine = RolloutEngine(target, drafter=drafter, config=EngineConfig(
      max_batch=16, max_prompt_len=8, max_new_tokens=24, prefill_buckets=(8,)))
  prompts = [np.random.default_rng(i).integers(0, 32, 3 + i % 5).tolist() for i in range(16)]
  result = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=3),
                           collect_hidden=True)
  seqs = [p + t for p, t in zip(prompts, result.tokens)]
  assert all(h.shape == (len(s) - 1, drafter.feature_size) for h, s in zip(result.hidden, seqs))
  # the collected features are the target's own over the finished sequence
  ids, positions, segments, _ = layout_rows(seqs[:1], 40)
  want, _ = target_features(target, ids, positions, segments, with_logits=False,
                            features=drafter.target_features)
  np.testing.assert_allclose(result.hidden[0], want[0, :len(seqs[0]) - 1], atol=2e-4)
  buffer = DataBuffer(rows=4, seq_len=32, seed=0)
  buffer.add(0, seqs, result.hidden, [len(p) for p in prompts])
  trainer = SpotTrainer(drafter, target, buffer, learning_rate=1e-2)
  target_params = nnx.state(target)
  before = trainer.evaluate(target_params)
  trainer.precompile(target_params, jax.devices()[0])  # ahead of time, from the batch's shapes
  trainer.run(target_params, max_steps=1)
  compiles = compile_count()
  trainer.run(target_params, max_steps=40)
  after = trainer.evaluate(target_params)
  assert compile_count() == compiles, "an eagle3 spot step recompiled"
  assert after["loss"] < before["loss"] and after["top1"] > before["top1"] + 0.1, (before, after)
