"""The GRPO trainer: batch layout, a short run, data-parallel equality, config validation, the
history store a suffix drafter drafts from."""

import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from tests.xla_env import subprocess_env
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.data import EVAL_SEED, eval_problems, metric_kind, step_problems
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rl.trainer_config import TrainerConfig, check_update_layout
from tlt_jax.rl.update import NonFiniteUpdateError, learning_rate_schedule
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.decode.suffix_history import HistoryConfig
from tlt_jax.utils import compile_count

ROOT = pathlib.Path(__file__).resolve().parents[2]


def make_trainer(mesh=None, kl_coef=0.0, drafter=None, history=None, suffix=None,
                 compute_dtype=None, **trainer_kw):
  task = ArithmeticTask(max_digits=3)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id, compute_dtype=compute_dtype)
  kw = dict(steps=2, prompts_per_step=4, max_new_tokens=24, minibatches=2, eval_problems=8)
  kw.update(trainer_kw)
  return GRPOTrainer(init_model(config, seed=0), tokenizer, task,
                     EngineConfig(max_batch=8, max_prompt_len=16, max_new_tokens=24,
                                  prefill_buckets=(16,)),
                     grpo.GRPOConfig(group_size=2, kl_coef=kl_coef), TrainerConfig(**kw),
                     mesh=mesh, drafter=drafter, history=history, suffix=suffix)


def hand_made_batch(trainer, rows: int):
  """``rows`` prompt/completion pairs with mixed advantages and plausible old log-probs."""
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, 14, int(rng.integers(2, 10))).tolist() for _ in range(rows)]
  comps = [rng.integers(3, 14, int(rng.integers(1, 20))).tolist() for _ in range(rows)]
  old = [rng.uniform(-3.0, -2.0, len(c)) for c in comps]
  advantages = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)
  return trainer.make_batch(prompts, comps, old, advantages)


class _Rewarded:
  """The task's problems with another reward of the completion text: the arithmetic reward
  gives a random policy 0 everywhere, so all advantages (and gradients) would be zero."""

  def __init__(self, task, reward_of_text):
    self.task, self.reward_of_text = task, reward_of_text

  def sample(self, rng, n):
    return self.task.sample(rng, n)

  def reward(self, problem, text):  # pylint: disable=unused-argument
    return self.reward_of_text(text)


def varied_rewards(trainer):
  """Rewards that differ within a group (the parity of the completion's length)."""
  trainer.task = _Rewarded(trainer.task, lambda text: float(len(text) % 2))


def nan_row_batches(trainer):
  """From now on the batch's row 0 has a NaN advantage (``del trainer.make_batch`` undoes it): with
  one epoch, exactly one minibatch per step is non-finite."""
  def make_batch(*args):
    batch = GRPOTrainer.make_batch(trainer, *args)
    batch["advantages"] = batch["advantages"].copy()
    batch["advantages"][0] = np.nan
    return batch
  trainer.make_batch = make_batch


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


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
  trainer.precompile_update()  # as the main job does: every update length, ahead of time
  before = jax.tree.map(np.asarray, trainer.policy.params)
  first = trainer.step()
  assert np.isfinite(first["loss"]) and 0.0 <= first["reward"] <= 1.0
  # vanilla rollouts: no switches, no acceptance length, no per-arm metrics
  assert first["sd_switches"] == 0 and first["sd_switch_s"] == 0.0
  assert "mean_accept_len" not in first and not any(k.startswith("arm_") for k in first)
  compiles = compile_count()
  second = trainer.step()
  assert compile_count() == compiles, "the second RL step must not compile anything"
  assert second["step"] == 2 and second["compiles"] == 0
  after = jax.tree.map(np.asarray, trainer.policy.params)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after))
  assert len(jax.tree.leaves(before)) == len(jax.tree.leaves(after))
  assert 0.0 <= trainer.evaluate(4) <= 1.0


def test_update_with_nonzero_advantages_moves_params():
  trainer = make_trainer()
  before = jax.tree.map(np.asarray, trainer.policy.params)
  trainer.policy.params, trainer.policy.opt_state, metrics = trainer.policy.update_fn(
      trainer.policy.params, trainer.policy.opt_state, hand_made_batch(trainer, 4))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in
           zip(jax.tree.leaves(before), jax.tree.leaves(trainer.policy.params))]
  assert sum(moved) > len(moved) // 2


