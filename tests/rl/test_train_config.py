"""The main job rejects bad config values at start, naming the field."""

import pathlib

import pytest

from tlt_jax import train
from tlt_jax.job.typed_config import load_config_file

ROOT = pathlib.Path(__file__).resolve().parents[2]


def default_config():
  return load_config_file(ROOT / "configs" / "tiny_grpo.py")


@pytest.mark.parametrize("field, value, match", [
    ("grpo.clip_eps_low", 2.0, r"config.grpo: GRPOConfig.clip_eps_low"),
    ("grpo.loss_agg", "mean", r"config.grpo: GRPOConfig.loss_agg"),
    ("trainer.steps", 0, r"config.trainer: TrainerConfig.steps"),
    ("trainer.temperature", 0.0, r"config.trainer: TrainerConfig.temperature"),
    ("model.num_kv_heads", 3, r"config.model: ModelConfig.num_heads"),
    ("task.max_digits", 0, r"config.task: ArithmeticTask.max_digits"),
    ("rollout.max_batch", -2, r"config.rollout: EngineConfig.max_batch"),
    ("checkpoint_every", -1, r"config.checkpoint_every must be an int >= 0"),
])
def test_bad_values_are_rejected_naming_the_field(tmp_path, field, value, match):
  cfg = default_config()
  cfg.logdir = str(tmp_path)
  *parents, key = field.split(".")
  target = cfg
  for part in parents:
    target = target[part]
  target[key] = value
  with pytest.raises(ValueError, match=match):
    train.run(cfg)


def test_unknown_keys_are_rejected(tmp_path):
  cfg = default_config()
  cfg.logdir = str(tmp_path)
  cfg.sft.stepz = 3
  with pytest.raises(ValueError, match=r"config.sft has unknown keys \['stepz'\]"):
    train.run(cfg)
