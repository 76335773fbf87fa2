"""Where one plain (non-speculative) decode step of our RolloutEngine spends its time.

  python -m experiments.rollout.profile_decode_step [--batch 32] [--repeats 7] [--trace]

Runs in the project venv (/tmp/venv) or the tunix venv; needs no checkpoint (timings do not
depend on the weights). Model: the bench_vs_tunix shape (4 layers, hidden 256, 8 / 4 KV heads,
SwiGLU 768, vocab 512, fp32). The state is a real prefilled ``DecodeState`` (prompt 64) in one
cache of ``prompt + new`` = 192 slots (``kv_buckets=()``), greedy, no stop ids.

Ablation: each variant is jitted as ``fori_loop(K steps)`` over the carried state, exactly as a
decode segment runs (so per-call dispatch is amortised and nothing is hoisted out of the loop),
and timed per step; variants are interleaved across ``--repeats``; min and median are reported
and differences are taken of the minima.

  step          ``StepFunctions.vanilla_step`` as is (forward + row_keys + sample_tokens + _emit)
  segment       the engine's own compiled segment executable (``lax.while_loop``), per step
  fwd           forward + argmax feedback + ``cache.advance`` (the minimum a step must do)
  fwd_nowrite   fwd, with the per-row KV write (vmapped dynamic_update_slice) made a no-op
  fwd_where     fwd, with the KV write as a one-hot select instead of a batched scatter
  fwd_emit      fwd + ``_emit`` (argmax tokens; no row_keys, no sample_tokens)
  fwd_sample    fwd + row_keys + sample_tokens (no _emit)
  sample        row_keys + sample_tokens alone, on [B, V] logits
  row_keys      the per-row PRNG folding alone
  logprobs      filtered_logprobs alone (the top-k/top-p sort sits behind a lax.cond)
  categorical   vmap(jax.random.categorical) alone (computed, then discarded, at temperature 0)
  emit          ``_emit`` alone (stop-id check + scatter of tokens/logprobs into [B, N])
  attn_slot_major / attn_head_major / attn_head_major_vt
                the attention core of all layers alone (KV write, scores, softmax, PV) with the
                cache laid out as now ``[B, S, Hkv, D]``, head-major ``[B, Hkv, S, D]``, or
                head-major K with V stored transposed ``[B, Hkv, D, S]``

``fwd_nowrite`` is not a clean ablation: without the scatter XLA still re-lays the cache out
for the attention einsums (unfused), so it is no faster; read the KV write's own cost from the
trace instead.

The engine is read through its public pieces only: ``weights``, ``prefill`` and
``executable`` (the compiled segment) of ``RolloutEngine``, and the step functions of its
``steps``.

``--trace`` also captures one engine segment with ``jax.profiler`` (perfetto JSON; the CPU thunk
runtime records one event per executed HLO op) and sums the op events per decode step, grouped by
the innermost Python function each op came from (read from the HLO's stack-frame tables).
On a loaded machine the op times are inflated, but their shares are still telling.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from experiments import harness
from experiments.harness import (EngineConfig, ModelConfig, RolloutEngine, SamplingParams,
                                 init_model, write_report)
from tlt_jax.models import transformer as tr
from tlt_jax.rollout import SamplerArgs, filtered_logprobs, row_keys, sample_tokens


def make_engine(batch: int, prompt_len: int, new_tokens: int, seed: int):
  config = harness.bench_config(tie_word_embeddings=False)
  model = init_model(config, seed=seed)
  engine = RolloutEngine(model, config=EngineConfig(
      max_batch=batch, max_prompt_len=prompt_len, max_new_tokens=new_tokens, kv_buckets=(),
      batch_buckets=(batch,), prefill_buckets=(prompt_len,)))
  return engine, config


class _LaxWithWrite(types.SimpleNamespace):
  """``jax.lax`` with another ``dynamic_update_slice``: swapped into the transformer module
  to ablate the per-row KV-cache write (only Attention calls it there)."""

  def __init__(self, dus):
    super().__init__()
    self._dus = dus

  def __getattr__(self, name):
    return getattr(lax, name)

  @property
  def dynamic_update_slice(self):
    return self._dus


def _write_nothing(buf, new, index):
  del new, index
  return buf


def _write_where(buf, new, index):
  """One-hot select over the slots (vmapped per row: a select over the whole [S, H, D] row)."""
  slot = jnp.arange(buf.shape[0])
  hit = (slot >= index[0]) & (slot < index[0] + new.shape[0])
  src = jnp.take(new, jnp.clip(slot - index[0], 0, new.shape[0] - 1), axis=0)
  return jnp.where(hit[:, None, None], src, buf)


def attention_layout_variants(config: ModelConfig, batch: int, kv_len: int, prompt_len: int,
                              steps: int):
  """The attention core of all layers alone (KV write + scores + softmax + PV), with the cache
  as now (``[B, S, Hkv, D]``, slot-major) or head-major (``[B, Hkv, S, D]``). Slot-major makes XLA
  copy every layer's whole K and V into ``[B, Hkv, D, S]`` each step for the dot_generals."""
  heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
  groups, layers = heads // kv_heads, config.num_layers
  write = jax.vmap(lambda buf, new, at: lax.dynamic_update_slice(buf, new, (at, 0, 0)))
  write_t = jax.vmap(lambda buf, new, at: lax.dynamic_update_slice(buf, new, (0, 0, at)))

  def core(head_major: bool, v_transposed: bool = False):
    def body(i, carry):
      ks, vs, lengths, q = carry
      mask = jnp.arange(kv_len)[None, :] <= lengths[:, None]  # [B, S]
      new_ks, new_vs = [], []
      for layer in range(layers):
        k_new = jnp.tanh(q[:, :, :kv_heads] + layer)  # [B, 1, Hkv, D]
        v_new = jnp.tanh(q[:, :, :kv_heads] - layer)
        if head_major:  # K cache [B, Hkv, S, D]; V cache the same or [B, Hkv, D, S]
          k = write(ks[layer], k_new.transpose(0, 2, 1, 3), lengths)
          if v_transposed:
            v = write_t(vs[layer], v_new.transpose(0, 2, 3, 1), lengths)
          else:
            v = write(vs[layer], v_new.transpose(0, 2, 1, 3), lengths)
          qg = q.reshape(batch, 1, kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)  # b k g t d
          scores = jnp.einsum("bkgtd,bksd->bkgts", qg, k) / np.sqrt(dim)
        else:  # cache [B, S, Hkv, D], as Attention does now
          k = write(ks[layer], k_new, lengths)
          v = write(vs[layer], v_new, lengths)
          qg = q.reshape(batch, 1, kv_heads, groups, dim)
          scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) / np.sqrt(dim)
        scores = jnp.where(mask[:, None, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        if v_transposed:
          out = jnp.einsum("bkgts,bkds->btkgd", probs, v)
        elif head_major:
          out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
        else:
          out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
        q = q + 1e-3 * out.reshape(q.shape)
        new_ks.append(k)
        new_vs.append(v)
      return tuple(new_ks), tuple(new_vs), lengths + 1, q

    def run(ks, vs, lengths, q):
      return lax.fori_loop(0, steps, body, (ks, vs, lengths, q))
    return jax.jit(run, donate_argnums=(0, 1))

  def inputs(head_major: bool, v_transposed: bool = False):
    shape = (batch, kv_heads, kv_len, dim) if head_major else (batch, kv_len, kv_heads, dim)
    v_shape = (batch, kv_heads, dim, kv_len) if v_transposed else shape
    zeros = lambda sh: tuple(jnp.zeros(sh, jnp.float32) for _ in range(layers))
    return (zeros(shape), zeros(v_shape), jnp.full((batch,), prompt_len, jnp.int32),
            jnp.ones((batch, 1, heads, dim), jnp.float32) * 0.1)

  return {"attn_slot_major": (core(False), functools.partial(inputs, False)),
          "attn_head_major": (core(True), functools.partial(inputs, True)),
          "attn_head_major_vt": (core(True, True), functools.partial(inputs, True, True))}


def build_variants(engine: RolloutEngine, args: SamplerArgs, steps: int):
  """name -> (jitted fn(weights, state, logits) -> carry, how it is called)."""
  vocab = engine.model_config.vocab_size

  def fwd_body(target, s):
    out = target.forward(s.last_token[:, None], cache=s.cache)
    tok = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
    return out, tok

  def loop(body):
    def run(weights, state):
      target, _ = engine.steps.merge(weights)
      return lax.fori_loop(0, steps, lambda i, s: body(target, s), state)
    return jax.jit(run, donate_argnums=1)

  def step(target, s):
    return engine.steps.vanilla_step(target, s, args)

  def fwd(target, s):
    out, tok = fwd_body(target, s)
    return dataclasses.replace(s, cache=out.cache.advance(1), last_token=tok)

  def fwd_emit(target, s):
    out, tok = fwd_body(target, s)
    logp = jnp.take_along_axis(out.logits[:, 0], tok[:, None], axis=-1)
    return engine.steps.emit(s, ~s.done, tok[:, None], logp, jnp.ones_like(tok),
                             out.cache.advance(1), tok, args)

  def fwd_sample(target, s):
    out = target.forward(s.last_token[:, None], cache=s.cache)
    keys = row_keys(args.seed, s.row_id, s.num_generated)
    tok, logp = sample_tokens(out.logits[:, 0], keys, args)
    return dataclasses.replace(s, cache=out.cache.advance(1), last_token=tok,
                               num_generated=s.num_generated + 1,
                               logprobs=s.logprobs.at[:, 0].set(logp))

  def with_write(dus, body):
    """``body`` traced with the transformer's KV write replaced by ``dus``."""
    def wrapped(target, s):
      saved = tr.lax
      tr.lax = _LaxWithWrite(dus)
      try:
        return body(target, s)
      finally:
        tr.lax = saved
    return wrapped

  def emit(target, s):
    del target
    tok = (s.last_token * 7 + 1) % vocab
    return engine.steps.emit(s, ~s.done, tok[:, None], tok[:, None].astype(jnp.float32) * -0.01,
                             jnp.ones_like(tok), s.cache.advance(1), tok, args)

  # pieces on [B, V] logits carried through the loop (so nothing is loop-invariant)
  def on_logits(piece):
    def run(logits, rows, pos):
      def body(i, carry):
        lg, acc = carry
        out = piece(lg, rows, pos + i)
        return lg + 1e-7 * out[:, :1], acc + out[:, :1]
      return lax.fori_loop(0, steps, body, (logits, jnp.zeros((logits.shape[0], 1))))
    return jax.jit(run)

  def p_sample(lg, rows, pos):
    tok, logp = sample_tokens(lg, row_keys(args.seed, rows, pos), args)
    return (tok.astype(jnp.float32) + logp)[:, None]

  def p_row_keys(lg, rows, pos):
    keys = row_keys(args.seed, rows, pos)
    return jax.random.key_data(keys)[:, :1].astype(jnp.float32) * 0 + lg[:, :1]

  def p_logprobs(lg, rows, pos):
    del rows, pos
    return filtered_logprobs(lg, args.temperature, args.top_k, args.top_p)

  def p_categorical(lg, rows, pos):
    keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.key(0), r * 1000 + p))(rows, pos)
    return jax.vmap(jax.random.categorical)(keys, lg).astype(jnp.float32)[:, None]

  state_fns = dict(step=loop(step), fwd=loop(fwd),
                   fwd_nowrite=loop(with_write(_write_nothing, fwd)),
                   fwd_where=loop(with_write(_write_where, fwd)),
                   fwd_emit=loop(fwd_emit), fwd_sample=loop(fwd_sample), emit=loop(emit))
  logit_fns = dict(sample=on_logits(p_sample), row_keys=on_logits(p_row_keys),
                   logprobs=on_logits(p_logprobs), categorical=on_logits(p_categorical))
  return state_fns, logit_fns


