"""Held-out accuracy of trained policies on problems their training never drew from.

  python -m experiments.rl.unseen_problems --run runs/s0 --run runs/s1 --not-trained
  python -m experiments.rl.unseen_problems --run runs/s0 --set min_terms=3 --set max_terms=3

For each run (a job's logdir), its starting policy (``config.json``'s ``model.path``) and its
``final_model`` answer the same ``--n`` problems of the run's reasoning_gym task with the dataset
settings changed by ``--set`` (e.g. two-digit terms where the job trained on one-digit ones:
problems it never saw), or with ``--not-trained`` the run's own distribution less every problem
its RL steps drew (the job's held-out set is drawn from the same pool as its training problems,
so on a small pool the two overlap), chat-formatted as the job formats them, greedy and sampled at the job's
temperature with a fixed seed; scored by the task's own reward. Reports each accuracy and the
gain of the final model over the start (the no-update control) with its binomial standard error.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from experiments import harness
from tlt_jax.models.load import from_pretrained, load_tokenizer
from tlt_jax.rl.external_tasks import ReasoningGymTask
from tlt_jax.rl.data import step_problems
from tlt_jax.rollout import EngineConfig, RolloutEngine, SamplingParams


def score(model_path, tokenizer, task, problems, temperature: float, max_new: int,
          seed: int) -> list[float]:
  """The task's rewards of ``model_path``'s completions of ``problems``."""
  model, _ = from_pretrained(model_path, dtype="float32")
  ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}]))
         for p in problems]
  engine = RolloutEngine(model, config=EngineConfig(
      max_batch=64, max_prompt_len=max(len(i) for i in ids), max_new_tokens=max_new,
      pad_token_id=tokenizer.pad_token_id or 0))
  result = engine.generate(ids, SamplingParams(temperature=temperature, max_new_tokens=max_new,
                                               seed=seed))
  texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
  return [task.reward(p, t) for p, t in zip(problems, texts)]


def main(argv=None) -> dict:
  p = harness.parser(__doc__)
  p.add_argument("--run", action="append", required=True, help="a job's logdir (repeatable)")
  p.add_argument("--set", action="append", default=[], help="dataset setting KEY=VALUE")
  p.add_argument("--n", type=int, default=128)
  p.add_argument("--seed", type=int, default=1234)
  p.add_argument("--not-trained", action="store_true",
                 help="the run's own problems, less those its RL steps drew")
  p.add_argument("--out", default="docs/results/unseen_problems.json")
  a = p.parse_args(argv)
  report = dict(sets=a.set, n=a.n, not_trained=a.not_trained, runs={})
  for run in a.run:
    cfg = json.loads((pathlib.Path(run) / "config.json").read_text())
    options = dict(cfg["task"].get("options") or {})
    options.update(harness.assignment(s) for s in a.set)
    task = ReasoningGymTask(cfg["task"]["name"], size=1000, seed=a.seed,
                            prompt_template=cfg["task"]["prompt_template"], **options)
    if a.not_trained:  # the job's own task, less what its steps drew
      trained = ReasoningGymTask(cfg["task"]["name"], size=cfg["task"]["size"],
                                 seed=cfg["task"]["seed"],
                                 prompt_template=cfg["task"]["prompt_template"], **options)
      seen = {q.prompt for s in range(cfg["trainer"]["steps"])
              for q in step_problems(trained, cfg["seed"], s, cfg["trainer"]["prompts_per_step"])}
      pool = {q.prompt: q for q in task.sample(np.random.default_rng(a.seed), 20 * a.n)}
      problems = [q for prompt, q in sorted(pool.items()) if prompt not in seen][:a.n]
    else:
      problems = task.sample(np.random.default_rng(a.seed), a.n)
    tokenizer = load_tokenizer(cfg["model"]["path"])
    out = {}
    for name, path in (("start", cfg["model"]["path"]),
                       ("final", str(pathlib.Path(run) / "final_model"))):
      for label, temperature in (("greedy", 0.0), ("sampled", cfg["trainer"]["temperature"])):
        r = score(path, tokenizer, task, problems, temperature, cfg["trainer"]["max_new_tokens"],
                  a.seed)
        out[f"{name}_{label}"] = float(np.mean(r))
        print(f"{run} {name} {label}: {np.mean(r):.3f}", flush=True)
    for label in ("greedy", "sampled"):
      s, f = out[f"start_{label}"], out[f"final_{label}"]
      out[f"gain_{label}"] = f - s
      out[f"se_{label}"] = float(np.sqrt((s * (1 - s) + f * (1 - f)) / len(problems)))
    out["problems"] = len(problems)
    report["runs"][run] = out
    print(json.dumps({run: out}), flush=True)
  harness.write_json(a.out, report)
  print(f"wrote {a.out}")
  return report


if __name__ == "__main__":
  main()
