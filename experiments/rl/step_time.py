"""A step-time model of TLT's end-to-end speedup against the number of devices (the TLT
paper's Table 3 shape), and the costs of the paper's setting.

With the global batch fixed, each device holds fewer rows as devices are added, so its
running batch is small (where speculative decoding pays) for more of the rollout, and the
update, which shrinks with the devices, is a smaller share of the step. This module turns
that argument into numbers, in Python and numpy (no JAX computation: ``predict_step`` and the
functions under it; rows are rounded and sharded with the rollout's own ``bucket_for`` and
``shard_ranges``). Given per-device costs (``Costs``) and the completion lengths of one RL
step's rows it predicts the rollout, update, drafter and step times and the speedup of TLT over
vanilla decoding.

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

``experiments/system/scale_model.py`` measures the costs on this machine, validates the
model against measured rollouts and updates, and predicts the paper's setting with
``paper_setting`` (``PAPER_ASSUMPTIONS``: assumptions, not measurements).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

import numpy as np

from tlt_jax.rollout import bucket_for, shard_ranges

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
