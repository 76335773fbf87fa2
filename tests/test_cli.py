"""The shared command line: ``--help`` lists the fields of the config file the command names."""

import pathlib
import subprocess
import sys

import pytest

from tests.xla_env import subprocess_env
from tlt_jax import cli
from tlt_jax.job.build import DEFAULT_CONFIG
from tlt_jax.job.typed_config import flatten, load_config_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py")
# the configs of the RL job (tiny_generate.py is tlt_jax.generate's)
JOB_CONFIGS = [p for p in CONFIGS if p.name != "tiny_generate.py"]


def help_of(argv: list[str], capsys) -> tuple[int, str]:
  code = cli.main("usage", lambda *a, **k: None, DEFAULT_CONFIG, ["prog", *argv])
  out = capsys.readouterr()
  return code, out.out + out.err


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_help_lists_the_fields_of_the_config_it_is_given(path, capsys):
  """``--help --config=FILE`` (either order, ``=`` or a space) lists FILE's fields with FILE's
  values, not the default config's."""
  fields = flatten(load_config_file(path))
  for argv in (["--help", f"--config={path}"], [f"--config={path}", "--help"],
               ["--config", str(path), "-h"]):
    code, out = help_of(argv, capsys)
    assert code == 0, out
    listed = [line.strip() for line in out.splitlines() if line.startswith("  --config.")]
    assert listed == [f"--config.{name}={value!r}" for name, value in fields.items()], argv
    assert f"Config fields of {path}" in out


def test_help_without_a_config_lists_the_default_one(capsys):
  code, out = help_of(["--help"], capsys)
  steps = load_config_file(DEFAULT_CONFIG).trainer.steps
  assert code == 0 and f"Config fields of {DEFAULT_CONFIG}" in out
  assert f"  --config.trainer.steps={steps}\n" in out


def test_help_for_a_config_file_that_is_not_there_says_so(capsys):
  code, out = help_of(["--help", "--config=configs/no_such.py"], capsys)
  assert code == 2 and "error: no config file at configs/no_such.py" in out


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_every_job_config_holds_every_job_wide_field(path):
  """A real-model config can set what the default one can, except the tiny policy's shape and
  the arithmetic task's fields: ``--config.fsdp=2`` on smollm2_gsm8k.py must not be "no such
  config field" (ml_collections sets only the fields a file holds)."""
  default = flatten(load_config_file(DEFAULT_CONFIG))
  job_wide = {name for name in default if not name.startswith(("model.", "task."))}
  missing = sorted(job_wide - set(flatten(load_config_file(path))))
  assert not missing, f"{path.name} lacks {missing}"


def test_the_command_line_help_follows_config():
  """As a user runs it: the real-model config's own fields (its model path, its task)."""
  done = subprocess.run(
      [sys.executable, "-m", "tlt_jax.train", "--help", "--config=configs/smollm2_gsm8k.py"],
      capture_output=True, text=True, timeout=120, cwd=ROOT, env=subprocess_env())
  assert done.returncode == 0, done.stderr[-2000:]
  assert "--config.model.path=" in done.stdout and "--config.task.kind='reasoning_gym'" in \
      done.stdout and "--config.fsdp=1" in done.stdout
  assert "--config.model.num_layers" not in done.stdout  # the tiny policy's field: not this one's
