"""Fingerprints every job config (its to_dict and its first RL steps' metrics) for comparison.

Taken before and after a refactor of the config or rollout code, two fingerprints show whether
anything a config says or a run logs has changed.

  python -m experiments.system.config_fingerprint --out FILE.json [--only tiny_grpo,...]
      [--steps 4] [--eval-problems 8] [--timeout-s 360] [--merge]
  python -m experiments.system.config_fingerprint --compare A.json B.json [--ignore key1,key2]

Run from the repository root. For each config file in ``tlt_jax/configs/`` it records:

* ``to_dict``: the config's ``to_dict()`` as ``--config=FILE`` loads it (values JSON cannot hold
  as their ``repr``; tuples become lists, so ``field_types`` keeps each field's type name);
* for a training job (every config but the generate demo ``tiny_generate``), the job's first
  ``--steps`` RL steps, run through ``tlt_jax.job.runner.run`` as ``python -m tlt_jax.train``
  does, in a fresh temporary logdir with the config's own seed. The only overrides are
  ``trainer.steps``, ``trainer.eval_every=0`` and a small ``trainer.eval_problems`` (the held-out
  evaluations at the start and the end still run, on fewer problems). From the job's
  ``metrics.jsonl`` it keeps every row, without the timing fields (seconds, milliseconds,
  per-second rates, compile counts, memory: ``timing_key``); the keys dropped are listed.

Each config runs in a subprocess of its own under ``--timeout-s``; one that runs past it (or
fails) keeps its ``to_dict`` and records why, with the tail of its output. The subprocesses get
``XLA_FLAGS=<--xla-flags>`` (default empty: XLA's defaults, as the CLI runs; recorded in the
JSON, and a comparison says when two files used different flags, which change the rounding and
so every metric). ``--merge`` keeps the configs of an existing ``--out`` that this run does not
redo (it must have been written with the same settings).

``--compare`` reads two such files and says per config whether ``to_dict`` is equal and which
metrics differ, row by row, ignoring the keys of ``--ignore`` (names or ``*`` patterns: metrics
known to vary between identical runs, e.g. the adaptive tuner's choices, which follow timings).
It exits 1 where anything differs.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from experiments import harness

CONFIGS = ("tiny_grpo", "tiny_longtail", "mid_longtail", "tiny_generate", "smollm2_gsm8k",
           "smollm2_reasoning_gym")
NOT_TRAIN_JOBS = {"tiny_generate"}  # python -m tlt_jax.generate configs: to_dict only
# metric names that are timings or resources, not results of the run
_TIMING_SUFFIXES = ("_s", "_ms", "_seconds", "_per_s", "_per_sec", "tok_s", "_tps",
                    "_bytes_peak")
_TIMING_WORDS = ("compile", "memory", "mem_", "wall", "tokens_per_second", "per_s_")
# the job's console lines kept in an entry (where the time went; not compared)
_LOGGED = re.compile(r"(warm start: \d+ steps|compiled |held-out at |step +\d+/)")


def config_dir() -> pathlib.Path:
  """The folder of the package's config files (of the tlt_jax that is imported)."""
  import tlt_jax  # pylint: disable=import-outside-toplevel
  return pathlib.Path(tlt_jax.__file__).resolve().parent / "configs"


def json_safe(value):
  """``value`` with dicts and sequences walked and anything JSON cannot hold as its ``repr``."""
  if isinstance(value, dict):
    return {str(k): json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(v) for v in value]
  if value is None or isinstance(value, (bool, int, str)):
    return value
  if isinstance(value, float):
    return value if math.isfinite(value) else repr(value)
  return repr(value)


def field_types(value: dict) -> dict[str, str]:
  """``{"trainer.steps": "int", ...}``: the type name of every leaf of a ``to_dict()``."""
  return {key: type(item).__name__ for key, item in _flat(value).items()}


def timing_key(key: str) -> bool:
  """Whether a metric is a timing or resource figure (dropped from the fingerprint)."""
  head = key.split("/", 1)[0]  # per-process keys: "process_idle_s/1"
  return head.endswith(_TIMING_SUFFIXES) or any(w in head for w in _TIMING_WORDS)


def read_metrics(path: pathlib.Path) -> tuple[list[dict], list[str]]:
  """The rows of a ``metrics.jsonl`` without timing fields, and the sorted keys dropped."""
  rows, dropped = [], set()
  if not path.exists():
    return rows, []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line torn by a kill
    dropped.update(k for k in row if timing_key(k))
    rows.append({k: json_safe(v) for k, v in row.items() if not timing_key(k)})
  return rows, sorted(dropped)


def run_overrides(steps: int, eval_problems: int, logdir: str) -> list[tuple[str, object]]:
  """The dotted overrides a fingerprint run applies to a training job's config."""
  return [("trainer.steps", steps), ("trainer.eval_every", 0),
          ("trainer.eval_problems", eval_problems), ("logdir", logdir)]


