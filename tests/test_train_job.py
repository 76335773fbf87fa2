"""The main job as a user meets it: resume semantics, metrics without duplicates, the final model
with its tokenizer, validation before any work, and the command line (help, one-line errors)."""

import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import types

import numpy as np
import pytest

from tests.helpers import assert_written_atomically, garble
from tests.xla_env import subprocess_env
from tlt_jax import generate, train
from tlt_jax.checkpoint.checkpointer import CheckpointError
from tlt_jax.job import console, loop, runner
from tlt_jax.job import precompile as precompile_lib
from tlt_jax.job.build import build_job
from tlt_jax.job.run_dir import CONFIG_FILE, check_resume_overrides, export_final_model, \
    resume_config, save_run_config
from tlt_jax.job.signals import Interrupted, StopSignals
from tlt_jax.job.typed_config import ConfigError, load_config_file, read_json_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import load_drafter, save_drafter
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.data import EVAL_SEED, eval_problems, metric_kind
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rl.update import NonFiniteUpdateError
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.decode.suffix_history import HistoryConfig
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.decode.suffix import SuffixConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(task=dict(max_digits=3), model=dict(hidden_size=32, intermediate_size=64,
                                                 num_layers=1),
            sft=dict(steps=3, rows=2, row_len=64),
            trainer=dict(steps=2, prompts_per_step=4, minibatches=2, max_new_tokens=16,
                         eval_problems=4, learning_rate=1e-3, eval_pass_k=2),
            grpo=dict(group_size=2), rollout=dict(max_batch=8, max_prompt_len=16))


def tiny_flags() -> dict:
  """``TINY`` as command-line fields: ``{"task.max_digits": 3, ...}``."""
  return {f"{section}.{k}": v for section, fields in TINY.items() for k, v in fields.items()}


def tiny_config(logdir, **top):
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  for name, fields in TINY.items():
    cfg[name].update(fields)
  cfg.logdir = str(logdir)
  cfg.checkpoint_every = 1
  cfg.update(top)
  return cfg


def metric_steps(logdir):
  rows = [json.loads(line) for line in (pathlib.Path(logdir) / "metrics.jsonl").open()]
  return [r["step"] for r in rows if "reward" in r]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A tiny run of 2 RL steps, finished (checkpoints at 1 and 2, final model), with a held-out
  evaluation after every step (``eval_every=1``)."""
  logdir = tmp_path_factory.mktemp("run") / "logdir"
  cfg = tiny_config(logdir)
  cfg.trainer.eval_every = 1
  summary = train.run(cfg)
  return logdir, summary


def test_held_out_evaluations_are_logged_every_eval_every_steps(finished_run):
  """The held-out curve: step 0, the periodic evaluation in step 1's row, the final one after
  step 2 (not twice); each a function of that step's params, so step 0's is the start's."""
  logdir, summary = finished_run
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  evals = [(r["step"], "reward" in r) for r in rows if "eval_accuracy" in r]
  assert evals == [(0, False), (1, True), (2, False)], evals
  assert rows[0]["eval_accuracy"] == summary["accuracy_start"]
  assert rows[-1]["eval_sampled_reward"] == summary["sampled_end"]
  # pass@2 beside them (TINY sets trainer.eval_pass_k=2), in the summary too
  assert all(0.0 <= r["eval_pass_at_2"] <= 1.0 for r in rows if "eval_accuracy" in r)
  assert rows[-1]["eval_pass_at_2"] == summary["pass_at_2_end"]
  assert rows[0]["eval_pass_at_2"] == summary["pass_at_2_start"]


def test_the_first_metrics_row_says_which_scorer_made_the_rewards(finished_run):
  """Step 0's row names the reward's scorer (a math dataset's differs with math_verify
  installed or not, so a run says which one scored it); the other rows do not repeat it."""
  logdir, _ = finished_run
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  assert rows[0]["step"] == 0 and rows[0]["reward_scorer"] == "ArithmeticTask.reward, the task's own"
  assert not any("reward_scorer" in r for r in rows[1:])


def test_a_run_saves_its_config_metrics_and_a_usable_final_model(finished_run):
  logdir, summary = finished_run
  saved = json.loads((logdir / "config.json").read_text())
  assert saved["trainer"]["steps"] == 2 and saved["model"]["hidden_size"] == 32
  assert "logdir" not in saved and "resume" not in saved
  assert metric_steps(logdir) == [1, 2] and summary["step"] == 2
  # the default job keeps no history store and draws fresh problems: nothing of either shows
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  assert not any(k.startswith("history") or k == "epoch" for row in rows for k in row)
  assert "history" not in checkpoint_metadata(logdir, 2)
  assert saved["task"]["num_prompts"] == 0 and saved["drafter"] == "none"
  # the final model carries its tokenizer: generate runs on it with a text prompt
  cfg = load_config_file(ROOT / "configs" / "tiny_generate.py")
  cfg.model.path = str(logdir / "final_model")
  cfg.rollout.update(max_batch=2, max_new_tokens=8, precompile=False)
  cfg.sampling.update(max_new_tokens=8, temperature=0.0)
  out = generate.run(cfg, prompts=["12+3=?", "7-5=?"])
  assert len(out["texts"]) == 2 and all(isinstance(t, str) for t in out["texts"])
  assert out["tokens"] > 0


def test_resume_of_a_finished_run_uses_its_saved_config_and_does_nothing(finished_run):
  logdir, _ = finished_run
  before = {p.name: p.stat().st_mtime_ns for p in (logdir / "final_model").iterdir()}
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")  # the default says 80 steps
  cfg.logdir, cfg.resume = str(logdir), True
  summary = train.run(cfg, overrides=[])  # as from the command line with no overrides
  assert summary["finished"] and summary["step"] == 2 and summary["history"] == []
  after = {p.name: p.stat().st_mtime_ns for p in (logdir / "final_model").iterdir()}
  assert after == before  # no new evaluation, no rewrite of final_model


def test_resume_with_an_override_continues_and_replaces_rerun_metric_rows(finished_run, tmp_path,
                                                                          capsys):
  logdir = tmp_path / "copy"
  shutil.copytree(finished_run[0], logdir)
  # a run killed after logging step 3 but before its checkpoint: the row is re-done on resume
  with (logdir / "metrics.jsonl").open("a") as f:
    f.write(json.dumps({"step": 3, "reward": -1.0}) + "\n" + '{"step": 4, "rew')  # torn line
  shutil.rmtree(logdir / "final_model")
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  cfg.logdir, cfg.resume, cfg.trainer.steps = str(logdir), True, 3
  summary = train.run(cfg, overrides=["trainer.steps"])
  out = capsys.readouterr().out
  assert "trainer.steps: 2 -> 3 (override)" in out
  assert [m["step"] for m in summary["history"]] == [3]
  assert metric_steps(logdir) == [1, 2, 3]
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  assert all(r.get("reward") != -1.0 for r in rows)
  assert json.loads((logdir / "config.json").read_text())["trainer"]["steps"] == 3
  assert (logdir / "final_model" / "char_tokenizer.json").is_file()


def test_a_garbled_checkpoint_is_reported_and_the_run_resumes_from_the_last_good_one(
    finished_run, tmp_path, capsys):
  """Bytes flipped inside the newest checkpoint's largest file (same size, still readable): the
  run names it, moves it aside, resumes from the step before and ends with finite weights."""
  logdir = tmp_path / "copy"
  shutil.copytree(finished_run[0], logdir)
  garble(logdir / "checkpoints" / "2")
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  cfg.logdir, cfg.resume, cfg.trainer.steps = str(logdir), True, 3
  summary = train.run(cfg, overrides=["trainer.steps"])
  out = capsys.readouterr().out
  assert "checkpoints/2" in out and "corrupt" in out.lower()
  assert "resumed from" in out and "checkpoints/1" in out
  assert [m["step"] for m in summary["history"]] == [2, 3]
  assert all(np.isfinite(m["loss"]) for m in summary["history"])
  # the bad step is kept aside for inspection; rotation (keep 2) holds the new steps 2 and 3
  assert sorted(p.name for p in (logdir / "checkpoints").iterdir()) == ["2", "2.corrupt", "3"]
  assert metric_steps(logdir) == [1, 2, 3]


def test_resume_config_takes_only_the_named_overrides():
  saved = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  saved.trainer.steps, saved.trainer.learning_rate = 40, 2e-5
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  cfg.trainer.steps, cfg.trainer.learning_rate = 80, 1e-4
  merged, notes = resume_config(cfg, saved, overrides=["trainer.learning_rate"])
  assert merged.trainer.steps == 40 and merged.trainer.learning_rate == 1e-4
  assert notes == ["  trainer.learning_rate: 2e-05 -> 0.0001 (override)"]
  merged, _ = resume_config(cfg, saved, overrides=None)  # API: every difference counts
  assert merged.trainer.steps == 80


