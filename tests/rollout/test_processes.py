"""A rollout shared over processes (``over_processes``), in one process playing process 1 of 2
(``hosts`` patched: the
exchange hands back what a real process 0 decoded): a process decodes exactly its rows with
their global keys, every process gets every row, and the tuner is saved and loaded per process.
The real multi-process runs are tests/test_multiprocess.py and tests/test_hosts.py."""

import numpy as np
import pytest

from tests.helpers import sharp_random_model
from tlt_jax import hosts
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.rollout import processes
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.processes import process_rows
from tlt_jax.rollout.decode.sampling import SamplingParams
from tlt_jax.rollout.host.stats import rollout_metrics

PROMPTS = [[7, 8, 9], [10, 11], [12, 13, 14, 15], [16], [17, 18]]


def as_process(monkeypatch, index: int, count: int, others: dict):
  """``hosts`` as process ``index`` of ``count``; ``others[tag]``: what every other process sends
  (``{process: value}``); records what this one sent."""
  sent = {}

  def allgather(value, tag):
    sent[tag] = value
    return [value if p == index else others[tag][p] for p in range(count)]

  monkeypatch.setattr(hosts, "process_index", lambda: index)
  monkeypatch.setattr(hosts, "process_count", lambda: count)
  monkeypatch.setattr(hosts, "is_primary", lambda: index == 0)
  monkeypatch.setattr(hosts, "allgather", allgather)
  return sent


ENGINE_CONFIG = EngineConfig(max_batch=4, max_prompt_len=8, max_new_tokens=12,
                             prefill_buckets=(8,))


@pytest.fixture(scope="module")
def target():
  return sharp_random_model(ModelConfig.tiny(vocab_size=32), seed=2)


@pytest.fixture(scope="module")
def engine(target):
  return RolloutEngine(target, None, ENGINE_CONFIG)


def shared(rollout):
  """``rollout`` marked to share its rows over the processes, as ``make_rollout`` marks it."""
  rollout.over_processes = True
  return rollout


@pytest.fixture
def sharing(target):
  """An engine that shares its rows over the processes (its own: ``engine`` stays a local one)."""
  return shared(RolloutEngine(target, None, ENGINE_CONFIG))


def test_process_1_decodes_its_rows_with_their_keys_and_gets_every_row(engine, sharing,
                                                                        monkeypatch):
  params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
  whole = engine.generate(PROMPTS, params)
  first = process_rows(len(PROMPTS), 2, 1, 0)
  assert first == range(0, 3)
  part = engine.generate(PROMPTS[:3], params)  # what process 0 decodes and sends
  sent = as_process(monkeypatch, 1, 2, {"rollout": {0: (part.tokens, part.logprobs,
                                                        part.finish_reasons, part.stats)}})
  out = sharing.generate(PROMPTS, params)
  assert sent["rollout"][0] == whole.tokens[3:]  # its rows, sampled as in the whole request
  assert out.tokens == whole.tokens
  for a, b in zip(out.logprobs, whole.logprobs):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert out.finish_reasons == whole.finish_reasons
  assert [p["rows"] for p in out.stats.processes] == [3, 2]
  assert len(out.stats.devices) == 2 and out.stats.tokens == whole.stats.tokens
  metrics = rollout_metrics(out.stats)
  assert {"process_rollout_s/0", "process_idle_s/1", "rollout_exchange_s"} <= set(metrics)
  assert min(metrics["process_idle_s/0"], metrics["process_idle_s/1"]) == 0.0



def test_shard_done_gets_the_shard_s_first_row_in_the_whole_request(engine, sharing,
                                                                      monkeypatch):
  """Process 1 of 2 decodes rows 3 and 4 on its one device: its ``idle_work.shard_done`` is told row 3 (the drafter's
  buffer looks the rows' prompts up by it), not its shard's local 0 nor 3 counted twice."""
  params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
  part = engine.generate(PROMPTS[:3], params)
  as_process(monkeypatch, 1, 2, {"rollout": {0: (part.tokens, part.logprobs,
                                                 part.finish_reasons, part.stats)}})
  done = []

  class Recorded:  # an IdleWork that records each finished shard
    def shard_done(self, k, first, result):
      done.append((k, first, result.tokens))

    def idle(self, k, stop):
      raise AssertionError("one device is never idle while another decodes")

  out = sharing.generate(PROMPTS, params, idle_work=Recorded())
  assert [(k, first) for k, first, _ in done] == [(0, 3)]
  assert done[0][2] == out.tokens[3:]

def test_a_bad_prompt_fails_on_every_process_not_only_its_owner(sharing, monkeypatch):
  as_process(monkeypatch, 1, 2, {})
  with pytest.raises(ValueError, match="prompt 0 is empty"):
    sharing.generate([[], [5]], SamplingParams(max_new_tokens=4))


def test_a_rollout_not_marked_decodes_every_row_itself(engine, monkeypatch):
  """Without ``over_processes`` (a rollout built outside ``make_rollout``) a process decodes every
  row it is given and exchanges nothing, whatever the process count."""
  params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
  whole = engine.generate(PROMPTS, params)
  sent = as_process(monkeypatch, 1, 2, {})
  out = engine.generate(PROMPTS, params)
  assert sent == {} and out.tokens == whole.tokens and out.stats.processes is None


class FakeTuner:
  """A tuner whose state is a given dict, recording what it loads."""

  def __init__(self, state):
    self.state, self.loaded = state, []
    self.config = type("Config", (), {"kind": state["kind"]})

  def state_dict(self):
    return self.state

  def load_state_dict(self, saved):
    self.loaded.append(saved)


def test_the_tuner_is_saved_and_loaded_per_process(sharing, monkeypatch):
  mine, theirs = {"kind": "cost", "who": 1}, {"kind": "cost", "who": 0}
  as_process(monkeypatch, 1, 2, {"tuner_state": {0: theirs}})
  tuner = FakeTuner(mine)
  monkeypatch.setattr(sharing, "tuner", tuner)
  saved = sharing.tuner_state()
  assert saved == {"kind": "cost", processes.PER_PROCESS: [theirs, mine]}
  sharing.load_tuner_state(saved)
  assert tuner.loaded == [mine]  # its own, not process 0's
  sharing.load_tuner_state(theirs)  # a one-process checkpoint: every process takes it
  assert tuner.loaded[-1] == theirs
  notes = []
  sharing.load_tuner_state({"kind": "cost", processes.PER_PROCESS: [theirs, mine, mine]},
                           notes.append)
  assert tuner.loaded[-1] == theirs  # another process count: process 0's
  assert notes == []  # process 0 alone says so
