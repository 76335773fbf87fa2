"""Spot training: drafter optimizer steps on ``DataBuffer`` batches whenever a device is idle.

TLT trains the drafter online, in the gaps of RL: on a spare device while the policy rolls out
and updates, or (one device) for a bounded time between rollout and update. :class:`SpotTrainer`
owns the drafter's params and optimizer state and runs the jitted step of
:func:`tlt_jax.drafter.objective.make_train_step` on ``buffer.batch()`` batches until it is told to
stop, runs out of steps or time, or the buffer is empty.

Several idle devices train together in *rounds* (``run_rounds``): synchronous data-parallel steps
over the set of devices idle when the round starts. Each member computes the gradient of the
drafter loss on a ``buffer.batch()`` of its own with the current params (copied to it); the
gradients are averaged on the home device (where params and optimizer state live) and one
optimizer update is applied there. A device that becomes idle joins the next round. A round of
the home device alone is the fused train step ``run`` takes, so one idle device trains exactly as
``run`` does.

Preemption happens only between steps (rounds): every step started is finished and counted before
the stop signal is checked, so a preempted run loses no update and ``steps`` always equals the
optimizer's update count. Batches have fixed shapes and the frozen target's params are an
argument, so after the first step on a device nothing recompiles (new policy weights included);
``precompile`` compiles every executable a device may need ahead.

Threads: ``run`` and ``run_rounds`` may be called from any thread while others dispatch their own
JAX work (a round's members are dispatched from the calling thread; each device runs its part
asynchronously). One run at a time: a second concurrent call raises RuntimeError. ``evaluate``,
``params_copy`` and ``state_dict`` may be called while a run is going; they wait for the step in
flight and read a consistent ``(params, opt_state, steps)``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from tlt_jax.aot import AotCache
from tlt_jax.drafter.buffer import DataBuffer, EmptyBufferError
from tlt_jax.drafter.objective import (CE_WEIGHT, DrafterBatch, batch_loss, make_eval_step,
                                       make_optimizer, make_train_step, split_drafter)
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer


def _should_stop(stop: threading.Event | Callable[[], bool] | None) -> bool:
  if stop is None:
    return False
  if isinstance(stop, threading.Event):
    return stop.is_set()
  return bool(stop())


def _on_device(tree, device) -> bool:
  """Whether every leaf of ``tree`` is committed to ``device`` alone."""
  return all(leaf.committed and leaf.devices() == {device} for leaf in jax.tree.leaves(tree))


def make_grad_step(drafter_graphdef: nnx.GraphDef, target: Transformer | nnx.GraphDef, *,
                   ce_weight: float = CE_WEIGHT):
  """A jitted ``grad(drafter_params, target_params, batch) -> (grads, metrics)``: one round
  member's contribution (the train step's loss and gradient, no update, nothing donated)."""
  target_graphdef = nnx.split(target)[0] if isinstance(target, nnx.Module) else target

  def grad_step(drafter_params: nnx.State, target_params: nnx.State, batch: DrafterBatch):
    frozen = nnx.merge(target_graphdef, jax.lax.stop_gradient(target_params))

    def loss_fn(params):
      return batch_loss(nnx.merge(drafter_graphdef, params), frozen, batch, ce_weight)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(drafter_params)
    return grads, metrics

  return jax.jit(grad_step)


def make_apply_step(optimizer: optax.GradientTransformation):
  """A jitted ``apply(params, opt_state, grads, weights) -> (params, opt_state, grad_norm)``:
  ``grads`` a tuple of gradient trees (one per slot), ``weights`` a float32 vector of as many;
  the update uses ``sum_i weights[i] * grads[i]`` (a round: ``1/n`` for each of its ``n``
  members, 0 for unused slots). Params and optimizer state are donated."""

  def apply_step(params: nnx.State, opt_state: optax.OptState, grads: tuple, weights: jax.Array):
    def combine(*leaves):
      total = weights[0].astype(leaves[0].dtype) * leaves[0]
      for i, leaf in enumerate(leaves[1:], 1):
        total = total + weights[i].astype(leaf.dtype) * leaf
      return total

    mean = jax.tree.map(combine, *grads)
    updates, opt_state = optimizer.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.global_norm(mean)

  return jax.jit(apply_step, donate_argnums=(0, 1))


class SpotTrainer:
  """Trains ``drafter`` on ``buffer`` batches against a frozen target, in preemptible runs.

  ``params`` (the drafter's ``nnx.State`` of Params), ``opt_state`` and ``steps`` (optimizer
  updates applied in total) are the trainer's state; ``optimizer`` defaults to
  ``make_optimizer(learning_rate)``. ``target`` gives only the graph definition: its params are
  passed to each ``run``/``evaluate``.
  """

  def __init__(self, drafter: Drafter, target: Transformer | nnx.GraphDef, buffer: DataBuffer, *,
               optimizer: optax.GradientTransformation | None = None,
               learning_rate: float = 1e-3, ce_weight: float = CE_WEIGHT):
    if not isinstance(buffer, DataBuffer):
      raise TypeError(f"SpotTrainer needs a DataBuffer, got {type(buffer).__name__}")
    self.buffer = buffer
    self.graphdef, self.params = split_drafter(drafter)
    self.optimizer = make_optimizer(learning_rate) if optimizer is None else optimizer
    self.opt_state = self.optimizer.init(self.params)
    self.steps = 0
    self._train_step = make_train_step(self.graphdef, target, self.optimizer, ce_weight=ce_weight)
    self._eval_step = make_eval_step(self.graphdef, target, ce_weight=ce_weight)
    self._grad_step = make_grad_step(self.graphdef, target, ce_weight=ce_weight)
    self._apply_step = make_apply_step(self.optimizer)
    self.feature_size = drafter.feature_size  # width of the buffer's features (EAGLE-3: wider)
    self._compiled = AotCache()  # ahead-of-time, per (kind, device)
    self._run_lock = threading.Lock()  # one run at a time
    self._state_lock = threading.RLock()  # (params, opt_state, steps) change together

  # ---------------------------------------------------------------------------------- training

  def run(self, target_params: nnx.State, *,
          stop: threading.Event | Callable[[], bool] | None = None,
          max_steps: int | None = None, max_seconds: float | None = None,
          device: jax.Device | None = None) -> dict:
    """Trains until ``stop`` is set (an Event, or a callable returning True), ``max_steps``
    steps are done, the time budget is spent, or the buffer is empty; at least one bound needed.

    ``device`` defaults to the one the params live on; params and optimizer state move there
    when they live elsewhere. ``target_params`` must already be on it. Every step started is
    completed and counted before ``stop`` is checked. A step is started only while the previous
    step's duration still fits into what is left of ``max_seconds``. Returns ``steps``, ``seconds``,
    the mean ``loss`` and ``top1`` over this run's steps (None without steps), ``preempted``
    (True when ``stop`` ended the run) and ``tokens`` (trained tokens seen).
    """
    if stop is None and max_steps is None and max_seconds is None:
      raise ValueError("SpotTrainer.run needs stop, max_steps or max_seconds; without any it "
                       "would train forever")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 0):
      raise ValueError(f"SpotTrainer.run: max_steps must be a non-negative int, got {max_steps!r}")
    if not self._run_lock.acquire(blocking=False):
      raise RuntimeError("SpotTrainer.run is already running in another thread; stop it (its "
                         "stop event) and wait for it before starting another")
    try:
      return self._run(target_params, stop, max_steps, max_seconds, device)
    finally:
      self._run_lock.release()

  def _run(self, target_params, stop, max_steps, max_seconds, device) -> dict:
    start = time.perf_counter()
    device = self._place(device)
    steps, tokens, losses, top1s = 0, 0, [], []
    preempted = False
    last_step_seconds = 0.0
    while max_steps is None or steps < max_steps:
      if _should_stop(stop):
        preempted = True
        break
      if max_seconds is not None and (time.perf_counter() - start + last_step_seconds
                                      > max_seconds):
        break
      try:
        batch = self.buffer.batch()
      except EmptyBufferError:
        break
      began = time.perf_counter()
      batch = jax.device_put(batch, device)
      with self._state_lock:
        step = self.step_for("train", device)
        self.params, self.opt_state, metrics = step(self.params, self.opt_state, target_params,
                                                    batch)
        self.steps += 1
      metrics = jax.device_get(metrics)  # waits for the step: it is done before stop is checked
      last_step_seconds = time.perf_counter() - began
      steps += 1
      tokens += int(metrics["num_tokens"])
      losses.append(float(metrics["loss"]))
      top1s.append(float(metrics["top1"]))
    return dict(steps=steps, seconds=time.perf_counter() - start,
                loss=float(np.mean(losses)) if losses else None,
                top1=float(np.mean(top1s)) if top1s else None,
                preempted=preempted, tokens=tokens)

  def run_rounds(self, members: Callable[[], Sequence[tuple[Hashable, jax.Device, nnx.State]]],
                 *, device: jax.Device, slots: int,
                 stop: threading.Event | Callable[[], bool] | None = None,
                 max_rounds: int | None = None) -> dict:
    """Trains in synchronous data-parallel rounds over the devices ``members()`` names, until
    ``stop`` is set, ``max_rounds`` rounds are done or the buffer is empty (one bound needed).

    ``members()`` is asked each round for at most ``slots`` ``(label, device, target_params)``
    triples; each member computes a gradient on its own batch and the mean is applied on ``device``.
    A round is one optimizer update, always finished before ``stop`` is checked. Returns ``run``'s
    keys plus ``contributions``, ``participants`` and per-label ``devices``: docs/library.md,
    "SpotTrainer.run_rounds".
    """
    if stop is None and max_rounds is None:
      raise ValueError("SpotTrainer.run_rounds needs stop or max_rounds; without either it would "
                       "train forever")
    if max_rounds is not None and (not isinstance(max_rounds, int) or max_rounds < 0):
      raise ValueError(f"SpotTrainer.run_rounds: max_rounds must be a non-negative int, got "
                       f"{max_rounds!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
      raise ValueError(f"SpotTrainer.run_rounds: slots must be a positive int (how many devices "
                       f"may take part in a round), got {slots!r}")
    if not self._run_lock.acquire(blocking=False):
      raise RuntimeError("SpotTrainer.run_rounds: a run is already going in another thread; stop "
                         "it (its stop event) and wait for it before starting another")
    try:
      return self._rounds(members, device, slots, stop, max_rounds)
    finally:
      self._run_lock.release()

  def _rounds(self, members, device, slots, stop, max_rounds) -> dict:
    start = time.perf_counter()
    home = self._place(device)
    rounds, tokens, losses, top1s, sizes = 0, 0, [], [], []
    per: dict[Hashable, dict] = {}
    preempted = False
    while max_rounds is None or rounds < max_rounds:
      if _should_stop(stop):
        preempted = True
        break
      team = list(members())
      if not team:
        break
      if len(team) > slots:
        raise ValueError(f"SpotTrainer.run_rounds: members() named {len(team)} devices but "
                         f"slots={slots}; pass slots= the most devices that may take part")
      try:
        batches = [self.buffer.batch() for _ in team]
      except EmptyBufferError:
        break
      began = time.perf_counter()
      metrics = jax.device_get(self._round(team, batches, home, slots))  # waits for the round
      seconds = time.perf_counter() - began
      rounds += 1
      sizes.append(len(team))
      for (label, _, _), m in zip(team, metrics):
        mine = per.setdefault(label, dict(contributions=0, seconds=0.0))
        mine["contributions"] += 1
        mine["seconds"] += seconds
        tokens += int(m["num_tokens"])
        losses.append(float(m["loss"]))
        top1s.append(float(m["top1"]))
    return dict(steps=rounds, seconds=time.perf_counter() - start,
                loss=float(np.mean(losses)) if losses else None,
                top1=float(np.mean(top1s)) if top1s else None,
                preempted=preempted, tokens=tokens, contributions=int(sum(sizes)),
                participants=sizes, devices=per)

  def _round(self, team, batches, home, slots) -> list:
    """Dispatches one round (see ``run_rounds``) and updates the state; returns each member's
    metrics (device arrays)."""
    with self._state_lock:
      if len(team) == 1 and team[0][1] == home:  # the home device alone: run's fused step
        step = self.step_for("train", home)
        self.params, self.opt_state, metrics = step(self.params, self.opt_state, team[0][2],
                                                    jax.device_put(batches[0], home))
        self.steps += 1
        return [metrics]
      grads, out = [], []
      for (_, device, target_params), batch in zip(team, batches):
        params = self.params if device == home else jax.device_put(self.params, device)
        g, metrics = self.step_for("grad", device)(params, target_params,
                                                   jax.device_put(batch, device))
        grads.append(g if device == home else jax.device_put(g, home))
        out.append(metrics)
      weights = np.zeros(slots, np.float32)
      weights[:len(team)] = 1.0 / len(team)
      grads += [grads[0]] * (slots - len(team))  # weight 0
      apply = self.step_for("apply", home, slots)
      self.params, self.opt_state, _ = apply(self.params, self.opt_state, tuple(grads),
                                             jax.device_put(weights, home))
      self.steps += 1
      return out

  def _home(self) -> jax.Device:
    """The single device the params live on."""
    devices = set().union(*(leaf.devices() for leaf in jax.tree.leaves(self.params)))
    if len(devices) != 1:
      raise ValueError(f"the drafter params span {len(devices)} devices; pass device= to say "
                       "where to train")
    return devices.pop()

  def _place(self, device: jax.Device | None) -> jax.Device:
    """Commits params and optimizer state to ``device`` (default: where the params are)."""
    with self._state_lock:
      device = self._home() if device is None else device
      if not (_on_device(self.params, device) and _on_device(self.opt_state, device)):
        self.params, self.opt_state = jax.device_put((self.params, self.opt_state), device)
      return device

  # ---------------------------------------------------------------------------------- reading

  def _batch_spec(self, device) -> DrafterBatch:
    """The shapes of every ``buffer.batch()`` (fixed by the buffer's rows and seq_len)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    rows, length = self.buffer.rows, self.buffer.seq_len
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    feats = spec((rows, length, self.feature_size), self.buffer.dtype)
    return DrafterBatch(tokens=spec((rows, length), np.int32), features=feats,
                        next_features=feats, next_logits=None,
                        mask=spec((rows, length), np.float32),
                        positions=spec((rows, length), np.int32),
                        segment_ids=spec((rows, length), np.int32))

  def precompile(self, target_params: nnx.State, device: jax.Device,
                 slots: int | None = None) -> None:
    """Compiles the train and eval steps for ``device`` now (``target_params`` on it), so that
    the first run there does not compile inside a rollout's tail; with ``slots`` (the most
    devices a round may have) also ``run_rounds``' gradient step and its apply step for rounds
    homed there."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    with self._state_lock:
      params, opt_state = jax.tree.map(spec, (self.params, self.opt_state))
    target, batch = jax.tree.map(spec, target_params), self._batch_spec(device)
    self._compiled.get(("train", device),
                       lambda: self._train_step.lower(params, opt_state, target, batch))
    self._compiled.get(("eval", device), lambda: self._eval_step.lower(params, target, batch))
    if slots is None:
      return
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
      raise ValueError(f"SpotTrainer.precompile: slots must be a positive int, got {slots!r}")
    weights = jax.ShapeDtypeStruct((slots,), np.float32, sharding=sharding)
    self._compiled.get(("grad", device), lambda: self._grad_step.lower(params, target, batch))
    self._compiled.get(("apply", device, slots), lambda: self._apply_step.lower(
        params, opt_state, (params,) * slots, weights))

  def step_for(self, kind: str, device: jax.Device, *key):
    """The train, eval, grad or apply step for ``device`` (apply: and its slot count): its
    ahead-of-time executable once ``precompile`` made one, else the jitted function (which
    compiles on first use)."""
    compiled = self._compiled.lookup((kind, device, *key))
    if compiled is not None:
      return compiled
    return dict(train=self._train_step, eval=self._eval_step, grad=self._grad_step,
                apply=self._apply_step)[kind]

  def evaluate(self, target_params: nnx.State, batch: DrafterBatch | None = None,
               device: jax.Device | None = None, params: nnx.State | None = None) -> dict:
    """Metrics (``loss``, ``feature_loss``, ``ce_loss``, ``top1``, ``tokens``) of the current
    params (or of ``params``, e.g. the weights an engine drafted with) on ``batch``, by default
    ``buffer.freshest_batch()``; without data the values are None and ``tokens`` is 0. No
    update; the params stay where they are."""
    if batch is None:
      batch = self.buffer.freshest_batch()
    if batch is None:
      return dict(loss=None, feature_loss=None, ce_loss=None, top1=None, tokens=0)
    with self._state_lock:
      device = self._home() if device is None else device
      params = self.params if params is None else params
      if not _on_device(params, device):
        params = jax.device_put(params, device)
      step = self.step_for("eval", device)
      metrics = jax.device_get(step(params, target_params, jax.device_put(batch, device)))
    out = {key: float(metrics[key]) for key in ("loss", "feature_loss", "ce_loss", "top1")}
    return dict(out, tokens=int(metrics["num_tokens"]))

  def params_copy(self, device: jax.Device | None = None) -> nnx.State:
    """A fresh copy of the params committed to ``device`` (default: theirs). It never aliases
    ``params``, whose buffers the next train step donates, so it stays valid (e.g. for drafting
    on another device while training goes on)."""
    with self._state_lock:
      device = self._home() if device is None else device
      return jax.block_until_ready(jax.device_put(self.params, device, may_alias=False))

  # ---------------------------------------------------------------------------------- state

  def state_dict(self) -> dict[str, Any]:
    """``params`` and ``opt_state`` (their trees with numpy leaves) and ``steps`` (an int)."""
    with self._state_lock:
      params, opt_state = jax.device_get((self.params, self.opt_state))
      return dict(params=jax.tree.map(np.array, params),
                  opt_state=jax.tree.map(np.array, opt_state), steps=int(self.steps))

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Loads a ``state_dict`` (same drafter and optimizer structure) onto the device the params
    are on now. Not while a run is going (RuntimeError)."""
    if not self._run_lock.acquire(blocking=False):
      raise RuntimeError("SpotTrainer.load_state_dict: a run is going; stop it first")
    try:
      with self._state_lock:
        device = self._home()
        params = _like(self.params, state["params"], "params")
        opt_state = _like(self.opt_state, state["opt_state"], "opt_state")
        self.params, self.opt_state = jax.device_put((params, opt_state), device)
        self.steps = int(state["steps"])
    finally:
      self._run_lock.release()


def _like(current, saved, name: str):
  """``saved`` checked against ``current``'s tree structure, shapes and dtypes (numpy leaves)."""
  if jax.tree.structure(saved) != jax.tree.structure(current):
    raise ValueError(f"SpotTrainer.load_state_dict: the saved {name} have another structure "
                     "than this trainer's (another drafter config or optimizer?)")
  out = []
  for (path, mine), theirs in zip(jax.tree_util.tree_flatten_with_path(current)[0],
                                  jax.tree.leaves(saved)):
    theirs = np.asarray(theirs)
    if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
      raise ValueError(f"SpotTrainer.load_state_dict: {name}{jax.tree_util.keystr(path)} is "
                       f"{theirs.dtype}{list(theirs.shape)} in the state but "
                       f"{mine.dtype}{list(mine.shape)} here")
    out.append(theirs)
  return jax.tree.unflatten(jax.tree.structure(current), out)
