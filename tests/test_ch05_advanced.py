"""Chapter 05: every command in 05-advanced/README.md runs, and every strategy it shows trains the
same model as single-process training.

Each README command runs once, as written with small flags appended (argparse keeps the last value
of a repeated flag), in the reader's play (tests/spine.py; the flags: ch05_common.PLAY): the tiny
GPT, 3 steps, plain SGD. TP, TP+SP,
1F1B pipeline, 2-D and HSDP also train the tiny Llama (--arch llama) at the same tolerance, and its
measured model state and collectives must equal distkit.theory's predictions (section "the tiny
Llama" below).

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

import json
import re

import pytest
import torch

from ch05_common import CHAPTER, LOOKUPS, QUICK, README, TOLERANCE, launch, reference
from distkit import compare
from distkit.harness import read_records
from launch import assert_one_line_error, assert_readme_covered, load_script, parse_args_result
from spine import flag_path, play_chapter


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
def played(reader):
    """The README's commands as the reader's play ran them (tests/spine.py; the flags it appends:
    ch05_common.PLAY)."""
    return play_chapter("05-advanced", reader)


@pytest.fixture(scope="module")
def pipeline_run(played):
    """The README's 4-rank pipeline command at the equivalence settings: (records file, folder)."""
    run = played.ok(LOOKUPS["pipeline"])
    return flag_path(run, "--results"), run["out"]


@pytest.fixture(scope="module")
def overlap_run(played):
    """The README's communication_overlap command, small: (records file, stdout, trace file)."""
    run = played.ok(LOOKUPS["overlap"])
    return flag_path(run, "--results"), run["stdout"], run["out"] / "trace.json"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_matches_single_process(sequence_parallel, played):
    run = played.ok(LOOKUPS["tp_sp" if sequence_parallel else "tp"])
    results, folder, stdout = flag_path(run, "--results"), run["out"], run["stdout"]
    assert "local per rank: r0 (16, 64)" in stdout  # q_proj weight: 64 output rows / 4 ranks

    expected, losses = reference(16)
    (record,) = read_records(results)
    assert record["strategy"] == ("tp_sp" if sequence_parallel else "tp")
    assert_matches(folder / f"{record['strategy']}.pt", expected)  # --save's {strategy} filled in
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
        assert f"{'all_reduce':<15} {8:>4} calls {mib}   vs   {8:>4} calls {mib}" in stdout, stdout[-3000:]
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


def test_two_rank_pipeline_matches_single_process(played):
    """The README's 2-rank comparison run (no CPU oversubscription), at the equivalence settings."""
    run = played.ok(LOOKUPS["pipeline_2ranks"])
    results, tmp_path = flag_path(run, "--results"), run["out"]
    expected, losses = reference(16, n_layer=8)
    records = read_records(results)
    assert [(r["world_size"], r["config"]["microbatches"]) for r in records] == [(2, 2), (2, 4)]
    for record in records:
        m = record["config"]["microbatches"]
        assert_matches(tmp_path / f"gpipe_m{m}.pt", expected)
        assert record["losses"] == pytest.approx(losses, abs=1e-5)
        assert record["bubble"]["theory"] == pytest.approx(1 / (m + 1))


@pytest.mark.parametrize("mode", ["2d", "hsdp"])
def test_hybrid_parallelism_matches_single_process(mode, played):
    run = played.ok(LOOKUPS[mode])
    results, tmp_path = flag_path(run, "--results"), run["out"]
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


