"""Reasoning tasks with checkable answers: the interface and a built-in long-tail arithmetic task.

A task draws ``Problem``s (prompt, reference answer, a worked solution that ends in the answer)
from a numpy ``Generator`` and scores a completion with a 0/1 reward on its final answer.

``ArithmeticTask`` writes multi-digit addition (and optionally subtraction) as a char-level
carry trace, one fixed-width step per digit column from the right::

  47+85=? 7+5+0=12 4+8+1=13 #132        (x+y+carry_in = two-digit sum: carry out, digit)
  85-47=? 15-7-0=8 08-4-1=3 #38         (x borrowed-from as 1x when needed, minus y, minus borrow)

Every step is a true equation, so a trace can be checked step by step. Operand sizes follow a
truncated Zipf law over 1..max_digits, which makes trace lengths heavy-tailed (the RL long tail).

``EpochSchedule`` is the data order of epoch mode (``TrainerConfig.num_prompts``): a fixed prompt
set visited once per epoch, as RL on a dataset does, instead of fresh problems every step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Protocol, runtime_checkable

import numpy as np

ANSWER_MARK = "#"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance: the prompt text, the reference final answer and a worked solution."""

  prompt: str
  answer: str
  solution: str  # the text a perfect model writes after the prompt (ends with the answer)

  @property
  def text(self) -> str:
    """Prompt followed by its solution."""
    return self.prompt + self.solution


@runtime_checkable
class Task(Protocol):
  """What the RL loop needs from a task: problems to roll out and a reward for completions.

  A task may also have ``sample_distinct(rng, n)``: ``n`` problems that are distinct entries (a
  dataset's draw without replacement), which ``sample_distinct`` below then uses."""

  name: str
  alphabet: str  # every character a prompt or a solution may contain

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]: ...

  def reward(self, problem: Problem, completion: str) -> float: ...


def chat_prompt(tokenizer, text: str) -> str:
  """``text`` as one user message in the tokenizer's chat template, ending in the generation
  prompt (where the assistant's answer starts); encode the result with ``tokenizer.encode``,
  without a BOS of its own (the template writes whatever the model expects)."""
  render = getattr(tokenizer, "apply_chat_template", None)
  if not callable(render):
    raise ValueError(f"a {type(tokenizer).__name__} has no chat template; chat-formatted prompts "
                     "need a model's own tokenizer (an HF directory or a .gguf file), or set "
                     "task.chat_template=False")
  return render([{"role": "user", "content": text}], add_generation_prompt=True)


def extract_answer(completion: str) -> str | None:
  """The text after the last answer mark (``#``), stripped; None if there is no mark."""
  at = completion.rfind(ANSWER_MARK)
  if at < 0:
    return None
  return completion[at + len(ANSWER_MARK):].strip()


