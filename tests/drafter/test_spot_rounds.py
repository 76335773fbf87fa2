"""Spot rounds: every idle device contributes a gradient to one drafter update
(``SpotTrainer.run_rounds`` and the ``OnlineDrafter`` hooks that drive it), on 4 simulated CPU
devices in a subprocess: the averaged update against one device's, nothing compiling after
precompile, preemption between rounds, an exact resume, and who took part."""

from __future__ import annotations

import itertools
import pathlib
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tests.drafter.test_spot import (CONFIG, assert_trees_equal, filled, make_samples, make_target,
                                     updates_applied)
from tests.xla_env import subprocess_env
from tlt_jax.drafter.buffer import DataBuffer
from tlt_jax.drafter.objective import CE_WEIGHT, batch_loss, split_drafter
from tlt_jax.drafter.online import DrafterTrainingConfig, OnlineDrafter, step_metrics
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.models.drafter import Drafter
from tlt_jax.rollout.host.stats import DeviceStats, RolloutStats
from tlt_jax.utils import compile_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
SGD = 0.5  # the reference check's learning rate: plain SGD, so the update's scale shows (Adam's
# is nearly scale-free: a sum of gradients would pass for their mean)


def reference_rounds(target, snapshot, members: int, rounds: int):
  """The params after ``rounds`` SGD updates, each on the mean loss of the next ``members``
  batches of a buffer restored from ``snapshot``, computed on one device with ``jax.grad``."""
  buffer = DataBuffer.from_state_dict(snapshot)
  graphdef, params = split_drafter(Drafter.create(CONFIG, seed=0))
  optimizer = optax.sgd(SGD)
  state = optimizer.init(params)
  for _ in range(rounds):
    batches = [buffer.batch() for _ in range(members)]

    def loss(p, batches=batches):
      drafter = nnx.merge(graphdef, p)
      return sum(batch_loss(drafter, target, b, CE_WEIGHT)[0] for b in batches) / len(batches)

    updates, state = optimizer.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
  return params


def check_rounds_average_like_one_device(devs, target, samples, tps):
  buffer = filled(samples, seed=4)
  snapshot = buffer.state_dict()
  trainer = SpotTrainer(Drafter.create(CONFIG, seed=0), target, buffer, optimizer=optax.sgd(SGD))
  team = [(k, devs[k], tps[k]) for k in (1, 0, 3)]  # homed on device 1; 3 of 4 slots used
  out = trainer.run_rounds(lambda: team, device=devs[1], slots=4, max_rounds=2)
  assert out["steps"] == 2 == trainer.steps and out["contributions"] == 6, out
  assert out["participants"] == [3, 3] and sorted(out["devices"]) == [0, 1, 3], out
  assert all(d["contributions"] == 2 and d["seconds"] > 0 for d in out["devices"].values()), out
  assert all(x.devices() == {devs[1]} for x in jax.tree.leaves(trainer.params))
  expected = reference_rounds(target, snapshot, members=3, rounds=2)
  for x, y in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)
  # one device alone is run()'s fused step: the same params as run() on the same batches
  alone = SpotTrainer(Drafter.create(CONFIG, seed=0), target, DataBuffer.from_state_dict(snapshot))
  solo = alone.run_rounds(lambda: [(2, devs[2], tps[2])], device=devs[2], slots=4, max_rounds=3)
  assert solo["participants"] == [1, 1, 1] and solo["contributions"] == 3, solo
  serial = SpotTrainer(Drafter.create(CONFIG, seed=0), target,
                       DataBuffer.from_state_dict(snapshot))
  serial.run(tps[2], max_steps=3, device=devs[2])
  assert_trees_equal(alone.params, serial.params)
  assert_trees_equal(alone.opt_state, serial.opt_state)
  print("rounds average like one device")


