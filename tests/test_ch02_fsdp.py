"""Chapter 02 (FSDP): every strategy trains the same model as one process, the measured bytes match
the sharding formulas, DCP checkpoints reshard from 4 ranks to 2, and the README's commands run.

The equivalence checks (check_like_one_process with FP32_ATOL, check_bf16_like_one_process with
BF16_RELATIVE) and the reference trainer are in ch02_common.py, which says what the tolerances were
measured at; test_ch02_negative.py runs broken copies of fsdp_transformer.py and fsdp_checkpoint.py
with the played commands' flags and shows each fails the same check by far (gradients summed instead
of averaged, a rank's shard never stepped, HSDP without its replica all-reduce, a DCP resume without
the Adam state or its step count). Byte counts are compared exactly: the dim-0 padding (vocab 65 on 4
ranks) changes them by less than 0.2%, so a relative tolerance of even 1% would hide a formula that
forgets it (test_measured_bytes_match_the_formulas shows that).

Launches are shared: the README's basics, strategies sweep, table and knob commands run once in the
reader's play (tests/spine.py; the flags appended: ch02_common.PLAY), one sweep (4 ranks) serving the
equivalence, byte and table tests; the three checkpoint commands run once here, in order, and the
failing launches (bad input, damaged or foreign checkpoints) run two at a time, on copies of that
checkpoint. Flag errors that argparse or parse_args catch are checked in this process.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ch02_common import (
    BASICS,
    BF16,
    CHAPTER,
    FP32_ATOL,
    LOOKUPS,
    OFFLOAD,
    README,
    RECORD,
    RESUME_FULL,
    RESUME_LATEST,
    SAVE,
    STEPS,
    STRATEGIES,
    SWEEP,
    TABLE,
    TINY,
    check_bf16_like_one_process,
    check_like_one_process,
    check_ok,
    dcp_weights,
    expected_bytes,
    max_diff,
    readme_argv,
    reference_state,
    run_all,
    shard_bytes,
)
from distkit import UsageError
from distkit.harness import read_records
from distkit.models import GPTConfig, TinyGPT, gpt_config
from launch import WORKERS, assert_one_line_error, assert_readme_covered, launcher_argv, load_script
from spine import flag_path, play_chapter


def model_of(record: dict) -> GPTConfig:
    """The GPTConfig of a harness record's ``model`` field."""
    assert record["model"]["arch"] == "gpt", record["model"]
    return GPTConfig(**{k: v for k, v in record["model"].items() if k != "arch"})


# ------------------------------------------------------------------------------ the strategies sweep

@pytest.fixture(scope="module")
def played(reader):
    """The README's commands as the reader's play ran them (tests/spine.py; ch02_common.PLAY)."""
    return play_chapter("02-fsdp", reader)


@pytest.fixture(scope="module")
def sweep(played):
    """One 4-rank launch of the README's strategies command: all five strategies, 4 steps each
    (2 warm-up steps: DDP re-broadcasts its bucket layout in step 2, then the counted step 3), its
    records where the README writes them: (folder, records file, result)."""
    run = played.ok(SWEEP)
    return run["out"], flag_path(run, "--results"), played.completed(SWEEP)


def test_every_strategy_matches_single_process_training(sweep):
    """Every strategy of the sweep (plain SGD, ch02_common.PLAY) ends where single-process SGD ends.
    Bugs caught (test_ch02_negative.py, mutants of the script run with these flags, each over 300x
    the tolerance): gradients summed instead of averaged (4 ranks and 2), a rank's shard never
    stepped, HSDP replicas not all-reduced."""
    tmp, records_file, _ = sweep
    assert {r["config"]["optimizer"] for r in read_records(records_file)} == {"sgd"}
    initial, reference = reference_state(STEPS, optimizer="sgd")
    moved = max_diff(initial, reference)
    assert moved > 500 * FP32_ATOL  # the check below is not vacuous: training really moved the weights
    for strategy in STRATEGIES:
        trained = torch.load(tmp / "params" / f"{strategy}.pt", weights_only=True)
        check_like_one_process(trained, reference, strategy)


