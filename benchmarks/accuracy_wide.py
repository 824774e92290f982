"""The accuracy testbed where ``auto_policy`` keeps 8-bit: byte LMs of width 2048 on the Python
standard library's source, trained on one GPU under each policy over paired seeds
(``python -m benchmarks.accuracy_gpu wide``).

Models (``MODELS``): ``examples.models.transformer.TransformerLM`` with d = 2048, 16 heads of 128,
2 blocks, sequence 256, byte vocabulary, bf16 modules (float32 parameters), on the first 24 MB of
the standard library's source (``examples.data.stdlib_text``; the last 10 % held out): ``gpt``
(pre-LayerNorm, GELU MLP of 4 d; 102.3 M parameters) and ``llama`` (RMSNorm, SwiGLU of 5632, no
biases; 104.3 M). Training: AdamW (weight decay 0.1, gradients clipped at global norm 1), linear warmup
over 100 steps then cosine decay to a tenth of the peak learning rate 5e-4, 1,000 steps of 32
sequences (8,192 tokens). Held-out loss: the plain model (bf16 modules) on the first 2,048 windows
(524,288 tokens) of the held-out split.

Policies (every op not named runs bf16; embedding lookups as written; attention products bf16,
fused on a GPU):

* ``bf16``: every op bf16 — the model's own program and ``auto_policy``'s base;
* ``int8_dense`` / ``fp8_dense``: that preset on every Dense and DenseGeneral (q/k/v/out, the MLP,
  the head);
* ``auto``: ``planners.allocator.auto_policy`` with its default accuracy budget, measured on this GPU
  first (its ``gradient`` indicator included);
* ``auto_speed``: the fastest candidate of the same search (the ``"speed"`` budget's choice).

A policy whose 8-bit set equals an earlier one's is not trained again (its rows repeat that one's,
marked ``same_as``). Each policy's training step (``planners.profiler.timing.single_device_step``: the
task's loss under the policy, its gradient, the optax update) is compiled once and trains every seed
(seed s: the same initial weights and batches under every policy); the next policy's step compiles
in a background thread while this one trains (so XLA's autotuning of that step shares the GPU with
the training). After training, each policy's step (and bf16's) is timed alone (round-robin) on this GPU; the
search's own interleaved timing of its candidates is in the search row. The search is then run again to time loading its cached
result.

Rows (``accuracy_gpu.jsonl``; the rows of one invocation share a ``run`` id): ``wide/<model>/<policy>``
held-out loss per seed (with the policy's 8-bit ops and their Ω from the search's indicator),
``wide/<model>/<policy>`` ``step_ms`` (timed alone), ``wide/<model>/search`` ``search_s`` (its
seconds per phase, the training steps it compiled, the sets it pruned, its indicator table and
the cached load's seconds). ``--search-only``: the search row alone. ``--skip-done``: the seeds the
jsonl already holds for this setup and device are not trained again, a policy with rows trains
the 8-bit set they record, and the search runs only for an auto policy without rows or where no
search row has an indicator table for a policy to train (Ω from the latest such row). The tables (``table``) read every row, whichever run wrote it: a
seed's last row, each step's speed-up against the bf16 step of its own run.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import zoo
from benchmarks.common.result_rows import mean_std, result_row
from planners.allocator import auto_policy
from planners.allocator.frontier import omega_cost
from planners.allocator.payoff import policy_of, traced_ops
from planners.profiler import timing
from qsync_jax.train.train_step import init_variables

MODELS = {
  "gpt": dict(width=2048, depth=2, heads=16, seq=256, max_bytes=24_000_000, block="gpt"),
  "llama": dict(width=2048, depth=2, heads=16, seq=256, max_bytes=24_000_000, block="llama"),
}
TINY = dict(width=32, depth=1, heads=2, seq=16, max_bytes=200_000)
"""``--tiny``: the same path at a CPU size."""
POLICIES = ("bf16", "auto", "auto_speed", "int8_dense", "fp8_dense")
"""Trained in this order: bf16 and auto's first, so that a run cut short keeps the comparison."""
DENSE_KINDS = ("dense", "dense_general")
TINY_SEARCH = dict(trace_repeats=1, step_repeats=2, rounds=1, indicator_steps=2, indicator_batches=1)