def check_preemption_and_resume(devs, target, samples, tps):
  team = [(k, devs[k], tps[k]) for k in range(4)]
  buffer = filled(samples, seed=5)
  snapshot = buffer.state_dict()
  trainer = SpotTrainer(Drafter.create(CONFIG, seed=0), target, buffer)
  stop, out = threading.Event(), {}
  thread = threading.Thread(target=lambda: out.update(
      trainer.run_rounds(lambda: team, device=devs[0], slots=4, stop=stop)))
  thread.start()
  deadline = time.monotonic() + 120
  while trainer.steps < 6 and time.monotonic() < deadline:
    time.sleep(0.005)
    if trainer.steps:
      with pytest.raises(RuntimeError, match="already"):
        trainer.run(tps[0], max_steps=1)
  stop.set()
  thread.join(120)
  assert not thread.is_alive() and out["preempted"], out
  # every round started was finished and counted: one optimizer update each
  assert out["steps"] == trainer.steps == updates_applied(trainer.opt_state) >= 6, out
  assert out["contributions"] == 4 * out["steps"], out
  replay = SpotTrainer(Drafter.create(CONFIG, seed=0), target, DataBuffer.from_state_dict(snapshot))
  replay.run_rounds(lambda: team, device=devs[0], slots=4, max_rounds=out["steps"])
  assert_trees_equal(replay.params, trainer.params)
  assert_trees_equal(replay.opt_state, trainer.opt_state)
  assert replay.buffer.stats() == buffer.stats()  # exactly as many batches drawn

  # a resumed trainer continues the rounds identically
  buffer = filled(samples, seed=6)
  first = SpotTrainer(Drafter.create(CONFIG, seed=0), target, buffer)
  checks = itertools.count()
  ran = first.run_rounds(lambda: team[:3], device=devs[0], slots=4,
                         stop=lambda: next(checks) >= 3)
  assert ran["steps"] == 3 and ran["preempted"], ran
  state, buffer_state = first.state_dict(), buffer.state_dict()
  first.run_rounds(lambda: team, device=devs[0], slots=4, max_rounds=2)
  resumed = SpotTrainer(Drafter.create(CONFIG, seed=9), target,
                        DataBuffer.from_state_dict(buffer_state))
  resumed.load_state_dict(state)
  resumed.run_rounds(lambda: team, device=devs[0], slots=4, max_rounds=2)
  assert resumed.steps == first.steps == 5 == updates_applied(resumed.opt_state)
  assert_trees_equal(resumed.params, first.params)
  assert_trees_equal(resumed.opt_state, first.opt_state)
  print("preemption between rounds, exact resume")


def online_drafter(target, samples) -> OnlineDrafter:
  online = OnlineDrafter(Drafter.create(CONFIG, seed=0), nnx.graphdef(target),
                         DrafterTrainingConfig(rows=4, seq_len=32))
  seqs, hidden, prompt_lens = samples
  online.buffer.add(0, seqs, hidden, prompt_lens.tolist())
  return online


def tail(online, engine, late: tuple[int, ...], rounds_before: int, rounds_after: int):
  """A rollout's tail played out on the drafter's ``idle_work``: device 0 goes idle first, the ``late`` devices
  after ``rounds_before`` rounds, and the last busy device finishes ``rounds_after`` rounds
  later (the stop)."""
  work = online.idle_work(1, [], engine)
  stop, returned = threading.Event(), {}

  waited = {}

  def device(k):
    returned[k] = work.idle(k, stop)
    waited[k] = stop.is_set()  # returned only once the rollout was done

  def wait_for(steps):
    deadline = time.monotonic() + 120
    while online.spot.steps < steps and time.monotonic() < deadline:
      time.sleep(0.002)

  threads = [threading.Thread(target=device, args=(0,))]
  threads[0].start()
  wait_for(online.spot.steps + rounds_before)
  for k in late:
    threads.append(threading.Thread(target=device, args=(k,)))
    threads[-1].start()
  wait_for(online.spot.steps + rounds_after)
  stop.set()
  for t in threads:
    t.join(120)
  assert not any(t.is_alive() for t in threads)
  runs = online.spot_runs()
  assert len(runs) == 1 and runs[0]["device"] == 0 and returned[0] is runs[0], (runs, returned)
  assert all(returned[k] is None for k in late)
  return runs[0], {k: waited[k] for k in late}