# ------------------------------------------------------------------------------ the tiny Llama
# The same strategies on the tiny Llama (--arch llama --model-size tiny: 2 layers, width 64, 8 query
# heads of 8, 4 key/value heads (GQA), SwiGLU MLP 128, vocabulary 64, 32 tokens), against the same
# single-process reference built by build_model, at the same tolerance (1e-5 after 3 SGD steps; the
# module docstring says which bugs it catches). Observed: 6e-8 to 1.2e-7. test_ch05_negative.py runs
# the Llama's own negative controls (o_proj's partial sums never reduced; a stage that skips a layer).
# Each run appends --arch llama to a README command (argparse keeps the last value), except TP+SP,
# which is the README's Llama command.
LLAMA = ("--arch", "llama")
ACT = 16 * 32 * 64 * 4  # one fp32 activation of the global batch: 16 sequences x 32 tokens x width 64
# parameters of one Llama layer: q, o 64x64; k, v 32x64 (4 kv heads x 8); gate, up, down 128x64;
# two RMSNorm weights of 64. Outside the layers: embed_tokens 64x64, model.norm 64, lm_head 64x64.
LAYER_MATRICES, LAYER_NORMS, EMBED = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64, 2 * 64, 64 * 64


def assert_predicted(record) -> None:
    """The model state every rank measured (parameters and gradients; SGD keeps no optimizer state)
    and its collectives per step, calls and bytes, equal what distkit.theory predicts for the cell
    (the prediction the benchmarks and plots use), exactly."""
    prediction = compare.predict_record(record)
    metrics = record["metrics"]
    for rank, (got, want) in enumerate(zip(metrics["model_state_bytes_per_rank"], prediction["state_per_rank"])):
        assert (got["params"], got["grads"]) == (want["params"], want["grads"]), (rank, got, want)
    calls_bytes = lambda comm: {k: (v["calls"], v["bytes"]) for k, v in comm.items() if k != "barrier"}  # noqa: E731
    for rank, (got, want) in enumerate(zip(metrics["comm_per_step_per_rank"], prediction["comm_per_rank"])):
        assert calls_bytes(got) == calls_bytes(want), (rank, got, want)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_llama_matches_single_process(sequence_parallel, played, tmp_path):
    """TP of the Llama by its Hugging Face names (GQA: k/v_proj split into one kv head per rank);
    with SP, the RMSNorms, embed_tokens and lm_head too, and the rotary positions of the whole
    sequence (the bug this catches: positions computed from a sequence shard's length)."""
    if sequence_parallel:  # the README's Llama command, as the play ran it
        run = played.ok(LOOKUPS["tp_llama_sp"])
        results, tmp_path, stdout = flag_path(run, "--results"), run["out"], run["stdout"]
    else:
        results = tmp_path / "r.jsonl"
        stdout = run_readme("tp", tmp_path, extra=(*QUICK, *LLAMA, "--global-batch-size", 16, "--results", results,
                                                   "--save", tmp_path / "{strategy}.pt")).stdout
    assert re.search(r"k_proj\.weight +full \(32, 64\) +local per rank: r0 \(8, 64\)", stdout), stdout[-3000:]
    expected, losses = reference(16, arch="llama")
    (record,) = read_records(results)
    assert record["strategy"] == ("tp_sp" if sequence_parallel else "tp")
    assert_matches(tmp_path / f"{record['strategy']}.pt", expected)
    assert record["losses"] == pytest.approx(losses, abs=1e-5)
    assert record["model"]["arch"] == "llama" and record["model"]["n_kv_head"] == 4
    total = 2 * (LAYER_MATRICES + LAYER_NORMS) + 2 * EMBED + 64
    assert record["param_count"] == sum(t.numel() for t in expected.values()) == total
    assert_predicted(record)
    # Independently of distkit.theory: a layer's matrices split 4 ways, its norms replicated; with SP
    # embed_tokens (rows) and lm_head (columns) are split too, but embed_tokens' gradient arrives whole.
    outside = 2 * EMBED // 4 + 64 if sequence_parallel else 2 * EMBED + 64
    held = 2 * (LAYER_MATRICES // 4 + LAYER_NORMS) + outside
    grads = held + (EMBED - EMBED // 4 if sequence_parallel else 0)
    held_per_rank = {(s["params"], s["grads"]) for s in record["metrics"]["model_state_bytes_per_rank"]}
    assert held_per_rank == {(4 * held, 4 * grads)}
    comm = record["metrics"]["comm_per_step"]
    if not sequence_parallel:  # Megatron: 4 all-reduces per layer of the activations
        assert (comm["all_reduce"]["calls"], comm["all_reduce"]["bytes"]) == (8, 8 * ACT)
    else:  # each all-reduce -> reduce-scatter + all-gather; + the embedding (one table), the LM head
        logits = 16 * 32 * 64 * 4
        assert (comm["all_gather"]["calls"], comm["all_gather"]["bytes"]) == (11, 10 * ACT + logits)
        assert (comm["reduce_scatter"]["calls"], comm["reduce_scatter"]["bytes"]) == (10, 10 * ACT)
        # the RMSNorms' weight gradients are Partial (each rank saw its sequence shard): summed once
        # after backward, one all-reduce per norm weight (2 per layer + the final norm), 64 floats each
        assert (comm["all_reduce"]["calls"], comm["all_reduce"]["bytes"]) == (5, 5 * 64 * 4)


def test_pipeline_llama_matches_single_process(tmp_path):
    """The README's 4-rank pipeline command with --arch llama, 1F1B: LlamaStage runs embed_tokens,
    its two of 8 layers with the rotary embeddings each needs, norm + lm_head (the bugs this catches:
    a stage that skips a layer or rotates by the wrong positions)."""
    results = tmp_path / "r.jsonl"
    run_readme("pipeline", tmp_path, extra=(*QUICK, *LLAMA, "--n-layer", 8, "--global-batch-size", 16,
                                            "--schedule", "1f1b", "--microbatches", 4, "--results", results,
                                            "--save", tmp_path / "{schedule}.pt"))
    expected, losses = reference(16, arch="llama", n_layer=8)
    (record,) = read_records(results)
    assert record["strategy"] == "pp_1f1b" and record["model"]["arch"] == "llama"
    assert_matches(tmp_path / "1f1b.pt", expected)
    assert record["losses"] == pytest.approx(losses, abs=1e-5)
    assert_predicted(record)
    layer = LAYER_MATRICES + LAYER_NORMS  # two layers per stage; embeddings first, norm + head last
    held = [s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]]
    assert held == [4 * (2 * layer + EMBED), 4 * 2 * layer, 4 * 2 * layer, 4 * (2 * layer + 64 + EMBED)]
    # rank 0 sends each of 4 micro-batches' activations (4 sequences x 32 x 64) forward once
    assert record["metrics"]["comm_per_step"]["send"] == pytest.approx(
        {"calls": 4, "bytes": ACT, "bus_bytes": ACT})


@pytest.mark.parametrize("mode", ["2d", "hsdp"])
def test_hybrid_parallelism_llama_matches_single_process(mode, tmp_path):
    """The README's 2-D and HSDP commands with --arch llama: the Llama's TP plan along tp, FSDP2 per
    model.layers.N and the root (the bugs this catches as for the GPT, module docstring)."""
    results = tmp_path / "r.jsonl"
    run_readme(mode, tmp_path, extra=(*QUICK, *LLAMA, "--global-batch-size", 16, "--results", results,
                                      "--save", tmp_path / "{mode}.pt"))
    expected, losses = reference(16, arch="llama")
    assert_matches(tmp_path / f"{mode}.pt", expected)
    (record,) = read_records(results)
    assert record["losses"] == pytest.approx(losses, abs=1e-5)
    assert record["model"]["arch"] == "llama"
    assert_predicted(record)
    total = sum(t.numel() for t in expected.values())
    # 2-D: matrices split 2 ways by TP then 2 ways by FSDP, the rest (norms, embeddings, head) 2
    # ways by FSDP; HSDP: everything 2 ways (sharded over 2, replicated twice). Every shape divides.
    held = 2 * LAYER_MATRICES // 4 + (total - 2 * LAYER_MATRICES) // 2 if mode == "2d" else total // 2
    assert [s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]] == [4 * held] * 4


