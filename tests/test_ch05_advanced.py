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

import shlex
from types import SimpleNamespace

import pytest
import torch

from ch05_common import CHAPTER, QUICK, README, TOLERANCE, launch, reference
from distkit.harness import read_records
from launch import load_script, parse_args_result, assert_one_line_error, assert_readme_covered, python, readme_command

# Every README command, as the lookup (needles, without) the test that runs it uses.
LOOKUPS = {"tp": (("tensor_parallel.py",), "--sequence-parallel"),
           "tp_sp": (("tensor_parallel.py", "--sequence-parallel"), None),
           "pipeline": (("pipeline_parallel.py", "nproc_per_node=4"), None),
           "pipeline_2ranks": (("pipeline_parallel.py", "nproc_per_node=2"), None),
           "2d": (("hybrid_parallelism.py", "--mode 2d", "nproc_per_node=4"), None),
           "hsdp": (("hybrid_parallelism.py", "--mode hsdp", "nproc_per_node=4"), None),
           "mesh_error": (("hybrid_parallelism.py", "nproc_per_node=2"), None),
           "accumulation": (("gradient_accumulation.py",), None),
           "overlap": (("communication_overlap.py",), None),
           "plot": (("plot_results.py",), None)}


def run_readme(name: str, tmp_path, extra=(), check=True):
    needles, without = LOOKUPS[name]
    return launch(tmp_path, *needles, without=without, extra=extra, check=check)


def assert_matches(checkpoint, expected: dict) -> None:
    state = torch.load(checkpoint, weights_only=True)["model"]
    assert set(state) == set(expected), set(state) ^ set(expected)
    for name, ref in expected.items():
        diff = (state[name] - ref).abs().max().item()
        assert diff < TOLERANCE, f"{checkpoint.name}: {name} max |distributed - single| = {diff:.2e}"


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """The README's 4-rank pipeline command at the equivalence settings: (records file, folder)."""
    tmp_path = tmp_path_factory.mktemp("pipeline")
    results = tmp_path / "r.jsonl"
    run_readme("pipeline", tmp_path, extra=(*QUICK, "--n-layer", 8, "--global-batch-size", 16, "--microbatches", 4,
                                            "--results", results, "--save", tmp_path / "{schedule}_m{microbatches}.pt"))
    return results, tmp_path


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    """The README's communication_overlap command, small: (records file, stdout, trace file)."""
    tmp_path = tmp_path_factory.mktemp("overlap")
    results, trace = tmp_path / "r.jsonl", tmp_path / "trace.json"
    out = run_readme("overlap", tmp_path, extra=("--layers", 16, "--steps", 3, "--warmup-steps", 1,
                                                 "--bucket-cap-mb", 0.02, 25, "--async-mib", 1,
                                                 "--results", results, "--trace", trace))
    return results, out.stdout, trace


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_matches_single_process(sequence_parallel, tmp_path):
    results = tmp_path / "r.jsonl"
    out = run_readme("tp_sp" if sequence_parallel else "tp", tmp_path,
                     extra=(*QUICK, "--global-batch-size", 16, "--results", results,
                            "--save", tmp_path / "{strategy}.pt"))
    assert "local per rank: r0 (16, 64)" in out.stdout  # q_proj weight: 64 output rows / 4 ranks

    expected, losses = reference(16)
    (record,) = read_records(results)
    assert record["strategy"] == ("tp_sp" if sequence_parallel else "tp")
    assert_matches(tmp_path / f"{record['strategy']}.pt", expected)  # --save's {strategy} filled in
    assert record["losses"] == pytest.approx(losses, abs=1e-5)
    # the record (schema 2): the model's configuration in its one place, the whole model's size
    assert record["model"]["arch"] == "gpt" and record["model"]["n_layer"] == 2
    assert record["param_count"] == sum(t.numel() for t in expected.values())
    assert not {"model_size", "param_count", "n_layer"} & set(record["config"])
    # Megatron's count for 2 blocks, batch 16 x 32 tokens x 64 wide fp32: 4 collectives per block.
    activation = 16 * 32 * 64 * 4
    comm = record["metrics"]["comm_per_step"]
    if not sequence_parallel:
        assert comm["all_reduce"]["calls"] == 4 * 2
        assert comm["all_reduce"]["bytes"] == 4 * 2 * activation
        # printed next to Megatron's formula from distkit.theory: the same 8 calls and bytes
        mib = f"{4 * 2 * activation / 2**20:8.2f} MiB"
        assert f"{'all_reduce':<15} {8:>4} calls {mib}   vs   {8:>4} calls {mib}" in out.stdout, out.stdout[-3000:]
    else:  # each all-reduce became reduce-scatter + all-gather; plus embeddings/head ones
        assert "all_reduce" not in comm or comm["all_reduce"]["bytes"] < activation
        for name in ("all_gather", "reduce_scatter"):
            assert comm[name]["calls"] >= 4 * 2 and comm[name]["bytes"] >= 4 * 2 * activation


