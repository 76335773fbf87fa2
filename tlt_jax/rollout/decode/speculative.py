"""Lossless speculative decoding: drafting (chain and tree), verification, and cache re-sync.

One speculative step per row: the drafter proposes tokens after the row's newest token (the
*root*), the target scores root + proposals in one forward pass, and the row accepts a prefix
(chain) or a root-to-leaf path (tree) plus one *bonus* token drawn from the target.

Why the output distribution is exactly the target's
----------------------------------------------------
Let ``p_c`` be the target's (tempered, top-k/top-p filtered) next-token distribution after the
prefix ending at tree node ``c``. The verify forward computes ``p_c`` exactly for every drafted
node, because each node attends to precisely its committed prefix and its ancestors, at the
positions it would have in a plain decode.

* Greedy (temperature 0): at node ``c`` we move to the child whose token equals ``argmax p_c``,
  if there is one, else emit ``argmax p_c`` as the bonus and stop. Every emitted token is thus
  the target's argmax after the tokens before it: identical to vanilla greedy decoding.
* Chain, sampled: draft token ``d_i`` is drawn from the drafter's distribution ``q_i``. It is
  accepted with probability ``min(1, p(d_i) / q_i(d_i))``; on the first rejection the bonus is
  drawn from ``normalize(max(p - q_i, 0))``. For one position this emits ``x`` with probability
  ``q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(p(x) - q(x), 0) / Z``, and
  ``Z = 1 - sum_y min(p(y), q(y))``, so the total is ``min(p, q) + max(p - q, 0) = p(x)``.
  Positions after an accepted token repeat the argument under the target's conditional, so
  the joint law of the emitted tokens is the target's. If every draft is accepted (or the
  drafter proposed fewer tokens) the bonus is drawn from ``p`` itself.
* Tree, sampled: the children ``t_1, t_2, ...`` of a node are a *deterministic* function of
  the drafter state (the top-k), not samples. We treat each as a draft from the point mass
  ``delta(t_j)``, in order: with residual ``r_1 = p``, accept ``t_j`` with probability
  ``r_j(t_j)``; on rejection set ``r_{j+1} = normalize(r_j with t_j removed)``. If all
  children are rejected the bonus is drawn from the last residual. By induction on ``j``, the
  token leaving the node has law ``r_1 = p``: ``P(x = t_j)`` is ``r_j(t_j)`` times the
  probability of reaching step ``j``, which is what ``r_j`` assigns, and the residual carries
  the remaining mass unchanged in proportion. Accepting ``t_j`` moves to that child, whose
  ``p`` is again exact, so the whole path is distributed as the target's own sampling.

All random draws come from per-row keys folded with the position of the token they decide,
so results depend on neither the batch nor the bucket a row runs in.

Drafter-invariant ("coupled") verification
------------------------------------------
Vanilla sampling draws the token at generated position ``g`` as ``argmax(log p + G_g)``, with
``G_g`` the Gumbel noise of the row's key for ``g`` (``sampling.gumbel_argmax``). In coupled mode
the drafter drafts with the same noise on its own log-probs, and the walk is the greedy walk on
the *perturbed* target log-probs ``log p_c + G_{g + depth(c)}``: a child is accepted iff its
token is the target's Gumbel-argmax at that node, and the bonus is that argmax. Every emitted
token is therefore exactly the token vanilla sampling draws with the same seed, whatever the
drafter, strategy or batch (Daliri, Musco, Suresh 2024). Acceptance is a little lower than with
rejection sampling (per token at least ``(1 - TV) / (1 + TV)`` instead of ``1 - TV``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tlt_jax.models.drafter import Drafter, spread_to_vocab
from tlt_jax.models.transformer import KVCache, Transformer
from tlt_jax.rollout.decode.sampling import SamplerArgs, filtered_logprobs, gumbel_noise, row_keys
from tlt_jax.utils import require_positive_ints

# Where the tokens a speculative step emitted were drafted from (the engine's counters
# ``source_steps`` / ``source_tokens`` are indexed like this): the suffix drafter's four sources
# and its "none" (nothing matched: the step emitted the bonus alone), the learned drafter, the
# n-gram drafter.
DRAFT_SOURCES = ("history", "group", "prompt", "self", "none", "learned", "ngram")

# Tags folded into a row's position key, one independent stream per use.
_DRAFT, _ACCEPT, _BONUS = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """A drafting strategy: ``depth`` draft levels, ``topk`` children per expanded node, and
  ``verify_tokens`` tokens per target verify pass (the root included). ``topk == 1`` is a
  chain, which needs ``verify_tokens == depth + 1``."""

  depth: int = 4
  topk: int = 1
  verify_tokens: int = 5

  def __post_init__(self):
    require_positive_ints(self, "depth", "topk", "verify_tokens")
    if self.topk == 1 and self.verify_tokens != self.depth + 1:
      raise ValueError(
          f"SpecConfig.verify_tokens must be depth + 1 = {self.depth + 1} for a chain (topk=1), "
          f"got {self.verify_tokens}")
    most = 1 + self.topk + (self.depth - 1) * self.topk * self.topk
    if self.topk > 1 and not 2 <= self.verify_tokens <= most:
      raise ValueError(
          f"SpecConfig.verify_tokens must be in [2, {most}] for depth={self.depth}, "
          f"topk={self.topk} (root + drafted candidates), got {self.verify_tokens}")

  @property
  def is_chain(self) -> bool:
    return self.topk == 1

  @property
  def max_emit(self) -> int:
    """Most tokens one step can emit: every level accepted plus the bonus."""
    return self.depth + 1


class Draft(NamedTuple):
  """A drafted tree over ``N = verify_tokens`` nodes in topological order, node 0 the root."""

  tokens: jax.Array  # [B, N]
  depth: jax.Array  # [B, N] 0 for the root
  parent: jax.Array  # [B, N] node index of the parent (root: 0)
  children: jax.Array  # [B, N, topk] node indices of the children, -1 where none
  draft_probs: jax.Array | None  # chain only: [B, depth, K] the distributions drafts came from
  draft_len: jax.Array  # [B] usable draft levels (a chain may propose fewer than depth)
  # [K] target ids of draft_probs' last axis (a reduced draft vocabulary); None: K = V, identity
  vocab_ids: jax.Array | None = None


def draft_probs_over_target(draft: Draft, level: int, vocab_size: int) -> jax.Array:
  """The chain's level-``level`` draft distribution ``[B, V]`` over target ids (zero outside a
  reduced draft vocabulary)."""
  return spread_to_vocab(draft.draft_probs[:, level], draft.vocab_ids, vocab_size)


def pick_positions(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x[b, index[b]]`` for ``x [B, T, ...]`` and ``index [B]``."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def _keys(args: SamplerArgs, rows, positions, tag: int):
  """Per-row keys for ``positions [B]`` and one stream ``tag``."""
  base = jax.random.key(args.seed)
  fold = lambda r, p: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, r), p), tag)
  return jax.vmap(fold)(rows, positions)


def coupled_noise(args: SamplerArgs, rows, gen_pos, levels: int, vocab: int) -> jax.Array:
  """Gumbel noise ``[B, levels, V]`` of generated positions ``gen_pos + 0 .. levels-1``: the noise
  vanilla sampling uses for those tokens (``row_keys``), shared by drafting and verification."""
  return jnp.stack([gumbel_noise(row_keys(args.seed, rows, gen_pos + i), vocab)
                    for i in range(levels)], axis=1)


def perturb_draft(noise: jax.Array, vocab_ids) -> jax.Array:
  """Target-vocabulary noise ``[..., V]`` restricted to a reduced draft vocabulary's ids."""
  return noise if vocab_ids is None else jnp.take(noise, jnp.asarray(vocab_ids), axis=-1)