def _hlo_sources(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> ``innermost_python_function:line`` from the module's stack frames."""
  def section(name):
    parts = hlo_text.split("\n" + name + "\n")
    return parts[1].split("\n\n")[0].splitlines() if len(parts) > 1 else []
  funcs = dict(re.findall(r'^(\d+) "(.*)"$', "\n".join(section("FunctionNames")), re.M))
  locs = {i: (funcs.get(f, "?"), line) for i, f, line in re.findall(
      r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+) line=(\d+)",
      "\n".join(section("FileLocations")), re.M)}
  frames = dict(re.findall(r"^(\d+) \{file_location_id=(\d+)",
                           "\n".join(section("StackFrames")), re.M))
  where = {}
  for name, frame in re.findall(r"%([\w.\-]+) = [^\n]*?stack_frame_id=(\d+)", hlo_text):
    func, line = locs.get(frames.get(frame, ""), ("?", "?"))
    where[name] = f"{func}:{line}"
  return where


_CATEGORIES = (  # (innermost function prefix, category); first match wins
    ("Attention.__call__.<locals>.<lambda>", "kv write (vmapped dynamic_update_slice = scatter)"),
    ("Attention.__call__", "attention core (scores, softmax, PV, reshapes)"),
    ("Linear.__call__", "linear layers (q/k/v/o, MLP, lm_head matmuls)"),
    ("MLP.__call__", "MLP elementwise (silu * up)"),
    ("apply_rope", "rope"), ("rope_inv_freq", "rope"),
    ("RMSNorm.__call__", "rms norms"), ("DecoderLayer.__call__", "residual adds"),
    ("attention_mask", "attention mask build"), ("positions_and_mask", "attention mask build"),
    ("Embed", "embedding lookup"), ("Transformer.", "transformer glue"),
    ("row_keys", "row_keys PRNG folding"), ("sample_tokens", "sample_tokens (categorical, argmax)"),
    ("filtered_logprobs", "filtered_logprobs (log_softmax; sort behind lax.cond)"),
    ("StepFunctions.emit", "_emit (stop check, scatter into [B, N])"),
    ("_is_stop", "_emit (stop check, scatter into [B, N])"),
    ("KVCache", "cache bookkeeping"), ("StepFunctions.segment", "while_loop condition"),
    ("StepFunctions.vanilla_step", "_decode_step glue"),
)


