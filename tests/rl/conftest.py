"""Shared fixtures for the RL tests."""

import sys

import pytest

from tlt_jax.rl import rewards


@pytest.fixture(autouse=True)
def no_math_verify(monkeypatch):
  """Rewards use this package's own rules even where math_verify happens to be installed."""
  monkeypatch.setitem(sys.modules, "math_verify", None)
  rewards._load_math_verify.cache_clear()
  yield
  rewards._load_math_verify.cache_clear()
