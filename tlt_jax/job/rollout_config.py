"""The rollout side of the main job's config: the drafter(s), the rollout engine and the drafter's
online training, as typed configs whose errors name ``config.drafter``, ``config.rollout.<field>``,
``config.suffix.<field>`` and ``config.drafter_training.<field>``."""

from __future__ import annotations

import dataclasses
import pathlib

import ml_collections

from tlt_jax.job.typed_config import ConfigError, check_keys, dataclass_section, section
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.drafter import Drafter, load_drafter
from tlt_jax.drafter.online import DrafterTrainingConfig
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.speculative import SpecConfig
from tlt_jax.rollout.suffix import SuffixConfig
from tlt_jax.rollout.tuner import TunerConfig
from tlt_jax.utils import FieldError


_DRAFTER_CHOICES = ("'none', 'ngram', 'eagle' (a drafter trained online from scratch) or the "
                   "directory of a drafter saved by tlt_jax.models.drafter.save_drafter")
SUFFIX = "suffix"  # config.drafter: the suffix drafter alone; "<learned drafter>+suffix": both
_SUFFIX_CHOICES = ("'suffix' (the suffix drafter, which drafts from the rollout's own history, "
                   "alone) or '<eagle or a drafter directory>+suffix' (both in one engine)")


def split_drafter(value) -> tuple[str, bool]:
  """``config.drafter`` as (the learned or n-gram drafter's part, whether the suffix drafter
  drafts too): ``"suffix"`` is ``("none", True)``, ``"eagle+suffix"`` ``("eagle", True)``."""
  if value == SUFFIX:
    return "none", True
  if isinstance(value, str) and value.endswith("+" + SUFFIX):
    return value[:-len(SUFFIX) - 1], True
  return value, False


def check_drafter(value) -> None:
  """Rejects a ``config.drafter`` that is neither a known kind nor an existing directory (either
  of them with ``+suffix``, or ``suffix`` alone)."""
  if value == SUFFIX:
    return
  base, suffix = split_drafter(value)
  if suffix and base in ("none", "ngram", ""):
    why = {"none": "the suffix drafter alone is 'suffix'",
           "ngram": "the suffix drafter already drafts from the group's sibling responses, as the "
                    "n-gram drafter does: use 'suffix'",
           "": "a learned drafter goes before '+suffix'"}[base]
    raise ConfigError(f"config.drafter={value!r}: {why} (config.drafter takes {_DRAFTER_CHOICES}; "
                      f"or {_SUFFIX_CHOICES})")
  if base in ("none", "ngram", "eagle"):
    return
  if not isinstance(base, str) or not base:
    raise ConfigError(f"config.drafter must be {_DRAFTER_CHOICES}, or {_SUFFIX_CHOICES}; got "
                      f"{value!r}")
  if not pathlib.Path(base).is_dir():
    raise ConfigError(f"config.drafter must be {_DRAFTER_CHOICES}; {base!r} is not an existing "
                      f"directory (or {_SUFFIX_CHOICES})")


def build_drafter(value, model_config: ModelConfig, seed: int = 0
                  ) -> Drafter | NgramConfig | None:
  """``config.drafter``'s learned or n-gram part: none, the n-gram drafter, a fresh EAGLE drafter
  (``eagle``) or a learned drafter loaded for the policy (the suffix part: ``build_suffix``)."""
  check_drafter(value)
  value = split_drafter(value)[0]
  if value == "none":
    return None
  if value == "ngram":
    return NgramConfig()
  if value == "eagle":
    return Drafter.create(model_config, seed=seed)
  try:
    return load_drafter(value, model_config)
  except Exception as e:  # pylint: disable=broad-except  # missing/garbled files, a misfit
    raise ConfigError(f"config.drafter {value} does not load as a drafter of this policy: {e} "
                      f"(config.drafter takes {_DRAFTER_CHOICES})") from None


_ENGINE_SCALARS = ("verify", "sd_max_batch", "verify_budget", "segment_steps")
_STRATEGY_HINT = "a list of [depth, topk, verify_tokens] triples, e.g. ((4, 1, 5), (4, 2, 8))"


