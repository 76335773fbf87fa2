"""Predicts TLT's step and rollout ratios on an accelerator for the long-tail jobs, before the
device run measures them, with the step-time model (``rl/step_time.py``).

  python -m experiments.rl.predict_longtail [--out docs/results/predict_longtail_h200.json]

Inputs, each named in the JSON with where it comes from:
- **the rows' lengths**: one step's 64 completions are the reference traces of the job's epoch-mode
  prompts (``configs/tiny_longtail.py``: 16 prompts x 4 samples; the sharp warm start of run 3
  repeats its traces, so a row's length is its trace's), every step of the first epoch;
- **per-bucket step costs on the H200**: the engine's calibration of run 3 at batch 1-8
  (``docs/results/longtail_e2e_h200_run3_sharp.json``: vanilla and the suffix chain of depth 8),
  and at 16-64 ``pass_cost_h200.json``'s 1-token and 9-token passes (128x3 for the tiny job,
  1024x12 for the mid-size one, with the learned drafter's chain priced as its depth in drafter
  passes of a tenth of a target pass each, an assumption);
- **acceptance per bucket**: run 3's mean accepted length over all SD steps (3.52, history drafts)
  where many rows are live, and at the buckets of the last rows (<= 8) the accepted length the
  last rows' measured time implies (run 3: the last rows took 0.76x vanilla's time at a suffix
  step of 1.15-1.28x vanilla's, so ~1.6 tokens a step): the long rows, which the rollout waits
  for, repeat their earlier completions least. Two scenarios bracket it: ``mean`` (3.52 at every
  bucket above 8) and ``critical`` (1.6 everywhere);
- **what is not decode**: run 3's vanilla medians per step: prefill, compaction and host time
  (8.3 ms; TLT's is meant to stay within 10 % of it, so the prediction charges TLT the
  same), the update (13 ms), so the rollout is 81 % of vanilla's step.

The model advances every live row at its bucket's accepted length (no stragglers within a
bucket) and charges SD where it is cheaper per token than vanilla (``policy="tlt"``): the tuner's
choice with what it measured. It leaves out the tuner's probes and segment boundaries.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics

import numpy as np

from experiments.rl.step_time import Costs, rollout_time

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
PROMPT_TOKENS = 16  # a long-tail prompt with its chat wrapping, about (counted by the update)
MID_PARAMS = 145e6


def job_lengths(config_path: str, steps: int) -> list[list[int]]:
  """Completion lengths (tokens, stop id included) of each of ``steps`` RL steps' rows: the
  reference trace of every prompt, once per sample."""
  from tlt_jax.job.build import build_job  # pylint: disable=import-outside-toplevel
  from tlt_jax.job.typed_config import load_config_file  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl.data import step_problems  # pylint: disable=import-outside-toplevel
  cfg = load_config_file(config_path)
  job = build_job(cfg)
  t = job.trainer
  out = []
  for step in range(steps):
    problems = step_problems(job.task, t.seed, step, t.prompts_per_step, t.num_prompts)
    lengths = [len(job.tokenizer.encode(p.solution)) + 1 for p in problems]
    out.append([n for n in lengths for _ in range(cfg.grpo.group_size)])
  return out


def interp(points: dict[int, float], b: int) -> float:
  """``points`` (batch -> value) at ``b``, linear in log2(batch) between the measured batches."""
  xs = sorted(points)
  if b in points:
    return points[b]
  lo = max(x for x in xs if x < b)
  hi = min(x for x in xs if x > b)
  w = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
  return points[lo] + w * (points[hi] - points[lo])


def pass_table(size: str) -> tuple[dict[int, float], dict[int, float]]:
  """pass_cost_h200.json's seconds of a 1-token and a 9-token pass by batch, for ``size``."""
  rows = json.loads((RESULTS / "pass_cost_h200.json").read_text())["rows"]
  one = {r["batch"]: r["ms"]["1"] * 1e-3 for r in rows if r["size"] == size}
  nine = {r["batch"]: r["ms"]["9"] * 1e-3 for r in rows if r["size"] == size}
  return one, nine


def scaled(costs: Costs, factor: float, boundary_s: float) -> Costs:
  """``costs`` with every step ``factor`` times dearer and a segment boundary at each bucket
  change (``compact_s``)."""
  return Costs(costs.buckets, [x * factor for x in costs.decode_s],
               [None if x is None else x * factor for x in costs.sd_step_s], costs.accept_len,
               costs.sd_max_batch, compact_s=boundary_s)


def tiny_costs(accept_small: float, accept_big: float) -> Costs:
  """The tiny long-tail job on the H200: run 3's calibration at 1-8, the 128x3 pass costs above
  (the suffix arm's 9 tokens at the pass's ratio), the given acceptances."""
  calib = json.loads((RESULTS / "longtail_e2e_h200_run3_sharp.json").read_text())[
      "calibration"]["step_s"]
  one, nine = pass_table("128x3")
  decode, sd = [], []
  for b in BUCKETS:
    if b <= 8:
      decode.append(calib[f"{b}/vanilla"])
      sd.append(calib[f"{b}/suffix d8"])
    else:
      decode.append(interp(one, b))
      sd.append(interp(one, b) * interp(nine, b) / interp(one, b))
  accept = [accept_small if b <= 8 else accept_big for b in BUCKETS]
  return Costs(BUCKETS, decode, sd, accept, sd_max_batch=64)


