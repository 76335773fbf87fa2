"""Model-free drafter over the rollout's own history: suffix matches in earlier completions of the
same prompt, in the current group's partial responses and in the row's own context.

In RL the same prompts come back epoch after epoch, and a prompt's group of G responses is decoded
side by side. Both are drafts no learned drafter has to be trained for (DAS, RhymeRL's HistoSpec,
Seer's grouped drafting). A draft costs no model pass here, only an index lookup inside the jitted
step, so a speculative step costs the verify pass alone.

Inputs of one lookup (all shapes static, everything jittable):

* ``ctx [B, L]`` each row's prompt then response, padded with -1 (``ngram.contexts``), its lengths
  ``ctx_len`` and ``prompt_lens``; the context ends with the row's newest token (the draft's root);
* ``group_ids [B]``: rows with the same id share a prompt; -1 marks padding (never drafted for and
  never a source);
* ``history [B, H]``: earlier completions of the row's prompt, newest first, each followed by -1
  (``pack_history``; all -1: none);
* ``remaining [B]``: tokens the row may still emit (its length budget).

Where a draft comes from. The row's suffix of ``n`` tokens (``n = min_ngram .. max_ngram``) is
looked up at every *occurrence*, an end position that is followed by at least one token, in four
sources: ``history`` (the row's history), ``group`` (the responses of the other rows of its
group, the first ``max_group`` of them; their prompts are the row's own and are left out),
``prompt`` and ``self`` (the row's own prompt and response). Occurrences are ranked by

1. the matched length ``n`` (a longer shared suffix predicts better),
2. *support*: how many occurrences matched at that length continue with the same next token (the
   most frequent continuation, as a suffix tree's counts would give it),
3. the tokens that follow it (up to the draft depth), then the source (history, group, self,
   prompt) and recency (the newest completion, the latest position).

The chain draft copies what follows the best occurrence. A tree draft (``branches > 1``) puts the
best occurrence of each of the ``branches`` most supported *distinct* next tokens under the root;
their first tokens differ, so the point-mass tree rule verifies it losslessly.

The length-aware budget: the verify pass has a fixed number of draft slots (``verify_tokens - 1``).
No branch is longer than the row's remaining length budget (tokens past it could never be emitted)
or the continuation its source has; the first branch (the most confident) takes what it can use up
to ``depth``, and every slot it leaves goes to the alternatives, in order. A row about to finish,
or whose best match is short, therefore hedges with more first-token alternatives. The batch-level
budget, whether drafting pays at all and how deep, is the tuner's choice per batch bucket.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rollout.decode import speculative as sd
from tlt_jax.rollout.decode.kinds import Drafted, DrafterKind, Kind, register
from tlt_jax.rollout.decode.ngram import contexts, shift
from tlt_jax.rollout.decode.speculative import DRAFT_SOURCES, Draft, SpecConfig
from tlt_jax.utils import require_positive_ints

SOURCES = DRAFT_SOURCES[:4]  # where a suffix draft was copied from: history, group, prompt, self
NO_DRAFT = DRAFT_SOURCES.index("none")  # source index of a row that found nothing to draft
_PRIORITY = {"history": 3, "group": 2, "self": 1, "prompt": 0}  # the tie-break among sources
_PAD = -1
_NO_QUERY = -2


@dataclasses.dataclass(frozen=True)
class SuffixConfig:
  """Static settings of the suffix drafter.

  ``max_ngram`` / ``min_ngram``: the suffix lengths matched (longest first); ``history_len``: the
  tokens of earlier completions each row can draft from (the newest first, cut to this many);
  ``depth``: draft levels of the default chain strategy (``EngineConfig.suffix_strategies``
  empty: one chain of this depth); ``candidates``: distinct next tokens whose support is counted
  before the best is chosen (at least a tree's branches); ``max_group``: the most rows of a group
  a row drafts from besides itself (the first ones, in row order; GRPO groups are usually 8 or
  16), so a batch bucket of B rows searches ``B * (max_group + 1)`` contexts, not ``B * B``."""

  max_ngram: int = 4
  min_ngram: int = 1
  depth: int = 8
  history_len: int = 512
  candidates: int = 3
  max_group: int = 16

  def __post_init__(self):
    require_positive_ints(self, "max_ngram", "min_ngram", "depth", "history_len", "candidates",
                          "max_group")
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"SuffixConfig.min_ngram ({self.min_ngram}) must be <= "
                       f"SuffixConfig.max_ngram ({self.max_ngram})")

  def chain(self) -> SpecConfig:
    """The default strategy: one chain of ``depth`` levels."""
    return SpecConfig(depth=self.depth, topk=1, verify_tokens=self.depth + 1)


def check_suffix_spec(spec: SpecConfig) -> None:
  """A suffix strategy is a chain, or a tree of ``topk`` branches under the root whose longest
  branch has ``depth`` levels; its ``verify_tokens - 1`` draft slots are shared by the branches,
  so ``depth <= verify_tokens - 1 <= topk * depth`` (a ``ValueError`` says so otherwise; the
  caller names the field)."""
  if spec.is_chain:
    return
  if not spec.depth <= spec.verify_tokens - 1 <= spec.topk * spec.depth:
    raise ValueError(
        f"a suffix tree has topk={spec.topk} branches of at most depth="
        f"{spec.depth} levels sharing verify_tokens - 1 = {spec.verify_tokens - 1} draft slots; "
        f"it needs depth <= verify_tokens - 1 <= topk * depth, e.g. "
        f"({spec.depth}, {spec.topk}, {spec.depth + spec.topk})")


def pack_history(completions: Sequence[Sequence[int]], length: int) -> np.ndarray:
  """One row's ``history [length]``: ``completions`` (newest first), each followed by -1, cut to
  ``length`` tokens (the rest -1)."""
  out = np.full((length,), _PAD, np.int32)
  at = 0
  for c in completions:
    if at >= length:
      break
    c = np.asarray(c, np.int32)[:length - at]
    out[at:at + c.size] = c
    at += c.size + 1  # the -1 after it ends every match and every copied draft there
  return out


class SuffixDraft(NamedTuple):
  """A drafted tree and where its nodes' tokens came from."""

  draft: Draft
  node_source: jax.Array  # [B, N] source index of each node's branch (root, unused: NO_DRAFT)
  match_len: jax.Array  # [B] the suffix length matched by the first branch (0: no draft)


class _Occurrences(NamedTuple):
  """Every end position a row may draft from on one flat axis ``[B, S * L + H]``: the ``S``
  candidate contexts' ``L`` positions, then the ``H`` history ones."""

  matched: jax.Array  # the suffix length matched there
  ok: jax.Array  # usable: followed by a token, in a source the row may use, matched >= min_ngram
  next_tok: jax.Array  # the token after it
  follow: jax.Array  # the tokens after it, capped at the draft depth
  source: jax.Array  # its source index (``SOURCES``)
  score: jax.Array  # its rank (higher first; -1: unusable)


def suffix_draft(ctx: jax.Array, ctx_len: jax.Array, prompt_lens: jax.Array, group_ids: jax.Array,
                 history: jax.Array, remaining: jax.Array, root: jax.Array, config: SuffixConfig,
                 spec: SpecConfig) -> SuffixDraft:
  """Drafts a chain (``spec.topk == 1``) or a tree of ``spec.topk`` branches for every row; see the
  module docstring for the rules. ``root [B]`` is each row's newest token (node 0)."""
  b, length = ctx.shape
  h = history.shape[1]
  depth, branches, n_nodes = spec.depth, spec.topk, spec.verify_tokens
  span = max(length, h) + 1
  if (config.max_ngram + 1) * (depth + 1) * 4 * span >= 2**31:
    raise ValueError(f"suffix_draft: a context of {length} / history of {h} tokens overflows the "
                     "int32 ranking score")
  ctx = ctx.astype(jnp.int32)
  history = history.astype(jnp.int32)
  ctx_len = ctx_len.astype(jnp.int32)
  group_ids = group_ids.astype(jnp.int32)
  live = group_ids >= 0
  rows = jnp.arange(b, dtype=jnp.int32)
  pos = jnp.arange(length, dtype=jnp.int32)
  hpos = jnp.arange(h, dtype=jnp.int32)

  # The rows each row drafts from (S of them): itself and its group's, [B, S] row indices.
  cand, cand_ok = _candidate_rows(group_ids, config.max_group)
  c_ctx = ctx[cand]  # [B, S, L]
  c_len = ctx_len[cand]
  ctx_ok, is_self, in_prompt = _context_ends(c_len, prompt_lens, group_ids, live, cand, cand_ok,
                                             rows, pos)
  next_h = shift(history, -1)
  hist_ok = (history >= 0) & (next_h >= 0) & live[:, None]
  m_ctx, m_hist = _match_lengths(ctx, ctx_len, c_ctx, history, config.max_ngram)
  follow_ctx, follow_h = _follow_counts(c_len, history, pos, depth)
  next_ctx = shift(c_ctx, -1)  # [B, S, L]
  occ = _flat_occurrences((m_ctx, m_hist), (ctx_ok, hist_ok), (next_ctx, next_h),
                          (follow_ctx, follow_h), is_self, in_prompt, pos, hpos,
                          config.min_ngram, depth, span)
  picks, matched, order = _best_distinct(occ, max(config.candidates, branches), branches)
  found = picks >= 0
  safe = jnp.maximum(picks, 0)

  levels = jnp.arange(depth, dtype=jnp.int32)
  tokens = _branch_tokens(safe, levels, c_ctx, history, rows)  # [B, K, D]
  avail = jnp.take_along_axis(occ.follow, safe, 1)
  source = jnp.where(found, jnp.take_along_axis(occ.source, safe, 1), NO_DRAFT)
  lens = _branch_lengths(found, live, avail, remaining, depth, n_nodes)  # [B, K]
  match_len = jnp.where(lens[:, 0] > 0, matched[jnp.arange(b), order[:, 0]], 0)
  if branches == 1:  # a chain: node i is level i, as every chain strategy lays it out
    draft = sd.chain_tree(jnp.where(levels[None] < lens, tokens[:, 0], 0), root, None, lens[:, 0])
    node_source = jnp.where(jnp.arange(n_nodes)[None] >= 1, source[:, :1], NO_DRAFT)
    node_source = jnp.where(jnp.arange(n_nodes)[None] <= lens, node_source, NO_DRAFT)
    return SuffixDraft(draft, node_source.astype(jnp.int32), match_len)
  draft, node_source = _branches_as_tree(root, tokens, lens, source, n_nodes)
  return SuffixDraft(draft, node_source, match_len)


def _context_ends(c_len, prompt_lens, group_ids, live, cand, cand_ok, rows, pos):
  """``(usable, is_self, in_prompt)``: the candidate contexts' end positions a row may draft from
  (its group's, followed by a token, no sibling's prompt), its own context, the prompt positions."""
  same = cand_ok & (group_ids[cand] == group_ids[:, None]) & live[:, None]
  is_self = cand == rows[:, None]  # [B, S]
  followed = pos[None, None, :] + 1 < c_len[:, :, None]
  in_prompt = pos[None, None, :] < prompt_lens[cand][:, :, None]
  ctx_ok = same[:, :, None] & followed & (is_self[:, :, None] | ~in_prompt)
  return ctx_ok, is_self, in_prompt


def _match_lengths(ctx, ctx_len, c_ctx, history, max_ngram: int) -> tuple[jax.Array, jax.Array]:
  """``([B, S, L], [B, H])``: the length of the row's suffix (up to ``max_ngram``) matched at
  every end position of the candidate contexts and of the history, grown one token at a time."""
  b, s_rows, length = c_ctx.shape
  h = history.shape[1]
  m_ctx = jnp.zeros((b, s_rows, length), jnp.int32)
  m_hist = jnp.zeros((b, h), jnp.int32)
  run_ctx = jnp.ones((b, s_rows, length), bool)
  run_hist = jnp.ones((b, h), bool)
  for k in range(max_ngram):
    q_idx = ctx_len - 1 - k
    query = jnp.where(q_idx >= 0, jnp.take_along_axis(ctx, jnp.maximum(q_idx, 0)[:, None], 1)[:, 0],
                      _NO_QUERY)
    run_ctx = run_ctx & (shift(c_ctx, k) == query[:, None, None])
    run_hist = run_hist & (shift(history, k) == query[:, None])
    m_ctx = m_ctx + run_ctx
    m_hist = m_hist + run_hist
  return m_ctx, m_hist


def _follow_counts(c_len, history, pos, depth: int) -> tuple[jax.Array, jax.Array]:
  """``([B, S, L], [B, H])``: the tokens that follow every end position of the candidate contexts
  and of the history, capped at ``depth``."""
  b, h = history.shape
  follow_ctx = jnp.clip(c_len[:, :, None] - 1 - pos[None, None, :], 0, depth)  # [B, S, L]
  follow_h = jnp.zeros((b, h), jnp.int32)
  alive = jnp.ones((b, h), bool)
  for i in range(1, depth + 1):
    alive = alive & (shift(history, -i) >= 0)
    follow_h = follow_h + alive
  return follow_ctx, follow_h


def _flat_occurrences(matched, usable, next_tok, follow, is_self, in_prompt, pos, hpos,
                      min_ngram: int, depth: int, span: int) -> _Occurrences:
  """The occurrences on one flat axis per row, ranked by matched length, following tokens, source
  and recency. ``matched``, ``usable``, ``next_tok``, ``follow``: ``(contexts, history)`` pairs."""
  m_ctx, m_hist = matched
  b, s_rows, length = m_ctx.shape
  h = m_hist.shape[1]
  flat = s_rows * length
  m_all = jnp.concatenate([m_ctx.reshape(b, flat), m_hist], 1)
  ok_all = jnp.concatenate([usable[0].reshape(b, flat), usable[1]], 1) & (m_all >= min_ngram)
  nxt_all = jnp.concatenate([next_tok[0].reshape(b, flat), next_tok[1]], 1)
  follow_all = jnp.concatenate([follow[0].reshape(b, flat), follow[1]], 1)
  src_ctx = jnp.where(is_self[:, :, None],
                      jnp.where(in_prompt, SOURCES.index("prompt"), SOURCES.index("self")),
                      SOURCES.index("group"))  # [B, S, L]
  src_all = jnp.concatenate([src_ctx.reshape(b, flat),
                             jnp.full((b, h), SOURCES.index("history"), jnp.int32)], 1)
  priority = jnp.asarray([_PRIORITY[x] for x in SOURCES], jnp.int32)[src_all]
  recency = jnp.concatenate([jnp.broadcast_to(jnp.tile(pos, s_rows)[None], (b, flat)),
                             jnp.broadcast_to((h - hpos)[None], (b, h))], 1)
  score = ((m_all * (depth + 1) + follow_all) * 4 + priority) * span + recency
  score = jnp.where(ok_all, score, -1)
  return _Occurrences(m_all, ok_all, nxt_all, follow_all, src_all, score)


def _best_distinct(occ: _Occurrences, n_cand: int, branches: int):
  """The best occurrence of each of ``n_cand`` distinct next tokens, ranked by matched length,
  support and score: ``(the first branches [B, K] (-1: none), matched [B, C], order [B, K])``."""
  picks, supports, matched, firsts = [], [], [], []
  s = occ.score
  for _ in range(n_cand):
    idx = jnp.argmax(s, axis=1).astype(jnp.int32)
    best = jnp.take_along_axis(s, idx[:, None], 1)[:, 0]
    tok = jnp.take_along_axis(occ.next_tok, idx[:, None], 1)[:, 0]
    m = jnp.where(best >= 0, jnp.take_along_axis(occ.matched, idx[:, None], 1)[:, 0], 0)
    same_tok = occ.ok & (occ.next_tok == tok[:, None])
    supports.append(jnp.where(best >= 0, jnp.sum(same_tok & (occ.matched == m[:, None]), axis=1),
                              -1).astype(jnp.int32))
    picks.append(jnp.where(best >= 0, idx, -1))
    matched.append(m)
    firsts.append(best)
    s = jnp.where(same_tok, -1, s)  # the next pick continues with a different token
  picks = jnp.stack(picks, 1)  # [B, C]
  supports, matched, firsts = (jnp.stack(x, 1) for x in (supports, matched, firsts))
  # rank: matched length, then support, then the occurrence's own score (all descending)
  order = jnp.lexsort((-firsts, -supports, -matched), axis=-1)[:, :branches]
  return jnp.take_along_axis(picks, order, 1), matched, order


def _branch_tokens(safe, levels, c_ctx, history, rows) -> jax.Array:
  """``[B, K, D]``: the ``D = len(levels)`` tokens after each branch's occurrence ``safe [B, K]``
  (an index on the flat occurrence axis)."""
  _, s_rows, length = c_ctx.shape
  h = history.shape[1]
  flat = s_rows * length
  in_ctx = safe < flat
  r, e = jnp.clip(safe // length, 0, s_rows - 1), safe % length
  e_h = jnp.clip(safe - flat, 0, h - 1)
  tok_ctx = c_ctx[rows[:, None, None], r[:, :, None],
                  jnp.clip(e[:, :, None] + 1 + levels, 0, length - 1)]  # [B, K, D]
  tok_h = history[rows[:, None, None], jnp.clip(e_h[:, :, None] + 1 + levels, 0, h - 1)]
  return jnp.where(in_ctx[:, :, None], tok_ctx, tok_h)


def _branch_lengths(found, live, avail, remaining, depth: int, n_nodes: int) -> jax.Array:
  """``[B, K]``: each branch's length within the row's length budget and the ``n_nodes - 1`` draft
  slots; the first branch takes what it can use, the slots it leaves go to the next in order."""
  budget = jnp.clip(remaining.astype(jnp.int32) - 1, 0, depth)  # the bonus is the last token
  want = jnp.where(found & live[:, None], jnp.minimum(avail, budget[:, None]), 0)  # [B, K]
  lens, left = [], jnp.full((found.shape[0],), n_nodes - 1, jnp.int32)
  for j in range(found.shape[1]):
    lj = jnp.minimum(want[:, j], left)
    lens.append(lj)
    left = left - lj
  return jnp.stack(lens, 1)


def _candidate_rows(group_ids: jax.Array, max_group: int) -> tuple[jax.Array, jax.Array]:
  """``(rows [B, S], usable [B, S])``: the rows each row drafts from. With at most ``max_group``
  rows in the batch, every row in order (``S = B``; the group is picked out later). Otherwise the
  row itself and the first ``max_group`` rows of its group in row order (``S = max_group + 1``;
  its own slot among those is masked), found by sorting the rows by group: the lookup then
  costs ``B * S`` contexts instead of ``B * B``."""
  b = group_ids.shape[0]
  rows = jnp.arange(b, dtype=jnp.int32)
  if b <= max_group:
    return jnp.broadcast_to(rows, (b, b)), jnp.ones((b, b), bool)
  key = jnp.where(group_ids >= 0, group_ids, jnp.iinfo(jnp.int32).max // (2 * b))
  order = jnp.argsort(key * b + rows).astype(jnp.int32)  # by group, then row
  sorted_groups = key[order]
  start = jnp.searchsorted(sorted_groups, key, side="left").astype(jnp.int32)  # [B]
  at = start[:, None] + jnp.arange(max_group, dtype=jnp.int32)[None, :]
  window = order[jnp.clip(at, 0, b - 1)]
  usable = (at < b) & (sorted_groups[jnp.clip(at, 0, b - 1)] == key[:, None]) & (
      window != rows[:, None])
  return (jnp.concatenate([rows[:, None], window], 1),
          jnp.concatenate([jnp.ones((b, 1), bool), usable], 1))


def _branches_as_tree(root, tokens, lens, source, n_nodes: int) -> tuple[Draft, jax.Array]:
  """Lays ``K`` branches (``tokens [B, K, D]``, ``lens [B, K]``) under the root into ``n_nodes``
  slots, branch by branch in order (``sum(lens) <= n_nodes - 1``); unused slots hang off the root
  with depth 1 and are nobody's child, so the walk never visits them."""
  b, k, d = tokens.shape
  start = 1 + jnp.cumsum(lens, axis=1) - lens  # [B, K] the first slot of each branch
  slot = jnp.arange(n_nodes, dtype=jnp.int32)[None, :, None]  # [1, N, 1]
  member = (slot >= start[:, None, :]) & (slot < (start + lens)[:, None, :])  # [B, N, K]
  used = jnp.any(member, axis=2)
  branch = jnp.argmax(member, axis=2).astype(jnp.int32)  # [B, N]
  level = slot[:, :, 0] - jnp.take_along_axis(start, branch, 1)  # 0-based level in its branch
  level = jnp.where(used, level, 0)
  node_tok = tokens[jnp.arange(b)[:, None], branch, jnp.clip(level, 0, d - 1)]
  node_tok = jnp.where(used, node_tok, 0).at[:, 0].set(root)
  node_depth = jnp.where(used, level + 1, 1).at[:, 0].set(0)
  parent = jnp.where(used & (level > 0), slot[:, :, 0] - 1, 0).astype(jnp.int32)
  # children: the root's are the branches' first slots; a node's one child is the next slot
  last = used & (level + 1 >= jnp.take_along_axis(lens, branch, 1))
  next_child = jnp.where(used & ~last, slot[:, :, 0] + 1, -1)
  children = jnp.full((b, n_nodes, k), -1, jnp.int32)
  children = children.at[:, :, 0].set(next_child)
  root_children = jnp.where(lens > 0, start, -1)  # [B, K]; empty branches leave -1 gaps
  order = jnp.argsort(root_children < 0, axis=1, stable=True)  # non-empty branches first
  children = children.at[:, 0, :].set(jnp.take_along_axis(root_children, order, 1))
  node_source = jnp.where(used, jnp.take_along_axis(source, branch, 1), NO_DRAFT)
  draft = Draft(tokens=node_tok.astype(jnp.int32), depth=node_depth.astype(jnp.int32),
                parent=parent, children=children, draft_probs=None,
                draft_len=jnp.max(lens, axis=1).astype(jnp.int32))
  return draft, node_source.at[:, 0].set(NO_DRAFT)


class SuffixKind(Kind):
  """Chains or trees from the suffix drafter; every strategy is a group of its own, and each
  node says which source (history, siblings, prompt, ...) drafted it."""

  def strategy_name(self, spec: SpecConfig) -> str:
    return f"suffix d{spec.depth}" + ("" if spec.is_chain else
                                      f" k{spec.topk} v{spec.verify_tokens}")

  def draft(self, steps, target, drafter, state, args, group, choice) -> Drafted:
    spec = group.members[0]
    ctx, ctx_len = contexts(state.prompt_tokens, state.prompt_lens, state.tokens,
                            state.num_generated)
    drafted = suffix_draft(ctx, ctx_len, state.prompt_lens, state.group_id, state.history,
                               args.max_new_tokens - state.num_generated, state.last_token,
                               steps.suffix, spec)
    mask = None if spec.is_chain else sd.tree_attention(drafted.draft, spec.depth)
    return Drafted(drafted.draft, mask, drafted.node_source)


SUFFIX = register(SuffixKind(DrafterKind.SUFFIX))
