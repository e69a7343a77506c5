"""Chapter 05's data paths, observed: what each rank's model was really fed (tests/workers/observe.py).

* ``test_context_parallel_feeds_each_rank_its_two_chunks``: with ``--layout zigzag`` CP rank r's
  model gets, of every sequence, chunks r and 2cp-1-r of the 2cp equal chunks (an early and a late
  one: the causal work balanced), with the positions of exactly those tokens; with ``contiguous``,
  chunks 2r and 2r+1. Mutant: the zig-zag layout handing out contiguous chunks. The equivalence tests
  cannot see that bug (the weights stay one process's; only the load balance is lost), this test
  does.

Written out here, not imported from the script: the chunk arithmetic (tests/README.md lists what else
is pinned and what is not yet).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from ch05_common import QUICK, STEPS
from distkit.harness import read_records
from distkit.models import TokenTask, model_config
from launch import REPO, WORKERS, job, run_jobs, torchrun

CP_SCRIPT = REPO / "05-advanced" / "context_parallel.py"
CP = 2
CP_RUNS = {
    "correct": None,
    "zigzag_contiguous": ('(rank, 2 * cp - 1 - rank) if layout == "zigzag"', '(2 * rank, 2 * rank + 1) if layout == "zigzag"'),
}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    def launch(name, folder):
        mutation = CP_RUNS[name]
        head = [str(folder / "seen"), str(CP_SCRIPT), *(["--mutate", *mutation] if mutation else [])]
        return torchrun(WORKERS / "observe.py", "TinyGPT", *head, "--", *map(str, QUICK),
                        "--results", folder / "r.jsonl", nproc=CP, tmp_path=folder, timeout=240)
    return run_jobs({name: (lambda folder, name=name: launch(name, folder)) for name in CP_RUNS}, tmp_path_factory)


def digests(t: torch.Tensor) -> list[str]:
    return [hashlib.sha1(row.contiguous().numpy().tobytes()).hexdigest() for row in t]


def expected_cp_calls(layout: str, batch: int, rank: int) -> list[tuple[list[str], list[str]]]:
    """(token rows, position rows) of each forward call of CP rank ``rank`` under ``layout``: one
    per step, each sequence of the step's global batch cut into 2cp equal chunks."""
    cfg = model_config("gpt", "tiny")
    task, size = TokenTask(cfg, seed=0), cfg.seq_len // (2 * CP)
    chunks = {"zigzag": (rank, 2 * CP - 1 - rank), "contiguous": (2 * rank, 2 * rank + 1)}[layout]
    calls = []
    for step in range(STEPS):
        inputs, _ = task.global_batch(step, batch)
        positions = torch.arange(cfg.seq_len).expand_as(inputs)
        mine = [torch.cat([t[:, c * size:(c + 1) * size] for c in chunks], dim=1) for t in (inputs, positions)]
        calls.append((digests(mine[0]), digests(mine[1])))
    return calls


def check_cp_chunks(folder: Path) -> None:
    records = read_records(folder / "r.jsonl")
    layouts = [r["config"]["layout"] for r in records]
    assert layouts == ["zigzag", "contiguous"]  # the script's default: both, one after the other
    batch = records[0]["config"]["global_batch_size"]
    for rank in range(CP):
        seen = [json.loads(line) for line in (folder / "seen" / f"rank{rank}.jsonl").read_text().splitlines()]
        got = [(call["rows"], call["more"][0]) for call in seen]
        want = [call for layout in layouts for call in expected_cp_calls(layout, batch, rank)]
        assert got == want, f"rank {rank}: the model was fed other tokens than its two chunks"


def test_context_parallel_feeds_each_rank_its_two_chunks(cp_runs):
    folder, _ = job(cp_runs, "correct")
    check_cp_chunks(folder)
    folder, _ = job(cp_runs, "zigzag_contiguous")
    with pytest.raises(AssertionError):
        check_cp_chunks(folder)
