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
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from tlt_jax.rollout.host import buckets as bk
from tlt_jax.rollout.decode.kinds import DrafterKind
from tlt_jax.rollout.host.pool import ExecutablePool
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.host.stats import RolloutStats
from tlt_jax.rollout.decode.suffix import pack_history
from tlt_jax.rollout.host.tuner import Arm, Tuner


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


def critical_length(made: np.ndarray, live: np.ndarray, steps: int) -> float | None:
  """Tokens per step of the rows a segment's rollout waits for: the mean over the rows still
  ``live`` at the segment's end (they ran every one of its ``steps``, and they are the longer
  rows, which decide when the rollout ends) of the tokens each ``made`` in it, divided by
  ``steps``; where no row is left, the row that made the most (the last to finish). ``made``:
  per row of the chunk; ``live``: their indices. None for a segment of no steps."""
  if steps <= 0 or made.size == 0:
    return None
  if live.size:
    return float(made[live].mean()) / steps
  return float(made.max()) / steps


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A decoding strategy as the scheduler sees it: its name, its executable group and its index
  in that group, and the spec (None: vanilla)."""

  name: str
  group: str
  choice: int
  spec: SpecConfig | None
  kind: DrafterKind = DrafterKind.LEARNED  # who drafts (``StrategyGroup.kind``); vanilla: any

  @property
  def arm(self) -> Arm:
    if self.spec is None:
      return Arm(self.name)
    return Arm(self.name, self.spec.depth, self.spec.topk, self.kind)

  @property
  def learned(self) -> bool:
    """Whether the learned drafter drafts this strategy (it must be caught up first)."""
    return self.spec is not None and self.kind == DrafterKind.LEARNED


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

  def finish_row(self, j: int, tokens: np.ndarray, logprobs: np.ndarray,
                 stop_ids: set[int]) -> None:
    """Row ``j`` is done with ``tokens`` and their ``logprobs``: it stopped if its last token is
    a stop id, else it ran out of length (an empty row too). Its ``hidden`` entry is the
    caller's."""
    self.tokens[j] = tokens.tolist()
    self.logprobs[j] = logprobs
    self.reasons[j] = "stop" if self.tokens[j] and self.tokens[j][-1] in stop_ids else "length"


def prefill_inputs(request: Request, chunk: range, batch: int, plen: int, pad_id: int,
                   history: np.ndarray) -> tuple[np.ndarray, ...]:
  """The prefill's inputs for the prompts ``request.prompts[chunk]`` in a batch bucket of
  ``batch`` rows and a prompt bucket of ``plen``: the padded ``ids``, the prompts' lengths
  ``lens`` (1 in the empty slots), each slot's ``row_id`` (its row in the whole request, the
  key of its sampling stream; -1: empty), its ``group_id`` (slots with the same prompt share
  one, counted from 0 in the chunk; -1: empty) and ``history`` (``[batch, width]``, all -1),
  filled in place with each prompt's earlier completions where the request has some and the
  width is not 0."""
  prompts = request.prompts
  ids = np.full((batch, plen), pad_id, np.int32)
  lens = np.ones((batch,), np.int32)
  row_id = np.full((batch,), -1, np.int32)
  group_id = np.full((batch,), -1, np.int32)
  groups: dict[tuple, int] = {}
  for slot, i in enumerate(chunk):
    ids[slot, :len(prompts[i])] = prompts[i]
    lens[slot], row_id[slot] = len(prompts[i]), i + request.row_offset
    group_id[slot] = groups.setdefault(tuple(prompts[i]), len(groups))  # same prompt, same group
    if history.shape[1] and request.history is not None and request.history[i]:
      history[slot] = pack_history(request.history[i], history.shape[1])
  return ids, lens, row_id, group_id, history


