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

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
  assert rl["job"]["verify"] == "coupled" and rl["job"]["dtype"] == "bfloat16"
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
