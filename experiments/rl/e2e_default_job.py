"""End to end on one device: the default job with ``drafter=eagle`` (or ``--drafter``) against
``drafter=none``.

  python -m experiments.rl.e2e_default_job [--steps 16] [--set trainer.prompts_per_step=8 ...]
      [--config-override drafter_training.serial_steps=8 ...]
  python -m experiments.rl.e2e_default_job --config configs/tiny_longtail.py --drafter suffix \
      --steps 16 --split-step 4 --verify both     # the long-tail job
  python -m experiments.rl.e2e_default_job --drafter suffix --set task.num_prompts=64 \
      --split-step 2 --steps 12      # recurring prompts, drafts from their history

The job's check that TLT is never slower than vanilla (the engine's: sd/never_slower.py). Both arms
are THE default job (``tlt_jax.job.build.DEFAULT_CONFIG``, configs/tiny_grpo.py, built by
``build_job``) with ``rollout.verify="coupled"``, the same seed and the same warm-started policy;
they differ only in ``config.drafter``: ``none`` (vanilla rollouts) or ``eagle`` (whatever the job
makes of it: a fresh EAGLE drafter trained online, the adaptive engine and its tuner). Coupled
verification makes speculative decoding emit exactly vanilla sampling's tokens, so both arms follow
one trajectory: tokens and rewards are asserted equal at every step, and only time differs.

The warm start runs once (cached on disk by ``rl_bench.warm_policy_dir``, keyed by the model,
sft, task and seed sections) and each arm loads its own copy. Each trainer is built as the job
builds it and precompiled (rollout, policy update and the online drafter's steps); then the arms
step in turn, the order rotating every step, so load from other processes falls on both. The
eagle arm also makes the job's selective async drafter save after each step when
``drafter_training.save_every`` asks for it and training changed the drafter (timed apart as
``drafter_save_s``).

``--verify rejection`` runs the SD arm with rejection sampling instead (its tokens, and so the
trajectory, differ from vanilla's: nothing is asserted), ``--verify both`` runs it twice, once per
mode, as two arms stepping in turn with ``none`` (the rejection arm is named
``<drafter>_rejection``), and also reports the paired ratio coupled / rejection: whether coupled
verification costs speed in the job.

Reported: the paired per-step ratio eagle step seconds / none step seconds, its median over the
steps (step 1 and every step in which either arm compiled left out), over the first quarter of the
steps (or the first ``--split-step`` steps: epoch mode's first epoch, which has no history) and over
the rest, the rollout seconds' ratio over the same spans, and the same for every ``*_s`` metric the
trainer reports (rollout_s, update_s, drafter_serial_s, drafter_* / ledger_* seconds, ...), with
each arm's medians: every such key whose values differ between the arms is printed. The target
(``TARGET``): median step time <= 1.05x vanilla's.

``--set KEY=VALUE`` changes both arms (e.g. smaller sizes); ``--config-override KEY=VALUE``
the eagle arm only (e.g. ``drafter_training.serial_steps=8`` for the fixed budget). Values are
Python literals (``8``, ``1e-4``, ``True``, ``"((3, 1, 4),)"``), anything else a string.

``--out``'s JSON is rewritten (whole, by a rename) before the warm start, after it, after each
arm is built and after every step (``partial``, ``stage``), so a run stopped by a timeout leaves
what it measured. Its ``breakdown`` holds SD's share of the decode steps per batch
bucket, the accepted tokens per draft source, each strategy's calibrated step cost against
vanilla's per bucket, the host time per rollout (rollout less prefill, decode and compaction)
and the compile seconds per executable kind, for each arm.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from experiments import harness
from experiments.rl import rl_bench as rb
from experiments.rl.rl_bench import config_lib
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.job.build import DEFAULT_CONFIG, build_job, job_devices
from tlt_jax.job.run_dir import DRAFTER_CHECKPOINTS
from tlt_jax.job import runner
from tlt_jax.job import precompile as precompile_lib

ARMS = ("none", "eagle")  # the second is --drafter's (main sets it)
TARGET = 1.05  # never slower: the SD arm's median step time at most 1.05x vanilla's


def job_config(seed: int, drafter: str, overrides: list[tuple[str, object]],
               verify: str = "coupled", path=DEFAULT_CONFIG):
  """The job ``path`` configures (the default job unless told) with ``seed``, ``drafter``,
  ``verify`` and the ``overrides`` (dotted keys) applied."""
  cfg = config_lib.load_config_file(path)
  cfg.seed, cfg.drafter = seed, drafter
  cfg.rollout.verify = verify
  return harness.apply_overrides(cfg, overrides, path)


def make_trainer(job, policy_dir: pathlib.Path) -> harness.GRPOTrainer:
  """The trainer the job's runner builds for ``job`` (``tlt_jax.job.runner.run``), on a fresh
  copy of the warm-started policy, precompiled as the runner does; ``precompile_s`` says how
  long each part took."""
  mesh = jax.sharding.Mesh(np.array(job_devices(job.cfg)), ("data",))
  trainer = runner.make_trainer(job, rb.load_policy(policy_dir), mesh)
  done = precompile_lib.precompile(trainer)
  trainer.precompile_s = dict(rollout=round(done.rollout_s, 1), update=round(done.update_s, 1),
                              drafter=round(done.drafter_s, 1),
                              executables=dict(rollout=done.rollout, update=done.update),
                              drafter_devices=done.drafter_devices)
  rb.record_rollouts(trainer)
  return trainer


def calibration(trainer) -> dict | None:
  """The engine's measured decode-step seconds per (batch bucket, strategy) and its segment
  boundary's seconds, where its cost tuner calibrated (JSON keys ``"<bucket>/<strategy>"``), and
  the SD arms its offers loop offered per bucket it visited (measured is not offered: an arm
  whose step costs more than its drafts can save is left out)."""
  shared = getattr(trainer.engine, "calibration", None)  # the rollout's Calibration
  if shared is None or shared.costs is None:
    return None
  costs, boundary = shared.costs
  offers = [o for e in pool_engines(trainer.engine)[:1] if (o := getattr(e, "offers", None))]
  return dict(step_s={f"{b}/{name}": s for (b, name), s in sorted(costs.items())},
              boundary_s=boundary,
              offered=({str(v.bucket): list(v.offered) for v in offers[0].visited}
                       if offers else None))


def pool_engines(engine) -> list:
  """The one-device rollout engines behind ``engine``: a data-parallel rollout's, or ``engine``
  itself."""
  if hasattr(engine, "engines"):
    return [e for sub in engine.engines for e in pool_engines(sub)]
  return [engine] if hasattr(engine, "pool") else []


def compile_by_kind(trainer) -> dict:
  """What the trainer's precompile spent: the rollout's executables per kind (``prefill``,
  ``segment``, ``catchup``, ``compact``, ``grow``: how many, their lowering and compiling seconds
  summed and the longest one; segments also per strategy group), over all its engines, beside
  the runner's seconds for the rollout (calibration included), the policy update and the
  drafter's steps (``precompile_s``)."""
  kinds: dict[str, dict] = {}
  groups: dict[str, dict] = {}
  for engine in pool_engines(trainer.engine):
    cache = engine.pool.executables
    for _ in range(3):  # compiles may land from other threads: copy, retrying a racing copy
      try:
        timed = list(dict(cache.seconds_by_key).items())
        break
      except RuntimeError:
        continue
    else:
      timed = []
    for key, seconds in timed:
      kind = key[0] if isinstance(key, tuple) else str(key)
      slots = [kinds.setdefault(kind, dict(count=0, seconds=0.0, max_s=0.0))]
      if kind == "segment" and len(key) > 4:
        slots.append(groups.setdefault(str(key[4]), dict(count=0, seconds=0.0, max_s=0.0)))
      for slot in slots:
        slot["count"] += 1
        slot["seconds"] = round(slot["seconds"] + seconds, 3)
        slot["max_s"] = round(max(slot["max_s"], seconds), 3)
  return dict(precompile_s=getattr(trainer, "precompile_s", None), rollout_by_kind=kinds,
              segments_by_group=groups,
              rollout_compile_s=round(sum(k["seconds"] for k in kinds.values()), 2))


