"""Whether a stage of the GPU check ended well: a pytest run's verdict read from its exit code and its
JUnit file, the check's verdict over every stage, and the watch on the check's own calls into CUDA.

A run's JUnit file alone misses most ways it can fail: a usage error or an internal error writes
none, a run that collects nothing writes an empty one, and a session-level failure (the suite's check
that the working tree is unchanged) fails no test. So :func:`suite_problems` reads pytest's exit code
as well, and every problem is one line of the check's verdict (:func:`problems_of`).
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from .jobs import GRACE_S, run_job


def suite_outcomes(junit: Path) -> list[dict]:
    """Each test of the JUnit XML: its id, outcome (passed/failed/error/skipped), seconds, and a skip's
    or failure's first line."""
    import xml.etree.ElementTree as ElementTree

    tests = []
    for case in ElementTree.parse(junit).iter("testcase"):
        found = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        # JUnit's <failure> is a failed test (pytest's "failed"), <error> an error in its setup or teardown
        outcome = "passed" if found is None else {"failure": "failed"}.get(found.tag, found.tag)
        message = (found.get("message") or "") if found is not None else ""
        reason = message.splitlines()[0][:200] if message else ""
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time", 0)), 1), "reason": reason})
    return tests


PYTEST_EXITS = {2: "pytest was interrupted", 3: "pytest's internal error", 4: "a pytest usage error",
                5: "pytest collected no test"}


def suite_problems(part: str, returncode: int, cut: bool, junit_found: bool, tests: list[dict],
                   rehearse: bool) -> list[str]:
    """Why this part of the GPU suite did not end well (empty when it did). pytest's exit code is read
    as well as the JUnit file: a session-level failure (the working tree changed) fails no test."""
    problems = []
    if cut:
        problems.append(f"suite {part}: cut at its limit")
    if not junit_found:
        problems.append(f"suite {part}: no JUnit file (pytest exit {returncode})")
    elif not tests:
        problems.append(f"suite {part}: no test collected")
    failed = [t["test"] for t in tests if t["outcome"] in ("failed", "error")]
    if failed:
        more = " ..." if len(failed) > 3 else ""
        problems.append(f"suite {part}: {len(failed)} failed: " + ", ".join(failed[:3]) + more)
    if returncode in PYTEST_EXITS:
        problems.append(f"suite {part}: {PYTEST_EXITS[returncode]} (exit {returncode})")
    elif returncode == 1 and not failed and not cut:
        problems.append(f"suite {part}: pytest exit 1 with no failed test: a session-level check failed "
                        "(the log's last lines say which)")
    elif returncode not in (0, 1) and not cut:
        problems.append(f"suite {part}: pytest exit {returncode}")
    if part == "first" and not rehearse and tests and not any(t["outcome"] == "passed" for t in tests):
        problems.append("suite first: no GPU test passed")
    return problems


def run_pytest(part: str, command: list[str], junit: Path, log: Path, limit_s: float, cwd: Path, env: dict,
               rehearse: bool, grace_s: float = GRACE_S) -> dict:
    """Run a pytest command as a job and read its verdict from its exit code and its JUnit file."""
    junit.unlink(missing_ok=True)
    with open(log, "w") as f:
        done = run_job(command, limit_s, cwd=cwd, env=env, stdout=f, grace_s=grace_s)
    tests = suite_outcomes(junit) if junit.exists() else []
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "failed", "error", "skipped")}
    problems = suite_problems(part, done.returncode, done.cut, junit.exists(), tests, rehearse)
    print(f"[gpu_check] suite {part}: {counts} in {done.wall_s:.0f} s (exit {done.returncode}"
          f"{', cut' if done.cut else ''}); log {log}")
    return {"name": f"suite_{part}", "status": "ok" if not problems else "; ".join(problems),
            "command": shlex.join(command[1:]), "returncode": done.returncode, "cut": done.cut,
            "wall_s": round(done.wall_s, 1), "counts": counts, "tests": tests, "problems": problems}


class CudaWatch:
    """A profile function that notes every call into ``torch.cuda`` made by the check's own process:
    the check must hold no CUDA context while its jobs run (exclusive-process GPUs allow one)."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name != "<module>" and "/torch/cuda/" in code.co_filename.replace(os.sep, "/"):
            if len(self.calls) < 10:
                self.calls.append(f"torch.cuda {Path(code.co_filename).name}:{code.co_name}")

    def start(self) -> None:
        import threading

        sys.setprofile(self)
        threading.setprofile(self)

    def stop(self) -> None:
        import threading

        sys.setprofile(None)
        threading.setprofile(None)


def problems_of(summary: dict) -> list[str]:
    """Everything that makes the verdict non-zero."""
    problems = []
    for step in summary["stages"]:
        if step["name"].startswith("suite_"):
            problems += step.get("problems", [])
        elif step["status"] != "ok" and not step["status"].startswith("skipped"):
            problems.append(f"{step['name']}: {step['status']}")
    if summary.get("check_cuda_calls"):
        problems.append("the check itself called into CUDA (" + ", ".join(summary["check_cuda_calls"][:3])
                        + "): in exclusive-process mode its context fails every later job")
    return problems
