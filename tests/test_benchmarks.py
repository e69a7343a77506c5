"""benchmarks/: theory formulas, the quick matrix against theory (bytes within 1%, model state within
5%), the plots, the committed CPU results, bad input, and every command of benchmarks/README.md.

One real launch of ``distributed_benchmarks.py --quick`` (10 torchrun jobs) is shared by the tests
that need measured records (a module-scoped fixture), so the matrix runs once per session.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from launch import REPO, assert_one_line_error, command_argv, job_env, python, readme_commands, run

BENCH = REPO / "benchmarks"
COMMITTED_RESULTS = BENCH / "results_cpu.jsonl"
BYTES_TOLERANCE = 0.01   # the bar: communication bytes within 1% of theory.py
STATE_TOLERANCE = 0.05   # model-state bytes within 5%


def _load(name: str):
    """Import benchmarks/<name>.py as module ``name`` (plot.py imports theory by that name)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


theory = _load("theory")


# ---------------------------------------------------------------- formulas (no launch)

def test_zero_paper_example_and_napkin_formulas():
    # ZeRO paper figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB per GPU.
    psi, n = 7.5e9, 64
    totals = [sum(theory.zero_paper_bytes(psi, n, stage).values()) / 1e9 for stage in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], rel=3e-3)  # the paper rounds to 3 digits
    assert theory.pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert theory.pipeline_bubble(4, 8, chunks_per_rank=2) == pytest.approx(3 / 19)
    assert theory.ddp_bytes(1000, 4) == {"bytes": 4000, "bus_bytes": 4000 * 2 * 3 / 4}
    tp = theory.megatron_tp_bytes_per_layer(8, 32, 64, tp=2)
    assert tp["all_reduce"]["calls"] == 4 and tp["all_reduce"]["bytes"] == 4 * 8 * 32 * 64 * 4
    sp = theory.megatron_tp_bytes_per_layer(8, 32, 64, tp=2, sequence_parallel=True)
    assert sp["all_gather"]["bus_bytes"] + sp["reduce_scatter"]["bus_bytes"] == tp["all_reduce"]["bus_bytes"]
    # FSDP2 pads dim 0 per parameter; torch.chunk gives the last rank the remainder.
    assert theory.fsdp_padded_numel((66, 64), 4) == 68 * 64
    assert theory.chunk_sizes(66, 4) == [17, 17, 17, 15]
    assert theory.chunk_sizes(3, 4) == [1, 1, 1, 0]
    fits = {s: theory.mixed_precision_state_per_gpu(s, 1e9, 8) for s in ("ddp", "zero1", "zero3")}
    assert fits["ddp"] == 16e9 and fits["zero3"] == 2e9 and fits["ddp"] > fits["zero1"] > fits["zero3"]


def test_predictions_are_consistent_across_strategies():
    cfg = theory.gpt_config("tiny", vocab_size=66, seq_len=30)  # shapes that do not divide by 4
    psi = sum(math.prod(s) for s in theory.gpt_param_shapes(cfg).values())
    ddp = theory.predict("ddp", cfg, 4, 16)
    assert ddp["comm_per_rank"][0]["all_reduce"]["bytes"] == 4 * psi
    full = theory.predict("fsdp_full_shard", cfg, 4, 16)
    held = [sum(s.values()) for s in full["state_per_rank"]]
    assert held[0] > held[3], "the last rank's shard lacks the padding rows"
    assert sum(held) == 16 * psi  # the shards add up to the whole model (4 + 4 + 8 bytes each)
    gathered = full["comm_per_rank"][0]["all_gather"]["bytes"]
    assert gathered > 4 * psi  # padded gathers, blocks gathered twice
    pp = theory.predict("pp_1f1b", cfg, 2, 16, {"microbatches": 4})
    assert sum(sum(s.values()) for s in pp["state_per_rank"]) == 16 * psi
    with pytest.raises(ValueError):
        theory.predict("no_such_strategy", cfg, 2, 16)


# ---------------------------------------------------------------- the quick matrix (one launch)

@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quick")
    results = tmp / "quick.jsonl"
    out = python(BENCH / "distributed_benchmarks.py", "--quick", "--results", results, tmp_path=tmp, timeout=900)
    return results, out.stdout


def _check_bars(records):
    failures = []
    for record in records:
        comparison = theory.compare_record(record)
        if comparison["comm_error"] > BYTES_TOLERANCE or comparison["state_error"] > STATE_TOLERANCE:
            failures.append((record["strategy"], record["world_size"], comparison["comm_error"],
                             comparison["state_error"]))
    assert not failures, f"(strategy, ranks, bytes error, state error) beyond the bars: {failures}"


