"""The harness's numbers that the GPU path gets wrong most easily, checked where the CPU can check them
(tests/test_gpu_numbers.py checks the same on a GPU):

* MFU's peak FLOP/s is measured in the dtype the training's matmuls ran in, observed on the
  instrumented step (a bf16 autocast run records ``bfloat16``, an fp32 run ``float32``; negative
  control: the harness's old behaviour, the peak in float32 whatever ran, records ``float32`` for
  the bf16 run), compiled models included, and the record's MFU follows from its own fields;
  ``ddp_training.py --precision bf16`` records ``bfloat16``.
* The matmul counter sees forward and backward: its FLOPs for one step of the tiny GPT are the
  analytic ``training_flops_per_token`` x tokens (negative control: forward only is a third).
* A record's machine follows the device the run used (a CPU run on a GPU host is labelled a CPU
  run): the labelling rule is a pure function, tested here as if CUDA were present (negative
  control: the old rule, "the GPU whenever CUDA is available", labels those CPU runs as GPU runs).

Everything runs in this process (a world of one, no process group) except the one script launch.
"""
from __future__ import annotations

import pytest
import torch

from ch01_common import TRAINING, training_flags
from distkit.comm_counter import MatmulCounter
from distkit.harness import Harness, read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from distkit.provenance import machine, machine_label, provenance, run_device
from distkit.runtime import DistContext
from distkit.theory import training_flops_per_token
from launch import python

ONE_PROCESS = DistContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo",
                          device=torch.device("cpu"), timeout_s=60)
CFG = gpt_config("tiny")
BATCH = 4


def train_tiny(autocast: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
               compile_backend=None) -> dict:
    """Four steps of the tiny GPT through the harness (1 warm-up, 1 instrumented, 2 timed), under
    CPU autocast to ``autocast`` when given; the record's metrics."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    if compile_backend is not None:
        model.compile(backend=compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    harness = Harness(ONE_PROCESS, "probe", model=model, optimizer=optimizer, warmup_steps=1,
                      comm_steps=1, compute_dtype=compute_dtype)
    task = TokenTask(CFG)
    for step in range(4):
        inputs, targets = task.global_batch(step, BATCH)
        with harness.step(samples=BATCH, tokens=BATCH * CFG.seq_len):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return harness.finish()["metrics"]


def assert_mfu_from_fields(metrics: dict) -> None:
    """MFU recomputed from the record's own fields: tokens/s per device x FLOPs per token / peak."""
    per_device = metrics["tokens_per_step"] / metrics["step_time_s_median"] / ONE_PROCESS.world_size
    assert metrics["tokens_per_s_per_device"] == pytest.approx(per_device, rel=1e-12)
    assert metrics["model_flops_per_token"] == training_flops_per_token(CFG)
    assert metrics["mfu"] == pytest.approx(per_device * metrics["model_flops_per_token"]
                                           / metrics["peak_flops_per_s"], rel=1e-12)
    assert 0 < metrics["mfu"] < 1


def test_peak_flops_are_measured_in_the_dtype_the_matmuls_ran_in():
    bf16 = train_tiny(autocast=torch.bfloat16)
    fp32 = train_tiny()
    assert bf16["peak_flops_dtype"] == "bfloat16", bf16["peak_flops_dtype"]
    assert fp32["peak_flops_dtype"] == "float32", fp32["peak_flops_dtype"]
    for metrics in (bf16, fp32):
        assert_mfu_from_fields(metrics)
        # TF32 changes an fp32 peak (and fp32 numerics): the record says which applied
        assert metrics["float32_matmul_precision"] == torch.get_float32_matmul_precision() == "highest"

    # Negative control: the old harness measured the peak in float32 whatever the run computed in
    # (compute_dtype defaulted to float32 and no script passed it); the override reproduces it.
    old = train_tiny(autocast=torch.bfloat16, compute_dtype=torch.float32)
    assert old["peak_flops_dtype"] == "float32"
    assert old["peak_flops_dtype"] != bf16["peak_flops_dtype"]  # what the assertion above catches


def test_compiled_model_records_its_training_dtype():
    """A compiled model's instrumented step runs eager (force_eager stance) and is observed like an
    eager one; the timed steps run the compiled code (tests/test_data_and_harness.py counts that)."""
    torch._dynamo.reset()
    try:
        metrics = train_tiny(autocast=torch.bfloat16, compile_backend="eager")
    finally:
        torch._dynamo.reset()
    assert metrics["peak_flops_dtype"] == "bfloat16"
    assert metrics["peak_memory_kind"] == "cpu_peak_rss"  # compiled: no MemTracker, as before
    assert_mfu_from_fields(metrics)


