"""The numbers a GPU run records, checked on a GPU (``pytest -m gpu tests/test_gpu_numbers.py``): what
the CPU suite cannot see because the CPU path computes it another way or not at all. Every test needs
one GPU and skips, saying so, without one.

Written by reading, before any GPU ran this code: where an assertion fails on a real GPU, check the
claim before loosening it. Each test is one launch at most (the in-process ones first), so that a
time-boxed GPU check gets the most answers per minute.

1. **MFU in the training dtype.** bf16 runs (``ddp_training.py --precision bf16``, autocast;
   ``fsdp_transformer.py --mixed-precision bf16`` at world size 1) record ``peak_flops_dtype``
   ``bfloat16``, 0 < MFU < 1, and on an H100/H200/A100 a peak above 1e14 FLOP/s (a bf16
   tensor-core rate). Negative control: the fp32 peak (TF32 off), which the old harness measured for
   every run (so bf16 MFU came out 10-15x too high), is below 1e14 on those GPUs: the bound tells
   the two apart. Every record also shows ``float32_matmul_precision`` "highest" (TF32 off for
   float32 matmuls): the premise of comparing GPU runs with the CPU single-process reference at the
   CPU suite's 5e-5 (tests/test_ch03_gpu.py).
2. **Peak memory covers the training steps only.** (a) In this process: a 512 MiB allocation after
   the last step is not in the harness's peak, but still in ``peak_memory_bytes`` (the whole window,
   which scripts read for their own figures). Negative control: the same allocation inside a step is.
   (b) ``zero_memory.py`` with ZeRO-3 + CPU offload and small gather windows: a step holds a few
   layers of gathered weights, gathering the whole model (as the script did before ``finish``)
   holds 4 bytes x Ψ. The recorded peak must stay below half of that (argued at the test).
   (c) ``deepspeed_train.py`` with its evaluation batch raised from 32 to 16384 sequences (a mutant
   of the script's own source): the recorded peak stays below 256 MiB, although the evaluation's MLP
   activation alone is 512 MiB.
3. **The device label.** A ``--device cpu`` run on a GPU host, recorded by ``distkit.records run``
   and by ``zero_memory.py --record``, is labelled with the CPU; negative control: the same command
   on the GPU (``--backend nccl``) is labelled with the GPU.
4. **A synchronised load time.** ``fsdp_hf_checkpoint.py`` with a GPU kernel of known length (about
   a second of ``torch.cuda._sleep``) queued inside its timed load (a mutant of its own source) prints
   a load time of at least that length: an unsynchronised clock stops before the kernel runs.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

import ch01_common as ch01
import ch02_common as ch02
import ch03_common as ch03
from distkit.harness import Harness, measure_peak_flops, peak_memory_bytes, read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from distkit.provenance import machine_label
from distkit.runtime import DistContext
from launch import REPO, WORKERS, command_argv, job_env, readme_command, require_gpus, run

pytestmark = pytest.mark.gpu
MiB = 2**20
NCCL = ["--backend", "nccl"]
MUTANT = WORKERS / "ch05_mutant.py"
TENSOR_CORE_GPUS = ("H100", "H200", "A100")  # bf16 dense matmul well above 1e14 FLOP/s, fp32 below


def gpu_env(folder: Path, **extra) -> dict:
    """A job that sees the GPUs; DeepSpeed's JIT extensions (if any) build inside the test's folder."""
    return job_env(folder, gpu=True, TORCH_EXTENSIONS_DIR=str(folder / "torch_extensions"), **extra)


def as_mutant(argv: list[str], script: str, old: str, new: str) -> list[str]:
    """A launch of a README command with its script replaced by the mutant worker running that
    script with one piece of source replaced (tests/workers/ch05_mutant.py)."""
    at = argv.index(script)
    return [*argv[:at], str(MUTANT), str(REPO / script), old, new, "--", *argv[at + 1:]]


def assert_highest_fp32_matmuls(record: dict) -> None:
    """TF32 off for float32 matmuls (torch's default): the GPU runs compute fp32 matmuls in fp32."""
    assert record["metrics"]["float32_matmul_precision"] == "highest", record["metrics"]["float32_matmul_precision"]


# ----------------------------------------------------------------------- in this process, on GPU 0
def cuda_context() -> DistContext:
    return DistContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="nccl",
                       device=torch.device("cuda", 0), timeout_s=60)


