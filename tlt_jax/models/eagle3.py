"""EAGLE-3 drafter: features of several target layers, a 2H-input first layer, its own norm and head.

The layout is the one of the ``speculators`` package's ``eagle3`` models (which vLLM serves), so a
drafter trained here exports exactly (:mod:`tlt_jax.models.speculators`):

* the target hands over the residual stream entering each of ``feature_layers`` (``n`` ids in
  ``[0, num_layers]``; vLLM's "auxiliary hidden states"), concatenated ``[..., n H]``;
* ``fc`` (no bias) maps them to ``H``: this is the drafter's input hidden ``g_t``;
* the first decoder layer reads ``cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))`` (2H
  wide) in its q/k/v projections, adds the attention output to ``g_t`` (the residual) and then
  runs the usual MLP block; its output ``o_t`` is the next step's input hidden when the drafter
  chains on its own (step 2 onward, with no ``fc``);
* ``norm`` and ``head`` (``H x K``, over the draft vocabulary ``vocab_ids``; ``K = V`` without a
  reduced one) give the draft logits.

The embedding is the target's (frozen, shared). ``forward`` takes either the target's features,
``[..., (n + 1) H]`` as ``Transformer.forward(return_hidden=feature_layers)`` returns them (the
last ``H`` is the target's final-normed hidden state, used only for training targets), or the
drafter's own output hidden ``[..., H]``: the width says which, so the engine passes both through
the same code as an EAGLE-1 drafter's.

Training (:func:`tlt_jax.drafter.objective.ttt_loss`) unrolls ``ttt_steps`` chained steps
(test-time training): step ``k`` at position ``t`` reads token ``x_{t+1+k}`` with step ``k-1``'s
output hidden at ``t``, sits at position ``t + k``, and attends to step 0's keys up to ``t`` and
to its own chain's earlier keys at ``t``: exactly what drafting with a cache does.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.drafter import Drafter, DrafterOutput
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import (MLP, Attention, KVCache, RMSNorm, Transformer, linear,
                                        positions_and_mask, rope_inv_freq)

DEFAULT_TTT_STEPS = 3


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
  """Low, middle and late target layers: ``speculators``' default ``(2, L // 2, L - 3)``, moved
  into ``[1, L - 1]`` and deduplicated for small models (layer 0's input is the embedding, and
  vLLM taps only layers it runs, so ``L`` is avoided by default)."""
  top = max(num_layers - 1, 1)
  return tuple(sorted({min(max(i, 1), top) for i in (2, num_layers // 2, num_layers - 3)}))


def check_feature_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
  """``layers`` as a sorted tuple of distinct ints in ``[0, num_layers]``, else a ValueError."""
  try:
    ids = tuple(int(i) for i in layers)
  except (TypeError, ValueError):
    raise ValueError(f"eagle3 feature layers must be a list of layer ids, got {layers!r}") from None
  if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
    raise ValueError(f"eagle3 feature layers must be distinct ids in [0, {num_layers}] (the "
                     f"target has {num_layers} layers), got {list(ids)}")
  if list(ids) != sorted(ids):
    raise ValueError(f"eagle3 feature layers must be in increasing order, got {list(ids)}")
  return ids


def draft_layer_config(target_config: ModelConfig) -> ModelConfig:
  """The drafter's decoder layer: the target's sizes, RoPE and eps, Llama-style (no biases, no
  query/key norms, whatever the target has)."""
  return target_config.replace(num_layers=1, attention_bias=False, architecture="llama",
                               qk_norm=False, tie_word_embeddings=False)


class Eagle3Layer(nnx.Module):
  """A pre-norm decoder layer whose attention reads ``cat(norm(embed), norm(hidden))``."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    h, dt = config.hidden_size, config.jnp_dtype
    self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dt)
    self.hidden_norm = RMSNorm(h, config.rms_norm_eps, dt)
    self.self_attn = Attention(config, rngs)
    for name, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads),
                        ("v_proj", config.num_kv_heads)):
      setattr(self.self_attn, name, linear(2 * h, heads * config.head_dim, False, config, rngs))
    self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dt)
    self.mlp = MLP(config, rngs)

  def __call__(self, embeds, hidden, positions, inv_freq, mask, cache_kv, cache_lengths):
    x = jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(hidden)], axis=-1)
    attn, kv = self.self_attn(x, positions, inv_freq, mask, cache_kv, cache_lengths)
    x = hidden + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, kv


