"""Sampled speculative decoding reaches every draft level and the bonus token after a fully
accepted draft, and its output still has the target's exact law.

A 1-layer target over 8 tokens with drafters close to it (acceptance high, but not 1), depth-3
chain and tree strategies, and 6 tokens per row (the prefill token + depth + 2): several
speculative steps run per row, so every draft level and the full-acceptance bonus land at
several positions. The engine's samples are compared with the exact law (every sequence scored
by the target's own logits): each position's marginal and the joint of every 2 and 3 adjacent
positions, by chi-square with Bonferroni over the windows and fixed seeds. The cases include
stop ids (rows end inside accepted drafts), top-k/top-p, and live-row compaction (rows move
from the 4096 to the 512 bucket mid-decode).
"""

import jax
import numpy as np
import pytest

from tests.helpers import RoundRobin, mirror_drafter, sharp_random_model
from tests.stats import (exact_logprobs, exact_sequences, padded, prefix_logits,
                         sampled_logprobs_error, window_pvalues)
from tlt_jax.drafter.warmup import warm_up_drafter
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.instances import with_compute_dtype
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.speculative import SpecConfig

VOCAB, PROMPT, HORIZON, SAMPLES = 8, [1, 5, 2], 6, 32768
WIDTHS = (1, 2, 3)  # windows of adjacent positions tested: 6 + 5 + 4 = 15 per case
ALPHA = 1e-3  # false-alarm rate of one case (Bonferroni over its windows)
STOP = 3  # ends about 45% of the rows within HORIZON tokens, never the prefill token
STRATEGIES = {"chain": SpecConfig(3, 1, 4), "tree": SpecConfig(3, 2, 11),
              "chain-reduced": SpecConfig(3, 1, 4), "tree-reduced": SpecConfig(3, 2, 11),
              "chain-eagle3": SpecConfig(3, 1, 4), "tree-eagle3": SpecConfig(3, 2, 11)}
# A reduced draft vocabulary (EAGLE-3 / FR-Spec): the drafter never proposes tokens 0 and 7
# (q = 0 there), yet the output law must stay the target's.
DRAFT_VOCAB = (1, 2, 3, 4, 5, 6)
CASES = {  # strategy, SamplingParams fields (none of which recompiles)
    "chain-plain": ("chain", dict(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=())),
    "chain-topk-topp-stop": ("chain", dict(temperature=0.8, top_k=5, top_p=0.9,
                                           stop_token_ids=(STOP,))),
    "tree-plain": ("tree", dict(temperature=0.7, top_k=0, top_p=1.0, stop_token_ids=())),
    "tree-topk-topp-stop": ("tree", dict(temperature=0.8, top_k=5, top_p=0.9,
                                         stop_token_ids=(STOP,))),
    # an EAGLE-3 drafter (several target layers, its own head), trained briefly on the target
    "chain-eagle3-plain": ("chain-eagle3", dict(temperature=1.0, top_k=0, top_p=1.0,
                                                stop_token_ids=())),
    "tree-eagle3-topk-topp-stop": ("tree-eagle3", dict(temperature=0.8, top_k=5, top_p=0.9,
                                                       stop_token_ids=(STOP,))),
    "chain-reduced-stop": ("chain-reduced", dict(temperature=1.0, top_k=0, top_p=1.0,
                                                 stop_token_ids=(STOP,))),
    "tree-reduced-topk-topp": ("tree-reduced", dict(temperature=0.8, top_k=5, top_p=0.9,
                                                    stop_token_ids=())),
    # the adaptive engine switching strategy every step: vanilla, the chain, the tree, ...
    "adaptive-switching-stop": ("adaptive", dict(temperature=0.9, top_k=0, top_p=1.0,
                                                 stop_token_ids=(STOP,))),
}


def noisy_mirror(target, sigma: float = 0.15, seed: int = 7):
  """``mirror_drafter`` with noise on its input projection: drafts are still mostly accepted,
  but its distribution differs from the target's, so acceptance probabilities spread over
  (0, 1) and the accept/reject draw at every level matters."""
  drafter = mirror_drafter(target)
  kernel = drafter.fc.kernel.get_value()
  drafter.fc.kernel.set_value(kernel + sigma * jax.random.normal(jax.random.key(seed),
                                                                 kernel.shape, kernel.dtype))
  return drafter


@pytest.fixture(scope="module")
def setup():
  """The target, every sequence's logits by enumeration, and engines built on first use."""
  target = sharp_random_model(ModelConfig.tiny(vocab_size=VOCAB, num_layers=1), seed=2, scale=3.0)
  return target, prefix_logits(target, PROMPT, HORIZON), {}


