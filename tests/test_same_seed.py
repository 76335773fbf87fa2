"""Same config and seed, same run, with TLT on.

The adaptive engine's tuner picks an arm per segment from measured speeds, and the ledger grants
the drafter steps from measured savings: those decisions differ between any two runs. What the
policy learns must not: in the default job (``rollout.verify="coupled"``) every arm emits the
tokens vanilla sampling draws for the seed, so rewards, losses and weights follow the seed alone.

The job as users run it (full tier): for ``drafter=eagle`` (SIGKILL), ``ngram`` (Ctrl-C's
SIGINT), ``suffix`` in epoch mode (SIGTERM) and ``eagle`` on two devices with spot training
(SIGKILL), each stopped at a random step and resumed, follows the uninterrupted run's policy
trajectory: the stopped run is a second run of the same config and seed up to its stop, and the
resumed one goes on from a checkpoint through the same timed decisions. (A third, uninterrupted
run was dropped for CI's time: a run that differed from the reference after the stop
without being stopped would make the resumed one differ too, which the test already fails on.) The fixed-tuner kill/resume cases, which also compare the drafter's
and the tuner's state exactly, are in tests/test_kill_resume.py.
"""

import dataclasses
import json
import signal

import jax
import numpy as np
import pytest

from tests.test_kill_resume import (CASES, assert_same_params, assert_same_rows,
                                    policy_rows, references,  # pylint: disable=unused-import
                                    stop_and_resume)
from tests.test_train_job import tiny_config
from tlt_jax.job import runner
from tlt_jax.job.build import build_job, job_devices
from tlt_jax.models.transformer import init_model
from tlt_jax.rl.data import metric_kind
from tlt_jax.rollout.host.tuner import TunerConfig


def job_trainer(tmp_path, fixed=None, **top):
  """The tiny default job's trainer with ``drafter=eagle`` (its strategies, verification, tuner,
  ledger and online drafter), the tuner fixed to ``fixed`` when given, on a fresh policy."""
  job = build_job(tiny_config(tmp_path / "run", drafter="eagle", **top))
  if fixed is not None:
    job = dataclasses.replace(job, engine=dataclasses.replace(
        job.engine, tuner=TunerConfig(kind="fixed", fixed=fixed)))
  mesh = jax.sharding.Mesh(np.array(job_devices(job.cfg)), ("data",))
  return runner.make_trainer(job, init_model(job.model_config, seed=0), mesh)


def policy(trainer) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(trainer.policy.params)]


def test_in_the_default_job_the_tuners_choice_of_arm_changes_nothing_the_policy_learns(tmp_path):
  """Two RL steps of the default job (drafter=eagle), once with every SD-capable bucket forced
  onto a speculative arm and once onto vanilla: the same tokens, rewards, losses and weights,
  while acceptance and the drafter's training differ."""
  probe = job_trainer(tmp_path)
  engine = probe.engine
  top = engine.config.max_batch
  sd_max = engine.config.sd_max_batch or top  # None: no fixed cap
  sd_arm = next(s.name for s in engine.strategies_for(min(engine.config.batch_buckets))
                if s.name != "vanilla")
  above = ((top, "vanilla"),) if top > sd_max else ()
  runs = {}
  for name, fixed in (("speculative", ((sd_max, sd_arm),) + above),
                      ("vanilla", ((top, "vanilla"),))):
    trainer = job_trainer(tmp_path / name, fixed)
    used, packed_update = [], trainer.policy.packed_update

    def recording(batch, picked, lengths, used=used, packed_update=packed_update):
      used.append(np.array(batch["old_logprobs"][picked]))  # what the loss compares against
      return packed_update(batch, picked, lengths)

    trainer.policy.packed_update = recording
    runs[name] = ([trainer.step() for _ in range(2)], policy(trainer), used)
  (sd_rows, sd_params, sd_old), (v_rows, v_params, v_old) = runs["speculative"], runs["vanilla"]
  assert len(sd_old) == len(v_old) == 4  # 2 steps x 2 minibatches
  for a, b in zip(sd_old, v_old):  # the loss's old log-probs: the rollout's would differ here
    np.testing.assert_array_equal(a, b)
  assert all(r.get("mean_accept_len") for r in sd_rows), "no speculative step ran"
  assert not any(r.get("mean_accept_len") for r in v_rows)
  for a, b in zip(sd_rows, v_rows):
    exact = [k for k in a if metric_kind(k) == "exact"]
    assert {"rollout_digest", "reward", "loss"} <= set(exact)
    assert {k: a[k] for k in exact} == {k: b.get(k) for k in exact}
  for a, b in zip(sd_params, v_params):
    np.testing.assert_array_equal(a, b)