@pytest.mark.cuda_in_pytest
def test_harness_peak_excludes_what_follows_the_last_step():
    """2 (a). The tiny GPT's steps peak at tens of MiB at most (cuBLAS's workspace included); 512 MiB
    allocated after the last step and held through ``finish`` must not be in the record's peak, and
    must be in it when allocated inside a step (negative control). The allocator's reserved peak of
    the steps is recorded beside it, never below it; 512 MiB freed inside a step stays reserved."""
    require_gpus(1, "CUDA's peak statistics of one device")
    ctx, cfg, big = cuda_context(), gpt_config("tiny"), 512 * MiB
    device = ctx.device

    def train(allocate_in_last_step: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = TinyGPT(cfg).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        harness = Harness(ctx, "probe", model=model, optimizer=optimizer, warmup_steps=1, comm_steps=1)
        task = TokenTask(cfg)
        for step in range(4):
            inputs, targets = (t.to(device) for t in task.global_batch(step, 4))
            with harness.step(samples=4, tokens=4 * cfg.seq_len):
                lm_loss(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
                if allocate_in_last_step and step == 3:
                    blob = torch.empty(big, dtype=torch.uint8, device=device)
                    del blob
        held = None if allocate_in_last_step else torch.empty(big, dtype=torch.uint8, device=device)
        record = harness.finish()
        window = peak_memory_bytes(device)
        del held, model, optimizer, harness
        torch.cuda.empty_cache()
        metrics = record["metrics"]
        assert metrics["peak_reserved_bytes_per_rank"][0] >= metrics["peak_memory_bytes_per_rank"][0] > 0
        return metrics["peak_memory_bytes_per_rank"][0], window, metrics["peak_reserved_bytes_per_rank"][0]

    after_peak, after_window, _ = train(allocate_in_last_step=False)
    assert after_peak < big / 2, after_peak  # the steps alone
    assert after_window >= big, after_window  # peak_memory_bytes still covers the whole window
    inside_peak, _, inside_reserved = train(allocate_in_last_step=True)
    assert inside_peak >= big, inside_peak  # negative control: inside a step it counts
    assert inside_reserved >= big, inside_reserved


SLEEP_CYCLES = 2_000_000_000  # about 1 s at an H100's 1.98 GHz


def sleep_seconds() -> float:
    """How long ``torch.cuda._sleep(SLEEP_CYCLES)`` keeps GPU 0 busy, by CUDA events."""
    torch.cuda._sleep(1000)  # warm-up: the kernel's first launch loads it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


# ------------------------------------------------------------------------------------- 1. MFU dtype
def assert_bf16_record(record: dict) -> None:
    assert (record["backend"], record["device"], record["world_size"]) == ("nccl", "cuda", 1)
    assert_highest_fp32_matmuls(record)
    metrics = record["metrics"]
    assert metrics["peak_flops_dtype"] == "bfloat16", metrics["peak_flops_dtype"]
    assert 0 < metrics["mfu"] < 1, metrics["mfu"]
    assert metrics["mfu"] == pytest.approx(metrics["tokens_per_s_per_device"] * metrics["model_flops_per_token"]
                                           / metrics["peak_flops_per_s"], rel=1e-9)
    gpu = record["machine"]["device_name"]
    if any(model in gpu for model in TENSOR_CORE_GPUS):
        assert metrics["peak_flops_per_s"] > 1e14, (gpu, metrics["peak_flops_per_s"])
        # negative control: the fp32 peak (TF32 off) that the old harness used is below the bound
        assert torch.get_float32_matmul_precision() == "highest"
        assert measure_peak_flops(torch.device("cuda", 0), torch.float32) < 1e14, gpu


def test_ddp_training_bf16_measures_a_bf16_peak(tmp_path):
    require_gpus(1, "ddp_training.py at world size 1 on NCCL")
    run([*ch01.readme_argv("--config", nproc=1), *ch01.training_flags(tmp_path), "--precision", "bf16", *NCCL],
        env=gpu_env(tmp_path), timeout=600)
    assert_bf16_record(read_records(tmp_path / "results.jsonl")[-1])


# ---------------------------------------------------------------------------- 2. peak memory, scripts
EVAL = "task.global_batch(EVAL_STEP, EVAL_BATCH)"
EVAL_SEQUENCES = 16384  # x 32 tokens: the tiny GPT's MLP activation is 16384 x 32 x 256 x 4 B = 512 MiB


def test_deepspeed_train_peak_excludes_the_evaluation(tmp_path):
    """2 (c). deepspeed_train.py (ZeRO-3, tiny GPT, global batch 16) with its evaluation batch raised
    from 32 to 16384 sequences: its training steps hold the model state (under 2 MiB), activations of
    16 sequences and cuBLAS's workspace, tens of MiB; the evaluation's forward holds its 512 MiB MLP
    activation (and the GELU's output beside it). The recorded peak must stay below 256 MiB."""
    require_gpus(1, "deepspeed_train.py on one NCCL rank")
    argv = as_mutant(command_argv(readme_command(ch03.README, "torchrun", "deepspeed_train.py"), 1),
                     "03-deepspeed/deepspeed_train.py", EVAL, f"task.global_batch(EVAL_STEP, {EVAL_SEQUENCES})")
    run([*argv, *ch03.SMALL, *NCCL, "--steps", "4", "--lr", str(ch03.LR), "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--save", "none", "--results", str(tmp_path / "results.jsonl")], env=gpu_env(tmp_path), timeout=600)
    (record,) = read_records(tmp_path / "results.jsonl")
    assert record["metrics"]["peak_memory_kind"] == "cuda_max_allocated"
    assert_highest_fp32_matmuls(record)
    assert record["eval_loss"] is not None and record["eval_loss"] > 0  # the evaluation ran
    peak, state = record["metrics"]["peak_memory_bytes_per_rank"][0], record["metrics"]["model_state_bytes_per_rank"][0]
    assert sum(state.values()) <= peak < 256 * MiB, (peak, state)


# ZeRO-3 + offload with gather windows far below the model: a step keeps only a few layers on the GPU.
WINDOW = 5_000_000  # elements: stage3_max_live_parameters, stage3_prefetch_bucket_size, reduce_bucket_size
WIDE_MODEL = ["--model-size", "tiny", "--n-embd", "1024", "--n-head", "16", "--n-layer", "16"]


def small_window_offload_config(path: Path) -> Path:
    config = {"train_batch_size": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 1000000, "wall_clock_breakdown": False, "zero_force_ds_cpu_optimizer": False,
              "zero_optimization": {
                  "stage": 3, "contiguous_gradients": True, "overlap_comm": False,
                  "reduce_bucket_size": WINDOW, "stage3_prefetch_bucket_size": WINDOW,
                  "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": WINDOW,
                  "stage3_max_reuse_distance": WINDOW,
                  "offload_optimizer": {"device": "cpu", "pin_memory": True},
                  "offload_param": {"device": "cpu", "pin_memory": True}}}
    path.write_text(json.dumps(config, indent=2))
    return path


@pytest.mark.timeout(300)  # builds a 201M-parameter model twice and runs AdamW on the host
def test_zero3_peak_excludes_the_final_gather(tmp_path):
    """2 (b). zero_memory.py at world size 1 with ZeRO-3 + CPU offload (parameters and optimizer state
    in host memory) on a 16-layer, 1024-wide GPT (Ψ ≈ 201M, 4Ψ ≈ 806 MB), one sequence of 32 tokens
    per step. What a step can hold on the GPU, from the config and the shapes: the live and
    prefetched windows plus the module being fetched (4 B x (2 x WINDOW + largest module): 57 MB),
    a module's gradients and the reduce bucket (2 x 4 B x WINDOW: 40 MB), the activations (at most
    20 tensors of 32 x 1024 fp32 per layer: 42 MB) and cuBLAS's workspaces with the allocator's
    rounding (128 MiB, generous): about 0.27 GB in all, below the asserted bound of half the model,
    2Ψ bytes (0.4 GB). Gathering every parameter, as full_weights did before ``finish``, holds all
    4Ψ (0.8 GB) on the GPU at once: twice the bound."""
    require_gpus(1, "zero_memory.py on one NCCL rank")
    config = small_window_offload_config(tmp_path / "zero3_offload_small_windows.json")
    results, record_file = tmp_path / "results.jsonl", tmp_path / "zero_memory.jsonl"
    run([*command_argv(readme_command(ch03.README, "zero_memory.py"), 1), "--configs", str(config), *WIDE_MODEL,
         "--global-batch-size", "1", "--steps", "4", "--results", str(results), "--record", str(record_file),
         *NCCL], env=gpu_env(tmp_path), timeout=600)
    (record,) = read_records(results)
    assert (record["strategy"], record["device"]) == ("zero3_offload", "cuda")
    assert_highest_fp32_matmuls(record)
    psi = record["param_count"]
    cfg = gpt_config("tiny", n_embd=1024, n_head=16, n_layer=16)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    assert psi == sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    activations = cfg.n_layer * 20 * cfg.seq_len * cfg.n_embd * 4
    step_at_most = 4 * (2 * WINDOW + largest) + 2 * 4 * WINDOW + activations + 128 * MiB
    assert step_at_most < 2 * psi, (step_at_most, psi)  # the setup: a step fits under the bound
    peak = record["metrics"]["peak_memory_bytes_per_rank"][0]
    assert peak < 2 * psi, (f"peak {peak / MiB:.0f} MiB; a step should hold at most {step_at_most / MiB:.0f} "
                            f"MiB, the gathered model {4 * psi / MiB:.0f} MiB")


# ---------------------------------------------------------------------------------- 3. device label
def test_records_run_labels_a_cpu_run_on_a_gpu_host_with_the_cpu(tmp_path):
    """``distkit.records run`` of ddp_training.py with ``--device cpu``, GPUs visible: the record's
    machine is the CPU. Negative control: the same command with ``--backend nccl`` is labelled with
    the GPU (the old rule labelled both so)."""
    require_gpus(1, "a GPU host, to run on its CPU")
    into = tmp_path / "outputs.jsonl"
    for name, flags in (("on_cpu", ["--device", "cpu"]), ("on_gpu", NCCL)):
        folder = tmp_path / name
        command = shlex.join([sys.executable, str(ch01.TRAINING), *ch01.training_flags(folder), *flags])
        run([sys.executable, "-m", "distkit.records", "run", "--into", str(into), "--name", name, "--", command],
            env=gpu_env(folder), timeout=300)
    records = {r["name"]: r for r in map(json.loads, into.read_text().splitlines())}
    cpu, gpu = records["on_cpu"], records["on_gpu"]
    assert cpu["returncode"] == gpu["returncode"] == 0
    assert "backend gloo | device cpu" in cpu["output"] and "backend nccl | device cuda" in gpu["output"]
    assert "gpu_count" not in cpu["machine"] and cpu["backend"] == "gloo", cpu["machine"]
    assert machine_label(cpu["machine"], cpu["backend"]) == f"{cpu['machine']['cpu_cores']}-core CPU, gloo"
    assert gpu["machine"]["gpu_count"] >= 1 and gpu["backend"] == "nccl", gpu["machine"]
    assert gpu["machine"]["device_name"] != cpu["machine"]["device_name"], gpu["machine"]


def test_zero_memory_record_of_a_cpu_run_on_a_gpu_host_names_the_cpu(tmp_path):
    """zero_memory.py --device cpu writes its own record (provenance of the run's device)."""
    require_gpus(1, "a GPU host, to run on its CPU")
    record_file = tmp_path / "zero_memory.jsonl"
    run([*command_argv(readme_command(ch03.README, "zero_memory.py"), 1), "--configs", "zero0", *ch03.SMALL,
         "--steps", "4", "--device", "cpu", "--record", str(record_file), "--results", str(tmp_path / "r.jsonl")],
        env=gpu_env(tmp_path), timeout=300)
    (zero,) = map(json.loads, record_file.read_text().splitlines())
    assert zero["backend"] == "gloo" and "gpu_count" not in zero["machine"], zero["machine"]
    assert zero["machine"]["device_name"].endswith("-core CPU"), zero["machine"]
    assert zero["table"]["machine"] == zero["machine"]["device_name"]  # the harness record's machine, too


# ------------------------------------------------------------------------------------ 4. load time
ROPE = "    reinit_rope_buffers(model)\n"


@pytest.mark.cuda_in_pytest
def test_hf_load_time_includes_the_gpu_work(tmp_path):
    """fsdp_hf_checkpoint.py with ``torch.cuda._sleep`` queued right after the load's last kernels (a
    mutant): the printed load time covers the sleep, measured here with CUDA events (the host's own
    share of a tiny model's load is hundredths of a second; an unsynchronised clock shows about that)."""
    require_gpus(1, "fsdp_hf_checkpoint.py on one NCCL rank")
    sleep_s = sleep_seconds()
    assert sleep_s > 0.3, sleep_s
    argv = as_mutant(command_argv(ch02.command(ch02.HF_CHECKPOINT), 1), "02-fsdp/fsdp_hf_checkpoint.py", ROPE,
                     ROPE + f"    torch.cuda._sleep({SLEEP_CYCLES})  # GPU work queued inside the timed load\n")
    out = run([*argv, "--model-size", "tiny", "--vocab-size", "65", "--global-batch-size", "8", "--steps", "1",
               "--hf-in", str(tmp_path / "hf_in"), "--create-hf-in", "--hf-out", str(tmp_path / "hf_out"),
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--results", str(tmp_path / "r.jsonl"), *NCCL],
              env=gpu_env(tmp_path), timeout=600).stdout
    found = re.search(r"loaded into 1 ranks' FSDP2 shards in ([\d.]+) s", out)
    assert found, out[-3000:]
    # the GPU's clock may differ a little between this process and the job's
    assert float(found.group(1)) >= 0.8 * sleep_s, (found.group(0), sleep_s)


# --------------------------------------------------------------------------- 1. MFU dtype, FSDP2 too
def test_fsdp_bf16_measures_a_bf16_peak(tmp_path):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16) at world size 1: its matmuls see bf16 weights."""
    require_gpus(1, "fsdp_transformer.py at world size 1 on NCCL")
    run([*command_argv(ch02.command(ch02.BF16), 1), *ch02.TINY, "--steps", "8", "--results",
         str(tmp_path / "results.jsonl"), *NCCL], env=gpu_env(tmp_path), timeout=600)
    assert_bf16_record(read_records(tmp_path / "results.jsonl")[-1])
