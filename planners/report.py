"""Plain-text tables for reports (the CLI, the demo, the benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A plain-text table with right-aligned numbers."""

  def fmt(x):
    return f"{x:.3f}" if isinstance(x, float) else str(x)

  cells = [[fmt(c) for c in r] for r in rows]
  widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
  lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
  lines.append("  ".join("-" * w for w in widths))
  for r in cells:
    lines.append(
      "  ".join(c.rjust(w) if c[:1].isdigit() or c[:1] == "-" else c.ljust(w) for c, w in zip(r, widths))
    )
  return "\n".join(lines)
