"""The rollout's own history: per prompt, the newest earlier completions of it, kept on the host for
a suffix drafter to draft from (``Rollout.generate(history=...)``).

RL revisits its prompts (every epoch, ``TrainerConfig.num_prompts``), and an earlier response to a
prompt is often a good guess of the next one. ``HistoryStore`` keeps, per prompt, the newest
``HistoryConfig.per_prompt`` completions, newest first, within a budget of ``max_bytes``: over
budget, the prompts added to least recently go first. Its ``state_dict`` is JSON (the tokens as
base64 of little-endian int32), saved in the RL checkpoint's metadata, and restores exactly: the
same completions in the same order, and the same eviction order.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np

from tlt_jax.utils import require_positive_ints

# what a completion costs in the budget: its tokens as int32, plus an estimate of what holding it
# costs beside them (the array's header, its slot in the prompt's list), and per prompt its key and
# entry; a prompt's cost is PROMPT_BYTES + sum(COMPLETION_BYTES + TOKEN_BYTES * len(completion))
TOKEN_BYTES = 4
COMPLETION_BYTES = 112
PROMPT_BYTES = 160
STATE_FORMAT = 1
_KEY_CHARS = 32  # a prompt's key: the hex blake2b-128 digest of its ids as little-endian int32
_STATE_KEYS = {"format", "max_bytes", "per_prompt", "prompts", "tokens"}
_MAX_ID = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class HistoryConfig:
  """Bounds of the ``HistoryStore``: ``max_bytes`` for everything it holds (tokens counted as 4
  bytes, plus a fixed overhead per completion and per prompt: ``completion_cost``), and the
  newest ``per_prompt`` completions kept per prompt."""

  max_bytes: int = 8 * 2**20
  per_prompt: int = 16

  def __post_init__(self):
    require_positive_ints(self, "max_bytes", "per_prompt")


def completion_cost(n_tokens: int) -> int:
  """Bytes a completion of ``n_tokens`` tokens counts for in the budget."""
  return COMPLETION_BYTES + TOKEN_BYTES * n_tokens


def _prompt_cost(completions: Sequence[np.ndarray]) -> int:
  return PROMPT_BYTES + sum(completion_cost(c.size) for c in completions) if completions else 0


def _token_ids(ids, what: str) -> np.ndarray:
  """``ids`` (a sequence of token ids) as a little-endian int32 array, or a ValueError."""
  if isinstance(ids, (str, bytes)):
    raise ValueError(f"{what} must be a sequence of token ids, got {ids!r}")
  array = np.asarray(ids)
  if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
    raise ValueError(f"{what} must be a flat sequence of int token ids, got an array of shape "
                     f"{array.shape} and dtype {array.dtype}")
  if array.size and (array.min() < 0 or array.max() > _MAX_ID):
    raise ValueError(f"{what} holds token ids outside 0..{_MAX_ID}: min {array.min()}, max "
                     f"{array.max()}")
  return array.astype("<i4")


def prompt_key(prompt_ids) -> str:
  """The store's key of a prompt: a stable hash (hex blake2b-128) of its token ids."""
  data = _token_ids(prompt_ids, "a prompt").tobytes()
  return hashlib.blake2b(data, digest_size=_KEY_CHARS // 2).hexdigest()


class HistoryStore:
  """Per prompt, its newest earlier completions (newest first), bounded in bytes, on the host.

  ``add`` one prompt's group after its step, ``lookup`` the step's prompts before it. Within one
  ``add`` the completions keep their order (the group's first row first), ahead of the older ones.
  Empty completions are not kept (there is nothing to draft from).
  """

  def __init__(self, config: HistoryConfig = HistoryConfig()):
    if not isinstance(config, HistoryConfig):
      raise TypeError(f"HistoryStore takes a HistoryConfig, got {config!r}")
    self.config = config
    # prompt key -> completions, newest first; the prompts in the order they were last added to
    # (the first is evicted first)
    self._prompts: collections.OrderedDict[str, list[np.ndarray]] = collections.OrderedDict()
    self._bytes = 0

  @property
  def size_bytes(self) -> int:
    """What the store holds, in the budget's bytes (never above ``config.max_bytes``)."""
    return self._bytes

  @property
  def num_prompts(self) -> int:
    """How many prompts have at least one completion kept."""
    return len(self._prompts)

  def add(self, prompt_ids, completions: Sequence[Sequence[int]]) -> None:
    """Adds one prompt's completions (its group of one step) as its newest; keeps the newest
    ``per_prompt`` of the prompt's and then evicts, least recently added-to prompt first, until
    the store fits ``max_bytes`` (the prompt added to last loses its oldest completions only when
    it alone is over budget)."""
    key = prompt_key(prompt_ids)
    if isinstance(completions, (str, bytes)) or not hasattr(completions, "__iter__"):
      raise ValueError(f"completions must be a sequence of token-id sequences, got "
                       f"{type(completions).__name__}")
    new = [_token_ids(c, f"completion {i}") for i, c in enumerate(completions)]
    new = [c for c in new if c.size]
    for c in new:
      c.flags.writeable = False  # lookup(arrays=True) hands these out
    if not new:
      return
    old = self._prompts.pop(key, [])
    kept = (new + old)[:self.config.per_prompt]
    self._bytes += _prompt_cost(kept) - _prompt_cost(old)
    self._prompts[key] = kept
    self._evict()

  def _evict(self) -> None:
    """Drops whole prompts, least recently added-to first, and then the newest prompt's oldest
    completions, until the store fits its budget."""
    while self._bytes > self.config.max_bytes:
      key, completions = next(iter(self._prompts.items()))
      if len(self._prompts) > 1 or len(completions) == 1:
        del self._prompts[key]
        self._bytes -= _prompt_cost(completions)
      else:
        self._bytes -= _prompt_cost(completions) - _prompt_cost(completions[:-1])
        completions.pop()

  def lookup(self, prompts: Sequence[Sequence[int]], arrays: bool = False) -> list[list[Any]]:
    """Per prompt, its kept completions as lists of ids, newest first (``[]`` for one never
    added); the store is unchanged (a lookup does not count as an add for eviction).
    ``arrays``: the completions as the store's own read-only int32 arrays instead (no copy: what
    the rollout packs for its suffix drafter)."""
    if arrays:
      return [list(self._prompts.get(prompt_key(p), ())) for p in prompts]
    return [[c.tolist() for c in self._prompts.get(prompt_key(p), ())] for p in prompts]

  def has(self, prompt_ids) -> bool:
    """Whether the store holds a completion of the prompt."""
    return prompt_key(prompt_ids) in self._prompts

  # ---- checkpoints ----------------------------------------------------------------------------
  def state_dict(self) -> dict[str, Any]:
    """JSON: the bounds it was kept with, per prompt (in eviction order: the first goes first)
    its key and completion lengths (newest first), and every token as one base64 string."""
    tokens = [c for completions in self._prompts.values() for c in completions]
    data = np.concatenate(tokens).astype("<i4").tobytes() if tokens else b""
    return {"format": STATE_FORMAT, "max_bytes": self.config.max_bytes,
            "per_prompt": self.config.per_prompt,
            "prompts": [[key, [int(c.size) for c in completions]]
                        for key, completions in self._prompts.items()],
            "tokens": base64.b64encode(data).decode("ascii")}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Replaces the contents with a ``state_dict()``'s, exactly; a malformed state raises a
    ValueError saying what is wrong (and changes nothing). Bounds smaller than the saved ones
    (another ``HistoryConfig``) then apply as ``add`` would: the oldest completions and prompts
    go."""
    prompts, total = _parse_state(state)
    self._prompts, self._bytes = prompts, total
    for key, completions in list(self._prompts.items()):
      if len(completions) > self.config.per_prompt:
        self._bytes -= _prompt_cost(completions) - _prompt_cost(
            completions[:self.config.per_prompt])
        del completions[self.config.per_prompt:]
    self._evict()


def _parse_state(state) -> tuple[collections.OrderedDict[str, list[np.ndarray]], int]:
  """The contents of a ``HistoryStore.state_dict()`` and their bytes, checked throughout."""
  where = "HistoryStore state"
  if not isinstance(state, dict):
    raise ValueError(f"{where} must be a dict (a HistoryStore.state_dict()), got "
                     f"{type(state).__name__}")
  missing, unknown = sorted(_STATE_KEYS - set(state)), sorted(set(state) - _STATE_KEYS)
  if missing or unknown:
    raise ValueError(f"{where} must have the keys {sorted(_STATE_KEYS)}; missing {missing}, "
                     f"unknown {unknown}")
  if state["format"] != STATE_FORMAT:
    raise ValueError(f"{where} has format {state['format']!r}; this version reads format "
                     f"{STATE_FORMAT}")
  try:
    saved = HistoryConfig(max_bytes=state["max_bytes"], per_prompt=state["per_prompt"])
  except ValueError as e:
    raise ValueError(f"{where}: its bounds are not a HistoryConfig: {e}") from None
  tokens = _state_tokens(state, where)
  prompts, at, total = _state_prompts(state["prompts"], tokens, saved, where)
  if at != tokens.size:
    raise ValueError(f"{where}: 'tokens' holds {tokens.size} token ids but the prompts' "
                     f"completion lengths add up to {at}")
  if total > saved.max_bytes:
    raise ValueError(f"{where} holds {total} bytes, over its own max_bytes={saved.max_bytes}")
  return prompts, total


def _state_tokens(state: dict, where: str) -> np.ndarray:
  """A state's ``tokens``: base64 of little-endian int32 ids, none negative."""
  if not isinstance(state["tokens"], str):
    raise ValueError(f"{where}: 'tokens' must be a base64 string, got "
                     f"{type(state['tokens']).__name__}")
  try:
    data = base64.b64decode(state["tokens"].encode("ascii"), validate=True)
  except (binascii.Error, UnicodeEncodeError) as e:
    raise ValueError(f"{where}: 'tokens' is not valid base64 ({e})") from None
  if len(data) % TOKEN_BYTES:
    raise ValueError(f"{where}: 'tokens' holds {len(data)} bytes, not a whole number of int32 "
                     "token ids")
  tokens = np.frombuffer(data, "<i4")
  if tokens.size and tokens.min() < 0:
    raise ValueError(f"{where}: 'tokens' holds a negative token id ({tokens.min()})")
  return tokens


def _state_prompts(entries, tokens: np.ndarray, saved: HistoryConfig, where: str
                   ) -> tuple[collections.OrderedDict[str, list[np.ndarray]], int, int]:
  """A state's ``prompts`` ([key, completion lengths] pairs) cut from ``tokens`` in order: the
  prompts, how many tokens they took and their bytes."""
  if not isinstance(entries, list):
    raise ValueError(f"{where}: 'prompts' must be a list of [key, lengths] pairs, got "
                     f"{type(entries).__name__}")
  prompts: collections.OrderedDict[str, list[np.ndarray]] = collections.OrderedDict()
  at, total = 0, 0
  for i, entry in enumerate(entries):
    name = f"{where}: prompts[{i}]"
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
      raise ValueError(f"{name} must be a [key, lengths] pair, got {entry!r:.80}")
    key, lengths = entry
    if not (isinstance(key, str) and len(key) == _KEY_CHARS
            and all(ch in "0123456789abcdef" for ch in key)):
      raise ValueError(f"{name} has the key {key!r:.80}; a key is {_KEY_CHARS} lowercase hex "
                       "digits")
    if key in prompts:
      raise ValueError(f"{name} repeats the key {key} of an earlier prompt")
    if not (isinstance(lengths, (list, tuple)) and 1 <= len(lengths) <= saved.per_prompt
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                    for n in lengths)):
      raise ValueError(f"{name} must list 1 to per_prompt={saved.per_prompt} completion lengths "
                       f"(ints >= 1), got {lengths!r:.80}")
    if at + sum(lengths) > tokens.size:
      raise ValueError(f"{where}: the prompts' completion lengths need more than the "
                       f"{tokens.size} tokens of 'tokens' (ran out at prompts[{i}])")
    completions = []
    for n in lengths:
      completions.append(tokens[at:at + n].copy())
      at += n
    prompts[key] = completions
    total += _prompt_cost(completions)
  return prompts, at, total