def test_quick_matrix_covers_every_strategy_and_meets_the_bars(quick_results):
    results, stdout = quick_results
    records = [json.loads(line) for line in results.read_text().splitlines()]
    by_strategy = {r["strategy"]: r for r in records}
    assert set(by_strategy) == set(theory.STRATEGIES) - {"zero0"}, stdout[-3000:]
    failed = {s: r.get("error") for s, r in by_strategy.items() if r["status"] != "ok"}
    assert not failed, failed
    for record in records:
        metrics = record["metrics"]
        assert metrics["timed_steps"] >= 2 and metrics["step_time_s_median"] > 0  # warm-up excluded
        assert metrics["comm_per_step"], f"{record['strategy']}: no collective counted"
        assert record["benchmark"]["gpt"]["n_layer"] == 4
        # no GPU here: every cell ran where it was asked to (auto -> gloo on CPU), nothing to explain
        assert record["benchmark"]["placement"] == {"backend": "auto", "device": "auto",
                                                    "gpus_hidden": False, "note": None}
        assert (record["backend"], record["device"]) == ("gloo", "cpu")
    _check_bars(records)


def test_plot_writes_every_png_and_the_table(quick_results, tmp_path):
    results, _ = quick_results
    out = python(BENCH / "plot.py", "--results", results, "--out-dir", tmp_path / "plots", tmp_path=tmp_path)
    plot = _load("plot")
    for name in (*plot.PLOTS, "summary.md"):
        path = tmp_path / "plots" / name
        assert path.exists() and path.stat().st_size > 1000, name
    table = (tmp_path / "plots" / "summary.md").read_text()
    assert "| fsdp_full_shard | 2 | tiny |" in table and "| hsdp | 4 | tiny |" in table, out.stdout


# ---------------------------------------------------------------- committed results (no launch)

def test_committed_cpu_results_meet_the_bars_and_plots_exist():
    records = [json.loads(line) for line in COMMITTED_RESULTS.read_text().splitlines()]
    ok = [r for r in records if r.get("status") == "ok"]
    assert {r["strategy"] for r in ok} >= set(theory.STRATEGIES) - {"zero0"}
    _check_bars(ok)
    for name in ("throughput.png", "memory.png", "comm_bytes.png", "scaling.png", "bandwidth.png"):
        assert (BENCH / "figures" / name).stat().st_size > 1000, name


# ---------------------------------------------------------------- where cells run (no launch)

def test_cells_beyond_the_gpus_are_planned_on_cpu_not_skipped():
    """The plan for a machine with one GPU: the 1-rank cells run as asked (NCCL on the GPU), the
    2-rank cells on CPU/gloo with the GPUs hidden and a note; --gpu-only or a forced --backend nccl
    skips them with the reason. Without GPUs nothing changes. (The GPU suite launches such cells.)"""
    bench = _load("distributed_benchmarks")
    argv = ["--strategies", "ddp", "pp_1f1b", "hsdp", "--world-sizes", "1", "2", "--n-layer", "4",
            "--global-batch-size", "8"]
    cells, skipped = bench.plan_cells(bench.parse_args(argv), gpus=1)
    by_world = {(c.strategies, c.world_size): c for c in cells}
    assert set(by_world) == {(("ddp",), 1), (("pp_1f1b",), 1), (("ddp",), 2), (("pp_1f1b",), 2)}
    assert [(s["strategy"], s["world_size"]) for s in skipped] == [("hsdp", 1), ("hsdp", 2)]
    for (_, world), cell in by_world.items():
        command = bench.cell_command(cell, bench.parse_args(argv), Path("/s"), Path("/r.jsonl"))
        backend_device = command[command.index("--backend") + 1], command[command.index("--device") + 1]
        if world == 1:
            assert cell.placement == bench.Placement("auto", "auto") and backend_device == ("auto", "auto")
        else:
            assert cell.placement.hide_gpus and backend_device == ("gloo", "cpu")
            assert cell.placement.note == "ran on CPU/gloo: 2 ranks need 2 GPUs (one per NCCL rank), this machine has 1"

    cells, skipped = bench.plan_cells(bench.parse_args([*argv, "--gpu-only"]), gpus=1)
    assert {c.world_size for c in cells} == {1}
    assert {s["error"] for s in skipped if s["strategy"] == "ddp"} == {
        "2 ranks need 2 GPUs (one per NCCL rank), this machine has 1 (--gpu-only)"}
    cells, skipped = bench.plan_cells(bench.parse_args([*argv, "--backend", "nccl"]), gpus=1)
    assert {c.world_size for c in cells} == {1} and all(c.placement.backend == "nccl" for c in cells)
    cells, _ = bench.plan_cells(bench.parse_args(argv), gpus=0)
    assert all(c.placement == bench.Placement("auto", "auto") for c in cells) and len(cells) == 4


