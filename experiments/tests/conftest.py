"""The experiments' tests run under the package tests' setup, tests/conftest.py: JAX on the CPU,
XLA's cheapest backend, one compile cache for the session and every subprocess, heaviest files
first, and the torchvision check.

Importing it sets up the environment, once per process. Its hooks act here too: when pytest
collects only this folder it never loads tests/conftest.py, so the hooks below call it; when it
collects both folders (``python -m pytest``: ``testpaths`` in pyproject.toml), pytest calls
tests/conftest.py's own hooks for every test, and these stand aside rather than run them twice.
"""

from tests import conftest as package_setup


def _package_setup_loaded(config) -> bool:
  return config.pluginmanager.is_registered(package_setup)


def pytest_configure(config):
  if not _package_setup_loaded(config):
    package_setup.pytest_configure(config)


def pytest_collection_modifyitems(config, items):
  if not _package_setup_loaded(config):
    package_setup.pytest_collection_modifyitems(config, items)
