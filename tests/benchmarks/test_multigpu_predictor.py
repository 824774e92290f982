"""The multi-GPU benchmark's predictor table and its offline replay, on a hand-built profile,
and its modes case: the kernel-trace summary on a hand-built trace, the table on hand-built
measurements, and the whole case run on the simulated CPU devices (a smoke test).

These are the parts of ``benchmarks/multigpu.py`` (and ``benchmarks.common.multigpu_modes``) that run after the GPUs are gone (the device
time that measured the steps cannot be spent again), or that must work the first time a GPU
host runs them, so they are tested here on the CPU.
"""

import json

import jax
import pytest

from benchmarks import multigpu
from benchmarks.common import multigpu_modes as modes
from benchmarks.common.link import LinkModel
from benchmarks.common.train_steps import stepper
from benchmarks.diagnosis import multigpu_replay
from planners.profile import Profile
from tests.benchmarks import result, write_rows
from tests.planners.fakes import fake_profile

ELEMS = 156250  # 625 kB of fp32 weights per op


@pytest.fixture
def profile():
  return fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, device_type="H100", remainder_ms=1.0)


def _by_case(rows):
  return {r["case"]: r for r in rows}


def test_predictor_rows_fit_fp32_per_device_count_and_evaluate_the_rest(profile):
  measured = {  # seconds, as multigpu.py keeps them
    ("fp32", 1): 0.030,
    ("bf16", 1): 0.012,
    ("mixed", 1): 0.011,
    ("fp32", 2): 0.040,
    ("bf16", 2): 0.020,
    ("bf16-tree", 2): 0.021,  # the same collectives as the default: never replayed
  }
  links = {2: LinkModel(2, 8.0, 0.0, 0.0)}
  rows = _by_case(
    multigpu.predictor_rows(profile, {"fp32", "bf16", "fp16", "int8"}, links, measured, 8, "test")
  )
  assert not [c for c in rows if "fp32" in c or "tree" in c]  # fp32 is the fit, not a prediction
  for n in (1, 2):
    raw, fit = rows[f"predictor/bf16/n{n}"], rows[f"predictor-fit/bf16/n{n}"]
    assert raw["baseline"] == fit["baseline"] == pytest.approx(1e3 * measured[("bf16", n)])
    # the refit moves every plan by the fp32 step's miss on that device count
    fp32 = multigpu.predict_case(profile, "fp32", n, 8, links.get(n)).step_ms
    assert fit["value"] - raw["value"] == pytest.approx(1e3 * measured[("fp32", n)] - fp32)
  errors = [abs(rows[f"predictor-fit/{c}"]["ratio"] - 1) for c in ("bf16/n1", "mixed/n1", "bf16/n2")]
  assert rows["predictor-fit/all"]["value"] == pytest.approx(sum(errors) / 3)
  # fit1: every device count moves by the one-device fp32 miss; the replay alone adds the rest
  one = 1e3 * measured[("fp32", 1)] - multigpu.predict_case(profile, "fp32", 1, 8).step_ms
  for case in ("bf16/n1", "mixed/n1", "bf16/n2"):
    assert rows[f"predictor-fit1/{case}"]["value"] - rows[f"predictor/{case}"]["value"] == pytest.approx(one)
  assert rows["predictor-fit1/bf16/n2"]["value"] != pytest.approx(rows["predictor-fit/bf16/n2"]["value"])


def test_replay_reads_both_step_sets_of_one_run(tmp_path):
  step, gpus = "step_time_ms_median", "H100 x4"
  path = write_rows(
    tmp_path / "multigpu.jsonl",
    [
      result("r1", "scaling/bf16/n2", step, 5.0, gpus),
      result("r1", "multiprocess/bf16/p2", step, 4.0, gpus),
      result("r1", "scaling/bf16/n2", "weak_scaling_efficiency", 0.8, gpus),
      result("r1", "scaling/bf16/n2", "step_time_ms_pipelined", 3.5, gpus),
      result("r0", "scaling/bf16/n4", step, 9.0, gpus),
    ],
  )
  single, multi, device, _ = multigpu_replay.measured_steps(path, "r1")
  assert single == {("bf16", 2): pytest.approx(0.005)}
  assert multi == {("bf16", 2): pytest.approx(0.004)}
  assert device == "H100 x4"
  pipelined, multi, _, _ = multigpu_replay.measured_steps(path, "r1", "pipelined")
  assert pipelined == {("bf16", 2): pytest.approx(0.0035)} and multi == {}


