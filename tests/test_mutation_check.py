"""The mutation check's mutants still apply: each one's text occurs exactly once in its file (a
refactor that moves the code would otherwise leave a mutant that tests nothing until someone runs
the whole check by hand), names are unique, and each names tests that exist."""

import collections

from tests.mutation_check import MUTANTS, ROOT


def test_every_mutant_applies_exactly_once_and_names_existing_tests():
  stale = {}
  for m in MUTANTS:
    path = ROOT / m.file
    count = path.read_text().count(m.old) if path.is_file() else 0
    if count != 1:
      stale[m.name] = (m.file, count)
  assert not stale, f"mutants whose text does not occur exactly once (file, count): {stale}"
  names = collections.Counter(m.name for m in MUTANTS)
  assert [n for n, c in names.items() if c > 1] == []
  for m in MUTANTS:
    assert m.old != m.new and m.tier in ("fast", "full") and m.why, m.name
    # the package's tests or the experiments' (experiments/tests/)
    paths = [t.split("::")[0] for t in m.tests if t.startswith(("tests/", "experiments/tests/"))]
    assert paths and all((ROOT / p).exists() for p in paths), (m.name, m.tests)