def test_matmul_counter_sees_forward_and_backward():
    """One training step of the tiny GPT: the counted matmul FLOPs equal the analytic
    6N + 12 L d s per token (distkit.theory) within 1% (the formula counts the LayerNorm weights as
    multiplying and the attention as non-causal, torch's attention formula does not: 0.4% here).
    Negative control: forward only, about a third of it, is outside that 1%."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    inputs, targets = TokenTask(CFG).global_batch(0, BATCH)
    expected = training_flops_per_token(CFG) * BATCH * CFG.seq_len
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with MatmulCounter() as both:
            lm_loss(model(inputs), targets).backward()
        with MatmulCounter() as forward_only:
            lm_loss(model(inputs), targets)
    assert set(both.flops_by_dtype) == {torch.bfloat16} and both.dominant_dtype() == torch.bfloat16
    assert sum(both.flops_by_dtype.values()) == pytest.approx(expected, rel=0.01)
    # backward multiplies twice per forward matmul (gradients of both operands)
    assert 0.3 < sum(forward_only.flops_by_dtype.values()) / sum(both.flops_by_dtype.values()) < 0.36
    assert MatmulCounter().dominant_dtype() is None  # nothing ran: the harness falls back to float32


def test_ddp_training_bf16_records_a_bf16_peak(tmp_path):
    """The script path: ddp_training.py --precision bf16 (autocast) on one CPU process."""
    python(TRAINING, *training_flags(tmp_path), "--precision", "bf16", tmp_path=tmp_path, timeout=300)
    record = read_records(tmp_path / "results.jsonl")[-1]
    assert record["config"]["precision"] == "bf16"
    assert record["metrics"]["peak_flops_dtype"] == "bfloat16"
    assert 0 < record["metrics"]["mfu"] < 1


# What a run prints, and the device the label must follow. The device statement is every chapter
# script's first line; commands without one follow their flags, then the host.
LABEL_CASES = [
    ("torchrun x.py", "[rank 0] world size 4 | backend gloo | device cpu | per-rank batch 4", "cpu"),
    ("deepspeed x.py", "[rank 0] zero3 | world size 1 | backend nccl | device cuda:0 | 1 parameters", "cuda"),
    ("python x.py --device cpu", "done", "cpu"),
    ("python x.py --device=cpu", "done", "cpu"),
    ("torchrun x.py --backend gloo", "done", "cpu"),
    ("torchrun x.py", "done", "cuda"),  # says nothing: the scripts take the GPUs where there are any
    # an error message naming the flag is no statement of the device
    ("torchrun x.py --backend nccl", "error: ... or use --backend gloo --device cpu", "cuda"),
]


def old_rule(command: str, output: str, cuda_available: bool) -> str:
    """How records were labelled before: the GPU whenever CUDA was available."""
    return "cuda" if cuda_available else "cpu"


def test_a_cpu_run_is_labelled_with_the_cpu_even_on_a_gpu_host():
    for command, output, device in LABEL_CASES:
        assert run_device(command, output, cuda_available=True) == device, (command, output)
        assert run_device(command, output, cuda_available=False) == "cpu", (command, output)
    # Negative control: the old rule gets every CPU run on a GPU host wrong.
    wrong = [case for case in LABEL_CASES if old_rule(case[0], case[1], True) != case[2]]
    assert wrong == [case for case in LABEL_CASES if case[2] == "cpu"]

    # A CPU device gives a CPU machine, whatever the host has: no GPU name, no GPU count.
    cpu = machine(torch.device("cpu"))
    assert "gpu_count" not in cpu and cpu["device_name"].endswith("-core CPU")
    assert machine("cpu") == cpu == provenance("python x.py", device=torch.device("cpu"))["machine"]
    assert machine_label(cpu, "gloo") == f"{cpu['device_name']}, gloo"
    # On a host without CUDA (this suite hides the GPUs) nothing changes for callers that name no device.
    assert machine() == cpu


def test_records_run_labels_the_device_the_command_reported():
    """distkit.records' capture, end to end on what a command prints (CUDA hidden here: CPU)."""
    from distkit.records import capture

    record = capture("echo '[rank 0] world size 1 | backend gloo | device cpu | per-rank batch 1'", "probe")
    assert record["backend"] == "gloo" and record["returncode"] == 0
    assert "gpu_count" not in record["machine"] and record["machine"]["device_name"].endswith("-core CPU")
