"""Where kernels may run: the GPU check shared by every op's ``api``."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable

import jax
from jax import lax


@functools.cache
def on_gpu() -> bool:
  """True when JAX's default backend is a CUDA GPU (where the Pallas kernels compile)."""
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:  # no backend initialised at all
    return False


@functools.cache
def gpu_arch() -> str | None:
  """The CUDA architecture of the default backend's first device (``"sm90"`` for compute
  capability 9.0); None off a CUDA GPU."""
  if not on_gpu():
    return None
  capability = str(getattr(jax.devices()[0], "compute_capability", "") or "")
  major, _, minor = capability.partition(".")
  if not (major.isdigit() and minor.isdigit()):
    return None
  return f"sm{major}{minor}"


_COMPILES: dict[str, bool] = {}


def compiles(name: str, arch: str, build: Callable[[], object]) -> bool:
  """Whether ``build()`` — lowering and compiling a tiny instance of kernel ``name`` on this GPU
  of architecture ``arch`` — succeeds; asked once per process per ``name``. A failure warns once,
  naming the kernel and the reason, and the caller runs its next implementation. A failure that
  aborts the process instead of raising (an LLVM fatal error, as Triton's for e4m3 below sm89)
  cannot be caught here: the architecture table never offers such a kernel."""
  if name not in _COMPILES:
    try:
      build()
      _COMPILES[name] = True
    except Exception as e:  # noqa: BLE001 - any failure to compile means: use the next implementation
      _COMPILES[name] = False
      reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
      warnings.warn(
        f"{name} does not compile on this GPU ({arch}): {reason}. Using the next implementation.",
        RuntimeWarning,
        stacklevel=2,
      )
  return _COMPILES[name]


def largest_pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two that divides ``n`` and is at most ``cap`` (1 if ``n`` is odd)."""
  d = 1
  while d * 2 <= cap and n % (d * 2) == 0:
    d *= 2
  return d


def vma(x) -> frozenset:
  """The ``shard_map`` mesh axes ``x`` is typed varying over (empty outside ``shard_map``)."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):  # jax >= 0.10
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", frozenset()))


def pvary(x, axes):
  """``x`` typed varying over ``axes`` too (no-op on values)."""
  axes = tuple(a for a in axes if a not in vma(x))
  if not axes:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, axes, to="varying")
  return lax.pvary(x, axes)


def varying_like(out, *inputs):
  """``out`` typed varying wherever one of ``inputs`` is: for kernels whose launcher drops the
  typing (``plgpu.kernel`` traces its body with the check off, so its outputs come back
  invariant). Under ``shard_map`` an invariant-typed activation is cast back to varying by the
  next op, whose transpose is a ``psum`` of its gradient over the devices."""
  axes = frozenset().union(*(vma(x) for x in inputs))
  return pvary(out, tuple(sorted(axes)))


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A ``pallas_call`` output typed like its most-varying input.

  Under ``shard_map(check_vma=True)`` Pallas needs each output's varying axes; a kernel's
  output varies wherever its inputs do.
  """
  like = max(inputs, key=lambda x: len(vma(x)))
  aval = jax.typeof(like)
  if hasattr(aval, "manual_axis_type"):
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
  if vma(like):  # older jax
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma(like))
  return jax.ShapeDtypeStruct(shape, dtype)


class ImplOverride:
  """A stack of forced implementations for an op's ``impl='auto'`` calls (benchmarks use it).

  ``with override.use("xla"): ...`` makes calls traced inside the block, in the same thread, pick
  ``"xla"`` (each thread has its own stack: a program traced in another thread meanwhile keeps its
  own choice); ``override.current`` is the innermost forced choice, or None — also inside
  ``use("auto")``, which forces nothing (the op's own choice runs).
  """

  def __init__(self, impls: tuple[str, ...]):
    self.impls, self._local = impls, threading.local()

  @property
  def _stack(self) -> list[str]:
    if not hasattr(self._local, "stack"):
      self._local.stack = []
    return self._local.stack

  @contextlib.contextmanager
  def use(self, impl: str):
    if impl not in self.impls:
      raise ValueError(f"impl={impl!r} is not one of {self.impls}.")
    self._stack.append(impl)
    try:
      yield
    finally:
      self._stack.pop()

  @property
  def current(self) -> str | None:
    return self._stack[-1] if self._stack and self._stack[-1] != "auto" else None
