"""Drafter training: the EAGLE objective, batches from the frozen target, the jitted optax step."""

from tlt_jax.drafter.train import (DrafterBatch, drafter_loss, eagle_loss,
                                   make_batch_from_sequences, make_eval_step, make_optimizer,
                                   make_train_step, split_drafter)

__all__ = ["DrafterBatch", "drafter_loss", "eagle_loss", "make_batch_from_sequences",
           "make_eval_step", "make_optimizer", "make_train_step", "split_drafter"]
