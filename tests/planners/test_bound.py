"""The pool's bound (hand-computed on affine steps), the best baseline, and the plan summary."""

import dataclasses

import pytest

from planners.allocator.bound import BASELINES, best_baseline, bound_step_ms, pool_bound
from planners.allocator.greedy import make_problem
from planners.allocator.joint import joint_plan, plan_of
from planners.allocator.search import Candidate, Search
from planners.allocator.summary import limits, summarize
from planners.predictor.replay import predict
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import PlanError
from tests.planners.fakes import SPEED, fake_indicator, fake_profile

NO_8BIT_GAIN = {**SPEED, "int8": 1.5, "fp8": 1.5}


def _problem(infer_optimizer_ms: float):
  """One op (fwd, drhs: the first op has no dlhs) at batch 8. Training group (fp32): legs 1 + 1 ms,
  optimizer 1 ms, so t(b) = 1 + 0.25·b replicated. Inference group: legs 2 + 2 ms at fp32; its
  fastest level is int8 (QSync's op: int8 forward 0.3×, fp16 gradient 0.5×, no cast cost),
  0.6 + 1.0 ms, so t(b) = infer_optimizer_ms + 0.2·b replicated."""
  # (8 bits slower than fp32 on the training group: its 8-bit auto policy is the training precision)
  train = fake_profile([(1.0, 1.0, 1.0)], device_type="A100", optimizer_ms=1.0, speed=NO_8BIT_GAIN)
  infer = fake_profile([(2.0, 2.0, 2.0)], device_type="T4", optimizer_ms=infer_optimizer_ms)
  cluster = ClusterSpec(
    (DeviceGroup("train", "A100", 2, 40.0, 8, 100.0), DeviceGroup("infer", "T4", 2, 16.0, 8, 100.0))
  )
  return make_problem(cluster, {"A100": train, "T4": infer}, fake_indicator(train.op_names, [1.0]))


def test_bound_of_hand_computable_affine_steps():
  # the optimizer update counts 1/4 on each of the pool's 4 devices (sharded over all of them)
  bound = pool_bound(Search(_problem(2.0), 1))
  assert bound.affine[0] == pytest.approx((0.25, 0.25)) and bound.affine[1] == pytest.approx((0.5, 0.2))
  # 2·(T − 0.25)/0.25 + 2·(T − 0.5)/0.2 = 32  →  18·T = 39
  assert bound.step_ms == pytest.approx(13 / 6)
  assert bound.samples_per_s == pytest.approx(32 / (13 / 6) * 1e3)
  assert bound.batches == pytest.approx(((13 / 6 - 0.25) / 0.25, (13 / 6 - 0.5) / 0.2))
  # A quarter of the update longer than the training groups' whole step (2·(T − 0.25)/0.25 = 32:
  # T = 4.25 < 20/4): the inference group gets nothing.
  bound = pool_bound(Search(_problem(20.0), 1))
  assert bound.step_ms == pytest.approx(4.25) and bound.batches == pytest.approx((16.0, 0.0))


def test_the_bound_has_the_training_groups_at_8_bits_where_their_profile_prices_it_faster():
  problem = _problem(2.0)
  fast = fake_profile([(1.0, 1.0, 1.0)], device_type="A100", optimizer_ms=1.0)  # int8 at 0.3× fp32
  problem = dataclasses.replace(
    problem, groups=(dataclasses.replace(problem.groups[0], profile=fast), problem.groups[1])
  )
  bound = pool_bound(Search(problem, 1))
  assert bound.affine[0] == pytest.approx((0.25, 0.3 * 0.25))  # its two legs at int8: 0.6 ms at batch 8
  # ...and so no baseline at the training groups' 8-bit auto policy beats it
  _, cands, search = joint_plan(problem, 1, 0.0)
  assert any(c.reference and c.name.endswith("8-bit auto") for c in cands)
  assert all(c.samples_per_s <= pool_bound(search).samples_per_s * (1 + 1e-9) for c in cands)


def test_bound_step_solves_the_water_filling_equation():
  assert bound_step_ms([(0.0, 1.0)], [4], 8) == pytest.approx(2.0)
  assert bound_step_ms([(3.0, 1.0), (0.0, 1.0)], [1, 1], 2) == pytest.approx(2.0)  # the first joins at 3
  assert bound_step_ms([(3.0, 1.0), (0.0, 1.0)], [1, 1], 5) == pytest.approx(4.0)  # (T−3) + T = 5
  with pytest.raises(ValueError, match="slope s_g=0"):
    bound_step_ms([(1.0, 0.0)], [1], 8)


