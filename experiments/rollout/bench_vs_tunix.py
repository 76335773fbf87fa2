"""Plain greedy decode: our RolloutEngine vs google-tunix's ``Sampler``, the same Qwen2 weights.

  /tmp/tunix_venv/bin/python -m experiments.rollout.bench_vs_tunix [--repeats 5] [--batches 1,8,32]

Needs a venv with google-tunix next to this package (tunix pins flax>=0.11 / safetensors<0.8):

  python3 -m venv /tmp/tunix_venv
  /tmp/tunix_venv/bin/pip install google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 \\
      optax chex ml-collections 'safetensors<0.8' tokenizers ml_dtypes absl-py tensorboardX tqdm \\
      transformers torch==2.13.0
  /tmp/tunix_venv/bin/pip install --no-deps -e .

What it does:
 1. writes (or reuses) a random fp32 Qwen2 HF checkpoint under experiments/out/ with transformers;
 2. loads it with ``tlt_jax.models.hf.from_pretrained`` and with tunix's own safetensors loader
    (``tunix.models.qwen2.params.create_model_from_safe_tensors``);
 3. checks both produce the same greedy tokens (the first ``--check-tokens`` of every row must be
    identical; where the rows diverge later it is reported, not fatal);
 4. times prompt 64 + 128 new tokens at each batch size, runs interleaved (ours, tunix, ...)
    after a warm-up that compiles, and reports tokens/s and the median of per-repeat ratios.

No row stops early on either side: our engine gets ``stop_token_ids=()``; tunix gets an EOS id
(-1) that no token can equal. Tunix's pad id is ``vocab_size`` (outside the vocabulary), because
its decode step masks every buffered token equal to the pad id out of attention: an in-vocabulary
pad id would silently change the outputs whenever the model generates that token.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import statistics
import sys
import time

import numpy as np

from experiments import harness
from experiments.harness import (EngineConfig, RolloutEngine, SamplingParams, compile_count, hf,
                                 write_report)

INSTALL_HINT = """\
google-tunix is not importable from this interpreter ({python}).
Create a separate venv for it (do not install it into the project venv):

  python3 -m venv /tmp/tunix_venv
  /tmp/tunix_venv/bin/pip install google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 \\
      optax chex ml-collections 'safetensors<0.8' tokenizers ml_dtypes absl-py tensorboardX tqdm \\
      transformers torch==2.13.0
  /tmp/tunix_venv/bin/pip install --no-deps -e /work/main
  /tmp/tunix_venv/bin/python -m experiments.rollout.bench_vs_tunix
