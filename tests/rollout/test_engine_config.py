"""EngineConfig's rules, each checked once where its field is defined: the library's message names
``EngineConfig.<field>`` (``TunerConfig.<field>``), and the job's names the same rule as
``config.rollout.<field>``; and ``resolve_engine_config``, which the engine only reads."""

from __future__ import annotations

import pathlib

import ml_collections
import pytest

from tlt_jax.job.build import build_job
from tlt_jax.job.rollout_config import ROLLOUT_FIELDS, build_engine_config, rollout_section
from tlt_jax.job.typed_config import ConfigError, load_config_file
from tlt_jax.rollout.host.engine_config import EngineConfig, parse_specs, resolve_engine_config
from tlt_jax.rollout.decode.ngram import NgramConfig
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.decode.suffix import SuffixConfig
from tlt_jax.rollout.host.tuner import TunerConfig
from tlt_jax.utils import FieldError

ROOT = pathlib.Path(__file__).resolve().parents[2]
LEARNED = object()  # stands for a learned drafter: the resolver needs only that there is one

# (config.rollout fields, config.drafter, the field the error names, the rule's words)
RULES = [
    (dict(max_batch=-2), "none", "max_batch", r"must be a positive int, got -2"),
    (dict(sd_max_batch=0), "none", "sd_max_batch", r"must be a positive int, got 0"),
    (dict(segment_steps=-1), "none", "segment_steps", r"must be an int >= 0 \(0: no limit\)"),
    (dict(verify="exact"), "none", "verify", r"must be one of \('rejection', 'coupled'\)"),
    (dict(strategies=(2, 1, 3)), "ngram", "strategies",
     r"must be a list of \[depth, topk, verify_tokens\] triples.*one strategy is written "
     r"\(\(2, 1, 3\),\)"),
    (dict(strategies=((2, 1),)), "ngram", r"strategies\[0\]",
     r"must be a \[depth, topk, verify_tokens\] triple, got \(2, 1\)"),
    (dict(strategies=((2, 1, 4),)), "ngram", r"strategies\[0\]",
     r"= \(2, 1, 4\): SpecConfig.verify_tokens must be depth \+ 1"),
    (dict(strategies=((2, 1, 3), (2, 1, 3))), "ngram", "strategies", r"has duplicates"),
    (dict(suffix_strategies=((4, 2, 4),)), "suffix", r"suffix_strategies\[0\]",
     r"= \(4, 2, 4\): a suffix tree has topk=2 branches"),
    (dict(suffix_strategies=((2, 1, 3),)), "none", "suffix_strategies",
     r"needs the suffix drafter, and there is no suffix drafter"),
    (dict(strategies=((2, 1, 3),)), "none", "strategies",
     r"needs a drafter \(a learned or n-gram one\), and there is no drafter"),
    (dict(strategies=((2, 2, 3),)), "ngram", "strategies",
     r"has tree strategies \(topk > 1\) but the ngram drafter drafts chains"),
    (dict(tuner=dict(kind="greedy")), "none", "tuner.kind", r"must be one of 'cost', 'beg_mab'"),
    (dict(strategies=((2, 1, 3),), tuner=dict(kind="fixed", fixed=((8, "chain d2"),))), "ngram",
     "tuner.fixed", r"maps bucket 1 to 'chain d2', which is not offered there"),
]


def library_call(fields: dict, drafter: str) -> EngineConfig:
  """What the job does with ``fields`` and ``config.drafter``, through the library alone."""
  return resolve_engine_config(EngineConfig(**fields),
                               NgramConfig() if drafter == "ngram" else None,
                               SuffixConfig() if drafter == "suffix" else None)


@pytest.mark.parametrize("fields, drafter, field, rule", RULES)
def test_each_rule_names_its_field_in_the_library(fields, drafter, field, rule):
  owner, name = ("TunerConfig", field.split(".")[1]) if field == "tuner.fixed" else (
      "EngineConfig", field)
  with pytest.raises(FieldError, match=rf"^{owner}\.{name} {rule}") as caught:
    library_call(fields, drafter)
  assert "config.rollout" not in str(caught.value)  # no job-level path in the library


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  cfg.logdir = str(tmp_path_factory.mktemp("run"))
  cfg.task.update(max_digits=3)
  cfg.trainer.update(steps=1, prompts_per_step=2, eval_problems=2)
  return cfg


