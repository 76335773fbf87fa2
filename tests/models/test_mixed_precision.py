"""Mixed precision: float32 params (what the optimizer updates and checkpoints hold) with bf16
arithmetic and KV cache (``ModelConfig.compute_dtype``), from the model to the policy update,
its checkpoint and the job's config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.test_trainer import host, learning_trainer
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.instances import with_compute_dtype
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import KVCache, init_model

MIXED = ModelConfig.tiny(vocab_size=32, compute_dtype="bfloat16")


def dtypes(tree) -> set:
  return {str(x.dtype) for x in jax.tree.leaves(tree)}


def test_params_are_float32_and_the_arithmetic_bf16():
  model = init_model(MIXED, seed=0)
  assert dtypes(jax.tree.map(lambda v: v, model)) == {"float32"}
  cache = KVCache.create(MIXED, batch=1, max_len=8)
  assert cache.k[0].dtype == jnp.bfloat16
  out = model.forward(jnp.array([[1, 2, 3]]), cache=cache, return_hidden=True)
  assert out.logits.dtype == jnp.float32  # the LM head accumulates in float32
  assert out.hidden.dtype == jnp.bfloat16 and out.cache.k[0].dtype == jnp.bfloat16
  drafter = Eagle3Drafter.for_target(model)
  assert dtypes(jax.tree.map(lambda v: v, drafter)) == {"float32"}


def test_with_compute_dtype_shares_the_params_and_changes_only_the_arithmetic():
  model = init_model(MIXED.replace(compute_dtype=None), seed=0)
  mixed = with_compute_dtype(model, "bfloat16")
  assert mixed.config.compute_dtype == "bfloat16" and with_compute_dtype(model, None) is model
  for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(mixed)):
    assert a is b
  ids = jnp.array([[1, 5, 9, 2]])
  diff = np.abs(np.asarray(model(ids)) - np.asarray(mixed(ids)))
  assert 0 < diff.max() < 0.05  # bf16 rounding, not another model


def test_a_bad_compute_dtype_is_named():
  with pytest.raises(ValueError, match=r"ModelConfig.compute_dtype must be None .* got 'bf16'"):
    MIXED.replace(compute_dtype="bf16")


def test_the_update_keeps_float32_params_and_moments_through_steps_and_a_checkpoint(tmp_path):
  """Two RL steps computing in bf16: params and Adam moments stay float32 (the gradients of the
  bf16 matmuls land on float32 params), the updates are finite and move the params, and a
  checkpoint restores them bit for bit."""
  from tlt_jax.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  trainer = learning_trainer(compute_dtype="bfloat16")
  before = host(trainer.policy.params)
  metrics = [trainer.step() for _ in range(2)]
  assert all(np.isfinite(m["loss"]) and m["skipped_updates"] == 0 for m in metrics), metrics
  assert dtypes(trainer.policy.params) == {"float32"}
  assert dtypes(trainer.policy.opt_state) <= {"float32", "int32"}
  moved = [not np.array_equal(a, b) for a, b in zip(before, host(trainer.policy.params))]
  assert sum(moved) > len(moved) // 2
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    trainer.save(ckpt)
  resumed = learning_trainer(compute_dtype="bfloat16")
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    resumed.restore(ckpt)
  assert dtypes(resumed.policy.params) == {"float32"}
  for a, b in zip(host(trainer.policy.params), host(resumed.policy.params)):
    np.testing.assert_array_equal(a, b)
  assert resumed.engine.config is not None
  state = resumed.engine.pool.state_spec(8, resumed.engine.config.cache_len)
  assert state.cache.k[0].dtype == jnp.bfloat16  # the rollout computes in bf16 too

