"""Memory per device of params, AdamW state and KV cache, by precision, computed from shapes.

  python -m experiments.system.memory_by_precision [--rows 64] [--cache-len 4608]
      [--out experiments/out/memory_by_precision.json]

The model is Qwen3-0.6B's shape (its released config.json's fields) with random weights, built
abstractly (``nnx.eval_shape``: nothing is allocated). For each setting (params dtype / compute
dtype): the params in their dtype, AdamW's two moments in the params' dtype (optax keeps them
so), and the rollout's KV cache of ``--rows`` rows of ``--cache-len`` slots in the compute
dtype. Activations of the update are left out: they depend on the micro-batch, not the
precision choice alone.
"""

from __future__ import annotations

import argparse
import datetime

import jax
import numpy as np
from flax import nnx

from experiments.harness import write_report
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import KVCache, Transformer

# Qwen3-0.6B's config.json (tied embeddings, head_dim 128 over 16 heads of a 1024 hidden)
QWEN3_0_6B = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                         num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         max_position_embeddings=40960, architecture="qwen3")
SETTINGS = (("float32", None), ("float32", "bfloat16"), ("bfloat16", None))


def nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def footprint(config: ModelConfig, rows: int, cache_len: int) -> dict:
  """Bytes of params, AdamW moments and a ``rows x cache_len`` KV cache for ``config``."""
  params = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
  cache = jax.eval_shape(lambda: KVCache.create(config, rows, cache_len))
  out = dict(params=nbytes(params), adamw_moments=2 * nbytes(params),
             kv_cache=nbytes((cache.k, cache.v)))
  out["total"] = sum(out.values())
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=64, help="rollout rows held in the KV cache")
  parser.add_argument("--cache-len", type=int, default=4608, help="slots per row")
  parser.add_argument("--out", default="experiments/out/memory_by_precision.json")
  a = parser.parse_args()
  rows = []
  for dtype, compute in SETTINGS:
    config = QWEN3_0_6B.replace(dtype=dtype, compute_dtype=compute)
    got = footprint(config, a.rows, a.cache_len)
    rows.append(dict(params_dtype=dtype, compute_dtype=compute or dtype,
                     **{k: round(v / 2**30, 3) for k, v in got.items()}))
    print(f"params {dtype:8} compute {compute or dtype:8}: " +
          ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in got.items()))
  write_report(a.out, dict(date=datetime.date.today().isoformat(), model="Qwen3-0.6B shape",
                           rows=a.rows, cache_len=a.cache_len, unit="GiB", settings=rows))


if __name__ == "__main__":
  main()