@pytest.mark.parametrize("fields, drafter, field, rule", RULES)
def test_each_rule_names_the_config_field_in_the_job(base_config, fields, drafter, field, rule):
  cfg = ml_collections.ConfigDict(base_config.to_dict())
  cfg.drafter = drafter
  for key, value in fields.items():
    with cfg.rollout.ignore_type():
      if key == "tuner":
        cfg.rollout.tuner.update(value)
      else:
        cfg.rollout[key] = value
  with pytest.raises(ConfigError, match=rf"^config\.rollout\.{field} {rule}") as caught:
    build_job(cfg)
  assert "EngineConfig" not in str(caught.value) and "TunerConfig" not in str(caught.value)


def test_the_resolved_config_is_filled_in_once_and_resolves_to_itself():
  raw = EngineConfig()
  assert resolve_engine_config(raw) is raw  # nothing to fill in
  suffix = SuffixConfig(depth=5)
  resolved = resolve_engine_config(raw, NgramConfig(depth=3), suffix)
  assert resolved.suffix_strategies == (suffix.chain(),)
  assert resolved.strategies == (SpecConfig(3, 1, 4),)  # the n-gram chain beside them
  assert raw == EngineConfig()  # the given config is left as it was
  assert resolve_engine_config(resolved, NgramConfig(depth=3), suffix) is resolved
  learned = resolve_engine_config(raw, LEARNED)
  assert learned.spec == SpecConfig() and resolve_engine_config(learned, LEARNED) is learned
  job = build_engine_config(rollout_section(), NgramConfig(), suffix, max_new_tokens=16)
  assert job == resolve_engine_config(job, NgramConfig(), suffix)
  assert job.suffix_strategies == (suffix.chain(),)


def test_one_parser_reads_strategies_for_every_field():
  specs = parse_specs([[2, 1, 3], dict(depth=3, topk=2, verify_tokens=6), SpecConfig()],
                      "Owner", "field")
  assert specs == (SpecConfig(2, 1, 3), SpecConfig(3, 2, 6), SpecConfig())
  with pytest.raises(FieldError, match=r"^Owner\.field\[1\] must be a \[depth, topk, "):
    parse_specs([(2, 1, 3), "chain d4"], "Owner", "field")


def test_the_rollout_section_takes_engine_config_s_defaults():
  section = rollout_section(max_batch=64)
  assert section.max_batch == 64 and section.segment_steps is None
  for name in ROLLOUT_FIELDS:
    if name not in ("max_batch", "segment_steps"):
      assert section[name] == getattr(EngineConfig, name)
  assert section.tuner.to_dict() == {f: getattr(TunerConfig(), f) for f in section.tuner}
  section.segment_steps = 4  # a placeholder a command line can set
  with pytest.raises(TypeError, match=r"\['max_batches'\] are not config.rollout fields"):
    rollout_section(max_batches=4)


def test_sd_max_batch_and_verify_budget_include_their_own_bucket():
  """``sd_max_batch`` is the largest bucket that may speculate, and a strategy whose verify pass
  fills ``verify_budget`` exactly still serves the bucket."""
  config = EngineConfig(max_batch=8, strategies=((4, 1, 5),), sd_max_batch=4)
  chain = config.strategies[0]
  assert [config.serves(chain, b) for b in (1, 2, 4, 8)] == [True, True, True, False]
  assert [len(config.options(b)) for b in config.batch_buckets] == [2, 2, 2, 1]
  config = EngineConfig(max_batch=8, strategies=((4, 1, 5),), verify_budget=10)
  assert [config.serves(chain, b) for b in (1, 2, 4, 8)] == [True, True, False, False]


def test_a_resolved_config_resolves_again_without_work_for_its_drafters_only(monkeypatch):
  """Resolving the config ``resolve_engine_config`` made, for the same drafters, is the identity
  with no check run again (the job resolves once; its rollout's engines take it as it is); for
  other drafters it is resolved and checked anew."""
  runs = []
  real = EngineConfig.check_fixed_tuner
  monkeypatch.setattr(EngineConfig, "check_fixed_tuner",
                      lambda self, *a, **k: (runs.append(1), real(self, *a, **k))[1])
  config = EngineConfig(max_batch=4, max_prompt_len=8, max_new_tokens=8)
  resolved = resolve_engine_config(config, NgramConfig())
  assert len(runs) == 1 and resolved.spec is not None
  assert resolve_engine_config(resolved, NgramConfig()) is resolved and len(runs) == 1
  with pytest.raises(ValueError, match="does not fit the ngram drafter"):  # another chain
    resolve_engine_config(resolved, NgramConfig(depth=2))
  with pytest.raises(ValueError, match="needs a drafter"):  # no drafter: checked anew, refused
    resolve_engine_config(resolved, None)
  assert len(runs) == 1  # both refused before the last check