def test_pipeline_schedules_match_single_process(pipeline_run):
    results, folder = pipeline_run
    expected, losses = reference(16, n_layer=8)
    records = {r["config"]["schedule"]: r for r in read_records(results)}
    assert set(records) == {"gpipe", "1f1b", "interleaved_1f1b"}
    for schedule, record in records.items():
        assert_matches(folder / f"{schedule}_m4.pt", expected)
        # The loss printed is the last stage's mean over micro-batches = the full-batch loss.
        assert record["losses"] == pytest.approx(losses, abs=1e-5), schedule
        stages = 2 if schedule == "interleaved_1f1b" else 1
        assert record["bubble"]["theory"] == pytest.approx(3 / (stages * 4 + 3))
        assert 0 <= record["bubble"]["measured"] < 1
        # compute inside the schedule's span on every rank: the README splits the idle rest
        for step_s, compute_s in zip(record["bubble"]["schedule_s_per_rank"], record["bubble"]["compute_s_per_rank"]):
            assert 0 < compute_s < step_s, schedule
        assert record["metrics"]["comm_per_step"]["send"]["calls"] > 0  # activations/grads move p2p
        # a rank holds its stages only; the record counts the whole model
        assert record["model"]["n_layer"] == 8 and record["param_count"] == sum(t.numel() for t in expected.values())


def test_two_rank_pipeline_matches_single_process(tmp_path):
    """The README's 2-rank comparison run (no CPU oversubscription), at the equivalence settings."""
    results = tmp_path / "r.jsonl"
    run_readme("pipeline_2ranks", tmp_path, extra=(*QUICK, "--global-batch-size", 16, "--microbatches", 2, 4,
                                                   "--results", results,
                                                   "--save", tmp_path / "{schedule}_m{microbatches}.pt"))
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
    run_readme(mode, tmp_path, extra=(*QUICK, "--global-batch-size", 16, "--results", results,
                                      "--save", tmp_path / "{mode}.pt"))
    expected, losses = reference(16)
    assert_matches(tmp_path / f"{mode}.pt", expected)
    (record,) = read_records(results)
    assert record["strategy"] == {"2d": "fsdp_tp_2d", "hsdp": "hsdp"}[mode]
    assert record["losses"] == pytest.approx(losses, abs=1e-5)
    dense = sum(t.numel() * 4 for t in expected.values())
    assert record["param_count"] * 4 == dense and record["model"]["arch"] == "gpt"
    held = [s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]]
    # 2-D: every rank holds ~1/4 of the weights; HSDP: ~1/2 (sharded over 2, replicated twice)
    assert max(held) < dense / (3 if mode == "2d" else 1.8), held


def test_mesh_that_does_not_match_world_size_is_one_clear_error(tmp_path):
    result = run_readme("mesh_error", tmp_path, check=False)
    assert_one_line_error(result, "the mesh axes must multiply to the world size")


