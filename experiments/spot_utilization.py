"""Spot drafter training in the rollout tail: idle device-seconds per RL step, the drafter steps run
in them, and the rollout's wall time with spot training on vs off, on N simulated devices.

  python experiments/spot_utilization.py [--devices 4] [--steps 16] [--depth 3]
      [--out docs/results/spot_utilization.json]

XLA_FLAGS=--xla_force_host_platform_device_count=N is set before JAX is imported. The policy
update runs data-parallel over a mesh of the N devices and the rollout too (rollout_devices=N:
one engine and host thread per device, each decoding a contiguous shard of the rows; with
``prompts`` = N the shards are whole GRPO groups, so they finish at different times). Two
trainers run the same steps, interleaved in alternating order, from the same warm policy and
the same offline-trained initial drafter, rolling out with one fixed speculative chain and
coupled verification (identical tokens, rewards and updates in both, checked):

* ``spot_on``: DrafterTrainingConfig(spot=True): a device whose shard is done trains the drafter
  on the buffer (one device at a time) until the last shard finishes;
* ``spot_off``: DrafterTrainingConfig(spot=False): no spot steps; the trainer then runs the
  drafter's serial steps (``serial_steps`` per RL step, on the first rollout device) between
  rollout and policy update, as it does with one device, and they cost step time.

Both arms precompile the drafter's train/eval steps for every rollout device before the timed
steps (``GRPOTrainer.precompile_drafter``), so no drafter step compiles inside a rollout's tail.

Per step: ``tail_idle_device_s`` (device-seconds between each device's shard finishing and the
last one finishing), ``tail_idle_used_device_s`` (the part of that window the spot hook ran in,
so at most the idle time), ``spot_overrun_s`` (how long the rollout waited past its last shard
for a drafter step in flight), ``drafter_spot_steps``/``drafter_spot_s``,
``drafter_serial_steps``/``drafter_serial_s``, the rollout's wall time (``rollout_s``: until every
thread, spot steps included, has returned), its decode wall time (the last shard's finish), the
wait from there to the trainer's ``rollout_s`` (``preemption_wait_s``: the overrun plus thread
joins and merging), the whole RL step's time and per-device busy/idle seconds. The drafter's
``drafter_top1`` is held out (the weights that drafted the rollout, on its freshest data) and
``drafter_train_top1`` in-sample (the step's drafter steps). Both arms' time ratios are per step
(same tokens), then the median.

The simulated devices share this machine's CPU cores, so spot steps compete with the devices
still decoding for the same cores: the change in rollout wall time measures that contention (and
the wait for the spot step in flight when the last shard finishes), not what separate
accelerators would see. The point here is that the mechanism runs end to end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ARMS = ("spot_on", "spot_off")


def main():
  # the device count first: JAX must see XLA_FLAGS before it is imported (rl_bench imports it)
  devices_arg = argparse.ArgumentParser(add_help=False)
  devices_arg.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
  devices = devices_arg.parse_known_args()[0].devices
  flag = f"--xla_force_host_platform_device_count={devices}"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from jax.sharding import Mesh
  import harness
  import rl_bench as rb
  from harness import DrafterTrainingConfig, SpecConfig

  parser = harness.parser(__doc__, parents=[devices_arg])
  rb.add_job_args(parser, steps=16, out="docs/results/spot_utilization.json")
  parser.add_argument("--depth", type=int, default=3, help="draft depth of the fixed chain")
  a = parser.parse_args()
  if jax.device_count() < a.devices:
    raise SystemExit(f"asked for {a.devices} devices, JAX sees {jax.devices()} (was JAX "
                     "imported before XLA_FLAGS was set?)")
  t_start = time.perf_counter()
  rows_per_device = math.ceil(a.prompts * a.group / a.devices)
  job, policy_dir, drafter_dir = rb.prepare(a, **{"rollout.max_batch": rows_per_device})
  mesh = Mesh(np.array(jax.devices()[:a.devices]), ("data",))
  spec = SpecConfig(a.depth, 1, a.depth + 1)
  t0 = time.perf_counter()
  arms = {name: rb.make_arm(job, policy_dir, drafter=drafter_dir, spec=spec, mesh=mesh,
                            rollout_devices=a.devices,
                            training=DrafterTrainingConfig(spot=name == "spot_on", seed=a.seed))
          for name in ARMS}
  build_s = time.perf_counter() - t0
  print(f"built and compiled {len(arms)} arms ({a.devices} rollout engines each) in "
        f"{build_s:.0f}s", flush=True)
  rows = {name: [] for name in ARMS}
  for step in range(a.steps):
    order = harness.repeat_order(ARMS, step, "alternate")
    for name in order:
      trainer = arms[name]
      row = rb.step_row(trainer.step())
      seen = trainer.rollout_devices_stats[-1]
      row.update(decode_wall_s=round(seen["rollout_wall_s"], 5),
                 preemption_wait_s=round(row["rollout_s"] - seen["rollout_wall_s"], 5),
                 devices=[{k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}
                          for d in seen["devices"]])
      rows[name].append(row)
    on, off = rows["spot_on"][-1], rows["spot_off"][-1]
    print(f"step {step + 1:3d}  idle {on['tail_idle_device_s']:.3f} dev-s, spot steps "
          f"{on['drafter_spot_steps']:3d} ({on['tail_idle_used_device_s']:.3f} dev-s used, "
          f"overrun {on['spot_overrun_s']:.3f}s)  rollout on {on['rollout_s']:.3f}s off "
          f"{off['rollout_s']:.3f}s  accept len on {rb.fmt(on.get('mean_accept_len'), '.2f')} "
          f"off {rb.fmt(off.get('mean_accept_len'), '.2f')}  step on {on['step_s']:.3f}s off "
          f"{off['step_s']:.3f}s (serial {off['drafter_serial_steps']} in "
          f"{off['drafter_serial_s']:.3f}s)  held-out top-1 on "
          f"{rb.fmt(on.get('drafter_top1'))} off {rb.fmt(off.get('drafter_top1'))}  compiles "
          f"{on['compiles']}/{off['compiles']}", flush=True)
  check = rb.same_trajectory(arms, rows)
  on, off = rows["spot_on"], rows["spot_off"]
  ratios = [x["rollout_s"] / y["rollout_s"] for x, y in zip(on, off)]
  step_ratios = [x["step_s"] / y["step_s"] for x, y in zip(on, off)]
  decode_ratios = [x["decode_wall_s"] / y["decode_wall_s"] for x, y in zip(on, off)]
  clean = [i for i, (x, y) in enumerate(zip(on, off)) if x["compiles"] == 0 and y["compiles"] == 0]
  idle = sum(r["tail_idle_device_s"] for r in on)
  used = sum(r["tail_idle_used_device_s"] for r in on)
  summary = dict(
      spot_steps_total=sum(r["drafter_spot_steps"] for r in on),
      spot_steps_median_per_rl_step=rb.median(r["drafter_spot_steps"] for r in on),
      tail_idle_device_s_median=rb.median(r["tail_idle_device_s"] for r in on),
      tail_idle_device_s_total=idle, tail_idle_used_device_s_total=used,
      idle_used_fraction=used / idle if idle else None,
      idle_share_of_device_time=rb.median(
          r["tail_idle_device_s"] / (a.devices * r["decode_wall_s"]) for r in on),
      rollout_s_median=dict(spot_on=rb.median(r["rollout_s"] for r in on),
                            spot_off=rb.median(r["rollout_s"] for r in off)),
      rollout_on_over_off_median=rb.median(ratios),
      rollout_on_over_off_median_no_compile_steps=rb.median(ratios[i] for i in clean),
      decode_wall_on_over_off_median=rb.median(decode_ratios),
      step_s_median=dict(spot_on=rb.median(r["step_s"] for r in on),
                         spot_off=rb.median(r["step_s"] for r in off)),
      step_on_over_off_median=rb.median(step_ratios),
      step_on_over_off_median_no_compile_steps=rb.median(step_ratios[i] for i in clean),
      drafter_steps_total=dict(spot_on=sum(r["drafter_spot_steps"] for r in on),
                               spot_off=sum(r["drafter_serial_steps"] for r in off)),
      drafter_s_median=dict(spot_on_spot=rb.median(r["drafter_spot_s"] for r in on),
                            spot_off_serial=rb.median(r["drafter_serial_s"] for r in off)),
      preemption_wait_s_median=rb.median(r["preemption_wait_s"] for r in on),
      spot_overrun_s_median=rb.median(r["spot_overrun_s"] for r in on),
      spot_overrun_s_max=max(r["spot_overrun_s"] for r in on),
      rollout_s_max=dict(spot_on=max(r["rollout_s"] for r in on),
                         spot_off=max(r["rollout_s"] for r in off)),
      steps_without_compiles=len(clean),
      compiles_during_steps=dict(spot_on=sum(r["compiles"] for r in on),
                                 spot_off=sum(r["compiles"] for r in off)),
      accept_len_mean=dict(spot_on=rb.mean(r.get("mean_accept_len") for r in on),
                           spot_off=rb.mean(r.get("mean_accept_len") for r in off)),
      # held out: the weights that drafted each rollout, on its freshest data
      drafter_heldout_top1_last=dict(spot_on=on[-1].get("drafter_top1"),
                                     spot_off=off[-1].get("drafter_top1")),
      drafter_heldout_top1_mean_last_quarter=dict(
          spot_on=rb.mean(r.get("drafter_top1") for r in on[-max(1, len(on) // 4):]),
          spot_off=rb.mean(r.get("drafter_top1") for r in off[-max(1, len(off) // 4):])),
      # in-sample: the mean over each step's drafter steps
      drafter_train_top1_mean=dict(spot_on=rb.mean(r.get("drafter_train_top1") for r in on),
                                   spot_off=rb.mean(r.get("drafter_train_top1") for r in off)),
      precompile_s={name: arms[name].precompile_s for name in ARMS},
      serial_steps_total=dict(spot_on=sum(r["drafter_serial_steps"] for r in on),
                              spot_off=sum(r["drafter_serial_steps"] for r in off)))
  report = dict(
      command=" ".join(sys.argv), args=vars(a), devices=a.devices, cpu_cores=os.cpu_count(),
      rows_per_device=rows_per_device, spec=dict(depth=a.depth, topk=1,
                                                 verify_tokens=a.depth + 1),
      verify="coupled", initial_drafter=rb.drafter_report(drafter_dir), build_s=round(build_s, 1),
      trajectory=check, summary=summary,
      note=("simulated devices share the machine's CPU cores: spot steps compete with the "
            "devices still decoding, so the rollout wall-time change measures that contention, "
            "not what separate accelerators would see; with spot=False the trainer trains the "
            "drafter with serial steps between rollout and update instead"),
      steps=rows, wall_s=round(time.perf_counter() - t_start, 1))
  rb.finish(a.out, report, [
      f"spot steps {summary['spot_steps_total']} in {idle:.2f} idle device-s ({used:.2f} used, "
      f"overrun median {summary['spot_overrun_s_median']:.3f}s max "
      f"{summary['spot_overrun_s_max']:.3f}s); serial steps (spot off) "
      f"{summary['drafter_steps_total']['spot_off']}; rollout on/off median "
      f"{summary['rollout_on_over_off_median']:.3f} (decode wall "
      f"{summary['decode_wall_on_over_off_median']:.3f}), step on/off "
      f"{summary['step_on_over_off_median']:.3f}; held-out top-1 last on "
      f"{rb.fmt(summary['drafter_heldout_top1_last']['spot_on'])} off "
      f"{rb.fmt(summary['drafter_heldout_top1_last']['spot_off'])}"])


if __name__ == "__main__":
  main()
