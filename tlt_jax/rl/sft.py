"""Supervised warm start: next-token training on a task's correct traces, and greedy evaluation.

Problems are packed into fixed rows (block-diagonal attention, positions restarting per
problem) so the step compiles once; the loss is taken on solution and EOS tokens only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tlt_jax.drafter.objective import layout_rows, segment_mask
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.rl.tasks import ArithmeticTask, Problem
from tlt_jax.rollout import EngineConfig, RolloutEngine, SamplingParams
from tlt_jax.utils import require_positive_ints


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The supervised warm start: ``steps`` optimizer steps on ``rows`` packed rows of ``row_len``."""

  steps: int = 300
  rows: int = 8
  row_len: int = 256
  learning_rate: float = 3e-3

  def __post_init__(self):
    if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
      raise ValueError(f"SFTConfig.steps must be an int >= 0 (0: no warm start), got "
                       f"{self.steps!r}")
    require_positive_ints(self, "rows", "row_len")
    if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
            and self.learning_rate > 0):
      raise ValueError(f"SFTConfig.learning_rate must be > 0 and finite, got "
                       f"{self.learning_rate!r}")


def encode_problem(tokenizer: CharTokenizer, problem: Problem) -> tuple[list[int], int]:
  """``<bos> prompt solution <eos>`` ids and the prompt length (bos included)."""
  prompt = [tokenizer.bos_token_id] + tokenizer.encode(problem.prompt)
  return prompt + tokenizer.encode(problem.solution) + [tokenizer.eos_token_id], len(prompt)


TEACHER_STREAM = 0x7EAC  # [seed, TEACHER_STREAM]: which traces the flawed teacher gets wrong


class PackedStream:
  """Fills ``rows`` rows of ``row_len`` tokens with fresh problems, first fit, in draw order."""

  def __init__(self, task: ArithmeticTask, tokenizer: CharTokenizer, rows: int, row_len: int,
               seed: int):
    self.task, self.tokenizer, self.rows, self.row_len = task, tokenizer, rows, row_len
    self.rng = np.random.default_rng(seed)
    self.teacher_rng = np.random.default_rng([seed, TEACHER_STREAM])  # the problems' stream alone
    self.pending: list[tuple[list[int], int]] = []

  def _next(self) -> tuple[list[int], int]:
    if not self.pending:
      problems = self.task.sample(self.rng, 256)
      taught = getattr(self.task, "taught", None)  # a flawed teacher's traces (ArithmeticTask)
      if callable(taught):
        problems = taught(problems, self.teacher_rng)
      self.pending = [encode_problem(self.tokenizer, p) for p in problems]
      self.pending.reverse()
    return self.pending.pop()

  def batch(self) -> dict[str, np.ndarray]:
    """One step's arrays: ids, positions, segment_ids, targets and loss mask ``[rows, row_len]``."""
    room = [self.row_len] * self.rows
    groups: list[list[tuple[list[int], int]]] = [[] for _ in range(self.rows)]
    while True:
      item = self._next()
      n = len(item[0])
      if n > self.row_len:
        raise ValueError(f"a {n}-token problem does not fit --row-len {self.row_len}")
      fit = next((r for r in range(self.rows) if room[r] >= n), None)
      if fit is None:
        self.pending.append(item)  # first of the next batch
        break
      groups[fit].append(item)
      room[fit] -= n
    ids = np.zeros((self.rows, self.row_len), np.int32)
    positions = np.zeros_like(ids)
    segments = np.zeros_like(ids)
    trained = np.zeros(ids.shape, bool)
    for r, group in enumerate(groups):
      if not group:
        continue
      row = layout_rows([s for s, _ in group], self.row_len, pack=True,
                        prompt_lens=[n for _, n in group])
      assert row[0].shape[0] == 1, "a group must fit one row"
      ids[r], positions[r], segments[r], trained[r] = (x[0] for x in row)
    next_ids = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
    next_seg = np.concatenate([segments[:, 1:], np.zeros_like(segments[:, :1])], axis=1)
    mask = (segments > 0) & (next_seg == segments) & trained
    return dict(ids=ids, positions=positions, segment_ids=segments, targets=next_ids,
                mask=mask.astype(np.float32))


def make_lm_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation):
  """A jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` of masked LM CE."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model.forward(batch["ids"], batch["positions"],
                           attn_mask=segment_mask(batch["segment_ids"])).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["mask"]
    count = jnp.maximum(mask.sum(), 1.0)
    correct = (jnp.argmax(logits, -1) == batch["targets"]) * mask
    return jnp.sum(ce * mask) / count, dict(token_acc=correct.sum() / count, tokens=mask.sum())

  def step(params, opt_state, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, dict(metrics, loss=loss)

  return jax.jit(step, donate_argnums=(0, 1))


def greedy_accuracy(model, tokenizer: CharTokenizer, task: ArithmeticTask,
                    problems: list[Problem], max_new_tokens: int) -> dict:
  """Greedy completions of ``problems`` through ``RolloutEngine``; mean reward and lengths."""
  prompts = [[tokenizer.bos_token_id] + tokenizer.encode(p.prompt) for p in problems]
  engine = RolloutEngine(model, config=EngineConfig(
      max_batch=64, max_prompt_len=max(32, max(map(len, prompts))),
      max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id))
  result = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens,
                                                   temperature=0.0, seed=0))
  texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
  rewards = np.array([task.reward(p, t) for p, t in zip(problems, texts)])
  longest = np.array([max(len(x) for x in p.prompt[:-2].replace("-", "+").split("+"))
                      for p in problems])
  by_size = {f"{lo}-{hi}": float(rewards[(longest >= lo) & (longest <= hi)].mean())
             for lo, hi in ((1, 2), (3, 5), (6, 12)) if np.any((longest >= lo) & (longest <= hi))}
  return dict(accuracy=float(rewards.mean()), accuracy_by_digits=by_size,
              mean_completion_len=float(np.mean([len(t) for t in result.tokens])),
              generate_s=result.stats.wall_s, example=texts[0],
              example_prompt=problems[0].prompt)


def warm_start(model, tokenizer: CharTokenizer, task: ArithmeticTask, config: SFTConfig,
               seed: int, progress: Callable[[int, dict], None] | None = None):
  """``config.steps`` supervised steps on correct traces; returns ``(model, last metrics)``.

  The steps donate the params' buffers: use the returned model, not the one passed in.
  ``progress(step, metrics)`` is called after each step (metrics are device arrays: reading
  them syncs, so a caller should do it only now and then).
  """
  graphdef, params = nnx.split(model)
  steps = config.steps
  if steps == 0:
    return model, {}
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, max(1, steps // 10), max(steps, 2),
      end_value=0.1 * config.learning_rate)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98))
  opt_state = optimizer.init(params)
  step_fn = make_lm_step(graphdef, optimizer)
  stream = PackedStream(task, tokenizer, config.rows, config.row_len, seed=seed)
  metrics = {}
  for i in range(steps):
    params, opt_state, metrics = step_fn(params, opt_state, stream.batch())
    if progress is not None:
      progress(i + 1, metrics)
  return nnx.merge(graphdef, params), {k: float(v) for k, v in jax.device_get(metrics).items()}
