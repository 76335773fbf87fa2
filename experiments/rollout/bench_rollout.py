"""Bucketed (compacting) engine vs one static batch on a long-tail workload, measured in one run.

  python -m experiments.rollout.bench_rollout [--repeats 5]
      [--out experiments/out/bench_rollout.json]

Workload: a random near-uniform target samples at temperature 1 with a set of stop ids covering
``stop_fraction`` of the vocabulary, so completion lengths are geometric: most rows stop early,
a few run long (the tail). Both engines decode the *same* tokens (per-row PRNG streams); the
ratio of their tokens/s is the benefit of shrinking the batch as rows finish.
"""

from __future__ import annotations

import json
import os
import statistics

import numpy as np

from experiments import harness
from experiments.harness import EngineConfig, RolloutEngine, SamplingParams, init_model


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--max-new-tokens", type=int, default=384)
  parser.add_argument("--mean-length", type=float, default=40.0)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--out", default="experiments/out/bench_rollout.json")
  a = parser.parse_args()

  vocab = 512
  model = init_model(harness.bench_config(vocab, a.hidden, a.layers), seed=0)
  n_stops = max(1, round(vocab / a.mean_length))
  params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, seed=0,
                          stop_token_ids=tuple(range(1, 1 + n_stops)))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(20, vocab, rng.integers(8, 33)).tolist() for _ in range(a.batch)]
  engines = {name: RolloutEngine(model, config=EngineConfig(
      max_batch=a.batch, max_prompt_len=32, max_new_tokens=a.max_new_tokens,
      compaction=compaction, max_stop_ids=n_stops))
             for name, compaction in (("bucketed", True), ("static", False))}
  harness.warm_up(engines)

  reference = {}  # the first run's tokens: both engines must decode them

  def run(name: str, _rep: int) -> dict:
    result = engines[name].generate(prompts, params)
    assert result.stats.compiles == 0, "the benchmark must not recompile"
    assert result.tokens == reference.setdefault("tokens", result.tokens), \
        "both engines must produce identical tokens"
    return result.stats.to_dict()

  # interleaved so machine noise hits both alike
  runs = harness.interleaved(run, engines, a.repeats)
  ratios = harness.ratios(runs["bucketed"], runs["static"])
  lengths = np.array([len(t) for t in reference["tokens"]])
  summary = {
      "workload": {"batch": a.batch, "max_new_tokens": a.max_new_tokens, "vocab": vocab,
                   "hidden": a.hidden, "layers": a.layers, "stop_ids": n_stops,
                   "length_p50": float(np.median(lengths)),
                   "length_p90": float(np.percentile(lengths, 90)),
                   "length_p99": float(np.percentile(lengths, 99)), "length_max": int(lengths.max()),
                   "tokens": int(lengths.sum())},
      "tokens_per_s": {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in runs.items()},
      "row_steps": {n: rs[0]["row_steps"] for n, rs in runs.items()},
      "segments_bucketed": runs["bucketed"][0]["segments"],
      "speedup_median": statistics.median(ratios),
      "speedup_all": ratios,
      "cpu_count": os.cpu_count(),
  }
  harness.write_json(a.out, summary)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  main()
