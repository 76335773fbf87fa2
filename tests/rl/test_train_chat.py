"""The main job with a pretrained policy, a reasoning_gym task and chat-formatted prompts (what the
SmolLM2 configs run), on a tiny model directory with SmolLM2's tokenizer layout and template."""

from __future__ import annotations

import json
import pathlib

import ml_collections
import numpy as np
import pytest

from tests.rl.chat_fixtures import write_chat_model
from tlt_jax import train
from tlt_jax.job.build import build_job
from tlt_jax.job.typed_config import ConfigError, load_config_file
from tlt_jax.models.load import load_tokenizer
from tlt_jax.models.tokenizer import HFTokenizer
from tlt_jax.rl.external_tasks import ReasoningGymTask
from tlt_jax.rl.tasks import chat_prompt
from tlt_jax.rl.trainer import GRPOTrainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("chat_model")
  write_chat_model(directory)
  return directory


def smollm2_config(name: str, model_dir, logdir, max_prompt_len: int = 256
                   ) -> ml_collections.ConfigDict:
  """A SmolLM2 config with the tiny model, shrunk to one quick step."""
  cfg = load_config_file(ROOT / "configs" / f"{name}.py")
  cfg.model.path = str(model_dir)
  cfg.logdir = str(logdir)
  cfg.checkpoint_every = 0
  cfg.task.size = 50
  cfg.trainer.update(dict(steps=1, prompts_per_step=2, minibatches=1, max_new_tokens=8,
                          eval_problems=2, update_tokens=0))
  cfg.grpo.group_size = 2
  cfg.rollout = ml_collections.ConfigDict(dict(
      max_batch=4, max_prompt_len=max_prompt_len, batch_buckets=(4,),
      prefill_buckets=(max_prompt_len,),
      kv_buckets=()))
  return cfg


@pytest.mark.parametrize("name, task_name", [("smollm2_gsm8k", "gsm_symbolic"),
                                             ("smollm2_reasoning_gym", "chain_sum")])
def test_smollm2_configs_build_a_chat_job(model_dir, tmp_path, name, task_name):
  # the tiny tokenizer's merges are SmolLM2's few: gsm_symbolic prompts run to ~300 of its tokens
  # (the job checks every prompt's length against max_prompt_len before any work)
  job = build_job(smollm2_config(name, model_dir, tmp_path, max_prompt_len=512))
  assert job.chat_template and job.model_path == model_dir
  assert isinstance(job.task, ReasoningGymTask) and job.task.dataset_name == task_name
  assert isinstance(job.tokenizer, HFTokenizer)
  assert job.model_config.vocab_size == job.tokenizer.vocab_size
  assert job.model_config.dtype == "float32" and job.sft.steps == 0
  assert job.engine.pad_token_id == job.tokenizer.pad_token_id == 2  # <|im_end|>


def test_chat_prompts_are_what_the_trainer_encodes(model_dir):
  tokenizer = load_tokenizer(model_dir)
  task = ReasoningGymTask("chain_sum", size=4, seed=0)
  problem = task.problem(1)

  def trainer(chat: bool) -> GRPOTrainer:
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # encode_prompt needs only these two fields
    trainer.tokenizer, trainer.chat_template = tokenizer, chat
    return trainer

  ids = trainer(True).encode_prompt(problem)
  assert ids == tokenizer.encode(chat_prompt(tokenizer, problem.prompt))
  # one BOS (<|im_start|>), the template's own; the prompt ends where the assistant answers
  assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
  assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
  plain = trainer(False).encode_prompt(problem)
  assert plain == [tokenizer.bos_token_id] + tokenizer.encode(problem.prompt)


def test_one_grpo_step_with_chat_prompts(model_dir, tmp_path):
  cfg = smollm2_config("smollm2_reasoning_gym", model_dir, tmp_path / "run")
  summary = train.run(cfg)
  (step,) = summary["history"]
  assert step["step"] == 1 and np.isfinite(step["loss"]) and np.isfinite(step["grad_norm"])
  assert 0.0 <= step["reward"] <= 1.0 and step["len_max"] <= 8
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["task"]["chat_template"] is True and saved["task"]["name"] == "chain_sum"
  final = load_tokenizer(tmp_path / "run" / "final_model")  # the template travels with it
  assert chat_prompt(final, "hi").endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("change, message", [
    (dict(task=dict(kind="sudoku")), r"config.task.kind must be one of"),
    (dict(task=dict(name="")), r"config.task.name must name a reasoning_gym dataset"),
    (dict(task=dict(name="no_such_dataset")), r"config.task \(reasoning_gym\): .*not registered"),
    (dict(task=dict(chat_template="yes")), r"config.task.chat_template must be True or False"),
    (dict(task=dict(temperature=1.0)), r"config.task has unknown keys \['temperature'\]"),
    (dict(sft=dict(steps=5)), r"config.sft.steps must be 0 here"),
    (dict(model=dict(path="")), r"config.model.path is empty"),
    (dict(model=dict(path="/no/such/model")), r"config.model.path /no/such/model does not exist"),
    (dict(model=dict(layers=3)), r"config.model has unknown keys \['layers'\]"),
])
def test_chat_job_mistakes_name_the_field(model_dir, tmp_path, change, message):
  cfg = smollm2_config("smollm2_reasoning_gym", model_dir, tmp_path)
  with cfg.ignore_type():
    for section, fields in change.items():
      for key, value in fields.items():
        cfg[section][key] = value
  with pytest.raises(ConfigError, match=message):
    build_job(cfg)


def test_chat_template_needs_a_tokenizer_that_has_one(tmp_path):
  """The tiny char-level policy has no chat template; a math_dataset task picks its records up."""
  data = tmp_path / "gsm.jsonl"  # two questions: task.eval_share holds one out for evaluation
  data.write_text(json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}) + "\n" +
                  json.dumps({"question": "What is 4+4?", "answer": "4+4=8\n#### 8"}) + "\n")
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  cfg.logdir = str(tmp_path)
  cfg.task = ml_collections.ConfigDict(dict(kind="math_dataset", path=str(data),
                                            chat_template=True))
  with pytest.raises(ConfigError, match="chat_template=True but the tokenizer cannot render"):
    build_job(cfg)
  cfg.task.chat_template = False
  with pytest.raises(ConfigError, match="max_prompt_len=32 is shorter than the task's prompts"):
    build_job(cfg)  # the record's prompt (with the math template) has 84 characters
  cfg.rollout.max_prompt_len = 128
  job = build_job(cfg)
  assert sorted(p.answer for p in job.task.problems + job.task.held_out) == ["5", "8"]
  assert len(job.task.held_out) == 1 and set("What is 2+3?") <= set(job.task.alphabet)
