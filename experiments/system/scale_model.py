"""A step-time model of TLT's end-to-end speedup against the number of devices (Table 3's shape).

  python -m experiments.system.scale_model [--quick] [--out experiments/out/scale_model.json]

The paper's Table 3 reports TLT's speedup over verl growing with scale (1.21x at 1 node to 1.76x
at 8 nodes of 8 GPUs, Qwen-7B). The reason: with the global batch fixed, each device holds fewer
rows, so its running batch is small (where speculative decoding pays) for more of the rollout,
and the update, which shrinks with the devices, is a smaller share of the step. This script turns
that argument into numbers in three parts:

1. **The model** (Python/numpy, no JAX computation: ``predict_step`` and the functions under it;
   it rounds and shards rows with the rollout's own ``bucket_for`` and ``shard_ranges``). Given
   per-device costs (``Costs``) and the completion lengths of one RL step's rows it predicts the
   rollout, update, drafter and step times and the speedup of TLT over vanilla decoding.
   * Rows to devices: the rows, in the order given, are cut into ``devices`` contiguous shards
     whose sizes differ by at most one (the first ones bigger), by ``rollout/parallel.py``'s
     ``shard_ranges``; a device holds ``ceil(rows / devices)`` or ``floor(rows / devices)`` rows.
     A device with more rows than its largest bucket decodes them in chunks of that many, one
     after another.
   * Decoding a chunk: the first token of every row comes with the prefill (``prefill_tokens``);
     after that all live rows advance together. While ``n`` rows are live the step runs at the
     bucket ``bucket_for(n)`` (the smallest batch bucket >= n: a bucket of 16 costs the same for
     9 live rows as for 16). Vanilla advances every live row one token per step at
     ``decode_s[bucket]``; SD (``policy="tlt"``: where it is cheaper per token than vanilla,
     ``"sd"``: wherever it was measured) runs only at buckets <= ``sd_max_batch`` and advances
     every live row ``accept_len[bucket]`` tokens per step at ``sd_step_s[bucket]`` (the mean
     accepted length, so steps are fractional). Each change from vanilla to SD costs
     ``switch_s``; each bucket change (a compaction) ``compact_s``; each chunk ``prefill_s`` at its
     first bucket plus ``rollout_fixed_s``.
   * Rollout time = the slowest device's (the step waits for it).
   * Update time = ``update_fixed_s + update_s_per_token * tokens / devices``, tokens = prompt +
     completion tokens of all rows (data-parallel over the devices, global batch fixed).
   * Drafter (TLT only): with one device nothing is idle, so ``drafter_serial_steps`` drafter
     steps run between rollout and update (``drafter_step_s`` each); with several devices the
     drafter trains on devices whose shard is done (spot training), free except the step in
     flight when the rollout ends, counted as half a step on average. The model does not check
     that the idle time suffices for any number of drafter steps: it holds the rollout's cost.
   * Step time = rollout + update + drafter. Speedup = vanilla step / TLT step.
   Left out: prefill and decode cost growing with the KV length (the measured engine uses one
   cache size), stragglers in accept length (every live row accepts the mean), rewards, weight
   broadcast and the host's own work between rollout and update, and contention between devices.

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
import math
import os
import platform
import statistics
import sys
from typing import Sequence

import numpy as np

from tlt_jax.rollout.buckets import bucket_for
from tlt_jax.rollout.parallel import shard_ranges

DEVICES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
POLICIES = ("vanilla", "tlt", "sd")
PAPER_TABLE3 = {"1": 1.21, "8": 1.76}  # nodes (8 GPUs each) -> TLT speedup over verl, Qwen-7B
# What the paper states that the paper-setting costs are derived from (assumptions, not ours).
PAPER_FIGURES = {
    "sd_speedup_batch1_verify64": 3.62,  # Table 4
    "sd_speedup_batch32_verify16": 2.48,  # Table 4
    "accept_len_adapted": 6.53,  # Table 6
    "rollout_share_vanilla": 0.85,  # "rollout is ~85% of a step"
    "sd_max_batch": 32,  # SD only while the running batch is at most 32
    "headline_end_to_end": "1.7-2.1x",
}
# Our own choices for the paper's setting, none of them from the paper's text.
PAPER_ASSUMPTIONS = {
    "global_rows": 512,  # responses per RL step, the same at every scale
    "gpus_per_node": 8,
    "length_median": 3000,  # lognormal completion lengths, capped
    "length_sigma": 0.8,
    "length_cap": 16384,
    "length_draws": 8,  # independent draws of the step's lengths; the speedup is their median
    "decode_batch_double": 64,  # a vanilla step at batch b costs (1 + b / 64) x the batch-1 step
    "decode_s_batch1": 0.02,  # seconds per vanilla step at batch 1 (only ratios matter)
    "buckets": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
    "sd_speedup_between": "log-linear in log2(batch) from 3.62x at 1 to 2.48x at 32",
    "update_calibrated_at_gpus": 8,  # the update cost makes rollout 85% of vanilla's step here
    "drafter": "trained on idle GPUs (spot): free, no overrun (drafter_step_s = 0)",
    "prefill": "free (prefill_s = 0): small next to decoding thousands of tokens",
}


# ----------------------------------------------------------------------------------- the model


@dataclasses.dataclass
class Costs:
  """One device's measured or assumed costs in seconds; lists run along ``buckets``."""

  buckets: list[int]  # batch buckets, ascending; the last is the most rows decoded at once
  decode_s: list[float]  # one vanilla decode step at each bucket
  sd_step_s: list[float | None]  # one SD step at each bucket (None: no SD there)
  accept_len: list[float | None]  # tokens per live row per SD step at each bucket
  sd_max_batch: int = 0  # SD only at buckets <= this
  prefill_s: list[float] | None = None  # one prefill at each bucket (None: free)
  rollout_fixed_s: float = 0.0  # per chunk: host work outside prefill and steps
  compact_s: float = 0.0  # per bucket change (compaction and the host round trip)
  switch_s: float = 0.0  # per change from vanilla to SD (the drafter's catch-up)
  update_fixed_s: float = 0.0  # per RL step, whatever the tokens
  update_s_per_token: float = 0.0  # device-seconds per update token (prompt + completion)
  drafter_step_s: float = 0.0  # one drafter training step
  drafter_serial_steps: int = 0  # drafter steps run serially when one device leaves none idle
  prompt_len: int = 0  # prompt tokens per row, counted by the update
  prefill_tokens: int = 1  # completion tokens per row that the prefill emits

  def __post_init__(self):
    n = len(self.buckets)
    if list(self.buckets) != sorted(set(self.buckets)) or not n or self.buckets[0] < 1:
      raise ValueError(f"buckets must be strictly increasing positive ints, got {self.buckets}")
    for name in ("decode_s", "sd_step_s", "accept_len") + (
        ("prefill_s",) if self.prefill_s is not None else ()):
      if len(getattr(self, name)) != n:
        raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} buckets")

  def index(self, bucket: int) -> int:
    """The position of ``bucket`` in ``buckets``."""
    return self.buckets.index(bucket)

  def sd_at(self, bucket: int, policy: str) -> bool:
    """Whether a step at ``bucket`` decodes with SD under ``policy`` (see ``POLICIES``)."""
    if policy == "vanilla" or bucket > self.sd_max_batch:
      return False
    i = self.index(bucket)
    if self.sd_step_s[i] is None or self.accept_len[i] is None:
      return False
    if policy == "sd":
      return True
    return self.sd_step_s[i] / self.accept_len[i] < self.decode_s[i]  # "tlt": the cheaper


