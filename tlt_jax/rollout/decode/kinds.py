"""Who drafts: the protocol of a drafter kind, and the registry the engine looks kinds up in.

A kind says how its strategies are named (the tuner's arm names, the stats' keys), which of them
share one segment executable, and how a speculative decode step drafts with it (``draft``: the
proposal, its tree mask, where each draft came from and the drafter's advanced cache). The step
functions (``steps.py``) look the kind up in ``KINDS`` and never branch on it.

Each built-in kind is declared and registered in a module of its own: ``learned`` (a drafter
model), ``ngram`` and ``suffix``; the package ``rollout.decode`` imports them, so they are
registered whatever imports this module.

A *model-free* kind (``ModelFreeKind``: the n-gram drafter, or one of a user's) drafts from the
decode state's tokens alone: the engine is given the kind's config (an instance of its
``config_type``) where a drafter model would go, and the kind's draft reads it as
``steps.free``. ``register`` adds one from anywhere, before the engines that use it are built
(``unregister`` takes it back); it is then a ``config.drafter`` choice of the job too
(``model_free_names``), its drafts counted under its own source name (``draft_sources``).
tests/rollout/test_registered_kind.py registers one from outside the package.

``DrafterKind`` names the built-in kinds; it is a ``StrEnum``, so a kind compares equal to its
name, and saved tuner state, stats and configs keep the plain strings.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax.rollout.decode import speculative as sd
from tlt_jax.rollout.decode.speculative import DRAFT_SOURCES, SpecConfig


class DrafterKind(enum.StrEnum):
  LEARNED = "learned"  # an EAGLE-style drafter model reading the target's hidden states
  NGRAM = "ngram"  # n-gram matches in the prompt and the group's sibling responses
  SUFFIX = "suffix"  # the suffix drafter: the row's own history, siblings and prompt


class Drafted(NamedTuple):
  """A speculative step's proposal, before the target verifies it."""

  draft: Any  # sd.Draft
  mask: jax.Array | None  # tree attention mask (None: a chain)
  source: jax.Array  # where the draft came from: per row [B] or per node [B, N] (DRAFT_SOURCES)
  dcache: Any = None  # the learned drafter's advanced KV cache (None: no drafter model)


def source_of(live: jax.Array, name: str) -> jax.Array:
  """Every row of ``live``'s shape marked as drafted by the source ``name``."""
  return jnp.full(live.shape, draft_sources().index(name), jnp.int32)


@dataclasses.dataclass(frozen=True)
class Kind:
  """One drafter kind: its name rules and its drafting (the subclasses below)."""

  kind: str  # its name: a ``DrafterKind`` for the built-in ones

  def strategy_name(self, spec: SpecConfig) -> str:
    """The arm name of ``spec`` drafted by this kind (``"chain d4"``, ``"ngram d8"``, ...)."""
    raise NotImplementedError

  def group_name(self, spec: SpecConfig) -> str:
    """The executable group ``spec`` belongs to: its own, unless the kind shares one."""
    return self.strategy_name(spec)

  def draft(self, steps, target, drafter, state, args, group, choice) -> Drafted:
    """The proposal of ``group``'s member ``choice`` for every row of ``state`` (traced inside a
    segment; ``steps``: the engine's ``StepFunctions``)."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ModelFreeKind(Kind):
  """A kind that drafts point-mass chains from the decode state alone (no drafter model; verified
  by the sequential point-mass rule, so SD stays lossless). The engine takes an instance of
  ``config_type`` (a frozen dataclass with a ``depth``: its default chain) as its drafter; the
  state carries each row's prompt (``prompt_tokens``, ``prompt_lens``) and prompt group
  (``group_id``) beside the generated ``tokens``. A subclass writes ``propose``."""

  config_type: type  # the class of its config (a frozen dataclass with a ``depth``)

  def strategy_name(self, spec: SpecConfig) -> str:
    if spec.is_chain:
      return f"{self.kind} d{spec.depth}"
    return f"tree d{spec.depth} k{spec.topk} v{spec.verify_tokens}"  # refused by the engine

  def chain(self, config) -> SpecConfig:
    """The chain ``config`` drafts by default: ``depth`` tokens, all verified at once."""
    return SpecConfig(depth=config.depth, topk=1, verify_tokens=config.depth + 1)

  def propose(self, config, state, depth: int) -> tuple[jax.Array, jax.Array]:
    """``(tokens [B, depth], count [B])``: each row's proposed continuation (``count`` of them,
    0: nothing to propose) from ``state`` and the kind's ``config`` (traced in a segment)."""
    raise NotImplementedError

  def draft(self, steps, target, drafter, state, args, group, choice) -> Drafted:
    spec = group.members[0]  # a model-free kind's groups are single chains
    proposal, proposal_len = self.propose(steps.free, state, spec.depth)
    draft = sd.chain_tree(proposal, state.last_token, None, proposal_len)
    return Drafted(draft, None, source_of(~state.done, self.kind))