"""


def import_tunix():
  """tunix's sampler, Qwen2 model and Qwen2 params modules, or an exit saying how to install it
  (imported in ``main``, so that ``--help`` works without tunix)."""
  try:
    # pylint: disable=import-outside-toplevel
    from tunix.generate import sampler
    from tunix.models.qwen2 import model, params
  except ImportError as e:  # pragma: no cover - depends on the venv
    sys.exit(f"{INSTALL_HINT.format(python=sys.executable)}\n(import error: {e})")
  return sampler, model, params


# The checkpoint: 4 layers, hidden 256, 8 heads / 4 KV heads (head dim 32), SwiGLU 768, vocab 512.
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
ROPE_THETA = 10000.0
WEIGHT_SCALE = 0.08  # larger than HF's 0.02 init so greedy picks are not near-ties


# ------------------------------------------------------------------------------------ checkpoint


def _checkpoint_matches(path: pathlib.Path, seed: int) -> bool:
  try:
    config = json.loads((path / "config.json").read_text())
    meta = json.loads((path / "bench_meta.json").read_text())
  except (OSError, ValueError):
    return False
  if not (path / "model.safetensors").exists():
    return False
  return (all(config.get(k) == v for k, v in MODEL.items())
          and meta == {"seed": seed, "weight_scale": WEIGHT_SCALE, "rope_theta": ROPE_THETA})


def make_checkpoint(path: pathlib.Path, seed: int) -> bool:
  """Writes the random Qwen2 HF directory unless an identical one is there; True if written."""
  if _checkpoint_matches(path, seed):
    return False
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    sys.exit(f"Creating the checkpoint needs torch and transformers ({e}); "
             "pip install transformers torch==2.13.0 (the CPU wheel)")
  spec = importlib.util.spec_from_file_location("hf_fixtures",
                                                harness.ROOT / "tests" / "hf_fixtures.py")
  fixtures = importlib.util.module_from_spec(spec)  # the tests' random HF weights
  spec.loader.exec_module(fixtures)
  torch.manual_seed(seed)
  config = transformers.Qwen2Config(**MODEL, rope_theta=ROPE_THETA, bos_token_id=1,
                                    eos_token_id=2, dtype="float32")
  model = transformers.Qwen2ForCausalLM(config)
  fixtures.randomize_parameters(model, seed, scale=WEIGHT_SCALE)
  model.eval()
  path.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(str(path))
  (path / "bench_meta.json").write_text(json.dumps(
      {"seed": seed, "weight_scale": WEIGHT_SCALE, "rope_theta": ROPE_THETA}))
  return True


# ----------------------------------------------------------------------------------------- tunix


class IdTokenizer:
  """Tunix's Sampler takes strings: a prompt is its token ids joined by spaces.

  ``pad_id`` is outside the vocabulary (tunix masks buffered tokens equal to it out of attention),
  ``eos_id`` is -1 (never sampled), ``bos_id`` is None (no BOS is prepended or de-duplicated).
  """

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(t)) for t in ids)

  def bos_id(self):
    return None

  def eos_id(self) -> int:
    return -1

  def pad_id(self) -> int:
    return self.vocab_size


def load_tunix(path: pathlib.Path, tunix_qwen2, tunix_qwen2_params):
  """Tunix's Qwen2 from the HF directory, with tunix's own safetensors loader (the modules
  ``tunix.models.qwen2.model`` and ``.params``)."""
  hf_config = json.loads((path / "config.json").read_text())
  rope = dict(hf_config.get("rope_parameters") or {})
  heads = hf_config["num_attention_heads"]
  config = tunix_qwen2.ModelConfig(
      num_layers=hf_config["num_hidden_layers"], vocab_size=hf_config["vocab_size"],
      embed_dim=hf_config["hidden_size"], hidden_dim=hf_config["intermediate_size"],
      num_heads=heads, head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
      num_kv_heads=hf_config["num_key_value_heads"],
      rope_theta=int(rope.get("rope_theta", hf_config.get("rope_theta", ROPE_THETA))),
      norm_eps=hf_config["rms_norm_eps"], use_tied_embedding=hf_config["tie_word_embeddings"])
  model = tunix_qwen2_params.create_model_from_safe_tensors(str(path), config)
  return model, config


def tunix_generate(sampler, prompts: list[list[int]], max_prompt_len: int, new_tokens: int,
                   logprobs: bool) -> list[list[int]]:
  out = sampler([" ".join(map(str, p)) for p in prompts], max_generation_steps=new_tokens,
                max_prompt_length=max_prompt_len, echo=False, eos_tokens=[-1], temperature=0.0,
                return_logprobs=logprobs)
  return [np.asarray(t).tolist() for t in out.tokens]


# ------------------------------------------------------------------------------------- checking


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict:
  """Per-row common-prefix lengths of the two token lists."""
  prefix = []
  for a, b in zip(ours, theirs):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
      n += 1
    prefix.append(n)
  return dict(rows=len(prefix), rows_identical=sum(a == b for a, b in zip(ours, theirs)),
              min_common_prefix=min(prefix), mean_common_prefix=float(np.mean(prefix)),
              first_divergence={i: p for i, p in enumerate(prefix) if p < len(ours[i])})


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batches", default="1,8,32")
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--check-tokens", type=int, default=16,
                      help="leading greedy tokens that must be identical in every row")
  parser.add_argument("--tunix-logprobs", action="store_true",
                      help="also make tunix return per-token log-probs, as our engine always does")
  parser.add_argument("--warmup", type=int, default=2, help="untimed calls of each before timing")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--checkpoint", default="experiments/out/bench_vs_tunix_qwen2")
  parser.add_argument("--out", default="experiments/out/bench_vs_tunix.json")
  a = parser.parse_args()
  tunix_sampler, tunix_qwen2, tunix_qwen2_params = import_tunix()
  batches = [int(b) for b in a.batches.split(",")]
  if a.repeats < 1 or a.warmup < 1 or not batches or min(batches) < 1:
    parser.error("--repeats, --warmup and every --batches entry must be >= 1")

  ckpt = pathlib.Path(a.checkpoint)
  wrote = make_checkpoint(ckpt, a.seed)
  print(f"checkpoint {ckpt} ({'written' if wrote else 'reused'})", flush=True)

  model, config = hf.from_pretrained(ckpt)
  tmodel, tconfig = load_tunix(ckpt, tunix_qwen2, tunix_qwen2_params)
  tokenizer = IdTokenizer(config.vocab_size)
  cache_size = a.prompt_len + a.new_tokens  # tunix needs prompt + generation steps <= cache size
  sampler = tunix_sampler.Sampler(tmodel, tokenizer, tunix_sampler.CacheConfig(
      cache_size=cache_size, num_layers=tconfig.num_layers, num_kv_heads=tconfig.num_kv_heads,
      head_dim=tconfig.head_dim))
  params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, stop_token_ids=())

  rng = np.random.default_rng(a.seed)
  results = {}
  for batch in batches:
    prompts = rng.integers(0, config.vocab_size, (batch, a.prompt_len)).tolist()
    engine = RolloutEngine(model, config=EngineConfig(
        max_batch=batch, max_prompt_len=a.prompt_len, max_new_tokens=a.new_tokens))
    t0 = time.perf_counter()
    n_exec = engine.precompile()
    precompile_s = time.perf_counter() - t0

    # warm-up (tunix compiles here; its second call still compiles one tiny eager op) and the
    # parity check
    for _ in range(a.warmup):
      ours_ref = engine.generate(prompts, params)
      assert ours_ref.stats.compiles == 0, "precompile() must cover the workload"
    c0, t0 = compile_count(), time.perf_counter()
    for _ in range(a.warmup):
      tunix_ref = tunix_generate(sampler, prompts, a.prompt_len, a.new_tokens, a.tunix_logprobs)
    tunix_warm_s, tunix_compiles = time.perf_counter() - t0, compile_count() - c0
    expected = [a.new_tokens] * batch
    assert [len(t) for t in ours_ref.tokens] == expected, "our rows must all run to the limit"
    assert [len(t) for t in tunix_ref] == expected, "tunix rows must all run to the limit"
    parity = compare(ours_ref.tokens, tunix_ref)
    print(f"batch {batch}: precompiled {n_exec} executables in {precompile_s:.1f}s; tunix "
          f"warm-up {tunix_warm_s:.1f}s ({tunix_compiles} compiles); greedy parity: "
          f"{parity['rows_identical']}/{batch} rows identical, min common prefix "
          f"{parity['min_common_prefix']}/{a.new_tokens}", flush=True)
    if parity["min_common_prefix"] < a.check_tokens:
      raise AssertionError(f"greedy tokens differ within the first {a.check_tokens}: {parity}")

    runs = {"ours": [], "tunix": []}
    for rep in range(a.repeats):  # interleaved so machine noise hits both alike
      result = engine.generate(prompts, params)
      st = result.stats.to_dict()
      assert st["compiles"] == 0, f"our engine recompiled in a timed run: {st['compiles']}"
      assert result.tokens == ours_ref.tokens, "our engine is not deterministic"
      assert st["tokens"] == batch * a.new_tokens
      runs["ours"].append(dict(wall_s=st["wall_s"], tokens=st["tokens"],
                               tokens_per_s=st["tokens"] / st["wall_s"],
                               # informative only (.get: the engine's stats may change)
                               prefill_s=st.get("prefill_s"), decode_s=st.get("decode_s"),
                               grow_s=st.get("grow_s"), decode_steps=st.get("decode_steps"),
                               segment_kv_lens=st.get("segment_kv_lens")))
      c0, t0 = compile_count(), time.perf_counter()
      toks = tunix_generate(sampler, prompts, a.prompt_len, a.new_tokens, a.tunix_logprobs)
      wall, compiles = time.perf_counter() - t0, compile_count() - c0
      assert compiles == 0, f"tunix recompiled in a timed run: {compiles}"
      assert toks == tunix_ref, "tunix is not deterministic"
      n = sum(len(t) for t in toks)
      runs["tunix"].append(dict(wall_s=wall, tokens=n, tokens_per_s=n / wall))
      print(f"  rep {rep}: ours {runs['ours'][-1]['tokens_per_s']:8.0f} tok/s   tunix "
            f"{runs['tunix'][-1]['tokens_per_s']:8.0f} tok/s", flush=True)
    ratios = harness.ratios(runs["ours"], runs["tunix"])
    results[str(batch)] = dict(
        tokens_per_s={k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()},
        ratio_ours_over_tunix=statistics.median(ratios), ratios=ratios,
        ours_prefill_s=harness.median(r["prefill_s"] for r in runs["ours"]),
        ours_decode_s=harness.median(r["decode_s"] for r in runs["ours"]),
        ours_decode_steps=runs["ours"][0]["decode_steps"],
        ours_segment_kv_lens=runs["ours"][0]["segment_kv_lens"],
        precompile_s=precompile_s, executables=n_exec, tunix_warmup_s=tunix_warm_s,
        parity=parity, runs=runs)
    r = results[str(batch)]
    print(f"batch {batch}: ours {r['tokens_per_s']['ours']:.0f} tok/s, tunix "
          f"{r['tokens_per_s']['tunix']:.0f} tok/s, ratio ours/tunix {r['ratio_ours_over_tunix']:.3f}"
          f" (per repeat {', '.join(f'{x:.3f}' for x in ratios)})", flush=True)

  summary = dict(
      workload=dict(prompt_len=a.prompt_len, new_tokens=a.new_tokens, batches=batches,
                    repeats=a.repeats, greedy=True, early_stop=False,
                    tunix_logprobs=a.tunix_logprobs, tunix_cache_size=cache_size, model=MODEL,
                    checkpoint=str(ckpt)),
      ratio_ours_over_tunix={b: r["ratio_ours_over_tunix"] for b, r in results.items()},
      tokens_per_s={b: r["tokens_per_s"] for b, r in results.items()},
      results=results,
      env=harness.machine("jax", "jaxlib", "flax", "backend", "devices", "python", "cpu_count",
                          "loadavg_end", tunix="google-tunix"))
  print(f"ratio ours/tunix: {json.dumps(summary['ratio_ours_over_tunix'])}")
  write_report(a.out, summary)


if __name__ == "__main__":
  main()
