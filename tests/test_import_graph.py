"""No import circles in ``tlt_jax``: the module import graph, read from the source, is acyclic.

Every ``.py`` file under ``tlt_jax/`` is a module (a package's ``__init__.py`` is the package);
its edges are its imports of other ``tlt_jax`` modules, those inside functions included (a lazy
import still ties the two modules together). ``from tlt_jax.x import y`` is an edge to module
``tlt_jax.x.y`` when that is a module, else to ``tlt_jax.x``; relative imports resolve against the
importing module's package. Importing a submodule also runs its packages' ``__init__``, but
that is no edge: a package importing its own submodules is the normal layout, not a circle.

The rollout is three layers, each importing only the layers below it: ``tlt_jax.rollout.decode``
(pure jitted decoding: sampling, drafts, their verification, the decode steps),
``tlt_jax.rollout.host`` (the host scheduler: segments, buckets, the tuner, the stats) and the
top ``tlt_jax.rollout`` (the rollouts over one device, N devices or N processes). The package
``tlt_jax.rollout`` is its one door: no module outside it, in ``tlt_jax`` or ``experiments``,
imports a rollout submodule (its ``__init__`` re-exports what they need).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = "tlt_jax"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_files(root: pathlib.Path, package: str = PACKAGE) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every ``.py`` file of ``package`` under ``root``."""
  files = {}
  for path in sorted((root / package).rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    files[".".join(parts)] = path
  return files


def _anchor(module: str, is_package: bool, level: int) -> str:
  """The package a relative import of ``level`` dots in ``module`` starts from."""
  parts = module.split(".")
  if not is_package:
    parts = parts[:-1]
  return ".".join(parts[:len(parts) - (level - 1)])


def _known(name: str, modules: set[str]) -> str | None:
  """``name`` if it is a module, else its nearest enclosing module (None outside them)."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name or None


def imports_of(module: str, path: pathlib.Path, modules: set[str],
               package: str = PACKAGE) -> set[str]:
  """The modules of ``package`` that ``module`` (in file ``path``) imports anywhere in its code."""
  tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
  is_package = path.name == "__init__.py"
  found: set[str] = set()
  for node in ast.walk(tree):
    targets: list[str] = []
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = _anchor(module, is_package, node.level)
        base = f"{anchor}.{base}" if base else anchor
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    for target in targets:
      if target == package or target.startswith(package + "."):
        resolved = _known(target, modules)
        if resolved is not None and resolved != module:
          found.add(resolved)
  return found


def import_graph(root: pathlib.Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
  """Module -> the package modules it imports."""
  files = module_files(root, package)
  return {name: imports_of(name, path, set(files), package) for name, path in files.items()}


def _shortest_cycle(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
  """The shortest path ``[start, ..., start]`` inside ``component`` (breadth first)."""
  paths = {start: [start]}
  frontier = [start]
  while frontier:
    following = []
    for node in frontier:
      for nxt in sorted(graph[node] & component):
        if nxt == start:
          return paths[node] + [start]
        if nxt not in paths:
          paths[nxt] = paths[node] + [nxt]
          following.append(nxt)
    frontier = following
  raise AssertionError(f"{start} is on no cycle of its component {sorted(component)}")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import cycles ``[a, b, ..., a]``: in each strongly connected component of more than one
  module, the shortest cycle through each of its modules (each cycle listed once)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[set[str]] = []

  def visit(node: str) -> None:  # Tarjan's algorithm
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in sorted(graph.get(node, ())):
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      component = set()
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.add(member)
        if member == node:
          break
      if len(component) > 1:
        components.append(component)

  for node in sorted(graph):
    if node not in index:
      visit(node)
  found: dict[tuple[str, ...], list[str]] = {}
  for component in components:
    for start in sorted(component):
      cycle = _shortest_cycle(graph, component, start)
      turn = cycle.index(min(cycle[:-1]))  # one entry per cycle, however it is entered
      key = tuple(cycle[turn:-1] + cycle[:turn])
      found.setdefault(key, list(key) + [key[0]])
  return sorted(found.values())


def test_the_package_has_no_import_cycle():
  graph = import_graph()
  found = cycles(graph)
  assert not found, "import cycles in tlt_jax (each: a module, what it imports, ... back):\n" + \
      "\n".join("  " + " -> ".join(cycle) for cycle in found)


# The rollout's layers, lowest first; a module belongs to the last layer whose name prefixes it.
ROLLOUT_LAYERS = ("tlt_jax.rollout.decode", "tlt_jax.rollout.host", "tlt_jax.rollout")
ROLLOUT_TOP = {"tlt_jax.rollout", "tlt_jax.rollout.interface", "tlt_jax.rollout.engine",
               "tlt_jax.rollout.parallel", "tlt_jax.rollout.processes", "tlt_jax.rollout.make"}


def layer_of(module: str, layers: tuple[str, ...]) -> int | None:
  """The index in ``layers`` (lowest first) of the layer ``module`` is in; None outside them all.
  A module is in a layer when it is the layer's package or inside it; a layer nested in another
  (``rollout.host`` in ``rollout``) takes its modules from the outer one."""
  found = [i for i, layer in enumerate(layers) if module == layer or module.startswith(layer + ".")]
  return min(found, key=lambda i: -len(layers[i])) if found else None


def layer_violations(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
  """``"a -> b"`` for each import of a module ``a`` of one layer from a higher layer's ``b``."""
  found = []
  for module, imported in sorted(graph.items()):
    own = layer_of(module, layers)
    for target in sorted(imported):
      other = layer_of(target, layers)
      if own is not None and other is not None and other > own:
        found.append(f"{module} -> {target}")
  return found


def test_the_rollout_layers_import_only_downwards():
  graph = import_graph()
  found = layer_violations(graph, ROLLOUT_LAYERS)
  assert not found, "a rollout layer imports a higher one (decode < host < rollout):\n" + \
      "\n".join("  " + edge for edge in found)
  rollout = {m for m in graph if layer_of(m, ROLLOUT_LAYERS) is not None}
  assert {m for m in rollout if layer_of(m, ROLLOUT_LAYERS) == 2} == ROLLOUT_TOP
  assert "tlt_jax.rollout.decode.speculative" in graph["tlt_jax.rollout.decode.steps"]
  assert "tlt_jax.rollout.decode.steps" in graph["tlt_jax.rollout.host.pool"]
  assert "tlt_jax.rollout.host.scheduler" in graph["tlt_jax.rollout.engine"]


def test_a_layer_importing_upwards_is_found(tmp_path):
  _write(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "from pkg.low import a\n",
                    "pkg/low/__init__.py": "", "pkg/low/a.py": "def f():\n  from pkg import top\n",
                    "pkg/low/b.py": "from pkg.low import a\n"})
  graph = import_graph(tmp_path, "pkg")
  assert layer_violations(graph, ("pkg.low", "pkg")) == ["pkg.low.a -> pkg.top"]


