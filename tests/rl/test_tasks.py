"""The arithmetic task: correct traces, rewards, a heavy length tail, determinism."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.rl.tasks import ANSWER_MARK, ArithmeticTask, Problem, Task, carries_out, \
    extract_answer, forget_final_carry, operand_digits

_STEP = re.compile(r"^(\d{1,2})([+-])(\d)[+-](\d)=(\d{1,2})$")


def parse_steps(solution: str) -> list[tuple[int, str, int, int, int]]:
  """The ``(x, op, y, carry_in, result)`` steps of a trace (everything before the answer mark)."""
  steps = []
  for chunk in solution.split(ANSWER_MARK)[0].split():
    match = _STEP.match(chunk)
    assert match is not None, f"not a trace step: {chunk!r}"
    x, op, y, c, r = match.groups()
    steps.append((int(x), op, int(y), int(c), int(r)))
  return steps


TASKS = [ArithmeticTask(), ArithmeticTask(subtraction=True)]


def check_trace(problem: Problem) -> None:
  """Asserts every step of the trace is a true column step and the answer follows from them."""
  lhs = problem.prompt.removesuffix("=?")
  op = "-" if "-" in lhs else "+"
  a, b = map(int, lhs.split(op))
  xs, ys = str(a)[::-1], str(b)[::-1]
  steps = parse_steps(problem.solution)
  assert len(steps) == max(len(xs), len(ys))
  carry, digits = 0, []
  for i, (x, step_op, y, c, r) in enumerate(steps):
    assert step_op == op
    assert c == carry, f"step {i} of {problem.text!r} uses carry {c}, expected {carry}"
    assert x % 10 == (int(xs[i]) if i < len(xs) else 0)
    assert y == (int(ys[i]) if i < len(ys) else 0)
    if op == "+":
      assert x + y + c == r and x < 10
      carry, digit = divmod(r, 10)
    else:
      assert x - y - c == r and 0 <= r <= 9
      carry, digit = x // 10, r  # "1x" means the column borrowed
    digits.append(digit)
  if carry:
    assert op == "+", "a subtraction must not end with a borrow"
    digits.append(carry)
  assert int("".join(map(str, reversed(digits)))) == int(problem.answer)
  assert int(problem.answer) == (a + b if op == "+" else a - b)
  assert extract_answer(problem.solution) == problem.answer


@pytest.mark.parametrize("task", TASKS, ids=["add", "add_sub"])
def test_traces_are_correct_arithmetic_and_score_one(task):
  assert isinstance(task, Task)
  tokenizer = CharTokenizer(task.alphabet)
  for problem in task.sample(np.random.default_rng(0), 500):
    check_trace(problem)
    tokenizer.encode(problem.text)  # every character is in the alphabet
    assert task.reward(problem, problem.solution) == 1.0


def test_hand_written_examples():
  task = ArithmeticTask()
  assert task.make_problem(47, 85).text == "47+85=? 7+5+0=12 4+8+1=13 #132"
  assert task.make_problem(85, 47, "-").text == "85-47=? 15-7-0=8 08-4-1=3 #38"
  assert task.make_problem(47, 85, "-").prompt == "85-47=?"
  for a, b, op in [(0, 0, "+"), (999, 1, "+"), (100, 99, "-"), (5, 5, "-"),
                   (123456789, 987654321, "+")]:
    check_trace(task.make_problem(a, b, op))


def test_reward_is_zero_for_wrong_or_garbage_answers():
  task = ArithmeticTask()
  problem = task.make_problem(47, 85)
  wrong = problem.solution.replace("#132", "#133")
  for completion in [wrong, "", "garbage", " 7+5+0=12 4+8+1=13", "#", "#13 2", "#-132", "#132x",
                     "#132#1", " #1e2"]:
    assert task.reward(problem, completion) == 0.0, completion
  # Only the final answer counts: a sloppy trace with the right answer still earns the reward,
  # as do surrounding spaces and leading zeros.
  for completion in ["#132", " 1+1+1=99 #132", "#0132 ", "#1#132"]:
    assert task.reward(problem, completion) == 1.0, completion


def test_solution_lengths_have_a_heavy_tail():
  problems = ArithmeticTask().sample(np.random.default_rng(1), 2000)
  lengths = np.array([len(p.solution) for p in problems])
  assert np.percentile(lengths, 99) >= 4 * np.median(lengths)


def test_same_seed_same_problems():
  for task in TASKS:
    first = task.sample(np.random.default_rng(7), 50)
    assert first == task.sample(np.random.default_rng(7), 50)
    assert first != task.sample(np.random.default_rng(8), 50)


def test_invalid_settings_are_rejected():
  with pytest.raises(ValueError, match="max_digits"):
    ArithmeticTask(max_digits=0)
  with pytest.raises(ValueError, match="digit_exponent"):
    ArithmeticTask(digit_exponent=0.0)
  with pytest.raises(ValueError, match="op"):
    ArithmeticTask().make_problem(1, 2, "*")


def test_sums_put_the_longer_operand_first_or_second_alike():
  """The larger operand of a sum is drawn first, then the pair is swapped half of the time: a
  model sees "5+123=?" as often as "123+5=?" (subtractions keep the larger one first)."""
  problems = ArithmeticTask(max_digits=6).sample(np.random.default_rng(2), 2000)
  lengths = [tuple(len(x) for x in p.prompt[:-2].split("+")) for p in problems]
  first, second = sum(a > b for a, b in lengths), sum(a < b for a, b in lengths)
  assert first > 200 and second > 200 and abs(first - second) < 0.2 * (first + second)
  for p in ArithmeticTask(max_digits=6, subtraction=True).sample(np.random.default_rng(2), 500):
    if "-" in p.prompt:
      a, b = (int(x) for x in p.prompt[:-2].split("-"))
      assert a >= b, p.prompt


def test_operand_digits_is_the_larger_operands_size():
  """The size a problem is drawn by: over many draws, each size's share follows digit_probs
  (a parse that took the first operand, or the result, would not)."""
  task = ArithmeticTask(max_digits=4, subtraction=True)
  assert operand_digits(task.make_problem(812, 5).prompt) == 3
  assert operand_digits(task.make_problem(5, 812, "-").prompt) == 3  # larger first: 812-5=?
  assert operand_digits("7+12345=?") == 5
  sizes = [operand_digits(p.prompt) for p in task.sample(np.random.default_rng(0), 4000)]
  shares = np.bincount(sizes, minlength=5)[1:] / len(sizes)
  np.testing.assert_allclose(shares, task.digit_probs(), atol=0.03)
  with pytest.raises(ValueError, match="not an arithmetic prompt"):
    operand_digits("What is 2+2?")


def test_operands_past_int64_are_drawn_and_traced_exactly():
  """The long-tail job's 24-digit operands (numpy's integers stop at 10**18): every digit count
  comes out as asked, the trace checks, and 18 digits and fewer draw as they always did."""
  task = ArithmeticTask(max_digits=24, digit_exponent=0.5)
  problems = task.sample(np.random.default_rng(3), 300)
  sizes = {max(len(p.prompt.split("+")[0]), len(p.prompt.split("+")[1][:-2])) for p in problems}
  assert max(sizes) == 24 and min(sizes) == 1
  for p in problems:
    a, b = (int(x) for x in p.prompt[:-2].split("+"))
    assert p.answer == str(a + b) and task.reward(p, p.solution) == 1.0
  from tlt_jax.rl import tasks  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  assert tasks.random_number(rng, 18) == int(np.random.default_rng(5).integers(10 ** 17, 10 ** 18))
  assert all(len(str(tasks.random_number(rng, 19))) == 19 for _ in range(50))


def test_a_flawed_teacher_forgets_the_final_carry_of_its_share_of_sums():
  """``teacher_error``: the share of sums with a final carry whose warm-start trace ends in the
  answer without it; the steps, the reference answer and the reward stay right, and sums
  without a final carry are always taught right."""
  task = ArithmeticTask(max_digits=3, teacher_error=0.6)
  problem = task.make_problem(57, 68)
  assert carries_out(problem) and not carries_out(task.make_problem(12, 34))
  assert not carries_out(task.make_problem(99, 1, "-"))
  wrong = forget_final_carry(problem)
  assert wrong.solution == " 7+8+0=15 5+6+1=12 #25" and wrong.answer == "125"
  assert task.reward(problem, wrong.solution) == 0.0 and task.reward(problem, problem.solution) == 1
  assert forget_final_carry(task.make_problem(5, 5)).solution.endswith("#0")
  problems = task.sample(np.random.default_rng(0), 4000)
  taught = task.taught(problems, np.random.default_rng(1))
  flawed = [t != p for p, t in zip(problems, taught)]
  assert not any(f for p, f in zip(problems, flawed) if not carries_out(p))
  share = np.mean([f for p, f in zip(problems, flawed) if carries_out(p)])
  assert abs(share - 0.6) < 0.04, share
  perfect = ArithmeticTask(max_digits=3)
  assert perfect.taught(problems, np.random.default_rng(1)) is problems
  for bad in (-0.1, 1.5, True, "0.5"):
    with pytest.raises(ValueError, match="teacher_error must be a share in"):
      ArithmeticTask(teacher_error=bad)
