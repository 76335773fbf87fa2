"""Loading a pretrained model by its path: the one place that picks a checkpoint format.

  model, config = from_pretrained(path)     # an HF directory or a .gguf file
  config = pretrained_config(path)          # its ModelConfig, without reading the weights
  tokenizer = load_tokenizer(path)          # also a tokenizer file or "char:<alphabet>"

A path with the ``.gguf`` suffix that is not a directory is read by ``tlt_jax.models.gguf``,
anything else as a Hugging Face directory by ``tlt_jax.models.hf``; the format modules never
dispatch to each other. The GGUF reader (and so the ``gguf`` package) is imported only when a
``.gguf`` path is loaded.
"""

from __future__ import annotations

from pathlib import Path

from tlt_jax.models import hf
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer, HFTokenizer
from tlt_jax.models.transformer import Transformer

GGUF_SUFFIX = ".gguf"
CHAR_PREFIX = "char:"


def is_gguf_path(path: str | Path) -> bool:
  """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix; it need not exist yet)."""
  path = Path(path)
  return path.suffix.lower() == GGUF_SUFFIX and not path.is_dir()


def from_pretrained(path: str | Path, dtype: str | None = None, *,
                    strict: bool = True) -> tuple[Transformer, ModelConfig]:
  """Loads a local HF Qwen2/Llama directory or a ``.gguf`` file as a ``Transformer``.

  ``dtype`` overrides the checkpoint's (a ``.gguf`` file, llama.cpp's format, is dequantized to
  ``dtype``, default float32). Every param is set from the checkpoint; ``strict`` rejects
  unknown (non-harmless) tensors. A damaged, incomplete, misshapen or non-finite checkpoint
  raises a one-line ``WeightsError``. See :func:`tlt_jax.models.hf.from_pretrained` and
  :func:`tlt_jax.models.gguf.load_gguf`.
  """
  path = Path(path)
  if is_gguf_path(path):
    from tlt_jax.models.gguf import load_gguf  # pylint: disable=import-outside-toplevel
    return load_gguf(path, dtype=dtype, strict=strict)
  return hf.from_pretrained(path, dtype=dtype, strict=strict)


def pretrained_config(path: str | Path, dtype: str | None = None) -> ModelConfig:
  """The ``ModelConfig`` of a pretrained checkpoint (HF directory or .gguf), without its weights."""
  path = Path(path)
  if is_gguf_path(path):
    from tlt_jax.models.gguf import gguf_config  # pylint: disable=import-outside-toplevel
    return gguf_config(path, dtype=dtype)
  return hf.config_from_hf(hf.read_hf_config(path), dtype=dtype)


def load_tokenizer(path: str | Path) -> HFTokenizer | CharTokenizer:
  """A tokenizer from a model directory (``char_tokenizer.json`` or ``tokenizer.json``), a
  tokenizer file, a ``.gguf`` file (its metadata's tokenizer), or ``"char:<alphabet>"``."""
  if isinstance(path, str) and path.startswith(CHAR_PREFIX):
    return CharTokenizer(path[len(CHAR_PREFIX):])
  path = Path(path)
  if is_gguf_path(path):
    from tlt_jax.models.gguf import tokenizer_from_gguf  # pylint: disable=import-outside-toplevel
    return tokenizer_from_gguf(path)
  char_file = path / CHAR_TOKENIZER_FILE if path.is_dir() else path
  if char_file.name == CHAR_TOKENIZER_FILE and char_file.is_file():
    return CharTokenizer.from_file(char_file)
  return HFTokenizer.from_file(path)