def wait_for_pool(trainer) -> float:
  """Waits until every SD arm the trainer's engines compile in the background (after the first
  step's vanilla executables: ``engine.offers``) exists; returns the seconds waited (0 where
  nothing compiles in the background)."""
  t0 = time.perf_counter()
  for engine in pool_engines(trainer.engine):
    wait = getattr(getattr(engine, "offers", None), "wait", None)
    if callable(wait):
      wait()
  return time.perf_counter() - t0


def host_seconds(row: dict) -> float | None:
  """A rollout's host time: ``rollout_s`` less its prefill, decode and compaction seconds (None
  where the step's metrics lack them)."""
  parts = ("rollout_s", "prefill_s", "decode_s", "compact_s")
  if not all(k in row for k in parts):
    return None
  return row["rollout_s"] - row["prefill_s"] - row["decode_s"] - row["compact_s"]


def breakdown(rows: dict[str, list[dict]], trainers: dict, sd: str, steps: list[int]) -> dict:
  """Where the SD arm's rollout differs from vanilla's, over ``steps`` (indices; medians): SD's
  share of the decode steps, overall and per batch bucket (``arm_steps/<bucket>/<arm>``); the
  accepted tokens per SD step per draft source (``accept_len/<source>``) and each source's
  share of the SD row-steps; each strategy's calibrated decode-step cost against vanilla's
  1-token step, per bucket; host time per rollout per arm; compile seconds per executable
  kind per arm."""
  med = lambda xs: statistics.median(xs) if xs else None
  sd_rows = [rows[sd][i] for i in steps if i < len(rows[sd])]

  def medians(prefix: str) -> dict:
    names = sorted({k[len(prefix):] for r in sd_rows for k in r if k.startswith(prefix)})
    return {n: med([r[prefix + n] for r in sd_rows if prefix + n in r]) for n in names}

  per_bucket = {}
  buckets: dict[str, set] = {}  # bucket -> the arms it offered
  for r in sd_rows:
    for k in r:
      if k.startswith("arm_steps/"):
        _, bucket, arm = k.split("/", 2)
        buckets.setdefault(bucket, set()).add(arm)
  for bucket in sorted(buckets, key=lambda b: int(b) if b.isdigit() else 0):
    decoded = [r for r in sd_rows if f"arm_steps/{bucket}/vanilla" in r]
    per_bucket[bucket] = dict(
        steps=len(decoded),
        sd_share_median=med([1.0 - r[f"arm_steps/{bucket}/vanilla"] for r in decoded]),
        sd_share_mean=(sum(1.0 - r[f"arm_steps/{bucket}/vanilla"] for r in decoded) /
                       len(decoded)) if decoded else None,
        arm_share_median={arm: med([r[f"arm_steps/{bucket}/{arm}"] for r in sd_rows
                                    if f"arm_steps/{bucket}/{arm}" in r])
                          for arm in sorted(buckets[bucket])})
  verify_cost = None
  cal = calibration(trainers[sd]) if sd in trainers else None
  if cal:
    verify_cost = {}
    for key, seconds in cal["step_s"].items():
      bucket, name = key.split("/", 1)
      base = cal["step_s"].get(f"{bucket}/vanilla")
      verify_cost.setdefault(bucket, {})[name] = round(seconds / base, 3) if base else None
  host = {}
  for arm, arm_rows in rows.items():
    values = [host_seconds(arm_rows[i]) for i in steps if i < len(arm_rows)]
    host[arm] = med([v for v in values if v is not None])
  paired = [host_seconds(rows[sd][i]) / host_seconds(rows["none"][i]) for i in steps
            if i < min(len(rows[sd]), len(rows["none"])) and host_seconds(rows["none"][i])
            and host_seconds(rows[sd][i]) is not None]
  return dict(
      steps=[i + 1 for i in steps],
      sd_share_of_decode_steps_median=med([1.0 - r["arm_share/vanilla"] for r in sd_rows
                                           if "arm_share/vanilla" in r]),
      sd_share_by_bucket=per_bucket,
      mean_accept_len_median=med([r["mean_accept_len"] for r in sd_rows
                                  if "mean_accept_len" in r]),
      accept_len_by_source_median=medians("accept_len/"),
      accept_share_by_source_median=medians("accept_share/"),
      verify_cost_vs_vanilla_step=verify_cost,
      host_s_per_rollout_median=host,
      host_s_ratio_paired_median=med(paired),
      compile={arm: compile_by_kind(t) for arm, t in trainers.items()})


