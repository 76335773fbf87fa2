"""The offline drafter warm-up: a drafter trained before RL on the policy's own completions.

The TLT paper starts RL with an EAGLE drafter already trained on the initial policy's rollouts;
the online drafter (``online.py``) then keeps it adapted. ``warm_up_drafter`` is that first
training: the policy's completions are packed into rows (``objective.make_batch_from_sequences``),
a drafter (a fresh one unless given) takes ``steps`` jitted optax steps on random ``batch_rows``
rows of them, and its top-1 agreement with the policy is measured over every row.

Every step and every evaluation call sees the same batch shape, so after the first step nothing
compiles again. ``own_sequences`` makes the completions with any rollout (``RolloutEngine``);
``warm_up_on_rollouts`` is the two together, the TLT paper's initial drafter in one call.
The pieces are public for callers with batches, a drafter or an optimizer of their own:
``train_drafter_on_batch`` (a drafter trained on a ready batch, evaluated on it and on held-out
rows), ``train_drafter_steps`` (the loop) and ``evaluate_drafter`` (the token-weighted
evaluation).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.drafter.objective import (DrafterBatch, make_batch_from_sequences, make_eval_step,
                                       make_optimizer, make_train_step, split_drafter)
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer
from tlt_jax.rollout import SamplingParams


def _require_count(name: str, value: Any) -> None:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def own_sequences(rollout, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                  temperature: float = 1.0, seed: int = 0) -> tuple[list[list[int]], list[int]]:
  """``(sequences, prompt_lens)``: each prompt followed by the policy's completion of it, sampled
  by ``rollout`` (a ``RolloutEngine`` or any ``Rollout``) at ``temperature`` with ``seed``."""
  if not prompts:
    raise ValueError("prompts must not be empty")
  result = rollout.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens,
                                                    temperature=temperature, seed=seed))
  sequences = [list(p) + list(t) for p, t in zip(prompts, result.tokens)]
  return sequences, [len(p) for p in prompts]


def evaluate_drafter(eval_step, params: nnx.State, target_params: nnx.State,
                     batch: DrafterBatch, rows: int) -> dict[str, float]:
  """Token-weighted metrics of ``eval_step`` (``make_eval_step``) over every row of ``batch``.

  The rows go in chunks of exactly ``rows`` (the last one wraps round to the first rows, their
  mask zeroed so that they count once), so the step compiles once whatever the row count.
  """
  _require_count("rows", rows)
  totals: dict[str, float] = {}
  n = batch.num_rows
  for start in range(0, n, rows):
    index = np.arange(start, start + rows)
    part = batch.take(index % n)
    if start + rows > n:
      part = part._replace(mask=part.mask * (index < n)[:, None])
    metrics = jax.device_get(eval_step(params, target_params, part))
    weight = float(metrics["num_tokens"])
    for key, value in metrics.items():
      totals[key] = totals.get(key, 0.0) + (weight if key == "num_tokens" else float(value) * weight)
  count = max(totals["num_tokens"], 1.0)
  return {k: (v if k == "num_tokens" else v / count) for k, v in totals.items()}


def train_drafter_steps(step, params: nnx.State, opt_state, target_params: nnx.State,
                        batch: DrafterBatch, *, steps: int, batch_rows: int = 8, seed: int = 0,
                        log_every: int = 50, on_log: Callable[[dict], Any] | None = None
                        ) -> tuple[nnx.State, Any, list[dict], dict[str, float]]:
  """``steps`` calls of ``step`` (``make_train_step``) on ``batch_rows`` rows of ``batch`` drawn
  at random (seeded by ``seed``; with replacement only when there are fewer rows than that).

  Every ``log_every`` steps and after the last one, the step's metrics (rounded to 4 places) with
  ``step`` and ``elapsed_s`` are appended to the log and passed to ``on_log``. Returns
  ``(params, opt_state, log, last)``: ``last`` is the final step's metrics at full precision.
  ``params`` and ``opt_state`` are donated to the step: use the returned ones.
  """
  _require_count("steps", steps)
  _require_count("batch_rows", batch_rows)
  _require_count("log_every", log_every)
  rng = np.random.default_rng(seed)
  replace = batch.num_rows < batch_rows
  t0 = time.perf_counter()
  log: list[dict] = []
  metrics: dict = {}
  for i in range(steps):
    index = rng.choice(batch.num_rows, size=batch_rows, replace=replace)
    params, opt_state, metrics = step(params, opt_state, target_params, batch.take(index))
    if (i + 1) % log_every == 0 or i + 1 == steps:
      entry = {k: round(float(v), 4) for k, v in jax.device_get(metrics).items()}
      entry.update(step=i + 1, elapsed_s=round(time.perf_counter() - t0, 1))
      log.append(entry)
      if on_log is not None:
        on_log(entry)
  last = {k: float(v) for k, v in jax.device_get(metrics).items()}
  return params, opt_state, log, last


def _check_sequences(sequences, prompt_lens, row_len: int) -> None:
  if len(sequences) == 0:
    raise ValueError("sequences must not be empty")
  if len(prompt_lens) != len(sequences):
    raise ValueError(f"prompt_lens must give one length per sequence: {len(prompt_lens)} "
                     f"prompt_lens for {len(sequences)} sequences")
  for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
    if len(seq) <= plen:
      raise ValueError(f"sequences[{i}] must be longer than its prompt (prompt_lens[{i}]="
                       f"{plen}), got {len(seq)} tokens: nothing to train on")
  if not any(min(len(s), row_len) > p for s, p in zip(sequences, prompt_lens)):
    raise ValueError(f"row_len ({row_len}) cuts every sequence before its completion: nothing "
                     "to train on")


def warm_up_drafter(policy: Transformer, sequences: Sequence[Sequence[int]],
                    prompt_lens: Sequence[int], *, steps: int, row_len: int,
                    batch_rows: int = 8, learning_rate: float = 2e-3, seed: int = 0,
                    drafter: Drafter | None = None, log_every: int = 50,
                    on_log: Callable[[dict], Any] | None = None, evaluate: bool = True
                    ) -> tuple[Drafter, dict]:
  """A drafter trained offline for ``steps`` steps on ``sequences`` (prompt + the policy's
  completion; ``prompt_lens`` say where each completion starts) under the frozen ``policy``.

  The sequences are packed into rows of ``row_len`` tokens, and only completion positions train.
  The drafter is ``drafter`` (copied: the caller's stays as it was) or a fresh one from ``seed``;
  ``seed`` also draws the rows, so the same arguments give the same params, bit for bit. The
  optimizer is ``make_optimizer(learning_rate)`` (AdamW, no weight decay, gradients clipped to
  norm 1). ``log_every`` and ``on_log`` are ``train_drafter_steps``'s.

  Returns ``(drafter, report)``; the report holds ``steps``, ``batch_rows``, ``row_len``,
  ``learning_rate``, ``seed``, ``sequences``, ``rows``, ``trained_positions``, ``log``, ``last``
  (the final step's metrics), ``train`` and ``train_top1`` (the token-weighted evaluation over
  every row, ``None`` when ``evaluate`` is false), and ``features_s``, ``train_s`` and
  ``seconds`` (the whole call).
  """
  t0 = time.perf_counter()
  _require_count("steps", steps)
  _require_count("batch_rows", batch_rows)
  _require_count("log_every", log_every)
  if not isinstance(row_len, (int, np.integer)) or isinstance(row_len, bool) or row_len < 2:
    raise ValueError(f"row_len must be an int >= 2, got {row_len!r}")
  if not learning_rate > 0:
    raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
  _check_sequences(sequences, prompt_lens, row_len)

  if drafter is None:
    drafter = Drafter.create(policy.config, seed=seed)
  batch = make_batch_from_sequences(policy, sequences, row_len, prompt_lens=prompt_lens,
                                    pack=True, features=drafter.target_features)
  features_s = time.perf_counter() - t0
  drafter, report = train_drafter_on_batch(
      policy, drafter, batch, steps=steps, batch_rows=batch_rows, learning_rate=learning_rate,
      seed=seed, log_every=log_every, on_log=on_log, evaluate=evaluate)
  report = dict(steps=steps, batch_rows=batch_rows, row_len=row_len,
                learning_rate=learning_rate, seed=seed, sequences=len(sequences),
                rows=int(batch.num_rows), trained_positions=int(batch.mask.sum()),
                log=report["log"], last=report["last"], train=report["train"],
                train_top1=report["train_top1"], features_s=features_s,
                train_s=report["train_s"], seconds=time.perf_counter() - t0)
  return drafter, report


def train_drafter_on_batch(policy: Transformer, drafter: Drafter, batch: DrafterBatch, *,
                           steps: int, batch_rows: int = 8, learning_rate=2e-3, seed: int = 0,
                           log_every: int = 50, on_log: Callable[[dict], Any] | None = None,
                           evaluate: bool = True, held_out: DrafterBatch | None = None
                           ) -> tuple[Drafter, dict]:
  """A copy of ``drafter`` trained for ``steps`` steps on rows of ``batch`` (features of the
  frozen ``policy``; ``make_batch_from_sequences``), as ``warm_up_drafter`` trains: the optimizer
  is ``make_optimizer(learning_rate)`` (a float or an optax schedule; AdamW, no weight decay,
  gradients clipped to norm 1), the rows are drawn by ``seed``, and ``log_every`` and ``on_log``
  are ``train_drafter_steps``'s.

  Returns ``(drafter, report)``: the report holds ``log``, ``last`` (the final step's metrics),
  ``train_s``, ``train`` and ``train_top1`` (the evaluation over every row of ``batch``, ``None``
  unless ``evaluate``), and with ``held_out``, ``held_out_at_init`` and ``held_out`` (its
  evaluation before and after training).
  """
  graphdef, params = split_drafter(drafter)
  params = jax.tree.map(jnp.array, params)  # the step donates its params: train a copy
  optimizer = make_optimizer(learning_rate, weight_decay=0.0, clip_norm=1.0)
  opt_state = optimizer.init(params)
  step = make_train_step(graphdef, policy, optimizer)
  target_params = nnx.state(policy)
  eval_step = make_eval_step(graphdef, policy) if evaluate or held_out is not None else None
  report: dict[str, Any] = {}
  if held_out is not None:
    report["held_out_at_init"] = evaluate_drafter(eval_step, params, target_params, held_out,
                                                  batch_rows)
  t0 = time.perf_counter()
  params, opt_state, log, last = train_drafter_steps(
      step, params, opt_state, target_params, batch, steps=steps, batch_rows=batch_rows,
      seed=seed, log_every=log_every, on_log=on_log)
  report.update(log=log, last=last, train_s=time.perf_counter() - t0, train=None)
  if evaluate:
    report["train"] = evaluate_drafter(eval_step, params, target_params, batch, batch_rows)
  report["train_top1"] = None if report["train"] is None else report["train"]["top1"]
  if held_out is not None:
    report["held_out"] = evaluate_drafter(eval_step, params, target_params, held_out, batch_rows)
  return nnx.merge(graphdef, params), report


def warm_up_on_rollouts(policy: Transformer, rollout, prompts: Sequence[Sequence[int]], *,
                        max_new_tokens: int, temperature: float = 1.0, sample_seed: int = 0,
                        **warm_up: Any) -> tuple[Drafter, dict]:
  """A drafter warmed up on ``policy``'s own completions of ``prompts``: ``own_sequences`` by
  ``rollout`` (which decodes ``policy``) at ``temperature`` with ``sample_seed``, then
  ``warm_up_drafter`` on them with the keyword arguments ``warm_up`` (``steps`` and ``row_len``
  at least).

  Returns ``(drafter, report)``: ``warm_up_drafter``'s report plus ``prompts``,
  ``temperature``, ``sample_seed``, ``mean_completion`` (tokens), ``generate_s`` (the
  rollout's seconds) and ``seconds`` (the whole call, rollout included).
  """
  t0 = time.perf_counter()
  sequences, prompt_lens = own_sequences(rollout, prompts, max_new_tokens=max_new_tokens,
                                         temperature=temperature, seed=sample_seed)
  generate_s = time.perf_counter() - t0
  drafter, report = warm_up_drafter(policy, sequences, prompt_lens, **warm_up)
  report.update(prompts=len(prompts), temperature=temperature, sample_seed=sample_seed,
                mean_completion=float(np.mean([len(s) - n for s, n in zip(sequences,
                                                                           prompt_lens)])),
                generate_s=generate_s, seconds=time.perf_counter() - t0)
  return drafter, report
