"""Tasks on outside data: a local GSM8K-style dataset and the reasoning_gym adapter.

The optional packages are the real ones (``datasets`` reads parquet, ``reasoning_gym`` generates
problems; both are dev dependencies); only the "not installed" messages and a crashing scorer are
simulated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tlt_jax.rl.external_tasks import (GymProblem, MathDatasetTask, ReasoningGymTask,
                                       extract_gym_answer)
from tlt_jax.rl.tasks import Problem, Task

DATA = Path(__file__).parent / "data" / "gsm8k_tiny.jsonl"
ANSWERS = ["72", "1,200", "-7", "3.5", "7"]


def write_jsonl(path: Path, records: list) -> Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


# --- MathDatasetTask -----------------------------------------------------------------------


def test_math_dataset_loads_gsm8k_records():
  task = MathDatasetTask(DATA)
  assert isinstance(task, Task)
  assert len(task) == 5 and task.name == "math:gsm8k_tiny"
  assert [p.answer for p in task.problems] == ANSWERS
  first = task.problems[0]
  assert first.prompt.startswith("Natalia sold clips")
  assert first.prompt.endswith("within \\boxed{}.")
  assert first.solution.endswith("#### 72")
  for problem in task.problems:
    assert set(problem.prompt + problem.solution) <= set(task.alphabet)
    assert task.reward(problem, problem.solution) == 1.0  # the worked solution earns the reward


def test_math_dataset_rewards():
  task = MathDatasetTask(DATA)
  pens = task.problems[1]
  assert task.reward(pens, r"400 times 3 is \boxed{1200}") == 1.0
  assert task.reward(pens, "So the answer is 1,200.") == 1.0
  assert task.reward(pens, r"\boxed{1100}") == 0.0
  assert task.reward(pens, "1200") == 0.0  # no stated final answer
  assert task.reward(task.problems[2], r"\boxed{-7}") == 1.0
  assert task.reward(task.problems[3], r"\boxed{\frac{7}{2}}") == 1.0


def test_math_dataset_sampling_is_deterministic():
  task = MathDatasetTask(DATA)
  a = task.sample(np.random.default_rng(3), 20)
  b = task.sample(np.random.default_rng(3), 20)
  c = task.sample(np.random.default_rng(4), 20)
  assert a == b and a != c
  assert all(isinstance(p, Problem) for p in a)
  assert {p.answer for p in a} <= set(ANSWERS) and len({p.answer for p in a}) > 1
  assert task.sample(np.random.default_rng(0), 0) == []
  with pytest.raises(ValueError, match="non-negative int"):
    task.sample(np.random.default_rng(0), -1)


def test_math_dataset_template_keys_and_bare_answers(tmp_path):
  path = write_jsonl(tmp_path / "mine.jsonl", [{"problem": "1+1?", "solution": "2"},
                                               {"problem": "Half of 1?", "solution": r"\frac12"}])
  task = MathDatasetTask(path, prompt_template="Q: {question}\nA:", question_key="problem",
                         answer_key="solution", name="mine")
  assert task.name == "mine"
  assert task.problems[0] == Problem(prompt="Q: 1+1?\nA:", answer="2", solution=r"\boxed{2}")
  assert task.reward(task.problems[1], r"\boxed{0.5}") == 1.0


def test_math_dataset_json_list_and_directory(tmp_path):
  records = [json.loads(line) for line in DATA.read_text().splitlines()]
  (tmp_path / "list.json").write_text(json.dumps(records[:2]))
  assert [p.answer for p in MathDatasetTask(tmp_path / "list.json").problems] == ANSWERS[:2]
  folder = tmp_path / "folder"
  folder.mkdir()
  write_jsonl(folder / "a.jsonl", records[:3])
  write_jsonl(folder / "b.jsonl", records[3:])
  assert [p.answer for p in MathDatasetTask(folder).problems] == ANSWERS


@pytest.mark.parametrize("content, message", [
    ("", "no records"),
    ('{"question": "q"}\n', "Record 0 .* no key 'answer'"),
    ('{"question": "q", "answer": "1"}\n{"answer": "2"}\n', "Record 1 .* no key 'question'"),
    ('{"question": "q", "answer": "1"}\nnot json\n', "line 2 is not valid JSON"),
    ('[1, 2]\n', "Record 0 .* is a list"),
    ('{"question": "q", "answer": null}\n', "must be a string or a number"),
])
def test_math_dataset_errors(tmp_path, content, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(content)
  with pytest.raises(ValueError, match=message):
    MathDatasetTask(path)


def test_math_dataset_path_and_template_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    MathDatasetTask(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="must contain '\\{question\\}'"):
    MathDatasetTask(DATA, prompt_template="no slot")
  (tmp_path / "data.csv").write_text("question,answer\n")
  with pytest.raises(ValueError, match="unsupported suffix"):
    MathDatasetTask(tmp_path / "data.csv")


def test_parquet_needs_datasets(tmp_path, monkeypatch):
  path = tmp_path / "train.parquet"
  path.write_bytes(b"PAR1")
  monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
  with pytest.raises(ImportError, match="pip install datasets"):
    MathDatasetTask(path)


@pytest.fixture
def real_datasets(tmp_path, monkeypatch):
  """The installed ``datasets`` package, caching into ``tmp_path`` (not the home directory)."""
  import datasets  # pylint: disable=import-outside-toplevel  (a dev extra: missing fails, not skips)
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
  return datasets


def write_parquet(path: Path, records: list[dict]) -> Path:
  """``records`` as a parquet file (written by pyarrow, read back by ``datasets``)."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  pq.write_table(pa.Table.from_pylist(records), str(path))
  return path


