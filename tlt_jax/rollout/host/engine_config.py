"""``EngineConfig``, the rollout engine's static shapes and strategies, and
``resolve_engine_config``, which fills in what follows from the drafters once, before an engine
is built: the engine reads the resolved config and never rewrites it.

One parser reads strategies (``parse_specs``: ``SpecConfig``s, dicts of their fields or
``(depth, topk, verify_tokens)`` triples), for every field that holds them. Errors are
``FieldError``s naming ``EngineConfig.<field>`` (``TunerConfig.<field>`` for the tuner's mapping);
a caller that calls the fields by other names (the job's ``config.rollout.<field>``) renames
them from the error's ``owner`` and ``field``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

import numpy as np

from tlt_jax.rollout.host import buckets as bk
from tlt_jax.rollout.decode.kinds import DrafterKind, model_free_kind
from tlt_jax.rollout.decode.speculative import SpecConfig
from tlt_jax.rollout.decode.steps import strategy_name
from tlt_jax.rollout.decode.suffix import SuffixConfig, check_suffix_spec
from tlt_jax.rollout.host.tuner import TunerConfig, fixed_arm
from tlt_jax.utils import FieldError, require_positive_ints

__all__ = ["EngineConfig", "VERIFY_MODES", "parse_spec", "parse_specs", "resolve_engine_config"]

VERIFY_MODES = ("rejection", "coupled")
SD_OFFERS = ("calibrated", "all")
PRECOMPILE_SCOPES = ("all", "first_step")
SPECS_HINT = "a list of [depth, topk, verify_tokens] triples, e.g. ((4, 1, 5), (4, 2, 8))"


def parse_spec(entry, owner: str, field: str,
               check: Callable[[SpecConfig], None] | None = None) -> SpecConfig:
  """A ``SpecConfig`` from itself, a dict of its fields (a ConfigDict too) or a ``(depth, topk,
  verify_tokens)`` triple, passed through ``check`` if given; a ``FieldError`` naming
  ``<owner>.<field>`` otherwise."""
  if isinstance(entry, SpecConfig):
    spec = entry
  else:
    if isinstance(entry, dict) or hasattr(entry, "to_dict"):
      args, kwargs = (), dict(entry.to_dict() if hasattr(entry, "to_dict") else entry)
    elif isinstance(entry, (list, tuple)) and len(entry) == 3:
      args, kwargs = tuple(entry), {}
    else:
      raise FieldError(owner, field, f"must be a [depth, topk, verify_tokens] triple, got "
                       f"{entry!r}")
    try:
      spec = SpecConfig(*args, **kwargs)
    except (TypeError, ValueError) as e:
      raise FieldError(owner, field, f"= {entry!r}: {e}") from None
  if check is not None:
    try:
      check(spec)
    except ValueError as e:
      raise FieldError(owner, field, f"= {entry!r}: {e}") from None
  return spec


def parse_specs(value, owner: str, field: str,
                check: Callable[[SpecConfig], None] | None = None) -> tuple[SpecConfig, ...]:
  """``<owner>.<field>``, a sequence of strategies (see ``parse_spec``), as a tuple of distinct
  ``SpecConfig``; a ``FieldError`` naming the field, or the entry (``<field>[i]``), otherwise."""
  if isinstance(value, (str, bytes, SpecConfig)) or not isinstance(value, (list, tuple)):
    raise FieldError(owner, field, f"must be {SPECS_HINT}, got {value!r}")
  if value and all(isinstance(v, (int, np.integer)) for v in value):
    raise FieldError(owner, field, f"must be {SPECS_HINT}, got the flat {tuple(value)!r}; one "
                     f"strategy is written ({tuple(value)!r},)")
  specs = tuple(parse_spec(entry, owner, f"{field}[{i}]", check) for i, entry in enumerate(value))
  if len(set(specs)) != len(specs):
    raise FieldError(owner, field, f"has duplicates (a strategy listed twice): {value!r}")
  return specs


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shapes and strategies of the rollout engine. Buckets default to powers of two up to
  the maxima. Every rule of a field is checked here, and every error is a ``FieldError`` naming
  ``EngineConfig.<field>``; what depends on the drafters too is ``resolve_engine_config``'s."""

  max_batch: int = 8
  max_prompt_len: int = 128
  max_new_tokens: int = 256
  batch_buckets: tuple[int, ...] | None = None
  prefill_buckets: tuple[int, ...] | None = None
  compaction: bool = True
  max_stop_ids: int = 8
  pad_token_id: int = 0
  spec: SpecConfig | None = None  # one speculative strategy for every segment (needs a drafter)
  # The adaptive engine: vanilla plus these strategies, chosen per segment by the tuner.
  strategies: tuple[SpecConfig, ...] = ()
  # The suffix drafter's strategies (``RolloutEngine(suffix=...)``), arms beside ``strategies``:
  # chains, or trees of topk branches under the root sharing verify_tokens - 1 draft slots
  # (``suffix.check_suffix_spec``). Empty with a suffix drafter: one chain of its depth
  # (``resolve_engine_config``).
  suffix_strategies: tuple[SpecConfig, ...] = ()
  # Buckets above this always decode vanilla (None: no fixed cap). The paper uses 32 (GPUs). With
  # the cost tuner and a precompile, the calibration decides per bucket which SD arms exist
  # (``offers.py``): an arm is offered where its measured step cost relative to vanilla's is below
  # what it emits at ``sd_prior_acceptance`` per drafted token, from the smallest bucket up to the
  # first where no arm pays.
  sd_max_batch: int | None = None
  sd_prior_acceptance: float = 0.85  # the per-token acceptance an SD arm must pay at to exist
  # "calibrated": the SD arms a bucket offers are the ones its calibration says pay (above);
  # "all": every arm the other fields permit, and the tuner alone decides (e.g. to study it)
  sd_offers: str = "calibrated"
  # What the job compiles before its first RL step. "all": every vanilla executable (then the SD
  # arms in the background). "first_step": only what its first requests start with (the batch
  # bucket each begins in, at every prompt and cache length); the rest of vanilla's compiles in a
  # background thread of the lowest priority, and until it is in, the rollout decodes on in the
  # buckets that are compiled (padded: the same tokens, more work). For real models, whose pool
  # takes minutes to compile on a CPU.
  precompile_scope: str = "all"
  verify_budget: int = 0  # > 0: a strategy serves bucket b only if b * verify_tokens <= this
  segment_steps: int | None = None  # most steps per segment (0: unbounded; None: 32 if adaptive)
  tuner: TunerConfig | None = None  # None: TunerConfig() (the cost tuner)
  # "rejection": lossless rejection sampling; "coupled": drafter-invariant Gumbel-max sampling
  # (SD emits exactly vanilla sampling's tokens for a seed, at a slightly lower acceptance)
  verify: str = "rejection"
  # KV-cache length buckets below the capacity ``cache_len`` (which is always the last bucket):
  # None = 128, 256, 512, ... (a power of two within 25% of the capacity is left out); () = a
  # single cache of the full capacity (decode steps then pay for the capacity, not the lengths).
  kv_buckets: tuple[int, ...] | None = None
  # Speculative steps report draft vs verify time, read by host callbacks at the phase
  # boundaries (one host round trip per phase: leave off when measuring throughput).
  time_phases: bool = False

  def __post_init__(self):
    if self.spec is not None:
      object.__setattr__(self, "spec", parse_spec(self.spec, "EngineConfig", "spec"))
    strategies = parse_specs(self.strategies, "EngineConfig", "strategies")
    object.__setattr__(self, "strategies", strategies)
    suffix = parse_specs(self.suffix_strategies, "EngineConfig", "suffix_strategies",
                         check_suffix_spec)
    object.__setattr__(self, "suffix_strategies", suffix)
    if (strategies or suffix) and self.spec is not None:
      raise FieldError("EngineConfig", "spec", "is one fixed strategy and strategies / "
                       "suffix_strategies make the engine adaptive: set either EngineConfig.spec "
                       "or them, not both")
    if self.verify not in VERIFY_MODES:
      raise FieldError("EngineConfig", "verify",
                       f"must be one of {VERIFY_MODES}, got {self.verify!r}")
    tuner = TunerConfig() if self.tuner is None else self.tuner
    if not isinstance(tuner, TunerConfig):
      try:
        tuner = TunerConfig(**dict(tuner))
      except FieldError as e:  # the field of the tuner's own
        raise FieldError("EngineConfig", f"tuner.{e.field}", e.problem) from None
      except (TypeError, ValueError) as e:
        raise FieldError("EngineConfig", "tuner", f"must be a TunerConfig or a dict of its fields: "
                         f"{e}") from None
    object.__setattr__(self, "tuner", tuner)
    if self.segment_steps is None:
      object.__setattr__(self, "segment_steps", 32 if strategies or suffix else 0)
    for name in ("segment_steps", "verify_budget"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise FieldError("EngineConfig", name, f"must be an int >= 0 (0: no limit), got {value!r}")
    require_positive_ints(self, "max_batch", "max_prompt_len", "max_new_tokens", "max_stop_ids")
    if self.sd_max_batch is not None:
      require_positive_ints(self, "sd_max_batch")
    for name, choices in (("sd_offers", SD_OFFERS), ("precompile_scope", PRECOMPILE_SCOPES)):
      if getattr(self, name) not in choices:
        raise FieldError("EngineConfig", name, f"must be one of {choices}, got "
                         f"{getattr(self, name)!r}")
    prior = self.sd_prior_acceptance
    if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0 < prior <= 1:
      raise FieldError("EngineConfig", "sd_prior_acceptance", f"must be a number in (0, 1] (a "
                       f"per-token acceptance, e.g. 0.85), got {prior!r}")
    defaults = (("batch_buckets", self.max_batch, bk.powers_of_two_up_to(self.max_batch)),
                ("prefill_buckets", self.max_prompt_len,
                 bk.powers_of_two_up_to(self.max_prompt_len, start=min(16, self.max_prompt_len))))
    for name, limit, default in defaults:
      value = getattr(self, name)
      value = default if value is None else tuple(int(v) for v in value)
      if not value or list(value) != sorted(set(value)) or value[0] <= 0 or value[-1] != limit:
        raise FieldError("EngineConfig", name, f"must be strictly increasing positive sizes ending "
                         f"at {limit}, got {value!r}")
      object.__setattr__(self, name, value)
    if self.kv_buckets is not None:
      value = tuple(self.kv_buckets)
      if (any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0 for v in value)
          or list(value) != sorted(set(value))):
        raise FieldError("EngineConfig", "kv_buckets", f"must be strictly increasing positive ints "
                         f"(or None for the default ladder), got {self.kv_buckets!r}")
      object.__setattr__(self, "kv_buckets", tuple(int(v) for v in value))

  @property
  def adaptive(self) -> bool:
    """Whether strategies are chosen per segment (vanilla is then always one of them)."""
    return bool(self.strategies or self.suffix_strategies)

  @property
  def draft_specs(self) -> tuple[SpecConfig, ...]:
    """The strategies the learned (or n-gram) drafter drafts."""
    return self.strategies or ((self.spec,) if self.spec is not None else ())

  @property
  def specs(self) -> tuple[SpecConfig, ...]:
    """Every speculative strategy this engine may run (the suffix drafter's last)."""
    return self.draft_specs + self.suffix_strategies

  def options(self, batch: int, kind: DrafterKind = DrafterKind.LEARNED
              ) -> list[tuple[str, SpecConfig | None]]:
    """``(drafter kind, spec)`` of what may decode a ``batch`` bucket: vanilla (``("vanilla",
    None)``) first, then the drafter's strategies (drafted by ``kind``), then the suffix
    drafter's; the adaptive engine offers a strategy only where it ``serves`` the bucket."""
    if not self.adaptive:
      return [("vanilla", None)] if self.spec is None else [(kind, self.spec)]
    return [("vanilla", None)] + [(k, s) for k, group in ((kind, self.strategies),
                                                          (DrafterKind.SUFFIX,
                                                           self.suffix_strategies))
                                  for s in group if self.serves(s, batch)]

  def serves(self, spec: SpecConfig, batch: int) -> bool:
    """Whether the adaptive engine may decode a ``batch`` bucket with ``spec``."""
    return (self.sd_max_batch is None or batch <= self.sd_max_batch) and (
        not self.verify_budget or batch * spec.verify_tokens <= self.verify_budget)

  def check_fixed_tuner(self, kind: str = DrafterKind.LEARNED) -> None:
    """Raises ``FieldError`` when a ``kind="fixed"`` tuner leaves a bucket with a choice unmapped
    or maps it to an arm not offered there (so the mistake shows before anything compiles;
    ``kind``: who drafts ``strategies``)."""
    if not self.adaptive or self.tuner.kind != "fixed":
      return
    for b in self.batch_buckets:
      names = [strategy_name(s, k) for k, s in self.options(b, kind)]
      if len(names) > 1:
        fixed_arm(self.tuner.fixed, b, names)

  @property
  def slack(self) -> int:
    """Extra slots past the longest sequence that a speculative step may write into."""
    return max((s.verify_tokens + s.depth * (s.topk + 1) + 2 for s in self.specs), default=0)

  @property
  def pending_width(self) -> int:
    """Most tokens one step of any strategy can emit (the drafter's pending window)."""
    return max((s.max_emit for s in self.specs), default=1)

  @property
  def cache_len(self) -> int:
    """KV-cache slots per row: the longest prompt plus the longest completion (plus slack)."""
    return self.max_prompt_len + self.max_new_tokens + self.slack

  @property
  def step_slots(self) -> int:
    """Cache slots past a live row's committed length that one decode step may write."""
    return self.slack if self.specs else 1

  @property
  def kv_lengths(self) -> tuple[int, ...]:
    """The KV-cache length buckets, ending at the capacity ``cache_len``. The adaptive engine's
    default ladder also holds vanilla's capacity (the longest prompt plus the longest completion,
    without the speculative slack), so rows that vanilla decodes to the end never attend over
    the slack."""
    cap = self.cache_len
    if self.kv_buckets is None:
      below = bk.powers_of_two_up_to(cap, start=min(128, cap))[:-1]
      if below and cap < 1.25 * below[-1]:  # e.g. 4096 next to a capacity of 4128: one is enough
        below = below[:-1]
      plain = self.max_prompt_len + self.max_new_tokens
      if self.adaptive and plain < cap and plain not in below:
        below = tuple(sorted(below + (plain,)))
    else:
      below = tuple(v for v in self.kv_buckets if v < cap)
    return below + (cap,)

  def prefill_kv_len(self, prompt_bucket: int) -> int:
    """The cache length a chunk prefilled at ``prompt_bucket`` starts with."""
    return bk.bucket_for(prompt_bucket + self.step_slots, self.kv_lengths)

  def tokens_len(self, kv_len: int) -> int:
    """Width of the generated-token buffers that go with a cache of ``kv_len`` slots (a row never
    has more generated tokens than cache slots)."""
    return min(kv_len, self.max_new_tokens + (self.pending_width if self.specs else 0))



