"""The host side of a rollout: chunks, segments, compaction, cache growth and strategy choice.

A chunk of at most ``max_batch`` prompts is prefilled, then decoded segment by segment. At every
segment boundary (where the host reads the finished rows anyway) the scheduler

1. asks the tuner which strategy decodes the next segment (when the bucket offers more than one);
   every change of strategy is a switch, and switching from vanilla to a learned drafter first
   runs the drafter's catch-up (timed as the switch cost, and charged to the segment's reward);
2. runs the segment and rewards the strategy with the tokens it emitted per second;
3. gathers the live rows into the next smaller batch bucket, and grows the caches when the next
   strategy's step could write past them (a vanilla step needs one slot, a speculative one the
   widest strategy's slack).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.speculative import SpecConfig
from tlt_jax.rollout.stats import RolloutStats
from tlt_jax.rollout.suffix import pack_history
from tlt_jax.rollout.tuner import Arm, Tuner


SETTLED_SEGMENTS = 8  # a settled bucket's segments: this many times EngineConfig.segment_steps
BOUNDARY_SHARE = 0.1  # a bounded segment runs long enough that its boundary costs at most this
# share of it, by the calibration's measure (``segment_lengths``)


def segment_lengths(step_costs: dict, boundary_s: float, segment_steps: int,
                    share: float = BOUNDARY_SHARE) -> dict[int, int]:
  """The most steps of a bounded segment per batch bucket (a bucket the tuner has not settled):
  at least ``segment_steps``, and enough that one segment boundary (``boundary_s``: dispatch and
  the host's read of the finished rows) costs at most ``share`` of the segment's vanilla steps
  (``step_costs[(bucket, "vanilla")]``, seconds), capped at a settled segment's length. Where a
  boundary costs ten decode steps (an accelerator, whose small decode steps are launch-bound), the
  segments grow from 32 steps to ~100; where it costs one or two, they stay as configured."""
  if segment_steps <= 0:  # unbounded already
    return {}
  cap = SETTLED_SEGMENTS * segment_steps
  out = {}
  for (bucket, name), seconds in step_costs.items():
    if name == "vanilla" and seconds > 0:
      wanted = int(np.ceil(boundary_s / (share * seconds)))
      out[bucket] = int(min(max(segment_steps, wanted), cap))
  return out


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A decoding strategy as the scheduler sees it: its name, its executable group and its index
  in that group, and the spec (None: vanilla)."""

  name: str
  group: str
  choice: int
  spec: SpecConfig | None
  kind: str = "learned"  # who drafts (``StrategyGroup.kind``); vanilla: irrelevant

  @property
  def arm(self) -> Arm:
    if self.spec is None:
      return Arm(self.name, 1)
    return Arm(self.name, self.spec.verify_tokens, self.spec.depth, self.spec.topk, self.kind)

  @property
  def learned(self) -> bool:
    """Whether the learned drafter drafts this strategy (it must be caught up first)."""
    return self.spec is not None and self.kind == "learned"


@dataclasses.dataclass(frozen=True)
class Request:
  """One ``generate`` call as every chunk of it sees it: the checked ``prompts``, the sampler's
  ``args`` and ``stop_ids``, ``row_offset`` (row ``i`` samples with the keys of row
  ``i + row_offset``), ``collect`` (per row: keep its hidden states; None: none) and
  ``progress(rows_done, rows_total)``."""

  prompts: list[list[int]]
  args: Any
  stop_ids: Sequence[int]
  row_offset: int = 0
  collect: np.ndarray | None = None
  progress: Callable[[int, int], Any] | None = None
  history: Sequence[Sequence[Sequence[int]]] | None = None  # per prompt, its earlier completions


@dataclasses.dataclass
class ChunkResult:
  """The rows of one chunk, in the chunk's order: generated ``tokens``, their ``logprobs``, the
  finish ``reasons`` and, where collected, the ``hidden`` states (None for other rows)."""

  tokens: list[list[int]]
  logprobs: list[np.ndarray]
  reasons: list[str]
  hidden: list[np.ndarray | None]

  @classmethod
  def empty(cls, n: int) -> ChunkResult:
    return cls([[] for _ in range(n)], [np.zeros(0, np.float32) for _ in range(n)],
               ["length"] * n, [None] * n)


class Scheduler:
  """Drives the pool's executables for one request, one chunk at a time."""

  def __init__(self, pool: ExecutablePool, strategies_for: Callable[[int], Sequence[Strategy]],
               tuner: Tuner | None, weights: Callable[[], Any], learned_drafter: bool):
    self.pool = pool
    self.config = pool.config
    self.strategies_for = strategies_for
    self.tuner = tuner
    self.weights = weights
    self.learned = learned_drafter
    self.segment_lengths: dict[int, int] = {}  # per bucket, a bounded segment's most steps
    # (``segment_lengths``, from the engine's calibration; else EngineConfig.segment_steps)

  def _run_timed(self, stats: RolloutStats, stat: str, key: tuple, *args):
    """Runs executable ``key`` on ``args`` to completion, adding its seconds to the field ``stat``
    of ``stats`` (compiling first, untimed, if it is not in the pool yet)."""
    executable = self.pool.get(key)
    t0 = time.perf_counter()
    out = jax.block_until_ready(executable(*args))
    seconds = time.perf_counter() - t0
    setattr(stats, stat, getattr(stats, stat) + seconds)
    return out, seconds

  def _choose(self, batch: int) -> tuple[Strategy, bool, int]:
    """The strategy for the next segment at ``batch``, whether the tuner chose it, and the most
    steps the segment may run (0: no limit). A bucket with one strategy, or one the tuner has
    settled (``Decision.max_steps == 0``), runs ``SETTLED_SEGMENTS`` times ``segment_steps``:
    few boundaries, and still one every so often, where an interrupt is noticed. Other segments
    run ``segment_lengths[batch]`` steps (measured: see ``segment_lengths``) or ``segment_steps``."""
    options = list(self.strategies_for(batch))
    settled = SETTLED_SEGMENTS * self.config.segment_steps
    bounded = self.segment_lengths.get(batch, self.config.segment_steps)
    if len(options) == 1 or self.tuner is None:
      return options[0], False, settled if len(options) == 1 else bounded
    decision = self.tuner.plan(batch, [s.arm for s in options])
    steps = {None: bounded, 0: settled}.get(decision.max_steps, decision.max_steps)
    return next(s for s in options if s.name == decision.arm), True, steps

  def run_chunk(self, request: Request, chunk: range, stats: RolloutStats) -> ChunkResult:
    """Prefills and decodes ``request.prompts[chunk]``; returns the chunk's rows, adding the
    chunk's seconds and counters to ``stats``.

    Row ``i``'s sampling keys derive from ``i + row_offset`` (a data-parallel shard passes its
    first row's index in the whole request, so tokens do not depend on the split). Where
    ``collect[i]``, the row's ``hidden`` entry holds the target's last-layer hidden states
    ``[L - 1, H]`` of the row's sequence (prompt + completion, ``L`` tokens) at positions
    ``0 .. L - 2``: the prompt's from the prefill, the completion's from the decode state's
    feature history, so no second forward pass."""
    cfg = self.config
    prompts, args, row_offset = request.prompts, request.args, request.row_offset
    collect, progress = request.collect, request.progress
    out = ChunkResult.empty(len(chunk))
    batch = bk.bucket_for(len(chunk), cfg.batch_buckets)
    plen = bk.bucket_for(max(len(prompts[i]) for i in chunk), cfg.prefill_buckets)
    ids = np.full((batch, plen), cfg.pad_token_id, np.int32)
    lens = np.ones((batch,), np.int32)
    row_id = np.full((batch,), -1, np.int32)
    group_id = np.full((batch,), -1, np.int32)
    history = self.pool.no_history(batch)
    groups: dict[tuple, int] = {}
    for slot, i in enumerate(chunk):
      ids[slot, :len(prompts[i])] = prompts[i]
      lens[slot], row_id[slot] = len(prompts[i]), i + row_offset
      group_id[slot] = groups.setdefault(tuple(prompts[i]), len(groups))  # same prompt, same group
      if history.shape[1] and request.history is not None and request.history[i]:
        history[slot] = pack_history(request.history[i], history.shape[1])
    kv_len = cfg.prefill_kv_len(plen)
    (state, prompt_hidden), _ = self._run_timed(stats, "prefill_s", ("prefill", batch, plen),
                                                self.weights(), ids, lens, row_id, group_id,
                                                history, args)
    wanted = [] if collect is None else [slot for slot, i in enumerate(chunk) if collect[i]]
    prompt_feats = {}
    if wanted:
      ph = np.asarray(jax.device_get(prompt_hidden))[np.asarray(wanted)]  # host-side indexing:
      # an eager gather on the device would compile for every new (shape, count) pair
      for k, slot in enumerate(wanted):
        prompt_feats[chunk[slot] + row_offset] = ph[k, :lens[slot] - 1]
    del prompt_hidden
    stop_set = set(request.stop_ids)
    before = dict(steps=0, tokens=0, row_steps=0)
    lagging = False  # the drafter may be more than one step's pairs behind (after vanilla)
    live_len = int(lens[:len(chunk)].max())  # the longest live row's committed length
    previous = None  # the arm of the chunk's last segment
    emitted = np.zeros(len(chunk), np.int64)  # tokens each row of the chunk has emitted
    per_segment = []  # (arm tally, tokens each row emitted in the segment), for critical_tokens
    while True:
      strategy, tuned, max_steps = self._choose(batch)
      if previous is not None and strategy.name != previous:
        stats.switches += 1
      previous = strategy.name
      need = 1 if strategy.spec is None else cfg.step_slots
      while live_len + need > kv_len:  # a live row needs more room for this strategy's steps
        bigger = cfg.kv_lengths[cfg.kv_lengths.index(kv_len) + 1]
        state, _ = self._run_timed(stats, "grow_s", ("grow", batch, kv_len, bigger), state)
        stats.grows += 1
        kv_len = bigger
      switch_s = 0.0
      if strategy.learned and lagging:
        state, switch_s = self._run_timed(stats, "switch_s", ("catchup", batch, kv_len),
                                          self.weights(), state)
        stats.catchups += 1
        lagging = False
      segment = self.pool.get(("segment", batch, kv_len, self.pool.stop_at(batch),
                               strategy.group))
      t0 = time.perf_counter()
      state = segment(self.weights(), state, args, np.int32(strategy.choice), np.int32(max_steps))
      done, n_gen, rows, counters, cache_lens = jax.device_get(
          (state.done, state.num_generated, state.row_id, state.counters, state.cache.lengths))
      seconds = time.perf_counter() - t0
      # only the learned drafter's steps consume the feature pairs; the others leave them pending
      lagging |= not strategy.learned and self.learned
      delta = {k: int(counters[k]) - before[k] for k in before}
      before = {k: int(counters[k]) for k in before}
      if tuned and delta["steps"] > 0:
        self.tuner.update(batch, strategy.name, delta["tokens"], seconds + switch_s,
                          steps=delta["steps"], row_steps=delta["row_steps"], switch_s=switch_s)
      arm = stats.arm(batch, strategy.name)
      arm.segments += 1
      arm.seconds += seconds + switch_s
      arm.steps += delta["steps"]
      arm.tokens += delta["tokens"]
      arm.row_steps += delta["row_steps"]
      now = emitted.copy()
      placed = rows >= 0
      now[rows[placed] - row_offset - chunk.start] = n_gen[placed]
      per_segment.append((arm, now - emitted))
      emitted = now
      stats.decode_s += seconds
      stats.segments.append((batch, delta["steps"], seconds, strategy.name))
      stats.segment_kv_lens.append(kv_len)
      stats.cache_bytes_peak = max(stats.cache_bytes_peak, self.pool.steps.cache_bytes(state))
      stats.decode_steps += delta["steps"]
      stats.row_steps += delta["steps"] * batch
      finished = [s for s in range(batch) if done[s] and rows[s] >= 0]
      if finished:
        toks, lps = jax.device_get((state.tokens, state.logprobs))
        keep = [s for s in finished if rows[s] in prompt_feats]
        feats = np.asarray(jax.device_get(state.feats))[np.asarray(keep)] if keep else None
        for s in finished:
          n, j = int(n_gen[s]), rows[s] - row_offset - chunk.start  # j: the row in the chunk
          out.tokens[j] = toks[s, :n].tolist()
          out.logprobs[j] = lps[s, :n]
          out.reasons[j] = "stop" if n and out.tokens[j][-1] in stop_set else "length"
          if rows[s] in prompt_feats:
            out.hidden[j] = np.concatenate([prompt_feats.pop(rows[s]), feats[keep.index(s), :n]])
      live = np.flatnonzero(~done)
      if progress is not None:  # rows of earlier chunks are all done
        progress(chunk.start + len(chunk) - live.size, len(prompts))
      if live.size == 0:
        longest = int(np.argmax(emitted))  # the row that sets vanilla's decode time
        for tally, made in per_segment:
          tally.critical_tokens += int(made[longest])
        stats.live_row_steps += int(counters["row_steps"])
        if "accept_hist" in counters:
          stats.accept_hist = (0 if stats.accept_hist is None else stats.accept_hist) + \
              counters["accept_hist"]
          stats.add_sources(counters["source_steps"], counters["source_tokens"])
        return out
      smaller = bk.bucket_for(live.size, cfg.batch_buckets)
      if cfg.compaction and smaller < batch:
        index = np.full((smaller,), -1, np.int32)
        index[:live.size] = live
        state, _ = self._run_timed(stats, "compact_s", ("compact", batch, smaller, kv_len), state,
                                   index)
        batch = smaller
      live_len = int(cache_lens[live].max())
