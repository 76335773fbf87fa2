"""The rollout engine: bucketed, jitted decode with live-row compaction and growing caches.

A request is split into chunks of at most ``max_batch`` prompts. Each chunk is prefilled at
(batch bucket, prompt-length bucket) into a KV cache of the smallest *length bucket* that holds
the prompts, then decoded by a jitted ``lax.while_loop`` *segment* that runs until every row is
finished, the live rows fit the next smaller batch bucket, or a live row is about to outgrow the
cache. The host then gathers the live rows into the smaller batch bucket (compaction) and/or
re-lays the cache into the next length bucket (growth), and continues. So every decode step
attends over (and every cache holds) about as many slots as the longest live row needs, not the
capacity ``max_prompt_len + max_new_tokens``. Every executable is keyed by its buckets and
compiled once (``precompile`` compiles them all).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import KVCache, Transformer
from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout import speculative as sd
from tlt_jax.rollout.ngram import NgramConfig, ngram_propose
from tlt_jax.rollout.sampling import (SamplerArgs, SamplingParams, filtered_logprobs, row_keys,
                                      sample_tokens)
from tlt_jax.rollout.speculative import SpecConfig
from tlt_jax.utils import compile_count, require_positive_ints


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shapes of the rollout engine. Buckets default to powers of two up to the maxima."""

  max_batch: int = 8
  max_prompt_len: int = 128
  max_new_tokens: int = 256
  batch_buckets: tuple[int, ...] | None = None
  prefill_buckets: tuple[int, ...] | None = None
  compaction: bool = True
  max_stop_ids: int = 8
  pad_token_id: int = 0
  spec: SpecConfig | None = None  # speculative decoding strategy (needs a drafter)
  # KV-cache length buckets below the capacity ``cache_len`` (which is always the last bucket):
  # None = 128, 256, 512, ... (a power of two within 25% of the capacity is left out); () = a
  # single cache of the full capacity (decode steps then pay for the capacity, not the lengths).
  kv_buckets: tuple[int, ...] | None = None
  # Speculative steps report draft vs verify time, read by host callbacks at the phase
  # boundaries (one host round trip per phase: leave off when measuring throughput).
  time_phases: bool = False

  def __post_init__(self):
    if self.spec is not None and not isinstance(self.spec, SpecConfig):
      raise ValueError(f"EngineConfig.spec must be a SpecConfig or None, got {self.spec!r}")
    require_positive_ints(self, "max_batch", "max_prompt_len", "max_new_tokens", "max_stop_ids")
    defaults = (("batch_buckets", self.max_batch, bk.powers_of_two_up_to(self.max_batch)),
                ("prefill_buckets", self.max_prompt_len,
                 bk.powers_of_two_up_to(self.max_prompt_len, start=min(16, self.max_prompt_len))))
    for name, limit, default in defaults:
      value = getattr(self, name)
      value = default if value is None else tuple(int(v) for v in value)
      if not value or list(value) != sorted(set(value)) or value[0] <= 0 or value[-1] != limit:
        raise ValueError(
            f"EngineConfig.{name} must be strictly increasing positive sizes ending at {limit}, "
            f"got {value!r}")
      object.__setattr__(self, name, value)
    if self.kv_buckets is not None:
      value = tuple(self.kv_buckets)
      if (any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0 for v in value)
          or list(value) != sorted(set(value))):
        raise ValueError(f"EngineConfig.kv_buckets must be strictly increasing positive ints "
                         f"(or None for the default ladder), got {self.kv_buckets!r}")
      object.__setattr__(self, "kv_buckets", tuple(int(v) for v in value))

  @property
  def slack(self) -> int:
    """Extra slots past the longest sequence that a speculative step may write into."""
    if self.spec is None:
      return 0
    return self.spec.verify_tokens + self.spec.depth * (self.spec.topk + 1) + 2

  @property
  def cache_len(self) -> int:
    """KV-cache slots per row: the longest prompt plus the longest completion (plus slack)."""
    return self.max_prompt_len + self.max_new_tokens + self.slack

  @property
  def step_slots(self) -> int:
    """Cache slots past a live row's committed length that one decode step may write."""
    return 1 if self.spec is None else self.slack

  @property
  def kv_lengths(self) -> tuple[int, ...]:
    """The KV-cache length buckets, ending at the capacity ``cache_len``."""
    cap = self.cache_len
    if self.kv_buckets is None:
      below = bk.powers_of_two_up_to(cap, start=min(128, cap))[:-1]
      if below and cap < 1.25 * below[-1]:  # e.g. 4096 next to a capacity of 4128: one is enough
        below = below[:-1]
    else:
      below = tuple(v for v in self.kv_buckets if v < cap)
    return below + (cap,)

  def prefill_kv_len(self, prompt_bucket: int) -> int:
    """The cache length a chunk prefilled at ``prompt_bucket`` starts with."""
    return bk.bucket_for(prompt_bucket + self.step_slots, self.kv_lengths)

  def tokens_len(self, kv_len: int) -> int:
    """Width of the generated-token buffers that go with a cache of ``kv_len`` slots (a row never
    has more generated tokens than cache slots)."""
    return min(kv_len, self.max_new_tokens + (self.spec.max_emit if self.spec else 0))


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
  # Speculative decoding only (None otherwise):
  dcache: KVCache | None = None  # the drafter's one-layer cache
  pend_tokens: jax.Array | None = None  # [B, W] tokens x_{t+1} of (feature, token) pairs ...
  pend_feats: jax.Array | None = None  # [B, W, H] ... and target features h_t not yet drafted on
  pend_count: jax.Array | None = None  # [B] how many pending pairs are valid
  # n-gram drafting only: each row's prompt and the group of rows sharing that prompt
  prompt_tokens: jax.Array | None = None  # [B, max_prompt_len]
  prompt_lens: jax.Array | None = None  # [B]
  group_id: jax.Array | None = None  # [B] (-1: padding)


