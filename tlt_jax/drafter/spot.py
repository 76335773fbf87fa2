"""Spot training: drafter optimizer steps on ``DataBuffer`` batches whenever a device is idle.

TLT trains the drafter online, in the gaps of RL: on a spare device while the policy rolls out
and updates, or (one device) for a bounded time between rollout and update. :class:`SpotTrainer`
owns the drafter's params and optimizer state and runs the jitted step of
:func:`tlt_jax.drafter.train.make_train_step` on ``buffer.batch()`` batches until it is told to
stop, runs out of steps or time, or the buffer is empty.

Preemption happens only between steps: every step started is finished and counted before the stop
signal is checked, so a preempted run loses no update and ``steps`` always equals the optimizer's
update count. Batches have fixed shapes and the frozen target's params are an argument, so after
the first step on a device nothing recompiles (new policy weights included).

Threads: ``run`` may be called from any thread while others dispatch their own JAX work. One
``run`` at a time: a second concurrent call raises RuntimeError. ``evaluate``, ``params_copy`` and
``state_dict`` may be called while a run is going; they wait for the step in flight and read a
consistent ``(params, opt_state, steps)``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx

from tlt_jax.aot import AotCache
from tlt_jax.drafter.buffer import DataBuffer, EmptyBufferError
from tlt_jax.drafter.train import (CE_WEIGHT, DrafterBatch, make_eval_step, make_optimizer,
                                   make_train_step, split_drafter)
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
    self.hidden_size = drafter.config.hidden_size
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
        step = self._step("train", device)
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
    feats = spec((rows, length, self.hidden_size), self.buffer.dtype)
    return DrafterBatch(tokens=spec((rows, length), np.int32), features=feats,
                        next_features=feats, next_logits=None,
                        mask=spec((rows, length), np.float32),
                        positions=spec((rows, length), np.int32),
                        segment_ids=spec((rows, length), np.int32))

  def precompile(self, target_params: nnx.State, device: jax.Device) -> None:
    """Compiles the train and eval steps for ``device`` now (``target_params`` on it), so that
    the first run there does not compile inside a rollout's tail."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    with self._state_lock:
      params, opt_state = jax.tree.map(spec, (self.params, self.opt_state))
    target, batch = jax.tree.map(spec, target_params), self._batch_spec(device)
    self._compiled.get(("train", device),
                       lambda: self._train_step.lower(params, opt_state, target, batch))
    self._compiled.get(("eval", device), lambda: self._eval_step.lower(params, target, batch))

  def _step(self, kind: str, device: jax.Device):
    """The train or eval step for ``device``: its ahead-of-time executable once ``precompile``
    made one, else the jitted function (which compiles on first use)."""
    compiled = self._compiled.lookup((kind, device))
    if compiled is not None:
      return compiled
    return self._train_step if kind == "train" else self._eval_step

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
      step = self._step("eval", device)
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
