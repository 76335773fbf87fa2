"""The rollout engine's pure, jittable step functions: prefill, one decode step per strategy, the
drafter catch-up at a vanilla -> SD switch, decode segments, cache growth and row compaction.

Everything here is a function of (weights, state, sampling args) with static shapes; the
executable pool (``pool.py``) compiles them per bucket and the scheduler (``scheduler.py``) drives
them from the host. The decode state has one layout for every strategy of an engine, so a row can
be decoded by vanilla steps in one segment and by any speculative strategy in the next:

* the KV caches have room for the widest strategy's step (``EngineConfig.slack``);
* with a learned drafter, ``feats [B, N, H]`` keeps the target's last-layer hidden state that
  produced each generated token: ``feats[b, g]`` is ``h`` at the position before generated token
  ``g``. The drafter reads pairs ``(h_t, x_{t+1})``; it has consumed every pair below its cache
  length ``dl`` and the ``pend = L - dl`` newest pairs (``L``: the target's committed length) are
  pending. A speculative step consumes up to ``pending_width`` of them before drafting; vanilla
  steps only add pairs, and ``catch_up`` consumes the backlog when SD takes over again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from tlt_jax.models.transformer import KVCache
from tlt_jax.rollout.decode import speculative as sd
from tlt_jax.rollout.decode.kinds import KINDS, DrafterKind, draft_sources, kind_of
from tlt_jax.rollout.decode.sampling import SamplerArgs, filtered_logprobs, row_keys, sample_tokens
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.decode.suffix import SuffixConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything a decode segment carries, one row per batch slot."""

  cache: KVCache
  last_token: jax.Array  # [B] the most recent token, fed at the next step
  tokens: jax.Array  # [B, N] generated tokens
  logprobs: jax.Array  # [B, N] their log-probs under the sampling distribution
  num_generated: jax.Array  # [B]
  done: jax.Array  # [B] bool; padding rows are done from the start
  row_id: jax.Array  # [B] index of the prompt in the request (-1: padding)
  counters: dict  # scalars / histograms summed over rows: not per-row, never compacted
  # A learned drafter only (None otherwise):
  dcache: KVCache | None = None  # the drafter's one-layer cache
  feats: jax.Array | None = None  # [B, N, H] the target feature before each generated token
  # model-free (n-gram, registered) and suffix drafting only: each row's prompt and the group of
  # rows sharing that prompt
  prompt_tokens: jax.Array | None = None  # [B, max_prompt_len]
  prompt_lens: jax.Array | None = None  # [B]
  group_id: jax.Array | None = None  # [B] (-1: padding)
  # suffix drafting only: earlier completions of the row's prompt (``suffix.pack_history``)
  history: jax.Array | None = None  # [B, SuffixConfig.history_len]


@dataclasses.dataclass(frozen=True)
class StrategyGroup:
  """Strategies that share one segment executable: vanilla alone, a chain alone, or the trees
  of one verify width (their drafting differs, the verify pass and the walk are shared)."""

  name: str
  members: tuple[SpecConfig, ...] = ()  # () for vanilla
  kind: str = DrafterKind.LEARNED  # who drafts (``kinds.py``)

  def __post_init__(self):
    object.__setattr__(self, "kind", kind_of(self.kind).kind)  # a name becomes its kind

  @property
  def is_vanilla(self) -> bool:
    return not self.members

  @property
  def walk_spec(self) -> SpecConfig:
    """A spec as deep and wide as the deepest/widest member: what the shared walk iterates over."""
    m = self.members
    return SpecConfig(depth=max(s.depth for s in m), topk=max(s.topk for s in m),
                      verify_tokens=m[0].verify_tokens)


def strategy_name(spec: SpecConfig | None, kind: str = DrafterKind.LEARNED) -> str:
  """``"vanilla"``, or the arm name of ``spec`` drafted by ``kind`` (``kinds.Kind``):
  ``"chain d4"``, ``"tree d4 k4 v16"``, ``"ngram d8"``, ``"suffix d8"``, ``"suffix d8 k3 v11"``."""
  return "vanilla" if spec is None else kind_of(kind).strategy_name(spec)


def group_name(spec: SpecConfig | None, kind: str = DrafterKind.LEARNED) -> str:
  """The name of the executable group a strategy belongs to (the learned drafter's trees of one
  verify width share one; every other strategy has its own)."""
  return "vanilla" if spec is None else kind_of(kind).group_name(spec)


