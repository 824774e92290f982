"""Tests of the benchmark scripts' CPU-side parts (tables, row readers, offline replays)."""

import json


def write_rows(path, rows) -> str:
  """Writes result ``rows`` (dicts) as JSON lines to ``path``; returns it as a string."""
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def result(run: str, case: str, metric: str, value: float, device: str, **extra) -> dict:
  """A results row with the fields the readers look at."""
  return {"run": run, "case": case, "metric": metric, "value": value, "device": device, **extra}