def run_script(name: str) -> str:
  """Runs ``tests/rl/<name>`` in a fresh process (it sets its own XLA device count); its stdout."""
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "rl" / name)], capture_output=True,
                        text=True, timeout=600, cwd=ROOT,
                        env=subprocess_env())
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_one_device_and_eight_devices_give_the_same_update():
  assert "max abs difference" in run_script("dp_equality.py")


@pytest.mark.slow
def test_trainer_on_a_four_device_mesh_steps_without_recompiling():
  """Rollout on one device, updates over 4 (simulated) devices: two steps, the second compiling
  nothing, then a NaN update restores the mesh-replicated state (see multi_device_trainer.py)."""
  assert "4-device trainer ok" in run_script("multi_device_trainer.py")


def test_nonfinite_update_stops_the_step_and_restores_the_state():
  trainer = make_trainer()  # 8 rows in 2 minibatches: the finite one is applied, then undone
  varied_rewards(trainer)
  nan_row_batches(trainer)
  params, opt_state = host(trainer.policy.params), host(trainer.policy.opt_state)
  with pytest.raises(NonFiniteUpdateError, match=r"RL step 1: 1 of 2 policy updates"):
    trainer.step()
  assert trainer.step_count == 0
  for a, b in zip(params + opt_state, host(trainer.policy.params) + host(trainer.policy.opt_state)):
    np.testing.assert_array_equal(a, b)
  # the engine holds the restored (live) params, and training goes on from them
  for a, b in zip(params, host(trainer.engine.params)):
    np.testing.assert_array_equal(a, b)
  del trainer.make_batch
  metrics = trainer.step()
  assert metrics["step"] == 1 and metrics["skipped_updates"] == 0 and np.isfinite(metrics["loss"])


def test_a_stop_at_once_inside_the_update_is_not_masked_by_its_donated_params(monkeypatch):
  """A second Ctrl-C can land inside an update, after it donated the params and before the new
  ones exist: the ``KeyboardInterrupt`` goes on as it is (the job prints its advice and exits
  130), not a RuntimeError from handing the engines deleted arrays."""
  trainer = make_trainer()
  varied_rewards(trainer)

  def interrupted_update(batch, step):
    del batch, step
    for leaf in jax.tree.leaves(trainer.policy.params):
      leaf.delete()  # what donating them to the update executable does
    raise KeyboardInterrupt("SIGINT received")

  monkeypatch.setattr(trainer.policy, "run", interrupted_update)
  with pytest.raises(KeyboardInterrupt, match="SIGINT received"):
    trainer.step()


def test_nonfinite_update_is_skipped_and_counted():
  trainer = make_trainer(on_nonfinite="skip")
  varied_rewards(trainer)
  nan_row_batches(trainer)
  before = host(trainer.policy.params)
  metrics = trainer.step()
  assert metrics["skipped_updates"] == 1 and metrics["step"] == 1
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])  # the applied one
  after = host(trainer.policy.params)
  assert all(np.all(np.isfinite(x)) for x in after)
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))
  # one update applied, not two
  assert int(jax.device_get(trainer.policy.opt_state[1][0].count)) == 1


def test_update_with_a_nonfinite_new_param_keeps_the_old_state():
  trainer = make_trainer()
  # a NaN in Adam's first moment: loss and gradient (functions of the params) stay finite, but
  # the updated params do not
  adam = trainer.policy.opt_state[1][0]
  leaves = jax.tree.leaves(adam.mu)
  leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(np.nan)
  mu = jax.tree.unflatten(jax.tree.structure(adam.mu), leaves)
  policy = trainer.policy
  policy.opt_state = (policy.opt_state[0], (adam._replace(mu=mu),) + policy.opt_state[1][1:])
  params, opt_state = host(policy.params), host(policy.opt_state)
  new_params, new_opt_state, metrics = policy.update_fn(policy.params, policy.opt_state,
                                                        hand_made_batch(trainer, 4))
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert not bool(metrics["finite"])
  for a, b in zip(params + opt_state, host(new_params) + host(new_opt_state)):
    np.testing.assert_array_equal(a, b)  # (NaN == NaN here)


