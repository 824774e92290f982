"""Plain-text tables for reports (the CLI, the demo, the benchmarks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from qsync_jax.devices import device
from qsync_jax.precision import PRESETS


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


def estimated_costs(device_types: Mapping[str, str], sources: Mapping[str, str], policies) -> list[str]:
  """One line per group whose costs are modeled (``sources[group]`` starts with ``"modeled"``)
  at a precision the catalog was never checked at on that device type: the datasheet
  estimates a plan relies on. ``device_types`` and ``policies`` are keyed by group; a policy
  is a preset name or a set of precisions."""
  lines = []
  for group, source in sources.items():
    if not source.startswith("modeled"):
      continue
    dev = device(device_types[group])
    used = set()
    for policy in policies.get(group, ()):
      used |= set(PRESETS[policy].precisions) if policy in PRESETS else {policy}
    estimated = sorted(used - set(dev.checked))
    if estimated:
      checked = f"checked against measurements at {', '.join(dev.checked)}" if dev.checked else "never measured"
      lines.append(
        f"{group} ({dev.name}): {', '.join(estimated)} costs are datasheet estimates "
        f"(the catalog's {dev.name} is {checked})"
      )
  return lines
