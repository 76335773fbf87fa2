"""Drafter-invariant (coupled, Gumbel-max) verification vs rejection sampling: what it costs.

  python experiments/coupled_vs_rejection.py [--temperatures 1.0,0.7] [--repeats 3]

Same target, same trained drafter, same prompts and seeds; for each strategy and temperature
the two verification modes decode the same batch, interleaved, and we report the mean accepted
length per step (tokens per live-row step) and the speed of each relative to vanilla sampling
(median over repeats). Coupled mode must emit exactly vanilla's tokens (asserted); rejection
sampling has the same law but draws other tokens. The theory: per token, rejection accepts with
probability 1 - TV(p, q), coupled with at least (1 - TV) / (1 + TV) (Daliri et al. 2024).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments.bench_sd import load_bench, long_prompts  # noqa: E402
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from tlt_jax.rollout.sampling import SamplingParams  # noqa: E402
from tlt_jax.rollout.speculative import SpecConfig  # noqa: E402
from tlt_jax.rollout.steps import strategy_name  # noqa: E402

STRATEGIES = (SpecConfig(3, 1, 4), SpecConfig(7, 1, 8), SpecConfig(7, 4, 16))


def floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="experiments/out/bench_target")
  parser.add_argument("--drafter", default="experiments/out/bench_drafter")
  parser.add_argument("--temperatures", type=floats, default=[1.0, 0.7])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max-new", type=int, default=160)
  parser.add_argument("--out", default="experiments/out/coupled_vs_rejection.json")
  a = parser.parse_args()
  target, config, drafter, tokenizer = load_bench(a.target, a.drafter)
  prompts = long_prompts(tokenizer, a.prompts, 10, 0)
  base = dict(max_batch=a.batch, max_prompt_len=48, max_new_tokens=a.max_new,
              prefill_buckets=(48,), compaction=False)
  engines = {"vanilla": RolloutEngine(target, config=EngineConfig(**base))}
  for spec in STRATEGIES:
    for mode in ("rejection", "coupled"):
      engines[f"{strategy_name(spec)} {mode}"] = RolloutEngine(
          target, drafter=drafter, config=EngineConfig(**base, spec=spec, verify=mode))
  for e in engines.values():
    e.precompile()
  rows = {}
  for temperature in a.temperatures:
    per = {name: dict(speed=[], accept=[]) for name in engines if name != "vanilla"}
    for r in range(a.repeats):
      params = SamplingParams(max_new_tokens=a.max_new, temperature=temperature, seed=r)
      timed = {}
      for name, engine in engines.items():
        t0 = time.perf_counter()
        result = engine.generate(prompts, params)
        timed[name] = (time.perf_counter() - t0, result)
      want = timed["vanilla"][1].tokens
      for name, (seconds, result) in timed.items():
        if name == "vanilla":
          continue
        if name.endswith("coupled"):
          assert result.tokens == want, f"{name} at T={temperature} differs from vanilla"
        per[name]["speed"].append(timed["vanilla"][0] / seconds)
        per[name]["accept"].append(result.stats["mean_accept_len"])
    rows[str(temperature)] = {name: dict(speed_vs_vanilla=statistics.median(v["speed"]),
                                         mean_accept_len=statistics.median(v["accept"]))
                              for name, v in per.items()}
    for name, v in rows[str(temperature)].items():
      print(f"T={temperature} {name:28s} {v['speed_vs_vanilla']:.2f}x vanilla, "
            f"accepted/step {v['mean_accept_len']:.2f}", flush=True)
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(dict(command=" ".join(sys.argv), batch=a.batch, prompts=a.prompts,
                                 repeats=a.repeats, results=rows), indent=2) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
