"""The rollout engine: bucketed, jitted decode with live-row compaction.

A request is split into chunks of at most ``max_batch`` prompts. Each chunk is prefilled at
(batch bucket, prompt-length bucket), then decoded by a jitted ``lax.while_loop`` *segment*
that runs until every row is finished or the live rows fit the next smaller batch bucket. The
host then gathers the live rows (and their KV cache) into that bucket and continues. Every
executable is keyed by its bucket and compiled once (``precompile`` compiles them all).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from tlt_jax.models.transformer import KVCache, Transformer
from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout.sampling import SamplerArgs, SamplingParams, row_keys, sample_tokens
from tlt_jax.utils import compile_count


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

  def __post_init__(self):
    for name in ("max_batch", "max_prompt_len", "max_new_tokens", "max_stop_ids"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
    for name, limit, default in (("batch_buckets", self.max_batch, bk.powers_of_two_up_to(self.max_batch)),
                                 ("prefill_buckets", self.max_prompt_len,
                                  bk.powers_of_two_up_to(self.max_prompt_len, start=min(16, self.max_prompt_len)))):
      value = getattr(self, name)
      value = default if value is None else tuple(int(v) for v in value)
      if not value or list(value) != sorted(set(value)) or value[0] <= 0 or value[-1] != limit:
        raise ValueError(
            f"EngineConfig.{name} must be strictly increasing positive sizes ending at {limit}, "
            f"got {value!r}")
      object.__setattr__(self, name, value)

  @property
  def cache_len(self) -> int:
    """KV-cache slots per row: the longest prompt plus the longest completion."""
    return self.max_prompt_len + self.max_new_tokens


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
  steps: jax.Array  # scalar: decode iterations run so far


@dataclasses.dataclass
class RolloutResult:
  """Completions (ids, per-token log-probs, finish reasons) and engine statistics."""

  tokens: list[list[int]]
  logprobs: list[np.ndarray]
  finish_reasons: list[str]  # "stop" (a stop id was sampled; it is included) or "length"
  stats: dict[str, Any]


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)


class RolloutEngine:
  """Generates completions for a list of prompts with bucketed, jitted decode segments."""

  def __init__(self, model: Transformer, drafter=None, config: EngineConfig = EngineConfig()):
    if drafter is not None:
      raise NotImplementedError("speculative decoding is not available yet; pass drafter=None")
    self.config = config
    self.model_config = model.config
    self.graphdef, self.params = nnx.split(model)
    self._executables: dict[tuple, Any] = {}
    self._compile_seconds = 0.0

  # ---- weights -------------------------------------------------------------------------------
  def update_params(self, params: nnx.State) -> None:
    """Swaps in new model weights (same structure and shapes; nothing recompiles)."""
    self.params = params

  # ---- jitted pieces ---------------------------------------------------------------------------
  def _merge(self, params):
    return nnx.merge(self.graphdef, params)

  def _prefill_fn(self, params, ids, prompt_lens, row_id, args: SamplerArgs) -> DecodeState:
    model = self._merge(params)
    batch = ids.shape[0]
    cache = KVCache.create(self.model_config, batch, self.config.cache_len)
    out = model.forward(ids, cache=cache)
    last_logits = jnp.take_along_axis(out.logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    keys = row_keys(args.seed, row_id, jnp.zeros_like(row_id))
    tok, logp = sample_tokens(last_logits, keys, args)
    padding = row_id < 0
    n = self.config.max_new_tokens
    tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(tok)
    logprobs = jnp.zeros((batch, n), jnp.float32).at[:, 0].set(logp)
    done = padding | _is_stop(tok, args.stop_ids) | (args.max_new_tokens <= 1)
    return DecodeState(cache=out.cache.with_lengths(prompt_lens), last_token=tok, tokens=tokens,
                       logprobs=logprobs, num_generated=jnp.where(padding, 0, 1).astype(jnp.int32),
                       done=done, row_id=row_id, steps=jnp.zeros((), jnp.int32))

  def _decode_step(self, model, state: DecodeState, args: SamplerArgs) -> DecodeState:
    live = ~state.done
    out = model.forward(state.last_token[:, None], cache=state.cache)
    keys = row_keys(args.seed, state.row_id, state.num_generated)
    tok, logp = sample_tokens(out.logits[:, 0], keys, args)
    rows = jnp.arange(tok.shape[0])
    slot = jnp.minimum(state.num_generated, self.config.max_new_tokens - 1)
    tokens = state.tokens.at[rows, slot].set(jnp.where(live, tok, state.tokens[rows, slot]))
    logprobs = state.logprobs.at[rows, slot].set(jnp.where(live, logp, state.logprobs[rows, slot]))
    num_generated = state.num_generated + live
    finished = _is_stop(tok, args.stop_ids) | (num_generated >= args.max_new_tokens)
    return DecodeState(cache=out.cache.advance(live.astype(jnp.int32)),
                       last_token=jnp.where(live, tok, state.last_token), tokens=tokens,
                       logprobs=logprobs, num_generated=num_generated,
                       done=state.done | (live & finished), row_id=state.row_id,
                       steps=state.steps + 1)

  def _segment_fn(self, params, state: DecodeState, args: SamplerArgs, *, stop_at: int):
    """Decodes until at most ``stop_at`` rows are live (0: until all rows finish)."""
    model = self._merge(params)
    cond = lambda s: jnp.sum(~s.done) > stop_at
    return lax.while_loop(cond, lambda s: self._decode_step(model, s, args), state)

  @staticmethod
  def _compact_fn(state: DecodeState, index: jax.Array) -> DecodeState:
    """Gathers rows ``index`` into a smaller batch; ``index == -1`` makes a padding row."""
    pad = index < 0
    take = lambda x: jnp.take(x, jnp.maximum(index, 0), axis=0)
    return DecodeState(cache=state.cache.take_rows(jnp.maximum(index, 0)),
                       last_token=take(state.last_token), tokens=take(state.tokens),
                       logprobs=take(state.logprobs), num_generated=take(state.num_generated),
                       done=take(state.done) | pad, row_id=jnp.where(pad, -1, take(state.row_id)),
                       steps=state.steps)

  # ---- executable pool -------------------------------------------------------------------------
  def _args_spec(self):
    return jax.eval_shape(lambda: SamplerArgs.from_params(
        SamplingParams(), (), self.config.max_stop_ids))

  def _state_spec(self, batch: int):
    ids = jax.ShapeDtypeStruct((batch, self.config.prefill_buckets[0]), jnp.int32)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return jax.eval_shape(self._prefill_fn, self.params, ids, vec, vec, self._args_spec())

  def _executable(self, key: tuple):
    """The compiled executable for ``key`` (compiled on first use, then reused)."""
    if key in self._executables:
      return self._executables[key]
    t0 = time.perf_counter()
    kind, batch = key[0], key[1]
    args = self._args_spec()
    if kind == "prefill":
      ids = jax.ShapeDtypeStruct((batch, key[2]), jnp.int32)
      vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
      lowered = jax.jit(self._prefill_fn).lower(self.params, ids, vec, vec, args)
    elif kind == "segment":
      fn = jax.jit(lambda p, s, a: self._segment_fn(p, s, a, stop_at=key[2]), donate_argnums=1)
      lowered = fn.lower(self.params, self._state_spec(batch), args)
    elif kind == "compact":
      index = jax.ShapeDtypeStruct((key[2],), jnp.int32)
      lowered = jax.jit(self._compact_fn).lower(self._state_spec(batch), index)
    else:
      raise KeyError(key)
    self._executables[key] = lowered.compile()
    self._compile_seconds += time.perf_counter() - t0
    return self._executables[key]

  def _stop_at(self, batch: int) -> int:
    return bk.next_smaller(batch, self.config.batch_buckets) if self.config.compaction else 0

  def executable_keys(self) -> list[tuple]:
    """Every executable the engine may need: prefill and segment per bucket, compaction per pair."""
    cfg = self.config
    keys = [("prefill", b, p) for b in cfg.batch_buckets for p in cfg.prefill_buckets]
    keys += [("segment", b, self._stop_at(b)) for b in cfg.batch_buckets]
    if cfg.compaction:
      keys += [("compact", b, s) for b in cfg.batch_buckets for s in cfg.batch_buckets if s < b]
    return keys

  def precompile(self) -> int:
    """Compiles every bucket's executables now; returns how many were compiled."""
    before = len(self._executables)
    for key in self.executable_keys():
      self._executable(key)
    return len(self._executables) - before

  # ---- generate ----------------------------------------------------------------------------
  def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    if len(prompts) == 0:
      raise ValueError("generate() needs at least one prompt")
    checked = []
    vocab = self.model_config.vocab_size
    for i, p in enumerate(prompts):
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

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()
               ) -> RolloutResult:
    """Completes every prompt; rows finish on a stop id or at ``params.max_new_tokens``."""
    prompts = self._check_prompts(prompts)
    if params.max_new_tokens > self.config.max_new_tokens:
      raise ValueError(
          f"SamplingParams.max_new_tokens={params.max_new_tokens} exceeds "
          f"EngineConfig.max_new_tokens={self.config.max_new_tokens}")
    stop_ids = (self.model_config.eos_token_ids if params.stop_token_ids is None
                else params.stop_token_ids)
    args = SamplerArgs.from_params(params, stop_ids, self.config.max_stop_ids)
    stats = dict(prefill_s=0.0, decode_s=0.0, compact_s=0.0, compile_s=0.0, decode_steps=0,
                 row_steps=0, segments=[], tokens=0)
    compiles0, compile_s0 = compile_count(), self._compile_seconds
    t_start = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[np.ndarray] = [np.zeros(0, np.float32) for _ in prompts]
    reasons = ["length"] * len(prompts)
    for start in range(0, len(prompts), self.config.max_batch):
      chunk = range(start, min(start + self.config.max_batch, len(prompts)))
      self._run_chunk(prompts, chunk, args, stop_ids, tokens, logprobs, reasons, stats)
    stats["compile_s"] = self._compile_seconds - compile_s0
    stats["compiles"] = compile_count() - compiles0
    stats["wall_s"] = time.perf_counter() - t_start
    stats["tokens"] = sum(len(t) for t in tokens)
    stats["tokens_per_s"] = stats["tokens"] / max(stats["wall_s"] - stats["compile_s"], 1e-9)
    return RolloutResult(tokens, logprobs, reasons, stats)

  def _run_chunk(self, prompts, chunk, args, stop_ids, tokens, logprobs, reasons, stats):
    cfg = self.config
    batch = bk.bucket_for(len(chunk), cfg.batch_buckets)
    plen = bk.bucket_for(max(len(prompts[i]) for i in chunk), cfg.prefill_buckets)
    ids = np.full((batch, plen), cfg.pad_token_id, np.int32)
    lens = np.ones((batch,), np.int32)
    row_id = np.full((batch,), -1, np.int32)
    for slot, i in enumerate(chunk):
      ids[slot, :len(prompts[i])] = prompts[i]
      lens[slot], row_id[slot] = len(prompts[i]), i
    prefill = self._executable(("prefill", batch, plen))
    t0 = time.perf_counter()
    state = prefill(self.params, ids, lens, row_id, args)
    jax.block_until_ready(state)
    stats["prefill_s"] += time.perf_counter() - t0
    stop_set = set(stop_ids)
    steps_before = 0
    while True:
      segment = self._executable(("segment", batch, self._stop_at(batch)))
      t0 = time.perf_counter()
      state = segment(self.params, state, args)
      done, n_gen, rows, steps = jax.device_get((state.done, state.num_generated, state.row_id,
                                                 state.steps))
      stats["decode_s"] += time.perf_counter() - t0
      run, steps_before = int(steps) - steps_before, int(steps)
      stats["segments"].append((batch, run))
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
      if live.size == 0:
        return
      smaller = bk.bucket_for(live.size, cfg.batch_buckets)
      index = np.full((smaller,), -1, np.int32)
      index[:live.size] = live
      compact = self._executable(("compact", batch, smaller))
      t0 = time.perf_counter()
      state = compact(state, index)
      jax.block_until_ready(state)
      stats["compact_s"] += time.perf_counter() - t0
      batch = smaller
