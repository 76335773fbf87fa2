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
    ("trainer.steps", 0, r"config.trainer.steps must be a positive int, got 0"),
    ("trainer.temperature", 0.0, r"config.trainer.temperature must be > 0 for RL sampling"),
    ("model.num_kv_heads", 3, r"config.model: ModelConfig.num_heads"),
    ("task.max_digits", 0, r"config.task: ArithmeticTask.max_digits"),
    ("rollout.max_batch", -2, r"config.rollout.max_batch must be a positive int, got -2"),
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


def test_the_long_tail_job_is_one_batch_of_heavy_tailed_rows_over_epochs():
  """configs/tiny_longtail.py builds, and is the shape it says: a step's rows are one engine
  batch, the prompt set recurs (epoch mode), every trace of its task fits the warm start's rows
  and the rollout's length, and the traces are heavy-tailed (the longest >= 10x the median)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tlt_jax.job.build import build_job  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl import tasks  # pylint: disable=import-outside-toplevel
  cfg = load_config_file(ROOT / "configs" / "tiny_longtail.py")
  job = build_job(cfg)
  rows = job.trainer.prompts_per_step * job.grpo.group_size
  assert rows == job.engine.max_batch and job.trainer.num_prompts > job.trainer.prompts_per_step
  assert cfg.drafter == "suffix"
  longest = job.task.make_problem(10 ** 32 - 1, 10 ** 32 - 1)
  assert len(longest.text) + 2 <= job.sft.row_len  # <bos> ... <eos>
  assert len(longest.solution) + 1 <= job.trainer.max_new_tokens
  prompt_set = tasks.sample_distinct(  # the job's prompt set: a few long traces, most short
      job.task, np.random.default_rng([cfg.seed, tasks.PROMPT_SET_STREAM]), job.trainer.num_prompts)
  lengths = np.array([len(p.solution) for p in prompt_set])
  assert lengths.max() >= 10 * np.median(lengths)


@pytest.mark.parametrize("name", ["tiny_grpo", "tiny_longtail", "smollm2_gsm8k",
                                  "smollm2_reasoning_gym"])
def test_every_shipped_config_reaches_every_field(name):
  """Each default lives in its dataclass and a config states only what it changes
  (``dataclass_section``): a shipped config's sft / grpo / trainer sections hold every field, so
  ``--config.<section>.<field>`` reaches it (the job fills seed and num_prompts itself)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import importlib  # pylint: disable=import-outside-toplevel
  from tlt_jax.job.build import TRAINER_SOURCES  # pylint: disable=import-outside-toplevel
  from tlt_jax.job.typed_config import dataclass_section  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl.grpo import GRPOConfig  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl.sft import SFTConfig  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl.trainer import TrainerConfig  # pylint: disable=import-outside-toplevel
  cfg = importlib.import_module(f"tlt_jax.configs.{name}").get_config()
  for section, cls, filled in [("sft", SFTConfig, ()), ("grpo", GRPOConfig, ()),
                               ("trainer", TrainerConfig, TRAINER_SOURCES)]:
    fields = {f.name for f in dataclasses.fields(cls)} - set(filled)
    assert set(cfg[section].keys()) == fields, (name, section)
  with pytest.raises(TypeError, match=r"give values for the fields \['group_size'\]"):
    dataclass_section(GRPOConfig, clip_eps_high=0.3)
