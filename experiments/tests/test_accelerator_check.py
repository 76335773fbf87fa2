"""The prepared accelerator check (``experiments/system/accelerator_check.sh``) runs on a CPU with
--tiny and writes the JSON it promises, so the script cannot rot between the runs on a GPU."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "system" / "accelerator_check.sh"


def load_driver():
  """``experiments/system/accelerator_check.py`` as a module (a script, importable as
  ``experiments.system.accelerator_check``)."""
  return importlib.import_module("experiments.system.accelerator_check")


def finite_positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_tiny_check_writes_the_promised_json(tmp_path):
  out = tmp_path / "check.json"
  env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
  proc = subprocess.run([str(SCRIPT), "--tiny", "--out", str(out)], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=480)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "jax" in proc.stdout and "devices" in proc.stdout  # the script prints the device
  r = json.loads(out.read_text())
  assert r["complete"] is True
  assert r["jax_version"] and r["backend"] == "cpu" and r["device_kind"]
  assert r["dtype"] == "bfloat16" and r["model"]["source"] == "tiny"
  assert r["prompts"]["chat_format"] == "chatml" and "<|im_start|>assistant" in \
      r["prompts"]["example"]

  # parity: bf16 against fp32 of the same weights, fp32 against transformers (a dev extra)
  bf16 = r["parity"]["bfloat16_vs_float32"]
  for key in ("max_abs_logprob_diff", "mean_abs_logprob_diff", "kl_mean"):
    assert math.isfinite(bf16[key]) and bf16[key] >= 0
  assert bf16["max_abs_logprob_diff"] > 0  # bf16 really ran in bf16
  assert 0.5 <= bf16["greedy_agreement"] <= 1
  hf = r["parity"]["hf_reference_float32"]
  assert "skipped" not in hf, hf
  assert hf["max_abs_logprob_diff"] < 1e-3 and hf["greedy_agreement"] == 1.0

  # speed: vanilla, n-gram and the (random) EAGLE drafter's chain and tree at every batch size
  assert list(r["speed"]) == ["2"] and not r["skipped"]
  row = r["speed"]["2"]
  assert finite_positive(row["vanilla"]["tokens_per_s"]) and row["vanilla"]["tokens"] > 0
  assert len(row["vanilla"]["tokens_per_s_runs"]) == 2  # --tiny: 2 repeats
  for name in ("ngram", "eagle_chain", "eagle_tree"):
    s = row[name]
    assert finite_positive(s["tokens_per_s"]) and finite_positive(s["speedup"]), name
    assert len(s["speedups"]) == 2 and all(map(finite_positive, s["speedups"]))
    assert s["mean_accept_len"] >= 1.0 and sum(s["accept_hist"]) > 0
    assert s["greedy_identical"] is True and s["rows_identical"] == 1.0, name
  assert row["eagle_tree"]["spec"]["topk"] > 1 and row["eagle_chain"]["spec"]["topk"] == 1
  assert r["greedy_identical"] is True
  check_rl_stage(r)


def check_rl_stage(r: dict) -> None:
  """The RL stage of a --tiny run: both arms stepped 3 times on the GSM8K-style task, on one
  trajectory (coupled verification), tlt with SD and its drafter trained, within the budget."""
  rl = r["rl"]
  assert "error" not in rl, rl.get("error")
  assert rl["complete"] is True and rl["stopped"] is None and rl["steps_done"] == 3
  assert rl["arms"] == ["vanilla", "tlt"] and set(rl["steps"]) == {"vanilla", "tlt"}
  assert rl["task"]["kind"] == "gsm_style" and rl["task"]["problems"] == 256
  assert pathlib.Path(rl["task"]["path"]).is_file()
  assert rl["job"]["verify"] == "coupled" and rl["job"]["compute_dtype"] == "bfloat16"
  assert rl["job"]["dtype"] == "float32"  # mixed precision: float32 params, bf16 arithmetic
  assert rl["job"]["rows_per_step"] == 8 and rl["job"]["strategies"]
  for name, steps in rl["steps"].items():
    assert [s["step"] for s in steps] == [1, 2, 3], name
    for s in steps:
      for key in ("step_s", "rollout_s", "update_s"):
        assert finite_positive(s[key]), (name, key, s)
      assert s["step_s"] >= s["rollout_s"] + s["update_s"] and s["compiles"] == 0
  # the same tokens and rewards in both arms at every step
  assert rl["trajectory"] == dict(identical_tokens=True, identical_rewards=True,
                                  first_divergent_step={})
  digests = [[s["rollout_digest"] for s in rl["steps"][n]] for n in ("vanilla", "tlt")]
  assert digests[0] == digests[1] and len(set(digests[0])) == 3  # fresh samples every step
  van, tlt = rl["summary"]["vanilla"], rl["summary"]["tlt"]
  assert rl["steps_in_medians"] == 2  # the first step is left out
  for s in (van, tlt):
    for key in ("step_s_median", "rollout_s_median", "update_s_median",
                "step_vs_vanilla_paired_median", "speedup_vs_vanilla"):
      assert finite_positive(s[key]), key
    assert len(s["step_vs_vanilla_paired"]) == 2
  assert van["step_vs_vanilla_paired_median"] == 1.0 and van["drafter_s_median"] == 0
  assert van["steps_with_sd"] == 0 and van["mean_accept_len"] is None
  # tlt: the adaptive engine ran speculative segments, and the drafter trained every step
  assert tlt["steps_with_sd"] >= 1 and tlt["mean_accept_len"] >= 1.0 and tlt["sd_share_mean"] > 0
  assert van["sd_share_mean"] == 0
  assert all(s["drafter_serial_steps"] > 0 for s in rl["steps"]["tlt"])
  assert tlt["drafter_s_median"] > 0
  assert set(rl["tuners"]) == {"tlt"}
  # the budget: the stage ended within --budget-s (and the whole run too)
  assert rl["seconds"] > 0 and r["wall_s"] <= r["args"]["budget_s"]


def test_rl_stage_stops_cleanly_when_out_of_budget(tmp_path):
  """With no time left the RL stage builds nothing and says why in the JSON."""
  driver = load_driver()
  args = driver.parse_args(["--tiny", "--out", str(tmp_path / "check.json")])
  model, tokenizer, _ = driver.load_target(args)
  report, writes = {}, []
  driver.rl_stage(args, model, tokenizer, None, report, lambda: writes.append(1),
                  deadline=driver.time.perf_counter())
  rl = report["rl"]
  assert rl["complete"] is False and "out of budget before building the arms" in rl["stopped"]
  assert rl["steps"] == {"vanilla": [], "tlt": []} and writes
  assert rl["job"]["sd_max_batch"] == 8 and rl["task"]["chat_template"] is False


def test_gsm_style_problems_are_deterministic_word_problems():
  driver = load_driver()
  problems = driver.gsm_style_problems(10, seed=3)
  assert problems == driver.gsm_style_problems(10, seed=3)
  assert problems != driver.gsm_style_problems(10, seed=4)
  for text, answer in problems:
    assert text.endswith("\\boxed{}.") and "?" in text
    assert isinstance(answer, int) and answer >= 0
  text, answer = problems[3]  # the apples problem: shares divide evenly
  assert "apples" in text and answer >= 3
  prompt = driver.chatml("hi")
  assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/model"], "does not exist"),
    (["--model", "{tmp}/m.gguf"], "'gguf' package is not installed"),
    (["--model", "{tmp}/file.txt"], "neither a directory nor a .gguf file"),
])
def test_bad_models_exit_saying_what_to_pass(tmp_path, monkeypatch, argv, message):
  driver = load_driver()
  (tmp_path / "m.gguf").write_bytes(b"")
  (tmp_path / "file.txt").write_text("")
  real = importlib.util.find_spec
  monkeypatch.setattr(driver.importlib.util, "find_spec",
                      lambda name, *a: None if name == "gguf" else real(name, *a))
  args = driver.parse_args([x.format(tmp=tmp_path) for x in argv])
  with pytest.raises(SystemExit, match=message):
    driver.load_target(args)


def test_driver_needs_no_torch_transformers_gguf_or_ml_collections():
  """What the accelerator image may lack: the driver imports and parses its arguments without."""
  code = ("import sys\n"
          "for name in ('torch', 'transformers', 'gguf', 'ml_collections', 'tensorboardX', "
          "'reasoning_gym', 'math_verify'):\n"
          "  sys.modules[name] = None  # importing it raises ImportError\n"
          "from experiments.system import accelerator_check as ac\n"
          "a = ac.parse_args(['--tiny'])\n"
          "assert a.batches == [2] and a.dtype == 'bfloat16'\n"
          "print(ac.hf_reference_parity(None, None))\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "'skipped'" in proc.stdout  # the transformers reference says why it did not run



def test_divergence_gaps_report_where_and_by_how_much():
  """Where greedy SD leaves vanilla, the two tokens' logits in one full forward of the vanilla
  path: the vanilla token is that forward's argmax, so its logit is the larger."""
  driver = load_driver()
  args = driver.parse_args(["--tiny"])
  model, _, _ = driver.load_target(args)
  prompts = [[5, 6, 7], [8, 9, 10, 11]]
  reference = []
  for p in prompts:  # greedy continuations, token by token, from full forwards
    seq = list(p)
    for _ in range(4):
      seq.append(int(driver.logits_of(model, np.array([seq], np.int32))[0, -1].argmax()))
    reference.append(seq[len(p):])
  other = [list(reference[0]), list(reference[1])]
  other[1][2] = (other[1][2] + 1) % model.config.vocab_size  # row 1 leaves at token 2
  assert driver.divergence_gaps(model, prompts, reference, reference, width=8) == []
  (found,) = driver.divergence_gaps(model, prompts, reference, other, width=8)
  assert (found["row"], found["position"]) == (1, 2)
  assert (found["vanilla_token"], found["sd_token"]) == (reference[1][2], other[1][2])
  assert found["logit_vanilla_token"] >= found["logit_sd_token"]
  assert found["gap"] == pytest.approx(found["logit_vanilla_token"] - found["logit_sd_token"])


