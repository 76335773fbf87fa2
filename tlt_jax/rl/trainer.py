"""The GRPO trainer: rollout -> reward -> group advantages -> jitted policy updates.

One RL step samples ``prompts_per_step`` problems (deterministically from ``(seed, step)``, so
the data position is the step number), completes each ``group_size`` times with the rollout
engine, scores the completions with the task's verifiable reward, and takes ``minibatches``
clipped policy-gradient steps per epoch. Updates run data-parallel over a 1-D ``Mesh`` (batch
rows sharded over ``data``, params replicated; XLA inserts the gradient all-reduce). An update
whose loss, gradient or new params are not finite is never applied (``on_nonfinite``).

Each update's cost follows the rows' live lengths, not the rollout capacity
(``TrainerConfig.update_tokens``): each minibatch's sequences (prompt + completion) are packed
back to back, first-fit decreasing, into rows of the shortest length of a fixed ladder
(``update_buckets``) that holds the longest one, each sequence attending only to itself
(block-diagonal causal attention, positions restarting at 0). Micro-batches of about
``update_tokens`` tokens of such rows are run and their gradients (of the loss as each one's
share of the minibatch's, through per-token loss weights) summed into one optimizer step equal to
that of the full-length update. Every micro-batch shape is static, so there is one executable per
length, compiled on first use or all at once by ``GRPOTrainer.precompile_update`` (after which no
update compiles, whatever the lengths).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax import checkpoint as ckpt
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.tokenizer import Tokenizer
from tlt_jax.models.transformer import Transformer
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import Problem, chat_prompt
from tlt_jax.rl.online_drafter import DrafterTrainingConfig, OnlineDrafter, step_metrics
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.parallel import DataParallelRollout
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.stats import rollout_metrics
from tlt_jax.utils import require_positive_ints


UPDATE_BUCKET_MIN = 16  # the shortest packed-row length of a packed policy update
TUNER_KEY = "tuner"  # checkpoint metadata: the adaptive rollout tuner's state_dict()
BUFFER_KEY = "drafter_buffer_sha256"  # checkpoint metadata: the drafter buffer file's checksum


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """How much to sample and how to update per RL step."""

  steps: int = 20
  prompts_per_step: int = 8
  learning_rate: float = 3e-4
  warmup_steps: int = 2
  grad_clip: float = 1.0
  minibatches: int = 1
  epochs: int = 1
  max_new_tokens: int = 96
  temperature: float = 1.0
  eval_problems: int = 64
  seed: int = 0
  # A non-finite loss, gradient or new param always leaves the params and optimizer state as they
  # were. "stop": the step raises NonFiniteUpdateError with the params from before the step;
  # "skip": the step goes on without that minibatch and reports it in `skipped_updates`.
  # ("stop" with several updates per step holds a device copy of params + optimizer state
  # through the step's updates, to restore them.)
  on_nonfinite: str = "stop"
  # Token budget (rows x length) of one policy-update micro-batch. Each minibatch's sequences
  # (rows with a completion) are packed back to back, first-fit decreasing, into rows of the
  # shortest length of a power-of-two ladder (16, 32, ..., ending at max_prompt_len +
  # max_new_tokens) that holds the longest one; a micro-batch of length T holds
  # update_tokens // T packed rows (at most the minibatch, a multiple of the mesh devices and at
  # least one row per device, so a length above the budget still runs). Their gradients are
  # summed into one optimizer step equal to the full-length update's. Bounds update memory; the
  # cost follows the live lengths. A budget well above a minibatch's real tokens pads its packed
  # rows back up (measured on a CPU: 2048 runs 1.3-1.8x fewer tokens than padding at 128 new
  # tokens, 8.3x at 1024; 8192 saves nothing at 128). Raise it on accelerators, which want
  # bigger passes. 0: pad every row to the full length and update each minibatch in one pass.
  update_tokens: int = 2048

  def __post_init__(self):
    require_positive_ints(self, "steps", "prompts_per_step", "minibatches", "epochs",
                          "max_new_tokens", "eval_problems")
    if not (isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < math.inf):
      raise ValueError(f"TrainerConfig.learning_rate must be a finite number > 0, got "
                       f"{self.learning_rate!r}")
    if not self.temperature > 0:
      raise ValueError(f"TrainerConfig.temperature must be > 0 for RL sampling, got "
                       f"{self.temperature!r}")
    if self.warmup_steps < 0:
      raise ValueError(f"TrainerConfig.warmup_steps must be >= 0, got {self.warmup_steps!r}")
    if self.on_nonfinite not in ("stop", "skip"):
      raise ValueError(f"TrainerConfig.on_nonfinite must be 'stop' or 'skip', got "
                       f"{self.on_nonfinite!r}")
    budget = self.update_tokens
    if (not isinstance(budget, int) or isinstance(budget, bool)
        or not (budget == 0 or budget >= UPDATE_BUCKET_MIN)):
      raise ValueError(f"TrainerConfig.update_tokens must be an int >= {UPDATE_BUCKET_MIN} "
                       f"(tokens per update micro-batch) or 0 (full-length updates), got "
                       f"{budget!r}")


class NonFiniteUpdateError(FloatingPointError):
  """A policy update produced a non-finite loss, gradient or param (``on_nonfinite="stop"``)."""


def learning_rate_schedule(config: TrainerConfig) -> optax.Schedule:
  """Linear warmup over ``warmup_steps`` updates, starting above zero (no wasted update) at
  ``lr / (warmup_steps + 1)``; with ``warmup_steps=0`` every update runs at the full rate."""
  if config.warmup_steps == 0:
    return optax.constant_schedule(config.learning_rate)
  return optax.linear_schedule(config.learning_rate / (config.warmup_steps + 1),
                               config.learning_rate, config.warmup_steps)


def packed_attention_mask(segments: jax.Array) -> jax.Array:
  """``[B, T, T]`` visibility of packed rows from their ``segments [B, T]`` (which sequence each
  token belongs to): block-diagonal causal, token i sees token j iff they are of the same
  sequence and j <= i, so no sequence sees another packed into the same row."""
  t = segments.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  return (segments[:, :, None] == segments[:, None, :]) & causal[None]


def make_logprobs_fn(graphdef: nnx.GraphDef, temperature: float = 1.0):
  """``logprobs(params, batch) -> [B, L-1]``: each next token's log-prob under
  ``softmax(logits / temperature)``, for a padded batch (``GRPOTrainer.make_batch``: one sequence
  per row from position 0, causal) or a packed one (``packed_microbatches``: several sequences
  per row, at their ``positions``, each seeing only itself through ``segments``)."""

  def logprobs(params, batch):
    ids, positions, attn_mask = batch["ids"], None, None
    if "segments" in batch:
      positions, attn_mask = batch["positions"], packed_attention_mask(batch["segments"])
    logits = nnx.merge(graphdef, params).forward(ids, positions, attn_mask=attn_mask).logits
    logits = logits[:, :-1]
    return grpo.token_logprobs(logits / temperature, ids[:, 1:])

  return logprobs


def _make_loss_fn(graphdef: nnx.GraphDef, config: grpo.GRPOConfig, temperature: float):
  """``loss_fn(params, ref_params, batch, total_tokens=None) -> (loss, metrics)`` of a padded
  batch, or of a packed micro-batch (``packed_microbatches``; ``total_tokens``: its minibatch's
  valid tokens): then the loss and metrics are that micro-batch's additive share of its
  minibatch's, through the per-token loss ``weights`` it carries."""
  logprobs_of = make_logprobs_fn(graphdef, temperature)

  def loss_fn(params, ref_params, batch, total_tokens=None):
    ref = None
    if config.kl_coef > 0:  # KL to the frozen reference policy (k3 estimator in policy_loss)
      ref = jax.lax.stop_gradient(logprobs_of(ref_params, batch))
    share = {}
    if "weights" in batch:
      share = dict(token_weights=batch["weights"], total_tokens=total_tokens)
    return grpo.policy_loss(logprobs_of(params, batch), batch["old_logprobs"],
                            batch["advantages"], batch["mask"], config, ref_logprobs=ref, **share)

  return loss_fn