def check_every_idle_device_trains(devs, target, samples, tps):
  online = online_drafter(target, samples)
  engine = types.SimpleNamespace(devices=devs, target_params=lambda k: tps[k])
  assert online.precompile_on(engine) == 4
  compiles = compile_count()
  run, waited = tail(online, engine, late=(2, 1), rounds_before=2, rounds_after=4)
  assert all(waited.values()), waited  # their hooks waited for the stop: they were in rounds
  # device 0 alone first, then devices 1 and 2 joined it; device 3 never went idle
  assert run["participants"][:2] == [1, 1] and max(run["participants"]) == 3, run
  assert sorted(run["devices"]) == [0, 1, 2] and run["contributions"] == sum(run["participants"])
  assert online.spot.steps == run["steps"] == updates_applied(online.spot.opt_state)
  assert all(x.devices() == {devs[0]} for x in jax.tree.leaves(online.spot.params))
  stats = RolloutStats(devices=[DeviceStats(1, 0.0, 0.3, 0.3, 10, 0.0)] * 3 +
                       [DeviceStats(1, 0.3, 0.0, 0.0, 10, 0.0)], idle_overrun_s=0.01)
  m = step_metrics(stats, [run], None, {})
  assert m["drafter_spot_steps"] == run["steps"] and m["drafter_spot_devices"] == 3, m
  assert m["drafter_spot_participants_max"] == 3 and m["drafter_spot_contributions"] > m[
      "drafter_spot_steps"], m
  assert m["drafter_spot_device_s_0"] > m["drafter_spot_device_s_1"] > 0, m  # 0 ran every round
  assert "drafter_spot_device_s_3" not in m and m["spot_overrun_s"] == 0.01, m
  assert abs(m["drafter_spot_device_s"] - sum(m[f"drafter_spot_device_s_{k}"]
                                              for k in range(3))) < 1e-9, m
  overrun = m["drafter_spot_device_s"] - m["drafter_spot_tail_device_s"]
  assert abs(overrun - 0.01 * run["participants"][-1]) < 1e-9, m
  # one idle device at a time (the behaviour before rounds): the others' hooks only wait
  online.spot_devices = 1
  run, waited = tail(online, engine, late=(1, 2, 3), rounds_before=1, rounds_after=3)
  assert set(run["participants"]) == {1} and sorted(run["devices"]) == [0], run
  assert not any(waited.values()), waited  # the full rounds' other devices returned at once
  # rounds homed elsewhere, with every team size, run() and evaluate(): all precompiled
  spot = online.spot
  for home, ks in ((2, (2,)), (2, (2, 0)), (1, (1, 3, 0, 2)), (3, (3, 1, 2))):
    team = [(k, devs[k], tps[k]) for k in ks]
    assert spot.run_rounds(lambda team=team: team, device=devs[home], slots=4,
                           max_rounds=2)["steps"] == 2
  spot.run(tps[0], max_steps=2, device=devs[0])
  spot.evaluate(tps[3], device=devs[3])
  assert compile_count() == compiles, "a drafter executable compiled after precompile"
  print("every idle device trains")


def four_device_main():
  """Run in a fresh process with four simulated CPU devices (see the test below)."""
  assert jax.device_count() == 4, jax.devices()
  devs = jax.devices()
  target = make_target()
  samples = make_samples(target)
  tps = [jax.device_put(nnx.state(target), d) for d in devs]
  check_rounds_average_like_one_device(devs, target, samples, tps)
  check_preemption_and_resume(devs, target, samples, tps)
  check_every_idle_device_trains(devs, target, samples, tps)
  print("four-device rounds ok")


def test_rounds_on_four_devices():
  env = subprocess_env(4)
  proc = subprocess.run(
      [sys.executable, "-c",
       "from tests.drafter.test_spot_rounds import four_device_main as m; m()"],
      capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "four-device rounds ok" in proc.stdout, proc.stdout


def test_round_arguments_are_checked():
  target = make_target()
  trainer = SpotTrainer(Drafter.create(CONFIG), target, DataBuffer(rows=2, seq_len=16))
  device = jax.devices()[0]
  team = lambda: [(0, device, nnx.state(target))]
  with pytest.raises(ValueError, match="forever"):
    trainer.run_rounds(team, device=device, slots=1)
  with pytest.raises(ValueError, match="slots must be a positive int"):
    trainer.run_rounds(team, device=device, slots=0, max_rounds=1)
  with pytest.raises(ValueError, match="named 2 devices but slots=1"):
    trainer.run_rounds(lambda: team() * 2, device=device, slots=1, max_rounds=1)
  out = trainer.run_rounds(team, device=device, slots=1, max_rounds=3)  # an empty buffer
  assert out["steps"] == 0 and out["participants"] == [] and out["loss"] is None, out
  with pytest.raises(ValueError, match="spot_devices must be an int >= 0"):
    DrafterTrainingConfig(spot_devices=-1)
