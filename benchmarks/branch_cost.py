"""A group's branch inside the hybrid step's ``lax.switch`` against its policy alone, on one device.

The hybrid step runs every device's group policy as one branch of a ``lax.switch``
(``qsync_jax.train.branch.device_switch``). This script checks that a device pays for its own
branch only: for each policy of a mixed plan (bf16, int8 on every Dense, fp8 where the device has
it), it times on one device

* ``alone``: the gradient of the model's loss under that policy, in ``shard_map`` over one device;
* ``switched``: the same gradient as the chosen branch of a ``lax.switch`` over all the plan's
  policies, the branch index an argument of the program: in the hybrid step it is read from a
  table at the device's partition id, a value the compiler does not know. (``device_switch`` on
  a one-device mesh would let XLA fold the switch into its one reachable branch: the program
  alone again.) One program serves every policy.

and prints the ratio ``switched / alone`` (1.00: the switch costs nothing), each policy's row as
soon as it is measured. Timing: after compiling the four programs (in parallel threads; a line
each), per policy rounds of ``--steps`` blocked calls of ``alone`` and ``switched`` in turn;
medians over rounds. Progress lines carry the seconds since the start and the compilations so
far. Rows go to ``benchmarks/results/branch_cost.jsonl``, each as it is measured.

Compile time is most of a run on a GPU: every 8-bit leg of every Dense is a Pallas kernel
compiled with its program, and the switched program holds every policy's. The parameters are
initialized by one compiled program (not op by op).

  python -m benchmarks.branch_cost                          # GPT d 256 x 2, seq 256, batch 8
  python -m benchmarks.branch_cost --quick                  # fewer rounds and calls
  python -m benchmarks.branch_cost --width 768 --seq 512    # a larger model
  python -m benchmarks.branch_cost --tiny --rounds 3 --steps 2   # the code path, on a CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from benchmarks.common.progress import Progress
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.common.zoo import gpt
from qsync_jax.devices import device_type_of, supported_precisions
from qsync_jax.ops.vma import shard_map
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.sync.common import AXIS
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
  """``{(policy, "alone"): f(params, batch, key)}`` per policy and ``{"switched": f(index,
  params, batch, key)}``: ``lax.switch(index, [every policy's fn], ...)``."""
  out = {}
  for name, fn in fns.items():
    out[(name, "alone")] = jax.jit(
      shard_map(fn, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
    )
  branches = list(fns.values())
  switched = lambda index, *args: lax.switch(index, branches, *args)  # noqa: E731
  out["switched"] = jax.jit(
    shard_map(switched, mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=P(), check_vma=False)
  )
  return out


def time_pair(runs: dict, steps: int, rounds: int) -> dict:
  """``{key: [ms per call, one per round]}``, each round running every program of ``runs``
  ``steps`` times in turn (round robin)."""
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
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--depth", type=int, default=2)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=10, help="calls per round")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--quick", action="store_true", help="3 rounds of 5 calls")
  ap.add_argument("--tiny", action="store_true", help="a tiny GPT (the code path, on a CPU)")
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  if args.tiny:
    args.width, args.depth, args.seq, args.batch = 32, 1, 16, 2
  if args.quick:
    args.rounds, args.steps = 3, 5
  progress = Progress()
  device = jax.devices()[0]
  task = gpt(args.width, args.depth, max(1, args.width // 64), args.seq, vocab=1024, dtype=jax.numpy.bfloat16)
  batch = jax.tree.map(np.asarray, next(iter(task.train_batches(args.batch, 0))))
  params = jax.jit(lambda b: init_variables(task, 0, b)[0]["params"])(batch)  # one program, not op by op
  key = jax.random.key(1)
  mesh = Mesh(np.asarray([device]), (AXIS,))
  named = policies(device_type_of(device))
  setup = f"GPT d {args.width} x {args.depth}, seq {args.seq}, batch {args.batch}; {len(named)}-branch switch"
  progress.say(f"{device.device_kind}: {setup}; parameters initialized")
  progs = programs(grad_fns(task, named), mesh)
  lowered = {}
  for k, f in progs.items():
    operands = (np.int32(0), params, batch, key) if k == "switched" else (params, batch, key)
    lowered[k] = f.lower(*operands)
    progress.say(f"traced and lowered {k}")
  compiled = {}
  with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:  # XLA compiles outside the GIL
    futures = {pool.submit(low.compile): k for k, low in lowered.items()}
    for future in concurrent.futures.as_completed(futures):
      compiled[futures[future]] = future.result()
      progress.say(f"compiled {futures[future]}")
  indices = {name: jax.device_put(np.int32(i)) for i, name in enumerate(named)}
  print(f"median ms over {args.rounds} rounds of {args.steps} calls", flush=True)
  print("| policy | alone ms | switched ms | switched / alone |\n|---|---|---|---|", flush=True)
  for name in named:
    alone, switched, index = compiled[(name, "alone")], compiled["switched"], indices[name]
    runs = {
      "alone": lambda f=alone: jax.block_until_ready(f(params, batch, key)),
      "switched": lambda f=switched, i=index: jax.block_until_ready(f(i, params, batch, key)),
    }
    for run in runs.values():
      run()  # warm-up
    ms = time_pair(runs, args.steps, args.rounds)
    alone_ms, switched_ms = statistics.median(ms["alone"]), statistics.median(ms["switched"])
    ratio = statistics.median(s / a for s, a in zip(ms["switched"], ms["alone"]))
    print(f"| {name} | {alone_ms:.3f} | {switched_ms:.3f} | {ratio:.3f} |", flush=True)
    row = result_row(
      "branch_cost",
      f"{name}/switched_vs_alone",
      "ms",
      switched_ms,
      baseline=alone_ms,
      device=device.device_kind,
      ratio=ratio,
      setup=setup,
      alone_ms=ms["alone"],
      switched_ms=ms["switched"],
    )
    if not args.no_save:  # row by row: a run cut short keeps what it measured
      append_rows(RESULTS, [row])
  count, seconds = progress.compiles()
  progress.say(
    f"done: {count} compilations took {seconds:.1f} s" + ("" if args.no_save else f"; rows in {RESULTS}")
  )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
