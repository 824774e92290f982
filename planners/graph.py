"""The op graph of one synchronous training step, costed for a plan.

``build_graph(groups)`` returns a DAG of ``Node`` s (in topological order). Each
``GroupCost`` (one device group: its profile, its op policies, its batch) contributes a chain
on its own ``compute`` stream:

  forward ops in order → forward remainder → backward remainder → for each op
  in reverse: [cast] → dlhs → drhs → … → optimizer

* The remainder (what is not an op: norms, activations, the loss) costs the profile's
  ``remainder_ms`` under every plan (fitted on the all-bf16 step where profiled, else on fp32).

* Activations flow between ops in the model's dtype (fp32), as the runtime's ops return it;
  each leg converts its operands into its precision, and that conversion is part of the
  leg's profiled time (XLA fuses it with the product). The one conversion outside any leg is
  a cast node before an op's gradient legs when its forward ran int8/fp8: the saved 1-byte
  operands are dequantized to fp32 (the profile's ``"int8->fp32"`` / ``"fp8->fp32"`` model).
* int8/fp8 legs cost their standalone time times the profile's ``quantized_leg_scale``
  (fitted on the all-int8 step): inside the step XLA shares and fuses part of their quantize
  passes. Full-fp32 legs cost theirs times ``fp32_leg_scale`` (fitted on the fp32 step once the
  remainder came from the all-bf16 step): inside the step the fp32 products run slower than
  alone (a 128-512-channel VGG's fp32 convolutions up to 17 % on an H100: scale 1.08-1.11,
  ``docs/results.md``).
* The first op takes the model input, which is not differentiated: it has no dlhs leg.
* Gradients are all-reduced in buckets of at most ``bucket_bytes`` of fp32 weight gradients
  (``buckets``): one ``comm`` node per bucket, shared by all groups, starts when *every*
  group's backward has produced the whole bucket and after the previous bucket (one comm
  stream), and overlaps the remaining backward. This is what the trainer's step compiles to on
  GPUs: XLA's all-reduce combiner packs the gradients into collectives of up to its threshold
  (``DEFAULT_BUCKET_BYTES``) in *parameter-tree* order (``Comm.bucket_order="tree"``; seen in
  the compiled HLO whatever order the ``psum`` lists them in), runs them one at a time, and
  starts each when its last gradient exists — with the first layers' weights in the first
  collectives, most of the all-reduce waits for the end of the backward.
* The optimizer is split by buckets, in proportion to their bytes: each group's update of a
  bucket's parameters runs on its compute stream after its own backward and that bucket's
  all-reduce (XLA updates the parameters of a finished collective while the next one runs).

Times scale linearly with the group's batch relative to the profiled batch. ``longest_path``
gives every node's start and end; the synchronous step is the latest end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from planners.catalog import allreduce_ms
from planners.profiler import QUANTIZED_FIT_PRESET, Profile
from qsync_jax.precision import FP32_LIKE, PRESETS, QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.sync.allreduce import pack

DEFAULT_BUCKET_BYTES = 30 * 2**20
"""XLA:GPU's default all-reduce combine threshold (``xla_gpu_all_reduce_combine_threshold_bytes``):
the compiled step of a 4-layer d=768 LM on 4 H200s held collectives of 30.7, 30.7, 30.7 and
23.6 MB, the greedy packing of its 28.9 M gradient values at 30 MiB."""
DEFAULT_LATENCY_US = 10.0
"""Fixed cost of one all-reduce collective when no link microbenchmark measured it."""
PRESET_NAMES = {pol: name for name, pol in PRESETS.items()}
LEG_NAMES = ("dlhs", "drhs")


class Node(NamedTuple):
  """One timed step of the graph. ``deps`` are indices of earlier nodes."""

  name: str
  kind: str  # fwd | dlhs | drhs | cast | remainder | optimizer | comm
  group: str  # device group, or "allreduce" for comm nodes
  stream: str  # compute | comm
  ms: float
  deps: tuple[int, ...] = ()
  op: str | None = None
  precision: str | None = None


@dataclasses.dataclass(frozen=True)
class GroupCost:
  """What costs one device group's share of a step.

  Attributes:
    name: group name.
    profile: the cost profile of the group's device type.
    op_policies: op name → OpPolicy (None or absent: the unmodified float op).
    batch_per_device: the group's per-device batch.
  """

  name: str
  profile: Profile
  op_policies: Mapping[str, OpPolicy | None]
  batch_per_device: int


@dataclasses.dataclass(frozen=True)
class Comm:
  """The shared gradient all-reduce: ``n_devices`` in a ring over the slowest link, in buckets
  of ``bucket_bytes`` packed in ``bucket_order`` (``buckets``)."""

  n_devices: int
  link_gbps: float
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  latency_us: float = DEFAULT_LATENCY_US
  bucket_order: str = "tree"


def float_precision(profile: Profile) -> str:
  """Precision of an unmodified float op: XLA's default (tf32 on GPUs that have it)."""
  return "tf32" if "tf32" in profile.op_ms.get(profile.ops[0].name, {}).get("fwd", {}) else "fp32"


