"""Launches per decode step: what command buffers and several steps per loop iteration save.

  python -m experiments.sd.launch_ab [--shapes mid,tiny] [--batches 1,16,64,4]
      [--arms vanilla,suffix,chain,tree] [--ks 1,2,4] [--settings default,cmdbuf]
      [--steps 8,32] [--repeats 5] [--budget-s 450] [--out experiments/out/launch_ab.json]
  python -m experiments.sd.launch_ab --count [--shapes tiny,mid] [--batches 1,4,16,64]
      [--out experiments/out/launch_ab_counts.json]      # the kernel-count proxy, no timing

On an H200 a 145M policy's 1-token pass takes 0.55-0.98 ms while reading its weights takes
~0.1 ms: a decode step is bound by its kernel launches, and a speculative step's extra kernels
(drafter passes, verify, the acceptance walk) cost in launches what they save in weight reads.
Two levers cut launches without touching the model; this measures whether they pay before either
is built into the engine:

* **command buffers over the loop** (``--settings cmdbuf``): XLA:GPU already records straight
  runs of at least 5 fusions / library calls as CUDA graphs, but not ``while`` and
  ``conditional``. So each iteration of a decode segment copies its predicate to the host to
  decide on the next, and every conditional (the top-k/top-p filter, the coupled draft's noise)
  splits the graphs. Adding WHILE and CONDITIONAL records the whole segment as one graph with
  conditional nodes (CUDA 12.3+). Each setting runs in a subprocess of its own, since XLA reads
  ``XLA_FLAGS`` once, when JAX starts.
* **k decode steps per loop iteration** (``--ks 1,2,4``): a ``lax.while_loop`` whose body runs
  k steps, built here from the engine's own step functions (``StepFunctions.vanilla_step`` /
  ``spec_step``, as ``StepFunctions.segment`` calls them), so the loop's condition and its
  host round trip come once per k steps. The condition asks for room for k steps; the k steps
  run unguarded, which is exact because a step changes nothing for a finished row (``emit``
  masks it), and costs at most k - 1 idle steps where a segment ends. Its tokens are checked
  against k = 1's (``same_tokens_as_k1``), and tests/test_launch_ab.py checks them greedy.

Arms, each from an engine built as the long-tail jobs build theirs (random weights: acceptance
does not change a step's cost, only which of its tokens are kept; every shape is static):
``vanilla`` (a plain engine, the job's vanilla arm), ``suffix`` (the suffix drafter's chain of
depth 8: configs/tiny_longtail.py's TLT), ``chain`` (the EAGLE drafter's chain of depth 3, the
mid job's learned arm) and ``tree`` (an EAGLE tree of depth 5, 4 children, 16 verified tokens:
the bench target's), the last three from one adaptive engine (``eagle+suffix``, coupled
verification) that shares one state layout (its cache has the tree's slack). ``vanilla_tlt``
(that engine's vanilla steps, which also keep the drafter's features) is there on request.

Per (setting, shape, batch, arm, k): the milliseconds a decode step takes, from a prefilled
state (prompts of 80 tokens, a cache of the full capacity: 80 + 352 new tokens + the slack), as
the difference of the medians of ``--repeats`` runs of the long and the short step count over
their difference (the call's dispatch and the state's copy cancel), and the total over the long
run; the compiled program's kernels per step (``hlo_counts``: fusions, library calls, dots,
copies, loops and conditionals per step, read from the optimized HLO, a range since which branch
of a conditional runs is decided at run time; on a GPU also the command-buffer regions). The
JSON is rewritten after each batch bucket, so a timeout leaves figures; a worker that crashes
(e.g. a command-buffer bug of the XLA at hand) is recorded with its output's tail and the next
one starts. ``--budget-s`` bounds the run: each worker (the 145M shape's first) gets a share of
what is left (``SHAPE_COST``: the 145M shape's programs take 3x as long to compile), starts no
bucket past its share and is stopped ``--grace-s`` after it. The first setting's workers also
trace their k = 1 programs in the first bucket (``--count-steps``) for the kernels a step
executes: on a GPU the device's kernels and memcpys (a loop's predicate copied to the host).

``--count`` compiles the same programs on this machine, runs each under ``jax.profiler`` and
writes only the kernel counts, static (HLO) and executed (XLA:CPU's thunk runtime traces one event
per executed op): the proxy a CPU gives (docs/results/launch_ab_cpu.md). XLA:CPU fuses otherwise,
runs dots as library calls and hashes random bits in rolled loops (kept apart as ``prng``), so
its counts rank the arms and show what k saves; they are not a GPU's.

Model shapes: ``tiny`` = configs/tiny_longtail.py's policy (hidden 128, 3 layers, fp32), ``mid``
= configs/mid_longtail.py's (1024 x 12, 145M parameters, bf16 arithmetic on an accelerator:
``compute_dtype="auto"``), ``toy`` = a 1-layer model for tests; the char-level policy's other
fields as the job builds them (``tlt_jax/job/build.py``: Qwen2, q/k/v biases, tied embeddings,
the arithmetic task's 19-token vocabulary). The configs are not imported, since the accelerator
image has no ml_collections; tests/test_launch_ab.py checks that the shapes match them.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import functools
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from experiments import harness
from experiments.harness import (ArithmeticTask, CharTokenizer, Drafter, EngineConfig, ModelConfig,
                                 RolloutEngine, SamplingParams, SpecConfig, Transformer)
from tlt_jax.rollout import SamplerArgs, SuffixConfig

# the policies' shapes (configs/tiny_longtail.py via tiny_grpo.py, configs/mid_longtail.py's
# MODEL); compute_dtype "auto": bf16 arithmetic on a GPU/TPU, the params' fp32 on a CPU
SHAPES = {
    "toy": dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                compute_dtype=None),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                 num_kv_heads=2, compute_dtype=None),
    "mid": dict(hidden_size=1024, intermediate_size=3072, num_layers=12, num_heads=16,
                num_kv_heads=4, compute_dtype="auto"),
}
# a shape's share of the budget, against the others' (compiling the 145M policy's programs takes
# most of a device run)
SHAPE_COST = {"toy": 1, "tiny": 1, "mid": 3}
PROMPT_LEN = 80  # the long-tail jobs' prompt bucket (rollout.max_prompt_len)
MAX_NEW = 352  # their trainer.max_new_tokens
EAGLE_CHAIN = SpecConfig(3, 1, 4)  # the job's EAGLE arm (job/rollout_config.EAGLE_STRATEGIES)
EAGLE_TREE = SpecConfig(5, 4, 16)  # the bench target's tree (harness.BENCH_STRATEGIES)
MOST_EMITTED = SuffixConfig().depth + 1  # the most tokens a step of any arm emits (suffix d8)
# arm -> (engine, the engine's strategy group)
ARMS = {"vanilla": ("plain", "vanilla"), "suffix": ("sd", "suffix d8"),
        "chain": ("sd", "chain d3"), "tree": ("sd", "tree v16"),
        "vanilla_tlt": ("sd", "vanilla")}
# XLA_FLAGS per setting, added to the caller's. Source: openxla/xla xla/debug_options_flags.cc
# (DefaultDebugOptionsIgnoringFlags: command buffers default to FUSION, CUBLAS, CUBLASLT,
# CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION; xla_gpu_graph_min_graph_size 5) and xla/xla.proto's
# DebugOptions.CommandBufferCmdType (WHILE, CONDITIONAL). The flag takes a list that replaces the
# defaults, or "+X,-Y" entries that edit them (ParseRepeatedEnumModifiers; jaxlib 0.10.2 has it:
# "All values must be incremental or none of them." is in its library); an empty value turns
# command buffers off. An unknown value stops JAX at start-up (checked on this CPU: the flags
# parse in the CPU jaxlib too). WHILE in command buffers needs CUDA graph conditional nodes
# (CUDA 12.3+); openxla/xla PR 35760 (2025-12-27) fixed a crash on a while loop's second run.
SETTINGS = {
    "default": "",
    "cmdbuf": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "cmdbuf_min1": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
                   "--xla_gpu_graph_min_graph_size=1",
    "nocmdbuf": "--xla_gpu_enable_command_buffer=",
}
# HLO instructions that launch nothing (views, tuples, constants folded into their users)
FREE_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                      "after-all", "opt-barrier", "partition-id", "replica-id", "domain"})


# ------------------------------------------------------------------------- models and engines


def model_config(shape: str) -> ModelConfig:
  """The policy of ``shape`` as the job builds the char-level policy (``job/build.py``)."""
  fields = dict(SHAPES[shape])
  if fields["compute_dtype"] == "auto":  # as job/build.resolve_compute_dtype reads it
    fields["compute_dtype"] = None if jax.default_backend() == "cpu" else "bfloat16"
  tokenizer = CharTokenizer(ArithmeticTask().alphabet)
  return ModelConfig(vocab_size=tokenizer.vocab_size, architecture="qwen2", attention_bias=True,
                     tie_word_embeddings=True, max_position_embeddings=512,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     **fields)


def build_engines(shape: str, batch: int, abstract: bool = False) -> dict[str, RolloutEngine]:
  """``plain`` (vanilla decoding) and ``sd`` (the EAGLE chain and tree and the suffix chain) for
  one static batch bucket and a cache of the full capacity (``kv_buckets=()``). ``abstract``:
  weights as shapes only (``nnx.eval_shape``), enough to lower and compile, not to run."""
  config = model_config(shape)
  make = nnx.eval_shape if abstract else (lambda f: f())
  target = make(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  drafter = make(lambda: Drafter.create(config, seed=1))
  base = dict(max_batch=batch, batch_buckets=(batch,), max_prompt_len=PROMPT_LEN,
              prefill_buckets=(PROMPT_LEN,), max_new_tokens=MAX_NEW, compaction=False,
              kv_buckets=(), verify="coupled")
  return {"plain": RolloutEngine(target, config=EngineConfig(**base)),
          "sd": RolloutEngine(target, drafter=drafter, suffix=SuffixConfig(),
                              config=EngineConfig(**base, strategies=(EAGLE_CHAIN, EAGLE_TREE),
                                                  sd_offers="all"))}


def k_step_loop(steps, group: str, k: int):
  """A decode segment of ``group`` whose loop body runs ``k`` steps: called as the engine's
  segment is, ``(weights, state, args, choice, max_steps, stop_at) -> state`` (``max_steps``:
  steps at most, a multiple of ``k`` to be exact; 0: no limit). Not donating its state, so one
  prefilled state serves every run."""
  g = steps.groups[group]
  need = k * (1 if g.is_vanilla else steps.config.step_slots)  # cache slots k steps may write

  def run(weights, state, args, choice, max_steps, stop_at):
    target, drafter = steps.merge(weights)
    if g.is_vanilla:
      step = lambda s: steps.vanilla_step(target, s, args)
    else:
      step = lambda s: steps.spec_step(target, drafter, s, args, g, choice)
    kv_len = state.cache.max_len

    def go_on(carry):
      s, i = carry
      live = ~s.done
      go = jnp.sum(live) > stop_at
      if kv_len < steps.config.cache_len:  # below the capacity: room for all k steps
        go &= ~jnp.any(live & (s.cache.lengths + need > kv_len))
      return go & ((max_steps <= 0) | (i < max_steps))

    def body(carry):
      s, i = carry
      for _ in range(k):
        s = step(s)
      return s, i + k

    return lax.while_loop(go_on, body, (state, jnp.zeros((), jnp.int32)))[0]

  return jax.jit(run)


def lower_arm(engines: dict[str, RolloutEngine], arm: str, k: int, batch: int):
  """The k-step loop of ``arm`` lowered for its engine's weights, state, args and scalars."""
  engine_name, group = ARMS[arm]
  pool = engines[engine_name].pool
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  state = pool.state_spec(batch, engines[engine_name].config.cache_len)
  return k_step_loop(engines[engine_name].steps, group, k).lower(
      pool.weights_spec(), state, pool.args_spec(), scalar, scalar, scalar)


