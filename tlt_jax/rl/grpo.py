"""GRPO objective as pure, jittable functions: group advantages, token log-probs, clipped loss.

Rollout rows are laid out group by group: rows ``g*G .. g*G+G-1`` are the ``G`` completions of
one prompt. ``group_advantages`` turns their scalar rewards into per-row advantages;
``policy_loss`` is the PPO-style clipped surrogate (optionally DAPO-style asymmetric clipping and
a k3 KL penalty to a reference policy) aggregated over the valid tokens of a padded batch as a
weighted sum (``loss_weights``), or, given the whole batch's per-token weights and token count,
one micro-batch's additive share of it (gradient accumulation over packed micro-batches).

Masked (padding) tokens never reach an ``exp``: their log-prob differences are zeroed first, so
garbage values there cannot produce NaNs, and their gradients are exactly zero.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """GRPO hyperparameters; frozen and hashable, so it can be a static jit argument."""

  group_size: int
  clip_eps_low: float = 0.2
  clip_eps_high: Optional[float] = None  # None: symmetric (same as clip_eps_low)
  kl_coef: float = 0.0
  loss_agg: str = "token-mean"
  normalize_std: bool = True  # False: Dr.GRPO-style centring only
  eps: float = 1e-6

  def __post_init__(self) -> None:
    g = self.group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
      raise ValueError(f"GRPOConfig.group_size must be an int >= 2, got {self.group_size!r}")
    if g == 1:  # a one-sample group is its own mean: every advantage and gradient is zero
      raise ValueError("GRPOConfig.group_size=1 gives every sample advantage 0, so GRPO would "
                       "train on zero gradients: set group_size to 2 or more (e.g. 8)")
    if not _is_real(self.clip_eps_low) or not 0.0 < self.clip_eps_low < 1.0:
      raise ValueError(f"GRPOConfig.clip_eps_low must be in (0, 1), got {self.clip_eps_low!r}")
    high = self.clip_eps_high
    if high is not None and (not _is_real(high) or not high > 0.0):
      raise ValueError(f"GRPOConfig.clip_eps_high must be None or a finite float > 0, got {high!r}")
    if not _is_real(self.kl_coef) or self.kl_coef < 0.0:
      raise ValueError(f"GRPOConfig.kl_coef must be a finite float >= 0, got {self.kl_coef!r}")
    if self.loss_agg not in LOSS_AGG_MODES:
      raise ValueError(f"GRPOConfig.loss_agg must be one of {LOSS_AGG_MODES}, "
                       f"got {self.loss_agg!r}")
    if not isinstance(self.normalize_std, bool):
      raise ValueError(f"GRPOConfig.normalize_std must be a bool, got {self.normalize_std!r}")
    if not _is_real(self.eps) or not self.eps > 0.0:
      raise ValueError(f"GRPOConfig.eps must be a finite float > 0, got {self.eps!r}")

  @property
  def eps_high(self) -> float:
    """Upper clip epsilon actually used (``clip_eps_low`` when ``clip_eps_high`` is None)."""
    return self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high


def _is_real(x: object) -> bool:
  """True for a finite int/float that is not a bool."""
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def group_advantages(rewards: jax.Array, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
  """Per-row advantages [N] from rewards [N]: reward minus its group's mean, over (std + eps).

  Uses the population std (ddof=0); with ``normalize_std=False`` only centres (Dr.GRPO). A
  numpy array is computed with numpy on the host (the trainer's rewards: nothing to compile or
  dispatch for a few floats), anything else with ``jax.numpy``.
  """
  xp = np if isinstance(rewards, np.ndarray) else jnp
  rewards = xp.asarray(rewards, xp.float32)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be 1-D [N], got shape {rewards.shape}")
  n = rewards.shape[0]
  if group_size < 1 or n % group_size != 0:
    raise ValueError(f"number of rewards {n} is not a multiple of group_size {group_size}")
  grouped = rewards.reshape(n // group_size, group_size)
  centred = grouped - grouped.mean(axis=1, keepdims=True)
  if normalize_std:
    centred = centred / (grouped.std(axis=1, keepdims=True) + eps)
  return centred.reshape(n)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Float32 log-probability [B, T] of each token under logits [B, T, V]."""
  if logits.shape[:-1] != tokens.shape:
    raise ValueError(f"logits {logits.shape} and tokens {tokens.shape} disagree on [B, T]")
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def loss_weights(mask, mode: str):
  """Per-token weights ``[B, T]`` of the loss aggregation ``mode`` over ``mask [B, T]``: the
  aggregated loss is ``sum(per_token * weights)``, so a sum over any part of the tokens is that
  part's additive share of it.

  token-mean: ``1 / valid tokens``; seq-mean-token-mean: ``1 / (the row's valid tokens x rows
  with a valid token)``; seq-mean-token-sum: ``1 / rows with a valid token``; 0 off the mask.
  Rows with no valid token (padding, bucket filler) do not count. NumPy in, NumPy out (for the
  host side of packed updates); JAX arrays or tracers in, JAX out.
  """
  xp = np if isinstance(mask, np.ndarray) else jnp
  m = (xp.asarray(mask) > 0).astype(xp.float32)
  counts = m.sum(axis=1, keepdims=True)
  if mode == "token-mean":
    weights = m / xp.maximum(m.sum(), 1.0)
  elif mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
    seqs = xp.maximum((counts > 0).sum(), 1.0)
    per_row = xp.maximum(counts, 1.0) if mode == "seq-mean-token-mean" else 1.0
    weights = m / (per_row * seqs)
  else:
    raise ValueError(f"unknown loss_agg {mode!r}")
  return weights.astype(xp.float32)


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                mask: jax.Array, config: GRPOConfig,
                ref_logprobs: Optional[jax.Array] = None, *,
                token_weights: Optional[jax.Array] = None,
                total_tokens: Optional[jax.Array] = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped GRPO surrogate (+ k3 KL to ref when ``kl_coef > 0``) and metrics, from [B, T] inputs.

  Metrics: loss, pg_loss, clip_fraction, ratio_mean, approx_kl (to old), and kl_to_ref when given.
  ``advantages`` are per row ``[B]`` or per token ``[B, T]`` (packed rows hold several sequences).

  The loss and pg_loss are ``sum(per_token * token_weights)`` over the valid tokens, the other
  metrics token means: sums over valid tokens divided by ``total_tokens``. By default the weights
  are ``loss_weights(mask, config.loss_agg)`` and the count is ``sum(mask)``: this batch's own.
  Given those of a bigger batch this one holds a part of (``loss_weights`` of the whole batch,
  moved along with its tokens, and its valid-token count), the loss, its gradient and every
  metric are this part's additive share: their sums over disjoint parts (micro-batches, packed
  or not) equal the values of the whole batch.
  """
  if logprobs.ndim != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
    raise ValueError(f"logprobs {logprobs.shape}, old_logprobs {old_logprobs.shape} and mask "
                     f"{mask.shape} must all be the same [B, T]")
  if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
    raise ValueError(f"advantages {advantages.shape} must be [B] or [B, T] for logprobs "
                     f"{logprobs.shape}")
  if token_weights is not None and token_weights.shape != logprobs.shape:
    raise ValueError(f"token_weights {token_weights.shape} must be [B, T] like logprobs "
                     f"{logprobs.shape}")
  if config.kl_coef > 0 and ref_logprobs is None:
    raise ValueError("GRPOConfig.kl_coef > 0 needs ref_logprobs")

  valid = mask.astype(bool)
  if token_weights is None:
    token_weights = loss_weights(mask, config.loss_agg)
  count = jnp.sum(valid.astype(jnp.float32)) if total_tokens is None else total_tokens
  count = jnp.maximum(jnp.asarray(count, jnp.float32), 1.0)
  weights = token_weights.astype(jnp.float32)
  logprobs = logprobs.astype(jnp.float32)
  adv = advantages.astype(jnp.float32)
  adv = adv[:, None] if adv.ndim == 1 else adv

  # whatever sits on the padding (garbage, NaN) never reaches a sum, nor a gradient
  weighted = lambda x: jnp.sum(jnp.where(valid, x * weights, 0.0))
  token_mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / count

  log_ratio = jnp.where(valid, logprobs - old_logprobs.astype(jnp.float32), 0.0)
  ratio = jnp.exp(log_ratio)
  lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.eps_high
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, lo, hi) * adv
  pg = -jnp.minimum(unclipped, clipped)
  # The clipped branch wins (and the gradient is cut) above the interval for A > 0, below for A < 0.
  clip_active = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))

  per_token = pg
  metrics: dict[str, jax.Array] = {}
  if ref_logprobs is not None:
    ref_diff = jnp.where(valid, ref_logprobs.astype(jnp.float32) - logprobs, 0.0)
    k3 = jnp.exp(ref_diff) - ref_diff - 1.0
    metrics["kl_to_ref"] = token_mean(k3)
    if config.kl_coef > 0:
      per_token = pg + config.kl_coef * k3

  loss = weighted(per_token)
  metrics.update(
      loss=loss,
      pg_loss=weighted(pg),
      clip_fraction=token_mean(clip_active.astype(jnp.float32)),
      ratio_mean=token_mean(ratio),
      approx_kl=token_mean((ratio - 1.0) - log_ratio),
  )
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
