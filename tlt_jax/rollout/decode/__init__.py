"""The rollout's pure layer: jitted decoding, and the drafter kinds it drafts with.

``sampling`` (token sampling), ``speculative`` (draft trees and their lossless verification),
``kinds`` (the drafter kinds' protocol and registry), one module per built-in kind that declares
and registers it (``learned``: a drafter model; ``ngram`` and ``suffix``: the drafters that copy
from the context or the history, and beside the suffix drafter ``suffix_history``, the host-side
store of earlier completions it drafts from, saved with the run) and ``steps`` (the decode steps
the engine compiles, which look a kind up in the registry). Nothing here imports the host
scheduler (``rollout.host``) or the rollouts (``rollout``); ``tests/test_import_graph.py`` checks
it.
"""

# the built-in kinds register themselves in ``kinds.KINDS`` when their modules are imported
from tlt_jax.rollout.decode import learned, ngram, suffix  # noqa: F401  pylint: disable=unused-import
