"""Chapter 05: every command in 05-advanced/README.md runs, and every strategy it shows trains the
same model as single-process training.

Each README command is launched as written (real torchrun subprocesses) with small flags appended
(argparse keeps the last value of a repeated flag): the tiny GPT, 3 steps, plain SGD.

Equivalence tolerance: 1e-5 absolute on every parameter after 3 SGD steps (lr 0.5, fp32), against
one process training the same initial weights on the whole global batch. SGD, not AdamW, because
AdamW normalises each update by the gradient's size: a gradient summed instead of averaged (a
missing 1/k or 1/world_size) would go unnoticed, while with SGD it moves the weights by ~lr x grad.
The distributed runs differ from the reference only in the order of floating-point additions
(observed max differences 6e-8 to 1.2e-7). test_ch05_negative.py proves the tolerance fails for the
bugs it must catch (summed gradients, a dropped shard, a skipped micro-batch, no 1/k), by >3,600x,
and that deleting gradient_accumulation.py's own ``/ k`` fails the accumulation test below.
"""
from __future__ import annotations

import importlib.util
import shlex
from types import SimpleNamespace

import pytest
import torch

from distkit.harness import read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from distkit.runtime import seed_everything
from launch import REPO, assert_one_line_error, python, readme_commands, torchrun

README = REPO / "05-advanced" / "README.md"
STEPS, LR, TOLERANCE = 3, 0.5, 1e-5
QUICK = ("--model-size", "tiny", "--steps", STEPS, "--optimizer", "sgd", "--lr", LR, "--warmup-steps", "1")


