"""Who drafts: each kind of drafter a speculative rollout can use, with everything the engine
needs of it in one place.

A kind says how its strategies are named (the tuner's arm names, the stats' keys), which of them
share one segment executable, and how a speculative decode step drafts with it (``draft``: the
proposal, its tree mask, where each draft came from and the drafter's advanced cache). The step
functions (``steps.py``) look the kind up in ``KINDS`` and never branch on it, so adding a kind
means one class here (and its tests).

``DrafterKind`` is a ``StrEnum``: a kind compares equal to its name, so saved tuner state, stats
and configs keep the plain strings.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tlt_jax.rollout.decode import speculative as sd
from tlt_jax.rollout.decode import suffix as sfx
from tlt_jax.rollout.decode.ngram import contexts, ngram_propose
from tlt_jax.rollout.decode.speculative import DRAFT_SOURCES, SpecConfig


class DrafterKind(enum.StrEnum):
  LEARNED = "learned"  # an EAGLE-style drafter model reading the target's hidden states
  NGRAM = "ngram"  # n-gram matches in the prompt and the group's sibling responses
  SUFFIX = "suffix"  # the suffix drafter: the row's own history, siblings and prompt


class Drafted(NamedTuple):
  """A speculative step's proposal, before the target verifies it."""

  draft: Any  # sd.Draft
  mask: jax.Array | None  # tree attention mask (None: a chain)
  source: jax.Array  # where the draft came from: per row [B] or per node [B, N] (DRAFT_SOURCES)
  dcache: Any = None  # the learned drafter's advanced KV cache (None: no drafter model)


def _source(live: jax.Array, name: str) -> jax.Array:
  return jnp.full(live.shape, DRAFT_SOURCES.index(name), jnp.int32)


@dataclasses.dataclass(frozen=True)
class Kind:
  """One drafter kind: its name rules and its drafting (the subclasses below)."""

  kind: DrafterKind

  def strategy_name(self, spec: SpecConfig) -> str:
    """The arm name of ``spec`` drafted by this kind (``"chain d4"``, ``"ngram d8"``, ...)."""
    raise NotImplementedError

  def group_name(self, spec: SpecConfig) -> str:
    """The executable group ``spec`` belongs to: its own, unless the kind shares one."""
    return self.strategy_name(spec)

  def draft(self, steps, target, drafter, state, args, group, choice) -> Drafted:
    """The proposal of ``group``'s member ``choice`` for every row of ``state`` (traced inside a
    segment; ``steps``: the engine's ``StepFunctions``)."""
    raise NotImplementedError


class LearnedKind(Kind):
  """A drafter model: chains, or trees of one verify width sharing one executable (``lax.switch``
  over the members), after catching up on the pending (hidden state, token) pairs."""

  def strategy_name(self, spec: SpecConfig) -> str:
    if spec.is_chain:
      return f"chain d{spec.depth}"
    return f"tree d{spec.depth} k{spec.topk} v{spec.verify_tokens}"

  def group_name(self, spec: SpecConfig) -> str:
    return self.strategy_name(spec) if spec.is_chain else f"tree v{spec.verify_tokens}"

  def draft(self, steps, target, drafter, state, args, group, choice) -> Drafted:
    live, rows, gen_pos = ~state.done, state.row_id, state.num_generated
    win_tokens, win_feats, pend = steps.pending_window(state, steps.config.pending_width)
    dout = drafter.forward(target, win_tokens, win_feats, cache=state.dcache)
    dcache = dout.cache.advance(jnp.where(live, pend, 0))
    feature = sd.pick_positions(dout.hidden, pend - 1)
    logits = sd.pick_positions(dout.logits, pend - 1)
    if group.members[0].is_chain:
      draft = sd.draft_chain(target, drafter, dcache, feature, logits, state.last_token, args,
                             rows, gen_pos, group.members[0].depth, coupled=steps.coupled)
      return Drafted(draft, None, _source(live, "learned"), dcache)
    walk = group.walk_spec

    def tree(spec):
      def noisy():
        noise = sd.coupled_noise(args, rows, gen_pos, spec.depth, steps.model_config.vocab_size)
        return sd.draft_tree(target, drafter, dcache, feature, logits, state.last_token, spec,
                             sd.perturb_draft(noise, drafter.vocab_ids))

      def plain():
        return sd.draft_tree(target, drafter, dcache, feature, logits, state.last_token, spec)

      def one():
        d = lax.cond(args.temperature <= 0, plain, noisy) if steps.coupled else plain()
        pad = walk.topk - d.children.shape[2]  # one children table for every member
        children = jnp.pad(d.children, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
        return d._replace(children=children)
      return one

    branches = [tree(spec) for spec in group.members]
    draft = branches[0]() if len(branches) == 1 else lax.switch(choice, branches)
    return Drafted(draft, sd.tree_attention(draft, walk.depth), _source(live, "learned"), dcache)


class NgramKind(Kind):
  """Point-mass chains from n-gram matches (verified by the sequential point-mass rule)."""

  def strategy_name(self, spec: SpecConfig) -> str:
    if spec.is_chain:
      return f"ngram d{spec.depth}"
    return f"tree d{spec.depth} k{spec.topk} v{spec.verify_tokens}"  # refused by the engine

  def draft(self, steps, target, drafter, state, args, group, choice) -> Drafted:
    spec = group.members[0]  # n-gram groups are single chains
    proposal, proposal_len = ngram_propose(
        state.prompt_tokens, state.prompt_lens, state.tokens, state.num_generated,
        state.group_id, max_ngram=steps.ngram.max_ngram, min_ngram=steps.ngram.min_ngram,
        depth=spec.depth)
    draft = sd.chain_tree(proposal, state.last_token, None, proposal_len)
    return Drafted(draft, None, _source(~state.done, "ngram"))


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
    drafted = sfx.suffix_draft(ctx, ctx_len, state.prompt_lens, state.group_id, state.history,
                               args.max_new_tokens - state.num_generated, state.last_token,
                               steps.suffix, spec)
    mask = None if spec.is_chain else sd.tree_attention(drafted.draft, spec.depth)
    return Drafted(drafted.draft, mask, drafted.node_source)


KINDS: dict[DrafterKind, Kind] = {k.kind: k for k in (
    LearnedKind(DrafterKind.LEARNED), NgramKind(DrafterKind.NGRAM), SuffixKind(DrafterKind.SUFFIX))}


def kind_of(name: str | DrafterKind) -> Kind:
  """The kind named ``name``; an unknown name says which ones exist."""
  try:
    return KINDS[DrafterKind(name)]
  except ValueError:
    raise ValueError(f"unknown drafter kind {name!r}; the kinds are "
                     f"{[k.value for k in DrafterKind]}") from None