def _guarded_step(optimizer: optax.GradientTransformation, params, opt_state, grads, loss,
                  metrics):
  """One optimizer step from ``grads``, kept only if the loss, the gradient norm and every new
  param are finite (else the old params and optimizer state come back): in-graph, no host trip."""
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  for leaf in jax.tree.leaves(new_params):
    finite &= jnp.all(jnp.isfinite(leaf))
  keep = lambda new, old: jnp.where(finite, new, old)  # in-graph: no host round trip
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm, finite=finite)
  return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt_state, opt_state),
          metrics)


PADDED_KEYS = ("ids", "mask", "old_logprobs", "advantages")
PACKED_KEYS = PADDED_KEYS + ("positions", "segments", "weights")


def _rows_sharding(mesh: Mesh, keys: tuple[str, ...]) -> dict[str, NamedSharding]:
  rows = NamedSharding(mesh, P("data"))
  return {k: rows for k in keys}


def _jit_padded_update(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                       config: grpo.GRPOConfig, mesh: Mesh, temperature: float):
  """The jitted full-length ``update(params, opt_state, batch, ref_params)`` (see make_update_fn)."""
  loss_fn = _make_loss_fn(graphdef, config, temperature)

  def update(params, opt_state, batch, ref_params):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params, batch)
    return _guarded_step(optimizer, params, opt_state, grads, loss, metrics)

  replicated = NamedSharding(mesh, P())
  return jax.jit(update, in_shardings=(replicated, replicated, _rows_sharding(mesh, PADDED_KEYS),
                                       replicated),
                 out_shardings=(replicated, replicated, replicated), donate_argnums=(0, 1))


def make_update_fn(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                   config: grpo.GRPOConfig, mesh: Mesh, temperature: float = 1.0):
  """A jitted ``update(params, opt_state, batch) -> (params, opt_state, metrics)`` over ``mesh``:
  one full-length pass over a padded batch (``GRPOTrainer.make_batch``).

  Log-probs are of the sampling distribution, ``softmax(logits / temperature)``, as the rollout's
  old log-probs are: the first update of a step then has ratio 1 whatever the temperature.

  ``metrics["finite"]`` says whether the update was applied: when the loss, the gradient norm or
  any new param is not finite, the old params and optimizer state come back unchanged.
  """
  jitted = _jit_padded_update(graphdef, optimizer, config, mesh, temperature)
  return lambda params, opt_state, batch, ref_params=None: jitted(params, opt_state, batch,
                                                                  ref_params)