def test_stepper_feeds_each_step_the_last_state_and_cycles_the_batches():
  seen = []

  def step(state, batch, *key):
    seen.append(len(key))
    return state + batch, None

  run, current = stepper(step, 0, [1, 10])
  assert [run() for _ in range(3)] == [1, 11, 12] and current() == 12
  run, _ = stepper(step, 0, [1], key=jax.random.key(0))
  run()
  assert seen == [0, 0, 0, 1]  # with a key, each step also gets fold_in(key, i)


GPU0 = "/device:GPU:0 (pid 1)"


def kernel(name, ts, dur, process=GPU0, hlo_op=None):
  """A GPU kernel event as ``planners.profiler.timing.profiler_events`` gives it (µs)."""
  return {
    "process": process,
    "name": name,
    "ts": ts,
    "dur": dur,
    "args": {"hlo_op": hlo_op} if hlo_op else {},
  }


def test_step_kernels_times_each_collective_kind_and_what_no_compute_hides():
  events = [
    kernel("gemm_fusion_dot_1", 0.0, 100.0),
    kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 50.0, 100.0),  # 100-150 exposed
    kernel("ncclDevKernel_AllGather_RING_LL", 200.0, 40.0),  # all exposed
    kernel("loop_add_fusion", 290.0, 40.0),
    kernel("ncclDevKernel_SendRecv", 300.0, 20.0),  # under loop_add_fusion
    kernel("one_shot_kernel", 400.0, 10.0, hlo_op="all-reduce-start.2"),  # a collective by its instruction
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0.0, 1e3, process="/device:GPU:1 (pid 2)"),
    kernel("PjitFunction(step)", 0.0, 1e3, process="/host:CPU"),
  ]
  k = modes.step_kernels(events, repeats=2)  # two steps traced: ms per step = µs / 2e3
  assert k.collective_ms == pytest.approx(
    {"reduce-scatter": 0.05, "all-gather": 0.02, "collective-permute": 0.01, "all-reduce": 0.005}
  )
  assert k.compute_ms == pytest.approx(0.07)
  assert k.exposed_ms == pytest.approx((50.0 + 40.0 + 10.0) / 2e3)
  assert modes.step_kernels(events[-1:], 1) is None  # no GPU kernel: a CPU host


def test_mode_groups_split_from_four_devices_and_two_level_needs_two_groups():
  assert [modes.mode_groups(n) for n in (2, 3, 4, 5, 8)] == [(2,), (3,), (2, 2), (3, 2), (4, 4)]
  assert ("two_level", "replicated", 1) not in modes.modes_of((2,))
  assert ("flat", "replicated", 2) in modes.modes_of((2,))
  assert modes.modes_of((2, 2)) == modes.MODES
  # one device: the sharded update over one device is the replicated one, so only that and micro-steps
  assert modes.modes_of((1,)) == (("flat", "replicated", 1), ("flat", "replicated", 2))


def test_mode_rows_on_one_device_have_no_link_and_model_the_accumulator(capsys):
  prof = mode_profile()
  measured = {m: modes.MeasuredMode([5.0, 6.0], None, 1_000_000) for m in modes.modes_of((1,))}
  predictions = {m: modes.predict_mode(prof, (1,), 8, m, None) for m in measured}
  rows = _by_case(modes.mode_rows((1,), measured, predictions, None, "test"))
  flat, micro = rows["modes/1dev/flat/replicated"], rows["modes/1dev/flat/replicated/micro2"]
  assert flat["link_gbps"] is None and not any(flat["modeled_collective_ms"].values())  # nothing to reduce
  # two micro-steps hold the summed fp32 gradient (one parameter set) and half the activations
  assert micro["modeled_peak_bytes"] != flat["modeled_peak_bytes"]
  assert "no link" in capsys.readouterr().out


def mode_profile():
  return fake_profile(
    [(1.0, 2.0, 3.0), (1.0, 2.0, 3.0)], rhs_elems=ELEMS, device_type="cpu", optimizer_ms=0.5
  )


