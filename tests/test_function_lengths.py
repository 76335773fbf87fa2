"""The host loops read as the list of their steps: ``Scheduler.run_chunk`` (a chunk's segments),
the runner's ``run`` (the job) and the loop's ``train_steps`` (the RL steps), and every step
they call, are named functions of at most 60 lines each, so that a reader sees a loop's order on
one screen and each step can be read and tested alone."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOST_LINES = 60
LOOPS = {"tlt_jax/rollout/host/scheduler.py": ("Scheduler.run_chunk",),
         "tlt_jax/job/runner.py": ("run",), "tlt_jax/job/loop.py": ("train_steps", "Steps.step")}


def function_lengths(path: pathlib.Path) -> dict[str, int]:
  """Every function and method of the module at ``path``, nested ones too: its qualified name
  (``Class.method``, ``outer.inner``) and its lines, from ``def`` to its last line."""
  lengths = {}

  def visit(node: ast.AST, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = prefix + child.name
        if not isinstance(child, ast.ClassDef):
          lengths[name] = child.end_lineno - child.lineno + 1
        visit(child, name + ".")

  visit(ast.parse(path.read_text()), "")
  return lengths


@pytest.mark.parametrize("module", sorted(LOOPS))
def test_no_function_of_the_host_loops_is_over_60_lines(module):
  lengths = function_lengths(ROOT / module)
  assert set(LOOPS[module]) <= set(lengths), f"{module}: renamed? {LOOPS[module]}"
  too_long = {name: n for name, n in lengths.items() if n > MOST_LINES}
  assert not too_long, f"{module}: functions over {MOST_LINES} lines: {too_long}"


ROLLOUT = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tlt_jax" / "rollout").rglob("*.py"))


@pytest.mark.parametrize("module", ROLLOUT)
def test_no_function_of_the_rollout_is_over_60_lines(module):
  """The rollout's three layers (jitted steps, the host scheduler, the rollout over devices and
  processes) read function by function."""
  lengths = function_lengths(ROOT / module)
  too_long = {name: n for name, n in lengths.items() if n > MOST_LINES}
  assert not too_long, f"{module}: functions over {MOST_LINES} lines: {too_long}"
