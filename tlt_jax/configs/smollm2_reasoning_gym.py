"""GRPO of SmolLM2-135M-Instruct on a reasoning_gym arithmetic task (``chain_sum``), chat-formatted.

  python -m tlt_jax.train --config=configs/smollm2_reasoning_gym.py --config.logdir=runs/smollm2_rg
  python -m tlt_jax.train --config=configs/smollm2_reasoning_gym.py --config.task.name=leg_counting

Like configs/smollm2_gsm8k.py (same model, no warm start, chat template) with shorter problems
and answers: sums and differences of a few multi-digit numbers, scored by reasoning_gym's own
scorer. Any reasoning_gym dataset with short answers fits (``basic_arithmetic``,
``leg_counting``, ...); its own settings go in ``task.options``.
"""

import ml_collections

from tlt_jax.configs import smollm2_gsm8k


def get_config() -> ml_collections.ConfigDict:
  c = smollm2_gsm8k.get_config()
  c.task.name = "chain_sum"
  c.task.size = 5000
  c.task.num_prompts = 0  # 0: fresh entries every step; N: epoch mode over N distinct entries
  c.trainer.max_new_tokens = 256
  c.trainer.update_tokens = 8192
  c.rollout.max_prompt_len = 128  # chat-formatted chain_sum prompts are 60-90 SmolLM2 tokens
  return c