def _strategies(value, field: str = "strategies") -> tuple[SpecConfig, ...]:
  """``config.rollout.<field>`` (``strategies`` or ``suffix_strategies``) as SpecConfigs; errors
  name the entry."""
  name = f"config.rollout.{field}"
  if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
    raise ConfigError(f"{name} must be {_STRATEGY_HINT}, got {value!r}")
  if value and all(isinstance(v, int) for v in value):
    raise ConfigError(f"{name} must be {_STRATEGY_HINT}, got the flat "
                      f"{tuple(value)!r}; one strategy is written ({tuple(value)!r},)")
  specs = []
  for i, entry in enumerate(value):
    where = f"{name}[{i}]"
    if isinstance(entry, SpecConfig):
      specs.append(entry)
      continue
    if isinstance(entry, (dict, ml_collections.ConfigDict)):
      args, kwargs = (), dict(entry)
    elif isinstance(entry, (list, tuple)) and len(entry) == 3:
      args, kwargs = tuple(entry), {}
    else:
      raise ConfigError(f"{where} must be a [depth, topk, verify_tokens] triple, got {entry!r}")
    try:
      spec = SpecConfig(*args, **kwargs)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"{where} = {entry!r}: {e}") from None
    specs.append(spec)
  if len(set(specs)) != len(specs):
    raise ConfigError(f"{name} lists a strategy twice: {value!r}")
  return tuple(specs)


def _tuner(value) -> TunerConfig:
  """``config.rollout.tuner`` (a section of TunerConfig fields) as a TunerConfig."""
  if isinstance(value, TunerConfig):
    return value
  if not isinstance(value, (dict, ml_collections.ConfigDict)):
    raise ConfigError(f"config.rollout.tuner must be a section of TunerConfig fields (kind, "
                      f"epsilon, window, ...), got {value!r}")
  fields = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else dict(value)
  check_keys(fields, {f.name for f in dataclasses.fields(TunerConfig)}, "rollout.tuner")
  try:
    return TunerConfig(**fields)
  except (TypeError, ValueError) as e:
    raise _named(e, "rollout.tuner") from None


def _named(error: Exception, where: str) -> ConfigError:
  """``error`` of a dataclass built from ``config.<where>`` as a ``ConfigError``: a
  ``FieldError`` names the field as ``config.<where>.<field>``; any other error is prefixed with
  ``config.<where>``."""
  if isinstance(error, FieldError):
    return ConfigError(f"config.{where}.{error.field} {error.problem}")
  return ConfigError(f"config.{where}: {error}")


def build_engine_config(rollout: ml_collections.ConfigDict, drafter,
                        suffix: SuffixConfig | None = None, **extra) -> EngineConfig:
  """``config.rollout`` as an ``EngineConfig`` (``extra``: fields set by the job); a bad value of
  the adaptive engine's fields names ``config.rollout.<field>``. ``suffix``: the suffix drafter
  drafts too (``config.rollout.suffix_strategies`` are its strategies and need it)."""
  fields = dict(rollout.items())
  if "strategies" in fields:
    fields["strategies"] = _strategies(fields["strategies"])
  suffix_strategies = _strategies(fields.pop("suffix_strategies", ()), "suffix_strategies")
  if suffix_strategies and suffix is None:
    raise ConfigError("config.rollout.suffix_strategies needs the suffix drafter: set "
                      f"config.drafter to {_SUFFIX_CHOICES}, or leave suffix_strategies empty")
  if suffix_strategies:  # (empty: one chain of config.suffix.depth, EngineConfig's default)
    fields["suffix_strategies"] = suffix_strategies
  if fields.get("tuner") is not None:
    fields["tuner"] = _tuner(fields["tuner"])
  engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
  check_keys(fields, engine_fields - set(extra), "rollout")
  values = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  try:  # built once; the engine's own checks of its fields, named as config fields
    engine = EngineConfig(**values, **extra)
  except (TypeError, ValueError) as e:
    if isinstance(e, FieldError) and e.field in _ENGINE_SCALARS:  # config.rollout.<field>
      raise _named(e, "rollout") from None
    raise ConfigError(f"config.rollout: {e}") from None
  try:
    engine.check_fixed_tuner(ngram=isinstance(drafter, NgramConfig))
  except ValueError as e:
    raise _named(e, "rollout.tuner") from None
  if engine.strategies and drafter is None:
    raise ConfigError("config.rollout.strategies needs a drafter: set config.drafter to 'ngram' "
                      "or a saved drafter's directory, or leave strategies empty (vanilla)" +
                      ("; the suffix drafter's strategies are config.rollout.suffix_strategies"
                       if suffix is not None else ""))
  if isinstance(drafter, NgramConfig) and any(not s.is_chain for s in engine.strategies):
    raise ConfigError(f"config.rollout.strategies {engine.strategies} has tree strategies "
                      "(topk > 1) but the n-gram drafter drafts chains: use topk=1 entries")
  return engine


