"""``ReasoningGymTask`` against the real ``reasoning_gym`` package, over several of its tasks: each
dataset entry becomes a problem, the entry's own answer scores 1 and a wrong one less, through
the package's ``score_answer``; and the prompt in a chat template (as the SmolLM2 configs use it).

(tests/rl/test_external_tasks.py covers the adapter's mechanics on ``basic_arithmetic``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.rl.chat_fixtures import write_chat_tokenizer
from tlt_jax.rl.external_tasks import DEFAULT_GYM_TEMPLATE, GymProblem, ReasoningGymTask
from tlt_jax.rl.tasks import Task, chat_prompt

# GSM8K-style word problems, arithmetic, counting, and tasks whose answers are not numbers
TASKS = ["gsm_symbolic", "basic_arithmetic", "chain_sum", "leg_counting", "products",
         "fraction_simplification", "spell_backward", "word_sorting"]
SIZE = 6


@pytest.fixture(scope="module")
def gym():
  import reasoning_gym  # pylint: disable=import-outside-toplevel  (a dev extra: missing fails)
  return reasoning_gym


def wrong_answer(answer: str) -> str:
  """An answer that differs from ``answer``: the number plus one, else the text reversed."""
  try:
    return str(int(answer) + 1)
  except ValueError:
    return answer[::-1] + " x" if answer[::-1] != answer else answer + " x"


@pytest.mark.parametrize("name", TASKS)
def test_entries_become_problems_scored_by_the_package(gym, name):
  task = ReasoningGymTask(name, size=SIZE, seed=7)
  reference = gym.create_dataset(name, size=SIZE, seed=7)  # the package, used directly
  assert isinstance(task, Task) and task.name == f"reasoning_gym:{name}" and len(task) == SIZE
  for i in range(SIZE):
    entry, problem = reference[i], task.problem(i)
    assert isinstance(problem, GymProblem) and problem.index == i
    assert problem.prompt == DEFAULT_GYM_TEMPLATE.replace("{question}", entry["question"])
    assert problem.answer == str(entry["answer"]) and problem.answer
    assert problem.solution == f"<answer>{entry['answer']}</answer>"
    # the dataset's own answer: full marks, through the package's scorer
    right = f"Let me think.\n<answer>{entry['answer']}</answer>"
    assert reference.score_answer(answer=str(entry["answer"]), entry=entry) == 1.0
    assert task.reward(problem, right) == 1.0
    assert task.reward(problem, problem.solution) == 1.0
    # a wrong answer scores less, and exactly what the package says
    wrong = wrong_answer(str(entry["answer"]))
    expected = float(reference.score_answer(answer=wrong, entry=entry))
    assert expected < 1.0
    assert task.reward(problem, f"<answer>{wrong}</answer>") == pytest.approx(expected)
    assert task.reward(problem, "no answer given") == 0.0


def test_sampled_problems_are_entries_and_reproducible(gym):
  task = ReasoningGymTask("gsm_symbolic", size=20, seed=3)
  problems = task.sample(np.random.default_rng(5), 8)
  assert problems == task.sample(np.random.default_rng(5), 8)
  reference = gym.create_dataset("gsm_symbolic", size=20, seed=3)
  for problem in problems:
    entry = reference[problem.index]
    assert entry["question"] in problem.prompt and problem.answer == entry["answer"]
    assert task.reward(problem, problem.solution) == 1.0


def test_gsm_symbolic_partial_credit_is_the_packages(gym):
  """gsm_symbolic gives a wrong number 0.01 (its scorer's own floor), not 0."""
  task = ReasoningGymTask("gsm_symbolic", size=3, seed=0)
  problem = task.problem(0)
  wrong = str(int(problem.answer) + 1)
  score = task.dataset.score_answer(answer=wrong, entry=task.entry(0))
  assert 0.0 < score < 1.0
  assert task.reward(problem, f"<answer>{wrong}</answer>") == pytest.approx(score)


@pytest.mark.parametrize("name", ["gsm_symbolic", "chain_sum"])
def test_prompt_in_a_chat_template(tmp_path, name):
  tokenizer = write_chat_tokenizer(tmp_path)
  task = ReasoningGymTask(name, size=4, seed=0)
  problem = task.problem(2)
  text = chat_prompt(tokenizer, problem.prompt)
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  f"Hugging Face<|im_end|>\n<|im_start|>user\n{problem.prompt}<|im_end|>\n"
                  "<|im_start|>assistant\n")
  ids = tokenizer.encode(text)
  start, end = tokenizer.bos_token_id, tokenizer.eos_token_id  # <|im_start|>, <|im_end|>
  assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2  # specials, not text
  assert tokenizer.decode(ids) == text
  assert problem.prompt in tokenizer.decode(ids, skip_special_tokens=True)
  # the reward reads the completion only: the template does not change the scoring
  assert task.reward(problem, problem.solution) == 1.0
