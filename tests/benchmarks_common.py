"""What tests/test_benchmarks.py (CPU suite) and tests/test_benchmarks_gpu.py (``pytest -m gpu``)
share: where benchmarks/ lives, the bars for theory vs measurement, loading a benchmarks
script by path, and running a script's argument parser in this process."""
from __future__ import annotations

import shlex

from launch import REPO, launcher_argv
from spine import Form

BENCH = REPO / "benchmarks"
README = BENCH / "README.md"
PLANNER_DOC = BENCH / "planner.md"  # the planner's own document, its commands the chapter's too
COMMITTED_RESULTS = BENCH / "records" / "results_cpu.jsonl"
BYTES_TOLERANCE = 0.01   # the bar: communication bytes within 1% of distkit.theory
STATE_TOLERANCE = 0.05   # model-state bytes within 5%
# planner.md's commands, checked by tests/test_planner.py as the play ran them.
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

# How the reader's play (tests/spine.py) runs the README's commands that tests/test_benchmarks.py and
# tests/test_parity.py check: the quick matrix's cells through the suite's fork launcher (not
# torchrun); the bigger matrices planned (--dry-run: the quick matrix runs their cells' code); parity
# for 20 steps with held-out losses every 10; one short round of the harness overhead; the planner's
# examples as written.
FORK_CELLS = shlex.join([*launcher_argv("fork"), "--standalone"]) + " --nproc_per_node={nproc}"
PARITY_STEPS, PARITY_EVERY = 20, 10
PLAY = {"distributed_benchmarks.py --quick": Form(("--launcher", FORK_CELLS)),
        ("plot.py", "runs/benchmarks.jsonl"): Form(),
        **{lookup: Form() for lookup in PLANNER_LOOKUPS.values()},  # as written (tests/test_planner.py)
        **{lookup: Form(("--dry-run",)) for lookup in [("distributed_benchmarks.py", f"--results runs/{name}.jsonl")
                                                         for name in ("full_cpu", "gpu", "one_gpu")]},
        "benchmarks/parity.py": Form(("--steps", str(PARITY_STEPS), "--held-out-every", str(PARITY_EVERY))),
        # a fresh interpreter, as the reader's python starts it (no module the fork server imported)
        "harness_overhead.py": Form(("--rounds", "1", "--steps", "2"), launcher="torchrun-fresh")}