def test_measured_bytes_match_the_formulas(sweep):
    tmp, records_file, result = sweep
    records = {r["strategy"]: r for r in read_records(records_file)}
    assert set(records) == {RECORD[s] for s in STRATEGIES}
    tiny = gpt_config("tiny", vocab_size=65)
    for strategy in STRATEGIES:
        record = records[RECORD[strategy]]
        # the model lives in the record's own fields, not in config (harness record schema 2)
        assert model_of(record) == tiny and record["param_count"] == sum(p.numel() for p in TinyGPT(tiny).parameters())
        assert not {"model_size", "gpt", "param_count"} & set(record["config"]), record["config"]
        # the sweep trains plain SGD (ch02_common.PLAY): no optimizer state at all
        assert record["config"]["optimizer"] == "sgd"
        expected = expected_bytes(strategy, world=4, shard_size=2, optimizer="sgd")
        measured = {k: v["bytes"] for k, v in record["metrics"]["comm_per_step"].items()}
        assert set(measured) == set(expected["comm"]), (strategy, measured)
        for collective, value in expected["comm"].items():
            assert measured[collective] == value, (strategy, collective)  # exact: whole bytes per step
        per_rank = record["metrics"]["model_state_bytes_per_rank"]
        assert per_rank[0] == expected["state"], strategy  # rank 0 holds full (padded-size) chunks
        for rank, rank_state in enumerate(per_rank):  # later ranks hold the rest, padding excluded
            assert rank_state["params"] == shard_bytes(strategy, rank, world=4, shard_size=2), (strategy, rank)
        # the script's own prediction (distkit.predictors, shown in the table) agrees with this
        # independent formula, its optimizer state SGD's none (the committed AdamW record below
        # checks the 2P/s of AdamW's), and the printed lines show the prediction next to the measurement
        assert record["predicted"]["comm_bytes"] == expected["comm"], strategy
        assert {k: record["predicted"][k] for k in expected["state"]} == expected["state"], strategy
        assert f"{strategy:>13} | bytes/step " in result.stdout and f"(predicted {expected['comm']})" in result.stdout
        assert f"{strategy:>13} | rank-0 state: " in result.stdout and \
            f"(predicted {expected['state']['params']:,} / {expected['state']['grads']:,} / 0)" in result.stdout
        assert record["config"]["precision"] == "fp32"
    check_hsdp_row(records[RECORD["hybrid_shard"]])  # the 2x2 mesh's bus bytes, group by group
    # FULL_SHARD moves about 1.5x DDP's bytes on the wire: 2 all-gathers + 1 reduce-scatter of P,
    # each (n-1)/n, against one all-reduce of P at 2(n-1)/n. The root unit is gathered once only.
    bus = {s: sum(v["bus_bytes"] for v in records[RECORD[s]]["metrics"]["comm_per_step"].values())
           for s in STRATEGIES}
    assert 1.4 < bus["full_shard"] / bus["ddp"] <= 1.5
    assert bus["shard_grad_op"] == pytest.approx(bus["ddp"], rel=0.03)
    assert "loss" in result.stdout and "records appended" in result.stdout

    # Negative control: the exact comparison catches a formula that forgets the dim-0 padding (vocab
    # 65 on 4 ranks: 3 rows of tok_emb and lm_head, under 0.2% of the bytes) or that gathers each
    # block once under FULL_SHARD (as if it were SHARD_GRAD_OP).
    for strategy in ("full_shard", "shard_grad_op", "hybrid_shard"):
        measured = {k: v["bytes"] for k, v in records[RECORD[strategy]]["metrics"]["comm_per_step"].items()}
        unpadded = expected_bytes(strategy, world=4, shard_size=2, pad=False)["comm"]
        assert measured != unpadded, strategy
        assert records[RECORD[strategy]]["metrics"]["model_state_bytes_per_rank"][0] != \
            expected_bytes(strategy, world=4, shard_size=2, pad=False, optimizer="sgd")["state"], strategy
    once = expected_bytes("full_shard", world=4, shard_size=2, block_gathers=1)["comm"]["all_gather"]
    assert records[RECORD["full_shard"]]["metrics"]["comm_per_step"]["all_gather"]["bytes"] != once


def test_committed_strategies_record_matches_the_formulas():
    """The committed record behind the chapter's table and plots (a 4-rank `small` GPT run, AdamW):
    its measured model state (AdamW's two moments: 2P/s) and bytes equal the formulas, computed here
    independently of the script; and the script's prediction, now taken from distkit.predictors,
    equals the one it recorded then (so the printed predicted-vs-measured numbers did not change)."""
    transformer = load_script(CHAPTER / "fsdp_transformer.py")
    records = {r["strategy"]: r for r in read_records(CHAPTER / "records" / "fsdp_strategies.jsonl")}
    assert set(records) == {RECORD[s] for s in STRATEGIES}
    for strategy in STRATEGIES:
        record = records[RECORD[strategy]]
        assert record["world_size"] == 4 and record["config"]["precision"] == "fp32"
        cfg = model_of(record)  # read_records upgraded the old record's config.gpt into `model`
        # recorded before --optimizer existed: AdamW, the script's default then and now
        optimizer = record["config"].get("optimizer", "adamw")
        assert optimizer == "adamw", strategy
        expected = expected_bytes(strategy, world=4, shard_size=2, cfg=cfg, optimizer="adamw")
        assert record["metrics"]["model_state_bytes_per_rank"][0] == expected["state"], strategy
        assert {k: v["bytes"] for k, v in record["metrics"]["comm_per_step"].items()} == expected["comm"], strategy
        args = SimpleNamespace(hsdp_shard_size=2, mixed_precision="fp32", wrap=record["config"]["wrap"],
                               optimizer=optimizer)
        predicted = transformer.predicted_bytes(cfg, strategy, args, record["world_size"])
        assert predicted == record["predicted"], strategy
        assert str(predicted["comm_bytes"]) == str(record["predicted"]["comm_bytes"]), strategy  # as printed


def hsdp_bus_bytes(comm: dict, shard: int, replicas: int) -> dict:
    """Bus bytes of an HSDP (replicas x shard) step per collective, from its payloads: all-gather and
    reduce-scatter run inside a shard group ((n-1)/n, n = shard), the all-reduce across the replicas
    (2(n-1)/n, n = replicas): the nccl-tests factors, written out here."""
    group = {"all_gather": shard, "reduce_scatter": shard, "all_reduce": replicas}
    factor = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_reduce": lambda n: 2 * (n - 1) / n}
    return {c: v["bytes"] * factor[c](group[c]) for c, v in comm.items()}


