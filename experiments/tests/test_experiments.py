"""The benchmark scripts in experiments/ keep running: every one answers ``--help`` (its flags are
parsed in ``main``, so importing it runs nothing), and the cheapest ones run end to end at tiny
sizes and write the JSON keys that docs/benchmarks.md reads its figures from.

Each test is one subprocess that runs the scripts in turn with ``runpy`` (as
``python experiments/TOPIC/NAME.py`` would, the repository on ``PYTHONPATH``), so JAX is imported
once rather than once a script."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
# not scripts: the modules the scripts share
LIBRARIES = {"__init__.py", "harness.py", "rl_bench.py", "step_time.py", "device_flags.py"}
TESTS = EXPERIMENTS / "tests"  # these tests: neither scripts nor what the scripts share

RUNNER = """\
import contextlib, io, json, runpy, sys
codes = {}
for script, args in json.loads(sys.argv[1]):
  sys.argv = [script, *args]
  out = io.StringIO()
  try:
    with contextlib.redirect_stdout(out):
      runpy.run_path(script, run_name="__main__")
    codes[script] = "returned"
  except SystemExit as e:
    codes[script] = e.code
  if args == ["--help"] and "usage:" not in out.getvalue():
    codes[script] = "no usage printed"
print(json.dumps(codes))
"""


def run_scripts(runs: list[tuple[str, list[str]]], cwd, timeout: int) -> dict:
  """Runs each ``(script, args)`` in one subprocess; what each ended with (the SystemExit code,
  or "returned")."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(runs)], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def modules() -> list[pathlib.Path]:
  """The scripts and the modules they share: every ``.py`` file of experiments/ but its tests."""
  return sorted(p for p in EXPERIMENTS.rglob("*.py") if TESTS not in p.parents)


def scripts() -> list[pathlib.Path]:
  return [p for p in modules() if p.name not in LIBRARIES]


def test_every_script_answers_help():
  found = scripts()
  assert len(found) >= 20  # the glob found the scripts
  assert {"never_slower.py", "e2e_default_job.py"} <= {p.name for p in found}  # "never slower"
  codes = run_scripts([(str(p), ["--help"]) for p in found], ROOT, timeout=240)
  assert codes == {str(p): 0 for p in found}


def test_no_script_edits_sys_path():
  """Scripts import ``harness`` as ``experiments.harness``, never from a path they put on
  sys.path."""
  for path in modules():
    text = path.read_text()
    assert "sys.path.insert" not in text and "sys.path.append" not in text, path.name


