"""Checkpointer integrity: checksums, NaN refusal, fallback to the newest good step, safe rotation,
and a quiet console when a checkpoint is damaged."""

import json
import logging
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.helpers import garble, largest_file
from tests.xla_env import subprocess_env
from tlt_jax.checkpoint import console
from tlt_jax.checkpoint import (CheckpointCorruptError, CheckpointError, Checkpointer,
                                NonFiniteError, UnverifiedCheckpointWarning)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"params": {"w": jnp.asarray(rng.standard_normal((64, 64), dtype=np.float32)),
                     "b": jnp.asarray(rng.standard_normal(8, dtype=np.float32))},
          "step": jnp.asarray(seed, jnp.int32)}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _same(a, b) -> bool:
  pairs = [(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in pairs)


def test_garbled_data_file_raises_corrupt_error(tmp_path):
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, _state(1), {})
  ckpt.save(2, _state(2), {})
  garble(tmp_path / "2")
  with pytest.raises(CheckpointCorruptError) as info:
    ckpt.restore(like=_abstract(_state()))
  message = str(info.value)
  assert "\n" not in message and str(tmp_path / "2") in message
  assert "array params/w does not match the checksum" in message
  assert "restore_latest_good" in message and "[1]" in message
  assert info.value.step == 2 and info.value.key == "params/w"
  assert ckpt.all_steps() == [1, 2]  # plain restore moves nothing
  assert _same(ckpt.restore(1, like=_abstract(_state()))[0], _state(1))


def test_garbled_metadata_is_detected(tmp_path):
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, _state(), {"data_position": 1234})
  path = tmp_path / "1" / "metadata" / "metadata"
  text = path.read_text()
  path.write_text(text.replace("1234", "1284"))
  with pytest.raises(CheckpointCorruptError, match="metadata does not match the checksum"):
    ckpt.restore(like=_abstract(_state()))


def test_restore_latest_good_falls_back_and_moves_the_bad_step_aside(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=3)
  for step in (1, 2, 3):
    ckpt.save(step, _state(step), {"step": step})
  garble(tmp_path / "3")
  garble(tmp_path / "2")
  lines: list[str] = []
  step, state, meta = ckpt.restore_latest_good(like=_abstract(_state()), report=lines.append)
  assert step == 1 and meta == {"step": 1} and _same(state, _state(1))
  assert len(lines) == 2 and all("\n" not in line for line in lines)
  assert str(tmp_path / "3") in lines[0] and "trying step 2" in lines[0]
  assert str(tmp_path / "2") in lines[1] and "trying step 1" in lines[1]
  assert sorted(os.listdir(tmp_path)) == ["1", "2.corrupt", "3.corrupt"]
  assert ckpt.all_steps() == [1]

  # Training resumes: the step numbers of the moved-aside checkpoints can be saved again.
  ckpt.save(2, _state(20), {"step": 2})
  assert ckpt.restore(like=_abstract(_state()))[1] == {"step": 2}
  ckpt.close()
  reopened = Checkpointer(tmp_path)  # orbax neither lists nor cleans up the moved-aside steps
  assert reopened.all_steps() == [1, 2]
  assert sorted(os.listdir(tmp_path)) == ["1", "2", "2.corrupt", "3.corrupt"]
  garble(tmp_path / "2")
  reopened.restore_latest_good(like=_abstract(_state()), report=lambda line: None)
  assert "2.corrupt1" in os.listdir(tmp_path)


def test_restore_latest_good_errors(tmp_path):
  ckpt = Checkpointer(tmp_path)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    ckpt.restore_latest_good(like=_abstract(_state()))
  ckpt.save(1, _state(1), {})
  ckpt.save(2, _state(2), {})
  # A `like` of another model is no corruption: nothing is moved aside.
  with pytest.raises(ValueError, match="missing from the checkpoint"):
    ckpt.restore_latest_good(like={"other": jax.ShapeDtypeStruct((2,), jnp.float32)})
  assert ckpt.all_steps() == [1, 2]
  garble(tmp_path / "1")
  garble(tmp_path / "2")
  with pytest.raises(CheckpointError, match=r"no good checkpoint left .*2 \(array params/w"):
    ckpt.restore_latest_good(like=_abstract(_state()), report=lambda line: None)
  assert ckpt.all_steps() == [] and sorted(os.listdir(tmp_path)) == ["1.corrupt", "2.corrupt"]