# ---- --e2e: the long-tail jobs, vanilla against TLT, one JSON each and a figure ----
E2E_ROW_KEYS = ("step_s", "rollout_s", "update_s", "prefill_s", "decode_s", "compact_s", "reward",
                "rollout_digest")
BREAKDOWN_KEYS = {"steps", "sd_share_of_decode_steps_median", "sd_share_by_bucket",
                  "mean_accept_len_median", "accept_len_by_source_median",
                  "accept_share_by_source_median", "verify_cost_vs_vanilla_step",
                  "host_s_per_rollout_median", "host_s_ratio_paired_median", "compile"}


def matplotlib_imports() -> bool:
  return importlib.util.find_spec("matplotlib") is not None


@pytest.mark.slow
def test_e2e_tiny_writes_each_jobs_json_and_the_step_time_figure(tmp_path):
  """``--e2e-tiny``: both long-tail jobs at toy sizes, each as vanilla and TLT stepping in turn,
  each into its finished JSON of paired per-step rows with its breakdown, plus the PNG
  of per-step seconds (where matplotlib imports) and a log per job."""
  from tests.xla_env import subprocess_env  # pylint: disable=import-outside-toplevel
  out = tmp_path / "e2e"
  env = subprocess_env(PYTHON=sys.executable, E2E_OUT=str(out))
  proc = subprocess.run([str(SCRIPT), "--e2e-tiny"], env=env, cwd=tmp_path, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
  expected = {"tiny_longtail": ("suffix", 4), "mid_longtail": ("eagle+suffix", 3)}
  for name, (sd, steps) in expected.items():
    r = json.loads((out / f"{name}_e2e.json").read_text())
    assert "partial" not in r and r["arms"] == ["none", sd] and r["steps"] == steps, name
    assert r["config"].endswith(f"{name}.py") and r["backend"] == "cpu"
    assert r["identical_tokens_and_rewards"] is True  # coupled: the CPU has never diverged
    rows = r["steps_metrics"]
    assert len(rows["none"]) == len(rows[sd]) == len(r["compiled"]) == steps
    for arm in ("none", sd):
      for i, row in enumerate(rows[arm]):
        assert row["step"] == i + 1 and all(k in row for k in E2E_ROW_KEYS), (name, arm, i)
        assert finite_positive(row["step_s"]) and row["step_s"] >= row["rollout_s"]
    assert [a["rollout_digest"] for a in rows["none"]] == [a["rollout_digest"] for a in rows[sd]]
    assert r["warm_start"]["sft"]["steps"] == 3 and "loss" in r["warm_start"]["metrics"]
    assert set(r["pool_wait_s"]) == {"none", sd}  # --wait-pool: SD's arms existed at step 1
    b = r["breakdown"]
    assert set(b) == BREAKDOWN_KEYS, name
    assert set(b["host_s_per_rollout_median"]) == {"none", sd}
    assert all(isinstance(v, float) for v in b["host_s_per_rollout_median"].values())
    assert set(b["compile"]) == {"none", sd}
    for arm, c in b["compile"].items():
      assert c["rollout_by_kind"]["segment"]["count"] >= 1 and c["rollout_compile_s"] > 0, arm
      assert c["precompile_s"]["update"] >= 0
    assert b["verify_cost_vs_vanilla_step"] is None or all(
        costs.get("vanilla") == 1.0 for costs in b["verify_cost_vs_vanilla_step"].values())
    assert (out / f"{name}.log").is_file()
  # the mid job's TLT: the online EAGLE drafter trains beside the suffix drafter exactly where the
  # calibration offered one of its arms (--wait-pool: the offers were settled before step 1; a
  # toy model on this CPU may offer none, and a drafter that cannot pay is not trained)
  mid = json.loads((out / "mid_longtail_e2e.json").read_text())
  offered = mid["calibration"]["offered"] or {}
  learned = any(name.startswith("chain") for per_bucket in offered.values() for name in per_bucket)
  trained = any(row.get("drafter_serial_steps", 0) > 0
                for row in mid["steps_metrics"]["eagle+suffix"])
  assert trained == learned, (offered, mid["breakdown"]["verify_cost_vs_vanilla_step"], trained)
  assert "tiny_longtail: 4 paired steps (complete)" in proc.stdout
  png = out / "e2e_step_times.png"
  if matplotlib_imports():
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  else:
    assert not png.exists() and "matplotlib is not installed" in proc.stdout


def fake_trainer(calibration=None, compiled=None):
  """What ``e2e_default_job.breakdown`` reads of a trainer: its engine's calibration (the
  rollout's shared ``Calibration``: its ``costs``) and pool."""
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  pool = SimpleNamespace(executables=SimpleNamespace(seconds_by_key=dict(compiled or {})))
  shared = SimpleNamespace(costs=calibration)
  return SimpleNamespace(engine=SimpleNamespace(calibration=shared, pool=pool),
                         precompile_s=dict(rollout=1.0, update=2.0, drafter=0.0))


def test_e2e_breakdown_reads_sd_shares_sources_verify_costs_host_time_and_compiles():
  job = importlib.import_module("experiments.rl.e2e_default_job")
  base = dict(rollout_s=1.0, prefill_s=0.1, decode_s=0.6, compact_s=0.1)  # host 0.2 s (tlt:
  # 0.25 and 0.3 s in steps 2 and 3)
  rows = {"none": [dict(base), dict(base), dict(base)],
          "tlt": [dict(base, decode_s=0.9),  # step 1: left out below
                  dict(base, rollout_s=0.9, decode_s=0.45, **{
                      "arm_share/vanilla": 0.75, "arm_steps/1/vanilla": 0.2,
                      "arm_steps/1/suffix_d8": 0.8, "arm_steps/64/vanilla": 1.0,
                      "arm_steps/64/suffix_d8": 0.0, "mean_accept_len": 3.0,
                      "accept_len/history": 3.5, "accept_share/history": 0.9}),
                  dict(base, rollout_s=0.8, decode_s=0.3, **{
                      "arm_share/vanilla": 0.5, "arm_steps/1/vanilla": 0.0,
                      "arm_steps/1/suffix_d8": 1.0, "mean_accept_len": 4.0,
                      "accept_len/history": 4.5, "accept_len/siblings": 2.0,
                      "accept_share/history": 0.8, "accept_share/siblings": 0.2})]}
  costs = {(1, "vanilla"): 1e-3, (1, "suffix d8"): 1.5e-3, (64, "vanilla"): 2e-3,
           (64, "suffix d8"): 5e-3}
  trainers = {"none": fake_trainer(compiled={("prefill", 64, 80): 1.0, ("segment", 64, 128, 16,
                                                                        "vanilla"): 2.0}),
              "tlt": fake_trainer((costs, 4e-4), {("segment", 1, 128, 0, "vanilla"): 1.0,
                                                  ("segment", 1, 128, 0, "suffix d8"): 3.0,
                                                  ("compact", 4, 1, 128): 0.5})}
  b = job.breakdown(rows, trainers, "tlt", [1, 2])
  assert set(b) == BREAKDOWN_KEYS and b["steps"] == [2, 3]
  assert b["sd_share_of_decode_steps_median"] == pytest.approx(0.375)
  one = b["sd_share_by_bucket"]["1"]
  assert one["steps"] == 2 and one["sd_share_median"] == pytest.approx(0.9)
  assert one["arm_share_median"] == {"suffix_d8": pytest.approx(0.9),
                                     "vanilla": pytest.approx(0.1)}
  assert b["sd_share_by_bucket"]["64"]["sd_share_median"] == 0.0
  assert list(b["sd_share_by_bucket"]) == ["1", "64"]  # by batch size, not as strings
  assert b["mean_accept_len_median"] == 3.5
  assert b["accept_len_by_source_median"] == {"history": 4.0, "siblings": 2.0}
  assert b["accept_share_by_source_median"]["history"] == pytest.approx(0.85)
  assert b["verify_cost_vs_vanilla_step"] == {"1": {"suffix d8": 1.5, "vanilla": 1.0},
                                              "64": {"suffix d8": 2.5, "vanilla": 1.0}}
  assert b["host_s_per_rollout_median"]["none"] == pytest.approx(0.2)
  assert b["host_s_per_rollout_median"]["tlt"] == pytest.approx(0.275)
  assert b["host_s_ratio_paired_median"] == pytest.approx(1.375)
  tlt = b["compile"]["tlt"]
  assert tlt["rollout_by_kind"]["segment"] == dict(count=2, seconds=4.0, max_s=3.0)
  assert tlt["segments_by_group"]["suffix d8"]["seconds"] == 3.0
  assert tlt["rollout_compile_s"] == 4.5 and tlt["precompile_s"]["update"] == 2.0
  assert b["compile"]["none"]["rollout_by_kind"]["prefill"]["count"] == 1
  # no SD arm built yet (the JSON written before the arms): nothing to read, nothing fails
  early = job.breakdown({"none": [], "tlt": []}, {}, "tlt", [])
  assert early["verify_cost_vs_vanilla_step"] is None and early["compile"] == {}


def e2e_report(steps: int, partial: bool = False) -> dict:
  rows = {"none": [dict(step=i + 1, step_s=1.0, rollout_s=0.8) for i in range(steps)],
          "suffix": [dict(step=i + 1, step_s=0.5 if i else 3.0, rollout_s=0.4)
                     for i in range(steps)]}
  compiled = [True] + [False] * (steps - 1)
  report = dict(arms=["none", "suffix"], steps_metrics=rows, compiled=compiled,
                breakdown=dict(sd_share_of_decode_steps_median=0.5,
                               sd_share_by_bucket={"1": dict(sd_share_median=1.0)},
                               accept_len_by_source_median={"history": 3.0},
                               host_s_per_rollout_median={"none": 0.01, "suffix": 0.011},
                               compile={"none": dict(rollout_compile_s=10.0)}))
  if partial:
    report.update(partial=True, stage=f"step {steps}")
  return report


def test_e2e_figure_script_reads_finished_partial_and_missing_jsons(tmp_path, capsys, monkeypatch):
  """``experiments/system/e2e_longtail.py``: each job's headline (paired medians over steps 2 on,
  compiled steps left out) from a finished JSON and from one a timeout cut short; a missing JSON
  is named, not fatal; the PNG is drawn where matplotlib imports and skipped with a note where
  it does not."""
  plot = importlib.import_module("experiments.system.e2e_longtail")
  (tmp_path / "tiny_longtail_e2e.json").write_text(json.dumps(e2e_report(5)))
  (tmp_path / "mid_longtail_e2e.json").write_text(json.dumps(e2e_report(2, partial=True)))
  paths = [str(tmp_path / f"{n}_e2e.json") for n in ("tiny_longtail", "mid_longtail", "nothing")]
  png = tmp_path / "steps.png"
  assert plot.main(["--png", str(png), *paths]) == 0
  text = capsys.readouterr().out
  assert "tiny_longtail: 5 paired steps (complete); TLT / vanilla paired median over 4: step " \
         "0.500, rollout 0.500" in text
  assert "mid_longtail: 2 paired steps (partial, at step 2)" in text
  assert "by bucket: 1 1.00" in text and "history 3.00" in text and "none 10.0" in text
  assert "nothing_e2e.json: no figures" in text
  if matplotlib_imports():
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  png.unlink(missing_ok=True)
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it raises ImportError
  assert plot.main(["--png", str(png), *paths]) == 0
  assert "matplotlib is not installed" in capsys.readouterr().out and not png.exists()
