"""The suffix drafter: its lookup against a plain-Python reference of the documented rules, and
speculative decoding drafted from the rollout's history is lossless (greedy identity, coupled
mode's exact tokens, chi-square on every draft level with stop ids), compiles nothing after
precompile, and splits over devices like any rollout."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import mirror_drafter, sharp_random_model
from tests.stats import exact_logprobs, exact_sequences, padded, prefix_logits, window_pvalues
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.ngram import contexts
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.decode.suffix import NO_DRAFT, SOURCES, SuffixConfig, pack_history, suffix_draft
from tlt_jax.utils import FieldError

PRIORITY = {"history": 3, "group": 2, "self": 1, "prompt": 0}


# ---- the lookup against a reference ------------------------------------------------------------
def reference(ctx, plen, group, hist, remaining, cfg, spec, width):
  """Per row: the branches ``[(tokens, source)]`` the documented rules give (``width``: the
  context axis, which orders occurrences of equal rank)."""
  out = []
  b = len(ctx)
  for row in range(b):
    if group[row] < 0:
      out.append([])
      continue
    own = ctx[row]
    occ = []  # (m, follow, priority, recency, flat index, next token, continuation, source)

    def match(seq, e):
      m = 0
      while (m < cfg.max_ngram and e - m >= 0 and len(own) - 1 - m >= 0 and seq[e - m] >= 0
             and seq[e - m] == own[len(own) - 1 - m]):
        m += 1
      return m
    members = [r for r in range(b) if group[r] == group[row]]
    if b > cfg.max_group:  # itself and the first max_group rows of its group
      members = sorted({row, *members[:cfg.max_group]})
    for r in members:
      seq = ctx[r]
      for e in range(len(seq) - 1):
        if r != row and e < plen[r]:
          continue
        m = match(seq, e)
        if m < cfg.min_ngram:
          continue
        source = ("prompt" if e < plen[r] else "self") if r == row else "group"
        cont = seq[e + 1:e + 1 + spec.depth]
        occ.append((m, len(cont), PRIORITY[source], e, r * width + e, seq[e + 1], cont, source))
    h = hist[row]
    for e in range(len(h) - 1):
      if h[e] < 0 or h[e + 1] < 0:
        continue
      m = match(h, e)
      if m < cfg.min_ngram:
        continue
      cont = []
      for t in h[e + 1:]:
        if t < 0 or len(cont) == spec.depth:
          break
        cont.append(t)
      occ.append((m, len(cont), 3, len(h) - e, b * width + e, h[e + 1], cont, "history"))
    picks, left = [], list(occ)
    for _ in range(max(cfg.candidates, spec.topk)):
      if not left:
        break
      best = max(left, key=lambda o: (o[:4], -o[4]))
      support = sum(1 for o in occ if o[5] == best[5] and o[0] == best[0])
      picks.append((best, support))
      left = [o for o in left if o[5] != best[5]]
    picks.sort(key=lambda p: (-p[0][0], -p[1], tuple(-x for x in p[0][:4])))
    budget = min(max(remaining[row] - 1, 0), spec.depth)
    slots, branches = spec.verify_tokens - 1, []
    for best, _ in picks[:spec.topk]:
      n = min(len(best[6]), budget, slots)
      slots -= n
      if n:
        branches.append((list(best[6][:n]), best[7]))
    out.append(branches)
  return out


def branches_of(drafted, row):
  """The branches ``[(tokens, source)]`` of one row of a ``SuffixDraft``, first child first."""
  d = drafted.draft
  tokens, children = np.asarray(d.tokens[row]), np.asarray(d.children[row])
  depth, source = np.asarray(d.depth[row]), np.asarray(drafted.node_source[row])
  longest = int(d.draft_len[row])  # a chain's children run on past its draft; a tree's end
  out = []
  for first in (children[0] if longest else ()):
    if first < 0:
      continue
    node, seq = int(first), []
    while node >= 0 and len(seq) < longest:
      assert depth[node] == len(seq) + 1  # each node one level below its parent
      seq.append(int(tokens[node]))
      node = int(children[node][0])
    out.append((seq, SOURCES[int(source[int(first)])]))
  return out


def random_case(rng, vocab, b, groups):
  plen = rng.integers(1, 5, b)
  prompts_of_group = {g: rng.integers(0, vocab, 4).tolist() for g in range(groups)}
  group = rng.integers(0, groups, b)
  group[rng.random(b) < 0.15] = -1  # padding rows
  ctx = []
  for row in range(b):
    prompt = prompts_of_group[max(group[row], 0)][:plen[row]] if group[row] >= 0 else [0]
    plen[row] = len(prompt)
    ctx.append(prompt + rng.integers(0, vocab, rng.integers(1, 9)).tolist())
  hist = [pack_history([rng.integers(0, vocab, rng.integers(1, 7)).tolist()
                        for _ in range(rng.integers(0, 4))], 16) for _ in range(b)]
  return ctx, plen, group, hist, rng.integers(1, 12, b)


@pytest.mark.parametrize("spec, max_group", [
    (SpecConfig(4, 1, 5), 16), (SpecConfig(3, 3, 7), 16), (SpecConfig(2, 2, 5), 16),
    (SpecConfig(4, 1, 5), 2), (SpecConfig(3, 3, 7), 1)],
    ids=["chain", "tree-3-shared", "tree-2-full", "chain-window-2", "tree-window-1"])
def test_lookup_follows_the_documented_rules(spec, max_group):
  cfg = SuffixConfig(max_ngram=3, min_ngram=1, depth=spec.depth, history_len=16,
                     max_group=max_group)
  rng = np.random.default_rng(0)
  checked = 0
  for case in range(40):
    vocab = 3 if case % 2 else 5  # few tokens: many matches, ties and shared next tokens
    ctx, plen, group, hist, remaining = random_case(rng, vocab, 6, 2)
    width = 4 + 8
    prompt_arr = np.zeros((6, 4), np.int32)
    gen_arr = np.zeros((6, 8), np.int32)
    glen = np.zeros(6, np.int32)
    for r, c in enumerate(ctx):
      prompt_arr[r, :plen[r]] = c[:plen[r]]
      gen_arr[r, :len(c) - plen[r]] = c[plen[r]:]
      glen[r] = len(c) - plen[r]
    c, cl = contexts(jnp.asarray(prompt_arr), jnp.asarray(plen), jnp.asarray(gen_arr),
                     jnp.asarray(glen))
    assert c.shape[1] == width
    root = jnp.asarray([x[-1] for x in ctx], jnp.int32)
    drafted = suffix_draft(c, cl, jnp.asarray(plen), jnp.asarray(group, jnp.int32),
                           jnp.asarray(np.stack(hist)), jnp.asarray(remaining), root, cfg, spec)
    want = reference(ctx, plen, group, hist, remaining, cfg, spec, width)
    for row in range(6):
      got = branches_of(drafted, row)
      assert got == want[row], (case, row, ctx[row], hist[row], got, want[row])
      assert int(drafted.draft.tokens[row, 0]) == ctx[row][-1]  # the root is the newest token
      checked += bool(want[row])
      if not want[row]:
        assert int(drafted.draft.draft_len[row]) == 0
        assert int(drafted.match_len[row]) == 0
  assert checked > 100  # most rows drafted something


def test_a_tree_hedges_with_distinct_first_tokens_in_the_slots_the_first_branch_leaves():
  cfg = SuffixConfig(max_ngram=2, depth=4, history_len=24)
  spec = SpecConfig(4, 3, 7)  # 6 draft slots for up to 3 branches of up to 4 levels
  # the row ends with 5 6; history continues 5 6 with 7 8 9 (twice) and with 1 2 (once)
  hist = pack_history([[5, 6, 7, 8, 9], [5, 6, 1, 2], [5, 6, 7, 8, 9]], 24)
  c, cl = contexts(jnp.asarray([[5]]), jnp.asarray([1]), jnp.asarray([[6, 0]]), jnp.asarray([1]))

  def draft(remaining):
    return suffix_draft(c, cl, jnp.asarray([1]), jnp.asarray([0]), jnp.asarray(hist[None]),
                        jnp.asarray([remaining]), jnp.asarray([6]), cfg, spec)
  got = draft(50)
  # the most supported continuation first (two completions agree on 7), then the hedge
  assert branches_of(got, 0) == [([7, 8, 9], "history"), ([1, 2], "history")]
  assert sorted(np.asarray(got.draft.tokens[0, 1:6]).tolist()) == [1, 2, 7, 8, 9]
  assert int(got.match_len[0]) == 2
  # near its length limit a row drafts no further than it can emit
  assert branches_of(draft(3), 0) == [([7, 8], "history"), ([1, 2], "history")]
  assert branches_of(draft(1), 0) == []


def test_pack_history_newest_first_separated_and_cut():
  np.testing.assert_array_equal(pack_history([[1, 2], [3]], 6), [1, 2, -1, 3, -1, -1])
  np.testing.assert_array_equal(pack_history([[1, 2, 3, 4], [5, 6]], 6), [1, 2, 3, 4, -1, 5])
  np.testing.assert_array_equal(pack_history([], 3), [-1, -1, -1])


# ---- decoding with history is lossless ---------------------------------------------------------
STOPS = (3, 4, 5, 6)
BASE = dict(max_batch=4, max_prompt_len=16, max_new_tokens=40, prefill_buckets=(16,),
            sd_max_batch=4)
SUFFIX = SuffixConfig(max_ngram=3, depth=4, history_len=96)
CHAIN, TREE = SpecConfig(4, 1, 5), SpecConfig(4, 3, 9)


def only(arm):
  """A fixed tuner that runs ``arm`` in every bucket."""
  return dict(kind="fixed", fixed=((4, arm),))


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=1)


@pytest.fixture(scope="module")
def engines(target):
  cache = {}

  def get(name):
    if name not in cache:
      if name == "vanilla":
        cache[name] = RolloutEngine(target, config=EngineConfig(**BASE))
      else:
        spec = CHAIN if name == "chain" else TREE
        arm = "suffix d4" if name == "chain" else "suffix d4 k3 v9"
        cache[name] = RolloutEngine(target, suffix=SUFFIX, config=EngineConfig(
            **BASE, suffix_strategies=(spec,), tuner=only(arm)))
    return cache[name]
  return get


def grouped_prompts(seed=0):
  rng = np.random.default_rng(seed)
  return [p for p in (rng.integers(7, 32, n).tolist() for n in (5, 9, 3)) for _ in range(2)]


@pytest.mark.parametrize("name", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_greedy_with_history_and_group_drafts_equals_vanilla(engines, name):
  prompts = grouped_prompts()
  greedy = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  want = engines("vanilla").generate(prompts, greedy)
  engine = engines(name)
  rng = np.random.default_rng(1)
  histories = {
      "none": None,
      # earlier completions that are the greedy ones: every draft is accepted, stops included
      "exact": [[w] for w in want.tokens],
      # wrong earlier completions: drafts are rejected, the output must not move
      "wrong": [[rng.integers(0, 32, 30).tolist(), rng.integers(0, 32, 10).tolist()]
                for _ in prompts],
  }
  for label, history in histories.items():
    got = engine.generate(prompts, greedy, history=history)
    assert got.tokens == want.tokens, label
    assert got.finish_reasons == want.finish_reasons, label
    for a, b in zip(got.logprobs, want.logprobs):
      np.testing.assert_allclose(a, b, atol=1e-4)
    by_source = got.stats.accept_by_source()
    if label == "exact":
      assert by_source["history"] > 4.0, by_source  # nearly every step accepts all 4 drafts
      assert "stop" in got.finish_reasons  # so stop ids were met inside accepted drafts
    if label == "none":
      assert "history" not in by_source and got.stats.source_steps.get("group", 0) > 0


@pytest.mark.slow
def test_coupled_mode_emits_vanilla_sampling_tokens_with_history(target):
  prompts = grouped_prompts(3)
  sampled = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, stop_token_ids=STOPS)
  want = RolloutEngine(target, config=EngineConfig(**BASE)).generate(prompts, sampled)
  earlier = RolloutEngine(target, config=EngineConfig(**BASE)).generate(
      prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=6, stop_token_ids=STOPS))
  for spec, arm in ((CHAIN, "suffix d4"), (TREE, "suffix d4 k3 v9")):
    engine = RolloutEngine(target, suffix=SUFFIX, config=EngineConfig(
        **BASE, suffix_strategies=(spec,), tuner=only(arm), verify="coupled"))
    got = engine.generate(prompts, sampled, history=[[w] for w in want.tokens])
    assert got.tokens == want.tokens
    assert got.stats.accept_by_source()["history"] > 3.0
    got = engine.generate(prompts, sampled, history=[[e] for e in earlier.tokens])
    assert got.tokens == want.tokens


@pytest.mark.slow
def test_nothing_compiles_after_precompile_with_history(engines):
  engine = engines("tree")
  engine.precompile()
  prompts = grouped_prompts(2)
  for temperature in (0.0, 1.0):
    result = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=temperature,
                                                     stop_token_ids=STOPS),
                             history=[[p[:4], p] for p in prompts])
    assert result.stats.compiles == 0


def test_bad_history_and_bad_suffix_configs_are_rejected(engines, target):
  engine = engines("chain")
  prompts = grouped_prompts()
  with pytest.raises(ValueError, match=r"one list of earlier completions per prompt \(6\)"):
    engine.generate(prompts, history=[[]])
  with pytest.raises(ValueError, match=r"history\[1\]\[0\] must be a list of token ids in \[0, 32\)"):
    engine.generate(prompts, history=[[], [[1, 99]], [], [], [], []])
  with pytest.raises(ValueError, match=r"history\[4\]\[1\] must be a list of token ids"):
    engine.generate(prompts, history=[[], [[1, 2]], [], [], [[3], [4, -1], [5]], []])
  stored = np.array([3, 4, 5], np.int32)  # the trainer's store hands out its own arrays: no copy
  checked = engine.check_history([[stored], [[1, 2]]], 2, observe=False)
  assert checked[0][0] is stored and checked[1][0].dtype == np.int32
  with pytest.raises(FieldError, match="suffix_strategies.*no suffix drafter"):
    RolloutEngine(target, config=EngineConfig(**BASE, suffix_strategies=(CHAIN,)))
  with pytest.raises(ValueError, match="a suffix tree has topk=2 branches"):
    EngineConfig(**BASE, suffix_strategies=(SpecConfig(4, 2, 4),))
  with pytest.raises(ValueError, match="min_ngram"):
    SuffixConfig(max_ngram=2, min_ngram=3)
  with pytest.raises(TypeError, match="SuffixConfig"):
    RolloutEngine(target, suffix={"depth": 4})
  # a vanilla engine has no use for history and ignores it
  assert not engines("vanilla").uses_history and engine.uses_history


def test_a_learned_drafter_and_the_suffix_drafter_share_one_engine(target):
  """Arms of both drafters in one adaptive engine; rows move between them (the learned drafter
  catches up on what suffix steps emitted), and greedy output stays vanilla's."""
  shallow = sharp_random_model(ModelConfig.tiny(vocab_size=32, num_layers=1), seed=1)
  engine = RolloutEngine(shallow, drafter=mirror_drafter(shallow), suffix=SUFFIX,
                         config=EngineConfig(**BASE, strategies=(SpecConfig(3, 1, 4),),
                                             suffix_strategies=(CHAIN,), segment_steps=2,
                                             tuner=dict(kind="fixed",
                                                        fixed=((2, "chain d3"), (4, "suffix d4")))))
  assert [s.name for s in engine.strategies_for(4)] == ["vanilla", "chain d3", "suffix d4"]
  prompts = grouped_prompts(4)
  greedy = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=STOPS)
  want = RolloutEngine(shallow, config=EngineConfig(**BASE)).generate(prompts, greedy)
  got = engine.generate(prompts, greedy, history=[[w[:10]] for w in want.tokens])
  assert got.tokens == want.tokens
  arms = {name for *_, name in got.stats.segments}
  assert {"chain d3", "suffix d4"} <= arms, arms
  assert got.stats.catchups > 0  # the learned drafter caught up after suffix segments
  assert {"learned", "history"} <= set(got.stats.accept_by_source())