def chain_tree(tokens: jax.Array, root: jax.Array, draft_probs, draft_len,
               vocab_ids: jax.Array | None = None) -> Draft:
  """Wraps a chain of drafts ``[B, D]`` after ``root [B]`` as a (linear) ``Draft``."""
  b, d = tokens.shape
  n = d + 1
  idx = jnp.arange(n, dtype=jnp.int32)
  children = jnp.where(idx[:, None] + 1 < n, idx[:, None] + 1, -1)
  return Draft(tokens=jnp.concatenate([root[:, None], tokens], axis=1),
               depth=jnp.broadcast_to(idx, (b, n)),
               parent=jnp.broadcast_to(jnp.maximum(idx - 1, 0), (b, n)),
               children=jnp.broadcast_to(children, (b, n, 1)),
               draft_probs=draft_probs, draft_len=draft_len, vocab_ids=vocab_ids)


def draft_chain(target: Transformer, drafter: Drafter, dcache: KVCache, feature, logits,
                root, args: SamplerArgs, rows, gen_pos, depth: int,
                coupled: bool = False) -> Draft:
  """Drafts ``depth`` tokens one at a time; sampled from the filtered drafter distribution,
  or its argmax when greedy (``coupled``: the argmax under the vanilla sampler's Gumbel noise).
  ``feature``/``logits`` are the drafter outputs for the root (over its draft vocabulary;
  drafted tokens are mapped to target ids)."""
  dl = dcache.lengths
  vocab = target.config.vocab_size

  def run(greedy: bool):
    def pick(lg, i):
      if greedy:
        return drafter.to_target_ids(jnp.argmax(lg, -1)), jnp.zeros_like(lg)
      logq = filtered_logprobs(lg, args.temperature, args.top_k, args.top_p)
      if coupled:
        noise = gumbel_noise(row_keys(args.seed, rows, gen_pos + i), vocab)
        index = jnp.argmax(logq + perturb_draft(noise, drafter.vocab_ids), -1)
        return drafter.to_target_ids(index), jnp.zeros_like(lg)
      index = jax.vmap(jax.random.categorical)(_keys(args, rows, gen_pos + i, _DRAFT), logq)
      return drafter.to_target_ids(index), jnp.exp(logq)

    def step(carry, i):
      feat, lg, cache = carry
      tok, q = pick(lg, i)
      out = drafter.forward(target, tok[:, None], feat[:, None], cache=cache.with_lengths(dl + i))
      return (out.hidden[:, 0], out.logits[:, 0], out.cache), (tok, q)

    # depth - 1 drafter passes; the last draft needs no pass of its own
    (_, last_logits, _), (toks, probs) = lax.scan(step, (feature, logits, dcache),
                                                  jnp.arange(depth - 1))
    last_tok, last_q = pick(last_logits, depth - 1)
    toks = jnp.concatenate([toks.T, last_tok[:, None]], 1)
    probs = jnp.concatenate([jnp.swapaxes(probs, 0, 1), last_q[:, None]], 1)
    return toks, probs

  toks, probs = lax.cond(args.temperature <= 0, lambda: run(True), lambda: run(False))
  vocab_ids = None if drafter.vocab_ids is None else jnp.asarray(drafter.vocab_ids, jnp.int32)
  return chain_tree(toks, root, probs, jnp.full(root.shape, depth, jnp.int32), vocab_ids)


