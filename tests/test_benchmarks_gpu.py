"""benchmarks/ on GPUs (``pytest -m gpu``): a small matrix on NCCL, checked against distkit.theory the way
the CPU suite checks its quick matrix, and the cells that need more GPUs than the machine has run on
CPU/gloo with a note in their record instead of being skipped.

At world size 1 only the model state is compared with distkit.theory: over a group of one the
implementations skip some collectives (DTensor, FSDP2's gathers) and keep others (DDP's
all-reduce), which distkit.theory does not model, and every bus byte is zero anyway. ZeRO cells are
checked for placement and memory but not against the byte bars on GPU: DeepSpeed's GPU path may pick
other collectives than the CPU/gloo path distkit.theory models (see the README's ZeRO row).
"""
from __future__ import annotations

import json

import pytest

from benchmarks_common import BENCH, BYTES_TOLERANCE, STATE_TOLERANCE
from distkit import compare
from distkit.harness import read_records
from launch import REPO, gpu_count, job_env, python, require_gpus

pytestmark = pytest.mark.gpu

SMALL = ("--n-layer", "4", "--steps", "5", "--warmup-steps", "1", "--global-batch-size", "8")


def matrix(tmp_path, *flags: str) -> tuple[list[dict], str]:
    results = tmp_path / "r.jsonl"
    out = python(BENCH / "distributed_benchmarks.py", *SMALL, *flags, "--results", results,
                 env=job_env(tmp_path, gpu=True), tmp_path=tmp_path, timeout=1200)
    return [json.loads(line) for line in results.read_text().splitlines()], out.stdout


def assert_gpu_cell(record: dict, world_size: int) -> None:
    assert record["status"] == "ok", record.get("error")
    assert (record["backend"], record["device"], record["world_size"]) == ("nccl", "cuda", world_size)
    assert record["benchmark"]["placement"]["note"] is None
    metrics = record["metrics"]
    assert metrics["peak_memory_kind"] == "cuda_max_allocated"
    for peak, state in zip(metrics["peak_memory_bytes_per_rank"], metrics["model_state_bytes_per_rank"],
                           strict=True):
        # Parameters, gradients and optimizer state all sit on the GPU (zero3_offload keeps its
        # optimizer state in CPU memory, so its state exceeds nothing here but the params); the tiny
        # model with activations of 8 sequences stays far below 1 GiB.
        on_gpu = state["params"] if record["strategy"] == "zero3_offload" else sum(state.values())
        assert on_gpu <= peak < 2**30, (record["strategy"], peak, state)
    assert metrics["timed_steps"] >= 2 and metrics["step_time_s_median"] > 0


def test_single_gpu_matrix_runs_on_nccl_and_matches_theory(tmp_path):
    require_gpus(1)
    strategies = ["ddp", "fsdp_full_shard", "fsdp_no_shard", "zero2", "tp", "pp_1f1b"]
    records, stdout = matrix(tmp_path, "--world-sizes", "1", "--strategies", *strategies)
    assert [r["strategy"] for r in records] == strategies, stdout[-3000:]
    for record in records:
        assert_gpu_cell(record, 1)
        comparison = compare.compare_record(record)
        assert comparison["state_error"] <= STATE_TOLERANCE, (record["strategy"], comparison["state"])


def test_two_gpu_matrix_meets_the_byte_bars(tmp_path):
    require_gpus(2, "one GPU per NCCL rank")
    strategies = ["ddp", "fsdp_full_shard", "fsdp_shard_grad_op", "tp", "tp_sp", "pp_gpipe", "zero3"]
    records, stdout = matrix(tmp_path, "--world-sizes", "2", "--strategies", *strategies)
    assert {r["strategy"] for r in records} == set(strategies), stdout[-3000:]
    for record in records:
        assert_gpu_cell(record, 2)
        comparison = compare.compare_record(record)
        assert comparison["state_error"] <= STATE_TOLERANCE, (record["strategy"], comparison["state"])
        if not record["strategy"].startswith("zero"):
            assert comparison["comm_error"] <= BYTES_TOLERANCE, (record["strategy"], comparison["comm"])


