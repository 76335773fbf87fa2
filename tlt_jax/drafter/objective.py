"""The EAGLE drafter objective, batches built from the frozen target, and a jitted optax step.

Alignment: for a sequence ``x_0 .. x_{L-1}`` the target gives last-layer features ``h_t`` (after
its final norm) and logits ``z_t`` (which predict ``x_{t+1}``). At position ``t`` the drafter reads
``(x_{t+1}, h_t)`` and is trained to produce ``h_{t+1}`` (SmoothL1) and the target's next-token
distribution ``softmax(z_{t+1})`` (soft cross-entropy, weight 0.1). Position ``t`` has a target
only while ``t + 1`` is in the same sequence.

An EAGLE-3 drafter (:class:`~tlt_jax.models.eagle3.Eagle3Drafter`) reads wider features (several
target layers, then ``h_t``) and has no feature loss: ``ttt_loss`` trains ``ttt_steps`` chained
steps, step ``k`` at ``t`` on the target's distribution of ``x_{t+2+k}`` (``softmax(z_{t+1+k})``),
weighted ``decay ** k``; ``batch_loss`` picks the objective of the drafter's kind.

Several short sequences may share a row (``pack=True``): ``segment_ids`` (0 = padding) keep
attention inside each sequence and ``positions`` restart at 0 for each one.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.eagle3 import Eagle3Drafter, ttt_logits  # the "ttt" objective's model
from tlt_jax.models.transformer import Transformer

CE_WEIGHT = 0.1
TTT_DECAY = 1.0  # weight of chained step k's loss: TTT_DECAY ** k (speculators' default)


class DrafterBatch(NamedTuple):
  """Aligned drafter inputs and targets, one row per (packed) sequence; numpy or jax arrays."""

  tokens: Any  # [B, T] int32: x_{t+1}
  features: Any  # [B, T, H]: h_t
  next_features: Any  # [B, T, H]: h_{t+1}
  next_logits: Any  # [B, T, V] float32: z_{t+1}; None to recompute from next_features
  mask: Any  # [B, T] float32: 1 where position t has a target
  positions: Any  # [B, T] int32: position of x_{t+1}'s pair within its sequence
  segment_ids: Any  # [B, T] int32: which sequence of the row (0 = padding)

  def take(self, index: np.ndarray) -> "DrafterBatch":
    """The rows ``index`` (host-side numpy indexing; keeps ``next_logits=None`` as None)."""
    return DrafterBatch(*(None if x is None else x[index] for x in self))

  @property
  def num_rows(self) -> int:
    """Number of rows."""
    return self.tokens.shape[0]


# ------------------------------------------------------------------------------------ loss


def segment_mask(segment_ids: jax.Array) -> jax.Array:
  """Causal attention ``[B, T, T]`` restricted to keys of the query's own segment."""
  t = segment_ids.shape[-1]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return same & jnp.tril(jnp.ones((t, t), bool))[None]