def test_rotation_keeps_the_newest_known_good_step(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2)
  ckpt.save(1, _state(1), {})
  ckpt.save(2, _state(2), {})
  ckpt.close()
  garble(tmp_path / "2")

  ckpt = Checkpointer(tmp_path, keep=2)  # a resumed run: nothing is known good yet
  step, _, _ = ckpt.restore_latest_good(like=_abstract(_state()), report=lambda line: None)
  assert step == 1
  bad = _state(3)
  bad["params"]["b"] = bad["params"]["b"].at[0].set(jnp.nan)
  for step in (2, 3, 4):  # the run diverged, but someone forced the saves through
    ckpt.save(step, bad, {}, allow_nonfinite=True)
  assert ckpt.all_steps() == [1, 3, 4]  # the newest 2 plus the verified step 1
  ckpt.save(5, _state(5), {})  # finite: the new known-good step
  assert ckpt.all_steps() == [4, 5]
  ckpt.close()


def test_async_saves_rotate_once_on_disk(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, async_save=True)
  for step in (1, 2, 3, 4):
    ckpt.save(step, _state(step), {"step": step})
  ckpt.wait()
  assert ckpt.all_steps() == [3, 4]
  assert ckpt.restore(3, like=_abstract(_state()))[1] == {"step": 3}
  ckpt.close()


def test_save_refuses_nonfinite_values(tmp_path):
  ckpt = Checkpointer(tmp_path)
  for bad_value in (jnp.nan, jnp.inf, -jnp.inf):
    state = _state()
    state["params"]["w"] = state["params"]["w"].at[3, 4].set(bad_value)
    state["params"]["b"] = state["params"]["b"].at[0].set(bad_value)
    with pytest.raises(NonFiniteError, match=r"step 7 .*: params/b holds 1 non-finite value"):
      ckpt.save(7, state, {})
  half = {"h": jnp.asarray([1.0, jnp.nan], jnp.bfloat16), "i": jnp.asarray([1, 2])}
  with pytest.raises(NonFiniteError, match="h holds 1 non-finite"):
    ckpt.save(7, half, {})
  assert ckpt.all_steps() == [] and not tmp_path.joinpath("7").exists()

  ckpt.save(7, half, {}, allow_nonfinite=True)
  restored, _ = ckpt.restore(like=_abstract(half))
  assert _same(restored, half)


def test_checksums_are_of_stored_bytes_and_metadata_stays_clean(tmp_path):
  state = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4),
           "rng": jax.random.key(3)}
  meta = {"config": {"lr": 0.1}, "tuple": (1, 2)}
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, state, meta)
  record = json.loads(next((tmp_path / "1" / "integrity").iterdir()).read_text())
  assert sorted(record["leaves"]) == ["rng", "w"]
  assert record["leaves"]["w"]["dtype"] == "float32" and record["leaves"]["w"]["shape"] == [3, 4]
  like = {"w": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16), "rng": jax.random.key(0)}
  restored, restored_meta = ckpt.restore(like=like)  # verified in float32, then cast
  assert restored["w"].dtype == jnp.bfloat16
  assert np.array_equal(restored["w"], state["w"].astype(jnp.bfloat16))
  assert np.array_equal(jax.random.key_data(restored["rng"]), jax.random.key_data(state["rng"]))
  assert restored_meta == {"config": {"lr": 0.1}, "tuple": [1, 2]}


def test_old_checkpoint_without_checksums_restores_with_warning(tmp_path):
  state = _state(4)
  handlers = {"state": ocp.StandardCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler()}
  with ocp.CheckpointManager(tmp_path, item_handlers=handlers) as manager:  # the old layout
    manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            metadata=ocp.args.JsonSave({"old": True})))
  ckpt = Checkpointer(tmp_path)
  with pytest.warns(UnverifiedCheckpointWarning, match=r"5 has no checksums"):
    restored, meta = ckpt.restore(like=_abstract(state))
  assert _same(restored, state) and meta == {"old": True}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
    assert ckpt.restore_latest_good(like=_abstract(state), report=print)[0] == 5
  ckpt.save(6, state, {})
  with warnings.catch_warnings():
    warnings.simplefilter("error", UnverifiedCheckpointWarning)
    assert _same(ckpt.restore(like=_abstract(state))[0], state)


