"""``python -m tlt_jax.export speculators``: a saved EAGLE-3 drafter becomes a speculators
checkpoint for its verifier (loading back to the same drafter), a drafter saved for another
policy is exported after a one-line warning, and every mistake is one line on stderr with exit
status 2 and nothing written. (That the package ``speculators`` computes our logits from such a
directory: tests/models/test_eagle3_speculators.py.)"""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from tests.models.random_model import random_model
from tests.xla_env import ROOT, subprocess_env
from tlt_jax import export
from tlt_jax.models import hf
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import load_drafter, policy_fingerprint, save_drafter
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.model_config import ModelConfig

CONFIG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, architecture="qwen2", attention_bias=True)


def params(drafter) -> dict:
  return {path: np.asarray(v.get_value())
          for path, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
  """A verifier directory, an EAGLE-3 drafter saved for it, one saved for another policy of the
  same shape, an EAGLE-1 drafter, and a verifier of another shape."""
  root = tmp_path_factory.mktemp("export")
  policy = random_model(CONFIG, seed=1)
  hf.save_pretrained(policy, CONFIG, root / "model")
  drafter = Eagle3Drafter.for_target(policy, seed=2)
  save_drafter(drafter, root / "eagle3", policy=policy, policy_name="the model")
  save_drafter(drafter, root / "for_other", policy=random_model(CONFIG, seed=9),
               policy_name="another run")
  save_drafter(Drafter.create(CONFIG, seed=3), root / "eagle")
  wide = CONFIG.replace(hidden_size=64, intermediate_size=128)
  hf.save_pretrained(random_model(wide, seed=4), wide, root / "wide_model")
  return root, drafter, policy


def run(argv, capsys) -> tuple[int, str, str]:
  code = export.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


def test_an_eagle3_drafter_exports_and_loads_back_as_itself(made, tmp_path, capsys):
  root, drafter, _ = made
  out = tmp_path / "spec"
  code, stdout, err = run(["speculators", root / "eagle3", out, "--verifier", root / "model"],
                          capsys)
  assert (code, err) == (0, ""), err
  assert stdout.startswith(f"wrote {out} ") and "vllm serve " in stdout, stdout
  spec = json.loads(stdout.split("--speculative-config ")[1].strip().strip("'"))
  assert spec == {"model": str(out), "method": "eagle3", "num_speculative_tokens": 3}
  back = load_drafter(out, CONFIG)
  assert isinstance(back, Eagle3Drafter) and back.feature_layers == drafter.feature_layers
  want, got = params(drafter), params(back)
  assert want.keys() == got.keys()
  for path, value in want.items():
    np.testing.assert_array_equal(got[path], value, err_msg=str(path))
  # run again: an existing speculators checkpoint is replaced
  assert run(["speculators", root / "eagle3", out, "--verifier", root / "model"], capsys)[0] == 0


def test_the_fingerprint_from_the_files_is_the_loaded_model_s(made):
  root, _, policy = made
  assert (policy_fingerprint(export.fingerprint_params(root / "model", CONFIG))
          == policy_fingerprint(policy) == policy_fingerprint(hf.from_pretrained(root / "model")[0]))


def test_a_drafter_trained_for_another_policy_is_exported_after_a_warning(made, tmp_path, capsys):
  root, _, _ = made
  out = tmp_path / "spec"
  code, _, err = run(["speculators", root / "for_other", out, "--verifier", root / "model"],
                     capsys)
  assert code == 0 and (out / "model.safetensors").is_file()
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("warning: drafter "), err
  assert "(another run), not for this one" in lines[0] and "(exported anyway)" in lines[0]


def _garble_config(root, tmp_path):
  bad = tmp_path / "garbled"
  bad.mkdir()
  for name in ("drafter.safetensors", "drafter_config.json"):
    (bad / name).write_bytes((root / "eagle3" / name).read_bytes())
  (bad / "drafter_config.json").write_text("{not json")
  return bad


def _truncate_weights(root, tmp_path):
  bad = tmp_path / "truncated"
  bad.mkdir()
  (bad / "drafter_config.json").write_bytes((root / "eagle3" / "drafter_config.json").read_bytes())
  data = (root / "eagle3" / "drafter.safetensors").read_bytes()
  (bad / "drafter.safetensors").write_bytes(data[:len(data) // 2])
  return bad


def _a_plain_directory(root, tmp_path):
  (tmp_path / "spec").mkdir()
  (tmp_path / "spec" / "notes.txt").write_text("mine")
  return root / "eagle3"


@pytest.mark.parametrize("drafter, verifier, message", [
    ("missing", "model", r"^error: DRAFTER_DIR .*missing is not a directory$"),
    ("eagle3", "missing", r"^error: --verifier .*missing is not a directory$"),
    ("eagle", "model", r"^error: a drafter=eagle \(EAGLE-1\) drafter cannot be written as a "
                       r"speculators checkpoint.*train one with drafter=eagle3$"),
    ("eagle3", "wide_model", r"^error: drafter at .*eagle3 was made for hidden_size=32, but the "
                             r"target has hidden_size=64$"),
    ("eagle3", "eagle", r"^error: No config.json in .*eagle"),  # a drafter is no verifier
    (_garble_config, "model", r"^error: .*garbled/drafter_config.json"),
    (_truncate_weights, "model", r"^error: .*truncated/drafter.safetensors is not a readable "
                                 r"safetensors file"),
    (_a_plain_directory, "model", r"^error: OUT_DIR .*spec exists and is not a speculators "
                                  r"checkpoint: choose a new directory"),
], ids=["no-drafter", "no-verifier", "eagle1", "mismatched-verifier", "verifier-not-hf",
        "garbled-config", "truncated-weights", "out-dir-taken"])
def test_mistakes_are_one_line_with_status_2_and_write_nothing(made, tmp_path, capsys, drafter,
                                                               verifier, message):
  root, _, _ = made
  drafter_dir = drafter(root, tmp_path) if callable(drafter) else root / drafter
  out = tmp_path / "spec"
  before = sorted(p.name for p in tmp_path.iterdir())
  code, stdout, err = run(["speculators", drafter_dir, out, "--verifier", root / verifier],
                          capsys)
  assert code == 2 and stdout == "", (code, stdout, err)
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  assert re.search(message, err.strip()), err
  assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT_DIR, no leftovers


def test_usage_mistakes_are_one_line_with_status_2(capsys):
  code, _, err = run(["speculators", "a", "b"], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith("error: the following arguments are required: --verifier (usage: "
                        "python -m tlt_jax.export speculators DRAFTER_DIR OUT_DIR --verifier "
                        "MODEL_DIR)"), err
  assert run(["--help"], capsys)[0] == 0


def test_the_module_runs_from_the_command_line(made, tmp_path):
  root, drafter, _ = made
  out = tmp_path / "spec"
  done = subprocess.run([sys.executable, "-m", "tlt_jax.export", "speculators",
                         str(root / "eagle3"), str(out), "--verifier", str(root / "model")],
                        capture_output=True, text=True, timeout=120, cwd=ROOT,
                        env=subprocess_env())
  assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
  assert "vllm serve" in done.stdout
  np.testing.assert_array_equal(params(load_drafter(out, CONFIG))[("head", "kernel")],
                                params(drafter)[("head", "kernel")])
