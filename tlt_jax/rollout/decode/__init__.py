"""The rollout's pure layer: jitted decoding with no host state.

``sampling`` (token sampling), ``speculative`` (draft trees and their lossless verification),
``ngram`` and ``suffix`` (the drafters that copy from the context or the history), ``kinds``
(the ``DrafterKind`` protocol, one class per kind) and ``steps`` (the decode steps the engine
compiles). Nothing here imports the host scheduler (``rollout.host``) or the rollouts
(``rollout``); ``tests/test_import_graph.py`` checks it.
"""
