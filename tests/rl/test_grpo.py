"""GRPO functions against plain NumPy loop references, plus gradient, jit and config checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl.grpo import (GRPOConfig, group_advantages, loss_weights, policy_loss,
                             token_logprobs)

# A ragged batch: row 2 has a single token, row 3 is all padding.
MASK = np.array([
    [1, 1, 1, 1, 0],
    [1, 1, 1, 0, 0],
    [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0],
], np.float32)


def ref_advantages(rewards: np.ndarray, g: int, normalize: bool, eps: float) -> np.ndarray:
  """Loop reference: each row minus its group's mean, optionally over (population std + eps)."""
  out = np.zeros(len(rewards), np.float64)
  for start in range(0, len(rewards), g):
    grp = [float(r) for r in rewards[start:start + g]]
    mean = sum(grp) / g
    std = (sum((r - mean) ** 2 for r in grp) / g) ** 0.5
    for j, r in enumerate(grp):
      out[start + j] = (r - mean) / (std + eps) if normalize else r - mean
  return out


def ref_loss(lp, old, adv, mask, cfg: GRPOConfig, ref=None) -> dict[str, float]:
  """Loop reference for policy_loss: per-token terms, aggregation and metrics."""
  lo = 1 - cfg.clip_eps_low
  hi = 1 + (cfg.clip_eps_low if cfg.clip_eps_high is None else cfg.clip_eps_high)
  b, t = lp.shape
  tok = np.zeros((b, t))
  pg = np.zeros((b, t))
  stats = {"n": 0, "clip": 0, "ratio": 0.0, "akl": 0.0, "kl": 0.0}
  for i in range(b):
    for j in range(t):
      if not mask[i, j]:
        continue
      r = np.exp(float(lp[i, j]) - float(old[i, j]))
      a = float(adv[i])
      pg[i, j] = -min(r * a, min(max(r, lo), hi) * a)
      tok[i, j] = pg[i, j]
      stats["n"] += 1
      stats["clip"] += int((a > 0 and r > hi) or (a < 0 and r < lo))
      stats["ratio"] += r
      stats["akl"] += (r - 1) - np.log(r)
      if ref is not None:
        d = float(ref[i, j]) - float(lp[i, j])
        k3 = np.exp(d) - d - 1
        stats["kl"] += k3
        if cfg.kl_coef > 0:
          tok[i, j] += cfg.kl_coef * k3

  def agg(x):
    if cfg.loss_agg == "token-mean":
      return sum(x[i, j] for i in range(b) for j in range(t) if mask[i, j]) / stats["n"]
    per_seq = []
    for i in range(b):
      n = int(mask[i].sum())
      if n == 0:
        continue
      s = sum(x[i, j] for j in range(t) if mask[i, j])
      per_seq.append(s / n if cfg.loss_agg == "seq-mean-token-mean" else s)
    return sum(per_seq) / len(per_seq)

  out = {"loss": agg(tok), "pg_loss": agg(pg), "clip_fraction": stats["clip"] / stats["n"],
         "ratio_mean": stats["ratio"] / stats["n"], "approx_kl": stats["akl"] / stats["n"]}
  if ref is not None:
    out["kl_to_ref"] = stats["kl"] / stats["n"]
  return out


def make_batch(seed: int = 0):
  """Random log-probs, ratios on both sides of the clip interval, mixed-sign advantages."""
  rng = np.random.default_rng(seed)
  old = rng.normal(-2.0, 0.5, MASK.shape).astype(np.float32)
  lp = (old + rng.uniform(-0.6, 0.6, MASK.shape)).astype(np.float32)
  ref = (lp + rng.normal(0.0, 0.3, MASK.shape)).astype(np.float32)
  lp[MASK == 0] = -1e30  # garbage on padding must not leak into anything
  adv = np.array([1.3, -0.7, 2.0, 0.5], np.float32)
  return lp, old, adv, ref


