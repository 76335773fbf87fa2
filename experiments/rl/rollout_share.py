"""Where an RL step's time goes on the default task: rollout vs update, and the rollout's tail.

  python -m experiments.rl.rollout_share [--steps 20] [--out-dir experiments/out]

Runs the main job's default config (warm start + GRPO) and reports the share of step time spent
in rollout and in its tail (decode segments with fewer than half of the rows live), with the
completion-length distribution (JSON + a PNG histogram). The paper reports ~85% rollout.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from experiments import harness
from experiments.rl.rl_bench import config_lib, train


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--steps", type=int, default=80)
  parser.add_argument("--sft-steps", type=int, default=300)
  parser.add_argument("--out-dir", default="experiments/out")
  a = parser.parse_args()
  cfg = config_lib.load_config_file(harness.TINY_GRPO)
  cfg.trainer.steps, cfg.sft.steps = a.steps, a.sft_steps
  cfg.logdir = str(pathlib.Path(a.out_dir) / "rollout_share_run")
  summary = train.run(cfg)
  history, lengths = summary["history"], np.array(summary["lengths"])
  steady = history[1:] or history  # the first step includes compilation
  total = sum(m["step_s"] for m in steady)
  result = {
      "steps": len(history),
      "rollout_share": sum(m["rollout_s"] for m in steady) / total,
      "update_share": sum(m["update_s"] for m in steady) / total,
      "tail_share_of_step": sum(m["tail_s"] for m in steady) / total,
      "tail_share_of_rollout": sum(m["tail_s"] for m in steady) / sum(m["rollout_s"] for m in steady),
      "length_p50": float(np.percentile(lengths, 50)), "length_p90": float(np.percentile(lengths, 90)),
      "length_p99": float(np.percentile(lengths, 99)), "length_max": int(lengths.max()),
      "accuracy_start": summary["accuracy_start"], "accuracy_end": summary["accuracy_end"],
      "sampled_reward_start": summary["sampled_start"], "sampled_reward_end": summary["sampled_end"],
      "per_step": [{k: m[k] for k in ("rollout_s", "update_s", "tail_s", "step_s", "reward")}
                   for m in history],
  }
  out = pathlib.Path(a.out_dir)
  harness.write_json(out / "rollout_share.json", result)
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.hist(lengths, bins=40)
  for q in (50, 99):
    ax.axvline(np.percentile(lengths, q), color="k", ls="--", lw=1)
  ax.set_xlabel("completion length (tokens)")
  ax.set_ylabel("completions")
  ax.set_title(f"GRPO rollouts: p50 {result['length_p50']:.0f}, p99 {result['length_p99']:.0f}")
  fig.tight_layout()
  fig.savefig(out / "rollout_lengths.png", dpi=100)
  print(json.dumps({k: v for k, v in result.items() if k != "per_step"}, indent=2))


if __name__ == "__main__":
  main()