def task_of(model: str, tiny: bool, depth: int | None = None):
  """``model``'s task (``MODELS``; ``TINY`` sizes with ``tiny``), with ``depth`` blocks if given."""
  cfg = {**MODELS[model], **(TINY if tiny else {}), **({"depth": depth} if depth else {})}
  return zoo.gpt(**cfg, dtype=jnp.bfloat16)


def policy_sets(ops, found, recorded: dict | None = None) -> dict[str, dict[str, str]]:
  """``{policy: {op: 8-bit preset}}`` of ``POLICIES`` (module docstring); ``found``: the search
  (None: none run); ``recorded``: ``Recorded.sets``, the sets earlier rows trained, which win (a
  run that adds seeds trains the set the earlier seeds trained)."""
  dense = [op.name for op in ops if op.kind in DENSE_KINDS]
  sets = {"bf16": {}, "int8_dense": {op: "int8" for op in dense}, "fp8_dense": {op: "fp8" for op in dense}}
  if found is not None:
    sets["auto"] = dict(found.chosen)
    sets["auto_speed"] = dict(found.candidates[found.speed_winner or found.winner])
  return {**sets, **(recorded or {})}


def omega_of_set(table, chosen, base: str = "bf16") -> float | None:
  """Σ Ω above ``base`` of ``chosen``'s ops from an indicator ``table`` ({op: {precision: Ω}};
  None: no table, no Ω)."""
  if table is None:
    return None
  cost = omega_cost(table, base)
  return sum(cost(op, preset) for op, preset in chosen.items())


class Recorded(NamedTuple):
  """What ``--jsonl`` already holds for one model, setup and device (rows not ``superseded``):
  ``seeds`` ({policy: seeds with a held-out row}), ``sets`` ({policy: the 8-bit set those rows
  trained}), ``omega`` ({policy: (Ω, Ω fraction)} of those rows), and the latest search row with
  an indicator table (``search``; None if none)."""

  seeds: dict[str, set[int]]
  sets: dict[str, dict[str, str]]
  omega: dict[str, tuple]
  search: dict | None


def recorded_rows(path: str, model: str, setup: str, device: str) -> Recorded:
  """``Recorded`` of the rows of ``path`` (none where the file is missing)."""
  rows = []
  if os.path.exists(path):
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  mine = [
    r
    for r in rows
    if r["case"].startswith(f"wide/{model}/") and r.get("setup") == setup and r["device"] == device
    if not r.get("superseded")
  ]
  seeds, sets, omega = {}, {}, {}
  for r in mine:
    if r["metric"] == "held-out loss":
      policy = r["case"].split("/")[2]
      seeds.setdefault(policy, set()).add(r["seed"])
      sets[policy] = r.get("eight_bit") or {}
      omega[policy] = (r.get("omega"), r.get("omega_fraction"))
  search = next((r for r in reversed(mine) if r["metric"] == "search_s" and r.get("omega")), None)
  return Recorded(seeds, sets, omega, search)


