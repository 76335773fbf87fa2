"""A small tokenizer with SmolLM2's chat template, and a tiny pretrained model directory using it:
what the chat-formatted RL paths need, without downloading a model."""

from __future__ import annotations

import json
from pathlib import Path

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.hf import save_pretrained
from tlt_jax.models.load import load_tokenizer
from tlt_jax.models.tokenizer import HFTokenizer
from tlt_jax.models.transformer import init_model

# SmolLM2-135M-Instruct's chat template (ChatML with a default system message), verbatim.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CORPUS = ["State the final answer to the following arithmetic problem: 12 + 7 - 3 =",
          "Give your final answer inside <answer></answer> tags.",
          "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
          "A carpenter works for 2 weeks every month. How much does he earn in a year?",
          "user assistant system 0123456789 + - * / = ?"]


def write_chat_tokenizer(directory: str | Path) -> HFTokenizer:
  """Trains a byte-level BPE (a few hundred ids) into ``directory`` with SmolLM2's specials and
  chat template in tokenizer_config.json; returns it as loaded back by ``load_tokenizer``."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer as RawTokenizer
  from tokenizers import decoders, models, pre_tokenizers, trainers
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  raw = RawTokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  raw.train_from_iterator(CORPUS, trainer=trainer)
  raw.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(
      bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
      chat_template=SMOLLM2_TEMPLATE)))
  return load_tokenizer(directory)


def write_chat_model(directory: str | Path, seed: int = 0) -> HFTokenizer:
  """A tiny random llama-architecture model (1 layer) with the chat tokenizer, saved as an HF
  directory like SmolLM2's (bos <|im_start|>, eos = pad = <|im_end|>); returns the tokenizer."""
  tokenizer = write_chat_tokenizer(directory)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, num_layers=1, architecture="llama",
                            attention_bias=False, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
  save_pretrained(init_model(config, seed=seed), config, directory)
  return tokenizer
