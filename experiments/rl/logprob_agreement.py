"""Rollout against update: how far the log-probs a rollout records are from the update's.

  python -m experiments.rl.logprob_agreement [--steps 3] [--set sft.steps=300 ...]
      [--out experiments/out/logprob_agreement.json]

Builds the default job (configs/tiny_grpo.py with ``--set`` overrides), warm-starts its policy
as the job does, and for each numerics setting (float32; float32 params computing in bfloat16)
rolls out RL steps 1..``--steps`` at the warm start's params and compares each completion token's recorded
log-prob with the update's own forward pass over it (``rl/agreement.py``): mean and max gap, the
importance ratio's largest distance from 1, and the share of tokens PPO would clip before any
update. (Speculative rollouts, whose tokens come from verify passes: tests/rl/
test_logprob_agreement.py.)
"""

from __future__ import annotations

import datetime
import sys

import jax
import numpy as np

from experiments import harness
from experiments.harness import write_report
from experiments.rl.rl_bench import job_config
from tlt_jax.job.build import build_job
from tlt_jax.job.runner import initial_model, make_trainer
from tlt_jax.models.instances import copy_module, with_compute_dtype
from tlt_jax.rl.agreement import logprob_agreement
from tlt_jax.rl.sft import warm_start

SETTINGS = {"float32": None, "bf16 compute": "bfloat16"}


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_set_flag(parser, help="config overrides of the default job")
  parser.add_argument("--steps", type=int, default=3, help="RL steps' rollouts compared")
  parser.add_argument("--out", default="experiments/out/logprob_agreement.json")
  a = parser.parse_args()
  cfg = job_config(0, a.set, "")
  job = build_job(cfg)
  policy, _ = warm_start(initial_model(job, cfg.seed), job.tokenizer, job.task, job.sft, cfg.seed)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  result = dict(date=datetime.date.today().isoformat(), backend=jax.default_backend(),
                command=" ".join(["python -m experiments.rl.logprob_agreement"] + sys.argv[1:]),
                warm_start_steps=job.sft.steps, rows=[])
  for name, compute in SETTINGS.items():
    scfg = job_config(0, a.set, "")
    scfg.model.compute_dtype = compute
    trainer = make_trainer(build_job(scfg), with_compute_dtype(copy_module(policy), compute),
                           mesh)
    for step in range(a.steps):
      got = logprob_agreement(trainer, step)
      result["rows"].append(dict(setting=name, step=step + 1, **got))
      print(f"{name:12} step {step + 1}: {got['tokens']} tokens, gap mean "
            f"{got['gap_mean']:.2e} max {got['gap_max']:.2e}, ratio off 1 by at most "
            f"{got['ratio_dev_max']:.2e}, clipped {got['clipped_share']:.4f}")
  write_report(a.out, result)


if __name__ == "__main__":
  main()