def make_packed_update_fns(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                           config: grpo.GRPOConfig, mesh: Mesh,
                           temperature: float = 1.0) -> dict[str, Any]:
  """Jitted pieces of a gradient-accumulated update over ``mesh``, equal to ``make_update_fn``'s:

  * ``zeros(params) -> acc``: an empty accumulator, ``(grads, metric sums)``;
  * ``accumulate(params, ref_params, acc, micro, total_tokens) -> acc``: adds one packed
    micro-batch's (``packed_microbatches``) gradient and metrics, each its share of the
    minibatch's (``total_tokens``: the minibatch's valid tokens, a float32 scalar); ``acc`` is
    donated;
  * ``apply(params, opt_state, acc) -> (params, opt_state, metrics)``: one optimizer step from the
    summed gradient, guarded like the full-length update (``metrics["finite"]``);
  * ``copy(tree) -> tree``: a device copy of replicated state.
  """
  loss_fn = _make_loss_fn(graphdef, config, temperature)
  replicated = NamedSharding(mesh, P())
  one = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  _, shapes = jax.eval_shape(lambda x: grpo.policy_loss(
      x, x, x, x, config, ref_logprobs=x if config.kl_coef > 0 else None), one)
  names = sorted(shapes)

  def zeros(params):
    return (jax.tree.map(jnp.zeros_like, params),
            {k: jnp.zeros((), jnp.float32) for k in names})

  def accumulate(params, ref_params, acc, micro, total_tokens):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params, micro,
                                                                    total_tokens)
    return jax.tree.map(jnp.add, acc, (grads, metrics))

  def apply(params, opt_state, acc):
    grads, sums = acc
    return _guarded_step(optimizer, params, opt_state, grads, sums["loss"], sums)

  return {
      "zeros": jax.jit(zeros, in_shardings=(replicated,), out_shardings=replicated),
      "accumulate": jax.jit(
          accumulate, in_shardings=(replicated, replicated, replicated,
                                    _rows_sharding(mesh, PACKED_KEYS), replicated),
          out_shardings=replicated, donate_argnums=(2,)),
      "apply": jax.jit(apply, in_shardings=(replicated, replicated, replicated),
                       out_shardings=(replicated, replicated, replicated), donate_argnums=(0, 1)),
      "copy": jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), in_shardings=(replicated,),
                      out_shardings=replicated),
  }


def update_buckets(seq_len: int, smallest: int = UPDATE_BUCKET_MIN) -> tuple[int, ...]:
  """Packed-row lengths of a packed update: the powers of two from ``smallest`` that are below
  ``seq_len``, then ``seq_len`` itself (the longest row a step can hold)."""
  if seq_len < 2 or smallest < 2:
    raise ValueError(f"update buckets need seq_len >= 2 and smallest >= 2, got {seq_len}, "
                     f"{smallest}")
  ladder, length = [], smallest
  while length < seq_len:
    ladder.append(length)
    length *= 2
  return tuple(ladder) + (seq_len,)


