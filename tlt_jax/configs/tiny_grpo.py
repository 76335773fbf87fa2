"""The default main job: warm-start a tiny policy on arithmetic traces, then GRPO on the CPU.

  python -m tlt_jax.train --config=configs/tiny_grpo.py --config.trainer.steps=40
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.logdir = ""  # tensorboard events, metrics.jsonl, checkpoints; "" = runs/<timestamp>
  c.resume = False  # True: continue from the latest checkpoint in <logdir>/checkpoints
  c.checkpoint_every = 5  # RL steps between checkpoints (0: only at the end)
  c.drafter = "none"  # "ngram": lossless speculative rollouts drafted from sibling responses
  c.distributed = False  # True: jax.distributed.initialize() (multi-host, from the environment)

  c.task = ml_collections.ConfigDict(dict(max_digits=8, digit_exponent=1.5))
  c.model = ml_collections.ConfigDict(dict(
      hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2))
  c.sft = ml_collections.ConfigDict(dict(steps=300, rows=8, row_len=256, learning_rate=3e-3))
  c.grpo = ml_collections.ConfigDict(dict(
      group_size=8, clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, loss_agg="token-mean",
      normalize_std=True))
  c.trainer = ml_collections.ConfigDict(dict(
      steps=80, prompts_per_step=8, learning_rate=2e-5, warmup_steps=2, grad_clip=1.0,
      minibatches=2, epochs=1, max_new_tokens=96, temperature=1.0, eval_problems=128))
  c.rollout = ml_collections.ConfigDict(dict(max_batch=64, max_prompt_len=32))
  return c
