"""Model-free drafter: propose a continuation by n-gram lookup over a row's group.

In GRPO every prompt is sampled G times, and the G responses of one group tend to repeat each
other's phrases. When no learned drafter is ready, a row's next tokens can often be guessed by
finding its last n tokens earlier in its own context or in a sibling's, and copying what followed.

Conventions (all shapes static, everything jittable):

* Row ``b``'s context is ``prompt_tokens[b, :prompt_lens[b]] ++ gen_tokens[b, :gen_lens[b]]``;
  ``gen_tokens`` already holds the newest token, so the context ends with it. Token ids are >= 0.
* Rows with ``group_ids[b] < 0`` are padding: they get ``draft_len == 0`` and are never searched.
* For ``n = max_ngram, ..., min_ngram`` (longest first, stop at the first ``n`` that matches) the
  suffix of length ``n`` is looked up among occurrences that are followed by at least one token
  (so the suffix's own position at the end of the context never counts):
  1. in the row's own context, the most recent occurrence (largest end position) wins;
  2. otherwise, among siblings (other rows with the same group id): the occurrence with the most
     following tokens (counted up to ``depth``), then the lowest row index, then the most recent.
* The draft is up to ``depth`` tokens that followed the chosen occurrence in its row;
  ``draft_len`` counts them (0 when nothing matched), and later entries of ``draft`` are 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tlt_jax.rollout.decode.kinds import DrafterKind, ModelFreeKind, register
from tlt_jax.utils import require_positive_ints

_PAD = -1  # marks context slots past a row's length; never equal to a token id
_NO_QUERY = -2  # marks suffix slots a short row does not have; never equal to anything


@dataclasses.dataclass(frozen=True)
class NgramConfig:
  """Static settings of the n-gram drafter: suffix lengths tried and how many tokens to propose."""

  max_ngram: int = 4
  min_ngram: int = 1
  depth: int = 8

  def __post_init__(self):
    require_positive_ints(self, "max_ngram", "min_ngram", "depth")
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"NgramConfig.min_ngram ({self.min_ngram}) must be <= NgramConfig.max_ngram "
                       f"({self.max_ngram})")


def contexts(prompt_tokens: jax.Array, prompt_lens: jax.Array, gen_tokens: jax.Array,
              gen_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Lays each row's prompt then response into ``[B, P+N]``, padded with -1; also its lengths."""
  _, p = prompt_tokens.shape
  n = gen_tokens.shape[1]
  plen = jnp.clip(prompt_lens.astype(jnp.int32), 0, p)
  ctx_len = plen + jnp.clip(gen_lens.astype(jnp.int32), 0, n)
  both = jnp.concatenate([prompt_tokens, gen_tokens], axis=1).astype(jnp.int32)
  j = jnp.arange(p + n, dtype=jnp.int32)[None, :]
  src = jnp.where(j < plen[:, None], j, p + j - plen[:, None])
  ctx = jnp.take_along_axis(both, jnp.clip(src, 0, p + n - 1), axis=1)
  return jnp.where(j < ctx_len[:, None], ctx, _PAD), ctx_len


def shift(x: jax.Array, k: int) -> jax.Array:
  """``x[..., e - k]`` at position ``e`` along the last axis (``k < 0``: ``x[..., e + |k|]``),
  ``_PAD`` where that falls outside."""
  if k == 0:
    return x
  pad = jnp.full(x.shape[:-1] + (abs(k),), _PAD, x.dtype)
  if k > 0:
    return jnp.concatenate([pad, x[..., :-k]], axis=-1)
  return jnp.concatenate([x[..., -k:], pad], axis=-1)


