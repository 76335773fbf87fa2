"""GRPO step time vs the rollout capacity (``max_new_tokens``) on an early-stopping workload.

  python -m experiments.rl.bench_grpo_capacity [--steps 4]
      [--out experiments/out/bench_grpo_capacity.json]

Workload: a random 4-layer / hidden-256 Qwen2-style policy (vocab 512), 8 prompts x 8
samples per step, 32-token prompts, sampled at temperature 1 with 8 stop ids (answers end early:
p50 ~60 tokens, a few run for hundreds), one AdamW update per step. Trainers, all from the same
weights and data:

* ``128-padded``: capacity 128, one full-capacity KV cache and the padded update (what the code
  did before KV-length buckets and the packed update: ``kv_buckets=()``, ``update_tokens=0``);
* ``128``, ``1024``: capacity 128 / 1024 with KV-length buckets and the packed update (defaults).

Steps run interleaved (step i of every trainer, then step i + 1), after every executable was
compiled (engine ``precompile()`` and ``precompile_update()``) and one untimed warm-up step; a
timed step that compiles is an error.
Reported per trainer: median step / rollout / update seconds, update seconds per generated token,
tokens run by the update vs valid tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from experiments import harness
from experiments.harness import (CharTokenizer, EngineConfig, GRPOTrainer, Problem, TrainerConfig,
                                 compile_count, grpo, init_model, write_report)

VOCAB = 512
ALPHABET = "".join(chr(0x100 + i) for i in range(VOCAB - 3))  # + <pad>, <bos>, <eos>


class RandomTextTask:
  """31-character random prompts; reward 1 if the answer contains the prompt's first character."""

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    out = []
    for _ in range(n):
      prompt = "".join(rng.choice(list(ALPHABET[16:]), 31))
      out.append(Problem(prompt=prompt, answer=prompt[0], solution=prompt[0]))
    return out

  def reward(self, problem: Problem, text: str) -> float:
    return float(problem.answer in text)


def make_trainer(capacity: int, old: bool, steps: int) -> GRPOTrainer:
  tokenizer = CharTokenizer(ALPHABET)
  stops = tuple(range(3, 3 + 8))  # 8 stop ids: answers are geometric, mean ~64 tokens
  config = harness.bench_config(VOCAB, eos_token_id=stops)
  engine = EngineConfig(max_batch=64, max_prompt_len=32, max_new_tokens=capacity,
                        kv_buckets=() if old else None, max_stop_ids=8)
  trainer_config = TrainerConfig(steps=steps, prompts_per_step=8, learning_rate=1e-5,
                                 warmup_steps=0, minibatches=1, epochs=1, max_new_tokens=capacity,
                                 temperature=1.0, **({"update_tokens": 0} if old else {}))
  return GRPOTrainer(init_model(config, seed=0), tokenizer, RandomTextTask(), engine,
                     grpo.GRPOConfig(group_size=8), trainer_config)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--trainers", default="128-padded,128,1024")
  parser.add_argument("--out", default="experiments/out/bench_grpo_capacity.json")
  a = parser.parse_args()

  trainers = {}
  for name in a.trainers.split(","):
    capacity, old = int(name.split("-")[0]), name.endswith("-padded")
    t0 = time.perf_counter()
    trainer = make_trainer(capacity, old, a.steps)
    n = trainer.engine.precompile() + trainer.precompile_update()
    trainers[name] = trainer
    print(f"{name}: compiled {n} executables in {time.perf_counter() - t0:.0f}s", flush=True)

  def step(name: str, rep: int) -> dict | None:
    trainer = trainers[name]
    before = compile_count()
    m = trainer.step()
    compiles = compile_count() - before
    if rep == 0:
      return None
    assert compiles == 0, f"{name} step {rep} compiled {compiles} executables"
    generated = int(trainer.last_lengths.sum())
    print(f"step {rep} {name:>10}: step {m['step_s']:.2f}s (rollout {m['rollout_s']:.2f}, "
          f"update {m['update_s']:.2f}), answers p50 {m['len_p50']:.0f} max {m['len_max']}, "
          f"update tokens {m['update_tokens_padded']} run / {m['update_tokens_valid']} valid",
          flush=True)
    return dict(step_s=m["step_s"], rollout_s=m["rollout_s"], update_s=m["update_s"],
                generated=generated, len_p50=m["len_p50"], len_max=m["len_max"],
                update_tokens_padded=m["update_tokens_padded"],
                update_tokens_valid=m["update_tokens_valid"],
                update_s_per_token=m["update_s"] / generated)

  # step 0 is a warm-up (eager host-side ops compile there); steps interleaved
  runs = harness.interleaved(step, trainers, a.steps, warmup=1)

  med = lambda name, key: statistics.median(r[key] for r in runs[name])
  summary = {name: {key: med(name, key) for key in runs[name][0]} for name in runs}
  ratios = {}
  if "128" in runs and "1024" in runs:
    ratios["step_1024_over_128"] = harness.median_ratio(runs["1024"], runs["128"],
                                                        lambda r: r["step_s"])
  if "128-padded" in runs:
    for name in runs:
      if name != "128-padded":
        ratios[f"update_per_token_padded128_over_{name}"] = harness.median_ratio(
            runs["128-padded"], runs[name], lambda r: r["update_s_per_token"])
  out = dict(steps=a.steps, summary=summary, ratios=ratios, runs=runs, cpus=os.cpu_count())
  print(json.dumps(dict(summary=summary, ratios=ratios), indent=2))
  write_report(a.out, out)


if __name__ == "__main__":
  main()
