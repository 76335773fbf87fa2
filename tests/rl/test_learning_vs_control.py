"""GRPO learns: held-out reward after a few RL steps beats a no-update control on the same problems.

A rising *training* reward proves little (each step draws other problems, and their mix alone
moves it), so this compares held-out figures on one fixed problem set: the policy after GRPO
against the same initial policy with no update. The evaluation is a pure function of the params
(fixed problems, fixed sampling seed), so a no-update run ends with exactly its start figures:
the test checks that determinism and uses the start figures as the control. The reward is
dense (the fraction of '1's written), so a randomly initialised policy learns in a few steps.
"""

import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import GRPOTrainer, TrainerConfig
from tlt_jax.rollout.engine import EngineConfig

STEPS = 8


class _Ones:
  """Arithmetic prompts rewarded by the fraction of '1's in the completion (a dense reward)."""

  def __init__(self, task):
    self.task = task

  def sample(self, rng, n):
    return self.task.sample(rng, n)

  def reward(self, problem, text):  # pylint: disable=unused-argument
    return text.count("1") / max(len(text), 1)


def dense_trainer() -> GRPOTrainer:
  """A random tiny policy, GRPO on the dense reward at a high learning rate."""
  task = ArithmeticTask(max_digits=3)
  tok = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.bos_token_id)
  return GRPOTrainer(
      init_model(config, seed=0), tok, _Ones(task),
      EngineConfig(max_batch=16, max_prompt_len=16, max_new_tokens=24, prefill_buckets=(16,)),
      grpo.GRPOConfig(group_size=4),
      TrainerConfig(steps=STEPS, prompts_per_step=4, max_new_tokens=24, minibatches=2,
                    eval_problems=32, learning_rate=1e-2, warmup_steps=0))


def held_out(trainer: GRPOTrainer) -> np.ndarray:
  """Greedy and sampled (T=1) mean reward on the trainer's fixed held-out problems."""
  return np.array([trainer.evaluate(), trainer.evaluate(temperature=1.0)])


def test_grpo_beats_a_no_update_control_on_held_out_problems():
  """After 8 GRPO steps the held-out greedy and sampled rewards are clearly above the no-update
  control's (the initial policy's, on the same problems and sampling seed)."""
  trainer = dense_trainer()
  control = held_out(trainer)
  assert np.array_equal(held_out(trainer), control)  # no update: the control ends where it starts
  for _ in range(STEPS):
    trainer.step()
  after = held_out(trainer)
  assert np.all(after > control + 0.1), (control, after)
