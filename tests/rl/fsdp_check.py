"""Run by test_fsdp in a fresh process with 4 simulated CPU devices: the policy update on a 1-D
data-parallel mesh and on FSDP meshes (fsdp=4; data=2 x fsdp=2), full-length and packed, all from
the same params on the same batch. Prints one line ``FSDP_RESULTS <json>`` of what test_fsdp
checks: per-device bytes of params + KL reference + optimizer state, losses, the largest
difference of params and optimizer state to the data-parallel update's, compiles after
``precompile``, ``rollout_params``' layout and values, and a checkpoint round trip."""

import os

from tests.xla_env import device_count_flags  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = device_count_flags(4)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # pylint: disable=wrong-import-position
import sys  # pylint: disable=wrong-import-position
import tempfile  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position
from jax.sharding import Mesh  # pylint: disable=wrong-import-position

from tlt_jax import checkpoint as ckpt  # pylint: disable=wrong-import-position
from tlt_jax.models.model_config import ModelConfig  # pylint: disable=wrong-import-position
from tlt_jax.models.transformer import init_model  # pylint: disable=wrong-import-position
from tlt_jax.rl import grpo  # pylint: disable=wrong-import-position
from tlt_jax.rl.packing import padded_batch  # pylint: disable=wrong-import-position
from tlt_jax.rl.trainer_config import TrainerConfig  # pylint: disable=wrong-import-position
from tlt_jax.rl.mesh import make_mesh  # pylint: disable=wrong-import-position
from tlt_jax.rl.update import PolicyUpdate  # pylint: disable=wrong-import-position
from tlt_jax.utils import compile_count  # pylint: disable=wrong-import-position

assert jax.device_count() == 4, jax.devices()
DEVICES = jax.devices()
SEQ_LEN, STEPS = 40, 3  # rows of up to 40 tokens; 3 RL steps of 2 minibatches: 6 Adam steps
# a vocabulary of 18 (the arithmetic task's): the embedding [18, 32] is sharded on its hidden
# dimension, the other leaves on their largest
MODEL = ModelConfig.tiny(vocab_size=18)
GRAPHDEF, _ = nnx.split(init_model(MODEL, seed=0))


def host_params(seed: int):
  """The tiny policy's params as host arrays: each PolicyUpdate gets buffers of its own (the
  update donates them)."""
  return jax.tree.map(np.asarray, nnx.split(init_model(MODEL, seed=seed))[1])


def make_batch(rows: int = 8):
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, 14, int(rng.integers(2, 10))).tolist() for _ in range(rows)]
  comps = [rng.integers(3, 14, int(rng.integers(1, 20))).tolist() for _ in range(rows)]
  old = [rng.uniform(-3.0, -2.0, len(c)) for c in comps]
  advantages = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)
  return padded_batch(prompts, comps, old, advantages, SEQ_LEN)


def make_policy(mesh, update_tokens: int = 0, seed: int = 0) -> PolicyUpdate:
  config = TrainerConfig(prompts_per_step=4, minibatches=2, update_tokens=update_tokens,
                         learning_rate=1e-3, warmup_steps=0)
  # kl_coef > 0: the frozen reference is sharded and gathered too
  return PolicyUpdate(GRAPHDEF, host_params(seed), config,
                      grpo.GRPOConfig(group_size=2, kl_coef=0.05), mesh, SEQ_LEN)


def bytes_per_device(tree) -> list[int]:
  """What each device holds of ``tree``'s arrays (their addressable shards there)."""
  leaves = jax.tree.leaves(tree)
  return [sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d)
          for d in DEVICES]


def host(tree) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def max_diff(a, b) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(host(a), host(b), strict=True))


def rollout_report(policy: PolicyUpdate) -> dict:
  """Whether ``rollout_params`` has a full copy of every param on every device, equal to it."""
  weights = policy.rollout_params()
  full = all(x.sharding.is_fully_replicated and len(x.addressable_shards) == len(DEVICES)
             and all(s.data.shape == x.shape for s in x.addressable_shards)
             for x in jax.tree.leaves(weights))
  equal = all(np.array_equal(np.asarray(s.data), np.asarray(p))
              for x, p in zip(jax.tree.leaves(weights), jax.tree.leaves(policy.params))
              for s in x.addressable_shards)
  return dict(full_copy_everywhere=full, equal=equal, is_params=weights is policy.params,
              bytes=bytes_per_device(weights))


