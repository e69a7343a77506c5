"""Chapter 03 (DeepSpeed ZeRO): every README command runs (with small flags appended), and what it
produces is checked against single-process training.

Tolerances. zero_memory.py (ZeRO 0, 1, 2, 3 and ZeRO-3 + CPU offload, one after another in one
job) is played with plain SGD at lr 0.5 (``--optimizer sgd``, ch03_common's SGD_LR), and every
config's weights must end within ``SGD_TOL`` = 1e-5 (absolute, per weight) of one process training
with torch's SGD on the same global batches (:func:`check_trains_like_one_process`). SGD's update is
lr x the gradient, so a gradient N times too large moves every weight N times as far; AdamW's
m / sqrt(v) would divide the N out, and a comparison with one AdamW process would pass. Measured on
2-core CPU, gloo (the tiny GPT with one block, 3 steps, global batch 16; training moves a weight by
up to 4.3e-2): the correct run lands 1.2e-7 from one process at every config on 4 ranks (one ulp of
the weights near 1: the gradient summed in another order; 1.5e-8 on 2 ranks), 80x below SGD_TOL; its
mutant whose loss is multiplied by the world size (what a reduction that sums instead of averaging
leaves) lands 3.8e-1 away on 4 ranks and 1.2e-1 on 2, at every config: 12,000x SGD_TOL and more.
:func:`test_summed_gradients_fail_the_equivalence_check` runs those mutants of the script with the
play's own flags and requires the check's own assertion to name every config even at 100x SGD_TOL.
There is no accumulation mutant: neither zero_memory.py nor deepspeed_train.py splits a step into
micro-batches (every config has ``gradient_accumulation_steps`` 1, and the 1/k would be DeepSpeed's
own, inside ``engine.backward``); chapters 01 and 05 mutate their scripts' ``/ k``.

deepspeed_train.py trains with AdamW (its resume test proves Adam's moments are restored), and its
weights must be single-process AdamW's within ``WEIGHT_TOL`` = 5e-5 after 3 or 6 steps at lr 3e-3:
fp32 rounding of the other summation order, about 1e-7 relative per step, which Adam's normalisation
magnifies for near-zero gradients to 1e-6-1e-5. A lost or repeated step shows (a weight moves up to
3e-3 per step: the consolidation test's control); a gradient of the wrong scale would not, which is
what the SGD comparison above is for.

Every played job runs with ``TORCH_EXTENSIONS_DIR`` in an empty folder of the clone, and the tests
assert that it stays empty: no DeepSpeed op was JIT-compiled (a fresh CI machine would spend 30-60 s
per op).

Each README command runs once per session, in the reader's play (tests/spine.py; the flags appended:
ch03_common.PLAY); the tests that check what it produced share that run. zero_memory.py runs on the
README's 4 ranks (its bytes are checked at N = 4, as the README's table shows them); the training,
resume and offload commands run on 2 ranks (``--nproc_per_node=2`` / ``--num_gpus=2``): what they
check (resume bit for bit, equivalence with one process, where offloaded state lives) does not depend
on the rank count, and on a 2-core machine 4 ranks cost twice the start-up. Flag and config-file
checks that end before any process group exists run in this process (``parse_args``,
``load_ds_config``), with one launched script per kind of error showing that the script turns it
into one line.

The GPU versions of these checks are in ``test_ch03_gpu.py``.
"""
from __future__ import annotations

import functools
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from ch03_common import (
    CHAPTER,
    INFERENCE,
    MEMORY,
    MEMORY_LAYERS,
    OFFLOAD,
    PLAY,
    README,
    RESUME,
    SGD_LR,
    SGD_TOL,
    STRATEGIES,
    TRAIN,
    WEIGHT_TOL,
    expected_state,
    max_diff,
    reference_weights,
)
from distkit import UsageError, theory
from distkit import deepspeed as dk
from distkit.checkpoint import load_model_state, safe_load
from distkit.harness import describe_model, read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from launch import (
    WORKERS,
    assert_one_line_error,
    assert_readme_covered,
    command_argv,
    free_port,
    job,
    job_env,
    load_script,
    python,
    readme_command,
    run,
    run_jobs,
)
from spine import EXTENSIONS, flag_path, play_chapter


