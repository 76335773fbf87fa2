"""Host-side store of rollout samples for online drafter training, drawn as fixed-shape batches.

The rollout engine hands over, per finished row, a *sample*: ``tokens [L]`` (prompt + completion,
``L = P + n``), the target's last-layer features ``hidden [L-1, H]`` (after its final norm) at
positions ``t = 0 .. L-2``, and the prompt length ``P``. As in :mod:`tlt_jax.drafter.objective`, the
drafter's pair ``t`` reads ``(x_{t+1}, h_t)`` and learns ``h_{t+1}`` (and the target's next-token
distribution, recomputed from ``h_{t+1}`` by the target's LM head: ``next_logits=None``). A sample
thus holds ``L-1`` pairs:

* ``t < P-1``: prompt context only (mask 0);
* ``P-1 <= t <= L-3``: trained (mask 1), ``n - 1`` of them;
* ``t = L-2``: no ``h_{L-1}`` exists (the engine never feeds the last sampled token), mask 0.
  ``make_batch_from_sequences`` runs the target over all ``L`` tokens and so also trains this
  last pair; everything else (tokens, features, positions, mask) lines up with it exactly.

Memory. ``nbytes`` (hidden + tokens) never exceeds ``max_bytes`` after ``add``. Samples are kept
in arrival order, and since RL steps never go backwards that is also step order: eviction takes
the oldest step first and, within a step, the earliest arrivals first. The engine adds a step's
rows roughly as they finish, so its short responses go first and the long ones (which finish last)
stay for the drafter: the TLT paper's "one-step offset". A sample that alone is bigger than
``max_bytes`` is skipped and counted (``stats()["skipped_too_large"]``), as is one with no trained
pair (a completion of at most one token, ``skipped_untrainable``): one odd rollout row must not
stop an RL run. After ``add(step=s)`` samples of steps ``<= s - keep_steps`` are dropped as stale.

Batches. ``batch()`` always returns the same shapes and dtypes (``[rows, seq_len]`` pairs,
features ``[rows, seq_len, H]``), so the jitted train step never recompiles. Samples are drawn
without replacement by a seeded numpy Generator, with probability proportional to their trained
pairs (long responses are represented by their tokens, not by their count), and packed first fit
into the rows (``pack_sequences``); ``segment_ids`` (0 = padding, then 1, 2, ... per sample of a
row) restrict attention to the sample's own pairs (``segment_mask``) and ``positions`` hold each
pair's absolute ``t`` in its own sequence, so RoPE sees what it sees at decode time. A sample of
more than ``seq_len`` pairs contributes a window of ``seq_len`` consecutive pairs: its start is
drawn uniformly among all ``seq_len``-wide windows overlapping the trained pairs, then shifted to
lie inside the sequence, so every trained pair is covered at least as often as an interior one
(the ends of the trained span a little more). The features are the target's exact ones, computed
with the full context, so a window needs nothing before its start.

``save``/``restore`` write and read one ``.npz`` with the contents, the RNG state and the
counters: batches drawn after a restore equal those drawn without the interruption. All public
methods take one lock, so a rollout thread may ``add`` while a training thread draws batches.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import zipfile
from typing import Any, NamedTuple, Sequence

import ml_dtypes
import numpy as np

from tlt_jax.drafter.objective import DrafterBatch, pack_sequences

STATE_FORMAT = 1
_COUNTERS = ("added", "evicted", "dropped_stale", "skipped_too_large", "skipped_untrainable",
             "batches")
_CONFIG = ("rows", "seq_len", "max_bytes", "keep_steps", "dtype")


class EmptyBufferError(ValueError):
  """``DataBuffer.batch()`` was called while the buffer holds no sample."""


class _Sample(NamedTuple):
  step: int
  tokens: np.ndarray  # [L] int32
  hidden: np.ndarray  # [L-1, H]
  prompt_len: int

  @property
  def pairs(self) -> int:
    """Pairs ``t = 0 .. L-2``."""
    return self.hidden.shape[0]

  @property
  def trained(self) -> int:
    """Pairs with a loss: ``P-1 .. L-3``."""
    return max(self.pairs - self.prompt_len, 0)

  @property
  def nbytes(self) -> int:
    return self.tokens.nbytes + self.hidden.nbytes


def _float_dtype(dtype) -> np.dtype:
  """``dtype`` as a numpy floating dtype (bfloat16 included), or a ValueError."""
  try:
    dt = np.dtype(dtype)  # "bfloat16" resolves once ml_dtypes is imported
  except TypeError as e:
    raise ValueError(f"DataBuffer dtype {dtype!r} is not a numpy dtype: {e}") from e
  if dt.kind != "f" and dt != np.dtype(ml_dtypes.bfloat16):
    raise ValueError(f"DataBuffer dtype must be a floating dtype (float32, bfloat16, ...), "
                     f"got {dt}")
  return dt


def _positive_int(name: str, value) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"DataBuffer {name} must be a positive int, got {value!r}")
  return int(value)


class DataBuffer:
  """Bounded, step-aware store of rollout samples drawn as fixed-shape packed drafter batches.

  See the module docstring for the sample layout, eviction, window choice and sampling.
  ``batch()`` raises :class:`EmptyBufferError` (a ValueError) when there is nothing to draw;
  ``freshest_batch()`` returns None then.
  """

  def __init__(self, *, rows: int, seq_len: int, max_bytes: int = 256 << 20, keep_steps: int = 2,
               seed: int = 0, dtype=np.float32):
    self.rows = _positive_int("rows", rows)
    self.seq_len = _positive_int("seq_len", seq_len)
    if self.seq_len < 2:
      raise ValueError(f"DataBuffer seq_len must be at least 2 pairs, got {seq_len}")
    self.max_bytes = _positive_int("max_bytes", max_bytes)
    self.keep_steps = _positive_int("keep_steps", keep_steps)
    self.dtype = _float_dtype(dtype)
    self.hidden_size: int | None = None  # fixed by the first sample
    self._rng = np.random.default_rng(seed)
    self._samples: collections.deque[_Sample] = collections.deque()
    self._nbytes = 0
    self._last_step: int | None = None
    self._counters = dict.fromkeys(_COUNTERS, 0)
    self._lock = threading.RLock()

  # ---------------------------------------------------------------------------------- contents

  def add(self, step: int, tokens: Sequence[Any], hidden: Sequence[Any],
          prompt_lens: Sequence[int]) -> None:
    """Stores the samples of RL ``step`` (arrival order matters: see eviction), then drops stale
    steps and evicts down to ``max_bytes``. Nothing is stored when any sample is malformed."""
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
      raise ValueError(f"DataBuffer.add: step must be an int, got {step!r}")
    step = int(step)
    if not len(tokens) == len(hidden) == len(prompt_lens):
      raise ValueError(f"DataBuffer.add: got {len(tokens)} tokens, {len(hidden)} hidden and "
                       f"{len(prompt_lens)} prompt_lens; pass one of each per sample")
    with self._lock:
      if self._last_step is not None and step < self._last_step:
        raise ValueError(f"DataBuffer.add: step {step} is older than the last step added "
                         f"({self._last_step}); steps must not go backwards")
      size = self.hidden_size
      if size is None and len(hidden) and np.ndim(hidden[0]) == 2:
        size = np.shape(hidden[0])[1]  # the first sample ever fixes the hidden size
      samples = [self._check_sample(step, i, size, *args)
                 for i, args in enumerate(zip(tokens, hidden, prompt_lens))]
      if samples:
        self.hidden_size = size
      self._last_step = step
      while self._samples and self._samples[0].step <= step - self.keep_steps:
        self._pop_oldest("dropped_stale")
      for sample in samples:
        if sample.nbytes > self.max_bytes:
          self._counters["skipped_too_large"] += 1
        elif sample.trained == 0:
          self._counters["skipped_untrainable"] += 1
        else:
          self._samples.append(sample)
          self._nbytes += sample.nbytes
          self._counters["added"] += 1
      while self._nbytes > self.max_bytes:
        self._pop_oldest("evicted")

  def _check_sample(self, step: int, i: int, size: int, tokens, hidden, prompt_len) -> _Sample:
    tokens = np.asarray(tokens)
    hidden = np.asarray(hidden)
    if tokens.ndim != 1 or tokens.shape[0] < 2 or tokens.dtype.kind not in "iu":
      raise ValueError(f"DataBuffer.add: sample {i}: tokens must be a 1-D int array of at least "
                       f"2 tokens, got shape {tokens.shape} dtype {tokens.dtype}")
    length = tokens.shape[0]
    if hidden.ndim != 2 or hidden.shape[0] != length - 1:
      raise ValueError(f"DataBuffer.add: sample {i}: hidden must be [L-1, H] = [{length - 1}, H] "
                       f"(features at positions 0 .. L-2 of its {length} tokens), got shape "
                       f"{hidden.shape}")
    if hidden.shape[1] != size:
      raise ValueError(f"DataBuffer.add: sample {i}: hidden size {hidden.shape[1]} differs from "
                       f"the buffer's {size}; one buffer holds features of one target")
    if (not isinstance(prompt_len, (int, np.integer)) or isinstance(prompt_len, bool)
        or not 1 <= prompt_len <= length):
      raise ValueError(f"DataBuffer.add: sample {i}: prompt_len must be an int in [1, {length}] "
                       f"(its token count), got {prompt_len!r}")
    return _Sample(step, np.array(tokens, np.int32), np.array(hidden, self.dtype), int(prompt_len))

  def _pop_oldest(self, counter: str) -> None:
    sample = self._samples.popleft()
    self._nbytes -= sample.nbytes
    self._counters[counter] += 1

  @property
  def num_samples(self) -> int:
    """Samples held."""
    return len(self._samples)

  @property
  def num_tokens(self) -> int:
    """Tokens held (prompt + completion, all samples)."""
    with self._lock:
      return sum(s.tokens.shape[0] for s in self._samples)

  @property
  def num_trained(self) -> int:
    """Trained pairs held (``n - 1`` per sample)."""
    with self._lock:
      return sum(s.trained for s in self._samples)

  @property
  def nbytes(self) -> int:
    """Bytes of hidden states and tokens held; at most ``max_bytes``."""
    return self._nbytes

  @property
  def steps(self) -> list[int]:
    """The RL steps with samples held, ascending."""
    with self._lock:
      return sorted({s.step for s in self._samples})

  @property
  def last_step(self) -> int | None:
    """The newest step ever added (None before the first ``add``)."""
    return self._last_step

  def stats(self) -> dict:
    """Sizes and counters: samples, tokens, trained, nbytes, max_bytes, steps, last_step, and the
    counts of samples added, evicted, dropped stale, skipped (too large / untrainable) and of
    batches drawn."""
    with self._lock:
      return dict(samples=self.num_samples, tokens=self.num_tokens, trained=self.num_trained,
                  nbytes=self._nbytes, max_bytes=self.max_bytes, steps=self.steps,
                  last_step=self._last_step, **self._counters)

  # ---------------------------------------------------------------------------------- batches

  def batch(self) -> DrafterBatch:
    """A random packed batch of numpy arrays, always ``[rows, seq_len]`` (module docstring).

    Raises :class:`EmptyBufferError` when the buffer holds no sample.
    """
    with self._lock:
      samples = list(self._samples)
      if not samples:
        raise EmptyBufferError("DataBuffer.batch: the buffer is empty; add rollout samples "
                               "before drawing a batch (check num_samples first)")
      weights = np.array([s.trained for s in samples], np.float64)
      # Weighted sampling without replacement: sort by Exp(1) / weight (Efraimidis-Spirakis).
      order = np.argsort(self._rng.exponential(size=len(samples)) / weights, kind="stable")
      picked = self._fill([samples[i] for i in order])
      starts = [0] * len(picked)
      long = [j for j, s in enumerate(picked) if s.pairs > self.seq_len]
      if long:
        # a window of seq_len pairs overlapping the trained pairs P-1 .. L-3, moved inside
        low = np.array([picked[j].prompt_len - self.seq_len for j in long])
        high = np.array([picked[j].pairs - 2 for j in long])
        drawn = self._rng.integers(low, high + 1)
        for j, u in zip(long, drawn.tolist()):
          starts[j] = min(max(u, 0), picked[j].pairs - self.seq_len)
      self._counters["batches"] += 1
      return self._assemble(list(zip(picked, starts)))

  def freshest_batch(self) -> DrafterBatch | None:
    """The newest step's samples, latest arrivals first, as one batch of ``batch()``'s shapes
    (for metrics); a long sample gives its last ``seq_len`` pairs. Deterministic: no RNG is
    consumed. None when the buffer is empty."""
    with self._lock:
      if not self._samples:
        return None
      newest = self._samples[-1].step
      fresh = [s for s in reversed(self._samples) if s.step == newest]
      return self._assemble([(s, max(s.pairs - self.seq_len, 0)) for s in self._fill(fresh)])

  def _fill(self, candidates: list[_Sample]) -> list[_Sample]:
    """The candidates, in order, whose pairs (cut to ``seq_len``) fit the batch's capacity."""
    room = self.rows * self.seq_len
    picked = []
    for s in candidates:
      n = min(s.pairs, self.seq_len)
      if n <= room:
        picked.append(s)
        room -= n
        if room == 0:
          break
    return picked

  def _assemble(self, picks: list[tuple[_Sample, int]]) -> DrafterBatch:
    """Packs ``(sample, window start)`` pairs into the fixed-shape arrays; samples that do not fit
    the ``rows`` rows after first-fit packing are left out."""
    rows, seq_len, size = self.rows, self.seq_len, self.hidden_size
    lengths = [min(s.pairs, seq_len) for s, _ in picks]
    groups = pack_sequences(lengths, seq_len)[:rows]
    tokens = np.zeros((rows, seq_len), np.int32)
    features = np.zeros((rows, seq_len, size), self.dtype)
    next_features = np.zeros((rows, seq_len, size), self.dtype)
    mask = np.zeros((rows, seq_len), np.float32)
    positions = np.zeros((rows, seq_len), np.int32)
    segments = np.zeros((rows, seq_len), np.int32)
    for r, group in enumerate(groups):
      at = 0
      for k, i in enumerate(group):
        s, a = picks[i]
        n = lengths[i]
        t = np.arange(a, a + n)
        # pair t: token x_{t+1}, feature h_t, target h_{t+1} (while t + 1 <= L - 2)
        with_next = min(n, s.pairs - 1 - a)
        tokens[r, at:at + n] = s.tokens[a + 1:a + n + 1]
        features[r, at:at + n] = s.hidden[a:a + n]
        next_features[r, at:at + with_next] = s.hidden[a + 1:a + 1 + with_next]
        mask[r, at:at + n] = (t >= s.prompt_len - 1) & (t <= s.pairs - 2)
        positions[r, at:at + n] = t
        segments[r, at:at + n] = k + 1
        at += n
    return DrafterBatch(tokens=tokens, features=features, next_features=next_features,
                        next_logits=None, mask=mask, positions=positions, segment_ids=segments)

  # ---------------------------------------------------------------------------------- state

  def state_dict(self) -> dict[str, np.ndarray]:
    """Contents, RNG state, counters and config as numpy arrays (``meta`` is a JSON string)."""
    with self._lock:
      samples = list(self._samples)
      size = self.hidden_size or 0
      hidden = (np.concatenate([s.hidden for s in samples]) if samples
                else np.zeros((0, size), self.dtype))
      meta = dict(format=STATE_FORMAT, rows=self.rows, seq_len=self.seq_len,
                  max_bytes=self.max_bytes, keep_steps=self.keep_steps, dtype=self.dtype.name,
                  hidden_size=self.hidden_size, last_step=self._last_step,
                  counters=self._counters, rng=self._rng.bit_generator.state)
      return dict(
          meta=np.array(json.dumps(meta)),
          tokens=(np.concatenate([s.tokens for s in samples]) if samples
                  else np.zeros((0,), np.int32)),
          # raw bytes: npz cannot hold bfloat16 as such
          hidden=hidden.view(np.dtype(f"u{self.dtype.itemsize}")),
          lengths=np.array([s.tokens.shape[0] for s in samples], np.int64),
          prompt_lens=np.array([s.prompt_len for s in samples], np.int64),
          sample_steps=np.array([s.step for s in samples], np.int64))

  def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
    """Replaces contents, RNG state and counters with a ``state_dict`` of a buffer configured
    like this one (rows, seq_len, max_bytes, keep_steps and dtype must match)."""
    meta = _meta(state)
    mine = dict(rows=self.rows, seq_len=self.seq_len, max_bytes=self.max_bytes,
                keep_steps=self.keep_steps, dtype=self.dtype.name)
    for key in _CONFIG:
      if meta[key] != mine[key]:
        raise ValueError(f"DataBuffer.load_state_dict: the state has {key}={meta[key]!r} but this "
                         f"buffer {key}={mine[key]!r}; build the buffer with the saved config "
                         "(DataBuffer.from_state_dict / DataBuffer.restore do)")
    lengths = np.asarray(state["lengths"], np.int64)
    prompt_lens = np.asarray(state["prompt_lens"], np.int64)
    steps = np.asarray(state["sample_steps"], np.int64)
    tokens = np.asarray(state["tokens"])
    hidden = np.asarray(state["hidden"])
    size = meta["hidden_size"]
    if (not len(lengths) == len(prompt_lens) == len(steps) or tokens.shape != (lengths.sum(),)
        or hidden.shape != (int((lengths - 1).sum()), size or 0)
        or hidden.dtype.itemsize != self.dtype.itemsize):
      raise ValueError("DataBuffer.load_state_dict: the arrays do not agree with each other "
                       f"(tokens {tokens.shape}, hidden {hidden.shape}, {len(lengths)} lengths); "
                       "the state is corrupt")
    hidden = hidden.view(self.dtype)
    samples: collections.deque[_Sample] = collections.deque()
    tok_at = hid_at = 0
    for length, prompt_len, step in zip(lengths.tolist(), prompt_lens.tolist(), steps.tolist()):
      samples.append(_Sample(step, np.array(tokens[tok_at:tok_at + length], np.int32),
                             np.array(hidden[hid_at:hid_at + length - 1]), prompt_len))
      tok_at += length
      hid_at += length - 1
    rng = np.random.default_rng()
    rng.bit_generator.state = meta["rng"]
    with self._lock:
      self._samples = samples
      self._nbytes = sum(s.nbytes for s in samples)
      self.hidden_size = size
      self._last_step = meta["last_step"]
      self._counters = {key: int(meta["counters"][key]) for key in _COUNTERS}
      self._rng = rng

  @classmethod
  def from_state_dict(cls, state: dict[str, np.ndarray]) -> "DataBuffer":
    """A buffer built with the saved config and holding the saved contents, RNG and counters."""
    meta = _meta(state)
    buffer = cls(**{key: meta[key] for key in _CONFIG})
    buffer.load_state_dict(state)
    return buffer

  def save(self, path: str | os.PathLike) -> None:
    """Writes ``state_dict()`` to one ``.npz`` file atomically (a temporary file, then rename)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    state = self.state_dict()
    try:
      with open(tmp, "wb") as f:
        np.savez(f, **state)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)

  @classmethod
  def restore(cls, path: str | os.PathLike) -> "DataBuffer":
    """The buffer ``save(path)`` wrote: next batches equal those the saved one would draw.

    FileNotFoundError when ``path`` does not exist, ValueError when it is not a readable buffer.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
      raise FileNotFoundError(f"DataBuffer.restore: no buffer file at {path}")
    try:
      with np.load(path, allow_pickle=False) as data:
        state = {key: data[key] for key in data.files}
      return cls.from_state_dict(state)
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile,
            json.JSONDecodeError) as e:
      raise ValueError(f"DataBuffer.restore: {path} is not a readable DataBuffer file "
                       f"(corrupt or truncated?): {e}") from e


def _meta(state: dict) -> dict:
  try:
    meta = json.loads(str(np.asarray(state["meta"])))
  except (KeyError, json.JSONDecodeError) as e:
    raise ValueError(f"DataBuffer state has no readable 'meta' entry: {e!r}") from e
  if meta.get("format") != STATE_FORMAT:
    raise ValueError(f"DataBuffer state format {meta.get('format')!r} is not {STATE_FORMAT}; it "
                     "was written by another version of tlt_jax")
  return meta
