"""quantize_both: one quantization written in the layouts of the two GEMMs that read it (the
forward's, contraction last, and the gradient leg's, the other axes last), against the jnp
reference transposed, in interpret mode on the CPU and compiled on a GPU."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize import api, kernel
from pallas_kernels.quantize.config import QuantizeConfig
from tests.pallas_kernels.test_quantize import IMPLS, assert_codes_match, draw, expected

# name: (reduce_axes, contract_axes) on a [batch, sequence, features] input
CASES = {
  "activation_per_channel": ((2,), (2,)),  # X of Y = X·W: contraction last, a scale per row
  "weight_per_channel": ((0,), (0,)),  # W [K, N]: contraction first, a scale per column
  "activation_per_tensor": ((0, 1, 2), (2,)),
  "two_contracted_axes": ((0, 1), (0, 1)),
}


def check(impl, x, fmt, reduce_axes, contract, rounding="nearest"):
  key = jax.random.key(9) if rounding == "stochastic" else None
  name, interpret = impl
  got = api.quantize_both(
    x, fmt, reduce_axes, rounding, key, contract_axes=contract, impl=name, interpret=interpret
  )
  rest = tuple(a for a in range(x.ndim) if a not in contract)
  want_last = expected(x, fmt, reduce_axes, contract, rounding=rounding, key=key)
  want_first = expected(x, fmt, reduce_axes, rest, rounding=rounding, key=key)
  for (q, s), (q_ref, s_ref) in zip(got, (want_last, want_first)):
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert_codes_match(impl, q, q_ref)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=3e-7 if interpret else 1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
  "case,fmt",
  [(c, "int8") for c in sorted(CASES)] + [("activation_per_channel", "e4m3"), ("weight_per_channel", "e5m2")],
)
def test_both_layouts_match_the_reference(impl, case, fmt):
  shape = (2, 256, 384) if impl == ("pallas", False) else (2, 16, 48)
  x = draw(shape, zlib.crc32(repr((case, fmt)).encode()) % 997, jnp.bfloat16)
  check(impl, x, fmt, *CASES[case])


@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_writes_one_draw_in_both_layouts(impl):
  """The two copies hold the same codes: one rounding per element (the reference's noise,
  ``noise.uniform_noise``), written twice."""
  shape = (256, 512) if impl == ("pallas", False) else (32, 64)
  x = draw(shape, 17, jnp.bfloat16)
  check(impl, x, "e4m3", (1,), (1,), "stochastic")


def test_a_contraction_inside_the_axes_runs_the_reference():
  """Contracted axes that are neither a prefix nor a suffix: the kernel declines, XLA
  transposes the reference; the values are the same either way."""
  x = draw((4, 8, 16), 5)
  with pytest.raises(NotImplementedError, match="prefix nor a suffix"):
    api._pallas_both(x, "int8", (1,), "nearest", None, (1,), None, True)
  check(("pallas", True), x, "int8", (1,), (1,))


def test_tiled_kernel_per_row_scale_on_a_non_square_tile_grid():
  """``quantize_tiled(layout='both', scale_axis='rows')``: each tile rounded once and stored in
  both outputs, on a grid of 4 × 8 tiles."""
  x = draw((64, 256), 21)
  scale = jnp.max(jnp.abs(x), axis=1) / 127.0
  cfg = QuantizeConfig(block_rows=16, block_cols=32)
  same, transposed = kernel.quantize_tiled(
    x, "int8", scale, scale_axis="rows", layout="both", config=cfg, interpret=True
  )
  want = jnp.clip(jnp.round(x / scale[:, None]), -127, 127).astype(jnp.int8)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(transposed), np.asarray(want.T))
  with pytest.raises(ValueError, match="layout"):
    kernel.quantize_tiled(x, "int8", scale, layout="diagonal", interpret=True)


def test_bad_calls_name_the_argument():
  x = draw((8, 16), 0)
  with pytest.raises(ValueError, match="contract_axes"):
    api.quantize_both(x, "int8", (1,), contract_axes=(2,))
  with pytest.raises(ValueError, match="key"):
    api.quantize_both(x, "int8", (1,), "stochastic", contract_axes=(1,))