def eagle_loss(pred_features: jax.Array, pred_logits: jax.Array, next_features: jax.Array,
               next_logits: jax.Array, mask: jax.Array, ce_weight: float = CE_WEIGHT
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """SmoothL1(pred, next feature) + ``ce_weight`` x soft CE(target next-token dist, drafter logits).

  Both terms are per-position means (over the hidden dim / the vocabulary distribution) averaged
  over ``mask``; metrics add the drafter/target top-1 agreement on the same positions.
  """
  mask = mask.astype(jnp.float32)
  count = jnp.maximum(mask.sum(), 1.0)
  diff = pred_features.astype(jnp.float32) - next_features.astype(jnp.float32)
  smooth_l1 = jnp.mean(optax.huber_loss(diff, delta=1.0), axis=-1)  # [B, T]
  target_probs = jax.nn.softmax(next_logits.astype(jnp.float32), axis=-1)
  log_q = jax.nn.log_softmax(pred_logits.astype(jnp.float32), axis=-1)
  cross_entropy = -jnp.sum(target_probs * log_q, axis=-1)  # [B, T]
  agree = jnp.argmax(pred_logits, axis=-1) == jnp.argmax(next_logits, axis=-1)
  feature_loss = jnp.sum(smooth_l1 * mask) / count
  ce_loss = jnp.sum(cross_entropy * mask) / count
  loss = feature_loss + ce_weight * ce_loss
  metrics = dict(loss=loss, feature_loss=feature_loss, ce_loss=ce_loss,
                 top1=jnp.sum(agree * mask) / count, num_tokens=mask.sum())
  return loss, metrics


def drafter_loss(drafter: Drafter, target: Transformer, tokens: jax.Array, features: jax.Array,
                 target_next_features: jax.Array, target_next_logits: jax.Array | None,
                 mask: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, ce_weight: float = CE_WEIGHT
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The EAGLE loss of ``drafter`` on one aligned batch (see the module docstring).

  ``target_next_logits=None`` recomputes them with the target's LM head from the next features.
  A drafter with a reduced vocabulary learns the target's distribution restricted to (and
  renormalised over) its ``vocab_ids``; its top-1 agreement is measured within that subset.
  """
  attn_mask = None if segment_ids is None else segment_mask(segment_ids)
  out = drafter.forward(target, tokens, features, positions, attn_mask=attn_mask)
  if target_next_logits is None:
    target_next_logits = drafter.target_logits(target, target_next_features)
  elif drafter.vocab_ids is not None and target_next_logits.shape[-1] != len(drafter.vocab_ids):
    target_next_logits = jnp.take(target_next_logits, jnp.asarray(drafter.vocab_ids), axis=-1)
  target_next_logits = jax.lax.stop_gradient(target_next_logits)
  target_next_features = jax.lax.stop_gradient(target_next_features)
  return eagle_loss(out.hidden, out.logits, target_next_features, target_next_logits, mask,
                    ce_weight)


def _shift(x: jax.Array, k: int) -> jax.Array:
  """``x [B, T, ...]`` moved ``k`` positions left along T, zeros past the end."""
  if k == 0:
    return x
  return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


def ttt_loss(drafter: Eagle3Drafter, target: Transformer, batch: DrafterBatch,
             decay: float = TTT_DECAY) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The EAGLE-3 objective: soft cross-entropy of each chained step against the target.

  Step ``k`` at pair ``t`` is scored where pair ``t`` drafts (``mask[t]``) and pair ``t + k``
  has a target in the same sequence (``mask[t + k]``, same segment). The loss is the
  ``decay ** k``-weighted mean of the steps' masked means; ``top1``/``num_tokens`` are step 0's
  (what EAGLE-1's mean), ``top1_last``/``ce_last`` the last step's agreement and cross-entropy.
  """
  logits = ttt_logits(drafter, target, batch.tokens, batch.features, batch.positions,
                      batch.segment_ids)
  if batch.next_logits is None:
    targets = drafter.target_logits(target, batch.next_features)
  elif drafter.vocab_ids is not None and batch.next_logits.shape[-1] != len(drafter.vocab_ids):
    targets = jnp.take(batch.next_logits, jnp.asarray(drafter.vocab_ids), axis=-1)
  else:
    targets = batch.next_logits
  targets = jax.lax.stop_gradient(targets.astype(jnp.float32))
  mask = batch.mask.astype(jnp.float32)
  segments = batch.segment_ids
  total, weights, steps = 0.0, 0.0, []
  for k, step_logits in enumerate(logits):
    step_mask = mask * _shift(mask, k) * (_shift(segments, k) == segments)
    count = jnp.maximum(step_mask.sum(), 1.0)
    target_k = _shift(targets, k)
    probs = jax.nn.softmax(target_k, axis=-1)
    cross_entropy = -jnp.sum(probs * jax.nn.log_softmax(step_logits, axis=-1), axis=-1)
    agree = jnp.argmax(step_logits, axis=-1) == jnp.argmax(target_k, axis=-1)
    steps.append((jnp.sum(cross_entropy * step_mask) / count,
                  jnp.sum(agree * step_mask) / count, step_mask.sum()))
    total, weights = total + decay ** k * steps[-1][0], weights + decay ** k
  loss = total / weights
  metrics = dict(loss=loss, feature_loss=jnp.zeros(()), ce_loss=loss, top1=steps[0][1],
                 top1_last=steps[-1][1], ce_last=steps[-1][0], num_tokens=steps[0][2])
  return loss, metrics


def _eagle_objective(drafter: Drafter, target: Transformer, batch: DrafterBatch,
                     ce_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  return drafter_loss(drafter, target, batch.tokens, batch.features, batch.next_features,
                      batch.next_logits, batch.mask, positions=batch.positions,
                      segment_ids=batch.segment_ids, ce_weight=ce_weight)


def _ttt_objective(drafter: Drafter, target: Transformer, batch: DrafterBatch,
                   ce_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  del ce_weight  # only the cross-entropy: nothing to weigh it against
  return ttt_loss(drafter, target, batch)


# the training objectives by the name a drafter class gives as its ``objective``
# (``models.learned_kinds``): (drafter, target, batch, ce_weight) -> (loss, metrics)
OBJECTIVES = {"eagle": _eagle_objective, "ttt": _ttt_objective}


def batch_loss(drafter: Drafter, target: Transformer, batch: DrafterBatch,
               ce_weight: float = CE_WEIGHT) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss of ``drafter``'s objective (``OBJECTIVES[drafter.objective]``: ``drafter_loss``
  for "eagle", ``ttt_loss`` for "ttt", where ``ce_weight`` does not apply) on a batch."""
  try:
    objective = OBJECTIVES[drafter.objective]
  except KeyError:
    raise ValueError(f"{type(drafter).__name__}.objective={drafter.objective!r} is not one of "
                     f"{sorted(OBJECTIVES)}") from None
  return objective(drafter, target, batch, ce_weight)


# ------------------------------------------------------------------------------------ batches


def pack_sequences(lengths: Sequence[int], row_len: int) -> list[list[int]]:
  """Groups sequence indices into rows of at most ``row_len`` tokens (first fit, longest first)."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  rows: list[list[int]] = []
  room: list[int] = []
  for i in order:
    n = min(lengths[i], row_len)
    for r, free in enumerate(room):
      if free >= n:
        rows[r].append(i)
        room[r] -= n
        break
    else:
      rows.append([i])
      room.append(row_len - n)
  return rows


def layout_rows(sequences: Sequence[Sequence[int]], seq_len: int, *, pack: bool = False,
                prompt_lens: Sequence[int] | None = None, pad_id: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Lays sequences (cut to ``seq_len``) into rows: ``(ids, positions, segment_ids, trained)``.

  ``trained [R, L]`` marks positions at or after ``prompt_len - 1`` of their sequence: those that
  draft completion tokens. Without ``pack`` each sequence gets a row of its own.
  """
  lengths = [min(len(s), seq_len) for s in sequences]
  groups = pack_sequences(lengths, seq_len) if pack else [[i] for i in range(len(sequences))]
  shape = (len(groups), seq_len)
  ids = np.full(shape, pad_id, np.int32)
  positions = np.zeros(shape, np.int32)
  segments = np.zeros(shape, np.int32)
  trained = np.zeros(shape, bool)
  for r, group in enumerate(groups):
    at = 0
    for k, i in enumerate(group):
      n = lengths[i]
      ids[r, at:at + n] = np.asarray(sequences[i][:n], np.int32)
      positions[r, at:at + n] = np.arange(n)
      segments[r, at:at + n] = k + 1
      first = 0 if prompt_lens is None else max(int(prompt_lens[i]) - 1, 0)
      trained[r, at + first:at + n] = True
      at += n
  return ids, positions, segments, trained


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _target_features(graphdef: nnx.GraphDef, params: nnx.State, ids: jax.Array,
                     positions: jax.Array, segment_ids: jax.Array, with_logits: bool = True,
                     features: bool | tuple[int, ...] = True
                     ) -> tuple[jax.Array, jax.Array | None]:
  """The target's features (``Drafter.target_features``; and logits) over rows of (packed)
  sequences."""
  target = nnx.merge(graphdef, params)
  out = target.forward(ids, positions, attn_mask=segment_mask(segment_ids),
                       return_hidden=features)
  return out.hidden, (out.logits if with_logits else None)  # unused logits are never computed


def target_features(target: Transformer, ids: np.ndarray, positions: np.ndarray,
                    segment_ids: np.ndarray, rows_per_call: int = 16, *, with_logits: bool = True,
                    features: bool | tuple[int, ...] = True
                    ) -> tuple[np.ndarray, np.ndarray | None]:
  """Runs the frozen target over rows in fixed-size chunks (one compile per row length).
  ``features``: what the drafter reads (``Drafter.target_features``).

  ``with_logits=False`` never computes the ``[rows, T, V]`` logits: on a real vocabulary they
  are ~200 KB a token (SmolLM2), far more than the features.
  """
  graphdef, params = nnx.split(target)
  n = ids.shape[0]
  chunk = min(rows_per_call, n)
  hidden, logits = [], []
  for start in range(0, n, chunk):
    stop = min(start + chunk, n)
    pad = chunk - (stop - start)
    part = [np.concatenate([x[start:stop], np.zeros((pad,) + x.shape[1:], x.dtype)])
            for x in (ids, positions, segment_ids)]
    h, z = jax.device_get(_target_features(graphdef, params, *part, with_logits, features))
    hidden.append(h[:stop - start])
    if with_logits:
      logits.append(z[:stop - start])
  return np.concatenate(hidden), (np.concatenate(logits) if with_logits else None)


def make_batch_from_sequences(target: Transformer, sequences: Sequence[Sequence[int]],
                              seq_len: int, *, prompt_lens: Sequence[int] | None = None,
                              pack: bool = False, with_logits: bool = True,
                              rows_per_call: int = 16,
                              features: bool | tuple[int, ...] = True) -> DrafterBatch:
  """Aligned drafter training arrays (numpy) for token ``sequences`` under the frozen ``target``.
  ``features``: what the drafter reads (``Drafter.target_features``: an EAGLE-3 drafter's
  layers).

  Position t pairs ``(x_{t+1}, h_t)`` with targets ``h_{t+1}``, ``z_{t+1}``; positions before
  ``prompt_len - 1`` (when given), across sequence ends and on padding are masked out.
  """
  if seq_len < 2:
    raise ValueError(f"seq_len must be at least 2, got {seq_len}")
  if prompt_lens is not None and len(prompt_lens) != len(sequences):
    raise ValueError(f"{len(prompt_lens)} prompt_lens for {len(sequences)} sequences")
  ids, positions, segments, trained = layout_rows(sequences, seq_len, pack=pack,
                                                  prompt_lens=prompt_lens)
  hidden, logits = target_features(target, ids, positions, segments, rows_per_call,
                                   with_logits=with_logits, features=features)
  shift = lambda x: np.concatenate([x[:, 1:], np.zeros_like(x[:, :1])], axis=1)
  next_segments = shift(segments)
  mask = (segments > 0) & (next_segments == segments) & trained
  return DrafterBatch(tokens=shift(ids), features=hidden, next_features=shift(hidden),
                      next_logits=shift(logits) if with_logits else None,
                      mask=mask.astype(np.float32), positions=positions, segment_ids=segments)


# ------------------------------------------------------------------------------------ training


def make_optimizer(learning_rate: float | optax.Schedule = 1e-3, *, weight_decay: float = 0.0,
                   clip_norm: float = 1.0, b2: float = 0.95) -> optax.GradientTransformation:
  """AdamW after global-norm gradient clipping; decay applies to matrices only."""
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(learning_rate, b2=b2, weight_decay=weight_decay,
                                 mask=decay_mask))


def split_drafter(drafter: Drafter) -> tuple[nnx.GraphDef, nnx.State]:
  """``(graphdef, params)`` of a drafter whose whole state is trainable params."""
  graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError("the drafter holds non-Param state; the train step only carries params")
  return graphdef, params


def _graphdef_of(module_or_graphdef) -> nnx.GraphDef:
  if isinstance(module_or_graphdef, nnx.Module):
    return nnx.split(module_or_graphdef)[0]
  return module_or_graphdef


def make_train_step(drafter: Drafter | nnx.GraphDef, target: Transformer | nnx.GraphDef,
                    optimizer: optax.GradientTransformation, *, ce_weight: float = CE_WEIGHT):
  """A jitted ``step(drafter_params, opt_state, target_params, batch)`` -> (params, state, metrics).

  Only the drafter's params are trained; the target's params are an argument (not a baked
  constant), so new policy weights never recompile the step. Drafter params and optimizer
  state are donated.
  """
  drafter_graphdef = _graphdef_of(drafter)
  target_graphdef = _graphdef_of(target)

  def train_step(drafter_params: nnx.State, opt_state: optax.OptState, target_params: nnx.State,
                 batch: DrafterBatch):
    frozen = nnx.merge(target_graphdef, jax.lax.stop_gradient(target_params))

    def loss_fn(params):
      return batch_loss(nnx.merge(drafter_graphdef, params), frozen, batch, ce_weight)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(drafter_params)
    updates, opt_state = optimizer.update(grads, opt_state, drafter_params)
    drafter_params = optax.apply_updates(drafter_params, updates)
    return drafter_params, opt_state, dict(metrics, grad_norm=optax.global_norm(grads))

  return jax.jit(train_step, donate_argnums=(0, 1))


def make_eval_step(drafter: Drafter | nnx.GraphDef, target: Transformer | nnx.GraphDef, *,
                   ce_weight: float = CE_WEIGHT):
  """A jitted ``eval(drafter_params, target_params, batch) -> metrics`` (no update)."""
  drafter_graphdef = _graphdef_of(drafter)
  target_graphdef = _graphdef_of(target)

  def eval_step(drafter_params: nnx.State, target_params: nnx.State, batch: DrafterBatch):
    drafter_module = nnx.merge(drafter_graphdef, drafter_params)
    return batch_loss(drafter_module, nnx.merge(target_graphdef, target_params), batch,
                      ce_weight)[1]

  return jax.jit(eval_step)
