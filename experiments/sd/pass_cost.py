"""What a T-token forward pass costs against a 1-token pass, by model size and batch.

  python -m experiments.sd.pass_cost [--sizes 128x3,256x4,512x6,768x8] [--batches 1,4,16,64]
      [--tokens 1,5,9] [--kv 512 --length 300] [--out experiments/out/pass_cost.json]

Speculative decoding pays where verifying T tokens costs little more than decoding one: each
SD step costs ``cost(T) + draft`` and yields the accepted tokens plus one, against ``cost(1)``
per token for vanilla decoding. This measures ``cost(T) / cost(1)`` for the policy's forward pass
with a KV cache (``Transformer.forward`` with ``cache=``), the pass both decode and verify make:
a jitted loop of ``--repeat`` passes at a cache of ``--kv`` slots filled to ``--length``, the
median of ``--runs`` timed runs, per (size, batch, T). The long-tail job's model size is chosen
from it (docs/benchmarks.md, "The long-tail job"): on a 2-core CPU a 9-token pass costs ~2-2.8x
a 1-token one at batch 1 for every size measured, so a larger model does not make SD cheaper
there; on an accelerator, small passes are launch-bound and T costs little.
"""

from __future__ import annotations

import sys
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments import harness
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import KVCache, init_model


def size_config(text: str, vocab: int) -> ModelConfig:
  """``HIDDENxLAYERS`` as a model config (heads of 32 wide, 2-4 KV heads, MLP 3x hidden)."""
  try:
    hidden, layers = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise SystemExit(f"--sizes: {text!r} is not HIDDENxLAYERS (e.g. 128x3)") from None
  heads = max(1, hidden // 64) if hidden >= 256 else 4
  kv_heads = 2 if heads < 8 else 4
  return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads)


def pass_seconds(model, batch: int, tokens: int, kv: int, length: int, repeat: int,
                 runs: int) -> float:
  """Median seconds of one ``tokens``-token pass at ``batch`` rows (a jitted loop of ``repeat``)."""
  graphdef, state = nnx.split(model)
  cache = KVCache.create(model.config, batch, kv).with_lengths(
      jnp.full((batch,), length, jnp.int32))
  ids = jnp.zeros((batch, tokens), jnp.int32)

  @jax.jit
  def run(state, cache, ids):
    m = nnx.merge(graphdef, state)

    def body(_, carry):
      c, acc = carry
      out = m.forward(ids, cache=c)
      return out.cache, acc + out.logits[:, -1, 0].sum()
    return jax.lax.fori_loop(0, repeat, body, (cache, jnp.float32(0)))[1]

  run(state, cache, ids).block_until_ready()  # compile
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    run(state, cache, ids).block_until_ready()
    times.append((time.perf_counter() - t0) / repeat)
  return statistics.median(times)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--sizes", default="128x3,256x4,512x6,768x8")
  parser.add_argument("--batches", default="1,4,16,64")
  parser.add_argument("--tokens", default="1,5,9")
  parser.add_argument("--vocab", type=int, default=64)
  parser.add_argument("--kv", type=int, default=512)
  parser.add_argument("--length", type=int, default=300)
  parser.add_argument("--repeat", type=int, default=20)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--out", default="experiments/out/pass_cost.json")
  a = parser.parse_args()
  ints = lambda s: [int(x) for x in s.split(",") if x]
  batches, tokens = ints(a.batches), ints(a.tokens)
  if 1 not in tokens:
    raise SystemExit("--tokens must include 1 (the ratios are against a 1-token pass)")
  if not 0 < a.length <= a.kv - max(tokens) * a.repeat:
    raise SystemExit(f"--length {a.length} must be > 0 and leave room for {a.repeat} passes of "
                     f"{max(tokens)} tokens in --kv {a.kv}")
  rows = []
  for text in a.sizes.split(","):
    config = size_config(text, a.vocab)
    model = init_model(config)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    for b in batches:
      ms = {t: 1e3 * pass_seconds(model, b, t, a.kv, a.length, a.repeat, a.runs) for t in tokens}
      row = dict(size=text, params_m=round(params / 1e6, 2), batch=b,
                 ms={str(t): round(v, 4) for t, v in ms.items()},
                 ratio={str(t): round(v / ms[1], 3) for t, v in ms.items()})
      rows.append(row)
      print(f"{text:>8s} ({row['params_m']}M) batch {b:3d}: " + "  ".join(
          f"T{t} {ms[t]:.3f}ms ({ms[t] / ms[1]:.2f}x)" for t in tokens), flush=True)
      harness.write_json(a.out, dict(command=" ".join(sys.argv), backend=jax.default_backend(),
                                     devices=[str(d) for d in jax.devices()], rows=rows))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