def test_log_filters_drop_only_orbax_noise():
  console.install_filters()
  orbax_file = os.path.join(os.path.dirname(ocp.__file__), "checkpoint_manager.py")

  def passes(logger, level, pathname=__file__, msg="x"):
    record = logging.LogRecord(logger, level, pathname, 1, msg, None, None)
    return logging.getLogger(logger).filter(record)

  assert not passes("absl", logging.INFO, orbax_file)
  assert passes("absl", logging.WARNING, orbax_file)
  assert passes("absl", logging.INFO)  # the user's own absl logs
  with console.quiet():
    assert not passes("absl", logging.ERROR, orbax_file)
    assert passes("absl", logging.ERROR)
  assert not passes("asyncio", logging.ERROR,
                    msg=f"Task was destroyed but it is pending!\ntask: <Task coro=<f() running at "
                        f"{orbax_file}:3>>")
  assert passes("asyncio", logging.ERROR, msg="Task was destroyed but it is pending! (user's)")

  # Unraisable exceptions: orbax's garbage-collected read coroutines and tensorstore's callbacks
  # into orbax's closed event loop are dropped; the user's own pass through.
  seen = []
  hook = sys.unraisablehook
  assert getattr(hook, "tlt_checkpoint", False)
  coro = SimpleNamespace(cr_code=SimpleNamespace(co_filename=orbax_file))
  closed = RuntimeError("Event loop is closed")
  try:
    sys.unraisablehook = lambda u: seen.append(u)
    console.install_filters()  # wraps the replaced hook again
    with pytest.raises(CheckpointCorruptError):  # an orbax failure arms the event-loop rule
      with console.quiet():
        raise CheckpointCorruptError("x")
    sys.unraisablehook(SimpleNamespace(object=coro, exc_value=Exception("read failed")))
    sys.unraisablehook(SimpleNamespace(object=None, exc_value=closed))
    assert not seen
    mine = SimpleNamespace(object=None, exc_value=RuntimeError("user's"))
    sys.unraisablehook(mine)
    assert seen == [mine]
  finally:
    sys.unraisablehook = hook



def test_the_unreadable_array_is_named_from_anywhere_in_the_error_chain():
  names = ["params/b", "params/w", "step"]
  inner = ValueError('tensorstore: reading "params.w/0.0" failed: checksum mismatch')
  try:
    try:
      raise inner
    except ValueError:
      raise RuntimeError("orbax: restore failed")  # pylint: disable=raise-missing-from
  except RuntimeError as e:
    assert console.key_in_error(e, names) == "params/w"  # raised while handling the read
  try:
    raise RuntimeError("orbax: restore failed") from inner
  except RuntimeError as e:
    assert console.key_in_error(e, names) == "params/w"  # raised from it
  assert console.key_in_error(RuntimeError('"params.wx/0" is missing'), names) is None


_CHILD = """
import gc, sys, time
import jax, jax.numpy as jnp
from absl import app
from tlt_jax.checkpoint import CheckpointError, Checkpointer

def main(argv):  # absl's default console logging, as under `python -m tlt_jax.train`
  like = {f"layer{i}": {"w": jax.ShapeDtypeStruct((128, 128), jnp.float32),
                        "b": jax.ShapeDtypeStruct((128,), jnp.float32)} for i in range(40)}
  ckpt = Checkpointer(argv[1])
  for _ in range(3):
    try:
      ckpt.restore(like=like)
    except CheckpointError as e:
      print(f"ERROR: {e}", file=sys.stderr)
  gc.collect()
  time.sleep(0.3)
  gc.collect()
  print("DONE", file=sys.stderr)

app.run(main)
"""


def test_truncated_checkpoint_one_line_error_and_quiet_stderr(tmp_path):
  rng = np.random.default_rng(0)
  state = {f"layer{i}": {"w": jnp.asarray(rng.random((128, 128), dtype=np.float32)),
                         "b": jnp.asarray(rng.random(128, dtype=np.float32))} for i in range(40)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
  path = largest_file(tmp_path / "1")
  os.truncate(path, os.path.getsize(path) // 2)

  env = subprocess_env()
  proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                        text=True, env=env, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  errors = [line for line in lines if line.startswith("ERROR: ")]
  assert len(errors) == 3 and lines[-1] == "DONE"
  assert str(tmp_path / "1") in errors[0] and "is unreadable" in errors[0]
  assert "No other checkpoint" in errors[0]
  others = [line for line in lines if not line.startswith("ERROR: ") and line != "DONE"]
  assert len(others) < 5, "\n".join(others[:40])


def test_late_errors_of_reads_abandoned_in_a_failed_step_are_dropped(tmp_path):
  """After a failed read, orbax's abandoned tensorstore reads fail on their own and asyncio logs
  "Future exception was never retrieved" naming the step directory (no orbax frame in the
  traceback): those records are dropped; the same report about any other path passes."""
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, _state(1), {})
    path = largest_file(tmp_path / "ckpt" / "1")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointCorruptError):
      ckpt.restore(1, like=_state(1))

  def passes(where):
    msg = (f"Future exception was never retrieved\nfuture: <Future finished exception=ValueError("
           f"'OUT_OF_RANGE: Error reading \"w\" in OCDBT database at local file \"{where}/state/\"')>")
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)
    return logging.getLogger("asyncio").filter(record)

  assert not passes(tmp_path / "ckpt" / "1")
  assert passes(tmp_path / "elsewhere" / "1")
