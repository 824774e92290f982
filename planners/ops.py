"""The quantizable ops of a model, in forward order, each as a canonical GEMM.

``collect_ops(model, variables, *args, **kwargs)`` traces ``apply`` abstractly with a ``tap``
(``qsync_jax.quantize``) and records every quantizable op call as an ``OpShape``: the
``batch × (m×k)·(k×n)`` product its forward computes (dlhs: ``(m×n)·(n×k)``, drhs:
``(k×m)·(m×n)``).

Canonical GEMM of each kind (``lhs``, ``rhs``, ``out`` shapes as the tap sees them):

* weight ops (dense, dense_general, einsum, embed, embed_attend): ``rhs`` is the weight,
  ``k = sqrt(|lhs|·|rhs| / |out|)``, ``m = |lhs| / k``, ``n = |rhs| / k``;
* conv: the im2col GEMM, ``m = |out| / C_out``, ``k = |rhs| / C_out``, ``n = C_out``;
* attention_qk ``[B,Q,H,D]·[B,K,H,D]``: batch ``B·H``, m ``Q``, k ``D``, n ``K``;
* attention_pv ``[B,H,Q,K]·[B,K,H,D]``: batch ``B·H``, m ``Q``, k ``K``, n ``D``.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from qsync_jax.models.flax_quant import quantize
from qsync_jax.ops.quant_ops import OpInfo
from qsync_jax.policy import PrecisionPolicy

ATTENTION_EINSUMS = {"attention_qk": "...qhd,...khd->...hqk", "attention_pv": "...hqk,...khd->...qhd"}
"""The products of ``flax.linen.dot_product_attention`` (their real operand layouts; also
how they are named in a step's JAX name stack)."""

ACTIVATION_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""The compute dtypes an op's activations can have, by dtype name, and their precision names."""

WEIGHT_KINDS = ("dense", "dense_general", "conv", "einsum", "embed", "embed_attend")
"""Op kinds whose right operand is a parameter (its gradient is all-reduced)."""


@dataclasses.dataclass(frozen=True)
class OpShape:
  """One quantizable op as a GEMM (see the module docstring).

  Attributes:
    name: ``"<module path>:<kind>"``.
    kind: op kind.
    batch, m, k, n: the forward product is ``batch × (m×k)·(k×n)``.
    calls: times the op runs per forward pass (a module applied twice counts twice).
    lhs_elems: elements of the actual left operand (conv: the input, not its patches).
    rhs_elems: elements of the right operand (the weight for weight ops).
    out_elems: elements of the output.
    lhs_shape, rhs_shape: the operands' shapes at the profiled batch (attention products
      are timed with their real einsum layout, which decides int8 speed on some backends).
    activation_dtype: the dtype the op returns, its model's compute dtype whatever its policy
      (``qsync_jax.ops.qdot``): what its activations and their gradients are between ops
      (``"float32"``, ``"bfloat16"`` or ``"float16"``).
  """

  name: str
  kind: str
  batch: int
  m: int
  k: int
  n: int
  calls: int = 1
  lhs_elems: int = 0
  rhs_elems: int = 0
  out_elems: int = 0
  lhs_shape: tuple[int, ...] = ()
  rhs_shape: tuple[int, ...] = ()
  activation_dtype: str = "float32"

  def __post_init__(self):
    if self.activation_dtype not in ACTIVATION_PRECISIONS:
      raise ValueError(
        f"op {self.name!r}: activation_dtype {self.activation_dtype!r} is not one of "
        f"{list(ACTIVATION_PRECISIONS)}. Fix: trace a model computing in one of them."
      )

  @property
  def activation_precision(self) -> str:
    """``activation_dtype`` as a precision name (``"fp32"``, ``"bf16"``, ``"fp16"``)."""
    return ACTIVATION_PRECISIONS[self.activation_dtype]

  @property
  def runs_8bit(self) -> bool:
    """Whether an 8-bit leg can run this op (a grouped convolution runs float policies only)."""
    return not grouped_conv(self.kind, self.lhs_shape, self.rhs_shape)

  @property
  def flops(self) -> float:
    """Flops of the forward product of one call."""
    return 2.0 * self.batch * self.m * self.k * self.n

  @property
  def has_weight(self) -> bool:
    return self.kind in WEIGHT_KINDS

  @property
  def param_elems(self) -> int:
    """Elements of the weight (0 for attention products); counted once per op."""
    return self.rhs_elems if self.has_weight else 0

  def scaled(self, factor: float) -> OpShape:
    """The same op at ``factor`` times the batch (activation dims scale, weights do not)."""

    def s(x):
      return max(1, round(x * factor))

    if self.kind in ("attention_qk", "attention_pv"):
      return dataclasses.replace(
        self,
        batch=s(self.batch),
        lhs_elems=s(self.lhs_elems),
        rhs_elems=s(self.rhs_elems),
        out_elems=s(self.out_elems),
      )
    return dataclasses.replace(self, m=s(self.m), lhs_elems=s(self.lhs_elems), out_elems=s(self.out_elems))

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, obj) -> OpShape:
    obj = dict(obj)
    for key in ("lhs_shape", "rhs_shape"):
      obj[key] = tuple(obj.get(key, ()))
    return cls(**obj)


def grouped_conv(kind: str, lhs_shape, rhs_shape) -> bool:
  """A convolution whose input has more channels than its kernel takes (``feature_group_count``
  > 1; Flax's NHWC input and HWIO kernel)."""
  return kind == "conv" and bool(lhs_shape) and bool(rhs_shape) and lhs_shape[-1] != rhs_shape[-2]


def gemm_shape(kind: str, lhs_shape, rhs_shape, out_shape) -> tuple[int, int, int, int]:
  """``(batch, m, k, n)`` of an op's forward product; see the module docstring."""
  lhs, rhs, out = math.prod(lhs_shape), math.prod(rhs_shape), math.prod(out_shape)
  if kind == "attention_qk":
    b, q, h, d = lhs_shape
    return b * h, q, d, rhs_shape[1]
  if kind == "attention_pv":
    b, h, q, kv = lhs_shape
    return b * h, q, kv, rhs_shape[-1]
  if kind == "conv":
    c_out = rhs_shape[-1]
    return 1, out // c_out, rhs // c_out, c_out
  k = max(1, round(math.sqrt(lhs * rhs / max(out, 1))))
  return 1, max(1, lhs // k), k, max(1, rhs // k)


def collect_ops(model, variables, *args, **kwargs) -> list[OpShape]:
  """Every quantizable op ``model.apply(variables, *args, **kwargs)`` calls, in order."""
  calls: dict[str, OpShape] = {}

  def tap(info: OpInfo, y):
    if info.name in calls:
      calls[info.name] = dataclasses.replace(calls[info.name], calls=calls[info.name].calls + 1)
      return y
    batch, m, k, n = gemm_shape(info.kind, info.lhs_shape, info.rhs_shape, y.shape)
    calls[info.name] = OpShape(
      info.name,
      info.kind,
      batch,
      m,
      k,
      n,
      1,
      math.prod(info.lhs_shape),
      math.prod(info.rhs_shape),
      math.prod(y.shape),
      tuple(info.lhs_shape),
      tuple(info.rhs_shape),
      jax.numpy.dtype(y.dtype).name,
    )
    return y

  qmodel = quantize(model, PrecisionPolicy.uniform("fp32"), tap=tap)
  jax.eval_shape(lambda v, *a: qmodel.apply(v, *a, **kwargs), variables, *args)
  return list(calls.values())