def cast_ms(profile: Profile, src: str, dst: str, numel: float, stochastic: bool = False) -> float:
  """ms to convert ``numel`` elements from ``src`` to ``dst`` precision (0 if they agree).

  fp32 and tf32 share storage; between two non-fp32 types the value goes through fp32.
  """
  src, dst = ("fp32" if x in FP32_LIKE else x for x in (src, dst))
  if src == dst or numel <= 0:
    return 0.0
  if src != "fp32" and dst != "fp32":
    return cast_ms(profile, src, "fp32", numel) + cast_ms(profile, "fp32", dst, numel, stochastic)
  sr = ":sr" if stochastic and dst in QUANTIZED_PRECISIONS else ""
  return profile.cast[f"{src}->{dst}{sr}"].ms(numel)


def op_costs(group: GroupCost, op_index: int) -> dict[str, tuple[float, str]]:
  """``{node kind: (ms, precision)}`` of one op of one group inside the step: its standalone
  costs (``standalone_costs``) as the step runs them (``in_step``, with the op's
  ``quantized_in_step_factors``)."""
  prof = group.profile
  op = prof.ops[op_index]
  pol = group.op_policies.get(op.name) or OpPolicy.uniform(float_precision(prof))
  costs, relayout = standalone_costs(prof, op_index, pol, group.batch_per_device / prof.batch_per_device)
  factors = quantized_in_step_factors(prof, op_index)
  return in_step(costs, prof.quantized_leg_scale, prof.fp32_leg_scale, relayout, factors)


