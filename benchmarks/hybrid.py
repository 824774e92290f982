"""Joint batch × precision plans on hybrid pools, against the best baseline and the pool's bound (modeled).

For each pool of the catalog (``POOLS``: a training group and one or two inference groups at
their datasheet memory), each topology (``TOPOLOGIES``: the training group on NVLink, 100 or
25 Gbit/s between hosts, and the what-if of free links) and each model at real size
(``benchmarks.common.zoo.HYBRID_MODELS``: ResNet-50 at 224², BERT-base at sequence 128 and 512,
GPT-2-medium- and GPT-2-large-sized LMs at sequence 1024), the model's ops are traced
(abstractly: nothing runs) and its memory counted by its shapes (parameters, Adam state,
gradients, batch, the ops' saved activations: ``benchmarks.common.op_profile.traced_memory``)
plus the rest of the step (logits, the loss's buffers, XLA's temporaries) fitted to XLA:GPU's
compiled peak of its step (``op_profile.fitted_memory``, ``benchmarks.diagnosis.traced_memory_gpu``),
every device is costed from the catalog (``planners.predictor.modeled``), and
``planners.allocator.joint`` plans it at each gradient sync of ``SYNCS``, in every mode
(replicated or sharded optimizer update, micro-steps where a batch does not fit at once). The training group runs ``qsync plan``'s default precision (fp16 mixed
precision on a V100, bf16 elsewhere). Printed and written as rows: every candidate's predicted
samples/s, accuracy cost, mode, sync and micro-steps, its ratio to the best baseline (the fastest
of ``planners.allocator.bound.BASELINES``: equal batches, dynamic batching and the training group alone, at the
training precision, accumulating and at 8-bit auto policies, at every sync), the pool's bound,
and what limits the chosen plan (``planners.allocator.summary``). Every figure is **modeled**
(catalog roofline + replay), not measured. The sensitivities Ω are measured where
``benchmarks.diagnosis.hybrid_omega`` has written the model's table (``omega_path``: the ``gradient``
indicator's Ω of every op and the accuracy cost of every gradient payload at the pools' device
counts, measured on one GPU); each candidate is then charged its payload's cost on Ω's scale
(``planners.allocator.search.with_payload_cost``), as ``qsync plan`` charges it, and rows and
printout say ``omega: "measured <device>"``. A model without a table is planned with a synthetic
draw (``synthetic_omega``: a seeded exponential per op, int8 : fp8 : 16-bit = 1 : 1/2 : 1/50;
``omega: "synthetic"``) whose costs compare plans of one model, not models, and its payloads'
accuracy cost is not measured (the widest payload within the slack wins).

  python -m benchmarks.hybrid                    # every 2-group pool × topology × model, minutes on a CPU
  python -m benchmarks.hybrid --pools A100+L4+T4 # the 3-group pool (slower: two inference groups)
  python -m benchmarks.hybrid --models bert_s128 --pools A100+T4 --topologies 100G
  python -m benchmarks.hybrid --tiny --models bert_s128 --pools A100+T4 --topologies 25G  # CPU sizes, seconds;
                                                 # appends no rows unless --results is given
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from benchmarks.common.op_profile import base_profile, fitted_memory, traced_record
from benchmarks.common.result_rows import append_rows, result_row, results_path, script_dir
from benchmarks.common.zoo import HYBRID_MODELS
from planners.allocator.bound import best_baseline, pool_bound
from planners.allocator.greedy import make_problem
from planners.allocator.joint import joint_plan, plan_of
from planners.allocator.payloads import NOT_MEASURED, payload_accuracy
from planners.allocator.search import precision_counts
from planners.allocator.summary import summarize
from planners.indicator import load as load_indicator
from planners.indicator import unreached_note
from planners.planning import train_precision
from planners.predictor.modeled import modeled_profile
from planners.predictor.replay import predict
from planners.report import table
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.devices import device

RESULTS = results_path("hybrid")
OMEGA_DIR = script_dir("hybrid")
"""Where ``benchmarks.diagnosis.hybrid_omega`` writes the models' measured Ω tables (``omega_path``)."""