def bucket_rows(length: int, update_tokens: int, minibatch_rows: int, devices: int) -> int:
  """Rows of a micro-batch of ``length`` tokens: ``update_tokens // length``, at most the
  minibatch, rounded down to a multiple of ``devices`` and at least ``devices``."""
  rows = min(minibatch_rows, max(devices, update_tokens // length))
  return max(devices, rows - rows % devices)


def needed_lengths(mask: np.ndarray) -> np.ndarray:
  """Per row of a padded batch, how many leading tokens its loss needs: its last trained
  position + 2 (prompt + completion length), 0 for a row with nothing to train on."""
  valid = np.asarray(mask) > 0
  last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
  return np.where(valid.any(axis=1), last + 2, 0)


def pack_length(lengths: np.ndarray, buckets: tuple[int, ...]) -> int:
  """The packed-row length of a minibatch: the shortest bucket that holds its longest row (the
  shortest bucket when no row has anything to train on)."""
  longest = int(np.max(lengths, initial=0))
  fits = [b for b in buckets if b >= longest]
  if not fits:
    raise ValueError(f"a row of {longest} tokens exceeds the longest update bucket {buckets[-1]}")
  return fits[0]


def pack_rows(lengths: np.ndarray, length: int) -> list[list[int]]:
  """Packs rows into packed rows of ``length`` tokens by first-fit decreasing: each row, longest
  first, goes into the first packed row with room for it, else opens a new one. Returns each
  packed row's row indices, in placement order (its sequences lie back to back in that order).
  Rows of length 0 (nothing to train on) are left out; every other row is in exactly one."""
  lengths = np.asarray(lengths)
  packs: list[list[int]] = []
  free: list[int] = []
  for i in np.argsort(-lengths, kind="stable"):
    n = int(lengths[i])
    if n <= 0:
      break  # the rest are empty too
    if n > length:
      raise ValueError(f"a row of {n} tokens does not fit in a packed row of {length}")
    for k, room in enumerate(free):
      if room >= n:
        packs[k].append(int(i))
        free[k] -= n
        break
    else:
      packs.append([int(i)])
      free.append(length - n)
  return packs


def plan_packs(lengths: np.ndarray, buckets: tuple[int, ...],
               rows_of: dict[int, int]) -> list[tuple[int, list[list[int]]]]:
  """Packs a minibatch's rows into packed rows of several lengths: ``[(T, packs), ...]``, the
  longest ``T`` first, ``len(packs)`` a multiple of ``rows_of[T]`` (whole micro-batches).

  The longest remaining row picks ``T`` (``pack_length``); the rows whose own bucket is ``T`` are
  packed by first-fit decreasing (``pack_rows``), the packed rows rounded up to whole
  micro-batches, and all their room, the added empty rows included, filled first-fit with the
  shorter remaining rows: a micro-batch's rows are computed anyway, so a short row costs nothing
  there. What is left goes to the next, shorter ``T``. Every non-empty row lands once."""
  lengths = np.asarray(lengths)
  own = {int(i): pack_length(lengths[i:i + 1], buckets) for i in np.flatnonzero(lengths > 0)}
  remaining = [i for i in np.argsort(-lengths, kind="stable").tolist() if lengths[i] > 0]
  plan = []
  while remaining:
    length = own[remaining[0]]
    group = [i for i in remaining if own[i] == length]
    mine = np.zeros_like(lengths)
    mine[group] = lengths[group]
    packs = pack_rows(mine, length)
    size = rows_of[length]
    packs += [[] for _ in range(-len(packs) % size)]
    free = [length - int(sum(lengths[i] for i in pack)) for pack in packs]
    left = []
    for i in remaining[len(group):]:  # sorted longest first: the group leads
      k = next((k for k, room in enumerate(free) if room >= lengths[i]), None)
      if k is None:
        left.append(i)
      else:
        packs[k].append(i)
        free[k] -= int(lengths[i])
    plan.append((length, packs))
    remaining = left
  return plan


def packed_microbatches(mini: dict[str, np.ndarray], packs: list[list[int]], length: int,
                        size: int, loss_agg: str,
                        pad_token_id: int = 0) -> list[dict[str, np.ndarray]]:
  """A minibatch (``make_batch``'s arrays of its rows) laid out as packed micro-batches of
  ``size`` packed rows of ``length`` tokens, ``packs`` (``pack_rows``) in order, the last
  micro-batch filled up with empty packed rows (mask 0: they contribute nothing).

  Per token: ``ids``, ``positions`` (from 0 in each sequence) and ``segments`` (the sequence's
  row in ``mini``; -1 on padding). Per predicted token (``[size, length - 1]``; the logit at t
  predicts token t + 1): ``mask`` (1 where t + 1 is a completion token of the same sequence),
  ``old_logprobs``, ``advantages`` (the sequence's) and ``weights`` (the token's weight in the
  minibatch's loss, ``grpo.loss_weights`` of the whole minibatch).
  """
  lengths = needed_lengths(mini["mask"])
  weights = grpo.loss_weights(mini["mask"], loss_agg)
  count = -(-len(packs) // size)
  shape, pred = (count * size, length), (count * size, length - 1)
  out = dict(ids=np.full(shape, pad_token_id, np.int32), positions=np.zeros(shape, np.int32),
             segments=np.full(shape, -1, np.int32), mask=np.zeros(pred, np.float32),
             old_logprobs=np.zeros(pred, np.float32), advantages=np.zeros(pred, np.float32),
             weights=np.zeros(pred, np.float32))
  for r, pack in enumerate(packs):
    at = 0
    for i in pack:
      n = int(lengths[i])
      tok, prd = np.s_[r, at:at + n], np.s_[r, at:at + n - 1]
      out["ids"][tok] = mini["ids"][i, :n]
      out["positions"][tok] = np.arange(n)
      out["segments"][tok] = i
      out["mask"][prd] = mini["mask"][i, :n - 1]
      out["old_logprobs"][prd] = mini["old_logprobs"][i, :n - 1]
      out["advantages"][prd] = mini["advantages"][i]
      out["weights"][prd] = weights[i, :n - 1]
      at += n
  return [{k: v[j * size:(j + 1) * size] for k, v in out.items()} for j in range(count)]


def check_update_layout(config: TrainerConfig, grpo_config: grpo.GRPOConfig, devices: int) -> None:
  """Raises ``ValueError`` unless a step's rows split into equal minibatches over ``devices``."""
  rows = config.prompts_per_step * grpo_config.group_size
  if rows % config.minibatches or (rows // config.minibatches) % devices:
    raise ValueError(
        f"trainer.prompts_per_step x grpo.group_size = {rows} rows must split into "
        f"trainer.minibatches={config.minibatches} minibatches whose size divides over "
        f"{devices} devices (set --config.mesh_devices, or change those fields)")


EVAL_SEED = 10_000  # the held-out problems' generator seed (independent of training data)


def eval_problems(task, n: int, seed: int = EVAL_SEED) -> list[Problem]:
  """The fixed held-out problems ``GRPOTrainer.evaluate`` scores the policy on."""
  return task.sample(np.random.default_rng(seed), n)


def step_problems(task, seed: int, step: int, n: int) -> list[Problem]:
  """The problems of RL step ``step``: a pure function of (seed, step), so a resumed run sees the
  same data."""
  return task.sample(np.random.default_rng([seed, step]), n)


def encode_prompt(tokenizer: Tokenizer, problem: Problem, chat_template: bool) -> list[int]:
  """A problem's prompt ids: its chat-formatted text (``chat_template``), else BOS (if the
  tokenizer has one) and its text."""
  if chat_template:
    return tokenizer.encode(chat_prompt(tokenizer, problem.prompt))
  bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
  return bos + tokenizer.encode(problem.prompt)


class GRPOTrainer:
  """Owns the policy params, optimizer state and rollout engine; ``step()`` runs one RL step."""

  def __init__(self, model: Transformer, tokenizer: Tokenizer, task, engine_config: EngineConfig,
               grpo_config: grpo.GRPOConfig, config: TrainerConfig, mesh: Mesh | None = None,
               drafter=None, chat_template: bool = False, rollout_devices: int = 1,
               drafter_training: DrafterTrainingConfig | None = None):
    """``drafter`` (a ``Drafter`` or ``NgramConfig``) makes rollouts speculative; being lossless,
    it changes their speed, never what is sampled. ``chat_template``: prompts are the task's
    prompt text as a user message in the tokenizer's chat template (``tasks.chat_prompt``)
    instead of ``<bos> + text``.

    ``rollout_devices``: how many of the mesh's devices roll out data-parallel, each with its own
    engine (``rollout/parallel.py``; 0: all of them, 1: the mesh's first device, as before).
    ``drafter_training``: train the (``Drafter``) drafter online from the rollouts' hidden
    states (``rl/online_drafter.py``): on the devices the tail leaves idle, or with one rollout
    device between rollout and update."""
    self.tokenizer, self.task, self.config, self.grpo_config = tokenizer, task, config, grpo_config
    self.chat_template = chat_template
    self.mesh = mesh or Mesh(np.array(jax.devices()[:1]), ("data",))
    check_update_layout(config, grpo_config, self.mesh.size)
    if config.max_new_tokens > engine_config.max_new_tokens:
      raise ValueError(f"TrainerConfig.max_new_tokens={config.max_new_tokens} exceeds "
                       f"EngineConfig.max_new_tokens={engine_config.max_new_tokens}")
    # this process's devices of the mesh (on several hosts each one rolls out on its own)
    devices = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
    if isinstance(rollout_devices, bool) or not isinstance(rollout_devices, int) or not (
        0 <= rollout_devices <= len(devices)):
      raise ValueError(f"rollout_devices must be an int in [0, {len(devices)}] (the mesh's "
                       f"devices; 0: all of them), got {rollout_devices!r}")
    self.rollout_devices = devices[:rollout_devices or len(devices)]
    if len(self.rollout_devices) > 1:
      self.engine = DataParallelRollout(model, drafter, engine_config, devices=self.rollout_devices)
    else:
      self.engine = RolloutEngine(model, drafter=drafter, config=engine_config,
                                  device=self.rollout_devices[0])
    self.online = None
    if drafter_training is not None:
      if not isinstance(drafter, Drafter):
        raise ValueError("drafter_training needs a learned (EAGLE) drafter, e.g. "
                         "Drafter.create(model.config); the n-gram drafter has nothing to train")
      self.online = OnlineDrafter(drafter, nnx.split(model)[0], drafter_training)
    self.graphdef, params = nnx.split(model)
    self.schedule = learning_rate_schedule(config)
    self.optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip),
                                 optax.adamw(self.schedule, b1=0.9, b2=0.99, weight_decay=0.0))
    replicated = NamedSharding(self.mesh, P())
    self.params = jax.device_put(params, replicated)
    self.opt_state = jax.device_put(self.optimizer.init(params), replicated)
    self._sync_engine()  # before anything compiles: the engine's executables take these arrays
    # the engines decode with copies of the drafter: its train step donates its own arrays
    self._sync_drafter()
    self._padded_update = _jit_padded_update(self.graphdef, self.optimizer, grpo_config,
                                             self.mesh, config.temperature)
    # the full-length update (what the trainer runs with update_tokens=0), callable directly
    self.update_fn = lambda params, opt_state, batch, ref_params=None: self._padded_update(
        params, opt_state, batch, ref_params)
    self._packed = make_packed_update_fns(self.graphdef, self.optimizer, grpo_config,
                                          self.mesh, temperature=config.temperature)
    self._executables: dict[tuple, Any] = {}  # ahead-of-time compiled update pieces
    # the reference policy for the KL term: the starting (warm-started) weights, kept frozen
    self.ref_params = (jax.tree.map(jnp.copy, self.params) if grpo_config.kl_coef > 0 else None)
    self.seq_len = engine_config.max_prompt_len + config.max_new_tokens
    self.minibatch_rows = config.prompts_per_step * grpo_config.group_size // config.minibatches
    # packed-row lengths and packed rows per micro-batch (static shapes: one executable each)
    self.update_buckets = update_buckets(self.seq_len) if config.update_tokens else ()
    self.update_rows = {t: bucket_rows(t, config.update_tokens, self.minibatch_rows,
                                       self.mesh.size) for t in self.update_buckets}
    self.step_count = 0
    self.last_lengths = np.zeros(0, np.int64)  # completion lengths of the latest step

  def _sync_engine(self) -> None:
    """Hands the rollout engine(s) the current params as single-device arrays.

    Each rollout device's engine decodes with that device's shard of the replicated params, a
    zero-copy view of the same buffer, so an engine compiles for one device and never sees a mesh
    sharding. (Compiling for the replicated sharding instead would run every decode step
    redundantly on all devices.) The views die with the params they view, which the update
    donates: call this after every update.
    """
    self._update_engine()

  def _update_engine(self, drafter: nnx.State | None = None) -> None:
    self.engine.update_params(self.params, drafter)  # each device's zero-copy shard

  def _sync_drafter(self) -> None:
    """Hands the engines a copy of the online drafter's current weights (no recompile)."""
    if self.online is not None:
      self._update_engine(self.online.engine_params(self.rollout_devices[0]))

  def precompile_drafter(self) -> int:
    """Compiles the online drafter's train and eval steps for every rollout device; returns how
    many devices (0 without online drafter training)."""
    if self.online is None:
      return 0
    # spot steps run on every rollout device; serial ones (one device, or spot off) on the first
    n = len(self.rollout_devices) if self.online.config.spot else 1
    self.online.precompile({self.rollout_devices[k]: self.engine.target_params(k)
                            for k in range(n)})
    return n

  # ---- data ---------------------------------------------------------------------------------
  def problems_for(self, step: int) -> list[Problem]:
    """The step's problems: a pure function of (seed, step), so a resumed run sees the same data."""
    return step_problems(self.task, self.config.seed, step, self.config.prompts_per_step)

  def encode_prompt(self, problem: Problem) -> list[int]:
    """The prompt's ids (``encode_prompt``)."""
    return encode_prompt(self.tokenizer, problem, self.chat_template)

  def make_batch(self, prompts, completions, logprobs, advantages) -> dict[str, np.ndarray]:
    """Fixed-shape arrays: ids ``[N, L]``, and per predicted token ``[N, L-1]`` mask/old logprobs."""
    n, length = len(prompts), self.seq_len
    ids = np.full((n, length), self.engine.config.pad_token_id, np.int32)
    mask = np.zeros((n, length - 1), np.float32)
    old = np.zeros((n, length - 1), np.float32)
    for i, (prompt, comp, lp) in enumerate(zip(prompts, completions, logprobs)):
      seq = prompt + comp
      ids[i, :len(seq)] = seq
      start = len(prompt) - 1  # the logit at position t predicts token t + 1
      mask[i, start:start + len(comp)] = 1.0
      old[i, start:start + len(comp)] = lp
    return dict(ids=ids, mask=mask, old_logprobs=old,
                advantages=np.asarray(advantages, np.float32))

  # ---- one RL step ---------------------------------------------------------------------------
  def step(self) -> dict[str, Any]:
    """Rollout, reward, advantages and policy updates for one step; returns its metrics."""
    cfg, g = self.config, self.grpo_config.group_size
    t0 = time.perf_counter()
    problems = self.problems_for(self.step_count)
    rows = [p for p in problems for _ in range(g)]  # each problem g times, group by group
    prompts = [self.encode_prompt(p) for p in rows]
    self._sync_engine()  # (cheap) in case the params were replaced from outside
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              seed=(cfg.seed * 1_000_003 + self.step_count) % 2**32)
    online, parallel = self.online, len(self.engine.devices) > 1
    # spot training: shards reach the buffer as they finish, for the idle devices to train on;
    # else the rows go in after the rollout, in row order, whichever device finished first
    spot = parallel and online is not None and online.config.spot
    extra = {}
    if online is not None:
      extra["collect_hidden"] = online.collect_fraction()
      if spot:
        extra["shard_done"], extra["idle"] = online.hooks(self.step_count, prompts, self.engine)
    result = self.engine.generate(prompts, sampling, **extra)
    t_rollout = time.perf_counter() - t0
    drafter_metrics = {}
    if online is not None:
      if not spot:
        online.add(self.step_count, prompts, result)
      first = self.rollout_devices[0]
      # held out: the weights that drafted this rollout, on its freshest data
      evaluation = online.evaluate(self.engine.target_params(0), first,
                                   params=self.engine.drafter_params)
      # one rollout device (or spot training off): the drafter trains now, under its budget
      serial = None if spot else online.serial(self.engine.target_params(0), first)
      drafter_metrics = step_metrics(result.stats, online.spot_runs() if spot else [],
                                     serial, evaluation)
      self._sync_drafter()
    elif parallel:
      drafter_metrics = step_metrics(result.stats, [], None, {})
    texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    rewards = np.array([self.task.reward(p, t) for p, t in zip(rows, texts)], np.float32)
    advantages = np.asarray(grpo.group_advantages(jnp.asarray(rewards), g,
                                                  self.grpo_config.normalize_std,
                                                  self.grpo_config.eps))
    batch = self.make_batch(prompts, result.tokens, result.logprobs, advantages)
    t1 = time.perf_counter()
    out = self.policy_update(batch)
    t_update = time.perf_counter() - t1
    self.step_count += 1
    lengths = np.array([len(t) for t in result.tokens])
    self.last_lengths = lengths
    out.update(step=self.step_count, reward=float(rewards.mean()),
               len_p50=float(np.percentile(lengths, 50)), len_p90=float(np.percentile(lengths, 90)),
               len_p99=float(np.percentile(lengths, 99)), len_max=int(lengths.max()),
               rollout_s=t_rollout, update_s=t_update, step_s=time.perf_counter() - t0,
               tail_s=result.stats.tail_s, compiles=result.stats.compiles)
    offered = None
    if self.engine.tuner is not None:
      offered = {b: [s.name for s in self.engine.strategies_for(b)]
                 for b in self.engine.config.batch_buckets}
    out.update(rollout_metrics(result.stats, offered))
    out.update(drafter_metrics)
    return out

  # ---- policy updates -------------------------------------------------------------------------
  def policy_update(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """``epochs`` x ``minibatches`` policy updates on one step's batch (``make_batch``'s arrays),
    in a random order that depends on (seed, step). Returns the mean of each update metric over
    the applied updates, ``skipped_updates``, and the tokens the updates ran through the model:
    ``update_tokens_padded`` (rows x length of every pass) and ``update_tokens_valid`` (the prompt
    + completion tokens of the rows with a completion), summed over the updates."""
    cfg = self.config
    n = len(batch["advantages"])
    size = n // cfg.minibatches
    lengths = needed_lengths(batch["mask"])
    order_rng = np.random.default_rng([cfg.seed, self.step_count, 1])
    # "stop" restores the state from before the step; the update donates its inputs, so keep a
    # device copy (a single update needs none: a rejected update already returns its inputs)
    before = None
    if self._keeps_copy():
      before = self._compiled(("copy",))((self.params, self.opt_state))
    metrics, padded, valid, passes = [], 0, 0, 0
    for _ in range(cfg.epochs):
      order = order_rng.permutation(n)
      for m in range(cfg.minibatches):
        picked = order[m * size:(m + 1) * size]
        valid += int(lengths[picked].sum())
        if cfg.update_tokens:
          mm, tokens, calls = self._packed_update(batch, picked, lengths[picked])
        else:
          mini = {k: v[picked] for k, v in batch.items()}
          self.params, self.opt_state, mm = self._compiled(("padded",))(
              self.params, self.opt_state, mini, self.ref_params)
          tokens, calls = size * self.seq_len, 1
        metrics.append(mm)
        padded += tokens
        passes += calls
    metrics = jax.device_get(metrics)
    self._sync_engine()
    finite = [bool(m.pop("finite")) for m in metrics]
    if not all(finite) and cfg.on_nonfinite == "stop":
      if before is not None:
        self.params, self.opt_state = before
        self._sync_engine()
      bad = metrics[finite.index(False)]
      raise NonFiniteUpdateError(
          f"RL step {self.step_count + 1}: {finite.count(False)} of {len(finite)} policy updates "
          f"were not finite (first: loss {float(bad['loss'])}, grad_norm "
          f"{float(bad['grad_norm'])}); params and optimizer state are back to before the step. "
          f"Set TrainerConfig.on_nonfinite='skip' to drop such updates instead")
    applied = [m for m, ok in zip(metrics, finite) if ok] or metrics  # all skipped: report NaNs
    out = {k: float(np.mean([m[k] for m in applied])) for k in applied[0]}
    out.update(skipped_updates=finite.count(False), update_tokens_padded=padded,
               update_tokens_valid=valid, update_passes=passes)
    return out

  def _packed_update(self, batch, picked, lengths):
    """One minibatch's update as gradient-accumulated packed micro-batches (``plan_packs``).
    Returns (metrics, tokens run, passes)."""
    mini = {k: v[picked] for k, v in batch.items()}
    total_tokens = np.asarray(mini["mask"].sum(), np.float32)
    acc = self._compiled(("zeros",))(self.params)
    tokens = passes = 0
    for length, packs in plan_packs(lengths, self.update_buckets, self.update_rows):
      size = self.update_rows[length]
      accumulate = self._compiled(("accumulate", length))
      for micro in packed_microbatches(mini, packs, length, size, self.grpo_config.loss_agg,
                                       self.engine.config.pad_token_id):
        acc = accumulate(self.params, self.ref_params, acc, micro, total_tokens)
        tokens, passes = tokens + size * length, passes + 1
    self.params, self.opt_state, metrics = self._compiled(("apply",))(self.params,
                                                                       self.opt_state, acc)
    return metrics, tokens, passes

  def _keeps_copy(self) -> bool:
    return self.config.on_nonfinite == "stop" and self.config.epochs * self.config.minibatches > 1

  def _update_keys(self) -> list[tuple]:
    keys = ([("zeros",)] + [("accumulate", t) for t in self.update_buckets] + [("apply",)]
            if self.config.update_tokens else [("padded",)])
    return keys + ([("copy",)] if self._keeps_copy() else [])

  def precompile_update(self) -> int:
    """Compiles, ahead of time, every executable the policy updates use (each micro-batch
    length's gradient step, the optimizer step; or the full-length update), so that no update
    compiles whatever the completion lengths. Returns how many it compiled now (0 once done)."""
    todo = [key for key in self._update_keys() if key not in self._executables]
    for key in todo:
      self._compiled(key)
    return len(todo)

  def update_temp_bytes(self) -> dict[str, int | None]:
    """XLA's scratch memory (beyond arguments and outputs) of each update executable compiled so
    far, by name ("accumulate 256", "apply", "padded", ...); None where the backend won't say."""
    out = {}
    for key, exe in self._executables.items():
      stats = exe.memory_analysis()
      out[" ".join(map(str, key))] = getattr(stats, "temp_size_in_bytes", None)
    return out

  def _compiled(self, key: tuple):
    """The executable of an update piece (``key``), compiled on first use for its static shapes."""
    exe = self._executables.get(key)
    if exe is None:
      replicated = NamedSharding(self.mesh, P())
      rows = NamedSharding(self.mesh, P("data"))

      spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)

      def padded_spec(n, length):
        return dict(ids=spec((n, length), jnp.int32), mask=spec((n, length - 1), jnp.float32),
                    old_logprobs=spec((n, length - 1), jnp.float32),
                    advantages=spec((n,), jnp.float32))

      def packed_spec(n, length):
        tokens = {k: spec((n, length), jnp.int32) for k in ("ids", "positions", "segments")}
        return dict(tokens, **{k: spec((n, length - 1), jnp.float32)
                               for k in ("mask", "old_logprobs", "advantages", "weights")})

      fns = self._packed
      acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         jax.eval_shape(fns["zeros"], self.params))
      scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
      if key[0] == "padded":
        lowered = self._padded_update.lower(self.params, self.opt_state,
                                            padded_spec(self.minibatch_rows, self.seq_len),
                                            self.ref_params)
      elif key[0] == "accumulate":
        lowered = fns["accumulate"].lower(self.params, self.ref_params, acc,
                                          packed_spec(self.update_rows[key[1]], key[1]),
                                          scalar)
      elif key[0] == "apply":
        lowered = fns["apply"].lower(self.params, self.opt_state, acc)
      elif key[0] == "zeros":
        lowered = fns["zeros"].lower(self.params)
      else:
        lowered = fns["copy"].lower((self.params, self.opt_state))
      exe = self._executables[key] = lowered.compile()
    return exe

  # ---- checkpoints ----------------------------------------------------------------------------
  def _checkpoint_state(self) -> dict:
    # params as a nested dict (readable key paths in errors); optimizer state as its leaf list
    state = {"params": ckpt.state_to_pure_dict(self.params),
             "opt_state": jax.tree.leaves(self.opt_state),
             "step": np.asarray(self.step_count, np.int64)}
    if self.ref_params is not None:
      state["ref_params"] = ckpt.state_to_pure_dict(self.ref_params)
    if self.online is not None:
      state["drafter"] = self.online.checkpoint_state()
    return state

  def save(self, checkpointer: ckpt.Checkpointer, metadata: dict | None = None) -> None:
    """Saves params, optimizer state and the step (the data position is the step) atomically;
    the metadata holds what the adaptive engine's tuner learned (``"tuner"``), if it has one."""
    metadata = {"format": 1, "trainer": dataclasses.asdict(self.config), **(metadata or {})}
    if (tuner := self.engine.tuner_state()) is not None:
      metadata[TUNER_KEY] = tuner
    buffer = None
    if self.online is not None:  # the drafter's data buffer: a file beside the step's arrays
      buffer, metadata[BUFFER_KEY] = self.online.buffer_bytes()
    checkpointer.save(self.step_count, self._checkpoint_state(), metadata)
    if buffer is not None:
      checkpointer.wait()
      self.online.write_buffer(checkpointer.step_dir(self.step_count), buffer)

  def restore(self, checkpointer: ckpt.Checkpointer, step: int | None = None,
              report=print) -> dict:
    """Loads ``step``, or by default the newest checkpoint that passes verification (a corrupt
    newer one is reported through ``report`` and moved aside), and its tuner state into the
    adaptive engine's tuner (see ``Rollout.load_tuner_state``); returns its metadata."""
    like = self._checkpoint_state()
    if step is None:
      _, state, metadata = checkpointer.restore_latest_good(like=like, report=report)
    else:
      state, metadata = checkpointer.restore(step, like=like)
    replicated = NamedSharding(self.mesh, P())
    self.params = jax.device_put(ckpt.pure_dict_to_state(state["params"], self.params), replicated)
    treedef = jax.tree.structure(self.opt_state)
    self.opt_state = jax.device_put(jax.tree.unflatten(treedef, state["opt_state"]), replicated)
    if self.ref_params is not None:
      self.ref_params = jax.device_put(
          ckpt.pure_dict_to_state(state["ref_params"], self.ref_params), replicated)
    self.step_count = int(state["step"])
    self._sync_engine()
    if self.online is not None:
      self.online.load_checkpoint_state(state["drafter"])
      problem = self.online.restore_buffer(checkpointer.step_dir(self.step_count),
                                           metadata.get(BUFFER_KEY))
      if problem:
        report(problem)
      self._sync_drafter()
    self.engine.load_tuner_state(metadata.get(TUNER_KEY), report)
    return metadata

  def evaluate(self, n: int | None = None, seed: int = EVAL_SEED, temperature: float = 0.0,
               progress=None) -> float:
    """Mean reward on held-out problems (a fixed set, independent of training data): greedy
    accuracy at temperature 0, or the expected reward of the sampling policy otherwise.
    ``progress(rows_done, rows_total)`` is passed to the engine's ``generate``."""
    problems = eval_problems(self.task, n or self.config.eval_problems, seed)
    self._sync_engine()
    result = self.engine.generate([self.encode_prompt(p) for p in problems], SamplingParams(
        max_new_tokens=self.config.max_new_tokens, temperature=temperature, seed=seed),
        progress=progress)
    texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    return float(np.mean([self.task.reward(p, t) for p, t in zip(problems, texts)]))
