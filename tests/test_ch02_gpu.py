"""Chapter 02 (FSDP) on GPUs with NCCL: the README's commands at small size, outcomes asserted.

``pytest -m gpu tests/test_ch02_gpu.py``. The one-GPU tests run each README command at world size 1
on NCCL (``--nproc_per_node=1 ... --backend nccl``); the multi-rank ones need one GPU per rank
(``require_gpus``: one GPU cannot host several NCCL ranks) and skip, saying so, where there are
fewer. On a machine without GPUs every test skips.

What they check, beyond exit codes: the loss falls; trained parameters equal single-process training
on the same GPU within the CPU suite's tolerances (FP32_ATOL, BF16_RELATIVE); the bytes each rank holds
and sends equal the formulas of the CPU suite; GPU peak memory (``torch.cuda.max_memory_allocated``)
is at least the model state the rank holds, is measured per configuration (no leftovers of the
previous strategy), and drops by at least the Adam state under CPU offload; full checkpoints hold CPU
tensors; and records say backend nccl, device cuda. A ``--device cpu`` job on a GPU host, and more
ranks than GPUs, stay on the CPU (the meshes follow the job's device, not the host's accelerator).
"""
from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import pytest
import torch

from ch02_common import (
    BASICS,
    BF16,
    BF16_RELATIVE,
    FP32_ATOL,
    LR,
    OFFLOAD,
    RECORD,
    RESUME_FULL,
    RESUME_LATEST,
    SAVE,
    STEPS,
    STRATEGIES,
    SWEEP,
    TABLE,
    TINY,
    command,
    expected_bytes,
    max_diff,
    reference_state,
    relative_error,
    shard_bytes,
)
from distkit.harness import read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from launch import command_argv, gpu_count, job_env, require_gpus, run

pytestmark = pytest.mark.gpu
MiB = 2**20


def gpu_run(command: str, tmp_path: Path, *extra, nproc: int | None = None, backend: str | None = "nccl",
            timeout: float = 600):
    """Run a README command on this machine's GPUs.

    ``torchrun`` becomes ``python -m torch.distributed.run --standalone`` with ``nproc`` processes
    (default: the README's count) and ``--backend nccl`` (unless ``backend=None``); ``extra`` flags
    follow (argparse keeps the last value of a repeated flag).
    """
    argv = command_argv(command, nproc)
    if command.startswith("torchrun") and backend:
        argv += ["--backend", backend]
    return run([*argv, *map(str, extra)], timeout=timeout, env=job_env(tmp_path, gpu=True))


@functools.lru_cache(maxsize=None)
def gpu_reference(steps: int, batch: int = 8, vocab: int = 65) -> dict:
    """Single-process AdamW training on GPU 0, same initial weights and global batches as the jobs
    (the model is built on the CPU from seed 0, then moved, as the scripts do); a CPU state dict.

    Compared on the same device type as the jobs, so the tolerance covers summation order only."""
    cfg = gpt_config("tiny", vocab_size=vocab)
    torch.manual_seed(0)
    model = TinyGPT(cfg).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    task = TokenTask(cfg, seed=0)
    for step in range(steps):
        inputs, targets = task.global_batch(step, batch)
        optimizer.zero_grad()
        lm_loss(model(inputs.cuda()), targets.cuda()).backward()
        optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def losses(stdout: str, label: str = "") -> list[float]:
    """The logged losses, in order (of one strategy when ``label`` is given)."""
    prefix = rf"{label}\s*\|\s*" if label else ""
    return [float(x) for x in re.findall(rf"{prefix}step\s+\d+ \| loss ([\d.]+)", stdout)]


