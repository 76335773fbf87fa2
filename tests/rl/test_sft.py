"""The supervised warm start: packed rows, the masked LM step, greedy evaluation, warm_start."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.models.random_model import random_model
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.rl.sft import (PackedStream, SFTConfig, encode_problem, greedy_accuracy,
                            make_lm_step, warm_start)
from tlt_jax.rl.tasks import ArithmeticTask

TASK = ArithmeticTask(max_digits=4)
TOKENIZER = CharTokenizer(TASK.alphabet)
CONFIG = ModelConfig.tiny(vocab_size=TOKENIZER.vocab_size, eos_token_id=TOKENIZER.eos_token_id,
                          num_layers=1)
ROWS, ROW_LEN, SEED = 3, 64, 7


def drawn_problems(seed: int = SEED):
  """The problems a ``PackedStream`` with ``seed`` draws, in order (it asks for 256 at a time)."""
  return TASK.sample(np.random.default_rng(seed), 256)


def segments_of(batch: dict, row: int) -> list[tuple[int, int]]:
  """``(start, length)`` of each problem in a row, in order of their segment ids."""
  seg = batch["segment_ids"][row]
  out = []
  for k in range(1, seg.max() + 1):
    where = np.flatnonzero(seg == k)
    assert where.size and np.all(np.diff(where) == 1), f"segment {k} of row {row} is split"
    out.append((int(where[0]), int(where.size)))
  return out


def test_packed_rows_hold_whole_problems_in_draw_order():
  stream = PackedStream(TASK, TOKENIZER, ROWS, ROW_LEN, seed=SEED)
  first, second = stream.batch(), stream.batch()
  for name in ("ids", "positions", "segment_ids", "targets", "mask"):
    assert first[name].shape == (ROWS, ROW_LEN), name
  expected = [encode_problem(TOKENIZER, p) for p in drawn_problems()]
  seen = []
  for batch in (first, second):
    packed = []
    for r in range(ROWS):
      for start, n in segments_of(batch, r):
        ids = batch["ids"][r, start:start + n].tolist()
        assert ids[0] == TOKENIZER.bos_token_id and ids[-1] == TOKENIZER.eos_token_id
        np.testing.assert_array_equal(batch["positions"][r, start:start + n], np.arange(n))
        packed.append(ids)
      used = batch["segment_ids"][r] > 0
      assert used[:used.sum()].all() and np.all(batch["ids"][r][~used] == 0)  # padding at the end
    # first fit keeps a batch a prefix of the draws: sort both to compare as multisets
    batch_expected = [ids for ids, _ in expected[len(seen):len(seen) + len(packed)]]
    assert sorted(packed) == sorted(batch_expected)
    # the problem that did not fit starts the next batch, so nothing is skipped
    leftover = expected[len(seen) + len(packed)][0]
    assert all(ROW_LEN - (batch["segment_ids"][r] > 0).sum() < len(leftover) for r in range(ROWS))
    seen += packed
  assert len(seen) > ROWS  # rows really hold several problems


def test_loss_mask_covers_exactly_solution_and_eos():
  stream = PackedStream(TASK, TOKENIZER, ROWS, ROW_LEN, seed=SEED)
  batch = stream.batch()
  problems = {tuple(encode_problem(TOKENIZER, p)[0]): p for p in drawn_problems()}
  want_mask = np.zeros((ROWS, ROW_LEN), np.float32)
  for r in range(ROWS):
    for start, n in segments_of(batch, r):
      problem = problems[tuple(batch["ids"][r, start:start + n])]
      prompt_len = 1 + len(problem.prompt)
      # position t predicts token t + 1: solution tokens and EOS are predicted from
      # the last prompt token up to the token before EOS.
      want_mask[r, start + prompt_len - 1:start + n - 1] = 1
      predicted = batch["targets"][r, start + prompt_len - 1:start + n - 1]
      assert TOKENIZER.decode(predicted[:-1].tolist()) == problem.solution
      assert predicted[-1] == TOKENIZER.eos_token_id
  np.testing.assert_array_equal(batch["mask"], want_mask)
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["ids"][:, 1:])


def test_too_long_problem_is_rejected():
  stream = PackedStream(ArithmeticTask(max_digits=12, digit_exponent=0.01), TOKENIZER, 2, 16,
                        seed=0)
  with pytest.raises(ValueError, match="does not fit --row-len 16"):
    stream.batch()


def reference_loss(model, batch: dict) -> float:
  """Mean CE over solution + EOS tokens, each problem run alone (unpacked, causal, from 0)."""
  alone, masks = [], []
  for r in range(batch["ids"].shape[0]):
    for start, n in segments_of(batch, r):
      alone.append(np.pad(batch["ids"][r, start:start + n], (0, ROW_LEN - n)))
      masks.append(np.pad(batch["mask"][r, start:start + n], (0, ROW_LEN - n)))
  ids, mask = np.stack(alone), np.stack(masks)  # one problem per row, padded after it
  logp = np.asarray(jax.nn.log_softmax(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)), -1))
  picked = np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]
  return float(-(picked * mask[:, :-1]).sum() / mask.sum())


def test_lm_step_loss_is_the_unpacked_loss_and_falls_on_a_repeated_batch():
  model = random_model(CONFIG, seed=0)
  batch = PackedStream(TASK, TOKENIZER, ROWS, ROW_LEN, seed=SEED).batch()
  want = reference_loss(model, batch)
  graphdef, params = nnx.split(model)
  optimizer = optax.adam(1e-2)
  opt_state = optimizer.init(params)
  step = make_lm_step(graphdef, optimizer)
  losses = []
  for _ in range(25):
    params, opt_state, metrics = step(params, opt_state, batch)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses[0], want, rtol=1e-4)  # first loss: before any update
  assert float(metrics["tokens"]) == batch["mask"].sum()
  assert 0.0 <= float(metrics["token_acc"]) <= 1.0
  assert losses[-1] < 0.5 * losses[0], losses


class LengthTask(ArithmeticTask):
  """Arithmetic prompts, but a reward that tells any two completions apart: their length."""

  def reward(self, problem, completion):
    return float(len(completion))


def manual_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
  """Greedy completions by full forwards over a padded buffer (no cache, no engine)."""
  width = max(map(len, prompts)) + max_new_tokens
  ids = np.zeros((len(prompts), width), np.int32)
  lengths = np.array([len(p) for p in prompts])
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  graphdef, params = nnx.split(model)
  logits_fn = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
  out = [[] for _ in prompts]
  done = np.zeros(len(prompts), bool)
  for _ in range(max_new_tokens):
    logits = np.asarray(logits_fn(params, jnp.asarray(ids)))
    for i in np.flatnonzero(~done):
      token = int(np.argmax(logits[i, lengths[i] - 1]))
      ids[i, lengths[i]] = token
      lengths[i] += 1
      out[i].append(token)
      done[i] = token == TOKENIZER.eos_token_id
  return out


def test_greedy_accuracy_agrees_with_a_plain_greedy_decode():
  model = random_model(CONFIG, seed=0, scale=0.3)  # varied completions, some stop early
  task = LengthTask(max_digits=12)
  problems = [task.make_problem(a, b) for a, b in
              [(3, 4), (12, 5), (123, 45), (9999, 1), (123456, 7), (4, 98765432)]]
  prompts = [[TOKENIZER.bos_token_id] + TOKENIZER.encode(p.prompt) for p in problems]
  tokens = manual_greedy(model, prompts, max_new_tokens=12)
  texts = [TOKENIZER.decode(t, skip_special_tokens=True) for t in tokens]
  rewards = np.array([task.reward(p, t) for p, t in zip(problems, texts)])
  assert len(set(texts)) == len(texts) and min(map(len, tokens)) < 12, texts

  result = greedy_accuracy(model, TOKENIZER, task, problems, max_new_tokens=12)
  assert result["example"] == texts[0] and result["example_prompt"] == problems[0].prompt
  assert result["accuracy"] == pytest.approx(rewards.mean())
  assert result["accuracy_by_digits"] == pytest.approx(
      {"1-2": rewards[:2].mean(), "3-5": rewards[2:4].mean(), "6-12": rewards[4:].mean()})
  assert result["mean_completion_len"] == pytest.approx(np.mean([len(t) for t in tokens]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=-1), "steps must be an int >= 0"),
    (dict(steps=2.0), "steps must be an int >= 0"),
    (dict(steps=True), "steps must be an int >= 0"),
    (dict(rows=0), "SFTConfig.rows must be a positive int"),
    (dict(row_len=-4), "SFTConfig.row_len must be a positive int"),
    (dict(row_len=8.0), "SFTConfig.row_len must be a positive int"),
    (dict(learning_rate=0.0), "learning_rate must be > 0"),
    (dict(learning_rate=-1e-3), "learning_rate must be > 0"),
    (dict(learning_rate="3e-3"), "learning_rate must be > 0"),
    (dict(learning_rate=float("inf")), "learning_rate must be > 0 and finite, got inf"),
])
def test_sft_config_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SFTConfig(**kwargs)


def test_sft_config_accepts_valid_values():
  config = SFTConfig(steps=0, rows=1, row_len=1, learning_rate=1)
  assert (config.steps, config.rows, config.row_len, config.learning_rate) == (0, 1, 1, 1)


def test_warm_start_lowers_the_loss_and_reports_each_step():
  model = random_model(CONFIG, seed=0, scale=0.02)
  before = jax.tree.map(np.asarray, nnx.state(model))
  calls = []
  config = SFTConfig(steps=30, rows=ROWS, row_len=ROW_LEN, learning_rate=1e-2)
  trained, last = warm_start(model, TOKENIZER, TASK, config, seed=SEED,
                             progress=lambda step, m: calls.append((step, float(m["loss"]))))
  assert [step for step, _ in calls] == list(range(1, 31))
  losses = [loss for _, loss in calls]
  assert last["loss"] == pytest.approx(losses[-1])
  assert np.mean(losses[-5:]) < 0.75 * losses[0], losses
  assert set(last) >= {"loss", "token_acc", "tokens"}
  assert not all(np.array_equal(a, np.asarray(b)) for a, b in
                 zip(jax.tree.leaves(before), jax.tree.leaves(nnx.state(trained))))


def test_warm_start_with_no_steps_is_a_no_op():
  model = random_model(CONFIG, seed=0, scale=0.02)
  calls = []
  out, metrics = warm_start(model, TOKENIZER, TASK, SFTConfig(steps=0), seed=0,
                            progress=lambda *a: calls.append(a))
  assert out is model and metrics == {} and calls == []


def test_the_warm_start_stream_draws_the_same_problems_whatever_the_teacher():
  """A flawed teacher changes only the answers of its share of sums with a final carry: the
  problems drawn, past the stream's first refill of 256, stay those of ``teacher_error=0``, and
  a perfect teacher's rows are bit for bit the same again."""
  import collections  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  def drawn(teacher_error):
    stream = PackedStream(dataclasses.replace(TASK, teacher_error=teacher_error), TOKENIZER, 8,
                          256, seed=SEED)
    batches = [stream.batch() for _ in range(5)]
    text = "".join(TOKENIZER.decode([int(t)]) if t > 2 else " "  # specials split problems
                   for b in batches for t in b["ids"].ravel())
    return batches, re.findall(r"\d+\+\d+=\?", text), re.findall(r"#\d+", text)
  (perfect, prompts, answers), (again, *_) = drawn(0.0), drawn(0.0)
  for a, b in zip(perfect, again):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  _, flawed_prompts, flawed_answers = drawn(0.5)
  # first-fit packing may move a problem to the next batch (shorter answers fit otherwise), so
  # the problems are compared as a multiset, past the first refill of 256
  n = min(len(prompts), len(flawed_prompts))
  both = collections.Counter(prompts[:n]) & collections.Counter(flawed_prompts[:n])
  common = sum(both.values())
  assert n > 256 and common >= n - 8, (n, common)
  assert flawed_answers[:n] != answers[:n]
