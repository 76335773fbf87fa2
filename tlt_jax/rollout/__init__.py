"""Rollouts: the bucketed engine, sampling parameters and speculative decoding strategies.

This package is the rollout's one door: code outside it (the trainer, the job, the drafter, the
experiments) imports every rollout name from here, never from a submodule
(``tests/test_import_graph.py`` holds that rule)::

  from tlt_jax.rollout import EngineConfig, SamplingParams, SpecConfig, make_rollout

  rollout = make_rollout(model, drafter, EngineConfig(...), devices)
  result = rollout.generate(prompts, SamplingParams(max_new_tokens=64))

``make_rollout`` picks the rollout for the devices and processes at hand; every one implements
``Rollout`` (``interface.py``).
"""

from tlt_jax.rollout.decode.kinds import (KINDS, DrafterKind, ModelFreeKind, model_free_names,
                                          register)
from tlt_jax.rollout.decode.ngram import NgramConfig
from tlt_jax.rollout.decode.sampling import (SamplerArgs, SamplingParams, filtered_logprobs,
                                             row_keys, sample_tokens)
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.decode.steps import strategy_name
from tlt_jax.rollout.decode.suffix import SuffixConfig
from tlt_jax.rollout.host.buckets import bucket_for
from tlt_jax.rollout.host.engine_config import EngineConfig, parse_specs, resolve_engine_config
from tlt_jax.rollout.decode.suffix_history import (PROMPT_BYTES, HistoryConfig, HistoryStore,
                                          completion_cost, prompt_key)
from tlt_jax.rollout.host.stats import RolloutStats, arm_line, rollout_metrics, run_sd_summary
from tlt_jax.rollout.host.tuner import TunerConfig, make_tuner
from tlt_jax.rollout.interface import IdleWork, Rollout
from tlt_jax.rollout.engine import RolloutEngine, RolloutResult
from tlt_jax.rollout.parallel import DataParallelRollout, shard_ranges
from tlt_jax.rollout.make import make_rollout

__all__ = [
    # building a rollout, and what it is
    "make_rollout", "Rollout", "IdleWork", "RolloutEngine", "DataParallelRollout",
    # its configs
    "EngineConfig", "resolve_engine_config", "parse_specs", "SpecConfig", "NgramConfig",
    "SuffixConfig", "TunerConfig", "make_tuner", "HistoryConfig",
    # sampling
    "SamplingParams", "SamplerArgs", "filtered_logprobs", "row_keys", "sample_tokens",
    # what it returns and reports
    "RolloutResult", "RolloutStats", "rollout_metrics", "arm_line", "run_sd_summary",
    # the drafter kinds (``KINDS``: the registered drafter kinds, by name)
    "KINDS", "DrafterKind", "ModelFreeKind", "model_free_names", "register", "strategy_name",
    # the suffix drafter's history
    "HistoryStore", "prompt_key", "PROMPT_BYTES", "completion_cost",
    # shapes and shards
    "bucket_for", "shard_ranges",
]
