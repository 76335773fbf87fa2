"""Spot drafter training in the rollout tail: idle device-seconds per RL step, how many idle
devices took part in the drafter's rounds and the device-seconds of drafter work they did, and
the rollout's wall time, every idle device vs one at a time (vs no spot training), on N
simulated devices.

  python -m experiments.drafter.spot_utilization [--devices 4] [--steps 16] [--depth 3]
      [--arms spot_all,spot_one] [--compile-cache experiments/out/xla_cache]
      [--out experiments/out/spot_utilization.json]

XLA_FLAGS=--xla_force_host_platform_device_count=N is set before JAX is imported. The policy
update runs data-parallel over a mesh of the N devices and the rollout too (rollout_devices=N:
one engine and host thread per device, each decoding a contiguous shard of the rows; with
``prompts`` = N the shards are whole GRPO groups, so they finish at different times). The arms
run the same steps, interleaved in alternating order, from the same warm policy and the same
offline-trained initial drafter, rolling out with one fixed speculative chain and coupled
verification (identical tokens, rewards and updates in every arm, checked):

* ``spot_all``: spot training with rounds over every idle device (``spot_devices`` =
  0, the default): each round, every device idle at its start computes a gradient on a batch
  of its own; the mean is applied on the first idle device; a device that goes idle joins the
  next round;
* ``spot_one``: the same with ``spot_devices=1``: only the first idle device trains (a round of
  one device is the fused train step), the others wait: the behaviour before rounds;
* ``spot_off`` (not by default): DrafterTrainingConfig(spot=False): the drafter's serial steps
  (``serial_steps``, on the first rollout device) between rollout and policy update instead.

Every arm precompiles the drafter's executables for every rollout device before the timed steps
(``GRPOTrainer.precompile_drafter``), so no drafter step compiles inside a rollout's tail.

Per step: ``tail_idle_device_s`` (device-seconds between each device's shard finishing and the last
one finishing), ``tail_idle_used_device_s`` (the part of that window the idle hooks ran in: with
rounds, a device waiting for the next round counts), ``drafter_spot_device_s`` (the device-seconds
of drafter work: each round's wall time times its members) and per device
``drafter_spot_device_s_<k>``, ``drafter_spot_tail_device_s`` (an estimate of its part inside the
tail: the last round's members times the overrun taken off), ``drafter_spot_devices`` (devices that
contributed), ``drafter_spot_participants_max``/``_mean`` (members per round),
``drafter_spot_steps`` (rounds: optimizer updates) and ``drafter_spot_contributions`` (gradients),
``spot_overrun_s`` (how long the rollout waited past its last shard for a round in flight: drafter
time on the critical path), the rollout's wall time (``rollout_s``), its decode wall time (the last
shard's finish), the whole RL step's time and per-device busy/idle seconds. ``drafter_top1`` is held
out (the weights that drafted the rollout, on its freshest data), ``drafter_train_top1`` in-sample.
Ratios against ``spot_one`` are per step (same tokens), then the median.

The simulated devices share this machine's CPU cores, so drafter work competes with the devices
still decoding for the same cores, and more devices in a round means more of it: the change in
decode wall time measures that contention (and the wait for the round in flight when the last
shard finishes), not what separate accelerators would see, and the gradients a round gets
through per second are bounded by the cores, not the devices.
"""

from __future__ import annotations

import math
import os
import sys
import time

from experiments import device_flags

ARMS = ("spot_all", "spot_one", "spot_off")
PER_DEVICE = "drafter_spot_device_s_"