@dataclasses.dataclass
class ChunkRun:
  """One chunk's decode as the host follows it from segment to segment.

  The device ``state`` sits in the batch bucket ``batch`` and the length bucket ``kv_len``;
  ``live_len`` is the longest live row's committed length. ``lagging``: the learned drafter may
  be more than one step's pairs behind (after segments it did not draft). ``previous``: the
  strategy of the chunk's last segment. ``counted``: the device's cumulative counters as last
  read. ``emitted``: the tokens each row of the chunk has emitted; ``per_segment``: each
  segment's arm tally with the tokens each row emitted in it (for ``critical_tokens``).
  ``prompt_feats``: by row id, the prompt's hidden states of each row that collects them and
  has not finished. ``out``: the rows finished so far."""

  state: Any
  batch: int
  kv_len: int
  live_len: int
  first_row: int  # the row id of the chunk's first row (its index in the whole request)
  out: ChunkResult
  prompt_feats: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
  lagging: bool = False
  previous: str | None = None
  counted: dict[str, int] = dataclasses.field(
      default_factory=lambda: dict(steps=0, tokens=0, row_steps=0))
  emitted: np.ndarray | None = None  # (made from out when not given)
  per_segment: list[tuple[Any, np.ndarray]] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if self.emitted is None:
      self.emitted = np.zeros(len(self.out.tokens), np.int64)

  def advance(self, counters: dict) -> dict[str, int]:
    """What the device's cumulative ``counters`` (steps, tokens, row_steps) grew by since they
    were last read."""
    delta = {k: int(counters[k]) - self.counted[k] for k in self.counted}
    self.counted = {k: int(counters[k]) for k in self.counted}
    return delta

  def record_emitted(self, tally: Any, rows: np.ndarray, n_gen: np.ndarray) -> np.ndarray:
    """After a segment of arm ``tally``: each slot's row id ``rows`` (-1: empty) has emitted
    ``n_gen`` tokens in all. A row compacted away earlier keeps its count. Returns the tokens
    each row of the chunk emitted in the segment."""
    now = self.emitted.copy()
    placed = rows >= 0
    now[rows[placed] - self.first_row] = n_gen[placed]
    made = now - self.emitted
    self.per_segment.append((tally, made))
    self.emitted = now
    return made

  def credit_critical_tokens(self) -> None:
    """Once every row is done: each segment's arm is credited the tokens that the chunk's
    longest row emitted in that segment."""
    longest = int(np.argmax(self.emitted))  # the row that sets vanilla's decode time
    for tally, made in self.per_segment:
      tally.critical_tokens += int(made[longest])


class SegmentEnd(NamedTuple):
  """What the host reads at a segment's end, in one round trip: per slot ``done``, the tokens
  generated ``n_gen``, the row id ``rows`` (-1: empty) and the committed cache length
  ``cache_lens``; the device's cumulative ``counters``; every slot's generated ``tokens`` and
  their ``logprobs`` (the finished rows' are copied out; a segment mostly ends because rows
  finished, so reading them with the rest saves a second round trip); and the segment's
  ``seconds`` (run and read)."""

  done: np.ndarray
  n_gen: np.ndarray
  rows: np.ndarray
  counters: dict
  cache_lens: np.ndarray
  tokens: np.ndarray
  logprobs: np.ndarray
  seconds: float