POOLS = {
  "V100+T4": (("V100", 4), ("T4", 4)),
  "A100+T4": (("A100", 4), ("T4", 4)),
  "H100+L4": (("H100", 4), ("L4", 4)),
  "A100+A10": (("A100", 4), ("A10", 4)),
  "A100+L4": (("A100", 4), ("L4", 4)),
  "H100+T4": (("H100", 4), ("T4", 4)),
  "1xA100+7xT4": (("A100", 1), ("T4", 7)),
  "1xA100+7xA10": (("A100", 1), ("A10", 7)),
  "1xH100+7xL4": (("H100", 1), ("L4", 7)),
  "A100+L4+T4": (("A100", 4), ("L4", 2), ("T4", 2)),
}
"""pool → ((device type, count), …): the training group first, then the inference groups."""
TWO_GROUP_POOLS = tuple(name for name, groups in POOLS.items() if len(groups) == 2)
SYNCS = ("fp32", "bf16", "global_qsgd")
"""The gradient syncs every pool is planned at (``qsync plan --sync auto`` without fp16, whose
payload is bf16's size), chosen by ``qsync plan``'s rule (``planners.allocator.joint.joint_plan``):
the least accuracy cost within the slack of the fastest, each candidate charged its payload's cost
as the model's measured table gives it at the devices that run (``omega_path``); without a table, or at a device
count it did not measure, nothing is charged and among plans within the slack the widest payload wins."""
SLOW_LINK_GBPS = 25.0
"""A topology at most this fast between hosts is a slow-link pool (``payload_check``)."""

NVLINK_GBPS = 2400.0
"""Between two devices of the training group: NVLink, 300 GB/s."""
FREE_LINKS_GBPS = 1e6
TOPOLOGIES = {"100G": 100.0, "25G": 25.0, "free": FREE_LINKS_GBPS}
"""topology → Gbit/s between hosts (every device's ``link_gbps``); the training group on NVLink
(``intra_link_gbps``), an inference group's devices on the inter-host link. ``free`` is a
what-if, not a cluster: every link, NVLink included, at ``FREE_LINKS_GBPS``, so the gradients
cost only the collectives' latency; it separates what communication costs every candidate
from what the plan's precisions and batches leave of the headroom to the bound."""


def traced(name: str, tiny: bool = False) -> dict:
  """The model's ops at its per-device batch (``tiny``: its CPU size), as
  ``benchmarks.diagnosis.roofline`` records them, and its memory by its shapes with the rest of the
  step fitted on XLA:GPU (``benchmarks.common.op_profile.traced_record``, ``fitted_memory``)."""
  record = traced_record(name, tiny)
  return {**record, "memory": fitted_memory(name, record["memory"], record["batch_per_device"])}


def omega_path(model: str, tiny: bool = False, directory: str = OMEGA_DIR) -> str:
  """``<directory>/omega_<model>.json`` (``tiny``: ``omega_<model>.tiny.json``): the model's measured
  Ω table (``benchmarks.diagnosis.hybrid_omega``)."""
  return os.path.join(directory, f"omega_{model}{'.tiny' if tiny else ''}.json")


def sensitivities(model: str, op_names, tiny: bool = False, directory: str = OMEGA_DIR) -> tuple[dict, str]:
  """``(indicator, how it was obtained)`` for planning ``model`` (its ops ``op_names``): its measured
  table where ``omega_path`` holds one (``planners.indicator.load``; ``"measured <device>"``), else
  ``synthetic_omega`` (``"synthetic"``, no payload section). A table that lacks one of the ops is a
  ``SystemExit`` naming the file and the fix (it was measured on another model or size)."""
  path = omega_path(model, tiny, directory)
  if not os.path.exists(path):
    return synthetic_omega(op_names), "synthetic"
  table = load_indicator(path)
  missing = [op for op in op_names if op not in table["omega"]]
  if missing:
    raise SystemExit(
      f"{path}: no Ω for op(s) {missing[:3]}{'…' if len(missing) > 3 else ''} of {model!r}. Fix: measure it "
      f"again (python -m benchmarks.diagnosis.hybrid_omega --models {model}{' --tiny' if tiny else ''}), or "
      "remove the file to plan with the synthetic draw."
    )
  return table, f"measured {table['metadata'].get('device', '?')}"


