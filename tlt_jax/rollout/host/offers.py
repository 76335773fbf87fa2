"""Which speculative arms each batch bucket offers, decided by measurement, and their executables
compiled off the critical path.

SD pays at a bucket only where a speculative step, drafting included, costs less than the tokens
it emits: ``accepted length > step cost / vanilla step cost``. That ratio depends on the hardware,
the model and the batch (docs/benchmarks.md, "What a T-token pass costs"), so no fixed batch
threshold suits every machine. ``SdOffers`` decides it
per bucket from the engine's calibration (each strategy's decode step timed at that bucket) and a
prior per-token acceptance (``EngineConfig.sd_prior_acceptance``): an arm is offered at a bucket
when it would pay there at that acceptance (``pays``); the tuner then chooses among the offered
arms by what they measure. Buckets are visited from the smallest up and the visit stops at the
first bucket where no arm pays (a verify pass's cost relative to a 1-token pass grows with the
batch), so a machine where SD pays only in the tail compiles SD only for the tail.

Off the critical path: ``run`` is the whole loop (compile a bucket's calibration executables,
calibrate, compile the paying arms' other executables, publish); ``start`` runs it in a thread
while the rollout decodes vanilla. Published buckets reach the engine at its next segment
boundary (``offered``), together with their step costs for the tuner, so an arm is never offered
before every executable it may run exists, and once the loop is done nothing compiles.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import weakref
from typing import Any, Callable, Sequence

from tlt_jax.rollout.host.tuner.cost import accepted_length
from tlt_jax.utils import background_compiles_allowed, mark_background


CHUNK = 8  # executables the loop compiles between two looks at a stop (a compile pool's width)


def pays(relative_cost: float, depth: int, topk: int, acceptance: float) -> bool:
  """Whether a speculative step of ``depth`` levels of ``topk`` candidates that costs
  ``relative_cost`` vanilla steps emits more tokens than that at per-token ``acceptance``."""
  return accepted_length(acceptance, depth, topk) > relative_cost


def paying(costs: dict, bucket: int, strategies: Sequence[Any], acceptance: float) -> list[Any]:
  """The speculative members of ``strategies`` (``scheduler.Strategy``) that pay at ``bucket`` by
  the step costs ``costs[(bucket, name)]`` (seconds; ``"vanilla"``'s among them) at per-token
  ``acceptance``; an arm whose cost is missing does not."""
  vanilla = costs.get((bucket, "vanilla"))
  out = []
  for s in strategies:
    cost = costs.get((bucket, s.name))
    if s.spec is not None and vanilla and cost and pays(cost / vanilla, s.spec.depth,
                                                         s.spec.topk, acceptance):
      out.append(s)
  return out


def offered_buckets(costs: dict, candidates: dict[int, Sequence[Any]],
                    acceptance: float) -> dict[int, list[str]]:
  """What ``SdOffers.run`` offers given a whole cost table (the loop itself, compiling nothing):
  per bucket that offers an SD arm, the names of those arms."""
  offers = SdOffers(candidates, acceptance)
  offers.run(lambda keys: 0, lambda b, strategies, calibration_only: [],
             lambda b, strategies: {(b, s.name): costs[(b, s.name)] for s in strategies
                                    if (b, s.name) in costs})
  return {b: [s.name for s in offers.offered(b)[1:]] for b in offers.buckets
          if len(offers.offered(b)) > 1}


@dataclasses.dataclass
class BucketOffer:
  """One visited bucket: its measured step costs relative to vanilla and the arms offered."""

  bucket: int
  relative_costs: dict[str, float]
  offered: list[str]


class SdOffers:
  """The arms each bucket offers (vanilla alone until a bucket's SD arms are measured to pay and
  compiled), and the loop that decides and compiles them.

  ``candidates[b]``: the strategies the config permits at bucket ``b`` (vanilla first).
  ``publish(costs)`` is called in the thread that asks for ``offered`` with the step costs of a
  newly offered bucket (the engine hands them to its tuner)."""

  def __init__(self, candidates: dict[int, Sequence[Any]], acceptance: float,
               publish: Callable[[dict], Any] | None = None):
    self.candidates = {b: list(c) for b, c in candidates.items()}
    self.acceptance = float(acceptance)
    self.publish = publish
    self._offered = {b: c[:1] for b, c in self.candidates.items()}  # vanilla alone
    self._ready: list[tuple[int, list[Any], dict]] = []
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._cancel = threading.Event()
    self.done = threading.Event()
    self.error: BaseException | None = None
    self.visited: list[BucketOffer] = []  # in visiting order
    self.compiled = 0  # executables the loop compiled
    self.on_done: Callable[[], Any] | None = None  # called once the loop has stopped
    self.skipped = False  # True: a background loop this host does not allow (``launch``)
    self.prelude: Sequence[Any] = ()  # keys the loop compiles before its first bucket (the
    # vanilla executables the first requests do not start with: ``RolloutEngine.precompile``)

  def offered(self, bucket: int) -> list[Any]:
    """The strategies ``bucket`` offers now (vanilla first); takes in what the loop published
    since the last call. Raises the loop's error, if it failed."""
    self.take_ready()
    return self._offered[bucket]

  def take_ready(self) -> None:
    """Offers what the loop published (handing its costs to ``publish`` first); raises the
    loop's error, if it failed."""
    if self.error is not None:
      error, self.error = self.error, None
      raise RuntimeError("compiling the speculative arms failed") from error
    if self._ready:
      with self._lock:
        ready, self._ready = self._ready, []
      for b, strategies, costs in ready:
        if self.publish is not None:
          self.publish(costs)
        self._offered[b] = strategies

  @property
  def buckets(self) -> list[int]:
    """The buckets with a choice to visit, smallest first."""
    return sorted(b for b, c in self.candidates.items() if len(c) > 1)

  def run(self, compile_keys: Callable[[list], int], keys_of: Callable[[int, list, bool], list],
          calibrate: Callable[[int, list], dict]) -> None:
    """Compiles the ``prelude`` keys; then visits the buckets smallest first: compiles the
    executables that time a bucket's
    candidates (``keys_of(b, strategies, True)``), times them (``calibrate(b, strategies)``:
    ``{(b, name): seconds per step}``, vanilla's included), compiles the rest of the paying
    arms' executables (``keys_of(b, paying, False)``) and publishes them; stops at the first
    bucket where none pays, or when ``cancel`` is called."""
    try:
      if not self._compile(compile_keys, list(self.prelude)):
        return
      for b in self.buckets:
        if self._cancel.is_set():
          return
        candidates = self.candidates[b]
        if not self._compile(compile_keys, keys_of(b, candidates[1:], True)):
          return
        costs = calibrate(b, candidates)
        chosen = paying(costs, b, candidates, self.acceptance)
        vanilla = costs.get((b, "vanilla"))
        self.visited.append(BucketOffer(
            b, {s.name: costs[(b, s.name)] / vanilla for s in candidates[1:]
                if vanilla and (b, s.name) in costs}, [s.name for s in chosen]))
        if not chosen:
          return
        if not self._compile(compile_keys, keys_of(b, chosen, False)):
          return
        with self._lock:
          self._ready.append((b, candidates[:1] + chosen, costs))
    finally:
      if self.on_done is not None:
        self.on_done()
      self.done.set()

  def _compile(self, compile_keys: Callable[[list], int], keys: list) -> bool:
    """Compiles ``keys`` a few at a time (``CHUNK``: a stop waits for one chunk at most);
    whether all were compiled (False: cancelled)."""
    for i in range(0, len(keys), CHUNK):
      if self._cancel.is_set():
        return False
      self.compiled += compile_keys(keys[i:i + CHUNK])
    return not self._cancel.is_set()

  def launch(self, background: bool, *args) -> int:
    """``run(*args)`` now, its arms offered at once (returns what it compiled), or with
    ``background`` in a thread (``start``; returns 0) where the host allows background compiles
    (``utils.background_compiles_allowed``); where it does not, nothing: the loop is ``skipped``,
    done at once, and vanilla alone is offered (the prelude's keys are never compiled)."""
    if background and not background_compiles_allowed():
      self.skipped = True
      if self.on_done is not None:
        self.on_done()
      self.done.set()
      return 0
    if background:
      self.start(*args)
      return 0
    self.run(*args)
    self.take_ready()
    return self.compiled

  def start(self, *args) -> None:
    """``run(*args)`` in a background thread (its error is raised by the next ``offered``)."""

    def guarded():
      mark_background()  # these compiles are off the critical path: not the rollout's
      try:
        self.run(*args)
      except BaseException as e:  # pylint: disable=broad-except  # raised by offered()
        self.error = e

    self._thread = threading.Thread(target=guarded, name="sd-offers", daemon=True)
    _RUNNING.add(self)
    self._thread.start()

  def cancel(self, wait: bool = True) -> None:
    """Stops the loop after its current compile (``wait``: until it has stopped)."""
    self._cancel.set()
    if wait and self._thread is not None:
      self._thread.join()

  def wait(self, timeout: float | None = None) -> bool:
    """Waits for the loop to finish; whether it has."""
    return self.done.wait(timeout)


_RUNNING: "weakref.WeakSet[SdOffers]" = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
  """At exit, every background loop stops after its current compile and is waited for: a thread
  torn down inside XLA aborts the process instead of letting it exit."""
  for offers in list(_RUNNING):
    offers.cancel(wait=True)
