"""Tasks backed by outside data: local math datasets (GSM8K style) and ``reasoning_gym`` generators.

Both satisfy the ``Task`` protocol of ``tlt_jax.rl.tasks``. Optional packages (``datasets`` for
parquet files, ``reasoning_gym`` for procedural tasks) are imported only when needed and are not
dependencies of this package; a missing one raises an ImportError that says what to install.

Held-out problems (``sample_held_out``, what ``trainer.eval_problems`` evaluates on) never come
from what training draws, when the task is told where they are: a ``MathDatasetTask`` evaluates
on a separate file (``eval_path``) or on a share of its questions set aside before any training
draw (``eval_share``); a ``ReasoningGymTask`` with ``eval_share`` > 0 holds out the entries whose
question falls in that share of a hash of the question text. Without either, the held-out
problems are drawn from the training pool, and ``held_out_note`` says so in one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from tlt_jax.rl.rewards import extract_boxed, extract_final_answer, math_reward, math_scorer
from tlt_jax.rl.tasks import Problem
from tlt_jax.utils import FieldError

logger = logging.getLogger(__name__)

DEFAULT_MATH_TEMPLATE = ("{question}\nPlease reason step by step, and put your final answer "
                         "within \\boxed{}.")
DEFAULT_GYM_TEMPLATE = "{question}\nGive your final answer inside <answer></answer> tags."
_JSON_SUFFIXES = (".jsonl", ".json")
HELD_OUT_DRAW_TRIES = 1000  # draws for an entry of one side of a reasoning_gym split, then a scan


def question_place(question: str) -> float:
  """Where a question falls in [0, 1), from a hash of its text: a split by it keeps every copy of
  a question on one side, and follows neither the rows' order nor any seed."""
  return int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big") / 2.0**64


def check_eval_share(share: Any, owner: str, zero_means: str | None = None) -> float:
  """``share`` as a float in (0, 1) (or [0, 1) where ``zero_means`` says what 0 does), else a
  FieldError naming ``owner.eval_share``."""
  low_ok = (lambda x: x >= 0) if zero_means else (lambda x: x > 0)
  number = not isinstance(share, (bool, np.bool_)) and isinstance(share, (int, float, np.number))
  if not (number and low_ok(share) and share < 1):
    span = f"in [0, 1) (0: {zero_means})" if zero_means else "in (0, 1)"
    raise FieldError(owner, "eval_share", f"must be a number {span}: the share of the questions "
                     f"held out for evaluation, which training never draws; got {share!r}")
  return float(share)


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


