"""Test helpers shared across test modules."""

import itertools
import os

import jax
from flax import nnx

from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import Transformer, init_model
from tlt_jax.rollout.host.tuner import Decision


def sharp_random_model(config: ModelConfig, seed: int = 0, scale: float = 8.0) -> Transformer:
  """A random model whose matrices are scaled up, so its next-token distributions are peaked
  and greedy trajectories vary (a plain 0.02-std init is nearly uniform and loops on one token)."""
  graphdef, state = nnx.split(init_model(config, seed))
  state = jax.tree.map(lambda x: x * scale if x.ndim == 2 else x, state)
  return nnx.merge(graphdef, state)


def mirror_drafter(target: Transformer, layer: int = 0):
  """A drafter that copies one target layer and whose ``fc`` passes the token embedding through
  (ignoring the feature): for a one-layer target it predicts almost exactly what the target does
  (it misses only the first prompt token), so drafts are mostly accepted."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from tlt_jax.models.drafter import Drafter  # pylint: disable=import-outside-toplevel
  drafter = Drafter.from_target_layer(target, layer)
  h = target.config.hidden_size
  drafter.fc.kernel.set_value(jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], 0).astype(
      drafter.fc.kernel.dtype))
  drafter.fc.bias.set_value(jnp.zeros((h,), drafter.fc.bias.dtype))
  return drafter


def largest_file(directory) -> str:
  """The path of the largest file under ``directory`` (a checkpoint's array data)."""
  files = [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]
  return max(files, key=os.path.getsize)


def garble(step_dir) -> None:
  """Flips 16 bytes in the middle of the largest file; its size (and readability) stay."""
  path = largest_file(step_dir)
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.seek(size // 2)
    chunk = f.read(16)
    f.seek(size // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))
  assert os.path.getsize(path) == size


class CrashAtSync(Exception):
  """A crash simulated when a writer syncs its file (``crash_at_fsync``)."""


def crash_at_fsync(monkeypatch) -> list[str]:
  """From now on ``os.fsync`` records the path of the file it is asked to sync and raises
  ``CrashAtSync``, as if the machine went down there; returns the recorded paths."""
  synced = []

  def fsync(fd):
    synced.append(os.readlink(f"/proc/self/fd/{fd}"))
    raise CrashAtSync(synced[-1])

  monkeypatch.setattr(os, "fsync", fsync)
  return synced


def assert_written_atomically(path, write, monkeypatch) -> None:
  """``write()`` replaces the file at ``path`` atomically: it syncs a sibling file first, and a
  crash there leaves the old file whole (a writer in place would have cut it short)."""
  path = os.fspath(path)
  old = _read(path)
  with monkeypatch.context() as patch:
    synced = crash_at_fsync(patch)
    try:
      write()
    except CrashAtSync:
      pass
  assert len(synced) == 1, f"{path}: never synced before it was renamed into place"
  assert synced[0] != os.path.realpath(path), f"{path} was written in place"
  assert os.path.dirname(synced[0]) == os.path.dirname(os.path.realpath(path))
  assert _read(path) == old, f"{path} changed before the new contents were synced"
  write()  # and without the crash, the new contents replace the old
  assert _read(path) != old and not os.path.exists(synced[0])


def _read(path) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def choose(tuner, bucket, arms) -> str:
  """The arm ``tuner.plan`` picks for the next segment of ``bucket`` (without how long it runs)."""
  return tuner.plan(bucket, arms).arm


class RoundRobin:
  """A scripted tuner: every bucket cycles through its arms, one segment each; ``updates`` keeps
  every ``update``'s ``(arm, tokens, seconds, measured keywords)``."""

  def __init__(self):
    self.turn = itertools.count()
    self.calls = []
    self.updates = []

  def choose(self, bucket, arms):
    arm = arms[next(self.turn) % len(arms)].name
    self.calls.append((bucket, arm))
    return arm

  def plan(self, bucket, arms):
    return Decision(self.choose(bucket, arms))

  def update(self, bucket, arm, tokens, seconds, **measured):
    assert tokens >= 0 and seconds > 0
    self.updates.append((arm, tokens, seconds, measured))

  def step_cost(self, bucket, arm):  # nothing measured: the rollout's SD saving is unknown
    return None

  def observe_drafter(self, quality=None, source="learned", forget=False):
    pass

  def summary(self):
    return {}
