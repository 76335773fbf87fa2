"""Never slower: the adaptive engine with a useless drafter against vanilla, round by round.

  python -m experiments.drafter.train_bench_target      # once: the 3.6M bench target
  python -m experiments.drafter.train_drafter_offline  # once: its EAGLE drafter (only its config)
  python -m experiments.sd.never_slower [--rounds 16] [--strategies "3,1,4;7,1,8"] [--trained]

The engine's check that TLT is never slower than vanilla (the job's: rl/e2e_default_job.py). The
drafter has random weights (``Drafter.create(config, seed=123)``): speculative decoding with it can
only cost, so the best the adaptive engine can do is to find that out quickly and cheaply and decode
vanilla. The workload is one ``generate`` call of 32 long-tail prompts (additions of 1 to 12 digits,
``harness.sweep_prompts``) sampled at temperature 1 until a stop id (the tokenizer's and the
target's EOS) or ``--max-new`` tokens; round r samples with seed r, as the steps of an RL run do.

Three engines, compiled first (the adaptive pools whole): vanilla, and the adaptive engine
(vanilla plus ``--strategies``, chosen per segment and batch bucket by its tuner) once with
``verify="rejection"`` and once with ``verify="coupled"``. After one untimed warm-up call each,
the adaptive engines get a fresh tuner, which then learns across the rounds as it would across
RL steps. Each round runs every engine once, in rotating order (load from other processes falls
on all of them). Asserted: no call compiles anything; coupled emits exactly vanilla's tokens
every round.

Reported per verification mode: the per-round ratio vanilla seconds / adaptive seconds, its median
over all rounds, the first 4 and the last 8, the ratio of total times over all rounds and over the
first 4; coupled's speed over rejection's (per-round median and total: whether coupling's exactness
costs speed, which ``--trained`` measures where SD runs); the seconds the adaptive engine spent in
speculative arms each round (from ``RolloutStats.arms``) and the tuner's final choice per bucket.
The targets (``TARGETS``): >= 0.95x over all rounds and >= 0.90x in the first 4.
"""

from __future__ import annotations

import statistics
import sys
import time

from experiments import harness
from experiments.harness import Drafter, SamplingParams, TunerConfig, strategy_name

MODES = ("rejection", "coupled")
FIRST, LAST = 4, 8  # the targets' "first 4" rounds (learning) and "last 8" (learned)
TARGETS = {"all": 0.95, f"first{FIRST}": 0.90}


def speed_summary(vanilla_s: list[float], mine_s: list[float]) -> dict:
  """Per-round ratios vanilla / mine and their medians over all rounds, the first ``FIRST`` and
  the last ``LAST``; the ratios of total seconds over all rounds and the first ``FIRST``."""
  per_round = [v / m for v, m in zip(vanilla_s, mine_s)]
  return dict(
      per_round=per_round, median_all=statistics.median(per_round),
      **{f"median_first{FIRST}": statistics.median(per_round[:FIRST]),
         f"median_last{LAST}": statistics.median(per_round[-LAST:]),
         "total_all": sum(vanilla_s) / sum(mine_s),
         f"total_first{FIRST}": sum(vanilla_s[:FIRST]) / sum(mine_s[:FIRST])})


