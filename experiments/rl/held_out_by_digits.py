"""Where a policy fails: the default job's held-out accuracy by operand size, greedy and sampled.

  python -m experiments.rl.held_out_by_digits [--set sft.steps=600 ...]       # the job's warm start
  python -m experiments.rl.held_out_by_digits --model RUN_DIR/final_model  # a run's final policy
      [--problems 512] [--failures 8] [--out docs/results/held_out_by_digits.json]

Builds the default job (configs/tiny_grpo.py with ``--set`` overrides), takes either its warm
start (the same seed gives the same warm start as the job's) or a saved policy (``--model``, an
HF-format directory such as a run's ``final_model``), and evaluates the job's own held-out
problems (``trainer.eval_problems``' fixed set, the fixed sampling seed) greedily and at the
trainer's temperature through ``GRPOTrainer.held_out``, what the job's evaluation averages. Prints
and writes the mean reward per size of the larger operand (digits) and each size's share, and the
first ``--failures`` wrong completions of each temperature, so a reader can see what kind of error
a policy makes.
"""

from __future__ import annotations

import collections
import datetime
import sys

import jax
import numpy as np

from experiments import harness
from experiments.harness import write_report
from experiments.rl.rl_bench import job_config
from tlt_jax.job.build import build_job
from tlt_jax.job.runner import initial_model, make_trainer
from tlt_jax.models import from_pretrained
from tlt_jax.rl.sft import warm_start
from tlt_jax.rl.tasks import carries_out, operand_digits
from tlt_jax.rl.data import eval_problems


def by_digits(problems, rewards) -> dict[int, dict[str, float]]:
  """``{digits: {"reward": mean reward, "share": share of the problems}}``, sizes ascending."""
  groups = collections.defaultdict(list)
  for problem, reward in zip(problems, rewards):
    groups[operand_digits(problem.prompt)].append(reward)
  return {d: dict(reward=float(np.mean(r)), share=len(r) / len(problems))
          for d, r in sorted(groups.items())}


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_set_flag(parser, help="config overrides of the default job, e.g. sft.steps=600")
  parser.add_argument("--model", default=None,
                      help="an HF-format policy directory (default: the job's warm start)")
  parser.add_argument("--problems", type=int, default=None,
                      help="held-out problems (default: the job's trainer.eval_problems)")
  parser.add_argument("--failures", type=int, default=8,
                      help="wrong completions to show per temperature")
  parser.add_argument("--pass-k", type=int, default=8,
                      help="pass@k at the trainer's temperature, per size (0: not measured)")
  parser.add_argument("--solvable-k", type=int, default=0,
                      help="also draw this many samples of each problem: the problems with a "
                      "right one are those the policy can solve at all, and pass@--pass-k is "
                      "estimated on them from those samples (0: not measured)")
  parser.add_argument("--out", default="experiments/out/held_out_by_digits.json")
  a = parser.parse_args()
  cfg = job_config(0, a.set, "")
  job = build_job(cfg)
  if a.model:
    model, _ = from_pretrained(a.model)
  else:
    model, _ = warm_start(initial_model(job, cfg.seed), job.tokenizer, job.task, job.sft,
                          cfg.seed)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  trainer = make_trainer(job, model, mesh)
  result = dict(date=datetime.date.today().isoformat(),
                command=" ".join(["python -m experiments.rl.held_out_by_digits"] + sys.argv[1:]),
                model=a.model or f"the warm start ({job.sft.steps} SFT steps, seed {cfg.seed})")
  for name, temperature in (("greedy", 0.0), ("sampled", job.trainer.temperature)):
    problems, texts, rewards = trainer.held_out(a.problems, temperature=temperature)
    sizes = by_digits(problems, rewards)
    wrong = [dict(prompt=p.prompt, expected=p.solution, wrote=t)
             for p, t, r in zip(problems, texts, rewards) if r == 0][:a.failures]
    carry = np.array([carries_out(p) for p in problems])
    split = {k: float(np.mean(np.asarray(rewards)[m])) if m.any() else None
             for k, m in (("carry_out", carry), ("no_carry_out", ~carry))}
    result[name] = dict(mean=float(np.mean(rewards)), by_digits=sizes, by_final_carry=split,
                        failures=wrong)
    print(f"  {name} on sums with a final carry {split['carry_out']}, without "
          f"{split['no_carry_out']}")
    print(f"{name}: {np.mean(rewards):.3f}; by digits " +
          " ".join(f"{d}: {s['reward']:.2f} ({s['share']:.0%})" for d, s in sizes.items()))
    for w in wrong:
      print(f"  {w['prompt']:>18} wrote{w['wrote']!r}, not{w['expected']!r}")
  if a.pass_k:
    passed = trainer.pass_at(a.pass_k, a.problems)
    problems = eval_problems(job.task, a.problems or job.trainer.eval_problems)
    sizes = by_digits(problems, passed.astype(float))
    result[f"pass_at_{a.pass_k}"] = dict(mean=float(passed.mean()), by_digits=sizes)
    print(f"pass@{a.pass_k}: {passed.mean():.3f}; by digits " +
          " ".join(f"{d}: {s['reward']:.2f}" for d, s in sizes.items()))
  if a.solvable_k:
    k = a.pass_k or 8
    rows, _, rewards = trainer.held_out(a.problems, temperature=job.trainer.temperature,
                                        samples=a.solvable_k)
    right = (np.asarray(rewards).reshape(-1, a.solvable_k) >= 1.0).sum(axis=1)
    problems = rows[::a.solvable_k]  # each problem's samples are consecutive rows
    estimate = np.array([pass_at_k_estimate(a.solvable_k, int(c), k) for c in right])
    solvable = right > 0
    sizes = by_digits([p for p, s in zip(problems, solvable) if s], estimate[solvable])
    result["solvable"] = dict(
        samples=a.solvable_k, k=k, share=float(solvable.mean()),
        share_by_digits=by_digits(problems, solvable.astype(float)),
        pass_at_k=float(estimate[solvable].mean()), pass_at_k_by_digits=sizes)
    print(f"solvable (a right answer in {a.solvable_k} samples): {solvable.mean():.3f} of the "
          f"problems; pass@{k} on them {estimate[solvable].mean():.3f}; by digits " +
          " ".join(f"{d}: {s['reward']:.2f}" for d, s in sizes.items()))
  write_report(a.out, result)


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
  """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are right (Chen et al.,
  2021): one minus the chance that ``k`` drawn without replacement are all wrong."""
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


if __name__ == "__main__":
  main()
