"""Where the policy update's arrays live: the update mesh (``data`` x ``fsdp``), the FSDP sharding
rule of a param leaf, and ``UpdateLayout``, the shardings of one update's params, optimizer state,
KL reference and batch rows, with the gather of FSDP params for the forward pass (see
``rl/update.py``, which runs the updates on it)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


DATA_AXIS, FSDP_AXIS = "data", "fsdp"


def make_mesh(devices: Sequence[jax.Device], fsdp: int = 1) -> Mesh:
  """The update mesh over ``devices``: axes ``("data", "fsdp")`` of shape
  ``(len(devices) // fsdp, fsdp)``. Rows are sharded over both axes; params and optimizer state
  over ``fsdp`` (``fsdp=1``: replicated, the plain data-parallel update). Devices next to each
  other in ``devices`` share an ``fsdp`` group, so with devices in process order a group stays
  within a process where it fits."""
  devices = np.asarray(devices, dtype=object).reshape(-1)
  n = len(devices)
  if n == 0:
    raise ValueError("make_mesh needs at least one device, got none")
  if isinstance(fsdp, bool) or not isinstance(fsdp, (int, np.integer)) or fsdp < 1 or n % fsdp:
    choices = [k for k in range(1, n + 1) if n % k == 0]
    raise ValueError(f"fsdp={fsdp!r} must be a positive int dividing the {n} devices of the "
                     f"mesh (the update shards params over fsdp devices and rows over all "
                     f"{n}); use one of {choices}")
  return Mesh(devices.reshape(n // int(fsdp), int(fsdp)), (DATA_AXIS, FSDP_AXIS))


def fsdp_size(mesh: Mesh) -> int:
  """How many devices the params are sharded over: the mesh's ``fsdp`` axis size (1 without)."""
  return int(dict(mesh.shape).get(FSDP_AXIS, 1))


def rows_spec(mesh: Mesh) -> P:
  """Batch rows (dim 0) sharded over every axis of ``mesh``: under FSDP every device gets rows of
  its own (FSDP is data parallel too). A 1-D mesh gives today's ``P("data")``."""
  names = tuple(mesh.axis_names)
  return P(names[0] if len(names) == 1 else names)


def fsdp_spec(shape: Sequence[int], size: int) -> P:
  """The FSDP sharding rule of one param (or optimizer-state) leaf of ``shape``, in MaxText's
  habit of sharding every weight over ``fsdp`` on one dimension: the largest dimension that
  ``size`` divides (the first of equal ones) is split over the ``fsdp`` axis; a leaf with no such
  dimension (scalars, e.g. Adam's step count, or odd sizes) stays replicated. Adam's moments have
  their param's shape, so they are sharded as their param is."""
  if size <= 1:
    return P()
  best = None
  for i, dim in enumerate(shape):
    if dim >= size and dim % size == 0 and (best is None or dim > shape[best]):
      best = i
  return P() if best is None else P(*([None] * best), FSDP_AXIS)


class UpdateLayout:
  """Where the update's arrays live on ``mesh``: ``rows`` (batch rows over every mesh axis),
  ``replicated``, and ``params`` / ``opt_state``: trees of ``NamedSharding`` of ``params`` and of
  an optimizer state ``opt_state`` by ``fsdp_spec`` (both plain ``replicated`` when the mesh has
  no ``fsdp`` axis of more than one device, or when they are not given: today's data-parallel
  update). ``ref`` is the KL reference's sharding, the params' (``kl=True``) or ``replicated``
  (no reference: ``None`` is passed)."""

  def __init__(self, mesh: Mesh, params: Any = None, opt_state: Any = None, kl: bool = False):
    self.mesh, self.fsdp = mesh, fsdp_size(mesh)
    self.replicated = NamedSharding(mesh, P())
    self.rows = NamedSharding(mesh, rows_spec(mesh))
    self.params = self.of(params) if params is not None else self.replicated
    self.opt_state = self.of(opt_state) if opt_state is not None else self.replicated
    self.ref = self.params if kl else self.replicated

  @property
  def sharded(self) -> bool:
    """Whether params are sharded (an ``fsdp`` axis of more than one device)."""
    return self.fsdp > 1

  def of(self, tree: Any) -> Any:
    """The FSDP shardings of ``tree``'s leaves (arrays or ``ShapeDtypeStruct``s), or plain
    ``replicated`` without FSDP."""
    if not self.sharded:
      return self.replicated
    return jax.tree.map(lambda x: NamedSharding(self.mesh, fsdp_spec(x.shape, self.fsdp)), tree)

  def rows_of(self, keys: tuple[str, ...]) -> dict[str, NamedSharding]:
    return {k: self.rows for k in keys}

  @staticmethod
  def abstract(tree: Any, shardings: Any) -> Any:
    """``tree``'s leaves as ``ShapeDtypeStruct``s placed by ``shardings`` (a tree like ``tree``'s,
    or one sharding for all)."""
    if isinstance(shardings, jax.sharding.Sharding):
      shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        shardings)

  def gather(self, params: Any) -> Any:
    """``params`` all-gathered (replicated) for the forward pass; in the backward pass (a
    ``custom_vjp``) their gradient is summed over the rows' devices, then each device keeps its
    shard of it, as the params are sharded. (Summed first: constrained straight to the params'
    shardings, XLA would try to shard the activations feeding a gradient as that gradient is
    sharded, e.g. on the hidden dimension, and fall back to replicating them.) ``params`` as they
    are without FSDP."""
    if not self.sharded or params is None:
      return params
    replicated, shardings = self.replicated, self.params
    constrain = jax.lax.with_sharding_constraint

    @jax.custom_vjp
    def gathered(p):
      return constrain(p, jax.tree.map(lambda _: replicated, p))

    def forward(p):
      return gathered(p), None

    def backward(_, cotangent):
      summed = constrain(cotangent, jax.tree.map(lambda _: replicated, cotangent))
      return (constrain(summed, shardings),)

    gathered.defvjp(forward, backward)
    return gathered(params)
