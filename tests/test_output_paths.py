"""Output paths are checked before the work (distkit.paths): a --results, --checkpoint-dir, --log-dir
... that the run could not write ends the job with one ``error:`` line naming the flag and the path,
before the first step, instead of a traceback (and a peer's "lost the connection") once training is
over. Also the planner's node and GPU-count lines, plan.py --plot into a new folder, and two labels.

The launches that must fail early ask for 10,000 steps (or 100,000 bandwidth iterations): minutes of
work, so ending within LAUNCH_TIMEOUT_S with no step logged and none of the other outputs created
shows the check came first. Negative controls: the same ddp_training.py command with good paths
trains and writes every output; with the check line deleted (tests/workers/ch05_mutant.py) the
bad --results or --checkpoint-dir is found only after training, with a traceback from distkit.
"""
from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import pytest

from distkit import UsageError, planner
from distkit.harness import read_records
from distkit.paths import check_outputs, output_problem, output_problems
from launch import REPO, WORKERS, assert_one_line_error, job, load_script, parse_args_result, python, run_jobs, torchrun

DDP = REPO / "01-ddp-basics" / "ddp_training.py"
FSDP = REPO / "02-fsdp" / "fsdp_transformer.py"
DEEPSPEED = REPO / "03-deepspeed" / "deepspeed_train.py"
BANDWIDTH = REPO / "04-nccl-operations" / "bandwidth_test.py"
PLAN = REPO / "benchmarks" / "plan.py"
MUTANT = WORKERS / "ch05_mutant.py"
DDP_CHECK = 'check_outputs(ctx, args, files=["results"], dirs=["checkpoint_dir", "log_dir"])'
LAUNCH_TIMEOUT_S = 60
LONG = ["--model-size", "tiny", "--global-batch-size", "8", "--steps", "10000", "--timeout-s", "60"]
SHORT = ["--model-size", "tiny", "--global-batch-size", "8", "--steps", "3", "--timeout-s", "60"]


# ---- the judging function, in this process -----------------------------------------------------

def test_output_problem_names_what_is_wrong_and_creates_nothing(tmp_path):
    a_file, a_folder = tmp_path / "a-file", tmp_path / "a-folder"
    a_file.write_text("x")
    a_folder.mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    before = sorted(os.listdir(tmp_path))
    judged = {
        "under a file": output_problem(a_file / "r.jsonl"),
        "deep under a file": output_problem(a_file / "x" / "y" / "r.jsonl"),
        "folder as a file": output_problem(a_folder),
        "file as a folder": output_problem(a_file, folder=True),
        "folder under a file": output_problem(a_file / "ck", folder=True),
        "under a broken link": output_problem(link / "ck", folder=True),
        "read-only place": output_problem("/proc/no-such-dir/r.jsonl"),
    }
    assert judged == {
        "under a file": f"its folder {a_file} is a file",
        "deep under a file": f"cannot create the folder {a_file / 'x' / 'y'}: {a_file} is a file",
        "folder as a file": "is a folder, not a file",
        "file as a folder": "is a file, not a folder",
        "folder under a file": f"cannot create the folder {a_file / 'ck'}: {a_file} is a file",
        "under a broken link": f"cannot create the folder {link / 'ck'}: {link} is a broken link",
        "read-only place": judged["read-only place"],
    }
    assert judged["read-only place"].startswith("/proc does not take new files (")
    # what a run can write passes: new nested folders, an existing file (appended to), an existing
    # folder, a {placeholder} the script fills in later
    for ok, folder in [(tmp_path / "new" / "deeper" / "r.jsonl", False), (a_file, False), (a_folder, True),
                       (tmp_path / "new" / "ck", True), (a_folder / "{strategy}_fp32.pt", False),
                       (tmp_path / "ck" / "{strategy}", True)]:
        assert output_problem(ok, folder=folder) is None, ok
    # nothing was created: no folders, no probe file left behind
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(a_folder) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_output_problem_read_only_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert output_problem(locked / "r.jsonl") == f"{locked} does not take new files (Permission denied)"
    finally:
        locked.chmod(0o755)