def standalone_costs(
  prof: Profile, op_index: int, pol: OpPolicy, scale: float = 1.0
) -> tuple[dict[str, tuple[float, str]], float]:
  """``({node kind: (ms, precision)}, relayout ms)`` of one op under ``pol`` at ``scale`` times
  the profiled batch, from its standalone programs: ``fwd``, ``cast_bwd``, ``dlhs`` (not for the
  first op), ``drhs``; and the relayout its drhs leg carries in the step.

  A leg's own operand conversions are inside its profiled time. A gradient leg at the
  forward's precision uses the ``:saved`` time (bf16/fp16: the saved operand needs no cast;
  int8/fp8: the leg reads the saved values, their scale folded into dY). ``cast_bwd`` — the saved int8/fp8 operands
  dequantized to fp32 — appears when some gradient leg runs at another precision.

  The relayout (``Profile.relayout_ms``) is paid when the op's policy makes XLA re-run the
  producer of its saved activation (fp32; see ``planners.steptrace``); under another policy
  that does, the relayout time its whole-policy programs measured (``"relayout_ms"``,
  XLA:CPU), where there is one.

  When the profile timed the op under its whole policy (``"policy:<preset>"``), that is used
  instead: the forward as timed, the backward split between dlhs and drhs in proportion to
  their leg times (the first op, which has no dlhs, keeps only the drhs share)."""
  op = prof.ops[op_index].scaled(scale)
  p = pol.fwd
  sr = pol.grad_rounding == "stochastic"
  legs = {"dlhs": pol.dlhs, "drhs": pol.drhs} if op_index > 0 else {"drhs": pol.drhs}

  def leg(name, q):
    saved = name != "fwd" and q == p and q not in FP32_LIKE
    variant = ":".join(["saved"] * saved + ["sr"] * (name != "fwd" and sr and q in QUANTIZED_PRECISIONS))
    return op.calls * scale * prof.leg_ms(op.name, name, q, variant)

  preset = PRESET_NAMES.get(pol)
  whole = prof.op_ms[op.name].get(f"policy:{preset}") if preset else None
  # the step-time relayout of the saved activation for the drhs leg (measured in the fp32
  # step, ``planners.steptrace``): paid by an fp32 op, and by any op whose policy also
  # leaves XLA re-running the activation's producer (``op_programs.producer_relayout_ms``)
  refuses = p in FP32_LIKE or bool(whole is not None and whole.get("refuses_producer"))
  relayout = scale * prof.relayout_ms.get(op.name, 0.0) if refuses else 0.0
  if refuses and p not in FP32_LIKE and "relayout_ms" in whole:
    # another policy's re-run differs from fp32's (fp16: a rounding per element in the loop);
    # its standalone relayout time (``op_programs.producer_relayout_ms``) stands for it
    relayout = scale * whole["relayout_ms"]
  if whole is not None:  # the op timed under its whole policy: split bwd by the legs' shares
    shares = {
      name: prof.leg_ms(op.name, name, pol.dlhs if name == "dlhs" else pol.drhs) for name in LEG_NAMES
    }
    total = sum(shares.values())
    costs = {"fwd": (op.calls * scale * whole["fwd"], p)}
    for name, q in legs.items():
      costs[name] = (op.calls * scale * whole["bwd"] * shares[name] / total, q)
    return costs, relayout
  costs = {"fwd": (leg("fwd", p), p)}
  if p in QUANTIZED_PRECISIONS and any(q != p for q in legs.values()):
    im2col = op.kind == "conv"  # a quantized conv saved its im2col patches
    lhs = op.batch * op.m * op.k if im2col else op.lhs_elems
    costs["cast_bwd"] = (
      op.calls * (cast_ms(prof, p, "fp32", lhs) + cast_ms(prof, p, "fp32", op.rhs_elems)),
      p,
    )
  for name, q in legs.items():
    costs[name] = (leg(name, q), q)
  return costs, relayout


def quantized_in_step_factors(prof: Profile, op_index: int) -> tuple[float, float] | None:
  """``(forward, backward)``: the op's time inside the all-int8 step, charged to it by a trace
  (``Profile.quantized_in_step_ms``), over its standalone all-int8 costs (``standalone_costs``),
  forward and gradient legs apart; None where the profile has no trace of the op or a leg came
  out without time (its kernels charged elsewhere)."""
  op = prof.ops[op_index]
  traced = prof.quantized_in_step_ms.get(op.name)
  if not traced or min(traced.get("fwd", 0.0), traced.get("bwd", 0.0)) <= 0:
    return None
  costs, _ = standalone_costs(prof, op_index, PRESETS[QUANTIZED_FIT_PRESET])
  fwd = costs["fwd"][0]
  bwd = sum(ms for kind, (ms, _) in costs.items() if kind != "fwd")
  return traced["fwd"] / fwd, traced["bwd"] / bwd


