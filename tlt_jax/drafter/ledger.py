"""The ledger of what TLT costs and saves on the critical path, and the serial drafter budget it
pays for.

With one rollout device nothing is idle, so every drafter step between rollout and update is
time the RL step waits for. Those steps are worth it only where speculative decoding pays, so
the budget comes from what SD saved: each rollout's ``RolloutStats.sd_saved_s`` (vanilla's
measured step cost times the steps SD avoided, minus what the speculative segments took;
negative where SD cost time, e.g. the tuner's probes) is credited at ``savings_share`` to a
balance in seconds, and each RL step runs as many drafter steps as the balance buys at the
measured seconds per drafter step (at most ``max_steps``). A fresh drafter cannot save anything
before it is good enough to be chosen, so up to ``bootstrap_steps`` steps are granted before SD
has saved anything; after that a drafter that is never used costs nothing. How fast they are
granted: with ``bootstrap_share`` (the job's default, 3 %) each RL step's seconds (``allow``)
credit that share to the bootstrap's own balance until SD has paid back the drafter's cost, and
a bootstrap step is granted only where that balance buys it (the first one, which measures the
cost, once the balance is positive), so the bootstrap never costs more than that share of the
run's steps; without it (None), ``max_steps`` of them per RL step, up front.

Everything the budget depends on is in ``state_dict`` (JSON), so a resumed run continues from the
balance it stopped at. What it cannot make deterministic is the input: savings and step costs
are measured seconds.
"""

from __future__ import annotations

import dataclasses
import math

from tlt_jax.utils import FieldError


@dataclasses.dataclass
class Entry:
  """One RL step in the ledger: SD's estimated saving, the drafter's time on the critical path
  (serial steps, its held-out evaluation and the copy to the engine), their net, and the steps
  the budget granted (``bootstrap`` of them from the up-front grant)."""

  saved_s: float
  drafter_s: float
  steps: int
  bootstrap: int

  @property
  def net_s(self) -> float:
    return self.saved_s - self.drafter_s


