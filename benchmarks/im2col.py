"""A quantized convolution's forward + both gradients with the patches sliced (``qconv.im2col``)
against the library's patch extraction (``lax.conv_general_dilated_patches``, a convolution
with a one-hot kernel) and against the native bf16 convolution, in the same run.

  python -m benchmarks.im2col [--repeats 20] [--rounds 3] [--precision int8] [--no-save]

Cases: 3×3 SAME convolutions, NHWC. On a GPU the shapes of ``vgg_wide``'s convolutions (the
predictor's wide VGG, batch 256); on a CPU smaller ones. Each is timed round-robin over
``--rounds`` rounds (median of the round medians; the spread is max − min of the rounds over
the median). Prints a table; appends rows to ``benchmarks/results/im2col.jsonl`` (metric
``fwd_bwd_ms``, baseline: the library patches; ``ratio_to_bf16`` beside).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common.result_rows import result_row, results_path, save_rows
from planners.profiler import timing
from qsync_jax import OpPolicy, quantized_conv_general_dilated
from qsync_jax.ops import qconv

RESULTS = results_path("im2col")

GPU_CASES = {  # (N, H, W, C_in, C_out): vgg_wide's conv1_1, conv2_1, conv3_1 at batch 256
  "conv1_1 256x16x16x128->128": (256, 16, 16, 128, 128),
  "conv2_1 256x8x8x256->256": (256, 8, 8, 256, 256),
  "conv3_1 256x4x4x512->512": (256, 4, 4, 512, 512),
}
CPU_CASES = {
  "32x16x16x32->32": (32, 16, 16, 32, 32),
  "32x8x8x64->64": (32, 8, 8, 64, 64),
  "32x4x4x128->128": (32, 4, 4, 128, 128),
}


def fwd_bwd(policy: OpPolicy):
  """A jitted forward + both gradients of one convolution under ``policy``."""
  dn = ("NHWC", "HWIO", "NHWC")

  def loss(x, w):
    dims = lax.conv_dimension_numbers(x.shape, w.shape, dn)
    key = jax.random.key(1)  # stochastic gradient rounding (all-int8) needs one
    y = quantized_conv_general_dilated(x, w, (1, 1), "SAME", None, None, dims, op_policy=policy, key=key)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.im2col", description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--precision", default="int8", help="the quantized policy preset (int8, fp8, int8_fwd)")
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  platform = jax.devices()[0].platform
  device = jax.devices()[0].device_kind
  clock = "wall" if platform == "cpu" else timing.PIPELINED_CLOCK
  cases = CPU_CASES if platform == "cpu" else GPU_CASES
  quantized, bf16 = OpPolicy.preset(args.precision), OpPolicy.preset("bf16")
  rows = []
  print(f"{args.precision} convolution, forward + both gradients, {device}, {clock} clock")
  print(
    f"{'case':28s} {'library ms':>10s} {'sliced ms':>10s} {'bf16 ms':>9s} {'sliced/library':>15s} {'sliced/bf16':>12s}  spread"
  )
  for name, (n, h, w, c, o) in cases.items():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, h, w, c), jnp.float32)
    k = jax.random.normal(kw, (3, 3, c, o), jnp.float32) / np.sqrt(9 * c)
    sliced = fwd_bwd(quantized)
    real_im2col = qconv.im2col
    qconv.im2col = qconv.library_patches  # the baseline: the code as it was, traced once here
    try:
      library = fwd_bwd(quantized)
      jax.block_until_ready(library(x, k))
    finally:
      qconv.im2col = real_im2col
    runs = {"library": library, "sliced": sliced, "bf16": fwd_bwd(bf16)}
    medians = {key: [] for key in runs}
    for _ in range(args.rounds):
      for key, fn in runs.items():
        medians[key].append(timing.timed_ms(lambda fn=fn, x=x, k=k: fn(x, k), args.repeats, clock=clock)[0])
    ms = {key: float(np.median(m)) for key, m in medians.items()}
    spread = max((max(m) - min(m)) / np.median(m) for m in medians.values())
    print(
      f"{name:28s} {ms['library']:10.3f} {ms['sliced']:10.3f} {ms['bf16']:9.3f} "
      f"{ms['sliced'] / ms['library']:15.3f} {ms['sliced'] / ms['bf16']:12.3f}  {100 * spread:4.1f} %"
    )
    rows.append(
      result_row(
        "im2col",
        f"{args.precision}/{name}",
        f"fwd_bwd_ms_{clock}_clock",
        ms["sliced"],
        ms["library"],
        device,
        ratio_to_bf16=ms["sliced"] / ms["bf16"],
        bf16_ms=ms["bf16"],
        library_ratio_to_bf16=ms["library"] / ms["bf16"],
        rounds={key: m for key, m in medians.items()},
      )
    )
  save_rows(RESULTS, rows, not args.no_save)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