def test_plot_keeps_cells_from_different_devices_apart(tmp_path):
    """A results file with a GPU cell next to CPU/gloo cells (what a matrix on a one-GPU machine
    writes): both rows stay, the table says where each ran, and panels are split per device. The
    GPU record is a relabelled copy of a CPU one: only the bookkeeping is under test here."""
    plot = _load("plot")
    records = [json.loads(line) for line in COMMITTED_RESULTS.read_text().splitlines()]
    ddp = next(r for r in records if r["strategy"] == "ddp" and r["world_size"] == 2 and r.get("status") == "ok")
    relabelled = dict(ddp, backend="nccl", device="cuda", machine=dict(ddp["machine"], device_name="GPU X"))
    mixed_file = tmp_path / "mixed.jsonl"
    mixed_file.write_text("".join(json.dumps(r) + "\n" for r in (ddp, relabelled)))
    cells, _, _ = plot.load(mixed_file)
    assert [plot.where(r) for r in cells] == ["cpu/gloo", "cuda/nccl"]
    table = plot.summary_table(cells, [])
    assert "| ran on |" in table and "| ddp | 2 | tiny | cpu/gloo |" in table and "| ddp | 2 | tiny | cuda/nccl |" in table
    assert set(plot._by_model(cells)) == {"tiny on cpu/gloo", "tiny on cuda/nccl"}
    assert "| ran on |" not in plot.summary_table([ddp], [])  # one device: the table as before


# ---------------------------------------------------------------- failures and bad input

def test_failed_cells_are_recorded_and_the_run_goes_on(tmp_path):
    results = tmp_path / "r.jsonl"
    out = python(BENCH / "distributed_benchmarks.py", "--strategies", "ddp", "tp", "--world-sizes", "2",
                 "--steps", "4", "--backend", "nccl", "--device", "cpu", "--results", results,
                 tmp_path=tmp_path, timeout=300)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["strategy"] for r in records] == ["ddp", "tp"], out.stdout
    for record in records:
        assert record["status"] in ("failed", "skipped") and record["error"], record
    assert "0 cells ok, 2 failed" in out.stdout and "nccl" in records[0]["error"].lower()


def test_bad_input_is_one_line(tmp_path):
    bad = python(BENCH / "distributed_benchmarks.py", "--strategies", "ddp", "nope", check=False, tmp_path=tmp_path)
    assert_one_line_error(bad, "unknown strategy nope")
    bad = python(BENCH / "distributed_benchmarks.py", "--world-sizes", "3", "--global-batch-size", "16",
                 check=False, tmp_path=tmp_path)
    assert_one_line_error(bad, "must divide by every world size")
    # numeric flags are range-checked where they are defined (distkit.flags)
    bad = python(BENCH / "distributed_benchmarks.py", "--world-sizes", "2", "0", check=False, tmp_path=tmp_path)
    assert_one_line_error(bad, "argument --world-sizes: must be a positive integer, got 0")
    bad = python(BENCH / "distributed_benchmarks.py", "--cell-timeout-s", "-5", check=False, tmp_path=tmp_path)
    assert_one_line_error(bad, "argument --cell-timeout-s: must be a positive number, got -5")
    bad = python(BENCH / "harness_overhead.py", "--rounds", "0", check=False, tmp_path=tmp_path)
    assert_one_line_error(bad, "argument --rounds: must be a positive integer, got 0")
    missing = python(BENCH / "plot.py", "--results", tmp_path / "missing.jsonl", check=False, tmp_path=tmp_path)
    assert_one_line_error(missing, "does not exist")
    (tmp_path / "garbage.jsonl").write_text("not json\n")
    garbage = python(BENCH / "plot.py", "--results", tmp_path / "garbage.jsonl", check=False, tmp_path=tmp_path)
    assert_one_line_error(garbage, "is not JSON lines")


# ---------------------------------------------------------------- README commands

# Appended to each README command so it runs quickly here and writes inside tmp_path (argparse keeps
# the last value of a repeated flag). Long matrix runs become --dry-run: the test checks they parse
# and plan; the --quick run itself is the quick_results fixture above.
def _quick_flags(command: str, tmp: Path, quick_results: Path) -> list[str]:
    if "distributed_benchmarks.py" in command:
        return ["--results", str(tmp / "readme.jsonl")] + ([] if "--quick" in command else ["--dry-run"])
    if "plot.py" in command:
        return ["--results", str(quick_results), "--out-dir", str(tmp / "plots")]
    if "harness_overhead.py" in command:
        return ["--rounds", "1", "--steps", "2"]
    return []


def test_readme_commands_run(quick_results, tmp_path):
    commands = readme_commands(BENCH / "README.md")
    assert commands, "benchmarks/README.md shows no command"
    for command in commands:
        if "distributed_benchmarks.py --quick" in command and "--results" not in command:
            continue  # exactly what the quick_results fixture ran
        result = run(command_argv(command) + _quick_flags(command, tmp_path, quick_results[0]), env=job_env(tmp_path), timeout=300)
        # The last non-empty line (output ends in a newline, so split("\n")[-1] would be "").
        lines = [line for line in result.stdout.lower().splitlines() if line.strip()]
        assert lines and "error" not in lines[-1], result.stdout[-2000:]