@pytest.fixture(scope="module")
def played(reader):
    """The README's commands as the reader's play ran them (tests/spine.py; ch03_common.PLAY). The
    play gives DeepSpeed an empty extension folder: a JIT-compiled op would show there."""
    played = play_chapter("03-deepspeed", reader)
    built = list((reader.clone / EXTENSIONS).glob("*"))
    assert not built, f"DeepSpeed JIT-compiled ops {built}: a fresh CI machine would build them"
    return played


def test_every_readme_command_is_run_by_a_test():
    assert_readme_covered(README, [TRAIN, RESUME, INFERENCE, OFFLOAD, MEMORY])


# ------------------------------------------------------------------------------------------------
# zero_memory.py: ZeRO 0, 1, 2, 3 and 3 + offload in one job
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zero_memory(played, tmp_path_factory):
    run = played.ok(MEMORY)
    return {"tmp": tmp_path_factory.mktemp("zero_memory"), "output": run["stdout"], "params": run["out"] / "params",
            "records": read_records(flag_path(run, "--results")), "record_file": flag_path(run, "--record")}


NOT_ONE_PROCESS = "zero_memory.py's weights are not one SGD process's"
WIDE = 100  # a negative control must miss by at least this factor of the tolerance


@functools.cache
def sgd_reference() -> dict[str, torch.Tensor]:
    """One process with plain SGD on the play's zero_memory.py run (3 steps, global batch 16, SGD_LR)."""
    return reference_weights(steps=3, batch=16, lr=SGD_LR, optimizer="sgd", n_layer=MEMORY_LAYERS)


def check_trains_like_one_process(params: Path, tolerance: float = SGD_TOL, strategies=STRATEGIES) -> None:
    """Each config's saved weights (``params/{strategy}.pt``) within ``tolerance`` of one process
    (the module docstring argues SGD_TOL); the message names each config that is not, in order."""
    reference = sgd_reference()
    diffs = {strategy: max_diff(safe_load(params / f"{strategy}.pt"), reference) for strategy in strategies}
    off = [f"{strategy} {diff:.1e}" for strategy, diff in diffs.items() if not diff < tolerance]
    assert not off, f"{NOT_ONE_PROCESS} (max |w - w_single| over {tolerance:.0e}): {', '.join(off)}"


def test_zero_stages_train_the_single_process_model(zero_memory):
    """The played zero_memory.py (4 ranks, plain SGD): every config ends with one process's weights;
    its negative controls are test_summed_gradients_fail_the_equivalence_check's."""
    assert "still referenced" not in zero_memory["output"]  # every engine was freed before the next config ran
    check_trains_like_one_process(zero_memory["params"])


# The bug the check exists for, made in the script: each rank's loss multiplied by the world size,
# the gradient that summing over the ranks instead of averaging leaves (N x the global batch's).
SUMMED = ("loss = lm_loss(engine(inputs), targets)", "loss = lm_loss(engine(inputs), targets) * ctx.world_size")


def launch_mutant(folder: Path, nproc: int, configs: list[str], old: str, new: str):
    """zero_memory.py's README command on ``nproc`` ranks with the play's flags (ch03_common.PLAY, its
    outputs in ``folder``), the script replaced by its mutant (tests/workers/ch05_mutant.py); ``--configs``
    only for fewer than the default ones, STRATEGIES."""
    argv = command_argv(readme_command(README, MEMORY), nproc)
    at = argv.index(f"{CHAPTER.name}/{MEMORY}")
    flags = [flag.replace("{out}", str(folder)) for flag in PLAY[MEMORY].flags]
    subset = ["--configs", *configs] if configs != STRATEGIES else []
    env = job_env(folder, TORCH_EXTENSIONS_DIR=str(folder / "torch_extensions"))
    return run([*argv[:at], str(WORKERS / "ch05_mutant.py"), str(CHAPTER / MEMORY), old, new, "--",
                *argv[at + 1:], *flags, *subset, "--record", str(folder / "zero_memory.jsonl")], env=env, timeout=400)


# The play's run on its 4 ranks, every config; and on 2 ranks (a factor of 2, the smallest), every
# ZeRO stage once (zero3_offload is stage 3 again, which the 4-rank mutant covers).
MUTANT_CONFIGS = {4: STRATEGIES, 2: STRATEGIES[:4]}


