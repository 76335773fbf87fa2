"""Trainer checkpoints on orbax: numbered step directories of verified arrays plus JSON metadata.

  from tlt_jax import checkpoint as ckpt
  with ckpt.Checkpointer(directory, keep=3) as saver:
    saver.save(step, ckpt.state_to_pure_dict(state), metadata)

Rooms: ``checkpointer.py`` (the ``Checkpointer``, its errors, and the layout, atomicity,
integrity and rotation rules in its docstring), ``trees.py`` (pytrees as stored: ``nnx.State``
and PRNG-key conversions, leaf paths, per-leaf checksums) and ``console.py`` (orbax's log noise
silenced, its errors cut to one line).
"""

from tlt_jax.checkpoint.checkpointer import (CheckpointCorruptError, CheckpointError, Checkpointer,
                                             NonFiniteError, UnverifiedCheckpointWarning)
from tlt_jax.checkpoint.trees import (count_nonfinite, data_to_key, key_to_data,
                                      pure_dict_to_state, state_to_pure_dict)

__all__ = ["CheckpointCorruptError", "CheckpointError", "Checkpointer", "NonFiniteError",
           "UnverifiedCheckpointWarning", "count_nonfinite", "data_to_key", "key_to_data",
           "pure_dict_to_state", "state_to_pure_dict"]
