"""The generation entry point: config loading, validation at the edge, an end-to-end run."""

import pathlib
import subprocess
import sys

import pytest

from tlt_jax import generate
from tlt_jax.job.typed_config import ConfigError, load_config_file

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_config():
  cfg = load_config_file(ROOT / "configs" / "tiny_generate.py")
  cfg.num_prompts = 5
  cfg.rollout.max_batch = 4
  cfg.rollout.max_new_tokens = 24
  cfg.rollout.precompile = False
  cfg.sampling.max_new_tokens = 24
  return cfg


def test_run_generates_for_every_prompt():
  out = generate.run(tiny_config())
  assert len(out["texts"]) == 5  # cfg.num_prompts demo questions, one completion each
  assert all(isinstance(t, str) and t for t in out["texts"])
  assert 5 <= out["tokens"] <= 5 * 24  # at least one token per prompt, at most the limit
  given = generate.run(tiny_config(), prompts=["1+2=?", "30-4=?"])
  assert len(given["texts"]) == 2


@pytest.mark.parametrize("field, value, match", [
    ("rollout.max_batch", 0, "config.rollout.max_batch must be a positive int"),
    ("sampling.temperature", -0.5, "config.sampling: SamplingParams.temperature"),
    ("model.tiny.num_kv_heads", 3, "config.model.tiny: ModelConfig.num_heads"),
    ("model.dtype", "float8", "ModelConfig.dtype"),
])
def test_bad_values_are_rejected_naming_the_field(field, value, match):
  cfg = tiny_config()
  section, key = field.rsplit(".", 1)
  target = cfg
  for part in section.split("."):
    target = target[part]
  target[key] = value
  with pytest.raises(ValueError, match=match):
    generate.run(cfg)


@pytest.mark.parametrize("where", ["", "model", "model.tiny", "rollout", "sampling"])
def test_unknown_keys_in_every_section_are_rejected(where):
  cfg = tiny_config()
  target = cfg
  for part in filter(None, where.split(".")):
    target = target[part]
  target.typo_field = 4
  prefix = f"config.{where}" if where else "config"
  with pytest.raises(ValueError, match=rf"{prefix} has unknown keys \['typo_field'\]"):
    generate.run(cfg)


def test_command_line_overrides():
  proc = subprocess.run(
      [sys.executable, "-m", "tlt_jax.generate", f"--config={ROOT}/configs/tiny_generate.py",
       "--config.num_prompts=3", "--config.rollout.max_batch=2", "--config.rollout.max_new_tokens=16",
       "--config.sampling.max_new_tokens=16", "--config.rollout.precompile=False"],
      capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "compiles during generate" in proc.stdout
  bad = subprocess.run(
      [sys.executable, "-m", "tlt_jax.generate", "--config.rollout.max_batch=-1"],
      capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert bad.returncode != 0 and "config.rollout.max_batch must be a positive int" in bad.stderr


def test_a_long_prompt_or_completion_names_the_flags_to_change():
  """Checked before the engine is built, in the flags a user types (not EngineConfig's or
  SamplingParams' fields)."""
  cfg = tiny_config()
  cfg.rollout.max_prompt_len = 8
  with pytest.raises(ConfigError) as e:
    generate.run(cfg, prompts=["1+2=?", "123456+654321=?"])
  assert str(e.value) == (
      "--prompt number 2 is 16 tokens long (with its BOS) but --config.rollout.max_prompt_len is 8; "
      "raise --config.rollout.max_prompt_len to at least 16 or shorten the prompt")
  cfg = tiny_config()
  cfg.sampling.max_new_tokens = 40
  with pytest.raises(ConfigError) as e:
    generate.run(cfg)
  assert str(e.value) == (
      "--config.sampling.max_new_tokens=40 exceeds --config.rollout.max_new_tokens=24 (the "
      "longest completion the engine is built for); lower the first or raise the second")