@pytest.mark.parametrize("script, strategy_flags", [
    ("05-advanced/pipeline_parallel.py", ("--schedule", "1f1b", "1f1b", "--microbatches", "4",
                                          "--save", "{tmp}/pp_{{schedule}}_{{microbatches}}.pt")),
    ("02-fsdp/fsdp_transformer.py", ("--sharding", "full_shard", "full_shard")),
], ids=["pipeline", "fsdp"])
def test_grouped_strategies_start_on_a_clean_gpu_slate(script, strategy_flags, tmp_path):
    """--quick runs several strategies in one process (a grouped cell). The same strategy twice in a
    row must report the same peak: were the first one's model and AdamW state (16 bytes/parameter,
    80 MB for the medium model) still allocated, or counted, the second peak would exceed the first
    by about that much."""
    require_gpus(1)
    results = tmp_path / "r.jsonl"
    flags = [flag.format(tmp=tmp_path) for flag in strategy_flags]
    python(REPO / script, *flags, "--model-size", "medium", "--steps", "3", "--warmup-steps", "1",
           "--global-batch-size", "8", "--results", results, "--backend", "nccl",
           env=job_env(tmp_path, gpu=True), tmp_path=tmp_path, timeout=600)
    first, second = [r["metrics"] for r in read_records(results)]
    state = sum(first["model_state_bytes_per_rank"][0].values())
    (peak_1,), (peak_2,) = first["peak_memory_bytes_per_rank"], second["peak_memory_bytes_per_rank"]
    assert state <= peak_1 and state <= peak_2
    assert abs(peak_2 - peak_1) < 0.25 * state, (peak_1, peak_2, state)


def test_cells_beyond_the_gpus_run_on_cpu_with_a_note(tmp_path):
    """A cell with one rank more than the machine has GPUs: on CPU/gloo (GPUs hidden from it), its
    record saying so; with --gpu-only it is skipped instead."""
    require_gpus(1)
    ranks = gpu_count() + 1
    records, stdout = matrix(tmp_path, "--world-sizes", str(ranks), "--strategies", "ddp",
                             "--global-batch-size", str(4 * ranks))
    (record,) = records
    assert record["status"] == "ok", record.get("error")
    assert (record["backend"], record["device"], record["world_size"]) == ("gloo", "cpu", ranks)
    placement = record["benchmark"]["placement"]
    assert placement["gpus_hidden"] and f"{ranks} ranks need {ranks} GPUs" in placement["note"]
    assert "ran on CPU/gloo" in stdout and "cells run on CPU/gloo" in stdout
    skipped, stdout = matrix(tmp_path / "gpu_only", "--world-sizes", str(ranks), "--strategies", "ddp",
                             "--global-batch-size", str(4 * ranks), "--gpu-only")
    (record,) = skipped
    assert record["status"] == "skipped" and "--gpu-only" in record["error"], stdout[-2000:]


def test_planner_predicts_the_single_gpu_cells(tmp_path):
    """The planner's validation at one-GPU shapes: the large GPT (39M parameters, sequences of 256) at
    world size 1 under every strategy that runs on one GPU. The planner's model state equals the
    measured bytes; its activations are within 10% and its peak within 15% of what the harness's
    MemTracker measured; with the GPU's speed measured on the DDP cell (``with_measured_speed``:
    the model's achieved fraction of the datasheet peak), the other cells' step times are within
    the validation bounds (median 20%, worst 50%). Bug caught: a GPU memory model that forgets a
    strategy's gathered parameters or buffers, or a time model charging work a single GPU does not
    do. Not yet run on a GPU (no session so far was lent one)."""
    import subprocess
    import sys

    from distkit import planner

    require_gpus(1)
    name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          env=job_env(gpu=True), capture_output=True, text=True, timeout=120).stdout
    gpu = planner.gpu_type(name)
    if gpu is None:
        pytest.skip(f"no planner.GPUS entry for {name.strip()!r}")
    strategies = ["ddp", "fsdp_full_shard", "fsdp_no_shard", "tp", "pp_1f1b"]
    records, stdout = matrix(tmp_path, "--world-sizes", "1", "--strategies", *strategies, "--model-size", "large",
                             "--n-layer", "12", "--global-batch-size", "32", "--steps", "8")
    assert [r["strategy"] for r in records] == strategies, stdout[-3000:]
    cluster = planner.with_measured_speed(planner.cluster(gpu, 1), records, arch="gpt")
    rows = planner.validate(records, cluster)
    assert len(rows) == len(strategies)
    for row in rows:
        assert row["state_error"] == 0, row
        assert abs(row["activations_error"]) <= 0.10, row
        assert abs(row["peak_error"]) <= 0.15, row
    step = planner.validation_summary(rows)["step"]
    assert step["cells"] == len(strategies) - 1
    assert step["median"] <= 0.20 and step["worst"] <= 0.50, planner.validation_table(rows)
