"""What chapter 04's tests share (the CPU suite and the GPU suite): the README's commands and which
test runs each, the bus factors counted by the ring model, torchrun's failure summary, the reader's play of
the README's commands (tests/spine.py), and argparse errors checked in this process.
"""
from __future__ import annotations

import re

from launch import REPO, command_argv, readme_command
from spine import Form
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

# How the reader's play (tests/spine.py) runs each command, so that tests/test_ch04_readme.py can check
# what it printed and wrote: quick sizes and short timeouts; the debug lab under the real torchrun
# (what torchrun shows when a job fails is its lesson), its logs under the command's own folder; the
# chapter's first command with fresh interpreters end to end, as a reader's torchrun starts them (the
# fork server's pre-imported modules would hide an import the script forgot)
LAB = ("--log-dir", "{out}/lab")
PLAY = {
    LOOKUPS["collective_ops"]: Form(launcher="torchrun-fresh"),
    LOOKUPS["collective_ops:only"]: Form(),
    LOOKUPS["point_to_point"]: Form(("--numel", "10001", "--deadlock-timeout-s", "2")),
    LOOKUPS["bandwidth_test"]: Form(("--max-bytes", "16K", "--iters", "2", "--warmup-iters", "1", "--p2p-matrix",
                                     "--p2p-bytes", "8K", "--plot", "{out}/bw.png")),
    LOOKUPS["debug_lab:mismatch"]: Form(("--timeout-s", "3", *LAB), launcher="torchrun"),
    LOOKUPS["debug_lab:missing-rank"]: Form(("--timeout-s", "2", *LAB), launcher="torchrun"),
    LOOKUPS["debug_lab:crash"]: Form(("--timeout-s", "3", *LAB), launcher="torchrun"),
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
