"""Every notebook in notebooks/ sets itself up and runs top to bottom, as a user would run it.

A notebook's first code cell is its setup: it finds the tlt_jax checkout it sits in (or the one
``TLT_JAX_SOURCE`` names) and installs tlt_jax from it with ``pip install -e``, unless tlt_jax
already imports from there. The fast tier runs that cell in process, with pip replaced, on
folders made for the purpose. The full tier executes each notebook as from a fresh clone: a copy
of this working tree (git's tracked and untracked-but-not-ignored files, so uncommitted edits
count) in a temporary folder, and a kernel from a new venv where tlt_jax does not import until
the first cell installs it from that copy. The kernel's working directory is the copy's
notebooks/ (Jupyter's default), so a notebook that reads a file by a path outside the copy, or
relative to another working directory, fails here.

The new venv is not bare: installing JAX and the rest from an index would take minutes, so it
sees this interpreter's packages, less tlt_jax, through a folder of links, and its pip runs with
no index (``PIP_NO_INDEX``) and no build isolation (the setuptools it builds with is one of
those). What the first cell must install is then tlt_jax itself (matplotlib is there already).

The notebooks assert their own results (lossless decoding, acceptance after drafter training, a
GRPO reward that rises), so this also checks that those still hold. Outputs are not written back;
to refresh the stored outputs, execute the notebooks in notebooks/ with nbclient (kernel
``python3``) and save them with nbformat.
"""

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys

import pytest

from tests.xla_env import FAST_COMPILE_FLAGS

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
COMPILE_BOUND = {"01_rollout_engine.ipynb"}  # run with the tests' fast-compile flags (see below)
KERNEL = "tlt_jax_fresh_clone"
# what installing tlt_jax leaves in a site-packages folder: the package (a plain install), its
# metadata, setuptools' editable finder and .pth, a legacy egg-link
TLT_JAX_INSTALL = re.compile(r"(__editable__[._]+)?tlt[_-]jax", re.IGNORECASE)


def test_there_are_notebooks():
  """The glob finds the four notebooks, in their reading order (the tests below run each)."""
  assert [p.name for p in NOTEBOOKS] == ["01_rollout_engine.ipynb",
                                         "02_speculative_decoding.ipynb", "03_grpo.ipynb",
                                         "04_adaptive_tlt.ipynb"]
  assert all(p.parent == NOTEBOOK_DIR and p.is_file() for p in NOTEBOOKS)


def setup_cell(path: pathlib.Path) -> str:
  """The source of the notebook's first code cell."""
  nb = nbformat.read(path, as_version=4)
  return next(cell.source for cell in nb.cells if cell.cell_type == "code")


def test_every_notebook_starts_with_the_same_setup_cell():
  """One setup cell, word for word, in all four, and it installs with pip from a checkout."""
  first = {path.name: setup_cell(path) for path in NOTEBOOKS}
  assert len(set(first.values())) == 1, "the notebooks' first code cells differ"
  source = first[NOTEBOOKS[0].name]
  assert "'pip', 'install', '-q', '-e', str(CHECKOUT)" in source
  assert "TLT_JAX_SOURCE" in source


def run_setup_cell(cwd: pathlib.Path, monkeypatch) -> tuple[dict, str, list]:
  """Runs the setup cell in this process from ``cwd``, pip replaced by a recorder: returns its
  globals, what it printed and the commands it would have run. ``sys.path`` is restored after."""
  calls = []

  def fake_run(argv, **kwargs):  # pylint: disable=unused-argument
    calls.append(list(argv))
    return subprocess.CompletedProcess(argv, 0, "", "")

  monkeypatch.setattr(subprocess, "run", fake_run)
  monkeypatch.setattr(sys, "path", list(sys.path))
  monkeypatch.chdir(cwd)
  scope, printed = {}, io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(setup_cell(NOTEBOOKS[0]), scope)  # pylint: disable=exec-used
  return scope, printed.getvalue(), calls