@pytest.mark.slow
def test_cheapest_benchmarks_run_at_tiny_sizes(tmp_path):
  out = {name: tmp_path / f"{name}.json" for name in ("rollout", "capacity", "update")}
  tiny_model = ["--hidden", "32", "--layers", "1"]
  runs = [
      (str(EXPERIMENTS / "rollout" / "bench_rollout.py"),
       ["--repeats", "2", "--batch", "2", "--max-new-tokens", "16", *tiny_model,
        "--out", str(out["rollout"])]),
      # one capacity: a capacity cuts answers short
      (str(EXPERIMENTS / "rollout" / "bench_capacity.py"),
       ["--repeats", "1", "--capacities", "48", "--old-layout", "48", "--batch", "2",
        "--out", str(out["capacity"])]),
      (str(EXPERIMENTS / "rl" / "bench_update.py"),
       ["--repeats", "1", "--max-new-tokens", "32", "--offline-max-new-tokens", "32",
        "--offline-budgets", "256", "--update-tokens", "256", "--prompts", "2", "--group", "2",
        "--prompt-len", "8", "--mean-length", "6", "--tail-rows", "0", "--vocab", "64",
        *tiny_model, "--out", str(out["update"])]),
  ]
  codes = run_scripts(runs, tmp_path, timeout=300)
  assert set(codes.values()) == {"returned"}, codes

  rollout = json.loads(out["rollout"].read_text())
  assert set(rollout["tokens_per_s"]) == {"bucketed", "static"}
  assert set(rollout["row_steps"]) == {"bucketed", "static"}
  assert len(rollout["speedup_all"]) == 2 and rollout["speedup_median"] > 0
  assert rollout["speedup_median"] == statistics.median(rollout["speedup_all"])
  workload = rollout["workload"]
  assert (workload["batch"], workload["max_new_tokens"]) == (2, 16)
  # two answers of at most 16 tokens: the median length is half their sum, the quantiles ordered
  assert workload["tokens"] == 2 * workload["length_p50"]
  assert workload["length_p50"] <= workload["length_p90"] <= workload["length_p99"] <= \
      workload["length_max"] <= 16

  capacity = json.loads(out["capacity"].read_text())
  assert capacity["base"] == "48-buckets" and set(capacity["engines"]) == {"48-buckets", "48-full"}
  for engine in capacity["engines"].values():
    assert engine["tokens_per_s"] > 0 and engine["pool"] > 0
    assert {"slowdown_vs_base", "slowdown_runs", "cache_bytes_peak", "grows", "kv_lens"} <= set(
        engine)
  assert capacity["engines"]["48-buckets"]["slowdown_vs_base"] == 1.0
  assert {"p50", "p90", "max", "tokens"} <= set(capacity["lengths"])
  # one timed repeat: each slowdown is the base's tokens per second over the engine's
  base_tps = capacity["engines"]["48-buckets"]["tokens_per_s"]
  for engine in capacity["engines"].values():
    assert engine["slowdown_runs"] == [engine["slowdown_vs_base"]]
    assert engine["slowdown_vs_base"] == base_tps / engine["tokens_per_s"]
  lengths = capacity["lengths"]
  assert lengths["tokens"] == 2 * lengths["p50"]  # two answers
  assert lengths["p50"] <= lengths["p90"] <= lengths["max"] <= 48

  update = json.loads(out["update"].read_text())
  (offline,) = update["offline_tokens"]
  assert offline["padded"] >= offline["packed"] >= offline["valid"] > 0
  (result,) = update["results"]
  assert result["speedup"] > 0 and result["tokens_ratio"] >= 1.0
  assert result["first_update_loss_abs_diff"] <= 1e-4
  for name in ("padded", "packed"):
    assert {"update_s", "s_per_valid_generated_token", "tokens_padded", "tokens_valid",
            "passes"} <= set(result[name])
  assert result["packed"]["tokens_padded"] == offline["packed"]
  # the timed update counted the tokens the offline count gives, and the ratios are of the
  # numbers reported
  assert result["padded"]["tokens_padded"] == offline["padded"]
  assert result["padded"]["tokens_valid"] == result["packed"]["tokens_valid"] == offline["valid"]
  assert result["tokens_ratio"] == offline["ratio"] == offline["padded"] / offline["packed"]
  assert result["speedup"] == result["padded"]["update_s"] / result["packed"]["update_s"]
  for name in ("padded", "packed"):
    assert result[name]["update_s"] == statistics.median(result[name]["update_s_all"])
    assert result[name]["s_per_valid_generated_token"] == (result[name]["update_s"] /
                                                           result["generated_tokens"])


@pytest.mark.slow
def test_e2e_default_job_runs_at_tiny_sizes(tmp_path):
  """The default job's eagle-vs-none benchmark at tiny sizes (~45 s): both arms follow one
  trajectory (the script asserts it per step), the eagle-only override reaches the eagle arm
  alone, and the report holds the paired ratios and the per-arm breakdown."""
  out = tmp_path / "e2e.json"
  tiny = ["trainer.prompts_per_step=2", "grpo.group_size=2", "rollout.max_batch=4",
          "sft.steps=2", "model.hidden_size=32", "model.intermediate_size=64",
          "model.num_layers=1", "trainer.max_new_tokens=16",
          "rollout.sd_offers=all"]  # every arm offered: the drafter trains where it may pay
  args = ["--steps", "3", "--config-override", "drafter_training.serial_steps=2",
          "--config-override", "drafter_training.bootstrap_share=None",  # granted up front
          "--verify", "both", "--out", str(out)]
  for item in tiny:
    args += ["--set", item]
  codes = run_scripts([(str(EXPERIMENTS / "rl" / "e2e_default_job.py"), args)], tmp_path,
                      timeout=300)
  assert set(codes.values()) == {"returned"}, codes
  report = json.loads(out.read_text())
  assert report["identical_tokens_and_rewards"] and report["verify"] == "both"
  assert report["arms"] == ["none", "eagle", "eagle_rejection"]
  both = report["coupled_over_rejection"]["step_ratio"]["all"]
  rows = report["steps_metrics"]
  kept = [i - 1 for i in report["summary"]["kept_steps"]]
  assert both["median"] == statistics.median(rows["eagle"][i]["step_s"] /
                                             rows["eagle_rejection"][i]["step_s"] for i in kept)
  assert set(report["summaries"]) == {"eagle", "eagle_rejection"}
  assert all(r["drafter_serial_steps"] == 2 for r in rows["eagle_rejection"])
  assert report["eagle_overrides"] == {"drafter_training.serial_steps": 2,
                                      "drafter_training.bootstrap_share": None}
  assert report["job"]["drafter_training"]["serial_steps"] == 2
  summary = report["summary"]
  assert summary["steps"] == 3 and 1 not in summary["kept_steps"] and summary["kept_steps"]
  assert summary["step_ratio"]["all"]["median"] > 0
  breakdown = summary["breakdown"]
  assert {"step_s", "rollout_s", "update_s"} <= set(breakdown)
  assert breakdown["drafter_serial_s"]["none_median"] == 0.0  # no drafter in the none arm
  assert [r["reward"] for r in rows["none"]] == [r["reward"] for r in rows["eagle"]]
  assert all("drafter_serial_s" not in r for r in rows["none"])


