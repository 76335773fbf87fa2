"""Selective async drafter save vs a full blocking RL checkpoint: how long the training loop waits.

The main job saves the drafter alone every RL step with an async ``Checkpointer`` (the call
returns once the arrays are on the host; files are written in the background) and the full
state (policy params + AdamW state + drafter + its optimizer) every ``checkpoint_every`` steps,
blocking. This measures both, the way the job does (``OnlineDrafter.checkpoint_state()`` for the
drafter; ``GRPOTrainer.checkpoint_state()``'s content for the full state), for the tiny default
policy and for a policy of SmolLM2-135M's shape (random weights, float32), median of repeats:

  python -m experiments.drafter.drafter_save_latency [--repeats 5]
      [--out docs/results/drafter_save_latency.json]

The paper's Fig. 17: 893 ms (full) -> 97 ms (selective async) on its setup.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import jax
import numpy as np
import optax
from flax import nnx

from experiments import harness
from experiments.harness import (Drafter, DrafterTrainingConfig, ModelConfig, OnlineDrafter,
                                 init_model, write_report)
from tlt_jax import checkpoint as ckpt

SHAPES = {
    "tiny (default job)": dict(vocab_size=19, hidden_size=128, intermediate_size=256,
                               num_layers=3, num_heads=4, num_kv_heads=2),
    "SmolLM2-135M shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_layers=30, num_heads=9, num_kv_heads=3),
}


def nbytes(tree) -> int:
  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def measure(name: str, fields: dict, repeats: int) -> dict:
  config = ModelConfig(**fields, tie_word_embeddings=True, architecture="llama")
  model = init_model(config, seed=0)
  graphdef, params = nnx.split(model)
  opt_state = optax.adamw(1e-5).init(params)
  online = OnlineDrafter(Drafter.create(config, seed=1), graphdef,
                         DrafterTrainingConfig(rows=2, seq_len=16))
  full = {"params": ckpt.state_to_pure_dict(params), "opt_state": jax.tree.leaves(opt_state),
          "step": np.asarray(0, np.int64), "drafter": online.checkpoint_state()}
  root = tempfile.mkdtemp(prefix="save_latency_")
  out = dict(model=name, full_bytes=nbytes(full), drafter_bytes=nbytes(online.checkpoint_state()))
  try:
    blocking = []
    with ckpt.Checkpointer(f"{root}/full", keep=2) as checkpointer:
      for step in range(repeats):
        t0 = time.perf_counter()
        checkpointer.save(step, full)
        blocking.append(time.perf_counter() - t0)
    returned, durable = [], []
    with ckpt.Checkpointer(f"{root}/drafter", keep=2, async_save=True) as checkpointer:
      for step in range(repeats):
        t0 = time.perf_counter()
        checkpointer.save(step, online.checkpoint_state())  # what the job does every RL step
        returned.append(time.perf_counter() - t0)
        checkpointer.wait()
        durable.append(time.perf_counter() - t0)
        time.sleep(0.2)  # the job trains between saves; the next save settles the previous one
  finally:
    shutil.rmtree(root, ignore_errors=True)
  ms = lambda xs: 1e3 * float(np.median(xs))
  out.update(full_blocking_ms=ms(blocking), drafter_async_return_ms=ms(returned),
             drafter_async_durable_ms=ms(durable), repeats=repeats,
             full_blocking_all_ms=[1e3 * x for x in blocking],
             drafter_async_return_all_ms=[1e3 * x for x in returned])
  out["ratio_full_over_async"] = out["full_blocking_ms"] / out["drafter_async_return_ms"]
  print(f"{name}: full {out['full_bytes'] / 2**20:.1f} MiB blocking {out['full_blocking_ms']:.0f} "
        f"ms; drafter {out['drafter_bytes'] / 2**20:.1f} MiB async returns in "
        f"{out['drafter_async_return_ms']:.0f} ms (on disk after "
        f"{out['drafter_async_durable_ms']:.0f} ms)", flush=True)
  return out


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="docs/results/drafter_save_latency.json")
  a = parser.parse_args()
  results = [measure(name, fields, a.repeats) for name, fields in SHAPES.items()]
  write_report(a.out, dict(backend=jax.default_backend(), results=results))


if __name__ == "__main__":
  main()
