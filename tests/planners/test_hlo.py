"""hlo.py reads collectives, their dtypes and bytes, and conditional branches from compiled HLO."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from planners.profiler import hlo
from qsync_jax.ops.vma import shard_map
from qsync_jax.sync.common import to_varying


def _program(mesh):
  def f(x, y):
    a = lax.psum(x.astype(jnp.int8), "data")
    b = lax.all_gather(y.astype(jnp.int8), "data", tiled=True)
    c = lax.psum_scatter(y, "data", tiled=True)
    flag = lax.psum(jnp.sum(x), "data")
    d = lax.cond(flag > 0, lambda v: to_varying(lax.psum(v, "data")), lambda v: v, y)
    return a.astype(jnp.float32), b[:8].astype(jnp.float32), c, d

  specs = (P("data"), P("data"))
  return jax.jit(shard_map(f, mesh=mesh, in_specs=specs, out_specs=(P("data"),) * 4))


def test_collectives_dtypes_and_bytes(mesh):
  x = jax.random.normal(jax.random.key(0), (64,))
  y = jax.random.normal(jax.random.key(1), (8 * 64,))
  text = hlo.compiled_text(_program(mesh), x, y)
  found = hlo.collectives(text)
  kinds = sorted((c.op, c.dtypes, c.bytes) for c in found)
  assert ("all-gather", ("s8",), 8 * 64) in kinds  # gathered buffer: 512 int8
  assert ("all-reduce", ("s8",), 8) in kinds
  assert ("reduce-scatter", ("f32",), 64 * 4) in kinds  # the buffer before the scatter
  assert ("all-reduce", ("f32",), 4) in kinds  # the scalar flag
  assert ("all-reduce", ("f32",), 64 * 4) in kinds  # inside the conditional
  assert all(c.group_size == 8 for c in found)
  ring = {c.op: c.wire_bytes for c in found if c.dtypes == ("s8",)}
  assert ring == {"all-gather": 7 / 8 * 512, "all-reduce": 2 * 7 / 8 * 8}
  summary = hlo.summarize(found)
  assert summary["count"] == len(found) == 5
  assert summary["bytes"] == 512 + 8 + 256 + 4 + 256


def test_conditional_branches_are_separated(mesh):
  x = jax.random.normal(jax.random.key(2), (64,))
  y = jax.random.normal(jax.random.key(3), (8 * 64,))
  text = hlo.compiled_text(_program(mesh), x, y)
  always = hlo.outside_conditionals(text)
  assert len(always) == 4 and all(c.bytes != 64 * 4 or c.op != "all-reduce" for c in always)
  (branches,) = hlo.conditional_branches(text)
  assert sorted(len(b) for b in branches) == [0, 1]
  (inside,) = [b for b in branches if b][0]
  assert (inside.op, inside.bytes) == ("all-reduce", 256)


def test_mesh_replica_groups_format_counts_the_group():
  """XLA on GPU (jax 0.11) writes ``replica_groups=mesh['data'=2] {'data'}`` (seen in the
  compiled step on 2 H200s): the group is the product of the named axes' sizes."""
  assert hlo._group_size("replica_groups=mesh['data'=2] {'data'}, use_global_device_ids=true") == 2
  assert hlo._group_size("replica_groups=mesh['data'=2,'model'=4] {'model'}, x") == 4
  assert hlo._group_size("replica_groups=mesh['data'=2,'model'=4] {'data','model'}, x") == 8
  assert hlo._group_size("replica_groups={{0,1,2}}, x") == 3


SCHEDULED = """HloModule step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (p: f32[256]) -> f32[256] {
  %p = f32[256] parameter(0)
  ROOT %ar2 = f32[256] all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (x: f32[1024], y: f32[256]) -> (f32[1024], f32[256]) {
  %x = f32[1024] parameter(0)
  %y = f32[256] parameter(1)
  %ars = f32[1024] all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%add
  %f1 = f32[256] fusion(%y), kind=kLoop, calls=%add
  %cc = f32[256] custom-call(%f1), custom_call_target="mosaic_gpu"
  %cp = f32[256] copy(%cc)
  %ard = f32[1024] all-reduce-done(%ars)
  %as = ((f32[256]), f32[256]) async-start(%cp), calls=%wrapped
  %ad = f32[256] async-done(%as)
  ROOT %t = (f32[1024], f32[256]) tuple(%ard, %ad)
}
"""


def test_async_spans_count_the_compute_between_start_and_done():
  """The all-reduce-start overlaps a fusion and a custom call (the copy is not compute); the
  async-wrapped all-reduce overlaps nothing: it runs exposed."""
  spans = {s.name: s for s in hlo.async_spans(SCHEDULED)}
  assert set(spans) == {"ars", "as"}
  assert (spans["ars"].op, spans["ars"].bytes, spans["ars"].compute, spans["ars"].custom_calls) == (
    "all-reduce",
    4096,
    2,
    1,
  )
  assert (spans["as"].op, spans["as"].bytes, spans["as"].compute) == ("all-reduce", 1024, 0)