def test_gradient_accumulation_equals_large_batch_and_no_sync_saves_k(tmp_path):
    results, k = tmp_path / "r.jsonl", 4
    run_readme("accumulation", tmp_path, extra=(*QUICK, "--grad-accum-steps", k, "--micro-batch-size", 2,
                                                "--results", results, "--save", tmp_path / "{sync}.pt"))
    expected, _ = reference(2 * k * 4)  # one k-times larger batch over 4 ranks
    assert_matches(tmp_path / "no_sync.pt", expected)
    assert_matches(tmp_path / "every_micro_batch.pt", expected)
    records = read_records(results)
    assert [r["config"]["grad_accum_steps"] for r in records] == [k, k]
    bytes_per_step = {r["config"]["sync"]: r["metrics"]["comm_per_step"]["all_reduce"]["bytes"] for r in records}
    dense = sum(t.numel() * 4 for t in expected.values())
    assert bytes_per_step["no_sync"] == dense  # one all-reduce of every gradient per optimizer step
    assert bytes_per_step["every_micro_batch"] == k * bytes_per_step["no_sync"]


def test_communication_overlap(overlap_run):
    results, out, trace = overlap_run
    assert "hidden" in out and "async_op=True + wait()" in out
    assert trace.stat().st_size > 0
    records = read_records(results)
    calls = {r["config"]["bucket_cap_mb"]: r["metrics"]["comm_per_step"]["all_reduce"]["calls"] for r in records}
    assert calls[25] == 1 and calls[0.02] > 1  # 16 x 128 x 128 fp32 = 1 MiB: one bucket vs many
    for record in records:  # the MLP says what it is in the record's model field
        assert record["model"] == {"arch": "mlp", "layers": 16, "width": 128}
        assert record["param_count"] == 16 * (128 * 128 + 128)
        assert record["config"]["global_batch_size"] == 256 and record["metrics"]["samples_per_step"] == 256


def test_readme_plot_command_draws_both_plots(pipeline_run, overlap_run, tmp_path):
    """The README's plot command, pointed at the records of the two runs above."""
    command = readme_command(README, *LOOKUPS["plot"][0])
    assert command.startswith("python 05-advanced/plot_results.py")
    out = python(CHAPTER / "plot_results.py", *shlex.split(command)[2:], "--results", pipeline_run[0],
                 overlap_run[0], "--out-dir", tmp_path, tmp_path=tmp_path).stdout
    assert f"wrote {tmp_path / 'pipeline_bubble.png'}" in out and f"wrote {tmp_path / 'bucket_sweep.png'}" in out
    for png in ("pipeline_bubble.png", "bucket_sweep.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overlap_is_measured_on_one_timeline():
    """On CPU, gloo's worker-thread spans against autograd's; on GPU, NCCL kernels against the other
    *kernels* only: the host spans there are launch times, and a host span covering everything
    must not make communication look hidden."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    overlap = load_script(CHAPTER / "communication_overlap.py")

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


def test_bad_flags_are_one_argparse_line():
    """A bad number is one argparse line and exit code 2 before any process group exists
    (distkit.flags types). The parsers run in this process (launch.parse_args_result): the
    same code and output as a launch."""
    cases = [("pipeline_parallel.py", ["--microbatches", "4", "0"], "argument --microbatches: must be a positive integer, got 0"),
             ("communication_overlap.py", ["--bucket-cap-mb", "-1"], "argument --bucket-cap-mb: must be a number >= 0, got -1"),
             ("hybrid_parallelism.py", ["--tp", "-2"], "argument --tp: must be a positive integer, got -2"),
             ("gradient_accumulation.py", ["--warmup-steps", "-1"], "argument --warmup-steps: must be an integer >= 0, got -1"),
             ("gradient_accumulation.py", ["--grad-accum-steps", "0"], "argument --grad-accum-steps: must be a positive integer, got 0"),
             ("gradient_accumulation.py", ["--accumulation-steps", "4"], "unrecognized arguments: --accumulation-steps 4"),
             ("tensor_parallel.py", ["--lr", "nan"], "argument --lr: must be a positive number, got 'nan'"),
             ("tensor_parallel.py", ["--checkpoint", "x.pt"], "unrecognized arguments: --checkpoint x.pt")]
    for script, args, expected in cases:
        result = parse_args_result(load_script(CHAPTER / script), *args)
        assert result.returncode == 2, (script, args, result.stdout[-2000:])
        assert_one_line_error(result, expected)


def test_every_readme_command_is_run_by_a_test():
    """Each lookup above is the one a test makes; together they must cover the README, each command
    exactly once, so a command added to the README without a test (or a lookup that no longer finds
    its command) fails here."""
    assert_readme_covered(README, list(LOOKUPS.values()))
