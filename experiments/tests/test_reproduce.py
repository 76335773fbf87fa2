"""experiments/reproduce.py: one command per paper table/figure; the tiny Fig. 17 entry runs for
real (CI's one tiny entry), the other entries' renderers are checked on small reports."""

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from experiments import reproduce as rp

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "experiments.reproduce", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def test_every_entry_is_listed_with_its_scripts():
  out = run_cli("--list", timeout=60)
  assert out.returncode == 0, out.stderr
  for name in ("table4", "fig13", "table5", "table6", "fig11", "fig17", "table3"):
    assert name in out.stdout
  assert "experiments/sd/bench_sd.py" in out.stdout
  assert "experiments/drafter/drafter_drift.py" in out.stdout


@pytest.mark.parametrize("args, message", [
    (("table7",), "unknown entry 'table7'"),
    ((), "say which table or figure"),
    (("fig17", "--model", "/nowhere.gguf"), "--model goes with --size real"),
    (("fig17", "--size", "real", "--model", "/nowhere.gguf"), "no such file"),
])
def test_bad_arguments_say_what_to_do(args, message):
  out = run_cli(*args, timeout=60)
  assert out.returncode == 2 and message in out.stderr


def test_an_entry_without_a_real_version_says_so(tmp_path):
  out = run_cli("table6", "--size", "real", "--work-dir", str(tmp_path / "w"), "--results-dir",
                str(tmp_path / "r"), "--index", str(tmp_path / "RESULTS.md"))
  assert out.returncode == 1
  assert "table6 has no --size real version" in out.stderr and "--size tiny" in out.stderr


@pytest.mark.slow
def test_fig17_tiny_writes_its_table_png_and_the_index(tmp_path):
  """CI's tiny entry: the real script runs; ours come from its JSON, the paper's beside them."""
  args = ("fig17", "--size", "tiny", "--work-dir", str(tmp_path / "w"), "--results-dir",
          str(tmp_path / "results"), "--index", str(tmp_path / "RESULTS.md"))
  out = run_cli(*args)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  md = (tmp_path / "results" / "fig17_tiny.md").read_text()
  measured = json.loads((tmp_path / "w" / "tiny" / "drafter_save_latency.json").read_text())
  tiny = measured["results"][0]
  assert f"{tiny['full_blocking_ms']:.0f} ms" in md  # ours: the measurement of this run
  assert "893 ms" in md and "97 ms" in md  # the paper's, in its own row
  assert "python -m experiments.reproduce fig17 --size tiny" in md
  assert (tmp_path / "results" / "fig17_tiny.png").stat().st_size > 1000
  index = (tmp_path / "RESULTS.md").read_text()
  assert "Fig. 17" in index and "results/fig17_tiny.png" in index
  again = run_cli(*args)  # the same command again: the script's JSON is reused, not remade
  assert again.returncode == 0
  assert "cached: experiments/drafter/drafter_save_latency.py" in again.stdout


def _ns(**kw):
  return argparse.Namespace(**{"size": "tiny", "model": None, **kw})


def _drift_report(adapted, frozen):
  steps = 6
  rows = lambda v: [dict(mean_accept_len=v, step_s=1.0) for _ in range(steps)]
  arm = lambda v: dict(accept_len_first_third=v, accept_len_last_third=v, accept_len_mean=v,
                       heldout_top1_first_third=0.9, heldout_top1_last_third=0.8)
  return dict(summary=dict(adapted=arm(adapted), frozen=arm(frozen), scratch=arm(1.5)),
              adapted_over_frozen_last_third=adapted / frozen, args=dict(steps=steps, out="x"),
              spec=dict(depth=5), trajectory=dict(identical_tokens=True),
              policy_kl_to_start=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5],
              steps=dict(adapted=rows(adapted), frozen=rows(frozen), scratch=rows(1.5)),
              critical_path=dict(drafter_serial_s_median=0.2, rollout_s_median=0.1,
                                 step_s_median=0.5))


def test_table6_puts_the_paper_beside_ours_and_flags_a_miss():
  hit = rp.render_table6({"drafter_drift": _drift_report(4.2, 3.0)}, _ns())
  text = "\n".join(hit.lines)
  assert "**1.40×**" in text
  assert "| adapted | 4.20 | 4.20 | 4.20 | 0.900 → 0.800 | 6.53 |" in text
  assert "Target missed" not in text and "KL" in text and "0.200 s per RL step" in text
  miss = rp.render_table6({"drafter_drift": _drift_report(3.1, 3.0)}, _ns())
  assert any("Target missed" in line for line in miss.lines)


