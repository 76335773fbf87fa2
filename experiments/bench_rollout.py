"""Bucketed (compacting) engine vs one static batch on a long-tail workload, measured in one run.

  python experiments/bench_rollout.py [--repeats 5] [--out experiments/out/bench_rollout.json]

Workload: a random near-uniform target samples at temperature 1 with a set of stop ids covering
``stop_fraction`` of the vocabulary, so completion lengths are geometric: most rows stop early,
a few run long (the tail). Both engines decode the *same* tokens (per-row PRNG streams); the
ratio of their tokens/s is the benefit of shrinking the batch as rows finish.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--max-new-tokens", type=int, default=384)
  parser.add_argument("--mean-length", type=float, default=40.0)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--out", default="experiments/out/bench_rollout.json")
  a = parser.parse_args()

  vocab = 512
  config = ModelConfig(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                       num_layers=a.layers, num_heads=8, num_kv_heads=4, architecture="qwen2",
                       attention_bias=True, tie_word_embeddings=True)
  model = init_model(config, seed=0)
  n_stops = max(1, round(vocab / a.mean_length))
  params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, seed=0,
                          stop_token_ids=tuple(range(1, 1 + n_stops)))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(20, vocab, rng.integers(8, 33)).tolist() for _ in range(a.batch)]
  engines = {}
  for name, compaction in (("bucketed", True), ("static", False)):
    engine = RolloutEngine(model, config=EngineConfig(
        max_batch=a.batch, max_prompt_len=32, max_new_tokens=a.max_new_tokens,
        compaction=compaction, max_stop_ids=n_stops))
    engine.precompile()
    engines[name] = engine

  runs = {name: [] for name in engines}
  reference = None
  for rep in range(a.repeats):  # interleaved so machine noise hits both alike
    for name, engine in engines.items():
      result = engine.generate(prompts, params)
      assert result.stats["compiles"] == 0, "the benchmark must not recompile"
      if reference is None:
        reference = result.tokens
      assert result.tokens == reference, "both engines must produce identical tokens"
      runs[name].append(result.stats)
  ratios = [b["tokens_per_s"] / s["tokens_per_s"] for b, s in zip(runs["bucketed"], runs["static"])]
  lengths = np.array([len(t) for t in reference])
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
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(summary, indent=2))
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  main()
