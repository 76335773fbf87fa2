"""The learned drafter's kind: an EAGLE-style drafter model (``tlt_jax.models``) drafting chains or
trees inside a decode segment, after catching up on the (hidden state, token) pairs that are
still pending. Registered under ``"learned"``; every learned architecture drafts through it
(``models.learned_kinds`` names the architectures).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tlt_jax.rollout.decode import speculative as sd
from tlt_jax.rollout.decode.kinds import Drafted, DrafterKind, Kind, register, source_of


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
      return Drafted(draft, None, source_of(live, "learned"), dcache)
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
    return Drafted(draft, sd.tree_attention(draft, walk.depth), source_of(live, "learned"), dcache)


LEARNED = register(LearnedKind(DrafterKind.LEARNED))
