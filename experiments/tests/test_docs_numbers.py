"""The numbers README.md and docs/RESULTS.md show follow the JSON they were made from.

* docs/RESULTS.md and its entries (``docs/results/<name>_<size>.md``) are written by
  ``python -m experiments.reproduce`` from the JSON its scripts wrote, a copy of which lies beside
  each entry. Each entry must be what today's renderer makes of that JSON (its verdict included),
  and the index what the entries make: ``python -m experiments.reproduce --rerender`` rewrites
  both after a change to the renderer, running nothing.
* README's results rows that quote a JSON under ``docs/results/`` are parsed, and each number is
  compared with the JSON to the digits it is written with. TLT/vanilla figures are speedups
  (vanilla's time ÷ TLT's), so a row's ``0.98×`` is checked against 1 / the JSON's time ratio.
* Every link into docs/benchmarks.md names one of its headings, and each README results row links
  a heading that carries the measurement's date.

No JAX, no script run: about a second.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics

import pytest

from experiments import reproduce as rp

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
INDEX = REPO / "docs" / "RESULTS.md"
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
DATE = re.compile(r"20\d\d-\d\d-\d\d")
REGENERATE = "python -m experiments.reproduce --rerender"


def load(name: str) -> dict:
  return json.loads((RESULTS / name).read_text())


def entries() -> list[tuple[str, str]]:
  """(name, size) of every entry whose markdown lies under docs/results/."""
  return [(name, size) for name in rp.ENTRIES for size in rp.SIZES
          if (RESULTS / f"{name}_{size}.md").is_file()]


# ------------------------------------------------------------------------------ docs/RESULTS.md


def test_there_are_entries_to_check():
  assert len(entries()) >= 7, entries()


@pytest.mark.parametrize("name, size", entries())
def test_each_entry_is_what_its_json_renders(name, size):
  written = (RESULTS / f"{name}_{size}.md").read_text()
  assert written == rp.rerendered(name, size, RESULTS), (
      f"docs/results/{name}_{size}.md differs from what its JSON renders today: {REGENERATE}")


def index_rows() -> dict[str, tuple[str, str, str]]:
  """RESULTS.md's table: entry stem (``fig11_tiny``) -> (size, date, verdict)."""
  rows = {}
  for line in INDEX.read_text().splitlines():
    m = re.fullmatch(r"\| \[[^]]+\]\(results/(\w+)\.md\) \| (\w+) \| ([\d-]+) \| (.*) \|", line)
    if m:
      rows[m.group(1)] = m.groups()[1:]
  return rows


def test_each_index_verdict_is_recomputed_from_its_json():
  rows = index_rows()
  assert set(rows) == {f"{name}_{size}" for name, size in entries()}
  for name, size in entries():
    reports = load(f"{name}_{size}.json")
    verdict = rp.ENTRIES[name].render(reports, argparse.Namespace(size=size, model=None)).verdict
    size_, date, written = rows[f"{name}_{size}"]
    assert (size_, written) == (size, verdict), f"{name}: {REGENERATE}"
    assert f" — {date}," in (RESULTS / f"{name}_{size}.md").read_text()  # the run's own date


def test_the_index_is_what_its_entries_make():
  assert INDEX.read_text() == rp.index_text(RESULTS, INDEX), REGENERATE


def test_the_index_states_the_speedup_convention_and_what_is_modelled():
  intro = INDEX.read_text().split("| entry |")[0]
  assert "speedup, higher is better" in intro and "vanilla's time ÷ TLT's" in intro
  assert "Table 3's" in intro and "step-time model" in intro


# ------------------------------------------------------------------------------ README.md


def readme_row(key: str) -> str:
  """The "measured" cell of the one README results row whose first cell contains ``key``."""
  cells = [line.split(" | ") for line in README.read_text().splitlines()
           if line.startswith("| ") and key in line.split(" | ")[0]]
  assert len(cells) == 1, f"README results rows matching {key!r}: {len(cells)}"
  return cells[0][1]


