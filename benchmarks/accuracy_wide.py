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
the training). After training, each policy's step is timed alone (round-robin) on this GPU; the
search's own interleaved timing of its candidates is in the search row. The search is then run again to time loading its cached
result.

Rows (``accuracy_gpu.jsonl``): ``wide/<model>/<policy>`` held-out loss per seed (with the policy's
8-bit ops and their Ω from the search's indicator), ``wide/<model>/<policy>`` ``step_ms`` (timed
alone), ``wide/<model>/search`` ``search_s`` (and the cached load's seconds).
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

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


def policy_sets(ops, found) -> dict[str, dict[str, str]]:
  """``{policy: {op: 8-bit preset}}`` of ``POLICIES`` (module docstring); ``found``: the search."""
  dense = [op.name for op in ops if op.kind in DENSE_KINDS]
  return {
    "bf16": {},
    "auto": dict(found.chosen),
    "auto_speed": dict(found.candidates[found.speed_winner or found.winner]),
    "int8_dense": {op: "int8" for op in dense},
    "fp8_dense": {op: "fp8" for op in dense},
  }


def omega_of_set(found, chosen) -> float | None:
  """Σ Ω above bf16 of ``chosen``'s ops from the search's indicator (None without one)."""
  if found.omega is None:
    return None
  cost = omega_cost(found.omega, found.base)
  return sum(cost(op, preset) for op, preset in chosen.items())


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
  times each step alone; writes each row as soon as it exists (``write``) and returns them."""
  task = task_of(model, args.tiny, args.depth)
  device = jax.devices()[0].device_kind
  batch = timing.device_batch(task, args.batch, 0)
  ops = traced_ops(task, batch, 0)
  setup = f"d {task.model.d_model} x {task.model.num_layers}, lr {args.lr:g}, batch {args.batch}, {args.steps} steps"
  common = dict(steps=args.steps, lr=args.lr, batch=args.batch, setup=setup, model=model)
  search_options = TINY_SEARCH if args.tiny else {}
  rows = []

  def emit(row):
    rows.append(row)
    write(row)

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
  sets = policy_sets(ops, found)
  dense = sum(op.kind in DENSE_KINDS for op in ops)
  reference = found.frontier.reference if found.frontier is not None else None
  emit(
    result_row(
      "accuracy_gpu", f"wide/{model}/search", "search_s", found.search_s, None, device,
      load_s=load_s, loaded=again.loaded, winner=found.winner, speed_winner=found.speed_winner,
      step_ms=found.step_ms, candidates=found.candidates, candidate_omega=found.candidate_omega,
      frontier=found.frontier.to_json() if found.frontier else None, indicator=found.indicator,
      dense_ops=dense, **common,
    )
  )  # fmt: skip
  trainer = Trainer(
    task, make_optimizer(args.lr, args.steps, args.warmup), batch, args.eval_windows, args.eval_batch
  )
  distinct: dict[tuple, str] = {}
  for name in args.policies:
    distinct.setdefault(tuple(sorted(sets[name].items())), name)
  order = list(distinct.values())
  compiled, finals = {}, {}
  with ThreadPoolExecutor(1) as pool:
    futures = {order[0]: pool.submit(trainer.compile, policy_of(ops, "bf16", sets[order[0]]))}
    for i, name in enumerate(order):
      if i + 1 < len(order):
        futures[order[i + 1]] = pool.submit(trainer.compile, policy_of(ops, "bf16", sets[order[i + 1]]))
      compiled[name] = futures[name].result()
      for seed in args.seeds:
        t0 = time.perf_counter()
        variables, opt_state, train_loss, ran = trainer.train(
          compiled[name], seed, args.steps, args.log_every, lambda m, name=name: say(f"[{model}] {name} {m}")
        )
        loss, accuracy = trainer.held_out(variables)
        finals[name] = (variables, opt_state)
        omega = omega_of_set(found, sets[name])
        for alias in [n for n in args.policies if distinct[tuple(sorted(sets[n].items()))] == name]:
          emit(
            result_row(
              "accuracy_gpu", f"wide/{model}/{alias}", "held-out loss", loss, None, device,
              seed=seed, eval_accuracy=accuracy, train_loss=train_loss, steps_run=ran,
              seconds=time.perf_counter() - t0, eight_bit=sets[alias], eight_bit_dense=len(sets[alias]),
              dense_ops=dense, omega=omega, omega_fraction=omega / reference if omega is not None and reference else None,
              same_as=name if alias != name else None, **common,
            )
          )  # fmt: skip
  for name, ms in time_alone(compiled, finals, trainer.batch, args).items():
    for alias in [n for n in args.policies if distinct[tuple(sorted(sets[n].items()))] == name]:
      emit(
        result_row(
          "accuracy_gpu", f"wide/{model}/{alias}", "step_ms", ms[0], None, device, round_ms=ms[1], **common
        )
      )
  return rows


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
  (mean, its standard error, the seeds), the 8-bit Dense ops, the Ω fraction and the step ms."""
  held = [r for r in rows if r["case"].startswith(f"wide/{model}/") and r["metric"] == "held-out loss"]
  step = {
    r["case"].split("/")[2]: r["value"]
    for r in rows
    if r["case"].startswith(f"wide/{model}/") and r["metric"] == "step_ms"
  }
  by_policy: dict[str, dict[int, dict]] = {}
  for r in held:
    by_policy.setdefault(r["case"].split("/")[2], {})[r["seed"]] = r
  base = by_policy.get("bf16", {})
  out = []
  for policy, per_seed in by_policy.items():
    seeds = sorted(per_seed)
    paired = [per_seed[s]["value"] - base[s]["value"] for s in seeds if s in base]
    diff, sd = mean_std(paired) if paired else (math.nan, math.nan)
    first = per_seed[seeds[0]]
    out.append(
      {
        "policy": policy,
        "seeds": seeds,
        "loss": mean_std([per_seed[s]["value"] for s in seeds]),
        "paired": (diff, sd / len(paired) ** 0.5 if len(paired) > 1 else math.nan, len(paired)),
        "eight_bit": first.get("eight_bit_dense"),
        "dense": first.get("dense_ops"),
        "omega_fraction": first.get("omega_fraction"),
        "step_ms": step.get(policy),
      }
    )
  return out


def table(rows: list[dict], model: str) -> list[str]:
  """The markdown table of ``summarize`` for ``model``, after its search's line."""
  search = next((r for r in rows if r["case"] == f"wide/{model}/search"), None)
  lines = []
  if search:
    lines += [
      f"`{model}` ({search['setup']}): search {search['value']:.1f} s, its cached result loaded again in "
      f"{search['load_s']:.2f} s; auto keeps `{search['winner']}`, speed-only `{search['speed_winner']}`.",
      "",
    ]
  lines += [
    "| policy | 8-bit Dense ops | Ω / speed-only Ω | step ms (alone) | seeds | held-out loss | − bf16, paired (± s.e.) |",
    "|---|---|---|---|---|---|---|",
  ]
  bf16_ms = next((s["step_ms"] for s in summarize(rows, model) if s["policy"] == "bf16"), None)
  for s in summarize(rows, model):
    (loss, sd), (d, se, n) = s["loss"], s["paired"]
    paired = "–" if s["policy"] == "bf16" else (f"{d:+.4f} ± {se:.4f}" if n > 1 else f"{d:+.4f} (1 seed)")
    frac = "–" if s["omega_fraction"] is None else f"{s['omega_fraction']:.2f}"
    ms = (
      "–"
      if s["step_ms"] is None
      else f"{s['step_ms']:.2f}" + (f" ({bf16_ms / s['step_ms']:.2f}×)" if bf16_ms else "")
    )
    seeds = ",".join(map(str, s["seeds"]))
    lines.append(
      f"| {s['policy']} | {s['eight_bit']} of {s['dense']} | {frac} | {ms} | {seeds} | {loss:.4f} ± {sd:.4f} | {paired} |"
    )
  return lines + verdict(rows, model, search)


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
  ms = [by[p]["step_ms"] for p in ("bf16", "auto", "auto_speed")]
  if None not in ms:
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
    "`python -m benchmarks.accuracy_gpu wide --out $OUT` on one GPU.",
    "",
    "Models: " + body,
    "",
    "Step ms: each policy's training step timed alone after training (median of 3 rounds of 30 pipelined "
    "steps; the speed-up against bf16 in brackets). Ω / speed-only Ω: the policy's 8-bit ops' Ω (the "
    "search's indicator, above bf16) over the speed-only choice's. Loss differences are paired by seed (the "
    "same initial weights and batches).",
    "",
  ]
  for model in models:
    lines += [*table(rows, model), ""]
  return "\n".join(lines) + "\n"


def run(args, make_optimizer, write) -> int:
  """``wide``: every model of ``args.models`` (``run_model``); prints the tables at the end."""
  say = lambda m: print(m, flush=True)  # noqa: E731
  t0 = time.perf_counter()
  rows = []
  for model in args.models:
    rows += run_model(model, args, make_optimizer, write, say)
  print(f"\nwide testbed on {jax.devices()[0].device_kind}, {time.perf_counter() - t0:.0f} s in all")
  for model in args.models:
    print("\n" + "\n".join(table(rows, model)))
  return 0
