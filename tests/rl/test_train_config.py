"""The main job rejects bad config values at start, naming the field."""

import pathlib
import types

import jax
import pytest

from tlt_jax import train
from tlt_jax.job.build import resolve_compute_dtype
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


def test_a_config_without_a_required_field_names_it(tmp_path):
  """A config file written by hand that lacks a field the job needs says which, not a KeyError
  from deep in the job; the fields with defaults (e.g. ``fsdp``) may be left out."""
  cfg = default_config()
  cfg.logdir = str(tmp_path)
  del cfg["checkpoint_every"]
  del cfg["fsdp"]
  with pytest.raises(ValueError, match=r"^config lacks the fields \['checkpoint_every'\]; start "
                                       r"from .*tiny_grpo.py"):
    train.run(cfg)


@pytest.mark.parametrize("backend, want", [("cpu", None), ("gpu", "bfloat16"), ("tpu", "bfloat16")])
def test_auto_compute_dtype_is_bfloat16_on_an_accelerator_and_the_params_dtype_on_a_cpu(
    monkeypatch, backend, want):
  """``compute_dtype="auto"`` (the real-model configs'): None (the params' dtype) on a CPU, where
  bf16 is emulated, bfloat16 on a GPU or TPU (``jax.default_backend`` faked: this runs on a CPU)."""
  assert load_config_file(ROOT / "configs" / "smollm2_gsm8k.py").model.compute_dtype == "auto"
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  assert resolve_compute_dtype("auto") == want
  assert resolve_compute_dtype(None) is None and resolve_compute_dtype("float32") == "float32"


def test_the_last_step_is_evaluated_once_and_always_checkpointed():
  """Periodic held-out evaluations come every eval_every steps but not after the last step,
  which the final evaluation covers (evaluated twice, a run would pay for the same figures
  twice); checkpoints every checkpoint_every steps and after the last."""
  from tlt_jax.job import loop  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl.trainer_config import TrainerConfig  # pylint: disable=import-outside-toplevel
  evaluation_due = loop.evaluation_due  # pylint: disable=protected-access
  checkpoint_due = loop.checkpoint_due  # pylint: disable=protected-access
  config = TrainerConfig(steps=6, eval_every=2)
  assert [s for s in range(1, 7) if evaluation_due(config, s)] == [2, 4]
  assert not any(evaluation_due(TrainerConfig(steps=6), s) for s in range(1, 7))
  job = types.SimpleNamespace(checkpoint_every=4, trainer=TrainerConfig(steps=6))
  assert [s for s in range(1, 7) if checkpoint_due(job, s)] == [4, 6]


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


def test_the_mid_size_long_tail_job_is_the_long_tail_job_at_145m_parameters():
  """configs/mid_longtail.py builds, and is what its docstring says: the long-tail job's task and
  step (one engine batch of heavy-tailed rows over epochs), a 1024 x 12 policy of ~145M
  parameters, TLT as the online EAGLE drafter plus history drafts, fewer batch buckets, and a
  warm start that the FLOP estimate puts within ~90 s on an accelerator."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from tlt_jax.job.build import build_job  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.transformer import init_model  # pylint: disable=import-outside-toplevel
  cfg = load_config_file(ROOT / "configs" / "mid_longtail.py")
  tiny = load_config_file(ROOT / "configs" / "tiny_longtail.py")
  assert cfg.task.to_dict() == tiny.task.to_dict() and cfg.grpo.to_dict() == tiny.grpo.to_dict()
  for key in ("steps", "prompts_per_step", "max_new_tokens", "minibatches", "update_tokens"):
    assert cfg.trainer[key] == tiny.trainer[key], key
  job = build_job(cfg)
  assert job.trainer.prompts_per_step * job.grpo.group_size == job.engine.max_batch == 64
  assert job.trainer.num_prompts > job.trainer.prompts_per_step  # epoch mode
  assert cfg.drafter == "eagle+suffix" and job.drafter_spec.fresh == "eagle"
  assert job.suffix is not None and job.drafter_training is not None
  assert job.engine.batch_buckets == (1, 4, 16, 64) and job.engine.prefill_buckets == (80,)
  m = job.model_config
  assert (m.hidden_size, m.num_layers, m.intermediate_size) == (1024, 12, 3072)
  shapes = nnx.state(nnx.eval_shape(lambda: init_model(m)))
  params = sum(x.size for x in jax.tree.leaves(shapes))
  assert 140e6 < params < 150e6, params
  # the warm start: 6 N tokens at 50 TFLOP/s (fp32 as it runs) within ~90 s, compile aside
  flops = 6 * params * job.sft.rows * job.sft.row_len * job.sft.steps
  assert flops / 50e12 <= 75, flops / 50e12
  longest = job.task.make_problem(10 ** 32 - 1, 10 ** 32 - 1)
  assert len(longest.text) + 2 <= job.sft.row_len


def test_the_mid_size_long_tail_job_runs_at_a_reduced_size(tmp_path):
  """configs/mid_longtail.py runs end to end (warm start, TLT's adaptive engine with the online
  EAGLE drafter and history drafts, 2 RL steps, the export) with its model and shapes shrunk:
  its own sections fit together, whatever the size."""
  import json  # pylint: disable=import-outside-toplevel
  cfg = load_config_file(ROOT / "configs" / "mid_longtail.py")
  cfg.logdir = str(tmp_path / "run")
  cfg.checkpoint_every = 0
  cfg.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                   num_kv_heads=2)
  cfg.task.update(max_digits=3, num_prompts=4)
  cfg.sft.update(steps=2, rows=2, row_len=64)
  cfg.trainer.update(steps=2, prompts_per_step=2, max_new_tokens=16, eval_problems=2)
  cfg.grpo.update(group_size=2)
  cfg.rollout.update(max_batch=4, max_prompt_len=16, batch_buckets=(1, 4), prefill_buckets=(16,))
  cfg.drafter_training.update(rows=2, seq_len=32)
  summary = train.run(cfg)
  assert summary["step"] == 2
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert [r["step"] for r in rows if "reward" in r] == [1, 2]
  assert json.loads((tmp_path / "run" / "config.json").read_text())["drafter"] == "eagle+suffix"


@pytest.mark.parametrize("name", ["tiny_grpo", "tiny_longtail", "mid_longtail", "smollm2_gsm8k",
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
  from tlt_jax.rl.trainer_config import TrainerConfig  # pylint: disable=import-outside-toplevel
  cfg = importlib.import_module(f"tlt_jax.configs.{name}").get_config()
  for section, cls, filled in [("sft", SFTConfig, ()), ("grpo", GRPOConfig, ()),
                               ("trainer", TrainerConfig, TRAINER_SOURCES)]:
    fields = {f.name for f in dataclasses.fields(cls)} - set(filled)
    assert set(cfg[section].keys()) == fields, (name, section)
  with pytest.raises(TypeError, match=r"give values for the fields \['group_size'\]"):
    dataclass_section(GRPOConfig, clip_eps_high=0.3)
