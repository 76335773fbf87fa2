"""The adaptive drafter in the RL loop: the rollout's hidden states feed a ``DataBuffer``, and a
``SpotTrainer`` trains the drafter on them where devices are idle, so the drafter follows the
policy as it changes.

Per RL step (``OnlineDrafter``):

1. the rollout keeps the target's last-layer hidden states of (a fraction of) its rows, read from
   the passes that produced the tokens (``generate(collect_hidden=...)``);
2. with several rollout devices, each device's finished shard goes into the buffer at once, and
   the devices whose shards are done train the drafter together until the last shard finishes:
   synchronous data-parallel rounds (``SpotTrainer.run_rounds``) over the devices idle when each
   round starts, each computing a gradient on a batch of its own, averaged and applied on the
   first idle device (where params and optimizer state live); a device that becomes idle joins
   the next round. These steps use time the tail leaves idle: *spot* steps;
3. with one rollout device nothing is idle, so the drafter trains between rollout and policy
   update under a budget (``serial_steps``/``serial_seconds``): these *serial* steps cost wall
   time and the metrics say so;
4. every engine gets a copy of the new drafter weights before the next rollout (same shapes: no
   recompile).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import threading
import time


import jax
import numpy as np
from flax import nnx

from tlt_jax import hosts
from tlt_jax.drafter.buffer import DataBuffer
from tlt_jax.drafter.ledger import DrafterLedger
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.drafter_io import save_drafter
from tlt_jax.rollout import RolloutStats
from tlt_jax.utils import FieldError

SERIAL_BUDGETS = ("ledger", "fixed")
BUFFER_FILE = "drafter_buffer.npz"
BUFFER_KEY = "drafter_buffer_sha256"  # checkpoint metadata: the buffer file's checksum
STATE_KEY = "drafter_host_state"  # checkpoint metadata: the ledger and the evaluation flags


_OWNER = "DrafterTrainingConfig"


@dataclasses.dataclass(frozen=True)
class DrafterTrainingConfig:
  """How the drafter trains online during RL."""

  learning_rate: float = 1e-3
  rows: int = 8  # packed rows per drafter step
  seq_len: int = 128  # (token, feature) pairs per packed row
  buffer_mb: float = 64.0  # the DataBuffer's bound
  keep_steps: int = 2  # RL steps the buffer keeps (2: the previous step's long responses too)
  collect: float = 1.0  # fraction of each rollout's rows whose hidden states are kept
  spot: bool = True  # with several rollout devices: train on the devices the tail leaves idle
  spot_devices: int = 0  # idle devices per spot round (0: every idle one; 1: one at a time)
  # Drafter steps between rollout and update (one rollout device, or spot off): "ledger" pays for
  # them from what speculative decoding saved (``drafter/ledger.py``), "fixed" runs serial_steps
  # (and/or serial_seconds) every RL step whether SD pays or not.
  serial_budget: str = "ledger"
  serial_steps: int = 8  # "fixed": drafter steps per RL step; "ledger": the most per RL step
  serial_seconds: float = 0.0  # "fixed": and/or a time budget for them (0: none)
  savings_share: float = 0.5  # "ledger": the share of SD's estimated saving spent on the drafter
  bootstrap_steps: int = 64  # "ledger": drafter steps granted before SD has saved anything
  # "ledger": the bootstrap's time budget, a share of each RL step's seconds until SD has paid
  # (None: max serial_steps bootstrap steps every RL step, up front)
  bootstrap_share: float | None = 0.03
  seed: int = 0

  def __post_init__(self):
    if isinstance(self.spot_devices, bool) or not isinstance(self.spot_devices, int) or \
        self.spot_devices < 0:
      raise FieldError(_OWNER, "spot_devices", f"must be an int >= 0 (0: every idle device), got "
                       f"{self.spot_devices!r}")
    for name in ("rows", "seq_len", "keep_steps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FieldError(_OWNER, name, f"must be a positive int, got {value!r}")
    if isinstance(self.serial_steps, bool) or not isinstance(self.serial_steps, int) or \
        self.serial_steps < 0:
      raise FieldError(_OWNER, "serial_steps", f"must be an int >= 0, got {self.serial_steps!r}")
    for name, low in (("learning_rate", 0.0), ("buffer_mb", 0.0)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
          value) or value <= low:
        raise FieldError(_OWNER, name, f"must be a positive number, got {value!r}")
    if not isinstance(self.collect, (int, float)) or not 0.0 < self.collect <= 1.0:
      raise FieldError(_OWNER, "collect", f"must be in (0, 1], got {self.collect!r}")
    if not isinstance(self.serial_seconds, (int, float)) or self.serial_seconds < 0:
      raise FieldError(_OWNER, "serial_seconds", f"must be >= 0, got {self.serial_seconds!r}")
    if self.serial_budget not in SERIAL_BUDGETS:
      raise FieldError(_OWNER, "serial_budget", f"must be one of {SERIAL_BUDGETS}, got "
                       f"{self.serial_budget!r}")
    if self.serial_budget == "ledger" and self.serial_seconds:
      raise FieldError(_OWNER, "serial_seconds", "is a fixed budget: set serial_budget='fixed' "
                       "with it, or leave it 0")
    try:
      DrafterLedger(self.savings_share, self.bootstrap_steps, self.serial_steps,
                    self.bootstrap_share)  # its rules: the ledger's, named as these fields
    except FieldError as e:
      raise FieldError(_OWNER, {"max_steps": "serial_steps"}.get(e.field, e.field),
                       e.problem) from None


class OnlineDrafter:
  """Owns the drafter's buffer and spot trainer, and the ``IdleWork`` the rollout runs."""

  def __init__(self, drafter: Drafter, target_graphdef: nnx.GraphDef,
               config: DrafterTrainingConfig = DrafterTrainingConfig()):
    self.config = config
    self.drafter_graphdef = nnx.split(drafter)[0]
    self.vocab_ids = drafter.vocab_ids
    self.buffer = DataBuffer(rows=config.rows, seq_len=config.seq_len,
                             max_bytes=int(config.buffer_mb * (1 << 20)),
                             keep_steps=config.keep_steps, seed=config.seed)
    self.spot = SpotTrainer(drafter, target_graphdef, self.buffer,
                            learning_rate=config.learning_rate)
    # how many idle devices may take part in a spot round (None: every idle one; 1: one device
    # at a time, the behaviour before rounds)
    self.spot_devices = config.spot_devices or None
    self._spot_runs: list[dict] = []
    self.ledger = (DrafterLedger(config.savings_share, config.bootstrap_steps, config.serial_steps,
                                 config.bootstrap_share)
                   if config.serial_budget == "ledger" else None)
    # the engines' drafter weights: scored yet? (an unchanged drafter is not scored again), and
    # whether training changed the weights since the engines got theirs
    self.evaluated = False
    self.changed = False
    self.quality: float | None = None  # the latest held-out top-1 (of the engines' weights)
    self._copy_s = 0.0  # seconds of the latest copy of the weights to the engines
    self._saved_steps: int | None = None  # optimizer steps at the latest selective save

  # ---- the rollout's idle work -------------------------------------------------------------------
  def collect_fraction(self) -> float | bool:
    return True if self.config.collect >= 1.0 else float(self.config.collect)

  def add(self, step: int, prompts, result, first_row: int = 0) -> int:
    """Adds the rows of ``result`` (prompts ``prompts[first_row:]``) that carry hidden states."""
    tokens, hidden, prompt_lens = [], [], []
    for j, h in enumerate(result.hidden or []):
      if h is None:
        continue
      prompt = prompts[first_row + j]
      tokens.append(np.asarray(prompt + result.tokens[j], np.int32))
      hidden.append(h)
      prompt_lens.append(len(prompt))
    if tokens:
      # within a step, add short sequences first: eviction takes a step's rows in arrival order,
      # so the long responses (the ones that finish last) are the last to go
      order = np.argsort([len(t) for t in tokens], kind="stable")
      self.buffer.add(step, [tokens[i] for i in order], [hidden[i] for i in order],
                      [prompt_lens[i] for i in order])
    return len(tokens)

  def idle_work(self, step: int, prompts, engine) -> SpotWork:
    """The ``IdleWork`` (``rollout.interface``) of RL step ``step``'s rollout on ``engine``: each
    finished shard goes into the buffer, and the idle devices train the drafter (``SpotWork``)."""
    work = SpotWork(self, step, prompts, engine)
    self._spot_runs = work.runs
    return work

  def serial(self, target_params, device=None, saved_s: float | None = None) -> dict:
    """Drafter steps between rollout and update on ``device`` (where ``target_params`` live),
    under the configured budget (with one rollout device, or with spot training off): "fixed"
    runs ``serial_steps``/``serial_seconds``; "ledger" credits the rollout's ``saved_s`` (its
    ``RolloutStats.sd_saved_s``) and runs what the ledger grants. ``bootstrap``: how many of the
    steps were the ledger's up-front grant."""
    c = self.config
    none = dict(steps=0, seconds=0.0, loss=None, top1=None, bootstrap=0)
    if self.ledger is None:
      if not c.serial_steps and not c.serial_seconds:
        return none
      return dict(self.spot.run(target_params, max_steps=c.serial_steps or None,
                                max_seconds=c.serial_seconds or None, device=device), bootstrap=0)
    self.ledger.credit(saved_s)
    steps, bootstrap = self.ledger.grant()
    if not steps or self.buffer.num_samples == 0:
      return none
    out = self.spot.run(target_params, max_steps=steps, device=device)
    return dict(out, bootstrap=min(bootstrap, out["steps"]))

  def end_step(self, step_s: float) -> None:
    """Tells the ledger (if any) how long the RL step took: its bootstrap's time budget."""
    if self.ledger is not None:
      self.ledger.allow(step_s)

  def spot_runs(self) -> list[dict]:
    return list(self._spot_runs)

  def engine_params(self, device=None) -> nnx.State:
    """A copy of the drafter weights for the engines (never donated by the trainer)."""
    t0 = time.perf_counter()
    params = self.spot.params_copy(device)
    self._copy_s, self.changed = time.perf_counter() - t0, False
    return params

  def new_engine_params(self, device=None) -> nnx.State | None:
    """``engine_params`` if training changed the weights since the engines got theirs, else
    None (an unchanged drafter is not copied again)."""
    if not self.changed:
      self._copy_s = 0.0
      return None
    return self.engine_params(device)

  def precompile(self, target_params_by_device: dict, slots: int | None = None) -> None:
    """Compiles the drafter's train and eval steps for every device that may train it (a dict
    device -> the target params there), so no first step compiles inside a rollout's tail; with
    ``slots`` (the most devices in a spot round) also each device's gradient step and the apply
    step of rounds homed there."""
    for device, target_params in target_params_by_device.items():
      self.spot.precompile(target_params, device, slots)

  def evaluate(self, target_params, device=None, params=None) -> dict:
    """Loss and top-1 agreement on the buffer's freshest step (on ``device``, where
    ``target_params`` live) of the current weights, or of ``params`` (the trainer passes the
    weights that drafted the step's rollout: a held-out score, before any training on it)."""
    batch = self.buffer.freshest_batch()
    return self.spot.evaluate(target_params, batch, device, params) if batch is not None else {}

  # ---- its part of an RL step -------------------------------------------------------------------
  def spot_trains(self, engine) -> bool:
    """Whether this step's drafter trains on the devices the tail leaves idle: spot training on,
    and an engine of several rollout devices."""
    return self.config.spot and len(engine.devices) > 1

  @staticmethod
  def cannot_pay(engine) -> bool:
    """Whether the engine's calibration offered none of the learned drafter's arms anywhere (so
    serial drafter steps and kept hidden states cost time that SD can never pay back). One
    process only: several processes' engines time their arms apart, and their drafters must
    take the same steps."""
    return jax.process_count() == 1 and not engine.learned_sd_possible()

  def rollout_options(self, step: int, prompts, engine) -> dict:
    """The extra ``engine.generate`` arguments of RL step ``step``: keep hidden states (unless
    the ledger has nothing left to grant: no bootstrap and no savings, or the engine offers none
    of the drafter's arms: ``cannot_pay``) and, with spot training,
    the ``idle_work`` that takes each finished shard into the buffer and trains on idle devices."""
    options = {"collect_hidden": self.collect_fraction()}
    if not self.spot_trains(engine) and ((self.ledger is not None and not self.ledger.can_grant())
                                         or self.cannot_pay(engine)):
      options["collect_hidden"] = False  # nothing will train on them: keeping them is waste
    if self.spot_trains(engine):
      options["idle_work"] = self.idle_work(step, prompts, engine)
    return options

  def after_rollout(self, step: int, prompts, result, engine) -> dict[str, float]:
    """The drafter's part of an RL step once its rollout is done; returns its metrics
    (``step_metrics``). Without spot training the rows go into the buffer now, in row order
    (whichever device finished first), and the drafter trains between rollout and update under
    its serial budget. The held-out score is of the weights that drafted this rollout, on its
    freshest data. The caller hands the engines the new weights (``engine_params``) afterwards."""
    t0 = time.perf_counter()
    spot = self.spot_trains(engine)
    if not spot:
      self.add(step, prompts, result)
    first = engine.devices[0]
    evaluation = {}
    if not self.evaluated:  # the engines' weights were not scored yet
      evaluation = self.evaluate(engine.target_params(0), first, params=engine.drafter_params)
      self.evaluated = bool(evaluation)
      if evaluation.get("top1") is not None:
        self.quality = float(evaluation["top1"])
    other_s = time.perf_counter() - t0 + self._copy_s  # the last copy to the engines, too
    saved_s = result.stats.sd_saved_s
    if spot:
      serial = None
    elif self.cannot_pay(engine):  # no arm of it is offered anywhere: training it is waste
      serial = dict(steps=0, seconds=0.0, loss=None, top1=None, bootstrap=0)
    else:
      serial = self.serial(engine.target_params(0), first, saved_s)
    runs = self.spot_runs() if spot else []
    if (serial or {}).get("steps") or any(r["steps"] for r in runs):
      self.changed, self.evaluated = True, False
    metrics = step_metrics(result.stats, runs, serial, evaluation)
    if self.ledger is not None and serial is not None:
      entry = self.ledger.spend(serial["steps"], serial["bootstrap"], serial["seconds"], other_s,
                                saved_s)
      metrics.update(ledger_balance_s=self.ledger.balance_s,
                     drafter_bootstrap_steps=entry.bootstrap)
      drafter_s = entry.drafter_s
    else:  # spot steps run in the tail: what waits for them is the rollout's overrun
      drafter_s = other_s + (serial or {}).get("seconds", 0.0) + metrics["spot_overrun_s"]
    metrics.update(tlt_saved_s=0.0 if saved_s is None else float(saved_s),
                   tlt_drafter_s=float(drafter_s))
    metrics["tlt_net_s"] = metrics["tlt_saved_s"] - metrics["tlt_drafter_s"]
    return metrics

  def sync_processes(self) -> float:
    """Several processes (``hosts.py``): makes every process's drafter the same again after each
    trained on its own idle devices from its own rows. The processes' params and optimizer
    states are averaged (in process order, so the result is bitwise the same everywhere; integer
    leaves such as Adam's count take the largest), the step count is the largest, and the
    evaluation flags say the weights changed wherever any process trained. Exchanged through
    the coordinator: a few tens of MB per step at most for the drafters here. Returns the seconds
    it took (0 with one process)."""
    if hosts.process_count() == 1:
      return 0.0
    t0 = time.perf_counter()
    state = self.spot.state_dict()
    leaves, treedef = jax.tree.flatten((state["params"], state["opt_state"]))
    mine = dict(leaves=leaves, steps=state["steps"], changed=self.changed,
                evaluated=self.evaluated, quality=self.quality)
    everyone = hosts.allgather(mine, "drafter_state")
    merged = []
    for i, leaf in enumerate(leaves):
      values = [np.asarray(p["leaves"][i]) for p in everyone]
      if np.issubdtype(leaf.dtype, np.floating):
        merged.append((np.sum(np.stack(values).astype(np.float64), 0) / len(values)).astype(
            leaf.dtype))
      else:
        merged.append(np.max(np.stack(values), 0).astype(leaf.dtype))
    params, opt_state = jax.tree.unflatten(treedef, merged)
    self.spot.load_state_dict(dict(params=params, opt_state=opt_state,
                                   steps=max(p["steps"] for p in everyone)))
    self.changed = any(p["changed"] for p in everyone)
    self.evaluated = all(p["evaluated"] for p in everyone) and not self.changed
    scores = [p["quality"] for p in everyone if p["quality"] is not None]
    self.quality = float(np.mean(scores)) if scores else None
    return time.perf_counter() - t0

  def precompile_on(self, engine) -> int:
    """Compiles every drafter executable a rollout device may run (spot rounds: every device's
    train, eval and gradient steps and the apply step of rounds homed there; serial steps: the
    first device's train and eval steps); returns how many devices."""
    spot = self.spot_trains(engine)
    n = len(engine.devices) if spot else 1
    self.precompile({engine.devices[k]: engine.target_params(k) for k in range(n)},
                    slots=len(engine.devices) if spot else None)
    return n

  # ---- checkpoints -------------------------------------------------------------------------------
  def checkpoint_state(self) -> dict:
    """Drafter params, optimizer state (leaf list) and the spot trainer's step count."""
    state = self.spot.state_dict()
    return {"params": _pure(state["params"]), "opt_state": jax.tree.leaves(state["opt_state"]),
            "steps": np.asarray(state["steps"], np.int64)}

  def load_checkpoint_state(self, saved: dict) -> None:
    like = self.spot.state_dict()
    params = _unpure(saved["params"], like["params"])
    opt_state = jax.tree.unflatten(jax.tree.structure(like["opt_state"]),
                                   [np.asarray(x) for x in saved["opt_state"]])
    self.spot.load_state_dict(dict(params=params, opt_state=opt_state,
                                   steps=int(saved["steps"])))

  def selective_save(self, checkpointer, step: int) -> float | None:
    """Saves the drafter's state alone (``checkpoint_state``) as ``step`` of ``checkpointer``
    (the job's async drafter checkpoints) unless no training step changed it since the last
    such save; returns the seconds the call took, None when nothing needed saving."""
    if self.spot.steps == self._saved_steps:
      return None
    t0 = time.perf_counter()
    checkpointer.save(step, self.checkpoint_state())
    self._saved_steps = self.spot.steps
    return time.perf_counter() - t0

  def save_buffer(self, checkpointer, step: int, metadata: dict):
    """Before ``checkpointer.save(step, ...)``: records the buffer's checksum in ``metadata``;
    returns the function that writes the buffer beside the step's arrays once they are saved."""
    data, sha = self.buffer_bytes()
    if hosts.process_count() == 1:
      metadata[BUFFER_KEY], metadata[STATE_KEY] = sha, self.host_state()
    else:  # every process's buffer is its own rows': a file and an entry each
      metadata[BUFFER_KEY], metadata[STATE_KEY] = map(list, zip(*hosts.allgather(
          (sha, self.host_state()), "drafter_buffer")))

    def write() -> None:
      checkpointer.wait()
      hosts.barrier(f"checkpoint {step}")  # the step's directory is final on every process
      self.write_buffer(checkpointer.step_dir(step), data)

    return write

  def restore(self, saved: dict, checkpointer, step: int, metadata: dict, report) -> None:
    """Loads the drafter's part of checkpoint ``step`` (``checkpoint_state()``) and the buffer
    saved beside it (a missing or corrupt buffer file is reported: the buffer starts empty)."""
    self.load_checkpoint_state(saved)
    host, sha = metadata.get(STATE_KEY), metadata.get(BUFFER_KEY)
    if isinstance(sha, list):  # saved by several processes: this process's entry
      me = hosts.process_index()
      if len(sha) != hosts.process_count():
        report(f"the checkpoint of step {step} holds the drafter buffers of {len(sha)} "
               f"process(es) but this run has {hosts.process_count()}: the buffers start empty")
        host, sha = host[0], "missing"
      else:
        host, sha = host[me], sha[me]
    if host is not None:
      self.load_host_state(host)
    problem = self.restore_buffer(checkpointer.step_dir(step), sha)
    if problem:
      report(problem)

  def host_state(self) -> dict:
    """What the trainer's host keeps between steps (JSON): the ledger, whether the engines'
    weights were scored, and their latest score."""
    return dict(ledger=None if self.ledger is None else self.ledger.state_dict(),
                evaluated=self.evaluated, changed=self.changed, quality=self.quality)

  def load_host_state(self, state: dict) -> None:
    if self.ledger is not None and state.get("ledger") is not None:
      self.ledger.load_state_dict(state["ledger"])
    self.evaluated = bool(state.get("evaluated", False))
    self.changed = bool(state.get("changed", False))
    self.quality = state.get("quality")

  def buffer_bytes(self) -> tuple[bytes, str]:
    """The buffer as npz bytes and their sha256 (written next to a checkpoint)."""
    stream = io.BytesIO()
    np.savez(stream, **self.buffer.state_dict())
    data = stream.getvalue()
    return data, hashlib.sha256(data).hexdigest()

  def write_buffer(self, step_dir: str, data: bytes) -> str:
    path = os.path.join(step_dir, buffer_file())
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    return path

  def restore_buffer(self, step_dir: str, sha256: str | None) -> str | None:
    """Loads the buffer saved next to a checkpoint; returns a problem to report, or None."""
    path = os.path.join(step_dir, buffer_file())
    if sha256 == "missing" or not os.path.isfile(path):
      return f"{path} is missing: the drafter's data buffer starts empty"
    data = open(path, "rb").read()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
      return f"{path} does not match its checksum: the drafter's data buffer starts empty"
    with np.load(io.BytesIO(data)) as z:
      state = {k: z[k] for k in z.files}
    self.buffer.load_state_dict(state)
    return None

  def export(self, path, policy=None, policy_name: str | None = None) -> None:
    """Writes the current drafter with ``save_drafter`` (loads with ``load_drafter``), recording
    ``policy`` (the policy it was trained with: a Transformer or its params) as its target."""
    drafter = nnx.merge(self.drafter_graphdef, jax.device_get(self.spot.params))
    save_drafter(drafter, path, policy=policy, policy_name=policy_name)


