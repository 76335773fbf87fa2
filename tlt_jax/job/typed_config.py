"""Turns ml_collections configs into validated typed configs, once, at the edge.

Every mistake a user can make in a config raises :class:`ConfigError` (a ``ValueError``) whose
message names the field as ``config.<section>.<key>``; entry points print it in one line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import typing
from typing import Any, Iterable, TypeVar

import ml_collections

from tlt_jax.utils import FieldError, read_json_object

T = TypeVar("T")


class ConfigError(ValueError):
  """A config value, key or file that cannot be used; the message says which and what to do."""


def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """``get_config()`` of an ml_collections config file, as ``--config=path`` would load it."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no config file at {path}")
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def section(cfg: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """``cfg[name]``, checked to be a section (a dict of fields) rather than a single value."""
  value = cfg.get(name)
  if not isinstance(value, (ml_collections.ConfigDict, dict)):
    raise ConfigError(f"config.{name} must be a section of fields, got {value!r}")
  return value


def optional_section(cfg: ml_collections.ConfigDict, name: str) -> dict:
  """The fields of the section ``cfg[name]`` (``section``), or none where ``cfg`` lacks it."""
  return dict(section(cfg, name).items()) if name in cfg else {}


def config_error(error: Exception, where: str | None, sections: dict[str, str] | None = None,
                 sources: dict[str, str] | None = None) -> ConfigError:
  """The one place where the job's config path goes in front of a library error: ``error``,
  raised while building a dataclass from ``config.<where>``, as a :class:`ConfigError`.

  A :class:`FieldError` (``Owner.field problem``) becomes ``config.<section>.<field> problem``,
  where the section is ``sections[Owner]`` (a nested dataclass's own section, e.g.
  ``{"TunerConfig": "rollout.tuner"}``) or ``where``; a field the job fills from elsewhere
  in the config is named by its ``sources`` path instead (``{"num_prompts":
  "task.num_prompts"}``). Any other error reads ``config.<where>: <message>`` (``where`` None:
  a rule over several sections, the message alone). Either way each
  ``Owner.`` of ``sections`` the message mentions is spelled as its section."""
  sections, sources = sections or {}, sources or {}
  if isinstance(error, FieldError):
    owner = sections.get(error.owner, where)
    path = sources.get(error.field) or (f"{owner}.{error.field}" if owner else error.field)
    text = f"config.{path} {error.problem}"
  else:
    text = str(error) if where is None else f"config{'.' if where else ''}{where}: {error}"
  for owner, section_ in sections.items():
    text = text.replace(f"{owner}.", f"config.{section_}.")
  return ConfigError(text)


def to_dataclass(cls: type[T], section_, where: str, ignore: Iterable[str] = (),
                 sources: dict[str, str] | None = None, sections: dict[str, str] | None = None,
                 **extra) -> T:
  """Builds ``cls`` from ``config.<where>``, a dataclass-typed field from its sub-section (the
  same way); unknown keys (but ``ignore``) and bad values raise ``config_error``'s ConfigError.

  ``extra``: fields the job fills, from the config paths ``sources`` names; ``sections``: the
  sections of owners a message may name (``config_error``)."""
  fields = {f.name for f in dataclasses.fields(cls)}
  check_keys(section_, (fields - set(extra)) | set(ignore), where)
  nested = _dataclass_fields(cls)
  values = {}
  for key, value in section_.items():
    if key in nested and isinstance(value, (ml_collections.ConfigDict, dict)):
      value = to_dataclass(nested[key], value, f"{where}.{key}")
    values[key] = tuple(value) if isinstance(value, list) else value
  values = {k: v for k, v in values.items() if k in fields}
  values.update(extra)
  try:
    return cls(**values)
  except (TypeError, ValueError) as e:
    raise config_error(e, where, sections, sources) from None


def _dataclass_fields(cls: type) -> dict[str, type]:
  """The fields of the dataclass ``cls`` typed as a dataclass (or one or None), by name."""
  try:
    hints = typing.get_type_hints(cls)
  except (NameError, TypeError):  # an annotation that names what the module does not import
    return {}
  out = {}
  for name, hint in hints.items():
    kinds = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
    if len(kinds) == 1 and isinstance(kinds[0], type):
      out[name] = kinds[0]
  return out


def dataclass_section(cls: type, omit: Iterable[str] = (), **values) -> ml_collections.ConfigDict:
  """A config section of every field of the dataclass ``cls`` but those in ``omit`` (fields the
  job fills from elsewhere, e.g. the trainer's seed from ``config.seed``), at its default unless
  given in ``values`` (which may add fields of the job's own). So a default lives in the
  dataclass alone, a config states only what it changes, and ``--help`` and
  ``--config.<section>.<field>`` still reach every field.

  A field without a default must be given; one whose default is ``None`` too (a ConfigDict field
  of value None takes no command-line override, so the config file picks a typed value).
  """
  omit, fields = set(omit), {}
  for field in dataclasses.fields(cls):
    if field.name in omit:
      continue
    if field.default is not dataclasses.MISSING:
      fields[field.name] = field.default
    elif field.default_factory is not dataclasses.MISSING:
      fields[field.name] = field.default_factory()
  fields.update(values)
  unset = sorted(f.name for f in dataclasses.fields(cls)
                 if f.name not in omit and fields.get(f.name) is None)
  if unset:
    raise TypeError(f"dataclass_section({cls.__name__}): give values for the fields {unset} "
                    "(no default, or a default of None)")
  return ml_collections.ConfigDict(fields)


def check_keys(section_: ml_collections.ConfigDict, allowed: set[str], where: str) -> None:
  """Rejects keys that nothing reads (usually a typo), naming them and the known ones."""
  unknown = sorted(set(section_.keys()) - set(allowed))
  if unknown:
    prefix = f"config.{where}" if where else "config"
    raise ConfigError(f"{prefix} has unknown keys {unknown}; known keys: {sorted(allowed)}")


def flatten(cfg: ml_collections.ConfigDict | dict, prefix: str = "") -> dict[str, Any]:
  """``{"trainer.steps": 80, ...}``: every leaf field under its dotted name."""
  out: dict[str, Any] = {}
  for key, value in cfg.items():
    name = f"{prefix}{key}"
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def set_dotted(cfg: ml_collections.ConfigDict, name: str, value: Any) -> None:
  """Sets the field ``name`` (``"trainer.steps"``) of ``cfg``, creating no new sections."""
  *parents, key = name.split(".")
  for part in parents:
    cfg = cfg[part]
  with cfg.ignore_type():
    cfg[key] = value


def read_json_config(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """A config saved as JSON (a run's ``config.json``); errors name the file."""
  try:
    return ml_collections.ConfigDict(read_json_object(path))
  except FileNotFoundError:
    raise ConfigError(f"{path} does not exist") from None
  except ValueError as e:
    raise ConfigError(str(e)) from None


def write_json_config(cfg: ml_collections.ConfigDict, path: str | pathlib.Path) -> None:
  """Writes ``cfg`` as readable JSON, atomically: a tmp file, synced to disk, then renamed over
  ``path`` (a crash leaves the old file or the new one, never a part)."""
  path = pathlib.Path(path)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
