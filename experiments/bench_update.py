"""Full-length vs length-bucketed GRPO policy updates on a long-tail batch, measured in one run.

  python experiments/bench_update.py [--repeats 3] [--max-new-tokens 128,1024]
                                     [--out experiments/out/bench_update.json]

Both updates go through the trainer (``GRPOTrainer.policy_update``) on the same batch:
``TrainerConfig.update_tokens=0`` pads every row to ``max_prompt_len + max_new_tokens`` and runs
each minibatch in one pass (the update before bucketing); ``update_tokens=N`` cuts each minibatch
into micro-batches of about N tokens at the lengths of a power-of-two ladder and sums their
gradients into one optimizer step. Both trainers start from the same weights, so their first
updates must agree (checked).

Workload (the issue's): a random 4-layer, hidden-256 Qwen2-style policy, 64 rows (8 prompts x 8
samples) of 32-token prompts, completions geometric with mean ``--mean-length`` plus
``--tail-rows`` rows of 200-300 tokens, capped at ``max_new_tokens``. Each length setting is
timed after ``precompile_update()`` and one warm-up update, repeats interleaved (alternating
which goes first), asserting that no timed update compiles; the median is reported, with the
seconds per generated (completion) token and the speedup (full-length / bucketed seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import GRPOTrainer, TrainerConfig
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.utils import compile_count


def completion_lengths(rng, rows, mean, tail_rows, max_new):
  lengths = rng.geometric(1.0 / mean, rows)
  lengths[rng.choice(rows, tail_rows, replace=False)] = rng.integers(200, 301, tail_rows)
  return np.minimum(lengths, max_new)


def build(a, model_config, max_new, update_tokens):
  task = ArithmeticTask(max_digits=3)  # only its tokenizer's special ids are used
  tokenizer = CharTokenizer(task.alphabet)
  return GRPOTrainer(
      init_model(model_config, seed=0), tokenizer, task,
      EngineConfig(max_batch=a.prompts * a.group, max_prompt_len=a.prompt_len,
                   max_new_tokens=max_new),
      grpo.GRPOConfig(group_size=a.group, kl_coef=a.kl_coef),
      TrainerConfig(prompts_per_step=a.prompts, max_new_tokens=max_new,
                    minibatches=a.minibatches, update_tokens=update_tokens, warmup_steps=0))


def measure(a, model_config, max_new):
  rng = np.random.default_rng(0)
  rows = a.prompts * a.group
  lengths = completion_lengths(rng, rows, a.mean_length, a.tail_rows, max_new)
  vocab = model_config.vocab_size
  prompts = [[1] + rng.integers(3, vocab, a.prompt_len - 1).tolist() for _ in range(rows)]
  comps = [rng.integers(3, vocab, int(n)).tolist() for n in lengths]
  old = [rng.normal(-np.log(vocab), 0.3, len(c)) for c in comps]
  advantages = np.asarray(grpo.group_advantages(rng.normal(size=rows).astype(np.float32), a.group))
  trainers = {"padded": build(a, model_config, max_new, 0),
              "bucketed": build(a, model_config, max_new, a.update_tokens)}
  batch = trainers["padded"].make_batch(prompts, comps, old, advantages)
  info = {}
  for name, trainer in trainers.items():
    t0 = time.perf_counter()
    compiled = trainer.precompile_update()
    info[name] = {"compiled": compiled, "compile_s": time.perf_counter() - t0}
  first = {name: trainer.policy_update(batch) for name, trainer in trainers.items()}  # warm-up
  loss_diff = abs(first["padded"]["loss"] - first["bucketed"]["loss"])
  assert loss_diff <= 1e-4 * max(1.0, abs(first["padded"]["loss"])), first
  seconds = {name: [] for name in trainers}
  metrics = {}
  before = compile_count()
  for rep in range(a.repeats):  # interleaved, alternating the order, so noise hits both alike
    for name in (list(trainers) if rep % 2 == 0 else list(trainers)[::-1]):
      t0 = time.perf_counter()
      metrics[name] = trainers[name].policy_update(batch)
      seconds[name].append(time.perf_counter() - t0)
  assert compile_count() == before, "a timed update compiled"
  generated = int(lengths.sum())
  out = {"max_new_tokens": max_new, "seq_len": trainers["padded"].seq_len,
         "generated_tokens": generated,
         "length_p50": float(np.median(lengths)), "length_p90": float(np.percentile(lengths, 90)),
         "length_max": int(lengths.max()),
         "buckets": list(trainers["bucketed"].update_buckets),
         "rows_per_bucket": {str(k): v for k, v in trainers["bucketed"].update_rows.items()},
         "first_update_loss_abs_diff": loss_diff}
  for name, trainer in trainers.items():
    median = statistics.median(seconds[name])
    temp = [v for v in trainer.update_temp_bytes().values() if v is not None]
    out[name] = dict(info[name], update_s=median, update_s_all=seconds[name],
                     s_per_generated_token=median / generated,
                     tokens_padded=metrics[name]["update_tokens_padded"],
                     tokens_valid=metrics[name]["update_tokens_valid"],
                     passes=metrics[name]["update_passes"],
                     max_temp_bytes=max(temp) if temp else None)
  out["speedup"] = out["padded"]["update_s"] / out["bucketed"]["update_s"]
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max-new-tokens", default="128,1024",
                      help="comma-separated rollout capacities to measure")
  parser.add_argument("--update-tokens", type=int, default=8192, help="the bucketed token budget")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--mean-length", type=float, default=55.0)
  parser.add_argument("--tail-rows", type=int, default=3)
  parser.add_argument("--minibatches", type=int, default=2)
  parser.add_argument("--kl-coef", type=float, default=0.0)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--out", default="experiments/out/bench_update.json")
  a = parser.parse_args()

  model_config = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                             intermediate_size=3 * a.hidden, num_layers=a.layers, num_heads=8,
                             num_kv_heads=4, architecture="qwen2", attention_bias=True,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                             max_position_embeddings=4096)
  results = []
  for max_new in (int(v) for v in a.max_new_tokens.split(",")):
    result = measure(a, model_config, max_new)
    results.append(result)
    print(f"max_new_tokens={max_new}: full length {result['padded']['update_s']:.3f}s, bucketed "
          f"{result['bucketed']['update_s']:.3f}s per step's update, speedup "
          f"{result['speedup']:.2f}x (tokens run {result['padded']['tokens_padded']} vs "
          f"{result['bucketed']['tokens_padded']}, valid {result['bucketed']['tokens_valid']})",
          flush=True)
  summary = {"workload": {k: v for k, v in vars(a).items() if k != "out"},
             "results": results, "cpu_count": os.cpu_count()}
  out = pathlib.Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(summary, indent=2))
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  main()