def fake_checkout(folder: pathlib.Path) -> pathlib.Path:
  """A folder that the setup cell takes for a tlt_jax checkout (its tlt_jax is not importable)."""
  (folder / "notebooks").mkdir(parents=True)
  (folder / "pyproject.toml").write_text('[project]\nname = "tlt_jax"\nversion = "0.1.0"\n')
  return folder.resolve()


def test_setup_cell_installs_nothing_when_tlt_jax_imports_from_the_checkout(monkeypatch):
  monkeypatch.delenv("TLT_JAX_SOURCE", raising=False)
  import tlt_jax  # pylint: disable=import-outside-toplevel
  checkout = pathlib.Path(tlt_jax.__file__).resolve().parents[1]  # this test's own tlt_jax
  scope, printed, calls = run_setup_cell(checkout / "notebooks", monkeypatch)
  assert scope["CHECKOUT"] == checkout and not calls
  assert f"tlt_jax already imports from {checkout}: nothing installed" in printed


def test_setup_cell_installs_the_checkout_it_sits_in(tmp_path, monkeypatch):
  monkeypatch.delenv("TLT_JAX_SOURCE", raising=False)
  checkout = fake_checkout(tmp_path / "clone")
  scope, printed, calls = run_setup_cell(checkout / "notebooks", monkeypatch)
  assert scope["CHECKOUT"] == checkout
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", "-e", str(checkout),
                    "matplotlib"]]
  assert sys.path[0] == str(checkout)  # this kernel imports it without a restart
  assert f"installed tlt_jax from {checkout} (pip install -e)" in printed
  assert "TLT_JAX_SOURCE" in printed  # and says how to pick another


def test_setup_cell_takes_the_checkout_tlt_jax_source_names(tmp_path, monkeypatch):
  other = fake_checkout(tmp_path / "elsewhere")
  monkeypatch.setenv("TLT_JAX_SOURCE", str(other))
  scope, _, calls = run_setup_cell(ROOT / "notebooks", monkeypatch)  # not the one it sits in
  assert scope["CHECKOUT"] == other and calls[0][-2:] == [str(other), "matplotlib"]
  monkeypatch.setenv("TLT_JAX_SOURCE", str(other / "notebooks"))  # not a checkout: no walking up
  with pytest.raises(FileNotFoundError, match="TLT_JAX_SOURCE"):
    run_setup_cell(ROOT / "notebooks", monkeypatch)


def test_setup_cell_outside_a_checkout_says_what_to_do(tmp_path, monkeypatch):
  monkeypatch.delenv("TLT_JAX_SOURCE", raising=False)
  (tmp_path / "pyproject.toml").write_text('[project]\nname = "another"\n')  # not tlt_jax's
  with pytest.raises(FileNotFoundError, match="set TLT_JAX_SOURCE to its path"):
    run_setup_cell(tmp_path, monkeypatch)