def main():
  # the device count first: JAX must see XLA_FLAGS before it is imported (rl_bench imports it)
  devices_arg, devices = device_flags.simulated_devices(4)
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from experiments import harness
  from experiments.rl import rl_bench as rb
  from experiments.harness import DrafterTrainingConfig, SpecConfig

  parser = harness.parser(__doc__, parents=[devices_arg])
  rb.add_job_args(parser, steps=16, out="experiments/out/spot_utilization.json")
  parser.add_argument("--depth", type=int, default=3, help="draft depth of the fixed chain")
  parser.add_argument("--arms", default="spot_all,spot_one",
                      help=f"comma-separated, from {','.join(ARMS)}")
  parser.add_argument("--compile-cache", default="experiments/out/xla_cache",
                      help="JAX's persistent compilation cache (a directory, or off): the arms "
                      "compile the same programs, so the second loads the first's")
  a = parser.parse_args()
  from tlt_jax import compile_cache  # pylint: disable=import-outside-toplevel
  compile_cache.enable(None if a.compile_cache.lower() in ("off", "0", "none") else
                       a.compile_cache)
  names = [n for n in a.arms.split(",") if n]
  if not names or any(n not in ARMS for n in names) or len(set(names)) != len(names):
    raise SystemExit(f"--arms takes distinct names from {ARMS}, got {a.arms!r}")
  if jax.device_count() < a.devices:
    raise SystemExit(f"asked for {a.devices} devices, JAX sees {jax.devices()} (was JAX "
                     "imported before XLA_FLAGS was set?)")
  t_start = time.perf_counter()
  rows_per_device = math.ceil(a.prompts * a.group / a.devices)
  job, policy_dir, drafter_dir = rb.prepare(a, **{"rollout.max_batch": rows_per_device})
  mesh = Mesh(np.array(jax.devices()[:a.devices]), ("data",))
  spec = SpecConfig(a.depth, 1, a.depth + 1)
  t0 = time.perf_counter()
  arms = {}
  for name in names:
    arms[name] = rb.make_arm(job, policy_dir, drafter=drafter_dir, spec=spec, mesh=mesh,
                             rollout_devices=a.devices,
                             training=DrafterTrainingConfig(
                                 spot=name != "spot_off", spot_devices=int(name == "spot_one"),
                                 serial_budget="fixed", seed=a.seed))
  build_s = time.perf_counter() - t0
  print(f"built and compiled {len(arms)} arms ({a.devices} rollout engines each) in "
        f"{build_s:.0f}s", flush=True)
  rows = {name: [] for name in names}
  for step in range(a.steps):
    for name in harness.repeat_order(names, step, "alternate"):
      trainer = arms[name]
      metrics = trainer.step()
      row = rb.step_row(metrics)
      row.update({k: (round(v, 5) if isinstance(v, float) else v) for k, v in metrics.items()
                  if k.startswith("drafter_spot_")})
      seen = trainer.rollout_devices_stats[-1]
      row.update(decode_wall_s=round(seen["rollout_wall_s"], 5),
                 preemption_wait_s=round(row["rollout_s"] - seen["rollout_wall_s"], 5),
                 devices=[{k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}
                          for d in seen["devices"]])
      rows[name].append(row)
    line = [f"step {step + 1:3d}"]
    for name in names:
      r = rows[name][-1]
      line.append(f"{name}: idle {r['tail_idle_device_s']:.3f} dev-s, drafter "
                  f"{r.get('drafter_spot_device_s', 0.0):.3f} dev-s on "
                  f"{r.get('drafter_spot_devices', 0)} dev (max "
                  f"{r.get('drafter_spot_participants_max', 0)}/round), "
                  f"{r['drafter_spot_steps']} upd {r.get('drafter_spot_contributions', 0)} "
                  f"grads, serial {r['drafter_serial_steps']}, overrun {r['spot_overrun_s']:.3f}s, "
                  f"decode {r['decode_wall_s']:.3f}s step {r['step_s']:.3f}s top-1 "
                  f"{rb.fmt(r.get('drafter_top1'))}, compiles {r['compiles']}")
    print("  |  ".join(line), flush=True)
  check = rb.same_trajectory(arms, rows)
  summary = {name: arm_summary(rows[name], a.devices, harness) for name in names}
  reference = "spot_one" if "spot_one" in names else names[-1]
  for name in names:
    if name != reference:
      summary[name]["vs_" + reference] = ratios(rows[name], rows[reference], harness)
  for name in names:
    summary[name]["precompile_s"] = arms[name].precompile_s
  report = dict(
      command=" ".join(sys.argv), args=vars(a), devices=a.devices, cpu_cores=os.cpu_count(),
      rows_per_device=rows_per_device, spec=dict(depth=a.depth, topk=1,
                                                 verify_tokens=a.depth + 1),
      verify="coupled", initial_drafter=rb.drafter_report(drafter_dir), build_s=round(build_s, 1),
      trajectory=check, summary=summary,
      note=(f"{a.devices} simulated devices share the machine's {os.cpu_count()} CPU cores: "
            "drafter rounds compete with the devices still decoding, and more devices in a "
            "round means more of that, so decode wall-time changes measure the contention, not "
            "what separate accelerators would see"),
      steps=rows, wall_s=round(time.perf_counter() - t_start, 1))
  lines = []
  for name in names:
    m = summary[name]
    lines.append(
        f"{name}: {m['updates_total']} updates from {m['contributions_total']} gradients; "
        f"idle {m['tail_idle_device_s_total']:.2f} dev-s, drafter work "
        f"{m['drafter_device_s_total']:.2f} dev-s ({rb.fmt(m['drafter_work_fraction_of_idle'])} "
        f"of idle, {m['drafter_tail_device_s_total']:.2f} inside the tail; per device "
        f"{m['drafter_device_s_by_device']}), devices per step median "
        f"{m['devices_participating_median']}, members per round mean "
        f"{rb.fmt(m['participants_mean'], '.2f')} max {m['participants_max']}; overrun median "
        f"{m['spot_overrun_s_median']:.3f}s max {m['spot_overrun_s_max']:.3f}s; decode median "
        f"{m['decode_wall_s_median']:.3f}s, step median {m['step_s_median']:.3f}s; held-out "
        f"top-1 last quarter {rb.fmt(m['drafter_heldout_top1_mean_last_quarter'])}; compiles "
        f"{m['compiles_during_steps']}")
    if "vs_" + reference in m:
      lines.append(f"  {name} / {reference} per-step medians: {m['vs_' + reference]}")
  rb.finish(a.out, report, lines)


