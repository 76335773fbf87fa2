"""What an RL run reads and fingerprints, as pure functions of the task and the seed: the
problems of a step (``step_problems``) and the held-out ones (``eval_problems``, described by
``held_out_line``), a problem's prompt ids (``encode_prompt``), a rollout's digest
(``tokens_digest``) and what a step metric follows (``metric_kind``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from tlt_jax.models.tokenizer import Tokenizer
from tlt_jax.rl.tasks import EpochSchedule, Problem, chat_prompt


# the held-out problems' generator seed: another stream than training's (seed, step) draws, which
# makes a held-out set disjoint from training only where the task keeps one (``eval_problems``)
EVAL_SEED = 10_000


def eval_problems(task, n: int, seed: int = EVAL_SEED) -> list[Problem]:
  """The fixed held-out problems ``GRPOTrainer.evaluate`` scores the policy on: the task's own
  ``sample_held_out`` where it has one (a file task's evaluation file or split, which training
  never draws), else ``task.sample``, a draw from the training pool itself (the built-in
  arithmetic task: the same problem may be drawn by both; ``held_out_line`` says which)."""
  rng = np.random.default_rng(seed)
  own = getattr(task, "sample_held_out", None)
  return own(rng, n) if callable(own) else task.sample(rng, n)


def held_out_line(task, n: int) -> str:
  """One line for the run's start: where its ``n`` held-out problems come from, and whether they
  are drawn from the training pool (the task's ``held_out_note`` where it has one)."""
  note = getattr(task, "held_out_note", None)
  if note is None:
    name = getattr(task, "name", type(task).__name__)
    return (f"held-out: {n} problems drawn from the training pool: {name}'s own generator with "
            f"seed {EVAL_SEED} (training's draws: (seed, step)), so a held-out problem can also "
            "be a training one")
  size = getattr(task, "held_out_size", None)
  repeat = f"; {n} evaluated, so some repeat" if size is not None and size < n else ""
  return f"{note}{repeat}"


def step_problems(task, seed: int, step: int, n: int, num_prompts: int = 0) -> list[Problem]:
  """The ``n`` problems of RL step ``step``: a pure function of (seed, step), so a resumed run sees
  the same data. ``num_prompts`` > 0: epoch mode, from a fixed set of that many problems
  (``EpochSchedule``; a trainer keeps one instead of drawing the set again every step)."""
  if num_prompts:
    return EpochSchedule(task, seed, num_prompts, n).step_problems(step)
  return task.sample(np.random.default_rng([seed, step]), n)


def encode_prompt(tokenizer: Tokenizer, problem: Problem, chat_template: bool) -> list[int]:
  """A problem's prompt ids: its chat-formatted text (``chat_template``), else BOS (if the
  tokenizer has one) and its text."""
  if chat_template:
    return tokenizer.encode(chat_prompt(tokenizer, problem.prompt))
  bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
  return bos + tokenizer.encode(problem.prompt)


def tokens_digest(tokens) -> int:
  """A 48-bit fingerprint of a rollout's completions (exact in a float64 metric): equal digests
  say two runs sampled the same tokens, row for row."""
  h = hashlib.sha256()
  for row in tokens:
    h.update(np.asarray(row, np.int64).tobytes())
    h.update(b"|")
  return int(h.hexdigest()[:12], 16)


# What a step's metrics follow (``metric_kind``). "timed": measured seconds or rates. "decided":
# counts and scores that follow decisions made from measured time: the tuner's arm per segment
# (arm shares, switches, accepted lengths, which executables a lazily compiled pool compiles),
# the drafter's budget (the steps the ledger granted or
# that fit in a tail) and so what the drafter learned (its losses and top-1). "exact": the
# policy's trajectory (rewards, lengths, rollout digests, policy losses, held-out evaluations),
# which with rollout.verify="coupled" (the default) follows the config and seed alone: every arm
# emits the tokens vanilla sampling draws. Every checkpoint saves the decisions' state (tuner,
# ledger), so a resumed run decides on from where it stopped.
_TIMED_SUFFIXES = ("_s", "_ms")  # of the name, or of its first part ("process_idle_s/1")
_TIMED_PREFIXES = ("arm_tps/",)
_DECIDED_PREFIXES = ("arm_share/", "arm_steps/", "accept_len/", "accept_share/", "drafter_",
                     "ledger_", "spot_", "tlt_", "tail_idle")
_DECIDED = ("mean_accept_len", "sd_switches", "decode_steps", "compiles", "segments")


def metric_kind(key: str) -> str:
  """"timed", "decided" or "exact": what a step metric ``key`` follows (see above)."""
  if key.split("/", 1)[0].endswith(_TIMED_SUFFIXES) or key.startswith(_TIMED_PREFIXES):
    return "timed"
  if key.startswith(_DECIDED_PREFIXES) or key in _DECIDED:
    return "decided"
  return "exact"