def test_a_run_saved_before_a_field_existed_resumes_as_it_began():
  """A reasoning-gym run saved before ``task.eval_share`` existed drew its training problems from
  every question; resumed, it keeps doing so (the field's default would set a share aside
  mid-run) unless the command line sets the field."""
  cfg = load_config_file(ROOT / "configs" / "smollm2_reasoning_gym.py")
  saved = load_config_file(ROOT / "configs" / "smollm2_reasoning_gym.py")
  del saved.task["eval_share"]
  merged, notes = resume_config(cfg, saved, overrides=[])
  assert cfg.task.eval_share > 0 and merged.task.eval_share == 0.0
  assert notes == ["  task.eval_share=0.0: the run was saved before the field existed, so it goes "
                   "on as it began"]
  merged, _ = resume_config(cfg, saved, overrides=["task.eval_share"])
  assert merged.task.eval_share == cfg.task.eval_share
  merged, notes = resume_config(cfg, cfg, overrides=[])  # saved with the field: as saved
  assert merged.task.eval_share == cfg.task.eval_share and not notes


def test_a_resume_may_change_the_drafters_training_but_not_the_drafter_or_the_model():
  # the checkpoint's arrays fix the model's fields and which drafter the run trains; how the
  # drafter trains (drafter_training.*, a name that merely starts like "drafter") is free
  saved = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  for name, value, allowed in (("drafter_training.serial_steps", 16, True),
                               ("drafter_training.learning_rate", 1e-4, True),
                               ("rollout.max_batch", 4, True),
                               ("drafter", "eagle", False),
                               ("model.hidden_size", 64, False)):
    cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
    section, _, field = name.rpartition(".")
    where = cfg[section] if section else cfg
    assert field in where and where[field] != value, name  # a real field, really changed
    where[field] = value
    if allowed:
      check_resume_overrides(saved, cfg)
    else:
      with pytest.raises(ConfigError, match=rf"--config\.{re.escape(name)}=.* conflicts with the "
                                            "run's saved config"):
        check_resume_overrides(saved, cfg)


def test_the_run_config_is_replaced_atomically(tmp_path, monkeypatch):
  """config.json is synced under another name and renamed over the old one: a crash while it is
  written leaves the old config whole (a resume reads it)."""
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  path = tmp_path / "run" / CONFIG_FILE
  path.parent.mkdir()
  path.write_text('{"trainer": {"steps": 1}}\n')
  assert_written_atomically(path, lambda: save_run_config(cfg, path.parent), monkeypatch)
  assert read_json_config(path).trainer.steps == cfg.trainer.steps


def test_resume_without_a_checkpoint_is_refused(tmp_path):
  """Neither a checkpoint nor a config.json (with a config.json: tests/test_restart_path.py):
  refused, and the logdir's files stay where they are."""
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "notes.txt").write_text("mine")
  cfg = tiny_config(tmp_path / "empty", resume=True)
  with pytest.raises(ConfigError, match=r"holds no run \(no checkpoint, no config.json\); drop "
                                        r"--config.resume to start a new run there"):
    train.run(cfg)
  assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["notes.txt"]


@pytest.fixture
def no_work(monkeypatch):
  """Fails the test if the job gets as far as building a model."""
  def refuse(*args, **kwargs):
    raise AssertionError("the job started working before validating its config")
  monkeypatch.setattr(runner, "init_model", refuse)


@pytest.mark.parametrize("where", ["", "task", "model", "sft", "grpo", "trainer", "rollout",
                                   "history", "suffix"])
def test_unknown_keys_in_every_section_are_rejected_before_work(tmp_path, no_work, where):
  cfg = tiny_config(tmp_path)
  (cfg[where] if where else cfg).typo_field = 1
  with pytest.raises(ConfigError, match=r"unknown keys \['typo_field'\]"):
    train.run(cfg)


@pytest.mark.parametrize("field, value, match", [
    ("sft.steps", -5, r"config.sft: SFTConfig.steps must be an int >= 0"),
    ("sft.learning_rate", -1.0, r"config.sft: SFTConfig.learning_rate must be > 0"),
    ("sft.rows", 0, r"config.sft.rows must be a positive int, got 0"),
    ("mesh_devices", -1, r"config.mesh_devices must be an int >= 0"),
    ("distributed", "yes", r"config.distributed must be True or False, got 'yes'"),
    ("distributed_timeout_s", 0, (r"config.distributed_timeout_s must be a finite number of "
                                  r"seconds > 0, got 0")),
    ("drafter", "eagle4", (r"config.drafter must be 'none', 'ngram' \(model-free drafting\), "
                           r"'eagle' or 'eagle3' \(a learned drafter of that architecture .* "
                           r"or the directory of a drafter saved by .*save_drafter; 'eagle4' is "
                           r"not an existing directory")),
    ("drafter", "eagle3+ngram", r"config.drafter must be .*'eagle3'.*; 'eagle3\+ngram' is not an "
                                r"existing directory \(or 'suffix'.* or '<eagle, eagle3 or a "
                                r"drafter directory>\+suffix'"),
    ("rollout_devices", -1, r"config.rollout_devices must be an int >= 0"),
    ("drafter_training.rows", 0, r"config.drafter_training.rows must be a positive int"),
    ("drafter_training.online", "yes", r"config.drafter_training.online must be 'auto', True"),
    ("drafter_training.savings_share", 1.5,
     r"config.drafter_training.savings_share must be in \[0, 1\], got 1.5"),
    ("drafter_training.serial_steps", -1,
     r"config.drafter_training.serial_steps must be an int >= 0, got -1"),
    ("drafter_training.serial_seconds", 2.0,
     r"config.drafter_training.serial_seconds is a fixed budget: set serial_budget='fixed'"),
    ("drafter_training.online", True, r"drafter_training.online=True needs a learned drafter"),
    ("rollout.strategies", ((2, 1, 3),), r"config.rollout.strategies needs a drafter"),
    ("rollout.strategies", (2, 1, 3), (r"config.rollout.strategies must be a list of \[depth, "
                                       r"topk, verify_tokens\] triples.*written \(\(2, 1, 3\),\)")),
    ("rollout.strategies", ((2, 1, 4),), (r"config.rollout.strategies\[0\] = \(2, 1, 4\): "
                                          r"SpecConfig.verify_tokens must be depth \+ 1")),
    ("rollout.strategies", ((2, 1),), (r"config.rollout.strategies\[0\] must be a \[depth, "
                                       r"topk, verify_tokens\] triple, got \(2, 1\)")),
    ("rollout.tuner.kind", "greedy", (r"config.rollout.tuner.kind must be one of 'cost', "
                                      r"'beg_mab', 'ucb1', 'fixed', got 'greedy'")),
    ("rollout.tuner.epsilon", 2.0, r"config.rollout.tuner.epsilon must be in \[0, 1\]"),
    ("rollout.verify", "exact", r"config.rollout.verify must be one of"),
    ("rollout.segment_steps", -1, r"config.rollout.segment_steps must be an int >= 0"),
    ("rollout.sd_max_batch", 0, r"config.rollout.sd_max_batch must be a positive int"),
    # checks that need the devices or the task's prompts, still before the warm start
    ("trainer.minibatches", 3, (r"config.trainer.prompts_per_step x config.grpo.group_size = \d+ "
                                r"rows must split into config.trainer.minibatches=3 minibatches "
                                r".*\(config.mesh_devices sets how many\)")),
    ("rollout_devices", 99, r"config.rollout_devices=99 but the mesh has \d+ devices"),
    ("mesh_devices", 99, r"config.mesh_devices=99 but only \d+ devices are visible"),
    ("rollout.max_prompt_len", 6, (r"config.rollout.max_prompt_len=6 is shorter than the task's "
                                   r"prompts: a .*problem.* has \d+ tokens .*at least \d+")),
    ("trainer.learning_rate", float("inf"), r"learning_rate must be a finite number > 0"),
    # epoch mode, the history store and the suffix drafter
    ("task.num_prompts", -1, r"config.task.num_prompts must be an int >= 0 \(0: fresh problems"),
    ("task.num_prompts", 2, (r"config.task.num_prompts \(2\) is fewer than prompts_per_step "
                             r"\(4\): every step would repeat a prompt")),
    ("history.max_bytes", 0, r"config.history.max_bytes must be a positive int, got 0"),
    ("history.per_prompt", 2.5, r"config.history.per_prompt must be a positive int, got 2.5"),
    ("suffix.depth", 0, r"config.suffix.depth must be a positive int, got 0"),
    ("suffix.min_ngram", 9, (r"config.suffix: SuffixConfig.min_ngram \(9\) must be <= "
                             r"SuffixConfig.max_ngram")),
    ("drafter", "ngram+suffix", (r"config.drafter='ngram\+suffix': the suffix drafter already "
                                 r"drafts from the group's sibling responses.*use 'suffix'")),
    ("drafter", "none+suffix", r"config.drafter='none\+suffix': the suffix drafter alone is "
                               r"'suffix'"),
    ("drafter", "no/such+suffix", r"config.drafter must be .*; 'no/such' is not an existing "
                                  r"directory \(or 'suffix'"),
    ("rollout.suffix_strategies", ((2, 1, 3),), (r"config.rollout.suffix_strategies needs the "
                                                 r"suffix drafter.*; config.drafter picks the "
                                                 r"drafters: .*or 'suffix'")),
    ("rollout.suffix_strategies", ((2, 1, 4),), (r"config.rollout.suffix_strategies\[0\] = "
                                                 r"\(2, 1, 4\): SpecConfig.verify_tokens")),
])
def test_bad_values_are_rejected_before_work(tmp_path, no_work, field, value, match):
  cfg = tiny_config(tmp_path)
  *parents, key = field.split(".")
  target = cfg
  for part in parents:
    target = target[part]
  with target.ignore_type():
    target[key] = value
  with pytest.raises(ConfigError, match=match):
    train.run(cfg)


