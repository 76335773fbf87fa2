"""Benchmark and check scripts over ``tlt_jax`` (see README.md here): ``harness`` is what they
share, ``reproduce`` runs them per paper table, and each topic is a subpackage."""
