"""What tests/test_benchmarks.py (CPU suite) and tests/test_benchmarks_gpu.py (``pytest -m gpu``)
share: where benchmarks/ lives, the issue's bars for theory vs measurement, loading a benchmarks
script by path, and running a script's argument parser in this process."""
from __future__ import annotations


from launch import REPO

BENCH = REPO / "benchmarks"
README = BENCH / "README.md"
COMMITTED_RESULTS = BENCH / "records" / "results_cpu.jsonl"
BYTES_TOLERANCE = 0.01   # the bar: communication bytes within 1% of distkit.theory
STATE_TOLERANCE = 0.05   # model-state bytes within 5%

