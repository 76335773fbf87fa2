"""The templated GSM8K-style word problems (``tlt_jax.rl.gsm_style``) and their JSONL file,
read by ``MathDatasetTask``."""

from __future__ import annotations

import json

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