@pytest.mark.parametrize("warmup, first", [(0, 1e-3), (2, 1e-3 / 3)])
def test_first_update_runs_at_the_warmup_rate(warmup, first):
  lr = 1e-3
  config = TrainerConfig(learning_rate=lr, warmup_steps=warmup)
  schedule = learning_rate_schedule(config)
  assert float(schedule(0)) == pytest.approx(first)
  assert float(schedule(warmup)) == pytest.approx(lr) and float(schedule(100)) == pytest.approx(lr)
  if warmup:
    assert float(schedule(1)) == pytest.approx(2 * lr / 3)
  # the trainer's optimizer uses it: Adam's first update is lr * g / |g| per element
  trainer = make_trainer(learning_rate=lr, warmup_steps=warmup)
  grads = jax.tree.map(lambda x: np.full(x.shape, 0.5, x.dtype), host(trainer.policy.params))
  grads = jax.tree.unflatten(jax.tree.structure(trainer.policy.params), grads)
  policy = trainer.policy
  updates, _ = policy.optimizer.update(grads, policy.opt_state, policy.params)
  for u in host(updates):
    np.testing.assert_allclose(u, -first, rtol=1e-4)


@pytest.mark.parametrize("kw, match", [
    (dict(steps=0), "TrainerConfig.steps"), (dict(temperature=0.0), "TrainerConfig.temperature"),
    (dict(learning_rate=-1.0), "TrainerConfig.learning_rate"),
    (dict(on_nonfinite="ignore"), "TrainerConfig.on_nonfinite")])
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
    trainer.policy.params, trainer.policy.opt_state, metrics = trainer.policy.update_fn(
        trainer.policy.params, trainer.policy.opt_state, batch, trainer.policy.ref_params)
    kls.append(float(metrics["kl_to_ref"]))
  assert kls[0] == pytest.approx(0.0, abs=1e-6)  # the first update starts at the reference
  assert kls[-1] > kls[0]


@pytest.mark.slow
def test_trainer_runs_with_speculative_rollouts():
  """The n-gram drafter plugs into the RL step (its losslessness is tested in
  tests/rollout/test_speculative.py: sampled SD matches the target's distribution, not its
  individual samples, so the two runs are not compared sample by sample)."""
  from tlt_jax.rollout.decode.ngram import NgramConfig  # pylint: disable=import-outside-toplevel
  trainer = make_trainer(drafter=NgramConfig(depth=4))
  assert trainer.engine.spec is not None
  first = trainer.step()
  second = trainer.step()
  assert second["compiles"] == 0
  assert all(0.0 <= m["reward"] <= 1.0 and np.isfinite(m["loss"]) for m in (first, second))
  # one fixed strategy: its acceptance is reported, but there are no arms to compare
  assert all(1.0 <= m["mean_accept_len"] <= 5.0 for m in (first, second))
  assert not any(k.startswith("arm_") for k in first)


def learning_trainer(**kw):
  """A trainer on a dense reward the random policy can move on: the fraction of '1's written."""
  trainer = make_trainer(**dict(dict(learning_rate=1e-2, warmup_steps=0, steps=8), **kw))
  trainer.task = _Rewarded(trainer.task, lambda text: text.count("1") / max(len(text), 1))
  return trainer


def held_out(trainer) -> np.ndarray:
  """Greedy and sampled (T=1) mean reward on the trainer's fixed held-out problems."""
  return np.array([trainer.evaluate(), trainer.evaluate(temperature=1.0)])


def test_a_correct_answer_ended_by_eos_scores_in_held_out_evaluation(monkeypatch):
  # a finished completion ends with the EOS token: the reward reads the text without it (decoded
  # with it, "#71<eos>" is no number and every correct answer would score 0); the held-out
  # problems answered perfectly score 1 each
  trainer = make_trainer(eval_problems=4)
  eos = trainer.tokenizer.eos_token_id
  problems = eval_problems(trainer.task, 4, EVAL_SEED)
  answer_for = {tuple(trainer.encode_prompt(p)): p.solution for p in problems}
  answers = lambda prompts: [trainer.tokenizer.encode(answer_for[tuple(p)]) + [eos]
                             for p in prompts]

  def generate(prompts, sampling, **_):
    tokens = answers(prompts)
    return types.SimpleNamespace(tokens=tokens, logprobs=[[0.0] * len(t) for t in tokens])

  monkeypatch.setattr(trainer.engine, "generate", generate)
  _, texts, rewards = trainer.held_out()
  assert rewards == [1.0] * 4 and not any("<eos>" in t for t in texts), texts
  assert trainer.completion_texts(answers([trainer.encode_prompt(problems[0])])) == [
      problems[0].solution]


