"""The main job: warm start + GRPO on long-tail arithmetic, or GRPO of a pretrained model.

  python -m tlt_jax.train [--config=CONFIG_FILE] [--config.<field>=VALUE ...] [--verbose]
                         [--compile_cache=PATH|off]

By default builds a tiny char-level policy, warm-starts it with supervised steps on traces from a
teacher that forgets the final carry of most sums with one (``task.teacher_error``, 0.6; 0: a
perfect teacher), then runs GRPO (rollout -> reward -> advantages -> policy update)
data-parallel over every local device, which makes the right answers its samples sometimes reach
its greedy habit. A real-model config (``--config=configs/smollm2_gsm8k.py`` or
``configs/smollm2_reasoning_gym.py``; the default config below has no such field) adds
``model.path`` (an HF directory or a ``.gguf`` file): the policy is that pretrained model with its
own tokenizer; ``task.kind`` picks the task (``arithmetic``, ``reasoning_gym``, ``math_dataset``)
and ``task.chat_template=True`` wraps each prompt in the tokenizer's chat template.
Writes to the logdir: ``config.json`` (the effective config, reused on resume),
``metrics.jsonl`` and tensorboard events, verified orbax checkpoints in ``checkpoints/``, and
the final policy with its tokenizer in ``final_model/`` (usable by ``tlt_jax.generate``).

  --config.logdir=DIR --config.resume=True   continues DIR's run with its saved config; other
                                             --config.<field> flags override it (announced)
  --verbose                                  tracebacks for errors (default: one line)

Ctrl-C or SIGTERM during the RL steps stops the run after the step in flight, checkpointed (a
second one stops at once); the message says how to resume.
"""

from __future__ import annotations

import sys

from tlt_jax.job.build import DEFAULT_CONFIG
from tlt_jax.job.runner import run

if __name__ == "__main__":
  from tlt_jax import cli  # pylint: disable=import-outside-toplevel
  sys.exit(cli.main(__doc__, run, DEFAULT_CONFIG, sys.argv))
