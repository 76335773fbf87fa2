"""Generation demo: ``python -m tlt_jax.generate [--config=configs/tiny_generate.py]``.

Builds the model (a local HF checkpoint or the embedded tiny preset), precompiles the engine's
buckets and completes a batch of prompts, printing completions and engine statistics.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from tlt_jax.config import check_keys, to_dataclass
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer, load_tokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams

_DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "tiny_generate.py"

DEMO_ALPHABET = "0123456789+-*=() ?"


def build_model(cfg):
  """The model and tokenizer named by ``cfg.model``."""
  check_keys(cfg.model, {"path", "dtype", "tiny"}, "model")
  if cfg.model.path:
    from tlt_jax.models import hf  # pylint: disable=import-outside-toplevel
    model, model_config = hf.from_pretrained(cfg.model.path, dtype=cfg.model.dtype)
    return model, load_tokenizer(cfg.model.path)
  tokenizer = CharTokenizer(DEMO_ALPHABET)
  model_config = to_dataclass(ModelConfig, cfg.model.tiny, "model.tiny",
                              vocab_size=tokenizer.vocab_size, dtype=cfg.model.dtype,
                              eos_token_id=tokenizer.eos_token_id, architecture="qwen2",
                              tie_word_embeddings=True, attention_bias=True)
  return init_model(model_config, seed=cfg.seed), tokenizer


def demo_prompts(n: int, seed: int) -> list[str]:
  """Small arithmetic questions, the shape of the RL task to come."""
  rng = np.random.default_rng(seed)
  return [f"{rng.integers(1, 10**rng.integers(1, 5))}+{rng.integers(1, 999)}=?" for _ in range(n)]


def run(cfg) -> dict:
  """Runs the demo for a config and returns the engine statistics."""
  check_keys(cfg, {"seed", "num_prompts", "model", "rollout", "sampling"}, "")
  model, tokenizer = build_model(cfg)
  check_keys(cfg.rollout, {f.name for f in dataclasses.fields(EngineConfig)} | {"precompile"},
             "rollout")
  check_keys(cfg.sampling, {f.name for f in dataclasses.fields(SamplingParams)} - {"seed"},
             "sampling")
  precompile = cfg.rollout.get("precompile", True)
  engine_config = to_dataclass(EngineConfig, cfg.rollout, "rollout",
                               pad_token_id=tokenizer.pad_token_id or 0)
  sampling = to_dataclass(SamplingParams, cfg.sampling, "sampling", seed=cfg.seed)
  engine = RolloutEngine(model, config=engine_config)
  if precompile:
    n = engine.precompile()
    print(f"precompiled {n} executables in {engine._compile_seconds:.1f}s")
  texts = demo_prompts(cfg.num_prompts, cfg.seed)
  result = engine.generate([tokenizer.encode(t) for t in texts], sampling)
  for text, toks in list(zip(texts, result.tokens))[:8]:
    print(f"{text!r:>14} -> {tokenizer.decode(toks)[:60]!r}")
  lengths = np.array([len(t) for t in result.tokens])
  s = result.stats
  print(f"lengths p50={np.percentile(lengths, 50):.0f} p90={np.percentile(lengths, 90):.0f} "
        f"max={lengths.max()} | segments (bucket, steps): {[seg[:2] for seg in s['segments']]}")
  print(f"{s['tokens']} tokens in {s['wall_s']:.2f}s ({s['tokens_per_s']:.0f} tok/s excl. "
        f"compile), compiles during generate: {s['compiles']}")
  return s


def main(argv):
  del argv
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined only when run as a program, so importing several entry points never clashes.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", str(_DEFAULT_CONFIG), "ml_collections config file (get_config()).")
  app.run(main)