def test_parquet_loads_through_real_datasets(tmp_path, real_datasets):
  records = [json.loads(line) for line in DATA.read_text().splitlines()]
  task = MathDatasetTask(write_parquet(tmp_path / "train.parquet", records))
  assert task.name == "math:train" and len(task) == 5
  assert task.problems == MathDatasetTask(DATA).problems  # same records, same problems
  assert task.alphabet == MathDatasetTask(DATA).alphabet
  assert task.reward(task.problems[1], r"\boxed{1200}") == 1.0
  assert task.reward(task.problems[1], r"\boxed{1201}") == 0.0


def test_parquet_directory_and_numeric_answers(tmp_path, real_datasets):
  folder = tmp_path / "shards"
  folder.mkdir()
  write_parquet(folder / "part-1.parquet", [{"q": "3+4?", "a": 7}, {"q": "10-1?", "a": 9}])
  write_parquet(folder / "part-0.parquet", [{"q": "2+2?", "a": 4}])
  task = MathDatasetTask(folder, question_key="q", answer_key="a")
  assert [p.answer for p in task.problems] == ["4", "7", "9"]  # files in name order
  assert task.problems[0].prompt.startswith("2+2?\n")
  assert task.problems[0].solution == r"\boxed{4}"
  assert task.reward(task.problems[1], "The answer is 7.") == 1.0
  bad = write_parquet(tmp_path / "bad.parquet", [{"q": "1+1?", "b": "2"}])
  with pytest.raises(ValueError, match="Record 0 .* no key 'a'"):
    MathDatasetTask(bad, question_key="q", answer_key="a")


# --- ReasoningGymTask ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gym():
  """The installed ``reasoning_gym`` package."""
  import reasoning_gym  # pylint: disable=import-outside-toplevel  (a dev extra: missing fails)
  return reasoning_gym


def test_gym_missing_package_message(monkeypatch):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
  with pytest.raises(ImportError, match="pip install reasoning-gym"):
    ReasoningGymTask("basic_arithmetic")


def test_gym_task_problems_are_the_datasets_entries(gym):
  task = ReasoningGymTask("basic_arithmetic", size=12, seed=5)
  assert isinstance(task, Task) and task.name == "reasoning_gym:basic_arithmetic"
  assert len(task) == 12
  reference = gym.create_dataset("basic_arithmetic", size=12, seed=5)
  problems = task.sample(np.random.default_rng(0), 8)
  assert all(isinstance(p, GymProblem) and 0 <= p.index < 12 for p in problems)
  assert len({p.index for p in problems}) > 1
  for problem in problems:
    entry = reference[problem.index]
    assert problem.answer == entry["answer"]
    assert problem.prompt.startswith(entry["question"]) and problem.prompt.endswith("tags.")
    assert problem.solution == f"<answer>{entry['answer']}</answer>"
    assert set(problem.prompt + problem.solution) <= set(task.alphabet)


