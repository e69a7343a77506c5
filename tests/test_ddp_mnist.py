"""The reader's first command: ddp_mnist.py on 4 ranks, offline sample, default flags.

One launch checks: the offline notice, the accuracy target (>= 90% on the 5k sample), the harness
record (all-reduce bytes per step equal the gradient bytes exactly, model-state bytes), and the
rank-0 checkpoint (loads with weights_only=True into the plain model).
"""
import re

import pytest
import torch

from distkit.checkpoint import safe_load
from distkit.harness import bus_factor, read_records
from distkit.models import MnistCNN
from launch import REPO, python, torchrun

SCRIPT = REPO / "01-ddp-basics" / "ddp_mnist.py"


def test_ddp_mnist_default_run_on_offline_sample(tmp_path):
    results, checkpoint = tmp_path / "results.jsonl", tmp_path / "model.pt"
    run = torchrun(SCRIPT, "--data-dir", tmp_path / "data", "--offline", "--results", results,
                   "--checkpoint", checkpoint, "--log-file", tmp_path / "log.txt",
                   nproc=4, tmp_path=tmp_path, timeout=400)
    out = run.stdout
    assert "5k offline sample" in out
    accuracy = float(re.search(r"done: test accuracy ([\d.]+)%", out).group(1))
    assert accuracy >= 90.0, out[-2000:]
    assert re.search(r"world size 4 \| backend gloo \(cpu\)", out)

    (record,) = read_records(results)
    assert record["strategy"] == "ddp" and record["world_size"] == 4 and record["backend"] == "gloo"
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
    assert (tmp_path / "log.txt").read_text().count("epoch 3/3") == 1


@pytest.mark.parametrize("nproc", [1, 2])
def test_ddp_mnist_runs_with_one_and_two_processes(nproc, tmp_path):
    data = tmp_path / "data"
    args = ["--data-dir", data, "--offline", "--epochs", "1", "--max-steps", "4",
            "--results", tmp_path / "r.jsonl", "--checkpoint", tmp_path / "m.pt"]
    if nproc == 1:  # plain python: a world of one process on loopback
        run = python(SCRIPT, *args, tmp_path=tmp_path)
    else:
        run = torchrun(SCRIPT, *args, nproc=nproc, tmp_path=tmp_path)
    assert f"world size {nproc} | backend gloo (cpu)" in run.stdout
    (record,) = read_records(tmp_path / "r.jsonl")
    assert record["world_size"] == nproc
    assert torch.load(tmp_path / "m.pt", weights_only=True)["world_size"] == nproc
