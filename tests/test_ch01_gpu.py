"""Chapter 01 on GPUs (``pytest -m gpu``): the README commands (ddp_mnist.py aside) at small size on
NCCL, world size 1 wherever one GPU can serve it, multi-rank where the machine has the GPUs.

Every job sees the machine's GPUs (``job_env(gpu=True)``) and is forced onto NCCL
(``--backend nccl``), so a silent fall-back to gloo/CPU fails the test instead of passing it. The
assertions are outcomes: loss falls, the record says nccl/cuda, peak memory is CUDA's and sane
against the model-state bytes, the DDP result equals single-process training within the CPU
tests' tolerance, a restart resumes from the right step.
"""
from __future__ import annotations

import sys

import pytest
import torch

from ch01_common import (
    CHAPTER,
    STEPS,
    TINY,
    TOLERANCE,
    final_params,
    max_diff,
    readme_argv,
    single_process_params,
    training_flags,
)
from distkit.checkpoint import safe_load
from distkit.harness import read_records
from launch import assert_one_line_error, gpu_count, job_env, require_gpus, run

pytestmark = pytest.mark.gpu
NCCL = ["--backend", "nccl"]


def on_gpus(argv: list[str], nproc: int) -> list[str]:
    """A README torchrun command with ``nproc`` workers instead of 4."""
    return [f"--nproc_per_node={nproc}" if a.startswith("--nproc_per_node=") else a for a in argv]


def gpu_env(folder, **extra) -> dict:
    return job_env(folder, gpu=True, **extra)


def assert_nccl_record(record: dict, world_size: int) -> None:
    """The harness record of a job that really ran on NCCL and CUDA, with CUDA's peak memory."""
    assert (record["backend"], record["device"], record["world_size"]) == ("nccl", "cuda", world_size)
    metrics = record["metrics"]
    assert metrics["peak_memory_kind"] == "cuda_max_allocated"
    for peak, state in zip(metrics["peak_memory_bytes_per_rank"], metrics["model_state_bytes_per_rank"]):
        # at least the parameters, gradients and optimizer state counted on that rank; the tiny
        # model's activations add a little, nowhere near a GiB
        assert sum(state.values()) <= peak < 2**30, (peak, state)
    assert metrics["tokens_per_s"] is None or metrics["tokens_per_s"] > 0


@pytest.fixture(scope="module")
def gpu_uninterrupted(tmp_path_factory):
    """The README's ddp_training.py command on one GPU, NCCL, with the CPU tests' small flags."""
    require_gpus(1, "NCCL needs a GPU per rank")
    folder = tmp_path_factory.mktemp("gpu_uninterrupted")
    out = run([*on_gpus(readme_argv("--config"), 1), *training_flags(folder), *NCCL],
              env=gpu_env(folder), timeout=600)
    assert "backend nccl | device cuda" in out.stdout and "done: loss" in out.stdout
    return folder


def test_ddp_training_on_one_gpu_matches_single_process(gpu_uninterrupted):
    record = read_records(gpu_uninterrupted / "results.jsonl")[-1]
    assert_nccl_record(record, 1)
    assert record["loss_history"][-1] < record["loss_history"][0]
    # One GPU rank with 2 micro-batches = the whole global batch, like the CPU reference process.
    assert max_diff({k: v.cpu() for k, v in final_params(gpu_uninterrupted).items()},
                    single_process_params()) < TOLERANCE
    # The checkpoint holds this rank's own GPU generator only (not one per GPU of the node).
    rng = safe_load(gpu_uninterrupted / "ck" / f"step_{STEPS:06d}.pt")["rng_per_rank"]
    assert len(rng) == 1 and isinstance(rng[0]["cuda"], torch.Tensor)


def test_restart_on_one_gpu_resumes(gpu_uninterrupted, tmp_path):
    """SIGKILL the only rank at step 5; torchrun restarts it, it resumes from step 4 on the GPU."""
    out = run([*on_gpus(readme_argv("--crash-at-step"), 1), *training_flags(tmp_path), *NCCL,
               "--crash-at-step", "5", "--crash-rank", "0"],
              env=gpu_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), timeout=600)
    assert "rank 0 sends itself SIGKILL at step 5" in out.stdout
    assert f"resumed from {tmp_path / 'ck' / 'step_000004.pt'} at step 4" in out.stdout
    # GPU kernels (embedding backward's atomics) need not repeat bit for bit: close, not identical.
    assert max_diff(final_params(tmp_path), final_params(gpu_uninterrupted)) < TOLERANCE


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_gpu(precision, tmp_path):
    """bf16 autocast, and fp16 autocast with GradScaler (GPU only): finite, falling loss on NCCL."""
    require_gpus(1, "fp16 GradScaler runs on a GPU")
    out = run([*on_gpus(readme_argv("--config"), 1), *training_flags(tmp_path), *NCCL,
               "--precision", precision, "--steps", "12"], env=gpu_env(tmp_path), timeout=600)
    assert f"| {precision}" in out.stdout
    record = read_records(tmp_path / "results.jsonl")[-1]
    assert_nccl_record(record, 1)
    losses = record["loss_history"]
    assert all(loss == loss and loss < 100 for loss in losses) and losses[-1] < losses[0]
    scaler = safe_load(tmp_path / "ck" / "step_000012.pt")["scaler"]
    assert (precision == "fp16") == bool(scaler), scaler  # the scaler's state exists only when enabled