def check_hsdp_row(record: dict, shard: int = 2, replicas: int = 2) -> None:
    """The HSDP row's mesh and bus bytes (per collective and the row's total), recomputed here; the
    bus bytes' message starts with ``bus bytes:``, so a control can show it broke them."""
    assert record["predicted"]["shard_group_size"] == shard and record["predicted"]["replicas"] == replicas
    comm = record["metrics"]["comm_per_step"]
    expected = hsdp_bus_bytes(comm, shard, replicas)
    assert {c: v["bus_bytes"] for c, v in comm.items()} == pytest.approx(expected, abs=0.5), \
        f"bus bytes: recorded {comm}, each collective in its own group {expected}"


def test_committed_hsdp_row_is_recomputed():
    """The committed 2x2 HSDP row: its mesh (2 replicas x shard 2) and its bus bytes from its payloads
    with each collective's own group. Control: the same payloads with world-group factors (every
    collective over all 4 ranks, the bug of reducing over the default group) fail the same check."""
    (record,) = [r for r in read_records(CHAPTER / "records" / "fsdp_strategies.jsonl")
                 if r["strategy"] == RECORD["hybrid_shard"]]
    check_hsdp_row(record)
    world = hsdp_bus_bytes(record["metrics"]["comm_per_step"], 4, 4)
    wrong = {**record, "metrics": {**record["metrics"], "comm_per_step": {
        c: {**v, "bus_bytes": world[c]} for c, v in record["metrics"]["comm_per_step"].items()}}}
    with pytest.raises(AssertionError, match="^bus bytes: "):
        check_hsdp_row(wrong)


def table_row(text: str, strategy: str) -> dict:
    """One row of the one markdown strategies table in text, as {column header: cell}."""
    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]
    (header,) = [line for line in text.splitlines() if line.startswith("| strategy |")]
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {strategy} |")]
    return dict(zip(cells(header), cells(row), strict=True))


def median(values: list) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def check_hsdp_table_cells(row: dict, hsdp: dict, ddp: dict, shard: int = 2, replicas: int = 2) -> None:
    """The HSDP row's peak memory, step ms and bus-vs-DDP cells, recomputed from the records' per-rank
    and per-step fields and compared at the precision the table prints (half a unit of its last
    digit), so a cell drawn from the wrong rank, the wrong statistic or the wrong row fails. Each
    message starts with its column, so a control can show which cell it broke."""
    m = hsdp["metrics"]
    (peak_header,) = [h for h in row if h.startswith("peak ")]
    peak_cell = row[peak_header]
    # the largest rank's peak: that is what a host must hold for every rank
    peak_mib = max(m["peak_memory_bytes_per_rank"]) / 2**20
    assert re.fullmatch(r"[\d,]+", peak_cell) and abs(float(peak_cell.replace(",", "")) - peak_mib) <= 0.5, \
        f"peak: cell {peak_cell} vs {peak_mib:.3f} MiB"

    # a step ends when its slowest rank does: the largest of the ranks' medians over their timed steps
    times = m["step_times_s_per_rank"]
    assert len(times) == hsdp["world_size"] and all(len(t) == m["timed_steps"] for t in times)
    step_ms = max(median(t) for t in times) * 1e3
    step_cell = row["step ms"]
    assert re.fullmatch(r"[\d,]+", step_cell) and abs(float(step_cell.replace(",", "")) - step_ms) <= 0.5, \
        f"step ms: cell {step_cell} vs {step_ms:.3f} ms"

    # bytes on the wire from the payloads, not from the harness's bus_bytes: HSDP's per group
    # (hsdp_bus_bytes), DDP's one all-reduce over the whole world at 2(n-1)/n
    hsdp_bus = sum(hsdp_bus_bytes(m["comm_per_step"], shard, replicas).values())
    ddp_comm, world = ddp["metrics"]["comm_per_step"], ddp["world_size"]
    assert set(ddp_comm) == {"all_reduce"}, ddp_comm
    ratio = hsdp_bus / (ddp_comm["all_reduce"]["bytes"] * 2 * (world - 1) / world)
    bus_cell = row["bus vs DDP"]
    assert re.fullmatch(r"\d+\.\d\dx", bus_cell) and abs(float(bus_cell[:-1]) - ratio) <= 0.005 + 1e-9, \
        f"bus vs DDP: cell {bus_cell} vs {ratio:.4f}"


def test_committed_hsdp_row_peak_step_and_bus_vs_ddp_are_recomputed():
    """The README table's HSDP row: its peak memory (largest rank's, MiB), step ms (slowest rank's
    median) and bus vs DDP (bytes on the wire from both records' payloads), recomputed from the
    committed record. Controls, one per cell, each failing the same check: the record with rank 3's
    peak 4 MiB higher; with rank 0's steps 10 ms slower; the row showing the DDP row's own ratio."""
    records = {r["strategy"]: r for r in read_records(CHAPTER / "records" / "fsdp_strategies.jsonl")}
    hsdp, ddp = records[RECORD["hybrid_shard"]], records[RECORD["ddp"]]
    readme = README.read_text()
    row = table_row(readme, RECORD["hybrid_shard"])
    check_hsdp_table_cells(row, hsdp, ddp)

    metrics = hsdp["metrics"]
    peaks = list(metrics["peak_memory_bytes_per_rank"])
    peaks[3] += 4 * 2**20
    higher_peak = {**hsdp, "metrics": {**metrics, "peak_memory_bytes_per_rank": peaks}}
    with pytest.raises(AssertionError, match="^peak: "):
        check_hsdp_table_cells(row, higher_peak, ddp)
    slow = [[t + 0.010 for t in times] if rank == 0 else times
            for rank, times in enumerate(metrics["step_times_s_per_rank"])]
    slower_rank = {**hsdp, "metrics": {**metrics, "step_times_s_per_rank": slow}}
    with pytest.raises(AssertionError, match="^step ms: "):
        check_hsdp_table_cells(row, slower_rank, ddp)
    ddp_ratio = {**row, "bus vs DDP": table_row(readme, RECORD["ddp"])["bus vs DDP"]}
    with pytest.raises(AssertionError, match="^bus vs DDP: "):
        check_hsdp_table_cells(ddp_ratio, hsdp, ddp)


