"""Checkpointer: bitwise round trips, retention, clear errors, and crash-safety under SIGKILL."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tlt_jax import checkpoint as ck
from tlt_jax.checkpoint import CheckpointError, Checkpointer
from tests.xla_env import subprocess_env

# After a failed (corrupt) read, orbax's tensorstore callbacks may hit an already closed asyncio
# loop in a background thread; that noise is harmless and not ours.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Tiny(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, width: int = 8) -> None:
    self.embed = nnx.Embed(16, width, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(2)])
    self.norm = nnx.RMSNorm(width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.embed(x)
    for layer in self.layers:
      h = jax.nn.gelu(layer(h))
    return self.norm(h)


@jax.jit
def _adamw_step(params: dict) -> tuple[dict, optax.OptState]:
  tx = optax.adamw(1e-2)
  opt_state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.sin(p * 3.0 + 1.0), params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _train_state(seed: int = 0, width: int = 8) -> dict:
  """Params after one adamw step (so the moments are non-trivial), an rng and a step counter."""
  model = _Tiny(nnx.Rngs(seed), width)
  params = ck.state_to_pure_dict(nnx.state(model, nnx.Param))
  params, opt_state = _adamw_step(params)
  return {"params": params, "opt_state": opt_state,
          "rng": ck.key_to_data(jax.random.key(seed + 7)),
          "step": jnp.asarray(3 + seed, jnp.int32)}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _assert_bitwise_equal(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def test_package_exports_are_the_implementations():
  from tlt_jax.checkpoint import checkpointer, trees  # pylint: disable=import-outside-toplevel
  assert ck.Checkpointer is checkpointer.Checkpointer
  assert ck.count_nonfinite is trees.count_nonfinite
  assert ck.pure_dict_to_state is trees.pure_dict_to_state
  assert set(ck.__all__) <= set(dir(ck))



def test_pure_dict_to_state_leaves_its_template_untouched():
  like = nnx.state(_Tiny(nnx.Rngs(0)), nnx.Param)
  before = ck.state_to_pure_dict(jax.tree.map(np.asarray, like))
  other = ck.state_to_pure_dict(nnx.state(_Tiny(nnx.Rngs(1)), nnx.Param))
  state = ck.pure_dict_to_state(other, like)
  _assert_bitwise_equal(ck.state_to_pure_dict(state), other)
  _assert_bitwise_equal(ck.state_to_pure_dict(like), before)


def test_round_trip_is_bitwise_exact(tmp_path):
  state = _train_state()
  meta = {"format_version": 1, "config": {"lr": 1e-2, "layers": [8, 8]}, "data_position": 123}
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(3, state, meta)
    restored, restored_meta = ckpt.restore(like=_abstract(state))
  _assert_bitwise_equal(state, restored)
  assert restored_meta == meta

  # The restored params drive a fresh model to the original's outputs.
  model, fresh = _Tiny(nnx.Rngs(0)), _Tiny(nnx.Rngs(1))
  nnx.update(model, ck.pure_dict_to_state(state["params"], nnx.state(model, nnx.Param)))
  nnx.update(fresh, ck.pure_dict_to_state(restored["params"], nnx.state(fresh, nnx.Param)))
  forward = nnx.jit(lambda m, x: m(x))
  x = jnp.arange(5)
  assert np.asarray(forward(model, x)).tobytes() == np.asarray(forward(fresh, x)).tobytes()
  key = ck.data_to_key(restored["rng"])
  assert np.array_equal(jax.random.bits(key, (4,)), jax.random.bits(jax.random.key(7), (4,)))


def test_typed_keys_and_async_save(tmp_path):
  state = {"rng": jax.random.key(5), "rbg": jax.random.split(jax.random.key(1, impl="rbg"), 3),
           "x": jnp.arange(6.0).reshape(2, 3)}
  ckpt = Checkpointer(tmp_path, async_save=True)
  ckpt.save(1, state, {})
  ckpt.wait()
  restored, _ = ckpt.restore(1, like=_abstract(state))
  ckpt.close()
  assert jax.random.key_impl(restored["rbg"]) == jax.random.key_impl(state["rbg"])
  for name in ("rng", "rbg"):
    assert restored[name].dtype == state[name].dtype
    assert np.array_equal(jax.random.key_data(restored[name]), jax.random.key_data(state[name]))
  assert np.array_equal(restored["x"], state["x"])


def test_keep_and_latest_step(tmp_path):
  directory = tmp_path / "run"
  ckpt = Checkpointer(directory, keep=2)
  assert ckpt.latest_step() is None and not directory.exists()
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    ckpt.restore(like={"a": jnp.zeros(2)})
  for step in (1, 2, 5, 9):
    ckpt.save(step, {"a": jnp.full((2,), step, jnp.int32)}, {"step": step})
  assert ckpt.latest_step() == 9 and ckpt.all_steps() == [5, 9]
  assert sorted(os.listdir(directory)) == ["5", "9"]
  with pytest.raises(ValueError, match="not newer than the latest checkpoint 9"):
    ckpt.save(9, {"a": jnp.zeros(2, jnp.int32)}, {})
  ckpt.close()

  reopened = Checkpointer(directory, keep=2)
  assert reopened.latest_step() == 9
  old, meta = reopened.restore(5, like={"a": jnp.zeros(2, jnp.int32)})
  assert meta == {"step": 5} and np.array_equal(old["a"], [5, 5])
  with pytest.raises(FileNotFoundError, match=r"available steps: \[5, 9\]"):
    reopened.restore(1, like={"a": jnp.zeros(2, jnp.int32)})


def test_delete_after_keeps_the_step_itself(tmp_path):
  """``delete_after(step)`` (a resumed run's drafter saves of the steps it redoes) deletes only
  the newer steps: ``step`` itself, the one the run resumes from, stays and restores."""
  ckpt = Checkpointer(tmp_path, keep=None)
  for step in (1, 2, 3):
    ckpt.save(step, {"a": jnp.full((2,), step, jnp.int32)}, {"step": step})
  assert ckpt.delete_after(2) == [3] and ckpt.all_steps() == [1, 2] and ckpt.latest_step() == 2
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]
  kept, meta = ckpt.restore(2, like={"a": jnp.zeros(2, jnp.int32)})
  assert meta == {"step": 2} and np.array_equal(kept["a"], [2, 2])
  assert ckpt.delete_after(2) == []
  ckpt.save(3, {"a": jnp.zeros(2, jnp.int32)}, {})  # the redone step saves anew
  ckpt.close()


def test_mismatched_shape_or_structure_raises_clear_error(tmp_path):
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, _train_state(width=8), {})
  wider = _abstract(_train_state(width=16))
  with pytest.raises(ValueError) as info:
    ckpt.restore(like=wider)
  message = str(info.value)
  assert str(tmp_path / "1") in message and "different model config" in message
  assert "has shape (16, 8), expected (16, 16)" in message  # the embedding comes first

  extra = _abstract(_train_state(width=8))
  extra["params"]["head"] = jax.ShapeDtypeStruct((8, 4), jnp.float32)
  with pytest.raises(ValueError, match="missing from the checkpoint: params/head"):
    ckpt.restore(like=extra)


@pytest.mark.parametrize("damage", ["garbage", "delete"])
def test_corrupt_checkpoint_raises_clear_error(tmp_path, damage):
  state = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "b": jnp.ones(3)}
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, state, {})
  ckpt.save(2, state, {})
  data_files = [os.path.join(root, name)
                for root, _, names in os.walk(tmp_path / "2" / "state")
                for name in names if os.path.basename(root) == "d"]
  assert data_files
  for path in data_files:
    if damage == "delete":
      os.remove(path)
    else:
      with open(path, "r+b") as f:
        f.write(np.random.default_rng(0).bytes(os.path.getsize(path)))
  with pytest.raises(CheckpointError, match="unreadable") as info:
    ckpt.restore(like=_abstract(state))
  assert str(tmp_path / "2") in str(info.value) and "[1]" in str(info.value)
  restored, _ = ckpt.restore(1, like=_abstract(state))
  _assert_bitwise_equal(state, restored)


_CHILD = """
import sys
import jax, jax.numpy as jnp, numpy as np
from tlt_jax.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], keep=2)
base = jnp.asarray(np.random.default_rng(0).random((16, 1024, 1024), dtype=np.float32))
for step in range(1, 41):
  ckpt.save(step, {"w": base + step, "step": jnp.asarray(step, jnp.int32)}, {"step": step})
  print(f"SAVED {step}", flush=True)
