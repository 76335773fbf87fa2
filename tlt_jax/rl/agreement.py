"""How far the log-probs a rollout records are from those the policy update recomputes.

One model code serves both sides, so at the params that sampled a step the two differ only by
rounding: the rollout decodes one token (or one verify pass) at a time through the KV cache,
the update runs whole rows. ``logprob_agreement`` measures that gap per completion token, and
its effect on the first update's importance ratio (the share of tokens PPO would clip before any
update, which should be 0).
"""

from __future__ import annotations

import numpy as np


def agreement(rollout: np.ndarray, update: np.ndarray, mask: np.ndarray, clip_low: float,
              clip_high: float) -> dict[str, float]:
  """Per completion token (``mask`` > 0) of ``[N, L-1]`` log-probs: the mean and max absolute
  gap between the rollout's and the update's, the mean and max importance ratio's distance from
  1 (``exp(update - rollout)``), and the share of tokens outside ``[1 - clip_low, 1 +
  clip_high]``."""
  valid = mask > 0
  if not valid.any():
    raise ValueError("no completion tokens to compare: every completion is empty")
  gap = (update.astype(np.float64) - rollout.astype(np.float64))[valid]
  ratio = np.exp(gap)
  clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
  return dict(tokens=int(valid.sum()), gap_mean=float(np.abs(gap).mean()),
              gap_max=float(np.abs(gap).max()), ratio_dev_mean=float(np.abs(ratio - 1).mean()),
              ratio_dev_max=float(np.abs(ratio - 1).max()), clipped_share=float(clipped.mean()))


def rollout_batch(trainer, step: int = 0) -> dict[str, np.ndarray]:
  """RL step ``step``'s rollout as the trainer samples it (its prompts, temperature and seed),
  as the padded batch its update takes, the rollout's log-probs as ``old_logprobs``."""
  g = trainer.grpo_config.group_size
  prompts = [trainer.encode_prompt(p) for p in trainer.problems_for(step) for _ in range(g)]
  result = trainer.engine.generate(prompts, trainer.sampling_for(step))
  return trainer.make_batch(prompts, result.tokens, result.logprobs, np.zeros(len(prompts)))


def logprob_agreement(trainer, step: int = 0) -> dict[str, float]:
  """``agreement`` of step ``step``'s rollout with the update's own forward passes over it
  (``PolicyUpdate.policy_logprobs``: the layout the update runs in), at the trainer's params."""
  batch = rollout_batch(trainer, step)
  update = trainer.policy.policy_logprobs(batch, np.arange(len(batch["advantages"])))
  grpo = trainer.grpo_config
  return agreement(batch["old_logprobs"], update, batch["mask"], grpo.clip_eps_low,
                   grpo.eps_high)
