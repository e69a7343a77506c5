"""What chapter 04's tests share (the CPU suite and the GPU suite): the README's commands and which
test runs each, the bus factors counted by the ring model, torchrun's failure summary, the process
check after a failing job, and argparse errors checked in this process.
"""
from __future__ import annotations

import re
from pathlib import Path

from launch import REPO, command_argv, readme_command
from workers import ch04_ring_model as ring_model

CHAPTER = REPO / "04-nccl-operations"
README = CHAPTER / "README.md"
BANDWIDTH_RECORD = CHAPTER / "records" / "bandwidth_cpu_gloo_4ranks.jsonl"  # the README's committed sweep

# Each README command, by name, as the lookup (needles, without) that finds it with
# launch.readme_command. assert_readme_covered(README, list(LOOKUPS.values())) proves they cover the
# README one to one.
LOOKUPS = {
    "collective_ops": (("collective_ops.py",), "--only"),
    "collective_ops:only": (("collective_ops.py", "--only"), None),
    "point_to_point": (("point_to_point.py",), None),
    "bandwidth_test": (("bandwidth_test.py",), None),
    "debug_lab:mismatch": (("debug_lab.py", "--scenario mismatch"), None),
    "debug_lab:missing-rank": (("debug_lab.py", "--scenario missing-rank"), None),
    "debug_lab:crash": (("debug_lab.py", "--scenario crash"), None),
}

# The nccl-tests bus factors, not written out again but counted: tests/workers/ch04_ring_model.py runs
# each collective's bandwidth-optimal algorithm on simulated ranks (checking it computes the
# definition) and divides the most bytes any rank sent by the collective's size S.
NCCL_TESTS_FACTOR = {c: (lambda n, c=c: float(ring_model.bus_factor(c, n))) for c in ring_model.COLLECTIVES}

# torchrun's failure summary: the first failure's rank and exit code
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\n\[\d+\]:\n(?:  .*\n)*?"
                        r"  rank +: (\d+) .*\n  exitcode +: (-?\d+)")


def readme_argv(name: str, nproc: int | None = None, launcher: str = "fork") -> list[str]:
    """The README command ``name`` (a key of LOOKUPS) as argv for this interpreter, with ``nproc``
    workers instead of the README's where given (``launcher``: see tests/launch.py)."""
    needles, without = LOOKUPS[name]
    return command_argv(readme_command(README, *needles, without=without), nproc=nproc, launcher=launcher)


def own_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a path only this test uses)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text:
            found.append(text)
    return found