def test_mode_rows_put_measured_kernels_beside_the_replay(capsys):
  prof, link, sizes = mode_profile(), LinkModel(4, 100.0, 20.0, 0.0), (2, 2)
  kern = modes.StepKernels({"reduce-scatter": 0.4, "all-gather": 0.3, "all-reduce": 0.01}, 5.0, 0.2)
  measured = {
    ("flat", "replicated", 1): modes.MeasuredMode([10.0, 11.0, 12.0], None, 3_000_000_000),
    ("flat", "sharded", 1): modes.MeasuredMode([12.0, 13.0, 14.0, 15.0], kern, 2_000_000_000),
    ("flat", "replicated", 2): modes.MeasuredMode([11.0], None, None),
  }
  predictions = {m: modes.predict_mode(prof, sizes, 8, m, link) for m in measured}
  rows = _by_case(modes.mode_rows(sizes, measured, predictions, link, "test"))
  flat, sharded = rows["modes/4dev/flat/replicated"], rows["modes/4dev/flat/sharded"]
  micro = rows["modes/4dev/flat/replicated/micro2"]
  # two micro-steps: compute priced on the whole batch as one step (linear in the batch), the same
  # all-reduce; the row is of its own plan
  assert micro["modeled_step_ms"] == pytest.approx(predictions[("flat", "replicated", 2)].step_ms)
  assert (flat["value"], flat["ratio"]) == (11.0, 1.0)
  assert (sharded["value"], sharded["baseline"], sharded["iqr_ms"]) == (13.5, 11.0, 1.5)
  assert (
    sharded["measured_collective_ms"] == kern.collective_ms and sharded["measured_exposed_comm_ms"] == 0.2
  )
  assert flat["measured_collective_ms"] is None  # no trace of this one
  pred = predictions[("flat", "sharded", 1)]
  assert flat["modeled_ratio"] == 1.0
  assert sharded["modeled_ratio"] == pytest.approx(
    pred.step_ms / predictions[("flat", "replicated", 1)].step_ms
  )
  assert sharded["modeled_collective_ms"] == pytest.approx(
    {
      "reduce-scatter": pred.comm_ms_by_phase["reduce-scatter"],
      "all-gather": pred.comm_ms_by_phase["all-gather"],
    }
  )
  assert sharded["modeled_optimizer_tail_ms"] == pytest.approx(0.5 / 4)  # a quarter of the update per device
  assert (sharded["measured_compute_ms"], sharded["modeled_compute_ms"]) == (5.0, pred.group_compute_ms["g0"])
  # memory: the compiled peak beside the memory model's, which holds a quarter of the optimizer state
  # on each of the 4 devices under the sharded update
  assert (flat["peak_bytes"], sharded["peak_bytes"], micro["peak_bytes"]) == (3e9, 2e9, None)
  assert sharded["modeled_peak_bytes"] == pred.memory_bytes["g0"]
  # (less the device's shards of the gradient, parameters and update: a quarter of the parameters' bytes)
  opt_state, params = prof.memory["opt_state_bytes"], prof.memory["param_bytes"]
  assert flat["modeled_peak_bytes"] - sharded["modeled_peak_bytes"] == pytest.approx(
    0.75 * opt_state - params / 4, abs=1
  )
  out = capsys.readouterr().out
  assert "0.40/" in out  # measured / modeled reduce-scatter
  assert f"2.00/{pred.memory_bytes['g0'] / 1e9:.2f}" in out  # measured / modeled memory, GB