def test_llama_tensor_parallel_needs_kv_heads_divisible():
    """GQA: the key/value heads split over the TP ranks too; one line says which number does not
    (checked in-process with the script's own check)."""
    from distkit import UsageError
    from distkit.models import model_config

    tp = load_script(CHAPTER / "tensor_parallel.py")
    with pytest.raises(UsageError, match=r"^--n-kv-head \(the key/value heads\) = 2 is not divisible by the "
                                         r"tensor-parallel degree 4$"):
        tp.check_divisible(model_config("llama", "tiny", n_kv_head=2), 4, sequence_parallel=False)
    tp.check_divisible(model_config("llama", "tiny"), 4, sequence_parallel=True)  # 8 q, 4 kv heads: fine


def test_mesh_that_does_not_match_world_size_is_one_clear_error(played):
    assert_one_line_error(played.completed(LOOKUPS["mesh_error"]), "the mesh axes must multiply to the world size")


def test_gradient_accumulation_equals_large_batch_and_no_sync_saves_k(played):
    run, k = played.ok(LOOKUPS["accumulation"]), 4  # ch05_common.PLAY: --grad-accum-steps 4
    results, tmp_path = flag_path(run, "--results"), run["out"]
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


def trace_overlap(trace: dict) -> tuple[float, float, float]:
    """(comm ms, hidden ms, hidden fraction) of rank 0's profiled step, recomputed here from the raw
    spans of its Chrome trace (microseconds): gloo's all-reduce spans, merged, against backward's
    autograd spans, merged; hidden = their intersection over the communication time."""
    def merged(prefix: str) -> list[list[float]]:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                       if e.get("ph") == "X" and e.get("name", "").startswith(prefix))
        out: list[list[float]] = []
        for start, end in spans:
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    comm, compute = merged("gloo:"), merged("autograd::engine::evaluate_function")
    busy = sum(end - start for start, end in comm)
    hidden = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in compute)
    assert busy > 0, "no all-reduce span in the trace"
    return busy / 1e3, hidden / 1e3, hidden / busy


