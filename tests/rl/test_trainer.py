"""The GRPO trainer: batch layout, a short run, data-parallel equality, config validation."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import GRPOTrainer, TrainerConfig
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.utils import compile_count

ROOT = pathlib.Path(__file__).resolve().parents[2]


def make_trainer(mesh=None, kl_coef=0.0, drafter=None, **trainer_kw):
  task = ArithmeticTask(max_digits=3)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
  kw = dict(steps=2, prompts_per_step=4, max_new_tokens=24, minibatches=2, eval_problems=8)
  kw.update(trainer_kw)
  return GRPOTrainer(init_model(config, seed=0), tokenizer, task,
                     EngineConfig(max_batch=8, max_prompt_len=16, max_new_tokens=24,
                                  prefill_buckets=(16,)),
                     grpo.GRPOConfig(group_size=2, kl_coef=kl_coef), TrainerConfig(**kw),
                     mesh=mesh, drafter=drafter)


def hand_made_batch(trainer, rows: int):
  """``rows`` prompt/completion pairs with mixed advantages and plausible old log-probs."""
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, 14, int(rng.integers(2, 10))).tolist() for _ in range(rows)]
  comps = [rng.integers(3, 14, int(rng.integers(1, 20))).tolist() for _ in range(rows)]
  old = [rng.uniform(-3.0, -2.0, len(c)) for c in comps]
  advantages = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)
  return trainer.make_batch(prompts, comps, old, advantages)


def test_batch_aligns_old_logprobs_with_predicted_tokens():
  trainer = make_trainer()
  batch = trainer.make_batch([[1, 5, 6], [1, 7]], [[8, 9, 2], [4]],
                             [np.array([-0.1, -0.2, -0.3]), np.array([-0.4])], [0.5, -0.5])
  assert batch["ids"].shape == (2, 16 + 24) and batch["mask"].shape == (2, 16 + 24 - 1)
  np.testing.assert_array_equal(batch["ids"][0, :6], [1, 5, 6, 8, 9, 2])
  # the logit at position t predicts token t+1: completion tokens start at prompt_len - 1
  np.testing.assert_array_equal(np.flatnonzero(batch["mask"][0]), [2, 3, 4])
  np.testing.assert_allclose(batch["old_logprobs"][0, 2:5], [-0.1, -0.2, -0.3])
  np.testing.assert_array_equal(np.flatnonzero(batch["mask"][1]), [1])


def test_short_run_is_finite_and_does_not_recompile():
  trainer = make_trainer()
  before = jax.tree.map(np.asarray, trainer.params)
  first = trainer.step()
  assert np.isfinite(first["loss"]) and 0.0 <= first["reward"] <= 1.0
  compiles = compile_count()
  second = trainer.step()
  assert compile_count() == compiles, "the second RL step must not compile anything"
  assert second["step"] == 2 and second["compiles"] == 0
  after = jax.tree.map(np.asarray, trainer.params)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after))
  assert len(jax.tree.leaves(before)) == len(jax.tree.leaves(after))
  assert 0.0 <= trainer.evaluate(4) <= 1.0


def test_update_with_nonzero_advantages_moves_params():
  trainer = make_trainer()
  before = jax.tree.map(np.asarray, trainer.params)
  trainer.params, trainer.opt_state, metrics = trainer.update_fn(
      trainer.params, trainer.opt_state, hand_made_batch(trainer, 4))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in
           zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params))]
  assert sum(moved) > len(moved) // 2


def test_one_device_and_eight_devices_give_the_same_update():
  script = ROOT / "tests" / "rl" / "dp_equality.py"
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=600, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "max abs difference" in proc.stdout, proc.stdout


@pytest.mark.parametrize("kw, match", [
    (dict(steps=0), "TrainerConfig.steps"), (dict(temperature=0.0), "TrainerConfig.temperature"),
    (dict(learning_rate=-1.0), "TrainerConfig.learning_rate")])
def test_bad_trainer_values_are_rejected(kw, match):
  with pytest.raises(ValueError, match=match):
    TrainerConfig(**kw)


def test_rows_must_split_over_minibatches():
  with pytest.raises(ValueError, match="minibatches"):
    make_trainer(prompts_per_step=3, minibatches=4)  # 6 rows do not split into 4


def test_kl_to_the_reference_policy_is_reported_and_grows_as_params_move():
  trainer = make_trainer(kl_coef=0.1)
  batch = hand_made_batch(trainer, 4)
  kls = []
  for _ in range(3):
    trainer.params, trainer.opt_state, metrics = trainer.update_fn(
        trainer.params, trainer.opt_state, batch, trainer.ref_params)
    kls.append(float(metrics["kl_to_ref"]))
  assert kls[0] == pytest.approx(0.0, abs=1e-6)  # the first update starts at the reference
  assert kls[-1] > kls[0]


def test_trainer_runs_with_speculative_rollouts():
  """The n-gram drafter plugs into the RL step (its losslessness is tested in
  tests/rollout/test_speculative.py: sampled SD matches the target's distribution, not its
  individual samples, so the two runs are not compared sample by sample)."""
  from tlt_jax.rollout.ngram import NgramConfig  # pylint: disable=import-outside-toplevel
  trainer = make_trainer(drafter=NgramConfig(depth=4))
  assert trainer.engine.spec is not None
  first = trainer.step()
  second = trainer.step()
  assert second["compiles"] == 0
  assert all(0.0 <= m["reward"] <= 1.0 and np.isfinite(m["loss"]) for m in (first, second))
