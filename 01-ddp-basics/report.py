"""Chapter 01: numbers the README derives from recorded runs (render marks of
``python -m distkit.records render 01-ddp-basics``; reads records only, runs nothing)."""
from __future__ import annotations

import re
from pathlib import Path

from distkit.records import find, machine_label

OUTPUTS = Path(__file__).resolve().parent / "records" / "outputs.jsonl"
PER_STEP = re.compile(r"all-reduce per step: (\d+) calls, ([\d.]+) MiB \| median step ([\d.]+) s")


def per_step(name: str) -> tuple[int, float, float, dict]:
    """(all-reduce calls per step, MiB per step, median step seconds, record) of a recorded run."""
    record = find(OUTPUTS, name)
    match = PER_STEP.search(record["output"])
    if match is None:
        raise ValueError(f"record {name!r} has no 'all-reduce per step' line")
    return int(match.group(1)), float(match.group(2)), float(match.group(3)), record


def per_call_latency(out_dir: Path) -> str:
    """The cost of one extra all-reduce call, from the by-hand and the DDP run recorded above."""
    calls_hand, mib_hand, step_hand, record = per_step("ddp_from_scratch")
    calls_ddp, mib_ddp, step_ddp, _ = per_step("ddp_training")
    ms = 1000 * (step_hand - step_ddp) / (calls_hand - calls_ddp)
    return (f"From the two recorded runs above ({mib_hand:.2f} and {mib_ddp:.2f} MiB per step): "
            f"({step_hand:.3f} s - {step_ddp:.3f} s) / ({calls_hand} - {calls_ddp}) calls = "
            f"**{ms:.1f} ms per extra all-reduce call** with 4 ranks on "
            f"{machine_label(record['machine'], record.get('backend'))} (a rough figure: two separate "
            "runs, on a machine other jobs may share).\n")
