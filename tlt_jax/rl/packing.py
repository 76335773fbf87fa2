"""The layout of a step's rows for the policy update: pure numpy, no model, no device.

A step's rollout becomes one padded batch (``padded_batch``: one sequence per row from position 0,
with the completion's mask, old log-probs and advantages). Each minibatch of it is then packed,
first-fit decreasing, into rows of the shortest length of a fixed ladder (``update_buckets``)
that holds its longest sequence, sequences lying back to back and each attending only to itself
(``packed_microbatches``: positions restart at 0, ``segments`` says which sequence a token is
of). ``plan_packs`` picks the lengths and rows; ``bucket_rows`` how many packed rows one
micro-batch of a length holds. Every shape is one of a fixed set, so the update compiles once
per length.
"""

from __future__ import annotations

import numpy as np

from tlt_jax.rl import grpo

UPDATE_BUCKET_MIN = 16  # the shortest packed-row length of a packed policy update


def padded_batch(prompts, completions, logprobs, advantages, length: int,
                 pad_token_id: int = 0) -> dict[str, np.ndarray]:
  """Fixed-shape arrays of a step's rows, each prompt + completion from position 0: ids
  ``[N, length]``, and per predicted token ``[N, length - 1]`` (the logit at t predicts token
  t + 1) the completion's mask and old log-probs; advantages ``[N]``."""
  n = len(prompts)
  ids = np.full((n, length), pad_token_id, np.int32)
  mask = np.zeros((n, length - 1), np.float32)
  old = np.zeros((n, length - 1), np.float32)
  for i, (prompt, comp, lp) in enumerate(zip(prompts, completions, logprobs)):
    seq = prompt + comp
    ids[i, :len(seq)] = seq
    start = len(prompt) - 1  # the logit at position t predicts token t + 1
    mask[i, start:start + len(comp)] = 1.0
    old[i, start:start + len(comp)] = lp
  return dict(ids=ids, mask=mask, old_logprobs=old, advantages=np.asarray(advantages, np.float32))


def update_buckets(seq_len: int, smallest: int = UPDATE_BUCKET_MIN) -> tuple[int, ...]:
  """Packed-row lengths of a packed update: the powers of two from ``smallest`` that are below
  ``seq_len``, then ``seq_len`` itself (the longest row a step can hold)."""
  if seq_len < 2 or smallest < 2:
    raise ValueError(f"update buckets need seq_len >= 2 and smallest >= 2, got {seq_len}, "
                     f"{smallest}")
  ladder, length = [], smallest
  while length < seq_len:
    ladder.append(length)
    length *= 2
  return tuple(ladder) + (seq_len,)


