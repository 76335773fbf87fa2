"""The entry points' persistent compilation cache (``tlt_jax/compile_cache.py``): where it lives,
that a second run loads what the first compiled, that ``off`` and an unwritable directory run
without it; generate compiles only its request's executables; an unknown flag's one-line error."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tlt_jax import compile_cache, generate

ROOT = pathlib.Path(__file__).resolve().parents[1]
ONE_PROMPT = ["--prompt=12+7=?", "--config.rollout.max_batch=1",
              "--config.rollout.max_new_tokens=16", "--config.sampling.max_new_tokens=16"]
# cli.main of generate, as `python -m tlt_jax.generate` runs it, counting JAX's cache events
_COUNTING_MAIN = """
import json, sys
from jax import monitoring
from tlt_jax import cli, generate
from tlt_jax.utils import compile_count
events = {}
monitoring.register_event_listener(lambda name, **kw: events.update({name: events.get(name, 0) + 1}))
compile_count()
rc = cli.main(generate.__doc__, generate.run, generate.DEFAULT_CONFIG, sys.argv,
              extra_flags=generate.prompt_flag)
print(json.dumps(dict(rc=rc, compiles=compile_count(),
                      requests=events.get("/jax/compilation_cache/compile_requests_use_cache", 0),
                      hits=events.get("/jax/compilation_cache/cache_hits", 0))))
"""


# the same for the main job (tlt_jax.train)
_COUNTING_TRAIN = _COUNTING_MAIN.replace(
    "from tlt_jax import cli, generate", "from tlt_jax import cli, train").replace(
    """cli.main(generate.__doc__, generate.run, generate.DEFAULT_CONFIG, sys.argv,
              extra_flags=generate.prompt_flag)""",
    "cli.main(train.__doc__, train.run, train.DEFAULT_CONFIG, sys.argv)")


def run_generate(args, **env):
  """The counting generate in a subprocess: (counts, stderr). Without the session's settings of
  JAX's cache thresholds (tests/conftest.py): the entry point must make its own."""
  inherited = {k: v for k, v in os.environ.items()
               if not k.startswith("JAX_PERSISTENT_CACHE_")}
  proc = subprocess.run([sys.executable, "-c", env.pop("main", _COUNTING_MAIN), *args],
                        capture_output=True,
                        text=True, timeout=300, cwd=ROOT,
                        env=dict(inherited, PYTHONPATH=str(ROOT), **env))
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def entries(directory):
  return [p for p in pathlib.Path(directory).glob("*") if not p.name.startswith(".")]


def test_directory_precedence(monkeypatch, tmp_path):
  for name in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.choose() == str(tmp_path / "tlt_jax" / "xla")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/jax/own")
  assert compile_cache.choose() == "/jax/own"
  monkeypatch.setenv(compile_cache.ENV, "/ours")
  assert compile_cache.choose() == "/ours"
  assert compile_cache.choose("/flag") == "/flag"
  for off in ("off", "0", "OFF"):
    assert compile_cache.choose(off) is None
    monkeypatch.setenv(compile_cache.ENV, off)
    assert compile_cache.choose() is None
  assert compile_cache.choose("/flag") == "/flag"  # the flag overrides the environment's off


def test_a_directory_under_home_is_expanded(monkeypatch, tmp_path):
  """``--compile_cache=~/x`` (or the environment's) is the home directory's ``x``, not a
  directory named ``~`` in the working directory."""
  monkeypatch.setenv("HOME", str(tmp_path))
  assert compile_cache.choose("~/xla") == str(tmp_path / "xla")
  monkeypatch.setenv(compile_cache.ENV, " ~/env_xla ")
  assert compile_cache.choose() == str(tmp_path / "env_xla")


def test_config_flags_of_either_form_are_overrides():
  """The fields a command line sets, which a resume takes over the saved config: absl's
  ``--noconfig.<bool>`` sets one too (to False), as ``--config.<field>=...`` does."""
  from tlt_jax import cli  # pylint: disable=import-outside-toplevel
  argv = ["tlt_jax.train", "--config.trainer.steps=3", "--noconfig.trainer.control",
          "--config.resume", "--verbose", "--compile_cache=off"]
  assert cli.config_overrides(argv) == ["trainer.steps", "trainer.control", "resume"]


def test_second_run_loads_what_the_first_compiled(tmp_path):
  cache = tmp_path / "cache"
  cold, _ = run_generate(ONE_PROMPT + [f"--compile_cache={cache}"])
  assert cold["rc"] == 0 and cold["compiles"] > 0
  assert cold["requests"] == cold["compiles"] and cold["hits"] == 0
  assert len(entries(cache)) >= cold["compiles"]  # every executable, however small, is cached
  warm, _ = run_generate(ONE_PROMPT, TLT_COMPILE_CACHE=str(cache))  # the same through the env
  # a loaded executable still counts as a compile (the engine's counter is unchanged by a hit)
  assert warm["compiles"] == cold["compiles"] and warm["hits"] == warm["compiles"]