class Eagle3Drafter(Drafter):
  """The EAGLE-3 drafter (see the module docstring); a ``Drafter`` to the engine."""

  kind = "eagle3"
  objective = "ttt"
  saved_fields = ("feature_layers", "ttt_steps")
  speculators_export = True

  def __init__(self, target_config: ModelConfig, *, rngs: nnx.Rngs,
               draft_vocab_size: int | None = None,
               feature_layers: Sequence[int] | None = None,
               ttt_steps: int = DEFAULT_TTT_STEPS):
    # pylint: disable=super-init-not-called  (its own modules, not EAGLE-1's)
    self.config = target_config
    h, dt = target_config.hidden_size, target_config.jnp_dtype
    layers = (default_feature_layers(target_config.num_layers) if feature_layers is None
              else feature_layers)
    self.feature_layers = check_feature_layers(layers, target_config.num_layers)
    if isinstance(ttt_steps, bool) or not isinstance(ttt_steps, (int, np.integer)) \
        or ttt_steps < 1:
      raise ValueError(f"eagle3 ttt_steps must be a positive int, got {ttt_steps!r}")
    self.ttt_steps = int(ttt_steps)
    k = target_config.vocab_size if draft_vocab_size is None else int(draft_vocab_size)
    if not 1 <= k <= target_config.vocab_size:
      raise ValueError(f"draft_vocab_size must be in [1, {target_config.vocab_size}] (the "
                       f"target's vocabulary), got {draft_vocab_size}")
    self.fc = linear(len(self.feature_layers) * h, h, False, target_config, rngs)
    self.layer = Eagle3Layer(draft_layer_config(target_config), rngs)
    self.norm = RMSNorm(h, target_config.rms_norm_eps, dt)
    self.head = linear(h, k, False, target_config, rngs)
    self.vocab_ids = None if draft_vocab_size is None else tuple(range(k))

  @classmethod
  def create(cls, target_config: ModelConfig, seed: int = 0,
             draft_vocab_size: int | None = None, feature_layers: Sequence[int] | None = None,
             ttt_steps: int = DEFAULT_TTT_STEPS) -> "Eagle3Drafter":
    """A randomly initialised EAGLE-3 drafter for ``target_config``."""
    return cls(target_config, rngs=nnx.Rngs(seed), draft_vocab_size=draft_vocab_size,
               feature_layers=feature_layers, ttt_steps=ttt_steps)

  @classmethod
  def fresh(cls, target_config: ModelConfig, seed: int = 0,
            policy: Transformer | None = None) -> "Eagle3Drafter":
    """A drafter to train online from scratch: its head the LM head of ``policy`` where given
    (``for_target``), else drawn at random."""
    if policy is None:
      return cls.create(target_config, seed)
    return cls.for_target(policy, seed)

  @classmethod
  def starts_from_policy(cls) -> bool:
    return True

  @classmethod
  def for_target(cls, target: Transformer, seed: int = 0,
                 draft_vocab_size: int | None = None, **kwargs) -> "Eagle3Drafter":
    """A drafter whose head starts as the target's LM head (rows of ``vocab_ids``)."""
    drafter = cls.create(target.config, seed, None, **kwargs)
    ids = np.arange(target.config.vocab_size if draft_vocab_size is None else draft_vocab_size)
    drafter.set_draft_vocab(target, ids)
    if draft_vocab_size is None:
      drafter.vocab_ids = None
    return drafter

  @property
  def target_features(self) -> tuple[int, ...]:
    """What ``Transformer.forward(return_hidden=...)`` must return for this drafter."""
    return self.feature_layers

  @property
  def feature_size(self) -> int:
    """Width of the target features the drafter reads, ``(n + 1) H`` (see the docstring)."""
    return (len(self.feature_layers) + 1) * self.config.hidden_size

  def target_logits(self, target: Transformer, hidden: jax.Array) -> jax.Array:
    """The target's LM head over the drafter's vocabulary on the final-normed hidden states
    (the last ``H`` of target features, or ``[..., H]`` itself), in float32."""
    hidden = hidden[..., -self.config.hidden_size:]
    if self.vocab_ids is None:
      return target.lm_logits(hidden)
    return super().target_logits(target, hidden)

  def input_hidden(self, features: jax.Array) -> jax.Array:
    """``fc`` of the target features' first ``n H``; the drafter's own hidden passes as is."""
    h = self.config.hidden_size
    width = features.shape[-1]
    if width == h:
      return features.astype(self.config.jnp_compute_dtype)
    if width != self.feature_size:
      raise ValueError(f"eagle3 drafter reads target features of width {self.feature_size} "
                       f"(layers {list(self.feature_layers)} and the final hidden state) or its "
                       f"own hidden of width {h}, got {width}")
    aux = features[..., :len(self.feature_layers) * h].astype(self.config.jnp_compute_dtype)
    return self.fc(aux)

  def forward(self, target: Transformer, tokens: jax.Array, features: jax.Array,
              positions: jax.Array | None = None, *, cache: KVCache | None = None,
              attn_mask: jax.Array | None = None,
              cache_mask: jax.Array | None = None) -> DrafterOutput:
    """Drafts from ``tokens [B, T]`` (x_{t+1}) and ``features`` (target features of ``t`` or
    the drafter's previous output hidden); cache semantics as ``Drafter.forward``."""
    positions, mask = positions_and_mask(tokens.shape, cache, positions, attn_mask, cache_mask)
    hidden = self.input_hidden(features)
    lengths = cache.lengths if cache is not None else None
    kv = (cache.k[0], cache.v[0]) if cache is not None else None
    x, (k, v) = self.layer(target.embed(tokens), hidden, positions, rope_inv_freq(self.config),
                           mask, kv, lengths)
    new_cache = KVCache((k,), (v,), cache.lengths) if cache is not None else None
    logits = jnp.einsum("...h,hk->...k", self.norm(x),
                        self.head.kernel.get_value().astype(self.config.jnp_compute_dtype),
                        preferred_element_type=jnp.float32)
    return DrafterOutput(logits, x, new_cache)


