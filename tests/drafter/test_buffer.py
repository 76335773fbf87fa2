"""DataBuffer: rollout samples -> fixed-shape packed drafter batches, bounded, exactly resumable."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from tests.helpers import garble, sharp_random_model
from tlt_jax.drafter.buffer import DataBuffer, EmptyBufferError
from tlt_jax.drafter.objective import (layout_rows, make_batch_from_sequences, make_eval_step,
                                   split_drafter, target_features)
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter

CONFIG = ModelConfig.tiny(vocab_size=32)
H = 8  # hidden size of the synthetic (non-model) samples


def engine_hidden(target, sequences, width: int = 48) -> list[np.ndarray]:
  """What the rollout engine reports: the target's features at positions 0 .. L-2 of each
  sequence (one compile: always ``width`` columns and chunks of 16 rows)."""
  rows = list(sequences) + [[0, 0]] * max(16 - len(sequences), 0)
  ids, positions, segments, _ = layout_rows(rows, width)
  hidden, _ = target_features(target, ids, positions, segments, with_logits=False)
  return [hidden[r, :len(s) - 1] for r, s in enumerate(sequences)]


def synthetic(ids, lengths, start: int = 0):
  """Samples whose token 0 is their id and whose hidden rows hold ``t`` (feature 0) and the id
  (feature 1), so a batch shows which sample and pair each slot came from."""
  tokens, hidden = [], []
  for i, n in zip(ids, lengths):
    tok = np.arange(start, start + n) % 1000
    tok[0] = i
    h = np.zeros((n - 1, H), np.float32)
    h[:, 0] = np.arange(n - 1)
    h[:, 1] = i
    tokens.append(tok)
    hidden.append(h)
  return tokens, hidden


def sample_bytes(n: int) -> int:
  return 4 * n + 4 * H * (n - 1)


def held_ids(buffer: DataBuffer) -> list[int]:
  """The ids (token 0) of the held samples in storage (arrival) order."""
  state = buffer.state_dict()
  starts = np.cumsum(state["lengths"]) - state["lengths"]
  return state["tokens"][starts].tolist()


def segments_of(batch):
  """``(row, slots)`` of every sample in a batch."""
  out = []
  for r in range(batch.num_rows):
    for k in range(1, batch.segment_ids[r].max() + 1):
      out.append((r, np.flatnonzero(batch.segment_ids[r] == k)))
  return out


def assert_batches_equal(a, b):
  for name, x, y in zip(a._fields, a, b):
    if x is None:
      assert y is None, name
    else:
      np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(CONFIG, seed=1)


def test_batch_lines_up_with_make_batch_from_sequences(target):
  rng = np.random.default_rng(0)
  lengths, prompt_lens = [9, 14, 20, 27, 33], [3, 5, 4, 6, 2]
  seqs = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]
  buffer = DataBuffer(rows=4, seq_len=40)
  buffer.add(0, seqs, engine_hidden(target, seqs), prompt_lens)
  ours = buffer.batch()
  theirs = make_batch_from_sequences(target, seqs, 40, prompt_lens=prompt_lens, with_logits=False)
  assert ours.tokens.shape == (4, 40) and ours.features.shape == (4, 40, CONFIG.hidden_size)
  # Every sample once, packed, each a contiguous block: identified by its pair count (L - 1).
  found = segments_of(ours)
  assert sorted(len(slots) for _, slots in found) == [n - 1 for n in lengths]
  assert ours.num_rows > len({r for r, _ in found}) >= 2  # packed: fewer rows than samples
  for r, slots in found:
    n = len(slots)
    i = lengths.index(n + 1)
    assert np.all(np.diff(slots) == 1)
    row = (r, slots)
    np.testing.assert_array_equal(ours.positions[row], np.arange(n))
    np.testing.assert_array_equal(ours.tokens[row], theirs.tokens[i, :n])
    np.testing.assert_allclose(ours.features[row], theirs.features[i, :n], atol=1e-5)
    # the engine has no feature of the last token: the last pair t = L-2 has no target
    want_mask = theirs.mask[i, :n].copy()
    assert want_mask[n - 1] == 1 and want_mask[:prompt_lens[i] - 1].sum() == 0
    want_mask[n - 1] = 0
    np.testing.assert_array_equal(ours.mask[row], want_mask)
    trained = want_mask > 0
    np.testing.assert_allclose(ours.next_features[row][trained],
                               theirs.next_features[i, :n][trained], atol=1e-5)
  assert ours.mask[ours.segment_ids == 0].sum() == 0
  assert ours.mask.sum() == sum(n - p - 1 for n, p in zip(lengths, prompt_lens))

  # The same loss as one row per sequence: attention stays inside each packed sample.
  theirs = theirs._replace(mask=theirs.mask * (np.arange(40) < np.array(lengths)[:, None] - 2))
  graphdef, params = split_drafter(Drafter.create(CONFIG, seed=3))
  evaluate = make_eval_step(graphdef, target)
  a, b = (evaluate(params, nnx.state(target), batch) for batch in (ours, theirs))
  for key in ("loss", "top1", "num_tokens"):
    np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=2e-5, err_msg=key)


def test_long_samples_give_windows_that_cover_every_trained_pair():
  seq_len, length, prompt_len = 16, 60, 10  # 59 pairs, trained t = 9 .. 57
  buffer = DataBuffer(rows=1, seq_len=seq_len, seed=5)
  tokens, hidden = synthetic([7], [length])
  buffer.add(0, tokens, hidden, [prompt_len])
  covered = np.zeros(length - 1, int)
  starts = set()
  for _ in range(300):
    b = buffer.batch()
    t = b.positions[0]
    a = t[0]
    starts.add(a)
    np.testing.assert_array_equal(t, a + np.arange(seq_len))  # absolute, consecutive
    assert 0 <= a <= length - 1 - seq_len and np.all(b.segment_ids == 1)
    np.testing.assert_array_equal(b.tokens[0], tokens[0][t + 1])
    np.testing.assert_array_equal(b.features[0, :, 0], t)
    want = ((t >= prompt_len - 1) & (t <= length - 3)).astype(np.float32)
    np.testing.assert_array_equal(b.mask[0], want)
    np.testing.assert_array_equal(b.next_features[0, want > 0, 0], t[want > 0] + 1)
    covered[t[want > 0]] += 1
  # Every trained pair, the first and the last one included, is drawn about as often as an
  # interior one (probability 16/64 each batch here: about 75 of 300).
  assert covered[prompt_len - 1:length - 2].min() >= 40, covered
  assert len(starts) > 20

  # A long prompt: every window still holds trained pairs.
  buffer = DataBuffer(rows=1, seq_len=seq_len, seed=6)
  buffer.add(0, tokens, hidden, [50])
  for _ in range(50):
    assert buffer.batch().mask.sum() > 0
  last = buffer.freshest_batch()  # deterministic: the last seq_len pairs
  np.testing.assert_array_equal(last.positions[0], np.arange(length - 1 - seq_len, length - 1))


def test_eviction_takes_the_oldest_step_first_then_arrival_order():
  budget = 5 * sample_bytes(10)
  buffer = DataBuffer(rows=2, seq_len=16, max_bytes=budget, keep_steps=10)
  buffer.add(0, *synthetic([0, 1, 2], [10] * 3), [3] * 3)
  buffer.add(1, *synthetic([3, 4, 5, 6], [10] * 4), [3] * 4)
  assert held_ids(buffer) == [2, 3, 4, 5, 6] and buffer.steps == [0, 1]
  assert buffer.nbytes == budget
  buffer.add(1, *synthetic([7, 8, 9], [10] * 3), [3] * 3)  # later arrivals of the same step
  assert held_ids(buffer) == [5, 6, 7, 8, 9] and buffer.steps == [1]
  # A new step: its short rows arrive first, the long one last; the long one stays.
  buffer.add(2, *synthetic([10, 11, 12], [4, 4, 20]), [2, 2, 2])
  assert held_ids(buffer) == [8, 9, 10, 11, 12] and buffer.nbytes <= budget
  buffer.add(2, *synthetic([13], [20]), [2])
  assert held_ids(buffer) == [10, 11, 12, 13] and buffer.nbytes <= budget
  buffer.add(2, *synthetic([14], [7]), [2])
  assert held_ids(buffer) == [12, 13, 14] and buffer.nbytes <= budget
  # One sample bigger than the whole budget is skipped (counted), nothing else is evicted.
  buffer.add(3, *synthetic([15], [60]), [2])
  assert sample_bytes(60) > budget and held_ids(buffer) == [12, 13, 14]
  stats = buffer.stats()
  assert stats["skipped_too_large"] == 1 and stats["evicted"] == 12 and stats["added"] == 15
  assert stats["nbytes"] == buffer.nbytes == sum(sample_bytes(n) for n in [20, 20, 7])


def test_stale_steps_are_dropped_and_steps_cannot_go_backwards():
  buffer = DataBuffer(rows=2, seq_len=16, keep_steps=2)
  for step in range(3):
    buffer.add(step, *synthetic([step], [8]), [3])
  assert buffer.steps == [1, 2] and held_ids(buffer) == [1, 2]
  buffer.add(2, *synthetic([9], [8]), [3])  # the same step again is fine
  with pytest.raises(ValueError, match="backwards"):
    buffer.add(1, *synthetic([5], [8]), [3])
  assert held_ids(buffer) == [1, 2, 9]
  buffer.add(5, [], [], [])  # steps <= 3 are stale
  assert buffer.num_samples == 0 and buffer.stats()["dropped_stale"] == 4
  with pytest.raises(EmptyBufferError, match="empty"):
    buffer.batch()
  assert buffer.freshest_batch() is None


def test_batches_have_fixed_shapes_and_follow_the_seed():
  def fill(buffer):
    rng = np.random.default_rng(1)
    lengths = rng.integers(3, 70, 40)
    buffer.add(0, *synthetic(range(40), lengths), rng.integers(1, 3, 40).tolist())
    buffer.add(1, *synthetic(range(40, 50), lengths[:10]), [2] * 10)
    return buffer

  a, b = fill(DataBuffer(rows=3, seq_len=24, seed=1)), fill(DataBuffer(rows=3, seq_len=24, seed=1))
  other = fill(DataBuffer(rows=3, seq_len=24, seed=2))
  first = a.batch()
  assert_batches_equal(first, b.batch())
  other.batch()
  spec = [(x.shape, x.dtype) for x in first if x is not None]
  assert spec[0] == ((3, 24), np.int32) and first.next_logits is None
  differ = 0
  for i in range(20):
    x = a.batch()
    assert [(y.shape, y.dtype) for y in x if y is not None] == spec
    if i % 3 == 0:  # metrics batches in between draw nothing from the RNG
      assert_batches_equal(b.freshest_batch(), b.freshest_batch())
    assert_batches_equal(x, b.batch())
    differ += not np.array_equal(x.tokens, other.batch().tokens)
    for r, slots in segments_of(x):  # contiguous blocks; positions restart within each sample
      assert np.all(np.diff(slots) == 1) and np.all(np.diff(x.positions[r, slots]) == 1)
      ids = set(x.features[r, slots, 1].tolist())
      assert len(ids) == 1
    assert (x.segment_ids > 0).mean() > 0.9  # well packed
  assert differ >= 15
  fresh = a.freshest_batch()
  assert set(fresh.features[..., 1][fresh.segment_ids > 0].tolist()) <= set(range(40, 50))
  assert fresh.mask.shape == (3, 24) and fresh.mask.sum() > 0


def test_draws_are_weighted_by_trained_pairs():
  buffer = DataBuffer(rows=1, seq_len=10, seed=3)  # one 10-pair sample fills the row
  buffer.add(0, *synthetic([1, 2], [11, 11]), [9, 1])  # 1 and 9 trained pairs
  picks = [buffer.batch().features[0, 0, 1] for _ in range(2000)]
  share = np.mean(np.array(picks) == 2)
  assert 0.87 < share < 0.93, share


def test_save_and_restore_continue_with_the_same_batches(tmp_path):
  def grow(buffer, step):
    rng = np.random.default_rng(step)
    lengths = rng.integers(4, 50, 12)
    buffer.add(step, *synthetic(range(12 * step, 12 * step + 12), lengths),
               rng.integers(1, 4, 12).tolist())

  for dtype in ("float32", "bfloat16"):
    path = tmp_path / f"buffer_{dtype}.npz"
    buffer = DataBuffer(rows=2, seq_len=20, max_bytes=40_000, seed=4, dtype=dtype)
    for step in range(3):
      grow(buffer, step)
      buffer.batch()
    buffer.save(path)
    restored = DataBuffer.restore(path)
    assert restored.stats() == buffer.stats() and restored.dtype == buffer.dtype
    for i in range(8):
      if i == 4:
        grow(buffer, 3)
        grow(restored, 3)
      x, y = buffer.batch(), restored.batch()
      assert x.features.dtype == np.dtype(dtype)
      assert_batches_equal(x, y)
    assert_batches_equal(buffer.freshest_batch(), restored.freshest_batch())

  with pytest.raises(FileNotFoundError, match="nowhere.npz"):
    DataBuffer.restore(tmp_path / "nowhere.npz")
  garble(tmp_path)  # the largest file: the float32 buffer
  with pytest.raises(ValueError, match="buffer_float32.npz"):
    DataBuffer.restore(tmp_path / "buffer_float32.npz")
  data = (tmp_path / "buffer_bfloat16.npz").read_bytes()
  (tmp_path / "buffer_bfloat16.npz").write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match="buffer_bfloat16.npz"):
    DataBuffer.restore(tmp_path / "buffer_bfloat16.npz")
  with pytest.raises(ValueError, match="seq_len"):
    DataBuffer(rows=2, seq_len=21, max_bytes=40_000, dtype="bfloat16").load_state_dict(
        restored.state_dict())
  assert not list(tmp_path.glob("*.tmp*"))


def test_add_rejects_malformed_samples_and_skips_untrainable_ones():
  buffer = DataBuffer(rows=2, seq_len=16)
  tokens, hidden = synthetic([0, 1], [8, 8])
  cases = [((tokens, [hidden[0], hidden[1][:-1]], [3, 3]), r"hidden must be \[L-1, H\]"),
           ((tokens, hidden, [3, 0]), "prompt_len"),
           ((tokens, hidden, [3, 9]), "prompt_len"),
           ((tokens, hidden, [3]), "one of each"),
           ((tokens, [hidden[0], hidden[1][:, :4]], [3, 3]), "hidden size 4")]
  for args, message in cases:
    with pytest.raises(ValueError, match=message):
      buffer.add(0, *args)
    assert buffer.num_samples == 0  # all or nothing
  buffer.add(0, tokens, hidden, [7, 3])  # a one-token completion trains nothing
  assert buffer.num_samples == 1 and buffer.stats()["skipped_untrainable"] == 1
  with pytest.raises(ValueError, match="hidden size 4"):
    buffer.add(1, [tokens[0]], [hidden[0][:, :4]], [3])
  with pytest.raises(ValueError, match="seq_len"):
    DataBuffer(rows=2, seq_len=1)
  with pytest.raises(ValueError, match="floating"):
    DataBuffer(rows=2, seq_len=8, dtype=np.int32)
