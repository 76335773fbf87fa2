"""The rollout interface: what the trainer (or any caller) uses of a rollout, whether it decodes on
one device (``RolloutEngine``) or data-parallel over several (``DataParallelRollout``).

A caller never needs to know which one it holds: both take the trainer's params as they are (for
example replicated over a mesh) and place them on their own device(s), both accept the
``IdleWork`` of ``generate`` (work on the devices the tail leaves idle), and both save and restore their tuner the same way. The
request checks both run at the edge (``check_prompts``, ``collect_mask``) live here too.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax import hosts
from tlt_jax.rollout import processes
from tlt_jax.rollout.decode.kinds import DrafterKind
from tlt_jax.rollout.decode.sampling import SamplingParams


def on_device(tree, device):
  """``tree`` with every array on ``device``: an array that already has a full copy there (e.g. a
  replicated array's shard) is used as is (zero-copy), anything else is copied with
  ``device_put``."""
  def put(x):
    if isinstance(x, jax.Array):
      for shard in x.addressable_shards:
        if shard.device == device and shard.data.shape == x.shape:
          # a single-device array whatever ``x``'s sharding (``shard.data`` of a one-device
          # mesh's array keeps the mesh's; device_put onto its own device re-labels it without a
          # copy). Its type may still name the mesh: the pool lowers from shapes and the device
          # alone (ExecutablePool.weights_spec), so a resumed run hits its first run's cache
          return jax.device_put(shard.data, device)
    return jax.device_put(x, device)
  return jax.tree.map(put, tree)


class IdleWork(Protocol):
  """Work a rollout runs on the devices its tail leaves idle (drafter training is one user:
  ``OnlineDrafter.idle_work``). A rollout over several devices calls ``shard_done`` in a
  device's thread once that device's shard is complete, then ``idle`` there while other devices
  still decode; a rollout on one device calls ``shard_done(0, row_offset, result)`` and never
  ``idle``. ``first_row`` counts in the whole request (``row_offset`` included: a process's
  rows start there), so any rollout can hand the same ``IdleWork`` to the one it runs on."""

  def shard_done(self, device_index: int, first_row: int, result: Any) -> None:
    """Device ``device_index`` completed its shard, whose first row is ``first_row`` of the
    request (of every process's rows, over processes); ``result`` its ``RolloutResult``."""

  def idle(self, device_index: int, stop: threading.Event) -> Any:
    """Runs on the idle device ``device_index`` and returns soon after ``stop`` is set (when the
    last shard completes); what it returns goes to ``stats.idle[device_index]``."""


class Rollout(abc.ABC):
  """A rollout: ``generate`` completions for a list of prompts with the weights it was last given.

  Implementations also hold the attributes annotated below (plain or as properties).
  """

  config: Any  # the EngineConfig
  devices: list  # where it decodes (this process's devices), in shard order
  tuner: Any  # the adaptive engine's tuner, or None
  drafter_params: nnx.State | None  # the weights the (first) device drafts with
  # Set by ``make_rollout`` where JAX runs several processes: ``generate`` then decodes this
  # process's share of the rows and every process gets every row, and the tuner is saved per
  # process (``processes.py``). False: this process decodes every row it is given.
  over_processes: bool = False

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
               progress: Callable[[int, int], Any] | None = None, *, row_offset: int = 0,
               collect_hidden: bool | float | Sequence[bool] = False,
               idle_work: IdleWork | None = None,
               history: Sequence[Sequence[Sequence[int]]] | None = None):
    """Completes every prompt; returns a ``RolloutResult``. Row ``i`` samples with the keys of
    row ``i + row_offset``. ``progress(rows_done, rows_total)`` is called as rows finish.
    ``collect_hidden`` (needs a learned drafter) fills ``RolloutResult.hidden`` for all rows
    (True), a seeded fraction (float) or one bool per prompt. ``idle_work.shard_done`` is called
    once per device's finished shard, ``idle_work.idle`` while other devices still decode (never
    on one device; ``IdleWork``). ``history``: per prompt, earlier completions of it (newest
    first) that a suffix drafter may draft from (``uses_history``); ignored by a rollout without
    one. Over several processes (``over_processes``): ``processes.generate_over_processes``; else
    ``generate_here``."""
    options = dict(row_offset=row_offset, collect_hidden=collect_hidden, idle_work=idle_work,
                   history=history)
    if self.shares_processes:
      return processes.generate_over_processes(self, prompts, params, progress, **options)
    return self.generate_here(prompts, params, progress, **options)

  @abc.abstractmethod
  def generate_here(self, prompts: Sequence[Sequence[int]],
                    params: SamplingParams = SamplingParams(),
                    progress: Callable[[int, int], Any] | None = None, *, row_offset: int = 0,
                    collect_hidden: bool | float | Sequence[bool] = False,
                    idle_work: IdleWork | None = None,
                    history: Sequence[Sequence[Sequence[int]]] | None = None):
    """``generate`` on this process's devices alone (the arguments are ``generate``'s)."""

  @property
  def shares_processes(self) -> bool:
    """Whether ``generate`` shares the rows over the processes: ``over_processes`` and JAX runs
    more than one."""
    return self.over_processes and hosts.process_count() > 1

  # ---- the request checks every rollout runs at its edge -----------------------------------------
  @abc.abstractmethod
  def check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The prompts as lists of Python ints; a ``ValueError`` names the first bad one
    (``interface.check_prompts``)."""

  @abc.abstractmethod
  def check_history(self, history, n: int, observe: bool = True):
    """``generate``'s ``history`` as int32 arrays (None: none, or no suffix drafter to use it); a
    ``ValueError`` names the first malformed entry; ``observe``: the tuner hears of a change in
    the share of prompts that have one."""

  @abc.abstractmethod
  def collect_mask(self, collect_hidden, n: int, seed: int) -> np.ndarray | None:
    """Which of ``n`` rows return hidden states (``interface.collect_mask``)."""

  @property
  def uses_history(self) -> bool:
    """Whether ``generate`` drafts from the ``history`` it is given (a suffix drafter)."""
    return False

  @abc.abstractmethod
  def update_params(self, params: nnx.State, drafter_params: nnx.State | None = None) -> None:
    """Swaps in new target (and optionally drafter) weights of the same shapes, placing them on
    this rollout's device(s) itself; no recompiles."""

  @abc.abstractmethod
  def target_params(self, index: int = 0) -> nnx.State:
    """The target weights device ``index`` decodes with (on that device)."""

  @abc.abstractmethod
  def strategies_for(self, batch: int) -> list:
    """The strategies that may decode a ``batch`` bucket (the first is the default)."""

  @abc.abstractmethod
  def executable_keys(self) -> list[tuple]:
    """The keys of every executable ``precompile`` may compile."""

  @abc.abstractmethod
  def precompile(self, progress: Callable[[int, int], Any] | None = None, *,
                 background: bool = False, first_rows: Sequence[int] | None = None) -> int:
    """Compiles the executables the rollout may run; returns how many were compiled now
    (``background``: the speculative arms' compile in a thread, offered once they exist;
    ``first_rows``: the row counts of the first requests, where only what they start with
    compiles now and the rest in that thread, if the rollout supports it)."""

  def learned_sd_possible(self) -> bool:
    """Whether a speculative arm that the learned drafter drafts is offered somewhere, or may
    still be; False: training that drafter cannot pay on this machine."""
    return True

  def observe_drafter(self, quality: float | None = None,
                      source: str = DrafterKind.LEARNED) -> None:
    """The drafter of ``source`` (a ``DrafterKind``) changed (``LEARNED``: its weights;
    ``SUFFIX``: the history it drafts from); ``quality``: the held-out top-1 of what drafted
    until now (None: unknown). The tuner re-judges the speculative arms of that drafter alone
    (``Tuner.observe_drafter``)."""
    if self.tuner is not None:
      self.tuner.observe_drafter(quality, source=source)

  # ---- the tuner in checkpoints --------------------------------------------------------------
  def tuner_state(self) -> dict | None:
    """What the adaptive engine's tuner learned (its ``state_dict``), or None without one; over
    several processes, every process's (``processes.gathered_tuner_state``)."""
    mine = None if self.tuner is None else self.tuner.state_dict()
    return processes.gathered_tuner_state(mine) if self.shares_processes else mine

  def load_tuner_state(self, saved: dict | None, report: Callable[[str], Any] = print) -> None:
    """Loads a checkpoint's tuner state into the tuner (over several processes, this process's
    entry: ``processes.own_tuner_state``). One of another kind (the run was resumed with
    another ``tuner.kind``) is reported and left: the tuner starts fresh."""
    if self.shares_processes:
      saved = processes.own_tuner_state(saved, report)
    tuner = self.tuner
    if saved is None or tuner is None:
      return
    if saved.get("kind") != tuner.config.kind:
      report(f"the checkpoint's tuner state is of kind {saved.get('kind')!r} but this rollout "
             f"engine's tuner is {tuner.config.kind!r}: the tuner starts fresh (set the tuner's "
             f"kind back to {saved.get('kind')!r} to keep what it learned)")
      return
    tuner.load_state_dict(saved)


# ---- request checks ------------------------------------------------------------------------------
def _a(x) -> str:
  """``"an int"``, ``"a str"``: the type of ``x`` with its article, for error messages."""
  name = type(x).__name__
  return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def is_integer(x) -> bool:
  """A Python or NumPy integer, or a 0-d integer array; never a bool or a float like 1.0."""
  if isinstance(x, (bool, np.bool_)):
    return False
  if isinstance(x, (int, np.integer)):
    return True
  return (isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0
          and jnp.issubdtype(x.dtype, jnp.integer))


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int,
                  max_prompt_len: int) -> list[list[int]]:
  """The prompts as lists of Python ints; a clear error for anything but a list of token-id
  lists within the vocabulary and ``max_prompt_len``."""
  expected = "pass a list of prompts, each a list of token ids"
  if isinstance(prompts, (str, bytes)):
    raise TypeError(f"prompts is {_a(prompts)}: {expected} (encode text with the "
                    f"tokenizer first)")
  try:
    prompts = list(prompts)
  except TypeError:
    raise TypeError(f"prompts is {_a(prompts)}: {expected}") from None
  if len(prompts) == 0:
    raise ValueError("generate() needs at least one prompt")
  checked = []
  for i, p in enumerate(prompts):
    if isinstance(p, (str, bytes)):
      raise TypeError(f"prompts[{i}] is {_a(p)}: {expected} (encode text with the "
                      f"tokenizer first)")
    if is_integer(p):
      raise TypeError(f"prompts[{i}] is an int: {expected} (for one prompt, pass [prompt])")
    try:
      p = list(p)
    except TypeError:
      raise TypeError(f"prompts[{i}] is {_a(p)}: {expected}") from None
    for j, t in enumerate(p):
      if not is_integer(t):
        raise TypeError(f"prompts[{i}][{j}] is {t!r} ({type(t).__name__}): token ids must be "
                        f"ints ({expected})")
    p = [int(t) for t in p]
    if not p:
      raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    if len(p) > max_prompt_len:
      raise ValueError(
          f"prompt {i} has {len(p)} tokens but EngineConfig.max_prompt_len is "
          f"{max_prompt_len}; truncate the prompt or raise max_prompt_len")
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    checked.append(p)
  return checked


