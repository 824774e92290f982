"""Timelines of a predicted step: Chrome trace JSON (opens in ui.perfetto.dev) and a PNG."""

from __future__ import annotations

import json

from planners.predictor.replay import Prediction
from qsync_jax.errors import PlanError
from qsync_jax.jsonio import write_text_atomic


def chrome_trace(pred: Prediction) -> dict:
  """Trace Event Format: one process per device group (and one for the all-reduce),
  one complete ("X") event per node; times in µs."""
  pids = {}
  events = []
  for node, (start, end) in zip(pred.nodes, pred.times):
    pid = pids.setdefault(node.group, len(pids))
    events.append(
      {
        "name": node.name,
        "cat": node.kind,
        "ph": "X",
        "ts": 1e3 * start,
        "dur": 1e3 * max(end - start, 0.0),
        "pid": pid,
        "tid": 0 if node.stream == "compute" else 1,
        "args": {"precision": node.precision, "op": node.op, "ms": node.ms},
      }
    )
  meta = [
    {
      "name": "process_name",
      "ph": "M",
      "pid": pid,
      "args": {"name": f"{group} ({pred.sources.get(group, 'comm')})"},
    }
    for group, pid in pids.items()
  ]
  return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": pred.to_json()}


def save_chrome_trace(pred: Prediction, path: str) -> None:
  """Writes ``chrome_trace(pred)`` to ``path`` atomically (``write_text_atomic``)."""
  write_text_atomic(path, json.dumps(chrome_trace(pred)), "trace file", PlanError)


COLORS = {
  "fwd": "tab:blue",
  "dlhs": "tab:orange",
  "drhs": "tab:red",
  "cast": "tab:purple",
  "remainder": "tab:gray",
  "optimizer": "tab:green",
  "comm": "tab:brown",
  "sync": "tab:olive",  # a gradient sync's own (de)quantize passes around its collective
}


def save_png(pred: Prediction, path: str) -> None:
  """One row per device group plus one for the all-reduce; bars coloured by node kind."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  rows = list(dict.fromkeys(n.group for n in pred.nodes))
  fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(rows)))
  for node, (start, end) in zip(pred.nodes, pred.times):
    if end > start:
      y = rows.index(node.group)
      ax.broken_barh(
        [(start, end - start)], (y - 0.4, 0.8), facecolors=COLORS[node.kind], edgecolor="white", linewidth=0.3
      )
  ax.set_yticks(range(len(rows)), rows)
  ax.invert_yaxis()
  ax.set_xlabel("ms")
  ax.set_title(f"predicted synchronous step {pred.step_ms:.3f} ms")
  ax.legend(
    handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
    ncol=len(COLORS),
    loc="upper center",
    bbox_to_anchor=(0.5, -0.35),
    fontsize="small",
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