def test_ddp_from_scratch_on_one_gpu(tmp_path):
    require_gpus(1, "NCCL needs a GPU per rank")
    out = run([*on_gpus(readme_argv("ddp_from_scratch.py"), 1), *TINY, *NCCL, "--save", str(tmp_path / "s.pt"),
               "--results", str(tmp_path / "s.jsonl")], env=gpu_env(tmp_path), timeout=600)
    assert "backend nccl (cuda)" in out.stdout
    record = read_records(tmp_path / "s.jsonl")[-1]
    assert_nccl_record(record, 1)
    assert record["loss_history"][-1] < record["loss_history"][0]
    reference = single_process_params()
    # the by-hand all-reduces of CUDA gradients, counted by the harness: every fp32 gradient once
    comm = record["metrics"]["comm_per_step"]["all_reduce"]
    assert comm["bytes"] == sum(t.numel() * 4 for t in reference.values()) and comm["calls"] == len(reference)
    assert max_diff({k: v.cpu() for k, v in safe_load(tmp_path / "s.pt")["model"].items()}, reference) < TOLERANCE


def test_validate_distributed_on_one_gpu(tmp_path):
    require_gpus(1, "NCCL needs a GPU per rank")
    out = run([*on_gpus(readme_argv("validate_distributed.py"), 1), *NCCL], env=gpu_env(tmp_path), timeout=600)
    lines = out.stdout.splitlines()
    for check in ("process group", "device binding", "backend nccl", "all_reduce", "all_gather", "broadcast"):
        assert any(line.startswith("PASS") and check in line for line in lines), (check, out.stdout)
    assert any("backend nccl" in line for line in lines if "process group" in line)
    assert any("rank 0 -> cuda:0" in line for line in lines)
    assert "all checks passed" in out.stdout


def test_benchmark_and_launchers_on_gpu(tmp_path):
    """ddp_benchmark.py (world size 1, NCCL), launch_ddp.sh (auto: one process per visible GPU)
    and ddp_spawn.py (one process, NCCL)."""
    require_gpus(1, "NCCL needs a GPU per rank")
    results = tmp_path / "bench.jsonl"
    run([*readme_argv("ddp_benchmark.py"), "--world-sizes", "1", "--model-size", "tiny", "--per-rank-batch", "4",
         "--steps", "4", *NCCL, "--results", str(results), "--plot", str(tmp_path / "p.png")],
        env=gpu_env(tmp_path), timeout=600)
    records = read_records(results)
    assert sorted(r["config"]["scaling"] for r in records) == ["strong", "weak"]
    for record in records:
        assert_nccl_record(record, 1)

    gpus = gpu_count()
    argv = readme_argv("launch_ddp.sh")
    del argv[argv.index("--nproc"):argv.index("--nproc") + 2]  # auto: one process per visible GPU
    launched = run([*argv, "--model-size", "tiny", "--steps", "3", "--global-batch-size", str(4 * gpus),
                    "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "logs"),
                    "--results", str(tmp_path / "r.jsonl")], env=gpu_env(tmp_path), timeout=600)
    assert f"({gpus} GPUs here)" in launched.stdout and f"--nproc_per_node={gpus}" in launched.stdout
    assert f"world size {gpus} | backend nccl | device cuda" in launched.stdout
    # CUDA_VISIBLE_DEVICES narrows what the launcher counts, as it narrows what the workers see.
    one = run(["bash", str(CHAPTER / "launch_ddp.sh"), "--dry-run", str(CHAPTER / "ddp_training.py")],
              env=gpu_env(tmp_path, CUDA_VISIBLE_DEVICES="0"))
    assert "(1 GPUs here)" in one.stdout and "--nproc_per_node=1" in one.stdout

    spawned = run([*readme_argv("ddp_spawn.py"), "--nproc", "1", "--steps", "2", "--model-size", "tiny", *NCCL],
                  env=gpu_env(tmp_path), timeout=600)
    assert "spawned 1 processes | backend nccl" in spawned.stdout


def test_too_many_ranks_for_the_gpus_is_one_line(tmp_path):
    """More NCCL ranks than GPUs: one line naming both counts, from distkit's backend choice."""
    require_gpus(1, "the message names the GPUs present")
    gpus = gpu_count()
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus + 1}",
                  str(CHAPTER / "ddp_training.py"), *NCCL, "--model-size", "tiny",
                  "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "logs")],
                 env=gpu_env(tmp_path), timeout=300, check=False)
    assert_one_line_error(result, f"--backend nccl: {gpus + 1} local ranks need {gpus + 1} GPUs but this "
                                  f"machine has {gpus}")


def test_two_gpus_match_single_process(tmp_path):
    """Two NCCL ranks (one GPU each): the same parameters as one process on the global batch."""
    require_gpus(2, "one GPU per NCCL rank")
    run([*on_gpus(readme_argv("--config"), 2), *training_flags(tmp_path), *NCCL], env=gpu_env(tmp_path), timeout=600)
    assert_nccl_record(read_records(tmp_path / "results.jsonl")[-1], 2)
    assert max_diff({k: v.cpu() for k, v in final_params(tmp_path).items()}, single_process_params()) < TOLERANCE
