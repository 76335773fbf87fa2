"""The learned drafter architectures, by the name ``config.drafter`` writes (``"eagle"``,
``"eagle3"``, and any a user registers).

An architecture is a ``Drafter`` subclass that says everything the rest of the code asks of it,
on the class: ``kind`` (its name), ``fresh`` (how the job builds one to train online from
scratch, and ``starts_from_policy``: whether that copies part of the policy), ``objective`` (the
training loss it uses, by name: ``tlt_jax.drafter.objective.OBJECTIVES``), ``saved_fields``
(what ``drafter_io.save_drafter`` writes beside the target config) and ``speculators_export``
(whether the run also exports it as a ``speculators`` checkpoint). The job's config, the
drafter files, the trainer and the exports look it up here and never name an architecture.
``register_learned`` adds one before the job is built; tests/models/test_learned_kinds.py adds
one from outside the package.
"""

from __future__ import annotations

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.eagle3 import Eagle3Drafter

LEARNED: dict[str, type[Drafter]] = {cls.kind: cls for cls in (Drafter, Eagle3Drafter)}
_BUILT_IN = tuple(LEARNED)


def register_learned(cls: type[Drafter]) -> type[Drafter]:
  """Adds the architecture ``cls`` (a ``Drafter`` subclass with its own ``kind``) under its
  ``kind``; registering it again changes nothing, a name taken by another class is an error.
  Returns it, so it can decorate the class."""
  if not (isinstance(cls, type) and issubclass(cls, Drafter)):
    raise TypeError(f"register_learned takes a Drafter subclass, got {cls!r}")
  if not isinstance(cls.kind, str) or not cls.kind.isidentifier():
    raise ValueError(f"{cls.__name__}.kind must be an identifier (its config.drafter name), got "
                     f"{cls.kind!r}")
  taken = LEARNED.get(cls.kind)
  if taken is not None and taken is not cls:
    raise ValueError(f"the learned drafter kind {cls.kind!r} is already {taken.__name__}; give "
                     f"{cls.__name__} a kind of its own")
  LEARNED[cls.kind] = cls
  return cls


def unregister_learned(name: str) -> None:
  """Removes the registered architecture ``name``; a built-in one stays."""
  if name in _BUILT_IN:
    raise ValueError(f"{name!r} is a built-in drafter architecture: it cannot be unregistered")
  LEARNED.pop(name, None)


def learned_names() -> tuple[str, ...]:
  """The registered architectures' names, built-in ones first."""
  return tuple(LEARNED)


def learned_kind(name: str) -> type[Drafter]:
  """The architecture named ``name``; an unknown name says which ones exist."""
  try:
    return LEARNED[name]
  except KeyError:
    raise ValueError(f"unknown learned drafter kind {name!r}; the kinds are "
                     f"{list(LEARNED)}") from None