def test_fig11_explains_a_missed_speedup_from_the_measured_breakdown():
  def arm(step, rollout, ratio):
    return dict(step_s_median=step, rollout_s_median=rollout, update_s_median=step - rollout,
                drafter_serial_s_median=0.0, step_vs_vanilla_paired_median=ratio)
  report = dict(summary=dict(vanilla=arm(1.0, 0.2, 1.0), tlt=arm(1.25, 0.3, 1.25)),
                steps=dict(vanilla=[dict(step_s=1.0)], tlt=[dict(step_s=1.25)]))
  text = "\n".join(rp.render_fig11({"e2e_speedup": report}, _ns()).lines)
  assert "**0.80×**" in text  # 1 / 1.25: slower than vanilla, said as it is
  assert "The rollout is 20% of vanilla's step" in text and "at most 1.25× faster" in text
  assert "0.000 s a step" in text


def test_fig11_on_the_long_tail_job_shows_the_shares_and_the_paired_ratio():
  def step(step_s, rollout_s, tail_s, last_s, accept=None):
    m = dict(step_s=step_s, rollout_s=rollout_s, update_s=step_s - rollout_s, tail_s=tail_s,
             last_s=last_s)
    return m if accept is None else dict(m, mean_accept_len=accept)
  none = [step(2.0, 1.0, 0.5, 0.2), step(1.0, 0.6, 0.3, 0.3), step(1.0, 0.6, 0.3, 0.3)]
  tlt = [step(2.0, 1.0, 0.5, 0.2, 2.0), step(1.25, 0.85, 0.3, 0.3, 2.0),
         step(1.25, 0.85, 0.3, 0.3, 2.0)]
  report = dict(arms=["none", "suffix"], steps_metrics=dict(none=none, suffix=tlt),
                summary=dict(kept_steps=[2, 3], step_ratio=dict(all=dict(median=1.25))))
  rendered = rp.render_fig11({"e2e_default_job": report}, _ns())
  text = "\n".join(rendered.lines)
  assert "| vanilla | 1.000 | 0.600 | 0.400 | 60% | 50% | 50% | 1.00× | – |" in text
  # the arm's column is a speedup too (vanilla's step time ÷ TLT's), never a time ratio
  assert "| TLT | 1.250 | 0.850 | 0.400 | 68% | 35% | 35% | 0.80× | 2.00 |" in text
  assert "**0.80×**" in text and "**Target missed.**" in text and "long-tail job" in text
  assert "0.80×" in rendered.verdict


def test_table5_shows_what_each_pool_compiles_when_it_misses():
  def pool(total, **kinds):
    return dict(executables=sum(kinds.values()), compile_s=1.0, memory_mb_total=total,
                memory_mb_max=10.0, by_kind=kinds)
  report = dict(strategies=["chain d3"], buckets=[1, 2, 4],
                pools={"naive": pool(900.0, prefill=18, compact=24),
                       "shared + threshold": pool(450.0, prefill=3, catchup=6)})
  text = "\n".join(rp.render_table5({"ablate_pool": report}, _ns()).lines)
  assert "**2.00×** here" in text and "30.4 GB → 10.7 GB = 2.84×" in text
  assert "**Target missed**" in text and "| naive | 0 | 24 | 18 |" in text
  report["pools"]["shared + threshold"]["memory_mb_total"] = 300.0  # 3.00x: met, no breakdown
  assert "Target missed" not in "\n".join(rp.render_table5({"ablate_pool": report}, _ns()).lines)


DRIFT_CHECK = """
import json, re, numpy as np
from experiments.rl import rl_bench as rb
from tlt_jax.rl.tasks import ArithmeticTask
task = rb.FormatShiftTask(ArithmeticTask(max_digits=6), new_style_share=0.3, old_style_reward=0.25)
problems = task.sample(np.random.default_rng(0), 400)
new = [p for p in problems if rb.is_new_style(p.solution)]
step = r"(\\d)\\+(\\d)\\+(\\d)=(\\d\\d)"
steps_ok = all(int(c) + int(y) + int(x) == int(t) and c in "01"
               for p in new for c, y, x, t in re.findall(step, p.solution))
old = next(p for p in problems if not rb.is_new_style(p.solution))
wrong = new[0].solution.replace("#" + new[0].answer, "#" + str(int(new[0].answer) + 1))
print(json.dumps(dict(share=len(new) / len(problems), steps_ok=steps_ok,
                      answers=[task.reward(p, p.solution) for p in (new[0], old)],
                      wrong=task.reward(new[0], wrong),
                      first=new[0].solution[:12], same_prompts=[p.prompt for p in problems[:5]] ==
                      [p.prompt for p in task.sample(np.random.default_rng(0), 5)])))
"""


