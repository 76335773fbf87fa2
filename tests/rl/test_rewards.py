"""Math answer rewards: extraction, normalisation, numeric comparison, optional math_verify."""

from __future__ import annotations

import concurrent.futures
import sys
import types

import pytest

from tlt_jax.rl import rewards
from tlt_jax.rl.rewards import (answers_match, extract_boxed, extract_final_answer, math_reward,
                                normalize_answer, parse_number)


@pytest.mark.parametrize("text, expected", [
    (r"so the result is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\sqrt{\frac{a}{b}}} done", r"\sqrt{\frac{a}{b}}"),
    (r"first \boxed{1}, then \boxed{2}", "2"),
    (r"\fbox{7}", "7"),
    (r"\boxed {  -3 }", "-3"),
    (r"\boxed{\boxed{3}}", r"\boxed{3}"),
    (r"\boxed{1} and a truncated \boxed{\frac{2}{", "1"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed 9", "9"),
    ("no box here", None),
    (r"\boxed{", None),
])
def test_extract_boxed(text, expected):
  assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    (r"We get \boxed{5}. The answer is 6.", "5"),  # a box beats any phrase
    ("Adding up: 48 + 24 = 72\n#### 72", "72"),
    ("#### 1,200\n", "1,200"),
    ("<think>hmm</think><answer> 12 </answer>", "12"),
    ("So the answer is 18.", "18"),
    ("The answer is $\\frac{1}{2}$.", "$\\frac{1}{2}$"),
    ("The final answer is: 3.5. Done.", "3.5"),
    ("Answer: **-4**", "-4"),
    ("I think the answer is 2.\nWait, no: the answer is 3.", "3"),  # the last phrase wins
    ("#### 8\nWait, I dropped a carry.\n#### 7", "7"),  # a revised GSM8K answer: the last one
    ("<answer>8</answer> on reflection <answer>7</answer>", "7"),  # the last tag
    ("The final answer to this arithmetic problem is 12.", "12"),  # SmolLM2's own phrasing
    ("The answer to the given problem is -5.", "-5"),
    ("The final answer to this problem is 6300 - 3680 = 2620.", "2620"),  # the result of the line
    ("The answer, as computed, is 4.", None),  # "answer" must run into "is" by to/of/for
    ("I have no idea.", None),
    ("", None),
])
def test_extract_final_answer(text, expected):
  assert extract_final_answer(text) == expected


@pytest.mark.parametrize("raw, expected", [
    ("1,000", "1000"),
    ("-1,234,567.5", "-1234567.5"),
    ("1{,}000", "1000"),
    ("\\$18.", "18"),
    ("$x = 5$", "5"),
    (r"\text{east}", "east"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    ("1,2", "1,2"),  # not a thousands pattern: a pair stays a pair
    (r"\dfrac{3}{4}", r"\frac{3}{4}"),
    (r"\boxed{7}", "7"),
    ("90^\\circ", "90"),
    ("50\\%", "50"),
    (r"\pi r^2", r"\pi r^2"),  # the space that ends a LaTeX command survives
    ("\u22125", "-5"),
    (" 42 ", "42"),
])
def test_normalize_answer(raw, expected):
  assert normalize_answer(raw) == expected


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-7", -7.0), ("3.50", 3.5), (".5", 0.5), ("1e3", 1000.0), ("1/4", 0.25),
    (r"\frac{1}{2}", 0.5), (r"-\frac{3}{4}", -0.75), (r"\frac12", 0.5), ("1/0", None),
    ("x", None), ("1,2", None), (r"\sqrt{2}", None),
])
def test_parse_number(text, value):
  assert parse_number(text) == value


@pytest.mark.parametrize("answer, reference", [
    ("0.5", r"\frac{1}{2}"), ("1/2", "0.5"), ("18.00", "18"), ("1,000", "1000"), ("-3", "-3.0"),
    ("1000000.0000001", "1000000"), (r"\text{(B)}", "(B)"), ("x=4", "4"),
])
def test_answers_match(answer, reference):
  assert answers_match(answer, reference)


@pytest.mark.parametrize("answer, reference", [
    ("0.5", "0.51"), ("-3", "3"), ("1,2", "12"), ("", ""), ("east", "west"), ("1.001", "1"),
])
def test_answers_differ(answer, reference):
  assert not answers_match(answer, reference)


@pytest.fixture(params=["own_rules", "math_verify"])
def checker(request):
  """Each reward test runs twice: with math_verify hidden, and with the installed package."""
  fixture = "no_math_verify" if request.param == "own_rules" else "real_math_verify"
  request.getfixturevalue(fixture)
  return request.param