def reference(global_batch: int, **overrides) -> tuple[dict, list[float]]:
    """Single-process SGD on the whole global batch from the scripts' seed-0 initial weights."""
    cfg = gpt_config("tiny", **overrides)
    seed_everything(0)
    model = TinyGPT(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    task, losses = TokenTask(cfg, seed=0), []
    for step in range(STEPS):
        inputs, targets = task.global_batch(step, global_batch)
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def assert_matches(checkpoint, expected: dict) -> None:
    state = torch.load(checkpoint, weights_only=True)["model"]
    assert set(state) == set(expected), set(state) ^ set(expected)
    for name, ref in expected.items():
        diff = (state[name] - ref).abs().max().item()
        assert diff < TOLERANCE, f"{checkpoint.name}: {name} max |distributed - single| = {diff:.2e}"


def readme_command(*needles: str, without: str | None = None) -> tuple[int, str, list[str]]:
    """The README command containing every needle (and not ``without``), as (nproc, script, args)."""
    found = [c for c in readme_commands(README)
             if all(n in c for n in needles) and (without is None or without not in c)]
    assert len(found) == 1, f"expected one README command with {needles}, found {found}"
    words = shlex.split(found[0])
    assert words[0] == "torchrun", found[0]
    nproc = int(next(w for w in words if w.startswith("--nproc_per_node=")).split("=")[1])
    script_at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return nproc, words[script_at], words[script_at + 1:]


def launch(tmp_path, *needles: str, without: str | None = None, extra=(), check=True):
    nproc, script, args = readme_command(*needles, without=without)
    return torchrun(REPO / script, *args, *extra, nproc=nproc, tmp_path=tmp_path, check=check, timeout=400)


def plot(results, out_dir, tmp_path) -> str:
    """The README's plot command, pointed at a test's records."""
    (command,) = [c for c in readme_commands(README) if "plot_results.py" in c]
    assert command.startswith("python 05-advanced/plot_results.py")
    return python(REPO / "05-advanced/plot_results.py", *shlex.split(command)[2:], "--results", results,
                  "--out-dir", out_dir, tmp_path=tmp_path).stdout


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_matches_single_process(sequence_parallel, tmp_path):
    results, ckpt = tmp_path / "r.jsonl", tmp_path / "tp.pt"
    out = launch(tmp_path, "tensor_parallel.py", *(["--sequence-parallel"] if sequence_parallel else []),
                 without=None if sequence_parallel else "--sequence-parallel",
                 extra=(*QUICK, "--global-batch-size", 16, "--results", results, "--checkpoint", ckpt))
    assert "local per rank: r0 (16, 64)" in out.stdout  # q_proj weight: 64 output rows / 4 ranks

    expected, losses = reference(16)
    assert_matches(ckpt, expected)
    (record,) = read_records(results)
    assert record["strategy"] == ("tp_sp" if sequence_parallel else "tp")
    assert record["losses"] == pytest.approx(losses, abs=1e-5)
    # Megatron's count for 2 blocks, batch 16 x 32 tokens x 64 wide fp32: 4 collectives per block.
    activation = 16 * 32 * 64 * 4
    comm = record["metrics"]["comm_per_step"]
    if not sequence_parallel:
        assert comm["all_reduce"]["calls"] == 4 * 2
        assert comm["all_reduce"]["bytes"] == 4 * 2 * activation
    else:  # each all-reduce became reduce-scatter + all-gather; plus embeddings/head ones
        assert "all_reduce" not in comm or comm["all_reduce"]["bytes"] < activation
        for name in ("all_gather", "reduce_scatter"):
            assert comm[name]["calls"] >= 4 * 2 and comm[name]["bytes"] >= 4 * 2 * activation


def test_pipeline_schedules_match_single_process(tmp_path):
    results = tmp_path / "r.jsonl"
    launch(tmp_path, "pipeline_parallel.py", "nproc_per_node=4", extra=(*QUICK, "--n-layer", 8, "--global-batch-size", 16,
                                                    "--microbatches", 4, "--results", results,
                                                    "--checkpoint", tmp_path / "{schedule}_m{microbatches}.pt"))
    expected, losses = reference(16, n_layer=8)
    records = {r["config"]["schedule"]: r for r in read_records(results)}
    assert set(records) == {"gpipe", "1f1b", "interleaved_1f1b"}
    for schedule, record in records.items():
        assert_matches(tmp_path / f"{schedule}_m4.pt", expected)
        # The loss printed is the last stage's mean over micro-batches = the full-batch loss.
        assert record["losses"] == pytest.approx(losses, abs=1e-5), schedule
        stages = 2 if schedule == "interleaved_1f1b" else 1
        assert record["bubble"]["theory"] == pytest.approx(3 / (stages * 4 + 3))
        assert 0 <= record["bubble"]["measured"] < 1
        # compute inside the schedule's span on every rank: the README splits the idle rest
        for step_s, compute_s in zip(record["bubble"]["schedule_s_per_rank"], record["bubble"]["compute_s_per_rank"]):
            assert 0 < compute_s < step_s, schedule
        assert record["metrics"]["comm_per_step"]["send"]["calls"] > 0  # activations/grads move p2p
    assert "wrote" in plot(results, tmp_path, tmp_path)
    assert (tmp_path / "pipeline_bubble.png").stat().st_size > 0


def test_two_rank_pipeline_matches_single_process(tmp_path):
    """The README's 2-rank comparison run (no CPU oversubscription), at the equivalence settings."""
    results = tmp_path / "r.jsonl"
    launch(tmp_path, "pipeline_parallel.py", "nproc_per_node=2",
           extra=(*QUICK, "--global-batch-size", 16, "--microbatches", 2, 4, "--results", results,
                  "--checkpoint", tmp_path / "{schedule}_m{microbatches}.pt"))
    expected, losses = reference(16, n_layer=8)
    records = read_records(results)
    assert [(r["world_size"], r["config"]["microbatches"]) for r in records] == [(2, 2), (2, 4)]
    for record in records:
        m = record["config"]["microbatches"]
        assert_matches(tmp_path / f"gpipe_m{m}.pt", expected)
        assert record["losses"] == pytest.approx(losses, abs=1e-5)
        assert record["bubble"]["theory"] == pytest.approx(1 / (m + 1))


@pytest.mark.parametrize("mode", ["2d", "hsdp"])
def test_hybrid_parallelism_matches_single_process(mode, tmp_path):
    results = tmp_path / "r.jsonl"
    launch(tmp_path, "hybrid_parallelism.py", f"--mode {mode}", "nproc_per_node=4",
           extra=(*QUICK, "--global-batch-size", 16, "--results", results, "--checkpoint", tmp_path / "{mode}.pt"))
    expected, losses = reference(16)
    assert_matches(tmp_path / f"{mode}.pt", expected)
    (record,) = read_records(results)
    assert record["strategy"] == {"2d": "fsdp_tp_2d", "hsdp": "hsdp"}[mode]
    assert record["losses"] == pytest.approx(losses, abs=1e-5)
    dense = sum(t.numel() * 4 for t in expected.values())
    held = [s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]]
    # 2-D: every rank holds ~1/4 of the weights; HSDP: ~1/2 (sharded over 2, replicated twice)
    assert max(held) < dense / (3 if mode == "2d" else 1.8), held


def test_mesh_that_does_not_match_world_size_is_one_clear_error(tmp_path):
    result = launch(tmp_path, "hybrid_parallelism.py", "nproc_per_node=2", check=False)
    assert_one_line_error(result, "the mesh axes must multiply to the world size")


def test_gradient_accumulation_equals_large_batch_and_no_sync_saves_k(tmp_path):
    results, k = tmp_path / "r.jsonl", 4
    launch(tmp_path, "gradient_accumulation.py",
           extra=(*QUICK, "--accumulation-steps", k, "--micro-batch-size", 2, "--results", results,
                  "--checkpoint", tmp_path / "{sync}.pt"))
    expected, _ = reference(2 * k * 4)  # one k-times larger batch over 4 ranks
    assert_matches(tmp_path / "no_sync.pt", expected)
    assert_matches(tmp_path / "every_micro_batch.pt", expected)
    bytes_per_step = {r["config"]["sync"]: r["metrics"]["comm_per_step"]["all_reduce"]["bytes"]
                      for r in read_records(results)}
    dense = sum(t.numel() * 4 for t in expected.values())
    assert bytes_per_step["no_sync"] == dense  # one all-reduce of every gradient per optimizer step
    assert bytes_per_step["every_micro_batch"] == k * bytes_per_step["no_sync"]