def arm_summary(rows: list[dict], devices: int, harness) -> dict:
  """One arm's totals and medians over its steps (``harness``: experiments.harness, imported by
  ``main`` once the device count is set)."""
  idle = sum(r["tail_idle_device_s"] for r in rows)
  work = sum(r.get("drafter_spot_device_s", 0.0) for r in rows)
  by_device = {k: round(sum(r.get(PER_DEVICE + str(k), 0.0) for r in rows), 4)
               for k in range(devices)}
  sizes = [(r["drafter_spot_participants_mean"], r["drafter_spot_steps"]) for r in rows
           if r.get("drafter_spot_steps")]
  last = rows[-max(1, len(rows) // 4):]
  return dict(
      updates_total=sum(r["drafter_spot_steps"] + r["drafter_serial_steps"] for r in rows),
      spot_updates_total=sum(r["drafter_spot_steps"] for r in rows),
      contributions_total=sum(r.get("drafter_spot_contributions", 0) for r in rows),
      serial_steps_total=sum(r["drafter_serial_steps"] for r in rows),
      tail_idle_device_s_total=idle, tail_idle_used_device_s_total=sum(
          r["tail_idle_used_device_s"] for r in rows),
      drafter_device_s_total=work, drafter_work_fraction_of_idle=work / idle if idle else None,
      drafter_tail_device_s_total=sum(r.get("drafter_spot_tail_device_s", 0.0) for r in rows),
      drafter_device_s_by_device=by_device,
      devices_participating_median=harness.median(r.get("drafter_spot_devices", 0) for r in rows),
      devices_participating_max=max(r.get("drafter_spot_devices", 0) for r in rows),
      participants_mean=(sum(m * n for m, n in sizes) / sum(n for _, n in sizes)
                         if sizes else None),
      participants_max=max(r.get("drafter_spot_participants_max", 0) for r in rows),
      idle_share_of_device_time=harness.median(
          r["tail_idle_device_s"] / (devices * r["decode_wall_s"]) for r in rows),
      spot_overrun_s_median=harness.median(r["spot_overrun_s"] for r in rows),
      spot_overrun_s_max=max(r["spot_overrun_s"] for r in rows),
      preemption_wait_s_median=harness.median(r["preemption_wait_s"] for r in rows),
      decode_wall_s_median=harness.median(r["decode_wall_s"] for r in rows),
      rollout_s_median=harness.median(r["rollout_s"] for r in rows),
      step_s_median=harness.median(r["step_s"] for r in rows),
      drafter_serial_s_median=harness.median(r["drafter_serial_s"] for r in rows),
      compiles_during_steps=sum(r["compiles"] for r in rows),
      accept_len_mean=harness.mean(r.get("mean_accept_len") for r in rows),
      # held out: the weights that drafted each rollout, on its freshest data
      drafter_heldout_top1_last=rows[-1].get("drafter_top1"),
      drafter_heldout_top1_mean_last_quarter=harness.mean(r.get("drafter_top1") for r in last),
      drafter_train_top1_mean=harness.mean(r.get("drafter_train_top1") for r in rows))


def ratios(rows: list[dict], reference: list[dict], harness) -> dict:
  """Per-step ratios of an arm to the reference arm (the same tokens at every step), medians."""
  out = {}
  for key in ("decode_wall_s", "rollout_s", "step_s"):
    out[key] = round(harness.median(x[key] / y[key] for x, y in zip(rows, reference)), 4)
  return out


if __name__ == "__main__":
  main()