def test_enable_takes_effect_after_compiles(tmp_path):
  # JAX sets its cache up at the first compile, once: enable() has it set up again
  code = ("import sys, jax; from tlt_jax import compile_cache\n"
          "jax.jit(lambda x: x + 1)(1); compile_cache.enable(sys.argv[1])\n"
          "jax.jit(lambda x: x * 3)(1); compile_cache.enable(None)\n"
          "jax.jit(lambda x: x * 5)(1); compile_cache.enable(sys.argv[2])\n"
          "jax.jit(lambda x: x * 7)(1)")
  first, second = tmp_path / "first", tmp_path / "second"
  proc = subprocess.run([sys.executable, "-c", code, str(first), str(second)], capture_output=True,
                        text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert len(entries(first)) == 1 and len(entries(second)) == 1


@pytest.mark.slow  # two CLI processes: the full tier
def test_off_and_an_unwritable_directory_run_without_cache(tmp_path):
  unused = tmp_path / "unused"
  off, stderr = run_generate(ONE_PROMPT + ["--compile_cache=off"], TLT_COMPILE_CACHE=str(unused),
                             JAX_COMPILATION_CACHE_DIR=str(unused))
  assert off["requests"] == 0 and not unused.exists(), stderr
  (tmp_path / "a_file").write_text("")
  bad = tmp_path / "a_file" / "cache"
  counts, stderr = run_generate(ONE_PROMPT, TLT_COMPILE_CACHE=str(bad))
  assert counts["rc"] == 0 and counts["requests"] == 0
  warnings = [line for line in stderr.splitlines() if "compile cache" in line]
  assert warnings == [f"warning: running without a compile cache: cannot write {bad} (Not a "
                      f"directory); --compile_cache=PATH (or TLT_COMPILE_CACHE=PATH) picks another "
                      f"directory, =off silences this"], stderr
  assert "Traceback" not in stderr


def test_generate_compiles_only_what_its_request_uses(monkeypatch):
  engines = []

  class Recorded(generate.RolloutEngine):
    def __init__(self, *a, **k):
      super().__init__(*a, **k)
      engines.append(self)

  monkeypatch.setattr(generate, "RolloutEngine", Recorded)
  cfg = generate.DEFAULT_CONFIG
  from tlt_jax.job import typed_config as config_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load_config_file(cfg)
  cfg.rollout.update(max_new_tokens=16)
  cfg.sampling.update(max_new_tokens=16)
  stats = generate.run(cfg, prompts=["12+7=?"])
  engine, = engines
  compiled = set(engine.pool.executables)
  # one row: its prefill and decode segments at batch 1, nothing of the other batch buckets
  assert stats["compiles"] == len(compiled) <= 3
  assert {key[1] for key in compiled} == {1} and ("prefill", 1, 16) in compiled
  assert len(engine.executable_keys()) > 10 * len(compiled)


@pytest.mark.parametrize("flag, hint", [("--prompts=1+1", "; did you mean --prompt?"),
                                        ("--nochatt", "; did you mean --chat?"),
                                        ("--zzz=3", "")])
def test_an_unknown_flag_says_so_in_one_line(flag, hint):
  proc = subprocess.run([sys.executable, "-m", "tlt_jax.generate", flag], capture_output=True,
                        text=True, timeout=120, cwd=ROOT)
  name = flag.split("=")[0]
  assert proc.returncode == 2
  assert proc.stderr == (f"error: unknown flag {name}{hint}\n"
                         "(--help lists the flags and config fields)\n")


@pytest.mark.slow
def test_a_resumed_run_loads_every_executable_its_run_compiled(tmp_path):
  """The main job stopped after a checkpoint and resumed: every executable the resume needs (the
  rollout's with restored weights among them) is a cache hit, and the cache gains nothing."""
  from tests.test_train_job import tiny_flags  # pylint: disable=import-outside-toplevel
  cache, logdir = tmp_path / "cache", tmp_path / "run"
  args = [f"--config.{k}={v}" for k, v in tiny_flags().items()] + [
      f"--config.logdir={logdir}", f"--compile_cache={cache}", "--config.checkpoint_every=1"]
  first, _ = run_generate(args + ["--config.trainer.steps=1"], main=_COUNTING_TRAIN)
  assert first["rc"] == 0 and first["compiles"] > 0 and first["hits"] == 0
  written = sorted(p.name for p in entries(cache))
  resumed, err = run_generate(args + ["--config.trainer.steps=2", "--config.resume=True"],
                              main=_COUNTING_TRAIN)
  assert resumed["rc"] == 0, err[-2000:]
  assert resumed["requests"] == resumed["compiles"] > 0
  assert resumed["hits"] == resumed["requests"], (resumed, err[-2000:])
  assert sorted(p.name for p in entries(cache)) == written