def bucket_rows(length: int, update_tokens: int, minibatch_rows: int, devices: int) -> int:
  """Rows of a micro-batch of ``length`` tokens: ``update_tokens // length``, at most the
  minibatch, rounded down to a multiple of ``devices`` and at least ``devices``."""
  rows = min(minibatch_rows, max(devices, update_tokens // length))
  return max(devices, rows - rows % devices)


def needed_lengths(mask: np.ndarray) -> np.ndarray:
  """Per row of a padded batch, how many leading tokens its loss needs: its last trained
  position + 2 (prompt + completion length), 0 for a row with nothing to train on."""
  valid = np.asarray(mask) > 0
  last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
  return np.where(valid.any(axis=1), last + 2, 0)


def pack_length(lengths: np.ndarray, buckets: tuple[int, ...]) -> int:
  """The packed-row length of a minibatch: the shortest bucket that holds its longest row (the
  shortest bucket when no row has anything to train on)."""
  longest = int(np.max(lengths, initial=0))
  fits = [b for b in buckets if b >= longest]
  if not fits:
    raise ValueError(f"a row of {longest} tokens exceeds the longest update bucket {buckets[-1]}")
  return fits[0]


def pack_rows(lengths: np.ndarray, length: int) -> list[list[int]]:
  """Packs rows into packed rows of ``length`` tokens by first-fit decreasing: each row, longest
  first, goes into the first packed row with room for it, else opens a new one. Returns each
  packed row's row indices, in placement order (its sequences lie back to back in that order).
  Rows of length 0 (nothing to train on) are left out; every other row is in exactly one."""
  lengths = np.asarray(lengths)
  packs: list[list[int]] = []
  free: list[int] = []
  for i in np.argsort(-lengths, kind="stable"):
    n = int(lengths[i])
    if n <= 0:
      break  # the rest are empty too
    if n > length:
      raise ValueError(f"a row of {n} tokens does not fit in a packed row of {length}")
    for k, room in enumerate(free):
      if room >= n:
        packs[k].append(int(i))
        free[k] -= n
        break
    else:
      packs.append([int(i)])
      free.append(length - n)
  return packs


def plan_packs(lengths: np.ndarray, buckets: tuple[int, ...],
               rows_of: dict[int, int]) -> list[tuple[int, list[list[int]]]]:
  """Packs a minibatch's rows into packed rows of several lengths: ``[(T, packs), ...]``, the
  longest ``T`` first, ``len(packs)`` a multiple of ``rows_of[T]`` (whole micro-batches).

  The longest remaining row picks ``T`` (``pack_length``); the rows whose own bucket is ``T`` are
  packed by first-fit decreasing (``pack_rows``), the packed rows rounded up to whole
  micro-batches, and all their room, the added empty rows included, filled first-fit with the
  shorter remaining rows: a micro-batch's rows are computed anyway, so a short row costs nothing
  there. What is left goes to the next, shorter ``T``. Every non-empty row lands once."""
  lengths = np.asarray(lengths)
  own = {int(i): pack_length(lengths[i:i + 1], buckets) for i in np.flatnonzero(lengths > 0)}
  remaining = [i for i in np.argsort(-lengths, kind="stable").tolist() if lengths[i] > 0]
  plan = []
  while remaining:
    length = own[remaining[0]]
    group = [i for i in remaining if own[i] == length]
    mine = np.zeros_like(lengths)
    mine[group] = lengths[group]
    packs = pack_rows(mine, length)
    size = rows_of[length]
    packs += [[] for _ in range(-len(packs) % size)]
    free = [length - int(sum(lengths[i] for i in pack)) for pack in packs]
    left = []
    for i in remaining[len(group):]:  # sorted longest first: the group leads
      k = next((k for k, room in enumerate(free) if room >= lengths[i]), None)
      if k is None:
        left.append(i)
      else:
        packs[k].append(i)
        free[k] -= int(lengths[i])
    plan.append((length, packs))
    remaining = left
  return plan


def packed_microbatches(mini: dict[str, np.ndarray], packs: list[list[int]], length: int,
                        size: int, loss_agg: str,
                        pad_token_id: int = 0) -> list[dict[str, np.ndarray]]:
  """A minibatch (``padded_batch``'s arrays of its rows) laid out as packed micro-batches of
  ``size`` packed rows of ``length`` tokens, ``packs`` (``pack_rows``) in order, the last
  micro-batch filled up with empty packed rows (mask 0: they contribute nothing).

  Per token: ``ids``, ``positions`` (from 0 in each sequence) and ``segments`` (the sequence's
  row in ``mini``; -1 on padding). Per predicted token (``[size, length - 1]``; the logit at t
  predicts token t + 1): ``mask`` (1 where t + 1 is a completion token of the same sequence),
  ``old_logprobs``, ``advantages`` (the sequence's) and ``weights`` (the token's weight in the
  minibatch's loss, ``grpo.loss_weights`` of the whole minibatch).
  """
  lengths = needed_lengths(mini["mask"])
  weights = grpo.loss_weights(mini["mask"], loss_agg)
  count = -(-len(packs) // size)
  shape, pred = (count * size, length), (count * size, length - 1)
  out = dict(ids=np.full(shape, pad_token_id, np.int32), positions=np.zeros(shape, np.int32),
             segments=np.full(shape, -1, np.int32), mask=np.zeros(pred, np.float32),
             old_logprobs=np.zeros(pred, np.float32), advantages=np.zeros(pred, np.float32),
             weights=np.zeros(pred, np.float32))
  for r, i, at, n in placements(packs, lengths):
    tok, prd = np.s_[r, at:at + n], np.s_[r, at:at + n - 1]
    out["ids"][tok] = mini["ids"][i, :n]
    out["positions"][tok] = np.arange(n)
    out["segments"][tok] = i
    out["mask"][prd] = mini["mask"][i, :n - 1]
    out["old_logprobs"][prd] = mini["old_logprobs"][i, :n - 1]
    out["advantages"][prd] = mini["advantages"][i]
    out["weights"][prd] = weights[i, :n - 1]
  return [{k: v[j * size:(j + 1) * size] for k, v in out.items()} for j in range(count)]


def unpack_predictions(values: np.ndarray, packs: list[list[int]], lengths: np.ndarray,
                       out: np.ndarray) -> np.ndarray:
  """Writes per-predicted-token ``values`` of packed rows (``[len(packs), T - 1]``, the rows of
  ``packed_microbatches`` for these ``packs``) back to their sequences' rows of ``out``
  (``[rows, L - 1]``, as in ``padded_batch``); ``lengths``: the sequences' ``needed_lengths``.
  Returns ``out``."""
  for r, i, at, n in placements(packs, lengths):
    out[i, :n - 1] = values[r, at:at + n - 1]
  return out


def placements(packs: list[list[int]], lengths: np.ndarray):
  """Where ``packs`` put each sequence: ``(packed row, sequence, offset, length)``, the sequences
  of a packed row back to back from offset 0 in pack order (``packed_microbatches`` lays them out
  so, ``unpack_predictions`` reads them back so)."""
  for r, pack in enumerate(packs):
    at = 0
    for i in pack:
      n = int(lengths[i])
      yield r, i, at, n
      at += n