@pytest.fixture(scope="module")
def saved_drafter(tmp_path_factory):
  """A randomly initialised drafter, saved for the tiny config's policy."""
  path = tmp_path_factory.mktemp("drafter") / "drafter"
  job = build_job(tiny_config(path.parent / "unused"))
  save_drafter(Drafter.create(job.model_config, seed=1), path)
  return path


def test_unusable_drafters_are_rejected_before_work(tmp_path, no_work, saved_drafter):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ConfigError, match=r"config.drafter .*empty does not load as a drafter of "
                                        r"this policy: No drafter.safetensors"):
    train.run(tiny_config(tmp_path / "a", drafter=str(empty)))
  cfg = tiny_config(tmp_path / "b", drafter=str(saved_drafter))
  cfg.model.hidden_size = 64  # another policy than the drafter was made for
  with pytest.raises(ConfigError, match=r"config.drafter .* does not load .*hidden_size=32"):
    train.run(cfg)
  cfg = tiny_config(tmp_path / "c", drafter="ngram")
  cfg.rollout.strategies = ((2, 2, 3),)  # a tree: the n-gram drafter drafts only chains
  with pytest.raises(ConfigError, match=r"config.rollout.strategies .* ngram drafter drafts "
                                        r"chains"):
    train.run(cfg)


def test_a_published_speculators_drafter_warm_starts_the_online_one(tmp_path):
  """config.drafter may name a speculators eagle3 checkpoint (as vLLM serves): it loads as the
  job's EAGLE-3 drafter, weights as published; one made for another model is refused in one
  line naming both sides."""
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.speculators_format import export_speculators  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.transformer import init_model  # pylint: disable=import-outside-toplevel
  config = build_job(tiny_config(tmp_path / "unused")).model_config
  hf.save_pretrained(init_model(config), config, tmp_path / "verifier")
  published = Eagle3Drafter.create(config, seed=2)
  export_speculators(published, tmp_path / "verifier", tmp_path / "published")
  cfg = tiny_config(tmp_path / "run", drafter=str(tmp_path / "published"))
  with cfg.drafter_training.ignore_type():
    cfg.drafter_training.online = True
  job = build_job(cfg)
  assert isinstance(job.drafter, Eagle3Drafter) and job.drafter_training is not None
  assert job.drafter.feature_layers == published.feature_layers
  want, got = drafter_params(published), drafter_params(job.drafter)
  assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
  cfg.model.hidden_size = 2 * config.hidden_size
  with pytest.raises(ConfigError, match=rf"hidden_size={config.hidden_size} but the target has "
                                        rf"hidden_size={2 * config.hidden_size}") as err:
    build_job(cfg)
  assert "\n" not in str(err.value)


def test_the_suffix_drafter_s_mistakes_are_rejected_before_work(tmp_path, no_work):
  cfg = tiny_config(tmp_path / "a", drafter="suffix")
  cfg.rollout.strategies = ((2, 1, 3),)  # the learned drafter's strategies, and there is none
  with pytest.raises(ConfigError, match=r"config.rollout.strategies needs a drafter.*; the suffix "
                                        r"drafter's strategies are config.rollout.suffix_strategies"):
    train.run(cfg)
  cfg = tiny_config(tmp_path / "b", drafter="suffix")
  with cfg.drafter_training.ignore_type():
    cfg.drafter_training.online = True
  with pytest.raises(ConfigError, match=r"drafter_training.online=True needs a learned drafter"):
    train.run(cfg)
  from tests.rl.test_external_tasks import DATA  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(tmp_path / "c")
  cfg.task = dict(kind="math_dataset", path=str(DATA), num_prompts=6)
  cfg.trainer.eval_problems = 2
  # 5 records, one held out for evaluation (task.eval_share=0.1, one question at least)
  with pytest.raises(ConfigError, match=r"config.task.num_prompts=6: math:gsm8k_tiny has 4 "
                                        r"training problems \(1 more held out for evaluation\), "
                                        r"fewer than the 6 distinct ones asked for"):
    train.run(cfg)


@pytest.mark.parametrize("drafter", ["none", "suffix", "eagle+suffix", "eagle3+suffix",
                                     "saved+suffix"])
def test_the_job_hands_the_trainer_its_suffix_drafter_and_history(tmp_path, monkeypatch,
                                                                 saved_drafter, drafter):
  """config.drafter's suffix part becomes the trainer's ``suffix=`` (config.suffix's fields), and
  config.history its ``history=``; the learned part stays the drafter (and trains online when it
  is 'eagle')."""
  cfg = tiny_config(tmp_path, drafter=drafter.replace("saved", str(saved_drafter)),
                    task=dict(max_digits=3, num_prompts=8))
  cfg.suffix.update(depth=5, history_len=64)
  cfg.history.update(max_bytes=12345, per_prompt=3)
  job = build_job(cfg)
  given = {}
  monkeypatch.setattr(runner, "GRPOTrainer", lambda *args, **kwargs: given.update(kwargs))
  runner.make_trainer(job, None, None)
  suffix = None if drafter == "none" else SuffixConfig(depth=5, history_len=64)
  assert given["suffix"] == suffix and job.suffix == suffix
  assert given["history"] == HistoryConfig(max_bytes=12345, per_prompt=3)
  assert job.trainer.num_prompts == 8
  learned = drafter.split("+")[0]
  assert isinstance(given["drafter"], Drafter) == (learned in ("eagle", "eagle3", "saved"))
  assert isinstance(given["drafter"], Eagle3Drafter) == (learned == "eagle3")
  assert (given["drafter_training"] is not None) == (learned in ("eagle", "eagle3"))
  if learned in ("eagle", "eagle3"):  # a fresh drafter's strategies, as without "+suffix"
    assert job.engine.strategies == (SpecConfig(depth=3, topk=1, verify_tokens=4),)


def test_a_history_store_too_small_for_an_epoch_is_noted(tmp_path):
  cfg = tiny_config(tmp_path, drafter="suffix", task=dict(max_digits=3, num_prompts=8))
  cfg.history.max_bytes = 4000  # 8 prompts x 2 completions x 16 tokens need 8 x 512 bytes
  note = console.history_room_note(build_job(cfg))
  assert note.startswith("note: history.max_bytes=4000 holds less than an epoch's completions at "
                         "full length (4096 bytes for 8 prompts x 2 completions x 16 tokens)")
  cfg.history.max_bytes = 4096
  assert console.history_room_note(build_job(cfg)) is None
  cfg.task.num_prompts = 0  # fresh problems: no epoch to hold
  cfg.history.max_bytes = 10
  assert console.history_room_note(build_job(cfg)) is None


def checkpoint_metadata(logdir, step: int) -> dict:
  """Checkpoint ``step``'s metadata (orbax writes it as a JSON file)."""
  path = pathlib.Path(logdir) / "checkpoints" / str(step) / "metadata" / "metadata"
  return json.loads(path.read_text())


