"""Tokenizers: the char-level one and the Hugging Face ``tokenizer.json`` wrapper."""

from __future__ import annotations

import json

import pytest

from tlt_jax.models.load import load_tokenizer
from tlt_jax.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog",
          "12 + 30 = 42, and 7 * 6 = 42 too",
          "Reasoning: first add, then check the answer."]


def test_char_tokenizer_round_trip():
  tokenizer = CharTokenizer("0123456789+= ")
  assert isinstance(tokenizer, Tokenizer)
  assert tokenizer.vocab_size == 3 + 13
  assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
  ids = tokenizer.encode("12 + 30 = 42")
  assert min(ids) >= 3
  assert tokenizer.decode(ids) == "12 + 30 = 42"
  with_specials = [tokenizer.bos_token_id] + ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
  assert tokenizer.decode(with_specials) == "<bos>12 + 30 = 42<eos><pad>"
  assert tokenizer.decode(with_specials, skip_special_tokens=True) == "12 + 30 = 42"


def test_char_tokenizer_errors_and_custom_specials():
  tokenizer = CharTokenizer("ab", specials=("<eos>",))
  assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (None, None, 0)
  with pytest.raises(ValueError, match="'c'"):
    tokenizer.encode("abc")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tokenizer.decode([3])
  with pytest.raises(ValueError, match="repeats"):
    CharTokenizer("aba")


def test_load_tokenizer_char_spec():
  tokenizer = load_tokenizer("char:xyz")
  assert isinstance(tokenizer, CharTokenizer)
  assert tokenizer.decode(tokenizer.encode("zyx")) == "zyx"


def build_tokenizer_json(directory) -> None:
  """Trains a small byte-level BPE on ``CORPUS`` and saves ``directory/tokenizer.json``."""
  from tokenizers import Tokenizer as RawTokenizer
  from tokenizers import decoders, models, pre_tokenizers, trainers

  raw = RawTokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  raw.train_from_iterator(CORPUS, trainer=trainer)
  raw.save(str(directory / "tokenizer.json"))


@pytest.fixture
def tokenizer_dir(tmp_path):
  build_tokenizer_json(tmp_path)
  return tmp_path


def test_hf_tokenizer_round_trip(tokenizer_dir):
  (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "<|bos|>", "special": True}, "eos_token": "<|eos|>",
       "pad_token": None}))
  (tokenizer_dir / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [99, 100], "pad_token_id": 0}))
  tokenizer = HFTokenizer.from_file(tokenizer_dir)
  assert isinstance(tokenizer, Tokenizer)
  assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
  assert tokenizer.vocab_size <= 300
  for text in CORPUS + ["unseen wörds: ∑ 3.14159!", ""]:
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text
  ids = tokenizer.encode(CORPUS[0])
  assert len(ids) < len(CORPUS[0])  # merges were learned
  wrapped = [tokenizer.bos_token_id] + ids + [tokenizer.eos_token_id]
  assert tokenizer.decode(wrapped, skip_special_tokens=True) == CORPUS[0]
  assert tokenizer.decode(wrapped) == "<|bos|>" + CORPUS[0] + "<|eos|>"


def test_hf_tokenizer_without_configs(tokenizer_dir):
  tokenizer = load_tokenizer(tokenizer_dir / "tokenizer.json")
  assert isinstance(tokenizer, HFTokenizer)
  assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (None,) * 3
  assert tokenizer.decode(tokenizer.encode("the dog")) == "the dog"


def test_hf_tokenizer_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    HFTokenizer.from_file(tmp_path)


def test_saved_tokenizers_load_back_from_a_model_directory(tokenizer_dir, tmp_path):
  """``save`` + ``load_tokenizer(dir)``: same ids and special ids (what final_model relies on)."""
  char = CharTokenizer("0123+=?", specials=("<pad>", "<bos>", "<eos>", "<sep>"))
  (tmp_path / "char").mkdir()
  char.save(tmp_path / "char")
  loaded = load_tokenizer(tmp_path / "char")
  assert isinstance(loaded, CharTokenizer) and loaded.specials == char.specials
  assert loaded.encode("12+3=?") == char.encode("12+3=?") and loaded.vocab_size == char.vocab_size
  hf_tok = HFTokenizer.from_file(tokenizer_dir)
  hf_tok = HFTokenizer(hf_tok.tokenizer, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  (tmp_path / "hf").mkdir()
  hf_tok.save(tmp_path / "hf")
  again = load_tokenizer(tmp_path / "hf")
  assert isinstance(again, HFTokenizer)
  assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)
  assert again.encode(CORPUS[0]) == hf_tok.encode(CORPUS[0])
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "char_tokenizer.json").write_text("{}")
  with pytest.raises(ValueError, match="char_tokenizer.json is not a char tokenizer file"):
    load_tokenizer(tmp_path / "bad")


def test_named_chat_templates_render_the_default_one(tokenizer_dir):
  """tokenizer_config's list form ``[{name, template}, ...]`` (as transformers writes it) picks
  the template named ``default``, else the first."""
  named = [{"name": "tool_use", "template": "TOOLS {{ messages[0]['content'] }}"},
           {"name": "default", "template": "PLAIN {{ messages[0]['content'] }}"}]
  config_file = tokenizer_dir / "tokenizer_config.json"
  config_file.write_text(json.dumps({"chat_template": named}))
  messages = [{"role": "user", "content": "hi"}]
  rendered = HFTokenizer.from_file(tokenizer_dir).apply_chat_template(messages)
  assert rendered == "PLAIN hi"
  config_file.write_text(json.dumps({"chat_template": named[:1]}))
  rendered = HFTokenizer.from_file(tokenizer_dir).apply_chat_template(messages)
  assert rendered == "TOOLS hi"
