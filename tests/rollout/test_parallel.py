"""The data-parallel rollout (``rollout/parallel.py``): one engine per device, host threads."""

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.xla_env import subprocess_env
from tlt_jax.rollout.parallel import shard_config, shard_ranges

ROOT = Path(__file__).resolve().parents[2]


def test_shard_ranges_split_rows_contiguously_and_evenly():
  assert shard_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
  assert shard_ranges(2, 3) == [range(0, 1), range(1, 2), range(2, 2)]
  assert shard_ranges(5, 1) == [range(0, 5)]


def test_one_device_is_the_plain_engine():
  from tests.helpers import sharp_random_model
  from tlt_jax.models.model_config import ModelConfig
  from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
  from tlt_jax.rollout.parallel import DataParallelRollout
  from tlt_jax.rollout.decode.sampling import SamplingParams
  target = sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=2)
  cfg = EngineConfig(max_batch=4, max_prompt_len=8, max_new_tokens=12, prefill_buckets=(8,))
  params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
  prompts = [[7, 8, 9], [10, 11], [12, 13, 14, 15], [16], [17, 18]]
  dp = DataParallelRollout(target, None, cfg)
  out = dp.generate(prompts, params)
  assert out.tokens == RolloutEngine(target, None, cfg).generate(prompts, params).tokens
  assert len(out.stats.devices) == 1 and out.stats.devices[0].idle_s == 0.0
  done = []

  class Recorded:  # an IdleWork that records each finished shard's first row
    def shard_done(self, k, first, result):
      done.append((k, first))

    def idle(self, k, stop):
      raise AssertionError("one device is never idle while another decodes")

  dp.generate(prompts, params, row_offset=3, idle_work=Recorded())  # process 1's rows, say
  assert done == [(0, 3)]  # counted in the whole request
  with pytest.raises(ValueError, match="devices repeat"):
    DataParallelRollout(target, None, cfg, devices=[dp.devices[0]] * 2)


def test_a_fresh_shared_tuner_keeps_the_calibrated_step_costs():
  """``set_tuner()`` builds a fresh tuner and hands it what the precompile measured, as the
  one-device engine's does (the cost tuner chooses by those costs)."""
  from tests.helpers import sharp_random_model  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.model_config import ModelConfig  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout.engine import EngineConfig  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout.decode.ngram import NgramConfig  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout.parallel import DataParallelRollout  # pylint: disable=import-outside-toplevel
  target = sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=2)
  dp = DataParallelRollout(target, NgramConfig(depth=3), EngineConfig(
      max_batch=2, max_prompt_len=8, max_new_tokens=8, prefill_buckets=(8,),
      strategies=((3, 1, 4),)))
  dp.calibration.measured(({(1, "vanilla"): 1e-3, (1, "ngram d3"): 3e-3}, 2e-4))
  old = dp.tuner
  dp.set_tuner()
  assert dp.tuner is not old
  assert dp.tuner.step_cost(1, "vanilla") == 1e-3 and dp.tuner.step_cost(1, "ngram d3") == 3e-3


@pytest.mark.slow
def test_two_devices_same_tokens_and_idle_devices_work():
  """See parallel_check.py: same tokens as one device (vanilla sampled, adaptive coupled
  sampled), each shard on its own device, idle devices run counted work while the others decode,
  a shard's error reaches the caller, and the spot trainer (the trainer's hooks) takes drafter
  steps on the idle device, is preempted at a step boundary, and its weights reach every
  engine."""
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "rollout" / "parallel_check.py")],
                        capture_output=True, text=True, timeout=600, cwd=ROOT,
                        env=subprocess_env())
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "parallel rollout ok" in proc.stdout, proc.stdout


def test_the_shared_tuner_reads_under_its_lock_too():
  """Every call of a tuner waits for its lock (summary and speeds read what another thread's
  plan/update is writing: in CI a summary once met a bucket's predictions half built)."""
  from tlt_jax.rollout.host.tuner import (  # pylint: disable=import-outside-toplevel
      Arm, TunerConfig, make_tuner)
  shared = make_tuner(TunerConfig())
  shared.plan(2, [Arm("vanilla"), Arm("chain d3", 3)])
  assert shared.config.kind == "cost"  # plain attributes as they are
  for call in (shared.summary, lambda: shared.speeds(2), shared.state_dict,
               lambda: shared.plan(2, [Arm("vanilla")])):
    done = threading.Event()
    with shared.lock:  # another thread inside the tuner
      worker = threading.Thread(target=lambda c=call: (c(), done.set()))
      worker.start()
      assert not done.wait(0.2), "a call went past the lock"
    assert done.wait(10)
    worker.join()


def is_held(lock) -> bool:
  """Whether some thread holds ``lock``: a fresh thread cannot take it."""
  free = []

  def probe():
    if lock.acquire(blocking=False):
      lock.release()
      free.append(True)

  thread = threading.Thread(target=probe)
  thread.start()
  thread.join()
  return not free


def test_every_public_tuner_method_holds_the_lock():
  """Every public method of every tuner kind runs under the tuner's lock, a kind's own methods
  and one a new kind adds included (a method that skipped it fails here)."""
  from tlt_jax.rollout.host.tuner import (  # pylint: disable=import-outside-toplevel
      BegMab, CostModel, FixedMapping, TunerConfig, Ucb1)
  for cls in (CostModel, BegMab, Ucb1, FixedMapping):
    public = {name for name in dir(cls) if not name.startswith("_")
              and callable(getattr(cls, name))}
    assert {"plan", "update", "summary", "state_dict", "set_costs"} <= public
    assert {name for name in public if not getattr(getattr(cls, name), "locked", False)} == set()

  class Probe(CostModel):  # a kind with a method of its own
    def probe(self, *args, **kwargs):
      return is_held(self.lock), args, kwargs

  assert Probe(TunerConfig()).probe(1, "arm", key="value") == (True, (1, "arm"), {"key": "value"})


def test_each_device_compiles_only_the_batch_buckets_its_shard_can_reach():
  """A chunk of ``max_batch`` rows over N devices gives each at most ceil(max_batch / N) rows:
  the buckets above that are never run on any device, so none is compiled there."""
  from tlt_jax.rollout.engine import EngineConfig  # pylint: disable=import-outside-toplevel
  config = EngineConfig(max_batch=64, max_prompt_len=16, max_new_tokens=8)
  assert shard_config(config, 1) is config
  four = shard_config(config, 4)
  assert (four.max_batch, four.batch_buckets) == (16, (1, 2, 4, 8, 16))
  assert shard_config(config, 3).batch_buckets == (1, 2, 4, 8, 16, 32)  # 22 rows: bucket 32
  five = shard_config(EngineConfig(max_batch=8, max_prompt_len=16, max_new_tokens=8), 5)
  assert five.batch_buckets == (1, 2)  # 2 rows on the first devices, 1 on the others
  sparse = shard_config(EngineConfig(max_batch=64, max_prompt_len=16, max_new_tokens=8,
                                     batch_buckets=(1, 4, 16, 64)), 8)
  assert sparse.batch_buckets == (1, 4, 16) and sparse.max_batch == 16