def in_step(
  costs: dict[str, tuple[float, str]],
  quantized_scale: float,
  fp32_scale: float,
  relayout_ms: float,
  quantized_factors: tuple[float, float] | None = None,
):
  """``costs`` as the step runs them: every full-fp32 leg's (not tf32) time times ``fp32_scale``
  (``Profile.fp32_leg_scale``); the drhs leg carrying ``relayout_ms``; every int8/fp8 leg's
  time times ``quantized_scale`` (``Profile.quantized_leg_scale``) — or, given the op's
  ``quantized_factors`` (``quantized_in_step_factors``), its forward leg times the forward
  factor and its gradient legs times the backward factor and ``quantized_scale``. The trace
  charges an op's forward kernels to it; what it charges to no op — on an H100, the all-int8
  step of a 128-512-channel VGG ran 0.44 ms more unnamed backward kernels than the all-bf16
  step, and 0.06 ms fewer forward ones (``docs/results.md``) — is left to the scale."""

  def scaled(kind, ms, p):
    if p in QUANTIZED_PRECISIONS and kind != "cast_bwd":
      if quantized_factors is None:
        return ms * quantized_scale
      return ms * quantized_factors[0] if kind == "fwd" else ms * quantized_factors[1] * quantized_scale
    return ms * fp32_scale if p == "fp32" else ms

  out = {kind: (scaled(kind, ms, p), p) for kind, (ms, p) in costs.items()}
  ms, p = out["drhs"]
  out["drhs"] = (ms + relayout_ms, p)
  return out


SIXTEEN_BIT = ("bf16", "fp16")


def sixteen_bit_share(profile: Profile, op_policies: Mapping[str, OpPolicy | None]) -> float:
  """The share of the step's activations that bf16/fp16 ops produce: the output elements of the
  ops whose forward runs at a 16-bit float, over those of all ops (0 without outputs)."""
  total = sum(op.out_elems * op.calls for op in profile.ops)
  if total <= 0:
    return 0.0
  sixteen = sum(
    op.out_elems * op.calls
    for op in profile.ops
    if (pol := op_policies.get(op.name)) is not None and pol.fwd in SIXTEEN_BIT
  )
  return sixteen / total


def mixed_by_16bit_share(
  profile: Profile,
  op_policies: Mapping[str, OpPolicy | None],
  fp32_value: float,
  sixteen_bit_value: float | None,
) -> float:
  """A quantity fitted on the fp32 step and, where fitted (not None), on the all-bf16 step,
  for a plan: the two mixed by its ``sixteen_bit_share`` (the memory correction,
  ``planners.replay.memory_bytes``)."""
  if sixteen_bit_value is None:
    return fp32_value
  share = sixteen_bit_share(profile, op_policies)
  return (1 - share) * fp32_value + share * sixteen_bit_value


def tree_position(op_name: str) -> tuple[str, ...]:
  """Sort key of an op's parameters in the parameter tree: its module path's components
  (``jax.tree`` flattens dicts by sorted keys: ``block0/mlp_in`` before ``block1/attn``)."""
  return tuple(op_name.split(":")[0].split("/"))


def buckets(profile: Profile, bucket_bytes: int, order: str = "tree") -> list[tuple[int, int]]:
  """``[(index of the op whose drhs completes the bucket, fp32 gradient bytes)]``, in the order
  the collectives run (the one completed first first).

  The weights are packed greedily, in ``order``, into buckets of at most ``bucket_bytes`` (a
  weight larger than that is a bucket of its own; ``qsync_jax.sync.allreduce.pack``, as the
  all-reduce packs its own buckets): ``"tree"`` — parameter-tree order
  (``tree_position``), as XLA's all-reduce combiner packs the operands of the trainer's
  ``psum``; ``"backward"`` — the order the backward pass produces them. A bucket is complete
  when the earliest of its ops in the forward (the latest in the backward) has its gradient.
  The parameters outside quantizable ops (biases, norms) join the bucket completed last.
  """
  if order not in ("tree", "backward"):
    raise ValueError(f"bucket order {order!r} must be 'tree' or 'backward'.")
  ops = profile.ops
  weighted = [i for i in range(len(ops)) if ops[i].param_elems > 0]
  if order == "tree":
    weighted.sort(key=lambda i: tree_position(ops[i].name))
  else:
    weighted.reverse()
  sizes = [4 * ops[i].param_elems for i in weighted]
  runs = [[weighted[j] for j in run] for run in pack(sizes, bucket_bytes)]
  out = sorted(((min(run), sum(4 * ops[i].param_elems for i in run)) for run in runs), reverse=True)
  rest = max(profile.memory["param_bytes"] - sum(4 * o.param_elems for o in ops), 0)
  if out and out[-1][0] == 0:
    out[-1] = (0, out[-1][1] + rest)
  elif rest > 0 or not out:
    out.append((0, rest))
  return out


