"""A group's branch inside the hybrid step's ``lax.switch`` against its policy alone, on one device.

The hybrid step runs every device's group policy as one branch of a ``lax.switch``
(``qsync_jax.train.branch.device_switch``). This script checks that a device pays for its own
branch only: for each policy of a mixed plan (bf16, int8 on every Dense, fp8 where the device has
it), it times on one device

* ``alone``: the gradient of the model's loss under that policy, in ``shard_map`` over one device;
* ``switched``: the same gradient as the chosen branch of a ``device_switch`` over all the plan's
  policies (the device's constant index picks it, as in the hybrid step),

and prints the ratio ``switched / alone`` (1.00: the switch costs nothing). Timing: after a
compiling warm-up, rounds of ``--steps`` blocked calls of each program in turn (round robin);
medians over rounds. Rows go to ``benchmarks/results/branch_cost.jsonl``.

  python -m benchmarks.branch_cost                 # GPT d 768 x 2 blocks, seq 512, batch 8
  python -m benchmarks.branch_cost --tiny --rounds 3 --steps 2   # the code path, on a CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from benchmarks.common.result_rows import result_row, results_path, save_rows
from benchmarks.common.zoo import gpt
from qsync_jax.devices import device_type_of, supported_precisions
from qsync_jax.ops.vma import shard_map
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.sync.common import AXIS
from qsync_jax.train.branch import device_switch
from qsync_jax.train.task_step import task_loss
from qsync_jax.train.train_step import init_variables

RESULTS = results_path("branch_cost")


def dense_policy(preset: str) -> PrecisionPolicy:
  """``preset`` on every Dense and DenseGeneral, bf16 elsewhere."""
  return PrecisionPolicy.from_json(
    {
      "rules": [{"path": ".*", "kind": kind, "policy": preset} for kind in ("dense", "dense_general")],
      "__default__": "bf16",
    }
  )


def policies(device_type: str) -> dict[str, PrecisionPolicy]:
  """The mixed plan's policies the device runs: bf16, int8 Dense, and fp8 Dense where it has fp8."""
  out = {"bf16": PrecisionPolicy.uniform("bf16"), "int8_dense": dense_policy("int8")}
  if "fp8" in supported_precisions(device_type):
    out["fp8_dense"] = dense_policy("fp8")
  return out


def grad_fns(task, named: dict[str, PrecisionPolicy]):
  """``{name: grads(params, batch, key)}``: the gradient of the task's loss under each policy."""
  return {name: jax.grad(task_loss(task, policy, params_only=True)) for name, policy in named.items()}


def programs(fns: dict, mesh: Mesh) -> dict[str, object]:
  """Per policy: ``alone`` and ``switched`` (the policy as the chosen branch of a switch over all)."""
  names = list(fns)
  out = {}
  for i, name in enumerate(names):
    for label, body in (
      ("alone", fns[name]),
      ("switched", device_switch([fns[n] for n in names], (i,))),
    ):
      mapped = shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
      out[(name, label)] = jax.jit(mapped)
  return out


def time_round_robin(runs: dict, steps: int, rounds: int) -> dict:
  """``{key: [ms per call, one per round]}``, each round running every program ``steps`` times in turn."""
  for run in runs.values():
    run()  # compile and warm up
  ms = {k: [] for k in runs}
  for _ in range(rounds):
    for k, run in runs.items():
      t0 = time.perf_counter()
      for _ in range(steps):
        run()
      ms[k].append((time.perf_counter() - t0) * 1e3 / steps)
  return ms


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--width", type=int, default=768)
  ap.add_argument("--depth", type=int, default=2)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=10, help="calls per round")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--tiny", action="store_true", help="a tiny GPT (the code path, on a CPU)")
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  if args.tiny:
    args.width, args.depth, args.seq, args.batch = 32, 1, 16, 2
  device = jax.devices()[0]
  task = gpt(args.width, args.depth, max(1, args.width // 64), args.seq, vocab=1024, dtype=jax.numpy.bfloat16)
  batch = jax.tree.map(np.asarray, next(iter(task.train_batches(args.batch, 0))))
  params = init_variables(task, 0, batch)[0]["params"]
  key = jax.random.key(1)
  mesh = Mesh(np.asarray([device]), (AXIS,))
  named = policies(device_type_of(device))
  progs = programs(grad_fns(task, named), mesh)
  runs = {k: (lambda f=f: jax.block_until_ready(f(params, batch, key))) for k, f in progs.items()}
  ms = time_round_robin(runs, args.steps, args.rounds)
  setup = f"GPT d {args.width} x {args.depth}, seq {args.seq}, batch {args.batch}; {len(named)}-branch switch"
  print(f"\n{device.device_kind}: {setup} (median ms over {args.rounds} rounds of {args.steps} calls)")
  print("| policy | alone ms | switched ms | switched / alone |\n|---|---|---|---|")
  rows = []
  for name in named:
    alone, switched = statistics.median(ms[(name, "alone")]), statistics.median(ms[(name, "switched")])
    ratio = statistics.median(s / a for s, a in zip(ms[(name, "switched")], ms[(name, "alone")]))
    print(f"| {name} | {alone:.3f} | {switched:.3f} | {ratio:.3f} |")
    rows.append(
      result_row(
        "branch_cost",
        f"{name}/switched_vs_alone",
        "ms",
        switched,
        baseline=alone,
        device=device.device_kind,
        ratio=ratio,
        setup=setup,
        alone_ms=ms[(name, "alone")],
        switched_ms=ms[(name, "switched")],
      )
    )
  if not args.no_save:
    save_rows(RESULTS, rows)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