def shard_sizes(rows: int, devices: int) -> list[int]:
  """Rows per device, as ``DataParallelRollout`` shards them (``shard_ranges``)."""
  return [len(r) for r in shard_ranges(rows, devices)]


def chunk_time(lengths: Sequence[int], costs: Costs, policy: str = "vanilla") -> dict:
  """Seconds to decode one chunk (at most the largest bucket of rows) on one device, with the
  decode steps per bucket and the seconds spent in SD."""
  if policy not in POLICIES:
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
  if not len(lengths):
    return {"seconds": 0.0, "steps": {}, "sd_s": 0.0}
  left = np.sort(np.maximum(np.asarray(lengths, float) - costs.prefill_tokens, 0.0))
  first = bucket_for(len(left), costs.buckets)
  seconds = costs.rollout_fixed_s + (
      costs.prefill_s[costs.index(first)] if costs.prefill_s is not None else 0.0)
  steps: dict[int, float] = {}
  sd_s, done, at, bucket, in_sd = 0.0, 0.0, 0, first, False  # done: tokens every live row has
  while True:
    at = int(np.searchsorted(left, done, side="right"))  # rows finished so far
    live = len(left) - at
    if live == 0:
      break
    b = bucket_for(live, costs.buckets)
    if b != bucket:
      seconds += costs.compact_s
      bucket = b
    i = costs.index(b)
    sd = costs.sd_at(b, policy)
    if sd and not in_sd:
      seconds += costs.switch_s
    in_sd = sd
    rate, step = (costs.accept_len[i], costs.sd_step_s[i]) if sd else (1.0, costs.decode_s[i])
    # run until the next row finishes or the live rows fit a smaller bucket
    smaller = costs.buckets[i - 1] if i > 0 else 0
    target = left[len(left) - smaller - 1] if smaller else left[-1]
    n = (target - done) / rate
    seconds += n * step
    sd_s += n * step if sd else 0.0
    steps[b] = steps.get(b, 0.0) + n
    done = target
  return {"seconds": seconds, "steps": steps, "sd_s": sd_s}


