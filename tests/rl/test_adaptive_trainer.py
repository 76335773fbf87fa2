"""The trainer with the adaptive rollout engine: per-step SD / arm metrics, and the tuner's state
through checkpoints (what it learned survives a resume)."""

import json
import math

import pytest

from tests.helpers import choose
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import GRPOTrainer
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.rollout.host.stats import ArmTally, RolloutStats, arm_line, rollout_metrics, run_sd_summary
from tlt_jax.rollout.host.tuner import TunerConfig, make_tuner

STRATEGY = (2, 1, 3)  # a chain of depth 2: arm "chain d2"


def adaptive_trainer(tuner: TunerConfig | None = None) -> GRPOTrainer:
  """A tiny trainer whose rollouts choose between vanilla and a 2-deep chain every 4 steps."""
  task = ArithmeticTask(max_digits=3)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
  engine = EngineConfig(max_batch=8, max_prompt_len=16, max_new_tokens=24, prefill_buckets=(16,),
                        batch_buckets=(4, 8), strategies=(STRATEGY,), segment_steps=4, tuner=tuner)
  return GRPOTrainer(init_model(config, seed=0), tokenizer, task, engine,
                     grpo.GRPOConfig(group_size=2),
                     TrainerConfig(steps=2, prompts_per_step=4, max_new_tokens=24, minibatches=2,
                                   eval_problems=4),
                     drafter=Drafter.create(config, seed=1))


@pytest.fixture(scope="module")
def stepped():
  """An adaptive trainer after one RL step, that step's metrics and its rollout's stats."""
  trainer = adaptive_trainer()
  results, real = [], trainer.engine.generate

  def generate(*args, **kwargs):
    results.append(real(*args, **kwargs))
    return results[-1]

  trainer.engine.generate = generate
  metrics = trainer.step()
  del trainer.engine.generate
  (result,) = results
  return trainer, metrics, result.stats


def test_an_adaptive_step_reports_switches_acceptance_and_arm_shares(stepped):
  trainer, m, stats = stepped
  assert trainer.engine.tuner is not None
  # the step's 8 rows decode as one chunk: a switch is a change of arm from one segment to the
  # next, and a catch-up each change from vanilla to the learned drafter's chain
  arms = [segment[3] for segment in stats.segments]
  assert stats.segments[0][0] == 8 and set(arms) <= {"vanilla", "chain d2"}, stats.segments
  assert isinstance(m["sd_switches"], int)
  assert m["sd_switches"] == sum(a != b for a, b in zip(arms, arms[1:])), arms
  assert stats.catchups == sum(a == "vanilla" != b for a, b in zip(arms, arms[1:])), arms
  assert (m["sd_switch_s"] > 0) == (stats.catchups > 0)
  assert m["sd_switch_s"] >= 0.0
  assert 1.0 <= m["mean_accept_len"] <= STRATEGY[0] + 1  # accepted drafts + the bonus token
  shares = {k: v for k, v in m.items() if k.startswith("arm_steps/")}
  buckets = {k.split("/")[1] for k in shares}
  assert buckets and buckets <= {"4", "8"}, shares
  for bucket in buckets:  # each decoded bucket: both arms, shares of its steps summing to 1
    assert {k for k in shares if k.split("/")[1] == bucket} == {
        f"arm_steps/{bucket}/vanilla", f"arm_steps/{bucket}/chain_d2"}
    assert math.isclose(shares[f"arm_steps/{bucket}/vanilla"] +
                        shares[f"arm_steps/{bucket}/chain_d2"], 1.0)
  # over the whole rollout: both arms' shares of every decode step, and the console line
  run_shares = {k: v for k, v in m.items() if k.startswith("arm_share/")}
  assert set(run_shares) == {"arm_share/vanilla", "arm_share/chain_d2"}, run_shares
  assert math.isclose(sum(run_shares.values()), 1.0) and m["decode_steps"] > 0
  assert arm_line(m) == (f"vanilla {100 * m['arm_share/vanilla']:.0f}% "
                         f"chain_d2 {100 * m['arm_share/chain_d2']:.0f}%")
  speeds = {k: v for k, v in m.items() if k.startswith("arm_tps/")}
  assert speeds and all(v > 0 for v in speeds.values())
  for key, speed in speeds.items():  # a speed only for an arm that ran
    assert shares[key.replace("arm_tps/", "arm_steps/")] > 0, (key, speed)
  # every metric is a plain scalar: the job writes each to tensorboard and to metrics.jsonl
  assert all(type(v) in (int, float) for v in m.values()), m
  json.dumps(m)


