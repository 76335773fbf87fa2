"""FSDP policy updates vs data-parallel ones: per-device bytes of params + optimizer state, XLA's
per-device memory of the update executable, and update step time, on N simulated CPU devices.

  python -m experiments.system.fsdp_memory [--devices 4] [--fsdp 1,2,4] [--models tiny,bench]
      [--steps 5] [--kl-coef 0.04] [--update-tokens 0] [--out docs/results/fsdp_memory.json]

XLA_FLAGS=--xla_force_host_platform_device_count=N is set before JAX is imported. For each model
(``tiny``: ``ModelConfig.tiny`` with a 512-token vocabulary; ``bench``: the synthetic
benchmarks' random 4-layer, hidden-256 Qwen2-style policy, ``harness.bench_config``) and each
``--fsdp`` size, a
``PolicyUpdate`` is built from the same params on the update mesh: fsdp=1 is today's 1-D
``("data",)`` mesh (params and optimizer state replicated), fsdp=k is ``make_mesh(devices, k)``
(rows over all N devices, params, KL reference and AdamW state sharded over k). Each arm runs
``--steps`` RL steps' updates (2 minibatches of 32 rows, 8 prompts x 4 samples, prompt 32 +
completion 96 tokens, full-length rows unless ``--update-tokens``) on the same batch after
``precompile`` and one untimed step, checking that nothing compiles, and reports:

* ``bytes_per_device``: params, KL reference and optimizer state held on each device (their
  addressable shards there; the max over devices), and their ratio to the data-parallel arm's;
* ``executable``: XLA's memory analysis of the update executable (per device: arguments,
  outputs, temporaries, and ``live_bytes``, all of them less the donated outputs: what one
  update holds at once) and its collectives (all-gather / all-reduce / reduce-scatter ops in the
  compiled HLO). Under FSDP the temporaries grow by the gathered params and reference (each
  update all-gathers them), while the state held between updates shrinks by 1/fsdp;
* ``step_s``: the median seconds of one RL step's updates, and the losses (equal across arms up
  to float rounding: checked against the data-parallel arm's).

The simulated devices are threads of one CPU process sharing this machine's cores, so the step
times say nothing about speed on real accelerators (collectives are memory copies here); the
byte counts are what FSDP saves on any backend. XLA:CPU reduces gradients with an all-reduce and
keeps the shard of it each device owns (hence no reduce-scatter in the counts); XLA:GPU's
ReduceScatterCreator pass fuses that pair into a reduce-scatter (not measured here).
"""

from __future__ import annotations

import re
import statistics
import time

from experiments import device_flags

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str) -> dict[str, int]:
  """How many of each collective op the compiled HLO text holds (async ones counted once)."""
  counts = dict.fromkeys(COLLECTIVES, 0)
  for m in re.finditer(r"= (?:\([^)]*\)|\S+) ([a-z-]+?)(?:-start)?\(", hlo):
    if m.group(1) in counts:
      counts[m.group(1)] += 1
  return counts