# every kind by name: the built-in ones register from their own modules (``learned``, ``ngram``,
# ``suffix``, imported by the package ``rollout.decode``), a user's with ``register``
KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
  """Adds ``kind`` to ``KINDS`` (again: nothing changes) before the engines that use it are
  built; a name taken by another kind is an error. Returns it. A user's kind is a
  ``ModelFreeKind``; learned drafters are models (``tlt_jax.models.learned_kinds``)."""
  if not isinstance(kind, Kind):
    raise TypeError(f"register takes a ModelFreeKind (a drafter of the decode state alone), got "
                    f"{type(kind).__name__}; learned drafters are models (tlt_jax.models)")
  if not isinstance(kind.kind, str) or not kind.kind.isidentifier():
    raise ValueError(f"a drafter kind's name must be an identifier, got {kind.kind!r}")
  if isinstance(kind, ModelFreeKind) and (not dataclasses.is_dataclass(kind.config_type)
                                          or not hasattr(kind.config_type(), "depth")):
    raise TypeError(f"{kind.kind}: config_type must be a dataclass whose defaults make a config "
                    f"with a depth (its default chain), got {kind.config_type!r}")
  taken = KINDS.get(kind.kind)
  if taken is not None and taken != kind:
    raise ValueError(f"the drafter kind {kind.kind!r} is already registered ({taken})")
  KINDS[kind.kind] = kind
  return kind


def unregister(name: str) -> None:
  """Removes the registered kind ``name`` (a built-in kind stays); engines already built with it
  keep what they compiled."""
  if name in (k.value for k in DrafterKind):
    raise ValueError(f"{name!r} is a built-in drafter kind: it cannot be unregistered")
  KINDS.pop(name, None)


def kind_of(name: str) -> Kind:
  """The kind named ``name``; an unknown name says which ones exist."""
  try:
    return KINDS[str(name)]
  except KeyError:
    raise ValueError(f"unknown drafter kind {name!r}; the kinds are {list(KINDS)}") from None


def model_free_names() -> tuple[str, ...]:
  """The names of the model-free kinds (the built-in ``ngram`` and any registered)."""
  return tuple(name for name, k in KINDS.items() if isinstance(k, ModelFreeKind))


def model_free_kind(drafter: Any) -> ModelFreeKind | None:
  """The model-free kind whose config ``drafter`` is (None: a drafter model, or none)."""
  for k in KINDS.values():
    if isinstance(k, ModelFreeKind) and isinstance(drafter, k.config_type):
      return k
  return None


def draft_sources() -> tuple[str, ...]:
  """Where a draft can come from, as the SD counters index it: ``DRAFT_SOURCES`` and then each
  registered model-free kind's name."""
  return DRAFT_SOURCES + tuple(n for n in model_free_names() if n not in DRAFT_SOURCES)
