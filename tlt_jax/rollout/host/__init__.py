"""The rollout's host layer: the scheduler that drives the jitted steps of ``rollout.decode``.

``scheduler`` (segments and their strategies), ``buckets`` and ``pool`` (batch and KV buckets,
one compiled program each), ``tuner`` (which strategy each bucket runs), ``offers`` (the
drafter offers a rollout weighs), ``stats`` (what a rollout reports) and ``engine_config`` (the
engine's settings resolved).
Imports ``rollout.decode``, never the rollouts above (``rollout``); ``tests/test_import_graph.py``
checks it.
"""
