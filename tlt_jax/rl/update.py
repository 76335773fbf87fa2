"""The policy update: params, optimizer state and the jitted, data-parallel update steps.

Updates run data-parallel over a ``Mesh``: a 1-D ``("data",)`` one (batch rows sharded over
``data``, params and optimizer state replicated; XLA inserts the gradient all-reduce), or a 2-D
``("data", "fsdp")`` one from ``make_mesh`` (``rl/mesh.py``) (fully sharded data parallel: rows sharded over both
axes, so every device gets rows of its own, and params, KL reference and optimizer state sharded
over ``fsdp`` by ``fsdp_spec``, so a device holds 1/fsdp of them between updates). Each FSDP
update all-gathers the params it runs with and hands each device its shard of the summed
gradient (``UpdateLayout.gather``; XLA:CPU sums with an all-reduce and slices, XLA:GPU's
ReduceScatterCreator pass fuses that pair into a reduce-scatter). The rollout engines decode
with full weights: ``PolicyUpdate.rollout_params`` gathers them. An update whose loss, gradient
or new params are not finite is never applied: the guard is in-graph (``_guarded_step``), and
``on_nonfinite`` says whether the step then stops or goes on without it.

Each update's cost follows the rows' live lengths, not the rollout capacity
(``update_tokens``): each minibatch's sequences are packed back to back (``rl/packing.py``) and
micro-batches of about ``update_tokens`` tokens are run, their gradients (of the loss as each
one's share of the minibatch's, through per-token loss weights) summed into one optimizer step
equal to that of the full-length update. Every micro-batch shape is static, so there is one
executable per length, compiled ahead of time on first use or all at once by
``PolicyUpdate.precompile`` (after which no update compiles, whatever the lengths).

``config`` below is the trainer's ``TrainerConfig`` (``rl/trainer.py``): this module reads its
update fields (learning_rate, warmup_steps, grad_clip, minibatches, epochs, temperature,
on_nonfinite, update_tokens, old_logprobs, seed) and does not import it.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from tlt_jax import checkpoint as ckpt
from tlt_jax.aot import AotCache
from tlt_jax.rl import grpo
from tlt_jax.rl.mesh import UpdateLayout
from tlt_jax.rl.packing import bucket_rows, needed_lengths, packed_microbatches, plan_packs, \
    unpack_predictions, update_buckets


class NonFiniteUpdateError(FloatingPointError):
  """A policy update produced a non-finite loss, gradient or param (``on_nonfinite="stop"``)."""


def learning_rate_schedule(config) -> optax.Schedule:
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
  ``softmax(logits / temperature)``, for a padded batch (``packing.padded_batch``: one sequence
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


def make_loss_fn(graphdef: nnx.GraphDef, config: grpo.GRPOConfig, temperature: float,
                  gather=None):
  """``loss_fn(params, ref_params, batch, total_tokens=None) -> (loss, metrics)`` of a padded
  batch, or of a packed micro-batch (``packed_microbatches``; ``total_tokens``: its minibatch's
  valid tokens): then the loss and metrics are that micro-batch's additive share of its
  minibatch's, through the per-token loss ``weights`` it carries. ``gather``: what the params
  (and reference) go through before the forward pass (``UpdateLayout.gather`` under FSDP)."""
  logprobs_of = make_logprobs_fn(graphdef, temperature)
  gather = gather or (lambda tree: tree)

  def loss_fn(params, ref_params, batch, total_tokens=None):
    params, ref_params = gather(params), gather(ref_params)
    ref = None
    if config.kl_coef > 0:  # KL to the frozen reference policy (k3 estimator in policy_loss)
      ref = jax.lax.stop_gradient(logprobs_of(ref_params, batch))
    share = {}
    if "weights" in batch:
      share = dict(token_weights=batch["weights"], total_tokens=total_tokens)
    logprobs = logprobs_of(params, batch)
    # NaN old log-probs (PolicyUpdate.policy_logprobs): the params of this very pass are the
    # ones that sampled the rows, so the old log-probs are this pass's own (ratio 1)
    old = batch["old_logprobs"]
    old = jnp.where(jnp.isnan(old), jax.lax.stop_gradient(logprobs), old)
    return grpo.policy_loss(logprobs, old, batch["advantages"], batch["mask"], config,
                            ref_logprobs=ref, **share)

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
FORWARD_KEYS = ("ids", "positions", "segments")  # what a packed forward pass reads


def _jit_logprobs(graphdef: nnx.GraphDef, layout: UpdateLayout, temperature: float,
                  keys: tuple[str, ...]):
  """The jitted ``logprobs(params, batch) -> [B, L-1]`` of ``make_logprobs_fn`` (a padded batch
  with ``keys=("ids",)``, a packed micro-batch with ``FORWARD_KEYS``): no gradient, the result
  replicated (every process can read it)."""
  logprobs_of = make_logprobs_fn(graphdef, temperature)
  return jax.jit(lambda params, batch: logprobs_of(layout.gather(params), batch),
                 in_shardings=(layout.params, layout.rows_of(keys)),
                 out_shardings=layout.replicated)


def _jit_padded_update(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                       config: grpo.GRPOConfig, layout: UpdateLayout, temperature: float):
  """The jitted full-length ``update(params, opt_state, batch, ref_params)`` over ``layout``: one
  pass over a padded batch (``packing.padded_batch``). Log-probs are of the sampling distribution,
  ``softmax(logits / temperature)``, as the rollout's old log-probs are: the first update of a
  step then has ratio 1 whatever the temperature. ``metrics["finite"]`` says whether the update
  was applied (``_guarded_step``)."""
  loss_fn = make_loss_fn(graphdef, config, temperature, layout.gather)

  def update(params, opt_state, batch, ref_params):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params, batch)
    return _guarded_step(optimizer, params, opt_state, grads, loss, metrics)

  return jax.jit(update, in_shardings=(layout.params, layout.opt_state,
                                       layout.rows_of(PADDED_KEYS), layout.ref),
                 out_shardings=(layout.params, layout.opt_state, layout.replicated),
                 donate_argnums=(0, 1))


def _ref_optional(update):
  """``update(params, opt_state, batch, ref_params)`` callable with ``ref_params`` left out (no
  KL term)."""
  return lambda params, opt_state, batch, ref_params=None: update(params, opt_state, batch,
                                                                  ref_params)


def make_packed_update_fns(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                           config: grpo.GRPOConfig, mesh: Mesh, temperature: float = 1.0,
                           layout: UpdateLayout | None = None) -> dict[str, Any]:
  """Jitted pieces of a gradient-accumulated update over ``mesh``, equal to the full-length update's
  (``layout``: where params and optimizer state live, default replicated; the accumulated
  gradient lives as the params do):

  * ``zeros(params) -> acc``: an empty accumulator, ``(grads, metric sums)``;
  * ``accumulate(params, ref_params, acc, micro, total_tokens) -> acc``: adds one packed
    micro-batch's (``packed_microbatches``) gradient and metrics, each its share of the
    minibatch's (``total_tokens``: the minibatch's valid tokens, a float32 scalar); ``acc`` is
    donated;
  * ``apply(params, opt_state, acc) -> (params, opt_state, metrics)``: one optimizer step from the
    summed gradient, guarded like the full-length update (``metrics["finite"]``);
  * ``copy(state) -> state``: a device copy of ``(params, opt_state)``.
  """
  layout = layout or UpdateLayout(mesh)
  loss_fn = make_loss_fn(graphdef, config, temperature, layout.gather)
  replicated = layout.replicated
  acc_sharding = (layout.params, replicated)  # (gradient sums, metric sums)
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

  state = (layout.params, layout.opt_state)
  return {
      "zeros": jax.jit(zeros, in_shardings=(layout.params,), out_shardings=acc_sharding),
      "accumulate": jax.jit(
          accumulate, in_shardings=(layout.params, layout.ref, acc_sharding,
                                    layout.rows_of(PACKED_KEYS), replicated),
          out_shardings=acc_sharding, donate_argnums=(2,)),
      "apply": jax.jit(apply, in_shardings=(layout.params, layout.opt_state, acc_sharding),
                       out_shardings=state + (replicated,), donate_argnums=(0, 1)),
      "copy": jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), in_shardings=(state,),
                      out_shardings=state),
  }


class PolicyUpdate:
  """The policy's params, optimizer state and frozen KL reference, and the ahead-of-time
  compiled pieces that update them; ``run(batch, step)`` takes one RL step's updates.

  ``config``: the trainer's ``TrainerConfig``; ``seq_len``: the longest row (prompt capacity +
  max new tokens); ``pad_token_id`` fills packed rows' padding. ``mesh``: a 1-D ``("data",)``
  mesh (params replicated) or one from ``make_mesh`` (params, reference and optimizer state
  sharded over its ``fsdp`` axis, ``self.layout``)."""

  def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, config,
               grpo_config: grpo.GRPOConfig, mesh: Mesh, seq_len: int, pad_token_id: int = 0):
    self.graphdef, self.config, self.grpo_config, self.mesh = graphdef, config, grpo_config, mesh
    self.seq_len, self.pad_token_id = seq_len, pad_token_id
    self.schedule = learning_rate_schedule(config)
    self.optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip),
                                 optax.adamw(self.schedule, b1=0.9, b2=0.99, weight_decay=0.0))
    self.layout = UpdateLayout(mesh, params, jax.eval_shape(self.optimizer.init, params),
                               kl=grpo_config.kl_coef > 0)
    self.params = jax.device_put(params, self.layout.params)
    if self.layout.sharded:  # made in place, shard by shard: never whole on one device
      self.opt_state = jax.jit(self.optimizer.init,
                               out_shardings=self.layout.opt_state)(self.params)
    else:
      self.opt_state = jax.device_put(self.optimizer.init(params), self.layout.replicated)
    self._padded_update = _jit_padded_update(graphdef, self.optimizer, grpo_config, self.layout,
                                             config.temperature)
    # the full-length update (what runs with update_tokens=0), callable directly
    self.update_fn = _ref_optional(self._padded_update)
    self._packed = make_packed_update_fns(graphdef, self.optimizer, grpo_config, mesh,
                                          temperature=config.temperature, layout=self.layout)
    # the old log-probs' forward pass (TrainerConfig.old_logprobs="policy")
    self.recompute = config.old_logprobs == "policy"
    self._logprobs = {
        "packed": _jit_logprobs(graphdef, self.layout, config.temperature, FORWARD_KEYS),
        "padded": _jit_logprobs(graphdef, self.layout, config.temperature, ("ids",))}
    # the params all-gathered for the rollout engines (FSDP only)
    self._gather = jax.jit(lambda tree: tree, in_shardings=(self.layout.params,),
                           out_shardings=self.layout.replicated)
    self.executables = AotCache()  # ahead-of-time compiled update pieces, by key
    # the reference policy for the KL term: the starting (warm-started) weights, kept frozen
    self.ref_params = (jax.tree.map(jnp.copy, self.params) if grpo_config.kl_coef > 0 else None)
    self.minibatch_rows = config.prompts_per_step * grpo_config.group_size // config.minibatches
    # packed-row lengths and packed rows per micro-batch (static shapes: one executable each)
    self.update_buckets = update_buckets(seq_len) if config.update_tokens else ()
    self.update_rows = {t: bucket_rows(t, config.update_tokens, self.minibatch_rows, mesh.size)
                        for t in self.update_buckets}

  # ---- one step's updates ---------------------------------------------------------------------
  def run(self, batch: dict[str, np.ndarray], step: int) -> dict[str, Any]:
    """``epochs`` x ``minibatches`` policy updates on RL step ``step``'s batch
    (``packing.padded_batch``'s arrays), in a random order that depends on (seed, step), against
    the old log-probs the batch brings or (``old_logprobs="policy"``) those of the params before
    the step's first update (``policy_logprobs``). Returns
    the mean of each update metric over the applied updates, ``skipped_updates``, and the tokens
    the updates ran through the model: ``update_tokens_padded`` (rows x length of every pass) and
    ``update_tokens_valid`` (the prompt + completion tokens of the rows with a completion), summed
    over the updates, and ``old_logprobs_s``, the seconds of the old log-probs' forward pass.
    Raises ``NonFiniteUpdateError`` (``on_nonfinite="stop"``) with the params
    and optimizer state from before the step."""
    cfg = self.config
    n = len(batch["advantages"])
    size = n // cfg.minibatches
    lengths = needed_lengths(batch["mask"])
    order_rng = np.random.default_rng([cfg.seed, step, 1])
    orders = [order_rng.permutation(n) for _ in range(cfg.epochs)]
    old_logprobs_s = 0.0
    if self.recompute:  # the first update's own pass serves its rows when no later epoch needs them
      t0 = time.perf_counter()
      batch = dict(batch, old_logprobs=self.policy_logprobs(batch, orders[0],
                                                            first_by_update=cfg.epochs == 1))
      old_logprobs_s = time.perf_counter() - t0
    # "stop" restores the state from before the step; the update donates its inputs, so keep a
    # device copy (a single update needs none: a rejected update already returns its inputs)
    before = None
    if self._keeps_copy():
      before = self._compiled(("copy",))((self.params, self.opt_state))
    metrics, padded, valid, passes = [], 0, 0, 0
    for order in orders:
      for m in range(cfg.minibatches):
        picked = order[m * size:(m + 1) * size]
        valid += int(lengths[picked].sum())
        if cfg.update_tokens:
          mm, tokens, calls = self.packed_update(batch, picked, lengths[picked])
        else:
          mini = {k: v[picked] for k, v in batch.items()}
          self.params, self.opt_state, mm = self._compiled(("padded",))(
              self.params, self.opt_state, mini, self.ref_params)
          tokens, calls = size * self.seq_len, 1
        metrics.append(mm)
        padded += tokens
        passes += calls
    metrics = jax.device_get(metrics)
    finite = [bool(m.pop("finite")) for m in metrics]
    if not all(finite) and cfg.on_nonfinite == "stop":
      if before is not None:
        self.params, self.opt_state = before
      bad = metrics[finite.index(False)]
      raise NonFiniteUpdateError(
          f"RL step {step + 1}: {finite.count(False)} of {len(finite)} policy updates "
          f"were not finite (first: loss {float(bad['loss'])}, grad_norm "
          f"{float(bad['grad_norm'])}); params and optimizer state are back to before the step. "
          f"Set TrainerConfig.on_nonfinite='skip' to drop such updates instead")
    applied = [m for m, ok in zip(metrics, finite) if ok] or metrics  # all skipped: report NaNs
    out = {k: float(np.mean([m[k] for m in applied])) for k in applied[0]}
    out.update(skipped_updates=finite.count(False), update_tokens_padded=padded,
               update_tokens_valid=valid, update_passes=passes, old_logprobs_s=old_logprobs_s)
    return out

  def policy_logprobs(self, batch: dict[str, np.ndarray], order: np.ndarray,
                      first_by_update: bool = False) -> np.ndarray:
    """The log-probs of ``batch``'s completion tokens under the current params (``[N, L-1]``, 0
    off the completions): a forward pass over each minibatch of ``order`` in the layout its
    update runs in (packed micro-batches, or full-length rows), so they are a function of the
    params and tokens alone. ``first_by_update``: the first minibatch's are left to its update's
    own forward pass, which runs with these params (NaN there: the loss takes its own log-probs),
    one pass fewer."""
    cfg = self.config
    size = len(order) // cfg.minibatches
    out = np.zeros_like(batch["old_logprobs"])
    if first_by_update:
      out[order[:size]] = np.where(batch["mask"][order[:size]] > 0, np.nan, 0.0)
    for m in range(1 if first_by_update else 0, cfg.minibatches):
      picked = order[m * size:(m + 1) * size]
      mini = {k: v[picked] for k, v in batch.items()}
      got = np.zeros_like(mini["old_logprobs"])
      if cfg.update_tokens:
        lengths = needed_lengths(mini["mask"])
        for length, packs in plan_packs(lengths, self.update_buckets, self.update_rows):
          forward = self._compiled(("logprobs", length))
          micros = packed_microbatches(mini, packs, length, self.update_rows[length],
                                       self.grpo_config.loss_agg, self.pad_token_id)
          values = [forward(self.params, {k: micro[k] for k in FORWARD_KEYS})
                    for micro in micros]
          unpack_predictions(np.concatenate(jax.device_get(values)), packs, lengths, got)
      else:
        got = np.asarray(jax.device_get(self._compiled(("padded_logprobs",))(
            self.params, {"ids": mini["ids"]})))
      out[picked] = np.where(mini["mask"] > 0, got, 0.0)
    return out

  def packed_update(self, batch, picked, lengths):
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
                                       self.pad_token_id):
        acc = accumulate(self.params, self.ref_params, acc, micro, total_tokens)
        tokens, passes = tokens + size * length, passes + 1
    self.params, self.opt_state, metrics = self._compiled(("apply",))(self.params,
                                                                       self.opt_state, acc)
    return metrics, tokens, passes

  def _keeps_copy(self) -> bool:
    return self.config.on_nonfinite == "stop" and self.config.epochs * self.config.minibatches > 1

  # ---- the rollout's weights ------------------------------------------------------------------
  def rollout_params(self) -> nnx.State:
    """The current params with a full copy on every device of the mesh, for the rollout engines
    (each decodes with its device's copy, zero-copy): ``self.params`` themselves without FSDP,
    else a new replicated all-gather of them (one precompiled executable). Like ``self.params``,
    call it again after every update."""
    if not self.layout.sharded:
      return self.params
    return self._compiled(("gather",))(self.params)

  # ---- executables ----------------------------------------------------------------------------
  def executable_keys(self) -> list[tuple]:
    """The keys of every executable the updates use: each micro-batch length's gradient step,
    the optimizer step (or the full-length update), each length's forward pass of the old
    log-probs (``old_logprobs="policy"``), the device copy ``stop`` keeps, and under
    FSDP the gather of ``rollout_params``."""
    keys = ([("zeros",)] + [("accumulate", t) for t in self.update_buckets] + [("apply",)]
            if self.config.update_tokens else [("padded",)])
    if self.recompute:
      keys += ([("logprobs", t) for t in self.update_buckets] if self.config.update_tokens
               else [("padded_logprobs",)])
    return (keys + ([("copy",)] if self._keeps_copy() else [])
            + ([("gather",)] if self.layout.sharded else []))

  def precompile(self, progress=None) -> int:
    """Compiles, ahead of time, every executable the policy updates use, so that no update
    compiles whatever the completion lengths. Returns how many it compiled now (0 once done);
    ``progress(done, total)`` after each."""
    return self.executables.compile_all(self.executable_keys(), self._lower, progress)

  def temp_bytes(self) -> dict[str, int | None]:
    """XLA's scratch memory (beyond arguments and outputs) of each update executable compiled so
    far, by name ("accumulate 256", "apply", "padded", ...); None where the backend won't say."""
    return {" ".join(map(str, key)): size for key, size in self.executables.temp_bytes().items()}

  def _lower(self, key: tuple):
    """The lowering of the update piece ``key`` for its static shapes."""
    replicated, rows = self.layout.replicated, self.layout.rows

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
    grads, sums = jax.eval_shape(fns["zeros"], self.params)
    acc = (self.layout.abstract(grads, self.layout.params), self.layout.abstract(sums, replicated))
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    if key[0] == "padded":
      return self._padded_update.lower(self.params, self.opt_state,
                                       padded_spec(self.minibatch_rows, self.seq_len),
                                       self.ref_params)
    if key[0] == "accumulate":
      return fns["accumulate"].lower(self.params, self.ref_params, acc,
                                     packed_spec(self.update_rows[key[1]], key[1]), scalar)
    if key[0] == "apply":
      return fns["apply"].lower(self.params, self.opt_state, acc)
    if key[0] == "logprobs":
      micro = packed_spec(self.update_rows[key[1]], key[1])
      return self._logprobs["packed"].lower(self.params, {k: micro[k] for k in FORWARD_KEYS})
    if key[0] == "padded_logprobs":
      ids = padded_spec(self.minibatch_rows, self.seq_len)["ids"]
      return self._logprobs["padded"].lower(self.params, {"ids": ids})
    if key[0] == "zeros":
      return fns["zeros"].lower(self.params)
    if key[0] == "gather":
      return self._gather.lower(self.params)
    return fns["copy"].lower((self.params, self.opt_state))

  def _compiled(self, key: tuple):
    """The executable of an update piece (``key``), compiled on first use."""
    return self.executables.get(key, lambda: self._lower(key))

  # ---- checkpoints ----------------------------------------------------------------------------
  def checkpoint_state(self) -> dict:
    """Params as a nested dict (readable key paths in errors), the optimizer state as its leaf
    list, and the KL reference's params where there is one."""
    state = {"params": ckpt.state_to_pure_dict(self.params),
             "opt_state": jax.tree.leaves(self.opt_state)}
    if self.ref_params is not None:
      state["ref_params"] = ckpt.state_to_pure_dict(self.ref_params)
    return state

  def load_checkpoint_state(self, state: dict) -> None:
    """Puts a restored ``checkpoint_state()`` back on the mesh, as ``self.layout`` says
    (replicated, or sharded over ``fsdp``; restoring with ``like=checkpoint_state()`` reads the
    arrays in those shardings already)."""
    layout = self.layout
    self.params = jax.device_put(ckpt.pure_dict_to_state(state["params"], self.params),
                                 layout.params)
    treedef = jax.tree.structure(self.opt_state)
    self.opt_state = jax.device_put(jax.tree.unflatten(treedef, state["opt_state"]),
                                    layout.opt_state)
    if self.ref_params is not None:
      self.ref_params = jax.device_put(
          ckpt.pure_dict_to_state(state["ref_params"], self.ref_params), layout.ref)