@pytest.mark.slow
def test_eagle3_vs_eagle_runs_at_tiny_sizes(tmp_path):
  """train_drafter_offline.py --kinds eagle,eagle3 on a tiny default-job policy
  (~25 s on a warm compile cache, ~80 s cold): both kinds train on the same rows, the chained
  top-1's first step is the teacher-forced top-1, and each kind's held-out acceptance in the
  engine is reported."""
  report_path, out = tmp_path / "report.json", tmp_path / "drafters"
  tiny = ["sft.steps=2", "model.hidden_size=32", "model.intermediate_size=64",
          "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1"]
  args = ["--target", "job", "--set", *tiny, "--kinds", "eagle,eagle3", "--prompts", "8",
          "--eval-prompts", "4", "--max-new-tokens", "16", "--row-len", "64", "--batch-rows",
          "2", "--steps", "3", "--log-every", "1", "--accept-depths", "2", "--out", str(out),
          "--report", str(report_path)]
  codes = run_scripts([(str(EXPERIMENTS / "drafter" / "train_drafter_offline.py"), args)],
                      tmp_path, timeout=300)
  assert set(codes.values()) == {"returned"}, codes
  report = json.loads(report_path.read_text())
  assert report == json.loads((out / "train_log.json").read_text())
  kinds = report["kinds"]
  assert set(kinds) == {"eagle", "eagle3"} and report["overrides"]["sft.steps"] == 2
  assert kinds["eagle3"]["feature_layers"] == [1] and kinds["eagle3"]["ttt_steps"] == 3
  # the same rows: every kind scored on the same trained and held-out positions
  assert kinds["eagle"]["train"]["num_tokens"] == kinds["eagle3"]["train"]["num_tokens"] == \
      report["trained_positions"]
  assert kinds["eagle"]["held_out"]["num_tokens"] == kinds["eagle3"]["held_out"]["num_tokens"]
  for kind, r in kinds.items():
    assert r["chained_top1"]["steps"] == 3
    assert r["chained_top1"]["step1"] == pytest.approx(r["held_out"]["top1"], abs=1e-6), kind
    assert r["s_per_step"] >= 0 and r["train_s"] > 0 and len(r["log"]) == 3
    assert set(r["acceptance"]) == {"chain_d2"}
    for cell in r["acceptance"]["chain_d2"].values():
      assert 1.0 <= cell["mean_accept_len"] <= 3.0 and sum(cell["accept_hist"]) > 0
    assert set(r["acceptance"]["chain_d2"]) == {"t0", "t1"}
    assert json.loads((out / kind / "drafter_config.json").read_text())["drafter_kind"] == kind
  assert kinds["eagle3"]["chained_top1"]["last"] == pytest.approx(
      kinds["eagle3"]["held_out"]["top1_last"], abs=1e-6)  # ttt_steps chained steps, both ways


@pytest.mark.parametrize("arms, message", [("sd_frozen,tlt", "must include vanilla"),
                                           ("vanilla,tlt_fast", "unknown arm(s) tlt_fast")])
def test_e2e_speedup_checks_its_arms_before_any_work(tmp_path, arms, message):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(EXPERIMENTS / "rl" / "e2e_speedup.py"), "--arms",
                         arms],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
  assert not (tmp_path / "experiments").exists()  # nothing warm-started or cached


