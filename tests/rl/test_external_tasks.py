"""Tasks on outside data: a local GSM8K-style dataset and the reasoning_gym adapter.

reasoning_gym and datasets are optional and usually absent here, so their tests inject small fake
modules into ``sys.modules`` that mimic the parts of the interfaces the adapters use:
``reasoning_gym.create_dataset(name, size=, seed=)`` returning an indexable dataset of
``{"question", "answer", "metadata"}`` entries with ``score_answer(answer=, entry=)``, and
``datasets.load_dataset(kind, data_files=, split=)`` returning an iterable of row dicts.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tlt_jax.rl import rewards
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


def test_parquet_goes_through_datasets(tmp_path, monkeypatch):
  path = tmp_path / "train.parquet"
  path.write_bytes(b"PAR1")
  calls = []

  def load_dataset(kind, data_files, split):
    calls.append((kind, data_files, split))
    return [{"question": "2+2?", "answer": "#### 4"}]

  monkeypatch.setitem(sys.modules, "datasets",
                      types.SimpleNamespace(load_dataset=load_dataset))
  task = MathDatasetTask(path)
  assert calls == [("parquet", [str(path)], "train")]
  assert task.problems[0].answer == "4"


# --- ReasoningGymTask ----------------------------------------------------------------------


class FakeGymDataset:
  """Mimics a reasoning_gym ProceduralDataset: indexable entries and ``score_answer``."""

  def __init__(self, size: int, seed: int, max_value: int = 50):
    self.size, self.seed, self.max_value = size, seed, max_value
    self.generated = 0

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict:
    self.generated += 1
    rng = np.random.default_rng([self.seed, index])
    a, b = (int(x) for x in rng.integers(0, self.max_value, size=2))
    return {"question": f"What is {a} + {b}?", "answer": str(a + b),
            "metadata": {"a": a, "b": b}}

  def score_answer(self, answer: str | None, entry: dict) -> float:
    if answer is None:
      return 0.0
    if answer.strip() == "crash":
      raise RuntimeError("scorer failure")
    return 1.0 if answer.strip() == entry["answer"] else 0.01  # partial credit, like the real one


@pytest.fixture
def fake_gym(monkeypatch):
  """A fake ``reasoning_gym`` module in ``sys.modules`` (the real package is optional)."""
  module = types.ModuleType("reasoning_gym")
  module.created = []

  def create_dataset(name, size, seed, **kwargs):
    if name != "fake_add":
      raise ValueError(f"unknown dataset {name}")
    module.created.append((name, size, seed, kwargs))
    return FakeGymDataset(size, seed, **kwargs)

  module.create_dataset = create_dataset
  monkeypatch.setitem(sys.modules, "reasoning_gym", module)
  return module


def test_gym_missing_package_message(monkeypatch):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
  with pytest.raises(ImportError, match="pip install reasoning-gym"):
    ReasoningGymTask("fake_add")


def test_gym_task_problems_and_rewards(fake_gym):
  task = ReasoningGymTask("fake_add", size=8, seed=5, max_value=20)
  assert fake_gym.created == [("fake_add", 8, 5, {"max_value": 20})]
  assert isinstance(task, Task) and task.name == "reasoning_gym:fake_add" and len(task) == 8
  problems = task.sample(np.random.default_rng(0), 6)
  assert all(isinstance(p, GymProblem) and 0 <= p.index < 8 for p in problems)
  problem = problems[0]
  entry = task.entry(problem.index)
  assert problem.answer == entry["answer"]
  assert problem.prompt.startswith(entry["question"]) and "<answer>" in problem.prompt
  assert task.reward(problem, problem.solution) == 1.0
  right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
  assert task.reward(problem, f"<think>add</think><answer>{right}</answer>") == 1.0
  assert task.reward(problem, rf"so \boxed{{{right}}}") == 1.0
  assert task.reward(problem, f"<answer>{wrong}</answer>") == 0.01
  assert task.reward(problem, "I do not know") == 0.0
  assert task.reward(problem, "<answer>crash</answer>") == 0.0  # scorer errors score 0
  plain = Problem(problem.prompt, problem.answer, problem.solution)  # found again by its prompt
  assert task.reward(plain, f"<answer>{right}</answer>") == 1.0
  with pytest.raises(ValueError, match="cannot find the dataset entry"):
    task.reward(Problem("unknown prompt", "1", "1"), "<answer>1</answer>")
  assert set(problem.prompt + problem.solution) <= set(task.alphabet)


def test_gym_sampling_is_deterministic_and_cached(fake_gym):
  task = ReasoningGymTask("fake_add", size=4, seed=1)
  a = task.sample(np.random.default_rng(9), 30)
  assert a == task.sample(np.random.default_rng(9), 30)
  assert a != task.sample(np.random.default_rng(10), 30)
  assert task.dataset.generated == 4  # each entry generated once
  with pytest.raises(ValueError, match="size must be a positive int"):
    ReasoningGymTask("fake_add", size=0)
  with pytest.raises(ValueError, match="unknown dataset"):
    ReasoningGymTask("nope")


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