def test_gym_rewards_use_the_real_scorer(gym):
  task = ReasoningGymTask("basic_arithmetic", size=10, seed=2)
  for problem in task.sample(np.random.default_rng(1), 5):
    right, wrong = problem.answer, str(int(problem.answer) + 1)
    assert task.reward(problem, problem.solution) == 1.0
    assert task.reward(problem, f"<think>work</think><answer> {right} </answer>") == 1.0
    assert task.reward(problem, rf"so \boxed{{{right}}}") == 1.0
    assert task.reward(problem, f"<answer>{wrong}</answer>") == 0.0
    assert task.reward(problem, f"{right}") == 0.0  # no stated answer
    assert task.reward(problem, "I do not know") == 0.0
    # reasoning_gym's partial credit: the oracle inside a longer answer.
    assert task.reward(problem, f"<answer>{right} units</answer>") == pytest.approx(
        len(right) / len(f"{right} units"))
    plain = Problem(problem.prompt, problem.answer, problem.solution)  # found by its prompt
    assert task.reward(plain, f"<answer>{right}</answer>") == 1.0
  with pytest.raises(ValueError, match="cannot find the dataset entry"):
    task.reward(Problem("unknown prompt", "1", "1"), "<answer>1</answer>")


def test_gym_dataset_options_reach_reasoning_gym(gym):
  task = ReasoningGymTask("leg_counting", size=6, seed=0, min_animals=1, max_animals=1,
                          max_instances=2)
  for i in range(6):
    entry = task.entry(i)
    assert entry == gym.create_dataset("leg_counting", size=6, seed=0, min_animals=1,
                                       max_animals=1, max_instances=2)[i]
    animals = entry["metadata"]["animals"]
    assert len(animals) == 1 and 1 <= sum(animals.values()) <= 2  # the options took effect
    problem = task.problem(i)
    assert task.reward(problem, f"<answer>{entry['answer']}</answer>") == 1.0
    assert task.reward(problem, f"<answer>{int(entry['answer']) + 2}</answer>") == 0.0


def test_gym_scorer_crash_scores_zero(gym, monkeypatch):
  task = ReasoningGymTask("basic_arithmetic", size=4, seed=0)
  problem = task.problem(0)

  def crash(answer, entry):
    raise RuntimeError("scorer failure")

  monkeypatch.setattr(task.dataset, "score_answer", crash)
  assert task.reward(problem, problem.solution) == 0.0


def test_a_non_finite_score_scores_zero(gym, monkeypatch):
  """A scorer that answers NaN or Inf gives reward 0: one such row would make its whole group's
  advantages NaN (and the update would be skipped or stop the run)."""
  task = ReasoningGymTask("basic_arithmetic", size=4, seed=0)
  problem = task.problem(0)
  for score in (float("nan"), float("inf"), -float("inf")):
    monkeypatch.setattr(task.dataset, "score_answer", lambda answer, entry, s=score: s)
    assert task.reward(problem, problem.solution) == 0.0, score


def test_gym_sampling_is_deterministic_and_cached(gym, monkeypatch):
  task = ReasoningGymTask("basic_arithmetic", size=4, seed=1)
  generated = []
  getitem = type(task.dataset).__getitem__
  monkeypatch.setattr(type(task.dataset), "__getitem__",
                      lambda self, i: generated.append(i) or getitem(self, i))
  a = task.sample(np.random.default_rng(9), 30)
  assert a == task.sample(np.random.default_rng(9), 30)
  assert a != task.sample(np.random.default_rng(10), 30)
  assert sorted(generated) == [0, 1, 2, 3]  # each entry generated once
  assert ReasoningGymTask("basic_arithmetic", size=4, seed=2).problem(0) != task.problem(0)
  with pytest.raises(IndexError, match="entries 0..3"):
    task.entry(4)
  with pytest.raises(ValueError, match="size must be a positive int"):
    ReasoningGymTask("basic_arithmetic", size=0)
  with pytest.raises(ValueError, match="not registered"):
    ReasoningGymTask("no_such_dataset")


@pytest.mark.parametrize("completion, expected", [
    ("<think>x</think><answer> 12 </answer>", "12"),
    ("<answer>1</answer> then <ANSWER>2</ANSWER>", "2"),
    ("<answer>unclosed 3", "unclosed 3"),
    (r"\boxed{4}", "4"),
    ("The answer is 5.", "5"),
    ("nothing", None),
])
def test_extract_gym_answer(completion, expected):
  assert extract_gym_answer(completion) == expected
