"""The rollout side of the main job's config: the drafter(s), the rollout engine and the drafter's
online training, as typed configs whose errors name ``config.drafter``, ``config.rollout.<field>``,
``config.suffix.<field>`` and ``config.drafter_training.<field>``."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import ml_collections
from ml_collections import config_dict

from tlt_jax.job.typed_config import ConfigError, config_error, dataclass_section, to_dataclass
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import load_drafter
from tlt_jax.models.learned_kinds import learned_kind, learned_names
from tlt_jax.models.transformer import Transformer
from tlt_jax.drafter.online import DrafterTrainingConfig
from tlt_jax.rollout import (KINDS, DrafterKind, EngineConfig, SuffixConfig, TunerConfig,
                             model_free_names, resolve_engine_config)
from tlt_jax.utils import FieldError


# config.drafter's fresh learned drafters, trained online from scratch, are the registered
# architectures' own names (``models.learned_kinds``: "eagle", EAGLE-1; "eagle3", EAGLE-3; ...).
# config.drafter: the suffix drafter alone; "<learned drafter>+suffix": both
SUFFIX = DrafterKind.SUFFIX


def _fresh_names() -> str:
  """The fresh learned drafters' names as messages list them: 'eagle' or 'eagle3'."""
  return " or ".join(repr(kind) for kind in learned_names())


def _suffix_choices() -> str:
  return ("'suffix' (the suffix drafter, which drafts from the rollout's own history, alone) or "
          f"'<{', '.join(learned_names())} or a drafter directory>+suffix' (both in one engine)")


def drafter_choices() -> str:
  """What ``config.drafter`` takes, for messages: the kinds registered now included."""
  free = ", ".join(repr(str(name)) for name in model_free_names())
  return (f"'none', {free} (model-free drafting), {_fresh_names()} (a learned drafter of that "
          "architecture trained online from scratch) or the directory of a drafter saved by "
          "tlt_jax.models.drafter_io.save_drafter")


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
  """``config.drafter``, parsed once (``parse_drafter``): the learned or n-gram drafter's
  ``kind`` and whether the suffix drafter drafts too."""

  value: str  # as the config spells it, for messages
  kind: str = "none"  # "none", a model-free kind ("ngram", ...), a learned one or "saved"
  suffix: bool = False
  path: pathlib.Path | None = None  # kind "saved": the drafter's directory

  @property
  def learned(self) -> str:
    """The learned or n-gram part as the config spells it (``"eagle"`` of ``"eagle+suffix"``)."""
    if self.value == SUFFIX:
      return "none"
    return self.value[:-len(SUFFIX) - 1] if self.suffix else self.value

  @property
  def fresh(self) -> str | None:
    """The architecture (``"eagle"``, ``"eagle3"``, ...: ``learned_kinds``) of a fresh drafter,
    trained online from scratch; None for any other."""
    return self.kind if self.kind in learned_names() else None

  @property
  def learns(self) -> bool:
    """Whether the drafter is a learned one (``Drafter``): fresh or saved."""
    return self.fresh is not None or self.kind == "saved"

  @property
  def head_from_policy(self) -> bool:
    """Whether the fresh drafter copies part of the policy (an EAGLE-3 one its LM head), so the
    job builds it after the warm start (``Drafter.starts_from_policy``)."""
    return self.fresh is not None and learned_kind(self.fresh).starts_from_policy()

  def build(self, model_config: ModelConfig, seed: int = 0, policy: Transformer | None = None
            ) -> Drafter | Any | None:
    """The learned or model-free drafter: none, a model-free kind's config at its defaults
    (``NgramConfig()``, ...), a fresh one of a learned architecture drawn for ``seed`` (its
    ``fresh``: an EAGLE-3 one's head the LM head of ``policy`` where given) or the saved one
    loaded for the policy."""
    if self.kind == "none":
      return None
    if self.kind in model_free_names():
      return KINDS[self.kind].config_type()
    if self.fresh:
      return learned_kind(self.fresh).fresh(model_config, seed=seed, policy=policy)
    try:
      return load_drafter(self.path, model_config)
    except Exception as e:  # pylint: disable=broad-except  # missing/garbled files, a misfit
      raise ConfigError(f"config.drafter {self.learned} does not load as a drafter of this "
                        f"policy: {e} (config.drafter takes {drafter_choices()})") from None


def parse_drafter(value) -> DrafterSpec:
  """``config.drafter`` as a ``DrafterSpec``: a known kind or an existing directory (either with
  ``+suffix``), or ``suffix`` alone; anything else is a ``ConfigError`` naming the choices."""
  if value == SUFFIX:
    return DrafterSpec(value, "none", suffix=True)
  suffix = isinstance(value, str) and value.endswith("+" + SUFFIX)
  base = value[:-len(SUFFIX) - 1] if suffix else value
  if suffix and base in ("none", DrafterKind.NGRAM, ""):
    why = {"none": "the suffix drafter alone is 'suffix'",
           "ngram": "the suffix drafter already drafts from the group's sibling responses, as the "
                    "n-gram drafter does: use 'suffix'",
           "": "a learned drafter goes before '+suffix'"}[base]
    raise ConfigError(f"config.drafter={value!r}: {why} (config.drafter takes {drafter_choices()}; "
                      f"or {_suffix_choices()})")
  if isinstance(base, str) and (base == "none" or base in model_free_names() or
                                base in learned_names()):
    return DrafterSpec(value, str(base), suffix)
  if not isinstance(base, str) or not base:
    raise ConfigError(f"config.drafter must be {drafter_choices()}, or {_suffix_choices()}; got "
                      f"{value!r}")
  if not pathlib.Path(base).is_dir():
    raise ConfigError(f"config.drafter must be {drafter_choices()}; {base!r} is not an existing "
                      f"directory (or {_suffix_choices()})")
  return DrafterSpec(value, "saved", suffix, pathlib.Path(base))