def test_output_problems_is_one_line_naming_each_flag(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    args = argparse.Namespace(results=str(a_file / "r.jsonl"), save="none", checkpoint_dir=str(a_file),
                              log_file=None, plot="")
    line = output_problems(args, files=["results", "save", "log_file", "plot"], dirs=["checkpoint_dir"])
    assert line == (f"--results {a_file / 'r.jsonl'}: its folder {a_file} is a file; "
                    f"--checkpoint-dir {a_file}: is a file, not a folder")
    # 'none' means no file for --save only; unset flags are skipped
    assert output_problems(argparse.Namespace(save=str(a_file / "m.pt")), files=["save"]).startswith("--save ")
    assert output_problems(argparse.Namespace(results=str(tmp_path / "r.jsonl")), files=["results"]) is None
    with pytest.raises(UsageError, match=r"^--results .*: its folder .* is a file$"):
        check_outputs(None, args, files=["results"])
    world_of_one = SimpleNamespace(is_main=True, world_size=1, device=None)
    with pytest.raises(UsageError, match="--checkpoint-dir"):
        check_outputs(world_of_one, args, dirs=["checkpoint_dir"])


def test_cluster_fills_whole_nodes():
    with pytest.raises(UsageError, match="--gpus 8 does not fill whole nodes of 3 GPUs"):
        planner.cluster("h100", 8, 3)
    with pytest.raises(UsageError, match="--gpus 12 does not fill whole nodes of 8 GPUs"):
        planner.cluster("h100", 12)  # the H100's usual node of 8
    assert (planner.cluster("h100", 16, 4).gpus_per_node, planner.cluster("h100", 3).gpus_per_node) == (4, 3)
    assert planner.cluster("h100", 2, 8).gpus_per_node == 2  # one node, partly used


# ---- real launches -----------------------------------------------------------------------------

def _job(script, *args, prefix=()):
    """A 2-rank launch of ``script`` in a fresh folder, timed; in ``args``, ``{file}`` is a regular
    file there and ``{folder}`` the folder (a later flag wins over an earlier one)."""
    def launch(folder):
        a_file = folder / "a-file"
        a_file.write_text("x")
        argv = [a.replace("{file}", str(a_file)).replace("{folder}", str(folder)) for a in args]
        start = time.monotonic()
        result = torchrun(script, *prefix, *argv, nproc=2, tmp_path=folder, timeout=LAUNCH_TIMEOUT_S, check=False)
        return result, time.monotonic() - start
    return launch


DDP_OUT = ["--results", "{folder}/r.jsonl", "--checkpoint-dir", "{folder}/ck", "--log-dir", "{folder}/logs"]
WITHOUT_CHECK = (DDP, DDP_CHECK, "pass", "--")  # tests/workers/ch05_mutant.py: the check line deleted
JOBS = {
    "ddp_results_under_file": _job(DDP, *LONG, *DDP_OUT, "--results", "{file}/r.jsonl"),
    "ddp_checkpoint_dir_under_file": _job(DDP, *LONG, *DDP_OUT, "--checkpoint-dir", "{file}/ck"),
    "ddp_results_is_a_folder": _job(DDP, *LONG, *DDP_OUT, "--results", "{folder}"),
    "ddp_log_dir_is_a_file": _job(DDP, *LONG, *DDP_OUT, "--log-dir", "{file}"),
    "fsdp_results_under_file": _job(FSDP, *LONG, "--results", "{file}/r.jsonl"),
    "bandwidth_results_under_file": _job(BANDWIDTH, "--iters", "100000", "--results", "{file}/r.jsonl",
                                         "--plot", "{folder}/bw.png"),
    "deepspeed_checkpoint_dir_under_file": _job(DEEPSPEED, *LONG, "--checkpoint-dir", "{file}/{strategy}",
                                                "--results", "{folder}/r.jsonl", "--save", "{folder}/{strategy}.pt"),
    # negative controls: good paths train and write; without the check the bad path is found late
    "ddp_good_paths": _job(DDP, *SHORT, *DDP_OUT, "--results", "{folder}/new/r.jsonl",
                           "--checkpoint-dir", "{folder}/new/ck"),
    "ddp_unchecked_results": _job(MUTANT, *SHORT, *DDP_OUT, "--results", "{file}/r.jsonl", prefix=WITHOUT_CHECK),
    "ddp_unchecked_checkpoint_dir": _job(MUTANT, *SHORT, *DDP_OUT, "--checkpoint-dir", "{file}/ck",
                                         prefix=WITHOUT_CHECK),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_jobs(JOBS, tmp_path_factory)


def assert_early_one_line(jobs, name, expected):
    """One error line with ``expected``, before any step: nothing logged, no other output created."""
    folder, (result, seconds) = job(jobs, name)
    assert_one_line_error(result, expected)
    assert "lost the connection" not in result.stdout and "terminate called" not in result.stdout
    said = [line for line in result.stdout.splitlines() if not line.startswith("error:")]
    assert not [line for line in said if "step" in line or "world size" in line], result.stdout[-2000:]
    assert seconds < LAUNCH_TIMEOUT_S
    return folder, result


@pytest.mark.parametrize("name, flag, problem", [
    ("ddp_results_under_file", "--results {folder}/a-file/r.jsonl", "its folder {folder}/a-file is a file"),
    ("ddp_checkpoint_dir_under_file", "--checkpoint-dir {folder}/a-file/ck",
     "cannot create the folder {folder}/a-file/ck: {folder}/a-file is a file"),
    ("ddp_results_is_a_folder", "--results {folder}", "is a folder, not a file"),
    ("ddp_log_dir_is_a_file", "--log-dir {folder}/a-file", "is a file, not a folder"),
])
def test_ddp_training_bad_output_is_one_line_before_training(jobs, name, flag, problem):
    folder = job(jobs, name)[0]
    assert_early_one_line(jobs, name, f"{flag}: {problem}".format(folder=folder))
    # nor were the good outputs of the same command started
    assert sorted(os.listdir(folder)) == ["a-file", "tmp"]


def test_fsdp_transformer_bad_results_is_one_line_before_training(jobs):
    folder = job(jobs, "fsdp_results_under_file")[0]
    assert_early_one_line(jobs, "fsdp_results_under_file", f"--results {folder}/a-file/r.jsonl: its folder")


def test_bandwidth_test_bad_results_is_one_line_before_measuring(jobs):
    folder = job(jobs, "bandwidth_results_under_file")[0]
    _, result = assert_early_one_line(jobs, "bandwidth_results_under_file", f"--results {folder}/a-file/r.jsonl")
    assert "# bandwidth test" not in result.stdout and not (folder / "bw.png").exists()


def test_deepspeed_bad_checkpoint_dir_is_one_line_before_training(jobs):
    """The {strategy} placeholder stays in the path: the folder it names would be created under a file."""
    folder = job(jobs, "deepspeed_checkpoint_dir_under_file")[0]
    assert_early_one_line(jobs, "deepspeed_checkpoint_dir_under_file",
                          f"--checkpoint-dir {folder}/a-file/{{strategy}}: cannot create the folder")


def test_negative_control_good_paths_train_and_write_everything(jobs):
    folder, (result, _) = job(jobs, "ddp_good_paths")
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(read_records(folder / "new" / "r.jsonl")) == 1
    assert sorted(os.listdir(folder / "new")) == ["ck", "r.jsonl"]  # and no probe file beside them
    assert [p.name for p in (folder / "new" / "ck").iterdir()] == ["step_000003.pt"]
    assert (folder / "logs" / "train.log").is_file()


@pytest.mark.parametrize("name, late_in", [("ddp_unchecked_results", "append_record"),
                                           ("ddp_unchecked_checkpoint_dir", "atomic_write")])
def test_negative_control_without_the_check_the_error_comes_late(jobs, name, late_in):
    """The script with its check_outputs line deleted: training runs, then a traceback from distkit."""
    _, (result, _) = job(jobs, name)
    assert result.returncode != 0
    assert "step 3/3" in result.stdout  # it trained first
    assert "Traceback" in result.stdout and late_in in result.stdout, result.stdout[-3000:]


# ---- plan.py -----------------------------------------------------------------------------------

def test_plan_plot_into_a_missing_folder_is_created(tmp_path):
    png = tmp_path / "new" / "sub" / "plan.png"
    result = python(PLAN, "--gpus", "8", "--plot", png, tmp_path=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in result.stdout


def test_plan_plot_that_cannot_be_written_is_one_line_before_the_plan(tmp_path):
    (tmp_path / "a-file").write_text("x")
    result = python(PLAN, "--plot", tmp_path / "a-file" / "plan.png", tmp_path=tmp_path, timeout=LAUNCH_TIMEOUT_S,
                    check=False)
    assert_one_line_error(result, f"--plot {tmp_path}/a-file/plan.png: its folder {tmp_path}/a-file is a file")
    assert "strategy" not in result.stdout


def test_plan_gpus_that_do_not_fill_nodes_is_one_line(tmp_path):
    result = python(PLAN, "--gpus", "8", "--gpus-per-node", "3", tmp_path=tmp_path, timeout=LAUNCH_TIMEOUT_S,
                    check=False)
    assert_one_line_error(result, "--gpus 8 does not fill whole nodes of 3 GPUs")
    assert "nodes of 3" not in result.stdout.replace("whole nodes of 3", "")  # no "3 nodes of 3" header


def test_plan_three_gpus_gives_true_reasons(tmp_path):
    # an explicit batch 3 GPUs cannot split (the planner's own batch would be rounded to 513 for them)
    result = python(PLAN, "--gpus", "3", "--global-batch", "512", tmp_path=tmp_path, timeout=LAUNCH_TIMEOUT_S,
                    check=False)
    assert result.returncode == 1  # nothing fits
    lines = result.stdout.splitlines()
    pipeline = [line for line in lines if line.startswith("pp_1f1b ")]
    assert pipeline == ["pp_1f1b              cannot run: no pipeline size: the planner tries 2, 4, 8 ... "
                        "stages, and none divides 3 GPUs"]
    assert "recommended: none: no strategy can run this job on 3 GPUs (reasons below)" in lines
    assert "needs at least 2 GPUs" not in result.stdout and "use more GPUs" not in result.stdout
    # control: 3 GPUs are plannable once the batch splits over them
    fits = python(PLAN, "--gpus", "3", "--global-batch", "510", tmp_path=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert any(line.startswith("recommended: zero") for line in fits.stdout.splitlines()), fits.stdout[-1500:]


# ---- labels ------------------------------------------------------------------------------------

def test_fsdp_checkpoint_names_the_llama(tmp_path):
    result = torchrun(REPO / "02-fsdp" / "fsdp_checkpoint.py", "--arch", "llama", "--model-size", "tiny",
                      "--steps", "0", "--checkpoint-format", "none", "--global-batch-size", "2",
                      nproc=1, tmp_path=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert "[rank 0] world size 1 | tiny Llama | steps 0 -> 0" in result.stdout, result.stdout[-2000:]


def test_fsdp_hf_checkpoint_help_states_its_llama_default():
    result = parse_args_result(load_script(REPO / "02-fsdp" / "fsdp_hf_checkpoint.py"), "--help")
    assert result.returncode == 0
    arch_help = " ".join(result.stdout.split("--arch {gpt,llama}")[-1].split("--model-size")[0].split())
    assert arch_help == "the architecture; a Hugging Face Llama folder loads into --arch llama only (default: llama)"


def test_plot_out_dir_under_a_file_is_one_line_before_drawing(tmp_path):
    """benchmarks/plot.py judges --out-dir before it draws (the committed record as input)."""
    (tmp_path / "a-file").write_text("x")
    results = REPO / "benchmarks" / "records" / "results_cpu.jsonl"
    result = python(REPO / "benchmarks" / "plot.py", "--results", results, "--out-dir", tmp_path / "a-file" / "plots",
                    tmp_path=tmp_path, timeout=LAUNCH_TIMEOUT_S, check=False)
    assert_one_line_error(result, f"--out-dir {tmp_path}/a-file/plots")
    assert "wrote" not in result.stdout


def test_gpu_check_out_under_a_file_is_one_line_before_anything(tmp_path):
    """benchmarks/gpu_check.py judges --out before the install and the suite, GPU or not (its own
    standard-library check: it runs before the wheel folder is installed)."""
    (tmp_path / "a-file").write_text("x")
    result = python(REPO / "benchmarks" / "gpu_check.py", "--out", tmp_path / "a-file" / "out", tmp_path=tmp_path,
                    timeout=LAUNCH_TIMEOUT_S, check=False, launcher="python")
    assert_one_line_error(result, f"--out {tmp_path}/a-file/out: cannot write there")
    assert "no GPU" not in result.stdout


def test_harness_overhead_help_states_its_tiny_default():
    help_text = parse_args_result(load_script(REPO / "benchmarks" / "harness_overhead.py"), "--help").stdout
    assert "default: tiny)" in " ".join(help_text.split())  # the old set_defaults left "default: small"