def decimals(text: str) -> list[str]:
  """The decimal numbers in ``text``, signed where a sign stands alone (``1.08-1.30``: two)."""
  return re.findall(r"(?<![\d.])[+-]?\d+\.\d+", text)


def agrees(written: str, value: float) -> bool:
  """``written`` is ``value`` rounded to the digits it shows."""
  digits = len(written.split(".")[1])
  return abs(float(written) - value) <= 0.5 * 10 ** -digits + 1e-9


def check(written: list[str], expected: list[float], what: str) -> None:
  assert len(written) >= len(expected), f"{what}: {written} against {expected}"
  wrong = [(w, round(e, 4)) for w, e in zip(written, expected) if not agrees(w, e)]
  assert not wrong, f"{what}: written / from the JSON: {wrong}"


def test_readme_default_job_rows_follow_default_learns_json():
  d = load("default_learns.json")
  grpo, control = d["arms"]["grpo"], d["arms"]["control"]
  seeds = sorted(d["over_control"], key=int)
  for key, field, gain in (("held-out greedy accuracy", "accuracy", "accuracy_gain"),
                           ("held-out sampled reward", "sampled", "sampled_gain")):
    expected = [grpo[f"{field}_start"]["mean"], grpo[f"{field}_end"]["mean"],
                *(d["over_control"][s][field if field == "accuracy" else "sampled"]
                  for s in seeds), grpo[gain]["mean"], grpo[gain]["std"]]
    check(decimals(readme_row(f"Default job: {key}")), expected, key)
    assert control[gain]["min"] == control[gain]["max"] == 0.0  # "the controls: exactly 0"
  runs = [r for r in d["runs"] if r["arm"] == "grpo"]
  expected = [statistics.mean(r["pass_at_8_start"] for r in runs),
              statistics.mean(r["pass_at_8_end"] for r in runs),
              grpo["pass_at_8_gain"]["mean"], grpo["pass_at_8_gain"]["std"]]
  check(decimals(readme_row("Default job: held-out pass@8")), expected, "pass@8")
  kept = re.search(r"1-2 digits: (\d+) of (\d+) kept", readme_row("by operand size"))
  by = d["kept_by_digits"]
  assert kept and [int(kept.group(1)), int(kept.group(2))] == [
      by["1"]["still_solved"] + by["2"]["still_solved"],
      by["1"]["solved_at_start"] + by["2"]["solved_at_start"]]


def test_job_md_quotes_the_same_default_job_figures():
  d = load("default_learns.json")
  text = (REPO / "docs" / "job.md").read_text()
  for field, gain, words in (("accuracy", "accuracy", "held-out greedy accuracy from"),
                             ("sampled", "sampled", "the held-out sampled reward from")):
    m = re.search(re.escape(words) + r" (\S+) to (\S+): \*\*(.+?)\*\*", text)
    assert m, words
    expected = [d["arms"]["grpo"][f"{field}_start"]["mean"],
                d["arms"]["grpo"][f"{field}_end"]["mean"],
                *(d["over_control"][s][gain] for s in sorted(d["over_control"], key=int))]
    check(decimals(" ".join(m.groups())), expected, f"job.md: {words}")


def evaluations(run: str) -> list[tuple[float, float]]:
  """One run's held-out (greedy, sampled) figures, in order (docs/results/smollm2_cpu_runs)."""
  rows = [json.loads(line) for line in
          (RESULTS / "smollm2_cpu_runs" / run / "metrics.jsonl").read_text().splitlines()]
  return [(r["eval_accuracy"], r["eval_sampled_reward"]) for r in rows if "eval_accuracy" in r]


def test_readme_smollm2_row_follows_its_runs():
  s0, s1, c0 = (evaluations(r) for r in ("s0", "s1", "c0"))
  assert s0[0] == s1[0] == c0[0] and len(set(c0)) == 1  # one start; the control is flat
  expected = []
  for k in (0, 1):  # greedy, then sampled: start -> seed 0, seed 1 (gain over the control)
    expected += [s0[0][k], s0[-1][k], s1[-1][k], s0[-1][k] - c0[-1][k], s1[-1][k] - c0[-1][k]]
  check(decimals(readme_row("SmolLM2-135M-Instruct GRPO")), expected, "SmolLM2 GRPO")