def check_against_ref(cfg: GRPOConfig, with_ref: bool) -> dict:
  lp, old, adv, ref = make_batch()
  loss, metrics = policy_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv),
                              jnp.asarray(MASK), cfg, jnp.asarray(ref) if with_ref else None)
  want = ref_loss(lp, old, adv, MASK, cfg, ref if with_ref else None)
  assert set(metrics) == set(want)
  np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-5, atol=1e-6)
  for k, v in want.items():
    np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
  return want


# ---------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("normalize", [True, False])
def test_group_advantages_match_reference(normalize):
  rewards = np.array([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 3], np.float32)
  got = np.asarray(group_advantages(jnp.asarray(rewards), 4, normalize, 1e-6))
  np.testing.assert_allclose(got, ref_advantages(rewards, 4, normalize, 1e-6), rtol=1e-5, atol=1e-6)
  assert np.all(got[4:8] == 0.0)  # a group with equal rewards carries no signal
  for start in range(0, 12, 4):
    assert abs(got[start:start + 4].sum()) < 1e-5


def test_group_advantages_bad_shape():
  with pytest.raises(ValueError, match="multiple of group_size"):
    group_advantages(jnp.zeros(7), 4)


# ---------------------------------------------------------------------------- token log-probs


def test_token_logprobs_match_reference():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 3, (2, 3, 7)).astype(np.float32)
  tokens = rng.integers(0, 7, (2, 3))
  got = token_logprobs(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(tokens))
  assert got.dtype == jnp.float32 and got.shape == (2, 3)
  got = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)))
  for i in range(2):
    for j in range(3):
      row = logits[i, j].astype(np.float64)
      want = row[tokens[i, j]] - np.log(np.exp(row - row.max()).sum()) - row.max()
      assert abs(got[i, j] - want) < 1e-5


# ---------------------------------------------------------------------------- loss values


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_loss_each_aggregation(agg):
  want = check_against_ref(GRPOConfig(group_size=2, loss_agg=agg), with_ref=False)
  assert 0 < want["clip_fraction"] < 1  # the batch exercises both branches


def test_aggregations_differ_on_ragged_masks():
  losses = {agg: check_against_ref(GRPOConfig(group_size=2, loss_agg=agg), False)["loss"]
            for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]}
  assert len({round(v, 6) for v in losses.values()}) == 3


def test_asymmetric_clipping():
  sym = check_against_ref(GRPOConfig(group_size=2, clip_eps_low=0.2), False)
  asym = check_against_ref(GRPOConfig(group_size=2, clip_eps_low=0.2, clip_eps_high=0.28), False)
  assert asym["clip_fraction"] <= sym["clip_fraction"]
  # One hand-made token: A > 0, ratio 1.25 is clipped at 1.2 but not at 1.28.
  lp, old = jnp.log(jnp.array([[1.25]])), jnp.zeros((1, 1))
  adv, m = jnp.ones((1,)), jnp.ones((1, 1))
  l_sym, ms = policy_loss(lp, old, adv, m, GRPOConfig(group_size=2))
  l_asym, ma = policy_loss(lp, old, adv, m, GRPOConfig(group_size=2, clip_eps_high=0.28))
  np.testing.assert_allclose([float(l_sym), float(l_asym)], [-1.2, -1.25], rtol=1e-6)
  assert float(ms["clip_fraction"]) == 1.0 and float(ma["clip_fraction"]) == 0.0
  # The low side is untouched by clip_eps_high: A < 0 with ratio 0.7 clips at 0.8 either way.
  lp = jnp.log(jnp.array([[0.7]]))
  for cfg in (GRPOConfig(group_size=2), GRPOConfig(group_size=2, clip_eps_high=0.28)):
    loss, mt = policy_loss(lp, old, -adv, m, cfg)
    np.testing.assert_allclose(float(loss), 0.8, rtol=1e-6)
    assert float(mt["clip_fraction"]) == 1.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_kl_penalty(agg):
  cfg = GRPOConfig(group_size=2, kl_coef=0.1, loss_agg=agg)
  want = check_against_ref(cfg, with_ref=True)
  assert want["kl_to_ref"] > 0 and want["loss"] > want["pg_loss"]
  # With kl_coef == 0 a given ref is only reported, not added.
  want0 = check_against_ref(GRPOConfig(group_size=2, loss_agg=agg), with_ref=True)
  np.testing.assert_allclose(want0["loss"], want0["pg_loss"])


