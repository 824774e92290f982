"""Gradient numerics of the 8-bit Dense op: how far its dX and dW sit from float32, per scheme.

  python -m benchmarks.grad_numerics [--shape 256 512 128] [--keys 2000] [--chunk 50] [--no-save]

Y = X·W with X: M×K, W: K×N and an upstream gradient dY (seeded normal draws; W scaled by
1/√K), under the all-int8 op policy (stochastic gradient rounding) and fp8 with stochastic
gradient rounding, per-channel scales. Schemes, each on the same forward (X and W rounded
to nearest, per row of X and per column of W):

* ``folded``: the op as it runs (``qsync_jax.quantized_dot_general``): the gradient legs reuse
  the saved 8-bit values and fold their scales into dY before it is quantized.
* ``requantized``: the saved operands dequantized and quantized again along the gradient
  leg's contraction (nearest), then the product (``qdot.leg_dot`` on the dequantized values):
  the scheme the op ran before the folded one.
* ``saturating`` (int8 only): the folded scheme with a gradient quantizer written here after
  Qwix's integer one (scale ``max|v| / 127.5``, ``round(v/scale + u - 1/2)`` with
  ``u ~ U[0, 1)``, clipped at ±127): values in the top half-step saturate, a bias.
* ``forward_only``: ``dY·Ŵᵀ`` and ``X̂ᵀ·dY`` in float32 from the dequantized forward operands,
  the expectation of an unbiased gradient rounding: the floor no scheme on this forward gets
  below.

Metrics (relative Frobenius distances, over the norm of the float32 gradient): ``mean_err``
of the mean over ``--keys`` PRNG keys from the float32 gradient, ``single_err`` of one key
(mean over the keys, with its standard deviation), and ``mean_bias`` of the mean from the
``forward_only`` gradient (what the gradient legs add to the forward's error: for an
unbiased rounding only its noise over √keys). Prints a table; appends rows to
``benchmarks/results/grad_numerics.jsonl`` (metric ``dW_mean_err`` etc.; baseline: the
``requantized`` scheme's value).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common.result_rows import result_row, results_path, save_rows
from pallas_kernels.quantize import dequantize, quantize
from qsync_jax import OpPolicy, quantized_dot_general
from qsync_jax.ops.qdot import Operand, dlhs_dims, drhs_dims, leg_dot, qformat

RESULTS = results_path("grad_numerics")
DIMS = (((1,), (0,)), ((), ()))
POLICIES = {
  "int8": OpPolicy.preset("int8"),
  "fp8": OpPolicy.uniform("fp8", grad_rounding="stochastic"),
}


def hi(a, b):
  return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def forward_operands(x, w, policy):
  """The forward's saved operands ``(qx, sx), (qw, sw)``: X per row, W per column, nearest."""
  fmt = qformat(policy.fwd, False)
  return quantize(x, fmt, (1,)), quantize(w, fmt, (0,))


def folded(x, w, g, policy, key):
  _, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, DIMS, policy, key), x, w)
  return vjp(g)


def requantized(x, w, g, policy, key):
  (xs, ws) = forward_operands(x, w, policy)
  xr, wr = dequantize(*xs), dequantize(*ws)
  value, grad = Operand(policy.rounding, False), Operand(policy.grad_rounding, True)
  k = jax.random.split(key, 4)
  p, gran = policy.dlhs, policy.granularity
  g_dims, _ = dlhs_dims(2, 2, DIMS)
  dx = leg_dot(p, gran, g, wr, g_dims, grad, value, k[0], k[1])
  g_dims, _ = drhs_dims(2, 2, DIMS)
  dw = leg_dot(p, gran, xr, g, g_dims, value, grad, k[2], k[3])
  return dx, dw


def saturating_int8(v, axis, key):
  """Qwix-style stochastic int8 rounding (see the module docstring): ``(codes, scale)``."""
  amax = jnp.max(jnp.abs(v), axis=axis, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.5, 1.0)
  y = v / scale + jax.random.uniform(key, v.shape) - 0.5
  return jnp.clip(jnp.round(y), -127.0, 127.0), scale


def saturating(x, w, g, policy, key):
  (qx, sx), (qw, sw) = forward_operands(x, w, policy)
  k1, k2 = jax.random.split(key)
  qg, sg = saturating_int8(g * sw, 1, k1)  # dX = Q(dY ⊙ s_w) · q_wᵀ, per row of dY
  dx = hi(qg, qw.astype(jnp.float32).T) * sg
  qg, sg = saturating_int8(sx * g, 0, k2)  # dW = q_xᵀ · Q(s_x ⊙ dY), per column of dY
  dw = hi(qx.astype(jnp.float32).T, qg) * sg
  return dx, dw


SCHEMES = {"folded": folded, "requantized": requantized, "saturating": saturating}


def rel(a, b):
  """Relative Frobenius distance of ``a`` from ``b`` over the trailing two axes."""
  return jnp.linalg.norm(a - b, axis=(-2, -1)) / jnp.linalg.norm(b)


def forward_only(x, w, g, policy):
  """(dX, dW) from the dequantized forward operands, in float32."""
  (xs, ws) = forward_operands(x, w, policy)
  return hi(g, dequantize(*ws).T), hi(dequantize(*xs).T, g)


