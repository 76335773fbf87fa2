"""The GRPO trainer: rollout -> reward -> group advantages -> jitted policy updates.

One RL step samples ``prompts_per_step`` problems (deterministically from ``(seed, step)``, so
the data position is the step number), completes each ``group_size`` times with the rollout
engine, scores the completions with the task's verifiable reward, and takes ``minibatches``
clipped policy-gradient steps per epoch. Updates run data-parallel over a 1-D ``Mesh`` (batch
rows sharded over ``data``, params replicated; XLA inserts the gradient all-reduce). An update
whose loss, gradient or new params are not finite is never applied (``on_nonfinite``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax import checkpoint as ckpt
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import Transformer
from tlt_jax.rl import grpo
from tlt_jax.rl.tasks import Problem
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.utils import require_positive_ints


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

  def __post_init__(self):
    require_positive_ints(self, "steps", "prompts_per_step", "minibatches", "epochs",
                          "max_new_tokens", "eval_problems")
    if not self.learning_rate > 0:
      raise ValueError(f"TrainerConfig.learning_rate must be > 0, got {self.learning_rate!r}")
    if not self.temperature > 0:
      raise ValueError(f"TrainerConfig.temperature must be > 0 for RL sampling, got "
                       f"{self.temperature!r}")
    if self.warmup_steps < 0:
      raise ValueError(f"TrainerConfig.warmup_steps must be >= 0, got {self.warmup_steps!r}")
    if self.on_nonfinite not in ("stop", "skip"):
      raise ValueError(f"TrainerConfig.on_nonfinite must be 'stop' or 'skip', got "
                       f"{self.on_nonfinite!r}")


class NonFiniteUpdateError(FloatingPointError):
  """A policy update produced a non-finite loss, gradient or param (``on_nonfinite="stop"``)."""


def learning_rate_schedule(config: TrainerConfig) -> optax.Schedule:
  """Linear warmup over ``warmup_steps`` updates, starting above zero (no wasted update) at
  ``lr / (warmup_steps + 1)``; with ``warmup_steps=0`` every update runs at the full rate."""
  if config.warmup_steps == 0:
    return optax.constant_schedule(config.learning_rate)
  return optax.linear_schedule(config.learning_rate / (config.warmup_steps + 1),
                               config.learning_rate, config.warmup_steps)


def make_update_fn(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                   config: grpo.GRPOConfig, mesh: Mesh, temperature: float = 1.0):
  """A jitted ``update(params, opt_state, batch) -> (params, opt_state, metrics)`` over ``mesh``.

  Log-probs are of the sampling distribution, ``softmax(logits / temperature)``, as the rollout's
  old log-probs are: the first update of a step then has ratio 1 whatever the temperature.

  ``metrics["finite"]`` says whether the update was applied: when the loss, the gradient norm or
  any new param is not finite, the old params and optimizer state come back unchanged.
  """

  def logprobs_of(params, ids):
    logits = nnx.merge(graphdef, params)(ids)[:, :-1]
    return grpo.token_logprobs(logits / temperature, ids[:, 1:])

  def loss_fn(params, ref_params, batch):
    ref = None
    if config.kl_coef > 0:  # KL to the frozen reference policy (k3 estimator in policy_loss)
      ref = jax.lax.stop_gradient(logprobs_of(ref_params, batch["ids"]))
    return grpo.policy_loss(logprobs_of(params, batch["ids"]), batch["old_logprobs"],
                            batch["advantages"], batch["mask"], config, ref_logprobs=ref)

  def update(params, opt_state, batch, ref_params):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params, batch)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    for leaf in jax.tree.leaves(new_params):
      finite &= jnp.all(jnp.isfinite(leaf))
    keep = lambda new, old: jnp.where(finite, new, old)  # in-graph: no host round trip
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, finite=finite)
    return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt_state, opt_state),
            metrics)

  replicated = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, P("data"))
  batch_sharding = {"ids": rows, "old_logprobs": rows, "advantages": rows, "mask": rows}
  jitted = jax.jit(update, in_shardings=(replicated, replicated, batch_sharding, replicated),
                   out_shardings=(replicated, replicated, replicated), donate_argnums=(0, 1))
  return lambda params, opt_state, batch, ref_params=None: jitted(params, opt_state, batch,
                                                                  ref_params)


def check_update_layout(config: TrainerConfig, grpo_config: grpo.GRPOConfig, devices: int) -> None:
  """Raises ``ValueError`` unless a step's rows split into equal minibatches over ``devices``."""
  rows = config.prompts_per_step * grpo_config.group_size
  if rows % config.minibatches or (rows // config.minibatches) % devices:
    raise ValueError(
        f"trainer.prompts_per_step x grpo.group_size = {rows} rows must split into "
        f"trainer.minibatches={config.minibatches} minibatches whose size divides over "
        f"{devices} devices (set --config.mesh_devices, or change those fields)")


class GRPOTrainer:
  """Owns the policy params, optimizer state and rollout engine; ``step()`` runs one RL step."""

  def __init__(self, model: Transformer, tokenizer: CharTokenizer, task, engine_config: EngineConfig,
               grpo_config: grpo.GRPOConfig, config: TrainerConfig, mesh: Mesh | None = None,
               drafter=None):
    """``drafter`` (a ``Drafter`` or ``NgramConfig``) makes rollouts speculative; being lossless,
    it changes their speed, never what is sampled."""
    self.tokenizer, self.task, self.config, self.grpo_config = tokenizer, task, config, grpo_config
    self.mesh = mesh or Mesh(np.array(jax.devices()[:1]), ("data",))
    check_update_layout(config, grpo_config, self.mesh.size)
    if config.max_new_tokens > engine_config.max_new_tokens:
      raise ValueError(f"TrainerConfig.max_new_tokens={config.max_new_tokens} exceeds "
                       f"EngineConfig.max_new_tokens={engine_config.max_new_tokens}")
    self.engine = RolloutEngine(model, drafter=drafter, config=engine_config)
    self.graphdef, params = nnx.split(model)
    self.schedule = learning_rate_schedule(config)
    self.optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip),
                                 optax.adamw(self.schedule, b1=0.9, b2=0.99, weight_decay=0.0))
    replicated = NamedSharding(self.mesh, P())
    self.params = jax.device_put(params, replicated)
    self.opt_state = jax.device_put(self.optimizer.init(params), replicated)
    self._sync_engine()  # before anything compiles: the engine's executables take these arrays
    self.update_fn = make_update_fn(self.graphdef, self.optimizer, grpo_config, self.mesh,
                                    temperature=config.temperature)
    # the reference policy for the KL term: the starting (warm-started) weights, kept frozen
    self.ref_params = (jax.tree.map(jnp.copy, self.params) if grpo_config.kl_coef > 0 else None)
    self.seq_len = engine_config.max_prompt_len + config.max_new_tokens
    self.step_count = 0
    self.last_lengths = np.zeros(0, np.int64)  # completion lengths of the latest step

  def _sync_engine(self) -> None:
    """Hands the rollout engine the current params as single-device arrays.

    The rollout runs on one device (the mesh's first) whatever the mesh size: each param's
    device-0 shard of the replicated array is a zero-copy view of the same buffer, so the engine
    compiles once for one device and never sees a mesh sharding. (Compiling the engine for the
    replicated sharding instead would run every decode step redundantly on all devices.) The
    views die with the params they view, which the update donates: call this after every update.
    """
    self.engine.update_params(jax.tree.map(lambda x: x.addressable_data(0), self.params))

  # ---- data ---------------------------------------------------------------------------------
  def problems_for(self, step: int) -> list[Problem]:
    """The step's problems: a pure function of (seed, step), so a resumed run sees the same data."""
    return self.task.sample(np.random.default_rng([self.config.seed, step]),
                            self.config.prompts_per_step)

  def encode_prompt(self, problem: Problem) -> list[int]:
    return [self.tokenizer.bos_token_id] + self.tokenizer.encode(problem.prompt)

  def make_batch(self, prompts, completions, logprobs, advantages) -> dict[str, np.ndarray]:
    """Fixed-shape arrays: ids ``[N, L]``, and per predicted token ``[N, L-1]`` mask/old logprobs."""
    n, length = len(prompts), self.seq_len
    ids = np.full((n, length), self.tokenizer.pad_token_id, np.int32)
    mask = np.zeros((n, length - 1), np.float32)
    old = np.zeros((n, length - 1), np.float32)
    for i, (prompt, comp, lp) in enumerate(zip(prompts, completions, logprobs)):
      seq = prompt + comp
      ids[i, :len(seq)] = seq
      start = len(prompt) - 1  # the logit at position t predicts token t + 1
      mask[i, start:start + len(comp)] = 1.0
      old[i, start:start + len(comp)] = lp
    return dict(ids=ids, mask=mask, old_logprobs=old,
                advantages=np.asarray(advantages, np.float32))

  # ---- one RL step ---------------------------------------------------------------------------
  def step(self) -> dict[str, Any]:
    """Rollout, reward, advantages and policy updates for one step; returns its metrics."""
    cfg, g = self.config, self.grpo_config.group_size
    t0 = time.perf_counter()
    problems = self.problems_for(self.step_count)
    rows = [p for p in problems for _ in range(g)]  # each problem g times, group by group
    prompts = [self.encode_prompt(p) for p in rows]
    self._sync_engine()  # (cheap) in case the params were replaced from outside
    result = self.engine.generate(prompts, SamplingParams(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        seed=(cfg.seed * 1_000_003 + self.step_count) % 2**32))
    t_rollout = time.perf_counter() - t0
    texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    rewards = np.array([self.task.reward(p, t) for p, t in zip(rows, texts)], np.float32)
    advantages = np.asarray(grpo.group_advantages(jnp.asarray(rewards), g,
                                                  self.grpo_config.normalize_std,
                                                  self.grpo_config.eps))
    batch = self.make_batch(prompts, result.tokens, result.logprobs, advantages)
    t1 = time.perf_counter()
    metrics = []
    n = len(prompts)
    size = n // cfg.minibatches
    order_rng = np.random.default_rng([cfg.seed, self.step_count, 1])
    # "stop" restores the state from before the step; the update donates its inputs, so keep a
    # device copy (a single update needs none: a rejected update already returns its inputs)
    before = None
    if cfg.on_nonfinite == "stop" and cfg.epochs * cfg.minibatches > 1:
      before = jax.tree.map(jnp.copy, (self.params, self.opt_state))
    for _ in range(cfg.epochs):
      order = order_rng.permutation(n)
      for m in range(cfg.minibatches):
        picked = order[m * size:(m + 1) * size]
        mini = {k: v[picked] for k, v in batch.items()}
        self.params, self.opt_state, mm = self.update_fn(self.params, self.opt_state, mini,
                                                         self.ref_params)
        metrics.append(mm)
    metrics = jax.device_get(metrics)
    self._sync_engine()
    finite = [bool(m.pop("finite")) for m in metrics]
    if not all(finite) and cfg.on_nonfinite == "stop":
      if before is not None:
        self.params, self.opt_state = before
        self._sync_engine()
      bad = metrics[finite.index(False)]
      raise NonFiniteUpdateError(
          f"RL step {self.step_count + 1}: {finite.count(False)} of {len(finite)} policy updates "
          f"were not finite (first: loss {float(bad['loss'])}, grad_norm "
          f"{float(bad['grad_norm'])}); params and optimizer state are back to before the step. "
          f"Set TrainerConfig.on_nonfinite='skip' to drop such updates instead")
    t_update = time.perf_counter() - t1
    self.step_count += 1
    lengths = np.array([len(t) for t in result.tokens])
    self.last_lengths = lengths
    applied = [m for m, ok in zip(metrics, finite) if ok] or metrics  # all skipped: report NaNs
    out = {k: float(np.mean([m[k] for m in applied])) for k in applied[0]}
    out.update(step=self.step_count, skipped_updates=finite.count(False),
               reward=float(rewards.mean()),
               len_p50=float(np.percentile(lengths, 50)), len_p90=float(np.percentile(lengths, 90)),
               len_p99=float(np.percentile(lengths, 99)), len_max=int(lengths.max()),
               rollout_s=t_rollout, update_s=t_update, step_s=time.perf_counter() - t0,
               tail_s=tail_seconds(result.stats), compiles=result.stats["compiles"])
    return out

  # ---- checkpoints ----------------------------------------------------------------------------
  def _checkpoint_state(self) -> dict:
    # params as a nested dict (readable key paths in errors); optimizer state as its leaf list
    state = {"params": ckpt.state_to_pure_dict(self.params),
             "opt_state": jax.tree.leaves(self.opt_state),
             "step": np.asarray(self.step_count, np.int64)}
    if self.ref_params is not None:
      state["ref_params"] = ckpt.state_to_pure_dict(self.ref_params)
    return state

  def save(self, checkpointer: ckpt.Checkpointer, metadata: dict | None = None) -> None:
    """Saves params, optimizer state and the step (the data position is the step) atomically."""
    checkpointer.save(self.step_count, self._checkpoint_state(),
                      {"format": 1, "trainer": dataclasses.asdict(self.config), **(metadata or {})})

  def restore(self, checkpointer: ckpt.Checkpointer, step: int | None = None,
              report=print) -> dict:
    """Loads ``step``, or by default the newest checkpoint that passes verification (a corrupt
    newer one is reported through ``report`` and moved aside); returns its metadata."""
    like = self._checkpoint_state()
    if step is None:
      _, state, metadata = checkpointer.restore_latest_good(like=like, report=report)
    else:
      state, metadata = checkpointer.restore(step, like=like)
    replicated = NamedSharding(self.mesh, P())
    self.params = jax.device_put(ckpt.pure_dict_to_state(state["params"], self.params), replicated)
    treedef = jax.tree.structure(self.opt_state)
    self.opt_state = jax.device_put(jax.tree.unflatten(treedef, state["opt_state"]), replicated)
    if self.ref_params is not None:
      self.ref_params = jax.device_put(
          ckpt.pure_dict_to_state(state["ref_params"], self.ref_params), replicated)
    self.step_count = int(state["step"])
    self._sync_engine()
    return metadata

  def evaluate(self, n: int | None = None, seed: int = 10_000, temperature: float = 0.0,
               progress=None) -> float:
    """Mean reward on held-out problems (a fixed set, independent of training data): greedy
    accuracy at temperature 0, or the expected reward of the sampling policy otherwise.
    ``progress(rows_done, rows_total)`` is passed to the engine's ``generate``."""
    problems = self.task.sample(np.random.default_rng(seed), n or self.config.eval_problems)
    self._sync_engine()
    result = self.engine.generate([self.encode_prompt(p) for p in problems], SamplingParams(
        max_new_tokens=self.config.max_new_tokens, temperature=temperature, seed=seed),
        progress=progress)
    texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    return float(np.mean([self.task.reward(p, t) for p, t in zip(problems, texts)]))


def tail_seconds(stats: dict) -> float:
  """Decode time spent in segments where fewer than half of the chunk's rows were live."""
  segments = stats["segments"]  # (bucket, steps, seconds), in order
  if not segments:
    return 0.0
  first = segments[0][0]
  return float(sum(seconds for bucket, _, seconds in segments if bucket < first / 2))
