"""What a README's output block shows of a recorded run: the output as the reader's own run prints
it, without what belongs to the recording machine.

A record keeps the whole output (:func:`distkit.records.capture`); the block shows it with three
changes, each for a reason a reader can check against their own run:

* **paths relative to the repository**: the repository's absolute path on the recording machine
  (the record's ``root``) is dropped, so ``/home/me/repo/data`` reads ``data``, as the README's
  commands name it; the recording interpreter's path (the record's ``interpreter``, which torchrun's
  agent prints when a worker fails) is shown by its name, ``python3``;
* **torchrun's failure report folded**: when a worker exits non-zero, torchrun prints its agent's
  log lines, a Python traceback of torchrun itself (frames in the recording machine's interpreter)
  and a ~25-line table of every rank's exit. The block keeps one line naming the failed script, the
  root-cause rank and its exit code: the cause is the script's own ``error:`` line above it, which
  the report would otherwise bury;
* **a note this code no longer prints**: older records carry a line about this CPU machine's
  torchvision build mismatch (:func:`distkit.data.import_torchvision`), which is now said only when
  the missing operator is called.
"""
from __future__ import annotations

import os
import re

TV_NOTE = "note: torchvision's compiled ops do not match this torch build"
_AGENT_LOG = re.compile(r"^[WEI]\d{4} .*torch/distributed/elastic/")
_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"


def shown(record: dict) -> str:
    """The record's output as its README block shows it (module docstring)."""
    text = record["output"]
    root = record.get("root")
    if root:
        text = text.replace(root.rstrip("/") + "/", "").replace(root.rstrip("/"), ".")
    interpreter = record.get("interpreter")
    if interpreter:  # torchrun's agent names the worker's interpreter by its path: a reader's differs
        text = text.replace(interpreter, os.path.basename(interpreter))
    lines = [line for line in text.split("\n") if not line.startswith(TV_NOTE)]
    return "\n".join(fold_torchrun_report(lines))


def fold_torchrun_report(lines: list[str]) -> list[str]:
    """``lines`` with each torchrun failure report (its agent's log lines, its traceback, its table)
    replaced by one line: the failed script, the root cause's rank and exit code."""
    out, i = [], 0
    while i < len(lines):
        end = _report_end(lines, i)
        if end is None:
            out.append(lines[i])
            i += 1
            continue
        start = i
        while out and _AGENT_LOG.match(out[-1]):  # the agent's own log lines just above belong to it
            out.pop()
            start -= 1
        out.append(_summary(lines[i:end], end - start))
        i = end
    return out


def _report_end(lines: list[str], i: int) -> int | None:
    """If a torchrun report's traceback starts at ``lines[i]``, the index after its table's last line."""
    if lines[i] != "Traceback (most recent call last):":
        return None
    failed = next((j for j in range(i + 1, min(i + 40, len(lines))) if lines[j] == _FAILED), None)
    if failed is None:
        return None
    rules = [j for j in range(failed + 1, min(failed + 60, len(lines))) if lines[j].startswith("=" * 20)]
    return rules[1] + 1 if len(rules) >= 2 else None


def _summary(report: list[str], folded: int) -> str:
    script = next((line.removesuffix(" FAILED") for line in report if line.endswith(" FAILED")), "the script")
    cause = report[next((j for j, line in enumerate(report) if line.startswith("Root Cause")), 0):]
    def field(name: str) -> str:  # "  rank      : 0 (local_rank: 0)" -> "0"
        return next((line.split(":", 1)[1].split("(")[0].strip() for line in cause
                     if line.strip().startswith(name + " ")), "?")

    rank, code = field("rank"), field("exitcode")
    return (f"[torchrun's failure report, {folded} lines, folded: {script} failed, first on rank {rank} "
            f"(exit code {code}); the cause is the error line above]")
