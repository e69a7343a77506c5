"""The reader's first command: ddp_mnist.py on 4 ranks, offline sample, default flags.

One launch of the README's command checks: the offline notice, the accuracy target (>= 90% on the
5k sample), the harness record (all-reduce bytes per step equal the gradient bytes exactly, model-state bytes), and the
rank-0 checkpoint (loads with weights_only=True into the plain model).
"""
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ch01_common import README
from distkit.checkpoint import safe_load
from distkit.harness import bus_factor, read_records
from distkit.models import MnistCNN
from launch import QUICK_START_FILES, REPO, python, quick_start_record, readme_command, torchrun

SCRIPT = REPO / "01-ddp-basics" / "ddp_mnist.py"


def test_ddp_mnist_readme_command_on_offline_sample(first_command_run):
    """The chapter's first command is the top README's quick start: conftest.py runs it once (real
    torchrun in a fresh clone, default epochs and paths, the offline sample) for both READMEs' tests."""
    # the same command (--standalone only asks for a private rendezvous port, which tests always get)
    chapter = readme_command(README, "ddp_mnist.py", without="srun").replace("--standalone ", "")
    assert chapter == readme_command(REPO / "README.md", "ddp_mnist.py")
    folder, done = first_command_run
    checkpoint = folder / QUICK_START_FILES["model"]
    out = done.stdout
    assert "5k offline sample" in out
    accuracy = float(re.search(r"done: test accuracy ([\d.]+)%", out).group(1))
    assert accuracy >= 90.0, out[-2000:]
    assert re.search(r"world size 4 \| backend gloo \(cpu\)", out)

    record = quick_start_record(folder)
    assert record["strategy"] == "ddp" and record["world_size"] == 4 and record["backend"] == "gloo"
    assert record["model"] == {"arch": "mnist_cnn"} and "model" not in record["config"]
    param_count = sum(p.numel() for p in MnistCNN().parameters())
    assert record["param_count"] == param_count
    grad_bytes = param_count * 4  # fp32 gradients
    # DDP's buckets are exact concatenations of the gradients: no padding, nothing else reduced.
    for per_rank in record["metrics"]["comm_per_step_per_rank"]:
        assert set(per_rank) == {"all_reduce"}, per_rank
        assert per_rank["all_reduce"]["bytes"] == grad_bytes
        assert per_rank["all_reduce"]["bus_bytes"] == pytest.approx(grad_bytes * bus_factor("all_reduce", 4))
    for state in record["metrics"]["model_state_bytes_per_rank"]:
        # Adadelta keeps two buffers per parameter (square_avg, acc_delta).
        assert state == {"params": grad_bytes, "grads": grad_bytes, "optimizer": 2 * grad_bytes}
    assert record["metrics"]["timed_steps"] > 0 and record["metrics"]["samples_per_s"] > 0
    assert abs(record["test_accuracy"] * 100 - accuracy) < 0.01

    state = safe_load(checkpoint)
    model = MnistCNN()
    model.load_state_dict(state["model"])
    assert state["world_size"] == 4
    assert (folder / QUICK_START_FILES["log"]).read_text().count("epoch 3/3") == 1


def test_ddp_mnist_runs_with_one_and_two_processes(tmp_path):
    """Plain ``python`` (a world of one process on loopback) and a 2-rank torchrun, side by side."""
    def launch(nproc):
        folder = tmp_path / f"n{nproc}"
        args = ["--data-dir", folder / "data", "--offline", "--epochs", "1", "--max-steps", "4",
                "--results", folder / "r.jsonl", "--save", folder / "m.pt"]
        if nproc == 1:
            return python(SCRIPT, *args, tmp_path=folder)
        return torchrun(SCRIPT, *args, nproc=nproc, tmp_path=folder)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip((1, 2), pool.map(launch, (1, 2))))
    for nproc, result in done.items():
        assert f"world size {nproc} | backend gloo (cpu)" in result.stdout
        (record,) = read_records(tmp_path / f"n{nproc}" / "r.jsonl")
        assert record["world_size"] == nproc
        assert torch.load(tmp_path / f"n{nproc}" / "m.pt", weights_only=True)["world_size"] == nproc


