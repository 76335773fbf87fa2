"""Held-out problems apart from training: a file task evaluates on its evaluation file
or on a share of its questions that training never draws, a reasoning_gym task on the questions
its ``eval_share`` holds out; a task with neither (the built-in arithmetic task) says in one line
that its held-out problems are drawn from the training pool. And which scorer the reward runs."""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from tlt_jax.job import runner
from tlt_jax.job.build import build_task
from tlt_jax.job.typed_config import ConfigError, load_config_file
from tlt_jax.rl import rewards
from tlt_jax.rl.external_tasks import MathDatasetTask, ReasoningGymTask, question_place
from tlt_jax.rl.tasks import ArithmeticTask, EpochSchedule
from tlt_jax.rl.data import EVAL_SEED, eval_problems, held_out_line, step_problems

ROOT = Path(__file__).resolve().parents[2]
ONE_DIGIT = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)  # 200 distinct questions


def write_rows(path: Path, questions: list[str]) -> Path:
  """A GSM8K-style .jsonl file: one row per question, its answer the question's index."""
  path.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n"
                          for i, q in enumerate(questions)))
  return path


def questions(n: int, repeats: int = 1) -> list[str]:
  """``n`` distinct questions, each written ``repeats`` times, interleaved."""
  return [f"How many apples are {k} apples and {k + 1} more?" for _ in range(repeats)
          for k in range(n)]


def prompts(problems) -> set[str]:
  return {p.prompt for p in problems}


def training_draws(task, seeds=range(6), steps=10, per_step=16) -> set[str]:
  """Every prompt the RL steps draw on ``seeds`` (fresh problems and epoch mode's set)."""
  drawn = set()
  for seed in seeds:
    for step in range(steps):
      drawn |= prompts(step_problems(task, seed, step, per_step))
    drawn |= prompts(EpochSchedule(task, seed, per_step, per_step).problems)
  return drawn


# --- a file task: a held-out share of its questions -----------------------------------------


def test_a_file_split_keeps_every_held_out_question_out_of_training(tmp_path):
  path = write_rows(tmp_path / "train.jsonl", questions(50, repeats=2))  # each question twice
  task = MathDatasetTask(path, eval_share=0.2)
  held = prompts(task.held_out)
  assert len(held) == 10 and len(task.held_out) == 20  # 20% of 50 questions, both copies
  assert len(task.problems) == 80 and not held & prompts(task.problems)
  assert held | prompts(task.problems) == prompts(MathDatasetTask(path).problems)  # no row lost
  assert not held & training_draws(task)  # training never draws a held-out question
  assert not held & prompts(task.sample_distinct(np.random.default_rng(0), 40))
  evaluated = eval_problems(task, 20)
  assert sorted(evaluated, key=str) == sorted(task.held_out, key=str)  # each held-out row once
  assert prompts(eval_problems(task, 64)) <= held  # more than there are: drawn again
  assert held_out_line(task, 64).startswith("held-out: 20 rows of train.jsonl")
  assert "not drawn from the training pool" in held_out_line(task, 64)
  assert held_out_line(task, 64).endswith("64 evaluated, so some repeat")
  # epoch mode asking for more than the training rows says how many are held out
  with pytest.raises(ValueError, match=r"has 80 training problems \(20 more held out for "
                                       r"evaluation\), fewer than the 81 distinct"):
    task.sample_distinct(np.random.default_rng(0), 81)


def test_the_split_follows_the_questions_not_the_rows_order_or_the_seed(tmp_path):
  qs = questions(30)
  a = MathDatasetTask(write_rows(tmp_path / "a.jsonl", qs), eval_share=0.3)
  b = MathDatasetTask(write_rows(tmp_path / "b.jsonl", qs[::-1]), eval_share=0.3)
  assert prompts(a.held_out) == prompts(b.held_out) and len(a.held_out) == 9
  # the held-out questions are those of the lowest places
  places = sorted(question_place(p.prompt) for p in a.problems + a.held_out)
  assert max(question_place(p.prompt) for p in a.held_out) == places[8]


def test_a_tiny_file_still_holds_one_question_out(tmp_path):
  task = MathDatasetTask(write_rows(tmp_path / "t.jsonl", questions(3)), eval_share=0.1)
  assert len(task.held_out) == 1 and len(task.problems) == 2


# --- a file task: a separate evaluation file ------------------------------------------------


def test_an_eval_file_is_what_the_held_out_problems_come_from(tmp_path):
  train = write_rows(tmp_path / "train.jsonl", questions(20))
  evaluation = write_rows(tmp_path / "test.jsonl", [f"What is {k} times 7?" for k in range(12)]
                          + questions(20)[:2])  # two of its questions are training rows too
  task = MathDatasetTask(train, eval_path=evaluation)
  assert prompts(task.held_out) == prompts(MathDatasetTask(evaluation).problems)
  assert len(task.problems) == 18 and task.dropped == 2  # those two left out of training
  assert not prompts(task.held_out) & training_draws(task)
  assert prompts(eval_problems(task, 14)) == prompts(task.held_out)
  assert set("What is 7 times 7?") <= set(task.alphabet)  # the char policy can read them
  line = held_out_line(task, 14)
  assert line.startswith(f"held-out: the 14 problems of {evaluation} (task.eval_path), not drawn "
                         "from the training pool; 2 rows of train.jsonl")