def all_tensors_on_cpu(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cpu"
    if isinstance(obj, dict):
        return all(all_tensors_on_cpu(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(all_tensors_on_cpu(v) for v in obj)
    return True


def assert_gpu_record(record: dict, world: int) -> None:
    """A record of an NCCL run whose GPU peak covers at least the model state the rank holds."""
    assert record["backend"] == "nccl" and record["device"] == "cuda", (record["backend"], record["device"])
    assert record["world_size"] == world
    metrics = record["metrics"]
    assert metrics["peak_memory_kind"] == "cuda_max_allocated"
    for peak, state in zip(metrics["peak_memory_bytes_per_rank"], metrics["model_state_bytes_per_rank"]):
        held = sum(state.values())
        if not record["config"].get("cpu_offload"):  # offloaded state lives in CPU memory
            assert held <= peak, (record["strategy"], held, peak)
        # generous: twice the state plus activations and library workspaces, not gigabytes
        assert 0 < peak <= 2 * held + 512 * MiB, (record["strategy"], held, peak)


def test_basics_on_one_gpu(tmp_path):
    require_gpus(1, "fsdp_basics at world size 1 on NCCL")
    results = tmp_path / "basics.jsonl"
    result = gpu_run(command(BASICS), tmp_path, *TINY, "--steps", "30", "--log-every", "10",
                     "--results", results, nproc=1)
    # a world of one: the "shard" is the whole tensor, still a DTensor outside the block's forward
    assert "[rank 0] blocks.0.attn.q_proj.weight  full (64, 64)   -> my shard (64, 64)" in result.stdout
    assert "block 0 forward ends:    q_proj.weight is DTensor shard (64, 64) of (64, 64)" in result.stdout
    logged = losses(result.stdout)
    assert len(logged) >= 3 and logged[-1] < logged[0] - 0.5, logged
    record = read_records(results)[0]
    assert_gpu_record(record, world=1)
    assert record["metrics"]["model_state_bytes_per_rank"][0] == expected_bytes("full_shard", 1, 1)["state"]


def test_basics_on_four_gpus(tmp_path):
    require_gpus(4, "the README's 4-rank fsdp_basics command on NCCL, one GPU per rank")
    results = tmp_path / "basics.jsonl"
    result = gpu_run(command(BASICS), tmp_path, *TINY, "--steps", "30", "--log-every", "10",
                     "--results", results)
    for rank in range(4):
        assert f"[rank {rank}] blocks.0.attn.q_proj.weight  full (64, 64)   -> my shard (16, 64)" in result.stdout
    assert "tok_emb.weight               full (65, 64)   -> my shard (17, 64)" in result.stdout  # padded
    assert result.stdout.count("backward  _reduce_scatter_base_") == 3  # 2 blocks + root
    logged = losses(result.stdout)
    assert logged[-1] < logged[0] - 0.5, logged
    assert_gpu_record(read_records(results)[0], world=4)


def check_strategies(tmp_path: Path, world: int, shard_size: int, result) -> list[dict]:
    """Equivalence with single-process training, and bytes vs the formulas, for every strategy."""
    reference = gpu_reference(STEPS)
    for strategy in STRATEGIES:
        trained = torch.load(tmp_path / "params" / f"{strategy}.pt", weights_only=True)
        assert all_tensors_on_cpu(trained), strategy  # gathered with cpu_offload: loads anywhere
        assert max_diff(trained, reference) <= FP32_ATOL, strategy
        assert len(set(losses(result.stdout, strategy))) >= 2, strategy  # it trained (loss moved)
    records = read_records(tmp_path / "records.jsonl")
    assert [r["strategy"] for r in records] == [RECORD[s] for s in STRATEGIES]
    for record, strategy in zip(records, STRATEGIES):
        assert_gpu_record(record, world)
        expected = expected_bytes(strategy, world=world, shard_size=shard_size)
        measured = {k: v["bytes"] for k, v in record["metrics"]["comm_per_step"].items()}
        assert set(measured) == set(expected["comm"]), (strategy, measured)
        for collective, value in expected["comm"].items():
            assert measured[collective] == pytest.approx(value, rel=0.01), (strategy, collective)
        assert record["predicted"]["comm_bytes"] == expected["comm"], strategy
        per_rank = record["metrics"]["model_state_bytes_per_rank"]
        assert per_rank[0] == expected["state"], strategy
        for rank, state in enumerate(per_rank):
            assert state["params"] == shard_bytes(strategy, rank, world=world, shard_size=shard_size)
    return records


def test_strategies_on_one_gpu(tmp_path):
    require_gpus(1, "every strategy at world size 1 on NCCL")
    result = gpu_run(command(SWEEP),
                     tmp_path, *TINY, "--hsdp-shard-size", "1", "--steps", str(STEPS), "--log-every", "1",
                     "--results", tmp_path / "records.jsonl", "--save", tmp_path / "params" / "{strategy}.pt", nproc=1)
    check_strategies(tmp_path, world=1, shard_size=1, result=result)

    # the table script labels these peaks as the GPU allocator's, not as process RSS
    text = gpu_run(command(TABLE), tmp_path, "--results", tmp_path / "records.jsonl",
                   "--plots-dir", tmp_path).stdout
    assert "| peak GPU memory allocated MiB (max rank) |" in text and "peak RSS" not in text
    assert "| fsdp_hybrid_shard | 1 x 1 |" in text


def test_strategies_on_four_gpus(tmp_path):
    require_gpus(4, "the README's 4-rank strategies command on NCCL (HSDP 2x2)")
    result = gpu_run(command(SWEEP),
                     tmp_path, *TINY, "--steps", str(STEPS), "--log-every", "1",
                     "--results", tmp_path / "records.jsonl", "--save", tmp_path / "params" / "{strategy}.pt")
    records = {r["strategy"]: r for r in check_strategies(tmp_path, world=4, shard_size=2, result=result)}
    bus = {s: sum(v["bus_bytes"] for v in records[RECORD[s]]["metrics"]["comm_per_step"].values())
           for s in STRATEGIES}
    assert 1.4 < bus["full_shard"] / bus["ddp"] <= 1.5


def test_each_strategy_gets_its_own_gpu_peak(tmp_path):
    """The same configuration before and after another one: equal peaks, so the earlier models and
    optimizers were freed (and the cache emptied) before the next peak window opened. The model is
    widened so its state (tens of MiB) dwarfs allocator noise."""
    require_gpus(1, "peak GPU memory per configuration")
    results = tmp_path / "records.jsonl"
    gpu_run(command(SWEEP), tmp_path,
            *TINY, "--n-embd", "256", "--sharding", "full_shard", "ddp", "full_shard", "--steps", str(STEPS),
            "--results", results, nproc=1)
    first, ddp, again = read_records(results)
    for record in (first, ddp, again):
        assert_gpu_record(record, world=1)
    ddp_state = sum(ddp["metrics"]["model_state_bytes_per_rank"][0].values())
    assert ddp_state > 16 * MiB  # a leftover of this size could not hide in the slack below
    peak_first = first["metrics"]["peak_memory_bytes_per_rank"][0]
    peak_again = again["metrics"]["peak_memory_bytes_per_rank"][0]
    assert peak_again <= 1.05 * peak_first + 4 * MiB, (peak_first, peak_again)


def test_knobs_on_one_gpu(tmp_path):
    """CPU offload keeps the maths and moves the Adam state (and the shards) off the GPU; bf16 stays
    within BF16_RELATIVE of what training moves the weights and keeps fp32 master weights."""
    require_gpus(1, "--cpu-offload and --mixed-precision bf16 on NCCL")
    reference = gpu_reference(STEPS)
    offload_command = command(OFFLOAD)
    runs = {}
    for name, line in (("offload", offload_command),
                       ("plain", offload_command.replace(" --cpu-offload", ""))):
        gpu_run(line, tmp_path, *TINY, "--steps", str(STEPS), "--results", tmp_path / f"{name}.jsonl",
                "--save", tmp_path / name / "{strategy}.pt", nproc=1)
        trained = torch.load(tmp_path / name / "full_shard.pt", weights_only=True)
        assert all_tensors_on_cpu(trained)
        assert max_diff(trained, reference) <= FP32_ATOL, name
        runs[name] = read_records(tmp_path / f"{name}.jsonl")[0]
        assert_gpu_record(runs[name], world=1)
    assert runs["offload"]["config"]["cpu_offload"] and not runs["plain"]["config"]["cpu_offload"]
    state = runs["plain"]["metrics"]["model_state_bytes_per_rank"][0]
    assert state == runs["offload"]["metrics"]["model_state_bytes_per_rank"][0]  # counted wherever it lives
    assert state == expected_bytes("full_shard", 1, 1)["state"]
    peak = {name: r["metrics"]["peak_memory_bytes_per_rank"][0] for name, r in runs.items()}
    assert peak["plain"] - peak["offload"] >= state["optimizer"], peak

    gpu_run(command(BF16), tmp_path, *TINY, "--steps", str(STEPS),
            "--results", tmp_path / "bf16.jsonl", "--save", tmp_path / "bf16" / "{strategy}.pt", nproc=1)
    trained = torch.load(tmp_path / "bf16" / "full_shard.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in trained.values())
    initial, _ = reference_state(STEPS)  # the same seed-0 weights the jobs start from (built on CPU)
    assert relative_error(trained, reference, initial) <= BF16_RELATIVE
    record = read_records(tmp_path / "bf16.jsonl")[0]
    assert_gpu_record(record, world=1)
    assert record["config"]["precision"] == "bf16"


def save_and_resume(tmp_path: Path, save_nproc: int | None, resume_nproc: int | None):
    """The README's three checkpoint commands at tiny size: save at step 3, resume the newest (DCP)
    to step 6, resume the full file; the resumes must load exactly what was saved, and the continued
    run must equal uninterrupted training."""
    ckpt = tmp_path / "ck"
    save = gpu_run(command(SAVE), tmp_path, *TINY, "--checkpoint-dir", ckpt, "--steps", "3", "--log-every", "1",
                   nproc=save_nproc)
    assert "sharded DCP checkpoint" in save.stdout and "full checkpoint" in save.stdout
    saved = torch.load(ckpt / "full.pt", weights_only=True)  # no map_location: a CUDA tensor would come back on a GPU
    assert saved["step"] == 3 and all_tensors_on_cpu(saved)
    first = tmp_path / "first.pt"
    shutil.copy(ckpt / "full.pt", first)

    resumed = gpu_run(command(RESUME_LATEST), tmp_path, *TINY, "--checkpoint-dir", ckpt, "--steps", "6",
                      "--log-every", "1", "--checkpoint-format", "full", "--dump-loaded", tmp_path / "loaded.pt",
                      nproc=resume_nproc)
    assert f"resumed from dcp checkpoint {ckpt}/dcp at step 3" in resumed.stdout
    assert max_diff(torch.load(tmp_path / "loaded.pt", weights_only=True), saved["model"]) == 0.0
    final = torch.load(ckpt / "full.pt", weights_only=True)
    assert final["step"] == 6
    assert max_diff(final["model"], gpu_reference(6)) <= FP32_ATOL

    gpu_run(command(RESUME_FULL), tmp_path, *TINY, "--resume", first, "--checkpoint-dir", tmp_path / "unused",
            "--steps", "6", "--checkpoint-format", "none", "--dump-loaded", tmp_path / "loaded_full.pt",
            nproc=resume_nproc)
    assert max_diff(torch.load(tmp_path / "loaded_full.pt", weights_only=True), saved["model"]) == 0.0
    return save, resumed


def test_checkpoints_on_one_gpu(tmp_path):
    require_gpus(1, "DCP and full checkpoints at world size 1 on NCCL")
    save_and_resume(tmp_path, save_nproc=1, resume_nproc=1)
    assert len(list((tmp_path / "ck" / "dcp").glob("*.distcp"))) == 1


def test_checkpoints_reshard_from_four_gpus_to_two(tmp_path):
    require_gpus(4, "the README's DCP save on 4 ranks and resume on 2, NCCL")
    _, resumed = save_and_resume(tmp_path, save_nproc=None, resume_nproc=None)  # the README's 4 and 2
    assert "(saved by 4 ranks) into 2 ranks" in resumed.stdout


def test_cpu_jobs_on_a_gpu_host_stay_on_the_cpu(tmp_path):
    """``--device cpu`` with GPUs visible, and more ranks than GPUs (auto falls back to gloo/CPU):
    the meshes follow the job's device, so no parameter moves to a GPU (a CPU target against CUDA
    logits) and no rank looks for a GPU it does not have ("invalid device ordinal")."""
    require_gpus(1, "needs a GPU host to show that CPU jobs ignore its accelerator")
    results = tmp_path / "cpu.jsonl"
    gpu_run(command(BASICS), tmp_path, *TINY, "--steps", "3", "--device", "cpu",
            "--results", results, nproc=2, backend=None)
    record = read_records(results)[0]
    assert (record["backend"], record["device"], record["metrics"]["peak_memory_kind"]) == (
        "gloo", "cpu", "cpu_mem_tracker")
    gpus = gpu_count()
    if gpus >= 4:
        pytest.skip(f"{gpus} GPUs: more ranks than GPUs would mean {gpus + 1} CPU ranks; checked --device cpu only")
    result = gpu_run(command(SAVE), tmp_path, *TINY, "--steps", "2",
                     "--checkpoint-format", "dcp", "--checkpoint-dir", tmp_path / "ck", nproc=gpus + 1, backend=None)
    assert f"world size {gpus + 1}" in result.stdout and "sharded DCP checkpoint" in result.stdout
    assert len(list((tmp_path / "ck" / "dcp").glob("*.distcp"))) == gpus + 1
