"""Tokenizers: a common protocol, a Hugging Face ``tokenizer.json`` wrapper and a char-level one.

``encode`` maps raw text to ids without adding special tokens (callers add BOS / chat
templates explicitly); ``decode`` keeps special tokens unless asked to skip them.
``HFTokenizer.apply_chat_template`` renders a model's Jinja chat template as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAR_TOKENIZER_FILE = "char_tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of the code base needs from a tokenizer."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def bos_token_id(self) -> int | None: ...

  @property
  def eos_token_id(self) -> int | None: ...

  @property
  def pad_token_id(self) -> int | None: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class CharTokenizer:
  """One id per character of ``alphabet``, after the ``specials`` (ids 0..len(specials)-1).

  Specials named ``<pad>``, ``<bos>``, ``<eos>`` become the pad / bos / eos ids.
  """

  def __init__(self, alphabet: str, specials: Sequence[str] = ("<pad>", "<bos>", "<eos>")):
    if len(set(alphabet)) != len(alphabet):
      repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
      raise ValueError(f"CharTokenizer alphabet repeats characters {repeated}")
    if len(set(specials)) != len(specials):
      raise ValueError(f"CharTokenizer specials repeat: {list(specials)}")
    self.alphabet = alphabet
    self.specials = tuple(specials)
    self._id_of_char = {c: len(self.specials) + i for i, c in enumerate(alphabet)}
    self._tokens = self.specials + tuple(alphabet)

  def _special_id(self, name: str) -> int | None:
    return self.specials.index(name) if name in self.specials else None

  @property
  def vocab_size(self) -> int:
    """Number of ids (specials + alphabet)."""
    return len(self._tokens)

  @property
  def pad_token_id(self) -> int | None:
    """Id of ``<pad>`` if it is a special, else None."""
    return self._special_id("<pad>")

  @property
  def bos_token_id(self) -> int | None:
    """Id of ``<bos>`` if it is a special, else None."""
    return self._special_id("<bos>")

  @property
  def eos_token_id(self) -> int | None:
    """Id of ``<eos>`` if it is a special, else None."""
    return self._special_id("<eos>")

  def encode(self, text: str) -> list[int]:
    """Ids of the characters of ``text``; a character outside the alphabet is a ValueError."""
    try:
      return [self._id_of_char[c] for c in text]
    except KeyError as error:
      raise ValueError(f"Character {error.args[0]!r} is not in the CharTokenizer alphabet "
                       f"{self.alphabet!r}") from None

  def save(self, directory: str | Path) -> None:
    """Writes ``char_tokenizer.json`` into ``directory`` (read back by ``load.load_tokenizer``)."""
    data = {"type": "char", "alphabet": self.alphabet, "specials": list(self.specials)}
    (Path(directory) / CHAR_TOKENIZER_FILE).write_text(json.dumps(data, indent=2) + "\n",
                                                        encoding="utf-8")

  @classmethod
  def from_file(cls, path: str | Path) -> "CharTokenizer":
    """Loads a ``char_tokenizer.json`` written by :meth:`save`; errors name the file."""
    path = Path(path)
    try:
      data = json.loads(path.read_text(encoding="utf-8"))
      return cls(data["alphabet"], tuple(data["specials"]))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{path} is not a char tokenizer file ({type(e).__name__}: {e})") from None

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text of ``ids``; specials appear by name unless skipped."""
    pieces = []
    for token_id in ids:
      token_id = int(token_id)
      if not 0 <= token_id < len(self._tokens):
        raise ValueError(f"Token id {token_id} is outside the vocabulary [0, {len(self._tokens)})")
      if skip_special_tokens and token_id < len(self.specials):
        continue
      pieces.append(self._tokens[token_id])
    return "".join(pieces)


def _token_content(value) -> str | None:
  """The string of a tokenizer_config special-token entry (a string or an AddedToken dict)."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _first_id(value) -> int | None:
  """An id from a generation_config entry (an int or a list of ints)."""
  if isinstance(value, list):
    return int(value[0]) if value else None
  return int(value) if isinstance(value, int) else None


def _template_from_config(value, config_file: Path) -> str | None:
  """A tokenizer_config ``chat_template``: a string, or a list of ``{name, template}`` (the
  ``default`` one, else the first)."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
    named = {t.get("name"): t.get("template") for t in value}
    return named.get("default", value[0].get("template"))
  raise ValueError(f"{config_file}: chat_template must be a string or a list of "
                   f"{{'name', 'template'}} objects, got {type(value).__name__}")