def test_rollout_metrics_of_hand_made_stats():
  """Only buckets with a choice that were decoded; an arm that did not run has share 0 and no
  speed; spaces in arm names become underscores."""
  arm = lambda steps, tps: ArmTally(segments=1, steps=steps, tokens=0, row_steps=0, seconds=1.0,
                                    mean_accept_len=None, tokens_per_s=tps)
  stats = RolloutStats(switches=3, switch_s=0.5, mean_accept_len=2.5, prefill_s=0.25,
               decode_s=2.0, compact_s=0.125, grow_s=0.0625,
               segments=[(2, 3, 1.0, "vanilla"), (2, 1, 0.5, "tree d4 k2 v8")],
               arms={"2": {"vanilla": arm(3, 10.0), "tree d4 k2 v8": arm(1, 30.0)},
                     "4": {"vanilla": arm(8, 40.0)},
                     "64": {"vanilla": arm(4, 90.0)}})
  offered = {1: ["vanilla", "chain d4"], 2: ["vanilla", "tree d4 k2 v8"],
             4: ["vanilla", "tree d4 k2 v8"], 64: ["vanilla"]}
  assert rollout_metrics(stats, offered) == {
      "sd_switches": 3, "sd_switch_s": 0.5, "mean_accept_len": 2.5,
      "segments": 2, "prefill_s": 0.25, "decode_s": 2.0, "compact_s": 0.1875,  # with the growth
      # all buckets together: 15 vanilla steps, 1 tree step, no chain step of 16
      "arm_share/vanilla": 15 / 16, "arm_share/chain_d4": 0.0, "arm_share/tree_d4_k2_v8": 1 / 16,
      "decode_steps": 16,
      "arm_steps/2/vanilla": 0.75, "arm_tps/2/vanilla": 10.0,
      "arm_steps/2/tree_d4_k2_v8": 0.25, "arm_tps/2/tree_d4_k2_v8": 30.0,
      "arm_steps/4/vanilla": 1.0, "arm_tps/4/vanilla": 40.0, "arm_steps/4/tree_d4_k2_v8": 0.0}
  assert arm_line(rollout_metrics(stats, offered)) == "vanilla 94% chain_d4 0% tree_d4_k2_v8 6%"
  vanilla = RolloutStats(switches=0, switch_s=0.0, arms={"8": {"vanilla": arm(4, 5.0)}})
  none = {"segments": 0, "prefill_s": 0.0, "decode_s": 0.0, "compact_s": 0.0}
  assert rollout_metrics(vanilla) == {"sd_switches": 0, "sd_switch_s": 0.0, **none}  # no arm
  assert arm_line(rollout_metrics(vanilla)) == ""
  # one fixed strategy (no tuner, so nothing offered): no arms to compare
  fixed = RolloutStats(switches=0, switch_s=0.0, arms={"8": {"chain d2": arm(6, 5.0)}})
  assert rollout_metrics(fixed) == {"sd_switches": 0, "sd_switch_s": 0.0, **none}