def omega_note(model: str, indicator: dict, label: str, path: str) -> str:
  """One line on how ``model``'s Ω and its payloads' accuracy costs were obtained (``path``: its
  ``omega_path``)."""
  if label == "synthetic":
    return (
      f"{model}: Ω synthetic (a seeded draw: no measured table at {os.path.relpath(path)}); payload accuracy "
      f"cost {NOT_MEASURED}"
    )
  meta = indicator["metadata"]
  return (
    f"{model}: Ω {label} (gradient indicator on {meta.get('batches')} batches of {meta.get('batch')}, "
    f"judged at a batch of {meta.get('loss_batch_size')}, {meta.get('train_steps')} fp32 steps, seed "
    f"{meta.get('seed')}, jax {meta.get('jax_version')}); payload accuracy cost "
    f"{payload_accuracy(indicator.get('payload'))}"
    + (f"; {note}" if (note := unreached_note(indicator, meta.get("train_steps", 0))) else "")
  )


def synthetic_omega(op_names, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  out = {}
  for name in op_names:
    s = float(rng.exponential())
    out[name] = {"int8": s, "fp8": s / 2, "fp16": s / 50, "bf16": s / 50, "fp32": 0.0}
  return {"omega": out}


def pool_cluster(pool: str, topology: str, batch_per_device: int) -> ClusterSpec:
  """The groups of ``pool`` (``train``, then ``infer`` or ``infer_<type>``) at their datasheet
  memory and the spec's ``batch_per_device``, linked as ``topology`` says."""
  link = TOPOLOGIES[topology]
  (train_dev, train_n), *inference = POOLS[pool]
  nvlink = max(NVLINK_GBPS, link)
  groups = [
    DeviceGroup("train", train_dev, train_n, device(train_dev).memory_gb, batch_per_device, link, nvlink)
  ]
  for dev, n in inference:
    name = "infer" if len(inference) == 1 else f"infer_{dev}"
    groups.append(DeviceGroup(name, dev, n, device(dev).memory_gb, batch_per_device, link))
  return ClusterSpec(tuple(groups), name=f"{pool}@{topology}")


def plan_pool(model: dict, pool: str, topology: str, granularity: int, slack: float, indicator=None):
  """``(problem, profiles, chosen, candidates, planning seconds, search)`` of ``pool`` at ``topology``,
  its ops' and payloads' accuracy costs from ``indicator`` (default: ``synthetic_omega``)."""
  base = base_profile(model)
  cluster = pool_cluster(pool, topology, model["batch_per_device"])
  profiles = {g.device_type: modeled_profile(base, g.device_type) for g in cluster.groups}
  preset = train_precision(cluster, ("train",), None)
  indicator = synthetic_omega(base.op_names) if indicator is None else indicator
  problem = make_problem(cluster, profiles, indicator, ["train"], preset)
  t0 = time.perf_counter()
  chosen, cands, search = joint_plan(problem, granularity, slack, syncs=SYNCS)
  return problem, profiles, chosen, cands, time.perf_counter() - t0, search


def speeds(bound) -> list[float]:
  """Each inference group's per-device speed over a training device's at their fastest
  precisions, compute alone (the bound's slopes ``s_train / s_g``)."""
  slope_train = bound.affine[0][1]
  return [slope_train / s for _, s in bound.affine[1:]]


def chosen_label(chosen) -> str:
  """``"name (batches[, micro-steps][, mode][, sync])"``: the candidate, its per-device batches
  (training group first), its micro-steps where it accumulates, its mode where it is not the flat
  all-reduce with the replicated update, and its gradient sync where it is not fp32 (with its
  payload's measured accuracy cost, where measured)."""
  name = chosen.name.replace("training groups only", "training only")
  parts = ["/".join(map(str, chosen.batches))]
  if chosen.micro_steps and max(chosen.micro_steps) > 1:
    parts.append("micro-steps " + "/".join(map(str, chosen.micro_steps)))
  mode = {("flat", "sharded"): "sharded update", ("two_level", "replicated"): "two-level"}.get(chosen.mode)
  parts += [mode] if mode else []
  if chosen.sync != "fp32":
    cost = f": payload Ω {chosen.payload_cost:.2g}" if chosen.payload_cost is not None else ""
    parts.append(f"{chosen.sync} sync{cost}")
  return f"{name} ({', '.join(parts)})"


def accuracy_cell(chosen, omega: str) -> str:
  """The chosen plan's accuracy cost and its payload's part of it (``"not measured"`` where the
  table has no figure for its sync and devices), ``"(synthetic)"`` after a synthetic draw's."""
  payload = f"{chosen.payload_cost:.2g}" if chosen.payload_cost is not None else "not measured"
  return f"{chosen.cost:.2g} (payload {payload})" + (" (synthetic)" if omega == "synthetic" else "")


def payload_check(plans, slack: float) -> str:
  """One line on the slow-link cases (``plans``: ``(case, chosen, candidates)`` at ``SLOW_LINK_GBPS`` or
  less): how many chose a payload other than fp32, and for those at fp32 whether a plan of the search
  at another payload is predicted faster by more than ``slack`` (the rule says none is; the line
  names any that is), with the fastest such plan over the fp32 one (modeled)."""
  at_fp32 = []
  for case, chosen, cands in plans:
    if chosen.sync == "fp32":
      others = [c.samples_per_s for c in cands if c.fits and not c.reference and c.sync != "fp32"]
      at_fp32.append((case, max(others) / chosen.samples_per_s if others else None))
  ratios = [r for _, r in at_fp32 if r is not None]
  beyond = [case for case, r in at_fp32 if r is not None and r > 1 + slack + 1e-9]
  span = f"{min(ratios):.2f}–{max(ratios):.2f}×" if ratios else "–"
  return (
    f"slow links (≤ {SLOW_LINK_GBPS:g} Gbit/s): the chosen payload is not fp32 in {len(plans) - len(at_fp32)} "
    f"of {len(plans)} cases; at fp32 in {len(at_fp32)}, where the fastest plan at a narrower payload is "
    f"{span} the fp32 plan (modeled; fp32 is chosen only where no plan at another payload is faster by "
    f"more than the slack {slack:g})"
    + (f"; beyond the slack in {', '.join(beyond)}" if beyond else "; beyond the slack in none")
  )


def markdown_table(cases: dict) -> str:
  """One markdown row per pool × model from ``cases[(pool, model)][topology] = (chosen,
  best baseline samples/s, bound samples/s, Limits, best baseline)``: the chosen plan at 100G
  and 25G (its batches, micro-steps, mode and sync: ``chosen_label``), the best baseline at 25G,
  its gain over the best baseline, the bound over the best baseline at 100G, 25G and with free
  links, the plan over the best baseline with free links, and what limits the plan at 100G."""
  headers = [
    "pool",
    "model",
    "chosen at 100G",
    "chosen at 25G",
    "best baseline at 25G",
    "gain vs best baseline, 100G / 25G",
    "bound samples/s",
    "bound / best baseline, 100G / 25G / free links",
    "plan / best baseline, free links",
    "limited by at 100G: group; exposed comm / optimizer ms",
  ]
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  for (pool, model), by_topology in cases.items():

    def at(topology, fmt, by=by_topology):
      return fmt(*by[topology]) if topology in by else "–"

    lim = by_topology.get("100G", (None, None, None, None, None))[3]
    cells = [
      pool,
      model,
      at("100G", lambda c, *_: chosen_label(c)),
      at("25G", lambda c, *_: chosen_label(c)),
      at("25G", lambda c, best, bound, lim, base: chosen_label(base)),
      " / ".join(at(t, lambda c, best, *_: f"{c.samples_per_s / best:.2f}×") for t in ("100G", "25G")),
      at("100G", lambda c, best, bound, *_: f"{bound:.1f}"),
      " / ".join(at(t, lambda c, best, bound, *_: f"{bound / best:.2f}") for t in ("100G", "25G", "free")),
      at("free", lambda c, best, *_: f"{c.samples_per_s / best:.3f}"),
      f"{lim.straggler}; {lim.exposed_comm_ms:.0f} / {lim.optimizer_ms:.1f}" if lim else "–",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.hybrid", description=__doc__.splitlines()[0])
  ap.add_argument("--models", default=",".join(HYBRID_MODELS))
  ap.add_argument("--pools", default=",".join(TWO_GROUP_POOLS), help=f"comma-separated of {list(POOLS)}")
  ap.add_argument("--topologies", default=",".join(TOPOLOGIES), help=f"comma-separated of {list(TOPOLOGIES)}")
  ap.add_argument("--granularity", type=int, default=1)
  ap.add_argument("--slack", type=float, default=0.02)
  ap.add_argument(
    "--tiny", action="store_true", help="the models' CPU sizes and their omega_<model>.tiny.json"
  )
  ap.add_argument("--omega-dir", default=OMEGA_DIR, help="where the measured Ω tables are (omega_path)")
  ap.add_argument("--results", default=None, help=f"rows to append to (default {RESULTS}; none with --tiny)")
  args = ap.parse_args(argv)
  results = args.results if args.results is not None else (None if args.tiny else RESULTS)
  pools, topologies = args.pools.split(","), args.topologies.split(",")
  for given, known, flag in ((pools, POOLS, "--pools"), (topologies, TOPOLOGIES, "--topologies")):
    unknown = [x for x in given if x not in known]
    if unknown:
      raise SystemExit(f"{flag}: unknown {unknown}. Fix: use some of {list(known)}, comma-separated.")
  host = jax.devices()[0].device_kind
  rows, summary, cases, slow, notes = [], [], {}, [], []
  for name in args.models.split(","):
    model = traced(name, args.tiny)
    op_names = [op["name"] for op in model["ops"]]
    indicator, omega = sensitivities(name, op_names, args.tiny, args.omega_dir)
    notes.append(omega_note(name, indicator, omega, omega_path(name, args.tiny, args.omega_dir)))
    for pool in pools:
      for topology in topologies:
        problem, profiles, chosen, cands, seconds, search = plan_pool(
          model, pool, topology, args.granularity, args.slack, indicator
        )
        pred = predict(problem.cluster, profiles, plan_of(problem, chosen))
        result = summarize(chosen, cands, search, pred)
        bound, base = pool_bound(search), best_baseline(cands)
        case = f"{pool}@{topology}/{name}"
        if TOPOLOGIES[topology] <= SLOW_LINK_GBPS:
          slow.append((case, chosen, cands))
        counts = precision_counts(problem, chosen)
        mixes = [
          ", ".join(f"{p}×{n}" for p, n in sorted(counts.get(g.name, {}).items())) or "(sits out)"
          for g in problem.cluster.groups[1:]
        ]
        lim = result.limits
        if base is not None:
          cases.setdefault((pool, name), {})[topology] = (
            chosen,
            base.samples_per_s,
            bound.samples_per_s,
            lim,
            base,
          )
        summary.append(
          [
            pool,
            topology,
            name,
            chosen_label(chosen),
            " | ".join(mixes),
            f"{chosen.samples_per_s:.1f}",
            accuracy_cell(chosen, omega),
            f"{chosen_label(base)} {base.samples_per_s:.1f}" if base else "-",
            f"{result.gain:.2f}×" if base else "-",
            f"{bound.samples_per_s:.1f}",
            f"{100 * result.headroom_captured:.0f} %" if result.headroom_captured is not None else "-",
            f"{lim.straggler}; {lim.exposed_comm_ms:.0f} / {lim.optimizer_ms:.1f}",
            " / ".join(f"{s:.2f}" for s in speeds(bound)),
            f"{seconds:.1f}",
          ]
        )
        common = {"topology": topology, "slack": args.slack, "granularity": args.granularity, "omega": omega}
        for c in cands:
          rows.append(
            result_row(
              "hybrid",
              f"{case}/{c.name}",
              "modeled_samples_per_s",
              c.samples_per_s,
              base.samples_per_s if base else None,
              host,
              accuracy_cost=c.cost,
              payload_accuracy_cost=c.payload_cost,
              batch_per_device=list(c.batches),
              reduction=c.mode[0],
              optimizer_update=c.mode[1],
              sync=c.sync,
              micro_steps=list(c.micro_steps) or None,
              reference=c.reference,
              fits=c.fits,
              chosen=c is chosen,
              **common,
            )
          )
        if base is not None:
          rows.append(
            result_row(
              "hybrid",
              f"{case}/best baseline",
              "modeled_samples_per_s",
              base.samples_per_s,
              None,
              host,
              name=base.name,
              reduction=base.mode[0],
              optimizer_update=base.mode[1],
              sync=base.sync,
              **common,
            )
          )
        rows.append(
          result_row(
            "hybrid",
            f"{case}/bound",
            "modeled_samples_per_s",
            bound.samples_per_s,
            base.samples_per_s if base else None,
            host,
            batch_per_device=list(bound.batches),
            **common,
          )
        )
        rows.append(
          result_row(
            "hybrid",
            case,
            "modeled_gain_vs_best_baseline",
            result.gain,
            None,
            host,
            chosen=chosen.name,
            sync=chosen.sync,
            payload_accuracy=payload_accuracy(problem.payload),
            headroom_captured=result.headroom_captured,
            limited_by=lim.to_json(),
            **common,
          )
        )
        rows.append(
          result_row("hybrid", case, "planning_s", seconds, None, host, replays=search.replays, **common)
        )
        print(
          f"  … {case}: {chosen.name} {chosen.samples_per_s:.1f} samples/s (modeled), {seconds:.1f} s",
          flush=True,
        )
  print(
    "\nthe chosen plan (modeled). batches: per device, training group first; best baseline: the fastest of "
    "equal batches, dynamic batching and the training group alone, each at the training precision, accumulating and at "
    "8-bit auto policies, at every sync; gain: the plan over it; bound: every device at its "
    "fastest precision, the batch split by speed, no communication; headroom: (plan − best) / "
    "(bound − best); "
    "limited by: the straggling group; its all-reduce time not overlapped with its compute / its optimizer "
    "update (ms); infer/train speed: an inference device's per-device speed over a training device's at "
    "their fastest precisions, compute alone; accuracy cost: Ω of the plan's ops and its payload's part of it "
    "(measured or synthetic: the lines under the tables say which, per model):"
  )
  headers = [
    "pool",
    "links",
    "model",
    "chosen (batches, micro-steps, mode, sync)",
    "infer precisions",
    "samples/s",
    "accuracy cost (payload)",
    "best baseline",
    "gain",
    "bound",
    "headroom",
    "limited by",
    "infer/train speed",
    "plan s",
  ]
  print(table(headers, summary))
  print("\nper pool × model (modeled; docs/planning.md):\n" + markdown_table(cases))
  print("\nsensitivities and payload accuracy costs:\n" + "\n".join(f"  {note}" for note in notes))
  if slow:
    print(payload_check(slow, args.slack))
  if results is None:
    print(f"{len(rows)} rows not appended (--tiny: pass --results FILE to keep them)")
    return 0
  append_rows(results, rows)
  print(f"appended {len(rows)} rows to {results}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
