"""Chapter 03 (DeepSpeed ZeRO) on GPUs with NCCL: the README commands at small size, asserting what
they produce, as ``test_ch03_deepspeed.py`` does on CPU.

Run with ``python3 -m pytest -m gpu tests/test_ch03_gpu.py``. With one GPU the commands run at world
size 1 (``--nproc_per_node=1`` / ``--num_gpus=1``, ``--backend nccl``); the multi-rank checks need 2
or 4 GPUs (one GPU cannot host several NCCL ranks) and skip, saying so, on a smaller machine.

Written by reading, before any GPU ran this code: where an assertion fails on a real GPU, check the
claim before loosening it.

Tolerance: one rule, ``WEIGHT_TOL`` (5e-5 per weight after 4-6 AdamW steps at lr 3e-3), for GPU
stages against each other and for a GPU run against the CPU single-process reference, as chapter 01's
GPU tests use its 5e-5 (``GPU_TOL`` is the same number). torch computes float32 matmuls in float32 on
the GPU by default (``torch.get_float32_matmul_precision()`` "highest": TF32 off for matmuls; cuDNN's
TF32 default concerns convolutions, which these transformers have none of; fp32 attention runs
CUTLASS's 3xTF32, float32-accurate), so what is left between a GPU and the CPU is the rounding of
float32 sums taken in another order (GEMM tiling, other exp/erf implementations, CUDA's embedding
backward accumulating with atomics, so two GPU runs are not bit-identical either), about 1e-7
relative per operation. That is the same kind and size of difference as the CPU suite's multi-rank
runs against one process (each rank multiplies other shapes, the reduction sums in another order),
which Adam magnifies for near-zero gradients to 1e-6-1e-5, within 5e-5. A weight moves up to 3e-3 per
step, so a wrong step (a missing reduction, a doubled gradient) shows far above it. The GPU jobs'
records say "highest" (``float32_matmul_precision``, asserted in tests/test_gpu_numbers.py); a run
with TF32 on (precision "high") would need its own tolerance.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from ch03_common import LR, README, SMALL, STRATEGIES, WEIGHT_TOL, expected_state, max_diff, reference_weights
from distkit.checkpoint import load_model_state, safe_load
from distkit.deepspeed import EVAL_BATCH, EVAL_STEP
from distkit.harness import read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from launch import assert_one_line_error, command_argv, gpu_count, job_env, readme_command, require_gpus, run

pytestmark = pytest.mark.gpu

GPU_TOL = WEIGHT_TOL  # one rule for GPU and CPU comparisons: see the module docstring
NCCL = ["--backend", "nccl"]
# A 5e8-element bucket alone is 1.86 GiB of fp32. Everything else these tiny runs hold (model state,
# activations, cuBLAS workspaces allocated through the caching allocator) stays far below this.
PEAK_ALLOWANCE = 256 * 2**20


def run_gpu(needles: tuple[str, ...], ranks: int, extra: list, tmp_path: Path, timeout: float = 600,
            check: bool = True, fresh_start: bool = False):
    """The README command with ``needles`` on ``ranks`` GPUs: its launcher's rank count replaced,
    ``extra`` appended, the GPUs visible (``job_env(gpu=True)``). ``fresh_start`` appends
    ``--resume none`` (the README's deepspeed-launcher command continues an earlier run with
    ``--resume latest``; the last value of a flag wins)."""
    argv = command_argv(readme_command(README, *needles), ranks)
    if fresh_start:
        extra = [*extra, "--resume", "none"]
    env = job_env(tmp_path, gpu=True, TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    return run([*argv, *map(str, extra)], timeout=timeout, env=env, check=check)


def assert_on_nccl(record: dict, world_size: int) -> None:
    assert (record["backend"], record["device"], record["world_size"]) == ("nccl", "cuda", world_size), \
        {k: record[k] for k in ("backend", "device", "world_size")}
    assert record["metrics"]["peak_memory_kind"] == "cuda_max_allocated"


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_gpu_zero_stages_memory_and_equivalence(tmp_path, ranks):
    """zero_memory.py on NCCL: every stage trains the single-process model; model state per rank as
    the fp32 formulas say; the CUDA peak holds the model state but no 2 GB bucket; overlap_comm and
    pinned offload buffers switched on for CUDA."""
    require_gpus(ranks, f"zero_memory.py on {ranks} NCCL rank(s)")
    record_file, params, results = tmp_path / "zero_memory.jsonl", tmp_path / "params", tmp_path / "results.jsonl"
    run_gpu(("zero_memory.py",), ranks,
            [*SMALL, *NCCL, "--steps", 4, "--lr", LR, "--record", record_file, "--save", params / "{strategy}.pt",
             "--results", results], tmp_path)

    records = read_records(results)
    assert [r["strategy"] for r in records] == STRATEGIES
    reference = reference_weights(steps=4, batch=16)
    zero0 = safe_load(params / "zero0.pt")
    assert max_diff(zero0, reference) < GPU_TOL
    for strategy in STRATEGIES[1:]:
        diff = max_diff(safe_load(params / f"{strategy}.pt"), zero0)
        assert diff < WEIGHT_TOL, f"{strategy} vs zero0 on GPU: {diff:.2e}"

    psi = sum(p.numel() for p in reference.values())
    share = math.ceil(psi / ranks)
    for record in records:
        assert_on_nccl(record, ranks)
        stage, offloaded = record["config"]["zero_stage"], record["strategy"].endswith("offload")
        expected = expected_state(stage, psi, ranks)
        for rank, measured in enumerate(record["metrics"]["model_state_bytes_per_rank"]):
            for key, value in expected.items():
                assert abs(measured[key] - value) <= 0.05 * value, (record["strategy"], rank, key, measured)
            peak = record["metrics"]["peak_memory_bytes_per_rank"][rank]
            state = sum(measured.values())
            if not offloaded:  # all of it lives on the GPU at the optimizer step
                assert peak >= 0.9 * state, (record["strategy"], rank, peak, state)
            assert peak < state + PEAK_ALLOWANCE, (record["strategy"], rank, peak, state)
        settings = record["config"]["engine_settings"]
        assert settings["overlap_comm"] is (stage >= 2), (record["strategy"], settings)
        if stage >= 1:
            assert settings["reduce_bucket_size"] == share, (record["strategy"], settings)
        if offloaded:
            assert settings["offload_optimizer.pin_memory"] is True
            assert settings["offload_param.pin_memory"] is True


def test_gpu_offload_keeps_model_state_off_the_gpu(tmp_path):
    """zero_offload.py on one GPU: the baseline keeps every piece of model state on cuda, offload on
    cpu; both train the same model; the CUDA peak drops by at least half of the 20Ψ bytes moved."""
    require_gpus(1, "zero_offload.py on one NCCL rank")
    results = tmp_path / "results.jsonl"
    out = run_gpu(("zero_offload.py",), 1,
                  ["--model-size", "small", "--global-batch-size", 16, "--steps", 4, *NCCL,
                   "--results", results], tmp_path).stdout
    base, offload = read_records(results)
    assert (base["strategy"], offload["strategy"]) == ("zero3", "zero3_offload")
    for record in (base, offload):
        assert_on_nccl(record, 1)
    assert "still referenced" not in out  # the first engine was freed before the second was measured
    assert all(device.startswith("cuda") for device, _ in base["placement"].values()), base["placement"]
    assert all(device == "cpu" for device, _ in offload["placement"].values()), offload["placement"]
    assert abs(base["final_loss"] - offload["final_loss"]) < 1e-4, (base["final_loss"], offload["final_loss"])
    psi = base["param_count"]
    saved = base["accelerator_peak_bytes_rank0"] - offload["accelerator_peak_bytes_rank0"]
    assert saved >= 10 * psi, f"offload saved {saved:,} B of GPU peak; 20Ψ = {20 * psi:,} B moved to the host"
    assert f"accelerator peak memory saved by offload: {saved:,} B per rank" in out
    assert offload["config"]["engine_settings"]["offload_param.pin_memory"] is True


def test_gpu_train_resume_consolidate_and_generate(tmp_path):
    """deepspeed_train.py (torchrun, then the deepspeed launcher resuming) and deepspeed_inference.py
    on one GPU: loss falls, resume continues the same run, the consolidated weights match
    single-process training and reproduce the engine's eval loss; fp16 inference generates."""
    require_gpus(1, "deepspeed_train.py and deepspeed_inference.py on one NCCL rank")
    checkpoints, results = tmp_path / "ckpt", tmp_path / "results.jsonl"
    straight, resumed = tmp_path / "straight_fp32.pt", tmp_path / "resumed_fp32.pt"
    common = [*SMALL, *NCCL, "--lr", LR, "--checkpoint-dir", checkpoints, "--results", results]
    run_gpu(("torchrun", "deepspeed_train.py"), 1,
            [*common, "--steps", 6, "--save-every", 3, "--save", straight], tmp_path)
    out = run_gpu(("deepspeed --num_gpus", "deepspeed_train.py"), 1,
                  [*common, "--steps", 6, "--resume", checkpoints / "step3", "--save", resumed], tmp_path).stdout
    assert "resumed from" in out and "at step 3" in out

    records = read_records(results)
    assert [r["resumed_from"] for r in records] == [0, 3]
    for record in records:
        assert_on_nccl(record, 1)
    first, second = safe_load(straight), safe_load(resumed)
    assert max_diff(first["model"], second["model"]) < WEIGHT_TOL  # GPU atomics: not bit for bit
    assert max_diff(first["model"], reference_weights(steps=6, batch=16)) < GPU_TOL

    cfg = gpt_config("tiny")
    inputs, targets = TokenTask(cfg).global_batch(EVAL_STEP, EVAL_BATCH)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    with torch.no_grad():
        untrained = lm_loss(model(inputs), targets).item()
        load_model_state(model, first["model"], str(straight))
        plain_loss = lm_loss(model(inputs), targets).item()
    assert plain_loss < untrained - 0.5, (untrained, plain_loss)  # CPU reference: 4.18 -> 3.20
    assert abs(plain_loss - first["eval_loss"]) < 1e-4, (plain_loss, first["eval_loss"])

    out = run_gpu(("deepspeed_inference.py",), 1,
                  ["--load", straight, "--new-tokens", 8, "--prompts", 2, *NCCL], tmp_path).stdout
    found = re.search(r"inference engine on (\S+) in torch\.float16 \| eval loss ([\d.]+)", out)
    assert found, out[-3000:]
    assert found.group(1).startswith("cuda")
    assert abs(float(found.group(2)) - plain_loss) < 2e-2  # fp16 weights and activations
    assert "valid transitions in generated tokens:" in out

    result = run_gpu(("deepspeed_inference.py",), 1,
                     ["--load", straight, "--kernel-inject", *NCCL], tmp_path, check=False)
    assert_one_line_error(result, "--kernel-inject: DeepSpeed")


