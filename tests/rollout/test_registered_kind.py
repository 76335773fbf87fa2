"""A model-free drafter kind added from outside the package, in this one file: a config, a
``propose`` and ``kinds.register``. The engine decodes with it (greedy SD equal to vanilla, its
drafts used and counted under its own name) and the job takes it as ``config.drafter``.

The kind repeats each row's last ``depth`` generated tokens as the next ones: right often enough
on the tiny policies' repetitive traces, and never a change to what is sampled (the point-mass
verification keeps SD lossless whatever is proposed).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import train
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.decode.kinds import ModelFreeKind, model_free_kind, model_free_names, \
    register, unregister
from tests.test_train_job import tiny_config


@dataclasses.dataclass(frozen=True)
class RepeatConfig:
  depth: int = 3  # tokens proposed a step (the default chain: depth 3, 4 verified)


class RepeatKind(ModelFreeKind):
  """Proposes a row's last ``depth`` generated tokens again (fewer where it has fewer)."""

  def propose(self, config, state, depth):
    n = state.num_generated[:, None]
    at = n - depth + jnp.arange(depth)[None, :]  # the last depth positions, oldest first
    tokens = jnp.take_along_axis(state.tokens, jnp.clip(at, 0, state.tokens.shape[1] - 1), 1)
    count = jnp.minimum(n[:, 0], depth)
    return jnp.where(at >= 0, tokens, 0), jnp.where(state.done, 0, count)


REPEAT = RepeatKind("repeat", RepeatConfig)


@pytest.fixture(autouse=True, scope="module")
def registered():
  """The kind, registered for this file's tests only (the others see the built-in kinds: their
  messages list the choices)."""
  register(REPEAT)
  yield
  unregister("repeat")
  assert "repeat" not in model_free_names()


def test_registering_is_idempotent_and_a_taken_name_is_refused():
  assert register(RepeatKind("repeat", RepeatConfig)) == REPEAT
  assert model_free_kind(RepeatConfig()) == REPEAT
  with pytest.raises(ValueError, match="'ngram' is already registered"):
    register(RepeatKind("ngram", RepeatConfig))
  with pytest.raises(ValueError, match="built-in"):
    unregister("ngram")


def test_the_engine_decodes_with_the_kind_greedy_sd_equal_to_vanilla():
  config = ModelConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2)
  model = init_model(config, seed=3)
  prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [2, 2, 2, 2, 2]]
  engine_config = EngineConfig(max_batch=4, max_prompt_len=8, max_new_tokens=24)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
  vanilla = RolloutEngine(model, config=engine_config).generate(prompts, greedy)
  sd = RolloutEngine(model, RepeatConfig(), config=engine_config)
  assert sd.config.spec is not None and sd.config.spec.depth == 3  # its default chain
  out = sd.generate(prompts, greedy)
  assert out.tokens == vanilla.tokens
  assert out.stats.source_steps.get("repeat", 0) > 0  # its drafts were verified ...
  assert out.stats.source_tokens["repeat"] > out.stats.source_steps["repeat"]  # ... and accepted
  assert set(out.stats.source_steps) == {"repeat"}


def test_the_job_takes_the_kind_as_its_drafter(tmp_path):
  """``config.drafter="repeat"`` through the job: two RL steps, every segment drafted by the kind
  (its default chain), its drafts verified and accepted."""
  summary = train.run(tiny_config(tmp_path / "run", drafter="repeat"))
  history = summary["history"]
  assert summary["finished"] and [m["step"] for m in history] == [1, 2]
  assert all(m["accept_share/repeat"] == 1.0 and m["accept_len/repeat"] > 1.0 for m in history)
  assert all(np.isfinite(m["loss"]) for m in history)
