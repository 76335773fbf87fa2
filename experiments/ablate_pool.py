"""The shared executable pool vs a naive one: executables, compile time and memory (Table 5 shape).

  python experiments/ablate_pool.py [--target experiments/out/bench_target] [--max-batch 32]

Pools compiled for the same target, buckets and strategies:

* ``naive``: every strategy its own engine (own state layout, own prefill / compaction / growth)
  at every batch bucket, plus a vanilla engine;
* ``shared, SD at every bucket``: one adaptive engine (one state layout for all strategies;
  trees of equal verify width share one segment executable), SD allowed at every bucket;
* ``shared + threshold``: the same with SD only where ``batch <= --sd-max-batch`` and
  ``batch * verify_tokens <= --verify-budget`` (the paper's bucket -> verify-width groups).

Memory is the sum over executables of ``compiled.memory_analysis()`` (arguments + outputs +
temporaries - aliased), i.e. what holding every executable's buffers at once would take; the
largest single executable is reported too. Without a trained target a random model of the bench
target's shape is used (compile cost and memory do not depend on the weights).
"""

from __future__ import annotations

import pathlib
import sys
import time

import harness
from harness import (Drafter, EngineConfig, ModelConfig, RolloutEngine, SpecConfig, init_model,
                     strategy_name)

STRATEGIES = (SpecConfig(3, 1, 4), SpecConfig(7, 1, 8), SpecConfig(5, 4, 16), SpecConfig(7, 4, 16),
              SpecConfig(7, 4, 32))


def pool_of(engines: list[RolloutEngine]) -> dict:
  """Compiles every engine's pool; totals of executables, seconds and memory."""
  t0 = time.perf_counter()
  n = sum(e.precompile() for e in engines)
  seconds = time.perf_counter() - t0
  stats = [e.pool_stats() for e in engines]
  memory = [m for s in stats for m in s["memory_bytes"].values()]
  by_kind: dict[str, int] = {}
  for s in stats:
    for kind, count in s["by_kind"].items():
      by_kind[kind] = by_kind.get(kind, 0) + count
  return dict(executables=n, by_kind=by_kind, compile_s=seconds,
              memory_mb_total=sum(memory) / 2**20 if memory else None,
              memory_mb_max=max(memory) / 2**20 if memory else None)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--target", default="experiments/out/bench_target")
  parser.add_argument("--max-batch", type=int, default=32)
  parser.add_argument("--max-new", type=int, default=256)
  parser.add_argument("--sd-max-batch", type=int, default=8)
  parser.add_argument("--verify-budget", type=int, default=64)
  parser.add_argument("--out", default="experiments/out/ablate_pool.json")
  a = parser.parse_args()
  if pathlib.Path(a.target).is_dir():
    target, config = harness.hf.from_pretrained(a.target)
  else:
    config = ModelConfig(vocab_size=19, hidden_size=256, intermediate_size=512, num_layers=6,
                         num_heads=8, num_kv_heads=4, head_dim=32)
    target = init_model(config)
  drafter = Drafter.create(config, seed=0)
  base = dict(max_batch=a.max_batch, max_prompt_len=48, max_new_tokens=a.max_new,
              prefill_buckets=(48,))
  rows = {}
  naive = harness.engines_for(target, base, {strategy_name(s): s for s in STRATEGIES}, drafter)
  rows["naive (every strategy x every bucket)"] = pool_of(list(naive.values()))
  print(rows, flush=True)
  rows["shared, SD at every bucket"] = pool_of([RolloutEngine(
      target, drafter=drafter, config=EngineConfig(**base, strategies=STRATEGIES,
                                                   sd_max_batch=a.max_batch))])
  print(rows, flush=True)
  shared = RolloutEngine(target, drafter=drafter, config=EngineConfig(
      **base, strategies=STRATEGIES, sd_max_batch=a.sd_max_batch,
      verify_budget=a.verify_budget))
  rows[f"shared + threshold (SD at batch <= {a.sd_max_batch}, batch x verify <= "
       f"{a.verify_budget})"] = pool_of([shared])
  report = dict(command=" ".join(sys.argv), strategies=[strategy_name(s) for s in STRATEGIES],
                buckets=list(shared.config.batch_buckets),
                served={b: [s.name for s in shared.strategies_for(b)]
                        for b in shared.config.batch_buckets},
                pools=rows)
  out = harness.write_json(a.out, report)
  for name, row in rows.items():
    mem = "n/a" if row["memory_mb_total"] is None else f"{row['memory_mb_total']:.0f} MB"
    print(f"{name}: {row['executables']} executables, {row['compile_s']:.0f}s compile, {mem}")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
