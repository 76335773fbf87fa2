"""A step-time model of TLT's end-to-end speedup against the number of devices (Table 3's shape).

  python -m experiments.system.scale_model [--quick] [--out experiments/out/scale_model.json]

The paper's Table 3 reports TLT's speedup over verl growing with scale (1.21x at 1 node to 1.76x
at 8 nodes of 8 GPUs, Qwen-7B). The reason: with the global batch fixed, each device holds fewer
rows, so its running batch is small (where speculative decoding pays) for more of the rollout,
and the update, which shrinks with the devices, is a smaller share of the step. This script turns
that argument into numbers in three parts:

1. **The model**: ``experiments.rl.step_time`` (Python/numpy, no JAX computation; its docstring
   says what it predicts and how). Given per-device costs (``Costs``) and the completion
   lengths of one RL step's rows it predicts the rollout, update, drafter and step times
   and the speedup of TLT over vanilla decoding.

2. **Validation here**: per-token costs measured with the repo's engine on this CPU (a 1-layer
   random Qwen2-style policy and a drafter that mirrors its layer, so drafts are mostly accepted),
   then rollouts and updates measured at several batch sizes, length caps and 1, 2 and 4
   simulated devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set before JAX is
   imported), each against the model's prediction from that run's own completion lengths.

3. **The paper's setting**: the same model with costs derived from the paper's own figures
   (``PAPER_ASSUMPTIONS``; assumptions, not measurements) and a long-tailed length distribution,
   predicting Table 3's speedups at 1, 2, 4 and 8 nodes beside the paper's 1.21x and 1.76x.

The JSON (``--out``) holds, at the top level:

* ``command``, ``date``, ``hardware`` (``platform``, ``cpu_count``, ``jax_version``, ``devices``),
  ``quick``;
* ``measured_costs``: the ``Costs`` measured here (``buckets``, ``decode_s``, ``sd_step_s``,
  ``accept_len``, ``sd_max_batch``, ``prefill_s``, ``rollout_fixed_s``, ``compact_s``,
  ``switch_s``, ``update_fixed_s``, ``update_s_per_token``, ``drafter_step_s``,
  ``drafter_serial_steps``, ``prompt_len``, ``prefill_tokens``), and ``measured_setup`` (model,
  strategy, sampling);
* ``validation``: a list of cases, each ``{name, kind ("rollout" | "update"), policy, devices,
  rows, max_new_tokens, tokens, predicted_s, measured_s, rel_error, measured_all_s}``
  (``rel_error = predicted / measured - 1``), and ``validation_summary`` (median and max |error|
  per kind and per device count);
* ``predictions_tiny``: the model at ``devices`` 1 .. 512 with the measured costs and
  ``global_rows`` rows of the lengths in ``lengths``; ``rows`` is a list of ``{devices,
  rows_per_device, vanilla_step_s, tlt_step_s, vanilla_rollout_s, tlt_rollout_s, update_s,
  tlt_drafter_s, rollout_share_vanilla, speedup}``;
* ``predictions_paper``: the same for the paper's setting (with ``assumptions``, the costs it
  derived, ``gpus_per_node``), and ``table3``: a list of ``{nodes, gpus, predicted_speedup,
  paper_speedup}`` (``paper_speedup`` null where the paper's value is not known to us);
* ``paper_table3``: the paper's reported values ``{"1": 1.21, "8": 1.76}`` (nodes -> speedup).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import sys
from typing import Sequence

import numpy as np

# pylint: disable=unused-import  # the model's names, for experiments/tests/test_scale_model.py
from experiments.rl.step_time import (Costs, DEVICES, PAPER_ASSUMPTIONS, PAPER_FIGURES,
                                      PAPER_TABLE3, POLICIES, bucket_for, calibrate_update,
                                      chunk_time, device_time, drafter_time, long_tail_lengths,
                                      paper_costs, paper_setting, predict_step, rollout_time,
                                      scale_curve, shard_sizes, update_time)
# pylint: enable=unused-import

# ---------------------------------------------------------------------- measurement (JAX here)


BUCKETS = (1, 4, 16)  # the measured engine's batch buckets
SD_MAX = 4  # SD at buckets <= this in the measured engine
PROMPT_LEN = 12
STOP_IDS = 8  # stop ids among a vocabulary of 256: completions of mean ~32 tokens


class Bench:
  """The measured setup: a 1-layer random policy, a drafter mirroring its layer, one adaptive
  engine per simulated device (a fixed tuner chooses vanilla or SD per bucket) and updates."""

  def __init__(self, devices: int, cap: int, repeats: int):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from experiments import harness  # pylint: disable=import-outside-toplevel
    from tlt_jax.rollout import (  # pylint: disable=import-outside-toplevel
        DataParallelRollout, make_tuner)
    self.jax, self.harness, self.repeats, self.cap = jax, harness, repeats, cap
    self.model_config = harness.bench_config(256, 128, 1, bos_token_id=1, eos_token_id=2)
    self.target = harness.init_model(self.model_config, seed=0)
    drafter = harness.Drafter.from_target_layer(self.target, 0)
    h = self.model_config.hidden_size
    # fc passes the token embedding through: the drafter then is the target's one layer
    drafter.fc.kernel.set_value(jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], 0).astype(
        drafter.fc.kernel.dtype))
    drafter.fc.bias.set_value(jnp.zeros((h,), drafter.fc.bias.dtype))
    self.spec = harness.SpecConfig(3, 1, 4)
    arm = harness.strategy_name(self.spec)
    self.devices = jax.devices()[:devices]
    config = harness.EngineConfig(
        max_batch=BUCKETS[-1], batch_buckets=BUCKETS, max_prompt_len=PROMPT_LEN + 4,
        prefill_buckets=(PROMPT_LEN + 4,), max_new_tokens=cap, kv_buckets=(),
        max_stop_ids=STOP_IDS,
        strategies=(self.spec,), sd_max_batch=SD_MAX, segment_steps=0,
        tuner=harness.TunerConfig(kind="fixed", fixed=((BUCKETS[-1], "vanilla"),)))
    self.engine_config = config
    self.rollout = DataParallelRollout(self.target, drafter, config, devices=self.devices)
    fixed = lambda mapping: make_tuner(harness.TunerConfig(kind="fixed", fixed=mapping))
    self.tuners = {"vanilla": fixed(((BUCKETS[-1], "vanilla"),)),
                   "sd": fixed(((SD_MAX, arm), (BUCKETS[-1], "vanilla")))}
    rng = np.random.default_rng(0)
    self.prompts = [[1] + rng.integers(20, 256, PROMPT_LEN - 1).tolist() for _ in range(64)]
    self.arm = arm
    self.trainers: dict = {}

  def view(self, devices: int):
    """A rollout over the first ``devices`` engines (the same compiled pools)."""
    import copy  # pylint: disable=import-outside-toplevel
    if devices == 1:
      return self.rollout.engines[0]
    view = copy.copy(self.rollout)
    view.engines, view.devices = self.rollout.engines[:devices], self.rollout.devices[:devices]
    return view

  def generate(self, rows: int, max_new: int, policy: str, devices: int, stop: bool = True,
               seed: int = 0):
    """One rollout; its stats and completion lengths."""
    self.rollout.set_tuner(self.tuners[policy])
    params = self.harness.SamplingParams(
        max_new_tokens=max_new, temperature=1.0, seed=seed,
        stop_token_ids=tuple(range(3, 3 + STOP_IDS)) if stop else ())
    result = self.view(devices).generate(self.prompts[:rows], params)
    return result.stats, [len(t) for t in result.tokens]

  def timed_rollouts(self, rows, max_new, policy, devices, stop=True, seed=0) -> dict:
    """One untimed run (compiles what it needs), then ``repeats`` timed: wall seconds each (the
    data-parallel wall time with several devices), the stats and lengths of the last."""
    self.generate(rows, max_new, policy, devices, stop, seed)
    walls, every = [], []
    for _ in range(self.repeats):
      stats, lengths = self.generate(rows, max_new, policy, devices, stop, seed)
      assert stats.compiles == 0, "a timed rollout compiled"
      walls.append(stats.rollout_wall_s if stats.rollout_wall_s is not None else stats.wall_s)
      every.append(stats)
    return {"walls": walls, "stats": stats, "every": every, "lengths": lengths}

  def trainer(self, devices: int):
    """A GRPO trainer whose update is data-parallel over the first ``devices`` devices."""
    if devices not in self.trainers:
      from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
      h = self.harness
      task = h.ArithmeticTask(max_digits=3)  # only its tokenizer's special ids are used
      self.trainers[devices] = h.GRPOTrainer(
          h.init_model(self.model_config, seed=0), h.CharTokenizer(task.alphabet), task,
          h.EngineConfig(max_batch=16, max_prompt_len=PROMPT_LEN + 4, max_new_tokens=self.cap),
          h.grpo.GRPOConfig(group_size=4),
          h.TrainerConfig(prompts_per_step=4, max_new_tokens=self.cap, warmup_steps=0,
                          update_tokens=4 * (PROMPT_LEN + 4 + self.cap)),
          mesh=Mesh(np.array(self.devices[:devices]), ("data",)))
    return self.trainers[devices]

  def timed_update(self, lengths: Sequence[int], devices: int) -> list[float]:
    """Seconds of ``repeats`` policy updates on rows of ``lengths`` completion tokens (one
    untimed first, which compiles what it needs)."""
    trainer = self.trainer(devices)
    rng = np.random.default_rng(1)
    rows = len(lengths)
    prompts = [p[:PROMPT_LEN] for p in self.prompts[:rows]]
    comps = [rng.integers(20, 256, int(n)).tolist() for n in lengths]
    old = [rng.normal(-5.5, 0.3, len(c)) for c in comps]
    adv = np.asarray(self.harness.grpo.group_advantages(rng.normal(size=rows).astype(np.float32),
                                                        4))
    batch = trainer.make_batch(prompts, comps, old, adv)
    trainer.policy_update(batch)
    before = self.harness.compile_count()
    seconds = [self.harness.timed(trainer.policy_update, batch)[0] for _ in range(self.repeats)]
    assert self.harness.compile_count() == before, "a timed update compiled"
    return seconds


def measure_costs(bench: Bench, say=print) -> Costs:
  """Per-bucket step costs from rollouts that never stop early (one segment at one bucket),
  per-call and per-compaction overheads, and the update's cost per token (a line through two
  token counts)."""
  steps = 48
  decode, sd_step, accept, prefill, fixed = [], [], [], [], []
  for b in BUCKETS:
    run = bench.timed_rollouts(b, steps, "vanilla", 1, stop=False)
    med = lambda f: statistics.median(f(s) for s in run["every"])  # over the repeats
    decode.append(med(lambda s: s.decode_s / s.decode_steps))
    prefill.append(med(lambda s: s.prefill_s))
    fixed.append(med(lambda s: s.wall_s - s.prefill_s - s.decode_s))
    if b <= SD_MAX:
      run = bench.timed_rollouts(b, steps, "sd", 1, stop=False)
      tallies = [s.arms[str(b)][bench.arm] for s in run["every"]]
      sd_step.append(statistics.median(t.seconds / t.steps for t in tallies))
      accept.append(statistics.median(t.tokens / t.row_steps for t in tallies))
    else:
      sd_step.append(None)
      accept.append(None)
    say(f"  bucket {b}: vanilla {decode[-1] * 1e3:.3f} ms/step"
        + (f", SD {sd_step[-1] * 1e3:.3f} ms/step at accept {accept[-1]:.2f}"
           if sd_step[-1] else "") + f", prefill {prefill[-1] * 1e3:.2f} ms", flush=True)
  costs = Costs(buckets=list(BUCKETS), decode_s=decode, sd_step_s=sd_step, accept_len=accept,
                sd_max_batch=SD_MAX, prefill_s=prefill, rollout_fixed_s=statistics.median(fixed),
                prompt_len=PROMPT_LEN)
  # compaction: a full-width long-tail rollout (another seed than the validation's), what its
  # wall time leaves after prefill, steps and the fixed part, per bucket change
  run = bench.timed_rollouts(BUCKETS[-1], bench.cap, "sd", 1, seed=99)
  every = run["every"]
  changes = max(len(every[0].segments) - 1, 1)
  switches = every[0].catchups
  costs.switch_s = statistics.median(s.switch_s for s in every) / switches if switches else 0.0
  rest = statistics.median(s.wall_s - s.prefill_s - s.decode_s - s.switch_s for s in every)
  costs.compact_s = max(rest - costs.rollout_fixed_s, 0.0) / changes
  # the update: two token counts, one device
  rng = np.random.default_rng(7)
  short = np.minimum(rng.geometric(1 / 12, 16), bench.cap)
  long = np.minimum(rng.geometric(1 / 60, 16), bench.cap)
  short[0] = long[0] = bench.cap  # the same packed-row length for both
  t_short = statistics.median(bench.timed_update(short, 1))
  t_long = statistics.median(bench.timed_update(long, 1))
  n_short, n_long = (float(x.sum()) + PROMPT_LEN * len(x) for x in (short, long))
  per_token = max((t_long - t_short) / (n_long - n_short), 0.0)
  costs.update_s_per_token = per_token
  costs.update_fixed_s = max(t_short - per_token * n_short, 0.0)
  say(f"  overheads: fixed {costs.rollout_fixed_s * 1e3:.2f} ms per rollout, compaction "
      f"{costs.compact_s * 1e3:.2f} ms, switch {costs.switch_s * 1e3:.2f} ms; update "
      f"{costs.update_fixed_s * 1e3:.1f} ms + {per_token * 1e6:.2f} us per token", flush=True)
  return costs


def validate(bench: Bench, costs: Costs, cases: list[dict], say=print) -> list[dict]:
  """Measured against predicted rollout (and update) seconds for each case, predicted from the
  case's own completion lengths."""
  out = []
  for case in cases:
    rows, cap, devices = case["rows"], case["max_new_tokens"], case["devices"]
    for policy in ("vanilla", "sd"):
      run = bench.timed_rollouts(rows, cap, policy, devices)
      predicted = rollout_time(run["lengths"], costs, devices, policy)["seconds"]
      measured = statistics.median(run["walls"])
      out.append(dict(name=f"rollout {policy}, {rows} rows, cap {cap}, {devices} dev",
                      kind="rollout", policy=policy, devices=devices, rows=rows,
                      max_new_tokens=cap, tokens=int(sum(run["lengths"])),
                      predicted_s=predicted, measured_s=measured,
                      rel_error=predicted / measured - 1, measured_all_s=run["walls"]))
      say(f"  {out[-1]['name']}: predicted {predicted:.4f}s, measured {measured:.4f}s "
          f"({out[-1]['rel_error']:+.1%})", flush=True)
    if case.get("update"):
      lengths = run["lengths"]
      walls = bench.timed_update(lengths, devices)
      predicted = update_time(lengths, costs, devices)
      measured = statistics.median(walls)
      out.append(dict(name=f"update, {rows} rows, cap {cap}, {devices} dev", kind="update",
                      policy=None, devices=devices, rows=rows, max_new_tokens=cap,
                      tokens=int(sum(lengths)) + PROMPT_LEN * rows, predicted_s=predicted,
                      measured_s=measured, rel_error=predicted / measured - 1,
                      measured_all_s=walls))
      say(f"  {out[-1]['name']}: predicted {predicted:.4f}s, measured {measured:.4f}s "
          f"({out[-1]['rel_error']:+.1%})", flush=True)
  return out


