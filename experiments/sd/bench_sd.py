"""Speculative vs vanilla decoding, tokens/s as ratios measured in one run (Table 4 / Fig. 13 shape).

  python -m experiments.drafter.train_bench_target     # once: a small target (arithmetic traces)
  python -m experiments.drafter.train_drafter_offline  # once: an EAGLE drafter on its generations
  python -m experiments.sd.bench_sd [--repeats 3] [--batches 1,2,4,8,16,32] [--verify 4,8,16,32]

For every batch size the vanilla engine and each speculative strategy decode the same prompts
(long addition problems, so all rows run for a similar number of tokens) with one static batch
(no compaction), greedy unless --temperature is set; repeats are interleaved and the median of
the per-repeat ratios is reported. Greedy outputs are checked to be identical to vanilla.
Writes JSON and a PNG heatmap to --out-dir.
"""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np

from experiments import harness
from experiments.harness import SamplingParams, forward_cost, heatmap, ints, measure, tree_for


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--target", default="experiments/out/bench_target")
  parser.add_argument("--drafter", default="experiments/out/bench_drafter")
  parser.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32])
  parser.add_argument("--verify", type=ints, default=[4, 8, 16, 32])
  parser.add_argument("--depth", type=int, default=7, help="draft depth for the batch table")
  parser.add_argument("--topk", type=int, default=4)
  parser.add_argument("--fig13-depths", type=ints, default=[3, 5, 7])
  parser.add_argument("--fig13-batch", type=int, default=1)
  parser.add_argument("--digits", type=int, default=10)
  parser.add_argument("--max-new", type=int, default=128)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", default="experiments/out")
  parser.add_argument("--phase-split", action="store_true",
                      help="only measure the draft/verify time split at batch 1")
  a = parser.parse_args()

  target, config, drafter, tokenizer = harness.load_bench(a.target, a.drafter)
  params = SamplingParams(max_new_tokens=a.max_new, temperature=a.temperature, seed=a.seed)
  prompts = harness.long_prompts(tokenizer, max(a.batches), a.digits, a.seed)
  t0 = time.time()
  if a.phase_split:
    cost = forward_cost(target)
    split = harness.phase_split(target, drafter, prompts[:1], {
        "chain depth 3": tree_for(4, 3, a.topk), "chain depth 7": tree_for(8, 7, a.topk),
        "tree depth 7 verify 16": tree_for(16, 7, a.topk)}, params, a.max_new)
    harness.write_json(pathlib.Path(a.out_dir) / "bench_sd_phases.json",
                       {"phases": split, "target_pass_ms": cost})
    return

  table = {}
  for bs in a.batches:
    strategies = {f"verify={v}": tree_for(v, a.depth, a.topk) for v in a.verify}
    table[bs] = measure(target, drafter, prompts[:bs], strategies, params, a.max_new, a.repeats)
    print(f"batch {bs:>3}: vanilla {table[bs]['vanilla_tokens_per_s']:.0f} tok/s | " + " | ".join(
        f"{k} {v['speedup']:.2f}x (accept {v['mean_accept_len']:.2f})"
        for k, v in table[bs].items() if k.startswith("verify")), flush=True)

  # the batch table's row at --fig13-batch is Fig. 13's row at --depth: measured once
  shared = a.depth in a.fig13_depths and a.fig13_batch in a.batches
  fig13 = harness.depth_table(target, drafter, prompts[:a.fig13_batch],
                              [d for d in a.fig13_depths if not (shared and d == a.depth)],
                              lambda depth: a.verify, a.topk, params, a.max_new, a.repeats)
  if shared:
    fig13 = {d: fig13[d] if d in fig13 else table[a.fig13_batch] for d in a.fig13_depths}

  out_dir = pathlib.Path(a.out_dir)
  summary = {"args": vars(a), "target": dict(layers=config.num_layers, hidden=config.hidden_size,
                                             vocab=config.vocab_size),
             "batch_by_verify": table, "depth_by_verify": fig13, "wall_s": time.time() - t0,
             "cpu_count": os.cpu_count()}
  harness.write_json(out_dir / "bench_sd.json", summary)
  heatmap(out_dir / "bench_sd_batch.png", a.batches, a.verify,
          [[table[b][f"verify={v}"]["speedup"] for v in a.verify] for b in a.batches],
          "SD speedup over vanilla (tokens/s)", "tokens to verify", "batch size")
  heatmap(out_dir / "bench_sd_depth.png", a.fig13_depths, a.verify,
          [[fig13[d].get(f"verify={v}", {"speedup": np.nan})["speedup"] for v in a.verify]
           for d in a.fig13_depths],
          f"SD speedup at batch {a.fig13_batch}", "tokens to verify", "draft depth")
  print(f"wrote {out_dir}/bench_sd.json and two PNGs in {summary['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
