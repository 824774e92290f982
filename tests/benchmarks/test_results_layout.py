"""``benchmarks/results/`` has one layout for every script: its rows in ``<name>.jsonl``, anything
else it writes or reads (logs, profiles, traces, plans) in the folder named after its module,
``<script>/`` (``benchmarks/<script>.py`` or ``benchmarks/diagnosis/<script>.py``)."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def benchmark_scripts(root: pathlib.Path) -> set[str]:
  """The module names of the scripts in ``benchmarks/`` and ``benchmarks/diagnosis/``."""
  return {
    p.stem
    for d in ("benchmarks", "benchmarks/diagnosis")
    for p in (root / d).glob("*.py")
    if p.stem != "__init__"
  }


def misplaced(entries: list[tuple[str, bool]], scripts: set[str]) -> list[str]:
  """Each ``(name, is_folder)`` in the results folder that breaks the layout: a file that is not
  ``<name>.jsonl``, or a folder not named after a benchmark script."""
  bad = []
  for name, is_folder in entries:
    if is_folder and name not in scripts:
      bad.append(
        f"{name}/ (no benchmark script of that name: move it under the folder of the script that writes it)"
      )
    elif not is_folder and not name.endswith(".jsonl"):
      bad.append(f"{name} (only <name>.jsonl rows sit at the top: move it under its script's folder)")
  return bad


def test_every_result_sits_in_its_scripts_layout():
  entries = [(p.name, p.is_dir()) for p in RESULTS.iterdir() if not p.name.startswith(".")]
  assert entries, "benchmarks/results/ holds the committed rows"
  assert misplaced(entries, benchmark_scripts(ROOT)) == []


def test_a_planted_log_or_stray_folder_is_reported():
  scripts = benchmark_scripts(ROOT)
  assert {"e2e", "roofline", "kernels"} <= scripts  # top level and diagnosis scripts both count
  planted = [("e2e.jsonl", False), ("e2e", True), ("e2e_run.log", False), ("profiles", True)]
  assert misplaced(planted, scripts) == [
    "e2e_run.log (only <name>.jsonl rows sit at the top: move it under its script's folder)",
    "profiles/ (no benchmark script of that name: move it under the folder of the script that writes it)",
  ]