# ---- GPU suite (pytest -m gpu): the same first command on the GPUs the machine has ----------------

@pytest.mark.gpu
def test_ddp_mnist_on_one_gpu_with_nccl(tmp_path):
    """The quick start at world size 1 (``torchrun --nproc_per_node=1``, the real torchrun) on a GPU
    host picks NCCL on cuda:0 by itself; the epoch totals and the test counts (all-reduced) must live
    on the GPU. The GPU suite runs this test first."""
    from launch import job_env, require_gpus

    require_gpus(1)
    results = tmp_path / "r.jsonl"
    run = torchrun(SCRIPT, "--data-dir", tmp_path / "data", "--offline", "--epochs", "2",
                   "--results", results, "--save", tmp_path / "m.pt", "--log-file", tmp_path / "log.txt",
                   nproc=1, env=job_env(tmp_path, gpu=True), timeout=140, launcher="torchrun")
    assert "world size 1 | backend nccl (cuda)" in run.stdout, run.stdout[-2000:]
    accuracy = float(re.search(r"done: test accuracy ([\d.]+)%", run.stdout).group(1))
    assert accuracy >= 85.0, run.stdout[-2000:]  # 2 epochs on the 4k offline sample, one rank
    (record,) = read_records(results)
    assert (record["backend"], record["device"]) == ("nccl", "cuda")
    assert record["machine"]["gpu_count"] >= 1 and record["machine"]["device_name"]
    metrics = record["metrics"]
    assert metrics["peak_memory_kind"] == "cuda_max_allocated"
    param_bytes = sum(p.numel() for p in MnistCNN().parameters()) * 4
    (state,) = metrics["model_state_bytes_per_rank"]
    assert state == {"params": param_bytes, "grads": param_bytes, "optimizer": 2 * param_bytes}
    (peak,) = metrics["peak_memory_bytes_per_rank"]
    # At least the model state (params + grads + 2 Adadelta buffers), and activations of a 64-image
    # batch of a small CNN stay far below 1 GiB: a leak or a wrong counter lands outside.
    assert 4 * param_bytes <= peak < 2**30, peak
    assert metrics["samples_per_s"] > 0
    assert torch.load(tmp_path / "m.pt", weights_only=True, map_location="cpu")["world_size"] == 1


@pytest.mark.gpu
def test_ddp_mnist_on_four_gpus_with_nccl(tmp_path):
    """The README's first command on a 4-GPU node (needs one GPU per rank: NCCL cannot share one)."""
    from launch import job_env, require_gpus

    require_gpus(4, "one GPU per rank")
    results = tmp_path / "r.jsonl"
    run = torchrun(SCRIPT, "--data-dir", tmp_path / "data", "--offline", "--results", results,
                   "--save", tmp_path / "m.pt", "--log-file", tmp_path / "log.txt",
                   nproc=4, env=job_env(tmp_path, gpu=True), timeout=600)
    assert "world size 4 | backend nccl (cuda)" in run.stdout
    accuracy = float(re.search(r"done: test accuracy ([\d.]+)%", run.stdout).group(1))
    assert accuracy >= 90.0, run.stdout[-2000:]
    (record,) = read_records(results)
    grad_bytes = sum(p.numel() for p in MnistCNN().parameters()) * 4
    for per_rank in record["metrics"]["comm_per_step_per_rank"]:
        assert per_rank["all_reduce"]["bytes"] == grad_bytes


@pytest.mark.gpu
def test_more_ranks_than_gpus_with_nccl_is_one_line(tmp_path):
    """--backend nccl with one rank more than the GPUs present: one error line, no hang."""
    from launch import assert_one_line_error, gpu_count, job_env, require_gpus

    require_gpus(1)
    ranks = gpu_count() + 1
    result = torchrun(SCRIPT, "--backend", "nccl", "--offline", "--data-dir", tmp_path / "data",
                      nproc=ranks, env=job_env(tmp_path, gpu=True), check=False, timeout=180)
    assert_one_line_error(result, f"{ranks} local ranks need {ranks} GPUs")
