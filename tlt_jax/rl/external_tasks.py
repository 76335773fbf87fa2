"""Tasks backed by outside data: local math datasets (GSM8K style) and ``reasoning_gym`` generators.

Both satisfy the ``Task`` protocol of ``tlt_jax.rl.tasks``. Optional packages (``datasets`` for
parquet files, ``reasoning_gym`` for procedural tasks) are imported only when needed and are not
dependencies of this package; a missing one raises an ImportError that says what to install.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from tlt_jax.rl.rewards import extract_boxed, extract_final_answer, math_reward
from tlt_jax.rl.tasks import Problem
from tlt_jax.utils import FieldError

logger = logging.getLogger(__name__)

DEFAULT_MATH_TEMPLATE = ("{question}\nPlease reason step by step, and put your final answer "
                         "within \\boxed{}.")
DEFAULT_GYM_TEMPLATE = "{question}\nGive your final answer inside <answer></answer> tags."
_JSON_SUFFIXES = (".jsonl", ".json")


def _import_optional(module: str, package: str, needed_for: str) -> ModuleType:
  """``module`` imported, or an ImportError naming the ``pip install`` that provides it."""
  try:
    return importlib.import_module(module)
  except ImportError as error:
    raise ImportError(f"{needed_for} needs the optional package '{module}', which is not "
                      f"installed; install it with `pip install {package}`.") from error


def _fill_template(template: str, question: str) -> str:
  """``template`` with ``{question}`` filled in; other braces (``\\boxed{}``) are left alone."""
  return template.replace("{question}", question)


def _check_template(template: str, owner: str) -> None:
  """Raises if a prompt template has no ``{question}`` slot."""
  if "{question}" not in template:
    raise ValueError(f"{owner} prompt_template must contain '{{question}}' where the question "
                     f"goes, got {template!r}")


def _check_n(n: Any) -> int:
  """``n`` as a non-negative int, or a ValueError."""
  if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
    raise ValueError(f"sample needs a non-negative int number of problems, got {n!r}")
  return int(n)


def _distinct_indices(rng: np.random.Generator, n: Any, size: int, name: str) -> list[int]:
  """``n`` distinct indices of ``0..size-1`` from ``rng``, or a ValueError when ``n > size``."""
  n = _check_n(n)
  if n > size:
    raise ValueError(f"{name} has {size} problems, fewer than the {n} distinct ones asked for; "
                     f"ask for at most {size} (or use a larger dataset)")
  return [int(i) for i in rng.choice(size, size=n, replace=False)]


def _alphabet(texts: Iterable[str]) -> str:
  """Every character that occurs in ``texts``, sorted."""
  chars: set[str] = set()
  for text in texts:
    chars.update(text)
  return "".join(sorted(chars))


def _read_json_file(path: Path) -> list[Any]:
  """Records of a ``.jsonl`` file, or of a ``.json`` file holding a list (or JSON lines)."""
  text = path.read_text(encoding="utf-8")
  if path.suffix == ".json":
    try:
      data = json.loads(text)
    except json.JSONDecodeError as error:
      if "Extra data" not in str(error):  # not JSON lines either
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    else:
      if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of records (or one record per line), "
                         f"got a {type(data).__name__}")
      return data
  records = []
  for line_no, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as error:
      raise ValueError(f"{path} line {line_no} is not valid JSON: {error}") from None
  return records


def _read_with_datasets(kind: str, files: list[Path]) -> list[Any]:
  """Records of ``files`` loaded by the ``datasets`` library (``kind`` is "json" or "parquet")."""
  datasets = _import_optional("datasets", "datasets", f"Loading {kind} files such as {files[0]}")
  loaded = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
  return [dict(row) for row in loaded]


def load_records(path: str | Path) -> list[Any]:
  """Records from a ``.jsonl``/``.json`` file, a ``.parquet`` file or a directory of either."""
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"Dataset path {path} does not exist; pass a .jsonl, .json or "
                            ".parquet file, or a directory of them.")
  if path.is_dir():
    files = sorted(p for p in path.iterdir()
                   if p.is_file() and p.suffix in _JSON_SUFFIXES + (".parquet",))
    if not files:
      raise FileNotFoundError(f"Dataset directory {path} holds no .jsonl, .json or .parquet files.")
    parquet = [f for f in files if f.suffix == ".parquet"]
    if parquet and len(parquet) != len(files):
      raise ValueError(f"Dataset directory {path} mixes parquet and JSON files; keep one format "
                       "per directory or pass a single file.")
    if parquet:
      return _read_with_datasets("parquet", parquet)
    return [record for f in files for record in _read_json_file(f)]
  if path.suffix in _JSON_SUFFIXES:
    return _read_json_file(path)
  if path.suffix == ".parquet":
    return _read_with_datasets("parquet", [path])
  raise ValueError(f"Dataset file {path} has an unsupported suffix {path.suffix!r}; use .jsonl, "
                   ".json or .parquet.")


class MathDatasetTask:
  """Math word problems with checkable final answers, read from a local dataset (GSM8K layout).

  Each record holds a question and an answer; the answer may be a worked solution ending in
  ``#### 42`` (GSM8K), contain a ``\\boxed{}`` answer, or be the bare answer. Problems carry the
  extracted final answer in ``Problem.answer``; rewards come from ``math_reward``.
  """

  def __init__(self, path: str | Path, prompt_template: str = DEFAULT_MATH_TEMPLATE,
               question_key: str = "question", answer_key: str = "answer",
               name: str | None = None):
    _check_template(prompt_template, "MathDatasetTask")
    self.path = Path(path)
    self.prompt_template = prompt_template
    self.question_key = question_key
    self.answer_key = answer_key
    self.name = name if name is not None else f"math:{self.path.stem}"
    records = load_records(self.path)
    if not records:
      raise ValueError(f"Dataset {self.path} has no records.")
    self.problems = [self._to_problem(i, record) for i, record in enumerate(records)]
    self.alphabet = _alphabet(p.prompt + p.solution for p in self.problems)

  def _to_problem(self, index: int, record: Any) -> Problem:
    """The ``Problem`` of record ``index``, or a ValueError naming what the record lacks."""
    if not isinstance(record, Mapping):
      raise ValueError(f"Record {index} of {self.path} is a {type(record).__name__}, expected an "
                       "object with question and answer fields.")
    for key in (self.question_key, self.answer_key):
      if key not in record:
        raise ValueError(f"Record {index} of {self.path} has no key {key!r} (its keys: "
                         f"{sorted(record)}); pass question_key=/answer_key= to match the data.")
    question, raw = record[self.question_key], record[self.answer_key]
    if not isinstance(question, str) or not question.strip():
      raise ValueError(f"Record {index} of {self.path}: {self.question_key!r} must be a non-empty "
                       f"string, got {question!r}")
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
      raise ValueError(f"Record {index} of {self.path}: {self.answer_key!r} must be a string or a "
                       f"number, got {raw!r}")
    raw = str(raw).strip()
    answer = extract_final_answer(raw)
    if answer is None:  # a bare answer such as "42" or "\frac{1}{2}"
      answer, solution = raw, f"\\boxed{{{raw}}}"
    else:  # a worked solution that ends in its answer
      solution = raw
    if not answer:
      raise ValueError(f"Record {index} of {self.path} has an empty answer in {self.answer_key!r}: "
                       f"{record[self.answer_key]!r}")
    return Problem(prompt=_fill_template(self.prompt_template, question), answer=answer,
                   solution=solution)

  def __len__(self) -> int:
    return len(self.problems)

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` problems drawn uniformly with replacement (same generator state, same problems)."""
    n = _check_n(n)
    return [self.problems[int(i)] for i in rng.integers(0, len(self.problems), size=n)]

  def sample_distinct(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` distinct records drawn without replacement (epoch mode's prompt set)."""
    return [self.problems[i] for i in _distinct_indices(rng, n, len(self.problems), self.name)]

  def reward(self, problem: Problem, completion: str) -> float:
    """1.0 if the completion's final answer equals ``problem.answer`` (see ``math_reward``)."""
    return math_reward(completion, problem.answer)


@dataclasses.dataclass(frozen=True)
class GymProblem(Problem):
  """A ``Problem`` that remembers which ``reasoning_gym`` dataset entry it came from."""

  index: int = -1


def extract_gym_answer(completion: str) -> str | None:
  """Text of the last ``<answer>...</answer>``, else the last ``\\boxed{}``, else a final answer."""
  at = completion.lower().rfind("<answer>")
  if at >= 0:
    rest = completion[at + len("<answer>"):]
    end = rest.lower().find("</answer>")
    return (rest if end < 0 else rest[:end]).strip()  # an unclosed tag runs to the end
  boxed = extract_boxed(completion)
  if boxed is not None:
    return boxed
  return extract_final_answer(completion)


class ReasoningGymTask:
  """Adapter for a ``reasoning_gym`` procedural dataset (``reasoning_gym.create_dataset``).

  Problems are ``GymProblem``s that keep their entry index; rewards come from the dataset's own
  ``score_answer`` on the completion's extracted answer. Needs ``pip install reasoning-gym``.
  """

  def __init__(self, name: str, size: int = 500, seed: int = 0,
               prompt_template: str = DEFAULT_GYM_TEMPLATE, **kwargs: Any):
    _check_template(prompt_template, "ReasoningGymTask")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(f"ReasoningGymTask size must be a positive int, got {size!r}")
    gym = _import_optional("reasoning_gym", "reasoning-gym", "ReasoningGymTask")
    self.dataset_name = name
    self.name = f"reasoning_gym:{name}"
    self.size = size
    self.seed = seed
    self.prompt_template = prompt_template
    self.dataset = gym.create_dataset(name, size=size, seed=seed, **kwargs)
    self._entries: dict[int, Mapping[str, Any]] = {}
    self._index_of_prompt: dict[str, int] = {}
    self._alphabet: str | None = None

  def __len__(self) -> int:
    return self.size

  def entry(self, index: int) -> Mapping[str, Any]:
    """Dataset entry ``index`` (``question``, ``answer``, ``metadata``), generated once, cached."""
    if not 0 <= index < self.size:
      raise IndexError(f"{self.name} has entries 0..{self.size - 1}, asked for {index}")
    if index not in self._entries:
      entry = self.dataset[index]
      if not isinstance(entry, Mapping) or "question" not in entry:
        raise ValueError(f"{self.name} entry {index} has no 'question' field: {entry!r}")
      self._entries[index] = entry
    return self._entries[index]

  def problem(self, index: int) -> GymProblem:
    """The problem of dataset entry ``index``."""
    entry = self.entry(index)
    answer = "" if entry.get("answer") is None else str(entry["answer"])
    prompt = _fill_template(self.prompt_template, str(entry["question"]))
    self._index_of_prompt.setdefault(prompt, index)
    return GymProblem(prompt=prompt, answer=answer, solution=f"<answer>{answer}</answer>",
                      index=index)

  @property
  def alphabet(self) -> str:
    """Every character of every prompt and solution (generates the whole dataset once)."""
    if self._alphabet is None:
      problems = [self.problem(i) for i in range(self.size)]
      self._alphabet = _alphabet(p.prompt + p.solution for p in problems)
    return self._alphabet

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` entries drawn uniformly with replacement (same generator state, same problems)."""
    n = _check_n(n)
    return [self.problem(int(i)) for i in rng.integers(0, self.size, size=n)]

  def sample_distinct(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` distinct entries drawn without replacement (epoch mode's prompt set)."""
    return [self.problem(i) for i in _distinct_indices(rng, n, self.size, self.name)]

  def _index(self, problem: Problem) -> int:
    """The entry index of a problem from this task (by its ``index``, else by its prompt)."""
    if isinstance(problem, GymProblem) and 0 <= problem.index < self.size:
      return problem.index
    if problem.prompt in self._index_of_prompt:
      return self._index_of_prompt[problem.prompt]
    raise ValueError(f"{self.name} cannot find the dataset entry of this problem; score only "
                     "problems returned by its sample() or problem(). "
                     f"Prompt: {problem.prompt[:80]!r}")

  def reward(self, problem: Problem, completion: str) -> float:
    """The dataset's ``score_answer`` for the completion's extracted answer; 0.0 without one."""
    entry = self.entry(self._index(problem))
    answer = extract_gym_answer(completion)
    if answer is None:
      return 0.0
    try:
      score = float(self.dataset.score_answer(answer=answer, entry=entry))
    except Exception as error:  # a scorer crashing on odd model output must not stop training
      logger.warning("%s score_answer raised %r on answer %r; scoring it 0.0", self.name, error,
                     answer[:80])
      return 0.0
    return score if np.isfinite(score) else 0.0


@dataclasses.dataclass(frozen=True)
class ReasoningGymFields:
  """The fields of a ``ReasoningGymTask`` as a config gives them (``options``: the dataset's own
  settings); ``make`` builds the task."""

  name: str | None = None
  size: int = 500
  seed: int = 0
  prompt_template: str = DEFAULT_GYM_TEMPLATE
  options: Mapping | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise FieldError("ReasoningGymFields", "name", f"must name a reasoning_gym dataset (e.g. "
                       f"'gsm_symbolic', 'chain_sum'), got {self.name!r}")
    if not isinstance(self.options or {}, Mapping) and not hasattr(self.options, "to_dict"):
      raise FieldError("ReasoningGymFields", "options", f"must be a section of the dataset's "
                       f"settings, got {self.options!r}")

  def make(self) -> ReasoningGymTask:
    """The task these fields describe."""
    return ReasoningGymTask(self.name, size=self.size, seed=self.seed,
                            prompt_template=self.prompt_template, **dict(self.options or {}))


@dataclasses.dataclass(frozen=True)
class MathDatasetFields:
  """The fields of a ``MathDatasetTask`` as a config gives them; ``make`` builds the task."""

  path: str | None = None
  prompt_template: str = DEFAULT_MATH_TEMPLATE
  question_key: str = "question"
  answer_key: str = "answer"

  def __post_init__(self):
    if not self.path:
      raise FieldError("MathDatasetFields", "path", "must name a GSM8K-style dataset file or "
                       "directory (.jsonl, .json or .parquet)")

  def make(self) -> MathDatasetTask:
    """The task these fields describe."""
    return MathDatasetTask(self.path, prompt_template=self.prompt_template,
                           question_key=self.question_key, answer_key=self.answer_key)