# ---- the rollout's one door -----------------------------------------------------------------
# Code outside the rollout package reaches it through the package alone (``tlt_jax/rollout/
# __init__.py``): its submodules are the package's own business. Tests under tests/ may import
# them to test them; the package and the experiments may not.
DOOR = "tlt_jax.rollout"
DOOR_USERS = (PACKAGE, "experiments")  # whose modules must use the door


def door_violations(graph: dict[str, set[str]], door: str) -> list[str]:
  """``"a -> b"`` for each import, by a module ``a`` outside package ``door``, of a module ``b``
  inside it (the package itself is the door and fine)."""
  inside = lambda name: name.startswith(door + ".")
  return [f"{module} -> {target}" for module, imported in sorted(graph.items())
          if module != door and not inside(module)
          for target in sorted(imported) if inside(target)]


def user_graph(root: pathlib.Path = ROOT, users: tuple[str, ...] = DOOR_USERS,
               package: str = PACKAGE) -> dict[str, set[str]]:
  """Module -> the modules of ``package`` it imports, for every module of each of ``users`` (the
  package itself among them, or e.g. the experiments, which import it from outside)."""
  known = set(module_files(root, package))
  graph = {}
  for user in users:
    for name, path in module_files(root, user).items():
      graph[name] = imports_of(name, path, known, package)
  return graph


