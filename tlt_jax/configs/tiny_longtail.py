"""The long-tail job: GRPO on arithmetic traces whose lengths are heavy-tailed, over epochs of a
fixed prompt set, at CPU scale (the paper's regime: the rollout is most of the step, and most of
the rollout is a few long rows decoding at a small batch).

  python -m tlt_jax.train --config=configs/tiny_longtail.py                      # TLT on
  python -m tlt_jax.train --config=configs/tiny_longtail.py --config.drafter=none  # vanilla

The larger operand has Zipf(1.5)-distributed digits on 1..32, so most traces are 10-40 tokens and
a few run to ~320 (one column of ``x+y+c=dd`` per digit). Each step rolls out 16 prompts x 4
samples = 64 rows, one batch of the engine: as rows finish the batch shrinks bucket by bucket,
and the last rows decode alone. The prompt set (64 problems) comes back every 4 steps, so the
suffix drafter has every prompt's earlier completions to draft from from the second epoch on.
The step line shows the rollout's share of the step and the seconds its last rows took (``last
rows``: at most an eighth of them live); docs/benchmarks.md, "The long-tail job", has the
measurements.

The model is the tiny default's (3 layers, hidden 128): on a CPU a larger one makes a 9-token
pass no cheaper against a 1-token one (``experiments/sd/pass_cost.py``), only the job slower.
"""

import ml_collections

from tlt_jax.configs import tiny_grpo


def get_config() -> ml_collections.ConfigDict:
  c = tiny_grpo.get_config()
  c.drafter = "suffix"  # TLT on: history, siblings and the prompt draft; the tuner chooses
  # a perfect teacher: this job measures speed, and its figures are those of the perfect warm start
  c.task.update(max_digits=32, digit_exponent=1.5, num_prompts=64, teacher_error=0.0)
  # 300 steps (the default job's 450 sharpen its flawed warm start); rows of 448 tokens: the
  # longest trace (32 digits) is ~390 tokens with its prompt
  c.sft.update(steps=300, row_len=448)
  # one policy update per step, in micro-batches of ~1024 tokens: a minibatch holding a 300-token
  # row packs into rows of 300-430 tokens, and a bigger micro-batch is mostly padding
  # (docs/benchmarks.md, "The long-tail job")
  c.trainer.update(steps=16, prompts_per_step=16, max_new_tokens=352, eval_problems=64,
                   minibatches=1, update_tokens=1024, eval_pass_k=0, eval_every=0)
  c.grpo.update(group_size=4)
  c.rollout.max_prompt_len = 80
  return c