def untimed_rows(logdir) -> list[dict]:
  rows = [json.loads(line) for line in (pathlib.Path(logdir) / "metrics.jsonl").open()]
  return [{k: v for k, v in r.items() if metric_kind(k) != "timed" and k != "compiles"}
          for r in rows]


def test_epoch_mode_with_a_history_store_resumes_the_store_exactly(tmp_path, monkeypatch, capsys):
  """The job in epoch mode (4 prompts, 4 a step) with an engine that drafts from history (here
  one that says so and ignores it): every prompt has history from step 2 on; a run resumed from
  step 2's checkpoint redoes step 3 with the same store (its metrics and the store it saves)."""
  monkeypatch.setattr(RolloutEngine, "uses_history", property(lambda self: True))
  logdir = tmp_path / "run"
  cfg = tiny_config(logdir, task=dict(max_digits=3, num_prompts=4))
  cfg.trainer.steps = 3
  cfg.history.per_prompt = 3
  train.run(cfg)
  out = capsys.readouterr().out
  assert "data: epoch mode, 4 fixed problems visited once per epoch, 4 per step" in out
  assert "history hits 100% of prompts" in out and "the suffix drafter drafts from" in out
  rows = [r for r in untimed_rows(logdir) if "reward" in r]
  assert [r["epoch"] for r in rows] == [0, 1, 2]
  assert [r["history_hit_rate"] for r in rows] == [0.0, 1.0, 1.0]
  assert [r["history_prompts"] for r in rows] == [4, 4, 4]
  store = checkpoint_metadata(logdir, 3)["history"]
  assert [len(lengths) for _, lengths in store["prompts"]] == [3] * 4  # 3 of the 3 steps' 2 rows

  copy = tmp_path / "copy"
  shutil.copytree(logdir, copy)
  shutil.rmtree(copy / "checkpoints" / "3")
  shutil.rmtree(copy / "final_model")
  again = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  again.logdir, again.resume = str(copy), True
  train.run(again, overrides=[])
  assert "resumed from" in capsys.readouterr().out
  assert untimed_rows(copy) == untimed_rows(logdir)
  assert checkpoint_metadata(copy, 3)["history"] == store


def test_a_fixed_tuner_naming_an_arm_not_offered_is_rejected_before_work(tmp_path, no_work):
  cfg = tiny_config(tmp_path, drafter="ngram")
  cfg.rollout.strategies = ((2, 1, 3),)
  cfg.rollout.tuner.update(kind="fixed", fixed=((8, "chain d2"),))  # n-gram chains: "ngram d2"
  with pytest.raises(ConfigError, match=r"config.rollout.tuner.fixed maps bucket 1 to 'chain d2', "
                                        r"which is not offered there; offered arms: "
                                        r"\['vanilla', 'ngram d2'\]"):
    train.run(cfg)


def test_a_refused_resume_writes_nothing(finished_run, tmp_path):
  """A resume whose override does not fit the checkpoint fails and leaves config.json and
  metrics.jsonl as they were (a plain resume then still works)."""
  logdir = tmp_path / "copy"
  shutil.copytree(finished_run[0], logdir)
  shutil.rmtree(logdir / "final_model")  # unfinished, so the resume restores
  before = {name: (logdir / name).read_bytes() for name in ("config.json", "metrics.jsonl")}
  cfg = tiny_config(logdir, resume=True)
  cfg.model.hidden_size = 64  # the checkpoint's policy has 32: refused before anything loads
  with pytest.raises(ValueError):
    train.run(cfg, overrides=["model.hidden_size"])
  assert {name: (logdir / name).read_bytes() for name in before} == before
  # an override the saved config allows, but no checkpoint restores (each one's arrays damaged):
  # the run fails at the restore itself, and config.json still holds the run's steps
  for array in (logdir / "checkpoints").rglob("*"):
    if array.is_file() and array.suffix not in (".json",) and array.stat().st_size > 64:
      array.write_bytes(b"\0" * array.stat().st_size)
  cfg = tiny_config(logdir, resume=True)
  cfg.trainer.steps = 5
  with pytest.raises(CheckpointError, match="no good checkpoint left"):
    train.run(cfg, overrides=["trainer.steps"])
  assert {name: (logdir / name).read_bytes() for name in before} == before


def test_a_new_run_in_a_logdir_with_checkpoints_is_refused(finished_run):
  """Without --config.resume a logdir that holds checkpoints is refused before any work, with
  the flag that continues it, and nothing there changes (the kill/resume tests resume such a
  logdir)."""
  logdir = finished_run[0]
  before = {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file()}
  with pytest.raises(ConfigError, match=r"already holds checkpoints \(latest step 2\); pass "
                                        r"--config.resume=True to continue that run"):
    train.run(tiny_config(logdir))
  assert {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file()} == before


class FakeTrainer:
  """What ``loop.train_steps`` uses of a GRPOTrainer; ``step`` runs ``on_step(step)`` first."""

  def __init__(self, on_step=lambda step: None):
    self.step_count, self.saved, self.on_step = 0, [], on_step
    self.config = types.SimpleNamespace(eval_problems=1, temperature=1.0, eval_pass_k=0,
                                         eval_pass_problems=0)
    self.last_lengths = np.zeros(1, np.int64)

  def evaluate(self, **kwargs):
    return 0.5

  def step(self):
    self.on_step(self.step_count + 1)
    self.step_count += 1
    return dict(step=self.step_count, reward=0.5, loss=0.0, len_p50=1, len_p90=1, len_max=1,
                rollout_s=0.0, tail_s=0.0, last_s=0.0, update_s=0.0, step_s=0.0)

  def save(self, checkpointer, metadata=None):
    self.saved.append(self.step_count)
    checkpointer.steps.append(self.step_count)


class FakeCheckpointer:
  def __init__(self, steps=()):
    self.steps = list(steps)

  def latest_step(self):
    return self.steps[-1] if self.steps else None

  def step_dir(self, step):
    return f"checkpoints/{step}"


class FakeLog:
  def __init__(self):
    self.rows = []

  def write(self, step, metrics):
    self.rows.append((step, metrics))


def fake_job(tmp_path, steps=4, checkpoint_every=0):
  return types.SimpleNamespace(cfg=tiny_config(tmp_path, checkpoint_every=checkpoint_every),
                               checkpoint_every=checkpoint_every,
                               trainer=TrainerConfig(steps=steps), logdir=tmp_path,
                               drafter_save_every=0, task=ArithmeticTask())


@pytest.mark.parametrize("checkpoints, advice", [
    ((), r"run the job again \(no checkpoint was written yet, so it starts over\)"),
    ((2,), r"resume from step 2: continue with: python -m tlt_jax.train --config.logdir=.* "
           r"--config.resume=True"),
])
def test_a_non_finite_update_advises_what_works(tmp_path, checkpoints, advice):
  """The advice names a config field that exists and a resume only where there is a checkpoint
  (the command line takes the field: test_mistakes_are_one_line_errors_without_traceback)."""
  def diverge(step):
    raise NonFiniteUpdateError(f"RL step {step}: 1 of 2 policy updates were not finite")
  with pytest.raises(NonFiniteUpdateError, match=advice + r" and add "
                     r"--config.trainer.on_nonfinite=skip .* or a lower "
                     r"--config.trainer.learning_rate"):
    loop.train_steps(FakeTrainer(diverge), fake_job(tmp_path), FakeCheckpointer(checkpoints),
                 FakeLog())
  assert "on_nonfinite" in load_config_file(ROOT / "configs" / "tiny_grpo.py").trainer


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_rl_stops_after_the_step_in_flight_and_saves_it(tmp_path, sig):
  """The first SIGTERM/SIGINT lets step 2 finish, checkpoints it (checkpoint_every=0 would save
  only at the end) and stops with 128 + the signal; a second one stops at once."""
  trainer = FakeTrainer(lambda step: os.kill(os.getpid(), sig) if step == 2 else None)
  log = FakeLog()
  with StopSignals() as stop:
    with pytest.raises(Interrupted, match=rf"stopped by {sig.name} after step 2, saved as "
                                                r"checkpoints/2; continue with") as e:
      loop.train_steps(trainer, fake_job(tmp_path), FakeCheckpointer(), log, stop=stop)
  assert e.value.exit_code == 128 + sig and trainer.saved == [2]
  assert [step for step, _ in log.rows] == [0, 1, 2]  # the start evaluation, then both steps

  def twice(step):
    if step == 2:
      os.kill(os.getpid(), sig)
      os.kill(os.getpid(), sig)
  trainer = FakeTrainer(twice)
  before = signal.getsignal(signal.SIGTERM)
  with StopSignals() as stop:
    with pytest.raises(Interrupted, match=r"interrupted during step 2; no checkpoint was "
                                                r"written yet") as e:
      loop.train_steps(trainer, fake_job(tmp_path), FakeCheckpointer(), FakeLog(), stop=stop)
  assert e.value.exit_code == 128 + sig and trainer.saved == []
  assert signal.getsignal(signal.SIGTERM) == before  # handlers restored


