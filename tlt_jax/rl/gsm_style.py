"""GSM8K-style word problems written from templates: a math task that needs no download.

Five templates (pencils, wages, a train, apples, muffins) filled with random numbers, each with
its integer answer. ``write_gsm_style_file`` stores them as the JSONL records that
``MathDatasetTask`` reads (a bare ``question`` and ``answer``), so an RL run on a machine
without datasets or network still trains on word problems with verifiable answers.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from tlt_jax.rl.external_tasks import DEFAULT_MATH_TEMPLATE

NAMES = ("Ava", "Liam", "Maya", "Noah", "Zoe", "Omar", "Ines", "Kenji", "Lena", "Ravi")


def gsm_style_questions(n: int, seed: int) -> list[tuple[str, int]]:
  """``n`` word problems (bare questions) with their integer answers, the templates in turn;
  the same ``seed`` gives the same problems."""
  rng = np.random.default_rng(seed)
  r = lambda lo, hi: int(rng.integers(lo, hi + 1))
  out = []
  for i in range(n):
    name = NAMES[int(rng.integers(len(NAMES)))]
    kind = i % 5
    if kind == 0:
      a, b, c = r(3, 12), r(6, 24), r(2, 20)
      text = (f"{name} buys {a} boxes of pencils. Each box holds {b} pencils. {name} gives "
              f"{c} pencils to friends. How many pencils does {name} have left?")
      answer = a * b - c
    elif kind == 1:
      a, b, c = r(12, 40), r(5, 7), r(2, 6)
      text = (f"{name} earns ${a} per hour and works {b} hours a day, 5 days a week. How much "
              f"money does {name} earn in {c} weeks?")
      answer = a * b * 5 * c
    elif kind == 2:
      a, b, c, d = r(30, 80), r(2, 5), r(20, 60), r(1, 4)
      text = (f"A train travels at {a} miles per hour for {b} hours, then at {c} miles per hour "
              f"for {d} hours. How many miles does the train travel in total?")
      answer = a * b + c * d
    elif kind == 3:
      friends, each, eaten = r(2, 6), r(3, 9), r(1, 10)
      text = (f"{name} picks {friends * each + eaten} apples, eats {eaten} of them and shares "
              f"the rest equally among {friends} friends. How many apples does each friend get?")
      answer = each
    else:
      a, b, c = r(20, 90), r(10, 40), r(2, 5)
      text = (f"A bakery bakes {a} muffins in the morning and {b} more in the afternoon. It "
              f"packs them in bags of {c} and keeps the rest. How many full bags does it pack?")
      answer = (a + b) // c
    out.append((text, answer))
  return out


def gsm_style_problems(n: int, seed: int) -> list[tuple[str, int]]:
  """``gsm_style_questions`` as prompts: each question in ``MathDatasetTask``'s default template
  (reason step by step, the answer in ``\\boxed{}``)."""
  return [(DEFAULT_MATH_TEMPLATE.replace("{question}", q), answer)
          for q, answer in gsm_style_questions(n, seed)]


def write_gsm_style_file(path, n: int, seed: int) -> pathlib.Path:
  """``n`` of ``gsm_style_questions`` as JSONL records (``question``, bare ``answer``) at
  ``path``: the layout ``MathDatasetTask`` reads, which adds the instruction itself."""
  path = pathlib.Path(path)
  path.write_text("".join(json.dumps(dict(question=q, answer=str(answer))) + "\n"
                          for q, answer in gsm_style_questions(n, seed)))
  return path
