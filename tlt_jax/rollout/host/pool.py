"""The compiled executable pool: every jitted piece of the engine, compiled once per shape bucket.

Keys are tuples whose first entry is the kind:

* ``("prefill", batch, prompt bucket)``
* ``("segment", batch, kv length, stop_at, group)``: a decode segment of one strategy group
  (vanilla, a chain, or the trees of one verify width, which share the verify pass); compiled
  only for the batch buckets the group may serve. ``stop_at`` names the bucket's compaction
  boundary (``stop_at(batch)``); the executable takes the live-row count it stops at as an
  operand, so a rollout whose smaller bucket is not compiled yet decodes on past it
* ``("catchup", batch, kv length)``: the drafter's catch-up at a vanilla -> SD switch
* ``("compact", batch, smaller batch, kv length)`` and ``("grow", batch, kv length, next)``

Prefill, catch-up, compaction and growth are shared by every strategy, because the decode state
has one layout for all of them (``steps.DecodeState``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.aot import AotCache, SharedPrograms
from tlt_jax.rollout.host import buckets as bk
from tlt_jax.rollout.decode.sampling import SamplerArgs, SamplingParams
from tlt_jax.rollout.decode.steps import StepFunctions


class ExecutablePool:
  """Compiles and holds the engine's executables; reports their count, compile time and memory."""

  def __init__(self, steps: StepFunctions, weights: Callable[[], Any],
               groups_for: Callable[[int], Sequence[str]], needs_catchup: Callable[[int], bool],
               shared: SharedPrograms | None = None, device: jax.Device | None = None):
    """``weights()`` gives arrays of the right shapes; ``groups_for(batch)`` names the strategy
    groups that may decode that batch bucket; ``needs_catchup(batch)``: whether SD may follow
    vanilla there. ``shared``: programs other devices' pools compiled, rebound to ``device``."""
    self.steps = steps
    self.config = steps.config
    self.weights = weights
    self.groups_for = groups_for
    self.needs_catchup = needs_catchup
    self.executables = AotCache(shared, device)
    self._state_specs: dict[tuple[int, int], Any] = {}
    self.deferred: set[tuple] = set()  # keys a background thread compiles (``defer``)
    self.used: set[tuple] = set()  # keys a rollout (or ``calibrate``) has run

  @property
  def compile_seconds(self) -> float:
    return self.executables.seconds

  def weights_spec(self):
    """The weights as the executables are lowered for: shapes, dtypes and the device, nothing
    else. An array's type can also carry the mesh it came from (a one-device view of a replicated
    array keeps its mesh's name, a restored one does not); lowered from the arrays themselves, a
    resumed run's HLO (and compile-cache key) would differ from its first run's."""
    return self._on_device(self.weights())

  def _on_device(self, tree):
    """``tree``'s shapes and dtypes on the weights' device (nothing else of its arrays' types)."""
    sharding = self.sharding()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

  def args_spec(self):
    return jax.eval_shape(lambda: SamplerArgs.from_params(
        SamplingParams(), (), self.config.max_stop_ids))

  def sharding(self):
    """Where the weights live (a data-parallel rollout commits each engine to its own device):
    executables that take no weights (compaction, growth) are compiled for the same device."""
    leaf = jax.tree.leaves(self.weights()[0])[0]
    return leaf.sharding if isinstance(leaf, jax.Array) else None

  def state_spec(self, batch: int, kv_len: int):
    """Shapes of a decode state of ``batch`` rows with ``kv_len`` cache slots (on the weights'
    device). Traced once per (batch, kv_len): every segment, catch-up, compaction and growth of
    that bucket takes the same state (tracing prefill again for each would add a large share to
    a warm-cache precompile)."""
    if (batch, kv_len) not in self._state_specs:
      self._state_specs[batch, kv_len] = self._trace_state_spec(batch, kv_len)
    return self._state_specs[batch, kv_len]

  def _trace_state_spec(self, batch: int, kv_len: int):
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(self.steps.prefill, kv_len=kv_len)
    shapes = jax.eval_shape(fn, self.weights_spec(), ids, vec, vec, vec, self.history_spec(batch),
                            self.args_spec())[0]
    return self._on_device(shapes)

  def no_history(self, batch: int) -> np.ndarray:
    """A prefill ``history`` input of ``batch`` rows without earlier completions."""
    return np.full((batch, self.steps.history_len), -1, np.int32)

  def history_spec(self, batch: int):
    """The shape of prefill's ``history`` input (width 0 without a suffix drafter)."""
    return jax.ShapeDtypeStruct((batch, self.steps.history_len), jnp.int32)

  def get(self, key: tuple):
    """The compiled executable for ``key`` (compiled on first use, then reused)."""
    self.used.add(key)
    return self.executables.get(key, lambda: self.lower(key))

  def defer(self, keys: Sequence[tuple]) -> None:
    """Marks ``keys`` as compiled by a background thread: until each is in, ``waiting`` says so
    and the scheduler decodes on compiled buckets instead of compiling it on the critical
    path."""
    self.deferred.update(keys)

  def waiting(self, key: tuple) -> bool:
    """Whether ``key`` is deferred to a background compile that has not finished it yet (a key
    that is neither compiled nor deferred compiles on first use, as ever)."""
    return key in self.deferred and key not in self.executables

  def ready(self, batch: int, kv_len: int) -> bool:
    """Whether vanilla can decode a ``batch`` bucket from cache length ``kv_len`` on without
    waiting for a background compile: its segments there and at every longer length vanilla
    reaches, and the growths between them."""
    top = self.vanilla_lengths()[-1]
    lengths = [n for n in self.kv_lengths_used() if n == kv_len or kv_len < n <= top]
    return not any(self.waiting(k) for k in self.vanilla_chain(batch, lengths))

  def vanilla_chain(self, batch: int, lengths: Sequence[int]) -> list[tuple]:
    """The keys vanilla decodes a ``batch`` bucket with through the cache ``lengths`` (ascending):
    its segment at each and the growths from one to the next."""
    keys = [("segment", batch, n, self.stop_at(batch), "vanilla") for n in lengths]
    return keys + [("grow", batch, n, m) for n, m in zip(lengths, lengths[1:])]

  def compact_ready(self, batch: int, smaller: int, kv_len: int) -> bool:
    """Whether a ``batch`` bucket at ``kv_len`` can compact into ``smaller`` and decode on there
    without waiting for a background compile."""
    return (not self.waiting(("compact", batch, smaller, kv_len))
            and self.ready(smaller, kv_len))

  def first_keys(self, rows: Sequence[int]) -> list[tuple]:
    """The vanilla keys the first requests need, for requests of ``rows`` rows each: at the
    batch bucket each starts in (a chunk of ``max_batch`` rows, or its remainder's), prefill at
    the largest prompt bucket (it holds every prompt), the segments at every length vanilla
    reaches from there and the growths between. Compiled first, they let the first rollout start
    while the rest of the pool compiles in the background (``defer``): until it is in, prompts
    are padded to the largest bucket and rows decode on past the smaller batch buckets."""
    cfg = self.config
    batches = set()
    for n in rows:
      if n >= cfg.max_batch:
        batches.add(cfg.batch_buckets[-1])
      if n % cfg.max_batch:
        batches.add(bk.bucket_for(n % cfg.max_batch, cfg.batch_buckets))
    plen = cfg.prefill_buckets[-1]
    lengths = [n for n in self.vanilla_lengths() if n >= cfg.prefill_kv_len(plen)]
    keys = []
    for b in sorted(batches, reverse=True):
      keys += [("prefill", b, plen)] + self.vanilla_chain(b, lengths)
    return keys

  def lower(self, key: tuple) -> jax.stages.Lowered:
    """The executable of ``key`` lowered for the weights' shapes and device."""
    kind, batch = key[0], key[1]
    args = self.args_spec()
    steps = self.steps
    if kind == "prefill":
      ids = jax.ShapeDtypeStruct((batch, key[2]), jnp.int32)
      vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
      fn = functools.partial(steps.prefill, kv_len=self.config.prefill_kv_len(key[2]))
      return jax.jit(fn).lower(self.weights_spec(), ids, vec, vec, vec, self.history_spec(batch),
                               args)
    if kind == "segment":
      fn = functools.partial(steps.segment, group=key[4])
      scalar = jax.ShapeDtypeStruct((), jnp.int32)
      return jax.jit(fn, donate_argnums=1).lower(self.weights_spec(),
                                                 self.state_spec(batch, key[2]), args, scalar,
                                                 scalar, scalar)
    if kind == "catchup":
      return jax.jit(steps.catch_up, donate_argnums=1).lower(self.weights_spec(),
                                                             self.state_spec(batch, key[2]))
    if kind == "compact":
      index = jax.ShapeDtypeStruct((key[2],), jnp.int32, sharding=self.sharding())
      return jax.jit(steps.compact).lower(self.state_spec(batch, key[3]), index)
    if kind == "grow":
      fn = jax.jit(functools.partial(steps.grow, kv_len=key[3]))  # new shapes: no donation
      return fn.lower(self.state_spec(batch, key[2]))
    raise KeyError(key)

  def stop_at(self, batch: int) -> int:
    """Live rows at which a segment of ``batch`` rows ends to compact (0: never)."""
    return bk.next_smaller(batch, self.config.batch_buckets) if self.config.compaction else 0

  def kv_lengths_used(self) -> tuple[int, ...]:
    """The length buckets a chunk can be in: from the shortest prefill's onwards."""
    first = self.config.prefill_kv_len(self.config.prefill_buckets[0])
    return tuple(n for n in self.config.kv_lengths if n >= first)

  def keys(self) -> list[tuple]:
    """Every executable the engine may need: prefill per (batch, prompt) bucket; a segment per
    (batch, length) bucket and group that may serve the batch; catch-up where SD may follow
    vanilla; compaction per (batch pair, length); growth per (batch, length)."""
    cfg = self.config
    lengths = self.kv_lengths_used()
    keys = [("prefill", b, p) for b in cfg.batch_buckets for p in cfg.prefill_buckets]
    keys += [("segment", b, n, self.stop_at(b), g) for b in cfg.batch_buckets
             for g in self.groups_for(b) for n in lengths]
    keys += [("catchup", b, n) for b in cfg.batch_buckets if self.needs_catchup(b)
             for n in lengths]
    if cfg.compaction:
      keys += [("compact", b, s, n) for b in cfg.batch_buckets for s in cfg.batch_buckets if s < b
               for n in lengths]
    keys += [("grow", b, n, m) for b in cfg.batch_buckets for n, m in zip(lengths, lengths[1:])]
    return keys

  def vanilla_lengths(self) -> tuple[int, ...]:
    """The cache lengths a rollout that decodes vanilla alone can reach: up to the smallest that
    holds the longest prompt with the longest completion (and every prefill's). The adaptive
    engine's capacity above it holds the speculative steps' slack: only SD grows a cache there."""
    cfg, lengths = self.config, self.kv_lengths_used()
    plain = bk.bucket_for(min(cfg.max_prompt_len + cfg.max_new_tokens, lengths[-1]), lengths)
    top = max([plain] + [cfg.prefill_kv_len(p) for p in cfg.prefill_buckets])
    return tuple(n for n in lengths if n <= top)

  def base_keys(self) -> list[tuple]:
    """The keys vanilla decoding needs: every key but the speculative groups' segments and the
    catch-ups, at the cache lengths vanilla reaches (``vanilla_lengths``): what a rollout that has
    offered no SD arm yet runs."""
    reach = set(self.vanilla_lengths())
    length = {"segment": 2, "compact": 3, "grow": 3}
    return [k for k in self.keys() if not (k[0] == "catchup" or
                                           (k[0] == "segment" and k[4] != "vanilla"))
            and (k[0] not in length or k[length[k[0]]] in reach)]

  def calibration_kv_len(self) -> int:
    """The cache length ``RolloutEngine.calibrate`` times steps at (the shortest prefill's)."""
    return self.config.prefill_kv_len(self.config.prefill_buckets[0])

  def sd_keys(self, batch: int, groups: Sequence[str], catchup: bool,
              calibration_only: bool = False) -> list[tuple]:
    """The keys that let speculative ``groups`` decode a ``batch`` bucket: their segments at
    every cache length (``calibration_only``: at the calibration's alone), the catch-up there
    where ``catchup`` (a learned drafter follows vanilla), and what a cache grown past
    ``vanilla_lengths`` by an SD step needs: the growth at ``batch``, and at ``batch`` and every
    smaller bucket (its rows compact into them) vanilla's segments and the compactions at those
    lengths."""
    cfg = self.config
    lengths = ((self.calibration_kv_len(),) if calibration_only else self.kv_lengths_used())
    keys = [("segment", batch, n, self.stop_at(batch), g) for g in dict.fromkeys(groups)
            if g != "vanilla" for n in lengths]
    if calibration_only:
      return keys
    if catchup:
      keys += [("catchup", batch, n) for n in lengths]
    reach = self.vanilla_lengths()
    beyond = [n for n in lengths if n not in reach]
    keys += [("grow", batch, n, m) for n, m in zip(lengths, lengths[1:]) if m in beyond]
    for b in (b for b in cfg.batch_buckets if b <= batch):
      keys += [("segment", b, n, self.stop_at(b), "vanilla") for n in beyond]
      if cfg.compaction:
        keys += [("compact", b, s, n) for s in cfg.batch_buckets if s < b for n in beyond]
    return keys

  def compile(self, keys: Sequence[tuple],
              progress: Callable[[int, int], Any] | None = None) -> int:
    """Compiles the keys not compiled yet; returns how many (``progress(done, total)`` after
    each)."""
    return self.executables.compile_all(keys, self.lower, progress)

  def precompile(self, progress: Callable[[int, int], Any] | None = None) -> int:
    """Compiles every key now; returns how many were compiled (``progress(done, total)`` after
    each)."""
    return self.compile(self.keys(), progress)

  def stats(self) -> dict[str, Any]:
    """Executables per kind (and per strategy group), compile seconds, and the device memory each
    needs where the backend reports it (``compiled.memory_analysis()``)."""
    kinds: dict[str, int] = {}
    groups: dict[str, int] = {}
    memory = {}
    for key, compiled in self.executables.items():
      kinds[key[0]] = kinds.get(key[0], 0) + 1
      if key[0] == "segment":
        groups[key[4]] = groups.get(key[4], 0) + 1
      try:
        m = compiled.memory_analysis()
        memory[key] = int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                          - m.alias_size_in_bytes)
      except Exception:  # pylint: disable=broad-except  # not every backend reports it
        pass
    return dict(executables=len(self.executables), used=len(self.used), by_kind=kinds,
                segments_by_group=groups,
                compile_s=self.compile_seconds, kv_lengths=list(self.kv_lengths_used()),
                memory_bytes_max=max(memory.values(), default=None),
                memory_bytes_total=int(np.sum(list(memory.values()))) if memory else None,
                memory_bytes=memory)