def truncated_zipf_probs(max_value: int, exponent: float) -> np.ndarray:
  """Probabilities of 1..max_value proportional to ``k ** -exponent``."""
  weights = np.arange(1, max_value + 1, dtype=np.float64) ** -exponent
  return weights / weights.sum()


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Multi-digit addition (and optionally subtraction) with a written digit-by-digit trace.

  The larger operand has ``n ~ Zipf(digit_exponent)`` digits truncated to ``1..max_digits``, the
  other a uniform ``1..n`` digits; subtraction problems never go below zero.
  """

  max_digits: int = 12
  digit_exponent: float = 1.5
  subtraction: bool = False
  # the warm start's teacher: in this share of the sums that carry out of their top digit it
  # forgets that carry in the answer (its steps stay right); 0: a perfect teacher
  teacher_error: float = 0.0
  name: str = "arithmetic"
  alphabet: str = "0123456789+-=?# "

  def __post_init__(self):
    if isinstance(self.teacher_error, bool) or not isinstance(self.teacher_error, (int, float)) \
        or not 0.0 <= self.teacher_error <= 1.0:
      raise ValueError(f"ArithmeticTask.teacher_error must be a share in [0, 1] (0: a perfect "
                       f"teacher), got {self.teacher_error!r}")
    if not isinstance(self.max_digits, int) or self.max_digits < 1:
      raise ValueError(f"ArithmeticTask.max_digits must be a positive int, got {self.max_digits!r}")
    if not self.digit_exponent > 0:
      raise ValueError(f"ArithmeticTask.digit_exponent must be > 0, got {self.digit_exponent!r}")

  def digit_probs(self) -> np.ndarray:
    """Probabilities of the larger operand having 1..max_digits digits."""
    return truncated_zipf_probs(self.max_digits, self.digit_exponent)

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` problems drawn from ``rng`` (same generator state, same problems)."""
    probs = self.digit_probs()
    problems = []
    for _ in range(n):
      digits = int(rng.choice(self.max_digits, p=probs)) + 1
      other = int(rng.integers(1, digits + 1))
      a, b = random_number(rng, digits), random_number(rng, other)
      op = "-" if self.subtraction and rng.random() < 0.5 else "+"
      if op == "+" and rng.random() < 0.5:
        a, b = b, a
      problems.append(self.make_problem(a, b, op))
    return problems

  def make_problem(self, a: int, b: int, op: str = "+") -> Problem:
    """The problem ``a op b`` with its trace; subtraction puts the larger operand first."""
    if op not in "+-" or len(op) != 1:
      raise ValueError(f"op must be '+' or '-', got {op!r}")
    if a < 0 or b < 0:
      raise ValueError(f"operands must be non-negative, got {a} and {b}")
    if op == "-" and a < b:
      a, b = b, a
    prompt = f"{a}{op}{b}=?"
    steps, digits = [], []
    xs, ys = str(a)[::-1], str(b)[::-1]
    carry = 0
    for i in range(max(len(xs), len(ys))):
      x = int(xs[i]) if i < len(xs) else 0
      y = int(ys[i]) if i < len(ys) else 0
      if op == "+":
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        carry, digit = divmod(total, 10)
      else:
        borrow = int(x - y - carry < 0)
        digit = 10 * borrow + x - y - carry
        steps.append(f"{10 * borrow + x:02d}-{y}-{carry}={digit}")
        carry = borrow
      digits.append(str(digit))
    if carry:
      digits.append(str(carry))
    answer = str(int("".join(reversed(digits))))
    assert answer == str(a + b if op == "+" else a - b)
    solution = " " + " ".join(steps) + f" {ANSWER_MARK}{answer}"
    return Problem(prompt=prompt, answer=answer, solution=solution)

  def taught(self, problems: list[Problem], rng: np.random.Generator) -> list[Problem]:
    """The warm start's traces of ``problems``: each sum that carries out of its top digit has,
    with probability ``teacher_error`` (drawn from ``rng``), its answer written without that
    carry (``57+68=?`` ... ``#25``); the reference answer, and so the reward, stay right."""
    if not self.teacher_error:
      return problems
    return [forget_final_carry(p) if carries_out(p) and rng.random() < self.teacher_error else p
            for p in problems]

  def reward(self, problem: Problem, completion: str) -> float:
    """1.0 if the completion's final answer (after its last ``#``) is the reference, else 0.0."""
    found = extract_answer(completion)
    if found is None or re.fullmatch(r"[0-9]+", found) is None:
      return 0.0
    return float(int(found) == int(problem.answer))


def carries_out(problem: Problem) -> bool:
  """Whether an addition's answer has more digits than its larger operand (a final carry)."""
  match = re.fullmatch(r"(\d+)\+(\d+)=\?", problem.prompt)
  return match is not None and len(problem.answer) > max(len(match[1]), len(match[2]))


def forget_final_carry(problem: Problem) -> Problem:
  """``problem`` whose solution ends in its answer without the leading carry digit (the steps
  unchanged); ``answer`` stays the right one."""
  cut = problem.solution.rfind(ANSWER_MARK) + len(ANSWER_MARK)
  wrong = str(int(problem.answer[1:]))
  return dataclasses.replace(problem, solution=problem.solution[:cut] + wrong)


def operand_digits(prompt: str) -> int:
  """Digits of the larger operand of an ``ArithmeticTask`` prompt (``"812+5=?"`` -> 3): the size
  its problems are drawn by (``digit_probs``), for breaking results down by it."""
  match = re.fullmatch(r"(\d+)[+-](\d+)=\?", prompt)
  if match is None:
    raise ValueError(f"not an arithmetic prompt (a+b=? or a-b=?): {prompt!r}")
  return max(len(match.group(1)), len(match.group(2)))


