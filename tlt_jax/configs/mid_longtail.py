"""The long-tail job with a policy of SmolLM2-135M's size class (145M parameters): what a user's
model costs on an accelerator, where the tiny policy's every pass is launch-bound.

  python -m tlt_jax.train --config=configs/mid_longtail.py                        # TLT on
  python -m tlt_jax.train --config=configs/mid_longtail.py --config.drafter=none  # vanilla
  experiments/system/accelerator_check.sh --e2e      # both arms stepping in turn, on a GPU

The task, prompt set and step shape are configs/tiny_longtail.py's. What differs:

- **The policy: hidden 1024, 12 layers** (16 heads of 64, 4 KV heads, MLP 3072), fp32:
  ``experiments/sd/pass_cost.py``'s ``1024x12``, whose 9-token pass is free at batch 1 on the
  H200, where the long tail decodes (docs/results/pass_cost_h200.json). An accelerator's job:
  the tests build it at a reduced size.
- **TLT = the online EAGLE drafter plus history drafts** (``drafter="eagle+suffix"``): EAGLE-1,
  which trained to a higher acceptance than EAGLE-3 in the same time (docs/benchmarks.md). The
  tuner chooses per bucket among vanilla, the drafter's chain (depth 3) and the suffix chain
  (depth 8); ``sd_max_batch`` is the engine's default rule.
- **Warm start: 1000 SFT steps of 8 rows x 448 tokens at lr 1e-3** (the usual stable rate at
  this size; the tiny policy's 3e-3 is for 0.6M parameters). The device run's ``warm_start``
  record (loss, token accuracy) says whether that is enough.
- **Fewer executables**: batch buckets 1 / 4 / 16 / 64 and one prompt bucket (80), since a
  1-token pass costs about the same at batch 1, 4 and 16 on an accelerator. The layers are
  unrolled (no scan), so each executable holds 12 of them; the executables' count, not the
  layers, sets the compile time.
- RL learning rate 1e-5 (the tiny job's 5e-5 suits a 0.6M policy).

Sizes, costs and estimates behind these choices: docs/benchmarks.md, "Figures moved out of the
library's docstrings".
"""

import ml_collections

from tlt_jax.configs import tiny_longtail

# pass_cost.py's size_config("1024x12"): heads of 64, 4 KV heads, MLP 3x hidden
MODEL = dict(hidden_size=1024, intermediate_size=3072, num_layers=12, num_heads=16,
             num_kv_heads=4, compute_dtype="auto")  # bf16 arithmetic on a GPU or TPU


def get_config() -> ml_collections.ConfigDict:
  c = tiny_longtail.get_config()
  c.drafter = "eagle+suffix"  # TLT on: the online EAGLE drafter and history drafts
  c.model.update(MODEL)
  c.sft.update(steps=1000, rows=8, row_len=448, learning_rate=1e-3)
  c.trainer.update(learning_rate=1e-5)
  c.rollout.update(batch_buckets=(1, 4, 16, 64), prefill_buckets=(80,))
  return c
