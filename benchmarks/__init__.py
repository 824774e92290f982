"""Benchmark scripts, each named by what it measures: run one from the repository root as
``python -m benchmarks.<name>`` (``e2e``, ``kernels``, ``predictor``, ``hybrid``…), or a
predictor / step diagnosis as ``python -m benchmarks.diagnosis.<name>``; ``--help`` lists a
script's options. Every script appends its rows to ``benchmarks/results/<name>.jsonl``. The
models they run are defined once, in ``benchmarks.common.zoo``; the helpers they share (result
rows, tables, the link fit, kernel summaries) are the other modules of ``benchmarks.common``,
which are imported, never run."""
