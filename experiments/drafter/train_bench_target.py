"""Trains the small char-level target LM the drafter/RL experiments use, on ArithmeticTask traces.

  python -m experiments.drafter.train_bench_target [--steps 240] [--hidden 256] [--layers 6]
      [--out experiments/out/bench_target] [--seed 0]

A Qwen2-style decoder learns next-token cross-entropy on ``<bos> prompt solution <eos>``, the
loss taken on solution and EOS tokens only. Fresh problems are packed into fixed rows each step
(block-diagonal attention, positions restarting per problem), so the step compiles once. At the
end the model answers held-out problems greedily through ``RolloutEngine`` and the task reward
scores them. Writes an HF checkpoint (``config.json`` + safetensors), ``char_tokenizer.json``
with the char alphabet, and ``train_log.json`` (loss curve, timings, accuracy) to ``--out``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import numpy as np
import optax
from flax import nnx

from experiments import harness
from experiments.harness import (ArithmeticTask, CharTokenizer, ModelConfig, PackedStream,
                                 greedy_accuracy, hf, init_model, make_lm_step)

TOKENIZER_FILE = "char_tokenizer.json"  # not tokenizer.json: that name means an HF tokenizer


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--steps", type=int, default=240)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--rows", type=int, default=8, help="packed rows per step")
  parser.add_argument("--row-len", type=int, default=256)
  parser.add_argument("--ffn", type=int, default=2, help="MLP width as a multiple of --hidden")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--max-digits", type=int, default=12)
  parser.add_argument("--train-exponent", type=float, default=None,
                      help="Zipf exponent of operand sizes in training data (default: the task's); "
                           "a flatter law shows more long problems per step")
  parser.add_argument("--eval-problems", type=int, default=256)
  parser.add_argument("--out", default="experiments/out/bench_target")
  parser.add_argument("--seed", type=int, default=0)
  a = parser.parse_args()

  task = ArithmeticTask(max_digits=a.max_digits)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=a.hidden,
                       intermediate_size=a.ffn * a.hidden, num_layers=a.layers, num_heads=a.heads,
                       num_kv_heads=a.kv_heads, architecture="qwen2", attention_bias=True,
                       tie_word_embeddings=True, max_position_embeddings=512,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
  model = init_model(config, seed=a.seed)
  graphdef, params = nnx.split(model)
  schedule = optax.warmup_cosine_decay_schedule(0.0, a.lr, min(100, a.steps // 10), a.steps,
                                                end_value=0.1 * a.lr)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, b2=0.98, weight_decay=0.01,
                                      mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  opt_state = optimizer.init(params)
  step = make_lm_step(graphdef, optimizer)
  train_task = task if a.train_exponent is None else dataclasses.replace(
      task, digit_exponent=a.train_exponent)
  stream = PackedStream(train_task, tokenizer, a.rows, a.row_len, seed=a.seed)

  print(f"target: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M params, "
        f"vocab {config.vocab_size}, {a.steps} steps x {a.rows} rows x {a.row_len} tokens")
  t_start = time.perf_counter()
  log, window = [], []
  for i in range(a.steps):
    params, opt_state, metrics = step(params, opt_state, stream.batch())
    if i == 0:
      jax.block_until_ready(params)
      compile_s = time.perf_counter() - t_start
    window.append(metrics)
    if (i + 1) % 50 == 0 or i + 1 == a.steps:
      m = {k: float(np.mean([float(w[k]) for w in window])) for k in window[0]}
      window = []
      m.update(step=i + 1, elapsed_s=round(time.perf_counter() - t_start, 1))
      log.append(m)
      print(f"step {i + 1:5d}  loss {m['loss']:.4f}  token_acc {m['token_acc']:.4f}  "
            f"tokens/step {m['tokens']:.0f}  {m['elapsed_s']:.0f}s", flush=True)
  train_s = time.perf_counter() - t_start

  model = nnx.merge(graphdef, params)
  held_out = task.sample(np.random.default_rng(10_000 + a.seed), a.eval_problems)
  max_new = max(len(p.solution) for p in held_out) + 16
  evaluation = greedy_accuracy(model, tokenizer, task, held_out, max_new)
  print(f"held-out greedy accuracy {evaluation['accuracy']:.3f} by digits "
        f"{evaluation['accuracy_by_digits']}  ({evaluation['generate_s']:.1f}s to generate)")
  print(f"example: {evaluation['example_prompt']}{evaluation['example']}")

  out = pathlib.Path(a.out)
  hf.save_pretrained(model, config, out)
  harness.write_json(out / TOKENIZER_FILE, {
      "type": "char", "alphabet": tokenizer.alphabet, "specials": list(tokenizer.specials),
      "task": {"name": task.name, "max_digits": task.max_digits,
               "digit_exponent": task.digit_exponent, "subtraction": task.subtraction}})
  summary = dict(args=vars(a), final_loss=log[-1]["loss"], final_token_acc=log[-1]["token_acc"],
                 compile_s=compile_s, train_s=train_s,
                 total_s=time.perf_counter() - t_start, eval=evaluation, log=log)
  harness.write_json(out / "train_log.json", summary)
  print(f"final loss {summary['final_loss']:.4f}; train {train_s:.0f}s "
        f"(compile {compile_s:.1f}s); saved to {out}")


if __name__ == "__main__":
  main()