def _category(op: str, where: str) -> str:
  if op.startswith("transpose_copy") and where.startswith("Attention.__call__.<locals>"):
    return "KV-cache relayout copy [B,S,Hkv,D] -> [B,Hkv,D,S] for the attention einsums"
  for prefix, category in _CATEGORIES:
    if where.startswith(prefix):
      return category
  return f"other ({where})"


def trace_segment(segment, run, steps_of, top: int):
  """Captures one segment run with jax.profiler (perfetto JSON) and sums the executed HLO ops,
  by category (from each op's Python source) and by op; microseconds per decode step."""
  logdir = tempfile.mkdtemp(prefix="tlt_trace_")
  jax.profiler.start_trace(logdir, create_perfetto_trace=True)
  out = run()
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  steps = steps_of(out)
  files = glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    return {"error": f"no perfetto trace written under {logdir}"}
  with gzip.open(files[0]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  where = _hlo_sources(segment.as_text())
  by_op: dict[str, float] = {}
  for ev in events:
    name = ev.get("name", "")
    # leaf HLO ops only: not the thunk executor, python frames or the enclosing while/conditional
    if ev.get("ph") != "X" or name not in where or name.split(".")[0] in (
        "while", "conditional", "call"):
      continue
    by_op[name] = by_op.get(name, 0.0) + ev["dur"] / steps
  by_cat: dict[str, float] = {}
  for name, us in by_op.items():
    cat = _category(name, where[name])
    by_cat[cat] = by_cat.get(cat, 0.0) + us
  total = sum(by_op.values())
  return dict(trace=files[0], steps=steps, op_us_per_step_total=total,
              by_category=sorted(by_cat.items(), key=lambda kv: -kv[1]),
              top_ops=[(n, us, where[n]) for n, us in
                       sorted(by_op.items(), key=lambda kv: -kv[1])[:top]])


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--steps", type=int, default=48, help="decode steps per timed call")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--trace", action="store_true", help="also run jax.profiler on a segment")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="experiments/out/profile_decode_step.json")
  a = parser.parse_args()
  if a.steps + 1 > a.new_tokens:
    parser.error("--steps must be below --new-tokens (rows must stay live)")

  engine, config = make_engine(a.batch, a.prompt_len, a.new_tokens, a.seed)
  params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, stop_token_ids=())
  args = SamplerArgs.from_params(params, (), engine.config.max_stop_ids)
  rng = np.random.default_rng(a.seed)
  ids = rng.integers(0, config.vocab_size, (a.batch, a.prompt_len)).astype(np.int32)
  lens = np.full((a.batch,), a.prompt_len, np.int32)
  rows = np.arange(a.batch, dtype=np.int32)
  weights = engine.weights()

  def fresh_state():
    return engine.prefill(ids, lens, args)

  state0 = fresh_state()
  kv_len = state0.cache.max_len
  print(f"batch {a.batch}, cache {kv_len} slots, prompt {a.prompt_len}, {a.steps} steps/call, "
        f"backend {jax.default_backend()}, {os.cpu_count()} CPUs", flush=True)

  state_fns, logit_fns = build_variants(engine, args, a.steps)
  logits = jnp.asarray(rng.normal(size=(a.batch, config.vocab_size)).astype(np.float32))
  pos = jnp.ones((a.batch,), jnp.int32)

  # the engine's own segment (while_loop until every row finishes), per step
  segment = engine.executable(("segment", a.batch, kv_len, engine.pool.stop_at(a.batch),
                               "vanilla"))

  def run_segment():
    st = fresh_state()
    jax.block_until_ready(st)
    t0 = time.perf_counter()
    out = segment(weights, st, args, np.int32(0), np.int32(0), np.int32(0))
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / int(out.counters["steps"])

  def run_state(fn):
    st = fresh_state()
    jax.block_until_ready(st)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(weights, st))
    return (time.perf_counter() - t0) / a.steps

  def run_logits(fn):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(logits, jnp.asarray(rows), pos))
    return (time.perf_counter() - t0) / a.steps

  def run_attention(fn, make_inputs):
    inputs = make_inputs()
    jax.block_until_ready(inputs)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    return (time.perf_counter() - t0) / a.steps

  runners = {"segment": run_segment}
  runners.update({k: functools.partial(run_attention, f, mk) for k, (f, mk) in
                  attention_layout_variants(config, a.batch, kv_len, a.prompt_len,
                                            a.steps).items()})
  runners.update({k: functools.partial(run_state, f) for k, f in state_fns.items()})
  runners.update({k: functools.partial(run_logits, f) for k, f in logit_fns.items()})
  t0 = time.perf_counter()
  for run in runners.values():  # compile + warm up
    run()
  print(f"compiled {len(runners)} variants in {time.perf_counter() - t0:.1f}s", flush=True)

  # sanity: the fori_loop step is the engine's step (same tokens as its segment)
  ref = segment(weights, fresh_state(), args, np.int32(0), np.int32(0), np.int32(0))
  mine = state_fns["step"](weights, fresh_state())
  got = np.asarray(mine.tokens)[:, :a.steps + 1]
  want = np.asarray(ref.tokens)[:, :a.steps + 1]
  assert np.array_equal(got, want), "the ablation step must reproduce the engine's tokens"

  times = harness.interleaved(lambda name, _rep: runners[name](), runners, a.repeats)
  med = {k: statistics.median(v) * 1e6 for k, v in times.items()}  # microseconds per step
  best = {k: min(v) * 1e6 for k, v in times.items()}
  # differences are taken of the minima (the least-disturbed run of each variant)
  step, fwd = best["step"], best["fwd"]
  derived = {
      "bookkeeping = step - fwd": step - fwd,
      "sampling (row_keys + sample_tokens) = fwd_sample - fwd": best["fwd_sample"] - fwd,
      "emit = fwd_emit - fwd": best["fwd_emit"] - fwd,
      "kv write (vmapped dynamic_update_slice) = fwd - fwd_nowrite": fwd - best["fwd_nowrite"],
      "kv write as one-hot select instead = fwd_where - fwd_nowrite":
          best["fwd_where"] - best["fwd_nowrite"],
      "attention core: slot-major - head-major cache":
          best["attn_slot_major"] - best["attn_head_major"],
      "attention core: slot-major - head-major K with V as [B,Hkv,D,S]":
          best["attn_slot_major"] - best["attn_head_major_vt"],
      "while_loop segment vs fori step = segment - step": best["segment"] - step,
  }
  print(f"\nper decode step over {a.repeats} interleaved repeats (us; % of the engine step's "
        f"min {step:.0f} us):")
  print(f"  {'variant':16s} {'min':>9s} {'median':>9s}  {'min %':>6s}")
  for name in times:
    print(f"  {name:16s} {best[name]:9.1f} {med[name]:9.1f}  {100 * best[name] / step:6.1f}%")
  print("derived (from the minima; noise on a busy machine is several hundred us):")
  for name, us in derived.items():
    print(f"  {name:62s} {us:8.1f} us  {100 * us / step:6.1f}%")
  summary = dict(batch=a.batch, kv_len=kv_len, prompt_len=a.prompt_len, steps=a.steps,
                 repeats=a.repeats, us_per_step_min=best, us_per_step_median=med,
                 derived_us=derived, all_s_per_step=times,
                 **harness.machine("backend", "jax", "cpu_count", "loadavg_end"))
  if a.trace:
    tr_out = trace_segment(
        segment, lambda: segment(weights, fresh_state(), args, np.int32(0), np.int32(0), np.int32(0)),
        lambda out: int(out.counters["steps"]), top=20)
    summary["trace"] = tr_out
    if "error" in tr_out:
      print("jax.profiler: " + tr_out["error"])
    else:
      total = tr_out["op_us_per_step_total"]
      print(f"\njax.profiler, one segment ({tr_out['steps']} steps): executed HLO ops, us per "
            f"step (sum {total:.0f} us; ops on the 2 threads may overlap)")
      for cat, us in tr_out["by_category"]:
        print(f"  {us:8.1f}  {100 * us / total:5.1f}%  {cat}")
      print("top ops:")
      for name, us, where in tr_out["top_ops"]:
        print(f"  {us:8.1f}  {name:28s} {where}")
  write_report(a.out, summary)


if __name__ == "__main__":
  main()
