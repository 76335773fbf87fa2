"""Rooms keep their names private: no module of ``tlt_jax`` reads another module's private name,
no test or experiment reads a private name of ``tlt_jax``, and nothing imports ``jax._src``.

The check reads the source (no import). In a file it flags

* an import of a private name or from a private module: ``from x import _name``,
  ``from jax._src import y``, ``import jax._src.z`` (``__future__`` and dunders are public);
* an attribute read ``thing._name`` (not a dunder), or the same by name (``getattr``,
  ``setattr``, ``hasattr``, ``delattr`` or ``monkeypatch.setattr`` with ``"_name"``), where
  ``thing`` is not ``self`` or ``cls`` and ``_name`` is not the file's own: defined in it by a
  ``def``, a ``class``, an assignment's target (``_name = ...``, ``self._name = ...``, a class
  body's ``_name: int``), a parameter or an import. Setting ``other._name = ...`` counts as a
  read. A class that reads its own private field on another of its instances
  (``other._cache``) is therefore fine; the same read from another file is not.

A few underscore names are public API by the language's documented convention: a named tuple's
``_replace``/``_fields``/``_asdict``/``_make``/``_field_defaults`` and ``os._exit`` (the exit
with no clean-up a forked or signalled process needs). Those are allowed; nothing else is.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC_BY_CONVENTION = frozenset({"_replace", "_fields", "_asdict", "_make", "_field_defaults",
                                  "_exit"})


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(tree: ast.AST) -> set[str]:
  """The private names a file defines: defs, classes, assignment targets (names, and attributes
  of ``self``/``cls``: setting ``other._name`` defines nothing), annotated fields, parameters,
  imports' local names and comprehension/loop/with targets."""
  names: set[str] = set()

  def targets(node: ast.AST) -> None:  # names, and attributes of self/cls (not another's)
    for sub in ast.walk(node):
      if isinstance(sub, ast.Name):
        names.add(sub.id)
      elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
            and sub.value.id in ("self", "cls")):
        names.add(sub.attr)

  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      for target in node.targets:
        targets(target)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.comprehension,
                           ast.NamedExpr)):
      targets(node.target)
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
      targets(node.optional_vars)
    elif isinstance(node, ast.arg):
      names.add(node.arg)
    elif isinstance(node, ast.alias):
      names.add(node.asname or node.name.split(".")[0])
  return {name for name in names if _private(name)}


BY_STRING = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _called(func: ast.expr) -> str:
  """The name a call calls: ``getattr`` for ``getattr(...)`` and ``monkeypatch.setattr(...)``."""
  return func.id if isinstance(func, ast.Name) else func.attr if isinstance(
      func, ast.Attribute) else ""


def _foreign(name: str, own: set[str], owner: ast.expr) -> bool:
  """Whether reading ``owner.name`` reads another file's private name."""
  return (_private(name) and name not in own and name not in PUBLIC_BY_CONVENTION
          and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")))


def _private_module(module: str) -> bool:
  return any(_private(part) for part in module.split(".")) and module != "__future__"


def private_reads(path: pathlib.Path) -> list[str]:
  """``file:line name`` for each read of another file's private name in the file at ``path``."""
  tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
  own = own_names(tree)
  where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names if _private_module(alias.name)]
    elif isinstance(node, ast.ImportFrom):
      module = node.module or ""
      if _private_module(module):
        found.append((node.lineno, module))
      found += [(node.lineno, alias.name) for alias in node.names if _private(alias.name)]
    elif isinstance(node, ast.Attribute) and _foreign(node.attr, own, node.value):
      found.append((node.lineno, node.attr))
    elif (isinstance(node, ast.Call) and _called(node.func) in BY_STRING and len(node.args) >= 2
          and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
          and _foreign(node.args[1].value, own, node.args[0])):
      found.append((node.lineno, node.args[1].value))
  return [f"{where}:{line} {name}" for line, name in sorted(set(found))]


def _scan(folder: str) -> list[str]:
  found = []
  for path in sorted((ROOT / folder).rglob("*.py")):
    found += private_reads(path)
  return found


def test_no_module_of_tlt_jax_reads_another_modules_private_name():
  found = _scan("tlt_jax")
  assert not found, "private names read across modules (give them a public name):\n  " + \
      "\n  ".join(found)


def test_no_test_or_experiment_reads_a_private_name_of_tlt_jax():
  found = _scan("tests") + _scan("experiments")
  assert not found, "tests or experiments reading private names (use the public API):\n  " + \
      "\n  ".join(found)


def test_the_check_sees_each_kind_of_private_read(tmp_path):
  path = tmp_path / "m.py"
  path.write_text(
      "from __future__ import annotations\n"
      "import jax._src.xla_bridge\n"
      "from jax._src import distributed\n"
      "from pkg.mod import _helper, public\n"
      "class C:\n"
      "  _mine = 1\n"
      "  def __init__(self, other):\n"
      "    self._own = other._own + other._mine + self._anything + other.__dict__\n"
      "    self.x = other._theirs\n"
      "    other._set = 1\n"
      "def f(engine, row):\n"
      "  return engine._executables, row._replace(a=1), public._helper2\n"
      "def g(monkeypatch, engine):\n"
      "  monkeypatch.setattr(engine, '_share', 0.0)\n"
      "  return getattr(engine, '_mine'), hasattr(self, '_x'), getattr(engine, 'public')\n")
  assert private_reads(path) == [f"{path}:2 jax._src.xla_bridge", f"{path}:3 jax._src",
                                 f"{path}:4 _helper", f"{path}:9 _theirs", f"{path}:10 _set",
                                 f"{path}:12 _executables", f"{path}:12 _helper2",
                                 f"{path}:14 _share"]