def summary(cases: list[dict]) -> dict:
  """Median and max |relative error| per kind, and per kind and device count."""
  groups: dict[str, list[float]] = {}
  for c in cases:
    for key in (c["kind"], f"{c['kind']}, {c['devices']} dev"):
      groups.setdefault(key, []).append(abs(c["rel_error"]))
  return {k: {"median_abs_error": statistics.median(v), "max_abs_error": max(v), "cases": len(v)}
          for k, v in groups.items()}


def validation_cases(quick: bool, devices: int) -> list[dict]:
  """The measured cases: batch sizes and length caps on one device, then 2 and 4 devices."""
  if quick:
    return [dict(rows=16, max_new_tokens=64, devices=1, update=True),
            dict(rows=8, max_new_tokens=32, devices=1)]
  cases = [dict(rows=16, max_new_tokens=128, devices=1, update=True),
           dict(rows=16, max_new_tokens=48, devices=1, update=True),
           dict(rows=8, max_new_tokens=128, devices=1),
           dict(rows=32, max_new_tokens=96, devices=1, update=True)]
  cases += [dict(rows=16, max_new_tokens=128, devices=d, update=True) for d in (2, 4)
            if d <= devices]
  return cases


def print_table(title: str, rows: list[dict]) -> None:
  """A console table of a scale curve."""
  print(title)
  print(f"  {'devices':>7} {'rows/dev':>8} {'vanilla s':>10} {'tlt s':>10} {'rollout%':>8} "
        f"{'speedup':>7}")
  for r in rows:
    print(f"  {r['devices']:>7} {r['rows_per_device']:>8} {r['vanilla_step_s']:>10.4g} "
          f"{r['tlt_step_s']:>10.4g} {100 * r['rollout_share_vanilla']:>7.1f}% "
          f"{r['speedup']:>6.2f}x")


