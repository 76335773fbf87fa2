"""FSDP policy updates (``make_mesh(devices, fsdp)``): params, KL reference and optimizer state
sharded over ``fsdp`` (a quarter of the bytes per device with fsdp=4 on 4 devices), rows over
every device, the same losses and params as the data-parallel update, nothing compiled after
``precompile``, ``rollout_params`` a full copy on every device, checkpoints restored in the
sharded layout, and clear errors for fsdp sizes that do not fit. The 4-device checks run once in
a fresh process (``fsdp_check.py``); each test here reads its part of what that measured."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from tests.xla_env import subprocess_env
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rl.mesh import fsdp_size, fsdp_spec, make_mesh, rows_spec
from tlt_jax.rl.update import PolicyUpdate

ROOT = pathlib.Path(__file__).resolve().parents[2]
FSDP_RUNS = ("fsdp1", "fsdp4", "data2_fsdp2_packed", "fsdp4_packed")
REFERENCE = {"fsdp1": "dp", "fsdp4": "dp", "data2_fsdp2_packed": "dp_packed",
             "fsdp4_packed": "dp_packed"}
SHARDS = {"fsdp1": 1, "fsdp4": 4, "data2_fsdp2_packed": 2, "fsdp4_packed": 4}


@pytest.fixture(scope="module")
def measured() -> dict:
  """What ``fsdp_check.py`` measured on 4 simulated devices (one subprocess for the module)."""
  env = subprocess_env()
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "rl" / "fsdp_check.py")],
                        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("FSDP_RESULTS ")]
  assert len(line) == 1, proc.stdout[-3000:]
  return dict(json.loads(line[0].removeprefix("FSDP_RESULTS ")), stderr=proc.stderr)


# ---------------------------------------------------------------------------- the rule, the mesh


@pytest.mark.parametrize("shape, size, spec", [
    ((64, 32), 4, P("fsdp")),  # the largest dimension
    ((32, 64), 4, P(None, "fsdp")),
    ((32, 32), 4, P("fsdp")),  # equal ones: the first
    ((6, 8), 4, P(None, "fsdp")),  # the largest divisible one
    ((30, 6), 4, P()),  # none divisible: replicated
    ((), 4, P()),  # a scalar (Adam's count)
    ((2,), 4, P()),  # smaller than the fsdp size
    ((64, 32), 1, P()),  # no FSDP
])
def test_fsdp_rule_shards_the_largest_divisible_dimension(shape, size, spec):
  assert fsdp_spec(shape, size) == spec


def test_make_mesh_is_data_by_fsdp():
  devices = jax.devices()[:1]
  mesh = make_mesh(devices, 1)
  assert mesh.axis_names == ("data", "fsdp") and dict(mesh.shape) == {"data": 1, "fsdp": 1}
  assert fsdp_size(mesh) == 1 and rows_spec(mesh) == P(("data", "fsdp"))
  one_d = Mesh(np.array(devices), ("data",))
  assert fsdp_size(one_d) == 1 and rows_spec(one_d) == P("data")


@pytest.mark.parametrize("fsdp", [0, -1, 2, True, 1.5, "1", None])
def test_bad_fsdp_on_one_device_says_what_works(fsdp):
  with pytest.raises(ValueError, match=r"fsdp=.* must be a positive int dividing the 1 devices.*"
                                       r"use one of \[1\]"):
    make_mesh(jax.devices()[:1], fsdp)


def test_no_devices_is_an_error():
  with pytest.raises(ValueError, match="at least one device"):
    make_mesh([], 1)


@pytest.mark.slow
def test_bad_fsdp_on_four_devices_lists_the_divisors(measured):
  for fsdp in ("3", "0", "8"):
    message = measured["errors"][fsdp]
    assert message is not None, f"make_mesh(4 devices, fsdp={fsdp}) was accepted"
    assert f"fsdp={fsdp} " in message and "use one of [1, 2, 4]" in message, message


def test_without_fsdp_rollout_params_are_the_params_themselves():
  graphdef, params = nnx.split(init_model(ModelConfig.tiny(), seed=0))
  for mesh in (make_mesh(jax.devices()[:1], 1), Mesh(np.array(jax.devices()[:1]), ("data",))):
    policy = PolicyUpdate(graphdef, jax.tree.map(np.asarray, params),
                          TrainerConfig(prompts_per_step=4, minibatches=2),
                          grpo.GRPOConfig(group_size=2), mesh, seq_len=40)
    assert not policy.layout.sharded and policy.rollout_params() is policy.params
    assert ("gather",) not in policy.executable_keys()


# ---------------------------------------------------------------------------- on 4 devices


@pytest.mark.parametrize("run", FSDP_RUNS)
def test_each_device_holds_its_share_of_params_and_optimizer_state(measured, run):
  """fsdp=4: about a quarter of the replicated run's bytes per device (Adam's step count stays
  replicated), params and optimizer state each; fsdp=2: a half; fsdp=1: all. Still so after
  the updates (they return the state sharded)."""
  got, full, shards = measured[run], measured[REFERENCE[run]], SHARDS[run]
  for part in ("param_bytes", "opt_bytes", "bytes", "bytes_after"):
    assert len(set(got[part])) == 1, (run, part, got[part])  # every device alike
    ratio = got[part][0] / full[part][0]
    assert ratio == pytest.approx(1 / shards, abs=1e-3), (run, part, got[part], full[part])


@pytest.mark.parametrize("run", FSDP_RUNS)
def test_fsdp_update_gives_the_data_parallel_losses_and_params(measured, run):
  got, want = measured[run], measured[REFERENCE[run]]
  np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
  np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-5)
  assert got["params_diff"] < 1e-5 and got["opt_diff"] < 1e-6, got
  assert want["losses"][-1] < want["losses"][0]  # the updates did something


@pytest.mark.parametrize("run", ("dp",) + FSDP_RUNS)
def test_every_device_gets_rows_of_its_own(measured, run):
  assert measured[run]["row_blocks"] == 4, measured[run]


@pytest.mark.parametrize("run", ("dp", "dp_packed") + FSDP_RUNS)
def test_nothing_compiles_after_precompile(measured, run):
  """Three RL steps, each handing the rollout its weights: the gather is precompiled too."""
  got = measured[run]
  assert got["compiles_after_precompile"] == 0, got
  extra = 1 if SHARDS.get(run, 1) > 1 else 0  # the rollout's gather
  reference = measured["dp_packed" if "packed" in run else "dp"]
  assert got["precompiled"] == reference["precompiled"] + extra, (got, reference)


@pytest.mark.parametrize("run", FSDP_RUNS)
def test_rollout_params_are_a_full_copy_on_every_device(measured, run):
  rollout = measured[run]["rollout"]
  assert rollout["full_copy_everywhere"] and rollout["equal"], rollout
  assert rollout["is_params"] == (SHARDS[run] == 1), rollout
  assert rollout["bytes"] == measured["dp"]["param_bytes"]


def test_data_parallel_rollout_params_are_the_params(measured):
  assert measured["dp"]["rollout"]["is_params"] and measured["dp"]["rollout"]["equal"]


def test_checkpoint_round_trip_under_fsdp(measured):
  """Saved from an fsdp=4 update, restored into one of other params: the arrays come back in the
  FSDP shardings, equal, and the next RL step gives the same loss and params, compiling
  nothing."""
  got = measured["checkpoint"]
  assert got["params_differed_before"] > 1e-3, got  # the restore had something to do
  assert got["restored_in_layout"] and got["loaded_in_layout"], got
  assert got["restored_diff"] == 0.0 and got["params_diff_after_step"] == 0.0, got
  assert got["loss"][0] == got["loss"][1] and got["compiles"] == 0, got


def test_xla_never_falls_back_to_replicating_activations(measured):
  """The gradient is summed before it is sharded (``UpdateLayout.gather``): constrained straight
  to a param's sharding (the embedding's is on the hidden dimension), XLA's partitioner cannot
  move the rows' activations to it and replicates them instead, saying so on stderr."""
  assert "Involuntary full rematerialization" not in measured["stderr"], measured["stderr"][-2000:]
