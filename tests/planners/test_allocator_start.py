"""Allocator start plan: the predicted-fastest of per-op-fastest and the uniform plans."""

import dataclasses

import numpy as np
import pytest

from planners.allocator.greedy import (
  Evaluator,
  fastest_levels,
  greedy,
  make_problem,
  start_assignment,
  uniform_levels,
)
from planners.predictor.collectives import allreduce_ms
from planners.predictor.replay import predict
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from tests.planners.fakes import fake_indicator, fake_profile

OPS = ("Dense_0:dense", "Dense_1:dense")
SEED = 7


def _profile(device_type, op_ms):
  return dataclasses.replace(
    fake_profile([(1.0, 1.0, 1.0)] * len(op_ms), device_type=device_type), op_ms=op_ms
  )


def _legs(fwd, dlhs, drhs):
  return {"fwd": fwd, "dlhs": dlhs, "drhs": drhs}


def _problem(jitter, link_gbps=0.0064, n_infer=1):
  """1 fp32 training device + ``n_infer`` T4 inference groups of 1 device. On the default slow link each op's
  gradient is one all-reduce bucket of ~5 ms, so the step is ``(the later group's first
  bucket) + 2 buckets``.

  On the T4, op 0 (last in the backward) is fastest at fp16 (slow forward, fast drhs as a whole
  fp16 op) and op 1 at int8. Per-op-fastest therefore has the longer forward, readies the first
  bucket later than the training group and straggles; uniform int8 readies it earlier and keeps
  pace (``jitter`` moves every time by a few percent without changing that)."""
  j = iter(jitter)
  train = _profile(
    "A100",
    {
      OPS[0]: _legs({"fp32": 1.0 * next(j)}, {"fp32": 1.0}, {"fp32": 1.0 * next(j)}),
      OPS[1]: _legs({"fp32": 0.75 * next(j)}, {"fp32": 0.75 * next(j)}, {"fp32": 0.75 * next(j)}),
    },
  )
  int8_fwd, fp16_fwd = 0.5 * next(j), 1.0 * next(j)
  drhs_fp16, drhs_fp16_policy = 3.0 * next(j), 1.0 * next(j)
  infer = _profile(
    "T4",
    {
      OPS[0]: {
        **_legs(
          {"int8": int8_fwd, "fp16": fp16_fwd, "fp32": 2.0},
          {"int8": 0.3, "fp16": 1.0, "fp32": 2.0},
          {"int8": 0.9, "fp16": drhs_fp16, "fp32": 4.0},
        ),
        # the whole fp16 op: its drhs (the first op has no dlhs) far faster than the fp16 leg
        # alone, whose operand it converts; the backward splits 1 : drhs_fp16 over dlhs, drhs
        "policy:fp16": {"fwd": fp16_fwd, "bwd": drhs_fp16_policy * (1.0 + drhs_fp16) / drhs_fp16},
      },
      OPS[1]: _legs(
        {"int8": int8_fwd, "fp16": fp16_fwd, "fp32": 2.0},
        {"int8": 0.3, "fp16": 1.0 * next(j), "fp32": 2.0},
        {"int8": 0.3, "fp16": 1.0 * next(j), "fp32": 2.0},
      ),
    },
  )
  cluster = ClusterSpec(
    (
      DeviceGroup("train", "A100", 1, 1.0, 8, link_gbps),
      *(DeviceGroup(f"infer{k}", "T4", 1, 1.0, 8, link_gbps) for k in range(n_infer)),
    )
  )
  profiles = {"A100": train, "T4": infer}
  indicator = fake_indicator(OPS, np.random.default_rng(SEED).exponential(size=2).tolist())
  return cluster, profiles, make_problem(cluster, profiles, indicator, ["train"], bucket_bytes=4000)


@pytest.mark.parametrize("n_infer", [1, 2])
def test_start_is_the_faster_as_a_whole_when_gradients_leave_the_switch_together(n_infer):
  # beside inference groups of other policies the step is a switch over branches: no bucket leaves
  # it before its group's whole backward, so on the slow link both ~5 ms buckets follow the later
  # group's backward (the first-bucket readiness that favours uniform int8 with overlap is gone)
  jitter = np.random.default_rng(SEED).uniform(0.97, 1.03, size=12)
  cluster, profiles, problem = _problem(jitter, n_infer=n_infer)
  ev = Evaluator(problem)
  assert fastest_levels(problem) == ((1, 0),) * n_infer
  legs = profiles["A100"].op_ms
  backward = sum(legs[o]["fwd"]["fp32"] + legs[o]["drhs"]["fp32"] for o in OPS) + legs[OPS[1]]["dlhs"]["fp32"]
  train_only = backward + 2 * allreduce_ms(4000, 1 + n_infer, 0.0064)
  assert ev.training_step_ms() == pytest.approx(train_only)
  candidates = (fastest_levels(problem), ((0, 0),) * n_infer)
  assert start_assignment(problem, ev) == min(candidates, key=ev.step_ms)

  alloc = greedy(problem)
  assert alloc.target_ms >= train_only * (1 - 1e-9)  # T* is the training groups' step, never less
  pred = predict(cluster, profiles, alloc.plan, bucket_bytes=4000)
  assert pred.fits
  assert pred.step_ms == pytest.approx(alloc.step_ms)


def test_start_keeps_per_op_fastest_when_it_is_fastest():
  # on a fast link the step is the T4's compute: per-op-fastest (fp16, int8) has the least sum
  jitter = np.random.default_rng(SEED).uniform(0.97, 1.03, size=12)
  _, _, problem = _problem(jitter, link_gbps=1e4)
  ev = Evaluator(problem)
  fastest = fastest_levels(problem)
  assert fastest == ((1, 0),)
  assert start_assignment(problem, ev) == fastest
  for p in ("int8", "fp16", "fp32"):
    assert ev.step_ms((uniform_levels(problem, 0, p),)) > ev.step_ms(fastest)
  assert ev.step_ms(fastest) > ev.training_step_ms()  # the T4 straggles: T* becomes its step
  alloc = greedy(problem)
  assert alloc.straggles and alloc.target_ms == pytest.approx(ev.step_ms(fastest))


def test_uniform_levels_use_the_nearest_level_above():
  cluster, profiles, _ = _problem(np.ones(12))
  # op 0 is scored only at int8 and fp32: its ladder has no 16-bit level
  indicator = {"omega": {OPS[0]: {"int8": 1.0, "fp32": 0.0}, OPS[1]: {"int8": 2.0, "fp16": 0.1, "fp32": 0.0}}}
  problem = make_problem(cluster, profiles, indicator, ["train"], bucket_bytes=4000)
  assert [[p for p, _ in lad] for lad in problem.ladders[0]] == [["int8", "fp32"], ["int8", "fp16", "fp32"]]
  assert uniform_levels(problem, 0, "int8") == (0, 0)
  assert uniform_levels(problem, 0, "fp16") == (1, 1)  # op 0: fp32, its nearest level above
  assert uniform_levels(problem, 0, "bf16") == (1, 1)  # not on a T4 ladder: the 16-bit level
  assert uniform_levels(problem, 0, "fp32") == (1, 2)