def worker(name: str, steps: int, eval_problems: int, logdir: str, record: pathlib.Path) -> int:
  """In the subprocess: writes ``name``'s ``to_dict`` to ``record``, then runs the job (a
  training config) for ``steps`` steps in ``logdir``."""
  from tlt_jax.job.typed_config import load_config_file  # pylint: disable=import-outside-toplevel
  path = config_dir() / f"{name}.py"
  cfg = load_config_file(path)
  as_dict = cfg.to_dict()
  record.write_text(json.dumps({"to_dict": json_safe(as_dict),
                                "field_types": field_types(as_dict)}, indent=1))
  if name in NOT_TRAIN_JOBS:
    return 0
  overrides = run_overrides(steps, eval_problems, logdir)
  cfg = harness.apply_overrides(cfg, overrides, path)
  from tlt_jax.job.runner import run  # pylint: disable=import-outside-toplevel
  run(cfg, overrides=[key for key, _ in overrides])
  return 0


def fingerprint(name: str, a, scratch: pathlib.Path) -> dict:
  """Runs ``name``'s worker subprocess and returns its entry: ``to_dict``, ``field_types``,
  ``status`` (ok, not_a_train_job, timeout, error), ``wall_s``, and the metrics or why none."""
  logdir, record, log = scratch / name, scratch / f"{name}.json", scratch / f"{name}.log"
  cmd = [sys.executable, "-m", "experiments.system.config_fingerprint", "--worker", name,
         "--steps", str(a.steps), "--eval-problems", str(a.eval_problems),
         "--worker-logdir", str(logdir), "--worker-record", str(record)]
  env = dict(os.environ, XLA_FLAGS=a.xla_flags)
  t0 = time.perf_counter()
  with open(log, "w", encoding="utf-8") as out:
    proc = subprocess.Popen(cmd, cwd=harness.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      rc, status = proc.wait(timeout=a.timeout_s), None
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      rc, status = proc.wait(), "timeout"
  entry = {"wall_s": round(time.perf_counter() - t0, 1), "timeout_s": a.timeout_s}
  entry.update(json.loads(record.read_text()) if record.exists() else {})
  if status is None:
    status = ("not_a_train_job" if name in NOT_TRAIN_JOBS else "ok") if rc == 0 else "error"
  entry["status"] = status
  if name in NOT_TRAIN_JOBS:
    return entry
  lines = log.read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines()
  entry["log_lines"] = [line for line in lines if _LOGGED.match(line)]  # not compared
  rows, dropped = read_metrics(logdir / "metrics.jsonl")
  steps_done = sorted({r["step"] for r in rows if "loss" in r or "reward" in r})
  if status == "ok":
    entry.update(metrics=rows, dropped_keys=dropped)
  else:
    why = (f"ran past --timeout-s={a.timeout_s}" if status == "timeout" else f"exit code {rc}")
    entry.update(reason=f"{why}; RL steps logged before it stopped: {steps_done}",
                 output_tail=[line for line in lines if line.strip()][-15:])
  return entry


def run_all(a) -> int:
  """Fingerprints the chosen configs, writing ``--out`` after each one."""
  names = [n for n in a.only.split(",") if n] if a.only else list(CONFIGS)
  unknown = [n for n in names if not (config_dir() / f"{n}.py").is_file()]
  if unknown:
    raise SystemExit(f"error: no config file for {unknown} in {config_dir()}")
  out = pathlib.Path(a.out)
  report = json.loads(out.read_text()) if a.merge and out.exists() else {}
  settings = dict(steps=a.steps, eval_problems=a.eval_problems, xla_flags=a.xla_flags,
                  overrides=[k for k, _ in run_overrides(0, 0, "")])
  if report and report.get("settings") != settings:
    raise SystemExit(f"error: {out} was written with other settings {report.get('settings')}; "
                     f"these are {settings}")
  report.update(settings=settings, tlt_jax=str(config_dir().parent),
                machine=harness.machine("platform", "cpu_count", "jax", "jaxlib", "flax"))
  report.setdefault("configs", {})
  with tempfile.TemporaryDirectory(prefix="fingerprint_") as scratch:
    for name in names:
      print(f"{name}: running", flush=True)
      entry = fingerprint(name, a, pathlib.Path(scratch))
      report["configs"][name] = entry
      harness.write_json(out, report)
      rows = len(entry.get("metrics", []))
      print(f"{name}: {entry['status']} in {entry['wall_s']:.0f}s ({rows} metric rows)"
            + (f": {entry['reason']}" if "reason" in entry else ""), flush=True)
  print(f"wrote {out}")
  return 0


def _same(x, y) -> bool:
  """Equal values, NaN equal to NaN (a float or its repr)."""
  nan = lambda v: (isinstance(v, float) and math.isnan(v)) or v == "nan"
  return x == y or (nan(x) and nan(y))


def _dict_diff(x: dict, y: dict, ignore: tuple[str, ...] = ()) -> list[str]:
  """Sorted keys of two flat dicts whose values differ or that only one has, but those matching
  a pattern of ``ignore`` (``fnmatch``: ``arm_steps/*``)."""
  return sorted(k for k in set(x) | set(y)
                if not any(fnmatch.fnmatchcase(k, p) for p in ignore)
                and (k not in x or k not in y or not _same(x[k], y[k])))


def _flat(value, prefix: str = "") -> dict:
  """``{"trainer.steps": 4, ...}``: every leaf of a nested dict under its dotted name."""
  out = {}
  for key, item in value.items():
    if isinstance(item, dict):
      out.update(_flat(item, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = item
  return out


def compare(path_a: str, path_b: str, ignore: tuple[str, ...]) -> int:
  """Prints per config what differs between two fingerprint files; 1 if anything does."""
  a, b = (json.loads(pathlib.Path(p).read_text()) for p in (path_a, path_b))
  differs = False
  if a.get("settings") != b.get("settings"):
    print(f"settings differ: {a.get('settings')} vs {b.get('settings')}")
    differs = True
  for name in sorted(set(a["configs"]) | set(b["configs"])):
    ca, cb = a["configs"].get(name), b["configs"].get(name)
    if ca is None or cb is None:
      print(f"{name}: only in {path_a if cb is None else path_b}")
      differs = True
      continue
    lines = []
    keys = _dict_diff(_flat(ca.get("to_dict", {})), _flat(cb.get("to_dict", {})))
    lines.append("to_dict equal" if not keys else f"to_dict differs at {keys}")
    types = _dict_diff(ca.get("field_types", {}), cb.get("field_types", {}))
    if types:
      lines.append(f"field types differ at {types}")
    if "metrics" in ca and "metrics" in cb:
      ra, rb = ca["metrics"], cb["metrics"]
      if len(ra) != len(rb):
        lines.append(f"metric rows: {len(ra)} vs {len(rb)}")
      by_key: dict[str, list] = {}
      for i, (x, y) in enumerate(zip(ra, rb)):
        for key in _dict_diff(x, y, ignore):
          by_key.setdefault(key, []).append(x.get("step", i))
      lines.append("metrics equal" + (f" (ignoring {sorted(ignore)})" if ignore else "")
                   if not by_key and len(ra) == len(rb) else
                   "metrics differ: " + ", ".join(f"{k} (steps {s})"
                                                  for k, s in sorted(by_key.items())))
      differs |= bool(by_key) or len(ra) != len(rb)
    elif "not_a_train_job" not in (ca.get("status"), cb.get("status")) or \
        ca.get("status") != cb.get("status"):
      lines.append(f"no metrics to compare (status {ca.get('status')} vs {cb.get('status')}"
                   + (f"; {ca.get('reason') or cb.get('reason')}" if "reason" in ca or
                      "reason" in cb else "") + ")")
      differs |= ca.get("status") != cb.get("status")
    differs |= bool(keys) or bool(types)
    print(f"{name}: " + "; ".join(lines))
  print("DIFFERENT" if differs else "SAME")
  return 1 if differs else 0


def main() -> int:
  parser = harness.parser(__doc__)
  parser.add_argument("--out", help="JSON file to write the fingerprint to")
  parser.add_argument("--only", default="", help="comma-separated config names (default: all)")
  parser.add_argument("--steps", type=int, default=4, help="RL steps per training job")
  parser.add_argument("--eval-problems", type=int, default=8,
                      help="trainer.eval_problems of the held-out evaluations at start and end")
  parser.add_argument("--timeout-s", type=float, default=360,
                      help="seconds a config may run before it is stopped and its metrics skipped")
  parser.add_argument("--xla-flags", default="", help="XLA_FLAGS of the runs (default: none)")
  parser.add_argument("--merge", action="store_true",
                      help="keep the configs of an existing --out that this run does not redo")
  parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
  parser.add_argument("--ignore", default="",
                      help="metric keys --compare leaves out (comma-separated; * patterns)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--worker-logdir", help=argparse.SUPPRESS)
  parser.add_argument("--worker-record", help=argparse.SUPPRESS)
  a = parser.parse_args()
  if a.compare:
    return compare(*a.compare, tuple(k for k in a.ignore.split(",") if k))
  if a.worker:
    return worker(a.worker, a.steps, a.eval_problems, a.worker_logdir,
                  pathlib.Path(a.worker_record))
  if not a.out:
    parser.error("--out is required (or --compare A.json B.json)")
  return run_all(a)


if __name__ == "__main__":
  sys.exit(main())
