"""The run directory of the main job: what a run leaves in its logdir, and what a resume reads.

  <logdir>/config.json          the effective config without where the run lives (reused on resume)
  <logdir>/metrics.jsonl        a row per step and evaluation, plus tensorboard events
  <logdir>/checkpoints/         verified orbax checkpoints of the whole run
  <logdir>/drafter_checkpoints/ selective async saves of the online drafter alone
  <logdir>/final_model/         the policy with its tokenizer (``tlt_jax.generate`` loads it)
  <logdir>/final_drafter/       the online-trained drafter (``load_drafter`` loads it)
  <logdir>/final_drafter_speculators/
                                the same drafter as a speculators ``eagle3`` checkpoint for
                                final_model/ (``vllm serve`` takes it as its speculative model);
                                only for an EAGLE-3 drafter (``drafter=eagle3``): the format
                                holds no EAGLE-1 drafter
  <logdir>/leftovers-<time>/    an attempt stopped before its first checkpoint, set aside by the
                                run that started over there

Finished directories are swapped in whole (``replace_dir``); a resumed run drops the metrics rows
of the steps it does again.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import TYPE_CHECKING, Iterable

import jax
import ml_collections
from flax import nnx

from tlt_jax.checkpoint import Checkpointer, count_nonfinite
from tlt_jax.job.typed_config import ConfigError, flatten, read_json_config, set_dotted, \
    write_json_config
from tlt_jax.models import hf
from tlt_jax.models.drafter_io import load_drafter
from tlt_jax.models.speculators_format import export_speculators
from tlt_jax.utils import replace_dir

if TYPE_CHECKING:
  from tlt_jax.job.build import Job
  from tlt_jax.rl.trainer import GRPOTrainer

RUN_FIELDS = {"logdir", "resume"}  # where a run lives, not what it does: never saved/compared
# fields added after runs were saved, with the value that does what those runs did: a resumed run
# whose config.json lacks one keeps that value (its default would change the run mid-way)
BEFORE_THE_FIELD = {
    "task.eval_share": 0.0,  # no held-out questions set aside from training's pool
}
CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"
FINAL_MODEL = "final_model"
FINAL_DRAFTER = "final_drafter"
FINAL_DRAFTER_SPECULATORS = "final_drafter_speculators"
DRAFTER_CHECKPOINTS = "drafter_checkpoints"


def choose_logdir(cfg: ml_collections.ConfigDict) -> pathlib.Path:
  """``config.logdir`` (``runs/<timestamp>`` when empty, set in ``cfg``), checked to be usable."""
  if not cfg.logdir:
    if cfg.resume:
      raise ConfigError("config.resume=True needs the run's --config.logdir")
    cfg.logdir = time.strftime("runs/%Y%m%d-%H%M%S")
  logdir = pathlib.Path(cfg.logdir)
  if logdir.exists() and not logdir.is_dir():
    raise ConfigError(f"config.logdir {logdir} is a file, not a directory; choose another "
                      "--config.logdir")
  return logdir


def open_run(cfg: ml_collections.ConfigDict, logdir: pathlib.Path,
             overrides: Iterable[str] | None
             ) -> tuple[ml_collections.ConfigDict, int | None, str | None]:
  """The config the run goes on with, the latest checkpoint step in ``logdir`` and a line for
  the console (or None). A resume (``cfg.resume``) takes the saved config, except ``overrides``
  (see ``resume_config``), and continues from the latest checkpoint; a run stopped before its
  first checkpoint has only its ``config.json``, and its resume starts it over with that config
  (returned with ``resume=False``: a new run, whose leftovers ``set_aside_leftovers`` moves).
  A new run refuses a logdir that holds checkpoints. Writes nothing."""
  checkpoint_dir = logdir / CHECKPOINTS
  with Checkpointer(checkpoint_dir, keep=None) as probe:
    latest = probe.latest_step()
  if not cfg.resume:
    if latest is not None:
      raise ConfigError(f"{checkpoint_dir} already holds checkpoints (latest step "
                        f"{latest}); pass --config.resume=True to continue that run, or choose "
                        "another --config.logdir")
    return cfg, latest, None
  saved_file = logdir / CONFIG_FILE
  if latest is None and not saved_file.exists():
    raise ConfigError(f"config.resume=True but {logdir} holds no run (no checkpoint, no "
                      f"{CONFIG_FILE}); drop --config.resume to start a new run there")
  source = "its saved config"
  try:
    saved = read_json_config(saved_file)
  except ConfigError as e:  # missing or damaged: every checkpoint carries the run's config
    if latest is None:
      raise ConfigError(f"{e}. There is no checkpoint to take the config from either: drop "
                        f"--config.resume to start a new run in {logdir} (its files are set "
                        "aside)") from None
    saved = checkpoint_config(checkpoint_dir, latest)
    source = (f"the config in its checkpoint of step {latest} ({e}; {CONFIG_FILE} is written "
              "again from it once the checkpoint is restored)")
  cfg, notes = resume_config(cfg, saved, overrides)
  if latest is None:  # nothing to restore: a new run with the saved config
    cfg.resume = False
    head = f"{logdir}'s run stopped before its first checkpoint: it starts over with {source}"
  else:
    check_resume_overrides(saved, cfg)
    head = f"resuming {logdir} with {source}"
  return cfg, latest, head + (", overridden:\n" + "\n".join(notes) if notes else "")


def checkpoint_config(checkpoint_dir: pathlib.Path, step: int) -> ml_collections.ConfigDict:
  """The run config saved in checkpoint ``step``'s metadata (every checkpoint holds one)."""
  try:
    with Checkpointer(checkpoint_dir, keep=None) as checkpointer:
      return ml_collections.ConfigDict(checkpointer.read_metadata(step)["config"])
  except Exception as e:  # pylint: disable=broad-except  (orbax's errors for unreadable files)
    raise ConfigError(f"the run's {CONFIG_FILE} is missing or damaged and its checkpoint of "
                      f"step {step} holds no readable config ({checkpoint_dir / str(step)}: "
                      f"{type(e).__name__}: {e}); restore {CONFIG_FILE} from a backup") from None