class _Frontier(NamedTuple):
  """The ``k`` nodes of a tree level that are expanded next, ``[B, k, ...]`` each."""

  index: jax.Array  # candidate index
  score: jax.Array  # cumulative draft log-probability
  tok: jax.Array  # target token id
  feat: jax.Array  # the drafter's input feature
  vis: jax.Array  # [B, k, depth * k] the uncommitted drafter slots it sees: own + ancestors'


def draft_tree(target: Transformer, drafter: Drafter, dcache: KVCache, feature, logits, root,
               spec: SpecConfig, noise: jax.Array | None = None) -> Draft:
  """EAGLE-2 style: expand the top-k children of the k best frontier nodes per level, then keep
  the ``verify_tokens - 1`` candidates with the highest cumulative draft log-probability.

  ``noise [B, depth, Kd]`` (coupled mode) perturbs each level's log-probs by the Gumbel noise of
  the position it drafts when picking the children, so the first child is the drafter's guess of
  the target's sample; scores stay the unperturbed log-probs (a child never outscores its
  parent, so the kept candidates always form a tree)."""
  k, depth = spec.topk, spec.depth
  top_children = _top_children(k, noise)
  dl = dcache.lengths
  width = depth * k  # uncommitted drafter slots used by the frontier nodes
  slot = jnp.arange(dcache.max_len)[None, :]
  level_cands, front = _root_children(drafter, feature, logits, top_children, k, width)
  cands, cache = [level_cands], dcache
  for level in range(1, depth):
    out = _forward_frontier(target, drafter, cache, dl, slot, front, level, k, width)
    cache = out.cache
    level_cands, front = _expand_frontier(drafter, out, front, top_children, level, k)
    cands.append(level_cands)
  tokens, score, parent, depth_c = (jnp.concatenate(x, 1) for x in zip(*cands))
  return _keep_best(tokens, score, parent, depth_c, root, spec)