@pytest.fixture(scope="module")
def summed(tmp_path_factory):
    """The SUMMED mutant at both world sizes of MUTANT_CONFIGS, two at a time."""
    old, new = SUMMED
    return run_jobs({f"summed_{n}_ranks": functools.partial(launch_mutant, nproc=n, configs=configs, old=old, new=new)
                     for n, configs in MUTANT_CONFIGS.items()}, tmp_path_factory)


def test_summed_gradients_fail_the_equivalence_check(summed):
    """The check of test_zero_stages_train_the_single_process_model fails its own assertion for the
    summed mutant on 4 and on 2 ranks, naming each config it ran, even at 100x SGD_TOL."""
    for nproc, configs in MUTANT_CONFIGS.items():
        folder, _ = job(summed, f"summed_{nproc}_ranks")
        named = ", ".join(rf"{name} \S+" for name in configs)
        every_config = re.escape(NOT_ONE_PROCESS) + rf".*: {named}(?:\n|$)"  # each config, and no other
        with pytest.raises(AssertionError, match=every_config):
            check_trains_like_one_process(folder / "params", tolerance=WIDE * SGD_TOL, strategies=configs)


def test_zero_stages_hold_the_formulas_bytes(zero_memory):
    """Bytes per rank as ch03_common.expected_state writes out DeepSpeed's fp32 layout for the play's
    plain SGD: no moments, so the optimizer column is ZeRO's fp32 master partition alone (4Ψ/N at
    stages 1-3, nothing at stage 0). The AdamW layout is the Llama's test's and the notebook's."""
    records = zero_memory["records"]
    assert [r["strategy"] for r in records] == STRATEGIES
    cfg = gpt_config("tiny", n_layer=MEMORY_LAYERS)
    psi, n = sum(p.numel() for p in TinyGPT(cfg).parameters()), 4
    assert psi % n == 0  # no padding of the flat partitions for this model: the bytes are exact
    for record in records:
        assert record["param_count"] == psi
        assert record["model"] == {"arch": "gpt", **cfg.to_dict()}
        assert "model_size" not in record["config"] and "param_count" not in record["config"]
        assert (record["config"]["optimizer"], record["config"]["lr"]) == ("sgd", SGD_LR)
        expected = expected_state(record["config"]["zero_stage"], psi, n, "sgd")
        for rank, measured in enumerate(record["metrics"]["model_state_bytes_per_rank"]):
            for key, value in expected.items():
                assert abs(measured[key] - value) <= 0.05 * value, (record["strategy"], rank, key, measured)

    # "auto" buckets as the engines parsed them: one rank's share of the model, not DeepSpeed's 5e8
    # (2 GB of fp32 per rank); no overlap and no pinned memory on CPU.
    share = math.ceil(psi / n)
    for record in records:
        settings = record["config"]["engine_settings"]
        if record["strategy"] != "zero0":
            assert settings["reduce_bucket_size"] == share, (record["strategy"], settings)
            assert settings["allgather_bucket_size"] == share, (record["strategy"], settings)
        assert settings["overlap_comm"] is False, (record["strategy"], settings)
        if record["config"]["zero_stage"] == 3:
            assert (settings["stage3_prefetch_bucket_size"], settings["stage3_max_live_parameters"],
                    settings["stage3_max_reuse_distance"]) == (share, share, share), settings
    assert records[-1]["config"]["engine_settings"]["offload_optimizer.pin_memory"] is False


def test_zero_memory_record_renders_the_readme_section(zero_memory):
    """The run's record (provenance + table) renders the README section: tables and plot."""
    record_file = zero_memory["record_file"]
    [record] = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert record["name"] == "zero_memory" and record["machine"]["device_name"] and record["torch"]
    assert record["command"].startswith("torchrun --nproc_per_node=4 03-deepspeed/zero_memory.py")
    table = record["table"]
    assert [row["strategy"] for row in table["rows"]] == STRATEGIES
    assert all(row["peak_memory_kind"] == "cpu_mem_tracker" and row["peak_memory_bytes_max"] > 0
               for row in table["rows"])
    psi, n = table["param_count"], table["world_size"]
    assert table["optimizer"] == "sgd"
    for row in table["rows"]:  # the formula columns come from distkit.theory, for the run's optimizer
        assert row["predicted"] == theory.zero_fp32_state_bytes(row["stage"], psi, n, "sgd")
    out = zero_memory["tmp"] / "render"
    out.mkdir()
    section = load_script(CHAPTER / "zero_memory.py").render_record(record_file, out)
    assert (out / "zero_memory.png").stat().st_size > 10_000
    assert "| zero3_offload |" in section and ", gloo, torch" in section  # caption: where it ran
    assert f"N = {n} ranks, fp32, SGD, 3 steps." in section  # and with what