def test_periodic_evaluations_go_into_their_steps_rows_before_the_save(tmp_path):
  """eval_every=2: step 2's row carries its held-out figures, steps 1 and 3 none; a signal in
  step 3 stops after saving it (nothing evaluated twice). A second signal during a periodic
  evaluation stops at once with that step unsaved, so a resume redoes step and evaluation."""
  job = fake_job(tmp_path)
  job.trainer = TrainerConfig(steps=4, eval_every=2)
  trainer = FakeTrainer(lambda step: os.kill(os.getpid(), signal.SIGTERM) if step == 3 else None)
  log = FakeLog()
  with StopSignals() as stop:
    with pytest.raises(Interrupted, match="stopped by SIGTERM after step 3"):
      loop.train_steps(trainer, job, FakeCheckpointer(), log, stop=stop)
  assert [(step, "eval_accuracy" in m) for step, m in log.rows] == [
      (0, True), (1, False), (2, True), (3, False)]
  assert trainer.saved == [3]

  trainer = FakeTrainer()
  def signal_twice(**kwargs):
    if trainer.step_count == 2:
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGTERM)
    return 0.5
  trainer.evaluate = signal_twice
  with StopSignals() as stop:
    with pytest.raises(Interrupted, match="after step 2, during its held-out evaluation"):
      loop.train_steps(trainer, job, FakeCheckpointer(), FakeLog(), stop=stop)
  assert trainer.saved == []


def test_a_checkpoint_is_due_every_checkpoint_every_steps_and_after_the_last(tmp_path):
  job = fake_job(tmp_path, steps=5, checkpoint_every=2)
  assert [step for step in range(1, 6) if loop.checkpoint_due(job, step)] == [2, 4, 5]
  job = fake_job(tmp_path, steps=5)  # checkpoint_every=0: the last step only
  assert [step for step in range(1, 6) if loop.checkpoint_due(job, step)] == [5]


class KeptRows:
  """A resumed run's metrics log: the rows of the earlier run, nothing written."""

  def __init__(self, rows):
    self.kept = rows

  def rows(self):
    return list(self.kept)

  def write(self, step, metrics):
    raise AssertionError(f"wrote step {step}'s row")


def test_a_resumed_run_reads_its_start_figures_from_step_0_s_row(tmp_path):
  """Not evaluated again: step 0's row with held-out figures gives them (NaN without one)."""
  trainer = FakeTrainer()
  trainer.step_count = 3
  trainer.evaluate = lambda **kwargs: pytest.fail("the start was evaluated again")
  rows = [dict(step=0, note="a row without figures"),
          dict(step=0, eval_accuracy=0.25, eval_sampled_reward=0.5, eval_pass_at_8=0.625,
               reward=0.1),
          dict(step=2, eval_accuracy=0.75, eval_sampled_reward=0.875)]
  steps = loop.Steps(trainer, fake_job(tmp_path), FakeCheckpointer(), KeptRows(rows), None,
                        StopSignals())
  assert steps.evaluate_at_start() == dict(eval_accuracy=0.25, eval_sampled_reward=0.5,
                                           eval_pass_at_8=0.625)
  steps.log = KeptRows(rows[:1] + rows[2:])
  assert np.isnan(list(steps.evaluate_at_start().values())).all()


def test_pass_at_k_takes_the_first_eval_pass_problems_of_the_larger_held_out_set(tmp_path,
                                                                                monkeypatch):
  """eval_problems=4, eval_pass_problems=2: greedy and sampled evaluation decode the 4 held-out
  problems, pass@3 three samples of each of the first 2 (a real trainer, its engine faked)."""
  from tests.rl.test_trainer import make_trainer  # pylint: disable=import-outside-toplevel
  trainer = make_trainer(temperature=1.0, eval_problems=4, eval_pass_k=3, eval_pass_problems=2)
  calls = []

  def generate(prompts, sampling, **_):
    calls.append(([tuple(p) for p in prompts], sampling.temperature))
    return types.SimpleNamespace(tokens=[[] for _ in prompts], logprobs=[[] for _ in prompts])

  monkeypatch.setattr(trainer.engine, "generate", generate)
  log = FakeLog()
  figures = loop.Steps(trainer, fake_job(tmp_path), FakeCheckpointer(), log, None,
                         StopSignals()).evaluate()
  held = [tuple(trainer.encode_prompt(p)) for p in eval_problems(trainer.task, 4, EVAL_SEED)]
  assert len(set(held)) == 4
  assert calls == [(held, 0.0), (held, 1.0), ([p for p in held[:2] for _ in range(3)], 1.0)]
  assert set(figures) == {"eval_accuracy", "eval_sampled_reward", "eval_pass_at_3"}
  assert log.rows == [(0, figures)]


def test_precompile_compiles_rollout_update_and_drafter_and_says_how_long():
  order = []

  class Engine:
    config = types.SimpleNamespace(precompile_scope="all")

    def executable_keys(self):
      return ["prefill", "segment"]

    def precompile(self, progress=None, background=False, first_rows=None):
      assert background  # the SD arms compile off the first step's critical path
      assert first_rows == [4, 8]  # the first requests' rows: the engine's scope decides
      order.append("rollout")
      if progress is not None:
        progress(1, 2)
        progress(2, 2)
      return 2

  def trainer(drafter_devices):
    return types.SimpleNamespace(
        engine=Engine(), precompile_update=lambda progress=None: order.append("update") or 3,
        precompile_drafter=lambda: order.append("drafter") or drafter_devices,
        policy=types.SimpleNamespace(executable_keys=lambda: [1, 2, 3]),
        first_request_rows=lambda: [4, 8], online=None)

  done = precompile_lib.precompile(trainer(0))
  assert order == ["update", "drafter", "rollout"]  # the rollout's background compile last
  assert (done.rollout, done.update, done.drafter_devices) == (2, 3, 0)
  assert min(done.rollout_s, done.update_s, done.drafter_s) >= 0
  assert re.fullmatch(r"compiled 2 rollout executables in \d+s, 3 policy-update executables in "
                      r"\d+s", done.line()), done.line()
  done = precompile_lib.precompile(trainer(2), progress=True)  # with its bar on stderr
  assert re.fullmatch(r"compiled 2 .* in \d+s, the drafter's steps for 2 device\(s\) in \d+s",
                      done.line()), done.line()


def test_a_drafter_saved_for_another_policy_is_named_in_a_warning(tmp_path, monkeypatch, capsys):
  """Checked against the policy RL starts from (after the warm start), before the trainer."""
  job = build_job(tiny_config(tmp_path / "unused"))
  other = runner.init_model(job.model_config, seed=7)  # same shape, other weights
  save_drafter(Drafter.create(job.model_config, seed=1), tmp_path / "for_other", policy=other,
               policy_name="another run")
  def stop(*args, **kwargs):
    raise RuntimeError("stopped before the trainer")
  monkeypatch.setattr(runner, "GRPOTrainer", stop)
  with pytest.raises(RuntimeError, match="stopped before the trainer"):
    train.run(tiny_config(tmp_path / "run", drafter=str(tmp_path / "for_other")))
  out = capsys.readouterr().out
  assert "warning: drafter " in out and "(another run), not for this one" in out, out[-2000:]


def checkpoint_tuner(logdir, step: int) -> dict:
  """The tuner state in checkpoint ``step``'s metadata (orbax writes it as a JSON file)."""
  metadata = pathlib.Path(logdir) / "checkpoints" / str(step) / "metadata" / "metadata"
  return json.loads(metadata.read_text())["tuner"]