OVERLAP_LINE = re.compile(r"^\[rank 0\]   rank 0: all-reduce busy ([\d.]+) ms, ([\d.]+) ms under backward "
                          r"compute -> (\d+)% hidden$", re.MULTILINE)


def check_overlap_line(trace: dict, out: str) -> None:
    """Rank 0's printed overlap line is its trace's spans, to the printed digits (1 decimal ms, whole %)."""
    ((busy, hidden, percent),) = OVERLAP_LINE.findall(out)
    comm_ms, hidden_ms, fraction = trace_overlap(trace)
    assert abs(float(busy) - comm_ms) <= 0.05 + 1e-3, f"all-reduce busy: printed {busy} ms, the trace's {comm_ms} ms"
    assert abs(float(hidden) - hidden_ms) <= 0.05 + 1e-3, (hidden, hidden_ms)
    assert abs(int(percent) - 100 * fraction) <= 0.5 + 1e-6, (percent, fraction)


def test_overlap_fraction_is_rank_0s_trace(overlap_run):
    """The reported hidden fraction, recomputed from the raw timings the script wrote (rank 0's trace).
    Control: the same trace with its first all-reduce span moved after every backward span and made
    1 ms longer (so the change shows at the printed digits however long the span took: a loaded
    machine's first span can last a millisecond already) fails the same check."""
    _, out, trace_file = overlap_run
    trace = json.loads(trace_file.read_text())
    check_overlap_line(trace, out)
    events = trace["traceEvents"]
    first = min((e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("gloo:")),
                key=lambda e: e["ts"])
    last_end = max(e["ts"] + e["dur"] for e in events if e.get("ph") == "X" and "dur" in e)
    moved = {**trace, "traceEvents": [e for e in events if e is not first]
             + [{**first, "ts": last_end + 1.0, "dur": first["dur"] + 1000.0}]}
    with pytest.raises(AssertionError, match="^all-reduce busy: "):
        check_overlap_line(moved, out)


