"""The shared executable pool vs a naive one: executables, compile time and memory (Table 5 shape).

  python -m experiments.sd.ablate_pool [--target experiments/out/bench_target] [--max-batch 32]

Pools compiled for the same target, buckets and strategies:

* ``naive``: every strategy its own engine (own state layout, own prefill / compaction / growth)
  at every batch bucket, plus a vanilla engine;
* ``shared, SD at every bucket``: one adaptive engine (one state layout for all strategies;
  trees of equal verify width share one segment executable), SD allowed at every bucket;
* ``shared + threshold``: the same with SD only where ``batch <= --sd-max-batch`` and
  ``batch * verify_tokens <= --verify-budget`` (the paper's bucket -> verify-width groups).

Memory is the sum over executables of ``compiled.memory_analysis()`` (arguments + outputs +
temporaries - aliased), i.e. what holding every executable's buffers at once would take; the
largest single executable is reported too. ``--target random``: a random model of the bench
target's width with --layers layers (compile cost and memory do not depend on the weights).
"""

from __future__ import annotations

import pathlib
import sys
import time

from experiments import harness
from experiments.harness import (Drafter, EngineConfig, ModelConfig, RolloutEngine, SpecConfig,
                                 init_model, strategy_name)

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
  parser.add_argument("--strategies", type=harness.spec_list, default=STRATEGIES,
                      help="depth,topk,verify_tokens per ;-separated entry (default: " +
                      ";".join(f"{x.depth},{x.topk},{x.verify_tokens}" for x in STRATEGIES) + ")")
  parser.add_argument("--skip-unthresholded", action="store_true", help="compile only the "
                      "naive pool and the shared one with the threshold (Table 5's two rows)")
  parser.add_argument("--layers", type=int, default=6, help="layers of the random model used "
                      "when --target is not a checkpoint directory (compile time grows with it)")
  parser.add_argument("--out", default="experiments/out/ablate_pool.json")
  a = parser.parse_args()
  if pathlib.Path(a.target).is_dir():
    target, config = harness.hf.from_pretrained(a.target)
  elif a.target != "random":
    parser.error(f"--target {a.target}: no such checkpoint directory (train one with "
                 "experiments/drafter/train_bench_target.py, or say --target random)")
  else:
    config = ModelConfig(vocab_size=19, hidden_size=256, intermediate_size=512,
                         num_layers=a.layers, num_heads=8, num_kv_heads=4, head_dim=32)
    target = init_model(config)
  drafter = Drafter.create(config, seed=0)
  base = dict(max_batch=a.max_batch, max_prompt_len=48, max_new_tokens=a.max_new,
              prefill_buckets=(48,))
  rows = {}
  naive = harness.engines_for(target, base, {strategy_name(s): s for s in a.strategies}, drafter)
  rows["naive (every strategy x every bucket)"] = pool_of(list(naive.values()))
  print(rows, flush=True)
  if not a.skip_unthresholded:
    rows["shared, SD at every bucket"] = pool_of([RolloutEngine(
        target, drafter=drafter, config=EngineConfig(**base, strategies=a.strategies,
                                                     sd_max_batch=a.max_batch))])
    print(rows, flush=True)
  shared = RolloutEngine(target, drafter=drafter, config=EngineConfig(
      **base, strategies=a.strategies, sd_max_batch=a.sd_max_batch,
      verify_budget=a.verify_budget))
  rows[f"shared + threshold (SD at batch <= {a.sd_max_batch}, batch x verify <= "
       f"{a.verify_budget})"] = pool_of([shared])
  report = dict(command=" ".join(sys.argv), strategies=[strategy_name(s) for s in a.strategies],
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