# ------------------------------------------------------------------------------------------------
# deepspeed_train.py (torchrun, then the deepspeed launcher resuming) and deepspeed_inference.py
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(played):
    """ZeRO-3 via torchrun on 2 ranks: 6 steps with a checkpoint at step 3; then the deepspeed
    launcher resumes from the step-3 checkpoint's path and trains to step 6 again (as the play ran
    them: ch03_common.PLAY)."""
    first, resume = played.ok(TRAIN), played.ok(RESUME)
    checkpoints = flag_path(first, "--checkpoint-dir")
    assert checkpoints == flag_path(resume, "--checkpoint-dir")
    return {"checkpoints": checkpoints, "latest_after_first": (checkpoints / "latest").read_text().strip(),
            "straight": flag_path(first, "--save"), "resumed": flag_path(resume, "--save"),
            "resume_out": resume["stdout"], "records": read_records(flag_path(first, "--results"))}


def test_resume_continues_the_same_run(trained):
    assert (trained["checkpoints"] / "step3").is_dir() and trained["latest_after_first"] == "step6"
    assert "resumed from" in trained["resume_out"] and "at step 3" in trained["resume_out"]
    first, second = safe_load(trained["straight"]), safe_load(trained["resumed"])
    assert first["strategy"] == "zero3"
    assert max_diff(first["model"], second["model"]) == 0.0  # resumed = uninterrupted, bit for bit
    records = trained["records"]
    assert [r["resumed_from"] for r in records] == [0, 3]
    assert all(r["strategy"] == "zero3" and r["config"]["precision"] == "fp32" and r["world_size"] == 2
               for r in records)
    assert all(r["param_count"] == sum(v.numel() for v in first["model"].values()) for r in records)


def test_consolidated_weights_match_single_process_and_generate(trained, played):
    """The consolidated fp32 state dict loads into the plain model, matches single-process training
    and reproduces the engine's eval loss; the inference script generates from it."""
    straight = trained["straight"]
    first = safe_load(straight)
    diff = max_diff(first["model"], reference_weights(steps=6, batch=16))
    assert diff < WEIGHT_TOL, f"ZeRO-3 training vs single process: {diff:.2e}"
    # --save-every 3 also consolidated the step-3 checkpoint: one process's weights after 3 steps,
    # not the final ones (control: the final file is 3 steps further from them)
    at_3 = safe_load(straight.with_name("straight_fp32.step3.pt"))
    assert at_3["steps"] == 3 and max_diff(at_3["model"], reference_weights(steps=3, batch=16)) < WEIGHT_TOL
    assert max_diff(first["model"], reference_weights(steps=3, batch=16)) > 100 * WEIGHT_TOL

    cfg = gpt_config("tiny")
    model = TinyGPT(cfg)
    load_model_state(model, first["model"], str(straight))
    inputs, targets = TokenTask(cfg).global_batch(dk.EVAL_STEP, dk.EVAL_BATCH)
    with torch.no_grad():
        plain_loss = lm_loss(model(inputs), targets).item()
    assert abs(plain_loss - first["eval_loss"]) < 1e-5, (plain_loss, first["eval_loss"])

    inference = played.ok(INFERENCE)
    assert flag_path(inference, "--load") == straight
    out = inference["stdout"]
    assert f"eval loss {plain_loss:.4f}" in out
    assert "valid transitions in generated tokens:" in out


