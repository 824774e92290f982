"""The planner: which precision each op of each device group runs, and how much of the batch each
group takes, from a model, a cluster spec and measurements.

Three layers, each importing only the ones below it (``tests/test_dependency_direction.py``):

* **shared modules** of plain data and formulas: ``ops`` (an op's shapes), ``profile`` (a cost
  profile and ``GroupCost``), ``catalog`` (the roofline of devices not at hand), ``report``
  (plain-text tables);
* **stages**, each a chain of pure functions over that data, runnable alone from the CLI:

  1. ``indicator`` — sensitivity ``Ω[op][precision]`` of the model's ops (``qsync indicator``);
  2. ``predictor`` — the replay: the op graph of a training step, costed for a plan from a
     profile, its collectives and its memory; devices without a profile modeled from the catalog
     (``qsync predict``);
  3. ``profiler`` — op × leg × precision costs measured on the local device, the step's
     remainder fitted through the replay (``qsync profile``);
  4. ``calibrate`` — a group's profile scaled to the speed a training run measured;
  5. ``allocator`` — the plan: QSync's greedy precision search, the joint batch × precision
     search over the trainer's modes, the baselines and the pool's bound;

* **the pipeline** the commands call: ``inputs`` (their files, read and checked against each
  other), ``planning`` (``plan_cluster``: what ``qsync plan`` runs) and ``plan_report`` (what it
  prints).

QSync orders its stages indicator → profiler → predictor → allocator. Here the predictor sits
below the profiler: a profile's remainder (the work between ops XLA fuses away or adds) and its
fixed share are fitted so that the replay reproduces the measured step, so the profiler calls the
predictor; and calibration to a run's measurements is a stage of its own, between profiling and
allocation, because the trainer measures each group's speed while it trains.
"""