def test_the_job_reads_eval_path_and_eval_share_from_config_task(tmp_path):
  train = write_rows(tmp_path / "train.jsonl", questions(20))
  evaluation = write_rows(tmp_path / "test.jsonl", ["What is 3 times 7?"])
  task, _ = build_task(ml_collections.ConfigDict(dict(kind="math_dataset", path=str(train))))
  assert len(task.held_out) == 2 and len(task.problems) == 18  # the default: eval_share=0.1
  task, _ = build_task(ml_collections.ConfigDict(dict(kind="math_dataset", path=str(train),
                                                      eval_share=0.5)))
  assert len(task.held_out) == 10
  task, _ = build_task(ml_collections.ConfigDict(dict(kind="math_dataset", path=str(train),
                                                      eval_path=str(evaluation))))
  assert [p.prompt.split("\n")[0] for p in task.held_out] == ["What is 3 times 7?"]
  assert len(task.problems) == 20  # with an evaluation file, eval_share splits nothing


@pytest.mark.parametrize("fields, message", [
    (dict(eval_share=0.0), r"config.task.eval_share must be a number in \(0, 1\).*got 0.0"),
    (dict(eval_share=1.0), r"config.task.eval_share must be a number in \(0, 1\).*got 1.0"),
    (dict(eval_share=-0.2), r"config.task.eval_share must be a number in \(0, 1\)"),
    (dict(eval_share=True), r"config.task.eval_share must be a number in \(0, 1\).*got True"),
    (dict(eval_share="0.1"), r"config.task.eval_share must be a number"),
    (dict(eval_path="missing.jsonl"), r"config.task \(math_dataset\): The evaluation file "
                                      r"eval_path='.*missing.jsonl' does not exist; give a .jsonl"),
    (dict(eval_path="empty.jsonl"), r"config.task \(math_dataset\): The evaluation file "
                                    r"eval_path='.*empty.jsonl' has no records"),
    (dict(path="one.jsonl"), r"eval_share=0.1 \(1 of its 1 distinct questions\) leaves .*one.jsonl "
                             r"no training rows; lower eval_share .*, or give eval_path"),
    (dict(eval_share=0.9), r"eval_share=0.9 \(3 of its 3 distinct questions\) leaves .* no "
                           r"training rows"),
    (dict(eval_path="same.jsonl"), r"Holding out the questions of its eval_path leaves .* no "
                                   r"training rows"),
])
def test_bad_held_out_settings_are_refused_naming_the_field(tmp_path, fields, message):
  write_rows(tmp_path / "three.jsonl", questions(3))
  write_rows(tmp_path / "one.jsonl", questions(1))
  write_rows(tmp_path / "same.jsonl", questions(3))
  (tmp_path / "empty.jsonl").write_text("\n")
  cfg = dict(kind="math_dataset", path=str(tmp_path / "three.jsonl"))
  cfg.update({k: str(tmp_path / v) if k.endswith("path") else v for k, v in fields.items()})
  with pytest.raises(ConfigError, match=message):
    build_task(ml_collections.ConfigDict(cfg))


def test_the_class_refuses_both_an_eval_file_and_a_share(tmp_path):
  path = write_rows(tmp_path / "t.jsonl", questions(4))
  with pytest.raises(ValueError, match="eval_path .* or eval_share .*, not both"):
    MathDatasetTask(path, eval_path=path, eval_share=0.5)


def test_without_either_a_file_task_says_it_evaluates_on_training_rows(tmp_path):
  task = MathDatasetTask(write_rows(tmp_path / "t.jsonl", questions(10)))  # the library default
  assert task.held_out is None
  assert eval_problems(task, 5) == task.sample(np.random.default_rng(EVAL_SEED), 5)
  assert held_out_line(task, 5).startswith("held-out: drawn from the training pool")


# --- reasoning_gym ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gym():
  import reasoning_gym  # pylint: disable=import-outside-toplevel  (a dev extra: missing fails)
  return reasoning_gym


def test_a_gym_split_keeps_held_out_questions_out_of_training(gym):
  task = ReasoningGymTask("chain_sum", size=400, seed=3, eval_share=0.25, **ONE_DIGIT)
  held = prompts(eval_problems(task, 64))
  assert len(held) > 10 and all(task.is_held_out(p.index) for p in eval_problems(task, 64))
  drawn = training_draws(task)
  assert len(drawn) > 50 and not held & drawn
  # a question's side follows its text: every entry of it is on the same side
  sides = {}
  for i in range(task.size):
    sides.setdefault(task.entry(i)["question"], set()).add(task.is_held_out(i))
  assert all(len(s) == 1 for s in sides.values())
  assert 0.15 < np.mean([s == {True} for s in sides.values()]) < 0.35
  assert "not drawn from the training pool" in held_out_line(task, 64)


