"""The main job: ``python -m tlt_jax.train [--config=configs/tiny_grpo.py]``.

Builds a tiny char-level policy for the arithmetic task, warm-starts it with supervised steps
on correct traces, then runs GRPO: rollout -> reward -> advantages -> policy update. Logs to
the console, ``<logdir>/metrics.jsonl`` and tensorboard event files (when tensorboardX is
installed), and reports held-out accuracy before and after RL.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
import optax
from absl import app, logging
from flax import nnx
from ml_collections import config_flags

from tlt_jax.checkpoint import Checkpointer
from tlt_jax.config import check_keys, to_dataclass
from tlt_jax.models import hf
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import CharTokenizer
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import grpo
from tlt_jax.rl.sft import PackedStream, make_lm_step
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.trainer import GRPOTrainer, TrainerConfig
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.rollout.ngram import NgramConfig

_DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "tiny_grpo.py"


class MetricsLog:
  """Appends metrics to ``metrics.jsonl`` and, if tensorboardX is available, event files."""

  def __init__(self, logdir: str):
    self.dir = pathlib.Path(logdir)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.jsonl = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.writer = SummaryWriter(str(self.dir))
    except ImportError:
      self.writer = None

  def write(self, step: int, metrics: dict) -> None:
    self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
    self.jsonl.flush()
    if self.writer is not None:
      for key, value in metrics.items():
        if isinstance(value, (int, float)):
          self.writer.add_scalar(key, value, step)
      self.writer.flush()

  def close(self) -> None:
    self.jsonl.close()
    if self.writer is not None:
      self.writer.close()


def warm_start(model, tokenizer, task, cfg, seed: int):
  """Supervised steps on correct traces; returns the trained params."""
  graphdef, params = nnx.split(model)
  steps = cfg.steps
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(1, steps // 10),
                                                max(steps, 2), end_value=0.1 * cfg.learning_rate)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98))
  opt_state = optimizer.init(params)
  step_fn = make_lm_step(graphdef, optimizer)
  stream = PackedStream(task, tokenizer, cfg.rows, cfg.row_len, seed=seed)
  metrics = {}
  for _ in range(steps):
    params, opt_state, metrics = step_fn(params, opt_state, stream.batch())
  return nnx.merge(graphdef, params), {k: float(v) for k, v in jax.device_get(metrics).items()}


def run(cfg) -> dict:
  """Runs warm start + GRPO for a config; returns a summary."""
  check_keys(cfg, {"seed", "logdir", "distributed", "resume", "checkpoint_every", "drafter",
                   "task", "model", "sft", "grpo", "trainer", "rollout"}, "")
  drafter = {"none": None, "ngram": NgramConfig()}.get(cfg.get("drafter", "none"), "bad")
  if drafter == "bad":
    raise ValueError(f"config.drafter must be 'none' or 'ngram', got {cfg.drafter!r}")
  if cfg.checkpoint_every < 0:
    raise ValueError(f"config.checkpoint_every must be >= 0 (0: only at the end), got "
                     f"{cfg.checkpoint_every!r}")
  if not cfg.logdir:
    if cfg.resume:
      raise ValueError("config.resume=True needs the run's --config.logdir")
    cfg.logdir = time.strftime("runs/%Y%m%d-%H%M%S")
  print(f"logdir: {cfg.logdir}", flush=True)
  if cfg.get("distributed", False):
    jax.distributed.initialize()  # multi-host: coordinator/process ids from the environment
  t_start = time.perf_counter()
  task = to_dataclass(ArithmeticTask, cfg.task, "task")
  tokenizer = CharTokenizer(task.alphabet)
  model_config = to_dataclass(
      ModelConfig, cfg.model, "model", vocab_size=tokenizer.vocab_size, architecture="qwen2",
      attention_bias=True, tie_word_embeddings=True, max_position_embeddings=512,
      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
  grpo_config = to_dataclass(grpo.GRPOConfig, cfg.grpo, "grpo")
  trainer_config = to_dataclass(TrainerConfig, cfg.trainer, "trainer", seed=cfg.seed)
  check_keys(cfg.rollout, {f.name for f in dataclasses.fields(EngineConfig)}, "rollout")
  engine_config = to_dataclass(EngineConfig, cfg.rollout, "rollout",
                               max_new_tokens=trainer_config.max_new_tokens,
                               pad_token_id=tokenizer.pad_token_id)
  check_keys(cfg.sft, {"steps", "rows", "row_len", "learning_rate"}, "sft")

  model = init_model(model_config, seed=cfg.seed)
  checkpointer = Checkpointer(pathlib.Path(cfg.logdir) / "checkpoints", keep=2)
  resuming = cfg.resume and checkpointer.latest_step() is not None
  if not cfg.resume and checkpointer.latest_step() is not None:
    raise ValueError(f"{checkpointer.directory} already holds checkpoints (latest step "
                     f"{checkpointer.latest_step()}); pass --config.resume=True to continue that "
                     "run, or choose another --config.logdir")
  if not resuming:
    t0 = time.perf_counter()
    model, sft_metrics = warm_start(model, tokenizer, task, cfg.sft, cfg.seed)
    print(f"warm start: {cfg.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
          f"loss {sft_metrics.get('loss', float('nan')):.3f}", flush=True)

  trainer = GRPOTrainer(model, tokenizer, task, engine_config, grpo_config, trainer_config,
                        drafter=drafter)
  if resuming:  # the checkpoint holds the warm-started (and RL-trained) params
    trainer.restore(checkpointer)
    print(f"resumed from {checkpointer.step_dir(trainer.step_count)}", flush=True)
  log = MetricsLog(cfg.logdir)
  t_eval = trainer.config.temperature
  accuracy_start = trainer.evaluate()
  sampled_start = trainer.evaluate(temperature=t_eval)
  print(f"held-out at step {trainer.step_count}: greedy accuracy {accuracy_start:.3f}, "
        f"sampled reward {sampled_start:.3f}", flush=True)
  history, lengths = [], []
  while trainer.step_count < trainer_config.steps:
    m = trainer.step()
    history.append(m)
    lengths.extend(trainer.last_lengths.tolist())
    if (cfg.checkpoint_every and trainer.step_count % cfg.checkpoint_every == 0) or \
        trainer.step_count == trainer_config.steps:
      trainer.save(checkpointer, {"config": cfg.to_dict()})
    log.write(m["step"], m)
    print(f"step {m['step']:4d} reward {m['reward']:.3f} loss {m['loss']:+.4f} "
          f"len p50/p90/max {m['len_p50']:.0f}/{m['len_p90']:.0f}/{m['len_max']} "
          f"rollout {m['rollout_s']:.1f}s (tail {m['tail_s']:.1f}s) update {m['update_s']:.1f}s",
          flush=True)
  accuracy_end = trainer.evaluate()
  sampled_end = trainer.evaluate(temperature=t_eval)
  log.write(trainer.step_count, {"eval_accuracy": accuracy_end, "eval_sampled_reward": sampled_end})
  log.close()
  checkpointer.close()
  hf.save_pretrained(nnx.merge(trainer.graphdef, trainer.params), model_config,
                     pathlib.Path(cfg.logdir) / "final_model")
  if not history:
    print(f"nothing to do: the checkpoint is already at step {trainer.step_count}")
    return dict(accuracy_start=accuracy_start, accuracy_end=accuracy_end,
                sampled_start=sampled_start, sampled_end=sampled_end, history=[], lengths=[])
  rollout = sum(m["rollout_s"] for m in history)
  total = sum(m["step_s"] for m in history)
  summary = dict(accuracy_start=accuracy_start, accuracy_end=accuracy_end,
                 sampled_start=sampled_start, sampled_end=sampled_end,
                 reward_first=float(np.mean([m["reward"] for m in history[:5]])),
                 reward_last=float(np.mean([m["reward"] for m in history[-5:]])),
                 rollout_share=rollout / max(total, 1e-9),
                 tail_share=sum(m["tail_s"] for m in history) / max(total, 1e-9),
                 wall_s=time.perf_counter() - t_start, lengths=lengths, history=history)
  print(f"held-out sampled reward: {sampled_start:.3f} -> {sampled_end:.3f}; held-out greedy "
        f"accuracy: {accuracy_start:.3f} -> {accuracy_end:.3f}; train reward "
        f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; rollout "
        f"{100 * summary['rollout_share']:.0f}% of step time (tail "
        f"{100 * summary['tail_share']:.0f}%); {summary['wall_s']:.0f}s in all", flush=True)
  return summary


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep orbax's per-save INFO lines off the console
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined only when run as a program, so importing several entry points never clashes.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", str(_DEFAULT_CONFIG), "ml_collections config file (get_config()).")
  app.run(main)