# fields a checkpoint's arrays depend on: the policy's architecture (or pretrained model) and
# which drafter the run trains; a resume cannot change them
FIXED_BY_CHECKPOINT = ("model.", "drafter")


def check_resume_overrides(saved: ml_collections.ConfigDict,
                           cfg: ml_collections.ConfigDict) -> None:
  """Refuses, before anything is loaded, a resume whose overrides change what the checkpoint's
  arrays were made for (``FIXED_BY_CHECKPOINT``), naming the flag and the saved value."""
  stored, current = flatten(saved), flatten(cfg)
  for name in sorted(stored):
    if name in current and _differs(stored[name], current[name]) and any(
        name == f or (f.endswith(".") and name.startswith(f)) for f in FIXED_BY_CHECKPOINT):
      raise ConfigError(
          f"--config.{name}={current[name]!r} conflicts with the run's saved config "
          f"({name}={stored[name]!r}): its checkpoints hold arrays made for the saved value. "
          f"Drop --config.{name} to resume the run, or start a new run with it in another "
          "--config.logdir")


LEFTOVERS = "leftovers-"  # where a new run moves an earlier attempt's files (no checkpoint)


def set_aside_leftovers(logdir: pathlib.Path) -> pathlib.Path | None:
  """Moves whatever ``logdir`` holds (an attempt stopped before its first checkpoint: its
  config, metrics and events; earlier set-asides stay where they are) into a new
  ``<logdir>/leftovers-<time>/``, so that a new run never mixes its files with another's;
  returns that directory, or None when there was nothing to move."""
  if not logdir.is_dir():
    return None
  entries = [p for p in logdir.iterdir() if not p.name.startswith(LEFTOVERS)]
  if not entries:
    return None
  stamp = time.strftime("%Y%m%d-%H%M%S")
  aside, n = logdir / f"{LEFTOVERS}{stamp}", 1
  while aside.exists():
    n += 1
    aside = logdir / f"{LEFTOVERS}{stamp}-{n}"
  aside.mkdir()
  for entry in entries:
    entry.rename(aside / entry.name)
  return aside


def save_run_config(cfg: ml_collections.ConfigDict, logdir: pathlib.Path) -> None:
  """Writes the run's effective config (without where the run lives) to ``<logdir>/config.json``."""
  logdir.mkdir(parents=True, exist_ok=True)
  saved = ml_collections.ConfigDict({k: v for k, v in cfg.to_dict().items()
                                     if k not in RUN_FIELDS})
  write_json_config(saved, logdir / CONFIG_FILE)



def resume_config(cfg: ml_collections.ConfigDict, saved: ml_collections.ConfigDict,
                  overrides: Iterable[str] | None) -> tuple[ml_collections.ConfigDict, list[str]]:
  """The saved run config with ``overrides`` (dotted names) taken from ``cfg``.

  ``overrides=None`` takes every field of ``cfg`` that differs from the saved one. Returns the
  merged config and one line per override or dropped field, for the console.
  """
  current, stored = flatten(cfg), flatten(saved)
  if overrides is None:
    overrides = {k for k, v in current.items() if k in stored and _differs(stored[k], v)}
  overrides = set(overrides) - RUN_FIELDS
  merged = ml_collections.ConfigDict(cfg.to_dict())
  notes = []
  for name, value in stored.items():
    if name in RUN_FIELDS:
      continue
    if name not in current:
      notes.append(f"  the saved field {name}={value!r} is no longer a config field: ignored")
    elif name in overrides:
      if _differs(value, current[name]):
        notes.append(f"  {name}: {value!r} -> {current[name]!r} (override)")
    else:
      set_dotted(merged, name, value)
  for name, value in BEFORE_THE_FIELD.items():
    if name in current and name not in stored and name not in overrides:
      set_dotted(merged, name, value)
      notes.append(f"  {name}={value!r}: the run was saved before the field existed, so it goes "
                   "on as it began")
  return merged, notes


