"""The adaptive engine's tuner vs every fixed strategy vs vanilla, whole-rollout time as ratios.

  python -m experiments.drafter.train_bench_target      # once: the 3.6M bench target
  python -m experiments.drafter.train_drafter_offline   # once: its EAGLE drafter
  python -m experiments.sd.ablate_tuner [--rounds 10] [--tuner beg_mab]

Two drafters: the trained one and one of random weights (useless: SD with it only costs).
Two workloads, each decoded greedily (so every engine must emit the same tokens, asserted):

* ``sweep``: 32 additions of 1 to 12 digits in one batch. Rows finish at very different times,
  so the live batch sweeps from 32 down to 1 (the long tail).
* ``tail``: 12-digit additions one at a time (batch 1 all along: where SD pays most here).

Every engine is compiled first (the tuner's whole pool included). Then ``--rounds`` rounds run
each engine once on the same prompts, in rotating order; the tuner keeps what it learned from
round to round, as it does over the RL steps of a run. Reported per workload: time per round,
the median over the rounds of each engine's speed relative to vanilla, the same over the second
half of the rounds (after learning), and the tuner's final choice per bucket.
"""

from __future__ import annotations

import statistics
import sys
import time

from flax import nnx

from experiments import harness
from experiments.harness import Drafter, SamplingParams, TunerConfig, strategy_name

STRATEGIES = harness.BENCH_STRATEGIES


def run_round(engines: dict, calls: list[list[list[int]]], params, order: list[str]) -> dict:
  """Each engine decodes every call's prompts; returns seconds and tokens per engine."""
  out = {}
  for name in order:
    seconds, tokens = 0.0, []
    for prompts in calls:
      took, result = harness.timed(engines[name].generate, prompts, params)
      seconds += took
      assert result.stats.compiles == 0, (name, result.stats.compiles)
      tokens.append(result.tokens)
      if "tuner" in name:
        out.setdefault("switch_s", 0.0)
        out["switch_s"] += result.stats.switch_s
    out[name] = dict(seconds=seconds, tokens=tokens)
  reference = out["vanilla"]["tokens"]
  for name in order:
    assert out[name]["tokens"] == reference, f"{name} emitted other tokens than vanilla"
  return out


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--target", default="experiments/out/bench_target")
  parser.add_argument("--drafter", default="experiments/out/bench_drafter")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--tuner", default="cost", choices=["cost", "beg_mab", "ucb1"])
  parser.add_argument("--sd-max-batch", type=int, default=32,
                      help="buckets up to this may speculate in the tuned engine (the fixed "
                      "engines speculate everywhere)")
  parser.add_argument("--segment-steps", type=int, default=32)
  parser.add_argument("--tail-prompts", type=int, default=4)
  parser.add_argument("--max-new", type=int, default=160)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--kv-buckets", default="default", choices=["default", "none"])
  parser.add_argument("--out", default="experiments/out/ablate_tuner.json")
  a = parser.parse_args()
  target, config, trained, tokenizer = harness.load_bench(a.target, a.drafter)
  useless = Drafter.create(config, seed=123)
  params = SamplingParams(max_new_tokens=a.max_new, temperature=0.0)
  # --kv-buckets none: one cache length. Every step then attends over the capacity, which holds
  # the widest strategy's slack, so the adaptive engine's vanilla steps pay for it (measured:
  # +40% per vanilla step here); with the default length buckets cost follows the live lengths.
  # Every XLA:CPU executable costs a few hundred memory maps: the default pools here need
  # `sysctl vm.max_map_count` above its default 65530.
  base = dict(max_batch=32, max_prompt_len=48, max_new_tokens=a.max_new, prefill_buckets=(48,),
              kv_buckets=() if a.kv_buckets == "none" else None)
  t0 = time.perf_counter()
  tuner = dict(strategies=STRATEGIES, segment_steps=a.segment_steps, sd_max_batch=a.sd_max_batch,
               tuner=TunerConfig(kind=a.tuner, seed=a.seed))
  engines = harness.engines_for(target, base, {
      **{f"fixed {strategy_name(spec)}": spec for spec in STRATEGIES}, "tuner": tuner}, trained)
  compiled = {name: e.precompile() for name, e in engines.items()}
  print(f"compiled {sum(compiled.values())} executables in {time.perf_counter() - t0:.0f}s",
        flush=True)
  workloads = {"sweep": [harness.sweep_prompts(tokenizer, 32, a.seed)],
               "tail": [[p] for p in harness.long_prompts(tokenizer, a.tail_prompts, 12,
                                                          a.seed)]}
  report = dict(command=" ".join(sys.argv), strategies=[strategy_name(s) for s in STRATEGIES],
                tuner=a.tuner, segment_steps=a.segment_steps, sd_max_batch=a.sd_max_batch,
                kv_buckets=a.kv_buckets,
                rounds=a.rounds, results={})
  for drafter_name, drafter in (("trained", trained), ("random", useless)):
    dparams = nnx.split(drafter)[1]
    for e in engines.values():
      if e.drafter_params is not None:
        e.update_params(e.params, dparams)
    for workload, calls in workloads.items():
      engines["tuner"].set_tuner()  # every (drafter, workload) starts with a fresh tuner
      names = list(engines)
      rounds = []
      for r in range(a.rounds):
        rounds.append(run_round(engines, calls, params, harness.repeat_order(names, r, "rotate")))
        print(f"{drafter_name:8s} {workload:6s} round {r}: " + "  ".join(
            f"{n} {rounds[-1][n]['seconds']:.2f}s" for n in names), flush=True)
      speed = {n: [rd["vanilla"]["seconds"] / rd[n]["seconds"] for rd in rounds] for n in names}
      late = a.rounds // 2
      summary = {n: dict(median_vs_vanilla=statistics.median(v),
                         median_vs_vanilla_after_learning=statistics.median(v[late:]),
                         seconds=[rd[n]["seconds"] for rd in rounds]) for n, v in speed.items()}
      fixed = [n for n in names if n.startswith("fixed")]
      best = max(fixed, key=lambda n: summary[n]["median_vs_vanilla_after_learning"])
      tuner_late = summary["tuner"]["median_vs_vanilla_after_learning"]
      report["results"][f"{drafter_name}/{workload}"] = dict(
          engines=summary, best_fixed=best,
          tuner_vs_best_fixed=tuner_late / summary[best]["median_vs_vanilla_after_learning"],
          tuner_vs_vanilla=tuner_late,
          tuner_choice={b: v.get("best") for b, v in engines["tuner"].tuner.summary().items()},
          tuner_summary=engines["tuner"].tuner.summary(),
          switch_s=[rd.get("switch_s", 0.0) for rd in rounds])
      line = report["results"][f"{drafter_name}/{workload}"]
      print(f"== {drafter_name}/{workload}: tuner {tuner_late:.2f}x vanilla, "
            f"{line['tuner_vs_best_fixed']:.2f}x best fixed ({best}); choices "
            f"{line['tuner_choice']}", flush=True)
  out = harness.write_json(a.out, report)
  print(f"wrote {out} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
  main()
