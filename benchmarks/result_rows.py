"""The JSON line a benchmark appends to ``benchmarks/results/<name>.jsonl``.

Imported by the benchmark scripts as a sibling module (``python benchmarks/<name>.py`` puts
this folder first on ``sys.path``).
"""

from __future__ import annotations

import datetime

import jax


def result_row(benchmark: str, case: str, metric: str, value, baseline, device: str, **extra) -> dict:
  """One result: ``ratio`` is ``value / baseline`` (None without a baseline); ``extra`` keys follow."""
  return {
    "benchmark": benchmark,
    "case": case,
    "device": device,
    "jax_version": jax.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "metric": metric,
    "value": value,
    "baseline": baseline,
    "ratio": value / baseline if baseline else None,
    **extra,
  }