def test_resume_that_finds_nothing_is_one_line(tmp_path):
    """--resume latest in an empty folder and --resume PATH of a missing checkpoint: one line each,
    before DeepSpeed is imported."""
    script = load_script(CHAPTER / "deepspeed_train.py")
    with pytest.raises(UsageError, match="--resume latest: no checkpoint in"):
        script.checkpoint_to_resume("latest", tmp_path)
    with pytest.raises(UsageError, match="no such checkpoint folder"):
        script.checkpoint_to_resume(str(tmp_path / "step7"), tmp_path)
    assert script.checkpoint_to_resume("none", tmp_path) is None
    (tmp_path / "step3").mkdir()
    (tmp_path / "latest").write_text("step3\n")
    assert script.checkpoint_to_resume("latest", tmp_path) == (tmp_path, "step3")
    assert script.checkpoint_to_resume(str(tmp_path / "step3"), Path("elsewhere")) == (tmp_path, "step3")


# ------------------------------------------------------------------------------------------------
# zero_offload.py
# ------------------------------------------------------------------------------------------------
def test_offload_trains_the_same_model_and_reports_placement(played):
    run, n = played.ok(OFFLOAD), 2
    out = run["stdout"]
    base, offload = read_records(flag_path(run, "--results"))
    assert (base["strategy"], offload["strategy"]) == ("zero3", "zero3_offload")
    assert offload["config"]["offload"] == {"offload_optimizer": "cpu", "offload_param": "cpu"}
    assert abs(base["final_loss"] - offload["final_loss"]) < 1e-5
    assert base["metrics"]["model_state_bytes_per_rank"] == offload["metrics"]["model_state_bytes_per_rank"]
    assert out.count("-> host (offloaded)") == 4 and out.count("-> accelerator") == 4
    psi = base["param_count"]
    assert base["world_size"] == n and psi % n == 0
    assert f"model state kept off the accelerator: {20 * psi // n:,} B per rank" in out  # 20Ψ/N, all of it
    check_placement(out, psi, n)
    doctored = out.replace(f"{4 * psi // n:,} B", f"{4 * psi:,} B", 1)  # control: one row not sharded
    with pytest.raises(AssertionError, match=re.escape("placement row 'parameter partition': ")):
        check_placement(doctored, psi, n)
    # The first engine (a reference cycle) was collected before the second config ran.
    assert "still referenced" not in out
    assert offload["config"]["engine_settings"]["offload_param.pin_memory"] is False


PLACEMENT_ROW = re.compile(r"^\[rank 0\]\s+(parameter partition|fp32 gradient partition|fp32 master weights|"
                           r"Adam exp_avg \+ exp_avg_sq)\s+([\d,]+) B\s+on (\S+)\s+-> (.+)$", re.MULTILINE)


