"""Math answer rewards: extraction, normalisation, numeric comparison, optional math_verify."""

from __future__ import annotations

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
])
def test_math_reward(completion, reference, reward):
  assert math_reward(completion, reference) == reward


def fake_math_verify(verdict) -> types.ModuleType:
  """A stand-in for math_verify whose ``verify`` returns ``verdict`` (or raises it)."""
  module = types.ModuleType("math_verify")
  module.parse = lambda text: [text]

  def verify(gold, pred):
    if isinstance(verdict, Exception):
      raise verdict
    return verdict

  module.verify = verify
  return module


def test_math_verify_is_asked_first(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", fake_math_verify(True))
  rewards._load_math_verify.cache_clear()
  assert math_reward(r"\boxed{\sqrt{4}}", "2") == 1.0  # beyond this module's own rules
  assert math_reward(r"\boxed{\sqrt{4}}", "2", use_math_verify=False) == 0.0
  assert math_reward("no answer stated", "2") == 0.0  # extraction still decides what is answered


@pytest.mark.parametrize("verdict", [False, RuntimeError("parser broke")])
def test_math_verify_falls_back(monkeypatch, verdict):
  monkeypatch.setitem(sys.modules, "math_verify", fake_math_verify(verdict))
  rewards._load_math_verify.cache_clear()
  assert math_reward(r"\boxed{1,000}", "1000") == 1.0
  assert math_reward(r"\boxed{999}", "1000") == 0.0
