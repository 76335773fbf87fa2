"""How much an RL step samples and how it updates (``TrainerConfig``), and the rules that tie
those numbers to the devices: a step's rows split into equal minibatches over the update mesh
(``check_update_layout``), and the rollout runs on at most the mesh's devices of this process
(``check_rollout_devices``).
"""

from __future__ import annotations

import dataclasses
import math

from tlt_jax.rl import grpo
from tlt_jax.rl.packing import UPDATE_BUCKET_MIN
from tlt_jax.utils import FieldError, require_positive_ints


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """How much to sample and how to update per RL step."""

  steps: int = 20
  prompts_per_step: int = 8
  learning_rate: float = 3e-4
  warmup_steps: int = 2
  grad_clip: float = 1.0
  minibatches: int = 1
  epochs: int = 1
  max_new_tokens: int = 96
  temperature: float = 1.0
  eval_problems: int = 64
  seed: int = 0
  # A non-finite loss, gradient or new param always leaves the params and optimizer state as they
  # were. "stop": the step raises NonFiniteUpdateError with the params from before the step;
  # "skip": the step goes on without that minibatch and reports it in `skipped_updates`.
  # ("stop" with several updates per step holds a device copy of params + optimizer state
  # through the step's updates, to restore them.)
  on_nonfinite: str = "stop"
  # Token budget (rows x length) of one policy-update micro-batch. Each minibatch's sequences
  # (rows with a completion) are packed back to back, first-fit decreasing, into rows of the
  # shortest length of a power-of-two ladder (16, 32, ..., ending at max_prompt_len +
  # max_new_tokens) that holds the longest one; a micro-batch of length T holds
  # update_tokens // T packed rows (at most the minibatch, a multiple of the mesh devices and at
  # least one row per device, so a length above the budget still runs). Their gradients are
  # summed into one optimizer step equal to the full-length update's. Bounds update memory; the
  # cost follows the live lengths. A budget well above a minibatch's real tokens pads its packed
  # rows back up (docs/benchmarks.md). Raise it on accelerators, which want bigger passes.
  # 0: pad every row to the full length and update each minibatch in one pass.
  update_tokens: int = 2048
  # 0: fresh problems every step, drawn from (seed, step). > 0: epoch mode, a fixed set of this
  # many problems (distinct prompts) drawn once from the seed and visited once per epoch in a
  # shuffled order (``tasks.EpochSchedule``); at least prompts_per_step
  num_prompts: int = 0
  # Where the policy loss's old log-probs come from. "policy" (the default): the update's own
  # forward pass over the step's completions with the params that sampled them, before the
  # step's first update: they depend on the params and tokens alone. "rollout": the log-probs the
  # rollout engine computed while sampling (no extra forward pass over the step's tokens), whose
  # last bits depend on how it decoded: a speculative step's verify pass over
  # several tokens rounds otherwise than a one-token decode step, so the tuner's timed choice of
  # arm would change the losses, and the run would not follow its seed alone.
  old_logprobs: str = "policy"
  # The no-update control: the same job (rollouts, rewards, drafter, held-out evaluations) with
  # every policy update skipped, so the params stay bit for bit the warm start's. Its held-out
  # curve is what the RL run's is measured against (held-out evaluation is a function of the
  # params alone: fixed problems, fixed sampling seed).
  control: bool = False
  # Held-out evaluation (greedy accuracy and sampled reward on the eval_problems) every this many
  # steps, into metrics.jsonl and tensorboard beside the step's metrics; 0: at the start and the
  # end only. Each costs two generations over eval_problems.
  eval_every: int = 0
  # pass@k of each held-out evaluation at the trainer's temperature: whether any of eval_pass_k
  # samples of a problem is right, over the first eval_pass_problems held-out problems (0: none)
  eval_pass_k: int = 0
  eval_pass_problems: int = 128

  def __post_init__(self):
    require_positive_ints(self, "steps", "prompts_per_step", "minibatches", "epochs",
                          "max_new_tokens", "eval_problems")
    bad = lambda field, problem: FieldError("TrainerConfig", field, problem)
    if not isinstance(self.control, bool):
      raise bad("control", f"must be True or False, got {self.control!r}")
    every = self.eval_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
      raise bad("eval_every", f"must be an int >= 0 (steps between held-out evaluations; 0: at "
                f"the start and the end only), got {every!r}")
    for name in ("eval_pass_k", "eval_pass_problems"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(name, f"must be an int >= 0, got {value!r}")
    if self.eval_pass_k and not self.eval_pass_problems:
      raise bad("eval_pass_problems", f"must be >= 1 where eval_pass_k={self.eval_pass_k} "
                "(or set eval_pass_k=0: no pass@k)")
    if not (isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < math.inf):
      raise bad("learning_rate", f"must be a finite number > 0, got {self.learning_rate!r}")
    if not self.temperature > 0:
      raise bad("temperature", f"must be > 0 for RL sampling, got {self.temperature!r}")
    if self.warmup_steps < 0:
      raise bad("warmup_steps", f"must be >= 0, got {self.warmup_steps!r}")
    n = self.num_prompts
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise bad("num_prompts", f"must be an int >= 0 (0: fresh problems every step), got {n!r}")
    if 0 < n < self.prompts_per_step:
      raise bad("num_prompts", f"({n}) is fewer than prompts_per_step ({self.prompts_per_step}): "
                f"every step would repeat a prompt; use at least {self.prompts_per_step} (or 0: "
                "fresh problems every step)")
    if self.old_logprobs not in ("policy", "rollout"):
      raise bad("old_logprobs", f"must be 'policy' or 'rollout', got {self.old_logprobs!r}")
    if self.on_nonfinite not in ("stop", "skip"):
      raise bad("on_nonfinite", f"must be 'stop' or 'skip', got {self.on_nonfinite!r}")
    budget = self.update_tokens
    if (not isinstance(budget, int) or isinstance(budget, bool)
        or not (budget == 0 or budget >= UPDATE_BUCKET_MIN)):
      raise bad("update_tokens", f"must be an int >= {UPDATE_BUCKET_MIN} (tokens per update "
                f"micro-batch) or 0 (full-length updates), got {budget!r}")

class UpdateLayoutError(ValueError):
  """A step's rows do not split into equal minibatches over the update mesh's devices."""


def check_update_layout(config: TrainerConfig, grpo_config: grpo.GRPOConfig, devices: int) -> None:
  """Raises ``UpdateLayoutError`` unless a step's rows split into equal minibatches over
  ``devices``."""
  rows = config.prompts_per_step * grpo_config.group_size
  if rows % config.minibatches or (rows // config.minibatches) % devices:
    raise UpdateLayoutError(
        f"TrainerConfig.prompts_per_step x GRPOConfig.group_size = {rows} rows must split into "
        f"TrainerConfig.minibatches={config.minibatches} minibatches whose size divides over "
        f"{devices} devices: change those fields or the devices")


def check_rollout_devices(value, available: int | None = None,
                          name: str = "rollout_devices") -> None:
  """Raises ``ValueError`` unless ``value`` (how many devices roll out; 0: all of them) is an int
  >= 0 and, where ``available`` (this process's devices of the mesh) is given, at most that.
  ``name``: what the message calls the value (the job's ``config.rollout_devices``)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{name} must be an int >= 0 (0: every device of the mesh), got {value!r}")
  if available is not None and value > available:
    raise ValueError(f"{name}={value} but the mesh has {available} devices in this process; use "
                     f"0 for all of them")


@dataclasses.dataclass(frozen=True)
class StepDevices:
  """The devices of a trainer's steps, checked once, where this is made: the update mesh's
  ``mesh_size`` devices, of which this process holds ``local``, and how many of those roll out
  (``rollout``; 0: all). The rollout's devices must be this process's (``check_rollout_devices``)
  and a step's rows must split into equal minibatches over the mesh (``check_update_layout``).
  The job makes one before any model exists and hands it to the trainer, which makes its own
  only where it is given none."""

  config: TrainerConfig
  grpo_config: grpo.GRPOConfig
  mesh_size: int
  local: int
  rollout: int = 1

  def __post_init__(self):
    check_rollout_devices(self.rollout, self.local)
    check_update_layout(self.config, self.grpo_config, self.mesh_size)

  def fits(self, config: TrainerConfig, grpo_config: grpo.GRPOConfig, mesh_size: int,
           local: int, rollout: int) -> bool:
    """Whether these are the devices checked for (no rule runs again)."""
    return (self.config is config and self.grpo_config is grpo_config and
            (self.mesh_size, self.local, self.rollout) == (mesh_size, local, rollout))