def buffer_file() -> str:
  """The data buffer's file in a checkpoint: one per process when there are several."""
  if hosts.process_count() == 1:
    return BUFFER_FILE
  return BUFFER_FILE.replace(".npz", f".process{hosts.process_index()}.npz")


def _pure(params) -> dict:
  return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def _unpure(pure, like):
  if isinstance(like, nnx.State):
    state = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(state, jax.tree.map(np.asarray, pure))
    return state
  return pure


def step_metrics(stats: RolloutStats, spot_runs: list[dict], serial: dict | None,
                 evaluation: dict) -> dict[str, float]:
  """The drafter's per-step metrics: held-out and in-sample loss/top-1, spot and serial steps and
  seconds, the tail's idle device-seconds and their use, and the spot rounds' contributions.

  Each key: docs/library.md, "Drafter step metrics"."""
  devices = stats.devices or []
  runs = list(spot_runs) + ([serial] if serial and serial.get("steps") else [])
  sizes = [n for r in spot_runs for n in r.get("participants", [])]
  per_device: dict = {}
  for r in spot_runs:
    for label, mine in (r.get("devices") or {}).items():
      per_device[label] = per_device.get(label, 0.0) + float(mine["seconds"])
  out = {"drafter_spot_steps": int(sum(r["steps"] for r in spot_runs)),
         "drafter_spot_s": float(sum(r["seconds"] for r in spot_runs)),
         "drafter_serial_steps": int((serial or {}).get("steps", 0)),
         "drafter_serial_s": float((serial or {}).get("seconds", 0.0)),
         "tail_idle_device_s": float(sum(d.idle_s for d in devices)),
         "tail_idle_used_device_s": float(sum(d.idle_used_s for d in devices)),
         "spot_overrun_s": float(stats.idle_overrun_s or 0.0),
         "drafter_spot_contributions": int(sum(sizes)),
         "drafter_spot_devices": len(per_device),
         "drafter_spot_participants_max": int(max(sizes, default=0)),
         "drafter_spot_participants_mean": float(np.mean(sizes)) if sizes else 0.0,
         "drafter_spot_device_s": float(sum(per_device.values()))}
  last = [r["participants"][-1] for r in spot_runs if r.get("participants")]
  out["drafter_spot_tail_device_s"] = max(0.0, out["drafter_spot_device_s"] - out[
      "spot_overrun_s"] * max(last, default=0))
  for label in sorted(per_device):
    out[f"drafter_spot_device_s_{label}"] = per_device[label]
  if evaluation.get("loss") is not None:
    out["drafter_loss"] = float(evaluation["loss"])
    out["drafter_top1"] = float(evaluation["top1"])
  trained = [r for r in runs if r.get("loss") is not None]
  if trained:
    weights = [r.get("contributions") or r["steps"] for r in trained]  # a round: its members
    out["drafter_train_loss"] = float(np.average([r["loss"] for r in trained], weights=weights))
    out["drafter_train_top1"] = float(np.average([r["top1"] for r in trained], weights=weights))
  return out