def check_placement(out: str, psi: int, n: int) -> None:
    """zero_offload.py's placement table, row by row, for ZeRO-3 and then ZeRO-3 with offload: each
    rank holds 1/N of each piece of the fp32 model state (parameters 4Ψ/N, gradients 4Ψ/N, master
    weights 4Ψ/N, Adam's two moments 8Ψ/N: ZeRO's Table 1, written out here), the device read from
    the tensors (the CPU's, on this machine), and the side the config puts it on: the accelerator,
    then the host for all four. Each config's "kept off" total is the offloaded rows' sum."""
    pieces = {"parameter partition": 4, "fp32 gradient partition": 4, "fp32 master weights": 4,
              "Adam exp_avg + exp_avg_sq": 8}
    rows = PLACEMENT_ROW.findall(out)
    assert len(rows) == 2 * len(pieces), rows
    for config, side in enumerate(("accelerator", "host (offloaded)")):
        table = rows[config * len(pieces):(config + 1) * len(pieces)]
        assert [name for name, *_ in table] == list(pieces), table
        for name, size, device, shown in table:
            want = pieces[name] * psi // n
            assert (int(size.replace(",", "")), device, shown) == (want, "cpu", side), \
                f"placement row {name!r}: {size} B on {device} -> {shown}, expected {want:,} B on cpu -> {side}"
    kept = re.findall(r"model state kept off the accelerator: ([\d,]+) B per rank", out)
    assert [int(k.replace(",", "")) for k in kept] == [0, 20 * psi // n], kept


# ------------------------------------------------------------------------------------------------
# Bad input: one line each
# ------------------------------------------------------------------------------------------------
def parse(script, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """A chapter script's ``parse_args`` on ``argv`` in this process: (exit status, stderr)."""
    monkeypatch.setattr(sys, "argv", [script.__file__, *argv])
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args()
    return exit_info.value.code, capsys.readouterr().err


def test_numeric_flags_are_checked_where_they_are_defined(tmp_path, monkeypatch, capsys):
    """A zero, negative or non-finite number is argparse's one line, before any process group or
    DeepSpeed import (DeepSpeed's own AssertionError for a batch of 0 is never reached): each case
    through the script's parse_args here, and one through a launched script."""
    cases = [
        ("deepspeed_train.py", ["--global-batch-size", "0"],
         "argument --global-batch-size: must be a positive integer, got 0"),
        ("deepspeed_train.py", ["--global-batch-size", "-8"],
         "argument --global-batch-size: must be a positive integer, got -8"),
        ("deepspeed_train.py", ["--steps", "0"], "argument --steps: must be a positive integer"),
        ("deepspeed_train.py", ["--lr", "nan"], "argument --lr: must be a positive number"),
        ("deepspeed_train.py", ["--weight-decay", "-0.1"], "argument --weight-decay: must be a number >= 0"),
        ("deepspeed_train.py", ["--save-every", "-1"], "argument --save-every: must be an integer >= 0"),
        ("zero_offload.py", ["--warmup-steps", "-1"], "argument --warmup-steps: must be an integer >= 0"),
        ("zero_memory.py", ["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer"),
        ("deepspeed_inference.py", ["--new-tokens", "0"], "argument --new-tokens: must be a positive integer"),
        ("deepspeed_inference.py", ["--prompts", "-1"], "argument --prompts: must be a positive integer"),
    ]
    scripts = {name: load_script(CHAPTER / name) for name in {case[0] for case in cases}}
    for name, flags, message in cases:
        status, err = parse(scripts[name], flags, monkeypatch, capsys)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1 and message in errors[0], (name, flags, err)

    result = python(CHAPTER / "deepspeed_train.py", "--global-batch-size", "0", tmp_path=tmp_path, check=False,
                    timeout=120)
    assert result.returncode == 2, result.stdout[-2000:]
    assert_one_line_error(result, "argument --global-batch-size: must be a positive integer, got 0")


def test_bad_configs_fail_with_one_line_naming_the_file(tmp_path):
    """Syntax errors, unknown stages, and sizes or switches that are neither "auto" nor of the right
    kind: one UsageError naming the file; a launched script prints it as one line."""
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 32,\n "zero_optimization": {"stage": 2,}}\n')
    cases = [(broken, "is not valid JSON"),
             ({"zero_optimization": {"stage": 7}}, "unknown ZeRO stage 7"),
             ({"train_batch_size": 0}, "train_batch_size: must be a positive integer, got 0"),
             ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}},
              "zero_optimization.reduce_bucket_size: must be a positive number"),
             ({"zero_optimization": {"stage": 2, "overlap_comm": "yes"}},
              "zero_optimization.overlap_comm must be true, false or \"auto\"")]
    for number, (config, message) in enumerate(cases):
        path = config if isinstance(config, Path) else tmp_path / f"bad{number}.json"
        if not isinstance(config, Path):
            path.write_text(json.dumps(config))
        with pytest.raises(UsageError) as error:
            dk.load_ds_config(path)
        assert message in str(error.value) and str(path) in str(error.value), str(error.value)
        assert "\n" not in str(error.value)

    result = python(CHAPTER / "deepspeed_train.py", "--deepspeed_config", broken, tmp_path=tmp_path, check=False,
                    timeout=120)
    assert_one_line_error(result, "is not valid JSON")
    assert str(broken) in [line for line in result.stdout.splitlines() if line.startswith("error:")][0]


