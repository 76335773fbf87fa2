"""A learned drafter architecture added from outside the package, in this one file: a ``Drafter``
subclass that says on the class what the code asks of it (its name, how it is built fresh, its
objective, what its files hold) and ``register_learned``. The job takes it as ``config.drafter``,
trains it online and exports it; the drafter files save and load it with its own field.

The architecture is EAGLE-1's with a ``scale`` on the features it reads: a constructor field of
its own, which the files must carry (``saved_fields``) for the drafter to load as it was saved.
"""

import pathlib

import jax
import numpy as np
import pytest

from tlt_jax import train
from tlt_jax.drafter.objective import OBJECTIVES, batch_loss
from tlt_jax.job.rollout_config import drafter_choices, parse_drafter
from tlt_jax.job.typed_config import ConfigError
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import load_drafter, save_drafter
from tlt_jax.models.learned_kinds import learned_kind, learned_names, register_learned, \
    unregister_learned
from tlt_jax.models.model_config import ModelConfig
from tests.test_train_job import tiny_config


class ScaledEagle(Drafter):
  """EAGLE-1 reading ``scale`` times the target's features."""

  kind = "scaled_eagle"
  saved_fields = ("scale",)

  def __init__(self, target_config, *, rngs, draft_vocab_size=None, scale: float = 1.0):
    super().__init__(target_config, rngs=rngs, draft_vocab_size=draft_vocab_size)
    self.scale = float(scale)

  @classmethod
  def fresh(cls, target_config, seed=0, policy=None):
    import flax.nnx as nnx  # pylint: disable=import-outside-toplevel
    return cls(target_config, rngs=nnx.Rngs(seed), scale=0.5)

  def forward(self, target, tokens, features, *args, **kwargs):
    return super().forward(target, tokens, features * self.scale, *args, **kwargs)


@pytest.fixture(autouse=True, scope="module")
def registered():
  """The architecture, registered for this file's tests only."""
  register_learned(ScaledEagle)
  yield
  unregister_learned("scaled_eagle")
  assert "scaled_eagle" not in learned_names()


CONFIG = ModelConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=4, num_kv_heads=2)


def test_registering_is_idempotent_and_a_taken_name_is_refused():
  assert register_learned(ScaledEagle) is ScaledEagle
  assert learned_kind("scaled_eagle") is ScaledEagle

  class Impostor(Drafter):
    kind = "eagle3"

  with pytest.raises(ValueError, match="'eagle3' is already Eagle3Drafter"):
    register_learned(Impostor)
  with pytest.raises(ValueError, match="built-in"):
    unregister_learned("eagle")
  with pytest.raises(TypeError, match="Drafter subclass"):
    register_learned(dict)


def test_the_config_takes_it_alone_or_with_the_suffix_drafter():
  assert "'scaled_eagle'" in drafter_choices()
  for value in ("scaled_eagle", "scaled_eagle+suffix"):
    spec = parse_drafter(value)
    assert spec.fresh == "scaled_eagle" and spec.learns and not spec.head_from_policy
    drafter = spec.build(CONFIG, seed=1)
    assert isinstance(drafter, ScaledEagle) and drafter.scale == 0.5  # its own fresh
  with pytest.raises(ConfigError, match="'scaled_eagle'"):  # the choices list it
    parse_drafter("scaled_eagel")


def test_its_files_carry_its_own_field_and_load_as_its_class(tmp_path):
  drafter = ScaledEagle.fresh(CONFIG, seed=2)
  save_drafter(drafter, tmp_path / "d")
  loaded = load_drafter(tmp_path / "d", CONFIG)
  assert type(loaded) is ScaledEagle and loaded.scale == 0.5
  saved = jax.tree.leaves(jax.tree.map(np.asarray, drafter))
  again = jax.tree.leaves(jax.tree.map(np.asarray, loaded))
  assert all(np.array_equal(a, b) for a, b in zip(saved, again))


def test_an_unknown_objective_is_named():
  class Odd(ScaledEagle):
    objective = "odd"

  assert "odd" not in OBJECTIVES
  with pytest.raises(ValueError, match="Odd.objective='odd'"):
    batch_loss(Odd.fresh(CONFIG), None, None)


def test_the_job_trains_it_online_and_exports_it(tmp_path):
  """``config.drafter="scaled_eagle"`` through the job: built fresh, trained online in the two RL
  steps, and exported as ``final_drafter``, which loads as the architecture with its field."""
  logdir = tmp_path / "run"
  summary = train.run(tiny_config(logdir, drafter="scaled_eagle"))
  history = summary["history"]
  assert summary["finished"] and [m["step"] for m in history] == [1, 2]
  assert sum(m["drafter_serial_steps"] + m["drafter_spot_steps"] for m in history) > 0  # trained
  assert all(np.isfinite(m["drafter_loss" if "drafter_loss" in m else "drafter_train_loss"])
             for m in history)
  final = load_drafter(pathlib.Path(logdir) / "final_drafter", None)
  assert type(final) is ScaledEagle and final.scale == 0.5
  assert not (pathlib.Path(logdir) / "final_drafter_speculators").exists()  # no such export
