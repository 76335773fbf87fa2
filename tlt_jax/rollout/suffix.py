"""Model-free drafter over the rollout's own history: suffix matches in earlier completions of the
same prompt, in the current group's partial responses and in the prompt itself.

(Work in progress: the configuration is fixed first so that the RL side can be built against it.)
"""

from __future__ import annotations

import dataclasses

from tlt_jax.utils import require_positive_ints

SOURCES = ("history", "group", "prompt", "self")  # where a suffix draft was copied from


@dataclasses.dataclass(frozen=True)
class SuffixConfig:
  """Static settings of the suffix drafter.

  ``max_ngram`` / ``min_ngram``: the suffix lengths matched (longest first); ``history_len``: the
  tokens of earlier completions each row can draft from (the newest first, cut to this many);
  ``depth``: draft levels of the default chain strategy (``EngineConfig.suffix_strategies``
  empty: one chain of this depth)."""

  max_ngram: int = 4
  min_ngram: int = 1
  depth: int = 8
  history_len: int = 512

  def __post_init__(self):
    require_positive_ints(self, "max_ngram", "min_ngram", "depth", "history_len")
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"SuffixConfig.min_ngram ({self.min_ngram}) must be <= "
                       f"SuffixConfig.max_ngram ({self.max_ngram})")