def test_run_sd_summary_weighs_steps_by_their_decode_steps():
  """The run's arm shares count decode steps (not steps of the run); the accepted length is the
  mean over the steps where SD ran; the drafter's steps add up, its held-out top-1 first -> last."""
  history = [
      {"arm_share/vanilla": 1.0, "arm_share/chain_d3": 0.0, "decode_steps": 30,
       "sd_switches": 0, "sd_switch_s": 0.0, "drafter_spot_steps": 0, "drafter_serial_steps": 3,
       "drafter_serial_s": 0.5, "drafter_loss": 2.0, "drafter_top1": 0.1},
      {"arm_share/vanilla": 0.5, "arm_share/chain_d3": 0.5, "decode_steps": 20,
       "mean_accept_len": 2.5, "sd_switches": 4, "sd_switch_s": 0.25, "drafter_spot_steps": 2,
       "drafter_serial_steps": 3, "drafter_serial_s": 0.5, "drafter_loss": 1.0,
       "drafter_top1": 0.4}]
  assert run_sd_summary(history[:1] + [{"step": 1, "eval_accuracy": 0.5}] + history[1:]) == (
      "SD: vanilla 80% chain_d3 20% of decode steps; mean accepted length 2.50 (1 of 2 steps "
      "with SD); 4 switches (0.25 s catch-up); drafter 2 spot + 6 serial steps (1.00 s serial), "
      "held-out top-1 0.100 -> 0.400")
  ngram = [{k: v for k, v in m.items() if not k.startswith("drafter_")} for m in history]
  assert run_sd_summary(ngram) == (
      "SD: vanilla 80% chain_d3 20% of decode steps; mean accepted length 2.50 (1 of 2 steps "
      "with SD); 4 switches (0.25 s catch-up)")
  # vanilla, data-parallel (spot metrics of zero steps, no drafter): nothing to say
  assert run_sd_summary([{"sd_switches": 0, "sd_switch_s": 0.0, "drafter_spot_steps": 0,
                          "drafter_serial_steps": 0, "drafter_serial_s": 0.0}] * 2) == ""
  assert run_sd_summary([]) == ""


def test_the_tuner_state_goes_through_a_checkpoint(stepped, tmp_path):
  """save -> a fresh trainer -> restore: the tuner is the saved one (a fresh tuner's state differs,
  so a restore that skips the tuner fails here), and it goes on choosing from there."""
  trainer, _, _ = stepped
  saved = trainer.engine.tuner.state_dict()
  assert saved["buckets"], "one RL step must have taught the tuner something"
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    trainer.save(ckpt)
  resumed = adaptive_trainer()
  fresh = resumed.engine.tuner.state_dict()
  assert fresh != saved
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    metadata = resumed.restore(ckpt)
  assert metadata["tuner"] == saved
  assert resumed.engine.tuner.state_dict() == saved
  # it continues the saved tuner's choice sequence (RNG included), reward for reward
  twin = make_tuner(trainer.engine.tuner.config)
  twin.load_state_dict(saved)
  arms = [s.arm for s in resumed.engine.strategies_for(8)]

  def choices(tuner):
    out = []
    for i in range(40):
      out.append(choose(tuner, 8, arms))
      tuner.update(8, out[-1], tokens=100 + i % 7, seconds=1.0)
    return out

  assert choices(resumed.engine.tuner) == choices(twin)


def test_a_tuner_of_another_kind_starts_fresh_and_says_so(stepped, tmp_path):
  """Resumed with another tuner kind (a deliberate override): reported, and that tuner starts
  from nothing rather than failing the resume."""
  trainer, _, _ = stepped
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    trainer.save(ckpt)
  other = adaptive_trainer(TunerConfig(kind="ucb1"))
  fresh = other.engine.tuner.state_dict()
  notes = []
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    other.restore(ckpt, report=notes.append)
  assert other.step_count == 1
  assert other.engine.tuner.state_dict() == fresh
  assert len(notes) == 1 and "'cost'" in notes[0] and "'ucb1'" in notes[0], notes
  assert "starts fresh" in notes[0]


def test_a_vanilla_trainer_saves_no_tuner_and_ignores_one_in_a_checkpoint(stepped, tmp_path):
  trainer, _, _ = stepped
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    trainer.save(ckpt)
  task = ArithmeticTask(max_digits=3)
  tokenizer = CharTokenizer(task.alphabet)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
  vanilla = GRPOTrainer(init_model(config, seed=0), tokenizer, task,
                        EngineConfig(max_batch=8, max_prompt_len=16, max_new_tokens=24,
                                     prefill_buckets=(16,)),
                        grpo.GRPOConfig(group_size=2),
                        TrainerConfig(steps=2, prompts_per_step=4, max_new_tokens=24,
                                      minibatches=2, eval_problems=4))
  assert vanilla.engine.tuner is None
  notes = []
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    vanilla.restore(ckpt, report=notes.append)
  assert notes == [] and vanilla.step_count == 1
  like = vanilla.checkpoint_state()
  with Checkpointer(tmp_path / "vanilla") as ckpt:
    vanilla.save(ckpt)
    _, metadata = ckpt.restore(1, like=like)
  assert "tuner" not in metadata