def _differs(a, b) -> bool:
  return json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str)


class MetricsLog:
  """``metrics.jsonl`` plus tensorboard events; on resume, rows after ``resume_step`` are dropped
  (they belong to steps the resumed run does again). ``write=False`` (the processes other than
  process 0 of a multi-process run) keeps this run's rows in memory and writes no file."""

  def __init__(self, logdir: pathlib.Path, resume_step: int | None = None, write: bool = True):
    self.path = logdir / "metrics.jsonl"
    self.memory: list[dict] | None = None if write else []
    self.writer = None
    if not write:
      return
    if resume_step is not None and self.path.exists():
      kept = []
      for line in self.path.read_text(encoding="utf-8").splitlines():
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line torn by a kill
        if isinstance(row, dict) and row.get("step", 0) <= resume_step:
          kept.append(line)
      tmp = self.path.with_name(self.path.name + ".tmp")
      tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
      tmp.replace(self.path)
    self.jsonl = open(self.path, "a", encoding="utf-8")
    try:
      summary_writer = tensorboardx_writer_class()
      purge = None if resume_step is None else resume_step + 1
      self.writer = summary_writer(str(logdir), purge_step=purge)
    except ImportError:
      self.writer = None

  def write(self, step: int, metrics: dict) -> None:
    if self.memory is not None:
      self.memory.append({"step": step, **metrics})
      return
    self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
    self.jsonl.flush()
    if self.writer is not None:
      for key, value in metrics.items():
        if isinstance(value, (int, float)):
          self.writer.add_scalar(key, value, step)
      self.writer.flush()

  def rows(self) -> list[dict]:
    """Every row written so far (this run's and, on resume, the kept earlier ones)."""
    if self.memory is not None:
      return list(self.memory)
    return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines()]

  def close(self) -> None:
    if self.memory is not None:
      return
    self.jsonl.close()
    if self.writer is not None:
      self.writer.close()


def tensorboardx_writer_class():
  """tensorboardX's ``SummaryWriter``, imported without torch: where torch is installed,
  tensorboardX imports it only to accept torch tensors (the job logs Python floats), and that
  import slows every job's start. Raises ImportError without tensorboardX."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    if blocked and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


def export_final_model(trainer: GRPOTrainer, job: Job) -> pathlib.Path:
  """Writes the policy and its tokenizer to ``<logdir>/final_model`` atomically (a complete new
  directory replaces the old one), refusing non-finite weights."""
  model = nnx.merge(trainer.policy.graphdef, trainer.policy.rollout_params())  # gathered (FSDP)
  for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
    if count_nonfinite(leaf):
      raise FloatingPointError(f"final model not written: {jax.tree_util.keystr(path)} holds "
                               "non-finite values")
  def write(tmp):
    hf.save_pretrained(model, job.model_config, tmp)
    job.tokenizer.save(tmp)
  return replace_dir(job.logdir / FINAL_MODEL, write)


def export_final_drafter(trainer: GRPOTrainer, job: Job) -> pathlib.Path:
  """Writes the online-trained drafter to ``<logdir>/final_drafter`` atomically (loads with
  ``tlt_jax.models.drafter_io.load_drafter``)."""
  return replace_dir(job.logdir / FINAL_DRAFTER, lambda tmp: trainer.online.export(
      tmp, policy=trainer.policy.rollout_params(), policy_name=str(job.logdir / FINAL_MODEL)))


def export_final_speculators(job: Job) -> pathlib.Path | None:
  """Writes ``<logdir>/final_drafter`` again as a speculators ``eagle3`` checkpoint for the
  verifier ``<logdir>/final_model`` (both exported already), at
  ``<logdir>/final_drafter_speculators`` atomically; returns that directory, or None for an
  EAGLE-1 drafter, which the format cannot hold."""
  drafter = load_drafter(job.logdir / FINAL_DRAFTER, job.model_config)  # what final_drafter holds
  if not drafter.speculators_export:
    return None
  return export_speculators(drafter, job.logdir / FINAL_MODEL,
                            job.logdir / FINAL_DRAFTER_SPECULATORS)