def test_table_script_prints_the_table_and_draws_the_plots(sweep, played, tmp_path, capsys):
    """The README's table command, as the play ran it right after the sweep, on the sweep's records."""
    _, records_file, _ = sweep
    run, result = played.ok(TABLE), played.completed(TABLE)
    assert flag_path(run, "--results") == records_file
    plots = flag_path(run, "--plots-dir")
    assert "| fsdp_full_shard |" in result.stdout and "| ddp |" in result.stdout
    assert "| peak memory MiB (max rank, MemTracker) |" in result.stdout  # CPU records: MemTracker's peak
    assert "Measured on " in result.stdout  # the caption says where it ran
    assert "`tiny` GPT (" not in result.stdout  # vocab 65 is no preset: the caption names the shape
    assert "GPT (vocab_size 65, seq_len 32, n_layer 2" in result.stdout
    # the caption names the optimizer the sweep trained (plain SGD); control: the same records
    # without config's `optimizer`, as written before --optimizer existed, are captioned AdamW
    table_script = load_script(CHAPTER / "make_strategies_table.py")
    assert ", fp32, SGD, block-wise wrapping, " in result.stdout
    swept = {r["strategy"]: r for r in read_records(records_file)}
    older = [{**r, "config": {k: v for k, v in r["config"].items() if k != "optimizer"}} for r in swept.values()]
    assert ", fp32, AdamW, block-wise wrapping, " in table_script.caption(older)
    assert (plots / "strategies_memory.png").stat().st_size > 0
    assert (plots / "strategies_comm.png").stat().st_size > 0

    # the printed HSDP row's peak, step ms and bus vs DDP, recomputed from this run's records;
    # control: the record with one rank's peak 4 MiB higher fails the same check
    hsdp, ddp = swept[RECORD["hybrid_shard"]], swept[RECORD["ddp"]]
    row = table_row(result.stdout, RECORD["hybrid_shard"])
    check_hsdp_table_cells(row, hsdp, ddp)
    peaks = list(hsdp["metrics"]["peak_memory_bytes_per_rank"])
    peaks[3] += 4 * 2**20
    with pytest.raises(AssertionError, match="^peak: "):
        check_hsdp_table_cells(row, {**hsdp, "metrics": {**hsdp["metrics"], "peak_memory_bytes_per_rank": peaks}}, ddp)

    # A results file that also holds a later run of another kind (here: the same records marked as
    # a 2-strategy GPU run, as a GPU host writes them) gives a table of that run alone, its peak
    # labelled as the GPU allocator's figure, never "peak RSS" and never mixed with the CPU rows.
    # (The script's main, in this process: the README command itself ran above.)
    mixed = tmp_path / "mixed.jsonl"
    lines = records_file.read_text().splitlines()
    gpu_like = []
    for line in lines:
        record = json.loads(line)
        if record["strategy"] in ("fsdp_full_shard", "ddp"):
            record.update(device="cuda", backend="nccl")
            record["metrics"]["peak_memory_kind"] = "cuda_max_allocated"
            gpu_like.append(json.dumps(record))
    mixed.write_text("\n".join(lines + gpu_like) + "\n")
    table_script.main(["--results", str(mixed), "--plots-dir", str(tmp_path / "plots")])
    text = capsys.readouterr().out
    assert "| peak GPU memory allocated MiB (max rank) |" in text and "peak RSS" not in text
    assert "| fsdp_full_shard |" in text and "| ddp |" in text and "| fsdp_no_shard |" not in text


# ------------------------------------------------------------------------------------- the knobs

@pytest.fixture(scope="module")
def knobs(played):
    """The README's two knob commands (4 ranks, as the negative controls), as the play ran them:
    {name: folder} (the records in r.jsonl, the weights as {strategy}.pt)."""
    folders = {}
    for name, lookup in (("offload", OFFLOAD), ("bf16", BF16)):
        folders[name] = played.ok(lookup)["out"]
    return folders