def copy_checkout(dest: pathlib.Path) -> None:
  """This working tree as a fresh clone of it would be: git's tracked files and its untracked
  ones that are not ignored, uncommitted edits included (without git: the tree, less .git and
  build output)."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=ROOT, capture_output=True, check=False)
  if listed.returncode:
    shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", ".ipynb_checkpoints", "build", "runs"))
    return
  for name in filter(None, listed.stdout.decode().split("\0")):
    source, target = ROOT / name, dest / name
    if not source.is_symlink() and not source.exists():
      continue  # deleted in the working tree, not yet in git
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
      target.symlink_to(os.readlink(source))
    else:
      shutil.copy2(source, target)


def venv_without_tlt_jax(where: pathlib.Path) -> pathlib.Path:
  """A new venv that sees this interpreter's packages (JAX, ipykernel, pip, setuptools, ...) but
  not tlt_jax: a .pth adds a folder of links to them, those of tlt_jax's install left out.
  Returns its python."""
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")], check=True)
  python = where / "venv" / "bin" / "python"
  purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
  links = where / "packages"
  links.mkdir()
  site_dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE
                                        else [])
  for site_dir in filter(os.path.isdir, site_dirs):
    for entry in pathlib.Path(site_dir).iterdir():
      if not TLT_JAX_INSTALL.match(entry.name) and not (links / entry.name).exists():
        (links / entry.name).symlink_to(entry)
  # addsitedir, not a bare path: the links' own .pth files (e.g. setuptools') still run
  (pathlib.Path(purelib) / "test_packages.pth").write_text(
      f"import site; site.addsitedir({str(links)!r})\n")
  return python


def imports_tlt_jax(python: pathlib.Path, cwd: pathlib.Path) -> subprocess.CompletedProcess:
  return subprocess.run([python, "-c", "import tlt_jax; print(tlt_jax.__file__)"], cwd=cwd,
                        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                        capture_output=True, text=True, check=False)


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
  """(the copy of the checkout, the kernel's python): a kernel spec named ``KERNEL`` runs a new
  venv in which tlt_jax does not import. The kernel inherits this environment, less PYTHONPATH
  and TLT_JAX_SOURCE, so the first cell finds the copy by walking up, and pip uses no index."""
  clone = (tmp_path / "clone").resolve()
  copy_checkout(clone)
  python = venv_without_tlt_jax(tmp_path)
  before = imports_tlt_jax(python, tmp_path)
  assert before.returncode and "No module named 'tlt_jax'" in before.stderr, \
      f"tlt_jax imports in the new venv before any install: {before.stdout}{before.stderr}"
  spec = tmp_path / "jupyter" / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "tlt_jax fresh clone", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.delenv("PYTHONPATH", raising=False)
  monkeypatch.delenv("TLT_JAX_SOURCE", raising=False)
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")  # pip reads "0" here as --no-build-isolation
  monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
  return clone, python


def stdout_of(cell) -> str:
  return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")


# the full tier executes every notebook (each takes 1-3 minutes: too long for the fast tier)
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, fresh_clone, monkeypatch):
  clone, python = fresh_clone
  # The kernel inherits the session's persistent compile cache (tests/conftest.py): a program
  # built twice (03 trains twice) or by two notebooks is loaded, not compiled, the second time.
  # Results are unchanged: an entry is keyed by the program and its compile options.
  # XLA's default optimisation, as a user's kernel has: a notebook runs real training (where the
  # fast-compile flags of conftest.py cost more than they save) and asserts what it learned. The
  # one notebook that mostly compiles keeps the flags (measured alone, 2026-12-06: 01 took 15 s
  # with them and 30 s without; 02, 03 and 04 took 69 / 113 / 51 s with them, 56 / 76 / 43 s
  # without)
  if path.name not in COMPILE_BOUND:
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE_FLAGS,
                                                                             "").strip())
  notebook = clone / "notebooks" / path.name
  nb = nbformat.read(notebook, as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell("import tlt_jax\nprint(tlt_jax.__file__)"))
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name=KERNEL,
                                   resources={"metadata": {"path": str(notebook.parent)}})
  client.execute()  # raises CellExecutionError on the first failing cell

  setup = next(cell for cell in nb.cells if cell.cell_type == "code")
  assert f"installed tlt_jax from {clone} (pip install -e)" in stdout_of(setup), stdout_of(setup)
  assert stdout_of(nb.cells[-1]).strip() == str(clone / "tlt_jax" / "__init__.py")
  after = imports_tlt_jax(python, clone.parent)  # a new kernel finds the install too
  assert after.stdout.strip() == str(clone / "tlt_jax" / "__init__.py"), after.stderr


def test_notebooks_are_saved_with_outputs():
  """The stored notebooks show their results on GitHub: every code cell ran, no errors."""
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), f"{path.name}: unexecuted cells"
    assert not any(out.output_type == "error" for cell in code for out in cell.outputs), \
        f"{path.name}: saved with an error"
    images = sum("image/png" in out.get("data", {}) for cell in code for out in cell.outputs)
    assert images >= 1, f"{path.name}: no plot in the stored outputs"