def test_code_outside_the_rollout_imports_only_its_package():
  graph = user_graph()
  outside = [name for name in graph if name.split(".")[0] != PACKAGE]  # the experiments' modules
  assert len(outside) > 10 and "tlt_jax.rl.trainer" in graph
  found = door_violations(graph, DOOR)
  assert not found, ("a module outside tlt_jax/rollout/ imports one of its submodules; import the "
                     "name from tlt_jax.rollout (re-exported in its __init__.py) instead:\n" +
                     "\n".join("  " + edge for edge in found))
  assert DOOR in graph["tlt_jax.rl.trainer"]


def test_a_submodule_import_past_the_door_is_found(tmp_path):
  _write(tmp_path, {"pkg/__init__.py": "", "pkg/door/__init__.py": "from pkg.door.room import x\n",
                    "pkg/door/room.py": "from pkg.door import other\nx = 1\n",
                    "pkg/door/other.py": "", "pkg/user.py": "from pkg.door import x\n",
                    "pkg/sneak.py": "def f():\n  from pkg.door.room import x\n",
                    "pkg/deep.py": "import pkg.door.other\n",
                    "out/script.py": "from pkg.door import room\n"})
  graph = user_graph(tmp_path, ("pkg", "out"), "pkg")
  assert door_violations(graph, "pkg.door") == ["out.script -> pkg.door.room",
                                                "pkg.deep -> pkg.door.other",
                                                "pkg.sneak -> pkg.door.room"]


def test_the_graph_sees_lazy_and_package_imports():
  graph = import_graph()
  assert "tlt_jax.models.gguf" in graph["tlt_jax.models.load"]  # imported inside a function
  assert "tlt_jax.models.weights" in graph["tlt_jax.models.hf"]
  assert "tlt_jax.models.load" in graph["tlt_jax.models"]  # the package's __init__


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_relative_and_lazy_imports_close_a_cycle(tmp_path):
  _write(tmp_path, {
      "pkg/__init__.py": "from pkg.a import thing\n",
      "pkg/a.py": "from . import b\nthing = 1\n",
      "pkg/sub/__init__.py": "",
      "pkg/b.py": "def f():\n  from .sub import c\n",
      "pkg/sub/c.py": "from .. import a\nfrom ..a import thing\n",
      "pkg/d.py": "import pkg.sub.c\nfrom pkg import thing\n",
  })
  graph = import_graph(tmp_path, "pkg")
  assert graph["pkg"] == {"pkg.a"}
  assert graph["pkg.b"] == {"pkg.sub.c"}
  assert graph["pkg.sub.c"] == {"pkg.a"}
  assert graph["pkg.d"] == {"pkg.sub.c", "pkg"}
  assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_an_acyclic_package_passes(tmp_path):
  _write(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n", "pkg/a.py": "from pkg import b\n",
                    "pkg/b.py": "import os\n"})
  assert cycles(import_graph(tmp_path, "pkg")) == []


def notebook_door_violations(root: pathlib.Path = ROOT, door: str = DOOR) -> list[str]:
  """``"notebook: module"`` for each import of a submodule of ``door`` in a notebook's code cells
  (shell and magic lines left out): a notebook is a user's first code, and uses the door too."""
  import json  # pylint: disable=import-outside-toplevel
  found = []
  for path in sorted((root / "notebooks").glob("*.ipynb")):
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
      if cell["cell_type"] != "code":
        continue
      lines = [line for line in "".join(cell["source"]).splitlines()
               if not line.lstrip().startswith(("!", "%"))]
      for node in ast.walk(ast.parse("\n".join(lines))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.name}: {name}" for name in names if name.startswith(door + ".")]
  return found


def test_the_notebooks_import_only_the_rollout_package():
  assert list((ROOT / "notebooks").glob("*.ipynb")), "no notebooks found"
  found = notebook_door_violations()
  assert not found, ("a notebook imports a rollout submodule; import the name from "
                     "tlt_jax.rollout instead:\n" + "\n".join("  " + f for f in found))
