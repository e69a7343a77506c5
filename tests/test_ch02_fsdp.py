"""Chapter 02 (FSDP): every strategy trains the same model as one process, the measured bytes match
the sharding formulas, DCP checkpoints reshard from 4 ranks to 2, and the README's commands run.

Tolerances (fp32, AdamW lr 3e-3, a handful of steps): a parameter may differ from single-process
training by at most FP32_ATOL = 2e-4 (about 7% of one Adam step; what remains is summation order,
amplified by Adam where a gradient is near zero: DDP itself lands at 4e-5). bf16 mixed precision
cannot be judged by a max-abs bound: its largest difference from the fp32 reference (1.1e-2) is as
large as what 4 training steps move the weights (1.2e-2), so untrained weights would pass. It is
judged by the L2 error as a fraction of the L2 movement (untrained weights score 1) under
BF16_RELATIVE = 0.15: measured 5.2e-2 for correct bf16 and 0.75 with one rank's gradient shard
dropped. test_ch02_negative.py proves both tolerances fail for those bugs (and for gradients summed
instead of averaged, HSDP without its replica all-reduce, a DCP resume without the Adam state or its
step count) with the scripts' own sharding and checkpoint code. Byte counts are compared exactly:
the dim-0 padding (vocab 65 on 4 ranks) changes them by less than 0.2%, so a relative tolerance of
even 1% would hide a formula that forgets it (test_measured_bytes_match_the_formulas shows that).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import (REPO, assert_one_line_error, command_argv, job_env, python, readme_commands, run,
                    torchrun)

from distkit.harness import read_records
from distkit.models import TinyGPT, gpt_config
from workers.reference import train_one_process

CHAPTER = REPO / "02-fsdp"
README = CHAPTER / "README.md"
FP32_ATOL = 2e-4
BF16_RELATIVE = 0.15
LR = 3e-3
# vocab 65 is not a multiple of 2 or 4: tok_emb and lm_head get padded rows, so the byte checks
# prove the padding is modelled.
TINY = ("--model-size", "tiny", "--vocab-size", "65", "--global-batch-size", "8")


def readme_command(fragment: str) -> str:
    """The one README command that contains ``fragment``."""
    found = [c for c in readme_commands(README) if fragment in c]
    assert len(found) == 1, f"expected one README command with {fragment!r}, got {found}"
    return found[0]


def run_readme(command: str, tmp_path: Path, *extra: str, timeout: float = 300):
    """Run a README command as written, plus ``extra`` flags (argparse keeps the last value).

    ``torchrun`` becomes ``python -m torch.distributed.run --standalone`` (a free port per test);
    ``python`` becomes this interpreter.
    """
    return run([*command_argv(command), *extra], timeout=timeout, env=job_env(tmp_path))


@functools.lru_cache(maxsize=None)  # several tests compare against the same run; nobody mutates it
def reference_state(steps: int, batch: int = 8, vocab: int = 65) -> tuple[dict, dict]:
    """Single-process AdamW training on the same global batches: (initial, final) state dicts."""
    cfg = gpt_config("tiny", vocab_size=vocab)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    return train_one_process(model, torch.optim.AdamW(model.parameters(), lr=LR), steps, batch)


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def relative_error(state: dict, expected: dict, initial: dict) -> float:
    """L2 |state - expected| / L2 |expected - initial| over all weights: the error as a fraction of
    what training moved (untrained weights score exactly 1)."""
    err = sum(((state[k].float() - expected[k].float()) ** 2).sum().item() for k in expected)
    moved = sum(((expected[k].float() - initial[k].float()) ** 2).sum().item() for k in expected)
    return (err / moved) ** 0.5


def expected_bytes(strategy: str, world: int, shard_size: int, gather_bytes: int = 4, cfg=None,
                   pad: bool = True, block_gathers: int | None = None) -> dict:
    """Textbook FSDP traffic and state per rank for the tiny GPT, written independently of the script.

    Units: one per block, then the root (the rest). Each parameter's dim 0 is padded to a multiple of
    the shard-group size s. All-gather payload = padded unit size, twice per block unit when resharded
    after forward (forward + backward), once for the root (never resharded) and for SHARD_GRAD_OP.
    Reduce-scatter payload = all padded gradients. All-reduce = the shard across replicas (P/s),
    issued by DDP and by every 2D (replicate, shard) mesh even when a group is one rank (world 1).
    ``cfg`` (default: the tests' tiny GPT, vocab 65) is the model; ``pad=False`` and ``block_gathers``
    give the deliberately wrong formulas of the negative control.
    """
    model = TinyGPT(cfg or gpt_config("tiny", vocab_size=65))
    s = {"full_shard": world, "shard_grad_op": world, "hybrid_shard": shard_size}.get(strategy, 1)

    def padded(params):
        rows = (lambda d0: math.ceil(d0 / s) * s) if pad else (lambda d0: d0)
        return sum(rows(p.shape[0]) * p[0].numel() for p in params)

    blocks = padded(model.blocks.parameters())
    root = padded(p for n, p in model.named_parameters() if not n.startswith("blocks."))
    every = blocks + root
    comm = {}
    if s > 1:
        gathers = 2 if strategy in ("full_shard", "hybrid_shard") else 1
        gathers = gathers if block_gathers is None else block_gathers
        comm["all_gather"] = (gathers * blocks + root) * gather_bytes
        comm["reduce_scatter"] = every * 4
    if strategy in ("ddp", "no_shard", "hybrid_shard"):
        comm["all_reduce"] = every // s * 4
    state = every // s * 4
    return {"comm": comm, "state": {"params": state, "grads": state, "optimizer": 2 * state}}


def shard_bytes(strategy: str, rank: int, world: int, shard_size: int) -> int:
    """Parameter bytes rank ``rank`` holds: its torch.chunk piece of dim 0 of every parameter
    (chunks of ceil(d0/s) rows; the last ranks get fewer rows or none, the padding is not data)."""
    s = {"full_shard": world, "shard_grad_op": world, "hybrid_shard": shard_size}.get(strategy, 1)
    index = rank % s  # meshes are (replicate, shard), row-major: rank = replica * s + index
    total = 0
    for p in TinyGPT(gpt_config("tiny", vocab_size=65)).parameters():
        rows = math.ceil(p.shape[0] / s)
        mine = max(0, min(rows, p.shape[0] - index * rows))
        total += mine * p[0].numel() * 4
    return total


STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "ddp"]
RECORD = {"full_shard": "fsdp_full_shard", "shard_grad_op": "fsdp_shard_grad_op",
          "no_shard": "fsdp_no_shard", "hybrid_shard": "fsdp_hybrid_shard", "ddp": "ddp"}
STEPS = 4


@pytest.fixture(scope="module")
def strategies_run(tmp_path_factory):
    """One 4-rank launch of the README's strategies command: all five strategies, 4 steps each
    (2 warm-up steps: DDP re-broadcasts its bucket layout in step 2, then the counted step 3)."""
    tmp = tmp_path_factory.mktemp("ch02_strategies")
    result = run_readme(readme_command("--sharding full_shard shard_grad_op no_shard hybrid_shard ddp"),
                        tmp, *TINY, "--steps", str(STEPS), "--log-every", "1",
                        "--results", str(tmp / "records.jsonl"), "--save-params", str(tmp / "params"))
    return tmp, result


def test_every_strategy_matches_single_process_training(strategies_run):
    """Bug caught (FP32_ATOL): gradients summed instead of averaged, a rank's gradient shard lost,
    HSDP replicas not all-reduced (test_ch02_negative.py: all 200x above the tolerance)."""
    tmp, _ = strategies_run
    initial, reference = reference_state(STEPS)
    moved = max_diff(initial, reference)
    assert moved > 50 * FP32_ATOL  # the check below is not vacuous: training really moved the weights
    for strategy in STRATEGIES:
        trained = torch.load(tmp / "params" / f"{strategy}.pt", weights_only=True)
        assert max_diff(trained, reference) <= FP32_ATOL, strategy


def test_measured_bytes_match_the_formulas(strategies_run):
    tmp, result = strategies_run
    records = {r["strategy"]: r for r in read_records(tmp / "records.jsonl")}
    assert set(records) == {RECORD[s] for s in STRATEGIES}
    for strategy in STRATEGIES:
        record = records[RECORD[strategy]]
        expected = expected_bytes(strategy, world=4, shard_size=2)
        measured = {k: v["bytes"] for k, v in record["metrics"]["comm_per_step"].items()}
        assert set(measured) == set(expected["comm"]), (strategy, measured)
        for collective, value in expected["comm"].items():
            assert measured[collective] == value, (strategy, collective)  # exact: whole bytes per step
        per_rank = record["metrics"]["model_state_bytes_per_rank"]
        assert per_rank[0] == expected["state"], strategy  # rank 0 holds full (padded-size) chunks
        for rank, rank_state in enumerate(per_rank):  # later ranks hold the rest, padding excluded
            assert rank_state["params"] == shard_bytes(strategy, rank, world=4, shard_size=2), (strategy, rank)
        # the script's own prediction (shown in the table) agrees with this independent formula
        assert record["predicted"]["comm_bytes"] == expected["comm"], strategy
        assert record["config"]["precision"] == "fp32"
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
            expected_bytes(strategy, world=4, shard_size=2, pad=False)["state"], strategy
    once = expected_bytes("full_shard", world=4, shard_size=2, block_gathers=1)["comm"]["all_gather"]
    assert records[RECORD["full_shard"]]["metrics"]["comm_per_step"]["all_gather"]["bytes"] != once


def test_committed_strategies_record_matches_the_formulas():
    """The committed record behind the chapter's table and plots (a 4-rank `small` GPT run): its
    measured model state and bytes equal the formulas, computed here independently of the script."""
    from distkit.models import GPTConfig

    records = {r["strategy"]: r for r in read_records(CHAPTER / "records" / "fsdp_strategies.jsonl")}
    assert set(records) == {RECORD[s] for s in STRATEGIES}
    for strategy in STRATEGIES:
        record = records[RECORD[strategy]]
        assert record["world_size"] == 4 and record["config"]["precision"] == "fp32"
        expected = expected_bytes(strategy, world=4, shard_size=2, cfg=GPTConfig(**record["config"]["gpt"]))
        assert record["metrics"]["model_state_bytes_per_rank"][0] == expected["state"], strategy
        assert {k: v["bytes"] for k, v in record["metrics"]["comm_per_step"].items()} == expected["comm"], strategy


def test_knobs_keep_training_equal(tmp_path):
    """Root-only wrapping + activation checkpointing + CPU offload change memory, not the maths
    (fp32 tolerance); bf16 mixed precision by its error relative to the training movement.

    Bugs caught: under offload, gradients summed or a shard dropped (FP32_ATOL, 200x); under bf16, a
    gradient shard dropped (BF16_RELATIVE, 5x) (test_ch02_negative.py)."""
    initial, reference = reference_state(STEPS)
    out = tmp_path / "params"
    run_readme(readme_command("--activation-checkpointing --cpu-offload"), tmp_path, *TINY,
               "--steps", str(STEPS), "--results", str(tmp_path / "r.jsonl"), "--save-params", str(out))
    for path in sorted(out.glob("*.pt")):
        assert max_diff(torch.load(path, weights_only=True), reference) <= FP32_ATOL, path.name
    record = read_records(tmp_path / "r.jsonl")[0]
    assert record["config"]["activation_checkpointing"] and record["config"]["cpu_offload"]
    assert record["config"]["wrap"] == "root"
    # one unit for the whole model: it is the root, so gathered once per step
    assert record["metrics"]["comm_per_step"]["all_gather"]["calls"] == 1

    bf16 = tmp_path / "bf16"
    run_readme(readme_command("--mixed-precision bf16"), tmp_path, *TINY, "--steps", str(STEPS),
               "--results", str(tmp_path / "bf16.jsonl"), "--save-params", str(bf16))
    trained = torch.load(bf16 / "full_shard.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in trained.values())  # fp32 master weights are kept
    bf16_error = relative_error(trained, reference, initial)
    print(f"bf16 vs fp32 reference: relative error {bf16_error:.3f}, max {max_diff(trained, reference):.2e}")
    assert bf16_error <= BF16_RELATIVE
    record = read_records(tmp_path / "bf16.jsonl")[0]
    # parameters are gathered in bf16 (half the bytes), gradients reduced in fp32
    expected = expected_bytes("full_shard", world=4, shard_size=2, gather_bytes=2)["comm"]
    for collective, value in expected.items():
        assert record["metrics"]["comm_per_step"][collective]["bytes"] == pytest.approx(value, rel=0.01)


def test_dcp_checkpoint_saved_by_4_ranks_resumes_on_2(tmp_path):
    """Loaded == saved exactly (a misplaced row or a missing key changes bits); continued training
    within FP32_ATOL of uninterrupted training. Bugs caught by the latter: the Adam moments not
    restored (76x the tolerance) or its step count reset (45x) (test_ch02_negative.py)."""
    dcp_dir, full = tmp_path / "dcp", tmp_path / "full.pt"
    paths = ("--dcp-dir", str(dcp_dir), "--full-checkpoint", str(full))
    save = run_readme(readme_command("fsdp_checkpoint.py --steps 100"), tmp_path, *TINY, *paths,
                      "--steps", "3", "--log-every", "1")
    assert "sharded DCP checkpoint" in save.stdout and "full checkpoint" in save.stdout
    assert len(list(dcp_dir.glob("*.distcp"))) == 4  # one shard file per rank
    saved = torch.load(full, weights_only=True)
    assert saved["step"] == 3
    first = tmp_path / "first.pt"
    shutil.copy(full, first)  # the resumed run below overwrites full.pt

    resumed = run_readme(readme_command("--resume dcp"), tmp_path, *TINY, *paths, "--steps", "6",
                         "--log-every", "1", "--save", "full", "--dump-loaded", str(tmp_path / "loaded.pt"))
    assert "resumed from dcp checkpoint at step 3 (saved by 4 ranks) into 2 ranks" in resumed.stdout
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert max_diff(loaded, saved["model"]) == 0.0  # resharded 4 -> 2, bit for bit

    # Training continued from step 3 to 6 on 2 ranks equals 6 uninterrupted single-process steps:
    # proves the optimizer state (Adam moments, step count) was restored too, not only weights.
    _, reference = reference_state(6)
    final = torch.load(full, weights_only=True)
    assert final["step"] == 6
    assert max_diff(final["model"], reference) <= FP32_ATOL

    # The same from the one-file checkpoint (rank 0 reads, broadcast and shard to 2 ranks).
    run_readme(readme_command("--resume full"), tmp_path, *TINY, "--full-checkpoint", str(first),
               "--steps", "6", "--save", "none", "--dump-loaded", str(tmp_path / "loaded_full.pt"))
    assert max_diff(torch.load(tmp_path / "loaded_full.pt", weights_only=True), saved["model"]) == 0.0


def test_basics_shows_shards_and_the_step_trace(tmp_path):
    result = run_readme(readme_command("fsdp_basics.py"), tmp_path, *TINY, "--steps", "4",
                        "--results", str(tmp_path / "b.jsonl"))
    for rank in range(4):
        assert f"[rank {rank}] blocks.0.attn.q_proj.weight  full (64, 64)   -> my shard (16, 64)" in result.stdout
    assert "tok_emb.weight               full (65, 64)   -> my shard (17, 64)" in result.stdout  # padded
    assert "block 0 forward starts:  q_proj.weight is full Tensor (64, 64)" in result.stdout
    assert "block 0 forward ends:    q_proj.weight is DTensor shard (16, 64) of (64, 64)" in result.stdout
    assert result.stdout.count("backward  _reduce_scatter_base_") == 3  # 2 blocks + root
    assert read_records(tmp_path / "b.jsonl")[0]["strategy"] == "fsdp_full_shard"


def test_table_script_prints_the_table_and_draws_the_plots(strategies_run, tmp_path):
    records, _ = strategies_run
    plots = tmp_path / "plots"
    result = run_readme(readme_command("make_strategies_table.py"), tmp_path,
                        "--results", str(records / "records.jsonl"), "--plots-dir", str(plots))
    assert "| fsdp_full_shard |" in result.stdout and "| ddp |" in result.stdout
    assert "| peak RSS MiB (max rank) |" in result.stdout  # CPU records measured process RSS
    assert "Measured on " in result.stdout  # the caption says where it ran
    assert (plots / "strategies_memory.png").stat().st_size > 0
    assert (plots / "strategies_comm.png").stat().st_size > 0

    # A results file that also holds a later run of another kind (here: the same records marked as
    # a 2-strategy GPU run, as a GPU host writes them) gives a table of that run alone, its peak
    # labelled as the GPU allocator's figure, never "peak RSS" and never mixed with the CPU rows.
    mixed = tmp_path / "mixed.jsonl"
    lines = (records / "records.jsonl").read_text().splitlines()
    gpu_like = []
    for line in lines:
        record = json.loads(line)
        if record["strategy"] in ("fsdp_full_shard", "ddp"):
            record.update(device="cuda", backend="nccl")
            record["metrics"]["peak_memory_kind"] = "cuda_max_allocated"
            gpu_like.append(json.dumps(record))
    mixed.write_text("\n".join(lines + gpu_like) + "\n")
    result = run_readme(readme_command("make_strategies_table.py"), tmp_path, "--results", str(mixed),
                        "--plots-dir", str(plots))
    text = result.stdout
    assert "| peak GPU memory allocated MiB (max rank) |" in text and "peak RSS" not in text
    assert "| fsdp_full_shard |" in text and "| ddp |" in text and "| fsdp_no_shard |" not in text


def test_bad_input_gives_one_error_line(tmp_path):
    script = CHAPTER / "fsdp_transformer.py"
    assert_one_line_error(python(script, "--sharding", "zero9", tmp_path=tmp_path, check=False), "--sharding")
    # a world of one cannot be split into shard groups of 2
    assert_one_line_error(python(script, "--sharding", "hybrid_shard", *TINY, "--steps", "1",
                                 "--results", str(tmp_path / "r.jsonl"), tmp_path=tmp_path, check=False),
                          "--hsdp-shard-size 2 does not divide the world size 1")
    assert_one_line_error(python(CHAPTER / "fsdp_checkpoint.py", "--resume", "dcp", *TINY,
                                 "--dcp-dir", str(tmp_path / "nothing"), tmp_path=tmp_path, check=False),
                          "no complete DCP checkpoint")
    other_model = tmp_path / "other.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "optim": {}, "step": 1}, other_model)
    assert_one_line_error(python(CHAPTER / "fsdp_checkpoint.py", "--resume", "full", *TINY, "--full-checkpoint",
                                 str(other_model), "--save", "none", tmp_path=tmp_path, check=False),
                          "is from a different model")
    assert_one_line_error(python(CHAPTER / "fsdp_basics.py", "--n-head", "3", tmp_path=tmp_path, check=False),
                          "divisible by the head count 3")


def load_script(name: str):
    """Import a chapter script as a module (its parse_args is then called in this process)."""
    spec = importlib.util.spec_from_file_location(f"ch02_{name}", CHAPTER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script,argv,expected", [
    ("fsdp_basics", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("fsdp_basics", ["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer"),
    ("fsdp_basics", ["--global-batch-size", "-8"], "argument --global-batch-size: must be a positive integer"),
    ("fsdp_basics", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    ("fsdp_basics", ["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    ("fsdp_basics", ["--lr", "nan"], "argument --lr: must be a positive number"),
    ("fsdp_basics", ["--warmup-steps", "-1"], "argument --warmup-steps: must be an integer >= 0"),
    ("fsdp_basics", ["--n-head", "0"], "argument --n-head: must be a positive integer, got 0"),
    ("fsdp_transformer", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("fsdp_transformer", ["--global-batch-size", "-1"], "argument --global-batch-size: must be a positive"),
    ("fsdp_transformer", ["--hsdp-shard-size", "0"], "argument --hsdp-shard-size: must be a positive integer"),
    ("fsdp_transformer", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    ("fsdp_transformer", ["--lr", "0"], "argument --lr: must be a positive number, got 0"),
    ("fsdp_transformer", ["--warmup-steps", "x"], "argument --warmup-steps: must be an integer >= 0, got 'x'"),
    ("fsdp_transformer", ["--n-embd", "-64"], "argument --n-embd: must be a positive integer, got -64"),
    ("fsdp_checkpoint", ["--steps", "-1"], "argument --steps: must be an integer >= 0, got -1"),
    ("fsdp_checkpoint", ["--global-batch-size", "0"], "argument --global-batch-size: must be a positive"),
    ("fsdp_checkpoint", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    ("fsdp_checkpoint", ["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    ("fsdp_checkpoint", ["--vocab-size", "0"], "argument --vocab-size: must be a positive integer, got 0"),
])
def test_numeric_flags_are_range_checked_where_defined(script, argv, expected, capsys, monkeypatch):
    """Each bad number is rejected by argparse (exit 2, one error line), before any process group."""
    monkeypatch.delenv("RANK", raising=False)  # rank 0 is the one that prints
    with pytest.raises(SystemExit) as exit_info:
        load_script(script).parse_args(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], errors


def test_flag_ranges_keep_valid_values():
    assert load_script("fsdp_checkpoint").parse_args(["--steps", "0"]).steps == 0  # saves step 0
    args = load_script("fsdp_basics").parse_args(["--warmup-steps", "0", "--lr", "1e-4"])
    assert args.warmup_steps == 0 and args.lr == 1e-4


def dead_pid() -> int:
    """The PID of a process that has just exited (a writer killed mid-save)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_bad_full_checkpoint_is_one_line_and_stale_temporaries_go(tmp_path):
    """2 ranks: rank 0 finds the 0-byte file and tells rank 1 (no hang); stale temporaries of a dead
    writer are removed at start, a live writer's are kept."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    empty = folder / "full.pt"
    empty.touch()
    host = socket.gethostname()
    stale = folder / f"full.pt.tmp.{host}.{dead_pid()}.abc123"
    live = folder / f"full.pt.tmp.{host}.{os.getpid()}.def456"  # this test process is alive
    stale.write_bytes(b"torn")
    live.write_bytes(b"being written")
    result = torchrun(CHAPTER / "fsdp_checkpoint.py", "--resume", "full", "--full-checkpoint", empty,
                      "--dcp-dir", folder / "dcp", "--save", "none", *TINY, nproc=2, tmp_path=tmp_path,
                      check=False)
    assert_one_line_error(result, f"checkpoint {empty} is empty (0 bytes)")
    assert not stale.exists() and live.exists()
    assert f"removed 1 temporary file(s) left by an interrupted save: {stale.name}" in result.stdout


def test_dcp_checkpoint_of_another_model_is_one_line(tmp_path):
    """A DCP folder saved by another model: named from trainer_state.json when it records the model;
    when it does not (older saves), DCP's CheckpointException (a BaseException) still becomes one
    line on 2 ranks; a damaged trainer_state.json too. (The saved model has fewer blocks: DCP itself
    loads a *larger* model's folder without complaint, reading only the keys asked for, which is
    why trainer_state.json records the model.)"""
    dcp_dir = tmp_path / "dcp"
    python(CHAPTER / "fsdp_checkpoint.py", *TINY, "--n-layer", "1", "--steps", "1", "--save", "dcp",
           "--dcp-dir", dcp_dir, tmp_path=tmp_path)
    meta_path = dcp_dir / "trainer_state.json"
    meta = json.loads(meta_path.read_text())
    assert meta["step"] == 1 and meta["model"]["n_layer"] == 1
    assert not list(dcp_dir.glob("*.tmp*")) and not list(tmp_path.glob("dcp.*"))  # no leftovers

    resume = ("--resume", "dcp", "--dcp-dir", dcp_dir, "--save", "none", "--steps", "2", *TINY)
    assert_one_line_error(torchrun(CHAPTER / "fsdp_checkpoint.py", *resume, nproc=2, tmp_path=tmp_path,
                                   check=False),
                          f"DCP checkpoint {dcp_dir} is from a different model (n_layer 1 there, 2 here)")
    del meta["model"]
    meta_path.write_text(json.dumps(meta))
    assert_one_line_error(torchrun(CHAPTER / "fsdp_checkpoint.py", *resume, nproc=2, tmp_path=tmp_path,
                                   check=False),
                          "does not fit this model or is damaged")
    meta_path.write_text("{not json")
    assert_one_line_error(python(CHAPTER / "fsdp_checkpoint.py", *resume, tmp_path=tmp_path, check=False),
                          "trainer_state.json is unreadable (JSONDecodeError")


def test_every_readme_command_is_run_by_a_test():
    """Each fragment below is looked up by a test above; together they must cover the README."""
    covered = ["fsdp_basics.py", "--sharding full_shard shard_grad_op no_shard hybrid_shard ddp",
               "make_strategies_table.py", "--activation-checkpointing --cpu-offload",
               "--mixed-precision bf16", "fsdp_checkpoint.py --steps 100", "--resume dcp", "--resume full"]
    for command in readme_commands(README):
        assert sum(fragment in command for fragment in covered) == 1, command
