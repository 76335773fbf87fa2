"""The names users reach for are importable at the package level and are the real objects."""

import subprocess
import sys

import pytest

from tlt_jax import models, rollout
from tlt_jax.models import drafter_io, hf, load, transformer, weights
from tlt_jax.rollout import engine, make, parallel
from tlt_jax.rollout.decode import ngram, sampling, speculative
from tlt_jax.rollout.host import tuner


def test_models_exports_are_the_implementations():
  assert models.from_pretrained is load.from_pretrained
  assert models.load_tokenizer is load.load_tokenizer
  assert models.pretrained_config is load.pretrained_config
  assert models.WeightsError is weights.WeightsError
  assert models.save_pretrained is hf.save_pretrained
  assert models.Transformer is transformer.Transformer
  assert models.load_drafter is drafter_io.load_drafter
  assert set(models.__all__) <= set(dir(models))


def test_rollout_exports_are_the_implementations():
  assert rollout.RolloutEngine is engine.RolloutEngine
  assert rollout.EngineConfig is engine.EngineConfig
  assert rollout.SamplingParams is sampling.SamplingParams
  assert rollout.SpecConfig is speculative.SpecConfig
  assert rollout.NgramConfig is ngram.NgramConfig
  assert rollout.TunerConfig is tuner.TunerConfig
  assert rollout.DataParallelRollout is parallel.DataParallelRollout
  assert rollout.make_rollout is make.make_rollout
  assert set(rollout.__all__) <= set(dir(rollout))


def test_drafter_exports_are_the_implementations():
  from tlt_jax import drafter as drafter_pkg  # pylint: disable=import-outside-toplevel
  from tlt_jax.drafter import buffer, spot  # pylint: disable=import-outside-toplevel
  assert drafter_pkg.DataBuffer is buffer.DataBuffer
  assert drafter_pkg.SpotTrainer is spot.SpotTrainer
  assert set(drafter_pkg.__all__) <= set(dir(drafter_pkg))


def test_rl_exports_are_the_implementations():
  from tlt_jax import rl  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl import tasks  # pylint: disable=import-outside-toplevel
  assert rl.ArithmeticTask is tasks.ArithmeticTask and rl.Problem is tasks.Problem
  assert rl.Task is tasks.Task and rl.extract_answer is tasks.extract_answer
  assert set(rl.__all__) <= set(dir(rl))


@pytest.mark.slow
def test_each_package_imports_first_in_a_fresh_process():
  """No circular import, whichever package a user imports first."""
  for first in ("tlt_jax.rollout", "tlt_jax.rollout.decode.steps", "tlt_jax.rollout.host.scheduler",
                "tlt_jax.models", "tlt_jax.drafter", "tlt_jax.rl.trainer",
                "tlt_jax.train"):
    code = f"import {first}; from tlt_jax.rollout import RolloutEngine; " \
           f"from tlt_jax.models import from_pretrained"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