def make_groups(specs: Sequence[SpecConfig], kind: str = DrafterKind.LEARNED,
                suffix_specs: Sequence[SpecConfig] = ()) -> dict[str, StrategyGroup]:
  """Vanilla plus ``specs`` (drafted by ``kind``) and ``suffix_specs`` grouped by ``group_name``
  (members in the order given)."""
  members: dict[tuple[str, str], list[SpecConfig]] = {}
  for k, group_specs in ((kind_of(kind).kind, specs), (DrafterKind.SUFFIX, suffix_specs)):
    for spec in group_specs:
      members.setdefault((group_name(spec, k), k), []).append(spec)
  groups = {"vanilla": StrategyGroup("vanilla")}
  groups.update({name: StrategyGroup(name, tuple(m), k) for (name, k), m in members.items()})
  return groups


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  """Whether each token (any shape) is one of ``stop_ids`` (padded with -1, which never matches)."""
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x[b, index[b, j]]`` for ``x [B, N, ...]`` and ``index [B, J]`` (clipped into range)."""
  index = jnp.clip(index, 0, x.shape[1] - 1)
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


class StepFunctions:
  """The engine's step functions for one target (and drafter) and one ``EngineConfig``.

  Pure in (weights, state, args); the static configuration lives on the instance. ``weights`` is
  ``(target params, drafter params or None)``.
  """

  def __init__(self, model_config, config, graphdef, drafter_graphdef,
               free, groups: dict[str, StrategyGroup],
               suffix: SuffixConfig | None = None, features: bool | tuple[int, ...] = True):
    self.model_config = model_config
    # what the target returns as a learned drafter's features (``Drafter.target_features``)
    self.features = features
    self.config = config
    self.graphdef = graphdef
    self.drafter_graphdef = drafter_graphdef
    self.free = free  # a model-free kind's config (``kinds.ModelFreeKind``), or None
    self.suffix = suffix
    self.groups = groups
    self.coupled = config.verify == "coupled"
    self.phase_marks: list[tuple[int, float]] = []

  @property
  def learned(self) -> bool:
    """Whether a learned (EAGLE) drafter is attached."""
    return self.drafter_graphdef is not None

  @property
  def any_sd(self) -> bool:
    return any(not g.is_vanilla for g in self.groups.values())

  @property
  def history_len(self) -> int:
    """Width of the ``history`` input of ``prefill`` (0 without a suffix drafter)."""
    return 0 if self.suffix is None else self.suffix.history_len

  def merge(self, weights):
    """The target and drafter modules of ``weights``."""
    params, dparams = weights
    target = nnx.merge(self.graphdef, params)
    drafter = nnx.merge(self.drafter_graphdef, dparams) if dparams is not None else None
    return target, drafter

  def _counters(self):
    counters = {"steps": jnp.zeros((), jnp.int32), "row_steps": jnp.zeros((), jnp.int32),
                "tokens": jnp.zeros((), jnp.int32)}
    if self.any_sd:
      counters["accept_hist"] = jnp.zeros((self.config.pending_width,), jnp.int32)
      counters["source_steps"] = jnp.zeros((len(draft_sources()),), jnp.int32)
      counters["source_tokens"] = jnp.zeros((len(draft_sources()),), jnp.int32)
    return counters

  # ---- prefill -----------------------------------------------------------------------------
  def prefill(self, weights, ids, prompt_lens, row_id, group_id, history, args: SamplerArgs, *,
              kv_len: int) -> tuple[DecodeState, jax.Array | None]:
    """Runs the prompts ``ids [B, P]``, samples each row's first token, and builds the state
    (the drafter consumes the prompt's pairs; the last one stays pending). ``history [B,
    history_len]``: the suffix drafter's earlier completions per row (width 0 without one).

    Returns ``(state, hidden)``: with a learned drafter ``hidden [B, P, H]`` is the target's
    last-layer hidden state over the prompts (computed for the drafter anyway; the host reads it
    only when it collects hidden states for drafter training), else None."""
    target, drafter = self.merge(weights)
    batch = ids.shape[0]
    cache = KVCache.create(self.model_config, batch, kv_len)
    out = target.forward(ids, cache=cache, return_hidden=drafter is not None and self.features)
    last_logits = sd.pick_positions(out.logits, prompt_lens - 1)
    keys = row_keys(args.seed, row_id, jnp.zeros_like(row_id))
    tok, logp = sample_tokens(last_logits, keys, args)
    padding = row_id < 0
    n = self.config.tokens_len(kv_len)
    tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(tok)
    logprobs = jnp.zeros((batch, n), jnp.float32).at[:, 0].set(logp)
    done = padding | _is_stop(tok, args.stop_ids) | (args.max_new_tokens <= 1)
    extra = {}
    if drafter is not None:
      # The drafter reads pairs (h_t, x_{t+1}): the prompt gives t = 0 .. len-2; the pair
      # (h_{len-1}, first sampled token) stays pending for the first speculative step.
      shifted = jnp.concatenate([ids[:, 1:], jnp.zeros((batch, 1), ids.dtype)], axis=1)
      dout = drafter.forward(target, shifted, out.hidden, cache=drafter.init_cache(batch, kv_len))
      feats = jnp.zeros((batch, n, out.hidden.shape[-1]), out.hidden.dtype)
      feats = feats.at[:, 0].set(sd.pick_positions(out.hidden, prompt_lens - 1))
      extra = dict(dcache=dout.cache.with_lengths(prompt_lens - 1), feats=feats)
    if self.free is not None or self.suffix is not None:
      pad = self.config.max_prompt_len - ids.shape[1]
      extra.update(prompt_tokens=jnp.pad(ids, ((0, 0), (0, pad))), prompt_lens=prompt_lens,
                   group_id=jnp.where(padding, -1, group_id))
    if self.suffix is not None:
      extra["history"] = jnp.where(padding[:, None], -1, history).astype(jnp.int32)
    state = DecodeState(cache=out.cache.with_lengths(prompt_lens), last_token=tok, tokens=tokens,
                        logprobs=logprobs, num_generated=jnp.where(padding, 0, 1).astype(jnp.int32),
                        done=done, row_id=row_id, counters=self._counters(), **extra)
    return state, (out.hidden if drafter is not None else None)

  # ---- one decode step ---------------------------------------------------------------------
  def vanilla_step(self, target, state: DecodeState, args: SamplerArgs) -> DecodeState:
    """One token per live row; with a learned drafter, its feature is kept for later drafting."""
    live = ~state.done
    out = target.forward(state.last_token[:, None], cache=state.cache,
                         return_hidden=state.feats is not None and self.features)
    keys = row_keys(args.seed, state.row_id, state.num_generated)
    tok, logp = sample_tokens(out.logits[:, 0], keys, args)
    extra = {}
    if state.feats is not None:
      rows = jnp.arange(tok.shape[0])
      extra["feats"] = state.feats.at[rows, state.num_generated].set(
          jnp.where(live[:, None], out.hidden[:, 0], state.feats[rows, state.num_generated]))
    return self.emit(state, live, tok[:, None], logp[:, None], jnp.ones_like(tok),
                     out.cache.advance(live.astype(jnp.int32)), tok, args, **extra)

  def emit(self, state, live, new_tokens, new_logprobs, count, cache, last_token, args, **extra):
    """Appends up to ``count [B]`` of ``new_tokens [B, W]`` per live row, cut at the first stop
    id or the length limit, and marks rows that finished."""
    width = new_tokens.shape[1]
    j = jnp.arange(width)[None, :]
    is_stop = _is_stop(new_tokens, args.stop_ids)
    first_stop = jnp.min(jnp.where(is_stop & (j < count[:, None]), j, width), axis=1)
    n_emit = jnp.minimum(jnp.minimum(count, first_stop + 1),
                         args.max_new_tokens - state.num_generated)
    n_emit = jnp.where(live, jnp.maximum(n_emit, 0), 0)
    rows = jnp.arange(new_tokens.shape[0])[:, None]
    slots = state.num_generated[:, None] + j
    keep = j < n_emit[:, None]
    tokens = state.tokens.at[rows, slots].set(jnp.where(keep, new_tokens, state.tokens[rows, slots]))
    logprobs = state.logprobs.at[rows, slots].set(
        jnp.where(keep, new_logprobs, state.logprobs[rows, slots]))
    num_generated = state.num_generated + n_emit
    finished = (first_stop < n_emit) | (num_generated >= args.max_new_tokens)
    c = state.counters
    counters = dict(c, steps=c["steps"] + 1, row_steps=c["row_steps"] + jnp.sum(live),
                    tokens=c["tokens"] + jnp.sum(n_emit))
    if "accept_hist" in counters and width > 1:
      counters["accept_hist"] = counters["accept_hist"] + jnp.sum(
          jax.nn.one_hot(count - 1, self.config.pending_width, dtype=jnp.int32) * live[:, None],
          axis=0)
    return dataclasses.replace(
        state, cache=cache, last_token=jnp.where(live, last_token, state.last_token),
        tokens=tokens, logprobs=logprobs, num_generated=num_generated,
        done=state.done | (live & finished), counters=counters, **extra)

  def mark_phase(self, phase: int, after: jax.Array) -> None:
    """With ``time_phases``, records on the host when ``after`` is computed (phase 0/1/2)."""
    if self.config.time_phases:
      jax.debug.callback(lambda p, _: self.phase_marks.append((int(p), time.perf_counter())),
                         phase, after, ordered=True)

  def pending_window(self, state: DecodeState, width: int):
    """The ``width`` oldest pending (token, feature) pairs of each row and the pending count."""
    pend = state.cache.lengths - state.dcache.lengths
    index = (state.num_generated - pend)[:, None] + jnp.arange(width)[None, :]
    return _gather_rows(state.tokens, index), _gather_rows(state.feats, index), pend

  def spec_step(self, target, drafter, state: DecodeState, args: SamplerArgs,
                group: StrategyGroup, choice: jax.Array) -> DecodeState:
    """Draft with member ``choice`` of ``group`` (as its drafter kind drafts: ``kinds.py``),
    verify in one target pass, accept."""
    self.mark_phase(0, state.last_token)
    drafted = KINDS[group.kind].draft(self, target, drafter, state, args, group, choice)
    self.mark_phase(1, drafted.draft.tokens)
    return self._verify_and_emit(target, state, drafted.draft, drafted.mask, args, group,
                                 dcache=drafted.dcache, source=drafted.source)

  def _verify_and_emit(self, target, state, draft, mask, args, group: StrategyGroup,
                       dcache=None, source=None):
    """One target pass over the draft, the lossless walk, cache commit and token emission.

    ``source``: where the draft came from, per row ``[B]`` or per node ``[B, N]`` (the accepted
    path's first node names it; a row that accepted nothing is its first branch's); counted in
    ``counters["source_steps"/"source_tokens"]``. With a learned drafter's features kept, the
    accepted path's hidden states are recorded whoever drafted (``dcache``: the learned
    drafter's new cache, None: unchanged)."""
    spec = group.walk_spec
    live = ~state.done
    rows, gen_pos = state.row_id, state.num_generated
    positions = state.cache.lengths[:, None] + draft.depth
    out = target.forward(draft.tokens, positions, cache=state.cache, attn_mask=mask,
                         return_hidden=state.feats is not None and self.features)
    verdict = sd.verify(draft, out.logits, args, rows, gen_pos, spec, coupled=self.coupled)
    self.mark_phase(2, verdict.bonus)
    accepted = verdict.accepted
    path_tokens = jnp.take_along_axis(draft.tokens, verdict.path, 1)  # [B, depth + 1]
    batch_rows = jnp.arange(path_tokens.shape[0])
    emitted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(path_tokens[:, :1])], 1)
    emitted = emitted.at[batch_rows, accepted].set(verdict.bonus)
    logp = filtered_logprobs(jnp.take_along_axis(out.logits, verdict.path[:, :, None], 1),
                             args.temperature, args.top_k, args.top_p)
    emitted_logp = jnp.take_along_axis(logp, emitted[:, :, None], 2)[:, :, 0]
    cache = out.cache if spec.is_chain else sd.compact_path_kv(out.cache, verdict.path,
                                                               spec.verify_tokens)
    count = accepted + 1
    cache = cache.advance(jnp.where(live, count, 0))
    extra = {}
    if source is not None:
      if source.ndim == 2:
        first = jnp.where(accepted > 0, verdict.path[:, 1],
                          jnp.where(draft.draft_len > 0, draft.children[:, 0, 0], 0))
        source = jnp.take_along_axis(source, jnp.maximum(first, 0)[:, None], 1)[:, 0]
      hit = jax.nn.one_hot(source, len(draft_sources()), dtype=jnp.int32) * live[:, None]
      c = state.counters
      extra["counters"] = dict(c, source_steps=c["source_steps"] + jnp.sum(hit, 0),
                               source_tokens=c["source_tokens"] + jnp.sum(hit * count[:, None], 0))
      state = dataclasses.replace(state, **extra)
    if state.feats is None:
      return self.emit(state, live, emitted, emitted_logp, count, cache, verdict.bonus, args)
    dcache = state.dcache if dcache is None else dcache
    # the features of the accepted path: feats[g + j] is the hidden state at path node j
    path_feats = jnp.take_along_axis(out.hidden, verdict.path[:, :, None], 1)
    slots = gen_pos[:, None] + jnp.arange(path_feats.shape[1])[None, :]
    old = _gather_rows(state.feats, slots)
    feats = state.feats.at[batch_rows[:, None], slots].set(
        jnp.where(live[:, None, None], path_feats, old))
    return self.emit(state, live, emitted, emitted_logp, count, cache, verdict.bonus, args,
                     dcache=dcache, feats=feats)

  # ---- segments and the switch -------------------------------------------------------------
  def segment(self, weights, state: DecodeState, args: SamplerArgs, choice: jax.Array,
              max_steps: jax.Array, stop_at: jax.Array, *, group: str) -> DecodeState:
    """Decodes with ``group`` (member ``choice``) until at most ``stop_at`` rows are live (0:
    until all rows finish), after ``max_steps`` steps (``max_steps`` and ``stop_at`` are int32
    scalars, so a short probe, a long settled segment and a segment that cannot compact yet share
    one executable; ``max_steps`` <= 0: no limit), or, below the largest length bucket, until a
    live row could write past the cache in its next step."""
    target, drafter = self.merge(weights)
    g = self.groups[group]
    if g.is_vanilla:
      body = lambda s: self.vanilla_step(target, s, args)
    else:
      body = lambda s: self.spec_step(target, drafter, s, args, g, choice)
    # a vanilla step writes one slot: vanilla segments may fill the cache that far (the host grows
    # it before a speculative segment needs more)
    kv_len, need = state.cache.max_len, 1 if g.is_vanilla else self.config.step_slots

    def go_on(carry):
      s, i = carry
      live = ~s.done
      go = jnp.sum(live) > stop_at
      if kv_len < self.config.cache_len:
        go &= ~jnp.any(live & (s.cache.lengths + need > kv_len))
      return go & ((max_steps <= 0) | (i < max_steps))

    state, _ = lax.while_loop(go_on, lambda c: (body(c[0]), c[1] + 1),
                              (state, jnp.zeros((), jnp.int32)))
    return state

  def catch_up(self, weights, state: DecodeState) -> DecodeState:
    """Runs the drafter over each live row's backlog of pending pairs (left by vanilla steps)
    until at most ``pending_width`` remain, ``slack - 1`` pairs per drafter pass."""
    target, drafter = self.merge(weights)
    width = self.config.slack - 1  # keeps every write inside the cache (L + slack <= kv_len)
    limit = self.config.pending_width

    def behind(s):
      return jnp.any(~s.done & (s.cache.lengths - s.dcache.lengths > limit))

    def consume(s):
      toks, feats, pend = self.pending_window(s, width)
      out = drafter.forward(target, toks, feats, cache=s.dcache)
      take = jnp.where(~s.done & (pend > limit), jnp.minimum(pend - 1, width), 0)
      return dataclasses.replace(s, dcache=out.cache.advance(take))

    return lax.while_loop(behind, consume, state)

  def grow(self, state: DecodeState, *, kv_len: int) -> DecodeState:
    """The same rows with their caches (and token buffers) re-laid into ``kv_len`` slots."""
    def pad(x, n):
      if x is None:
        return None
      return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    def grow(cache):
      if cache is None:
        return None
      return KVCache(tuple(pad(k, kv_len) for k in cache.k), tuple(pad(v, kv_len) for v in cache.v),
                     cache.lengths)

    n = self.config.tokens_len(kv_len)
    return dataclasses.replace(state, cache=grow(state.cache), dcache=grow(state.dcache),
                               tokens=pad(state.tokens, n), logprobs=pad(state.logprobs, n),
                               feats=pad(state.feats, n))

  @staticmethod
  def compact(state: DecodeState, index: jax.Array) -> DecodeState:
    """Gathers rows ``index`` into a smaller batch; ``index == -1`` makes a padding row."""
    pad = index < 0
    counters = state.counters
    rows = dataclasses.replace(state, counters=None)
    rows = jax.tree.map(lambda x: jnp.take(x, jnp.maximum(index, 0), axis=0), rows)
    rows = dataclasses.replace(rows, done=rows.done | pad, row_id=jnp.where(pad, -1, rows.row_id),
                               counters=counters)
    if rows.group_id is not None:  # a padding copy must not act as anyone's sibling
      rows = dataclasses.replace(rows, group_id=jnp.where(pad, -1, rows.group_id))
    return rows

  @staticmethod
  def cache_bytes(state: DecodeState) -> int:
    """Bytes held by the decode state's KV caches (target and drafter) and drafter features."""
    caches = [c for c in (state.cache, state.dcache) if c is not None]
    total = sum(x.size * x.dtype.itemsize for c in caches for x in c.k + c.v)
    if state.feats is not None:
      total += state.feats.size * state.feats.dtype.itemsize
    return total