def main():
  import argparse  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="one device, fewer cases and repeats (well under 2 minutes)")
  parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; 3 "
                      "with --quick)")
  parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (1, 2, 4)")
  parser.add_argument("--paper-only", action="store_true",
                      help="only the paper-setting predictions (no JAX, nothing measured)")
  parser.add_argument("--out", default="experiments/out/scale_model.json")
  a = parser.parse_args()
  devices = 1 if a.quick else a.devices
  report = {"command": " ".join(["python", "experiments/system/scale_model.py"] + sys.argv[1:]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": a.quick,
            "paper_table3": PAPER_TABLE3}
  hardware = {"platform": platform.platform(), "cpu_count": os.cpu_count()}
  if not a.paper_only:
    flag = f"--xla_force_host_platform_device_count={devices}"
    if "jax" not in sys.modules:  # XLA reads its flags when JAX is first imported
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # pylint: disable=import-outside-toplevel
    devices = min(devices, len(jax.devices()))
    hardware.update(jax_version=jax.__version__, devices=devices,
                    backend=jax.default_backend())
    repeats = a.repeats or (3 if a.quick else 5)
    bench = Bench(devices, 64 if a.quick else 128, repeats)
    print(f"measuring costs ({devices} simulated devices, {repeats} repeats)", flush=True)
    costs = measure_costs(bench)
    print("validation", flush=True)
    cases = validate(bench, costs, validation_cases(a.quick, devices))
    rng = np.random.default_rng(0)
    tiny_rows = 512
    draws = [np.minimum(rng.geometric(1 / 32, tiny_rows), bench.cap) for _ in range(8)]
    tiny = scale_curve(draws, costs)
    report.update(
        measured_costs=dataclasses.asdict(costs),
        measured_setup={"model": "random Qwen2-style, 1 layer, hidden 128, vocab 256",
                        "drafter": "mirrors the target's layer (fc passes the embedding)",
                        "strategy": str(bench.spec), "sd_max_batch": SD_MAX,
                        "buckets": list(BUCKETS), "prompt_len": PROMPT_LEN,
                        "sampling": f"temperature 1, {STOP_IDS} stop ids of 256, rejection SD",
                        "kv_buckets": "one cache of the full capacity",
                        "drafter_cost": "not measured here (drafter_step_s = 0)"},
        validation=cases, validation_summary=summary(cases),
        predictions_tiny={"global_rows": tiny_rows,
                          "lengths": f"geometric, mean 32, capped at {bench.cap}, 8 draws",
                          "rows": tiny})
    print_table("predicted, tiny setting (measured costs)", tiny)
  paper = paper_setting()
  # how much the prediction leans on our assumptions: other global batches, a flatter decode cost
  paper["sensitivity"] = [
      {"change": change, "table3": paper_setting((8,), **change)["table3"]}
      for change in ({"global_rows": 2048}, {"global_rows": 8192}, {"decode_batch_double": 256},
                     {"length_median": 6000})]
  report.update(hardware=hardware, predictions_paper=paper)
  print_table("predicted, paper setting (costs derived from the paper's figures: assumptions)",
              paper["rows"])
  for r in paper["table3"]:
    known = "" if r["paper_speedup"] is None else f"  (paper: {r['paper_speedup']:.2f}x)"
    print(f"  {r['nodes']} node(s), {r['gpus']} GPUs: predicted {r['predicted_speedup']:.2f}x"
          + known)
  for item in paper["sensitivity"]:
    print(f"  with {item['change']}: " + ", ".join(
        f"{r['nodes']} node(s) {r['predicted_speedup']:.2f}x" for r in item["table3"]))
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(a.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2, default=str) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
