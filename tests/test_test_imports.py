"""The package's tests never import experiments/: every ``.py`` file under tests/ (this one, the
helpers and the mutation check included) is read for an import of ``experiments`` or one of its
modules. A test of an experiment script, of a module the scripts share (the step-time model,
``harness``, ``reproduce``) or of the docs' figures those make lives in experiments/tests/, which
``python -m pytest`` runs too (pyproject.toml's ``testpaths``). A file that has yet to move
there may be listed in ``PENDING`` (none is).

An import is any of: an ``import``/``from`` statement, anywhere in the file (inside a function
too); a string that names a module of experiments (``importlib.import_module("experiments.x")``,
``python -m experiments.x`` in a subprocess); a line of a string that is such a statement (code
run by ``python -c``). Reading an experiments file as text (e.g. the private-name check) is no
import.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
OTHER = "experiments"  # what the package's tests must not import
DOTTED_NAME = re.compile(rf"{OTHER}(\.[A-Za-z_]\w*)+")  # a module of it, named in a string
STATEMENT = re.compile(rf"^\s*(from\s+{OTHER}[\s.]|import\s+{OTHER}\b)", re.MULTILINE)

# Files not yet where the rule puts them, each with where it goes. A file listed here that no
# longer imports experiments (moved, or rewritten) fails the check until its entry is removed.
PENDING: dict[str, str] = {}


def _is_experiments(module: str) -> bool:
  return module == OTHER or module.startswith(OTHER + ".")


def experiments_imports(path: pathlib.Path) -> list[str]:
  """``"line: what"`` for each import of experiments in the Python file ``path``."""
  tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, f"import {a.name}") for a in node.names
                if _is_experiments(a.name)]
    elif isinstance(node, ast.ImportFrom) and not node.level and _is_experiments(node.module or ""):
      found.append((node.lineno, f"from {node.module} import ..."))
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      if DOTTED_NAME.fullmatch(node.value):
        found.append((node.lineno, repr(node.value)))
      elif STATEMENT.search(node.value):
        found.append((node.lineno, repr(STATEMENT.search(node.value).group(0).strip())))
  return [f"{line}: {what}" for line, what in sorted(set(found))]


def imports_by_file(root: pathlib.Path = ROOT, folder: str = "tests") -> dict[str, list[str]]:
  """Each ``.py`` file under ``root/folder`` that imports experiments (its path from ``root``)
  -> its imports."""
  found = {}
  for path in sorted((root / folder).rglob("*.py")):
    imports = experiments_imports(path)
    if imports:
      found[path.relative_to(root).as_posix()] = imports
  return found


def test_the_package_tests_import_nothing_of_experiments():
  found = imports_by_file()
  stale = sorted(set(PENDING) - set(found))
  assert not stale, ("these no longer import experiments (moved to "
                     f"{[PENDING[s] for s in stale]}?): remove them from PENDING: {stale}")
  found = {path: imports for path, imports in found.items() if path not in PENDING}
  assert not found, (
      "tests/ imports experiments (a test of an experiment goes to experiments/tests/):\n" +
      "\n".join(f"  {path}:{line}" for path, imports in found.items() for line in imports))


def test_the_experiments_tests_are_where_pytest_looks():
  """Every test file of experiments/ is in experiments/tests/, a folder of ``testpaths``."""
  setting = re.search(r"^testpaths = (.*)$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
  testpaths = ast.literal_eval(setting.group(1))
  assert testpaths == ["tests", f"{OTHER}/tests"]
  elsewhere = [p.relative_to(ROOT).as_posix() for p in (ROOT / OTHER).rglob("test_*.py")
               if p.parent != ROOT / OTHER / "tests"]
  assert not elsewhere, elsewhere
  assert (ROOT / OTHER / "tests" / "conftest.py").is_file()


def test_the_check_sees_each_kind_of_import(tmp_path):
  lines = [
      f"import {OTHER}",
      f"import os, {OTHER}.harness as h",
      f"from {OTHER}.rl import step_time",
      "def f():",
      f"  from {OTHER} import reproduce",
      f"  importlib.import_module('{OTHER}.system.accelerator_check')",
      f"  subprocess.run([sys.executable, '-m', '{OTHER}.reproduce', '--list'])",
      f"  subprocess.run([sys.executable, '-c', 'import sys\\nfrom {OTHER}.system import x\\n'])",
  ]
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_bad.py").write_text("\n".join(lines) + "\n")
  found = imports_by_file(tmp_path)["tests/test_bad.py"]
  assert [entry.split(":")[0] for entry in found] == ["1", "2", "3", "5", "6", "7", "8"], found


def test_the_check_leaves_what_imports_nothing(tmp_path):
  lines = [
      "import experiments_like",  # another module whose name starts the same
      "from tlt_jax import experiments",  # a name of the package
      f"ROOT / '{OTHER}' / 'README.md'",  # a path read as text
      f"'see {OTHER}/tests/ and python -m {OTHER}.x'",  # prose that names a command
      "from . import helpers",
  ]
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_good.py").write_text("\n".join(lines) + "\n")
  assert imports_by_file(tmp_path) == {}