class SpotWork:
  """The ``IdleWork`` of one rollout (``OnlineDrafter.idle_work``): ``shard_done`` adds a finished
  shard's rows to the drafter's buffer; ``idle`` trains the drafter on the idle devices.

  The first device to go idle leads: it runs ``SpotTrainer.run_rounds`` homed on itself until
  the rollout's ``stop``; every device idle at a round's start (at most ``spot_devices`` of
  them, the leader first) takes part in it. The others' ``idle`` waits for ``stop`` (their device
  is handed to the rounds meanwhile) and returns None; once ``spot_devices`` devices are idle,
  a device going idle later returns at once. ``runs``: the leader's ``run_rounds`` output."""

  def __init__(self, online: OnlineDrafter, step: int, prompts, engine):
    self.online, self.step, self.prompts, self.engine = online, step, prompts, engine
    self.runs: list[dict] = []
    self.lock = threading.Lock()
    self.idle_now: dict[int, tuple] = {}  # device index -> (index, device, target params)
    self.leader: list[int] = []

  def shard_done(self, device_index: int, first_row: int, result) -> None:
    del device_index  # the rows are the same data whichever device decoded them
    self.online.add(self.step, self.prompts, result, first_row)

  def members(self) -> list[tuple]:
    """The devices of the next round: the leader, then the others idle now (by index)."""
    with self.lock:
      leader = self.leader[0]
      team = [self.idle_now[leader]] + [self.idle_now[j] for j in sorted(self.idle_now)
                                        if j != leader]
    limit = self.online.spot_devices
    return team[:limit] if limit is not None else team

  def idle(self, device_index: int, stop: threading.Event) -> dict | None:
    online, engine, k = self.online, self.engine, device_index
    if not online.config.spot or online.buffer.num_samples == 0:
      return None
    with self.lock:
      if self.leader and online.spot_devices is not None and \
          len(self.idle_now) >= online.spot_devices:
        return None  # the rounds are full: this device can never take part
      self.idle_now[k] = (k, engine.devices[k], engine.target_params(k))
      leads = not self.leader
      if leads:
        self.leader.append(k)
    if not leads:
      stop.wait()  # this device trains in the leader's rounds until the rollout is done
      return None
    out = online.spot.run_rounds(self.members, device=engine.devices[k],
                                 slots=len(engine.devices), stop=stop)
    out["device"] = k
    self.runs.append(out)
    return out