# the fast tier learns in fp32; the bf16-compute variant runs in the full tier
@pytest.mark.parametrize("compute_dtype", [
    None, pytest.param("bfloat16", marks=pytest.mark.slow)], ids=["fp32", "bf16-compute"])
def test_rl_steps_learn_a_dense_reward(compute_dtype):
  """GRPO learns, measured against a no-update control: after 8 steps the held-out greedy and
  sampled rewards (one fixed problem set and sampling seed) are clearly above the initial
  policy's on the same problems, which is exactly where a run without updates stays (checked).
  A rising training reward would prove little: each step draws other problems. The same holds
  with mixed precision (float32 params, bf16 arithmetic in rollout and update)."""
  trainer = learning_trainer(eval_problems=32, compute_dtype=compute_dtype)
  control = held_out(trainer)
  assert np.array_equal(held_out(trainer), control)  # evaluation is a function of the params
  start = host(trainer.policy.params)
  history = [trainer.step() for _ in range(8)]
  assert all(m["grad_norm"] > 0 for m in history)
  assert any(not np.array_equal(a, b) for a, b in zip(start, host(trainer.policy.params)))
  after = held_out(trainer)
  assert np.all(after > control + 0.1), (control, after)
  # the engine samples with the updated weights, not the ones it was built with
  engine = [np.asarray(x) for x in jax.tree.leaves(trainer.engine.params)]
  assert all(np.array_equal(a, b) for a, b in zip(engine, host(trainer.policy.params)))