def test_kl_requires_ref():
  lp, old, adv, _ = make_batch()
  with pytest.raises(ValueError, match="kl_coef"):
    policy_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(MASK),
                GRPOConfig(group_size=2, kl_coef=0.1))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_weights_spell_out_each_aggregation(agg):
  """Per-token weights: NumPy (host) and JAX agree, they sum to 1 over the valid tokens (the
  mean of a constant is the constant), and zero off the mask and on empty rows."""
  host = loss_weights(MASK, agg)
  assert isinstance(host, np.ndarray) and host.dtype == np.float32
  np.testing.assert_allclose(host, np.asarray(loss_weights(jnp.asarray(MASK), agg)), rtol=1e-6)
  assert np.all(host[MASK == 0] == 0) and np.all(host[MASK > 0] > 0)
  seqs, counts = 3, MASK.sum(1)  # row 3 is empty
  want = {"token-mean": MASK / MASK.sum(),
          "seq-mean-token-mean": MASK / (np.maximum(counts, 1)[:, None] * seqs),
          "seq-mean-token-sum": MASK / seqs}[agg]
  np.testing.assert_allclose(host, want, rtol=1e-6)
  if agg != "seq-mean-token-sum":
    np.testing.assert_allclose(host.sum(), 1.0, rtol=1e-6)
  with pytest.raises(ValueError, match="loss_agg"):
    loss_weights(MASK, "mean")


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_shares_of_parts_sum_to_the_whole_batch(agg, kl_coef):
  """Given the whole batch's per-token weights and valid-token count, each part of its tokens
  gives its share: loss, metrics and gradient summed over the parts equal the whole batch's.
  Parts: rows cut to fewer columns (a padding row, row 3, included or not), and rows 1 and 2
  packed back to back into one row with per-token advantages (a packed micro-batch)."""
  cfg = GRPOConfig(group_size=2, kl_coef=kl_coef, loss_agg=agg)
  lp, old, adv, ref = map(jnp.asarray, make_batch())
  mask = jnp.asarray(MASK)
  weights = jnp.asarray(loss_weights(MASK, agg))
  total = jnp.sum(mask)

  (whole, want), want_grad = jax.value_and_grad(
      lambda x: policy_loss(x, old, adv, mask, cfg, ref), has_aux=True)(lp)
  got_grad = np.zeros(MASK.shape, np.float32)
  rows, cols = np.array([0, 3]), 5
  (_, part), grad = jax.value_and_grad(lambda x: policy_loss(
      x, old[rows, :cols], adv[rows], mask[rows, :cols], cfg, ref[rows, :cols],
      token_weights=weights[rows, :cols], total_tokens=total), has_aux=True)(lp[rows, :cols])
  got = {k: float(v) for k, v in part.items()}
  got_grad[rows, :cols] += np.asarray(grad)
  # rows 1 (3 tokens) and 2 (1 token) in one packed row of 5, the last column padding
  take = lambda a: jnp.concatenate([a[1, :3], a[2, :1], jnp.zeros(1, a.dtype)])[None]
  packed_adv = take(jnp.broadcast_to(adv[:, None], MASK.shape))
  (_, part), grad = jax.value_and_grad(lambda x: policy_loss(
      x, take(old), packed_adv, take(mask), cfg, take(ref), token_weights=take(weights),
      total_tokens=total), has_aux=True)(take(lp))
  got = {k: got[k] + float(v) for k, v in part.items()}
  grad = np.asarray(grad)[0]
  got_grad[1, :3] += grad[:3]
  got_grad[2, :1] += grad[3:4]
  assert grad[4] == 0

  assert set(got) == set(want)
  np.testing.assert_allclose(got["loss"], float(whole), rtol=1e-5)
  for k in want:
    np.testing.assert_allclose(got[k], float(want[k]), rtol=1e-5, atol=1e-7, err_msg=k)
  np.testing.assert_allclose(got_grad, np.asarray(want_grad), rtol=1e-5, atol=1e-7)
  # without the whole batch's weights a part is its own batch: its loss is not a share
  alone, _ = policy_loss(lp[1:2, :3], old[1:2, :3], adv[1:2], mask[1:2, :3], cfg, ref[1:2, :3])
  share, _ = policy_loss(lp[1:2, :3], old[1:2, :3], adv[1:2], mask[1:2, :3], cfg, ref[1:2, :3],
                         token_weights=weights[1:2, :3], total_tokens=total)
  assert abs(float(alone) - float(share)) > 1e-3