def build_graph(groups: Sequence[GroupCost], comm: Comm, cost_fn=None) -> list[Node]:
  """The step graph of all ``groups`` with their shared all-reduce; see the module docstring.

  ``cost_fn(group, op_index)`` defaults to ``op_costs`` (a caller replaying many plans may
  pass a memoized one)."""
  cost_fn = cost_fn or op_costs
  nodes: list[Node] = []

  def add(node: Node) -> int:
    nodes.append(node)
    return len(nodes) - 1

  closing = []  # per group: {op index: node index of its drhs}
  last = []
  for g in groups:
    prof = g.profile
    scale = g.batch_per_device / prof.batch_per_device
    prev: tuple[int, ...] = ()
    drhs_nodes = {}
    costs = [cost_fn(g, i) for i in range(len(prof.ops))]
    for op, c in zip(prof.ops, costs):
      for kind in ("cast_in", "fwd"):
        if kind in c:
          ms, p = c[kind]
          node_kind = "cast" if kind.startswith("cast") else kind
          prev = (add(Node(f"{op.name} {kind}", node_kind, g.name, "compute", ms, prev, op.name, p)),)
    for part in ("fwd", "bwd"):
      ms = scale * prof.remainder_ms[part]
      prev = (add(Node(f"remainder {part}", "remainder", g.name, "compute", ms, prev)),)
    for i in reversed(range(len(prof.ops))):
      op, c = prof.ops[i], costs[i]
      for kind in ("cast_bwd", "dlhs", "drhs"):
        if kind in c:
          ms, p = c[kind]
          node_kind = "cast" if kind.startswith("cast") else kind
          prev = (add(Node(f"{op.name} {kind}", node_kind, g.name, "compute", ms, prev, op.name, p)),)
      drhs_nodes[i] = prev[0]
    closing.append(drhs_nodes)
    last.append(prev[0])

  comm_prev: tuple[int, ...] = ()
  comm_nodes = []
  plan = buckets(groups[0].profile, comm.bucket_bytes, comm.bucket_order)
  for b, (op_index, nbytes) in enumerate(plan):
    ready = tuple(closing[j][op_index] for j in range(len(groups)))
    ms = allreduce_ms(nbytes, comm.n_devices, comm.link_gbps, comm.latency_us)
    comm_prev = (
      add(
        Node(
          f"all-reduce bucket {b} ({nbytes / 2**20:.1f} MiB)",
          "comm",
          "allreduce",
          "comm",
          ms,
          ready + comm_prev,
        )
      ),
    )
    comm_nodes.append(comm_prev[0])

  total = sum(nbytes for _, nbytes in plan)
  for j, g in enumerate(groups):
    prev = (last[j],)
    for b, (_, nbytes) in enumerate(plan):
      name = "optimizer" if len(plan) == 1 else f"optimizer (bucket {b})"
      ms = g.profile.optimizer_ms * nbytes / total
      prev = (add(Node(name, "optimizer", g.name, "compute", ms, (*prev, comm_nodes[b]))),)
  return nodes


def longest_path(nodes: Sequence[Node]) -> list[tuple[float, float]]:
  """``(start, end)`` ms of every node: it starts when all its deps have ended (at 0 without
  deps). A negative remainder (the fitted correction where standalone op timings exceed their
  cost inside the step, as on a busy host) moves everything after it earlier by its full
  amount, even past 0, so that a refit reproduces any step it is fitted to."""
  times: list[tuple[float, float]] = []
  for node in nodes:
    start = max((times[d][1] for d in node.deps), default=0.0)
    times.append((start, start + node.ms))
  return times