def test_a_gym_task_without_a_split_draws_as_before_and_says_so(gym):
  task = ReasoningGymTask("chain_sum", size=400, seed=3, **ONE_DIGIT)  # eval_share=0
  rng = np.random.default_rng(EVAL_SEED)
  before = [task.problem(int(i)) for i in rng.integers(0, 400, size=16)]  # the old evaluation
  assert eval_problems(task, 16) == before
  assert held_out_line(task, 16).startswith("held-out: drawn from the training pool")


def test_gym_split_mistakes(gym):
  with pytest.raises(ValueError, match=r"eval_share must be a number in \[0, 1\)"):
    ReasoningGymTask("chain_sum", size=10, eval_share=1.0)
  task = ReasoningGymTask("chain_sum", size=4, seed=0, eval_share=1e-9)  # nothing falls in it
  with pytest.raises(ValueError, match=r"entries is training's: none is held out; raise "
                                       r"eval_share"):
    eval_problems(task, 2)
  task = ReasoningGymTask("chain_sum", size=4, seed=0, eval_share=0.999999999)
  with pytest.raises(ValueError, match=r"entries is held out: none is left to train on"):
    step_problems(task, 0, 0, 2)
  with pytest.raises(ConfigError, match=r"config.task.eval_share must be a number in \[0, 1\)"):
    build_task(ml_collections.ConfigDict(dict(kind="reasoning_gym", name="chain_sum",
                                              eval_share=-0.1)))


def test_the_smollm2_configs_hold_questions_out(gym):
  for name, share in (("smollm2_gsm8k", 0.1), ("smollm2_cpu", 0.25),
                      ("smollm2_reasoning_gym", 0.1)):
    cfg = load_config_file(ROOT / "configs" / f"{name}.py")
    assert cfg.task.eval_share == share, name


# --- the built-in arithmetic task --------------------------------------------------------------


def test_arithmetic_evaluates_as_before_and_says_it_shares_the_training_pool():
  task = ArithmeticTask(max_digits=8)
  assert eval_problems(task, 32) == task.sample(np.random.default_rng(EVAL_SEED), 32)
  line = held_out_line(task, 512)
  assert line.startswith("held-out: 512 problems drawn from the training pool")
  assert "\n" not in line


# --- the scorer --------------------------------------------------------------------------------


def test_the_scorer_names_math_verify_when_it_is_installed(tmp_path, real_math_verify):
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  version = importlib.metadata.version("math-verify")
  assert rewards.math_scorer().startswith(f"math_verify {version} first, then this package's")
  task = MathDatasetTask(write_rows(tmp_path / "t.jsonl", questions(3)))
  assert rewards.task_scorer(task) == rewards.math_scorer()


def test_the_scorer_names_the_built_in_rules_without_math_verify(tmp_path, no_math_verify):
  said = rewards.math_scorer()
  assert said.startswith("this package's answer rules") and "math_verify not installed" in said
  task = MathDatasetTask(write_rows(tmp_path / "t.jsonl", questions(3)))
  assert rewards.task_scorer(task) == said


def test_other_tasks_name_their_own_scorer(gym):
  assert rewards.task_scorer(ArithmeticTask()) == "ArithmeticTask.reward, the task's own"
  task = ReasoningGymTask("chain_sum", size=4)
  assert rewards.task_scorer(task) == ("reasoning_gym's chain_sum score_answer on the extracted "
                                       "answer")


class StopHere(Exception):
  """Raised where the job would write its first file: its start lines are out by then."""


@pytest.mark.parametrize("installed", [True, False])
def test_the_job_says_where_held_out_comes_from_and_which_scorer_runs(
    tmp_path, capsys, monkeypatch, request, installed):
  request.getfixturevalue("real_math_verify" if installed else "no_math_verify")
  cfg = load_config_file(ROOT / "configs" / "tiny_grpo.py")
  cfg.logdir = str(tmp_path / "run")
  cfg.rollout.max_prompt_len = 128
  cfg.task = ml_collections.ConfigDict(dict(
      kind="math_dataset", path=str(write_rows(tmp_path / "t.jsonl", questions(20)))))

  def stop(*_):
    raise StopHere

  monkeypatch.setattr(runner, "save_run_config", stop)
  with pytest.raises(StopHere):
    runner.run(cfg)
  out = capsys.readouterr().out.splitlines()
  assert "held-out: 2 rows of t.jsonl (task.eval_share=0.1 of its distinct questions, by a hash " \
         "of the text) set aside before training, not drawn from the training pool: training " \
         "draws from the other 18 rows; 512 evaluated, so some repeat" in out
  scorer = "reward: math_verify" if installed else "reward: this package's answer rules"
  assert sum(line.startswith(scorer) for line in out) == 1, out