def test_the_no_update_control_leaves_the_params_bit_identical():
  """``control=True`` runs the job's steps (rollouts, rewards) with every update skipped: params
  and optimizer state stay bit for bit as they were, so its held-out curve is flat at the
  start's. (The learning test above shows the same trainer moves them without it.)"""
  trainer = learning_trainer(eval_problems=8, control=True)
  start = held_out(trainer)
  params, opt_state = host(trainer.policy.params), host(trainer.policy.opt_state)
  history = [trainer.step() for _ in range(3)]
  assert all(m["control"] and "loss" not in m for m in history)
  assert trainer.step_count == 3 and all(m["reward"] > 0 for m in history)
  for a, b in zip(params, host(trainer.policy.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(opt_state, host(trainer.policy.opt_state)):
    np.testing.assert_array_equal(a, b)
  assert np.array_equal(held_out(trainer), start)


def test_control_and_eval_every_are_checked():
  with pytest.raises(ValueError, match="TrainerConfig.control must be True or False"):
    TrainerConfig(control="yes")
  with pytest.raises(ValueError, match="TrainerConfig.eval_every must be an int >= 0"):
    TrainerConfig(eval_every=-1)


def test_save_and_restore_continue_exactly(tmp_path):
  """A run checkpointed after step 1 and continued by a fresh trainer ends bitwise equal to the
  run that saved it going on uninterrupted: params, optimizer state (Adam moments, count), KL
  reference and step all come back (each mutant that drops one of them breaks the equality).
  (One run both saves and goes on, as the main job does: a save that disturbed the live state
  would break the equality too.)"""
  from tlt_jax.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  straight = learning_trainer(kl_coef=0.1)
  straight.step()
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    straight.save(ckpt)
  straight.step()
  resumed = learning_trainer(kl_coef=0.1)
  # must be overwritten by the restore
  resumed.policy.ref_params = jax.tree.map(lambda x: x * 0.5, resumed.policy.ref_params)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    resumed.restore(ckpt)
  assert resumed.step_count == 1
  resumed.step()
  for name in ("params", "opt_state", "ref_params"):
    for a, b in zip(host(getattr(straight.policy, name)), host(getattr(resumed.policy, name))):
      np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("temperature", [0.6, 1.4])
def test_first_update_sees_ratio_one_at_any_sampling_temperature(temperature):
  """The rollout's old log-probs are of softmax(logits / T); the update must score tokens the
  same way, or even the first (on-policy) update has importance ratios != 1 (the rollout's:
  the policy's own old log-probs would agree with any scoring)."""
  trainer = make_trainer(temperature=temperature, minibatches=1, old_logprobs="rollout")
  varied_rewards(trainer)
  m = trainer.step()
  assert abs(m["ratio_mean"] - 1.0) < 1e-4 and abs(m["approx_kl"]) < 1e-6, m
  assert m["clip_fraction"] == 0.0


# ---- the history store (a suffix drafter's) ------------------------------------------------------
def untimed(metrics: dict) -> dict:
  """A step's metrics without what depends on timing or on what other trainers compiled."""
  return {k: v for k, v in metrics.items() if metric_kind(k) != "timed" and k != "compiles"}


def record_generate(trainer) -> list[dict]:
  """From now on, each ``trainer.engine.generate`` call's prompts, ``history`` argument (as lists
  of ints; the string "absent" when not given) and completions."""
  calls, real = [], trainer.engine.generate

  def generate(prompts, params, *args, **kwargs):
    result = real(prompts, params, *args, **kwargs)
    history = kwargs.get("history", "absent")
    if history != "absent":  # the store's arrays, as lists to compare
      history = [[list(map(int, c)) for c in row] for row in history]
    calls.append(dict(prompts=[tuple(p) for p in prompts], history=history,
                      tokens=[list(t) for t in result.tokens]))
    return result

  trainer.engine.generate = generate
  return calls


@pytest.fixture
def engine_uses_history(monkeypatch):
  """Every RolloutEngine says it drafts from ``history`` (it still ignores it): the trainer's side
  of the contract, before a suffix drafter exists to use it."""
  monkeypatch.setattr(RolloutEngine, "uses_history", property(lambda self: True))


def test_a_vanilla_engine_gets_no_history_and_its_steps_are_unchanged():
  """The store is kept only for an engine that drafts from it: with the vanilla engine a history
  config changes nothing (the same metrics, no history_* ones, no history argument)."""
  plain, with_config = make_trainer(num_prompts=4), make_trainer(num_prompts=4,
                                                                  history=HistoryConfig())
  assert not with_config.engine.uses_history and with_config.history is None
  calls = record_generate(with_config)
  for _ in range(2):
    a, b = plain.step(), with_config.step()
    assert untimed(a) == untimed(b)
    assert not any(k.startswith("history") for k in b)
  assert [c["history"] for c in calls] == ["absent", "absent"]


def history_by_prompt(call: dict, g: int = 2) -> dict:
  """A generate call's completions per prompt, as its groups of ``g`` rows."""
  out = {}
  for first in range(0, len(call["prompts"]), g):
    out[call["prompts"][first]] = call["tokens"][first:first + g]
  return out


def test_each_step_drafts_from_the_earlier_completions_of_its_prompts(engine_uses_history):
  """Epoch mode over 4 prompts, 4 per step: from step 2 on every prompt has history, the rows of
  a group get its prompt's earlier completions newest first (at most per_prompt), and a step whose
  update raised adds nothing."""
  trainer = make_trainer(num_prompts=4, history=HistoryConfig(per_prompt=3))
  assert trainer.history is not None
  calls = record_generate(trainer)
  varied_rewards(trainer)
  nan_row_batches(trainer)
  with pytest.raises(NonFiniteUpdateError):
    trainer.step()
  assert trainer.history.num_prompts == 0  # the failed step left the store as it was
  del trainer.make_batch
  calls.clear()
  metrics = [trainer.step() for _ in range(3)]
  assert [m["epoch"] for m in metrics] == [0, 1, 2]
  assert [m["history_hit_rate"] for m in metrics] == [0.0, 1.0, 1.0]
  assert all(m["history_prompts"] == 4 for m in metrics)
  assert calls[0]["history"] == [[]] * 8
  first, second = history_by_prompt(calls[0]), history_by_prompt(calls[1])
  for row, prompt in enumerate(calls[1]["prompts"]):  # each row: its prompt's group of step 1
    assert calls[1]["history"][row] == first[prompt]
  for row, prompt in enumerate(calls[2]["prompts"]):  # newest first, 3 at most
    assert calls[2]["history"][row] == (second[prompt] + first[prompt])[:3]
  # the bytes: each prompt's overhead and 3 completions, as the store counts them
  assert metrics[-1]["history_bytes"] == trainer.history.size_bytes > 0


def test_each_row_drafts_from_its_own_prompts_history_and_its_group_is_stored_there(
    engine_uses_history):
  """Rows come group by group (row r is prompt r // g): every row gets its own prompt's earlier
  completions, and each group's completions are stored under its own prompt, newest first."""
  trainer = make_trainer(num_prompts=4, history=HistoryConfig(per_prompt=4))
  g = trainer.grpo_config.group_size
  prompts = [trainer.encode_prompt(p) for p in trainer.problems_for(0)]
  earlier = [[[3 + i] * (i + 1)] for i in range(len(prompts))]  # each names its prompt
  for prompt, completions in zip(prompts, earlier):
    trainer.history.add(prompt, completions)
  calls = record_generate(trainer)
  trainer.step()
  (call,) = calls
  assert call["prompts"] == [tuple(p) for p in prompts for _ in range(g)]
  assert call["history"] == [earlier[r // g] for r in range(len(call["prompts"]))]
  groups = [[t for t in call["tokens"][i * g:(i + 1) * g] if t] for i in range(len(prompts))]
  assert len({tuple(map(tuple, group)) for group in groups}) == len(prompts)  # told apart
  assert trainer.history.lookup(prompts) == [group + old for group, old in zip(groups, earlier)]


def test_each_step_samples_its_rollout_with_a_seed_of_its_own():
  """The same seed every step would give each row the same noise at each position, step after
  step: each step's rollout gets another one."""
  trainer = make_trainer()
  seeds, real = [], trainer.engine.generate

  def generate(prompts, params, *args, **kwargs):
    seeds.append(params.seed)
    return real(prompts, params, *args, **kwargs)

  trainer.engine.generate = generate
  trainer.step()
  trainer.step()
  assert len(seeds) == 2 and seeds[0] != seeds[1], seeds


def test_the_store_is_saved_and_restored_exactly_and_old_checkpoints_still_load(
    tmp_path, engine_uses_history):
  from tlt_jax.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  config = HistoryConfig(max_bytes=3000, per_prompt=2)  # small: the store evicts
  straight = make_trainer(num_prompts=6, history=config)
  straight.step()
  straight.step()
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    straight.save(ckpt)
  saved = straight.history.state_dict()
  calls = record_generate(straight)
  straight.step()

  resumed = make_trainer(num_prompts=6, history=config)
  resumed.history.add([1, 2], [[3]])  # replaced by the checkpoint's
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    resumed.restore(ckpt)
  assert resumed.history.state_dict() == saved
  resumed_calls = record_generate(resumed)
  resumed.step()
  assert resumed_calls[0]["history"] == calls[0]["history"]  # the same drafts' sources
  assert resumed.history.state_dict() == straight.history.state_dict()

  # a checkpoint without a store (from before it existed, or of a trainer without one): reported,
  # the store starts empty
  straight.history = None  # saves as a trainer without a store does
  with Checkpointer(tmp_path / "old") as ckpt:
    straight.save(ckpt)
  lines = []
  with Checkpointer(tmp_path / "old") as ckpt:
    resumed.restore(ckpt, report=lines.append)
  assert resumed.step_count == 3 and resumed.history.num_prompts == 0
  assert lines == ["the checkpoint of step 3 holds no rollout history (saved before the history "
                   "store existed, or without a suffix drafter): the store starts empty"]
  # one that does not load says so
  with Checkpointer(tmp_path / "bad") as ckpt:
    straight.save(ckpt, {"history": {"format": 7}})
  resumed.step()  # step 4: the store and params differ from checkpoint 3's
  before, params = resumed.history.state_dict(), host(resumed.policy.params)
  with Checkpointer(tmp_path / "bad") as ckpt:
    with pytest.raises(ValueError, match=r"the checkpoint of step 3 holds a rollout history that "
                                         r"does not load: HistoryStore state must have the keys"):
      resumed.restore(ckpt)
  assert resumed.step_count == 4 and resumed.history.state_dict() == before  # as it was
  for a, b in zip(params, host(resumed.policy.params)):
    np.testing.assert_array_equal(a, b)


def test_epoch_mode_steps_revisit_the_prompt_set():
  trainer = make_trainer(num_prompts=6)
  for step in (0, 1, 2, 5):
    assert trainer.problems_for(step) == step_problems(trainer.task, 0, step, 4, num_prompts=6)
  seen = [p.prompt for step in range(3) for p in trainer.problems_for(step)]  # 12: two epochs
  assert sorted(seen[:6]) == sorted(seen[6:]) == sorted(p.prompt for p in trainer.schedule.problems)
  assert make_trainer().schedule is None


@pytest.mark.slow
def test_the_suffix_drafter_drafts_from_the_store():
  """A trainer with the suffix drafter alone keeps the store and its steps draft speculatively
  (an acceptance length); from the second epoch every prompt has history."""
  from tlt_jax.rollout.decode.suffix import SuffixConfig  # pylint: disable=import-outside-toplevel
  trainer = make_trainer(num_prompts=4, history=HistoryConfig(), suffix=SuffixConfig(depth=3))
  assert trainer.engine.uses_history and trainer.history is not None
  trainer.engine.precompile(calibrate=False)  # every permitted arm: the fixed tuner below
  trainer.precompile_update()
  # every segment speculative (the cost tuner may rightly find vanilla faster on this CPU)
  from tlt_jax.rollout.host.tuner import TunerConfig, make_tuner  # pylint: disable=import-outside-toplevel
  trainer.engine.set_tuner(make_tuner(TunerConfig(kind="fixed", fixed=((8, "suffix d3"),))))
  first, second = trainer.step(), trainer.step()
  assert first["history_hit_rate"] == 0.0 and second["history_hit_rate"] == 1.0
  assert first["compiles"] == second["compiles"] == 0  # history changes no shape
  assert all(1.0 <= m["mean_accept_len"] <= 4.0 for m in (first, second))
  # the second epoch drafts from the first one's completions
  assert "accept_len/history" not in first and second["accept_len/history"] >= 1.0


def test_the_update_layout_rule_names_the_fields():
  config = TrainerConfig(prompts_per_step=4, minibatches=3)
  with pytest.raises(ValueError, match=r"TrainerConfig.prompts_per_step x GRPOConfig.group_size = "
                                       r"8 rows must split into TrainerConfig.minibatches=3 "):
    check_update_layout(config, grpo.GRPOConfig(group_size=2), 1)
  check_update_layout(TrainerConfig(prompts_per_step=4, minibatches=2), grpo.GRPOConfig(2), 2)


def test_pass_at_k_is_any_of_k_samples_of_each_held_out_problem():
  """``pass_at(k)``: per held-out problem, whether one of its k samples (rows of their own, at the
  trainer's temperature) earns the reward; k = 1 is the sampled reward itself."""
  trainer = make_trainer(temperature=1.0, eval_problems=8)
  varied_rewards(trainer)  # 0/1 rewards that differ between samples
  problems, _, rewards = trainer.held_out(8, temperature=1.0, samples=4)
  assert len(problems) == 32 and problems[0] == problems[3] != problems[4]
  per_problem = np.asarray(rewards).reshape(8, 4)
  assert 0 < per_problem.mean() < 1
  passed = trainer.pass_at(4, 8)
  np.testing.assert_array_equal(passed, per_problem.max(axis=1) >= 1.0)
  assert passed.mean() > per_problem[:, 0].mean()
  np.testing.assert_array_equal(trainer.pass_at(1, 8),
                                np.asarray(trainer.held_out(8, temperature=1.0)[2]) >= 1.0)


def test_grpo_makes_a_flawed_warm_starts_sampled_habit_its_greedy_answer():
  """RL's regime, the default job's: a warm start taught by a teacher that forgets the final carry
  in 70% of the sums with one answers those greedily without it, while its samples often keep it. A
  few GRPO steps make the right answer the greedy one: held-out greedy accuracy rises well above the
  warm start's, where the no-update control stays (the params are its, bit for bit)."""
  from tlt_jax.rl.sft import SFTConfig, warm_start  # pylint: disable=import-outside-toplevel
  task = ArithmeticTask(max_digits=1, teacher_error=0.7)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id, hidden_size=32,
                            intermediate_size=64, num_layers=1)
  model, _ = warm_start(init_model(config, seed=0), tokenizer, task,
                        SFTConfig(steps=200, rows=8, row_len=128, learning_rate=1e-2), 0)
  trainer = GRPOTrainer(model, tokenizer, task,
                        EngineConfig(max_batch=64, max_prompt_len=8, max_new_tokens=24,
                                     prefill_buckets=(8,)),
                        grpo.GRPOConfig(group_size=8),
                        TrainerConfig(steps=6, prompts_per_step=8, max_new_tokens=24,
                                      eval_problems=32, learning_rate=3e-4, warmup_steps=0,
                                      update_tokens=0))
  start = held_out(trainer)
  assert trainer.pass_at(8).mean() > start[1] + 0.2  # samples reach what greedy misses
  for _ in range(6):
    trainer.step()
  after = held_out(trainer)
  assert after[0] > start[0] + 0.15, (start, after)
