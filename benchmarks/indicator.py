"""How well each sensitivity indicator ranks ops by the loss change of quantizing them.

For each example task (``vgg``: a CNN with BatchNorm; ``lm``: a transformer LM with stock
``nn.MultiHeadDotProductAttention``): train briefly in fp32, compute every indicator's
Ω[op][int8] on ``--batches`` training batches, then measure the ground truth: for each op
alone quantized to int8 *in the forward product only* (``OpPolicy(fwd="int8", dlhs="fp32", drhs="fp32")``: per-channel
absmax scales, nearest rounding, backward legs fp32) through ``qsync_jax.quantize`` with a
one-op policy, the training-mode loss change over the fp32 model on each of
``--truth-batches`` *other* batches of ``--truth-batch-size``. Two truths:

* ``mean``: the mean loss increase (signed; what the issue asks for);
* ``mean_abs``: the mean magnitude of the per-batch loss change.

Reports the Spearman ρ of each indicator with each truth; the ratio column's baseline is
QSync's GVAR measured in the same run (a ratio against a negative ρ is negative). Ours
(``gradient``) is the ``moments`` estimator judged at the truth's batch size (``gradient.py``:
E[ΔL_B²] with B = ``--truth-batch-size``, the batch on which the truth measures the change).
Variants of ours: ``gradient_moments`` (the same at the probed batches' own size, 32: how
much the choice of B matters), ``gradient_sample`` (per-sample mean square E[s²], the earlier
default), ``gradient_batch`` (⟨∂L/∂Y, δY⟩² of each probed batch) and ``gradient_signed`` (a
signed prediction of the mean loss change: first + ½ second order; it ranks the ``mean``
truth, not a sensitivity).

The ``truth_ceiling`` row is the ρ between the truths of the two halves of the truth batches
(each half measured independently): how well the truth ranks itself. An indicator cannot be
expected to beat it by more than noise; the full truth (both halves) is less noisy than
either half.

  python -m benchmarks.indicator [--tasks vgg lm] [--steps 100] [--batches 32] [--verbose]
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import numpy as np
from scipy.stats import spearmanr

from benchmarks.common import zoo
from benchmarks.common.result_rows import append_rows, results_path
from examples.train_loop import LoopConfig, train_and_evaluate
from planners.indicator.gradient import gradient_omega
from planners.indicator.gvar import gvar_omega
from planners.indicator.hessian import hessian_omega, hutchinson_traces
from planners.indicator.probes import collect, mean_over_batches, op_order
from planners.indicator.random_ind import random_omega
from planners.indicator.wvar import wvar_omega
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from qsync_jax.train.task import get_task
from qsync_jax.train.task_step import task_loss

RESULTS = results_path("indicator")
TRUTH_POLICY = OpPolicy(fwd="int8", dlhs="fp32", drhs="fp32")
METHODS = ("gradient", "gvar", "wvar", "hessian", "random")
VARIANTS = ("gradient_moments", "gradient_sample", "gradient_batch", "gradient_signed")
OMEGA_FNS = {"gvar": gvar_omega, "wvar": wvar_omega, "random": random_omega}


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def loss_fn(task, policy):
  """jit (variables, batch, key) → training-mode loss, all ops under ``policy`` (None: plain)."""
  loss = task_loss(task, policy)
  return jax.jit(lambda variables, batch, key: loss(variables, batch, key)[0])


def ground_truth(task, variables, ops, batches, seed):
  """{op: mean over batches of loss(op alone int8 fwd) − loss(fp32)}."""
  keys = [jax.random.fold_in(jax.random.key(seed), i) for i in range(len(batches))]
  base_fn = loss_fn(task, None)
  base = np.array([float(base_fn(variables, b, k)) for b, k in zip(batches, keys)])
  deltas = {}
  for op in ops:
    fn = loss_fn(task, PrecisionPolicy.from_ops({op: TRUTH_POLICY}))
    deltas[op] = np.array([float(fn(variables, b, k)) for b, k in zip(batches, keys)]) - base
  return deltas, float(base.mean())


def summaries(deltas, part):
  """The two truths (``mean``, ``mean_abs``) of the per-batch loss changes ``deltas[op][part]``."""
  return {
    "mean": {op: float(np.mean(d[part])) for op, d in deltas.items()},
    "mean_abs": {op: float(np.mean(np.abs(d[part]))) for op, d in deltas.items()},
  }


def spearman(a, b, ops):
  return float(spearmanr([a[op] for op in ops], [b[op] for op in ops]).statistic)


def run_task(name, args):
  task = zoo.task("gpt_25m") if name == "gpt" else get_task(name)
  t0 = time.perf_counter()
  trained = train_and_evaluate(
    task, LoopConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed), log=None
  )
  variables = {"params": trained["variables"]["params"], **trained["variables"]["state"]}
  train_s = time.perf_counter() - t0
  stream = task.train_batches(args.batch_size, args.seed + 1000)
  ind_batches = take(stream, args.batches)
  truth_batches = take(task.train_batches(args.truth_batch_size, args.seed + 2000), args.truth_batches)
  timings, omega = {}, {}
  t = time.perf_counter()
  calls, per_batch = collect(task, variables, ind_batches, ("int8",), seed=args.seed)
  probe_s = time.perf_counter() - t
  for method in METHODS + VARIANTS:
    t = time.perf_counter()
    if method == "hessian":
      traces = hutchinson_traces(task, variables, ind_batches, calls, args.hutchinson_samples, args.seed)
      table = hessian_omega(calls, traces, mean_over_batches(per_batch), ("int8",))
    elif method == "gradient":
      table = gradient_omega(calls, per_batch, ("int8",), "moments", args.truth_batch_size)
    elif method.startswith("gradient_"):
      table = gradient_omega(calls, per_batch, ("int8",), estimator=method.split("_")[1])
    else:
      table = OMEGA_FNS[method](calls, per_batch, ("int8",))
    omega[method] = {op: v["int8"] for op, v in table.items()}
    timings[method] = probe_s + time.perf_counter() - t
  ops = op_order(calls)
  t = time.perf_counter()
  deltas, base_loss = ground_truth(task, variables, ops, truth_batches, args.seed)
  truth_s = time.perf_counter() - t
  half = len(truth_batches) // 2
  truths = summaries(deltas, slice(None))
  halves = summaries(deltas, slice(half)), summaries(deltas, slice(half, None))
  rho = {kind: {m: spearman(omega[m], truth, ops) for m in omega} for kind, truth in truths.items()}
  for kind in truths:
    rho[kind]["truth_ceiling"] = spearman(halves[0][kind], halves[1][kind], ops)
  timings["truth_ceiling"] = truth_s
  return {
    "task": name,
    "ops": ops,
    "truth": truths["mean"],
    "truth_abs": truths["mean_abs"],
    "truth_std": {op: float(np.std(d) / np.sqrt(len(d))) for op, d in deltas.items()},
    "base_loss": base_loss,
    "final_train_loss": trained["train"]["loss"],
    "rho": rho,
    "seconds": timings,
    "train_s": train_s,
    "truth_s": truth_s,
    "omega": omega,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.indicator",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--tasks",
    nargs="+",
    default=["vgg", "lm"],
    help="vgg, lm, or gpt (benchmarks.accuracy_gpu's 25 M-parameter LM, zoo's gpt_25m)",
  )
  parser.add_argument("--steps", type=int, default=100, help="fp32 training steps before probing")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--batches", type=int, default=32, help="batches the indicators average over")
  parser.add_argument(
    "--hutchinson-samples", type=int, default=1, help="Hessian-vector products per batch (hessian)"
  )
  parser.add_argument(
    "--truth-batches", type=int, default=32, help="other batches for the ground truth (two halves: ceiling)"
  )
  parser.add_argument(
    "--truth-batch-size",
    type=int,
    default=128,
    help="their size (large: less first-order noise in the truth)",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results")
  parser.add_argument("--verbose", action="store_true", help="print per-op values")
  args = parser.parse_args(argv)
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  device = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"
  rows = []
  print(f"indicator benchmark: Spearman rho with the int8-fwd loss change ({device}, jax {jax.__version__})")
  print("  truth 'mean' = mean over batches of the loss increase; 'mean_abs' = mean of its magnitude")
  print(
    f"{'task':6} {'ops':>4} {'method':15} {'rho mean':>9} {'vs gvar':>8} {'rho |.|':>8} {'vs gvar':>8} {'sec':>6}"
  )
  for name in args.tasks:
    res = run_task(name, args)
    if args.verbose:
      for op in res["ops"]:
        vals = "  ".join(f"{m}={res['omega'][m][op]:.3g}" for m in res["omega"])
        print(
          f"  {op:48s} truth={res['truth'][op]:+.2e}±{res['truth_std'][op]:.1e} "
          f"|truth|={res['truth_abs'][op]:.2e}  {vals}"
        )
    for method in [*res["omega"], "truth_ceiling"]:
      cells = []
      for kind in ("mean", "mean_abs"):
        r, base = res["rho"][kind][method], res["rho"][kind]["gvar"]
        ratio = r / base if base else float("nan")
        cells.append(f"{r:9.3f} {ratio:8.2f}")
        rows.append(
          {
            "benchmark": "indicator",
            "case": f"{name}/{method}",
            "device": device,
            "jax_version": jax.__version__,
            "date": date,
            "metric": f"spearman_rho_int8_fwd_{kind}",
            "value": r,
            "baseline": base,
            "ratio": ratio,
            "ops": len(res["ops"]),
            "seconds": res["seconds"][method],
            "steps": args.steps,
            "seed": args.seed,
            "batches": args.batches,
            "hutchinson_samples": args.hutchinson_samples,
            "truth_batches": args.truth_batches,
            "truth_batch_size": args.truth_batch_size,
          }
        )
      print(f"{name:6} {len(res['ops']):4d} {method:15} {cells[0]} {cells[1]} {res['seconds'][method]:6.1f}")
    print(
      f"{name:6} fp32 loss {res['base_loss']:.3f} after {args.steps} steps ({res['train_s']:.0f} s); "
      f"ground truth {res['truth_s']:.0f} s"
    )
  if not args.no_save:
    append_rows(RESULTS, rows)
  return rows


if __name__ == "__main__":
  main()