def report_steps(compiled: list[bool], skip: int) -> list[int]:
  """The steps (indices) the running breakdown covers: from ``skip`` on and none compiled, or
  every step while there are none such yet."""
  kept = [i for i in range(skip, len(compiled)) if not compiled[i]]
  return kept or list(range(len(compiled)))


def write_json(path, report: dict) -> pathlib.Path:
  """``harness.write_json`` by way of a temporary file renamed over ``path``, so that a run killed
  mid-write (the accelerator check's ``timeout``) leaves the previous JSON whole."""
  path = pathlib.Path(path)
  tmp = harness.write_json(path.with_name(path.name + ".tmp"), report)
  os.replace(tmp, path)
  return path


def seconds_keys(rows: dict[str, list[dict]]) -> list[str]:
  """Every metric key ending in ``_s`` that either arm reported."""
  return sorted({k for arm in rows.values() for r in arm for k in r if k.endswith("_s")})


def paired(rows: dict[str, list[dict]], key: str, steps: list[int], sd: str) -> dict:
  """``key`` per arm (its median over ``steps``, 0 where an arm lacks it) and the paired
  per-step ratio ``sd`` / none (median; None where none's value is 0) and difference."""
  get = lambda arm, i: float(rows[arm][i].get(key, 0.0))
  out = {f"{arm}_median": statistics.median(get(arm, i) for i in steps) for arm in ("none", sd)}
  out["diff_median"] = statistics.median(get(sd, i) - get("none", i) for i in steps)
  ratios = [get(sd, i) / get("none", i) for i in steps if get("none", i) > 0]
  out["ratio_median"] = statistics.median(ratios) if ratios else None
  return out