@pytest.mark.parametrize("completion, reference, reward", [
    (r"... so \boxed{72}", "72", 1.0),
    (r"... so \boxed{72}", "Natalia sold 72 clips.\n#### 72", 1.0),  # GSM8K reference field
    (r"\boxed{1200}", "#### 1,200", 1.0),
    (r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", 1.0),
    ("The answer is -7.", "-7", 1.0),
    ("#### 3.5", "3.50", 1.0),
    (r"\boxed{71}", "72", 0.0),
    ("It is 72 for sure", "72", 0.0),  # no stated final answer
    ("", "72", 0.0),
    (r"\boxed{}", "72", 0.0),
    (r"first \boxed{72}, then on reflection \boxed{70}", "72", 0.0),  # only the last box counts
    ("#### 8 ... wait, that forgets a carry ... #### 7", "7", 1.0),  # the last marked answer
    ("#### 7 ... wait, that forgets a carry ... #### 8", "7", 0.0),
])
def test_math_reward(checker, completion, reference, reward):
  assert math_reward(completion, reference) == reward


def test_own_rules_without_math_verify(no_math_verify):
  assert rewards.load_math_verify() is None
  assert math_reward(r"\boxed{\frac{1}{2}}", "0.5") == 1.0  # numbers: this module's own parser
  assert math_reward(r"\boxed{\sqrt{4}}", "2") == 0.0  # beyond its rules


# --- the installed math_verify package -------------------------------------------------------


@pytest.mark.parametrize("completion, reference", [
    (r"so \boxed{\sqrt{4}}", "2"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{\{1,2\}}", r"\{2,1\}"),
    ("The answer is $\\frac{\\sqrt{3}}{2}$.", r"\frac{\sqrt3}{2}"),
    (r"\boxed{\frac{\pi}{2}}", r"Half a turn: \boxed{\frac{1}{2}\pi}"),
])
def test_math_verify_accepts_what_own_rules_cannot(real_math_verify, completion, reference):
  assert math_reward(completion, reference) == 1.0
  assert math_reward(completion, reference, use_math_verify=False) == 0.0


@pytest.mark.parametrize("completion, reference", [
    (r"\boxed{3}", "4"), (r"\boxed{\sqrt{5}}", "2"), (r"\boxed{\pi}", "3.14159"),
    (r"\boxed{(1,2)}", "(2,1)"), (r"\boxed{x^2+1}", "(x+1)^2"), ("The answer is 2.", "#### -2"),
    (r"\boxed{4} is wrong; the answer is 5", "5"),  # the box wins over the phrase
])
def test_math_verify_rejects_wrong_answers(real_math_verify, completion, reference):
  assert math_reward(completion, reference) == 0.0


def test_equivalent_forms_with_math_verify(real_math_verify):
  assert rewards.math_verify_says(r"\frac{1}{2}", "0.5") is True
  assert math_reward(r"We halve it: \boxed{\frac{1}{2}}", "0.5") == 1.0
  assert math_reward(r"\boxed{0.5}", r"\boxed{\tfrac{1}{2}}") == 1.0
  assert math_reward(r"\boxed{\text{1,000}} apples", "#### 1000") == 1.0
  assert math_reward("The final answer is: $x = 6$.", "6") == 1.0


def test_own_rules_decide_when_math_verify_says_no(real_math_verify):
  assert rewards.math_verify_says("1e3", "1000") is False
  assert math_reward(r"\boxed{1e3}", "1000") == 1.0
  assert rewards.math_verify_says("1000000.0000001", "1000000") is False
  assert math_reward(r"\boxed{1000000.0000001}", "1000000") == 1.0


def test_math_verify_works_outside_the_main_thread(real_math_verify):
  """math_verify's SIGALRM timeouts fail off the main thread; the verdict must not change there."""
  pairs = [(r"\boxed{\sqrt{4}}", "2"), (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"), (r"\boxed{3}", "4")]
  in_main = [math_reward(c, r) for c, r in pairs]
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    in_threads = list(pool.map(lambda pair: math_reward(*pair), pairs))
  assert in_main == [1.0, 1.0, 0.0]
  assert in_threads == in_main


# --- fallback when math_verify fails (a fake module: the real one does not crash on demand) --


def fake_math_verify(verdict) -> types.ModuleType:
  """A stand-in for math_verify whose ``verify`` returns ``verdict`` (or raises it)."""
  module = types.ModuleType("math_verify")
  module.parse = lambda text, **kwargs: [text]

  def verify(gold, pred, **kwargs):
    if isinstance(verdict, Exception):
      raise verdict
    return verdict

  module.verify = verify
  return module


@pytest.mark.parametrize("verdict", [False, RuntimeError("parser broke")])
def test_math_verify_falls_back(monkeypatch, verdict):
  monkeypatch.setitem(sys.modules, "math_verify", fake_math_verify(verdict))
  rewards.load_math_verify.cache_clear()
  try:
    assert math_reward(r"\boxed{1,000}", "1000") == 1.0
    assert math_reward(r"\boxed{999}", "1000") == 0.0
  finally:
    rewards.load_math_verify.cache_clear()