def test_per_token_advantages_equal_per_row_ones():
  cfg = GRPOConfig(group_size=2, kl_coef=0.1, loss_agg="seq-mean-token-mean")
  lp, old, adv, ref = map(jnp.asarray, make_batch())
  mask = jnp.asarray(MASK)
  loss, m = policy_loss(lp, old, adv, mask, cfg, ref)
  loss2, m2 = policy_loss(lp, old, jnp.broadcast_to(adv[:, None], MASK.shape), mask, cfg, ref)
  assert float(loss) == float(loss2) and all(float(m[k]) == float(m2[k]) for k in m)
  with pytest.raises(ValueError, match="advantages"):
    policy_loss(lp, old, adv[:2], mask, cfg, ref)
  with pytest.raises(ValueError, match="token_weights"):
    policy_loss(lp, old, adv, mask, cfg, ref, token_weights=mask[:, :2])


# ---------------------------------------------------------------------------- gradients


def grad_wrt_logprobs(lp, old, adv, mask, cfg, ref=None):
  return np.asarray(jax.grad(lambda x: policy_loss(x, old, adv, mask, cfg, ref)[0])(lp))


def test_gradient_sign_inside_clip_range():
  old = jnp.full(MASK.shape, -1.5)
  lp = old + 0.05  # ratio ~1.05, inside [0.8, 1.2]
  lp = jnp.where(MASK > 0, lp, -1e30)
  for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]:
    cfg = GRPOConfig(group_size=2, loss_agg=agg)
    g = grad_wrt_logprobs(lp, old, jnp.ones(4), jnp.asarray(MASK), cfg)
    assert np.all(np.isfinite(g))
    assert np.all(g[MASK > 0] < 0), agg  # raising a good token's log-prob lowers the loss
    assert np.all(g[MASK == 0] == 0), agg
    g = grad_wrt_logprobs(lp, old, -jnp.ones(4), jnp.asarray(MASK), cfg)
    assert np.all(g[MASK > 0] > 0) and np.all(g[MASK == 0] == 0), agg


def test_gradient_zero_on_clipped_side():
  old = jnp.zeros((4, 1))
  ratio = jnp.array([[1.5], [1.5], [0.5], [0.5]])
  adv = jnp.array([1.0, -1.0, -1.0, 1.0])
  g = grad_wrt_logprobs(jnp.log(ratio), old, adv, jnp.ones((4, 1)), GRPOConfig(group_size=2))
  assert g[0, 0] == 0 and g[2, 0] == 0  # A>0 above 1+eps, A<0 below 1-eps: clipped, no gradient
  # The other side stays unclipped: d(-r*A)/d(log r) = -r*A, over 4 tokens.
  np.testing.assert_allclose([g[1, 0], g[3, 0]], [1.5 / 4, -0.5 / 4], rtol=1e-6)