class Trainer:
  """One model's compiled pieces shared by every policy: the jitted init (per seed), optimizer init,
  held-out batches and the jitted evaluation; ``compile(policy)``: a policy's step, ahead of time."""

  def __init__(self, task, optimizer, batch, eval_windows: int, eval_batch: int):
    self.task, self.optimizer, self.batch = task, optimizer, batch
    self.promotion = (
      jax.config.jax_numpy_dtype_promotion
    )  # a thread's own setting: compile() may run in another
    self.init = jax.jit(lambda sample, seed: init_variables(task, seed, sample)[0])
    self.opt_init = jax.jit(optimizer.init)

    def evaluate(variables, b):
      loss, metrics = task.loss(task.model.apply(variables, *task.inputs(b), **task.eval_kwargs), b)
      return loss, metrics.get("accuracy", jnp.float32(jnp.nan))

    self.eval_fn = jax.jit(evaluate)
    n = max(eval_windows // eval_batch, 1)
    self.eval_batches = [
      jax.tree_util.tree_map(jnp.asarray, b) for b in itertools.islice(task.eval_batches(eval_batch), n)
    ]
    variables = self.init(batch, 0)  # compiles init, optimizer init and evaluation here, in this thread
    self.abstract = jax.eval_shape(lambda v: (v, optimizer.init(v["params"])), variables)
    self.opt_init(variables["params"])
    self.eval_fn(variables, self.eval_batches[0])

  def compile(self, policy):
    """The step of ``policy``, compiled (in any thread: under the dtype promotion this model's
    pieces were built under)."""
    step = timing.single_device_step(self.task, policy, self.optimizer)
    variables, opt_state = self.abstract
    with jax.numpy_dtype_promotion(self.promotion):
      return step.lower(variables, opt_state, self.batch, jax.random.key(0)).compile()

  def train(self, step, seed: int, steps: int, log_every: int, say):
    """``(variables, opt_state, last training loss, steps run)`` of ``steps`` steps from seed
    ``seed``'s initial weights on its batches; stops where a logged loss is not finite."""
    stream = self.task.train_batches(int(jax.tree_util.tree_leaves(self.batch)[0].shape[0]), seed)
    variables = self.init(self.batch, seed)
    opt_state = self.opt_init(variables["params"])
    key, loss, ran = jax.random.key(seed), jnp.float32(jnp.nan), 0
    for ran in range(1, steps + 1):
      batch = jax.tree_util.tree_map(jnp.asarray, next(stream))
      variables, opt_state, loss = step(variables, opt_state, batch, jax.random.fold_in(key, ran))
      if ran % log_every == 0 or ran == steps:
        value = float(loss)
        say(f"seed {seed}: step {ran}, loss {value:.4f}")
        if not math.isfinite(value):
          break
    return variables, opt_state, float(loss), ran

  def held_out(self, variables) -> tuple[float, float]:
    out = [self.eval_fn(variables, b) for b in self.eval_batches]
    return float(np.mean([float(loss) for loss, _ in out])), float(np.mean([float(a) for _, a in out]))


def run_model(model: str, args, make_optimizer, write, say) -> list[dict]:
  """Searches, trains every policy over ``args.seeds`` with ``make_optimizer(lr, steps, warmup)``,
  times each step alone; writes each row as soon as it exists (``write``) and returns them.
  ``args.search_only``: the search alone. ``args.skip_done``: the seeds ``args.jsonl`` already holds
  (same setup and device) are not trained again, a policy with rows keeps the set they trained, and
  the search runs only where an auto policy has no rows or a policy to train has no Ω (no row of
  it, no search row with an indicator table; else Ω from the latest such search row)."""
  task = task_of(model, args.tiny, args.depth)
  device = jax.devices()[0].device_kind
  batch = timing.device_batch(task, args.batch, 0)
  ops = traced_ops(task, batch, 0)
  setup = f"d {task.model.d_model} x {task.model.num_layers}, lr {args.lr:g}, batch {args.batch}, {args.steps} steps"
  common = dict(steps=args.steps, lr=args.lr, batch=args.batch, setup=setup, model=model, run=args.run)
  rows = []

  def emit(row):
    rows.append(row)
    write(row)

  done = recorded_rows(args.jsonl, model, setup, device) if args.skip_done else Recorded({}, {}, {}, None)
  todo = {p: [s for s in args.seeds if s not in done.seeds.get(p, set())] for p in args.policies}
  unsearched = [p for p in args.policies if p in ("auto", "auto_speed") and p not in done.sets]
  no_omega = done.search is None and any(seeds and p not in done.omega for p, seeds in todo.items())
  found = None
  if args.search_only or unsearched or no_omega or not args.skip_done:
    found = search(model, task, ops, args, lambda row: emit({**row, **common}), say)
  if args.search_only:
    return rows
  sets = policy_sets(ops, found, done.sets)
  source = (
    {"omega": found.omega, "frontier": found.frontier.to_json() if found.frontier else None}
    if found
    else done.search
  )
  table, reference = (source or {}).get("omega"), ((source or {}).get("frontier") or {}).get("reference")

  def omega_of(policy):
    if policy in done.omega:
      return done.omega[policy]
    omega = omega_of_set(table, sets[policy])
    return omega, omega / reference if omega is not None and reference else None

  for p, seeds in todo.items():
    if len(seeds) < len(args.seeds):
      say(
        f"[{model}] {p}: seeds {sorted(set(args.seeds) - set(seeds))} are in {args.jsonl}; training {seeds}"
      )
  trainer = Trainer(
    task, make_optimizer(args.lr, args.steps, args.warmup), batch, args.eval_windows, args.eval_batch
  )
  dense = sum(op.kind in DENSE_KINDS for op in ops)

  def record(alias, seed, result, seconds):
    omega, fraction = omega_of(alias)
    emit(
      result_row(
        "accuracy_gpu", f"wide/{model}/{alias}", "held-out loss", result["loss"], None, device,
        seed=seed, eval_accuracy=result["accuracy"], train_loss=result["train_loss"], steps_run=result["ran"],
        seconds=seconds, eight_bit=sets[alias], eight_bit_dense=len(sets[alias]), dense_ops=dense,
        omega=omega, omega_fraction=fraction, same_as=result["name"] if alias != result["name"] else None,
        **common,
      )
    )  # fmt: skip

  timed = list(dict.fromkeys(["bf16", *args.policies]))  # bf16: every run's speed-ups against its own
  times = train_policies(
    trainer, ops, {p: sets[p] for p in timed}, todo, args, record, lambda m: say(f"[{model}] {m}")
  )
  for alias, ms in times.items():
    emit(
      result_row(
        "accuracy_gpu", f"wide/{model}/{alias}", "step_ms", ms[0], None, device, round_ms=ms[1], **common
      )
    )
  return rows


def search(model: str, task, ops, args, emit, say):
  """``auto_policy`` at the default budget, measured (a fresh cache), then loaded from its cache;
  emits the ``wide/<model>/search`` row and returns the search."""
  search_options = TINY_SEARCH if args.tiny else {}
  device = jax.devices()[0].device_kind
  with tempfile.TemporaryDirectory() as cache:
    say(f"[{model}] auto_policy search (default accuracy budget)")
    found = auto_policy(
      task, args.batch, progress=lambda m: say(f"[{model}] auto: {m}"), cache_dir=cache, **search_options
    )
    for line in found.summary():
      say(line)
    t0 = time.perf_counter()
    again = auto_policy(task, args.batch, cache_dir=cache, **search_options)
    load_s = time.perf_counter() - t0
  emit(
    result_row(
      "accuracy_gpu", f"wide/{model}/search", "search_s", found.search_s, None, device,
      load_s=load_s, loaded=again.loaded, winner=found.winner, speed_winner=found.speed_winner,
      step_ms=found.step_ms, candidates=found.candidates, candidate_omega=found.candidate_omega,
      frontier=found.frontier.to_json() if found.frontier else None, indicator=found.indicator,
      omega=found.omega, search_phases=found.search_phases, compiled_steps=found.compiled_steps,
      predicted_ms=found.predicted_ms, pruned=found.pruned,
      dense_ops=sum(op.kind in DENSE_KINDS for op in ops),
    )
  )  # fmt: skip
  return found


def train_policies(trainer, ops, sets, todo, args, record, say) -> dict[str, tuple[float, list[float]]]:
  """Trains each distinct set of ``sets`` ({policy: set}) over the seeds ``todo`` lists for it and
  its aliases (``record(policy, seed, result, seconds)`` for each policy missing that seed), the next
  set's step compiling in a background thread; then times every set's step alone (``time_alone``:
  from its last trained state, or from seed 0's initial one where nothing was trained) and returns
  ``{policy: (ms, round medians)}``."""
  distinct: dict[tuple, str] = {}
  for name, chosen in sets.items():
    distinct.setdefault(tuple(sorted(chosen.items())), name)
  of = {name: distinct[tuple(sorted(chosen.items()))] for name, chosen in sets.items()}
  order = list(distinct.values())
  compiled, finals = {}, {}
  with ThreadPoolExecutor(1) as pool:
    futures = {order[0]: pool.submit(trainer.compile, policy_of(ops, "bf16", sets[order[0]]))}
    for i, name in enumerate(order):
      if i + 1 < len(order):
        futures[order[i + 1]] = pool.submit(trainer.compile, policy_of(ops, "bf16", sets[order[i + 1]]))
      compiled[name] = futures[name].result()
      aliases = [p for p in sets if of[p] == name]
      for seed in sorted({s for p in aliases for s in todo.get(p, ())}):
        t0 = time.perf_counter()
        variables, opt_state, train_loss, ran = trainer.train(
          compiled[name], seed, args.steps, args.log_every, lambda m, name=name: say(f"{name} {m}")
        )
        loss, accuracy = trainer.held_out(variables)
        finals[name] = (variables, opt_state)
        result = dict(name=name, loss=loss, accuracy=accuracy, train_loss=train_loss, ran=ran)
        for alias in aliases:
          if seed in todo.get(alias, ()):
            record(alias, seed, result, time.perf_counter() - t0)
      if name not in finals:
        variables = trainer.init(trainer.batch, 0)
        finals[name] = (variables, trainer.opt_init(variables["params"]))
  times = time_alone(compiled, finals, trainer.batch, args)
  return {p: times[of[p]] for p in sets}


def time_alone(compiled, finals, batch, args) -> dict[str, tuple[float, list[float]]]:
  """``{policy: (ms, round medians)}``: each trained policy's step from its final state, round-robin
  (``timing.time_round_robin``, the default step clock: pipelined on a GPU)."""
  clock = timing.default_step_clock()
  key = jax.random.key(0)

  def runner(name):
    state = list(finals[name])

    def run():
      state[0], state[1], loss = compiled[name](state[0], state[1], batch, key)
      return loss

    return run

  rounds, repeats = (1, 2) if args.tiny else (3, 30)
  medians = timing.time_round_robin({n: runner(n) for n in compiled}, repeats, rounds, clocks=(clock,))[clock]
  return {n: (float(np.median(m)), m) for n, m in medians.items()}


def summarize(rows: list[dict], model: str) -> list[dict]:
  """Per policy of ``model``: seeds, held-out loss (mean ± std), the paired difference from bf16
  (mean, its standard error, the seeds), the 8-bit Dense ops, the Ω fraction, and the step ms of
  its latest ``step_ms`` row with its speed-up against the bf16 step of the same run (rows of one
  invocation share ``run``; rows from before ``run`` existed count as one run). Every row counts,
  whichever run wrote it; a seed with several rows: the last."""
  mine = [r for r in rows if r["case"].startswith(f"wide/{model}/")]
  step = {r["case"].split("/")[2]: r for r in mine if r["metric"] == "step_ms"}
  bf16_of_run = {
    r.get("run"): r["value"] for r in mine if r["metric"] == "step_ms" and r["case"].endswith("/bf16")
  }
  by_policy: dict[str, dict[int, dict]] = {}
  for r in mine:
    if r["metric"] == "held-out loss":
      by_policy.setdefault(r["case"].split("/")[2], {})[r["seed"]] = r
  base = by_policy.get("bf16", {})
  out = []
  for policy, per_seed in by_policy.items():
    seeds = sorted(per_seed)
    paired = [per_seed[s]["value"] - base[s]["value"] for s in seeds if s in base]
    diff, sd = mean_std(paired) if paired else (math.nan, math.nan)
    first = per_seed[seeds[0]]
    fractions = [
      per_seed[s].get("omega_fraction") for s in seeds if per_seed[s].get("omega_fraction") is not None
    ]
    ms = step[policy]["value"] if policy in step else None
    bf16_ms = bf16_of_run.get(step[policy].get("run")) if policy in step else None
    out.append(
      {
        "policy": policy,
        "seeds": seeds,
        "loss": mean_std([per_seed[s]["value"] for s in seeds]),
        "paired": (diff, sd / len(paired) ** 0.5 if len(paired) > 1 else math.nan, len(paired)),
        "eight_bit": first.get("eight_bit_dense"),
        "eight_bit_set": first.get("eight_bit"),
        "dense": first.get("dense_ops"),
        "omega_fraction": fractions[0] if fractions else None,
        "step_ms": ms,
        "speedup": bf16_ms / ms if ms and bf16_ms else None,
      }
    )
  return out


def trained_search(rows: list[dict], model: str) -> dict | None:
  """The latest search row of ``model`` whose auto and speed-only sets are the ones the auto and
  auto_speed rows trained (else the latest search row; None without one)."""
  searches = [r for r in rows if r["case"] == f"wide/{model}/search"]
  sets = {s["policy"]: s["eight_bit_set"] for s in summarize(rows, model)}

  def trained(r):
    candidates = r.get("candidates", {})
    return candidates.get(r["winner"]) == sets.get("auto") and candidates.get(r["speed_winner"]) == sets.get(
      "auto_speed"
    )

  return next((r for r in reversed(searches) if trained(r)), searches[-1] if searches else None)


def search_line(rows: list[dict], model: str) -> list[str]:
  """The line over ``model``'s table: its latest search's seconds (per phase where recorded),
  its cached reload, the earlier searches' seconds, and what auto keeps."""
  searches = [r for r in rows if r["case"] == f"wide/{model}/search"]
  if not searches:
    return []
  last = searches[-1]
  phases = ", ".join(f"{k} {v:.1f}" for k, v in (last.get("search_phases") or {}).items())
  earlier = ", ".join(f"{r['value']:.0f}" for r in searches[:-1])
  return [
    f"`{model}` ({last['setup']}): search {last['value']:.1f} s"
    + (f" ({phases} s; {last.get('compiled_steps')} training steps compiled)" if phases else "")
    + f", its cached result loaded again in {last['load_s']:.2f} s"
    + (f" (earlier searches of this model: {earlier} s)" if earlier else "")
    + f"; auto keeps `{last['winner']}`, speed-only `{last['speed_winner']}`.",
    "",
  ]


def table(rows: list[dict], model: str) -> list[str]:
  """The markdown table of ``summarize`` for ``model``, after its search's line."""
  lines = search_line(rows, model) + [
    "| policy | 8-bit Dense ops | Ω / speed-only Ω | step ms (alone) | seeds | held-out loss | − bf16, paired (± s.e.) |",
    "|---|---|---|---|---|---|---|",
  ]
  for s in summarize(rows, model):
    (loss, sd), (d, se, n) = s["loss"], s["paired"]
    paired = "–" if s["policy"] == "bf16" else (f"{d:+.4f} ± {se:.4f}" if n > 1 else f"{d:+.4f} (1 seed)")
    frac = "–" if s["omega_fraction"] is None else f"{s['omega_fraction']:.2f}"
    ms = (
      "–"
      if s["step_ms"] is None
      else f"{s['step_ms']:.2f}" + (f" ({s['speedup']:.2f}×)" if s["speedup"] else "")
    )
    seeds = ",".join(map(str, s["seeds"]))
    lines.append(
      f"| {s['policy']} | {s['eight_bit']} of {s['dense']} | {frac} | {ms} | {seeds} | {loss:.4f} ± {sd:.4f} | {paired} |"
    )
  return lines + verdict(rows, model, trained_search(rows, model))


def kept(base_ms: float, ms: float, speed_ms: float) -> float:
  """The share of the speed-only choice's time saved (against ``base_ms``) that ``ms`` keeps."""
  return (base_ms - ms) / (base_ms - speed_ms) if base_ms > speed_ms else math.nan


def verdict(rows: list[dict], model: str, search: dict | None) -> list[str]:
  """The issue's two checks for ``model``: auto's paired loss difference from bf16 in standard
  errors, and the share of speed-only's time saved that auto keeps (timed alone; in the search)."""
  by = {s["policy"]: s for s in summarize(rows, model)}
  if not {"bf16", "auto", "auto_speed"} <= set(by):
    return []
  d, se, n = by["auto"]["paired"]
  out = [
    f"auto − bf16: {d:+.4f} ± {se:.4f} over {n} seeds ({d / se:+.1f} s.e.)"
    if se > 0
    else f"auto − bf16: {d:+.4f}"
  ]
  speedups = [by[p]["speedup"] for p in ("auto", "auto_speed")]
  if None not in speedups:
    ms = [1.0, *(1 / x for x in speedups)]  # each against its own run's bf16 step
    out.append(f"auto keeps {100 * kept(*ms):.0f} % of speed-only's time saved (steps timed alone)")
  if search:
    step = search["step_ms"]
    out.append(
      f"{100 * kept(step['base'], step[search['winner']], step[search['speed_winner']]):.0f} % in the search's timing"
    )
  return ["", "; ".join(out) + "."]


def markdown(rows: list[dict], command: str) -> str:
  """The wide testbed's section of ``docs/results.md`` from its rows: per model, ``table``."""
  rows = [r for r in rows if r["case"].startswith("wide/")]
  models = list(dict.fromkeys(r["case"].split("/")[1] for r in rows))
  devices = sorted({r["device"] for r in rows})
  body = __doc__.split("Models (``MODELS``): ", 1)[1].split("A policy whose", 1)[0].strip().replace("``", "`")
  lines = [
    f"### GPU testbed where auto keeps 8-bit: byte LMs of width 2048 ({', '.join(devices)})",
    "",
    f"Generated by `{command}` from the `wide/` rows of `benchmarks/results/accuracy_gpu.jsonl`, written by "
    "`python -m benchmarks.accuracy_gpu wide --out $OUT` on one GPU; a run with `--skip-done` adds the seeds "
    "and policies the file lacks, and the tables combine every run's rows.",
    "",
    "Models: " + body,
    "",
    "Step ms: each policy's training step timed alone after training (median of 3 rounds of 30 pipelined "
    "steps; the speed-up against the bf16 step of the same run in brackets). Ω / speed-only Ω: the policy's 8-bit ops' Ω (the "
    "search's indicator, above bf16) over the speed-only choice's. Loss differences are paired by seed (the "
    "same initial weights and batches).",
    "",
  ]
  for model in models:
    lines += [*table(rows, model), ""]
  return "\n".join(lines) + "\n"


def run(args, make_optimizer, write) -> int:
  """``wide``: every model of ``args.models`` (``run_model``); prints at the end the tables of every
  row of ``args.jsonl`` (this run's and earlier runs')."""
  say = lambda m: print(m, flush=True)  # noqa: E731
  t0 = time.perf_counter()
  args.run = getattr(args, "run", None) or time.strftime("wide-%Y%m%d-%H%M%S", time.gmtime())
  rows = []
  for model in args.models:
    rows += run_model(model, args, make_optimizer, write, say)
  print(f"\nwide testbed on {jax.devices()[0].device_kind}, {time.perf_counter() - t0:.0f} s in all")
  if os.path.exists(args.jsonl):
    with open(args.jsonl) as f:
      rows = [r for r in (json.loads(line) for line in f if line.strip()) if not r.get("superseded")]
  for model in args.models:
    print("\n" + "\n".join(table(rows, model)))
  return 0