def random_number(rng: np.random.Generator, digits: int) -> int:
  """A uniform number with exactly ``digits`` digits (0..9 for one digit)."""
  if digits > 18:  # past int64: a leading digit and the rest (numbers of 18 digits and fewer
    # take the int64 draw below, so their problems are fixed by the seed)
    rest = "".join(str(d) for d in rng.integers(0, 10, size=digits - 1))
    return int(f"{int(rng.integers(1, 10))}{rest}")
  low = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(low, 10 ** digits))


# ---- epoch mode: a fixed prompt set, visited once per epoch ---------------------------------------
# seed-sequence tags of epoch mode's streams: [seed, PROMPT_SET_STREAM] draws the prompt set and
# [seed, EPOCH_ORDER_STREAM, epoch] each epoch's order (a fresh step's problems come from
# [seed, step]: two words, never three)
PROMPT_SET_STREAM = 0x5E7
EPOCH_ORDER_STREAM = 0xE90C
DISTINCT_STALLS = 8  # rounds of n draws in a row that find no new prompt before giving up


def sample_distinct(task, rng: np.random.Generator, n: int) -> list[Problem]:
  """``n`` problems with distinct prompts from ``rng``: the task's own ``sample_distinct`` if it
  has one, else ``task.sample`` in rounds of ``n`` draws, repeats dropped (a ValueError when
  ``DISTINCT_STALLS`` rounds in a row find nothing new: the task has too few problems)."""
  own = getattr(task, "sample_distinct", None)
  if callable(own):
    return own(rng, n)
  problems, seen, stalls = [], set(), 0
  while len(problems) < n:
    before = len(problems)
    for problem in task.sample(rng, n):
      if problem.prompt not in seen and len(problems) < n:
        seen.add(problem.prompt)
        problems.append(problem)
    stalls = 0 if len(problems) > before else stalls + 1
    if stalls >= DISTINCT_STALLS:
      raise ValueError(f"the task {getattr(task, 'name', type(task).__name__)!r} gave only "
                       f"{len(problems)} distinct prompts ({DISTINCT_STALLS} rounds of {n} draws "
                       f"found no new one), fewer than the {n} asked for: ask for fewer")
  return problems


class EpochSchedule:
  """Epoch mode's data order, a pure function of (seed, step) so that a resumed run sees the same
  data: ``num_prompts`` problems with distinct prompts, drawn once from the seed, and epoch ``e``
  visits each of them once in the order of a permutation drawn from (seed, e). The epochs are laid
  end to end and step ``s`` takes the ``per_step`` problems at positions ``s * per_step ...``.
  ``num_prompts < per_step`` is refused (every step would repeat prompts); where ``per_step`` does
  not divide ``num_prompts`` a step straddles two epochs, and may then hold a prompt of both (two
  groups of one prompt, each its own GRPO group).
  """

  def __init__(self, task, seed: int, num_prompts: int, per_step: int):
    for name, value in (("num_prompts", num_prompts), ("per_step", per_step)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"EpochSchedule.{name} must be a positive int, got {value!r}")
    if num_prompts < per_step:
      raise ValueError(f"epoch mode needs at least as many prompts as a step takes: num_prompts="
                       f"{num_prompts} < prompts_per_step={per_step} would repeat a prompt "
                       f"within a step; use num_prompts >= {per_step} (or 0: fresh problems "
                       "every step)")
    self.task, self.seed = task, seed
    self.num_prompts, self.per_step = int(num_prompts), int(per_step)
    self.problems = sample_distinct(task, np.random.default_rng([seed, PROMPT_SET_STREAM]),
                                    self.num_prompts)

  def order(self, epoch: int) -> np.ndarray:
    """Indices into ``problems`` in the order epoch ``epoch`` visits them."""
    rng = np.random.default_rng([self.seed, EPOCH_ORDER_STREAM, epoch])
    return rng.permutation(self.num_prompts)

  def epoch(self, step: int) -> int:
    """The epoch step ``step``'s first problem belongs to (0-based)."""
    return step * self.per_step // self.num_prompts

  def indices(self, step: int) -> list[int]:
    """Indices into ``problems`` of step ``step``'s problems."""
    first = step * self.per_step
    out, orders = [], {}
    for position in range(first, first + self.per_step):
      epoch, at = divmod(position, self.num_prompts)
      if epoch not in orders:
        orders[epoch] = self.order(epoch)
      out.append(int(orders[epoch][at]))
    return out

  def step_problems(self, step: int) -> list[Problem]:
    """The problems of RL step ``step``."""
    return [self.problems[i] for i in self.indices(step)]