def compile_all(lowerers: dict, threads: int) -> tuple[dict, dict]:
  """``{key: compiled}`` of ``{key: lower()}``: each program lowered in the caller (tracing
  holds the GIL) and handed at once to one of ``threads`` compiling threads (XLA releases it), so
  lowering the next overlaps compiling the last; an exception in the place of a program XLA could
  not compile. Also the seconds each compile took."""
  seconds = {}

  def one(key, lowered):
    t0 = time.perf_counter()
    try:
      out = lowered.compile()
    except Exception as e:  # pylint: disable=broad-except  # e.g. a setting this XLA refuses
      out = e
    seconds[key] = time.perf_counter() - t0
    return out

  if threads <= 1:
    return {key: one(key, lower()) for key, lower in lowerers.items()}, seconds
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    futures = {key: pool.submit(one, key, lower()) for key, lower in lowerers.items()}
    return {key: f.result() for key, f in futures.items()}, seconds


def compile_threads() -> int:
  """Half the host's cores, at most 8 (as the engine's ``AotCache`` compiles); 1 on 2 cores."""
  return max(1, min(8, (os.cpu_count() or 2) // 2))


# ------------------------------------------------------------------------ the kernel counts


def parse_hlo(text: str) -> tuple[dict[str, list[str]], str]:
  """The computations of an HLO module's text (name -> instruction lines) and the entry's name."""
  comps: dict[str, list[str]] = {}
  entry, current = "", None
  for line in text.splitlines():
    head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
    if head:
      current = head.group(2)
      comps[current] = []
      entry = current if head.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and re.match(r"^\s+(ROOT )?%", line):
      comps[current].append(line)
  return comps, entry


def opcode(line: str) -> str:
  """The opcode of one HLO instruction line (``%x = SHAPE opcode(...)``; a tuple shape is
  parenthesised and may hold spaces)."""
  rest = line.split(" = ", 1)[1]
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        break
    rest = rest[i + 1:]
  else:
    rest = rest.split(" ", 1)[1]
  return re.match(r"\s*([\w\-]+)\(", rest).group(1)


def called(line: str, attr: str) -> list[str]:
  """The computations an instruction names under ``attr`` (``body``, ``to_apply``,
  ``branch_computations``, ...)."""
  m = re.search(attr + r"=(\{[^}]*\}|%[\w.\-]+)", line)
  return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


PRNG_LOOP = re.compile(r'op_name="[^"]*(threefry|_uniform|_gumbel|random_bits)[^"]*/while"')


def op_class(op: str) -> str:
  """The class an HLO opcode's launch is counted in: ``fusion``, ``custom-call`` (library calls:
  cuBLAS, cuDNN, sorts), ``dot`` (unfused dots and convolutions), ``copy``, ``while`` and
  ``conditional`` (each a host decision without command buffers), ``other`` (unfused scatters,
  slices, reductions, ...)."""
  if op in ("fusion", "custom-call", "copy", "while", "conditional"):
    return op
  return "dot" if op in ("dot", "convolution") else "other"


def kernel_tally(comps: dict, name: str, memo: dict, pick=max) -> collections.Counter:
  """What one run of computation ``name`` launches, by ``op_class``, with ``cmd_buffer``
  (calls of a command-buffer region: a GPU's graphs) and ``loop_iterations`` (of nested loops).
  A nested loop counts its body and condition times its known trip count (once where unknown:
  ``unknown_trips``), a PRNG loop (``PRNG_LOOP``) as one ``prng_loop`` and its work as
  ``prng``; a call what it calls; a conditional the branch ``pick`` (max or min)
  chooses by launches: which branch runs is decided at run time (the sampling's temperature,
  top-k, top-p), so the static count is a range."""
  if name in memo:
    return memo[name]
  tally = collections.Counter()
  for line in comps.get(name, ()):
    op = opcode(line)
    if op in FREE_OPS:
      continue
    if op == "while":
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
      n = int(trips.group(1)) if trips else 1
      tally["unknown_trips"] += 0 if trips else 1
      inner = kernel_tally(comps, called(line, "body")[0], memo, pick) + kernel_tally(
          comps, called(line, "condition")[0], memo, pick)
      if PRNG_LOOP.search(line):  # a CPU's rolled threefry hash: kept apart
        tally["prng_loop"] += 1
        tally["prng"] += n * (launches(inner) + inner["prng"])
        continue
      tally.update({key: n * v for key, v in inner.items()})
      tally["loop_iterations"] += n
    elif op == "conditional":
      branches = called(line, "branch_computations") or (
          called(line, "true_computation") + called(line, "false_computation"))
      tallies = [kernel_tally(comps, b, memo, pick) for b in branches]
      tally.update(pick(tallies, key=launches) if tallies else {})
    elif op == "call":
      target = called(line, "to_apply")[0]
      tally.update(kernel_tally(comps, target, memo, pick))
      tally["cmd_buffer"] += target.startswith("command_buffer")
      continue
    tally[op_class(op)] += 1
  memo[name] = tally
  return tally


def launches(tally) -> int:
  """Kernels and host decisions in a tally (not its region or iteration counts, nor the PRNG
  loops' work)."""
  return sum(v for key, v in tally.items() if key not in (
      "cmd_buffer", "loop_iterations", "unknown_trips", "prng", "prng_loop"))


def outer_loop(comps: dict, entry: str) -> str:
  """The line of the segment's while loop: in the entry computation or a computation it calls
  (with WHILE command buffers XLA:GPU moves the loop into a ``command_buffer`` call), not a PRNG
  loop hoisted out of it (a loop-invariant hash, e.g. a row's key folds): the largest body."""
  names, loops = [entry], []
  while names:
    lines = comps.get(names.pop(), ())
    loops += [line for line in lines if opcode(line) == "while" and not PRNG_LOOP.search(line)]
    names += [c for line in lines if opcode(line) == "call" for c in called(line, "to_apply")]
  if not loops:
    raise ValueError("no while loop in the entry computation or its calls")
  return max(loops, key=lambda line: len(comps.get(called(line, "body")[0], ())))


def hlo_counts(text: str, k: int) -> dict:
  """Per decode step, what the outermost loop of a compiled k-step segment runs (its body and
  condition once per iteration, over ``k``), read from the optimized HLO: ``max`` with every
  conditional's largest branch, ``min`` with its smallest; ``kernels`` sums the launching
  classes, ``iterations`` is the outer loop's iterations a step (1 / k)."""
  comps, entry = parse_hlo(text)
  loop = outer_loop(comps, entry)
  out = {}
  for pick in (min, max):
    memo: dict = {}
    tally = kernel_tally(comps, called(loop, "body")[0], memo, pick) + kernel_tally(
        comps, called(loop, "condition")[0], memo, pick)
    per_step = {key: round(v / k, 2) for key, v in sorted(tally.items())}
    per_step["kernels"] = round(launches(tally) / k, 2)
    out[pick.__name__] = per_step
  out["iterations"] = round(1 / k, 3)
  return out


def prng_computations(comps: dict) -> set[str]:
  """The computations that run inside a PRNG loop: jax lowers threefry hashing as a rolled loop
  of 5 rounds on a CPU (unrolled and fused on a GPU), so a CPU's counts keep it apart."""
  inside: set[str] = set()
  todo = [name for lines in comps.values() for line in lines
          if opcode(line) == "while" and PRNG_LOOP.search(line)
          for name in called(line, "body") + called(line, "condition")]
  while todo:
    name = todo.pop()
    if name not in inside:
      inside.add(name)
      todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations|"
                         r"true_computation|false_computation)=\{?%([\w.\-]+)",
                         "\n".join(comps.get(name, ())))
  return inside


def hlo_range(counts: dict) -> str:
  """``hlo_counts``' kernels per step as "min-max" ("?" where the HLO was not read)."""
  if "min" not in counts:
    return "?"
  return f"{counts['min']['kernels']:g}-{counts['max']['kernels']:g}"


def instruction_classes(text: str) -> dict[str, str]:
  """Each HLO instruction's name -> its ``op_class``, as ``prng/<class>`` inside a PRNG loop
  (``prng_computations``) and ``prng_loop`` for such a loop itself."""
  comps = parse_hlo(text)[0]
  prng = prng_computations(comps)
  classes = {}
  for comp, lines in comps.items():
    for line in lines:
      name = line.split(" = ", 1)[0].strip().removeprefix("ROOT ").lstrip("%")
      op = opcode(line)
      if op == "while" and PRNG_LOOP.search(line):
        classes[name] = "prng_loop"
      else:
        classes[name] = f"prng/{op_class(op)}" if comp in prng else op_class(op)
  return classes


def traced_events(run) -> tuple[list[dict], dict[int, str], dict[tuple, str]]:
  """The complete events of a ``jax.profiler`` trace of ``run()``, each process's name and each
  line's (``(pid, tid)``: "process / thread")."""
  import glob  # pylint: disable=import-outside-toplevel
  import gzip  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  logdir = tempfile.mkdtemp(prefix="launch_ab_trace_")
  jax.profiler.start_trace(logdir, create_perfetto_trace=True)
  try:
    jax.block_until_ready(run())
  finally:
    jax.profiler.stop_trace()
  files = glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)
  with gzip.open(files[0]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  meta = [e for e in events if e.get("ph") == "M"]
  processes = {e["pid"]: e.get("args", {}).get("name", "") for e in meta
               if e.get("name") == "process_name"}
  lines = {(e["pid"], e.get("tid")): f"{processes.get(e['pid'], '')} / "
           f"{e.get('args', {}).get('name', '')}" for e in meta if e.get("name") == "thread_name"}
  return [e for e in events if e.get("ph") == "X"], processes, lines


LAUNCHING = ("fusion", "custom-call", "dot", "copy", "while", "conditional", "other", "kernel")


def event_classes(events, processes, lines, classes: dict[str, str]) -> collections.Counter:
  """Executed work by class: on a CPU each event named after an HLO instruction (the thunk
  runtime's one event per executed op) by ``classes``; on a GPU each event of a device process,
  per line (``line/...``), and on its CUDA stream lines (all device lines where none is named a
  stream) as ``kernel``, ``memcpy`` (e.g. a loop's predicate copied to the host) or ``memset``."""
  tally = collections.Counter()
  if jax.default_backend() == "cpu":
    tally.update(classes[e["name"]] for e in events if e.get("name") in classes)
    return tally
  device = [e for e in events if re.search(r"gpu|device", processes.get(e.get("pid"), ""), re.I)]
  line_of = lambda e: lines.get((e.get("pid"), e.get("tid")), processes.get(e.get("pid"), ""))
  streams = any("stream" in line_of(e).lower() for e in device)
  for e in device:
    line = line_of(e)
    tally["line/" + line] += 1
    if "stream" in line.lower() or not streams:
      low = e.get("name", "").lower()
      tally["memcpy" if "memcpy" in low else "memset" if "memset" in low else "kernel"] += 1
  return tally


def executed_per_step(fn, call_args: tuple, text: str, steps_pair: tuple[int, int]) -> dict:
  """What the compiled k-step loop ``fn`` executes per decode step, from two traced runs
  (``fn(*call_args, max_steps, 0)``: their difference over the steps between): by class
  (``event_classes``) and ``executed``, the launching classes' sum: on a CPU without the PRNG
  loops, whose loops (``prng_loop``, each a fused kernel or two on a GPU) and ops inside
  (``prng/...``) are summed apart as ``prng``; on a GPU the stream lines' kernels."""
  classes = instruction_classes(text)
  counts = []
  for n in steps_pair:
    events, processes, lines = traced_events(
        lambda n=n: fn(*call_args, np.int32(n), np.int32(0)))
    counts.append(event_classes(events, processes, lines, classes))
  span = steps_pair[1] - steps_pair[0]
  per_step = {key: round((counts[1][key] - counts[0][key]) / span, 2)
              for key in sorted(set(counts[0]) | set(counts[1]))
              if counts[1][key] != counts[0][key]}
  per_step["prng"] = round(sum(v for key, v in per_step.items() if key.startswith("prng")), 2)
  per_step["executed"] = round(sum(per_step.get(key, 0) for key in LAUNCHING), 2)
  return per_step


# ------------------------------------------------------------------------------- the timing


def prefilled(engine: RolloutEngine, batch: int, args: SamplerArgs, seed: int):
  """The decode state after prefilling ``batch`` random prompts of ``PROMPT_LEN`` tokens (no
  specials: ids from 3 on)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, engine.model_config.vocab_size, (batch, PROMPT_LEN)).astype(np.int32)
  return engine.prefill(ids, np.full((batch,), PROMPT_LEN, np.int32), args)


def time_program(fn, weights, state, args, steps_pair: tuple[int, int], repeats: int
                 ) -> tuple[dict, np.ndarray]:
  """Milliseconds per decode step of the compiled k-step loop ``fn``: the marginal
  ``(median(long) - median(short)) / (long - short)`` and the total ``median(long) / long``;
  the steps it ran and its tokens after the long run (one untimed run first)."""
  short, long = steps_pair
  choice, zero = np.int32(0), np.int32(0)
  out = jax.block_until_ready(fn(weights, state, args, choice, np.int32(long), zero))
  ran = int(out.counters["steps"])
  times: dict[int, list[float]] = {short: [], long: []}
  for rep in range(repeats):
    for n in ((short, long) if rep % 2 == 0 else (long, short)):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(weights, state, args, choice, np.int32(n), zero))
      times[n].append(time.perf_counter() - t0)
  med = {n: statistics.median(v) for n, v in times.items()}
  return dict(ms_per_step=1e3 * (med[long] - med[short]) / (long - short),
              ms_per_step_total=1e3 * med[long] / long, steps_run=ran,
              seconds={str(n): v for n, v in times.items()}), np.asarray(out.tokens)


def bucket_programs(shape: str, batch: int, a) -> tuple[dict, SamplerArgs, dict, dict, dict]:
  """One batch bucket's engines, sampler args, prefilled states (per engine) and every (arm, k)
  program compiled (in threads), with the seconds each compile took."""
  engines = build_engines(shape, batch)
  params = SamplingParams(max_new_tokens=MAX_NEW, temperature=a.temperature, seed=a.seed,
                          stop_token_ids=())
  args = SamplerArgs.from_params(params, (), engines["plain"].config.max_stop_ids)
  used = {ARMS[arm][0] for arm in a.arms}
  states = {name: prefilled(engines[name], batch, args, a.seed) for name in used}
  lowerers = {(arm, k): functools.partial(lower_arm, engines, arm, k, batch)
              for arm in a.arms for k in a.ks}
  compiled, seconds = compile_all(lowerers, compile_threads())
  return engines, args, states, compiled, seconds


def measure_program(program, call_args: tuple, k: int, a, trace: bool) -> tuple[dict, object]:
  """One compiled k-step loop's entry (its HLO's counts, its times; traced: the kernels it
  executes per step) and its tokens after the long run (None where it failed)."""
  if isinstance(program, Exception):
    return dict(error=f"compile: {program!r}"[:500]), None
  text = program.as_text()
  try:
    entry = dict(hlo=hlo_counts(text, k))
  except (ValueError, IndexError, AttributeError) as e:  # an HLO text this parser misreads
    entry = dict(hlo={"error": repr(e)[:300]})
  try:
    timing, tokens = time_program(program, *call_args[:3], a.steps, a.repeats)
  except Exception as e:  # pylint: disable=broad-except  # recorded; the next program runs
    return dict(entry, error=f"run: {e!r}"[:500]), None
  entry.update(timing)
  if trace:
    try:
      entry["executed"] = executed_per_step(program, call_args, text, a.count_steps)
    except Exception as e:  # pylint: disable=broad-except  # a profiler without device traces
      entry["executed"] = {"error": repr(e)[:300]}
  return entry, tokens


def run_bucket(shape: str, batch: int, a, deadline: float) -> dict:
  """Every arm and k of one batch bucket: compiled together, then timed one after another
  (none started past ``deadline``); per arm and k its times, its HLO's kernel counts (with
  ``a.trace``, in the first bucket, k = ``a.ks[0]``'s executed kernels too: a trace costs
  seconds, and a step's kernels hardly change with the batch) and whether its tokens are those
  of the first k timed (``same_tokens_as_k1``: ``--ks`` starts at 1)."""
  engines, args, states, compiled, seconds = bucket_programs(shape, batch, a)
  cell: dict = {}
  for arm in a.arms:
    name = ARMS[arm][0]
    call_args = (engines[name].weights(), states[name], args, np.int32(0))
    first_tokens = None
    for k in a.ks:
      if time.time() > deadline:
        entry, tokens = dict(skipped="budget"), None
      else:
        trace = bool(a.trace) and k == a.ks[0] and batch == a.batches[0]
        entry, tokens = measure_program(compiled[arm, k], call_args, k, a, trace)
      entry["compile_s"] = round(seconds[arm, k], 2)
      if tokens is not None:
        first_tokens = tokens if first_tokens is None else first_tokens
        entry["same_tokens_as_k1"] = bool(np.array_equal(tokens, first_tokens))
      cell.setdefault(arm, {})[str(k)] = entry
      print(f"  {shape} b{batch} {arm:11s} k={k}: " + (
          f"{entry['ms_per_step']:.3f} ms/step ({entry['ms_per_step_total']:.3f} total), "
          f"{hlo_range(entry['hlo'])} HLO kernels/step, "
          f"same tokens {entry['same_tokens_as_k1']}" if "ms_per_step" in entry
          else entry.get("error", entry.get("skipped"))), flush=True)
  return cell


# ---------------------------------------------------------------------- the report's file


def update_report(path, fn) -> None:
  """Reads the JSON at ``path`` (empty where there is none), applies ``fn`` to it and writes it
  whole or not at all (a worker killed while writing leaves the last report)."""
  path = pathlib.Path(path)
  report = json.loads(path.read_text()) if path.exists() else {}
  fn(report)
  os.replace(harness.write_json(path.with_name(path.name + ".tmp"), report), path)


def worker(a) -> None:
  """One setting's subprocess: the buckets of one shape, each written into the report as done."""
  setting, shape = a.worker.split(":")
  deadline = time.time() + a.budget_s
  print(f"== worker {setting}:{shape}: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        f"{jax.devices()[0].device_kind}, {a.budget_s:.0f}s", flush=True)
  for batch in a.batches:
    if time.time() > deadline:
      print(f"  {shape} b{batch}: skipped (budget)", flush=True)
      continue
    t0 = time.perf_counter()
    cell = run_bucket(shape, batch, a, deadline)
    cell["bucket_s"] = round(time.perf_counter() - t0, 1)

    def put(report, cell=cell, batch=batch):
      report.setdefault("cells", {}).setdefault(setting, {}).setdefault(shape, {})[
          str(batch)] = cell
      report.setdefault("worker_machine", {})[f"{setting}:{shape}"] = dict(
          harness.machine("jax", "backend", "device_kind", "cpu_count"),
          xla_flags=os.environ.get("XLA_FLAGS", ""))
    update_report(a.out, put)


def stream(proc, prefix: str, tail: collections.deque) -> threading.Thread:
  """A thread that prints ``proc``'s output lines and keeps the last ones in ``tail``."""
  def pump():
    for line in proc.stdout:
      print(prefix + line, end="", flush=True)
      tail.append(line.rstrip())
  thread = threading.Thread(target=pump, daemon=True)
  thread.start()
  return thread


def worker_args(a, setting: str, shape: str, budget: float) -> list[str]:
  """The worker's command line: the parent's choices, its own setting, shape and budget; it
  traces (``--trace``) in the first setting unless told otherwise."""
  trace = a.trace if a.trace is not None else int(setting == a.settings[0])
  return [sys.executable, "-m", "experiments.sd.launch_ab", "--worker", f"{setting}:{shape}",
          "--trace", str(trace),
          "--batches", ",".join(map(str, a.batches)), "--arms", ",".join(a.arms),
          "--ks", ",".join(map(str, a.ks)), "--steps", ",".join(map(str, a.steps)),
          "--repeats", str(a.repeats), "--temperature", str(a.temperature),
          "--seed", str(a.seed), "--count-steps", ",".join(map(str, a.count_steps)),
          "--budget-s", f"{budget:.0f}", "--out", str(a.out)]


def run_worker(a, setting: str, shape: str, budget: float) -> dict:
  """Runs one worker with the setting's flags added to ``XLA_FLAGS``, stopped ``a.grace_s``
  after its ``budget``; what it ended with."""
  flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), SETTINGS[setting]) if f)
  env = dict(os.environ, XLA_FLAGS=flags, PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.ROOT), env.get("PYTHONPATH")) if p)
  t0, tail = time.time(), collections.deque(maxlen=30)
  proc = subprocess.Popen(worker_args(a, setting, shape, budget), env=env, cwd=harness.ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  thread = stream(proc, "", tail)
  try:
    code = proc.wait(timeout=budget + a.grace_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    code = f"killed after {budget + a.grace_s:.0f}s"
    proc.wait()
  thread.join(timeout=5)
  return dict(setting=setting, shape=shape, xla_flags=flags, exit=code, budget_s=round(budget),
              seconds=round(time.time() - t0, 1), tail=list(tail) if code != 0 else [])


def summary_rows(report: dict, settings: list[str], ks: list[int]) -> list[dict]:
  """Per (shape, batch, arm): ms per step by setting and k, and the levers' ratios against the
  default setting at k = 1 (below 1: faster)."""
  cells = report.get("cells", {})
  rows = []
  keys = sorted({(shape, int(b), arm) for s in cells.values() for shape, by_b in s.items()
                 for b, by_arm in by_b.items() for arm in by_arm if arm != "bucket_s"})
  for shape, batch, arm in keys:
    ms = {f"{s} k{k}": cells.get(s, {}).get(shape, {}).get(str(batch), {}).get(arm, {}).get(
        str(k), {}).get("ms_per_step") for s in settings for k in ks}
    base = ms.get(f"{settings[0]} k{ks[0]}")
    ratio = {key: round(v / base, 3) for key, v in ms.items() if v and base and base > 0}
    rows.append(dict(shape=shape, batch=batch, arm=arm, ms_per_step=ms, vs_first=ratio))
  return rows


def print_summary(rows: list[dict]) -> None:
  if not rows:
    print("no figures")
    return
  cols = list(rows[0]["ms_per_step"])
  print("ms per decode step (x the first column)")
  print(f"{'shape':6s} {'batch':>5s} {'arm':11s} " + " ".join(f"{c:>20s}" for c in cols))
  for r in rows:
    cells = [("-" if r["ms_per_step"][c] is None else f"{r['ms_per_step'][c]:.3f}") +
             (f" ({r['vs_first'][c]:.2f}x)" if c in r["vs_first"] else "") for c in cols]
    print(f"{r['shape']:6s} {r['batch']:5d} {r['arm']:11s} " + " ".join(f"{c:>20s}"
                                                                          for c in cells))


def parent(a) -> None:
  """Every (shape, setting) worker in turn, within ``--budget-s``; the report's summary."""
  start = time.time()
  header = dict(command=" ".join(sys.argv), date=datetime.date.today().isoformat(),
                settings={s: SETTINGS[s] for s in a.settings},
                config=dict(shapes=a.shapes, batches=a.batches, arms=a.arms, ks=a.ks,
                            steps=a.steps, repeats=a.repeats, temperature=a.temperature,
                            prompt_len=PROMPT_LEN, max_new_tokens=MAX_NEW,
                            shapes_fields={s: SHAPES[s] for s in a.shapes}),
                # not the backend: the parent leaves the device to its workers
                machine=harness.machine("platform", "python", "cpu_count", "jax"),
                workers=[], cells={})
  harness.write_json(a.out, header)
  runs = [(setting, shape) for shape in a.shapes for setting in a.settings]
  for i, (setting, shape) in enumerate(runs):
    left = a.budget_s - (time.time() - start)
    weight = SHAPE_COST[shape] / sum(SHAPE_COST[sh] for _, sh in runs[i:])
    if left < 20:
      record = dict(setting=setting, shape=shape, exit="not started: budget")
    else:
      record = run_worker(a, setting, shape, left * weight)
    print(f"== {setting}:{shape}: exit {record['exit']}", flush=True)
    update_report(a.out, lambda r, rec=record: r.setdefault("workers", []).append(rec))
  report = json.loads(pathlib.Path(a.out).read_text())
  report["summary"] = summary_rows(report, a.settings, a.ks)
  report["seconds"] = round(time.time() - start, 1)
  harness.write_json(a.out, report)
  print_summary(report["summary"])
  print(f"wrote {a.out} in {report['seconds']:.0f}s")


def count_mode(a) -> None:
  """The kernel-count proxy on this machine: every (shape, batch, arm, k) compiled, its HLO's
  kernels per step (``hlo_counts``) and the kernels it executes per step (``executed_per_step``,
  traced over ``a.count_steps``), the JSON rewritten after each bucket."""
  report = dict(command=" ".join(sys.argv), date=datetime.date.today().isoformat(),
                machine=harness.machine("platform", "python", "cpu_count", "jax", "backend"),
                config=dict(temperature=a.temperature, steps=a.count_steps,
                            prompt_len=PROMPT_LEN, max_new_tokens=MAX_NEW), counts={})
  for shape in a.shapes:
    for batch in a.batches:
      engines, args, states, compiled, seconds = bucket_programs(shape, batch, a)
      for arm, k in compiled:
        name = ARMS[arm][0]
        text = compiled[arm, k].as_text()
        call_args = (engines[name].weights(), states[name], args, np.int32(0))
        entry = dict(hlo=hlo_counts(text, k), compile_s=round(seconds[arm, k], 1),
                     executed=executed_per_step(compiled[arm, k], call_args, text,
                                                a.count_steps))
        report["counts"].setdefault(shape, {}).setdefault(str(batch), {}).setdefault(
            arm, {})[str(k)] = entry
        print(f"{shape} b{batch} {arm} k{k}: executed {entry['executed']}, HLO "
              f"{hlo_range(entry['hlo'])}", flush=True)
      harness.write_json(a.out, report)
  print("\n".join(counts_table(report["counts"])))
  print(f"wrote {a.out}")


def counts_table(counts: dict) -> list[str]:
  """``--count``'s figures as a markdown table: per shape, batch and arm the ops executed per
  step at each k; k = 1's by class, its PRNG loops, a GPU-like count (without the copies, which
  on a CPU are mostly of the PRNG loops' key state, and each PRNG loop as one kernel) and its
  HLO's static range."""
  ks = sorted({k for by_batch in counts.values() for by_arm in by_batch.values()
               for by_k in by_arm.values() for k in by_k}, key=int)
  rows = [f"| shape | batch | arm | executed / step, k = {', '.join(ks)} | k = {ks[0]}: fusions "
          "/ dots, calls / copies / conditionals / other | PRNG loops | GPU-like | HLO (min-max) |",
          "|---|---|---|---|---|---|---|---|"]
  for shape, by_batch in counts.items():
    for batch, by_arm in by_batch.items():
      for arm, by_k in by_arm.items():
        first = by_k[ks[0]]
        ex, hlo = first["executed"], first["hlo"]
        classes = (ex.get("fusion", 0), ex.get("dot", 0) + ex.get("custom-call", 0),
                   ex.get("copy", 0), ex.get("conditional", 0),
                   ex.get("other", 0) + ex.get("while", 0))
        executed = " / ".join(f"{by_k[k]['executed']['executed']:g}" if k in by_k else "-"
                              for k in ks)
        gpu_like = ex["executed"] - ex.get("copy", 0) + ex.get("prng_loop", 0)
        rows.append(f"| {shape} | {batch} | {arm} | {executed} | "
                    f"{' / '.join(f'{c:g}' for c in classes)} | {ex.get('prng_loop', 0):g} | "
                    f"{gpu_like:g} | {hlo['min']['kernels']:g}-{hlo['max']['kernels']:g} |")
  return rows


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--shapes", default="mid,tiny", help=f"of {sorted(SHAPES)}")
  parser.add_argument("--batches", type=harness.positive_ints, default=[1, 16, 64, 4],
                      help="in the order they run (a worker out of time skips the last)")
  parser.add_argument("--arms", default="vanilla,suffix,chain,tree", help=f"of {list(ARMS)}")
  parser.add_argument("--ks", type=harness.positive_ints, default=[1, 2, 4],
                      help="decode steps per loop iteration (the first is the reference)")
  parser.add_argument("--settings", default="default,cmdbuf", help=f"of {list(SETTINGS)}")
  parser.add_argument("--steps", type=harness.positive_ints, default=[8, 32],
                      help="the short and the long run's decode steps (multiples of every k)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--temperature", type=float, default=1.0, help="the jobs sample at 1")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--budget-s", type=float, default=450.0,
                      help="the whole run's (a worker's: its own share)")
  parser.add_argument("--grace-s", type=float, default=30.0,
                      help="a worker is killed this long after its share")
  parser.add_argument("--trace", type=int, default=None,
                      help="1: trace the first k's runs for the kernels executed per step "
                      "(default: in the first setting's workers)")
  parser.add_argument("--count", action="store_true",
                      help="only the kernel counts (HLO and executed), on this machine")
  parser.add_argument("--count-steps", type=harness.positive_ints, default=[4, 8],
                      help="the two traced runs' decode steps (multiples of every k)")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # SETTING:SHAPE
  parser.add_argument("--out", default=None)
  a = parser.parse_args()
  a.shapes, a.arms, a.settings = (a.shapes.split(","), a.arms.split(","), a.settings.split(","))
  check_args(parser, a)
  if a.count:
    a.out = a.out or "experiments/out/launch_ab_counts.json"
    count_mode(a)
  elif a.worker:
    worker(a)
  else:
    a.out = a.out or "experiments/out/launch_ab.json"
    parent(a)


def check_args(parser, a) -> None:
  for name, values, known in (("shapes", a.shapes, SHAPES), ("arms", a.arms, ARMS),
                              ("settings", a.settings, SETTINGS)):
    unknown = [v for v in values if v not in known]
    if unknown:
      parser.error(f"--{name}: {unknown} unknown; choose from {list(known)}")
  for flag, pair in (("steps", a.steps), ("count-steps", a.count_steps)):
    if len(pair) != 2 or not pair[0] < pair[1]:
      parser.error(f"--{flag} takes two step counts, the short run's below the long run's")
    if any(n % k for n in pair for k in a.ks):
      parser.error(f"--{flag} {pair}: each must be a multiple of every k in --ks {a.ks}")
  most = (MAX_NEW - 1) // MOST_EMITTED
  if max(a.steps[1], a.count_steps[1]) > most:  # rows that reach MAX_NEW end the loop early
    parser.error(f"--steps: the long run may take at most {most} steps (a step emits up to "
                 f"{MOST_EMITTED} tokens; rows stop at {MAX_NEW})")
  if a.repeats < 1:
    parser.error("--repeats must be >= 1")


if __name__ == "__main__":
  main()
