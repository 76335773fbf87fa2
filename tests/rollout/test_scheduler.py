"""The scheduler's host-side steps, alone and on numpy arrays (no model, nothing compiled): the
prefill's inputs, a finished row's entry in a chunk's result, and a chunk's bookkeeping of the
tokens each row emitted (the arms' critical tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from tlt_jax.rollout.host.scheduler import (ChunkResult, ChunkRun, Request, critical_length,
                                      prefill_inputs)
from tlt_jax.rollout.host.stats import ArmTally


def test_prefill_inputs_give_rows_their_request_ids_and_equal_prompts_one_group():
  prompts = [[9], [1, 2], [3], [1, 2], [4, 5, 6]]
  history = [[], [[7, 7]], [], [], [[8], [6, 6, 6]]]  # per prompt, its earlier completions
  request = Request(prompts, None, (), row_offset=10, history=history)
  ids, lens, row_id, group_id, packed = prefill_inputs(
      request, range(1, 5), batch=8, plen=4, pad_id=0, history=np.full((8, 6), -1, np.int32))
  np.testing.assert_array_equal(ids[:4], [[1, 2, 0, 0], [3, 0, 0, 0], [1, 2, 0, 0],
                                          [4, 5, 6, 0]])
  assert (ids[4:] == 0).all()
  np.testing.assert_array_equal(lens, [2, 1, 2, 3, 1, 1, 1, 1])  # empty slots: 1
  np.testing.assert_array_equal(row_id, [11, 12, 13, 14, -1, -1, -1, -1])  # + row_offset
  np.testing.assert_array_equal(group_id, [0, 1, 0, 2, -1, -1, -1, -1])  # same prompt, same group
  np.testing.assert_array_equal(packed[0], [7, 7, -1, -1, -1, -1])
  np.testing.assert_array_equal(packed[3], [8, -1, 6, 6, 6, -1])
  assert (packed[[1, 2, 4, 5, 6, 7]] == -1).all()  # no earlier completions, or an empty slot
  # without a suffix drafter the history input has width 0 and nothing is packed
  *_, none = prefill_inputs(request, range(1, 5), 8, 4, 0, np.full((8, 0), -1, np.int32))
  assert none.shape == (8, 0)


def test_a_finished_row_stops_only_on_a_stop_id_as_its_last_token():
  out = ChunkResult.empty(3)
  logprobs = np.array([-0.1, -0.2, -0.3], np.float32)
  out.finish_row(0, np.array([5, 6, 2]), logprobs, {2})
  out.finish_row(1, np.array([5, 2, 6]), np.zeros(3, np.float32), {2})  # stop id, not last
  out.finish_row(2, np.zeros(0, np.int32), np.zeros(0, np.float32), {2})  # nothing generated
  assert out.tokens == [[5, 6, 2], [5, 2, 6], []]
  assert out.reasons == ["stop", "length", "length"]
  assert all(isinstance(t, int) for t in out.tokens[0])  # plain ints, not numpy scalars
  assert out.logprobs[0] is logprobs
  assert out.hidden == [None] * 3  # the caller's to fill


def test_each_segment_s_arm_is_credited_the_tokens_of_the_chunk_s_longest_row():
  """Three rows (request rows 20..22) over three segments; the second compacts row 21 away
  (it finished), so it is in no slot at the third: its count stays. Row 22 emits the most in
  all (9), so each arm is credited what row 22 emitted in its segments."""
  run = ChunkRun(state=None, batch=4, kv_len=16, live_len=3, first_row=20,
                 out=ChunkResult.empty(3))
  first, second = ArmTally(), ArmTally()
  counters = dict(steps=2, tokens=5, row_steps=5)
  assert run.advance(counters) == counters
  run.record_emitted(first, np.array([20, 21, 22, -1]), np.array([1, 2, 2, 0]))
  assert run.advance(dict(steps=5, tokens=9, row_steps=8)) == dict(steps=3, tokens=4,
                                                                   row_steps=3)
  run.record_emitted(second, np.array([20, 21, 22, -1]), np.array([3, 4, 4, 0]))
  run.record_emitted(first, np.array([22, 20]), np.array([9, 3]))  # row 21 compacted away
  np.testing.assert_array_equal(run.emitted, [3, 4, 9])
  np.testing.assert_array_equal(run.per_segment[2][1], [0, 0, 5])
  run.credit_critical_tokens()
  assert (first.critical_tokens, second.critical_tokens) == (2 + 5, 2)


def test_the_critical_length_is_that_of_the_rows_still_live_at_the_segment_s_end():
  """Rows 0 and 2 finished in the segment having made many tokens; rows 1 and 3 are live and made
  6 and 10 in 4 steps: 2 tokens a step. With none live, the row that made the most."""
  made = np.array([20, 6, 18, 10])
  assert critical_length(made, np.array([1, 3]), steps=4) == pytest.approx(2.0)
  assert made.sum() / 16 > 3  # what the mean row over 4 x 4 row-steps would say
  assert critical_length(made, np.array([], np.int64), steps=5) == pytest.approx(4.0)
  assert critical_length(made, np.array([1]), steps=0) is None