class Scheduler:
  """Drives the pool's executables for one request, one chunk at a time."""

  def __init__(self, pool: ExecutablePool, strategies_for: Callable[[int], Sequence[Strategy]],
               tuner: Tuner | None, weights: Callable[[], Any], learned_drafter: bool,
               calibration: Any):
    self.pool = pool
    self.config = pool.config
    self.strategies_for = strategies_for
    self.tuner = tuner
    self.weights = weights
    self.learned = learned_drafter
    # the rollout's ``calibration.Calibration`` (shared by its engines): its ``segment_lengths``
    self.calibration = calibration

  @property
  def segment_lengths(self) -> dict[int, int]:
    """Per bucket, a bounded segment's most steps (``segment_lengths``, from the rollout's
    calibration; a bucket not in it runs ``EngineConfig.segment_steps``)."""
    return self.calibration.segment_lengths

  @segment_lengths.setter
  def segment_lengths(self, lengths: dict[int, int]) -> None:
    self.calibration.segment_lengths = lengths

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
    run = self._prefill(request, chunk, stats)
    stop_ids = set(request.stop_ids)
    while True:  # one segment a turn, with what happens at its boundaries
      strategy, tuned, max_steps = self._choose(run.batch)
      self._count_switch(run, strategy, stats)
      self._make_room(run, strategy, stats)
      switch_s = self._catch_up(run, strategy, stats)
      end = self._decode_segment(run, strategy, max_steps, request.args)
      self._account(run, strategy, tuned, end, switch_s, stats)
      self._collect_finished(run, end, stop_ids)
      live = np.flatnonzero(~end.done)
      if request.progress is not None:  # rows of earlier chunks are all done
        request.progress(chunk.start + len(chunk) - live.size, len(request.prompts))
      if live.size == 0:
        self._finish_chunk(run, end.counters, stats)
        return run.out
      self.compact(run, live, end.cache_lens, stats)

  def _start_buckets(self, rows: int, longest: int) -> tuple[int, int]:
    """The (batch, prompt) buckets a chunk of ``rows`` prompts, the longest ``longest`` tokens,
    is prefilled in: the smallest that hold it, or, while a background compile has not finished
    them, the smallest larger pair whose prefill and vanilla decode are compiled (padded: the same
    tokens, at more cost); the smallest pair if none is (it compiles now)."""
    cfg, pool = self.config, self.pool
    batch = bk.bucket_for(rows, cfg.batch_buckets)
    plen = bk.bucket_for(longest, cfg.prefill_buckets)
    pairs = sorted(((b, p) for b in cfg.batch_buckets if b >= batch
                    for p in cfg.prefill_buckets if p >= plen), key=lambda bp: (bp[0] * bp[1], bp))
    for b, p in pairs:
      if not pool.waiting(("prefill", b, p)) and pool.ready(b, cfg.prefill_kv_len(p)):
        return b, p
    return batch, plen

  def _prefill(self, request: Request, chunk: range, stats: RolloutStats) -> ChunkRun:
    """Prefills the chunk in the smallest buckets that hold it (``_start_buckets``); keeps the
    prompts' hidden states of the rows that collect them (until they finish)."""
    cfg = self.config
    batch, plen = self._start_buckets(len(chunk), max(len(request.prompts[i]) for i in chunk))
    ids, lens, row_id, group_id, history = prefill_inputs(
        request, chunk, batch, plen, cfg.pad_token_id, self.pool.no_history(batch))
    (state, prompt_hidden), _ = self._run_timed(stats, "prefill_s", ("prefill", batch, plen),
                                                self.weights(), ids, lens, row_id, group_id,
                                                history, request.args)
    run = ChunkRun(state, batch, cfg.prefill_kv_len(plen), int(lens[:len(chunk)].max()),
                   chunk.start + request.row_offset, ChunkResult.empty(len(chunk)))
    collect = request.collect
    wanted = [] if collect is None else [slot for slot, i in enumerate(chunk) if collect[i]]
    if wanted:
      ph = np.asarray(jax.device_get(prompt_hidden))[np.asarray(wanted)]  # host-side indexing:
      # an eager gather on the device would compile for every new (shape, count) pair
      for k, slot in enumerate(wanted):
        run.prompt_feats[chunk[slot] + request.row_offset] = ph[k, :lens[slot] - 1]
    return run

  def _count_switch(self, run: ChunkRun, strategy: Strategy, stats: RolloutStats) -> None:
    """A segment whose strategy is not the chunk's last segment's is a switch."""
    if run.previous is not None and strategy.name != run.previous:
      stats.switches += 1
    run.previous = strategy.name

  def _make_room(self, run: ChunkRun, strategy: Strategy, stats: RolloutStats) -> None:
    """Grows the chunk's caches into the next length bucket, as often as it takes for the
    longest live row to have room for a step of ``strategy`` (vanilla: one slot; speculative:
    the widest strategy's slack)."""
    cfg = self.config
    need = 1 if strategy.spec is None else cfg.step_slots
    while run.live_len + need > run.kv_len:
      bigger = cfg.kv_lengths[cfg.kv_lengths.index(run.kv_len) + 1]
      run.state, _ = self._run_timed(stats, "grow_s", ("grow", run.batch, run.kv_len, bigger),
                                     run.state)
      stats.grows += 1
      run.kv_len = bigger

  def _catch_up(self, run: ChunkRun, strategy: Strategy, stats: RolloutStats) -> float:
    """Before a learned-drafter segment that follows segments the drafter did not draft, its
    catch-up over the pending feature pairs; returns its seconds (0.0 when none runs)."""
    if not (strategy.learned and run.lagging):
      return 0.0
    run.state, switch_s = self._run_timed(stats, "switch_s", ("catchup", run.batch, run.kv_len),
                                          self.weights(), run.state)
    stats.catchups += 1
    run.lagging = False
    return switch_s

  def _decode_segment(self, run: ChunkRun, strategy: Strategy, max_steps: int,
                      args: Any) -> SegmentEnd:
    """Runs one segment of ``strategy`` (at most ``max_steps`` steps; 0: no limit) and reads
    what the host needs at its end, timing both."""
    segment = self.pool.get(("segment", run.batch, run.kv_len, self.pool.stop_at(run.batch),
                             strategy.group))
    t0 = time.perf_counter()
    run.state = state = segment(self.weights(), run.state, args, np.int32(strategy.choice),
                                np.int32(max_steps), np.int32(self._stop_at(run)))
    read = jax.device_get((state.done, state.num_generated, state.row_id, state.counters,
                           state.cache.lengths, state.tokens, state.logprobs))
    seconds = time.perf_counter() - t0
    # only the learned drafter's steps consume the feature pairs; the others leave them pending
    run.lagging |= not strategy.learned and self.learned
    return SegmentEnd(*read, seconds)

  def _account(self, run: ChunkRun, strategy: Strategy, tuned: bool, end: SegmentEnd,
               switch_s: float, stats: RolloutStats) -> None:
    """Adds a segment to the tallies: the tokens each row emitted, the tuner's reward where it
    chose the strategy (its tokens over the segment's seconds, the catch-up before it included,
    and the accepted length of the rows the rollout waits for), the arm's tally and the
    rollout's counters."""
    delta = run.advance(end.counters)
    arm = stats.arm(run.batch, strategy.name)
    made = run.record_emitted(arm, end.rows, end.n_gen)
    if tuned and delta["steps"] > 0:
      live = end.rows[(end.rows >= 0) & ~end.done] - run.first_row
      self.tuner.update(run.batch, strategy.name, delta["tokens"], end.seconds + switch_s,
                        steps=delta["steps"], row_steps=delta["row_steps"], switch_s=switch_s,
                        critical_length=critical_length(made, live, delta["steps"]))
    arm.segments += 1
    arm.seconds += end.seconds + switch_s
    arm.steps += delta["steps"]
    arm.tokens += delta["tokens"]
    arm.row_steps += delta["row_steps"]
    stats.decode_s += end.seconds
    stats.segments.append((run.batch, delta["steps"], end.seconds, strategy.name))
    stats.segment_kv_lens.append(run.kv_len)
    stats.cache_bytes_peak = max(stats.cache_bytes_peak, self.pool.steps.cache_bytes(run.state))
    stats.decode_steps += delta["steps"]
    stats.row_steps += delta["steps"] * run.batch

  def _collect_finished(self, run: ChunkRun, end: SegmentEnd, stop_ids: set[int]) -> None:
    """Copies the finished rows out of the device state into ``run.out``, each with its hidden
    states where it collects them (the prompt's, then the completion's feature history)."""
    rows, n_gen = end.rows, end.n_gen
    finished = [s for s in range(run.batch) if end.done[s] and rows[s] >= 0]
    if not finished:
      return
    toks, lps = end.tokens, end.logprobs
    keep = [s for s in finished if rows[s] in run.prompt_feats]
    feats = np.asarray(jax.device_get(run.state.feats))[np.asarray(keep)] if keep else None
    for s in finished:
      n, j = int(n_gen[s]), rows[s] - run.first_row  # j: the row in the chunk
      run.out.finish_row(j, toks[s, :n], lps[s, :n], stop_ids)
      if rows[s] in run.prompt_feats:
        run.out.hidden[j] = np.concatenate([run.prompt_feats.pop(rows[s]),
                                            feats[keep.index(s), :n]])

  def _finish_chunk(self, run: ChunkRun, counters: dict, stats: RolloutStats) -> None:
    """The chunk's last tallies, once every row is done: the arms' critical tokens, the live
    rows' steps and, with SD, the accepted lengths and the drafts' sources."""
    run.credit_critical_tokens()
    stats.live_row_steps += int(counters["row_steps"])
    if "accept_hist" in counters:
      stats.accept_hist = (0 if stats.accept_hist is None else stats.accept_hist) + \
          counters["accept_hist"]
      stats.add_sources(counters["source_steps"], counters["source_tokens"])

  def _stop_at(self, run: ChunkRun) -> int:
    """Live rows at which the chunk's next segment ends to compact: the largest smaller bucket
    it can compact into now (the next smaller one, unless a background compile has not finished
    it); 0 (decode on) where there is none, or compaction is off."""
    if not self.pool.stop_at(run.batch):
      return 0
    smaller = [b for b in self.config.batch_buckets if b < run.batch]
    return next((b for b in reversed(smaller)
                 if self.pool.compact_ready(run.batch, b, run.kv_len)), 0)

  def compact(self, run: ChunkRun, live: np.ndarray, cache_lens: np.ndarray,
              stats: RolloutStats) -> None:
    """Gathers the ``live`` slots into the smallest batch bucket that holds them and that it can
    decode in now (with compaction on and where that bucket is smaller; a bucket a background
    compile has not finished is passed over), and notes their longest committed length."""
    buckets = self.config.batch_buckets
    smaller = next((b for b in buckets if live.size <= b < run.batch
                    and self.pool.compact_ready(run.batch, b, run.kv_len)), run.batch)
    if self.config.compaction and smaller < run.batch:
      index = np.full((smaller,), -1, np.int32)
      index[:live.size] = live
      run.state, _ = self._run_timed(stats, "compact_s",
                                     ("compact", run.batch, smaller, run.kv_len), run.state, index)
      run.batch = smaller
    run.live_len = int(cache_lens[live].max())
