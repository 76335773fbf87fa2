"""The generation entry point: config loading, validation at the edge, an end-to-end run."""

import pathlib
import subprocess
import sys

import pytest

from tlt_jax import generate
from tlt_jax.config import load_config_file

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
  stats = generate.run(tiny_config())
  assert stats["tokens"] > 0 and stats["decode_steps"] > 0


@pytest.mark.parametrize("field, value, match", [
    ("rollout.max_batch", 0, "config.rollout: EngineConfig.max_batch must be a positive int"),
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


def test_unknown_keys_are_rejected():
  cfg = tiny_config()
  cfg.rollout.max_batchh = 4
  with pytest.raises(ValueError, match=r"config.rollout has unknown keys \['max_batchh'\]"):
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
  assert bad.returncode != 0 and "EngineConfig.max_batch" in bad.stderr