@functools.partial(jax.jit, static_argnames=("max_ngram", "min_ngram", "depth"))
def ngram_propose(prompt_tokens: jax.Array, prompt_lens: jax.Array, gen_tokens: jax.Array,
                  gen_lens: jax.Array, group_ids: jax.Array, *, max_ngram: int = 4,
                  min_ngram: int = 1, depth: int = 8) -> tuple[jax.Array, jax.Array]:
  """Drafts up to ``depth`` tokens per row by suffix lookup in its own and its siblings' contexts.

  Returns ``(draft [B, depth] int32, draft_len [B] int32)``; see the module docstring for the rules.
  """
  NgramConfig(max_ngram=max_ngram, min_ngram=min_ngram, depth=depth)  # validates the statics
  b, length = prompt_tokens.shape[0], prompt_tokens.shape[1] + gen_tokens.shape[1]
  if (depth + 1) * length >= 2**31:
    raise ValueError(f"ngram_propose: depth {depth} x context {length} overflows the int32 score")
  ctx, ctx_len = contexts(prompt_tokens, prompt_lens, gen_tokens, gen_lens)
  group_ids = group_ids.astype(jnp.int32)
  live = group_ids >= 0
  rows = jnp.arange(b, dtype=jnp.int32)
  pos = jnp.arange(length, dtype=jnp.int32)
  # An occurrence ending at ``e`` in row ``r`` is usable when a token follows it there.
  followed = pos[None, :] + 1 < ctx_len[:, None]  # [B(r), L]
  n_follow = jnp.minimum(depth, ctx_len[:, None] - 1 - pos[None, :])  # [B(r), L]
  siblings = ((group_ids[:, None] == group_ids[None, :]) & live[:, None] & live[None, :]
              & (rows[:, None] != rows[None, :]))  # [B(b), B(r)]
  sib_ok = siblings[:, :, None] & followed[None, :, :]  # [B, B, L]
  own_ok = followed & live[:, None]  # [B, L]

  found = jnp.zeros((b,), bool)
  src_row = rows
  src_end = jnp.zeros((b,), jnp.int32)
  own_match = jnp.ones((b, length), bool)
  sib_match = jnp.ones((b, b, length), bool)
  for k in range(max_ngram):  # grow the suffix one token at a time: n = k + 1, shortest first
    n = k + 1
    q_idx = ctx_len - 1 - k
    query = jnp.where(q_idx >= 0, jnp.take_along_axis(ctx, jnp.maximum(q_idx, 0)[:, None], 1)[:, 0],
                      _NO_QUERY)  # [B] the k-th token from the end of each row
    shifted = shift(ctx, k)  # [B(r), L]: token k places before each end position
    own_match = own_match & (shifted == query[:, None])
    sib_match = sib_match & (shifted[None, :, :] == query[:, None, None])
    if n < min_ngram:
      continue
    # Own context: the most recent usable occurrence.
    own_end = jnp.max(jnp.where(own_match & own_ok, pos[None, :], -1), axis=1)
    # Siblings: most following tokens, then the lowest row, then the most recent occurrence.
    score = jnp.where(sib_match & sib_ok, n_follow[None, :, :] * length + pos[None, None, :], -1)
    best = jnp.max(score, axis=2)  # [B, B(r)]
    best_row = jnp.argmax(best // length, axis=1).astype(jnp.int32)  # first max: lowest row
    best_score = jnp.take_along_axis(best, best_row[:, None], axis=1)[:, 0]
    hit_own = own_end >= 0
    hit = hit_own | (best_score >= 0)
    # n grows through the loop, so a hit here overrides any hit at a shorter suffix.
    src_row = jnp.where(hit, jnp.where(hit_own, rows, best_row), src_row)
    src_end = jnp.where(hit, jnp.where(hit_own, own_end, best_score % length), src_end)
    found = found | hit

  start = src_end + 1
  avail = jnp.take_along_axis(ctx_len, src_row, axis=0) - start
  draft_len = jnp.where(found, jnp.clip(avail, 0, depth), 0).astype(jnp.int32)
  idx = jnp.clip(start[:, None] + jnp.arange(depth, dtype=jnp.int32)[None, :], 0, length - 1)
  draft = ctx[src_row[:, None], idx]
  keep = jnp.arange(depth, dtype=jnp.int32)[None, :] < draft_len[:, None]
  return jnp.where(keep, draft, 0).astype(jnp.int32), draft_len


@dataclasses.dataclass(frozen=True)
class NgramKind(ModelFreeKind):
  """Point-mass chains from n-gram matches in the row's own context and its siblings'."""

  def propose(self, config, state, depth: int) -> tuple[jax.Array, jax.Array]:
    return ngram_propose(state.prompt_tokens, state.prompt_lens, state.tokens,
                         state.num_generated, state.group_id, max_ngram=config.max_ngram,
                         min_ngram=config.min_ngram, depth=depth)


NGRAM = register(NgramKind(DrafterKind.NGRAM, NgramConfig))