def _chat_environment():
  """A sandboxed Jinja environment set up the way transformers renders chat templates."""
  # pylint: disable=import-outside-toplevel
  import datetime

  from jinja2 import nodes
  from jinja2.ext import Extension, loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in
    transformers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
      next(parser.stream)
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.Scope(body)

  def raise_exception(message: str):
    raise ValueError(f"Chat template error: {message}")

  def tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
             sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[GenerationBlock, loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


class HFTokenizer:
  """A Hugging Face ``tokenizers.Tokenizer`` with special-token ids and the chat template from the
  model directory (or GGUF file)."""

  def __init__(self, tokenizer, bos_token_id: int | None = None, eos_token_id: int | None = None,
               pad_token_id: int | None = None, chat_template: str | None = None):
    self.tokenizer = tokenizer
    self._bos_token_id = bos_token_id
    self._eos_token_id = eos_token_id
    self._pad_token_id = pad_token_id
    self.chat_template = chat_template
    self._compiled: tuple[str, Any] | None = None  # (template source, compiled template)

  @classmethod
  def from_file(cls, path_or_dir: str | Path) -> "HFTokenizer":
    """Loads ``tokenizer.json`` (a file, or the one in a directory) and the special-token ids found
    in ``tokenizer_config.json`` then ``generation_config.json`` beside it (None where absent); the
    chat template from tokenizer_config.json's ``chat_template``, else ``chat_template.jinja``."""
    from tokenizers import Tokenizer as RawTokenizer

    path = Path(path_or_dir)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
      raise FileNotFoundError(f"No tokenizer file at {file}")
    tokenizer = RawTokenizer.from_file(str(file))
    ids: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
    chat_template = None
    config_file = file.parent / TOKENIZER_CONFIG_FILE
    if config_file.is_file():
      tokenizer_config = json.loads(config_file.read_text())
      for kind in ids:
        content = _token_content(tokenizer_config.get(f"{kind}_token"))
        if content is not None:
          ids[kind] = tokenizer.token_to_id(content)
      chat_template = _template_from_config(tokenizer_config.get("chat_template"), config_file)
    template_file = file.parent / CHAT_TEMPLATE_FILE
    if chat_template is None and template_file.is_file():
      chat_template = template_file.read_text(encoding="utf-8")
    generation_file = file.parent / GENERATION_CONFIG_FILE
    if generation_file.is_file():
      generation_config = json.loads(generation_file.read_text())
      for kind in ids:
        if ids[kind] is None:
          ids[kind] = _first_id(generation_config.get(f"{kind}_token_id"))
    return cls(tokenizer, bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
               chat_template=chat_template)

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included."""
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def bos_token_id(self) -> int | None:
    """The BOS id, or None."""
    return self._bos_token_id

  @property
  def eos_token_id(self) -> int | None:
    """The EOS id, or None."""
    return self._eos_token_id

  @property
  def pad_token_id(self) -> int | None:
    """The padding id, or None."""
    return self._pad_token_id

  def _special_tokens(self) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}`` for the special ids this tokenizer knows."""
    return {f"{kind}_token": self.tokenizer.id_to_token(i)
            for kind, i in (("bos", self._bos_token_id), ("eos", self._eos_token_id),
                            ("pad", self._pad_token_id)) if i is not None}

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          **template_kwargs) -> str:
    """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``), rendered with
    the chat template as transformers does; ``template_kwargs`` (e.g. ``tools``) reach the template.

    Tokenize the result with :meth:`encode` (the template already writes any BOS it wants).
    """
    if self.chat_template is None:
      raise ValueError("This tokenizer has no chat template (none in tokenizer_config.json, "
                       f"{CHAT_TEMPLATE_FILE} or the GGUF metadata); set tokenizer.chat_template "
                       "or pass prompts as plain text")
    if isinstance(messages, dict) or not all(isinstance(m, dict) for m in messages):
      raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got "
                      f"{messages!r:.80}")
    if self._compiled is None or self._compiled[0] != self.chat_template:
      self._compiled = (self.chat_template, _chat_environment().from_string(self.chat_template))
    variables = dict(self._special_tokens(), tools=None, documents=None)
    variables.update(template_kwargs)
    return self._compiled[1].render(messages=list(messages),
                                    add_generation_prompt=add_generation_prompt, **variables)

  def save(self, directory: str | Path) -> None:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template)."""
    directory = Path(directory)
    self.tokenizer.save(str(directory / TOKENIZER_FILE))
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                        "clean_up_tokenization_spaces": False}
    tokenizer_config.update(self._special_tokens())
    if self.chat_template is not None:
      tokenizer_config["chat_template"] = self.chat_template
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=2) + "\n",
                                                   encoding="utf-8")

  def encode(self, text: str) -> list[int]:
    """Ids of ``text`` without added special tokens."""
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text of ``ids``."""
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