def resolve_engine_config(config: EngineConfig, drafter=None,
                          suffix: SuffixConfig | None = None) -> EngineConfig:
  """``config`` with what the drafters imply filled in, checked against them: the engine's
  config. ``drafter`` is the learned drafter, a model-free kind's config (the n-gram drafter's
  ``NgramConfig``, or a registered kind's: ``kinds.model_free_kind``) or None; ``suffix`` the
  suffix drafter's ``SuffixConfig`` or None.

  Filled in: the suffix drafter's strategies (empty: one chain of its depth), the n-gram
  drafter's chain (its ``spec``, or the adaptive engine's strategy when the suffix drafter's are
  the only ones) and a learned drafter's default ``SpecConfig()`` (its ``spec``, or its
  strategy beside the suffix drafter's). A resolved config resolves to itself, so an engine
  given one changes nothing. (``segment_steps`` and the buckets are filled in by
  ``EngineConfig`` itself, from the fields as given.)"""
  if not isinstance(config, EngineConfig):
    raise TypeError(f"resolve_engine_config takes an EngineConfig, got {type(config).__name__}")
  if suffix is not None and not isinstance(suffix, SuffixConfig):
    raise TypeError(f"the suffix drafter is a SuffixConfig, got {suffix!r}")
  free = model_free_kind(drafter)  # model-free drafting: chains from the decode state
  drafters = _drafters_key(drafter, free, suffix)
  if _RESOLVED.get(config) == drafters:  # resolved and checked for these drafters already
    return config
  changes = {}
  if suffix is None and config.suffix_strategies:
    raise FieldError("EngineConfig", "suffix_strategies", "needs the suffix drafter, and there "
                     "is no suffix drafter: give one (a SuffixConfig) or leave it empty")
  if suffix is not None and not config.suffix_strategies:
    if config.spec is not None:
      raise FieldError("EngineConfig", "spec", "is one fixed strategy, and a suffix drafter makes "
                       "the engine adaptive; set EngineConfig.strategies instead")
    changes["suffix_strategies"] = (suffix.chain(),)
  adaptive = config.adaptive or "suffix_strategies" in changes
  if free is not None:
    chain = free.chain(drafter)
    if config.spec is not None and config.spec != chain:
      raise FieldError("EngineConfig", "spec", f"{config.spec} does not fit the {free.kind} "
                       f"drafter; leave it None (it becomes {chain})")
    if any(not s.is_chain for s in config.strategies):
      raise FieldError("EngineConfig", "strategies", "has tree strategies (topk > 1) but the "
                       f"{free.kind} drafter drafts chains: use topk=1 entries, got "
                       f"{config.strategies}")
    if not adaptive:
      changes["spec"] = chain
    elif not config.strategies:  # the suffix drafter's strategies alone: add the n-gram chain
      changes["strategies"] = (chain,)
  elif drafter is not None and not config.draft_specs:
    changes["strategies" if adaptive else "spec"] = (SpecConfig(),) if adaptive else SpecConfig()
  if config.draft_specs and drafter is None:
    field = "strategies" if config.adaptive else "spec"
    raise FieldError("EngineConfig", field, "needs a drafter (a learned or n-gram one), and there "
                     "is no drafter: give one or leave it empty for vanilla decoding" +
                     ("; the suffix drafter's strategies are EngineConfig.suffix_strategies"
                      if suffix is not None else ""))
  resolved = dataclasses.replace(config, **changes) if changes else config
  resolved.check_fixed_tuner(DrafterKind.LEARNED if free is None else free.kind)
  _RESOLVED[resolved] = drafters
  return resolved


# The configs ``resolve_engine_config`` made, each with the drafters it made it for: the job
# resolves its config once, and the rollouts and engines given it take it as it is, unchecked
# again. (Keyed by value: an equal config is as resolved; held weakly: no config kept alive.)
_RESOLVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _drafters_key(drafter, free, suffix: SuffixConfig | None) -> tuple:
  """What of the drafters a resolution depends on: none, a drafter model, or a model-free kind
  with its chain; and the suffix drafter's config."""
  if drafter is None:
    return (None, None, suffix)
  if free is None:
    return ("learned", None, suffix)
  return (free.kind, free.chain(drafter), suffix)
