"""The templated GSM8K-style word problems (``tlt_jax.rl.gsm_style``) and their JSONL file,
read by ``MathDatasetTask``."""

from __future__ import annotations

import json
import re

import numpy as np

from tlt_jax.rl.external_tasks import MathDatasetTask
from tlt_jax.rl.gsm_style import gsm_style_problems, gsm_style_questions, write_gsm_style_file


def test_problems_are_seeded_and_carry_the_math_instruction():
  problems = gsm_style_problems(10, seed=3)
  assert problems == gsm_style_problems(10, seed=3) != gsm_style_problems(10, seed=4)
  for (text, answer), (question, same) in zip(problems, gsm_style_questions(10, seed=3)):
    assert text.startswith(question) and text.endswith("\\boxed{}.") and answer == same
    assert isinstance(answer, int) and answer >= 0


def test_the_file_is_a_math_dataset_whose_answers_score(tmp_path):
  path = write_gsm_style_file(tmp_path / "gsm.jsonl", 12, seed=1)
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert [(r["question"], int(r["answer"])) for r in records] == gsm_style_questions(12, 1)
  task = MathDatasetTask(path, name="gsm_style")
  assert len(task) == 12
  (problem,) = task.sample(np.random.default_rng(0), 1)
  assert task.reward(problem, f"so \\boxed{{{problem.answer}}}") == 1.0


def _answer_from_the_text(question: str) -> int:
  """The answer a reader works out from the numbers a question states (one rule per template)."""
  n = [int(x) for x in re.findall(r"\d+", question)]
  if "boxes of pencils" in question:  # a boxes of b pencils, c given away
    return n[0] * n[1] - n[2]
  if "per hour and works" in question:  # $a an hour, b hours a day, 5 days a week, c weeks
    return n[0] * n[1] * n[2] * n[3]
  if "train travels" in question:  # a mph for b hours, then c mph for d hours
    return n[0] * n[1] + n[2] * n[3]
  if "apples" in question:  # picks p, eats e, shares the rest among f friends
    return (n[0] - n[1]) // n[2]
  if "muffins" in question:  # a + b muffins in bags of c: full bags
    return (n[0] + n[1]) // n[2]
  raise AssertionError(f"no template matches {question!r}")


def test_every_answer_follows_from_the_numbers_its_question_states():
  questions = gsm_style_questions(50, seed=5)
  for question, answer in questions:
    assert answer == _answer_from_the_text(question), question
  # the apples are shared without a remainder: the question has one right answer
  for question, answer in questions[3::5]:
    picked, eaten, friends = (int(x) for x in re.findall(r"\d+", question))
    assert (picked - eaten) == friends * answer, question
