"""Decode cost vs the engine's capacity (``max_new_tokens``) on identical work, measured in one run.

  python -m experiments.rollout.bench_capacity [--repeats 3] [--capacities 256,4096,16384]
                                       [--out experiments/out/bench_capacity.json]

Workload: a random Qwen2-style target (4 layers, hidden 256, vocab 512, fp32), 32
prompts of 32 tokens, sampled at temperature 1 with 13 stop ids, so answers end early (p50 ~30
tokens, max ~200). Every engine decodes the *same* tokens (per-row PRNG streams; asserted): only
the capacity differs. Engines with KV-length buckets (the default) are compared with the old
layout (``kv_buckets=()``: one cache of the full capacity) for the smaller capacities. Runs are
interleaved, the first (compiling) run of each engine is a warm-up, timed runs must compile nothing
(asserted). Reported: tokens/s per engine (median), the ratio to the 256-token engine, peak cache
bytes, and how often caches grew.
"""

from __future__ import annotations

import os
import resource
import statistics

import numpy as np

from experiments import harness
from experiments.harness import (EngineConfig, RolloutEngine, SamplingParams, init_model,
                                 write_report)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--capacities", default="256,4096,16384")
  parser.add_argument("--old-layout", default="256,4096",
                      help="capacities also run with one full-capacity cache (kv_buckets=())")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--out", default="experiments/out/bench_capacity.json")
  a = parser.parse_args()

  vocab, n_stops = 512, 13
  model = init_model(harness.bench_config(vocab), seed=0)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(20, vocab, 32).tolist() for _ in range(a.batch)]
  capacities = harness.ints(a.capacities)
  old = harness.ints(a.old_layout)
  variants = [(c, "buckets") for c in capacities] + [(c, "full") for c in old]
  engines, params = {}, {}
  for cap, layout in variants:
    name = f"{cap}-{layout}"
    engines[name] = RolloutEngine(model, config=EngineConfig(
        max_batch=a.batch, max_prompt_len=32, max_new_tokens=cap, max_stop_ids=n_stops,
        kv_buckets=None if layout == "buckets" else ()))
    params[name] = SamplingParams(max_new_tokens=cap, temperature=1.0, seed=0,
                                  stop_token_ids=tuple(range(1, 1 + n_stops)))

  reference = {}  # the first run's tokens: every engine must decode them

  def run(name: str, rep: int) -> dict | None:
    result = engines[name].generate(prompts, params[name])
    assert result.tokens == reference.setdefault("tokens", result.tokens), \
        f"{name} decoded other tokens"
    if rep == 0:
      return None
    s = result.stats.to_dict()
    assert s["compiles"] == 0, f"{name} compiled {s['compiles']} times in a timed run"
    print(f"rep {rep} {name:>12}: {s['tokens_per_s']:8.0f} tok/s, wall {s['wall_s']:.2f}s, "
          f"grows {s['grows']}, peak cache {s['cache_bytes_peak'] / 2**20:.1f} MiB", flush=True)
    return dict(tokens_per_s=s["tokens_per_s"], wall_s=s["wall_s"], decode_s=s["decode_s"],
                grow_s=s["grow_s"], grows=s["grows"], compact_s=s["compact_s"],
                cache_bytes_peak=s["cache_bytes_peak"], kv_lens=sorted(set(s["segment_kv_lens"])))

  # repeat 0 compiles (a warm-up); runs interleaved
  runs = harness.interleaved(run, engines, a.repeats, warmup=1)
  lengths = np.array([len(t) for t in reference["tokens"]])
  base = "256-buckets" if "256-buckets" in runs else next(iter(runs))
  summary = {}
  for name, rs in runs.items():
    # per-repeat ratio to the base engine of the same repeat, then the median
    ratios = harness.ratios(runs[base], rs)
    summary[name] = dict(
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in rs),
        slowdown_vs_base=statistics.median(ratios), slowdown_runs=ratios,
        cache_bytes_peak=rs[0]["cache_bytes_peak"], grows=rs[0]["grows"], kv_lens=rs[0]["kv_lens"],
        grow_s=statistics.median(r["grow_s"] for r in rs),
        compact_s=statistics.median(r["compact_s"] for r in rs),
        pool=engines[name].pool_stats()["executables"])
  out = dict(base=base, repeats=a.repeats, batch=a.batch,
             lengths=dict(p50=float(np.median(lengths)), p90=float(np.percentile(lengths, 90)),
                          max=int(lengths.max()), tokens=int(lengths.sum())),
             peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
             engines=summary, cpus=os.cpu_count())
  print(f"\nanswer lengths: p50 {out['lengths']['p50']}, p90 {out['lengths']['p90']}, "
        f"max {out['lengths']['max']}")
  for name, s in summary.items():
    print(f"{name:>12}: {s['tokens_per_s']:8.0f} tok/s, {s['slowdown_vs_base']:.2f}x slower than "
          f"{base}, peak cache {s['cache_bytes_peak'] / 2**20:.1f} MiB, kv lengths {s['kv_lens']}")
  write_report(a.out, out)


if __name__ == "__main__":
  main()
