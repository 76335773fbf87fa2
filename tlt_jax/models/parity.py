"""Numerical parity of two models on the same tokens: log-prob differences, KL and greedy
agreement, against a second dtype or Hugging Face ``transformers``; where greedy decodings part.

A model in bf16 is never bit-equal to its float32 weights, and greedy speculative decoding in
bf16 may leave vanilla's tokens where two logits tie after rounding. These functions measure by
how much, so a check can tell rounding (small differences, ties) from a bug (large ones). They
import only the package's runtime dependencies; ``hf_reference_parity`` uses torch and
transformers when they import and otherwise says why it did not run.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from tlt_jax.models.transformer import Transformer


def teacher_forced_batch(prompts: list[list[int]], max_len: int) -> np.ndarray:
  """The prompts cut to one length (``max_len`` at most, the shortest prompt's at least), so
  that no position of the ``[B, T]`` batch holds padding."""
  length = min(max_len, min(len(p) for p in prompts))
  return np.array([p[:length] for p in prompts], np.int32)


def logits_of(model: Transformer, ids: np.ndarray, precision: str | None = None) -> np.ndarray:
  """``model``'s float32 logits ``[B, T, V]`` for ``ids``; ``precision="highest"`` runs float32
  matmuls at full precision (a GPU would otherwise use TF32)."""
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  if precision is None:
    return np.asarray(fn(state, ids))
  with jax.default_matmul_precision(precision):
    return np.asarray(fn(state, ids))


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """Log-probs of ``logits`` over the last axis, in float64."""
  x = logits.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logprobs(lp_ref: np.ndarray, lp: np.ndarray) -> dict:
  """How far the ``[B, T, V]`` log-probs ``lp`` are from the reference ``lp_ref``: the largest
  and mean absolute difference (overall, where the reference's probability exceeds 1e-3, at its
  top token), the KL divergence from the reference, and how often the two argmaxes agree (over
  all positions and over those where the reference's top-2 gap exceeds 0.1, the others being
  near-ties that rounding may flip)."""
  lp_ref, lp = lp_ref.astype(np.float64), lp.astype(np.float64)
  diff = np.abs(lp - lp_ref)
  p_ref = np.exp(lp_ref)
  likely = p_ref > 1e-3
  top_ref, top = lp_ref.argmax(-1), lp.argmax(-1)
  sorted_ref = np.sort(lp_ref, -1)
  clear = sorted_ref[..., -1] - sorted_ref[..., -2] > 0.1
  kl = np.sum(p_ref * (lp_ref - lp), -1)
  agree = top == top_ref
  return dict(
      positions=int(diff.shape[0] * diff.shape[1]),
      max_abs_logprob_diff=float(diff.max()),
      max_abs_logprob_diff_p_gt_1e3=float(diff[likely].max()),
      mean_abs_logprob_diff=float(diff.mean()),
      max_abs_top1_logprob_diff=float(np.take_along_axis(diff, top_ref[..., None], -1).max()),
      kl_mean=float(kl.mean()), kl_max=float(kl.max()),
      greedy_agreement=float(agree.mean()),
      greedy_agreement_margin_gt_0p1=float(agree[clear].mean()) if clear.any() else None,
      near_ties=int((~clear).sum()))


def logprob_parity(ref: Transformer, test: Transformer, ids: np.ndarray) -> dict:
  """``compare_logprobs`` of ``test``'s next-token log-probs on ``ids`` against ``ref``'s, the
  reference run at full matmul precision."""
  return compare_logprobs(log_softmax(logits_of(ref, ids, "highest")),
                          log_softmax(logits_of(test, ids)))


def hf_reference_parity(model32: Transformer, ids: np.ndarray) -> dict:
  """``model32``'s float32 log-probs on ``ids`` against those of Hugging Face transformers (on
  the CPU, float32) for the same weights, written through ``save_pretrained``; ``{"skipped":
  why}`` where torch or transformers is not installed."""
  for module in ("torch", "transformers"):
    if importlib.util.find_spec(module) is None:
      return {"skipped": f"'{module}' is not installed here"}
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.hf import save_pretrained  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    save_pretrained(model32, model32.config, tmp)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    hf_model.eval()
    with torch.no_grad():
      hf_logits = hf_model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
  ours = logits_of(model32, ids, "highest")
  out = compare_logprobs(log_softmax(hf_logits), log_softmax(ours))
  out.update(max_abs_logit_diff=float(np.abs(ours - hf_logits).max()),
             transformers_version=transformers.__version__, torch_version=torch.__version__,
             seconds=time.perf_counter() - t0)
  return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
  """The first index where two token lists differ (the shorter one's length where one extends
  the other; None where they are equal)."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def divergence_gaps(target: Transformer, prompts, reference, other, width: int,
                    most: int = 4) -> list[dict]:
  """Where the greedy completions ``other`` first leave the greedy ``reference`` (up to ``most``
  rows): both tokens' logits there, from one ``[most, width]`` forward of the reference path in
  the model's dtype (causal, so later tokens do not matter). A gap of 0 is an exact tie of the
  rounded logits, which different batch shapes may break either way; a large gap points at a
  bug, since greedy decoding must pick the argmax."""
  found = []
  for row, (a, b) in enumerate(zip(reference, other)):
    at = first_divergence(a, b)
    if at is not None and at < min(len(a), len(b)):
      found.append((row, at))
  if not found:
    return []
  found = found[:most]
  ids = np.zeros((most, width), np.int32)
  for i, (row, _) in enumerate(found):
    seq = (prompts[row] + reference[row])[:width]
    ids[i, :len(seq)] = seq
  logits = logits_of(target, ids)
  out = []
  for i, (row, at) in enumerate(found):
    pos = len(prompts[row]) + at - 1  # the logit that chose generated token ``at``
    want, got = reference[row][at], other[row][at]
    out.append(dict(row=row, position=at, vanilla_token=int(want), sd_token=int(got),
                    logit_vanilla_token=float(logits[i, pos, want]),
                    logit_sd_token=float(logits[i, pos, got]),
                    gap=float(abs(logits[i, pos, want] - logits[i, pos, got]))))
  return out
