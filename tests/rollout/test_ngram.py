"""The n-gram drafter against a plain-Python reference of the same rules, plus jit behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout.decode.ngram import NgramConfig, ngram_propose
from tlt_jax.utils import compile_count


def reference_propose(prompt, plen, gen, glen, gid, max_ngram, min_ngram, depth):
  """Loops over every candidate occurrence, exactly as the module docstring states the rules."""
  b_size = len(gid)
  ctx = [list(prompt[b, :plen[b]]) + list(gen[b, :glen[b]]) for b in range(b_size)]
  draft = np.zeros((b_size, depth), np.int32)
  draft_len = np.zeros((b_size,), np.int32)
  for b in range(b_size):
    if gid[b] < 0:
      continue
    mine = ctx[b]
    for n in range(max_ngram, min_ngram - 1, -1):
      if len(mine) < n:
        continue
      suffix = mine[-n:]
      source = None
      for end in range(len(mine) - 2, n - 2, -1):  # most recent first; a token must follow
        if mine[end - n + 1:end + 1] == suffix:
          source = (mine, end)
          break
      if source is None:
        candidates = []
        for r in range(b_size):
          if r == b or gid[r] != gid[b]:
            continue
          for end in range(n - 1, len(ctx[r]) - 1):
            if ctx[r][end - n + 1:end + 1] == suffix:
              candidates.append((min(depth, len(ctx[r]) - 1 - end), -r, end))
        if candidates:
          _, neg_r, end = max(candidates)
          source = (ctx[-neg_r], end)
      if source is not None:
        follow = source[0][source[1] + 1:source[1] + 1 + depth]
        draft[b, :len(follow)] = follow
        draft_len[b] = len(follow)
        break
  return draft, draft_len


def random_case(rng, b, p, n, vocab, num_groups):
  """Random padded prompts/responses; siblings share a prompt and copy chunks of each other."""
  gid = rng.integers(0, num_groups, size=b).astype(np.int32)
  gid[rng.random(b) < 0.15] = -1  # padding rows
  prompt = rng.integers(0, vocab, size=(b, p)).astype(np.int32)
  plen = rng.integers(0, p + 1, size=b).astype(np.int32)
  for g in range(num_groups):  # one prompt per group
    members = np.flatnonzero(gid == g)
    if len(members):
      prompt[members] = prompt[members[0]]
      plen[members] = plen[members[0]]
  gen = rng.integers(0, vocab, size=(b, n)).astype(np.int32)
  for row in range(b):  # paste a sibling's phrase so long matches exist
    sibs = np.flatnonzero((gid == gid[row]) & (np.arange(b) != row))
    if len(sibs) and rng.random() < 0.7:
      src, width = rng.choice(sibs), rng.integers(2, n // 2 + 1)
      a, c = rng.integers(0, n - width + 1, size=2)
      gen[row, c:c + width] = gen[src, a:a + width]
  glen = rng.integers(0, n + 1, size=b).astype(np.int32)
  # Garbage beyond the lengths must be ignored.
  prompt[np.arange(p)[None, :] >= plen[:, None]] = 10_000
  gen[np.arange(n)[None, :] >= glen[:, None]] = 10_001
  return prompt, plen, gen, glen, gid


@pytest.mark.parametrize("max_ngram, min_ngram, depth",
                         [(4, 1, 8), (3, 2, 5), (2, 2, 3), (1, 1, 4)])
def test_matches_reference_on_random_cases(max_ngram, min_ngram, depth):
  rng = np.random.default_rng(max_ngram * 100 + min_ngram * 10 + depth)
  stats = {"no_match": 0, "short": 0, "sibling_only": 0}
  for trial in range(40):
    vocab = int(rng.choice([2, 3, 5, 12, 40]))
    case = random_case(rng, b=6, p=5, n=12, vocab=vocab, num_groups=int(rng.integers(1, 4)))
    got = ngram_propose(*case, max_ngram=max_ngram, min_ngram=min_ngram, depth=depth)
    expect = reference_propose(*case, max_ngram, min_ngram, depth)
    np.testing.assert_array_equal(np.asarray(got[1]), expect[1], err_msg=f"lengths, trial {trial}")
    np.testing.assert_array_equal(np.asarray(got[0]), expect[0], err_msg=f"draft, trial {trial}")
    live = case[4] >= 0
    stats["no_match"] += int(np.sum(live & (expect[1] == 0)))
    stats["short"] += int(np.sum((expect[1] > 0) & (expect[1] < depth)))
    own_only = reference_propose(*case[:4], np.where(live, np.arange(len(live)), -1),
                                 max_ngram, min_ngram, depth)[1]
    stats["sibling_only"] += int(np.sum((expect[1] > 0) & (own_only == 0)))
  assert all(v > 0 for v in stats.values()), stats  # the random cases cover every branch


def test_proposes_a_siblings_phrase():
  # Group 0: rows 0 and 2 share the prompt [7, 8]; row 1 is another group, row 3 is padding.
  prompt = np.array([[7, 8, 0], [7, 8, 0], [7, 8, 0], [7, 8, 0]], np.int32)
  plen = np.array([2, 2, 2, 2], np.int32)
  gen = np.array([[1, 2, 3, 4, 5, 6, 9, 11],  # the sibling wrote "3 4 5 6 ..." after "1 2"
                  [1, 2, 3, 1, 2, 0, 0, 0],   # other group: ends "1 2", matches its own past
                  [5, 1, 2, 0, 0, 0, 0, 0],   # ends "1 2", never followed by anything in itself
                  [1, 2, 3, 4, 5, 6, 7, 8]],  # padding row: never searched, never drafts
                 np.int32)
  glen = np.array([8, 5, 3, 8], np.int32)
  gid = np.array([0, 1, 0, -1], np.int32)
  draft, draft_len = ngram_propose(prompt, plen, gen, glen, gid, max_ngram=3, min_ngram=1, depth=4)
  np.testing.assert_array_equal(np.asarray(draft_len), [0, 3, 4, 0])  # "11" never recurs
  np.testing.assert_array_equal(np.asarray(draft[2]), [3, 4, 5, 6])  # sibling row 0's phrase
  np.testing.assert_array_equal(np.asarray(draft[1]), [3, 1, 2, 0])  # own match, 3 tokens left
  np.testing.assert_array_equal(np.asarray(draft)[[0, 3]], 0)


def test_own_most_recent_beats_sibling_and_longer_suffix_wins():
  prompt = np.zeros((2, 1), np.int32)
  plen = np.zeros((2,), np.int32)
  gen = np.array([[4, 1, 5, 1, 6, 2, 1],    # own: "1" followed by 5 then (more recently) 6
                  [2, 1, 7, 7, 7, 0, 0]],   # sibling: "2 1" followed by 7 7 7
                 np.int32)
  glen = np.array([7, 5], np.int32)
  gid = np.array([3, 3], np.int32)
  draft, draft_len = ngram_propose(prompt, plen, gen, glen, gid, max_ngram=2, min_ngram=1, depth=3)
  np.testing.assert_array_equal(np.asarray(draft[0]), [7, 7, 7])  # n=2 in the sibling wins
  assert int(draft_len[0]) == 3
  draft, _ = ngram_propose(prompt, plen, gen, glen, gid, max_ngram=1, min_ngram=1, depth=3)
  np.testing.assert_array_equal(np.asarray(draft[0]), [6, 2, 1])  # n=1: own, most recent


def test_the_engine_s_ngram_kind_drafts_from_a_row_s_siblings():
  """``kinds.NgramKind`` (what the engine's n-gram steps call) searches the rows of the decode
  state's prompt group: row 1 has only just started and drafts its sibling's continuation."""
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout.decode.kinds import KINDS, DrafterKind  # pylint: disable=import-outside-toplevel
  from tlt_jax.rollout.decode.speculative import SpecConfig  # pylint: disable=import-outside-toplevel
  state = SimpleNamespace(
      prompt_tokens=jnp.array([[5, 6, 0], [5, 6, 0]], jnp.int32),
      prompt_lens=jnp.array([2, 2], jnp.int32),
      tokens=jnp.array([[7, 8, 9, 10, 0], [7, 0, 0, 0, 0]], jnp.int32),
      num_generated=jnp.array([4, 1], jnp.int32), last_token=jnp.array([10, 7], jnp.int32),
      group_id=jnp.array([0, 0], jnp.int32), row_id=jnp.array([0, 1], jnp.int32),
      done=jnp.array([False, False]))
  drafted = KINDS[DrafterKind.NGRAM].draft(
      SimpleNamespace(free=NgramConfig(max_ngram=3, depth=4)), None, None, state, None,
      SimpleNamespace(members=[SpecConfig(4, 1, 5)]), 0)
  np.testing.assert_array_equal(np.asarray(drafted.draft.draft_len), [0, 3])
  np.testing.assert_array_equal(np.asarray(drafted.draft.tokens[1, :4]), [7, 8, 9, 10])


def test_no_recompile_across_values_and_runs_in_while_loop():
  rng = np.random.default_rng(0)
  cases = [random_case(rng, b=8, p=6, n=16, vocab=4, num_groups=2) for _ in range(3)]
  ngram_propose(*cases[0], max_ngram=3, min_ngram=1, depth=4)
  before = compile_count()
  for case in cases[1:]:
    jax.block_until_ready(ngram_propose(*case, max_ngram=3, min_ngram=1, depth=4))
  assert compile_count() == before

  prompt, plen, gen, glen, gid = cases[0]
  glen = np.minimum(glen, 4)

  @jax.jit
  def accept_all(gen, glen):
    """Appends each row's first drafted token (or token 0) until every row is full."""
    def body(state):
      gen, glen = state
      draft, draft_len = ngram_propose(prompt, plen, gen, glen, gid, max_ngram=3, depth=4)
      tok = jnp.where(draft_len > 0, draft[:, 0], 0)
      gen = gen.at[jnp.arange(gen.shape[0]), jnp.minimum(glen, gen.shape[1] - 1)].set(tok)
      return gen, jnp.minimum(glen + 1, gen.shape[1])
    return jax.lax.while_loop(lambda s: jnp.any(s[1] < s[0].shape[1]), body, (gen, glen))

  out, out_len = accept_all(gen, glen)
  assert out.shape == gen.shape and np.all(np.asarray(out_len) == gen.shape[1])


@pytest.mark.parametrize("kwargs, field", [
    ({"max_ngram": 0}, "max_ngram"), ({"depth": -1}, "depth"), ({"min_ngram": 1.5}, "min_ngram"),
    ({"min_ngram": 5, "max_ngram": 4}, "min_ngram")])
def test_config_validation_names_the_field(kwargs, field):
  with pytest.raises(ValueError, match=f"NgramConfig.{field}"):
    NgramConfig(**kwargs)
  assert NgramConfig() == NgramConfig(max_ngram=4, min_ngram=1, depth=8)