# ---- sampled: the target's exact law at every draft level ------------------------------------
VOCAB, PROMPT, HORIZON, SAMPLES = 8, [1, 5, 2], 6, 16384
STOP = 3


@pytest.mark.parametrize("spec, temperature, stops", [
    pytest.param(SpecConfig(3, 1, 4), 1.0, (), marks=pytest.mark.slow),
    (SpecConfig(3, 1, 4), 0.3, (STOP,)),  # the fast tier's case
    pytest.param(SpecConfig(3, 3, 6), 0.5, (STOP,), marks=pytest.mark.slow),
], ids=["chain", "chain-stop-t0.3", "tree-stop-t0.5"])
def test_sampled_with_history_keeps_the_target_law(spec, temperature, stops):
  target = sharp_random_model(ModelConfig.tiny(vocab_size=VOCAB, num_layers=1), seed=2, scale=3.0)
  shape = dict(max_batch=512, batch_buckets=(128, 512), max_prompt_len=4, max_new_tokens=HORIZON,
               prefill_buckets=(4,), sd_max_batch=512)
  params = SamplingParams(max_new_tokens=HORIZON, temperature=temperature, seed=11,
                          stop_token_ids=stops)
  # earlier completions: the target's own samples (another seed), as RL history would be
  earlier = RolloutEngine(target, config=EngineConfig(**shape)).generate(
      [PROMPT] * 64, SamplingParams(max_new_tokens=HORIZON, temperature=temperature, seed=3,
                                    stop_token_ids=stops)).tokens
  arm = f"suffix d3" + ("" if spec.is_chain else f" k{spec.topk} v{spec.verify_tokens}")
  engine = RolloutEngine(target, suffix=SuffixConfig(max_ngram=2, depth=3, history_len=64),
                         config=EngineConfig(**shape, suffix_strategies=(spec,),
                                             tuner=dict(kind="fixed", fixed=((512, arm),))))
  result = engine.generate([PROMPT] * SAMPLES, params, history=[earlier[:8]] * SAMPLES)
  prefixes, logits = prefix_logits(target, PROMPT, HORIZON)
  logp = exact_logprobs(logits, temperature)
  seqs, probs = exact_sequences(prefixes, logp, stops)
  symbols = VOCAB + 1 if stops else VOCAB
  samples = padded(result.tokens, HORIZON, VOCAB)
  pvalues = {}
  for width in (1, 2, 3):
    pvalues.update(window_pvalues(samples, seqs, probs, symbols, width))
  assert min(pvalues.values()) * len(pvalues) > 1e-3, pvalues
  # every level is accepted, and fully accepted drafts (then the bonus) happen often enough to
  # weigh in the windows (the random 8-token target is flat at T=1: about 1 step in 400)
  hist = np.asarray(result.stats.accept_hist)
  assert hist[-1] >= 20 and np.all(hist > 0), hist
  assert result.stats.accept_by_source()["history"] > 1.2


def test_the_tuner_forgets_the_suffix_arms_only_when_the_share_with_history_moves(target,
                                                                                   monkeypatch):
  """A new epoch (the share of prompts with history moves by more than a quarter) re-opens the
  suffix arms; the next requests of that epoch do not, or they would be probed every step."""
  engine = RolloutEngine(target, suffix=SUFFIX, config=EngineConfig(  # fresh: no request seen
      **BASE, suffix_strategies=(CHAIN,), tuner=only("suffix d4")))
  told = []
  monkeypatch.setattr(engine.tuner, "observe_drafter",
                      lambda quality=None, source="learned", forget=False:
                      told.append((source, forget)))
  engine.observe_history([[[1, 2]], [[3]]])  # every prompt has history now: 0 -> 1
  engine.observe_history([[[4]], [[5, 6]]])  # still every prompt
  engine.observe_history([[[4]], [], [], []])  # a quarter: moved by 0.75
  engine.observe_history([[[4]], [[5]], [], []])  # a half: moved by 0.25 only
  assert told == [("suffix", True), ("suffix", True)]
