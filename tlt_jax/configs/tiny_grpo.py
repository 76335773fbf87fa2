"""The default main job: warm-start a tiny policy on arithmetic traces, then GRPO on the CPU.

  python -m tlt_jax.train --config=configs/tiny_grpo.py --config.trainer.steps=20
"""

import ml_collections
from ml_collections import config_dict

from tlt_jax.job.build import trainer_section
from tlt_jax.job.rollout_config import drafter_training_section, rollout_section, \
    suffix_section
from tlt_jax.job.typed_config import dataclass_section
from tlt_jax.rl.grpo import GRPOConfig
from tlt_jax.rl.sft import SFTConfig
from tlt_jax.rollout import HistoryConfig


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # every PRNG stream and the data order derive from (seed, step)
  c.logdir = ""  # config.json, metrics.jsonl, tensorboard events, checkpoints/, final_model/;
  #               "" = runs/<timestamp>
  c.resume = False  # True: continue the run in <logdir> with its saved config.json
  c.checkpoint_every = 5  # RL steps between checkpoints (0: only at the end)
  # "ngram": lossless speculative rollouts drafted from sibling responses; a directory written by
  # tlt_jax.models.drafter_io.save_drafter: an EAGLE-style drafter made for this policy
  # "eagle": an EAGLE drafter trained online from scratch during RL (see drafter_training);
  # "eagle3": an EAGLE-3 drafter so trained (several target layers' features, its own head,
  # started from the policy's LM head), also written for vLLM as final_drafter_speculators/
  # "suffix": the suffix drafter, which drafts from the rollout's own history (every prompt's
  # earlier completions, see history; the group's siblings; the prompt); "eagle+suffix",
  # "eagle3+suffix" or "<drafter directory>+suffix": a learned drafter and the suffix drafter in
  # one engine
  c.drafter = "none"
  # devices that roll out data-parallel, an engine each (0: every device of the mesh)
  c.rollout_devices = 0
  c.mesh_devices = 0  # devices of the data-parallel update mesh (0: every device)
  c.distributed = False  # True: jax.distributed.initialize() (multi-host, from the environment)
  # several processes: how long one waits for another's rollout rows (or any exchange) before it
  # stops with an error naming the process that did not come (a dead one is noticed sooner)
  c.distributed_timeout_s = 600
  # the policy update's FSDP axis: params and optimizer state sharded over this many devices
  # (it must divide the mesh's devices; 1: replicated, plain data parallel)
  c.fsdp = 1

  # ArithmeticTask: operands of up to max_digits digits, sizes Zipf(digit_exponent)-distributed.
  # num_prompts: 0 draws fresh problems every step; N > 0 is epoch mode, a fixed set of N
  # problems (at least trainer.prompts_per_step) drawn once from the seed and visited once per
  # epoch in a shuffled order, so that RL revisits its prompts as on a dataset
  # teacher_error: the warm start's teacher forgets the final carry of this share of the sums
  # that have one (0: a perfect teacher). 0.6, RL's regime: the warm start's greedy answer drops
  # almost every final carry while its samples often keep it, so GRPO has a habit to fix
  # (docs/benchmarks.md, "A warm start with a consistent flaw")
  c.task = ml_collections.ConfigDict(dict(max_digits=8, digit_exponent=1.5, num_prompts=0,
                                          teacher_error=0.6))
  # ModelConfig of the char-level policy: a Qwen2 one ("qwen3": per-head q/k norms, no qkv bias;
  # "llama"); float32 params, computing in compute_dtype (None: float32; "bfloat16"; "auto":
  # bfloat16 on a GPU or TPU)
  c.model = ml_collections.ConfigDict(dict(
      architecture="qwen2", hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
      num_kv_heads=2, compute_dtype=config_dict.placeholder(str)))
  # supervised warm start on the teacher's traces (steps=0: none); 450 steps (SFTConfig's default
  # is 300): a warm start sure of everything but its flaw, so that the flaw is most of what GRPO
  # can fix (docs/benchmarks.md, "A warm start with a consistent flaw")
  c.sft = dataclass_section(SFTConfig, steps=450)  # the other fields at SFTConfig's defaults
  # GRPOConfig: samples per prompt, PPO clip range (DAPO clip-higher), KL to the warm start
  c.grpo = dataclass_section(GRPOConfig, group_size=8, clip_eps_high=0.28)
  # TrainerConfig: RL steps, prompts per step, AdamW, updates per step, rollout length, tokens
  # per update micro-batch (sequences are packed into rows of about their live length; 0: every
  # row padded to the full length); on_nonfinite: a non-finite update "stop"s the run (params
  # from before the step) or is "skip"ped and counted; old_logprobs: the loss's old log-probs from
  # the "policy"'s own forward pass before the step's updates (exact for a seed whatever the
  # rollout decoded with) or from the "rollout" (no extra pass; their last bits follow the arm);
  # control=True: the no-update control (every policy update skipped, the same held-out
  # evaluations); eval_every: steps between held-out evaluations (0: at the start and end only)
  # (every other field at TrainerConfig's default; seed and num_prompts come from config.seed
  # and config.task.num_prompts). 40 steps: the held-out figures stop rising by step 20; an
  # evaluation of 512 problems (6 s on 2 cores) every 10 steps draws the curve; eval_pass_k=8:
  # pass@8 of the first eval_pass_problems (128) held-out problems
  c.trainer = trainer_section(steps=40, prompts_per_step=32, learning_rate=5e-5, minibatches=2,
                              eval_problems=512, eval_every=10, eval_pass_k=8)
  # EngineConfig of the rollout engine (batch buckets up to max_batch rows). The adaptive
  # engine (needs a drafter): strategies lists [depth, topk, verify_tokens] triples, e.g.
  #   --config.drafter=ngram --config.rollout.strategies="((4, 1, 5), (8, 1, 9))"
  # and the tuner picks vanilla or one of them per decode segment of at most segment_steps
  # steps (None: 32 when adaptive, else unbounded). A bucket offers a strategy where its
  # calibration (each arm's decode step timed at precompile) says it pays at
  # sd_prior_acceptance per drafted token (sd_offers="calibrated"; "all": wherever permitted),
  # from the smallest bucket up to the first where none does, compiled in the background while
  # the first steps decode vanilla; sd_max_batch (None: no cap) and, with verify_budget > 0,
  # bucket * verify_tokens <= verify_budget bound where it may. verify: "coupled" (the
  # default: SD emits exactly the tokens vanilla sampling draws for the seed, so the tuner's
  # choices, which follow measured speeds, change no token and one config and seed give one
  # policy trajectory; as fast as rejection: docs/benchmarks.md) or "rejection"
  # (lossless rejection sampling: the same law, faster where it accepts more, but its tokens
  # follow the arm, so with an adaptive tuner runs are not reproducible).
  # () = vanilla decoding (with a drafter: one fixed speculative strategy for every segment).
  # suffix_strategies: the suffix drafter's [depth, topk, verify_tokens] triples (with
  # drafter="suffix" or "...+suffix"; () = one chain of suffix.depth)
  # (the other fields at EngineConfig's defaults: strategies=(), sd_max_batch=None,
  # sd_prior_acceptance=0.85, sd_offers="calibrated", verify_budget=0, segment_steps=None,
  # suffix_strategies=())
  c.rollout = rollout_section(max_batch=64, max_prompt_len=32, verify="coupled")
  # TunerConfig of the adaptive engine: kind "cost" (the default: calibrated step costs against
  # counted accepted lengths, one short probe of probe_steps per strategy and drafter version),
  # "beg_mab" (epsilon-greedy on windowed medians of tokens/s), "ucb1" or "fixed"
  # (fixed=((max_bucket, arm_name), ...), e.g. ((8, "chain d4"), (64, "vanilla"))); what it
  # learned is saved in every checkpoint and restored on resume
  # (c.rollout.tuner: every field at TunerConfig's default)
  # The drafter trained online from the rollouts' hidden states (online="auto": when
  # drafter="eagle" or "eagle3"; True also trains a drafter loaded from a directory). With several rollout
  # devices it trains on the ones the tail leaves idle (spot; spot_devices: 0 every idle one);
  # with one, drafter steps run between rollout and update: serial_budget "ledger" pays for
  # them from savings_share of what SD saved, after up to bootstrap_steps granted in
  # bootstrap_share of each step's time until SD has paid, at most serial_steps a step; "fixed"
  # runs serial_steps (and/or serial_seconds) every step.
  # save_every: RL steps between selective async saves of the drafter alone (0: none; an
  # unchanged drafter is not saved again; the full checkpoint holds it too).
  # learning_rate: 1e-3 suits a drafter from scratch; fine-tuning a trained one wants ~1e-4 (at
  # 1e-3 it lost acceptance against a frozen copy: docs/benchmarks.md, "The adaptive drafter").
  # Every field at its default (DrafterTrainingConfig's and the job's online / save_every).
  c.drafter_training = drafter_training_section()
  # SuffixConfig of the suffix drafter (used with drafter="suffix" or "...+suffix"): the suffix
  # lengths it matches (max_ngram down to min_ngram), the draft depth of its default chain, the
  # tokens of earlier completions a row drafts from (history_len). Every field at its default.
  c.suffix = suffix_section()
  # HistoryConfig of the store of every prompt's earlier completions the suffix drafter drafts
  # from (kept only with it, saved in every checkpoint): the newest per_prompt completions per
  # prompt, max_bytes in all (4 bytes a token plus a small overhead; the prompts added to least
  # recently go first). To keep every prompt until the next epoch it needs about task.num_prompts
  # x min(per_prompt, grpo.group_size) x 4 x the completions' length; the job says when it
  # cannot hold them at full length.
  c.history = dataclass_section(HistoryConfig)
  return c