@dataclasses.dataclass
class RolloutResult:
  """Completions (ids, per-token log-probs, finish reasons) and engine statistics."""

  tokens: list[list[int]]
  logprobs: list[np.ndarray]
  finish_reasons: list[str]  # "stop" (a stop id was sampled; it is included) or "length"
  stats: dict[str, Any]


def _a(x) -> str:
  """``"an int"``, ``"a str"``: the type of ``x`` with its article, for error messages."""
  name = type(x).__name__
  return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _is_integer(x) -> bool:
  """A Python or NumPy integer, or a 0-d integer array; never a bool or a float like 1.0."""
  if isinstance(x, (bool, np.bool_)):
    return False
  if isinstance(x, (int, np.integer)):
    return True
  return (isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0
          and jnp.issubdtype(x.dtype, jnp.integer))


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  """Whether each token (any shape) is one of ``stop_ids`` (padded with -1, which never matches)."""
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


class RolloutEngine:
  """Generates completions for a list of prompts with bucketed, jitted decode segments.

  With a ``drafter`` (and ``config.spec``, default ``SpecConfig()``), every decode step is a
  lossless speculative step: draft, verify in one target pass, accept per row.
  """

  def __init__(self, model: Transformer, drafter: Drafter | NgramConfig | None = None,
               config: EngineConfig = EngineConfig()):
    self.ngram = drafter if isinstance(drafter, NgramConfig) else None
    if self.ngram is not None:
      # model-free drafting: a chain of up to ngram.depth tokens copied from the row's group
      chain = SpecConfig(depth=self.ngram.depth, topk=1, verify_tokens=self.ngram.depth + 1)
      if config.spec is not None and config.spec != chain:
        raise ValueError(f"EngineConfig.spec {config.spec} does not fit the n-gram drafter; "
                         f"leave it None (it becomes {chain})")
      config = dataclasses.replace(config, spec=chain)
      drafter = None
    elif drafter is not None and config.spec is None:
      config = dataclasses.replace(config, spec=SpecConfig())
    if config.spec is not None and drafter is None and self.ngram is None:
      raise ValueError("EngineConfig.spec is set but no drafter was given; pass drafter=... "
                       "or set spec=None for vanilla decoding")
    if drafter is not None and drafter.config.hidden_size != model.config.hidden_size:
      raise ValueError(f"drafter hidden_size {drafter.config.hidden_size} does not match the "
                       f"target's {model.config.hidden_size}")
    self.config = config
    self.spec = config.spec
    self.model_config = model.config
    self.graphdef, self.params = nnx.split(model)
    self.drafter_graphdef, self.drafter_params = (nnx.split(drafter) if drafter is not None
                                                  else (None, None))
    self._executables: dict[tuple, Any] = {}
    self._compile_seconds = 0.0
    self._phase_marks: list[tuple[int, float]] = []

  # ---- weights -------------------------------------------------------------------------------
  def update_params(self, params: nnx.State, drafter_params: nnx.State | None = None) -> None:
    """Swaps in new target (and optionally drafter) weights of the same shapes; no recompiles."""
    self.params = params
    if drafter_params is not None:
      self.drafter_params = drafter_params

  def _weights(self):
    return (self.params, self.drafter_params)

  # ---- jitted pieces ---------------------------------------------------------------------------
  def _merge(self, weights):
    params, dparams = weights
    target = nnx.merge(self.graphdef, params)
    drafter = nnx.merge(self.drafter_graphdef, dparams) if dparams is not None else None
    return target, drafter

  def _counters(self):
    counters = {"steps": jnp.zeros((), jnp.int32), "row_steps": jnp.zeros((), jnp.int32)}
    if self.spec is not None:
      counters["accept_hist"] = jnp.zeros((self.spec.max_emit,), jnp.int32)
    return counters

  def _prefill_fn(self, weights, ids, prompt_lens, row_id, group_id, args: SamplerArgs, *,
                  kv_len: int) -> DecodeState:
    target, drafter = self._merge(weights)
    batch = ids.shape[0]
    cache = KVCache.create(self.model_config, batch, kv_len)
    out = target.forward(ids, cache=cache, return_hidden=drafter is not None)
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
      dcache = drafter.init_cache(batch, kv_len)
      dout = drafter.forward(target, shifted, out.hidden, cache=dcache)
      width = self.spec.max_emit
      pend_tokens = jnp.zeros((batch, width), jnp.int32).at[:, 0].set(tok)
      pend_feats = jnp.zeros((batch, width, out.hidden.shape[-1]), out.hidden.dtype)
      pend_feats = pend_feats.at[:, 0].set(sd.pick_positions(out.hidden, prompt_lens - 1))
      extra = dict(dcache=dout.cache.with_lengths(prompt_lens - 1), pend_tokens=pend_tokens,
                   pend_feats=pend_feats, pend_count=jnp.ones((batch,), jnp.int32))
    if self.ngram is not None:
      pad = self.config.max_prompt_len - ids.shape[1]
      extra = dict(prompt_tokens=jnp.pad(ids, ((0, 0), (0, pad))), prompt_lens=prompt_lens,
                   group_id=jnp.where(padding, -1, group_id))
    return DecodeState(cache=out.cache.with_lengths(prompt_lens), last_token=tok, tokens=tokens,
                       logprobs=logprobs, num_generated=jnp.where(padding, 0, 1).astype(jnp.int32),
                       done=done, row_id=row_id, counters=self._counters(), **extra)

  def _decode_step(self, target, state: DecodeState, args: SamplerArgs) -> DecodeState:
    live = ~state.done
    out = target.forward(state.last_token[:, None], cache=state.cache)
    keys = row_keys(args.seed, state.row_id, state.num_generated)
    tok, logp = sample_tokens(out.logits[:, 0], keys, args)
    return self._emit(state, live, tok[:, None], logp[:, None], jnp.ones_like(tok),
                      out.cache.advance(live.astype(jnp.int32)), tok, args)

  def _emit(self, state, live, new_tokens, new_logprobs, count, cache, last_token, args, **extra):
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
    counters = dict(state.counters, steps=state.counters["steps"] + 1,
                    row_steps=state.counters["row_steps"] + jnp.sum(live))
    if "accept_hist" in counters:
      counters["accept_hist"] = counters["accept_hist"] + jnp.sum(
          jax.nn.one_hot(count - 1, width, dtype=jnp.int32) * live[:, None], axis=0)
    return dataclasses.replace(
        state, cache=cache, last_token=jnp.where(live, last_token, state.last_token),
        tokens=tokens, logprobs=logprobs, num_generated=num_generated,
        done=state.done | (live & finished), counters=counters, **extra)

  def _mark_phase(self, phase: int, after: jax.Array) -> None:
    """With ``time_phases``, records on the host when ``after`` is computed (phase 0/1/2)."""
    if self.config.time_phases:
      jax.debug.callback(lambda p, _: self._phase_marks.append((int(p), time.perf_counter())),
                         phase, after, ordered=True)

  def _spec_step(self, target, drafter, state: DecodeState, args: SamplerArgs) -> DecodeState:
    """Catch the drafter up on the pending pairs, draft, verify in one target pass, accept."""
    spec = self.spec
    live = ~state.done
    rows, gen_pos = state.row_id, state.num_generated
    self._mark_phase(0, state.last_token)
    if self.ngram is not None:
      proposal, proposal_len = ngram_propose(
          state.prompt_tokens, state.prompt_lens, state.tokens, state.num_generated,
          state.group_id, max_ngram=self.ngram.max_ngram, min_ngram=self.ngram.min_ngram,
          depth=self.ngram.depth)
      # point-mass drafts: verified by the sequential point-mass rule (draft_probs=None)
      draft = sd.chain_tree(proposal, state.last_token, None, proposal_len)
      self._mark_phase(1, draft.tokens)
      return self._verify_and_emit(target, state, draft, None, args)
    dout = drafter.forward(target, state.pend_tokens, state.pend_feats, cache=state.dcache)
    dcache = dout.cache.advance(jnp.where(live, state.pend_count, 0))
    feature = sd.pick_positions(dout.hidden, state.pend_count - 1)
    logits = sd.pick_positions(dout.logits, state.pend_count - 1)
    if spec.is_chain:
      draft = sd.draft_chain(target, drafter, dcache, feature, logits, state.last_token, args,
                             rows, gen_pos, spec.depth)
      mask = None
    else:
      draft = sd.draft_tree(target, drafter, dcache, feature, logits, state.last_token, spec)
      mask = sd.tree_attention(draft, spec.depth)
    self._mark_phase(1, draft.tokens)
    return self._verify_and_emit(target, state, draft, mask, args, dcache=dcache)

  def _verify_and_emit(self, target, state, draft, mask, args, dcache=None):
    """One target pass over the draft, the lossless walk, cache commit and token emission."""
    spec = self.spec
    live = ~state.done
    rows, gen_pos = state.row_id, state.num_generated
    positions = state.cache.lengths[:, None] + draft.depth
    out = target.forward(draft.tokens, positions, cache=state.cache, attn_mask=mask,
                         return_hidden=True)
    verdict = sd.verify(draft, out.logits, args, rows, gen_pos, spec)
    self._mark_phase(2, verdict.bonus)
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
    if dcache is None:
      return self._emit(state, live, emitted, emitted_logp, count, cache, verdict.bonus, args)
    pend_feats = jnp.take_along_axis(out.hidden, verdict.path[:, :, None], 1)
    return self._emit(state, live, emitted, emitted_logp, count, cache, verdict.bonus, args,
                      dcache=dcache, pend_tokens=jnp.where(live[:, None], emitted, state.pend_tokens),
                      pend_feats=jnp.where(live[:, None, None], pend_feats, state.pend_feats),
                      pend_count=jnp.where(live, count, state.pend_count))

  def _segment_fn(self, weights, state: DecodeState, args: SamplerArgs, *, stop_at: int):
    """Decodes until at most ``stop_at`` rows are live (0: until all rows finish), or, below the
    largest length bucket, until a live row could write past the cache in its next step."""
    target, drafter = self._merge(weights)
    if self.spec is None:
      body = lambda s: self._decode_step(target, s, args)
    else:
      body = lambda s: self._spec_step(target, drafter, s, args)
    kv_len, need = state.cache.max_len, self.config.step_slots

    def go_on(s):
      live = ~s.done
      go = jnp.sum(live) > stop_at
      if kv_len < self.config.cache_len:
        go &= ~jnp.any(live & (s.cache.lengths + need > kv_len))
      return go

    return lax.while_loop(go_on, body, state)

  def _grow_fn(self, state: DecodeState, *, kv_len: int) -> DecodeState:
    """The same rows with their caches (and token buffers) re-laid into ``kv_len`` slots."""
    def pad(x, n):
      return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    def grow(cache):
      if cache is None:
        return None
      return KVCache(tuple(pad(k, kv_len) for k in cache.k), tuple(pad(v, kv_len) for v in cache.v),
                     cache.lengths)

    n = self.config.tokens_len(kv_len)
    return dataclasses.replace(state, cache=grow(state.cache), dcache=grow(state.dcache),
                               tokens=pad(state.tokens, n), logprobs=pad(state.logprobs, n))

  @staticmethod
  def _compact_fn(state: DecodeState, index: jax.Array) -> DecodeState:
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

  # ---- executable pool -------------------------------------------------------------------------
  def _args_spec(self):
    return jax.eval_shape(lambda: SamplerArgs.from_params(
        SamplingParams(), (), self.config.max_stop_ids))

  def _state_spec(self, batch: int, kv_len: int):
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(self._prefill_fn, kv_len=kv_len)
    return jax.eval_shape(fn, self._weights(), ids, vec, vec, vec, self._args_spec())

  def _executable(self, key: tuple):
    """The compiled executable for ``key`` (compiled on first use, then reused)."""
    if key in self._executables:
      return self._executables[key]
    t0 = time.perf_counter()
    kind, batch = key[0], key[1]
    args = self._args_spec()
    if kind == "prefill":  # ("prefill", batch, prompt bucket)
      ids = jax.ShapeDtypeStruct((batch, key[2]), jnp.int32)
      vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
      fn = functools.partial(self._prefill_fn, kv_len=self.config.prefill_kv_len(key[2]))
      lowered = jax.jit(fn).lower(self._weights(), ids, vec, vec, vec, args)
    elif kind == "segment":  # ("segment", batch, kv length, stop_at)
      fn = jax.jit(lambda p, s, a: self._segment_fn(p, s, a, stop_at=key[3]), donate_argnums=1)
      lowered = fn.lower(self._weights(), self._state_spec(batch, key[2]), args)
    elif kind == "compact":  # ("compact", batch, smaller batch, kv length)
      index = jax.ShapeDtypeStruct((key[2],), jnp.int32)
      lowered = jax.jit(self._compact_fn).lower(self._state_spec(batch, key[3]), index)
    elif kind == "grow":  # ("grow", batch, kv length, next kv length)
      fn = jax.jit(functools.partial(self._grow_fn, kv_len=key[3]))  # new shapes: no donation
      lowered = fn.lower(self._state_spec(batch, key[2]))
    else:
      raise KeyError(key)
    self._executables[key] = lowered.compile()
    self._compile_seconds += time.perf_counter() - t0
    return self._executables[key]

  @staticmethod
  def _cache_bytes(state: DecodeState) -> int:
    """Bytes held by the decode state's KV caches (target and drafter)."""
    caches = [c for c in (state.cache, state.dcache) if c is not None]
    return sum(x.size * x.dtype.itemsize for c in caches for x in c.k + c.v)

  def _stop_at(self, batch: int) -> int:
    return bk.next_smaller(batch, self.config.batch_buckets) if self.config.compaction else 0

  def _kv_lengths_used(self) -> tuple[int, ...]:
    """The length buckets a chunk can be in: from the shortest prefill's onwards."""
    first = self.config.prefill_kv_len(self.config.prefill_buckets[0])
    return tuple(n for n in self.config.kv_lengths if n >= first)

  def executable_keys(self) -> list[tuple]:
    """Every executable the engine may need: prefill per (batch, prompt) bucket; segment per
    (batch, length) bucket; compaction per (batch pair, length); growth per (batch, length)."""
    cfg = self.config
    lengths = self._kv_lengths_used()
    keys = [("prefill", b, p) for b in cfg.batch_buckets for p in cfg.prefill_buckets]
    keys += [("segment", b, n, self._stop_at(b)) for b in cfg.batch_buckets for n in lengths]
    if cfg.compaction:
      keys += [("compact", b, s, n) for b in cfg.batch_buckets for s in cfg.batch_buckets if s < b
               for n in lengths]
    keys += [("grow", b, n, m) for b in cfg.batch_buckets for n, m in zip(lengths, lengths[1:])]
    return keys

  def pool_stats(self) -> dict[str, Any]:
    """The compiled pool: executables per kind, compile seconds, and the device memory each
    needs where the backend reports it (``compiled.memory_analysis()``)."""
    kinds: dict[str, int] = {}
    memory = {}
    for key, compiled in self._executables.items():
      kinds[key[0]] = kinds.get(key[0], 0) + 1
      try:
        m = compiled.memory_analysis()
        memory[key] = int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                          - m.alias_size_in_bytes)
      except Exception:  # pylint: disable=broad-except  # not every backend reports it
        pass
    return dict(executables=len(self._executables), by_kind=kinds,
                compile_s=self._compile_seconds, kv_lengths=list(self._kv_lengths_used()),
                memory_bytes_max=max(memory.values(), default=None), memory_bytes=memory)

  def precompile(self, progress: Callable[[int, int], Any] | None = None) -> int:
    """Compiles every bucket's executables now; returns how many were compiled.

    ``progress(done, total)``, if given, is called after each executable compiles, ``total``
    being how many this call compiles (executables compiled earlier are not counted).
    """
    missing = [key for key in self.executable_keys() if key not in self._executables]
    for done, key in enumerate(missing, 1):
      self._executable(key)
      if progress is not None:
        progress(done, len(missing))
    return len(missing)

  # ---- generate ----------------------------------------------------------------------------
  def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The prompts as lists of Python ints; a clear error for anything but a list of token-id
    lists within the vocabulary and ``max_prompt_len``."""
    expected = "pass a list of prompts, each a list of token ids"
    if isinstance(prompts, (str, bytes)):
      raise TypeError(f"prompts is {_a(prompts)}: {expected} (encode text with the "
                      f"tokenizer first)")
    try:
      prompts = list(prompts)
    except TypeError:
      raise TypeError(f"prompts is {_a(prompts)}: {expected}") from None
    if len(prompts) == 0:
      raise ValueError("generate() needs at least one prompt")
    checked = []
    vocab = self.model_config.vocab_size
    for i, p in enumerate(prompts):
      if isinstance(p, (str, bytes)):
        raise TypeError(f"prompts[{i}] is {_a(p)}: {expected} (encode text with the "
                        f"tokenizer first)")
      if _is_integer(p):
        raise TypeError(f"prompts[{i}] is an int: {expected} (for one prompt, pass [prompt])")
      try:
        p = list(p)
      except TypeError:
        raise TypeError(f"prompts[{i}] is {_a(p)}: {expected}") from None
      for j, t in enumerate(p):
        if not _is_integer(t):
          raise TypeError(f"prompts[{i}][{j}] is {t!r} ({type(t).__name__}): token ids must be "
                          f"ints ({expected})")
      p = [int(t) for t in p]
      if not p:
        raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
      if len(p) > self.config.max_prompt_len:
        raise ValueError(
            f"prompt {i} has {len(p)} tokens but EngineConfig.max_prompt_len is "
            f"{self.config.max_prompt_len}; truncate the prompt or raise max_prompt_len")
      bad = [t for t in p if not 0 <= t < vocab]
      if bad:
        raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
      checked.append(p)
    return checked

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
               progress: Callable[[int, int], Any] | None = None) -> RolloutResult:
    """Completes every prompt; rows finish on a stop id or at ``params.max_new_tokens``.

    ``progress(rows_done, rows_total)``, if given, is called after every decode segment (where
    the host reads the finished rows anyway); the last call has ``rows_done == rows_total``.
    """
    prompts = self._check_prompts(prompts)
    if params.max_new_tokens > self.config.max_new_tokens:
      raise ValueError(
          f"SamplingParams.max_new_tokens={params.max_new_tokens} exceeds "
          f"EngineConfig.max_new_tokens={self.config.max_new_tokens}")
    stop_ids = (self.model_config.eos_token_ids if params.stop_token_ids is None
                else params.stop_token_ids)
    args = SamplerArgs.from_params(params, stop_ids, self.config.max_stop_ids)
    stats = dict(prefill_s=0.0, decode_s=0.0, compact_s=0.0, grow_s=0.0, compile_s=0.0,
                 decode_steps=0, row_steps=0, live_row_steps=0, segments=[], segment_kv_lens=[],
                 grows=0, cache_bytes_peak=0, tokens=0)
    compiles0, compile_s0 = compile_count(), self._compile_seconds
    self._phase_marks.clear()
    t_start = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[np.ndarray] = [np.zeros(0, np.float32) for _ in prompts]
    reasons = ["length"] * len(prompts)
    for start in range(0, len(prompts), self.config.max_batch):
      chunk = range(start, min(start + self.config.max_batch, len(prompts)))
      self._run_chunk(prompts, chunk, args, stop_ids, tokens, logprobs, reasons, stats,
                      progress)
    stats["compile_s"] = self._compile_seconds - compile_s0
    stats["compiles"] = compile_count() - compiles0
    stats["wall_s"] = time.perf_counter() - t_start
    stats["tokens"] = sum(len(t) for t in tokens)
    stats["tokens_per_s"] = stats["tokens"] / max(stats["wall_s"] - stats["compile_s"], 1e-9)
    if self.spec is not None:
      # tokens emitted per live row per speculative step (accepted drafts + the bonus token)
      hist = np.asarray(stats.get("accept_hist", np.zeros(self.spec.max_emit)))
      stats["accept_hist"] = hist.tolist()  # index i: steps that emitted i + 1 tokens
      stats["mean_accept_len"] = float((hist * np.arange(1, hist.size + 1)).sum() /
                                       max(hist.sum(), 1))
      if self.config.time_phases:
        marks = self._phase_marks
        spans = {1: 0.0, 2: 0.0}  # phase 1 ends drafting, phase 2 ends verification
        for (p0, t0), (p1, t1) in zip(marks, marks[1:]):
          if p1 == p0 + 1:
            spans[p1] += t1 - t0
        stats["draft_s"], stats["verify_s"] = spans[1], spans[2]
    return RolloutResult(tokens, logprobs, reasons, stats)

  def _run_timed(self, stats: dict, stat: str, key: tuple, *args) -> DecodeState:
    """Runs executable ``key`` on ``args`` to completion, adding its seconds to ``stats[stat]``
    (compiling first, untimed, if it is not in the pool yet)."""
    executable = self._executable(key)
    t0 = time.perf_counter()
    state = jax.block_until_ready(executable(*args))
    stats[stat] += time.perf_counter() - t0
    return state

  def _run_chunk(self, prompts, chunk, args, stop_ids, tokens, logprobs, reasons, stats,
                 progress=None):
    cfg = self.config
    batch = bk.bucket_for(len(chunk), cfg.batch_buckets)
    plen = bk.bucket_for(max(len(prompts[i]) for i in chunk), cfg.prefill_buckets)
    ids = np.full((batch, plen), cfg.pad_token_id, np.int32)
    lens = np.ones((batch,), np.int32)
    row_id = np.full((batch,), -1, np.int32)
    group_id = np.full((batch,), -1, np.int32)
    groups: dict[tuple, int] = {}
    for slot, i in enumerate(chunk):
      ids[slot, :len(prompts[i])] = prompts[i]
      lens[slot], row_id[slot] = len(prompts[i]), i
      group_id[slot] = groups.setdefault(tuple(prompts[i]), len(groups))  # same prompt, same group
    kv_len = cfg.prefill_kv_len(plen)
    state = self._run_timed(stats, "prefill_s", ("prefill", batch, plen), self._weights(), ids,
                            lens, row_id, group_id, args)
    stop_set = set(stop_ids)
    steps_before = 0
    while True:
      segment = self._executable(("segment", batch, kv_len, self._stop_at(batch)))
      t0 = time.perf_counter()
      state = segment(self._weights(), state, args)
      done, n_gen, rows, counters, cache_lens = jax.device_get(
          (state.done, state.num_generated, state.row_id, state.counters, state.cache.lengths))
      seconds = time.perf_counter() - t0
      stats["decode_s"] += seconds
      run, steps_before = int(counters["steps"]) - steps_before, int(counters["steps"])
      stats["segments"].append((batch, run, seconds))
      stats["segment_kv_lens"].append(kv_len)
      stats["cache_bytes_peak"] = max(stats["cache_bytes_peak"], self._cache_bytes(state))
      stats["decode_steps"] += run
      stats["row_steps"] += run * batch
      finished = [s for s in range(batch) if done[s] and rows[s] >= 0]
      if finished:
        toks, lps = jax.device_get((state.tokens, state.logprobs))
        for s in finished:
          n = int(n_gen[s])
          tokens[rows[s]] = toks[s, :n].tolist()
          logprobs[rows[s]] = lps[s, :n]
          reasons[rows[s]] = "stop" if n and tokens[rows[s]][-1] in stop_set else "length"
      live = np.flatnonzero(~done)
      if progress is not None:  # rows of earlier chunks are all done
        progress(chunk.start + len(chunk) - live.size, len(prompts))
      if live.size == 0:
        stats["live_row_steps"] += int(counters["row_steps"])
        if "accept_hist" in counters:
          stats["accept_hist"] = stats.get("accept_hist", 0) + counters["accept_hist"]
        return
      smaller = bk.bucket_for(live.size, cfg.batch_buckets)
      if cfg.compaction and smaller < batch:
        index = np.full((smaller,), -1, np.int32)
        index[:live.size] = live
        state = self._run_timed(stats, "compact_s", ("compact", batch, smaller, kv_len), state,
                                index)
        batch = smaller
      while int(cache_lens[live].max()) + cfg.step_slots > kv_len:  # a live row needs more room
        bigger = cfg.kv_lengths[cfg.kv_lengths.index(kv_len) + 1]
        state = self._run_timed(stats, "grow_s", ("grow", batch, kv_len, bigger), state)
        stats["grows"] += 1
        kv_len = bigger
