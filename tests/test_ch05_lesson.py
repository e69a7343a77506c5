"""Chapter 05's data paths and reported losses, observed: what each rank's model was really fed and
returned (tests/workers/observe.py).

* ``test_context_parallel_feeds_each_rank_its_two_chunks``: with ``--layout zigzag`` CP rank r's
  model gets, of every sequence, chunks r and 2cp-1-r of the 2cp equal chunks (an early and a late
  one: the causal work balanced), with the positions of exactly those tokens; with ``contiguous``,
  chunks 2r and 2r+1. Mutant: the zig-zag layout handing out contiguous chunks. The equivalence tests
  cannot see that bug (the weights stay one process's; only the load balance is lost), this test
  does.

* ``test_pipeline_first_stage_gets_each_micro_batch_in_order``: the first stage runs, each step,
  the forwards of micro-batches 0 .. m-1 of that step's global batch, with exactly their rows.
  Mutant: the previous step's batch fed.
* ``test_pipeline_loss_is_the_mean_over_micro_batches_of_the_last_stage``: each recorded loss is the
  mean over micro-batches of the token cross-entropy of the logits the last stage returned. Mutant:
  the micro-batch losses summed. The weights are unchanged by it, so no equivalence test sees it.

Written out here, not imported from the script: the chunk arithmetic (tests/README.md lists what else
is pinned and what is not yet).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ch05_common import QUICK, STEPS
from distkit.harness import read_records
from distkit.models import TokenTask, model_config
from launch import REPO, job
from observed import digest_rows, observe_jobs, seen_calls

CP_SCRIPT = REPO / "05-advanced" / "context_parallel.py"
CP = 2
CP_RUNS = {
    "correct": None,
    "zigzag_contiguous": ('(rank, 2 * cp - 1 - rank) if layout == "zigzag"', '(2 * rank, 2 * rank + 1) if layout == "zigzag"'),
}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, CP_SCRIPT, "TinyGPT", CP_RUNS,
                        lambda folder: [*QUICK, "--results", folder / "r.jsonl"], nproc=CP)


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
        calls.append((digest_rows(mine[0]), digest_rows(mine[1])))
    return calls


def check_cp_chunks(folder: Path) -> None:
    records = read_records(folder / "r.jsonl")
    layouts = [r["config"]["layout"] for r in records]
    assert layouts == ["zigzag", "contiguous"]  # the script's default: both, one after the other
    batch = records[0]["config"]["global_batch_size"]
    for rank in range(CP):
        got = [(call["rows"], call["more"][0]) for call in seen_calls(folder, rank)]
        want = [call for layout in layouts for call in expected_cp_calls(layout, batch, rank)]
        assert got == want, f"rank {rank}: the model was fed other tokens than its two chunks"


def test_context_parallel_feeds_each_rank_its_two_chunks(cp_runs):
    folder, _ = job(cp_runs, "correct")
    check_cp_chunks(folder)
    folder, _ = job(cp_runs, "zigzag_contiguous")
    with pytest.raises(AssertionError):
        check_cp_chunks(folder)


# ==== pipeline_parallel.py: micro-batches into the first stage, the loss out of the last =============

PP_SCRIPT = REPO / "05-advanced" / "pipeline_parallel.py"
PP, MICRO = 2, 2
PP_RUNS = {
    "correct": None,
    "previous_batch": ("inputs, targets = task.global_batch(step, args.global_batch_size)",
                       "inputs, targets = task.global_batch(max(step - 1, 0), args.global_batch_size)"),
    "loss_summed": ("torch.stack(micro_losses).mean()", "torch.stack(micro_losses).sum()"),
}


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, PP_SCRIPT, "TinyGPT", PP_RUNS, lambda folder: [
        *QUICK, "--schedule", "gpipe", "--microbatches", MICRO, "--results", folder / "r.jsonl"],
        nproc=PP, outputs=True)


def pp_micro_batches(batch: int):
    """(inputs, targets) of each (step, micro-batch): the step's global batch in MICRO equal parts."""
    task, size = TokenTask(model_config("gpt", "tiny"), seed=0), batch // MICRO
    out = {}
    for step in range(STEPS):
        inputs, targets = task.global_batch(step, batch)
        for m in range(MICRO):
            out[step, m] = inputs[m * size:(m + 1) * size], targets[m * size:(m + 1) * size]
    return out


def pp_calls(folder: Path, rank: int) -> list[dict]:
    """The stage's forwards of the training steps. torch's PipelineStage, given no example inputs
    (as here), first runs one forward of the first micro-batch to learn the shapes it will send
    (torch 2.13: ``_forward_metadata_inference``): it comes before the first step and is left out."""
    calls = seen_calls(folder, rank)
    extra = len(calls) - STEPS * MICRO
    assert extra in (0, 1), f"rank {rank}: {len(calls)} forwards for {STEPS} steps of {MICRO} micro-batches"
    if extra and rank == 0:  # the inference forward ran on the first micro-batch, like the first step
        assert calls[0]["rows"] == calls[1]["rows"]
    return calls[extra:]


def check_first_stage_rows(folder: Path) -> None:
    """The first stage (rank 0) runs every micro-batch forward, in order, with exactly its rows."""
    (record,) = read_records(folder / "r.jsonl")
    expected = pp_micro_batches(record["config"]["global_batch_size"])
    got = [call["rows"] for call in pp_calls(folder, 0)]
    assert got == [digest_rows(expected[step, m][0]) for step in range(STEPS) for m in range(MICRO)]


def check_pipeline_losses(folder: Path) -> None:
    """Each step's recorded loss is the mean over micro-batches of the token cross-entropy of the
    logits the last stage returned (the pipeline's loss is that mean: its gradients are averaged)."""
    (record,) = read_records(folder / "r.jsonl")
    expected = pp_micro_batches(record["config"]["global_batch_size"])
    calls = pp_calls(folder, PP - 1)
    for step in range(STEPS):
        losses = [torch.nn.functional.cross_entropy(torch.tensor(calls[step * MICRO + m]["outputs"]).flatten(0, 1),
                                                    expected[step, m][1].flatten()).item() for m in range(MICRO)]
        assert abs(record["losses"][step] - sum(losses) / MICRO) <= 1e-5, (step, record["losses"][step], losses)


def test_pipeline_first_stage_gets_each_micro_batch_in_order(pp_runs):
    folder, _ = job(pp_runs, "correct")
    check_first_stage_rows(folder)
    folder, _ = job(pp_runs, "previous_batch")
    with pytest.raises(AssertionError):
        check_first_stage_rows(folder)


def test_pipeline_loss_is_the_mean_over_micro_batches_of_the_last_stage(pp_runs):
    folder, _ = job(pp_runs, "correct")
    check_pipeline_losses(folder)
    folder, _ = job(pp_runs, "loss_summed")
    with pytest.raises(AssertionError):
        check_pipeline_losses(folder)
