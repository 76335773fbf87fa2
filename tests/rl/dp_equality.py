"""Run by test_trainer in a fresh process with 8 simulated CPU devices: one GRPO update on a
1-device mesh and on an 8-device mesh (rows sharded over ``data``) must give the same params."""

import os

from tests.xla_env import device_count_flags  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = device_count_flags(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import Mesh  # pylint: disable=wrong-import-position

from tests.rl.test_trainer import hand_made_batch, make_trainer  # pylint: disable=wrong-import-position

assert jax.device_count() == 8, jax.devices()
params = []
for n in (1, 8):
  trainer = make_trainer(mesh=Mesh(np.array(jax.devices()[:n]), ("data",)), prompts_per_step=4,
                         minibatches=1)
  batch = hand_made_batch(trainer, 8)
  for _ in range(2):  # two steps, so the optimizer state must agree too
    policy = trainer.policy
    policy.params, policy.opt_state, _ = policy.update_fn(policy.params, policy.opt_state, batch)
  params.append(jax.tree.map(np.asarray, jax.device_get(trainer.policy.params)))
diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params[0]),
                                                         jax.tree.leaves(params[1])))
print(f"max abs difference {diff:.3e}")
assert diff < 1e-5, diff
