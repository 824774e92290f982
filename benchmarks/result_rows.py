"""The JSON line a benchmark appends to ``benchmarks/results/<name>.jsonl``.

Shared by the benchmark scripts (``from benchmarks.result_rows import ...``; they run from
the repository root as ``python -m benchmarks.<name>``).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence

import jax


def result_row(
  benchmark: str, case: str, metric: str, value, baseline, device: str, ratio=None, **extra
) -> dict:
  """One result: ``ratio`` defaults to ``value / baseline`` (None without a baseline); ``extra``
  keys follow."""
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