def test_e2e_speedup_summarizes_a_subset_of_arms():
  """``--arms vanilla,sd_frozen`` (Fig. 11 without TLT's drafter training): the summary covers the
  arms that ran, each paired with vanilla's step."""
  from experiments.rl import e2e_speedup  # pylint: disable=import-outside-toplevel

  def row(step_s, accept=None):
    r = dict(step_s=step_s, rollout_s=step_s / 2, update_s=step_s / 4, tail_s=0.0, compiles=0,
             reward=0.5)
    return r if accept is None else dict(r, mean_accept_len=accept)

  rows = {"vanilla": [row(9.0), row(1.0), row(1.0), row(1.0)],
          "sd_frozen": [row(9.0, 2.0), row(0.5, 2.0), row(0.8, 2.0), row(0.5, 2.0)]}
  assert e2e_speedup.arm_names("sd_frozen, vanilla") == ("vanilla", "sd_frozen")
  summary, kept, _ = e2e_speedup.summarize(rows, skip=1)
  assert set(summary) == {"vanilla", "sd_frozen"} and list(kept) == [1, 2, 3]
  assert summary["sd_frozen"]["step_vs_vanilla_paired_median"] == pytest.approx(0.5)
  assert summary["sd_frozen"]["speedup_vs_vanilla"] == pytest.approx(2.0)
  assert summary["vanilla"]["step_vs_vanilla_paired_median"] == pytest.approx(1.0)


@pytest.mark.parametrize("args, message", [
    (["--strategies", "3,1,5"], "verify_tokens must be depth + 1"),
    (["--strategies", "5:4:16"], "write depth,topk,verify_tokens"),
    (["--target", "no_such_dir"], "or say --target random")])
def test_ablate_pool_says_what_is_wrong_with_its_arguments(tmp_path, args, message):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(EXPERIMENTS / "sd" / "ablate_pool.py"), *args],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_a_script_started_inside_experiments_stops_before_writing_there():
  """Its relative default outputs would land in experiments/experiments/out (a cached policy
  was once committed from there)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  topic = EXPERIMENTS / "drafter"
  proc = subprocess.run([sys.executable, "drafter_save_latency.py", "--repeats", "1"], cwd=topic,
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1 and "from the repository root" in proc.stderr, proc.stderr[-2000:]
  for folder in (EXPERIMENTS, topic):
    assert not (folder / "experiments").exists() and not (folder / "docs").exists()


def test_predict_longtail_reproduces_run_3s_vanilla_and_brackets_tlt(tmp_path):
  """The long-tail jobs' H200 prediction from the stored device results: its vanilla rollout is run
  3's by construction (decode scaled to the measured one, the rest charged as measured), and each
  scenario's TLT is no slower than vanilla, the critical rows' no faster than the mean row's."""
  out = tmp_path / "predict.json"
  codes = run_scripts([(str(EXPERIMENTS / "rl" / "predict_longtail.py"), ["--out", str(out)])],
                      tmp_path, timeout=300)
  assert set(codes.values()) == {"returned"}, codes
  report = json.loads(out.read_text())
  measured = report["inputs"]["run3_vanilla_medians"]["rollout_s"]
  for job in ("tiny", "mid"):
    assert report[job] and all(r["rollout_ratio"] >= 1.0 and r["step_ratio"] >= 1.0
                               for r in report[job].values()), report[job]
  tiny = report["tiny"]
  assert tiny["mean"]["vanilla_rollout_s"] == pytest.approx(measured, rel=0.1)
  assert tiny["critical"]["rollout_ratio"] <= tiny["mean"]["rollout_ratio"]


def test_an_experiment_takes_the_jobs_override_style_as_well_as_set(tmp_path, monkeypatch):
  """``--config.KEY=VALUE`` (the job's style) in a script with ``--set`` is ``--set KEY=VALUE``:
  one way of setting a config field everywhere; a script without ``--set`` still rejects it."""
  from experiments import harness  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(tmp_path)  # harness.parser refuses to start from inside experiments/
  parser = harness.parser("a script\n")
  harness.add_set_flag(parser)
  parser.add_argument("--steps", type=int, default=1)
  args = parser.parse_args(["--config.trainer.learning_rate=1e-4", "--steps", "3", "--set",
                            "sft.steps=0", "--config.drafter=eagle"])
  assert args.set == [("trainer.learning_rate", 1e-4), ("sft.steps", 0), ("drafter", "eagle")]
  assert args.steps == 3
  bare = harness.parser("a script without --set\n")
  with pytest.raises(SystemExit):
    bare.parse_args(["--config.trainer.steps=3"])
