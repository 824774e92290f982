"""The JSON line a benchmark appends to ``benchmarks/results/<name>.jsonl`` (``results_path``),
and the helpers benchmarks share to summarize seeds and rewrite their section of a doc.

Shared by the benchmark scripts (``from benchmarks.common.result_rows import ...``), wherever
they sit. One layout for every script's results, under ``RESULTS_DIR``: its rows in
``<name>.jsonl`` (``results_path``), everything else it writes or reads (logs, profiles, traces,
plans) in the folder named after the script's module, ``<script>/`` (``script_dir``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Sequence

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root (child processes of a benchmark run from here)."""
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
"""Every benchmark's results: ``<name>.jsonl`` rows and one ``<script>/`` folder per script."""


def results_path(name: str) -> str:
  """``benchmarks/results/<name>.jsonl``: the rows of the benchmark ``name`` (absolute)."""
  return os.path.join(RESULTS_DIR, f"{name}.jsonl")


def script_dir(script: str) -> str:
  """``benchmarks/results/<script>/``: the logs, profiles and tables of the benchmark module
  ``script`` (``benchmarks/<script>.py`` or ``benchmarks/diagnosis/<script>.py``), absolute."""
  return os.path.join(RESULTS_DIR, script)


def result_row(
  benchmark: str, case: str, metric: str, value, baseline, device: str, ratio=None, **extra
) -> dict:
  """One result: ``ratio`` defaults to ``value / baseline`` (None without a baseline); ``extra``
  keys follow, then the ``XLA_FLAGS`` the process ran with, where set."""
  flags = os.environ.get("XLA_FLAGS")
  return {
    "benchmark": benchmark,
    "case": case,
    "device": device,
    "jax_version": jax.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "metric": metric,
    "value": value,
    "baseline": baseline,
    "ratio": ratio if ratio is not None else (value / baseline if baseline else None),
    **extra,
    **({"xla_flags": flags} if flags else {}),
  }


def append_rows(path: str, rows: Sequence[dict]) -> None:
  """Appends ``rows`` to the JSON lines file ``path`` (its folder is created if missing)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def save_rows(path: str, rows: Sequence[dict], save: bool = True) -> None:
  """``append_rows`` and say so, unless ``save`` is false (a benchmark's ``--no-save``)."""
  if save:
    append_rows(path, rows)
    print(f"appended {len(rows)} rows to {path}")


def mean_std(values):
  n = len(values)
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
  return mean, std


def write_section(path: str, section: str, key: str) -> None:
  """Replaces the section ``key`` of ``path`` (between its markers), keeping the rest; each
  set of tasks (``key``) has its own section, so runs of different tasks do not clobber."""
  begin, end = f"<!-- accuracy.py {key}: begin -->", f"<!-- accuracy.py {key}: end -->"
  text = open(path).read() if os.path.exists(path) else "# Results\n\n"
  block = f"{begin}\n{section}{end}\n"
  if begin in text and end in text:
    head, rest = text.split(begin, 1)
    text = head + block + rest.split(end, 1)[1].lstrip("\n")
  else:
    text = text.rstrip("\n") + "\n\n" + block
  with open(path, "w") as f:
    f.write(text)
