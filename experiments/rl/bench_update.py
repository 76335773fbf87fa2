"""Full-length vs packed GRPO policy updates on a long-tail batch, measured in one run.

  python -m experiments.rl.bench_update [--repeats 3] [--max-new-tokens 128,1024]
                                     [--out experiments/out/bench_update.json]

Both updates go through the trainer (``GRPOTrainer.policy_update``) on the same batch:
``TrainerConfig.update_tokens=0`` pads every row to ``max_prompt_len + max_new_tokens`` and runs
each minibatch in one pass (the update before packing); ``update_tokens=N`` packs each
minibatch's sequences first-fit decreasing into rows of the shortest ladder length that holds
the longest one, runs them in micro-batches of about N tokens and sums their gradients into one
optimizer step. Both trainers start from the same weights, so their first updates must agree
(checked).

Workload: a random 4-layer, hidden-256 Qwen2-style policy, 64 rows (8 prompts x 8
samples) of 32-token prompts, completions geometric with mean ``--mean-length`` plus
``--tail-rows`` rows of 200-300 tokens, capped at ``max_new_tokens``. Each length setting is
timed after ``precompile_update()`` and one warm-up update, repeats interleaved (alternating
which goes first), asserting that no timed update compiles; the median is reported, with the
seconds per valid generated (completion) token and the speedup (full-length / packed seconds).

Before any model is built, the tokens each update would run are counted offline (the trainer's
own minibatch order and packing, no model) for ``--offline-max-new-tokens`` and the budgets
``--offline-budgets``: padded / packed tokens is the most packing can save in compute. The
measured runs check their token counts against the offline ones.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import numpy as np

from experiments import harness
from experiments.harness import (ArithmeticTask, CharTokenizer, EngineConfig, GRPOTrainer,
                                 TrainerConfig, bucket_rows, compile_count, grpo, init_model,
                                 plan_packs, update_buckets, write_report)


def completion_lengths(rng, rows, mean, tail_rows, max_new):
  lengths = rng.geometric(1.0 / mean, rows)
  lengths[rng.choice(rows, tail_rows, replace=False)] = rng.integers(200, 301, tail_rows)
  return np.minimum(lengths, max_new)


def offline_tokens(a, max_new, update_tokens, devices=1):
  """(padded, packed, valid) tokens of one update pass over the workload's batch, as the trainer
  plans them (its first step's minibatch order, ``TrainerConfig.seed=0``), without a model."""
  rows = a.prompts * a.group
  lengths = completion_lengths(np.random.default_rng(0), rows, a.mean_length, a.tail_rows, max_new)
  needed = np.where(lengths > 0, a.prompt_len + lengths, 0)  # prompt + completion, or nothing
  seq_len = a.prompt_len + max_new
  size = rows // a.minibatches
  order = np.random.default_rng([0, 0, 1]).permutation(rows)  # GRPOTrainer.policy_update's
  packed = 0
  for m in range(a.minibatches):
    mini = needed[order[m * size:(m + 1) * size]]
    buckets = update_buckets(seq_len)
    rows_of = {t: bucket_rows(t, update_tokens, size, devices) for t in buckets}
    packed += sum(len(packs) * length for length, packs in plan_packs(mini, buckets, rows_of))
  return rows * seq_len, packed, int(needed.sum())


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
              "packed": build(a, model_config, max_new, a.update_tokens)}
  batch = trainers["padded"].make_batch(prompts, comps, old, advantages)
  info = {}
  for name, trainer in trainers.items():
    t0 = time.perf_counter()
    compiled = trainer.precompile_update()
    info[name] = {"compiled": compiled, "compile_s": time.perf_counter() - t0}
  first, failed = {}, {}
  for name, trainer in list(trainers.items()):  # warm-up
    try:
      first[name] = trainer.policy_update(batch)
    except jax.errors.JaxRuntimeError as e:  # the padded update at a large capacity
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      failed[name] = str(e).splitlines()[0]
      print(f"max_new_tokens={max_new}: the {name} update failed: {failed[name]}", flush=True)
      del trainers[name]
  loss_diff = None
  if not failed:
    loss_diff = abs(first["padded"]["loss"] - first["packed"]["loss"])
    assert loss_diff <= 1e-4 * max(1.0, abs(first["padded"]["loss"])), first
  before = compile_count()
  # interleaved, alternating the order, so noise hits both alike
  runs = harness.interleaved(lambda name, _rep: harness.timed(trainers[name].policy_update, batch),
                             trainers, a.repeats, "alternate")
  assert compile_count() == before, "a timed update compiled"
  seconds = {name: [took for took, _ in rs] for name, rs in runs.items()}
  metrics = {name: rs[-1][1] for name, rs in runs.items()}
  generated = int(lengths.sum())
  padded, packed, valid = offline_tokens(a, max_new, a.update_tokens)
  for name, tokens in (("padded", padded), ("packed", packed)):  # per update, x epochs (1)
    if name in failed:
      continue
    assert metrics[name]["update_tokens_padded"] == tokens, (name, metrics[name], tokens)
    assert metrics[name]["update_tokens_valid"] == valid, (name, metrics[name], valid)
  out = {"max_new_tokens": max_new, "seq_len": a.prompt_len + max_new,
         "generated_tokens": generated,
         "length_p50": float(np.median(lengths)), "length_p90": float(np.percentile(lengths, 90)),
         "length_max": int(lengths.max()),
         "buckets": list(trainers["packed"].policy.update_buckets),
         "rows_per_bucket": {str(k): v for k, v in trainers["packed"].policy.update_rows.items()},
         "first_update_loss_abs_diff": loss_diff}
  for name, trainer in trainers.items():
    median = statistics.median(seconds[name])
    temp = [v for v in trainer.update_temp_bytes().values() if v is not None]
    out[name] = dict(info[name], update_s=median, update_s_all=seconds[name],
                     s_per_valid_generated_token=median / generated,
                     tokens_padded=metrics[name]["update_tokens_padded"],
                     tokens_valid=metrics[name]["update_tokens_valid"],
                     passes=metrics[name]["update_passes"],
                     max_temp_bytes=max(temp) if temp else None)
  for name, error in failed.items():
    out[name] = dict(info[name], error=error, tokens_padded=padded if name == "padded" else packed)
  out["tokens_ratio"] = padded / packed
  if not failed:
    out["speedup"] = out["padded"]["update_s"] / out["packed"]["update_s"]
  return out


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max-new-tokens", default="128,1024",
                      help="comma-separated rollout capacities to measure")
  parser.add_argument("--update-tokens", type=int, default=2048, help="the packed token budget")
  parser.add_argument("--offline-max-new-tokens", default="128,1024",
                      help="comma-separated rollout capacities to count tokens at, offline")
  parser.add_argument("--offline-budgets", default="2048,4096,8192",
                      help="comma-separated update_tokens budgets to count tokens at, offline")
  parser.add_argument("--offline-only", action="store_true", help="count tokens, time nothing")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--mean-length", type=float, default=55.0)
  parser.add_argument("--tail-rows", type=int, default=3)
  parser.add_argument("--minibatches", type=int, default=1)
  parser.add_argument("--kl-coef", type=float, default=0.0)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--out", default="experiments/out/bench_update.json")
  a = parser.parse_args()

  model_config = harness.bench_config(a.vocab, a.hidden, a.layers, bos_token_id=1,
                                      eos_token_id=2, max_position_embeddings=4096)
  offline = []
  for max_new in harness.ints(a.offline_max_new_tokens):
    for budget in sorted({a.update_tokens} | set(harness.ints(a.offline_budgets))):
      padded, packed, valid = offline_tokens(a, max_new, budget)
      offline.append(dict(max_new_tokens=max_new, update_tokens=budget, padded=padded,
                          packed=packed, valid=valid, ratio=padded / packed,
                          ideal_ratio=padded / valid))
      print(f"offline max_new_tokens={max_new} update_tokens={budget}: padded / packed tokens "
            f"{padded}/{packed} = {padded / packed:.2f}x (padded / valid {padded / valid:.2f}x)",
            flush=True)
  results = []
  for max_new in ([] if a.offline_only else harness.ints(a.max_new_tokens)):
    result = measure(a, model_config, max_new)
    results.append(result)
    padded, packed = result["padded"], result["packed"]
    if "speedup" not in result:
      print(f"max_new_tokens={max_new}: packed {packed['update_s']:.3f}s per step's update, "
            f"{packed['s_per_valid_generated_token']:.2e} s per valid generated token; the "
            f"full-length update failed ({padded['error']})", flush=True)
      continue
    print(f"max_new_tokens={max_new}: full length {padded['update_s']:.3f}s, packed "
          f"{packed['update_s']:.3f}s per step's update, speedup {result['speedup']:.2f}x; "
          f"s per valid generated token {padded['s_per_valid_generated_token']:.2e} vs "
          f"{packed['s_per_valid_generated_token']:.2e}; tokens run {padded['tokens_padded']} vs "
          f"{packed['tokens_padded']} ({result['tokens_ratio']:.2f}x), valid "
          f"{packed['tokens_valid']}", flush=True)
  summary = {"workload": {k: v for k, v in vars(a).items() if k != "out"},
             "offline_tokens": offline, "results": results, "cpu_count": os.cpu_count()}
  print(json.dumps(summary, indent=2))
  write_report(a.out, summary)


if __name__ == "__main__":
  main()
