"""The rollout's own history (``rollout/decode/suffix_history.py``, beside the suffix drafter that
drafts from it) and the epochs that make it worth keeping (``tasks.EpochSchedule``): the store's
bounds, eviction order and exact state round trip, its
errors for malformed states; the epoch order's determinism and coverage."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest

from tlt_jax.rl.external_tasks import MathDatasetTask, ReasoningGymTask
from tlt_jax.rl.tasks import ArithmeticTask, EpochSchedule, Problem, sample_distinct
from tlt_jax.rl.data import step_problems
from tlt_jax.rl.trainer_config import TrainerConfig
from tlt_jax.rollout.decode.suffix_history import (PROMPT_BYTES, HistoryConfig, HistoryStore, completion_cost,
                                     prompt_key)
from tlt_jax.utils import FieldError

from tests.rl.test_external_tasks import DATA


# ---- the store ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(max_bytes=0), r"HistoryConfig.max_bytes must be a positive int, got 0"),
    (dict(max_bytes=1.5e6), r"HistoryConfig.max_bytes must be a positive int, got 1500000.0"),
    (dict(per_prompt=0), r"HistoryConfig.per_prompt must be a positive int, got 0"),
    (dict(per_prompt=True), r"HistoryConfig.per_prompt must be a positive int, got True"),
])
def test_bad_history_configs_are_rejected_naming_the_field(kw, match):
  with pytest.raises(FieldError, match=match):
    HistoryConfig(**kw)


def test_completions_come_back_newest_first_per_prompt_and_at_most_per_prompt():
  store = HistoryStore(HistoryConfig(per_prompt=3))
  assert store.lookup([[1, 2]]) == [[]] and store.num_prompts == 0 and store.size_bytes == 0
  store.add([1, 2], [[10, 11], [12]])  # a group of two rows: kept in row order
  store.add([7], [[70]])
  store.add([1, 2], [[13], [], [14, 15]])  # a newer group; its empty row is not kept
  assert store.lookup([[1, 2], [7], [1, 2, 3], [2, 1]]) == [
      [[13], [14, 15], [10, 11]], [[70]], [], []]  # 3 per prompt: [12], the oldest, is gone
  assert store.num_prompts == 2 and store.has([7]) and not store.has([1])
  # the bytes: a prompt's overhead and each completion's
  assert store.size_bytes == 2 * PROMPT_BYTES + sum(map(completion_cost, [1, 2, 2, 1]))
  # what lookup returns is a copy: changing it leaves the store as it was
  store.lookup([[7]])[0][0].append(99)
  assert store.lookup([[7]]) == [[[70]]]
  # as arrays (what the rollout packs): the store's own, read-only, the same ids
  arrays = store.lookup([[1, 2], [7], [9]], arrays=True)
  assert [[a.tolist() for a in row] for row in arrays] == [[[13], [14, 15], [10, 11]], [[70]], []]
  assert all(a.dtype == np.int32 and not a.flags.writeable for row in arrays for a in row)
  with pytest.raises(ValueError):
    arrays[1][0][0] = 99
  store.add([3], [[], []])  # only empty completions: nothing to keep
  assert store.num_prompts == 2
  # numpy ids are the same prompt as python ints
  assert store.lookup([np.array([1, 2], np.int64)]) == store.lookup([[1, 2]])
  assert prompt_key(np.array([1, 2], np.int32)) == prompt_key((1, 2))


@pytest.mark.parametrize("prompt, completions, match", [
    ("12", [[1]], r"a prompt must be a sequence of token ids"),
    ([1, 2], [[1.5]], r"completion 0 must be a flat sequence of int token ids"),
    ([1, 2], [[1], [[2, 3]]], r"completion 1 must be a flat sequence"),
    ([1, -2], [[1]], r"a prompt holds token ids outside 0..2147483647"),
    ([1], [[2**31]], r"completion 0 holds token ids outside"),
    ([1], "abc", r"completions must be a sequence of token-id sequences"),
])
def test_bad_ids_are_rejected(prompt, completions, match):
  store = HistoryStore()
  with pytest.raises(ValueError, match=match):
    store.add(prompt, completions)
  assert store.num_prompts == 0


def test_over_budget_the_prompt_added_to_least_recently_goes_first():
  one = PROMPT_BYTES + completion_cost(10)  # a prompt holding one completion of 10 tokens
  store = HistoryStore(HistoryConfig(max_bytes=3 * one))
  ten = lambda start: [list(range(start, start + 10))]
  for prompt in ([1], [2], [3]):
    store.add(prompt, ten(prompt[0] * 100))
  assert store.num_prompts == 3 and store.size_bytes == 3 * one
  store.add([1], ten(500))  # [1] is the newest now; [2] was added to least recently
  assert [store.has([p]) for p in (1, 2, 3)] == [True, False, True]
  assert store.lookup([[1]]) == [ten(500) + ten(100)]
  store.lookup([[3]])  # a lookup is no add: [3] goes next
  store.add([4], ten(400))
  assert [store.has([p]) for p in (1, 2, 3, 4)] == [True, False, False, True]
  assert store.size_bytes == one + completion_cost(10) + one <= 3 * one


def test_a_prompt_alone_over_budget_keeps_its_newest_completions_that_fit():
  store = HistoryStore(HistoryConfig(max_bytes=PROMPT_BYTES + 2 * completion_cost(4)))
  store.add([1], [[9, 9]])
  store.add([2], [[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]])  # 3 rows: the oldest one goes
  assert store.lookup([[1], [2]]) == [[], [[1, 1, 1, 1], [2, 2, 2, 2]]]
  store.add([3], [list(range(1000))])  # over the budget by itself: nothing of it can stay
  assert store.num_prompts == 0 and store.size_bytes == 0


class ReferenceStore:
  """The store's rules written plainly: a list of (prompt, completions) pairs, oldest added-to
  first, each newest first."""

  def __init__(self, config: HistoryConfig):
    self.config, self.entries = config, []

  def cost(self) -> int:
    return sum(PROMPT_BYTES + sum(completion_cost(len(c)) for c in cs) for _, cs in self.entries)

  def add(self, prompt, completions):
    new = [list(c) for c in completions if len(c)]
    if not new:
      return
    old = [cs for p, cs in self.entries if p == tuple(prompt)]
    self.entries = [(p, cs) for p, cs in self.entries if p != tuple(prompt)]
    self.entries.append((tuple(prompt), (new + (old[0] if old else []))[:self.config.per_prompt]))
    while self.cost() > self.config.max_bytes:
      if len(self.entries) > 1 or len(self.entries[0][1]) == 1:
        self.entries.pop(0)
      else:
        self.entries[0][1].pop()

  def lookup(self, prompts):
    held = dict(self.entries)
    return [held.get(tuple(p), []) for p in prompts]


def random_groups(seed: int, n: int, prompts: int = 12):
  """``n`` random (prompt, group) adds over a few prompts, some rows empty."""
  rng = random.Random(seed)
  for _ in range(n):
    prompt = [1, rng.randrange(prompts)]
    yield prompt, [[rng.randrange(50) for _ in range(rng.choice([0, 1, 5, 20, 60]))]
                   for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("seed", range(4))
def test_the_store_follows_its_rules_under_random_adds(seed):
  config = HistoryConfig(max_bytes=[900, 2500, 6000, 10**6][seed], per_prompt=[1, 3, 5, 16][seed])
  store, reference = HistoryStore(config), ReferenceStore(config)
  every = [[1, p] for p in range(12)]
  for prompt, group in random_groups(seed, 120):
    store.add(prompt, group)
    reference.add(prompt, group)
    assert store.lookup(every) == reference.lookup(every)
    assert store.size_bytes == reference.cost() <= config.max_bytes
    assert store.num_prompts == len(reference.entries)


def filled_store(seed: int = 0, config=HistoryConfig(max_bytes=4000, per_prompt=4)):
  store = HistoryStore(config)
  for prompt, group in random_groups(seed, 60):
    store.add(prompt, group)
  assert store.num_prompts > 2
  return store


def test_the_state_round_trips_exactly_through_json_and_keeps_the_eviction_order():
  store = filled_store()
  state = store.state_dict()
  restored = HistoryStore(store.config)
  restored.add([5, 5], [[1, 2, 3]])  # whatever it held goes
  restored.load_state_dict(json.loads(json.dumps(state)))  # as the checkpoint's metadata
  assert restored.state_dict() == state
  assert restored.size_bytes == store.size_bytes and restored.num_prompts == store.num_prompts
  every = [[1, p] for p in range(12)] + [[5, 5]]
  assert restored.lookup(every) == store.lookup(every)
  # the same adds from here evict the same prompts in the same order
  for prompt, group in random_groups(99, 40):
    store.add(prompt, group)
    restored.add(prompt, group)
    assert restored.state_dict() == store.state_dict()
  empty = HistoryStore(store.config)
  empty.load_state_dict(HistoryStore().state_dict())
  assert empty.num_prompts == 0 and empty.lookup(every) == [[]] * len(every)


def test_smaller_bounds_than_the_saved_ones_apply_on_load():
  store = filled_store(config=HistoryConfig(max_bytes=10**6, per_prompt=4))
  smaller = HistoryConfig(max_bytes=store.size_bytes // 2, per_prompt=2)
  restored = HistoryStore(smaller)
  restored.load_state_dict(store.state_dict())
  reference = ReferenceStore(smaller)
  for prompt, completions in _entries(store):  # the oldest first, as they were added
    reference.add(prompt, completions)
  every = [[1, p] for p in range(12)]
  assert restored.lookup(every) == reference.lookup(every)
  assert restored.size_bytes == reference.cost() <= smaller.max_bytes


def _entries(store):
  """(prompt, completions) of a store whose prompts are [1, p], oldest added-to first."""
  by_key = {prompt_key([1, p]): [1, p] for p in range(12)}
  for key, _ in store.state_dict()["prompts"]:
    yield by_key[key], store.lookup([by_key[key]])[0]


def _set(key, value):
  """A change of a state: its ``key`` set to ``value``."""
  def change(state):
    state[key] = value
    return state
  return change


def _drop(key):
  return lambda state: {k: v for k, v in state.items() if k != key}


def _entry(i, field, value):
  """A change of a state: field 0 (key) or 1 (lengths) of its ``prompts[i]`` set to ``value``."""
  def change(state):
    state["prompts"][i][field] = value(state) if callable(value) else value
    return state
  return change


def _prompts(change_list):
  def change(state):
    change_list(state["prompts"])
    return state
  return change


BAD_STATES = [
    ("not a dict", lambda s: [s], r"must be a dict"),
    ("missing key", _drop("tokens"), r"missing \['tokens'\]"),
    ("unknown key", _set("extra", 1), r"unknown \['extra'\]"),
    ("format", _set("format", 2), r"has format 2; this version reads format 1"),
    ("bounds", _set("per_prompt", 0), r"its bounds are not a HistoryConfig: .*per_prompt"),
    ("tokens type", _set("tokens", [1, 2]), r"'tokens' must be a base64 string"),
    ("tokens base64", _set("tokens", "not base64!"), r"'tokens' is not valid base64"),
    ("tokens bytes", _set("tokens", "AAAA"), r"holds 3 bytes, not a whole number of int32"),
    ("negative id", _set("tokens", "/////w=="), r"negative token id \(-1\)"),
    ("prompts type", _set("prompts", {}), r"'prompts' must be a list of \[key, lengths\] pairs"),
    ("entry shape", _prompts(lambda ps: ps.__setitem__(0, ["ab"])),
     r"prompts\[0\] must be a \[key, lengths\] pair"),
    ("bad key", _entry(0, 0, "XYZ"), r"prompts\[0\] has the key 'XYZ'; a key is 32 lowercase"),
    ("repeated key", _entry(1, 0, lambda s: s["prompts"][0][0]), r"prompts\[1\] repeats the key"),
    ("no lengths", _entry(0, 1, []), r"prompts\[0\] must list 1 to per_prompt=4 completion "
                                     r"lengths"),
    ("too many", _entry(0, 1, [1] * 5), r"prompts\[0\] must list 1 to per_prompt=4"),
    ("zero length", _entry(0, 1, [0]), r"prompts\[0\] must list .*\(ints >= 1\)"),
    ("too long", _entry(0, 1, [10**6]), r"need more than the \d+ tokens of 'tokens' \(ran out "
                                        r"at prompts\[0\]\)"),
    ("tokens left", _prompts(lambda ps: ps.pop()), r"'tokens' holds \d+ token ids but the "
                                                   r"prompts' completion lengths add up to \d+"),
    ("over budget", _set("max_bytes", 100), r"holds \d+ bytes, over its own max_bytes=100"),
]


@pytest.mark.parametrize("change, match", [b[1:] for b in BAD_STATES],
                         ids=[b[0] for b in BAD_STATES])
def test_a_malformed_state_says_what_is_wrong_and_changes_nothing(change, match):
  bad = change(copy.deepcopy(filled_store().state_dict()))
  target = filled_store(seed=1)
  before = target.state_dict()
  with pytest.raises(ValueError, match=r"HistoryStore state.*" + match):
    target.load_state_dict(bad)
  assert target.state_dict() == before


# ---- epoch mode -------------------------------------------------------------------------------


def test_every_prompt_comes_once_per_epoch_in_a_shuffled_order():
  task = ArithmeticTask(max_digits=3)
  schedule = EpochSchedule(task, seed=3, num_prompts=8, per_step=4)
  prompts = [p.prompt for p in schedule.problems]
  assert len(set(prompts)) == 8  # distinct prompts
  epochs = [schedule.indices(2 * e) + schedule.indices(2 * e + 1) for e in range(5)]
  assert all(sorted(e) == list(range(8)) for e in epochs)  # each prompt once per epoch
  assert len({tuple(e) for e in epochs}) == 5  # and another order every epoch
  assert [schedule.epoch(s) for s in range(5)] == [0, 0, 1, 1, 2]
  assert [p.prompt for p in schedule.step_problems(3)] == [prompts[i] for i in epochs[1][4:]]
  # one-digit sums: 100 problems, so 40 draws repeat some (the birthday bound); the set does not
  small = EpochSchedule(ArithmeticTask(max_digits=1), seed=0, num_prompts=40, per_step=8)
  assert len({p.prompt for p in small.problems}) == 40


def test_a_step_that_straddles_two_epochs_takes_the_end_of_one_and_the_start_of_the_next():
  schedule = EpochSchedule(ArithmeticTask(max_digits=3), seed=0, num_prompts=10, per_step=4)
  stream = [i for s in range(5) for i in schedule.indices(s)]  # 20 positions: two epochs
  assert sorted(stream[:10]) == sorted(stream[10:]) == list(range(10))
  assert stream == list(schedule.order(0)) + list(schedule.order(1))
  assert [schedule.epoch(s) for s in range(6)] == [0, 0, 0, 1, 1, 2]  # step 2 starts in epoch 0


def test_epoch_mode_is_a_pure_function_of_seed_and_step():
  task = ArithmeticTask(max_digits=4)
  first = EpochSchedule(task, seed=5, num_prompts=12, per_step=4)
  again = EpochSchedule(task, seed=5, num_prompts=12, per_step=4)
  for step in (7, 0, 3, 7):  # in any order, in a fresh schedule (a resumed run)
    assert again.step_problems(step) == first.step_problems(step)
    assert step_problems(task, 5, step, 4, num_prompts=12) == first.step_problems(step)
  other = EpochSchedule(task, seed=6, num_prompts=12, per_step=4)
  assert [p.prompt for p in other.problems] != [p.prompt for p in first.problems]


def test_without_num_prompts_the_steps_draw_fresh_problems_as_before():
  task = ArithmeticTask(max_digits=4)
  for step in range(3):
    assert step_problems(task, 2, step, 5) == task.sample(np.random.default_rng([2, step]), 5)


def test_epoch_mode_refuses_too_few_prompts():
  with pytest.raises(ValueError, match=r"num_prompts=3 < prompts_per_step=4 would repeat a "
                                       r"prompt within a step; use num_prompts >= 4"):
    EpochSchedule(ArithmeticTask(), 0, 3, 4)
  with pytest.raises(ValueError, match=r"EpochSchedule.num_prompts must be a positive int"):
    EpochSchedule(ArithmeticTask(), 0, 0, 4)
  with pytest.raises(ValueError, match=r"TrainerConfig.num_prompts \(3\) is fewer than "
                                       r"prompts_per_step \(4\)"):
    TrainerConfig(num_prompts=3, prompts_per_step=4)
  with pytest.raises(ValueError, match=r"TrainerConfig.num_prompts must be an int >= 0"):
    TrainerConfig(num_prompts=-1)
  assert TrainerConfig(num_prompts=4, prompts_per_step=4).num_prompts == 4


class FewProblems:
  """A task with only three problems."""

  name = "few"

  def sample(self, rng, n):
    return [Problem(f"{i}+0=?", str(i), f" #{i}") for i in rng.integers(0, 3, n)]


def test_a_task_with_too_few_distinct_problems_is_named():
  assert sorted(p.prompt for p in sample_distinct(FewProblems(), np.random.default_rng(0), 3)) == \
      ["0+0=?", "1+0=?", "2+0=?"]
  with pytest.raises(ValueError, match=r"the task 'few' gave only 3 distinct prompts .* fewer "
                                       r"than the 4 asked for"):
    EpochSchedule(FewProblems(), 0, 4, 2)


def test_dataset_tasks_draw_their_prompt_set_without_replacement():
  task = MathDatasetTask(DATA)
  schedule = EpochSchedule(task, seed=0, num_prompts=5, per_step=5)
  assert sorted(p.answer for p in schedule.problems) == sorted(p.answer for p in task.problems)
  with pytest.raises(ValueError, match=r"math:gsm8k_tiny has 5 problems, fewer than the 6 "
                                       r"distinct ones asked for"):
    EpochSchedule(task, seed=0, num_prompts=6, per_step=2)
  gym = ReasoningGymTask("basic_arithmetic", size=6, seed=0)
  schedule = EpochSchedule(gym, seed=1, num_prompts=6, per_step=3)
  assert sorted(p.index for p in schedule.problems) == list(range(6))
  assert all(gym.reward(p, p.solution) == 1.0 for p in schedule.step_problems(1))
  with pytest.raises(ValueError, match=r"reasoning_gym:basic_arithmetic has 6 problems"):
    EpochSchedule(gym, seed=0, num_prompts=7, per_step=2)
