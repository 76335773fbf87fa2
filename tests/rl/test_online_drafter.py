"""The drafter trained online in the RL loop (``drafter/online.py``): metrics, weights reaching
the engine, and an exact resume of drafter + optimizer + buffer position from a checkpoint."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from tests.helpers import assert_written_atomically
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.drafter.online import BUFFER_FILE, DrafterTrainingConfig
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.utils import compile_count

TRAINING = DrafterTrainingConfig(rows=4, seq_len=32, serial_steps=3, learning_rate=3e-3,
                                 serial_budget="fixed")


def online_trainer(training=TRAINING) -> GRPOTrainer:
  task = ArithmeticTask(max_digits=3)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
  engine = EngineConfig(max_batch=8, max_prompt_len=16, max_new_tokens=24, prefill_buckets=(16,),
                        batch_buckets=(4, 8), spec=(2, 1, 3))  # fixed: the rollout is
  # deterministic for a seed (an adaptive tuner's choices follow timings, and with rejection
  # sampling the tokens follow the choices), so a resumed step can be compared exactly
  return GRPOTrainer(init_model(config, seed=0), tokenizer, task, engine,
                     grpo.GRPOConfig(group_size=2),
                     TrainerConfig(steps=4, prompts_per_step=4, max_new_tokens=24, minibatches=2,
                                   eval_problems=4),
                     drafter=Drafter.create(config, seed=1), drafter_training=training)


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def stepped():
  trainer = online_trainer()
  start = host(trainer.online.spot.params)
  first = trainer.step()
  return trainer, start, first


def test_one_device_trains_the_drafter_between_rollout_and_update(stepped):
  trainer, start, m = stepped
  assert m["drafter_serial_steps"] == 3 and m["drafter_serial_s"] > 0
  assert m["drafter_spot_steps"] == 0 and m["tail_idle_device_s"] == 0.0  # nothing was idle
  assert np.isfinite(m["drafter_loss"]) and 0.0 <= m["drafter_top1"] <= 1.0
  assert trainer.online.spot.steps == 3
  assert trainer.online.buffer.num_samples == 8  # every row's hidden states (collect=1.0)
  trained = host(trainer.online.spot.params)
  assert any(not np.array_equal(a, b) for a, b in zip(start, trained))
  # the engine decodes with the new drafter weights (a copy: the next drafter step donates its own)
  for a, b in zip(trained, host(trainer.engine.drafter_params)):
    np.testing.assert_array_equal(a, b)


def test_resume_restores_drafter_optimizer_and_buffer_position_exactly(stepped, tmp_path):
  trainer, _, _ = stepped
  with Checkpointer(tmp_path / "ckpt", keep=2) as checkpointer:
    trainer.save(checkpointer)
    step_dir = checkpointer.step_dir(trainer.step_count)
  assert os.path.isfile(os.path.join(step_dir, BUFFER_FILE))
  resumed = online_trainer()
  with Checkpointer(tmp_path / "ckpt", keep=2) as checkpointer:
    resumed.restore(checkpointer)
  assert resumed.online.spot.steps == trainer.online.spot.steps
  for a, b in zip(host(trainer.online.spot.opt_state), host(resumed.online.spot.opt_state)):
    np.testing.assert_array_equal(a, b)
  # the next step: the same drafter batches (buffer contents and RNG), so identical weights
  compiles = compile_count()
  m1, m2 = trainer.step(), resumed.step()
  assert m1["drafter_serial_steps"] == m2["drafter_serial_steps"] == 3
  assert m1["reward"] == m2["reward"] and m1["drafter_loss"] == m2["drafter_loss"]
  for a, b in zip(host(trainer.online.spot.params), host(resumed.online.spot.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(host(trainer.engine.drafter_params), host(resumed.engine.drafter_params)):
    np.testing.assert_array_equal(a, b)
  assert m1["compiles"] == 0  # the first trainer's second step: nothing new to compile
  del compiles


def test_a_damaged_buffer_file_is_reported_and_the_buffer_starts_empty(stepped, tmp_path):
  trainer, _, _ = stepped
  with Checkpointer(tmp_path / "ckpt", keep=2) as checkpointer:
    trainer.save(checkpointer)
    path = os.path.join(checkpointer.step_dir(trainer.step_count), BUFFER_FILE)
  with open(path, "r+b") as f:
    f.seek(100)
    f.write(b"garbage!")
  resumed = online_trainer()
  said = []
  with Checkpointer(tmp_path / "ckpt", keep=2) as checkpointer:
    resumed.restore(checkpointer, report=said.append)
  assert any("does not match its checksum" in s for s in said), said
  assert resumed.online.buffer.num_samples == 0
  assert resumed.online.spot.steps == trainer.online.spot.steps  # the drafter itself restored


def test_the_buffer_file_is_replaced_atomically(stepped, tmp_path, monkeypatch):
  """The buffer beside a checkpoint is synced under another name and renamed into place: a crash
  while it is written leaves the old file whole."""
  trainer, _, _ = stepped
  path = tmp_path / BUFFER_FILE
  path.write_bytes(b"the buffer of an earlier save")
  data, sha = trainer.online.buffer_bytes()
  assert_written_atomically(path, lambda: trainer.online.write_buffer(str(tmp_path), data),
                            monkeypatch)
  assert path.read_bytes() == data and trainer.online.restore_buffer(str(tmp_path), sha) is None


def test_drafter_training_config_errors():
  with pytest.raises(ValueError, match="DrafterTrainingConfig.rows"):
    DrafterTrainingConfig(rows=0)
  with pytest.raises(ValueError, match=r"DrafterTrainingConfig.collect must be in \(0, 1\]"):
    DrafterTrainingConfig(collect=0.0)
  # the ledger's rules, named as this config's fields
  with pytest.raises(ValueError, match=r"DrafterTrainingConfig.savings_share must be in \[0, 1\]"):
    DrafterTrainingConfig(savings_share=1.5)
  with pytest.raises(ValueError, match=r"DrafterTrainingConfig.serial_steps must be an int >= 0"):
    DrafterTrainingConfig(serial_steps=-1)
  with pytest.raises(ValueError, match="learning_rate"):
    DrafterTrainingConfig(learning_rate=float("nan"))
  # a time budget is the "fixed" budget's: the ledger (the default) would silently ignore it
  with pytest.raises(ValueError, match="DrafterTrainingConfig.serial_seconds is a fixed budget"):
    DrafterTrainingConfig(serial_seconds=2.0)
  DrafterTrainingConfig(serial_budget="fixed", serial_seconds=2.0)


def test_precompiled_drafter_steps_compile_nothing_and_metrics_split(stepped):
  """After precompile_drafter() the first drafter steps on a device compile nothing (they would
  otherwise compile inside a rollout's tail); the step's metrics score the weights that drafted
  the rollout (held out) apart from the training steps' own (in-sample) loss."""
  trainer, _, m = stepped
  assert {"drafter_loss", "drafter_top1", "drafter_train_loss", "drafter_train_top1"} <= set(m)
  fresh = online_trainer()
  fresh.online.buffer.load_state_dict(trainer.online.buffer.state_dict())
  assert fresh.precompile_drafter() == 1
  device = fresh.rollout_devices[0]
  compiles = compile_count()
  out = fresh.online.serial(fresh.engine.params, device)
  fresh.online.evaluate(fresh.engine.params, device, params=fresh.engine.drafter_params)
  assert out["steps"] == 3 and compile_count() == compiles


def test_serial_training_stops_when_its_time_budget_is_spent(stepped):
  """serial_seconds bounds the serial steps: a step starts only while the previous step's
  duration fits what is left, so a budget spent before the first step (1e-9 s) runs none of the
  20 allowed steps (at most 1 on a clock too coarse to see that time), a generous one all."""
  trainer, _, _ = stepped
  fresh = online_trainer(dataclasses.replace(TRAINING, serial_steps=20, serial_seconds=1e-9))
  fresh.online.buffer.load_state_dict(trainer.online.buffer.state_dict())
  device = fresh.rollout_devices[0]
  out = fresh.online.serial(fresh.engine.params, device)
  assert out["steps"] <= 1 and fresh.online.spot.steps == out["steps"], out
  fresh.online.config = dataclasses.replace(TRAINING, serial_steps=3, serial_seconds=1e6)
  out = fresh.online.serial(fresh.engine.params, device)
  assert out["steps"] == 3 and fresh.online.spot.steps == 3, out
