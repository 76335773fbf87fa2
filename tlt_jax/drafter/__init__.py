"""Drafter training: the EAGLE objective, batches from the frozen target, the jitted optax step,
the DataBuffer of rollout hidden states and the preemptible SpotTrainer."""

from tlt_jax.drafter.buffer import DataBuffer, EmptyBufferError
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.drafter.train import (DrafterBatch, drafter_loss, eagle_loss,
                                   make_batch_from_sequences, make_eval_step, make_optimizer,
                                   make_train_step, split_drafter)

__all__ = ["DataBuffer", "DrafterBatch", "EmptyBufferError", "SpotTrainer", "drafter_loss",
           "eagle_loss", "make_batch_from_sequences", "make_eval_step", "make_optimizer",
           "make_train_step", "split_drafter"]