def test_readme_plot_command_draws_both_plots(pipeline_run, overlap_run, played):
    """The README's plot command as the play ran it, after the two runs above: it draws their records
    (its default --results are the README's pipeline and overlap records)."""
    run = played.ok(LOOKUPS["plot"])
    assert run["command"] == "python 05-advanced/plot_results.py --out-dir runs/plots"
    assert [pipeline_run[0], overlap_run[0]] == [played.clone / "runs" / "pipeline.jsonl",
                                                 played.clone / "runs" / "overlap.jsonl"]
    out, plots = run["stdout"], flag_path(run, "--out-dir")
    assert "wrote runs/plots/pipeline_bubble.png" in out and "wrote runs/plots/bucket_sweep.png" in out, out
    for png in ("pipeline_bubble.png", "bucket_sweep.png"):
        assert (plots / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overlap_is_measured_on_one_timeline():
    """On CPU, gloo's worker-thread spans against autograd's; on GPU, NCCL kernels against the other
    *kernels* only: the host spans there are launch times, and a host span covering everything
    must not make communication look hidden."""
    overlap = load_script(CHAPTER / "communication_overlap.py")

    def event(name, start, end, cat="cpu_op"):  # a Chrome trace's complete event, microseconds
        return {"ph": "X", "name": name, "ts": start, "dur": end - start, "cat": cat}

    host_backward = event("autograd::engine::evaluate_function: AddmmBackward0", 0, 1000)
    gpu = [host_backward,
           event("void at::native::gemm_kernel", 0, 50, "kernel"),
           event("void at::native::gemm_kernel", 60, 100, "kernel"),
           event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 40, 80, "kernel"),
           event("record_param_comms", 40, 41)]  # host side of the launch: ignored on GPU
    result = overlap.overlap_from_trace(gpu, "cuda")
    assert result["comm_ms"] == pytest.approx(0.040)  # trace times are microseconds
    assert result["hidden_fraction"] == pytest.approx(30 / 40)  # [40,50] and [60,80] under kernels
    cpu = [event("gloo:all_reduce", 0, 10), event("gloo:all_reduce", 20, 30),
           event("autograd::engine::evaluate_function: AddmmBackward0", 5, 25),
           {"ph": "i", "name": "gloo:all_reduce", "ts": 0}]  # an instant event has no span
    assert overlap.overlap_from_trace(cpu, "cpu")["hidden_fraction"] == pytest.approx(10 / 20)


def test_bad_flags_are_one_argparse_line():
    """A bad number is one argparse line and exit code 2 before any process group exists
    (distkit.flags types). The parsers run in this process (launch.parse_args_result): the
    same code and output as a launch."""
    cases = [("pipeline_parallel.py", ["--microbatches", "4", "0"],
              "argument --microbatches: must be a positive integer, got 0"),
             ("communication_overlap.py", ["--bucket-cap-mb", "-1"],
              "argument --bucket-cap-mb: must be a number >= 0, got -1"),
             ("hybrid_parallelism.py", ["--tp", "-2"], "argument --tp: must be a positive integer, got -2"),
             ("gradient_accumulation.py", ["--warmup-steps", "-1"],
              "argument --warmup-steps: must be an integer >= 0, got -1"),
             ("gradient_accumulation.py", ["--grad-accum-steps", "0"],
              "argument --grad-accum-steps: must be a positive integer, got 0"),
             ("gradient_accumulation.py", ["--accumulation-steps", "4"],
              "unrecognized arguments: --accumulation-steps 4"),
             ("tensor_parallel.py", ["--lr", "nan"], "argument --lr: must be a positive number, got 'nan'"),
             ("tensor_parallel.py", ["--checkpoint", "x.pt"], "unrecognized arguments: --checkpoint x.pt")]
    for script, args, expected in cases:
        result = parse_args_result(load_script(CHAPTER / script), *args)
        assert result.returncode == 2, (script, args, result.stdout[-2000:])
        assert_one_line_error(result, expected)


def test_every_readme_command_is_run_by_a_test():
    """Each lookup in ch05_common.LOOKUPS is the one a test makes; together they must cover the
    README, each command exactly once, so a command added to the README without a test (or a lookup
    that no longer finds its command) fails here."""
    assert_readme_covered(README, list(LOOKUPS.values()))