def test_kl_gradient_pulls_towards_ref():
  old = jnp.zeros((1, 2))
  lp = jnp.zeros((1, 2))
  ref = jnp.array([[-1.0, 1.0]])  # lp above ref on token 0, below on token 1
  cfg = GRPOConfig(group_size=2, kl_coef=1.0)
  g = grad_wrt_logprobs(lp, old, jnp.zeros(1), jnp.ones((1, 2)), cfg, ref)
  assert g[0, 0] > 0 and g[0, 1] < 0


# ---------------------------------------------------------------------------- jit


def test_jit_static_config_and_closure():
  lp, old, adv, ref = map(jnp.asarray, make_batch())
  mask = jnp.asarray(MASK)
  cfg = GRPOConfig(group_size=2, kl_coef=0.05, clip_eps_high=0.3, loss_agg="seq-mean-token-sum")
  eager_loss, eager_m = policy_loss(lp, old, adv, mask, cfg, ref)
  jitted = jax.jit(policy_loss, static_argnames=("config",))
  loss, m = jitted(lp, old, adv, mask, config=cfg, ref_logprobs=ref)
  np.testing.assert_allclose(float(loss), float(eager_loss), rtol=1e-6)
  for k in eager_m:
    np.testing.assert_allclose(float(m[k]), float(eager_m[k]), rtol=1e-5, atol=1e-7)
  closed = jax.jit(jax.value_and_grad(
      lambda x: policy_loss(x, old, adv, mask, cfg, ref), has_aux=True))
  (loss2, _), g = closed(lp)
  np.testing.assert_allclose(float(loss2), float(eager_loss), rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(g)))
  adv_fn = jax.jit(functools.partial(group_advantages, group_size=2, normalize_std=False))
  np.testing.assert_allclose(np.asarray(adv_fn(jnp.array([1.0, 3.0, 2.0, 2.0]))), [-1, 1, 0, 0])
  tl = jax.jit(token_logprobs)(jnp.zeros((1, 2, 4)), jnp.array([[0, 3]]))
  np.testing.assert_allclose(np.asarray(tl), np.log(0.25), rtol=1e-6)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("field,value", [
    ("group_size", 0), ("group_size", 2.0), ("group_size", True),
    ("clip_eps_low", 0.0), ("clip_eps_low", 1.0), ("clip_eps_low", -0.1),
    ("clip_eps_high", 0.0), ("clip_eps_high", float("nan")),
    ("kl_coef", -0.1), ("kl_coef", float("inf")),
    ("loss_agg", "mean"), ("normalize_std", 1), ("eps", 0.0),
    ("eps", float("inf")),  # every advantage would be 0: nothing to learn from
])
def test_bad_config_raises_with_field_name(field, value):
  kwargs = {"group_size": 4, field: value}
  with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
    GRPOConfig(**kwargs)


def test_group_of_one_is_refused_as_no_learning_signal():
  """A one-sample group's advantage is 0 whatever its reward (zero gradients): the config says so
  in one line that names the field and the fix, also through the config layer."""
  assert np.all(np.asarray(group_advantages(jnp.array([0.0, 1.0, 1.0]), 1)) == 0.0)
  with pytest.raises(ValueError, match=r"GRPOConfig.group_size=1 .*zero gradients.*2 or more"):
    GRPOConfig(group_size=1)
  # pylint: disable-next=import-outside-toplevel
  from tlt_jax.job.typed_config import ConfigError, to_dataclass
  import ml_collections  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match=r"^config.grpo: GRPOConfig.group_size=1 [^\n]*$"):
    to_dataclass(GRPOConfig, ml_collections.ConfigDict(dict(group_size=1)), "grpo")
  assert GRPOConfig(group_size=2).group_size == 2


def test_config_defaults_and_hashable():
  cfg = GRPOConfig(group_size=8)
  assert cfg.eps_high == cfg.clip_eps_low == 0.2
  assert GRPOConfig(group_size=8, clip_eps_high=0.28).eps_high == 0.28
  assert hash(cfg) == hash(GRPOConfig(group_size=8))