@pytest.mark.slow
def test_a_run_with_a_saved_drafter_and_strategies_resumes_them_and_the_tuner(
    saved_drafter, tmp_path, capsys):
  """The adaptive engine in the main job: SD and per-arm metrics in metrics.jsonl, the drafter,
  strategies and tuner settings round-trip through config.json, and the resumed run's tuner goes
  on from the checkpoint's (its reward windows extend the saved ones)."""
  logdir = tmp_path / "run"
  cfg = tiny_config(logdir, drafter=str(saved_drafter))
  cfg.rollout.update(strategies=((2, 1, 3),), segment_steps=4,
                     batch_buckets=(8,))  # one batch bucket: few executables to compile
  # every arm offered from the first step (the calibration would offer this CPU none at batch 8)
  cfg.rollout.sd_offers = "all"
  cfg.rollout.tuner.window = 1000  # every reward stays in the windows
  cfg.trainer.steps = 1
  first = train.run(cfg)
  saved = json.loads((logdir / "config.json").read_text())
  assert saved["drafter"] == str(saved_drafter)
  assert saved["rollout"]["strategies"] == [[2, 1, 3]] and saved["rollout"]["segment_steps"] == 4
  assert saved["rollout"]["tuner"]["window"] == 1000
  row = [json.loads(line) for line in (logdir / "metrics.jsonl").open()][1]
  assert row == first["history"][0]
  assert {"sd_switches", "sd_switch_s", "arm_steps/8/vanilla", "arm_steps/8/chain_d2"} <= set(row)
  # an accepted length only where a speculative step ran (not 0.0 for a vanilla-only rollout)
  assert ("mean_accept_len" in row) == (row["arm_steps/8/chain_d2"] > 0), row
  tuner_1 = checkpoint_tuner(logdir, 1)
  assert tuner_1["kind"] == "cost" and tuner_1["buckets"]["8"]["decisions"] > 0

  capsys.readouterr()
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")  # no drafter, no strategies
  cfg.rollout.batch_buckets = (8,)  # (not a field of the default file: a user's file has it)
  cfg.logdir, cfg.resume, cfg.trainer.steps = str(logdir), True, 2
  summary = train.run(cfg, overrides=["trainer.steps"])
  out = capsys.readouterr().out
  assert "trainer.steps: 1 -> 2 (override)" in out and "rollout." not in out.split("config:")[0]
  assert "arm_steps/8/chain_d2" in summary["history"][0]  # the adaptive engine is back
  tuner_2 = checkpoint_tuner(logdir, 2)
  arms_1 = {name: (pulls, rewards) for name, pulls, rewards, *_ in tuner_1["buckets"]["8"]["arms"]}
  arms_2 = {name: (pulls, rewards) for name, pulls, rewards, *_ in tuner_2["buckets"]["8"]["arms"]}
  assert tuner_2["buckets"]["8"]["decisions"] > tuner_1["buckets"]["8"]["decisions"]
  for name, (pulls, rewards) in arms_1.items():
    assert arms_2[name][0] >= pulls and arms_2[name][1][:len(rewards)] == rewards, name


def test_a_logdir_that_is_a_file_is_rejected_before_work(tmp_path, no_work):
  (tmp_path / "file").write_text("x")
  with pytest.raises(ConfigError, match=r"is a file, not a directory"):
    train.run(tiny_config(tmp_path / "file"))


def test_a_broken_saved_config_names_the_file(tmp_path):
  """Without a checkpoint to take the config from (with one: test_restart_path.py)."""
  logdir = tmp_path / "run"
  logdir.mkdir()
  (logdir / "config.json").write_text("{broken")
  with pytest.raises(ConfigError, match=r"config.json is not valid JSON.*There is no checkpoint "
                                        r"to take the config from either: drop --config.resume"):
    train.run(tiny_config(logdir, resume=True))


def test_generate_rejects_a_prompt_string_instead_of_a_list():
  with pytest.raises(TypeError, match="prompts must be a list of strings"):
    generate.encode_prompts(generate.CharTokenizer("0123"), "0123")


# ---- the command line, as a user runs it ---------------------------------------------------


def cli(*args, timeout=120):
  env = subprocess_env()
  return subprocess.run([sys.executable, "-m", "tlt_jax.train", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=ROOT, env=env)


def test_help_lists_the_config_fields():
  done = cli("--help")
  assert done.returncode == 0
  steps = load_config_file(ROOT / "configs" / "tiny_grpo.py").trainer.steps
  assert f"--config.trainer.steps={steps}" in done.stdout and "--config.resume=False" in done.stdout
  assert "--config.trainer.on_nonfinite='stop'" in done.stdout
  # model.path is not a field of the default config: the help says where it comes from
  assert "A real-model config" in done.stdout and "--config.model.path" not in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--config.trainer.stepz=3"], "no such config field 'stepz'. Did you mean \"steps\""),
    (["--config.rollout.kv_buckets=(64,)"], "no such config field 'kv_buckets'"),  # no close one
    (["--config.sft.steps=-5"], "config.sft: SFTConfig.steps must be an int >= 0"),
    (["--config=missing.py"], "no config file at missing.py"),
    (["--config.drafter_training.online=True"], ("config.drafter_training.online=True needs a "
                                                 "learned drafter")),  # True from the command line
    (["--config.drafter=no/such/drafter"], ("config.drafter must be 'none', 'ngram' (model-free "
                                            "drafting), 'eagle' or 'eagle3' (a learned "
                                            "drafter of that architecture trained online from "
                                            "scratch) or the directory of a drafter saved by")),
    # the adaptive fields parse from the command line (the error is about the missing drafter)
    (["--config.rollout.strategies=((4, 1, 5), (4, 2, 8))", "--config.rollout.tuner.kind=ucb1",
      "--config.rollout.segment_steps=8"], "config.rollout.strategies needs a drafter"),
    # the field a non-finite update's advice names parses (the error is about the devices)
    (["--config.trainer.on_nonfinite=skip", "--config.rollout_devices=99"],
     "config.rollout_devices=99 but the mesh has"),
    # the suffix drafter's fields parse from the command line (the errors are about their values)
    (["--config.rollout.suffix_strategies=((2, 1, 3),)", "--config.history.per_prompt=4",
      "--config.suffix.depth=4"], "config.rollout.suffix_strategies needs the suffix drafter"),
    (["--config.task.num_prompts=2", "--config.trainer.prompts_per_step=3",
      "--config.drafter=suffix"], "config.task.num_prompts (2) is fewer than "
                                  "prompts_per_step (3)"),
])
def test_mistakes_are_one_line_errors_without_traceback(tmp_path, args, message):
  done = cli(f"--config.logdir={tmp_path / 'run'}", *args)
  assert done.returncode == 2
  assert "Traceback" not in done.stderr
  lines = done.stderr.strip().splitlines()
  assert lines[0].startswith("error: ") and message in lines[0] and len(lines) <= 2, done.stderr


