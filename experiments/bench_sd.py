"""Speculative vs vanilla decoding, tokens/s as ratios measured in one run (Table 4 / Fig. 13 shape).

  python experiments/train_bench_target.py      # once: a small target trained on arithmetic traces
  python experiments/train_drafter_offline.py   # once: an EAGLE drafter trained on its generations
  python experiments/bench_sd.py [--repeats 3] [--batches 1,2,4,8,16,32] [--verify 4,8,16,32]

For every batch size the vanilla engine and each speculative strategy decode the same prompts
(long addition problems, so all rows run for a similar number of tokens) with one static batch
(no compaction), greedy unless --temperature is set; repeats are interleaved and the median of
the per-repeat ratios is reported. Greedy outputs are checked to be identical to vanilla.
Writes JSON and a PNG heatmap to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import numpy as np

from tlt_jax.models import hf
from tlt_jax.models.drafter import load_drafter
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import SpecConfig


def ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def long_prompts(tokenizer: CharTokenizer, n: int, digits: int, seed: int) -> list[list[int]]:
  """``n`` addition problems of two ``digits``-digit numbers: long, similar-length solutions."""
  rng = np.random.default_rng(seed)
  task = ArithmeticTask()
  lo, hi = 10 ** (digits - 1), 10 ** digits
  problems = [task.make_problem(int(rng.integers(lo, hi)), int(rng.integers(lo, hi)))
              for _ in range(n)]
  return [[tokenizer.bos_token_id] + tokenizer.encode(p.prompt) for p in problems]


def load_bench(target_dir: str, drafter_dir: str):
  """The bench target, its config, its trained drafter and its char tokenizer (a clear exit if
  the training scripts have not been run)."""
  for path in (target_dir, drafter_dir):
    if not pathlib.Path(path).is_dir():
      raise SystemExit(f"{path} not found: run experiments/train_bench_target.py and "
                       "experiments/train_drafter_offline.py first")
  target, config = hf.from_pretrained(target_dir)
  drafter = load_drafter(drafter_dir, config)
  tok = json.loads((pathlib.Path(target_dir) / "char_tokenizer.json").read_text())
  return target, config, drafter, CharTokenizer(tok["alphabet"], tuple(tok["specials"]))


def tree_for(verify: int, depth: int, topk: int) -> SpecConfig:
  """A strategy verifying ``verify`` tokens: a chain when that is depth + 1, else a tree."""
  if verify == depth + 1:
    return SpecConfig(depth=depth, topk=1, verify_tokens=verify)
  return SpecConfig(depth=depth, topk=topk, verify_tokens=verify)


def combined_stats(results) -> dict:
  """One stats dict for several ``generate`` calls run one after another (sums; tokens/s and
  mean accepted length over all of them)."""
  stats = {key: sum(r.stats[key] for r in results)
           for key in ("tokens", "wall_s", "compile_s", "decode_s", "compiles")}
  stats["tokens_per_s"] = stats["tokens"] / max(stats["wall_s"] - stats["compile_s"], 1e-9)
  hists = [np.asarray(r.stats["accept_hist"]) for r in results if "accept_hist" in r.stats]
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
  base = dict(max_batch=bs, batch_buckets=(bs,), max_prompt_len=plen, prefill_buckets=(plen,),
              max_new_tokens=max_new, compaction=False)
  engines = {"vanilla": RolloutEngine(target, config=EngineConfig(**base))}
  for name, spec in strategies.items():
    engines[name] = RolloutEngine(target, drafter=drafter, config=EngineConfig(**base, spec=spec))
  for engine in engines.values():
    engine.precompile()
    engine.generate(groups[0], params)  # warm-up run
  runs = {name: [] for name in engines}
  reference = None
  for _ in range(repeats):
    for name, engine in engines.items():
      results = [engine.generate(group, params) for group in groups]
      tokens = [t for r in results for t in r.tokens]
      stats = combined_stats(results)
      assert stats["compiles"] == 0
      if name == "vanilla":
        reference = tokens
      elif params.temperature == 0:
        assert tokens == reference, f"{name}: greedy SD differs from vanilla"
      runs[name].append(stats)
  # Decode phase only (tokens after each row's first, over the decode segments' seconds): the
  # prefill is the same for both and, with short answers, a large share of the wall time.
  decode_rate = lambda s: (s["tokens"] - len(prompts)) / s["decode_s"]
  out = {}
  for name in strategies:
    ratios = [s["tokens_per_s"] / v["tokens_per_s"] for s, v in zip(runs[name], runs["vanilla"])]
    decode = [decode_rate(s) / decode_rate(v) for s, v in zip(runs[name], runs["vanilla"])]
    out[name] = {"speedup": statistics.median(ratios), "speedups": ratios,
                 "decode_speedup": statistics.median(decode),
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
  plen = max(len(p) for p in prompts)
  base = dict(max_batch=len(prompts), batch_buckets=(len(prompts),), max_prompt_len=plen,
              prefill_buckets=(plen,), max_new_tokens=max_new, compaction=False)
  out = {}
  for name, spec in {"vanilla": None, **strategies}.items():
    engine = RolloutEngine(target, drafter=drafter if spec else None,
                           config=EngineConfig(**base, spec=spec, time_phases=spec is not None))
    engine.precompile()
    engine.generate(prompts, params)
    s = engine.generate(prompts, params).stats
    n = s["decode_steps"]
    out[name] = {"step_ms": 1e3 * s["decode_s"] / n}
    if spec is not None:
      out[name].update(draft_ms=1e3 * s["draft_s"] / n, verify_ms=1e3 * s["verify_s"] / n,
                       mean_accept_len=s["mean_accept_len"])
    print(name, {k: round(v, 3) for k, v in out[name].items()}, flush=True)
  return out


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
    jax.block_until_ready(fwd(params, ids, cache))
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      for _ in range(repeats // 5):
        r = fwd(params, ids, cache)
      jax.block_until_ready(r)
      times.append((time.perf_counter() - t0) / (repeats // 5) * 1e3)
    out[t] = statistics.median(times)
  base = out[widths[0]]
  print("target pass, ms (x the 1-token pass): " + ", ".join(
      f"T={t}: {ms:.2f} ({ms / base:.1f}x)" for t, ms in out.items()), flush=True)
  return out


def heatmap(path, rows, cols, values, title, xlabel, ylabel):
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="experiments/out/bench_target")
  parser.add_argument("--drafter", default="experiments/out/bench_drafter")
  parser.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32])
  parser.add_argument("--verify", type=ints, default=[4, 8, 16, 32])
  parser.add_argument("--depth", type=int, default=7, help="draft depth for the batch table")
  parser.add_argument("--topk", type=int, default=4)
  parser.add_argument("--fig13-depths", type=ints, default=[3, 5, 7])
  parser.add_argument("--fig13-batch", type=int, default=1)
  parser.add_argument("--digits", type=int, default=10)
  parser.add_argument("--max-new", type=int, default=128)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", default="experiments/out")
  parser.add_argument("--phase-split", action="store_true",
                      help="only measure the draft/verify time split at batch 1")
  a = parser.parse_args()

  target, config, drafter, tokenizer = load_bench(a.target, a.drafter)
  params = SamplingParams(max_new_tokens=a.max_new, temperature=a.temperature, seed=a.seed)
  prompts = long_prompts(tokenizer, max(a.batches), a.digits, a.seed)
  t0 = time.time()
  if a.phase_split:
    cost = forward_cost(target)
    split = phase_split(target, drafter, prompts[:1], {
        "chain depth 3": tree_for(4, 3, a.topk), "chain depth 7": tree_for(8, 7, a.topk),
        "tree depth 7 verify 16": tree_for(16, 7, a.topk)}, params, a.max_new)
    pathlib.Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(a.out_dir) / "bench_sd_phases.json").write_text(
        json.dumps({"phases": split, "target_pass_ms": cost}, indent=2))
    return

  table = {}
  for bs in a.batches:
    strategies = {f"verify={v}": tree_for(v, a.depth, a.topk) for v in a.verify}
    table[bs] = measure(target, drafter, prompts[:bs], strategies, params, a.max_new, a.repeats)
    print(f"batch {bs:>3}: vanilla {table[bs]['vanilla_tokens_per_s']:.0f} tok/s | " + " | ".join(
        f"{k} {v['speedup']:.2f}x (accept {v['mean_accept_len']:.2f})"
        for k, v in table[bs].items() if k.startswith("verify")), flush=True)

  fig13 = depth_table(target, drafter, prompts[:a.fig13_batch], a.fig13_depths,
                      lambda depth: a.verify, a.topk, params, a.max_new, a.repeats)

  out_dir = pathlib.Path(a.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  summary = {"args": vars(a), "target": dict(layers=config.num_layers, hidden=config.hidden_size,
                                             vocab=config.vocab_size),
             "batch_by_verify": table, "depth_by_verify": fig13, "wall_s": time.time() - t0,
             "cpu_count": os.cpu_count()}
  (out_dir / "bench_sd.json").write_text(json.dumps(summary, indent=2, default=str))
  heatmap(out_dir / "bench_sd_batch.png", a.batches, a.verify,
          [[table[b][f"verify={v}"]["speedup"] for v in a.verify] for b in a.batches],
          "SD speedup over vanilla (tokens/s)", "tokens to verify", "batch size")
  heatmap(out_dir / "bench_sd_depth.png", a.fig13_depths, a.verify,
          [[fig13[d].get(f"verify={v}", {"speedup": np.nan})["speedup"] for v in a.verify]
           for d in a.fig13_depths],
          f"SD speedup at batch {a.fig13_batch}", "tokens to verify", "draft depth")
  print(f"wrote {out_dir}/bench_sd.json and two PNGs in {summary['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