def _top_children(k: int, noise: jax.Array | None):
  """``top_children(logits, level)``: the log-probs and indices of the ``k`` best children, picked
  by the log-probs perturbed with level ``level`` of ``noise`` when it is given."""

  def top_children(logits, level):
    lp = jax.nn.log_softmax(logits, -1)
    if noise is None:
      return lax.top_k(lp, k)
    shaken = lp + noise[:, level].reshape((lp.shape[0],) + (1,) * (lp.ndim - 2) + (lp.shape[-1],))
    _, index = lax.top_k(shaken, k)
    return jnp.take_along_axis(lp, index, -1), index
  return top_children


def _root_children(drafter: Drafter, feature, logits, top_children, k: int, width: int):
  """The root's ``k`` children: the first level's candidates ``(tokens, scores, parents,
  depths)`` and the frontier they form."""
  b = logits.shape[0]
  lp, tok = top_children(logits, 0)  # [B, k]
  tok = drafter.to_target_ids(tok)
  parent = jnp.full((b, k), -1, jnp.int32)
  depth = jnp.ones((b, k), jnp.int32)
  frontier = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index
  f_feat = jnp.broadcast_to(feature[:, None], (b, k, feature.shape[-1]))
  f_vis = jnp.broadcast_to(jnp.eye(k, width, dtype=bool), (b, k, width))  # own + ancestors' slots
  return (tok, lp, parent, depth), _Frontier(frontier, lp, tok, f_feat, f_vis)


def _forward_frontier(target: Transformer, drafter: Drafter, cache: KVCache, dl, slot,
                      front: _Frontier, level: int, k: int, width: int):
  """One drafter pass over the frontier of ``level``: each node attends to the committed prefix
  and to the uncommitted slots of its own ancestors."""
  b = dl.shape[0]
  rel = slot - dl[:, None]  # [B, S]
  in_draft = (rel >= 0) & (rel < width)
  seen = jnp.take_along_axis(front.vis, jnp.broadcast_to(jnp.clip(rel, 0, width - 1)[:, None],
                                                         (b, k, slot.shape[1])), axis=2)
  mask = (rel < 0)[:, None, :] | (in_draft[:, None, :] & seen)
  positions = jnp.broadcast_to((dl + level - 1)[:, None], (b, k))
  return drafter.forward(target, front.tok, front.feat, positions,
                         cache=cache.with_lengths(dl + (level - 1) * k), cache_mask=mask)


def _expand_frontier(drafter: Drafter, out, front: _Frontier, top_children, level: int, k: int):
  """The ``k * k`` children of the frontier (level ``level + 1``'s candidates ``(tokens, scores,
  parents, depths)``) and the ``k`` best of them, the next frontier."""
  b, width = front.vis.shape[0], front.vis.shape[2]
  child_lp, child_tok = top_children(out.logits, level)  # [B, k, k]
  child_tok = drafter.to_target_ids(child_tok)
  child_score = (front.score[:, :, None] + child_lp).reshape(b, k * k)
  cands = (child_tok.reshape(b, k * k), child_score, jnp.repeat(front.index, k, axis=1),
           jnp.full((b, k * k), level + 1, jnp.int32))
  f_score, pick = lax.top_k(child_score, k)  # the next frontier
  from_parent = pick // k
  f_tok = jnp.take_along_axis(child_tok.reshape(b, k * k), pick, 1)
  f_feat = jnp.take_along_axis(out.hidden, from_parent[:, :, None], 1)
  own = jax.nn.one_hot(level * k + jnp.arange(k), width, dtype=bool)
  f_vis = jnp.take_along_axis(front.vis, from_parent[:, :, None], 1) | own[None]
  offset = k + (level - 1) * k * k  # candidates of the levels before
  return cands, _Frontier(offset + pick, f_score, f_tok, f_feat, f_vis)


