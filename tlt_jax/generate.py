"""Generation: completes prompts with the rollout engine and prints completions and statistics.

  python -m tlt_jax.generate [--config=CONFIG_FILE] [--config.<field>=VALUE ...]
                             [--prompt TEXT [--prompt TEXT ...]] [--chat] [--verbose]
                             [--compile_cache=PATH|off]

The model is a local checkpoint (``--config.model.path``: an HF directory, a trained main job's
``<logdir>/final_model``, whose tokenizer is saved beside the weights, or a ``.gguf`` file, which
holds its tokenizer) or, by default, an embedded tiny preset with random weights. Without
``--prompt``, small arithmetic questions are generated. The tokenizer's BOS id, if it has one,
starts every prompt; with ``--chat`` each prompt is instead a user message rendered with the
tokenizer's chat template.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from tlt_jax.job.build import resolve_compute_dtype
from tlt_jax.job.typed_config import ConfigError, check_keys, section, to_dataclass
from tlt_jax.models.instances import with_compute_dtype
from tlt_jax.models.load import from_pretrained, is_gguf_path, load_tokenizer
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout import EngineConfig, RolloutEngine, SamplingParams
from tlt_jax.utils import progress_bar

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "tiny_generate.py"

DEMO_ALPHABET = "0123456789+-*=() ?"


def build_model(cfg):
  """The model and tokenizer named by ``cfg.model``."""
  model_cfg = section(cfg, "model")
  check_keys(model_cfg, {"path", "dtype", "compute_dtype", "tiny"}, "model")
  compute = resolve_compute_dtype(model_cfg.get("compute_dtype"))
  if model_cfg.path:
    path = pathlib.Path(model_cfg.path)
    if not (path.is_dir() or (is_gguf_path(path) and path.is_file())):
      raise ConfigError(f"config.model.path {path} is not a directory or a .gguf file (expected "
                        "a checkpoint directory with config.json and *.safetensors, or a GGUF "
                        "file)")
    model, _ = from_pretrained(path, dtype=model_cfg.dtype)
    model = with_compute_dtype(model, compute)
    try:
      tokenizer = load_tokenizer(path)
    except FileNotFoundError:
      raise FileNotFoundError(f"{path} has no tokenizer (tokenizer.json or "
                              "char_tokenizer.json); copy the model's tokenizer there") from None
    return model, tokenizer
  tokenizer = CharTokenizer(DEMO_ALPHABET)
  model_config = to_dataclass(ModelConfig, section(model_cfg, "tiny"), "model.tiny",
                              vocab_size=tokenizer.vocab_size, dtype=model_cfg.dtype,
                              compute_dtype=compute,
                              eos_token_id=tokenizer.eos_token_id, architecture="qwen2",
                              tie_word_embeddings=True, attention_bias=True)
  return init_model(model_config, seed=cfg.seed), tokenizer


def demo_prompts(n: int, seed: int) -> list[str]:
  """Small arithmetic questions, the shape of the RL task."""
  rng = np.random.default_rng(seed)
  return [f"{rng.integers(1, 10**rng.integers(1, 5))}+{rng.integers(1, 999)}=?" for _ in range(n)]


def encode_prompts(tokenizer, texts: list[str], chat: bool = False) -> list[list[int]]:
  """Token ids of each text, after the tokenizer's BOS id when it has one; with ``chat``, each
  text is a user message rendered with the chat template (which writes its own BOS, if any)."""
  if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
    raise TypeError(f"prompts must be a list of strings, got {texts!r:.80}")
  if chat:
    if not hasattr(tokenizer, "apply_chat_template"):
      raise ValueError(f"--chat needs a tokenizer with a chat template; {type(tokenizer).__name__} "
                       "has none")
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
            for t in texts]
  bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
  return [bos + tokenizer.encode(t) for t in texts]


def run(cfg, overrides=None, prompts: list[str] | None = None, chat: bool = False) -> dict:
  """Generates for ``prompts`` (default: ``cfg.num_prompts`` demo questions; ``chat``: as user
  messages in the chat template); returns the engine statistics plus the completions (``texts``)."""
  del overrides  # generation has no saved run to resume
  check_keys(cfg, {"seed", "num_prompts", "model", "rollout", "sampling"}, "")
  model, tokenizer = build_model(cfg)
  rollout = section(cfg, "rollout")
  precompile = rollout.get("precompile", False)  # default: compile what the request reaches
  engine_config = to_dataclass(EngineConfig, rollout, "rollout", ignore={"precompile"},
                               pad_token_id=tokenizer.pad_token_id or 0)
  sampling = to_dataclass(SamplingParams, section(cfg, "sampling"), "sampling", seed=cfg.seed)
  texts = list(prompts) if prompts else demo_prompts(cfg.num_prompts, cfg.seed)
  ids = encode_prompts(tokenizer, texts, chat=chat)
  check_lengths(ids, engine_config, sampling, given=bool(prompts),
                bos_id=None if chat else getattr(tokenizer, "bos_token_id", None))
  engine = RolloutEngine(model, config=engine_config)
  if precompile:
    n = engine.precompile()
    print(f"precompiled {n} executables in {engine.compile_seconds:.1f}s", flush=True)
  with progress_bar(len(ids), "generating", "row") as bar:
    result = engine.generate(ids, sampling, progress=lambda done, _: bar.update(done - bar.n))
  completions = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
  shown = len(texts) if prompts else 8
  for text, completion in list(zip(texts, completions))[:shown]:
    print(f"{text!r} -> {completion!r}")
  lengths = np.array([len(t) for t in result.tokens])
  s = result.stats.to_dict()
  print(f"lengths p50={np.percentile(lengths, 50):.0f} p90={np.percentile(lengths, 90):.0f} "
        f"max={lengths.max()} | segments (bucket, steps): {[seg[:2] for seg in s['segments']]}")
  print(f"{s['tokens']} tokens in {s['wall_s']:.2f}s ({s['tokens_per_s']:.0f} tok/s excl. "
        f"compile), compiles during generate: {s['compiles']} ({s['compile_s']:.1f}s)")
  return dict(s, texts=completions)


def check_lengths(ids: list[list[int]], engine_config: EngineConfig, sampling: SamplingParams,
                  given: bool, bos_id: int | None = None) -> None:
  """The engine's limits, checked before it is built, in the flags a user types (``bos_id``:
  the tokenizer's BOS, which starts every prompt and counts)."""
  if sampling.max_new_tokens > engine_config.max_new_tokens:
    raise ConfigError(
        f"--config.sampling.max_new_tokens={sampling.max_new_tokens} exceeds "
        f"--config.rollout.max_new_tokens={engine_config.max_new_tokens} (the longest completion "
        "the engine is built for); lower the first or raise the second")
  for i, prompt in enumerate(ids):
    if len(prompt) > engine_config.max_prompt_len:
      which = f"--prompt number {i + 1}" if given else f"demo prompt {i}"
      extra = " (with its BOS)" if bos_id is not None else ""
      raise ConfigError(
          f"{which} is {len(prompt)} tokens long{extra} but --config.rollout.max_prompt_len is "
          f"{engine_config.max_prompt_len}; raise --config.rollout.max_prompt_len to at least "
          f"{max(len(p) for p in ids)} or shorten the prompt")


def prompt_flag() -> dict:
  from absl import flags  # pylint: disable=import-outside-toplevel
  return {"prompts": flags.DEFINE_multi_string("prompt", None, "a prompt text (repeatable)"),
          "chat": flags.DEFINE_bool("chat", False, "send each prompt as a user message in the "
                                    "tokenizer's chat template")}


if __name__ == "__main__":
  from tlt_jax import cli  # pylint: disable=import-outside-toplevel
  sys.exit(cli.main(__doc__, run, DEFAULT_CONFIG, sys.argv, extra_flags=prompt_flag))