def test_gpu_two_ranks_train_like_one_process(tmp_path):
    """The deepspeed launcher on 2 GPUs (ZeRO-3 over NCCL) trains the single-process model."""
    require_gpus(2, "deepspeed --num_gpus=2 on NCCL")
    results, straight = tmp_path / "results.jsonl", tmp_path / "fp32.pt"
    run_gpu(("deepspeed --num_gpus", "deepspeed_train.py"), 2,
            [*SMALL, *NCCL, "--lr", LR, "--steps", 6, "--checkpoint-dir", tmp_path / "ckpt",
             "--results", results, "--save", straight], tmp_path, fresh_start=True)
    (record,) = read_records(results)
    assert_on_nccl(record, 2)
    assert max_diff(safe_load(straight)["model"], reference_weights(steps=6, batch=16)) < GPU_TOL


def test_gpu_launcher_with_more_ranks_than_gpus(tmp_path):
    """``deepspeed --num_gpus=<more than present>``: with --backend nccl, one error line naming
    both counts; with the default backend, the job falls back to gloo on the CPU and trains."""
    require_gpus(1, "a GPU host, to ask for one GPU more than it has")
    have = gpu_count()
    command = ("deepspeed --num_gpus", "deepspeed_train.py")
    common = [*SMALL, "--global-batch-size", 2 * (have + 1), "--steps", 2, "--checkpoint-dir", tmp_path / "ckpt",
              "--save", tmp_path / "fp32.pt"]
    result = run_gpu(command, have + 1, [*common, *NCCL, "--results", tmp_path / "nccl.jsonl"], tmp_path,
                     check=False, timeout=300, fresh_start=True)
    assert_one_line_error(result, f"--backend nccl: {have + 1} local ranks need {have + 1} GPUs")

    results = tmp_path / "fallback.jsonl"
    run_gpu(command, have + 1, [*common, "--results", results], tmp_path, timeout=600, fresh_start=True)
    (record,) = read_records(results)
    assert (record["backend"], record["device"], record["world_size"]) == ("gloo", "cpu", have + 1)