@pytest.mark.slow
def test_main_job_on_four_devices_and_ctrl_c_says_how_to_resume(tmp_path):
  """The command line on 4 simulated CPU devices: the update mesh spans all of them, the rollout
  2 of them with the eagle drafter trained on idle devices; Ctrl-C (SIGINT) after two RL steps
  exits 130 and names the resume command."""
  import signal  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  logdir = tmp_path / "run"
  flat = tiny_flags()
  # the rollout data-parallel over 2 of the 4 devices, with the drafter trained online on the
  # one whose shard finishes first
  flat.update({"trainer.steps": 50, "checkpoint_every": 1, "rollout_devices": 2,
               "drafter": "eagle"})
  env = subprocess_env(4)
  proc = subprocess.Popen(
      [sys.executable, "-m", "tlt_jax.train", f"--config.logdir={logdir}",
       *[f"--config.{k}={v}" for k, v in flat.items()]],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
  lines, deadline = [], time.time() + 400
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("step    2/50") or time.time() > deadline:
        break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  stdout = "".join(lines) + out
  assert "devices: 4 x cpu" in stdout, stdout[-2000:]
  assert "rollout: data-parallel over 2 devices" in stdout, stdout[-2000:]
  assert "on the devices the tail leaves idle" in stdout, stdout[-2000:]
  assert " spot / 0 serial" in stdout, stdout[-2000:]  # the console shows the drafter's steps
  assert "step    2/50" in stdout, (stdout + err)[-3000:]
  assert proc.returncode == 130, err[-2000:]
  assert "Traceback" not in err
  assert f"--config.logdir={logdir} --config.resume=True" in err
  assert (logdir / "checkpoints" / "2" / "drafter_buffer.npz").is_file()
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  steps = [r for r in rows if "reward" in r]
  assert len(steps) >= 2 and all("drafter_spot_steps" in r and r["drafter_serial_steps"] == 0
                                 for r in steps), steps
  # the device whose shard finishes first idles until the other's does (rows on both, or none on
  # one); the idle hooks' share of it is clipped to the tail
  assert all(r["tail_idle_device_s"] > 0 for r in steps), steps
  assert all(0 <= r["tail_idle_used_device_s"] <= r["tail_idle_device_s"] for r in steps), steps


def test_final_model_is_never_written_from_non_finite_weights(tmp_path):
  """A NaN anywhere in the policy: export refuses, and an existing final_model stays intact."""
  import types  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  job = build_job(tiny_config(tmp_path))
  graphdef, params = nnx.split(runner.init_model(job.model_config, seed=0))
  def trainer_with(weights):  # what export reads of a trainer: its graphdef and gathered params
    return types.SimpleNamespace(policy=types.SimpleNamespace(graphdef=graphdef,
                                                              rollout_params=lambda: weights))
  final = export_final_model(trainer_with(params), job)
  before = (final / "model.safetensors").read_bytes()
  leaves, treedef = jax.tree.flatten(params)
  leaves[-1] = leaves[-1].at[0].set(float("nan"))
  with pytest.raises(FloatingPointError, match="non-finite"):
    export_final_model(trainer_with(jax.tree.unflatten(treedef, leaves)), job)
  assert (final / "model.safetensors").read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["final_model"]


@pytest.mark.slow
def test_eagle_drafter_trains_online_saves_resumes_and_exports(tmp_path):
  """config.drafter='eagle': the drafter trains during RL (one device: serial steps), its state
  is in every checkpoint with the data buffer, selective async saves are timed against the full
  blocking one, a resumed run continues the drafter's step count, and final_drafter/ loads."""
  logdir = tmp_path / "eagle"
  cfg = tiny_config(logdir, drafter="eagle")
  cfg.drafter_training.update(rows=2, seq_len=32, serial_steps=2, serial_budget="fixed")
  train.run(cfg)
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  steps = [r for r in rows if "reward" in r]
  assert [r["drafter_serial_steps"] for r in steps] == [2, 2]
  assert all(r["drafter_spot_steps"] == 0 and np.isfinite(r["drafter_loss"]) for r in steps)
  assert all(r["drafter_save_ms"] > 0 and r["checkpoint_save_ms"] > 0 for r in steps)
  assert (logdir / "checkpoints" / "2" / "drafter_buffer.npz").is_file()
  assert sorted(p.name for p in (logdir / "drafter_checkpoints").iterdir()) == ["1", "2"]
  drafter = load_drafter(logdir / "final_drafter")
  assert drafter.config.hidden_size == 32
  # killed after step 2's selective drafter save but before its full checkpoint: the resumed run
  # does step 2 again (its drafter save is dropped and written anew), then step 3
  shutil.rmtree(logdir / "checkpoints" / "2")
  again = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  again.logdir, again.resume = str(logdir), True
  again.trainer.steps = 3
  summary = train.run(again, overrides=["trainer.steps"])
  assert summary["step"] == 3
  from tlt_jax.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  with Checkpointer(logdir / "checkpoints") as checkpointer:
    assert checkpointer.latest_step() == 3
  last = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  assert [r["step"] for r in last if "reward" in r] == [1, 2, 3]
  assert sorted(p.name for p in (logdir / "drafter_checkpoints").iterdir()) == ["2", "3"]
  # final_drafter/ records the policy it was trained with: final_model/
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.drafter_io import drafter_policy, drafter_policy_mismatch  # pylint: disable=import-outside-toplevel
  final, _ = hf.from_pretrained(logdir / "final_model")
  assert drafter_policy(logdir / "final_drafter")["name"] == str(logdir / "final_model")
  assert drafter_policy_mismatch(logdir / "final_drafter", final) is None


def drafter_params(drafter) -> dict:
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return {path: np.asarray(v.get_value())
          for path, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}


def trainer_arguments(job, monkeypatch, latest=None) -> dict:
  """What ``runner.set_up_trainer`` hands the trainer: its keyword arguments and ``model``."""
  given = {}
  monkeypatch.setattr(runner, "GRPOTrainer",
                      lambda model, *args, **kwargs: given.update(kwargs, model=model))
  runner.set_up_trainer(job, latest, None)
  return given


def test_a_fresh_eagle3_drafter_starts_its_head_from_the_policy_rl_starts_from(
    tmp_path, monkeypatch, capsys):
  """config.drafter='eagle3': the drafter is built once, by the runner, its own head the
  warm-started policy's LM head (its other weights a fresh drafter's of the seed), the same in
  every run of the seed; a resumed run whose drafter trains online keeps the drafter build_job
  made (the checkpoint restores it), one whose drafter does not train (no checkpoint holds it)
  warm-starts again and starts the head as the first run did."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.drafter import target_head_rows  # pylint: disable=import-outside-toplevel
  job = build_job(tiny_config(tmp_path / "run", drafter="eagle3"))
  assert job.drafter is None and job.drafter_from_policy and job.drafter_training is not None
  given = trainer_arguments(job, monkeypatch)
  drafter, policy = given["drafter"], given["model"]
  assert isinstance(drafter, Eagle3Drafter) and drafter.vocab_ids is None
  rows = target_head_rows(policy, jnp.arange(job.model_config.vocab_size))
  np.testing.assert_array_equal(drafter.head.kernel.get_value(), np.asarray(rows).T)
  built = drafter_params(Eagle3Drafter.create(job.model_config, seed=job.seed))
  started = drafter_params(drafter)
  assert not np.array_equal(built[("head", "kernel")], started[("head", "kernel")])
  for path in set(built) - {("head", "kernel")}:
    np.testing.assert_array_equal(built[path], started[path], err_msg=str(path))
  again = trainer_arguments(build_job(tiny_config(tmp_path / "again", drafter="eagle3")),
                            monkeypatch)["drafter"]
  for path, value in drafter_params(again).items():
    np.testing.assert_array_equal(value, started[path], err_msg=str(path))
  capsys.readouterr()
  resumed = build_job(tiny_config(tmp_path / "run", drafter="eagle3", resume=True))
  assert isinstance(resumed.drafter, Eagle3Drafter) and not resumed.drafter_from_policy
  assert trainer_arguments(resumed, monkeypatch, latest=1)["drafter"] is resumed.drafter
  assert "warm start" not in capsys.readouterr().out  # the checkpoint holds the params
  frozen = tiny_config(tmp_path / "frozen", drafter="eagle3")
  with frozen.drafter_training.ignore_type():
    frozen.drafter_training.online = False
  first = trainer_arguments(build_job(frozen), monkeypatch)
  assert first["drafter_training"] is None
  frozen.resume = True
  capsys.readouterr()
  later = trainer_arguments(build_job(frozen), monkeypatch, latest=1)["drafter"]
  assert "warm start: 3 steps" in capsys.readouterr().out
  for path, value in drafter_params(later).items():
    np.testing.assert_array_equal(value, drafter_params(first["drafter"])[path], err_msg=str(path))


@pytest.mark.parametrize("kind", [Drafter, Eagle3Drafter], ids=["eagle", "eagle3"])
def test_the_final_exports_write_an_eagle3_drafter_for_vllm_too(tmp_path, monkeypatch, kind):
  """Beside final_drafter/, final_drafter_speculators/ (the same drafter, for final_model/) for
  an EAGLE-3 drafter; for an EAGLE-1 one the final line says in a clause why there is none."""
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  job = build_job(tiny_config(tmp_path / "run", drafter=kind.kind))
  policy = runner.init_model(job.model_config, seed=0)
  drafter = kind.create(job.model_config, seed=1)

  def final_model(trainer, job):
    hf.save_pretrained(policy, job.model_config, job.logdir / "final_model")
    return job.logdir / "final_model"

  def final_drafter(trainer, job):
    save_drafter(drafter, job.logdir / "final_drafter", policy=policy)
    return job.logdir / "final_drafter"

  monkeypatch.setattr(runner, "export_final_model", final_model)
  monkeypatch.setattr(runner, "export_final_drafter", final_drafter)
  trainer = types.SimpleNamespace(online=object(), step_count=2)
  final, extra = runner.export_run(trainer, job, job.logdir)
  served = job.logdir / "final_drafter_speculators"
  assert final == job.logdir / "final_model"
  if kind is Drafter:
    assert extra == (f", final drafter {job.logdir / 'final_drafter'} (no speculators/vLLM "
                     "export: that format holds only EAGLE-3 drafters)")
    assert not served.exists()
    return
  assert extra == f", final drafter {job.logdir / 'final_drafter'}, for vLLM {served}"
  back = load_drafter(served, job.model_config)
  assert isinstance(back, Eagle3Drafter)
  for path, value in drafter_params(drafter).items():
    np.testing.assert_array_equal(drafter_params(back)[path], value, err_msg=str(path))
  assert sorted(p.name for p in job.logdir.iterdir()) == ["final_drafter",
                                                          "final_drafter_speculators",
                                                          "final_model"]


# the full tier also runs the job with a Qwen3 policy (the fast tier has Qwen3 SD and export tests)
@pytest.mark.parametrize("architecture", ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_an_eagle3_job_trains_its_drafter_and_writes_it_for_vllm(tmp_path, capsys, architecture):
  """The tiny default job with config.drafter='eagle3' (one RL step), its policy a Qwen2 or a
  Qwen3 one: the drafter trains online, final_drafter/ loads as an Eagle3Drafter,
  final_drafter_speculators/ loads back to the same params and in the speculators package, and
  the final line names both."""
  logdir = tmp_path / "eagle3"
  cfg = tiny_config(logdir, drafter="eagle3")
  cfg.model.architecture = architecture
  cfg.trainer.steps = 1
  cfg.drafter_training.update(rows=2, seq_len=32, serial_steps=1, serial_budget="fixed")
  train.run(cfg)
  out = capsys.readouterr().out
  rows = [json.loads(line) for line in (logdir / "metrics.jsonl").open()]
  steps = [r for r in rows if "reward" in r]
  assert [r["drafter_serial_steps"] for r in steps] == [1], steps
  assert np.isfinite(steps[0]["drafter_loss"]), steps
  drafter = load_drafter(logdir / "final_drafter")
  assert isinstance(drafter, Eagle3Drafter)
  served = load_drafter(logdir / "final_drafter_speculators", drafter.config)
  assert isinstance(served, Eagle3Drafter) and served.feature_layers == drafter.feature_layers
  want, got = drafter_params(drafter), drafter_params(served)
  assert want.keys() == got.keys()
  for path, value in want.items():
    np.testing.assert_array_equal(got[path], value, err_msg=str(path))
  assert (f"final drafter {logdir / 'final_drafter'}, for vLLM "
          f"{logdir / 'final_drafter_speculators'}") in out, out[-2000:]
  # and the speculators package itself computes the trained drafter's logits from that pair
  pytest.importorskip("speculators")
  from tests.models.test_eagle3_speculators import compare_with_package  # pylint: disable=import-outside-toplevel
  from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
  policy, _ = hf.from_pretrained(logdir / "final_model")
  assert policy.config.architecture == architecture and policy.config.qk_norm == (
      architecture == "qwen3")
  assert compare_with_package(drafter, policy, logdir / "final_drafter_speculators") < 2e-5


@pytest.mark.slow  # a process killed and resumed: the full tier's
def test_a_killed_suffix_drafter_run_resumes_to_the_uninterrupted_one(tmp_path):
  """drafter="suffix" in epoch mode (8 prompts, 4 a step: the second epoch, which drafts from the
  first one's completions, starts at step 3), SIGKILLed after a random step and resumed: the same
  per-step metrics, history store and final weights as the uninterrupted run (the store decides
  the drafts, and with rejection sampling the drafts decide the tokens)."""
  from tests.test_kill_resume import (  # pylint: disable=import-outside-toplevel
      STEPS, assert_same_params, assert_same_rows, run_job, step_rows)
  # a fixed tuner: speculative in every bucket that offers a choice (timing-free, so the resumed
  # run must match exactly; the cost tuner's state is resumed in its own tests)
  flags = {"drafter": "suffix", "task.num_prompts": 8, "trainer.prompts_per_step": 4,
           "rollout.tuner.kind": "fixed", "rollout.tuner.fixed": "((8, 'suffix d8'),)",
           "rollout.verify": "rejection"}
  reference = tmp_path / "reference"
  rc, _, err = run_job(reference, flags, 1)
  assert rc == 0, err[-3000:]
  seed = random.randrange(2**32)
  at = random.Random(seed).randint(2, STEPS - 2)  # after a checkpoint (every 2 steps)
  why = f"SIGKILL after step {at} (seed {seed})"
  logdir = tmp_path / "run"
  rc, out, err = run_job(logdir, flags, 1, kill=(signal.SIGKILL, at))
  assert rc == -signal.SIGKILL and f"step {at:4d}/{STEPS}" in out, (why, rc, err[-2000:])
  rc, out, err = run_job(logdir, flags, 1, "--config.resume=True")
  assert rc == 0 and "resumed from" in out, (why, err[-3000:])
  want, got = step_rows(reference), step_rows(logdir)
  steps = [r for r in want if "reward" in r]
  assert [r["history_hit_rate"] for r in steps] == [0.0, 0.0] + [1.0] * (STEPS - 2), steps
  assert all(r.get("mean_accept_len", 0) >= 1.0 for r in steps), steps
  assert_same_rows(want, got, why)
  assert (checkpoint_metadata(logdir, STEPS)["history"] ==
          checkpoint_metadata(reference, STEPS)["history"]), why
  assert_same_params(reference, logdir, why)


def test_each_device_rule_and_the_engine_config_resolve_once_per_job(tmp_path, monkeypatch):
  """The job checks the step's device rules before any model (the trainer takes them as
  checked) and resolves the engine's config once: the rollout's own resolves of that config
  change nothing and check nothing again (``check_fixed_tuner``, the resolution's last check,
  runs once in the whole job)."""
  from tests.rl.test_run_state import count_calls  # pylint: disable=import-outside-toplevel
  from tlt_jax.job import rollout_config  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl import trainer_config  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout import engine as engine_lib  # pylint: disable=import-outside-toplevel
  calls = count_calls(monkeypatch, trainer_config, "check_update_layout", "check_rollout_devices")
  count_calls(monkeypatch, rollout_config, "resolve_engine_config", calls=calls)
  real_resolve, changed = engine_lib.resolve_engine_config, []

  def resolve(config, *args, **kwargs):
    resolved = real_resolve(config, *args, **kwargs)
    changed.append(resolved != config)
    return resolved

  monkeypatch.setattr(engine_lib, "resolve_engine_config", resolve)
  real_check = engine_lib.EngineConfig.check_fixed_tuner

  def check(self, *args, **kwargs):
    calls["check_fixed_tuner"] += 1
    return real_check(self, *args, **kwargs)

  monkeypatch.setattr(engine_lib.EngineConfig, "check_fixed_tuner", check)
  built = []

  def trainer_then_stop(*args, **kwargs):
    built.append(runner_trainer(*args, **kwargs))
    raise Interrupted(2, "stopped once the trainer was built")

  runner_trainer = runner.GRPOTrainer
  monkeypatch.setattr(runner, "GRPOTrainer", trainer_then_stop)
  with pytest.raises(Interrupted):
    train.run(tiny_config(tmp_path / "run", drafter="ngram"))
  assert built and calls == {"check_update_layout": 1, "check_rollout_devices": 1,
                             "resolve_engine_config": 1, "check_fixed_tuner": 1}
  assert changed and not any(changed)


JOB_MODULES = ("runner.py", "loop.py", "console.py", "precompile.py")


def raw_config_reads(source: str) -> list[str]:
  """The field reads of a raw config in ``source``: ``cfg.<field>``, ``cfg[...]``,
  ``cfg.get(...)`` or ``<x>.cfg.<field>`` (passing the config whole, or ``to_dict()`` to save
  it, is no read)."""
  import ast  # pylint: disable=import-outside-toplevel
  reads = []
  for node in ast.walk(ast.parse(source)):
    value = node.value if isinstance(node, (ast.Attribute, ast.Subscript)) else None
    raw = (isinstance(value, ast.Name) and value.id == "cfg" or
           isinstance(value, ast.Attribute) and value.attr == "cfg")
    if raw and not (isinstance(node, ast.Attribute) and node.attr == "to_dict"):
      reads.append(f"line {node.lineno}: {ast.unparse(node)}")
  return reads


@pytest.mark.parametrize("module", JOB_MODULES)
def test_the_job_reads_its_typed_fields_not_the_raw_config(module):
  """The runner and the loop read the ``Job``; the raw config is only passed on whole, to be
  printed or saved (a field read would bypass the Job's checks and types)."""
  path = ROOT / "tlt_jax" / "job" / module
  assert raw_config_reads(path.read_text()) == []


def test_a_raw_config_read_is_seen():
  assert raw_config_reads("if cfg.distributed:\n  t = cfg.get('x')\n") == [
      "line 1: cfg.distributed", "line 2: cfg.get"]
  assert raw_config_reads("n = job.cfg['trainer']\nsave(job.cfg.to_dict(), cfg)\n") == [
      "line 1: job.cfg['trainer']"]