def _distinct_indices(rng: np.random.Generator, n: Any, size: int, name: str,
                      held_out: int = 0) -> list[int]:
  """``n`` distinct indices of ``0..size-1`` from ``rng``, or a ValueError when ``n > size``
  (``held_out``: the problems set aside for evaluation, for the message)."""
  n = _check_n(n)
  if n > size:
    what = (f"{size} training problems ({held_out} more held out for evaluation)" if held_out
            else f"{size} problems")
    raise ValueError(f"{name} has {what}, fewer than the {n} distinct ones asked for; "
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

  Held-out problems (``held_out``, drawn by ``sample_held_out``) are the records of a separate
  file, ``eval_path`` (rows of ``path`` whose question it also holds are left out of training),
  or with ``eval_share`` the rows of about that share of ``path``'s distinct questions (at least
  one), picked by a hash of the question text, so the same ones whatever the seed or the rows'
  order. Either way ``problems``, what ``sample`` and ``sample_distinct`` draw from, holds none of
  them. With neither, ``held_out`` is None and the held-out problems are training rows.
  """

  def __init__(self, path: str | Path, prompt_template: str = DEFAULT_MATH_TEMPLATE,
               question_key: str = "question", answer_key: str = "answer",
               name: str | None = None, eval_path: str | Path | None = None,
               eval_share: float | None = None):
    _check_template(prompt_template, "MathDatasetTask")
    self.path = Path(path)
    self.prompt_template = prompt_template
    self.question_key = question_key
    self.answer_key = answer_key
    self.name = name if name is not None else f"math:{self.path.stem}"
    self.eval_path = Path(eval_path) if eval_path else None
    if self.eval_path is not None and eval_share is not None:
      raise ValueError("MathDatasetTask takes eval_path (a separate evaluation file) or "
                       "eval_share (a share of path's questions held out), not both")
    self.eval_share = None if eval_share is None else check_eval_share(
        eval_share, "MathDatasetTask")
    records = load_records(self.path)
    if not records:
      raise ValueError(f"Dataset {self.path} has no records.")
    rows = [self._to_problem(i, record, self.path) for i, record in enumerate(records)]
    self.dropped = 0  # training rows left out because the evaluation file holds their question
    self.held_out: list[Problem] | None = None
    if self.eval_path is not None:
      self.held_out = self._read_eval_file()
      self.problems = self._without(rows, {p.prompt for p in self.held_out}, "its eval_path")
      self.dropped = len(rows) - len(self.problems)
    elif self.eval_share is not None:
      self.held_out, self.problems = self._split(rows)
    else:
      self.problems = rows
    self.alphabet = _alphabet(p.prompt + p.solution for p in self.problems + (self.held_out or []))

  def _read_eval_file(self) -> list[Problem]:
    """The problems of ``eval_path``, or an error saying what is wrong with the file."""
    if not self.eval_path.exists():
      raise FileNotFoundError(f"The evaluation file eval_path={str(self.eval_path)!r} does not "
                              "exist; give a .jsonl, .json or .parquet file (or a directory of "
                              f"them) of held-out problems, or leave eval_path empty to hold out "
                              f"a share of {self.path} (eval_share).")
    records = load_records(self.eval_path)
    if not records:
      raise ValueError(f"The evaluation file eval_path={str(self.eval_path)!r} has no records; "
                       "give a file of held-out problems, or leave eval_path empty to hold out a "
                       f"share of {self.path} (eval_share).")
    return [self._to_problem(i, record, self.eval_path) for i, record in enumerate(records)]

  def _split(self, rows: list[Problem]) -> tuple[list[Problem], list[Problem]]:
    """(held-out rows, training rows): the rows of the ``eval_share`` of the distinct questions
    that come first by ``question_place``, and the others."""
    questions = sorted({p.prompt for p in rows}, key=lambda q: (question_place(q), q))
    k = max(1, round(self.eval_share * len(questions)))
    held = set(questions[:k])
    training = self._without(rows, held, f"eval_share={self.eval_share} ({k} of its "
                                         f"{len(questions)} distinct questions)")
    return [p for p in rows if p.prompt in held], training

  def _without(self, rows: list[Problem], held: set[str], why: str) -> list[Problem]:
    """``rows`` but those whose prompt is in ``held``; a ValueError if none is left."""
    kept = [p for p in rows if p.prompt not in held]
    if not kept:
      raise ValueError(f"Holding out the questions of {why} leaves {self.path} no training rows; "
                       "lower eval_share (a split holds one question out at least), or give "
                       "eval_path a file of other questions.")
    return kept

  def _to_problem(self, index: int, record: Any, path: Path) -> Problem:
    """The ``Problem`` of record ``index`` of ``path``, or a ValueError naming what it lacks."""
    if not isinstance(record, Mapping):
      raise ValueError(f"Record {index} of {path} is a {type(record).__name__}, expected an "
                       "object with question and answer fields.")
    for key in (self.question_key, self.answer_key):
      if key not in record:
        raise ValueError(f"Record {index} of {path} has no key {key!r} (its keys: "
                         f"{sorted(record)}); pass question_key=/answer_key= to match the data.")
    question, raw = record[self.question_key], record[self.answer_key]
    if not isinstance(question, str) or not question.strip():
      raise ValueError(f"Record {index} of {path}: {self.question_key!r} must be a non-empty "
                       f"string, got {question!r}")
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
      raise ValueError(f"Record {index} of {path}: {self.answer_key!r} must be a string or a "
                       f"number, got {raw!r}")
    raw = str(raw).strip()
    answer = extract_final_answer(raw)
    if answer is None:  # a bare answer such as "42" or "\frac{1}{2}"
      answer, solution = raw, f"\\boxed{{{raw}}}"
    else:  # a worked solution that ends in its answer
      solution = raw
    if not answer:
      raise ValueError(f"Record {index} of {path} has an empty answer in {self.answer_key!r}: "
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
    held = len(self.held_out or ())
    return [self.problems[i]
            for i in _distinct_indices(rng, n, len(self.problems), self.name, held)]

  def sample_held_out(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` held-out problems: distinct ones of ``held_out`` where it has ``n`` or more, else
    drawn with replacement; without ``held_out``, ``sample``'s draw from the training rows."""
    if self.held_out is None:
      return self.sample(rng, n)
    n, pool = _check_n(n), self.held_out
    picks = (rng.choice(len(pool), size=n, replace=False) if n <= len(pool)
             else rng.integers(0, len(pool), size=n))
    return [pool[int(i)] for i in picks]

  @property
  def held_out_size(self) -> int | None:
    """How many held-out problems there are to draw from (None: the training rows)."""
    return None if self.held_out is None else len(self.held_out)

  @property
  def held_out_note(self) -> str:
    """One line: where the held-out problems come from, and whether training draws them too."""
    if self.eval_path is not None:
      dropped = (f"; {self.dropped} rows of {self.path.name} with their questions were left out "
                 "of training" if self.dropped else "")
      return (f"held-out: the {len(self.held_out)} problems of {self.eval_path} (task.eval_path), "
              f"not drawn from the training pool{dropped}")
    if self.held_out is not None:
      return (f"held-out: {len(self.held_out)} rows of {self.path.name} (task.eval_share="
              f"{self.eval_share} of its distinct questions, by a hash of the text) set aside "
              f"before training, not drawn from the training pool: training draws from the other "
              f"{len(self.problems)} rows")
    return (f"held-out: drawn from the training pool, the rows of {self.path.name} training "
            "draws from (give eval_path or eval_share for problems training never sees)")

  @property
  def scorer(self) -> str:
    """The reward's scorer in this install (``math_reward``: with or without math_verify)."""
    return math_scorer()

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

  ``eval_share`` > 0 splits the entries by question: an entry is held out when its question text
  falls in the first ``eval_share`` of ``question_place``'s range (about that share of the
  distinct questions, the same ones whatever the seed), and training (``sample``,
  ``sample_distinct``) draws only the others, while ``sample_held_out`` draws only those. A task
  of few distinct questions (one-digit sums) would otherwise evaluate on questions it trains on.
  Entries are generated as they are drawn, as without a split. 0: no split, the held-out
  problems are training entries.
  """

  def __init__(self, name: str, size: int = 500, seed: int = 0,
               prompt_template: str = DEFAULT_GYM_TEMPLATE, eval_share: float = 0.0,
               **kwargs: Any):
    _check_template(prompt_template, "ReasoningGymTask")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(f"ReasoningGymTask size must be a positive int, got {size!r}")
    self.eval_share = check_eval_share(eval_share, "ReasoningGymTask", zero_means="no split")
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
    self._held: dict[int, bool] = {}  # entry index -> whether its question is held out

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
    """``n`` entries drawn uniformly with replacement (same generator state, same problems);
    with ``eval_share``, from the entries that are not held out."""
    n = _check_n(n)
    if not self.eval_share:
      return [self.problem(int(i)) for i in rng.integers(0, self.size, size=n)]
    return [self.problem(self._draw(rng, held_out=False)) for _ in range(n)]

  def sample_distinct(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` distinct entries drawn without replacement (epoch mode's prompt set); with
    ``eval_share``, the first ``n`` of a random order that are not held out."""
    if not self.eval_share:
      return [self.problem(i) for i in _distinct_indices(rng, n, self.size, self.name)]
    n, picked = _check_n(n), []
    for index in rng.permutation(self.size):
      if len(picked) == n:
        break
      if not self.is_held_out(int(index)):
        picked.append(int(index))
    if len(picked) < n:
      raise ValueError(f"{self.name} has {len(picked)} training entries (the other "
                       f"{self.size - len(picked)} are held out for evaluation, eval_share="
                       f"{self.eval_share}), fewer than the {n} distinct ones asked for; ask for "
                       f"at most {len(picked)} (or raise size)")
    return [self.problem(i) for i in picked]

  def sample_held_out(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` held-out entries drawn uniformly with replacement: with ``eval_share``, of those
    training never draws; without it, ``sample``'s (training) entries."""
    if not self.eval_share:
      return self.sample(rng, n)
    return [self.problem(self._draw(rng, held_out=True)) for _ in range(_check_n(n))]

  def is_held_out(self, index: int) -> bool:
    """Whether entry ``index``'s question is in the held-out share (generates it once)."""
    if index not in self._held:
      question = str(self.entry(index)["question"])
      self._held[index] = question_place(question) < self.eval_share
    return self._held[index]

  def _draw(self, rng: np.random.Generator, held_out: bool) -> int:
    """A uniform entry index of one side of the split: uniform draws until one is on that side,
    then (after ``HELD_OUT_DRAW_TRIES``) a draw from the whole side, which every entry is
    generated to find (a ValueError if it is empty)."""
    for _ in range(HELD_OUT_DRAW_TRIES):
      index = int(rng.integers(0, self.size))
      if self.is_held_out(index) == held_out:
        return index
    side = [i for i in range(self.size) if self.is_held_out(i) == held_out]
    if not side:
      which = ("is held out: none is left to train on; lower eval_share" if not held_out else
               "is training's: none is held out; raise eval_share")
      raise ValueError(f"every question of {self.name}'s {self.size} entries {which} (eval_share="
                       f"{self.eval_share}) or raise size")
    return side[int(rng.integers(0, len(side)))]

  @property
  def held_out_note(self) -> str:
    """One line: where the held-out problems come from, and whether training draws them too."""
    if self.eval_share:
      return (f"held-out: entries of {self.name} whose question is in the held-out task."
              f"eval_share={self.eval_share} of the questions (by a hash of the text), not drawn "
              "from the training pool: training never draws them")
    return (f"held-out: drawn from the training pool, the {self.size} entries of {self.name} "
            "training draws from (task.eval_share=0; > 0 holds questions out)")

  @property
  def scorer(self) -> str:
    """The reward's scorer: the dataset's own (math_verify plays no part)."""
    return f"reasoning_gym's {self.dataset_name} score_answer on the extracted answer"

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
  # the share of the questions held out for evaluation, never drawn by training (0: no split;
  # the held-out problems are then training entries, and the job's start line says so)
  eval_share: float = 0.1

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise FieldError("ReasoningGymFields", "name", f"must name a reasoning_gym dataset (e.g. "
                       f"'gsm_symbolic', 'chain_sum'), got {self.name!r}")
    check_eval_share(self.eval_share, "ReasoningGymFields", zero_means="no split, the held-out "
                     "problems are training entries")
    if not isinstance(self.options or {}, Mapping) and not hasattr(self.options, "to_dict"):
      raise FieldError("ReasoningGymFields", "options", f"must be a section of the dataset's "
                       f"settings, got {self.options!r}")

  def make(self) -> ReasoningGymTask:
    """The task these fields describe."""
    return ReasoningGymTask(self.name, size=self.size, seed=self.seed,
                            prompt_template=self.prompt_template, eval_share=self.eval_share,
                            **dict(self.options or {}))


@dataclasses.dataclass(frozen=True)
class MathDatasetFields:
  """The fields of a ``MathDatasetTask`` as a config gives them; ``make`` builds the task."""

  path: str | None = None
  prompt_template: str = DEFAULT_MATH_TEMPLATE
  question_key: str = "question"
  answer_key: str = "answer"
  # held-out problems, never drawn by training: the records of this evaluation file (same layout
  # and keys as path; rows of path with one of its questions are left out of training), or where
  # it is "", the rows of this share of path's distinct questions, set aside before training
  eval_path: str = ""
  eval_share: float = 0.1

  def __post_init__(self):
    if not self.path:
      raise FieldError("MathDatasetFields", "path", "must name a GSM8K-style dataset file or "
                       "directory (.jsonl, .json or .parquet)")
    if not isinstance(self.eval_path, str):
      raise FieldError("MathDatasetFields", "eval_path", "must be a path to an evaluation file "
                       f"(or \"\": hold out eval_share of path), got {self.eval_path!r}")
    check_eval_share(self.eval_share, "MathDatasetFields")

  def make(self) -> MathDatasetTask:
    """The task these fields describe: held-out problems from ``eval_path`` where it is given,
    else from an ``eval_share`` split of ``path``."""
    split = {"eval_path": self.eval_path} if self.eval_path else {"eval_share": self.eval_share}
    return MathDatasetTask(self.path, prompt_template=self.prompt_template,
                           question_key=self.question_key, answer_key=self.answer_key, **split)