def scheme_errors(fn, x, w, g, policy, keys, chunk):
  """``{metric: value}`` of one scheme over ``keys`` (see the module docstring)."""
  exact_dx, exact_dw = hi(g, w.T), hi(x.T, g)
  fwd_dx, fwd_dw = forward_only(x, w, g, policy)

  @jax.jit
  def one_chunk(x, w, g, ks):  # operands as arguments: XLA would constant-fold closed-over ones
    dx, dw = jax.vmap(lambda k: fn(x, w, g, policy, k))(ks)
    return dx.sum(0), dw.sum(0), rel(dx, exact_dx), rel(dw, exact_dw)

  sum_dx, sum_dw, single_dx, single_dw = 0.0, 0.0, [], []
  for i in range(0, len(keys), chunk):
    sdx, sdw, ex, ew = one_chunk(x, w, g, keys[i : i + chunk])
    sum_dx, sum_dw = sum_dx + sdx, sum_dw + sdw
    single_dx.append(np.asarray(ex))
    single_dw.append(np.asarray(ew))
  n = len(keys)
  single_dx, single_dw = np.concatenate(single_dx), np.concatenate(single_dw)
  return {
    "dX_mean_err": float(rel(sum_dx / n, exact_dx)),
    "dW_mean_err": float(rel(sum_dw / n, exact_dw)),
    "dX_mean_bias": float(jnp.linalg.norm(sum_dx / n - fwd_dx) / jnp.linalg.norm(exact_dx)),
    "dW_mean_bias": float(jnp.linalg.norm(sum_dw / n - fwd_dw) / jnp.linalg.norm(exact_dw)),
    "dX_single_err": float(single_dx.mean()),
    "dX_single_err_std": float(single_dx.std()),
    "dW_single_err": float(single_dw.mean()),
    "dW_single_err_std": float(single_dw.std()),
  }


def forward_only_errors(x, w, g, policy):
  dx, dw = forward_only(x, w, g, policy)
  ex, ew = float(rel(dx, hi(g, w.T))), float(rel(dw, hi(x.T, g)))
  return {
    "dX_mean_err": ex,
    "dW_mean_err": ew,
    "dX_single_err": ex,
    "dW_single_err": ew,
    "dX_mean_bias": 0.0,
    "dW_mean_bias": 0.0,
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.grad_numerics", description=__doc__.splitlines()[0])
  ap.add_argument("--shape", type=int, nargs=3, default=(256, 512, 128), metavar=("M", "K", "N"))
  ap.add_argument("--keys", type=int, default=2000)
  ap.add_argument("--chunk", type=int, default=50, help="keys per vmapped program")
  ap.add_argument("--formats", nargs="+", default=sorted(POLICIES), choices=sorted(POLICIES))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--results", default=RESULTS, help="JSON lines file the rows are appended to")
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)

  m, k, n = args.shape
  kx, kw, kg = jax.random.split(jax.random.key(args.seed), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  g = jax.random.normal(kg, (m, n), jnp.float32)
  keys = jax.random.split(jax.random.key(args.seed + 1), args.keys)
  device = f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}"
  case = f"dense {m}x{k}x{n}"

  rows = []
  header = (
    f"{'format':6} {'scheme':12} {'dW mean':>9} {'dW bias':>9} {'dW 1 key':15} "
    f"{'dX mean':>9} {'dX bias':>9} {'dX 1 key':15} {'s':>5}"
  )
  print(f"{case}, {args.keys} keys, {device}\n{header}")
  for fmt in args.formats:
    policy = POLICIES[fmt]
    results = {}
    for name, fn in SCHEMES.items():
      if name == "saturating" and fmt != "int8":
        continue
      t0 = time.perf_counter()
      results[name] = scheme_errors(fn, x, w, g, policy, keys, args.chunk)
      results[name]["seconds"] = time.perf_counter() - t0
    results["forward_only"] = forward_only_errors(x, w, g, policy)
    base = results["requantized"]
    for name, r in results.items():

      def single(leg, r=r):
        std = r.get(f"{leg}_single_err_std")
        return f"{r[f'{leg}_single_err']:9.3e}" + ("" if std is None else f"±{std:.0e}").ljust(6)

      print(
        f"{fmt:6} {name:12} {r['dW_mean_err']:9.3e} {r['dW_mean_bias']:9.3e} {single('dW')} "
        f"{r['dX_mean_err']:9.3e} {r['dX_mean_bias']:9.3e} {single('dX')} {r.get('seconds', 0):5.0f}"
      )
      for metric in (
        "dW_mean_err",
        "dX_mean_err",
        "dW_mean_bias",
        "dX_mean_bias",
        "dW_single_err",
        "dX_single_err",
      ):
        extra = {f"{metric}_std": r[f"{metric}_std"]} if f"{metric}_std" in r else {}
        rows.append(
          result_row(
            "grad_numerics",
            f"{case} {fmt}",
            metric,
            r[metric],
            base[metric],
            device,
            scheme=name,
            keys=args.keys,
            policy=policy.to_json(),
            seed=args.seed,
            **extra,
          )
        )
  save_rows(args.results, rows, not args.no_save)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