def build_suffix(cfg: ml_collections.ConfigDict) -> SuffixConfig | None:
  """``config.suffix`` as a ``SuffixConfig`` when ``config.drafter`` has the suffix drafter
  (``suffix`` or ``<drafter>+suffix``), else None; the section is checked in any case, so a
  mistake shows before it matters (a config without the section takes the defaults)."""
  fields = dict(section(cfg, "suffix").items()) if "suffix" in cfg else {}
  check_keys(fields, {f.name for f in dataclasses.fields(SuffixConfig)}, "suffix")
  try:
    suffix = SuffixConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
  except (TypeError, ValueError) as e:
    raise _named(e, "suffix") from None
  return suffix if split_drafter(cfg.drafter)[1] else None


def suffix_section() -> ml_collections.ConfigDict:
  """``config.suffix`` with every ``SuffixConfig`` field at its default, for config files."""
  return dataclass_section(SuffixConfig)


# config.drafter_training's fields of the job's own (the others are DrafterTrainingConfig's):
# whether the drafter trains online ("auto": when config.drafter is "eagle" or "eagle+suffix"),
# and the RL steps between selective async saves of the drafter alone (0: none)
DRAFTER_TRAINING_JOB_FIELDS = {"online": "auto", "save_every": 1}


def drafter_training_section() -> ml_collections.ConfigDict:
  """``config.drafter_training`` with every field at its default (the job's and
  ``DrafterTrainingConfig``'s), for config files."""
  return dataclass_section(DrafterTrainingConfig, **DRAFTER_TRAINING_JOB_FIELDS)


EAGLE_STRATEGIES = ((3, 1, 4),)  # config.drafter="eagle" without rollout.strategies: chain d3


def build_drafter_training(cfg: ml_collections.ConfigDict, drafter
                           ) -> tuple[DrafterTrainingConfig | None, int]:
  """``config.drafter_training`` as a ``DrafterTrainingConfig`` when the drafter trains online
  (``online="auto"``: when ``config.drafter="eagle"``), and the selective-save interval."""
  fields = dict(DRAFTER_TRAINING_JOB_FIELDS)
  if "drafter_training" in cfg:
    fields.update(section(cfg, "drafter_training").items())
  online = fields.pop("online")
  # the field's default is the string "auto", so a command line's True/False arrives as text
  online = {"true": True, "false": False}.get(str(online).lower(), online)
  save_every = fields.pop("save_every")
  if online not in ("auto", True, False):
    raise ConfigError(f"config.drafter_training.online must be 'auto', True or False, got "
                      f"{online!r}")
  if not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 0:
    raise ConfigError(f"config.drafter_training.save_every must be an int >= 0, got "
                      f"{save_every!r}")
  try:  # checked even when unused, so a mistake shows before it matters
    training = DrafterTrainingConfig(**fields)
  except TypeError as e:
    raise ConfigError(f"config.drafter_training: {e}") from None
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  online = split_drafter(cfg.drafter)[0] == "eagle" if online == "auto" else online
  if not online:
    return None, 0
  if not isinstance(drafter, Drafter):
    raise ConfigError(f"config.drafter_training.online=True needs a learned drafter: set "
                      f"config.drafter to 'eagle' or a saved drafter's directory (either may "
                      f"add '+suffix'), not {cfg.drafter!r}")
  return training, save_every