def test_modes_case_runs_on_the_simulated_devices_past_a_failing_mode(tmp_path, monkeypatch, capsys):
  profile = tmp_path / "profile.json"
  mode_profile().save(str(profile))
  link = LinkModel(8, 100.0, 20.0, 0.0)
  monkeypatch.setattr(multigpu, "measure_link", lambda devices: link)  # tests/benchmarks/test_link.py
  build = modes.build_mode

  def build_but_flat(task, sizes, batch, mode):  # flat/replicated, the baseline, fails to build
    if mode == modes.MODES[0]:
      raise ValueError("no flat here")
    return build(task, sizes, batch, mode)

  monkeypatch.setattr(modes, "build_mode", build_but_flat)
  results = tmp_path / "multigpu.jsonl"
  tiny = ["--d-model", "16", "--heads", "2", "--layers", "1", "--seq", "16", "--batch", "2", "--steps", "1"]
  argv = ["--cases", "modes", *tiny, "--profile-file", str(profile), "--results", str(results)]
  assert multigpu.main(argv) == 0
  assert "flat/replicated failed: ValueError: no flat here" in capsys.readouterr().out
  rows = _by_case(json.loads(line) for line in results.read_text().splitlines())
  assert sorted(rows) == [
    "modes/8dev/flat/replicated/micro2",
    "modes/8dev/flat/sharded",
    "modes/8dev/two_level/replicated",
  ]
  for case, r in rows.items():
    assert (r["metric"], r["baseline"], r["ratio"], r["groups"]) == ("step_ms", None, None, [4, 4])
    assert r["timed_samples"] == modes.MODE_ROUNDS and r["value"] > 0
    assert r["measured_collective_ms"] is None  # no GPU kernels on a CPU
    mode = next(m for m in modes.MODES if f"modes/8dev/{modes.mode_name(m)}" == case)
    pred = modes.predict_mode(Profile.load(str(profile)), (4, 4), 2, mode, link)
    assert r["modeled_step_ms"] == pytest.approx(pred.step_ms)
    assert r["modeled_exposed_comm_ms"] == pytest.approx(pred.exposed_comm_ms["g0"])
    assert r["peak_bytes"] > 0 and r["modeled_peak_bytes"] == pred.memory_bytes["g0"]  # compiled on the CPU
  assert set(rows["modes/8dev/two_level/replicated"]["modeled_collective_ms"]) == {"collective-permute"}


def test_modes_case_without_a_bf16_profile_fails_before_measuring(capsys):
  with pytest.raises(SystemExit):
    multigpu.main(["--cases", "modes", "--profile-precisions", "fp32", "--no-save"])
  assert "has no bf16. Fix: add bf16 to --profile-precisions" in capsys.readouterr().err


def test_modes_case_refuses_a_mode_the_devices_cannot_run_before_measuring(monkeypatch, capsys):
  # the tests' 8 simulated CPU devices run every mode; a device count of one runs no sharded update
  monkeypatch.setattr(multigpu.jax, "device_count", lambda: 1)
  with pytest.raises(SystemExit):
    multigpu.main(["--cases", "modes", "--modes", "flat/sharded", "--no-save"])
  err = capsys.readouterr().err
  assert "--modes flat/sharded: 1 device(s) run only flat/replicated, flat/replicated/micro2" in err
  assert "Fix: leave those modes out" in err


def test_sync_case_puts_each_syncs_measured_step_over_fp32_beside_its_priced_passes(tmp_path, capsys):
  """``--cases sync --syncs bf16``: fp32 (the baseline) and bf16 alone run; bf16's row holds its step
  over fp32's, measured, and the passes the replay prices for it (``payload.pass_ms``) on the
  devices that ran, over the trainer's parameter elements."""
  from planners.predictor.payload import pass_ms
  from qsync_jax.devices import device_type_of

  results = tmp_path / "multigpu.jsonl"
  tiny = ["--d-model", "16", "--heads", "2", "--layers", "1", "--seq", "16", "--batch", "2", "--steps", "2"]
  assert multigpu.main(["--cases", "sync", "--syncs", "bf16", *tiny, "--results", str(results)]) == 0
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  assert sorted({r["case"] for r in rows}) == ["sync/bf16", "sync/fp32"]  # no SelSync / QSDP asked for
  over = {r["case"]: r for r in rows if r["metric"] == "ms_over_fp32_measured"}
  n = jax.device_count()
  bf16 = over["sync/bf16"]
  assert bf16["devices"] == n and bf16["param_elements"] > 0
  assert bf16["modeled_passes_ms"] == pytest.approx(
    sum(pass_ms("bf16", device_type_of(jax.devices()[0]), bf16["param_elements"], n))
  )
  assert bf16["modeled_passes_ms"] > 0 and over["sync/fp32"]["modeled_passes_ms"] == 0
  steps = {r["case"]: r["value"] for r in rows if r["metric"] == "step_time_ms_median"}
  assert bf16["value"] == pytest.approx(steps["sync/bf16"] - steps["sync/fp32"])
  assert "+ms over fp32 meas/passes modeled" in capsys.readouterr().out
