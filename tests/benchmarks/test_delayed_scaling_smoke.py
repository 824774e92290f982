"""``benchmarks/diagnosis/delayed_scaling.py``: delayed (amax-history) scaling of a Dense."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.diagnosis import delayed_scaling as ds
from pallas_kernels.quantize.reference import quantize_reference


def test_the_delayed_dense_is_close_to_the_dynamic_one_and_its_history_moves_every_step():
  got = ds.dense_numerics("int8", tokens=64, width=32, steps=3)
  assert got["history_changed"] == 3
  assert all(a > 0 for a in got["x_history"] + got["dy_history"])
  # int8 with one scale per tensor (delayed) against one per row / column (dynamic): about 1 %
  # apart on normal data; a wrong scale or a stale (empty) history is off by far more
  for part in ("y", "dx", "dw"):
    assert got[f"delayed_vs_dynamic_{part}"] < 0.05
    assert got[f"delayed_{part}"] < 0.05


def test_the_forward_quantizes_with_the_history_scale_and_the_cotangent_is_the_next_history():
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (16, 8), jnp.float32)
  w = jax.random.normal(kw, (8, 4), jnp.float32)
  g = jax.random.normal(kg, (16, 4), jnp.float32)
  history = {
    "x": jnp.zeros((ds.HISTORY,), jnp.float32).at[3].set(2.0),
    "dy": jnp.zeros((ds.HISTORY,), jnp.float32),
  }
  spec = ds.delayed_spec("fp8")  # rounds to nearest: no key

  @jax.jit
  def step(x, w, history, g):
    y, vjp = jax.vjp(lambda x, w, h: ds.delayed_matmul(x, w, h, None, spec, jnp.float32), x, w, history)
    return y, vjp(g)[2]

  y, new = step(x, w, history, g)
  # the jnp definition: X at the history's scale (2 / 448, values above 2 clipped), W per column
  s_x = 2.0 / 448.0
  q_x = jnp.clip(x / s_x, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s_x
  q_w, s_w = quantize_reference(w, "e4m3", (0,))
  np.testing.assert_allclose(y, q_x @ (q_w.astype(jnp.float32) * s_w), rtol=1e-5, atol=1e-5)
  expected_x = jnp.roll(history["x"], 1).at[0].set(jnp.max(jnp.abs(x)))
  np.testing.assert_array_equal(new["x"], expected_x)
  assert float(new["dy"][0]) == pytest.approx(float(jnp.max(jnp.abs(g))))
  assert float(jnp.sum(new["dy"][1:])) == 0.0


class _TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((2, 4), name="split")(x)  # [B, 2, 4]
    return nn.DenseGeneral(3, axis=(-2, -1), name="merge")(nn.relu(h))


def test_the_interceptor_gives_every_dense_its_history_and_carries_the_new_ones_out():
  model = _TwoDense()
  x = jax.random.normal(jax.random.key(2), (32, 8), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  task = type("T", (), {"model": model, "inputs": staticmethod(lambda b: (b,)), "train_kwargs": {}})
  histories = ds.initial_histories(task, variables, x)
  assert list(histories) == ["split", "merge"]
  spec = ds.delayed_spec("fp8")

  def loss(histories):
    with nn.intercept_methods(ds.DelayedDense(histories, spec)):
      return jnp.sum(model.apply(variables, x) ** 2)

  grad = jax.jit(jax.grad(loss))
  for _ in range(2):  # the first step quantizes at scale 1, the second at the history's
    new = grad(histories)
    for path in histories:
      assert float(new[path]["x"][0]) > 0 and float(new[path]["dy"][0]) > 0
    histories = new
  assert float(histories["split"]["x"][1]) == float(histories["split"]["x"][0])  # x did not change
  with nn.intercept_methods(ds.DelayedDense(histories, spec)):
    y = model.apply(variables, x)
  # e4m3 keeps 3 mantissa bits: each product's rounding is a few percent
  assert float(ds.rel_err(y, model.apply(variables, x))) < 0.1


def test_every_width_runs_its_int8_variants_before_any_fp8_one_and_a_skipped_group_says_why():
  got = ds.groups([768, 4096], ["bf16", "fp8_delayed", "int8_delayed"])
  assert got == [
    (768, ("bf16", "int8_delayed")),
    (4096, ("bf16", "int8_delayed")),
    (768, ("fp8_delayed",)),
    (4096, ("fp8_delayed",)),
  ]
  row = ds.failed_row(768, "fp8_delayed", "budget: needs ~60 s, 10 s left", "r", "skipped")
  assert row["case"] == "gpt/d768/fp8_delayed" and row["metric"] == "skipped"
  assert "skipped: budget: needs ~60 s" in ds.table([row])
