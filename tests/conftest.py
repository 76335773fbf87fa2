"""Shared test setup: keep JAX on the CPU and quiet."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