def targets_met(speed: dict) -> dict:
  """Each target against both readings (median of per-round ratios, ratio of totals)."""
  return {f"{span}>={goal}": dict(median=speed[f"median_{span}"] >= goal,
                                  total=speed[f"total_{span}"] >= goal)
          for span, goal in TARGETS.items()}


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--target", default="experiments/out/bench_target")
  parser.add_argument("--drafter", default="experiments/out/bench_drafter",
                      help="the trained drafter's directory (loaded with the target; the "
                      "benchmark's drafter is a random one of the same config)")
  parser.add_argument("--rounds", type=int, default=16)
  parser.add_argument("--prompts", type=int, default=32, help="prompts of the one generate call "
                      "(its batch)")
  parser.add_argument("--max-new", type=int, default=160)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--strategies", type=harness.spec_list, default=harness.BENCH_STRATEGIES,
                      help="the adaptive pool besides vanilla: depth,topk,verify_tokens entries "
                      "separated by ';' (default: ablate_tuner.py's 3,1,4;7,1,8;5,4,16;7,4,16)")
  parser.add_argument("--tuner", default=None, choices=["cost", "beg_mab", "ucb1"],
                      help="TunerConfig.kind (default: the engine's default TunerConfig)")
  parser.add_argument("--segment-steps", type=int, default=None,
                      help="EngineConfig.segment_steps (default: the engine's)")
  parser.add_argument("--drafter-seed", type=int, default=123)
  parser.add_argument("--trained", action="store_true",
                      help="draft with the trained drafter instead of a random one (to compare "
                      "coupled against rejection verification where SD pays)")
  parser.add_argument("--prompt-seed", type=int, default=0)
  parser.add_argument("--out", default="experiments/out/never_slower.json")
  a = parser.parse_args()
  if a.rounds < 1 or a.prompts < 1:
    raise SystemExit("--rounds and --prompts must be >= 1")
  t_start = time.perf_counter()
  target, config, trained, tokenizer = harness.load_bench(a.target, a.drafter)
  drafter = trained if a.trained else Drafter.create(config, seed=a.drafter_seed)
  prompts = harness.sweep_prompts(tokenizer, a.prompts, a.prompt_seed)
  stop = tuple(sorted({tokenizer.eos_token_id, *config.eos_token_ids}))
  plen = max(len(p) for p in prompts)
  base = dict(max_batch=a.prompts, max_prompt_len=plen, prefill_buckets=(plen,),
              max_new_tokens=a.max_new)
  adaptive = dict(strategies=a.strategies)
  if a.tuner is not None:
    adaptive["tuner"] = TunerConfig(kind=a.tuner)
  if a.segment_steps is not None:
    adaptive["segment_steps"] = a.segment_steps
  engines = harness.engines_for(target, base, {
      f"adaptive {mode}": dict(adaptive, verify=mode) for mode in MODES}, drafter)
  sampling = lambda seed: SamplingParams(max_new_tokens=a.max_new, temperature=a.temperature,
                                         seed=seed, stop_token_ids=stop)
  compiles0 = harness.compile_count()
  warm = harness.warm_up(engines, prompts, sampling(10_000 + a.rounds))  # a seed no round uses
  executables = harness.compile_count() - compiles0
  print(f"compiled {executables} executables and warmed up in {sum(warm.values()):.0f}s "
        f"({', '.join(f'{n} {s:.0f}s' for n, s in warm.items())})", flush=True)
  for mode in MODES:
    engines[f"adaptive {mode}"].set_tuner()  # learning starts at round 0

  def run(name: str, rnd: int) -> dict:
    seconds, result = harness.timed(engines[name].generate, prompts, sampling(rnd))
    stats = result.stats
    assert stats.compiles == 0, f"{name} compiled {stats.compiles} executables in round {rnd}"
    per_arm = stats.arm_totals("seconds")
    return dict(seconds=seconds, tokens=result.tokens, n_tokens=stats.tokens,
                sd_s=sum(s for arm, s in per_arm.items() if arm != "vanilla"),
                arm_s=per_arm, arm_steps=stats.arm_totals("steps"), switch_s=stats.switch_s,
                switches=stats.switches, mean_accept_len=stats.mean_accept_len)

  names = list(engines)
  runs = {name: [] for name in names}
  for rnd in range(a.rounds):  # harness.interleaved's loop, with a line and a check per round
    for name in harness.repeat_order(names, rnd, "rotate"):
      runs[name].append(run(name, rnd))
    got = {name: runs[name][-1] for name in names}
    assert got["adaptive coupled"]["tokens"] == got["vanilla"]["tokens"], (
        f"round {rnd}: coupled verification emitted other tokens than vanilla")
    print(f"round {rnd:2d}: vanilla {got['vanilla']['seconds']:.2f}s " + "  ".join(
        f"| {mode} {got[f'adaptive {mode}']['seconds']:.2f}s "
        f"({got['vanilla']['seconds'] / got[f'adaptive {mode}']['seconds']:.2f}x, SD "
        f"{got[f'adaptive {mode}']['sd_s']:.2f}s)" for mode in MODES), flush=True)
  vanilla_s = [r["seconds"] for r in runs["vanilla"]]
  report = dict(
      command=" ".join(sys.argv), target=a.target,
      drafter=a.drafter if a.trained else f"random (seed {a.drafter_seed})",
      strategies=[strategy_name(s) for s in a.strategies], rounds=a.rounds, prompts=a.prompts,
      max_new=a.max_new, temperature=a.temperature, stop_ids=list(stop),
      tuner=a.tuner or "engine default", segment_steps=a.segment_steps or "engine default",
      executables=executables, warm_up_s=warm, targets=TARGETS,
      vanilla=dict(seconds=vanilla_s, tokens=[r["n_tokens"] for r in runs["vanilla"]]),
      modes={})
  for mode in MODES:
    name = f"adaptive {mode}"
    mine = runs[name]
    speed = speed_summary(vanilla_s, [r["seconds"] for r in mine])
    tuner = engines[name].tuner.summary()
    report["modes"][mode] = dict(
        speed_vs_vanilla=speed, targets_met=targets_met(speed),
        seconds=[r["seconds"] for r in mine], sd_s=[r["sd_s"] for r in mine],
        sd_share_of_time=[r["sd_s"] / r["seconds"] for r in mine],
        arm_s=[r["arm_s"] for r in mine], arm_steps=[r["arm_steps"] for r in mine],
        switch_s=[r["switch_s"] for r in mine], switches=[r["switches"] for r in mine],
        mean_accept_len=[r["mean_accept_len"] for r in mine],
        identical_tokens_to_vanilla=[r["tokens"] == v["tokens"]
                                     for r, v in zip(mine, runs["vanilla"])],
        tuner_choice={b: v.get("best") for b, v in tuner.items() if isinstance(v, dict)},
        tuner_summary=tuner)
  coupled_over_rejection = [r["seconds"] / c["seconds"] for r, c in
                            zip(runs["adaptive rejection"], runs["adaptive coupled"])]
  report["coupled_speed_over_rejection"] = dict(
      per_round=coupled_over_rejection, median=statistics.median(coupled_over_rejection),
      total=sum(r["seconds"] for r in runs["adaptive rejection"]) /
      sum(c["seconds"] for c in runs["adaptive coupled"]))
  out = harness.write_json(a.out, report)
  for mode in MODES:
    m = report["modes"][mode]
    s = m["speed_vs_vanilla"]
    print(f"== {mode}: adaptive vs vanilla, median of per-round ratios: all {s['median_all']:.3f}"
          f"x, first {FIRST} {s[f'median_first{FIRST}']:.3f}x, last {LAST} "
          f"{s[f'median_last{LAST}']:.3f}x; total time: all {s['total_all']:.3f}x, first "
          f"{FIRST} {s[f'total_first{FIRST}']:.3f}x; SD seconds per round "
          f"{[round(x, 2) for x in m['sd_s']]}; choice {m['tuner_choice']}", flush=True)
  c = report["coupled_speed_over_rejection"]
  print(f"== coupled speed / rejection speed: median of per-round ratios {c['median']:.3f}x, "
        f"total time {c['total']:.3f}x", flush=True)
  print(f"wrote {out} in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
  main()
