"""``benchmarks/diagnosis/delayed_scaling.py``: delayed (amax-history) scaling of a Dense."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.common.e2e_inspect import pallas_kernels
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


def test_the_fused_delayed_dense_is_the_jnp_definition_and_carries_three_amaxes():
  """``fused_delayed_matmul`` (fp8: rounds to nearest, no key): X at its history's scale, W per
  column, dX with W's scale folded into dY at the ``dy_w`` history's scale, dW at ``dy``'s; the
  cotangent holds this step's max|x|, max|dY|, max|dY ⊙ s_w| first."""
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (32, 16), jnp.float32)
  w = jax.random.normal(kw, (16, 8), jnp.float32)
  g = jax.random.normal(kg, (32, 8), jnp.float32)
  history = {k: v.at[2].set(h) for (k, v), h in zip(ds.empty_history(fused=True).items(), (2.0, 1.5, 0.5))}
  spec = ds.delayed_spec("fp8", fused=True)
  y, vjp = jax.vjp(lambda x, w, h: ds.fused_delayed_matmul(x, w, h, None, spec, jnp.float32), x, w, history)
  dx, dw, new = vjp(g)

  def q(v, scale, fmt):  # the format's rounding at a per-tensor scale, saturated
    qmax = 448.0 if fmt == "e4m3" else 57344.0
    return jnp.clip(v / scale, -qmax, qmax).astype(
      getattr(jnp, f"float8_{fmt}fn" if fmt == "e4m3" else "float8_e5m2")
    )

  s_x, s_g, s_gw = 2.0 / 448.0, 1.5 / 57344.0, 0.5 / 57344.0
  q_x = q(x, s_x, "e4m3").astype(jnp.float32) * s_x
  q_w, s_w = quantize_reference(w, "e4m3", (0,))
  w_hat = q_w.astype(jnp.float32)
  np.testing.assert_allclose(y, q_x @ (w_hat * s_w), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    dx, (q(g * s_w, s_gw, "e5m2").astype(jnp.float32) * s_gw) @ w_hat.T, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(dw, q_x.T @ (q(g, s_g, "e5m2").astype(jnp.float32) * s_g), rtol=1e-5, atol=1e-6)
  want = {"x": jnp.max(jnp.abs(x)), "dy": jnp.max(jnp.abs(g)), "dy_w": jnp.max(jnp.abs(g * s_w))}
  for name, amax in want.items():
    assert float(new[name][0]) == float(amax) and float(new[name][3]) == float(history[name][2])


def test_only_the_fused_step_reads_no_activation_or_gradient_for_its_amax():
  """``absmax_passes`` of a two-Dense step traced with the GPU kernels forced: the jnp delayed
  step reduces X and dY of each Dense (4 max-reductions over values from the batch), the fused
  one none, and neither takes a separate absmax kernel; the weights' reductions never count."""
  model = _TwoDense()
  x = jax.random.normal(jax.random.key(2), (32, 8), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  task = type("T", (), {"model": model, "inputs": staticmethod(lambda b: (b,)), "train_kwargs": {}})
  got = {}
  for fused in (False, True):
    histories = ds.initial_histories(task, variables, x, fused)
    spec = ds.delayed_spec("int8", fused)

    def loss(params, histories, x, key, spec=spec):
      with nn.intercept_methods(ds.DelayedDense(histories, spec)):
        return jnp.sum(model.apply({"params": params}, x, rngs={ds.RNG_COLLECTION: key}) ** 2)

    with ds.kernels_forced():
      traced = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(
        variables["params"], histories, x, jax.random.key(1)
      )
    got[fused] = ds.absmax_passes(
      traced.jaxpr, ds.batch_flags(traced.jaxpr, x), 32 * 3
    )  # the smallest: dY [32, 3]
    kernels = {k[0].split(" ")[0] for k in pallas_kernels(traced.jaxpr)} if fused else set()
  assert got[False] == {"batch_max_reductions": 4, "absmax_kernels": 0}
  assert got[True] == {"batch_max_reductions": 0, "absmax_kernels": 0}
  assert any("amax" in k for k in kernels), kernels  # the fused step's kernels wrote the amaxes


def test_variant_names_split_into_precision_scaling_and_fusion():
  assert ds.split_variant("int8_delayed_fused") == ("int8", "delayed", True)
  assert ds.split_variant("fp8_dynamic") == ("fp8", "dynamic", False)
  assert ds.split_variant("bf16") == ("bf16", "", False)
  assert set(ds.ESTIMATE_S) == set(ds.VARIANTS)