def device_time(lengths: Sequence[int], costs: Costs, policy: str = "vanilla") -> float:
  """Seconds one device takes for its shard: chunks of at most the largest bucket, in turn."""
  size = costs.buckets[-1]
  return sum(chunk_time(lengths[k:k + size], costs, policy)["seconds"]
             for k in range(0, len(lengths), size))


def rollout_time(lengths: Sequence[int], costs: Costs, devices: int = 1,
                 policy: str = "vanilla") -> dict:
  """The rollout's seconds (its slowest device's), each device's, and the idle device-seconds
  that devices done early leave in the tail."""
  lengths = list(lengths)
  per_device = [device_time(lengths[r.start:r.stop], costs, policy)
                for r in shard_ranges(len(lengths), devices)]
  slowest = max(per_device)
  return {"seconds": slowest, "device_s": per_device,
          "idle_device_s": sum(slowest - s for s in per_device)}


def update_time(lengths: Sequence[int], costs: Costs, devices: int = 1) -> float:
  """The update's seconds: a fixed part plus the step's tokens (prompt + completion) at the
  per-token cost, shared by the devices."""
  tokens = float(np.sum(lengths)) + costs.prompt_len * len(lengths)
  return costs.update_fixed_s + costs.update_s_per_token * tokens / devices


def drafter_time(costs: Costs, devices: int = 1) -> float:
  """Drafter training on the critical path: serial steps on one device; with several, half a
  step in flight when the rollout ends (the rest runs on idle devices)."""
  if devices == 1:
    return costs.drafter_serial_steps * costs.drafter_step_s
  return 0.5 * costs.drafter_step_s


def predict_step(lengths: Sequence[int], costs: Costs, devices: int = 1) -> dict:
  """Vanilla and TLT step times (rollout + update [+ drafter]) for one RL step's ``lengths`` on
  ``devices`` devices, and TLT's speedup."""
  vanilla = rollout_time(lengths, costs, devices, "vanilla")
  tlt = rollout_time(lengths, costs, devices, "tlt")
  update = update_time(lengths, costs, devices)
  drafter = drafter_time(costs, devices)
  v_step, t_step = vanilla["seconds"] + update, tlt["seconds"] + update + drafter
  rows = len(lengths)
  return {"devices": devices, "rows_per_device": math.ceil(rows / devices),
          "vanilla_step_s": v_step, "tlt_step_s": t_step, "vanilla_rollout_s": vanilla["seconds"],
          "tlt_rollout_s": tlt["seconds"], "update_s": update, "tlt_drafter_s": drafter,
          "rollout_share_vanilla": vanilla["seconds"] / v_step, "speedup": v_step / t_step}


def scale_curve(draws: Sequence[Sequence[int]], costs: Costs,
                devices: Sequence[int] = DEVICES) -> list[dict]:
  """``predict_step`` at each device count; with several draws of the lengths, each field is
  the median over the draws."""
  out = []
  for d in devices:
    runs = [predict_step(lengths, costs, d) for lengths in draws]
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    row.update(devices=d, rows_per_device=runs[0]["rows_per_device"])
    out.append(row)
  return out