def worst_window(rows: dict[str, list[dict]], sd: str, base: str = "none", width: int = 4) -> dict:
  """The worst ``width`` consecutive steps (step 1 included: a user waits for it too): the
  largest ratio of ``sd``'s summed step seconds to ``base``'s over any such window, and its
  first step (1-based), for the long-tail job's target "every window of 4 consecutive steps
  <= 1.08x"."""
  n = len(rows[base])
  if n < width:
    return dict(width=width, ratio=None, first_step=None)
  ratios = [sum(rows[sd][i]["step_s"] for i in range(j, j + width)) /
            sum(rows[base][i]["step_s"] for i in range(j, j + width)) for j in range(n - width + 1)]
  j = int(np.argmax(ratios))
  return dict(width=width, ratio=ratios[j], first_step=j + 1)


def wall_seconds(trainer, rows: list[dict]) -> float:
  """An arm's job wall time less the shared warm start: its precompile and every step (with the
  drafter save the job makes after it)."""
  p = trainer.precompile_s
  return (p["rollout"] + p["update"] + p["drafter"] +
          sum(r["step_s"] + r.get("drafter_save_s", 0.0) for r in rows))


def summarize(rows: dict[str, list[dict]], compiled: list[bool], skip: int,
              split: int | None = None, sd: str | None = None, base: str = "none") -> dict:
  """Paired step-time and rollout-time ratios ``sd`` / ``base`` (``sd``: the first SD arm by
  default) over the kept steps (from ``skip`` on, none compiled), all of them, the first quarter
  of the run's steps (or the first ``split``) and the rest; every ``*_s`` key's breakdown (against
  none)."""
  sd = sd or ARMS[1]
  n = len(rows["none"])
  kept = [i for i in range(skip, n) if not compiled[i]]
  if not kept:
    raise SystemExit(f"no step to report: {n} steps, the first {skip} skipped, compiles in "
                     f"{sum(compiled)}; raise --steps")
  quarter = max(1, n // 4) if split is None else split
  spans = {"all": kept, "first_quarter": [i for i in kept if i < quarter],
           "rest": [i for i in kept if i >= quarter]}

  def span_ratios(key):
    ratio = lambda i: rows[sd][i][key] / rows[base][i][key]
    return {span: dict(median=statistics.median(ratio(i) for i in s) if s else None,
                       steps=len(s),
                       total=(sum(rows[sd][i][key] for i in s) /
                              sum(rows[base][i][key] for i in s)) if s else None)
            for span, s in spans.items()}
  out = dict(steps=n, kept_steps=[i + 1 for i in kept], quarter_steps=quarter,
             step_ratio=span_ratios("step_s"), rollout_ratio=span_ratios("rollout_s"),
             worst_window=worst_window(rows, sd, base))
  if base != "none":
    return out
  out["breakdown"] = {key: paired(rows, key, kept, sd) for key in seconds_keys(rows)}
  if "drafter_save_s" in out["breakdown"]:  # the job's loop: the step plus the drafter save
    loop = lambda arm, i: rows[arm][i]["step_s"] + rows[arm][i].get("drafter_save_s", 0.0)
    out["step_plus_save_ratio_median"] = statistics.median(
        loop(sd, i) / loop("none", i) for i in kept)
  return out


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the job's config file "
                      "(default: the default job's), e.g. configs/tiny_longtail.py")
  parser.add_argument("--steps", type=int, default=None, help="RL steps per arm (default: the "
                      "job's trainer.steps)")
  parser.add_argument("--seed", type=int, default=0)
  harness.add_set_flag(parser, dest="both", help="config fields of both arms (repeatable)")
  harness.add_set_flag(parser, "--config-override", dest="eagle", help="config fields of the "
                       "eagle arm only (repeatable), e.g. drafter_training.serial_steps=8")
  parser.add_argument("--skip", type=int, default=1, help="first steps left out of the medians")
  parser.add_argument("--drafter", default="eagle", help="config.drafter of the SD arm, e.g. "
                      "suffix or eagle+suffix")
  parser.add_argument("--split-step", type=int, default=None, help="the first span's steps "
                      "(default: a quarter of them), e.g. epoch mode's steps per epoch")
  parser.add_argument("--verify", default="coupled", choices=["coupled", "rejection", "both"],
                      help="the SD arm's rollout.verify (both: one SD arm per mode)")
  parser.add_argument("--allow-divergence", action="store_true", help="record, instead of "
                      "failing on, a step where a coupled arm's tokens differ from none's (on an "
                      "accelerator a T-token pass may round differently from a 1-token one, and "
                      "a sample near a tie can flip; the arms then follow two trajectories)")
  parser.add_argument("--budget-s", type=float, default=None, help="start no step after this "
                      "many seconds of the run (the JSON is rewritten after every step)")
  parser.add_argument("--wait-pool", action="store_true", help="build the SD arms first and "
                      "wait, before the first step, until every executable their engines "
                      "compile in the background exists (so that short runs measure TLT with "
                      "its SD arms, not while they compile; the wait is reported as "
                      "pool_wait_s)")
  parser.add_argument("--out", default="experiments/out/e2e_default_job.json")
  a = parser.parse_args()
  t_start = time.perf_counter()
  global ARMS  # pylint: disable=global-statement
  sd = a.drafter if a.verify != "rejection" else f"{a.drafter}_rejection"
  ARMS = ("none", sd) + ((f"{a.drafter}_rejection",) if a.verify == "both" else ())
  cfgs = {"none": job_config(a.seed, "none", a.both, path=a.config)}
  for arm in ARMS[1:]:
    cfgs[arm] = job_config(a.seed, a.drafter, a.both + a.eagle,
                           "rejection" if arm.endswith("_rejection") else "coupled", a.config)
  coupled_arms = [arm for arm in ARMS[1:] if not arm.endswith("_rejection")]
  jobs = {arm: build_job(cfg) for arm, cfg in cfgs.items()}
  steps = a.steps if a.steps is not None else jobs["none"].trainer.steps
  if steps < 1:
    raise SystemExit("--steps must be >= 1")
  warm = None
  trainers: dict = {}
  rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
  compiled: list[bool] = []
  diverged: dict[str, int] = {}  # arm -> the first step its tokens differed (--allow-divergence)

  def progress(stage: str) -> dict:
    """The JSON as it stands, rewritten at every stage and step (a run stopped by a timeout
    leaves what it had measured)."""
    return dict(command=" ".join(sys.argv), config=str(a.config), partial=True, stage=stage,
                seconds=round(time.perf_counter() - t_start, 1), arms=list(ARMS),
                warm_start=warm,
                precompile_s={arm: t.precompile_s for arm, t in trainers.items()},
                calibration=calibration(trainers[sd]) if sd in trainers else None,
                first_divergent_step=diverged or None,
                breakdown=breakdown(rows, trainers, sd, report_steps(compiled, a.skip)),
                steps_metrics=rows, compiled=compiled)

  write_json(a.out, progress("warm start"))
  policy_dir = rb.warm_policy_dir(jobs["none"])  # model, sft, task and seed: both arms'
  assert all(rb.warm_policy_dir(jobs[arm]) == policy_dir for arm in ARMS), (
      "the arms' warm starts differ")
  warm = json.loads((policy_dir / "warm_start.json").read_text())  # its steps, loss, seconds
  write_json(a.out, progress("warm start done"))
  t0 = time.perf_counter()
  # --wait-pool: the SD arms first, so that what they compile in the background overlaps the
  # vanilla arm's build
  order = [arm for arm in ARMS if arm != "none"] + ["none"] if a.wait_pool else list(ARMS)
  for arm in order:
    trainers[arm] = make_trainer(jobs[arm], policy_dir)
    write_json(a.out, progress(f"built {arm}"))
  trainers = {arm: trainers[arm] for arm in ARMS}
  pool_wait_s = None
  if a.wait_pool:
    pool_wait_s = {arm: round(wait_for_pool(t), 2) for arm, t in trainers.items()}
    print(f"waited for the background compiles: {pool_wait_s}", flush=True)
    write_json(a.out, progress("pools complete"))
  build_s = time.perf_counter() - t0
  print(f"built and compiled both trainers in {build_s:.0f}s: " + ", ".join(
      f"{arm} {t.precompile_s}" for arm, t in trainers.items()), flush=True)
  eagle_job = jobs[sd]
  saves = None
  with tempfile.TemporaryDirectory() as tmp:
    if trainers[sd].online is not None and eagle_job.drafter_save_every:
      saves = {arm: Checkpointer(pathlib.Path(tmp) / arm / DRAFTER_CHECKPOINTS, keep=2,
                                 async_save=True) for arm in ARMS[1:]}
    try:
      for step in range(steps):
        c0 = harness.compile_count()
        for arm in harness.repeat_order(ARMS, step, "rotate"):
          trainer = trainers[arm]
          m = trainer.step()
          if arm != "none" and saves is not None and \
              trainer.step_count % eagle_job.drafter_save_every == 0:
            m["drafter_save_s"] = trainer.online.selective_save(saves[arm],
                                                                trainer.step_count) or 0.0
          rows[arm].append({k: (v if isinstance(v, (bool, int)) else float(v))
                            for k, v in m.items() if isinstance(v, (int, float, np.number))})
        compiled.append(harness.compile_count() > c0)
        digests = {arm: trainers[arm].rollout_digests[-1] for arm in ARMS}
        for arm in coupled_arms:  # coupled SD emits vanilla's tokens
          same = (digests["none"] == digests[arm] and
                  rows["none"][-1]["reward"] == rows[arm][-1]["reward"])
          if not same and a.allow_divergence:
            diverged.setdefault(arm, step + 1)
            print(f"step {step + 1}: {arm}'s tokens or rewards differ from none's", flush=True)
            continue
          assert digests["none"] == digests[arm], f"step {step + 1}: {arm}'s tokens differ"
          assert rows["none"][-1]["reward"] == rows[arm][-1]["reward"], (
              f"step {step + 1}: {arm}'s rewards differ")
        n, e = rows["none"][-1], rows[sd][-1]
        print(f"step {step + 1:3d} reward {n['reward']:.3f} step none {n['step_s']:.3f}s {sd} "
              f"{e['step_s']:.3f}s (x{e['step_s'] / n['step_s']:.2f}) rollout "
              f"{n['rollout_s']:.3f}/{e['rollout_s']:.3f}s drafter serial "
              f"{e.get('drafter_serial_s', 0.0):.3f}s accept "
              f"{rb.fmt(e.get('mean_accept_len'), '.2f')} sd share "
              f"{1 - e.get('arm_share/vanilla', 1.0):.2f}" +
              (" (compiled)" if compiled[-1] else ""), flush=True)
        write_json(a.out, progress(f"step {step + 1}"))
        if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s \
            and step + 1 < steps:
          print(f"--budget-s {a.budget_s:.0f} spent: stopping after {step + 1} steps", flush=True)
          steps = step + 1
          break
        if a.verify == "both":
          r = rows[ARMS[2]][-1]
          print(f"         {ARMS[2]} {r['step_s']:.3f}s (x{r['step_s'] / n['step_s']:.2f}) "
                f"rollout {r['rollout_s']:.3f}s accept {rb.fmt(r.get('mean_accept_len'), '.2f')}"
                f" sd share {1 - r.get('arm_share/vanilla', 1.0):.2f}", flush=True)
    finally:
      for saver in (saves or {}).values():
        saver.close()
  summary = summarize(rows, compiled, a.skip, a.split_step)
  summaries = {arm: summarize(rows, compiled, a.skip, a.split_step, sd=arm) for arm in ARMS[1:]}
  coupled_vs_rejection = None
  if a.verify == "both":  # paired per step: coupled's time / rejection's
    coupled_vs_rejection = summarize(rows, compiled, a.skip, a.split_step, sd=sd, base=ARMS[2])
  tuner = trainers[sd].engine.tuner
  report = dict(
      command=" ".join(sys.argv), config=str(a.config), seed=a.seed, steps=steps,
      drafter=a.drafter, arms=list(ARMS), both=dict(a.both), eagle_overrides=dict(a.eagle),
      verify=a.verify, warm_start=warm,
      target=TARGET,
      target_met=summary["step_ratio"]["all"]["median"] <= TARGET,
      job=dict(prompts_per_step=eagle_job.trainer.prompts_per_step,
               group_size=eagle_job.grpo.group_size,
               max_new_tokens=eagle_job.trainer.max_new_tokens,
               strategies=[harness.strategy_name(s) for s in eagle_job.engine.strategies],
               sd_max_batch=eagle_job.engine.sd_max_batch,
               drafter_training=eagle_job.cfg.drafter_training.to_dict()),
      build_s=round(build_s, 1), precompile_s={arm: t.precompile_s for arm, t in trainers.items()},
      pool_wait_s=pool_wait_s,
      wall_s_per_arm={arm: round(wall_seconds(trainers[arm], rows[arm]), 2) for arm in ARMS},
      wall_ratio=wall_seconds(trainers[sd], rows[sd]) / wall_seconds(trainers["none"],
                                                                     rows["none"]),
      identical_tokens_and_rewards=bool(coupled_arms) and not diverged,
      first_divergent_step=diverged or None, summary=summary, summaries=summaries,
      coupled_over_rejection=coupled_vs_rejection,
      tuner=None if tuner is None else tuner.summary(), calibration=calibration(trainers[sd]),
      breakdown=breakdown(rows, trainers, sd, [i - 1 for i in summary["kept_steps"]]),
      backend=jax.default_backend(), steps_metrics=rows, compiled=compiled,
      wall_s=round(time.perf_counter() - t_start, 1))
  out = write_json(a.out, report)
  ratio = summary["step_ratio"]
  print(f"{sd} / none step time, paired median: " + ", ".join(
      f"{span} {rb.fmt(r['median'])} ({r['steps']} steps)" for span, r in ratio.items()) +
      f"; target <= {TARGET}: {'met' if report['target_met'] else 'MISSED'}")
  print(f"{sd} / none: worst window of {summary['worst_window']['width']} steps "
        f"{rb.fmt(summary['worst_window']['ratio'])} (from step "
        f"{summary['worst_window']['first_step']}); precompile + steps "
        f"{report['wall_ratio']:.3f} ({report['wall_s_per_arm']})")
  print(f"{sd} / none rollout time, paired median: " + ", ".join(
      f"{span} {rb.fmt(r['median'])}" for span, r in summary["rollout_ratio"].items()))
  if coupled_vs_rejection is not None:
    print("coupled / rejection, paired median: step " + ", ".join(
        f"{span} {rb.fmt(r['median'])}" for span, r in coupled_vs_rejection["step_ratio"].items())
        + "; rollout " + ", ".join(f"{span} {rb.fmt(r['median'])}"
                                    for span, r in coupled_vs_rejection["rollout_ratio"].items()))
    for arm in ARMS[1:]:
      print(f"  {arm} / none step, all: {rb.fmt(summaries[arm]['step_ratio']['all']['median'])}")
  if "step_plus_save_ratio_median" in summary:
    print(f"  with the job's drafter save after each step: "
          f"{summary['step_plus_save_ratio_median']:.3f}")
  print(f"{'metric':32s} {'none':>9s} {sd:>9s} {'diff':>9s} {'ratio':>7s}   (medians)")
  for key, b in summary["breakdown"].items():
    if b["none_median"] != b[f"{sd}_median"] or b["diff_median"] != 0:
      print(f"{key:32s} {b['none_median']:9.4f} {b[f'{sd}_median']:9.4f} "
            f"{b['diff_median']:+9.4f} {rb.fmt(b['ratio_median'], '7.3f')}")
  b = report["breakdown"]
  print(f"{sd}: SD share of decode steps {rb.fmt(b['sd_share_of_decode_steps_median'])}, by "
        "bucket " + ", ".join(f"{k} {rb.fmt(v['sd_share_median'], '.2f')}"
                              for k, v in b["sd_share_by_bucket"].items()) +
        "; accepted per SD step by source " + ", ".join(
            f"{k} {rb.fmt(v, '.2f')}" for k, v in b["accept_len_by_source_median"].items()) +
        "; host s per rollout " + ", ".join(
            f"{k} {rb.fmt(v, '.4f')}" for k, v in b["host_s_per_rollout_median"].items()))
  print(f"wrote {out} in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
  main()
