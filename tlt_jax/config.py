"""Turns ml_collections configs into validated typed configs, once, at the edge."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from typing import TypeVar

import ml_collections

T = TypeVar("T")


def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """``get_config()`` of an ml_collections config file, as ``--config=path`` would load it."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no config file at {path}")
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def to_dataclass(cls: type[T], section: ml_collections.ConfigDict, where: str, **extra) -> T:
  """Builds ``cls`` from the keys of ``section`` it knows; errors name the field as ``where.key``."""
  fields = {f.name for f in dataclasses.fields(cls)}
  values = {k: v for k, v in section.items() if k in fields}
  values.update(extra)
  for key, value in values.items():
    if isinstance(value, list):
      values[key] = tuple(value)
  try:
    return cls(**values)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.{where}: {e}") from None


def check_keys(section: ml_collections.ConfigDict, allowed: set[str], where: str) -> None:
  """Rejects keys that nothing reads (usually a typo), naming them."""
  unknown = sorted(set(section.keys()) - allowed)
  if unknown:
    raise ValueError(f"config.{where} has unknown keys {unknown}; known keys: {sorted(allowed)}")