def main():
  # the device count first: JAX must see XLA_FLAGS before it is imported (harness imports it)
  devices_arg, n_devices = device_flags.simulated_devices(4)
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh
  from experiments import harness
  from experiments.harness import ModelConfig, TrainerConfig, compile_count, grpo, init_model
  from tlt_jax.rl.packing import padded_batch
  from tlt_jax.rl.mesh import make_mesh
  from tlt_jax.rl.update import PolicyUpdate

  parser = harness.parser(__doc__, parents=[devices_arg])
  parser.add_argument("--fsdp", default="1,2,4", help="comma-separated fsdp sizes (1: the "
                      "data-parallel update, replicated params)")
  parser.add_argument("--models", default="tiny,bench", help="comma-separated, from tiny,bench")
  parser.add_argument("--steps", type=int, default=5, help="timed RL steps per arm")
  parser.add_argument("--kl-coef", type=float, default=0.04,
                      help="> 0 keeps a KL reference (sharded like the params)")
  parser.add_argument("--update-tokens", type=int, default=0,
                      help="TrainerConfig.update_tokens (0: full-length rows)")
  parser.add_argument("--out", default="docs/results/fsdp_memory.json")
  a = parser.parse_args()
  if jax.device_count() < a.devices:
    raise SystemExit(f"asked for {a.devices} devices, JAX sees {jax.devices()} (was JAX "
                     "imported before XLA_FLAGS was set?)")
  sizes = harness.ints(a.fsdp)
  models = {"tiny": ModelConfig.tiny(vocab_size=512),
            "bench": harness.bench_config(vocab=512, hidden=256, layers=4)}
  names = [m for m in a.models.split(",") if m]
  if not names or any(m not in models for m in names):
    raise SystemExit(f"--models takes names from {sorted(models)}, got {a.models!r}")
  devices = jax.devices()[:a.devices]
  prompts, group, prompt_len, new_tokens = 8, 4, 32, 96
  seq_len = prompt_len + new_tokens
  rng = np.random.default_rng(0)
  rows = prompts * group
  comps = [rng.integers(3, 500, int(rng.integers(8, new_tokens + 1))).tolist() for _ in range(rows)]
  batch = padded_batch([[1] + rng.integers(3, 500, prompt_len - 1).tolist() for _ in range(rows)],
                       comps, [rng.uniform(-7.0, -5.0, len(c)) for c in comps],
                       rng.normal(0.0, 1.0, rows), seq_len)
  config = TrainerConfig(prompts_per_step=prompts, minibatches=2, max_new_tokens=new_tokens,
                         update_tokens=a.update_tokens, learning_rate=1e-4, warmup_steps=0)
  grpo_config = grpo.GRPOConfig(group_size=group, kl_coef=a.kl_coef)

  def held(tree) -> int:
    """The most any device holds of ``tree``'s arrays."""
    leaves = jax.tree.leaves(tree)
    return max(sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d)
               for d in devices)

  def arm(model_config, fsdp: int) -> dict:
    graphdef, params = nnx.split(init_model(model_config, seed=0))
    params = jax.tree.map(np.asarray, params)  # host copies: the update donates its buffers
    mesh = Mesh(np.array(devices), ("data",)) if fsdp == 1 else make_mesh(devices, fsdp)
    policy = PolicyUpdate(graphdef, params, config, grpo_config, mesh, seq_len)
    t0 = time.perf_counter()
    compiled = policy.precompile()
    compile_s = time.perf_counter() - t0
    parts = {"params": policy.params, "ref_params": policy.ref_params,
             "opt_state": policy.opt_state}
    memory = {k: held(v) for k, v in parts.items()}
    memory["total"] = held(tuple(parts.values()))
    key = ("apply",) if a.update_tokens else ("padded",)
    executable = policy.executables.lookup(key)
    analysis = executable.memory_analysis()
    exe = {f"{k}_bytes": getattr(analysis, f"{k}_size_in_bytes", None)
           for k in ("argument", "output", "temp", "alias")}
    if None not in exe.values():  # what the executable holds at once: in + out + scratch
      exe["live_bytes"] = (exe["argument_bytes"] + exe["output_bytes"] + exe["temp_bytes"]
                           - exe["alias_bytes"])
    exe["name"] = " ".join(map(str, key))
    if a.update_tokens:  # the gradient pass of the longest rows
      grad = policy.executables.lookup(("accumulate", policy.update_buckets[-1]))
      exe["accumulate_temp_bytes"] = grad.memory_analysis().temp_size_in_bytes
      exe["collectives"] = collectives(grad.as_text())
    else:
      exe["collectives"] = collectives(executable.as_text())
    policy.run(batch, 0)  # untimed: first-call costs
    policy.rollout_params()
    compiles, times, losses = compile_count(), [], []
    for step in range(1, a.steps + 1):
      t0 = time.perf_counter()
      metrics = policy.run(batch, step)
      jax.block_until_ready(policy.params)
      times.append(time.perf_counter() - t0)
      losses.append(metrics["loss"])
      policy.rollout_params()  # what the trainer hands the rollout after every step
    assert compile_count() == compiles, f"fsdp={fsdp}: a timed step compiled"
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return dict(fsdp=fsdp, mesh=dict(mesh.shape), params=n_params, executables=compiled,
                compile_s=compile_s, bytes_per_device=memory, executable=exe,
                step_s=statistics.median(times), step_s_all=times, losses=losses)

  t_start = time.perf_counter()
  report = dict(devices=a.devices, platform=devices[0].platform, kl_coef=a.kl_coef,
                update_tokens=a.update_tokens, rows=rows, seq_len=seq_len, minibatches=2,
                steps=a.steps, note="simulated CPU devices share this machine's cores: step "
                "times are not speed numbers; bytes are per device", models={})
  for name in names:
    arms = [arm(models[name], k) for k in sizes]
    base = arms[0]
    for result in arms:
      result["bytes_ratio_to_first"] = (result["bytes_per_device"]["total"]
                                        / base["bytes_per_device"]["total"])
      result["loss_max_abs_diff_to_first"] = max(
          abs(x - y) for x, y in zip(result["losses"], base["losses"]))
      assert result["loss_max_abs_diff_to_first"] < 1e-4, (name, result["fsdp"], result["losses"])
      print(f"{name:6s} fsdp={result['fsdp']}: params+ref+opt "
            f"{result['bytes_per_device']['total'] / 2**20:7.2f} MiB/device "
            f"({result['bytes_ratio_to_first']:.3f} of fsdp={base['fsdp']}), update live "
            f"{(result['executable'].get('live_bytes') or 0) / 2**20:6.2f} MiB, step "
            f"{result['step_s'] * 1e3:7.1f} ms, collectives {result['executable']['collectives']}")
    report["models"][name] = dict(config=dict(hidden=models[name].hidden_size,
                                              layers=models[name].num_layers,
                                              vocab=models[name].vocab_size), arms=arms)
  report["wall_s"] = time.perf_counter() - t_start
  path = harness.write_json(a.out, report)
  print(f"wrote {path} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
  main()