def test_no_candidate_beats_the_bound():
  problem = _problem(2.0)
  chosen, cands, search = joint_plan(problem, 1, 0.0)
  bound = pool_bound(search)
  assert all(c.samples_per_s <= bound.samples_per_s * (1 + 1e-9) for c in cands)


def _cand(name, step_ms, fits=True):
  return Candidate(name, (8, 8), (None, None), step_ms, 0.0, 32, fits)


def test_best_baseline_is_the_faster_fitting_one():
  dyn, alone = _cand("dynamic batching", 10.0), _cand("training groups only", 8.0)
  others = [_cand("uniform low precision", 1.0), _cand("joint", 7.0)]
  assert best_baseline([dyn, alone, *others]) is alone
  assert best_baseline([dyn, dataclasses.replace(alone, fits=False), *others]) is dyn
  assert best_baseline(others) is None


def test_summary_gain_against_the_faster_baseline_and_limits_add_up():
  # The inference group's update (20 ms) is slower than the training group's whole step:
  # the training groups alone beat dynamic batching, so the gain is against them.
  problem = _problem(20.0)
  chosen, cands, search = joint_plan(problem, 1, 0.0)
  by_name = {}  # each name at its fastest fitting mode and sync, as the best baseline takes it
  for c in sorted((c for c in cands if c.fits), key=lambda c: c.samples_per_s):
    by_name[c.name] = c
  assert by_name["training groups only"].samples_per_s > by_name["dynamic batching"].samples_per_s
  pred = predict(
    problem.cluster, {g.profile.device_type: g.profile for g in problem.groups}, plan_of(problem, chosen)
  )
  summary = summarize(chosen, cands, search, pred)
  assert summary.baseline == "training groups only"
  assert summary.gain == pytest.approx(chosen.samples_per_s / by_name["training groups only"].samples_per_s)
  assert summary.bound_samples_per_s == pytest.approx(pool_bound(search).samples_per_s)
  lim = limits(pred)
  running = [g.name for g, b in zip(problem.cluster.groups, chosen.batches) if b]
  assert lim.straggler in running
  assert lim.exposed_comm_ms == pred.exposed_comm_ms[lim.straggler]
  assert lim.optimizer_ms == pred.optimizer_tail_ms[lim.straggler]
  # the straggler's backward ends last, and then the step has at least its optimizer update left
  assert lim.backward_end_ms + lim.optimizer_ms <= pred.step_ms * (1 + 1e-9)
  lines = summary.lines()
  assert len(lines) == 3 and all(line.startswith("modeled: ") for line in lines)
  assert "the best baseline (training groups only" in lines[0]
  assert summary.to_json()["best_baseline"]["name"] == "training groups only"


def test_summary_without_a_baseline_says_so():
  """``batch="equal"``: the baseline is the faster of plain data parallelism (the spec's equal
  batches at the training precision) and the training groups accumulating the global batch; a
  summary given no baseline claims no gain and still gives the bound."""
  problem = _problem(2.0)
  chosen, cands, search = joint_plan(problem, 1, 0.0, batch="equal")
  named = {c.name: c for c in cands if c.fits}
  pair = [named[n] for n in ("equal batches, training precision", "training groups only, accumulating")]
  assert best_baseline(cands) is max(pair, key=lambda c: c.samples_per_s)  # 2 × 8 × 2 micro-steps = 32
  profiles = {g.profile.device_type: g.profile for g in problem.groups}
  others = [c for c in cands if c.name not in BASELINES]
  summary = summarize(chosen, others, search, predict(problem.cluster, profiles, plan_of(problem, chosen)))
  assert summary.baseline is None and summary.gain is None and summary.headroom_captured is None
  assert "no baseline" in summary.lines()[0] and summary.to_json()["best_baseline"] is None
  assert summary.bound_samples_per_s == pytest.approx(pool_bound(search).samples_per_s)


def test_a_profile_whose_step_shrinks_with_the_batch_is_refused_by_name():
  # A fitted remainder of -3 ms (standalone op timings above the step measured) outweighs the
  # 2 ms of ops at batch 8: the priced step falls as the batch grows, so no bound exists.
  train = fake_profile([(1.0, 1.0, 1.0)], device_type="A100", remainder_ms=-3.0)
  infer = fake_profile([(2.0, 2.0, 2.0)], device_type="T4")
  cluster = ClusterSpec(
    (DeviceGroup("train", "A100", 2, 40.0, 8, 100.0), DeviceGroup("infer", "T4", 2, 16.0, 8, 100.0))
  )
  problem = make_problem(cluster, {"A100": train, "T4": infer}, fake_indicator(train.op_names, [1.0]))
  with pytest.raises(PlanError, match=r"group 'train' \(A100\).*does not grow with the batch.*qsync profile"):
    pool_bound(Search(problem, 1))