def test_communication_overlap_and_plots(tmp_path):
    results, trace = tmp_path / "r.jsonl", tmp_path / "trace.json"
    out = launch(tmp_path, "communication_overlap.py",
                 extra=("--layers", 16, "--steps", 3, "--warmup-steps", 1, "--bucket-mb", 0.02, 25,
                        "--async-mib", 1, "--results", results, "--trace", trace))
    assert "hidden" in out.stdout and "async_op=True + wait()" in out.stdout
    assert trace.stat().st_size > 0
    calls = {r["config"]["bucket_cap_mb"]: r["metrics"]["comm_per_step"]["all_reduce"]["calls"]
             for r in read_records(results)}
    assert calls[25] == 1 and calls[0.02] > 1  # 16 x 128 x 128 fp32 = 1 MiB: one bucket vs many
    plot(results, tmp_path, tmp_path)
    assert (tmp_path / "bucket_sweep.png").stat().st_size > 0


def _load_script(name: str):
    """Import 05-advanced/<name>.py as a module (its functions, without running main)."""
    spec = importlib.util.spec_from_file_location(f"ch05_{name}", REPO / "05-advanced" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_is_measured_on_one_timeline():
    """On CPU, gloo's worker-thread spans against autograd's; on GPU, NCCL kernels against the other
    *kernels* only: the host spans there are launch times, and a host span covering everything
    must not make communication look hidden."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    overlap = _load_script("communication_overlap")

    def event(name, start, end, device=DeviceType.CPU):
        return SimpleNamespace(name=name, time_range=Interval(start, end), device_type=device)

    host_backward = event("autograd::engine::evaluate_function: AddmmBackward0", 0, 1000)
    gpu = [host_backward,
           event("void at::native::gemm_kernel", 0, 50, DeviceType.CUDA),
           event("void at::native::gemm_kernel", 60, 100, DeviceType.CUDA),
           event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 40, 80,
                 DeviceType.CUDA),
           event("record_param_comms", 40, 41)]  # host side of the launch: ignored on GPU
    result = overlap.overlap_from_profile(gpu, "cuda")
    assert result["comm_ms"] == pytest.approx(0.040)  # profiler times are microseconds
    assert result["hidden_fraction"] == pytest.approx(30 / 40)  # [40,50] and [60,80] under kernels
    cpu = [event("gloo:all_reduce", 0, 10), event("gloo:all_reduce", 20, 30),
           event("autograd::engine::evaluate_function: AddmmBackward0", 5, 25)]
    assert overlap.overlap_from_profile(cpu, "cpu")["hidden_fraction"] == pytest.approx(10 / 20)


def test_numeric_flags_are_range_checked(tmp_path):
    """A bad number is one argparse line before any process group exists (distkit.flags types)."""
    cases = [("pipeline_parallel.py", ["--microbatches", "4", "0"], "argument --microbatches: must be a positive integer, got 0"),
             ("communication_overlap.py", ["--bucket-mb", "0"], "argument --bucket-mb: must be a positive number, got 0"),
             ("hybrid_parallelism.py", ["--tp", "-2"], "argument --tp: must be a positive integer, got -2"),
             ("gradient_accumulation.py", ["--warmup-steps", "-1"], "argument --warmup-steps: must be an integer >= 0, got -1"),
             ("tensor_parallel.py", ["--lr", "nan"], "argument --lr: must be a positive number, got 'nan'")]
    for script, args, expected in cases:
        result = python(REPO / "05-advanced" / script, *args, tmp_path=tmp_path, check=False)
        assert_one_line_error(result, expected)


def test_every_readme_command_is_run_by_a_test():
    """Each lookup below is one a test above makes (``launch``/``plot`` needles); together they must
    cover the README, each command exactly once, so a command added to the README without a test
    (or a lookup that no longer finds its command) fails here."""
    lookups = [(("tensor_parallel.py",), "--sequence-parallel"),
               (("tensor_parallel.py", "--sequence-parallel"), None),
               (("pipeline_parallel.py", "nproc_per_node=4"), None),
               (("pipeline_parallel.py", "nproc_per_node=2"), None),
               (("hybrid_parallelism.py", "--mode 2d", "nproc_per_node=4"), None),
               (("hybrid_parallelism.py", "--mode hsdp", "nproc_per_node=4"), None),
               (("hybrid_parallelism.py", "nproc_per_node=2"), None),
               (("gradient_accumulation.py",), None),
               (("communication_overlap.py",), None),
               (("plot_results.py",), None)]

    def matches(command, needles, without):
        return all(n in command for n in needles) and (without is None or without not in command)

    commands = readme_commands(README)
    assert commands, "05-advanced/README.md shows no command"
    for command in commands:
        assert sum(matches(command, *lookup) for lookup in lookups) == 1, command
    for lookup in lookups:
        assert sum(matches(command, *lookup) for command in commands) == 1, lookup
