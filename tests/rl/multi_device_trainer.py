"""Run by test_trainer in a fresh process with 4 simulated CPU devices: GRPO steps on a 4-device
mesh roll out on one device, update data-parallel, compile nothing after the first step (update
executables precompiled), and a
non-finite update restores the (mesh-replicated) state from before the step."""

import os

from tests.xla_env import device_count_flags  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = device_count_flags(4)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import Mesh  # pylint: disable=wrong-import-position

from tests.rl.test_trainer import (make_trainer, nan_row_batches,  # pylint: disable=wrong-import-position
                                   varied_rewards)
from tlt_jax.rl.update import NonFiniteUpdateError  # pylint: disable=wrong-import-position
from tlt_jax.utils import compile_count  # pylint: disable=wrong-import-position

assert jax.device_count() == 4, jax.devices()
trainer = make_trainer(mesh=Mesh(np.array(jax.devices()), ("data",)))  # 8 rows, 2 minibatches
varied_rewards(trainer)
trainer.precompile_update()  # as the main job does: every update length, ahead of time
start = jax.tree.map(np.asarray, trainer.policy.params)
first = trainer.step()
compiles = compile_count()
second = trainer.step()
assert compile_count() == compiles and second["compiles"] == 0, (compile_count() - compiles, second)
for m in (first, second):
  bad = {k: v for k, v in m.items() if isinstance(v, float) and not np.isfinite(v)}
  assert not bad and m["skipped_updates"] == 0, m
assert second["grad_norm"] > 0, second
params = jax.tree.map(np.asarray, trainer.policy.params)
assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(params)))
# the engine rolls out with the current weights, on one device
for mine, engine in zip(jax.tree.leaves(trainer.policy.params),
                        jax.tree.leaves(trainer.engine.params)):
  assert len(engine.devices()) == 1 and np.array_equal(np.asarray(mine), np.asarray(engine))

nan_row_batches(trainer)  # row 0 NaN: one of the two updates is finite and applied, then undone
opt_state = jax.tree.map(np.asarray, trainer.policy.opt_state)
try:
  trainer.step()
  raise AssertionError("a NaN update did not stop the step")
except NonFiniteUpdateError as e:
  assert "step 3" in str(e), e
for a, b in zip(jax.tree.leaves((params, opt_state)),
                jax.tree.leaves((trainer.policy.params, trainer.policy.opt_state))):
  np.testing.assert_array_equal(a, np.asarray(b))
del trainer.make_batch  # back to finite batches: the restored state trains on, compiling nothing
compiles = compile_count()
third = trainer.step()
assert third["step"] == 3 and np.isfinite(third["loss"]) and compile_count() == compiles, third
print("4-device trainer ok")
