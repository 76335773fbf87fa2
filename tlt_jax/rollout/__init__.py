"""Rollouts: the bucketed engine, sampling parameters and speculative decoding strategies.

The names most code needs are importable from here::

  from tlt_jax.rollout import (RolloutEngine, EngineConfig, SamplingParams, SpecConfig,
                               NgramConfig, TunerConfig, DataParallelRollout)
"""

from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, RolloutResult
from tlt_jax.rollout.decode.ngram import NgramConfig
from tlt_jax.rollout.parallel import DataParallelRollout
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.host.tuner import TunerConfig

__all__ = ["DataParallelRollout", "EngineConfig", "NgramConfig", "RolloutEngine", "RolloutResult",
           "SamplingParams", "SpecConfig", "TunerConfig"]