def test_the_drift_workload_rewards_the_style_its_warm_start_rarely_writes():
  env = dict(__import__("os").environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", DRIFT_CHECK], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert 0.22 < got["share"] < 0.38  # new_style_share of the warm start's traces
  assert got["steps_ok"] and got["first"].startswith("= ")  # carry first, the same arithmetic
  assert got["answers"] == [1.0, 0.25] and got["wrong"] == 0.0
  assert got["same_prompts"]


TOY = """\
import json, os, pathlib, sys, time
out, flag = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out.write_text('{"value": ')  # a JSON half written
if flag.exists():  # the run to be killed: waits here
  (flag.parent / "toy.pid").write_text(str(os.getpid()))
  print("started", flush=True)
  time.sleep(120)
out.write_text(json.dumps({"value": 42}))
"""

DRIVER = """\
import pathlib, sys
from experiments import reproduce as rp
run = rp.Run(tuple(sys.argv[1:4]), pathlib.Path(sys.argv[2]))
rp.execute(run, pathlib.Path(sys.argv[4]), fresh=True)
"""


def test_a_run_killed_part_way_is_run_again_not_taken_from_the_cache(tmp_path):
  """reproduce killed (SIGKILL) while a script runs: the next call runs that script again and
  gets what an uninterrupted run gets, never the half-written JSON under the earlier stamp."""
  toy, out, flag, work = (tmp_path / "toy.py", tmp_path / "toy.json", tmp_path / "hang",
                          tmp_path / "work")
  toy.write_text(TOY)
  work.mkdir()
  run = rp.Run((str(toy), str(out), str(flag)), out)
  quiet = lambda *_, **__: None
  assert rp.execute(run, work, fresh=False, say=quiet) == {"value": 42}  # uninterrupted
  reference = out.read_text()
  assert rp.read_stamp(run.stamp)["command"] == run.key

  flag.touch()  # --fresh, killed while the script runs
  driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(toy), str(out), str(flag),
                             str(work)], cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    for line in driver.stdout:
      if "started" in line:
        break
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
  finally:
    pid = tmp_path / "toy.pid"
    if pid.exists():
      try:
        os.kill(int(pid.read_text()), signal.SIGKILL)  # the orphaned script
      except ProcessLookupError:
        pass
  time.sleep(0.2)
  assert out.read_text() == '{"value": '  # what the kill left
  flag.unlink()
  assert rp.execute(run, work, fresh=False, say=quiet) == {"value": 42}  # resumed: run again
  assert out.read_text() == reference and rp.read_stamp(run.stamp)["command"] == run.key


def test_fresh_runs_a_script_shared_by_two_entries_once(tmp_path, monkeypatch):
  """``all --fresh``: Fig. 13 takes the scripts Table 4 has just run in this call, not a second
  run of each; an earlier call's JSON is still run again."""
  counter = tmp_path / "runs"
  toy = tmp_path / "count.py"
  toy.write_text("import json, pathlib, sys\n"
                 f"c = pathlib.Path({str(counter)!r})\n"
                 "c.write_text(str(int(c.read_text() or 0) + 1) if c.exists() else '1')\n"
                 "pathlib.Path(sys.argv[1]).write_text(json.dumps({'ok': 1}))\n")
  out = tmp_path / "count.json"
  run = rp.Run((str(toy), str(out)), out)
  quiet = lambda *_, **__: None
  rp.execute(run, tmp_path, fresh=False, say=quiet)  # an earlier call's JSON
  monkeypatch.setattr(rp, "RAN_HERE", set())  # a new process
  for _ in range(2):  # two entries of one --fresh call asking for the same script
    assert rp.execute(run, tmp_path, fresh=True, say=quiet) == {"ok": 1}
  assert counter.read_text() == "2"  # the earlier one, then once in this call