def test_knobs_keep_training_equal(knobs):
    """Root-only wrapping + activation checkpointing + CPU offload change memory, not the maths
    (fp32 tolerance); bf16 mixed precision by its error relative to the training movement. Both plain
    SGD, as the sweep (ch02_common.PLAY).

    Bugs caught (test_ch02_negative.py, mutants of the script run with these flags): gradients summed
    instead of averaged, under offload (FP32_ATOL, over 1,000x) and under bf16 (BF16_RELATIVE, 22x)."""
    initial, reference = reference_state(STEPS, optimizer="sgd")
    saved = sorted(knobs["offload"].glob("*.pt"))
    assert [p.name for p in saved] == ["full_shard.pt"]
    check_like_one_process(torch.load(saved[0], weights_only=True), reference, "root wrap + AC + CPU offload")
    record = read_records(knobs["offload"] / "r.jsonl")[0]
    assert record["config"]["activation_checkpointing"] and record["config"]["cpu_offload"]
    assert record["config"]["wrap"] == "root"
    # one unit for the whole model: it is the root, so gathered once per step
    assert record["metrics"]["comm_per_step"]["all_gather"]["calls"] == 1
    # the script's prediction models the single unit too (distkit.theory, wrap="root")
    assert record["predicted"]["comm_bytes"] == {k: v["bytes"] for k, v in record["metrics"]["comm_per_step"].items()}

    trained = torch.load(knobs["bf16"] / "full_shard.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in trained.values())  # fp32 master weights are kept
    check_bf16_like_one_process(trained, reference, initial, "bf16")
    record = read_records(knobs["bf16"] / "r.jsonl")[0]
    assert record["config"]["optimizer"] == "sgd" and record["config"]["precision"] == "bf16"
    # parameters are gathered in bf16 (half the bytes), gradients reduced in fp32
    expected = expected_bytes("full_shard", world=4, shard_size=2, gather_bytes=2)["comm"]
    for collective, value in expected.items():
        assert record["metrics"]["comm_per_step"][collective]["bytes"] == pytest.approx(value, rel=0.01)
    assert record["predicted"]["comm_bytes"] == expected


# ------------------------------------------------------------------------------------ checkpoints

@pytest.fixture(scope="module")
def checkpoints(played):
    """The README's three checkpoint commands as the play ran them, in order, in the README's folder
    (ch02_common.PLAY): save both formats on 4 ranks at step 3; resume the newest (the DCP folder) on
    2 ranks and train to 6, writing only the full file; resume that full file on 2 ranks, writing
    nothing. The DCP folder therefore still holds the 4-rank save of step 3."""
    save, latest, full = played.ok(SAVE), played.ok(RESUME_LATEST), played.ok(RESUME_FULL)
    return SimpleNamespace(ckpt=played.clone / "checkpoints" / "fsdp", save=save["stdout"],
                           resumed=latest["stdout"], loaded=latest["out"] / "loaded.pt",
                           from_full=full["stdout"], loaded_full=full["out"] / "loaded_full.pt")


def test_dcp_checkpoint_saved_by_4_ranks_resumes_on_2(checkpoints):
    """Loaded == saved exactly (a misplaced row or a missing key changes bits); continued training
    within FP32_ATOL of uninterrupted training (AdamW, the checkpoint script's optimizer). Bugs caught
    by the latter (test_ch02_negative.py, mutants of fsdp_checkpoint.py's load_dcp resumed with the
    played flags): the Adam moments not restored, its step count reset (each over 20x)."""
    ckpt = checkpoints.ckpt
    assert "full checkpoint (rank 0 only): checkpoints/fsdp/full.pt" in checkpoints.save
    assert "sharded DCP checkpoint: checkpoints/fsdp/dcp | 6 files" in checkpoints.save
    assert len(list((ckpt / "dcp").glob("*.distcp"))) == 4  # one shard file per rank
    meta = json.loads((ckpt / "dcp" / "trainer_state.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 4
    _, reference = reference_state(6)
    saved = dcp_weights(ckpt / "dcp", reference)  # read here, in one process
    assert max_diff(saved, reference_state(3)[1]) <= FP32_ATOL

    # --resume latest took the DCP folder (written after the full file by a `both` save)
    assert "resumed from dcp checkpoint checkpoints/fsdp/dcp at step 3 (saved by 4 ranks) into 2 ranks" \
        in checkpoints.resumed
    assert max_diff(torch.load(checkpoints.loaded, weights_only=True), saved) == 0.0  # resharded 4 -> 2, bit for bit

    # Training continued from step 3 to 6 on 2 ranks equals 6 uninterrupted single-process steps:
    # proves the optimizer state (Adam moments, step count) was restored too, not only weights.
    final = torch.load(ckpt / "full.pt", weights_only=True)
    assert final["step"] == 6
    check_like_one_process(final["model"], reference, "training resumed on 2 ranks", optimizer="AdamW")
    assert "sharded DCP checkpoint" not in checkpoints.resumed  # --checkpoint-format full

    # The same from the one-file checkpoint (rank 0 reads, broadcast and shard to 2 ranks).
    assert "resumed from full checkpoint checkpoints/fsdp/full.pt at step 6 into 2 ranks" in checkpoints.from_full
    assert max_diff(torch.load(checkpoints.loaded_full, weights_only=True), final["model"]) == 0.0
    assert "checkpoint (rank 0 only)" not in checkpoints.from_full  # --checkpoint-format none
    assert torch.load(ckpt / "full.pt", weights_only=True)["step"] == 6


def test_resume_latest_takes_the_newer_checkpoint(tmp_path):
    """--resume latest / PATH, resolved without launching anything: the newer of DIR/dcp and
    DIR/full.pt (DCP on a tie), a folder is DCP and a file a full checkpoint, nothing is one error."""
    resolve = load_script(CHAPTER / "fsdp_checkpoint.py").resolve_resume
    folder = tmp_path / "ck"
    with pytest.raises(UsageError, match=f"--resume latest: no checkpoint in {folder}"):
        resolve("latest", str(folder))
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "trainer_state.json").write_text("{}")
    (folder / "full.pt").write_bytes(b"x")
    os.utime(folder / "full.pt", (1000, 1000))
    os.utime(folder / "dcp" / "trainer_state.json", (2000, 2000))
    assert resolve("latest", str(folder)) == ("dcp", str(folder / "dcp"))
    os.utime(folder / "full.pt", (3000, 3000))  # a later --checkpoint-format full run
    assert resolve("latest", str(folder)) == ("full", str(folder / "full.pt"))
    os.utime(folder / "full.pt", (2000, 2000))
    assert resolve("latest", str(folder)) == ("dcp", str(folder / "dcp"))  # a tie: DCP
    (folder / "dcp" / "trainer_state.json").unlink()  # an incomplete folder is no candidate
    assert resolve("latest", str(folder)) == ("full", str(folder / "full.pt"))
    assert resolve(str(folder / "dcp"), "elsewhere") == ("dcp", str(folder / "dcp"))
    assert resolve(str(folder / "full.pt"), "elsewhere") == ("full", str(folder / "full.pt"))
    assert resolve("none", str(folder)) is None
    with pytest.raises(UsageError, match="no such checkpoint"):
        resolve(str(tmp_path / "missing.pt"), str(folder))
    with pytest.raises(UsageError, match=r"no complete DCP checkpoint in .*trainer_state.json is missing"):
        load_script(CHAPTER / "fsdp_checkpoint.py").read_trainer_state(str(folder / "dcp"), gpt_config("tiny"))


def dead_pid() -> int:
    """The PID of a process that has just exited (a writer killed mid-save)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def torchrun_argv(script: str, *args, nproc: int = 2) -> list:
    return [*launcher_argv("fork"), "--standalone", f"--nproc_per_node={nproc}", CHAPTER / script, *args]


@pytest.fixture(scope="module")
def failures(checkpoints, tmp_path_factory):
    """Every launch that must end in one error line, two at a time: bad input, a missing checkpoint,
    a 0-byte full checkpoint beside stale temporaries (2 ranks), a full checkpoint of another model,
    and copies of the 4-rank DCP save made foreign or damaged (2 ranks, and 1)."""
    tmp = tmp_path_factory.mktemp("ch02_failures")
    # a world of one, started as `python script` starts it (forked by the fork server: --python)
    ckpt_script, python = CHAPTER / "fsdp_checkpoint.py", [*launcher_argv("fork"), "--python"]

    other_model = tmp / "other.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "optim": {}, "step": 1}, other_model)

    folder = tmp / "empty"  # a 0-byte full.pt, a dead writer's temporary and a live writer's
    folder.mkdir()
    (folder / "full.pt").touch()
    host = socket.gethostname()
    stale = folder / f"full.pt.tmp.{host}.{dead_pid()}.abc123"
    live = folder / f"full.pt.tmp.{host}.{os.getpid()}.def456"  # this test process is alive
    stale.write_bytes(b"torn")
    live.write_bytes(b"being written")

    copies = {}
    for name in ("named", "unnamed", "damaged"):
        copies[name] = tmp / name / "dcp"
        shutil.copytree(checkpoints.ckpt / "dcp", copies[name])
    meta_path = copies["unnamed"] / "trainer_state.json"
    meta = json.loads(meta_path.read_text())
    del meta["model"]  # as saves from before trainer_state.json named the model
    meta_path.write_text(json.dumps(meta))
    (copies["damaged"] / "trainer_state.json").write_text("{not json")

    no_save = ("--checkpoint-format", "none", "--checkpoint-dir", tmp / "unused", *TINY)
    jobs = {
        "hybrid_world_1": [*python, CHAPTER / "fsdp_transformer.py", "--sharding", "hybrid_shard", *TINY,
                           "--steps", "1", "--results", tmp / "r.jsonl"],
        "no_checkpoint": [*python, ckpt_script, "--resume", "latest", *TINY, "--checkpoint-dir", tmp / "nothing"],
        "other_model_full": [*python, ckpt_script, "--resume", other_model, *no_save],
        "empty_full": torchrun_argv("fsdp_checkpoint.py", "--resume", folder / "full.pt", "--checkpoint-dir",
                                    folder, "--checkpoint-format", "none", *TINY),
        # the saved model has 2 blocks; a 3-block model asks DCP for keys it does not have (DCP itself
        # loads a *larger* model's folder into a smaller one without complaint)
        "named_dcp": torchrun_argv("fsdp_checkpoint.py", "--resume", copies["named"], *no_save, "--n-layer", "3"),
        "unnamed_dcp": torchrun_argv("fsdp_checkpoint.py", "--resume", copies["unnamed"], *no_save, "--n-layer", "3"),
        "damaged_dcp": [*python, ckpt_script, "--resume", copies["damaged"], *no_save],
    }
    results = run_all(jobs, tmp)
    return SimpleNamespace(results=results, stale=stale, live=live, empty=folder / "full.pt", copies=copies)


def test_bad_input_gives_one_error_line(failures):
    results = failures.results
    # a world of one cannot be split into shard groups of 2
    assert_one_line_error(results["hybrid_world_1"], "--hsdp-shard-size 2 does not divide the world size 1")
    assert_one_line_error(results["no_checkpoint"], "--resume latest: no checkpoint in")
    assert_one_line_error(results["other_model_full"], "is from a different model")


def test_bad_full_checkpoint_is_one_line_and_stale_temporaries_go(failures):
    """2 ranks: rank 0 finds the 0-byte file and tells rank 1 (no hang); stale temporaries of a dead
    writer are removed at start, a live writer's are kept."""
    result = failures.results["empty_full"]
    assert_one_line_error(result, f"checkpoint {failures.empty} is empty (0 bytes)")
    assert not failures.stale.exists() and failures.live.exists()
    assert f"removed 1 temporary file(s) left by an interrupted save: {failures.stale.name}" in result.stdout


def test_dcp_checkpoint_of_another_model_is_one_line(checkpoints, failures):
    """A DCP folder saved by another model: named from trainer_state.json when it records the model
    (rank 0 checks it before any model is built, and tells rank 1); when it does not (older saves),
    DCP's CheckpointException (a BaseException, raised on every rank) still becomes one line on 2
    ranks; a damaged trainer_state.json too."""
    meta = json.loads((checkpoints.ckpt / "dcp" / "trainer_state.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 4 and meta["model"]["n_layer"] == 2
    assert not list(checkpoints.ckpt.glob("*.tmp*")) and not list(checkpoints.ckpt.glob("dcp.*"))  # no leftovers
    results, copies = failures.results, failures.copies
    assert_one_line_error(results["named_dcp"],
                          f"DCP checkpoint {copies['named']} is from a different model (n_layer 2 there, 3 here)")
    assert_one_line_error(results["unnamed_dcp"], "does not fit this model or is damaged")
    assert_one_line_error(results["damaged_dcp"], "trainer_state.json is unreadable (JSONDecodeError")


# --------------------------------------------------------------------------------------- basics

def test_basics_shows_shards_and_the_step_trace(played):
    """The README command (tiny GPT, 4 ranks, 4 steps; as the play ran it): the shards, the traced
    step, and the trained weights (--save) equal single-process training within FP32_ATOL (measured
    1.0e-5)."""
    run, result = played.ok(BASICS), played.completed(BASICS)
    tmp_path = run["out"]
    for rank in range(4):
        assert f"[rank {rank}] blocks.0.attn.q_proj.weight  full (64, 64)   -> my shard (16, 64)" in result.stdout
    assert "tok_emb.weight               full (65, 64)   -> my shard (17, 64)" in result.stdout  # padded
    assert "block 0 forward starts:  q_proj.weight is full Tensor (64, 64)" in result.stdout
    assert "block 0 forward ends:    q_proj.weight is DTensor shard (16, 64) of (64, 64)" in result.stdout
    assert result.stdout.count("backward  _reduce_scatter_base_") == 3  # 2 blocks + root
    # each traced collective is named by its unit, from distkit.theory's padded sizes
    assert result.stdout.count("<- a block's unit") == 6 and result.stdout.count("<- root unit") == 2
    record = read_records(tmp_path / "b.jsonl")[0]
    assert record["strategy"] == "fsdp_full_shard" and record["model"]["vocab_size"] == 65
    assert not {"model_size", "gpt", "param_count"} & set(record["config"])
    _, reference = reference_state(4)
    assert max_diff(torch.load(tmp_path / "basics.pt", weights_only=True), reference) <= FP32_ATOL


# every rank trains on rank 0's share of each global batch: the job sees a quarter of the data
BASICS_SAME_BATCH = ("rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device),\n"
                     "                rank_slice(targets, ctx.rank, ctx.world_size)",
                     "rank_slice(inputs, 0, ctx.world_size).to(ctx.device),\n"
                     "                rank_slice(targets, 0, ctx.world_size)")


def test_basics_shards_and_trains_the_llama_like_one_process(tmp_path):
    """--arch llama (tiny, vocab 65, 4 ranks, 4 AdamW steps): the lesson names the Llama's own
    parameters and FSDP units, and the trained weights equal single-process training within
    FP32_ATOL (2e-4; measured 1.9e-6). Bug it must catch, the negative control run beside it (the
    script's source with every rank training on rank 0's share of the batch, tests/workers/
    ch05_mutant.py): it lands 2.4e-2 away (measured; 118x FP32_ATOL)."""
    flags = [*TINY, "--arch", "llama", "--steps", "4", "--log-every", "1"]
    correct = readme_argv(BASICS, *flags, "--results", tmp_path / "l.jsonl", "--save", tmp_path / "llama.pt")
    mutant = readme_argv(BASICS, *flags, "--results", tmp_path / "m.jsonl", "--save", tmp_path / "mutant.pt")
    script = next(i for i, a in enumerate(mutant) if a.endswith("fsdp_basics.py"))
    mutant[script:script + 1] = [str(WORKERS / "ch05_mutant.py"), str(CHAPTER / "fsdp_basics.py"),
                                 *BASICS_SAME_BATCH, "--"]
    results = run_all({"correct": correct, "same_batch": mutant}, tmp_path, parallel=2, timeout=600)
    out = check_ok(results["correct"])
    check_ok(results["same_batch"])
    for rank in range(4):
        assert (f"[rank {rank}] model.layers.0.self_attn.q_proj.weight full (64, 64)   -> my shard (16, 64)"
                in out), out[-3000:]
    assert "model.embed_tokens.weight              full (65, 64)   -> my shard (17, 64)" in out  # padded
    assert "block 0 forward ends:    q_proj.weight is DTensor shard (16, 64) of (64, 64)" in out
    assert out.count("backward  _reduce_scatter_base_") == 3  # 2 decoder layers + root
    assert out.count("<- a block's unit") == 6 and out.count("<- root unit (embed_tokens, norm, lm_head)") == 2
    (record,) = read_records(tmp_path / "l.jsonl")
    assert record["model"]["arch"] == "llama" and record["model"]["vocab_size"] == 65

    initial, reference = reference_state(4, arch="llama")
    trained = torch.load(tmp_path / "llama.pt", weights_only=True)
    assert "model.layers.0.self_attn.q_proj.weight" in trained
    assert max_diff(initial, reference) > 50 * FP32_ATOL  # training moved the weights
    assert max_diff(trained, reference) <= FP32_ATOL
    broken = max_diff(torch.load(tmp_path / "mutant.pt", weights_only=True), reference)
    print(f"fsdp_basics --arch llama: every rank on rank 0's share lands {broken:.2e} away")
    assert broken > 20 * FP32_ATOL, broken


# ------------------------------------------------------------------------------ flags, in-process

@pytest.mark.parametrize("script,argv,expected", [
    ("fsdp_basics", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("fsdp_basics", ["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer"),
    ("fsdp_basics", ["--global-batch-size", "-8"], "argument --global-batch-size: must be a positive integer"),
    ("fsdp_basics", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    ("fsdp_basics", ["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    ("fsdp_basics", ["--lr", "nan"], "argument --lr: must be a positive number"),
    ("fsdp_basics", ["--warmup-steps", "-1"], "argument --warmup-steps: must be an integer >= 0"),
    ("fsdp_basics", ["--n-head", "0"], "argument --n-head: must be a positive integer, got 0"),
    ("fsdp_transformer", ["--sharding", "zero9"], "argument --sharding: invalid choice: 'zero9'"),
    ("fsdp_transformer", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("fsdp_transformer", ["--global-batch-size", "-1"], "argument --global-batch-size: must be a positive"),
    ("fsdp_transformer", ["--hsdp-shard-size", "0"], "argument --hsdp-shard-size: must be a positive integer"),
    ("fsdp_transformer", ["--optimizer", "adam"], "argument --optimizer: invalid choice: 'adam'"),
    ("fsdp_transformer", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    ("fsdp_transformer", ["--lr", "0"], "argument --lr: must be a positive number, got 0"),
    ("fsdp_transformer", ["--warmup-steps", "x"], "argument --warmup-steps: must be an integer >= 0, got 'x'"),
    ("fsdp_transformer", ["--n-embd", "-64"], "argument --n-embd: must be a positive integer, got -64"),
    ("fsdp_transformer", ["--sharding", "full_shard", "ddp", "--save", "x.pt"],
     "--save x.pt names one file for 2 strategies; put {strategy} in it"),
    ("fsdp_checkpoint", ["--steps", "-1"], "argument --steps: must be an integer >= 0, got -1"),
    ("fsdp_checkpoint", ["--global-batch-size", "0"], "argument --global-batch-size: must be a positive"),
    ("fsdp_checkpoint", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    ("fsdp_checkpoint", ["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    ("fsdp_checkpoint", ["--vocab-size", "0"], "argument --vocab-size: must be a positive integer, got 0"),
    ("fsdp_checkpoint", ["--checkpoint-format", "dcp2"], "argument --checkpoint-format: invalid choice"),
])
def test_numeric_flags_are_range_checked_where_defined(script, argv, expected, capsys, monkeypatch):
    """Each bad flag is rejected by argparse (exit 2, one error line), before any process group."""
    monkeypatch.delenv("RANK", raising=False)  # rank 0 is the one that prints
    with pytest.raises(SystemExit) as exit_info:
        load_script(CHAPTER / f"{script}.py").parse_args(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], errors


def test_flag_values_checked_after_parsing():
    """What only the combination can tell, raised as the UsageError run_main prints as one line."""
    with pytest.raises(UsageError, match="divisible by the head count 3"):
        load_script(CHAPTER / "fsdp_basics.py").parse_args(["--n-head", "3"])
    with pytest.raises(UsageError, match=r"--save 'x\{foo\}.pt': unknown placeholder 'foo' \(known: \{strategy\}\)"):
        load_script(CHAPTER / "fsdp_transformer.py").parse_args(["--save", "x{foo}.pt"])


def test_flag_ranges_keep_valid_values():
    args = load_script(CHAPTER / "fsdp_checkpoint.py").parse_args(["--steps", "0"])
    assert args.steps == 0 and args.resume == "none" and args.checkpoint_format == "both"  # saves step 0
    args = load_script(CHAPTER / "fsdp_basics.py").parse_args(["--warmup-steps", "0", "--lr", "1e-4"])
    assert args.warmup_steps == 0 and args.lr == 1e-4
    transformer = load_script(CHAPTER / "fsdp_transformer.py")
    args = transformer.parse_args(["--sharding", "full_shard", "ddp", "--save", "out/{strategy}.pt"])
    assert [transformer.save_file(args, s) for s in args.sharding] == ["out/full_shard.pt", "out/ddp.pt"]
    assert transformer.save_file(transformer.parse_args([]), "full_shard") is None  # default: none


def test_every_readme_command_is_run_by_a_test():
    """Each lookup in ch02_common.LOOKUPS is run by a test above; together they cover the README."""
    assert_readme_covered(README, LOOKUPS)