class DrafterLedger:
  """Credits SD's savings, grants serial drafter steps from them, and keeps the totals."""

  def __init__(self, savings_share: float = 0.5, bootstrap_steps: int = 64, max_steps: int = 8,
               bootstrap_share: float | None = None):
    shares = [("savings_share", savings_share)]
    if bootstrap_share is not None:  # None: the bootstrap granted up front
      shares.append(("bootstrap_share", bootstrap_share))
    for name, value in shares:
      if isinstance(value, bool) or not isinstance(value, (int, float)) or \
          not 0.0 <= value <= 1.0:
        raise FieldError("DrafterLedger", name, f"must be in [0, 1], got {value!r}")
    for name, value in (("bootstrap_steps", bootstrap_steps), ("max_steps", max_steps)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FieldError("DrafterLedger", name, f"must be an int >= 0, got {value!r}")
    self.savings_share = float(savings_share)
    self.bootstrap_share = None if bootstrap_share is None else float(bootstrap_share)
    self.max_steps = max_steps
    self.bootstrap_left = bootstrap_steps
    self.bootstrap_balance_s = 0.0  # with bootstrap_share: seconds the bootstrap may still spend
    self.balance_s = 0.0  # seconds the savings have credited and the steps not yet spent
    self.step_s: float | None = None  # the latest measured seconds per drafter step
    self.saved_s = 0.0  # totals over the run
    self.drafter_s = 0.0
    self.steps = 0
    self.bootstrap_used = 0

  def credit(self, saved_s: float | None) -> None:
    """Credits a rollout's estimated saving (None: nothing could be estimated)."""
    if saved_s is None:
      return
    if not math.isfinite(saved_s):
      raise ValueError(f"DrafterLedger.credit: saved_s must be finite, got {saved_s!r}")
    self.saved_s += float(saved_s)
    self.balance_s += self.savings_share * float(saved_s)

  def paid(self) -> bool:
    """Whether SD has saved at least what the drafter cost on the critical path (and something)."""
    return self.saved_s > 0 and self.saved_s >= self.drafter_s

  def allow(self, step_s: float) -> None:
    """Tells the ledger an RL step took ``step_s`` seconds: with ``bootstrap_share``, its share
    goes to the bootstrap's balance while bootstrap steps are left and SD has not paid."""
    if not math.isfinite(step_s) or step_s < 0:
      raise ValueError(f"DrafterLedger.allow: step_s must be finite and >= 0, got {step_s!r}")
    if self.bootstrap_share is not None and self.bootstrap_left > 0 and not self.paid():
      self.bootstrap_balance_s += self.bootstrap_share * float(step_s)

  def grant(self) -> tuple[int, int]:
    """How many drafter steps this RL step may run, and how many of them are bootstrap steps.
    Before the first step's cost is known the balance buys nothing (the bootstrap's balance, if
    positive, one step)."""
    bootstrap = min(self.bootstrap_left, self.max_steps)
    if self.bootstrap_share is not None:  # what the bootstrap's own balance buys
      if self.bootstrap_balance_s <= 0:
        bootstrap = 0
      else:
        affordable = (math.floor(self.bootstrap_balance_s / self.step_s + 1e-9) if self.step_s
                      else 1)
        bootstrap = int(min(bootstrap, affordable))
    earned = 0
    if self.step_s and self.balance_s > 0:
      affordable = math.floor(self.balance_s / self.step_s + 1e-9)  # 0.05 / 0.01 is 4.999...
      earned = int(min(affordable, self.max_steps - bootstrap))
    return bootstrap + earned, bootstrap

  def can_grant(self) -> bool:
    """Whether a step could be granted now or after a saving of at most one drafter step's cost:
    bootstrap steps are left or the balance is positive."""
    return self.bootstrap_left > 0 or self.balance_s > 0

  def spend(self, steps: int, bootstrap: int, train_s: float, other_s: float = 0.0,
            saved_s: float | None = None) -> Entry:
    """Books an RL step: ``steps`` drafter steps ran (``bootstrap`` of them granted up front) in
    ``train_s`` seconds, ``other_s`` more drafter seconds on the critical path (evaluation, the
    copy to the engine), against ``saved_s`` (the step's ``credit``, for the entry)."""
    bootstrap = min(bootstrap, steps)
    self.bootstrap_left -= bootstrap
    self.bootstrap_used += bootstrap
    drafter_s = float(train_s + other_s)
    if steps:
      self.step_s = train_s / steps
      self.balance_s -= drafter_s * (steps - bootstrap) / steps  # the earned steps' share
      if self.bootstrap_share is not None:
        self.bootstrap_balance_s -= drafter_s * bootstrap / steps  # and the bootstrap's
    else:
      self.balance_s -= other_s
    self.drafter_s += drafter_s
    self.steps += steps
    return Entry(0.0 if saved_s is None else float(saved_s), drafter_s, steps, bootstrap)

  def totals(self) -> dict[str, float]:
    """The run so far: SD's estimated saving, the drafter's critical-path seconds, their net,
    drafter steps (bootstrap among them) and the balance left."""
    return dict(saved_s=self.saved_s, drafter_s=self.drafter_s,
                net_s=self.saved_s - self.drafter_s, steps=self.steps,
                bootstrap_steps=self.bootstrap_used, balance_s=self.balance_s)

  def state_dict(self) -> dict:
    return dict(bootstrap_left=self.bootstrap_left, balance_s=self.balance_s, step_s=self.step_s,
                saved_s=self.saved_s, drafter_s=self.drafter_s, steps=self.steps,
                bootstrap_used=self.bootstrap_used, bootstrap_balance_s=self.bootstrap_balance_s)

  def load_state_dict(self, state: dict) -> None:
    try:
      self.bootstrap_left = int(state["bootstrap_left"])
      self.balance_s = float(state["balance_s"])
      self.step_s = None if state["step_s"] is None else float(state["step_s"])
      self.saved_s, self.drafter_s = float(state["saved_s"]), float(state["drafter_s"])
      self.steps, self.bootstrap_used = int(state["steps"]), int(state["bootstrap_used"])
      # (a checkpoint from before the bootstrap's time budget has none: it starts at 0)
      self.bootstrap_balance_s = float(state.get("bootstrap_balance_s", 0.0))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"DrafterLedger.load_state_dict: a malformed ledger state ({e!r}); the "
                       "checkpoint's drafter_ledger entry is damaged") from None


def step_line(metrics: dict) -> str:
  """A step's ledger for the console, e.g. ``"TLT saved 0.12s, drafter 0.05s, net +0.07s"``
  (empty without an online drafter)."""
  if "tlt_saved_s" not in metrics:
    return ""
  return (f"TLT saved {metrics['tlt_saved_s']:.2f}s, drafter {metrics['tlt_drafter_s']:.2f}s, "
          f"net {metrics['tlt_net_s']:+.2f}s")


def run_line(history: list[dict]) -> str:
  """The run's ledger in one line from its steps' metrics (empty without an online drafter):
  SD's estimated saving, the drafter's seconds on the critical path, the net, and the share of
  the run's step time the net is."""
  rows = [m for m in history if "tlt_saved_s" in m]
  if not rows:
    return ""
  saved = sum(m["tlt_saved_s"] for m in rows)
  drafter = sum(m["tlt_drafter_s"] for m in rows)
  steps = sum(m.get("step_s", 0.0) for m in rows)
  bootstrap = sum(m.get("drafter_bootstrap_steps", 0) for m in rows)
  share = f" ({100 * (saved - drafter) / steps:+.1f}% of the steps' time)" if steps else ""
  return (f"TLT ledger over {len(rows)} steps: speculative decoding saved ~{saved:.2f}s "
          f"(estimated from the arms' measured speeds), the drafter took {drafter:.2f}s on the "
          f"critical path ({bootstrap} bootstrap steps), net {saved - drafter:+.2f}s{share}")
