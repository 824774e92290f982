"""``benchmarks.trainer`` reads the rate, TFLOP/s and MFU from the line the ``Trainer`` prints
(``qsync_jax.train.progress.progress_line``), with the H200's peak from the device table."""

import types

import pytest

from benchmarks.trainer import LineStream, first_rated_line, mlp_step_flops
from qsync_jax.train.progress import jaxpr_flops, peak_tflops, progress_line, rates


def test_the_printed_rate_tflops_and_mfu_are_read_from_the_trainers_line():
  h200 = peak_tflops([types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")])
  assert h200 == ("H200", 989.0)  # the table's dense bf16 peak: MFU's denominator on the lent GPU
  lines = []
  stream = LineStream(lines.append)
  for step, steps_per_s in ((1, None), (30, 212.5)):
    record = {"step": step, **rates(steps_per_s, 4096, None, 1.3e12, h200)}
    print(progress_line(step, 60, {"loss": 2.3, "accuracy": 0.1}, record), file=stream)
  assert len(lines) == 2 and stream.lines == lines  # the first: no rate yet (the compiling step)
  line, fields = first_rated_line(lines)
  assert line == lines[1]
  assert fields == {
    "step": 30,
    "steps_per_s": 212.5,
    "tflops": pytest.approx(276.25, abs=0.5),
    "mfu": pytest.approx(0.279),
  }


def test_the_mlp_flops_by_hand_are_the_traced_steps():
  import jax
  import optax

  from benchmarks.common.zoo import mlp_task
  from benchmarks.trainer import plain_step

  task = mlp_task(6, 8, 2)
  batch = next(task.train_batches(4, 0))
  params = jax.eval_shape(lambda: task.model.init(jax.random.key(0), batch["x"])["params"])
  optimizer = optax.sgd(0.1)
  traced = (
    plain_step(task, optimizer).trace(params, jax.eval_shape(optimizer.init, params), batch).jaxpr.jaxpr
  )
  assert jaxpr_flops(traced) == mlp_step_flops(6, 8, 2, 4)