def trained_eagle3(target, steps: int = 40):
  """An EAGLE-3 drafter trained ``steps`` steps on 256 of the target's own samples: about 3 in 4
  depth-3 chains are fully accepted, and the rest reject at every level."""
  engine = RolloutEngine(target, config=EngineConfig(max_batch=256, max_prompt_len=4,
                                                      max_new_tokens=12, prefill_buckets=(4,)))
  result = engine.generate([PROMPT] * 256, SamplingParams(max_new_tokens=12, temperature=1.0,
                                                          seed=1, stop_token_ids=()))
  drafter, _ = warm_up_drafter(target, [PROMPT + t for t in result.tokens], [len(PROMPT)] * 256,
                               steps=steps, row_len=16, batch_rows=16, learning_rate=3e-3,
                               drafter=Eagle3Drafter.for_target(target), evaluate=False)
  return drafter


@pytest.fixture(scope="module")
def setup_bf16(setup):
  """``setup``'s target computing in bfloat16 (its params stay float32), the exact law of its
  own bf16 logits, and its engines."""
  target = with_compute_dtype(setup[0], "bfloat16")
  return target, prefix_logits(target, PROMPT, HORIZON), {}


def engine_for(setup, strategy):
  target, _, engines = setup
  if strategy not in engines:
    if strategy.endswith("eagle3"):
      drafter = engines.get("eagle3 drafter") or trained_eagle3(target)
      engines["eagle3 drafter"] = drafter
    else:
      drafter = noisy_mirror(target) if strategy.startswith("chain") else mirror_drafter(target)
    if strategy.endswith("reduced"):
      drafter.set_draft_vocab(target, DRAFT_VOCAB)
    shape = dict(max_batch=4096, batch_buckets=(512, 4096), max_prompt_len=4,
                 max_new_tokens=HORIZON, prefill_buckets=(4,), compaction=True)
    if strategy == "adaptive":  # one step per segment; round robin over vanilla and SD
      engines[strategy] = RolloutEngine(target, drafter=noisy_mirror(target), config=EngineConfig(
          **shape, strategies=(STRATEGIES["chain"], STRATEGIES["tree"]), segment_steps=1,
          sd_max_batch=4096), tuner=RoundRobin())
    else:
      engines[strategy] = RolloutEngine(target, drafter=drafter, config=EngineConfig(
          **shape, spec=STRATEGIES[strategy]))
  return engines[strategy]


def exact_case(setup, case):
  """``(logp, seqs, probs, symbols)``: the case's filtered log-probs and exact law."""
  _, (prefixes, logits), _ = setup
  kw = CASES[case][1]
  logp = exact_logprobs(logits, kw["temperature"], kw["top_k"], kw["top_p"])
  seqs, probs = exact_sequences(prefixes, logp, kw["stop_token_ids"])
  return logp, seqs, probs, VOCAB + 1 if kw["stop_token_ids"] else VOCAB


def family_pvalues(samples, seqs, probs, symbols):
  """p-values of every tested window of ``samples [N, HORIZON]`` against the exact law."""
  pvalues = {}
  for width in WIDTHS:
    pvalues.update(window_pvalues(samples, seqs, probs, symbols, width))
  return pvalues


def rejects(pvalues) -> bool:
  return min(pvalues.values()) * len(pvalues) <= ALPHA


