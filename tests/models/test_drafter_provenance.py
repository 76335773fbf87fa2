"""Which policy a drafter was trained for: the fingerprint saved with it and the mismatch check."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from tests.models.random_model import random_model
from tests.models.test_drafter_io import random_drafter
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter_io import (CONFIG_FILE, POLICY_KEY, drafter_policy,
                                       drafter_policy_mismatch, load_drafter, policy_fingerprint,
                                       save_drafter)
from tlt_jax.drafter.online import OnlineDrafter

CONFIG = ModelConfig.tiny(vocab_size=32, num_layers=2)


@pytest.fixture(scope="module")
def policies():
  """Two policies of the same shape (different weights) and the first one's bf16 cast."""
  return (random_model(CONFIG, seed=1), random_model(CONFIG, seed=2),
          random_model(CONFIG.replace(dtype="bfloat16"), seed=1))


def test_same_policy_no_warning_other_policy_warns(tmp_path, policies):
  policy, other, _ = policies
  save_drafter(random_drafter(CONFIG), tmp_path, policy=policy, policy_name="runs/a/final_model")
  assert drafter_policy(tmp_path) == {"fingerprint": policy_fingerprint(policy),
                                      "name": "runs/a/final_model"}
  assert drafter_policy_mismatch(tmp_path, policy) is None
  warning = drafter_policy_mismatch(tmp_path, other)
  assert warning is not None and "\n" not in warning
  assert policy_fingerprint(policy)[:19] in warning and policy_fingerprint(other)[:19] in warning
  assert "(runs/a/final_model)" in warning and "--config" not in warning  # the job's words
  assert "expect far fewer accepted drafts; retrain it for this policy or fine-tune it " \
         "online" in warning
  load_drafter(tmp_path, CONFIG)  # the record does not stop it from loading


def test_fingerprint_is_stable_across_forms_and_dtypes(policies):
  policy, other, policy_bf16 = policies
  fingerprint = policy_fingerprint(policy)
  assert fingerprint.startswith("sha256:") and len(fingerprint) == 7 + 64
  assert policy_fingerprint(nnx.split(policy)[1]) == fingerprint  # the trainer's params
  assert policy_fingerprint(jax.device_put(nnx.split(policy)[1])) == fingerprint
  assert policy_fingerprint(nnx.to_pure_dict(nnx.state(policy))) == fingerprint
  assert policy_fingerprint(policy_bf16) == fingerprint  # the same weights loaded as bf16
  assert policy_fingerprint(other) != fingerprint


def test_fingerprint_sees_a_change_to_one_norm(policies):
  policy = policies[0]
  _, state = nnx.split(policy)
  pure = nnx.to_pure_dict(state)
  pure["layers"][1]["post_attention_layernorm"]["weight"] = (
      pure["layers"][1]["post_attention_layernorm"]["weight"] * 1.01)
  assert policy_fingerprint(pure) != policy_fingerprint(policy)


def test_drafter_saved_without_a_fingerprint_loads_without_warning(tmp_path, policies):
  policy, other, _ = policies
  save_drafter(random_drafter(CONFIG), tmp_path / "plain")
  assert drafter_policy(tmp_path / "plain") is None
  assert drafter_policy_mismatch(tmp_path / "plain", other) is None
  # a drafter written before fingerprints existed: the same files without the key
  save_drafter(random_drafter(CONFIG), tmp_path / "old", policy=policy)
  config = json.loads((tmp_path / "old" / CONFIG_FILE).read_text())
  del config[POLICY_KEY]
  (tmp_path / "old" / CONFIG_FILE).write_text(json.dumps(config))
  assert drafter_policy_mismatch(tmp_path / "old", other) is None
  load_drafter(tmp_path / "old", CONFIG)


def test_online_drafter_export_records_the_policy(tmp_path, policies):
  policy, other, _ = policies
  drafter = random_drafter(CONFIG)
  online = OnlineDrafter(drafter, nnx.split(policy)[0])
  online.export(tmp_path / "final_drafter", policy=nnx.split(policy)[1],
                policy_name="final_model")
  assert drafter_policy(tmp_path / "final_drafter")["name"] == "final_model"
  assert drafter_policy_mismatch(tmp_path / "final_drafter", policy) is None
  assert drafter_policy_mismatch(tmp_path / "final_drafter", other) is not None
  loaded = load_drafter(tmp_path / "final_drafter", CONFIG)
  np.testing.assert_array_equal(np.asarray(loaded.fc.kernel.get_value()),
                                np.asarray(drafter.fc.kernel.get_value()))
  online.export(tmp_path / "unrecorded")  # without a policy: as before, no record
  assert drafter_policy(tmp_path / "unrecorded") is None
