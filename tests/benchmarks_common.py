"""What tests/test_benchmarks.py (CPU suite) and tests/test_benchmarks_gpu.py (``pytest -m gpu``)
share: where benchmarks/ lives, the bars for theory vs measurement, loading a benchmarks
script by path, and running a script's argument parser in this process."""
from __future__ import annotations

from launch import REPO

BENCH = REPO / "benchmarks"
README = BENCH / "README.md"
COMMITTED_RESULTS = BENCH / "records" / "results_cpu.jsonl"
BYTES_TOLERANCE = 0.01   # the bar: communication bytes within 1% of distkit.theory
STATE_TOLERANCE = 0.05   # model-state bytes within 5%
# The README's planner commands (section "Planning"), run by tests/test_planner.py; the README
# coverage check needs them next to test_benchmarks.py's own lookups.
# A lookup is needles, or (needles, without), as readme_command takes them.
PLANNER_LOOKUPS = {"plan_8b_8xh100": (("plan.py", "--gpus 8 "), "--gpu-memory-gib"),
                   "plan_8b_8xh100_96gb": ("plan.py", "--gpu-memory-gib 96"),
                   "plan_8b_64xh100": ("plan.py", "--gpus 64 "),
                   "plan_1b_4xl4": ("plan.py", "--gpu l4"),
                   "plan_405b_256xh100": ("plan.py", "--gpus 256"),
                   "plan_70b_64xh100_layout": ("plan.py", "--layout "),
                   "plan_published": ("plan.py", "--published"),
                   "plan_validation": (("plan.py", "--validate"), "--only-misses"),
                   "plan_validation_repeat": ("plan.py", "--validate", "--only-misses")}