def train(name: str, mesh, update_tokens: int = 0) -> tuple[PolicyUpdate, dict]:
  """STEPS RL steps of the same batch, handing the rollout its weights after each, as the
  trainer does; what they measured."""
  policy = make_policy(mesh, update_tokens)
  batch = make_batch()
  state = (policy.params, policy.ref_params, policy.opt_state)
  out = dict(name=name, mesh=dict(mesh.shape), bytes=bytes_per_device(state),
             param_bytes=bytes_per_device(policy.params),
             opt_bytes=bytes_per_device(policy.opt_state))
  out["precompiled"] = policy.precompile()
  compiles = compile_count()
  metrics = []
  for step in range(STEPS):
    metrics.append(policy.run(batch, step))
    policy.rollout_params()
  out["compiles_after_precompile"] = compile_count() - compiles
  out["losses"] = [m["loss"] for m in metrics]
  out["grad_norms"] = [m["grad_norm"] for m in metrics]
  out["bytes_after"] = bytes_per_device((policy.params, policy.ref_params, policy.opt_state))
  out["rollout"] = rollout_report(policy)
  # how many different blocks of rows the compiled update hands the devices (FSDP: one each)
  key = ("accumulate", SEQ_LEN) if update_tokens else ("padded",)
  rows = policy.executables.lookup(key).input_shardings[0][3 if update_tokens else 2]["ids"]
  out["row_blocks"] = len({str(i) for i in rows.devices_indices_map((8, SEQ_LEN)).values()})
  return policy, out


def checkpoint_round_trip(policy: PolicyUpdate) -> dict:
  """Saves ``policy``'s state, restores it into a policy of other params on the same mesh, and
  runs one more RL step on both: restored arrays in the update's shardings, same loss, same
  params, no compile."""
  batch = make_batch()
  with tempfile.TemporaryDirectory() as directory:
    saver = ckpt.Checkpointer(directory)
    saver.save(STEPS, policy.checkpoint_state())
    other = make_policy(policy.mesh, policy.config.update_tokens, seed=1)
    other.precompile()
    before = max_diff(other.params, policy.params)
    state, _ = saver.restore(STEPS, like=other.checkpoint_state())
    saver.close()
  like = other.checkpoint_state()
  landed = all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(state),
                                                        jax.tree.leaves(like), strict=True))
  other.load_checkpoint_state(state)
  kept = all(x.sharding == y.sharding for x, y in zip(
      jax.tree.leaves(other.checkpoint_state()), jax.tree.leaves(like), strict=True))
  restored_diff = max(max_diff(other.params, policy.params),
                      max_diff(other.opt_state, policy.opt_state),
                      max_diff(other.ref_params, policy.ref_params))
  compiles = compile_count()
  want, got = policy.run(batch, STEPS), other.run(batch, STEPS)
  return dict(params_differed_before=before, restored_in_layout=landed, loaded_in_layout=kept,
              restored_diff=restored_diff, loss=[want["loss"], got["loss"]],
              params_diff_after_step=max_diff(other.params, policy.params),
              compiles=compile_count() - compiles)


def bad_mesh_errors() -> dict:
  errors = {}
  for fsdp in (3, 0, 8):
    try:
      make_mesh(DEVICES, fsdp)
      errors[str(fsdp)] = None
    except ValueError as e:
      errors[str(fsdp)] = str(e)
  return errors


def main() -> None:
  results = {}
  runs = {"dp": (Mesh(np.array(DEVICES), ("data",)), 0), "fsdp1": (make_mesh(DEVICES, 1), 0),
          "fsdp4": (make_mesh(DEVICES, 4), 0),
          "data2_fsdp2_packed": (make_mesh(DEVICES, 2), 64),
          "dp_packed": (Mesh(np.array(DEVICES), ("data",)), 64),
          "fsdp4_packed": (make_mesh(DEVICES, 4), 64)}
  policies = {}
  for name, (mesh, tokens) in runs.items():
    policies[name], results[name] = train(name, mesh, tokens)
  for name, reference in (("fsdp1", "dp"), ("fsdp4", "dp"), ("data2_fsdp2_packed", "dp_packed"),
                          ("fsdp4_packed", "dp_packed")):
    results[name]["params_diff"] = max_diff(policies[name].params, policies[reference].params)
    results[name]["opt_diff"] = max_diff(policies[name].opt_state, policies[reference].opt_state)
    results[name]["specs"] = sorted({str(x.sharding.spec) for x in
                                     jax.tree.leaves(policies[name].opt_state)})
  results["checkpoint"] = checkpoint_round_trip(policies["fsdp4"])
  results["errors"] = bad_mesh_errors()
  print("FSDP_RESULTS " + json.dumps(results))
  sys.stdout.flush()


if __name__ == "__main__":
  main()
