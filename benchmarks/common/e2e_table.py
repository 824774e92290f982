"""``benchmarks.e2e``'s rows as text tables: step cells (by model and width, with the ratio to
the row's baseline — ``plain_cudnn_attn`` of the same width where the run has it, else
``plain``), micro-benchmarks and kernel profiles."""

from __future__ import annotations

import collections


def table(rows: list[dict]) -> str:
  """The run's rows as text tables: step cells (by model and width), micro-benchmarks, profiles."""
  lines = []
  cells = collections.defaultdict(dict)
  for r in rows:
    if r["metric"] in ("step_ms", "compile_s", "peak_bytes", "skipped", "failed"):
      cells[r["case"]][r["metric"]] = r
  if cells:
    lines.append(
      f"{'cell':32s} {'step ms':>8s} {'speed':>6s} {'compile s':>9s} {'x base':>7s} "
      f"{'trace':>6s} {'lower':>6s} {'xla':>6s} {'1st':>6s} {'peak GB':>7s}  note"
    )
  for case, m in cells.items():
    st, cp, pk = m.get("step_ms"), m.get("compile_s"), m.get("peak_bytes")
    note = (m.get("skipped") or m.get("failed") or {}).get("reason", "")
    ms = f"{st['value']:8.2f}" if st else f"{'-':>8s}"
    speed = f"{st['baseline'] / st['value']:6.2f}" if st and st.get("baseline") else f"{'-':>6s}"
    if cp:
      plain_c = cp.get("baseline")
      stages = " ".join(
        f"{cp.get(k, float('nan')):6.1f}" for k in ("trace_s", "lower_s", "compile_s", "first_call_s")
      )
      comp = f"{cp['value']:9.1f} {cp['value'] / plain_c if plain_c else float('nan'):7.2f} {stages}"
    else:
      comp = f"{'-':>9s} {'-':>7s} " + " ".join(f"{'-':>6s}" for _ in range(4))
    peak = f"{pk['value'] / 2**30:7.2f}" if pk and pk["value"] else f"{'-':>7s}"
    lines.append(f"{case:32s} {ms} {speed} {comp} {peak}  {note[:60]}")
  lines += category_table(rows)
  micro = [r for r in rows if r["metric"] == "fwd_bwd_ms"]
  if micro:
    lines.append(
      f"\n{'micro-benchmark (fwd + bwd)':44s} {'ms':>8s} {'x bf16':>7s} {'rel err':>8s} {'compile s':>9s}"
    )
    for r in micro:
      if r["value"] is None:
        lines.append(f"{r['case']:44s} failed: {r.get('error', '')[:70]}")
        continue
      ratio = f"{r['baseline'] / r['value']:7.2f}" if r.get("baseline") else f"{'-':>7s}"
      lines.append(
        f"{r['case']:44s} {r['value']:8.3f} {ratio} {r.get('rel_err', 0):8.4f} {r.get('compile_s', 0):9.1f}"
      )
  for r in rows:
    if r["metric"] == "kernel_ms":
      kinds = ", ".join(f"{k} {v['ms']:.2f}" for k, v in r["by_kind"].items())
      lines.append(f"\n{r['case']}: {r['value']:.2f} ms of kernels, {r['kernels']:.0f} launches: {kinds}")
      for name, ms, n, stack in r["top"][:12]:
        lines.append(f"  {ms:7.3f} ms x{n:<4.0f} {name[:60]:60s} {stack[-60:]}")
  return "\n".join(lines)


CATEGORY_COLUMNS = (
  ("gemm", "GEMM"),
  ("quantize", "quant"),
  ("cast_transpose", "cast/T"),
  ("attention", "attn"),
  ("norm_elementwise", "norm/ew"),
  ("optimizer", "optim"),
)


def category_table(rows: list[dict]) -> list[str]:
  """Lines of the step cells traced by category (``--categories``): the step, its kernel ms per
  category, and the ceiling (the step without its quantize and cast/transpose/copy kernels) with
  its ratio to the baseline step."""
  traced = [r for r in rows if r["metric"] == "step_ms" and r.get("categories")]
  if not traced:
    return []
  head = " ".join(f"{label:>7s}" for _, label in CATEGORY_COLUMNS)
  lines = [f"\n{'kernel ms by category':32s} {'step':>7s} {'speed':>6s} {head} {'ceiling':>7s} {'speed':>6s}"]
  for r in traced:
    cats = " ".join(f"{r['categories'][c]['ms']:7.2f}" for c, _ in CATEGORY_COLUMNS)
    base = r.get("baseline")
    speed = f"{base / r['value']:6.2f}" if base else f"{'-':>6s}"
    ceiling = f"{base / r['ceiling_ms']:6.2f}" if base else f"{'-':>6s}"
    lines.append(f"{r['case']:32s} {r['value']:7.2f} {speed} {cats} {r['ceiling_ms']:7.2f} {ceiling}")
  return lines