def collect_mask(collect_hidden, n: int, seed: int, learned: bool) -> np.ndarray | None:
  """Which of ``n`` rows return hidden states: all (True), none (False), a seeded random
  fraction (a float in (0, 1]) or a per-row sequence of bools. ``learned``: whether the engine
  has a learned drafter (the hidden states are its feature history)."""
  if collect_hidden is False or collect_hidden is None:
    return None
  if not learned:
    raise ValueError("collect_hidden needs a learned drafter on the engine (the hidden states "
                     "are the feature history it decodes with); pass drafter=Drafter(...)")
  if collect_hidden is True:
    return np.ones(n, bool)
  if isinstance(collect_hidden, float):
    if not 0.0 < collect_hidden <= 1.0:
      raise ValueError(f"collect_hidden as a fraction must be in (0, 1], got {collect_hidden}")
    mask = np.zeros(n, bool)
    picked = np.random.default_rng(seed).permutation(n)[:max(1, round(collect_hidden * n))]
    mask[picked] = True
    return mask
  mask = np.asarray(collect_hidden)
  if mask.dtype != bool or mask.shape != (n,):
    raise ValueError(f"collect_hidden must be a bool, a fraction in (0, 1] or {n} bools (one "
                     f"per prompt), got {collect_hidden!r}")
  return mask