def test_auto_values_follow_the_model_and_the_device():
    """resolve_auto is pure: buckets ceil(Ψ/N) capped at DeepSpeed's 5e8, missing sizes count as
    auto at stages 1-3, explicit numbers kept; overlap and pinning on for CUDA only."""
    def config(**zero):
        return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": "auto"},
                                      "overlap_comm": "auto", **zero}}

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on_gpu = config(reduce_bucket_size="auto", allgather_bucket_size=1000)
    chosen = dk.resolve_auto(on_gpu, cuda, param_count=1001, world_size=4)
    zero = on_gpu["zero_optimization"]
    assert zero["reduce_bucket_size"] == 251 and zero["allgather_bucket_size"] == 1000
    assert zero["stage3_prefetch_bucket_size"] == zero["stage3_max_reuse_distance"] == 251  # missing = auto
    assert zero["overlap_comm"] is True and zero["offload_optimizer"]["pin_memory"] is True
    assert chosen["overlap_comm"] is True and "allgather_bucket_size" not in chosen

    on_cpu = config()
    dk.resolve_auto(on_cpu, cpu, param_count=7_000_000_000, world_size=8)
    zero = on_cpu["zero_optimization"]
    assert zero["reduce_bucket_size"] == dk.DEEPSPEED_DEFAULT_BUCKET  # 875M/rank: capped at 5e8
    assert zero["overlap_comm"] is False and zero["offload_optimizer"]["pin_memory"] is False

    stage1 = {"zero_optimization": {"stage": 1}}
    dk.resolve_auto(stage1, cuda, param_count=100, world_size=2)
    assert stage1["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    stage0 = {"zero_optimization": {"stage": 0}}
    assert dk.resolve_auto(stage0, cuda, param_count=100, world_size=2) == {}

    for shipped in sorted((CHAPTER / "configs").glob("*.json")):  # no 5e8 left in a shipped config
        zero = json.loads(shipped.read_text()).get("zero_optimization", {})
        assert all(zero.get(key, "auto") == "auto" for key in dk.BUCKET_KEYS), shipped


def test_model_state_is_counted_on_untimed_steps_only(monkeypatch):
    """The optimizer hook walks every parameter and state tensor only on warm-up and
    communication-counting steps, never inside a timed step."""
    from types import SimpleNamespace

    from distkit.runtime import DistContext

    walks = []
    counting_bytes = dk._bytes
    monkeypatch.setattr(dk, "_bytes", lambda *a: walks.append(1) or counting_bytes(*a))
    ctx = DistContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo",
                      device=torch.device("cpu"), timeout_s=60)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    harness = dk.ZeroHarness(ctx, "test", model=model, warmup_steps=1, comm_steps=1)
    harness.attach(SimpleNamespace(module=model), optimizer)
    walks_after = []
    for _ in range(5):
        with harness.step(samples=4):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        walks_after.append(len(walks))
    assert walks_after[0] > 0 and walks_after[1] > walks_after[0]  # untimed steps counted
    assert walks_after[1] == walks_after[2] == walks_after[3] == walks_after[4]  # timed: untouched
    assert harness.state_bytes() == {"params": 8 * 9 * 4, "grads": 8 * 9 * 4, "optimizer": 2 * 8 * 9 * 4}
    assert harness.local_metrics()["timed_steps"] == 3


def test_kernel_inject_without_a_policy_is_one_line(tmp_path):
    """The small GPT has no DeepSpeed injection policy: one line saying so, not DeepSpeed's
    ``AssertionError: No default policy found!``; prompts longer than the task's sequences too."""
    cfg = gpt_config("tiny")
    checkpoint = tmp_path / "tiny_fp32.pt"
    torch.save({"model": TinyGPT(cfg).state_dict(), "model_config": describe_model(cfg), "strategy": "zero3",
                "steps": 0, "eval_loss": 4.2, "seed": 0}, checkpoint)
    script = CHAPTER / "deepspeed_inference.py"
    for flags, message in ((["--kernel-inject"], "--kernel-inject: DeepSpeed"),
                           (["--prompt-len", "99"], "--prompt-len 99: the task has")):
        result = python(script, "--load", checkpoint, *flags, tmp_path=tmp_path, check=False, timeout=180)
        assert_one_line_error(result, message)
        assert "No default policy found" not in result.stdout


def test_deepspeed_launcher_ranks_without_gpus_are_one_line(tmp_path):
    """The deepspeed launcher tells ranks their node size in LOCAL_SIZE (not LOCAL_WORLD_SIZE):
    asking for CUDA for 2 local ranks on a machine with none is one line naming both counts (it blames
    --backend nccl where torch is a CUDA build, whose NCCL is there without a GPU, else --device cuda)."""
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", f"--master_port={free_port()}", "--num_gpus=2",
            str(CHAPTER / "deepspeed_train.py"), "--device", "cuda", "--model-size", "tiny"]
    result = run(argv, env=job_env(tmp_path), check=False, timeout=180)
    assert_one_line_error(result, ": 2 local ranks need 2 GPUs but this machine has 0")