def speedup(time_ratio: float) -> float:
  return 1.0 / time_ratio


def test_readme_speedups_follow_the_e2e_json():
  one_process = [speedup(load(f)["summary"]["step_ratio"]["all"]["median"])
                 for f in ("e2e_default_job_issue56.json", "e2e_longtail_cpu_issue52.json")]
  check(decimals(readme_row("both arms in one process")), one_process, "TLT, one process")

  longtail = (load("separate_processes_tiny_longtail_suffix.json")["ratios"]["step"] +
              load("separate_processes_tiny_longtail_suffix_2.json")["ratios"]["step"])
  apart = [speedup(load("separate_processes_tiny_grpo_eagle.json")["median_ratio"]["step"]),
           speedup(statistics.median(longtail)), speedup(max(longtail)), speedup(min(longtail))]
  check(decimals(readme_row("its own `python -m tlt_jax.train` process")), apart,
        "TLT, separate processes")

  run3 = load("longtail_e2e_h200_run3_sharp.json")["summary"]
  h200 = [speedup(run3["step_ratio"]["all"]["median"]),
          speedup(run3["rollout_ratio"]["all"]["median"]),
          speedup(run3["breakdown"]["tail_s"]["ratio_median"]),
          speedup(run3["breakdown"]["last_s"]["ratio_median"])]
  check(decimals(readme_row("one H200")), h200, "TLT on an H200, run 3")

  predicted = [v["step_ratio"] for job in ("tiny", "mid")  # the model's ratios are speedups
               for v in load("predict_longtail_h200.json")[job].values()]
  check(decimals(readme_row("TLT end-to-end speedup on an accelerator")),
        [min(predicted), max(predicted)], "the step-time model's prediction")


def test_readme_decode_speedups_follow_their_json():
  check(decimals(readme_row("Bucketed decode")), [load("bench_rollout.json")["speedup_median"]],
        "bucketed decode")
  batch1 = load("bench_sd_smollm2_batch1.json")["depth_by_verify"]
  batch8 = load("bench_sd_smollm2.json")["batch_by_verify"]["8"]
  best = lambda cells: max(c["speedup"] for c in cells if isinstance(c, dict))
  check(decimals(readme_row("SD vs vanilla decoding, SmolLM2")),
        [best(c for row in batch1.values() for c in row.values()), best(batch8.values())],
        "SD on SmolLM2")


def test_readme_states_the_speedup_convention():
  results = README.read_text().split("## Results")[1].split("| what |")[0]
  assert "speedup, higher is better" in results and "vanilla's time ÷ TLT's" in results


# ---------------------------------------------------------------------- links to benchmarks.md


def headings() -> dict[str, str]:
  """docs/benchmarks.md's headings (outside code blocks) by GitHub anchor."""
  found, fenced = {}, False
  for line in BENCHMARKS.read_text().splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced and re.match(r"#{1,6} ", line):
      text = line.lstrip("#").strip()
      anchor = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
      found.setdefault(anchor, text)
  return found


LINKING = [README, REPO / "experiments" / "README.md", REPO / "docs" / "RESULTS.md",
           *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", sorted(set(LINKING)), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_into_benchmarks_md_names_a_heading(page):
  anchors = re.findall(r"benchmarks\.md#([\w-]+)", page.read_text())
  missing = sorted(set(anchors) - set(headings()))
  assert not missing, f"{page.name} links to no heading of docs/benchmarks.md: {missing}"


def test_each_readme_result_links_a_dated_measurement():
  table = README.read_text().split("| what | measured | details |")[1].split("\n\n")[0]
  rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
  assert len(rows) >= 10
  known = headings()
  for row in rows:
    linked = [known.get(a, "") for a in re.findall(r"benchmarks\.md#([\w-]+)", row)]
    assert any(DATE.search(h) for h in linked), f"no dated benchmarks.md heading: {row[:80]}"