def test_every_metric_has_a_kind():
  """What a step reports is exact (the policy's trajectory), decided (follows a timed decision)
  or timed (seconds); tests/test_kill_resume.py compares the exact ones between runs."""
  exact = ["reward", "rollout_digest", "len_p50", "len_max", "loss", "approx_kl", "epoch",
           "eval_accuracy", "eval_sampled_reward", "step"]
  decided = ["compiles", "mean_accept_len", "arm_share/vanilla", "arm_steps/8/chain_d3", "sd_switches",
             "decode_steps", "accept_len/eagle", "accept_share/eagle", "drafter_loss",
             "drafter_top1", "drafter_serial_steps", "drafter_bootstrap_steps",
             "drafter_spot_devices"]
  timed = ["step_s", "rollout_s", "sd_saved_s", "arm_tps/8/vanilla", "ledger_balance_s",
           "tlt_saved_s", "drafter_serial_s", "update_s", "tail_idle_device_s",
           "process_rollout_s/0", "process_idle_s/1"]  # (per process, several processes)
  assert {k: metric_kind(k) for k in exact} == dict.fromkeys(exact, "exact")
  assert {k: metric_kind(k) for k in decided} == dict.fromkeys(decided, "decided")
  assert {k: metric_kind(k) for k in timed} == dict.fromkeys(timed, "timed")


# The configuration users run: the default tuner ("cost"), serial budget ("ledger") and
# verification ("coupled"). The tuner's choices and the ledger's grants follow measured time, so
# what the drafter and the tuner do differs between any two runs; the policy's trajectory (the
# metrics tlt_jax.rl.data.metric_kind calls "exact", and the weights) may not.
DEFAULT_TUNER_CASES = [("eagle_default_tuner", signal.SIGKILL),
                       ("ngram_default_tuner", signal.SIGINT),
                       ("suffix_default_tuner", signal.SIGTERM),
                       ("eagle_2_devices_default_tuner", signal.SIGKILL),
                       ("longtail_every_feature", signal.SIGKILL)]


@pytest.mark.slow
@pytest.mark.parametrize("case, sig", DEFAULT_TUNER_CASES,
                         ids=[f"{c}-{signal.Signals(s).name}" for c, s in DEFAULT_TUNER_CASES])
def test_with_the_default_tuner_a_stopped_and_resumed_run_follows_the_uninterrupted_policy(
    references, tmp_path, case, sig):
  stopped = tmp_path / "stopped"
  why = stop_and_resume(stopped, case, sig)
  reference = references(case)
  assert_same_rows(policy_rows(reference), policy_rows(stopped), why)
  assert_same_params(reference, stopped, why)
  # there were timed decisions to make: the tuner chose an arm per segment, and the drafter
  # trained on what the ledger granted or the idle device's tail allowed. (At these sizes the cost
  # tuner mostly keeps vanilla; with the suffix drafter's history it took SD in some segments of
  # the second epoch on this CPU. A step with SD forced onto every segment changes nothing the
  # policy learns either: the fast test above.)
  rows = [json.loads(line) for line in (reference / "metrics.jsonl").open()]
  steps = [r for r in rows if "reward" in r]
  if case != "eagle_default_tuner":  # (its offers follow this CPU's calibration: maybe none)
    assert any(k.startswith("arm_steps/") for r in steps for k in r), why
  if case.startswith("longtail"):  # after precompile nothing compiles, whatever the tuner
    # chose and whichever drafter (learned, history, siblings, prompt) drafted
    assert [r["compiles"] for r in steps] == [0] * len(steps), why
  # (eagle_default_tuner: the drafter trains while its arms may still be offered, i.e. until the
  # background calibration ends; how many steps that is follows this CPU's timing)
  if case == "eagle_2_devices_default_tuner":  # spot steps on the idle device, none serial
    assert sum(r["drafter_spot_steps"] for r in steps) > 0, why
    assert sum(r["drafter_serial_steps"] for r in steps) == 0, why
  if case == "suffix_default_tuner":  # the second epoch (step 3 on) drafts from the first's
    assert [r["history_hit_rate"] for r in steps][2:] == [1.0] * (len(steps) - 2), why
