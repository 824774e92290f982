"""The optimizer update's time, measured, against the catalog's modeled cost — whole and as the
1/N share a device updates under ``optimizer_update: "sharded"``.

An ``optax.adamw`` update of a BERT-base-sized parameter set (108.9 M fp32 values in 262 leaves:
the embedding tables, 12 layers of Q/K/V/out and MLP kernels, their biases and norm scales) is
jitted alone and timed back to back (10 updates per sample, 20 samples, median and p10/p90),
in two layouts:

* ``leaves``: the parameter tree as the trainer holds it (each leaf its own fusion);
* ``one_buffer``: every leaf flattened (and, for a share, padded to a multiple of N) into one
  vector — the work a bandwidth roofline describes.

Each at the whole set (N = 1: the replicated update) and a 1/N share (N = 2, 4, 8: one device's
work in the sharded update), every case twice in both orders (clock drift). ``modeled_ms`` is the
catalog's optimizer cost for the same number of values on this device type
(``planners.predictor.modeled.optimizer_ms``). Rows: ``case`` = ``adamw/bert_base/<layout>/share_1of<N>``,
``metric`` = ``update_ms``, ``baseline`` = the modeled ms.

Alone, the ``leaves`` layout is dispatch-bound (hundreds of small kernels); inside a training
step XLA fuses the leaves' updates across the program, which ``benchmarks.e2e`` measures (the
per-leaf adamw inside the GPT step is not slower than one flat buffer's).

  python -m benchmarks.optimizer_tail      # on a GPU; a CPU run measures the CPU
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common.result_rows import result_row, results_path, save_rows
from planners.predictor.modeled import optimizer_ms
from qsync_jax.devices import device, device_type_of_kind

RESULTS = results_path("optimizer_tail")
D = 768
SHAPES = (
  [(30522, D), (512, D)] + [(D, D)] * 48 + [(D, 4 * D), (4 * D, D)] * 12 + [(D,)] * 100 + [(4 * D,)] * 12
)
"""BERT-base's parameter leaves (embedding and position tables, attention and MLP kernels, biases, scales)."""


def leaves_of(layout: str, n: int) -> list[jax.Array]:
  """The parameters one device updates: the tree's leaves, or one padded flat share of 1/n."""
  shares = [-(-int(np.prod(s)) // n) for s in SHAPES]
  if layout == "one_buffer":
    return [jnp.full((sum(shares),), 0.01, jnp.float32)]
  if n == 1:
    return [jnp.full(s, 0.01, jnp.float32) for s in SHAPES]
  return [jnp.full((m,), 0.01, jnp.float32) for m in shares]


def update_ms(layout: str, n: int, samples: int) -> list[float]:
  """Per-update ms of ``samples`` samples of 10 back-to-back adamw updates."""
  opt = optax.adamw(1e-4)
  params = leaves_of(layout, n)
  grads = [0.5 * p for p in params]

  @jax.jit
  def step(p, s):
    u, s = opt.update(grads, s, p)
    return optax.apply_updates(p, u), s

  p, s = step(params, opt.init(params))
  jax.block_until_ready(p)
  out = []
  for _ in range(samples):
    t0 = time.perf_counter()
    for _ in range(10):
      p, s = step(p, s)
    jax.block_until_ready(p)
    out.append((time.perf_counter() - t0) * 1e2)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--samples", type=int, default=20)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  kind = jax.devices()[0].device_kind
  dtype = device_type_of_kind(kind) if jax.default_backend() == "gpu" else "cpu"
  cases = [(layout, n) for n in (1, 2, 4, 8) for layout in ("leaves", "one_buffer")]
  times: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
  for c in cases + cases[::-1]:
    times[c] += update_ms(*c, args.samples)
  rows = []
  print(f"adamw update, BERT-base parameters, {kind} (measured) vs the catalog's {dtype} (modeled)")
  print(
    f"{'layout':<11}{'share':>7}{'values':>12}{'measured ms':>13}{'p10-p90':>19}{'modeled ms':>12}{'ratio':>7}"
  )
  for layout, n in cases:
    ts = times[(layout, n)]
    values = sum(x.size for x in leaves_of(layout, n))
    modeled = optimizer_ms(device(dtype), 4 * values)
    med, p10, p90 = (float(np.percentile(ts, q)) for q in (50, 10, 90))
    print(
      f"{layout:<11}{'1/' + str(n):>7}{values:>12,}{med:>13.3f}{f'{p10:.3f}-{p90:.3f}':>19}{modeled:>12.3f}{med / modeled:>7.2f}"
    )
    rows.append(
      result_row(
        "optimizer_tail",
        f"adamw/bert_base/{layout}/share_1of{n}",
        "update_ms",
        med,
        modeled,
        kind,
        p10=p10,
        p90=p90,
        values=values,
        samples=len(ts),
        device_type=dtype,
        baseline_is="modeled_ms",
      )
    )
  save_rows(RESULTS, rows, not args.no_save)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