def _keep_best(tokens, score, parent, depth_c, root, spec: SpecConfig) -> Draft:
  """The ``verify_tokens - 1`` best candidates under the root, in topological order, as a
  ``Draft`` with its parent and children tables."""
  b, k = root.shape[0], spec.topk
  # A child's score never exceeds its parent's; the depth penalty breaks exact ties parent-first,
  # so the best candidates always form a tree that contains every chosen node's ancestors.
  n_pick = spec.verify_tokens - 1
  _, sel = lax.top_k(score - 1e-4 * depth_c, n_pick)
  order = jnp.argsort(jnp.take_along_axis(depth_c, sel, 1), axis=1, stable=True)
  sel = jnp.take_along_axis(sel, order, 1)  # topological: by depth, best first within a level
  node_of = jnp.zeros(tokens.shape, jnp.int32).at[jnp.arange(b)[:, None], sel].set(
      jnp.arange(1, n_pick + 1, dtype=jnp.int32)[None])
  sel_parent = jnp.take_along_axis(parent, sel, 1)
  parent_node = jnp.where(sel_parent < 0, 0,
                          jnp.take_along_axis(node_of, jnp.maximum(sel_parent, 0), 1))
  parent_node = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent_node], 1)  # [B, N]
  n = n_pick + 1
  idx = jnp.arange(n)
  # rank of each node among its siblings, and the children table
  same = (parent_node[:, :, None] == parent_node[:, None, :]) & (idx[None, :] < idx[:, None])[None]
  same &= (idx[None, None, :] >= 1)
  rank = jnp.sum(same, axis=2)
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
  children = jnp.full((b, n, k), -1, jnp.int32)
  children = children.at[rows[:, 1:], parent_node[:, 1:], rank[:, 1:]].set(
      jnp.broadcast_to(idx[1:], (b, n - 1)).astype(jnp.int32))
  return Draft(tokens=jnp.concatenate([root[:, None], jnp.take_along_axis(tokens, sel, 1)], 1),
               depth=jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                                      jnp.take_along_axis(depth_c, sel, 1)], 1),
               parent=parent_node, children=children, draft_probs=None,
               draft_len=jnp.full((b,), spec.depth, jnp.int32))


def tree_attention(draft: Draft, max_depth: int) -> jax.Array:
  """``[B, N, N]``: node i sees node j iff j is i or one of its ancestors."""
  b, n = draft.parent.shape
  seen = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
  cur = draft.parent
  for _ in range(max_depth):
    seen = seen | jax.nn.one_hot(cur, n, dtype=bool)
    cur = jnp.take_along_axis(draft.parent, cur, 1)
  return seen


class Verdict(NamedTuple):
  path: jax.Array  # [B, depth + 1] accepted node indices (path[0] = root; beyond `accepted`: 0)
  accepted: jax.Array  # [B] number of accepted draft tokens
  bonus: jax.Array  # [B] the token drawn from the target after the accepted path


def verify(draft: Draft, logits: jax.Array, args: SamplerArgs, rows, gen_pos, spec: SpecConfig,
           coupled: bool = False) -> Verdict:
  """Walks the draft against the target ``logits [B, N, V]``; exact for greedy and sampling.

  ``coupled``: sampled rows take the greedy walk on the Gumbel-perturbed target log-probs (the
  noise of each node's position), so the emitted tokens are vanilla sampling's.

  A chain of point-mass drafts (the n-gram and suffix drafters') takes ``_walk_point_chain``:
  the same decisions from the same random draws, all levels at once."""
  walker = _walk_point_chain if spec.is_chain and draft.draft_probs is None else _walk
  walk = lambda greedy: lambda: walker(draft, logits, args, rows, gen_pos, spec, greedy)
  if coupled:
    def perturbed_walk():
      logp = filtered_logprobs(logits, args.temperature, args.top_k, args.top_p)
      noise = coupled_noise(args, rows, gen_pos, spec.depth + 1, logits.shape[-1])
      logp = logp + jnp.take_along_axis(noise, draft.depth[:, :, None], axis=1)
      return walker(draft, logp, args, rows, gen_pos, spec, True)
    return lax.cond(args.temperature <= 0, walk(True), perturbed_walk)
  return lax.cond(args.temperature <= 0, walk(True), walk(False))


