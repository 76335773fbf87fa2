"""Shared fixtures for the RL tests."""

import sys

import pytest

from tlt_jax.rl import rewards


@pytest.fixture
def no_math_verify(monkeypatch):
  """math_verify hidden (as if not installed): rewards use this package's own rules only."""
  monkeypatch.setitem(sys.modules, "math_verify", None)
  rewards.load_math_verify.cache_clear()
  yield
  rewards.load_math_verify.cache_clear()


@pytest.fixture
def real_math_verify():
  """The installed math_verify package, which ``math_reward`` consults first."""
  import math_verify as module  # pylint: disable=import-outside-toplevel  (a dev extra: no skip)
  rewards.load_math_verify.cache_clear()
  assert rewards.load_math_verify() is module
  yield module
  rewards.load_math_verify.cache_clear()