# the fast tier runs the plain chain (every level, the bonus) with an EAGLE-1 drafter; the full
# tier every case (the EAGLE-3 drafter's included: the verifier is the same whatever drafted)
FAST_TIER_CASES = ("chain-plain",)


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=() if c in FAST_TIER_CASES else pytest.mark.slow) for c in CASES])
def test_every_draft_level_and_bonus_keep_the_target_law(setup, case):
  strategy, kw = CASES[case]
  result = engine_for(setup, strategy).generate([PROMPT] * SAMPLES, SamplingParams(
      max_new_tokens=HORIZON, seed=11, **kw))
  logp, seqs, probs, symbols = exact_case(setup, case)
  pvalues = family_pvalues(padded(result.tokens, HORIZON, VOCAB), seqs, probs, symbols)
  worst = min(pvalues, key=pvalues.get)
  assert not rejects(pvalues), (
      f"positions {worst[0]}..{sum(worst) - 1}: p = {pvalues[worst]:.3g} over {len(pvalues)} "
      f"windows; all: {pvalues}")
  # the reported log-probs are the target's filtered ones, drafts and bonus tokens alike
  assert sampled_logprobs_error(result.tokens, result.logprobs, logp) < 1e-4
  # Coverage. accept_hist[i] counts live-row steps that emitted i + 1 tokens: full acceptance
  # (depth drafts + the bonus after them) must be common.
  s = result.stats
  hist = np.asarray(s.accept_hist, np.float64)
  assert hist[-1] / hist.sum() > 0.1, hist
  # At most one bonus token per live-row step, so over a third of the decoded tokens are
  # accepted drafts: many of the stop ids sampled in the stop cases end a row inside a draft.
  # (A third of the adaptive case's steps are vanilla steps, which emit one token each.)
  assert 1 - s.live_row_steps / (s.tokens - SAMPLES) > (
      0.25 if strategy == "adaptive" else 0.33), s
  assert {batch for batch, *_ in s.segments} == {512, 4096}  # rows were compacted
  if strategy == "adaptive":  # every strategy decoded, and SD followed vanilla many times
    assert {name for *_, name in s.segments} == {"vanilla", "chain d3", "tree d3 k2 v11"}
    assert s.switches >= 8
    return  # the strategy sequence differs between calls: no row-by-row comparison below
  if kw["stop_token_ids"]:
    assert 0.3 < result.finish_reasons.count("stop") / SAMPLES < 0.7
    # Every draw is keyed by (row, position), so without stop ids the first rows sample the
    # same tokens and simply go on: each stopped row is exactly that row cut after its stop.
    free = engine_for(setup, strategy).generate([PROMPT] * 4096, SamplingParams(
        max_new_tokens=HORIZON, seed=11, **dict(kw, stop_token_ids=())))
    for row, (tokens, logprobs) in enumerate(zip(free.tokens, free.logprobs)):
      end = tokens.index(STOP) + 1 if STOP in tokens else HORIZON
      assert result.tokens[row] == tokens[:end], row
      assert result.finish_reasons[row] == ("stop" if STOP in tokens else "length"), row
      np.testing.assert_allclose(result.logprobs[row], logprobs[:end], atol=1e-5)


@pytest.mark.slow  # 32k samples per case: the full tier (fast-tier bf16 checks: test_bf16.py)
@pytest.mark.parametrize("case", ["chain-plain", "tree-topk-topp-stop"])
def test_bf16_compute_keeps_the_target_law(setup_bf16, case):
  """Mixed precision (float32 params, bf16 arithmetic and KV cache): the sampled law is the bf16
  target's at every draft level and the bonus, and the log-probs reported are its own."""
  strategy, kw = CASES[case]
  engine = engine_for(setup_bf16, strategy)
  assert engine.pool.state_spec(512, engine.config.cache_len).cache.k[0].dtype == "bfloat16"
  result = engine.generate([PROMPT] * SAMPLES, SamplingParams(max_new_tokens=HORIZON, seed=11,
                                                              **kw))
  logp, seqs, probs, symbols = exact_case(setup_bf16, case)
  pvalues = family_pvalues(padded(result.tokens, HORIZON, VOCAB), seqs, probs, symbols)
  assert not rejects(pvalues), pvalues
  assert sampled_logprobs_error(result.tokens, result.logprobs, logp) < 1e-2
  hist = np.asarray(result.stats.accept_hist, np.float64)
  assert hist[-1] / hist.sum() > 0.1, hist


@pytest.mark.parametrize("case", ["chain-plain", "tree-topk-topp-stop"])
def test_chi_square_family_detects_a_one_percent_shift_in_a_real_joint(setup, case):
  """Power of the test above at its sample size, on the case's exact law: for each pair of
  adjacent positions (k, k + 1), move 1% of probability from the likeliest pair of tokens to
  the second likeliest (scaling the sequences that contain them), draw SAMPLES sequences and
  run the same 15-window family. Most trials must reject; unbiased draws must not."""
  _, seqs, probs, symbols = exact_case(setup, case)
  rng = np.random.default_rng(0)
  draw = lambda p: seqs[np.repeat(np.arange(len(p)), rng.multinomial(SAMPLES, p))]
  trials, rejected = 6, 0
  for k in range(HORIZON - 1):
    pair = seqs[:, k] * symbols + seqs[:, k + 1]
    pair_probs = np.bincount(pair, weights=probs, minlength=symbols ** 2)
    top, second = np.argsort(pair_probs)[::-1][:2]
    biased = probs.copy()
    biased[pair == top] *= (pair_probs[top] - 0.01) / pair_probs[top]
    biased[pair == second] *= (pair_probs[second] + 0.01) / pair_probs[second]
    rejected += sum(rejects(family_pvalues(draw(biased), seqs, probs, symbols))
                    for _ in range(trials))
  assert rejected >= 2 / 3 * trials * (HORIZON - 1), rejected
  assert sum(rejects(family_pvalues(draw(probs), seqs, probs, symbols)) for _ in range(10)) == 0