def _walk(draft: Draft, logits: jax.Array, args: SamplerArgs, rows, gen_pos, spec: SpecConfig,
          greedy: bool) -> Verdict:
  """The acceptance walk; ``greedy`` (static) skips every random draw."""
  b, n = draft.tokens.shape
  depth = spec.depth
  probs = final_residual = None
  if not greedy:
    probs = jnp.exp(filtered_logprobs(logits, args.temperature, args.top_k, args.top_p))
    final_residual = pick_positions(probs, jnp.zeros((b,), jnp.int32))
  cur = jnp.zeros((b,), jnp.int32)
  active = jnp.ones((b,), bool)
  path = [cur]
  for level in range(depth):
    residual = None if greedy else pick_positions(probs, cur)  # the node's target distribution
    argmax_here = jnp.argmax(pick_positions(logits, cur), -1)
    children = pick_positions(draft.children, cur)  # [B, k]
    usable = active & (level < draft.draft_len)
    chosen = jnp.full((b,), -1, jnp.int32)
    for j in range(children.shape[1]):
      child = children[:, j]
      ok = usable & (child >= 0) & (chosen < 0)
      tok = jnp.take_along_axis(draft.tokens, jnp.maximum(child, 0)[:, None], 1)[:, 0]
      if greedy:
        chosen = jnp.where(ok & (tok == argmax_here), child, chosen)
        continue
      if draft.draft_probs is not None:  # chain: rejection against the drafter's q
        q = draft_probs_over_target(draft, level, residual.shape[-1])
        q_tok = jnp.take_along_axis(q, tok[:, None], 1)[:, 0]
        p_tok = jnp.take_along_axis(residual, tok[:, None], 1)[:, 0]
        accept_prob = jnp.minimum(1.0, p_tok / jnp.maximum(q_tok, 1e-30))
        rejected_residual = jnp.maximum(residual - q, 0.0)
      else:  # tree: sequential rejection of point-mass candidates
        accept_prob = jnp.take_along_axis(residual, tok[:, None], 1)[:, 0]
        rejected_residual = jnp.where(jax.nn.one_hot(tok, residual.shape[-1], dtype=bool), 0.0,
                                      residual)
      u = jax.vmap(jax.random.uniform)(_keys(args, rows, gen_pos + level, _ACCEPT + 8 * j))
      accept = u < accept_prob
      chosen = jnp.where(ok & accept, child, chosen)
      mass = jnp.sum(rejected_residual, -1, keepdims=True)
      rejected_residual = jnp.where(mass > 0, rejected_residual / jnp.maximum(mass, 1e-30),
                                    residual)
      residual = jnp.where((ok & ~accept)[:, None], rejected_residual, residual)
    found = chosen >= 0
    if not greedy:
      final_residual = jnp.where((active & ~found)[:, None], residual, final_residual)
    cur = jnp.where(found, chosen, cur)
    path.append(jnp.where(found, chosen, 0))
    active = active & found
  accepted = jnp.sum(jnp.stack(path[1:], 1) > 0, axis=1).astype(jnp.int32)
  if greedy:
    bonus = jnp.argmax(pick_positions(logits, cur), -1)
  else:
    final_residual = jnp.where(active[:, None], pick_positions(probs, cur), final_residual)
    bonus_key = _keys(args, rows, gen_pos + accepted, _BONUS)
    bonus = jax.vmap(jax.random.categorical)(bonus_key,
                                             jnp.log(jnp.maximum(final_residual, 0.0)))
  return Verdict(jnp.stack(path, 1), accepted, bonus.astype(jnp.int32))