def ttt_logits(drafter: Eagle3Drafter, target: Transformer, tokens: jax.Array,
               features: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               steps: int | None = None) -> list[jax.Array]:
  """The logits ``[B, T, K]`` of each of ``steps`` chained (teacher-forced) drafting steps.

  Step ``k`` reads ``tokens`` shifted left by ``k`` (zeros past the end), the previous step's
  output hidden, positions ``+ k``; its queries see step 0's keys causally within their segment
  and the keys of the same position in steps ``1 .. k`` (the chain drafted so far), as drafting
  with a cache does. ``segment_ids`` (0 = padding): packed sequences; None: one per row.
  """
  steps = drafter.ttt_steps if steps is None else steps
  b, t = tokens.shape
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  causal = same & jnp.tril(jnp.ones((t, t), bool))[None]
  diag = jnp.broadcast_to(jnp.eye(t, dtype=bool)[None], (b, t, t))
  cache = KVCache.create(draft_layer_config(drafter.config), b, steps * t)
  hidden = features
  out_logits = []
  for k in range(steps):
    blocks = [causal] + [diag] * k + [jnp.zeros((b, t, t), bool)] * (steps - 1 - k)
    step_tokens = jnp.concatenate([tokens[:, k:], jnp.zeros((b, k), tokens.dtype)], axis=1)
    out = drafter.forward(target, step_tokens, hidden, positions + k,
                          cache=cache.with_lengths(jnp.full((b,), k * t, jnp.int32)),
                          cache_mask=jnp.concatenate(blocks, axis=2))
    cache, hidden = out.cache, out.hidden
    out_logits.append(out.logits)
  return out_logits
