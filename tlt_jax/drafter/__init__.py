"""The adaptive drafter's training: the EAGLE objective, batches from the frozen target and the
jitted optax step (``objective.py``), the DataBuffer of rollout hidden states (``buffer.py``), the
preemptible SpotTrainer (``spot.py``), the offline warm-up of a drafter before RL on the
policy's own completions (``warmup.py``) and, tying them into the RL step, the OnlineDrafter
(``online.py``). The drafter model itself is ``tlt_jax.models.drafter``."""

from tlt_jax.drafter.buffer import DataBuffer, EmptyBufferError
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.drafter.objective import (DrafterBatch, drafter_loss, eagle_loss,
                                   make_batch_from_sequences, make_eval_step, make_optimizer,
                                   make_train_step, split_drafter)
from tlt_jax.drafter.warmup import (evaluate_drafter, own_sequences, train_drafter_on_batch,
                                    train_drafter_steps, warm_up_drafter, warm_up_on_rollouts)

__all__ = ["DataBuffer", "DrafterBatch", "EmptyBufferError", "SpotTrainer", "drafter_loss",
           "eagle_loss", "evaluate_drafter", "make_batch_from_sequences", "make_eval_step",
           "make_optimizer", "make_train_step", "own_sequences", "split_drafter",
           "train_drafter_on_batch", "train_drafter_steps", "warm_up_drafter",
           "warm_up_on_rollouts"]
