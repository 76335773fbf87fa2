"""Drafter-invariant (coupled, Gumbel-max) verification vs rejection sampling: what it costs.

  python -m experiments.sd.coupled_vs_rejection [--temperatures 1.0,0.7] [--repeats 3]

Same target, same trained drafter, same prompts and seeds; for each strategy and temperature
the two verification modes decode the same batch, interleaved, and we report the mean accepted
length per step (tokens per live-row step) and the speed of each relative to vanilla sampling
(median over repeats). Coupled mode must emit exactly vanilla's tokens (asserted); rejection
sampling has the same law but draws other tokens. The theory: per token, rejection accepts with
probability 1 - TV(p, q), coupled with at least (1 - TV) / (1 + TV) (Daliri et al. 2024).
"""

from __future__ import annotations

import statistics
import sys

from experiments import harness
from experiments.harness import SamplingParams, SpecConfig, floats, strategy_name

STRATEGIES = (SpecConfig(3, 1, 4), SpecConfig(7, 1, 8), SpecConfig(7, 4, 16))


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--target", default="experiments/out/bench_target")
  parser.add_argument("--drafter", default="experiments/out/bench_drafter")
  parser.add_argument("--temperatures", type=floats, default=[1.0, 0.7])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max-new", type=int, default=160)
  parser.add_argument("--out", default="experiments/out/coupled_vs_rejection.json")
  a = parser.parse_args()
  target, _, drafter, tokenizer = harness.load_bench(a.target, a.drafter)
  prompts = harness.long_prompts(tokenizer, a.prompts, 10, 0)
  base = dict(max_batch=a.batch, max_prompt_len=48, max_new_tokens=a.max_new,
              prefill_buckets=(48,), compaction=False)
  engines = harness.engines_for(target, base, {
      f"{strategy_name(spec)} {mode}": dict(spec=spec, verify=mode)
      for spec in STRATEGIES for mode in ("rejection", "coupled")}, drafter)
  harness.warm_up(engines)
  rows = {}
  for temperature in a.temperatures:
    sampling = lambda rep, t=temperature: SamplingParams(max_new_tokens=a.max_new, temperature=t,
                                                         seed=rep)
    runs = harness.interleaved(lambda name, rep: harness.timed(
        engines[name].generate, prompts, sampling(rep)), engines, a.repeats)
    per = {name: dict(speed=[], accept=[]) for name in engines if name != "vanilla"}
    for r, (vanilla_s, want) in enumerate(runs["vanilla"]):
      for name, v in per.items():
        seconds, result = runs[name][r]
        if name.endswith("coupled"):
          assert result.tokens == want.tokens, f"{name} at T={temperature} differs from vanilla"
        v["speed"].append(vanilla_s / seconds)
        v["accept"].append(result.stats.mean_accept_len)
    rows[str(temperature)] = {name: dict(speed_vs_vanilla=statistics.median(v["speed"]),
                                         mean_accept_len=statistics.median(v["accept"]))
                              for name, v in per.items()}
    for name, v in rows[str(temperature)].items():
      print(f"T={temperature} {name:28s} {v['speed_vs_vanilla']:.2f}x vanilla, "
            f"accepted/step {v['mean_accept_len']:.2f}", flush=True)
  out = harness.write_json(a.out, dict(command=" ".join(sys.argv), batch=a.batch,
                                       prompts=a.prompts, repeats=a.repeats, results=rows))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