def _walk_point_chain(draft: Draft, logits: jax.Array, args: SamplerArgs, rows, gen_pos,
                      spec: SpecConfig, greedy: bool) -> Verdict:
  """``_walk`` for a chain of point-mass drafts (``draft_probs`` None, node ``i`` at level ``i``),
  every level at once instead of one after another: level ``i``'s draft ``d_i`` passes iff it is
  the target's argmax there (greedy) or ``u_i < p_i(d_i)`` with ``u_i`` the uniform ``_walk``
  draws for that level; the first failure (or the end of the draft) stops the walk, and the bonus
  is drawn from ``p`` with the rejected token removed (or from ``p`` after full acceptance),
  with ``_walk``'s key. The same draws give the same verdict as ``_walk``."""
  b, n = draft.tokens.shape
  depth = spec.depth
  levels = jnp.arange(depth, dtype=jnp.int32)
  nxt = draft.tokens[:, 1:depth + 1]  # [B, D] the draft of each level
  usable = levels[None, :] < draft.draft_len[:, None]
  if greedy:
    passed = jnp.argmax(logits[:, :depth], -1) == nxt
  else:
    probs = jnp.exp(filtered_logprobs(logits, args.temperature, args.top_k, args.top_p))
    p_tok = jnp.take_along_axis(probs[:, :depth], nxt[:, :, None], 2)[:, :, 0]  # [B, D]
    keys = jax.vmap(lambda level: _keys(args, rows, gen_pos + level, _ACCEPT), out_axes=1)(levels)
    u = jax.vmap(jax.vmap(jax.random.uniform))(keys)  # [B, D]
    passed = u < p_tok
  run = jnp.cumprod((passed & usable).astype(jnp.int32), axis=1)
  accepted = jnp.sum(run, axis=1).astype(jnp.int32)
  path = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), run * (levels[None, :] + 1)], 1)
  if greedy:
    bonus = jnp.argmax(pick_positions(logits, accepted), -1)
  else:
    here = pick_positions(probs, accepted)  # [B, V] the target at the node the walk ended on
    stopped = accepted < draft.draft_len  # the draft at that node was rejected: remove it
    rejected = jnp.take_along_axis(nxt, jnp.minimum(accepted, depth - 1)[:, None], 1)[:, 0]
    removed = jnp.where(jax.nn.one_hot(rejected, here.shape[-1], dtype=bool), 0.0, here)
    mass = jnp.sum(removed, -1, keepdims=True)
    removed = jnp.where(mass > 0, removed / jnp.maximum(mass, 1e-30), here)
    final = jnp.where(stopped[:, None], removed, here)
    bonus_key = _keys(args, rows, gen_pos + accepted, _BONUS)
    bonus = jax.vmap(jax.random.categorical)(bonus_key, jnp.log(jnp.maximum(final, 0.0)))
  return Verdict(path, accepted, bonus.astype(jnp.int32))


def compact_path_kv(cache: KVCache, path: jax.Array, n: int) -> KVCache:
  """Moves the KV of the accepted path's nodes (written at ``lengths + node``) to
  ``lengths + 0..a``, so the row's committed cache is contiguous again."""
  path = path[:, :n]  # a tree of n nodes accepts at most n - 1 drafts, whatever its depth
  b, width = path.shape
  order = jnp.concatenate([path, jnp.broadcast_to(jnp.arange(width, n), (b, n - width))], 1)
  # Beyond the accepted length the path is 0-padded; those slots are dead, any content will do.

  def move(buf):
    window = jax.vmap(lambda x, at: lax.dynamic_slice_in_dim(x, at, n, 0))(buf, cache.lengths)
    window = jnp.take_along_axis(window, order[:, :, None, None], 1)
    return jax.vmap(lambda x, w, at: lax.dynamic_update_slice_in_dim(x, w, at, 0))(
        buf, window, cache.lengths)

  return KVCache(tuple(map(move, cache.k)), tuple(map(move, cache.v)), cache.lengths)