def mid_costs(accept_small: float, accept_big: float, learned_accept: float,
              drafter_pass: float = 0.1) -> Costs:
  """The mid-size job (1024x12) on the H200 from pass_cost_h200.json's passes, each bucket's SD
  step the cheaper per token of two arms: the suffix chain (a 9-token pass, drafting in the
  graph at no model cost; ``accept_small`` / ``accept_big`` tokens) and the learned chain of
  depth 3 (a 4-token pass, between the 1- and 9-token ones, plus 3 drafter passes of
  ``drafter_pass`` of a 1-token pass each; ``learned_accept`` tokens at every bucket)."""
  one, nine = pass_table("1024x12")
  decode, sd, accept = [], [], []
  for b in BUCKETS:
    p1, p9 = interp(one, b), interp(nine, b)
    suffix = (p9, accept_small if b <= 8 else accept_big)
    learned = (p1 + (p9 - p1) * 3 / 8 + 3 * drafter_pass * p1, learned_accept)
    step, tokens = min(suffix, learned, key=lambda arm: arm[0] / arm[1])
    decode.append(p1)
    sd.append(step)
    accept.append(tokens)
  return Costs(BUCKETS, decode, sd, accept, sd_max_batch=64)


def predict(lengths: list[list[int]], costs: Costs, fixed_s: float, update_s: float) -> dict:
  """Median over the steps of the vanilla and TLT rollout and step seconds and their ratios."""
  rows = []
  for step_lengths in lengths:
    v = rollout_time(step_lengths, costs, 1, "vanilla")["seconds"] + fixed_s
    t = rollout_time(step_lengths, costs, 1, "tlt")["seconds"] + fixed_s
    rows.append(dict(vanilla_rollout_s=v, tlt_rollout_s=t, rollout_ratio=v / t,
                     step_ratio=(v + update_s) / (t + update_s),
                     rollout_share=v / (v + update_s)))
  return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=4, help="RL steps of lengths (an epoch)")
  parser.add_argument("--out", default="experiments/out/predict_longtail_h200.json")
  args = parser.parse_args()
  run3 = json.loads((RESULTS / "longtail_e2e_h200_run3_sharp.json").read_text())
  metrics = {k: statistics.median(r[k] for r in run3["steps_metrics"]["none"][4:])
             for k in ("rollout_s", "decode_s", "prefill_s", "compact_s", "update_s")}
  fixed = metrics["rollout_s"] - metrics["decode_s"]  # prefill, compaction and host: vanilla's
  lengths = job_lengths(str(ROOT / "configs" / "tiny_longtail.py"), args.steps)
  boundary = run3["calibration"]["boundary_s"]
  # the calibration times steps at the shortest cache; the rollout's run at longer ones: scale
  # every step so that the model's vanilla decode is run 3's measured one
  base = scaled(tiny_costs(1.0, 1.0), 1.0, boundary)
  modelled = statistics.median(rollout_time(x, base, 1, "vanilla")["seconds"] for x in lengths)
  factor = metrics["decode_s"] / modelled
  critical, mean = 1.6, 3.52
  scenarios = {"mean": (critical, mean), "critical": (critical, critical)}
  tokens = statistics.median(sum(x) for x in lengths) + 64 * PROMPT_TOKENS
  # the mid-size update: 4 passes of 2 N FLOP a token (forward and backward, plus the old
  # log-probs' forward) over the padded tokens (x1.3) at 50 TFLOP/s, plus the tiny update's
  # seconds (launch-bound: the fixed part)
  update_mid = metrics["update_s"] + 8 * MID_PARAMS * tokens * 1.3 / 50e12
  out = {"inputs": dict(run3_vanilla_medians=metrics, fixed_s=fixed, accept_critical=critical,
                        accept_mean=mean, steps=args.steps, boundary_s=boundary,
                        step_cost_factor=factor, update_tokens=tokens,
                        mid_update_s_assumed=update_mid,
                        lengths_p50=float(np.median(np.concatenate(lengths))),
                        lengths_max=int(np.max(np.concatenate(lengths)))),
         "tiny": {}, "mid": {}}
  for name, (small, big) in scenarios.items():
    costs = scaled(tiny_costs(small, big), factor, boundary)
    out["tiny"][name] = predict(lengths, costs, fixed - boundary, metrics["update_s"])
  # the mid-size job: the same lengths, boundaries and host time; its passes' own costs (no
  # scale: pass_cost.py's loop runs over a cache filled to 300, as the rollout's long rows do)
  for name, (small, big) in scenarios.items():
    for learned in (2.0, 3.0):
      costs = scaled(mid_costs(small, big, learned), 1.0, boundary)
      out["mid"][f"{name}, learned {learned:g}"] = predict(lengths, costs, fixed - boundary,
                                                           update_mid)
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  for job in ("tiny", "mid"):
    for name, r in out[job].items():
      print(f"{job:4s} {name:8s} rollout {r['rollout_ratio']:.2f}x  step {r['step_ratio']:.2f}x  "
            f"(vanilla rollout {1e3 * r['vanilla_rollout_s']:.1f} ms, "
            f"{100 * r['rollout_share']:.0f}% of its step)")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