def long_tail_lengths(rng: np.random.Generator, rows: int, median: float, sigma: float,
                      cap: int) -> np.ndarray:
  """``rows`` lognormal completion lengths (``median``, log-std ``sigma``), at least 1, capped."""
  return np.clip(np.round(rng.lognormal(math.log(median), sigma, rows)), 1, cap).astype(int)


def paper_costs(figures: dict = PAPER_FIGURES, assumptions: dict = PAPER_ASSUMPTIONS) -> Costs:
  """Per-GPU costs derived from the paper's figures and our stated assumptions; the update cost
  is left at 0 (``calibrate_update`` sets it)."""
  buckets = list(assumptions["buckets"])
  c1, double = assumptions["decode_s_batch1"], assumptions["decode_batch_double"]
  decode = [c1 * (1 + b / double) for b in buckets]
  s1, s32 = figures["sd_speedup_batch1_verify64"], figures["sd_speedup_batch32_verify16"]
  accept = figures["accept_len_adapted"]
  sd_max = figures["sd_max_batch"]
  sd_step, acc = [], []
  for b, c in zip(buckets, decode):
    if b > sd_max:
      sd_step.append(None)
      acc.append(None)
      continue
    speedup = s1 + (s32 - s1) * math.log2(b) / math.log2(32)  # per-token, vs vanilla at b
    sd_step.append(accept * c / speedup)
    acc.append(accept)
  return Costs(buckets=buckets, decode_s=decode, sd_step_s=sd_step, accept_len=acc,
               sd_max_batch=sd_max, prefill_tokens=0)


def calibrate_update(costs: Costs, draws: Sequence[Sequence[int]], devices: int,
                     rollout_share: float) -> Costs:
  """``costs`` with the update's per-token cost set so that the vanilla rollout is
  ``rollout_share`` of the vanilla step at ``devices`` (median over the draws)."""
  rollout = statistics.median(rollout_time(d, costs, devices)["seconds"] for d in draws)
  tokens = statistics.median(float(np.sum(d)) + costs.prompt_len * len(d) for d in draws)
  update = rollout * (1 - rollout_share) / rollout_share
  return dataclasses.replace(costs, update_fixed_s=0.0,
                             update_s_per_token=update * devices / tokens)


def paper_setting(devices: Sequence[int] = DEVICES, **changes) -> dict:
  """The model in the paper's setting: costs from ``paper_costs``, lengths from
  ``PAPER_ASSUMPTIONS`` (``changes`` replace some); the predicted speedup at every device count
  and at Table 3's nodes."""
  a = dict(PAPER_ASSUMPTIONS, **changes)
  rng = np.random.default_rng(0)
  draws = [long_tail_lengths(rng, a["global_rows"], a["length_median"], a["length_sigma"],
                             a["length_cap"]) for _ in range(a["length_draws"])]
  costs = calibrate_update(paper_costs(PAPER_FIGURES, a), draws, a["update_calibrated_at_gpus"],
                           PAPER_FIGURES["rollout_share_vanilla"])
  gpus = a["gpus_per_node"]
  curve = scale_curve(draws, costs, sorted(set(devices) | {gpus * n for n in (1, 2, 4, 8)}))
  by_devices = {r["devices"]: r for r in curve}
  table = [{"nodes": n, "gpus": gpus * n, "predicted_speedup": by_devices[gpus * n]["speedup"],
            "paper_speedup": PAPER_TABLE3.get(str(n))} for n in (1, 2, 4, 8)]
  lengths = np.concatenate(draws)
  return {"assumptions": a, "paper_figures": PAPER_FIGURES, "costs": dataclasses.asdict(costs),
          "gpus_per_node": gpus, "global_rows": a["global_rows"],
          "lengths": {"p50": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
                      "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max()),
                      "share_at_cap": float(np.mean(lengths == a["length_cap"]))},
          "rows": [r for r in curve if r["devices"] in devices], "table3": table}


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
    from tlt_jax.rollout import parallel  # pylint: disable=import-outside-toplevel
    from tlt_jax.rollout.tuner import make_tuner  # pylint: disable=import-outside-toplevel
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
    self.rollout = parallel.DataParallelRollout(self.target, drafter, config, devices=self.devices)
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
    self.rollout.shared_tuner.tuner = self.tuners[policy]
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