"""


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path):
  directory = str(tmp_path / "run")
  env = subprocess_env()
  proc = subprocess.Popen([sys.executable, "-c", _CHILD, directory], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=env)
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
  saved: list[int] = []
  killed_mid_save = False
  try:
    saved.append(int(lines.get(timeout=60).split()[1]))  # the first checkpoint is complete
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
      if any("tmp" in name for name in os.listdir(directory)):
        os.kill(proc.pid, signal.SIGKILL)
        killed_mid_save = True
        break
      time.sleep(0.001)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=30)
  time.sleep(0.2)  # let the reader thread drain what the child printed
  while not lines.empty():
    saved.append(int(lines.get().split()[1]))
  assert killed_mid_save and proc.returncode == -signal.SIGKILL

  ckpt = Checkpointer(directory, keep=2)
  latest = ckpt.latest_step()
  # The last reported save is there; at most one more finished its rename before the kill.
  assert latest in (saved[-1], saved[-1] + 1)
  like = {"w": jax.ShapeDtypeStruct((16, 1024, 1024), jnp.float32),
          "step": jax.ShapeDtypeStruct((), jnp.int32)}
  restored, meta = ckpt.restore(like=like)
  base = np.random.default_rng(0).random((16, 1024, 1024), dtype=np.float32)
  assert meta == {"step": latest} and int(restored["step"]) == latest
  assert np.asarray(restored["w"]).tobytes() == np.asarray(jnp.asarray(base) + latest).tobytes()

  # Resuming writes the next step; the crashed save's leftover is gone by then.
  ckpt.save(latest + 1, {"w": restored["w"], "step": jnp.asarray(latest + 1, jnp.int32)}, {})
  ckpt.close()
  assert not any("tmp" in name for name in os.listdir(directory))
  assert Checkpointer(directory).all_steps() == [latest, latest + 1]