# the config sections of the rollout's dataclasses: an error naming ``<Class>.<field>`` names
# ``config.<section>.<field>`` in the job
_SECTIONS = {"EngineConfig": "rollout", "TunerConfig": "rollout.tuner"}


def build_engine_config(rollout, drafter, suffix: SuffixConfig | None = None,
                        **extra) -> EngineConfig:
  """``config.rollout`` as the ``EngineConfig`` resolved for the job's drafters
  (``resolve_engine_config``; ``extra``: fields set by the job; ``suffix``: the suffix drafter
  drafts too); the errors of either name ``config.rollout.<field>``."""
  engine = to_dataclass(EngineConfig, rollout, "rollout", sections=_SECTIONS, **extra)
  try:
    return resolve_engine_config(engine, drafter, suffix)
  except ValueError as e:  # the strategies against the drafters config.drafter chose
    hint = (f"; config.drafter picks the drafters: {drafter_choices()}, or {_suffix_choices()}"
            if isinstance(e, FieldError) and e.owner == "EngineConfig" else "")
    raise ConfigError(str(config_error(e, "rollout", _SECTIONS)) + hint) from None


# the config.rollout fields of the job, in the order config files list them (the other
# EngineConfig fields are the job's to set, or kept at their defaults)
ROLLOUT_FIELDS = ("max_batch", "max_prompt_len", "strategies", "sd_max_batch",
                  "sd_prior_acceptance", "sd_offers", "verify_budget", "segment_steps",
                  "verify", "suffix_strategies", "precompile_scope")


def rollout_section(**values) -> ml_collections.ConfigDict:
  """``config.rollout`` for config files: the job's ``EngineConfig`` fields at the dataclass's
  defaults unless given in ``values``, and ``tuner`` with every ``TunerConfig`` field, so a
  config file states only what it changes. ``segment_steps`` and ``sd_max_batch`` (default
  None: the engine decides) are int placeholders, which a command line can still set."""
  unknown = sorted(set(values) - set(ROLLOUT_FIELDS) - {"tuner"})
  if unknown:
    raise TypeError(f"rollout_section: {unknown} are not config.rollout fields "
                    f"({', '.join(ROLLOUT_FIELDS)}, tuner)")
  defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
  fields = {name: values.get(name, defaults[name]) for name in ROLLOUT_FIELDS}
  for name in ("segment_steps", "sd_max_batch"):  # None: the engine decides
    if fields[name] is None:
      fields[name] = config_dict.placeholder(int)
  section_ = ml_collections.ConfigDict(fields)
  section_.tuner = values.get("tuner", dataclass_section(TunerConfig))
  return section_


def suffix_section() -> ml_collections.ConfigDict:
  """``config.suffix`` with every ``SuffixConfig`` field at its default, for config files."""
  return dataclass_section(SuffixConfig)


@dataclasses.dataclass(frozen=True)
class OnlineTraining:
  """``config.drafter_training``'s fields of the job's own (the others are
  ``DrafterTrainingConfig``'s): whether the drafter trains online and how often it is saved."""

  online: bool | str = "auto"  # "auto": when config.drafter is a fresh drafter (+suffix or not)
  save_every: int = 1  # RL steps between selective async saves of the drafter alone (0: none)

  def __post_init__(self):
    # the field's default is the string "auto", so a command line's True/False arrives as text
    online = {"true": True, "false": False}.get(str(self.online).lower(), self.online)
    if online not in ("auto", True, False):
      raise FieldError("OnlineTraining", "online", f"must be 'auto', True or False, got "
                       f"{online!r}")
    object.__setattr__(self, "online", online)
    save_every = self.save_every
    if not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 0:
      raise FieldError("OnlineTraining", "save_every", f"must be an int >= 0, got {save_every!r}")


_ONLINE_FIELDS = tuple(f.name for f in dataclasses.fields(OnlineTraining))


def drafter_training_section() -> ml_collections.ConfigDict:
  """``config.drafter_training`` with every field at its default (the job's and
  ``DrafterTrainingConfig``'s), for config files."""
  return dataclass_section(DrafterTrainingConfig, **dataclass_section(OnlineTraining))


# a fresh drafter (config.drafter="eagle" or "eagle3") without rollout.strategies: chain d3
EAGLE_STRATEGIES = ((3, 1, 4),)


def build_drafter_training(section_, spec: DrafterSpec
                           ) -> tuple[DrafterTrainingConfig | None, int]:
  """``config.drafter_training`` as a ``DrafterTrainingConfig`` when the drafter ``spec`` names
  trains online (``online="auto"``: when it is a fresh drafter), and the save interval; the
  section is checked in any case, so a mistake shows before it matters."""
  job = to_dataclass(OnlineTraining, {k: v for k, v in section_.items() if k in _ONLINE_FIELDS},
                     "drafter_training")
  training = to_dataclass(DrafterTrainingConfig, section_, "drafter_training",
                          ignore=_ONLINE_FIELDS)
  online = spec.fresh is not None if job.online == "auto" else job.online
  if not online:
    return None, 0
  if not spec.learns:
    raise ConfigError(f"config.drafter_training.online=True needs a learned drafter: set "
                      f"config.drafter to {_fresh_names()} or a saved drafter's directory (any may "
                      f"add '+suffix'), not {spec.value!r}")
  return training, job.save_every
