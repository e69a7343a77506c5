"""Chapter 01 tools and bad input: every README command is run by a test (small flags appended), the
validation script, the scaling benchmark, the launchers, and one clear error line for each bad input.

The two jobs that mostly wait (a SIGSTOPped rank ends after --timeout-s plus torchrun's 30 s grace;
a missing node after the join timeout) start in the background when this module starts, so the
other tests run while they wait; their tests collect them.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml

from ch01_common import CHAPTER, README, README_LOOKUPS, TRAINING, readme_argv
from distkit import UsageError
from distkit.checkpoint import atomic_save
from distkit.harness import read_records
from launch import (
    assert_one_line_error,
    assert_readme_covered,
    free_port,
    job_env,
    load_script,
    python,
    run,
)
from spine import play_chapter


@pytest.fixture(scope="module", autouse=True)
def background(tmp_path_factory):
    """The waiting jobs, started at once: ``{name: future}`` (see the module docstring)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {"stopped_rank": pool.submit(stop_a_rank, tmp_path_factory.mktemp("stopped")),
               "missing_node": pool.submit(start_two_of_three_nodes, tmp_path_factory.mktemp("missing"))}


def test_every_readme_command_is_run_by_a_test():
    """Each README command is found by exactly one of the lookups the tests use, and each lookup
    finds exactly one command (ch01_common.README_LOOKUPS names the file that runs it)."""
    assert_readme_covered(README, README_LOOKUPS)


@pytest.fixture(scope="module")
def played(reader):
    """The README's commands as the reader's play ran them (tests/spine.py; ch01_common.PLAY)."""
    return play_chapter("01-ddp-basics", reader)


def test_validate_distributed(played):
    out = played.ok("validate_distributed.py")["stdout"]
    lines = out.splitlines()
    for check in ("process group", "device binding", "backend gloo", "all_reduce", "all_gather", "broadcast"):
        assert any(line.startswith("PASS") and check in line for line in lines), (check, out)
    assert not any(line.startswith("FAIL") for line in lines)
    assert "MASTER_ADDR=" in out and "all checks passed" in out


def test_scaling_benchmark(played):
    """The README's benchmark command at 1 and 2 ranks (ch01_common.PLAY), as the play ran it."""
    run_ = played.ok("ddp_benchmark.py")
    results, png = run_["out"] / "bench.jsonl", run_["out"] / "scaling.png"
    records = read_records(results)
    assert sorted((r["config"]["scaling"], r["world_size"]) for r in records) == [
        ("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)]
    for r in records:  # strong: the global batch is fixed; weak: the per-rank batch is
        expected = 8 if r["config"]["scaling"] == "strong" else 4 * r["world_size"]
        assert r["config"]["global_batch_size"] == expected and r["metrics"]["tokens_per_s"] > 0
    assert "speedup" in run_["stdout"] and png.stat().st_size > 10_000


def test_launchers(played):
    """launch_ddp.sh as the play ran the README command (its --nproc 4; the tiny run of
    ch01_common.PLAY): it called torchrun on one node (tests/bin/torchrun, first on PATH), which trained
    to the end on 4 ranks. ddp_spawn.py, the README's other launcher, runs in tests/test_ch01_ch03_more_lessons.py,
    which also observes what each rank trained on."""
    launched = played.ok("launch_ddp.sh")
    assert "--standalone --nproc_per_node=4" in launched["stdout"] and "done: loss" in launched["stdout"]
    (record,) = read_records(launched["out"] / "r.jsonl")
    assert record["world_size"] == 4 and len(record["loss_history"]) == 3 and record["config"]["global_batch_size"] == 4
    # SLURM and Kubernetes files: valid shell / valid manifest that runs the chapter's script.
    run(["bash", "-n", str(CHAPTER / "slurm_ddp.sbatch")])
    job = yaml.safe_load((CHAPTER / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and "01-ddp-basics/ddp_training.py" in container["args"]


def test_bad_inputs_give_one_error_line(tmp_path):
    """Each bad input: non-zero exit, one `error:` line, no traceback. Run side by side (one process each)."""
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("steps: 10\nlearning_rate: 0.1\n")
    negative_batch = tmp_path / "negative.yaml"
    negative_batch.write_text("global_batch_size: -4\n")
    empty = tmp_path / "empty.pt"
    empty.touch()
    other_model = tmp_path / "other" / "step_000004.pt"
    atomic_save({"model": {"weight": torch.zeros(3)}, "step": 4}, other_model)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        lonely_port = s.getsockname()[1]
    common = ["--model-size", "tiny", "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "logs")]
    cases = [  # (argv, extra environment, expected text in the error line)
        ([TRAINING, "--config", bad_config, *common], {}, "unknown key 'learning_rate'"),
        ([TRAINING, "--resume", other_model, *common], {}, "is from a different model"),
        ([TRAINING, "--resume", garbage, *common], {}, "is unreadable"),
        ([TRAINING, "--resume", empty, *common], {}, "is empty (0 bytes)"),
        ([TRAINING, "--config", negative_batch, *common], {}, "global_batch_size: must be a positive integer, got -4"),
        ([TRAINING, "--num-sequences", "8", *common], {}, "--num-sequences 8 must be at least --global-batch-size 32"),
        ([TRAINING, *common], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy_port)}, "already in use"),
        # GPUs are hidden from every CPU-suite job: a CPU build has no NCCL at all, a CUDA build has
        # NCCL but no visible GPU (distkit.runtime.choose_backend_and_device words the two apart).
        ([TRAINING, "--backend", "nccl", *common], {},
         "1 local ranks need 1 GPUs but this machine has 0" if dist.is_nccl_available() else "no NCCL"),
        ([TRAINING, "--device", "cuda", *common], {}, "GPUs but this machine has 0"),
        ([TRAINING, "--precision", "fp16", *common], {}, "fp16 needs a GPU"),
        ([TRAINING, "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        # rank 0 of a 2-rank job whose rank 1 never starts: ends within --timeout-s, one line.
        ([TRAINING, "--timeout-s", "5", *common],
         {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(lonely_port)}, "could not join the process group"),
    ]

    def attempt(case):
        argv, extra, _ = case
        return python(*map(str, argv), env=job_env(tmp_path, **extra), timeout=240, check=False)

    # torchrun itself hosts the rendezvous store on --master_port: a busy port fails in torchrun,
    # before any of this repository's code runs, with torchrun's own traceback (the README says so).
    torchrun_busy = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
                     f"--master_port={busy_port}", str(TRAINING), *common]
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            # validate_distributed reports a missing backend as a FAIL line with a hint, exit 1.
            validate = pool.submit(python, CHAPTER / "validate_distributed.py", "--backend", "nccl",
                                   env=job_env(tmp_path), timeout=240, check=False)
            busy_torchrun = pool.submit(run, torchrun_busy, env=job_env(tmp_path), timeout=240, check=False)
            results = list(pool.map(attempt, cases))
            validated, busy_torchrun = validate.result(), busy_torchrun.result()
    finally:
        busy.close()
    for (argv, _, expected), result in zip(cases, results):
        assert_one_line_error(result, expected)
    assert validated.returncode == 1 and "FAIL  process group" in validated.stdout and "hint:" in validated.stdout
    assert busy_torchrun.returncode != 0
    assert "DistNetworkError" in busy_torchrun.stdout and "address already in use" in busy_torchrun.stdout
    assert "[rank 0]" not in busy_torchrun.stdout  # no worker ever started


def parse_error(monkeypatch, capsys, parse, argv) -> str:
    """Run a script's argument parsing on ``argv`` in this process; it must exit 2 with one error line."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        parse()
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


def test_flag_and_config_ranges_are_checked(monkeypatch, capsys, tmp_path):
    """Every count, size and rate is range-checked where its flag is defined (argparse, before any
    process group) and, for ddp_training.py, a config file's value goes through the same flag's type."""
    training = load_script(TRAINING)
    for argv, expected in [
        (["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer, got 0"),
        (["--global-batch-size", "-8"], "argument --global-batch-size: must be a positive integer, got -8"),
        (["--grad-accum-steps", "0"], "argument --grad-accum-steps: must be a positive integer, got 0"),
        (["--base-batch-size", "0"], "argument --base-batch-size: must be a positive integer, got 0"),
        (["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
        (["--num-sequences", "0"], "argument --num-sequences: must be a positive integer, got 0"),
        (["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
        (["--lr", "nan"], "argument --lr: must be a positive number, got 'nan'"),
        (["--keep-checkpoints", "0"], "argument --keep-checkpoints: must be a positive integer, got 0"),
        (["--grad-clip", "-1"], "argument --grad-clip: must be a number >= 0, got -1"),
        (["--bucket-cap-mb", "-1"], "argument --bucket-cap-mb: must be a number >= 0, got -1"),
        (["--sync-batchnorm"], "unrecognized arguments: --sync-batchnorm"),  # gone: the model has no BatchNorm
    ]:
        assert expected in parse_error(monkeypatch, capsys, training.parse_args, argv)

    monkeypatch.delenv("RANK", raising=False)  # rank 0 reads the config file
    cpu = torch.device("cpu")

    def config_error(text: str, world_size: int = 4, *flags: str) -> str:
        """The one-line error of ``--config`` holding ``text``: from parsing, or from rank 0's check
        of what needs the world size (world_size_error, given the job's size and device)."""
        path = tmp_path / "c.yaml"
        path.write_text(text)
        try:
            args = training.parse_args(["--config", str(path), *flags])
        except UsageError as exc:
            return str(exc)
        return training.world_size_error(args, SimpleNamespace(world_size=world_size, device=cpu))

    assert config_error("global_batch_size: 0\n").endswith("global_batch_size: must be a positive integer, got 0")
    assert config_error("grad_accum_steps: 0\n").endswith("grad_accum_steps: must be a positive integer, got 0")
    assert config_error("base_batch_size: -32\n").endswith("must be a positive integer, got -32")
    assert config_error("lr: -1\n").endswith("lr: must be a positive number, got -1")
    assert config_error("log_every: 0\n").endswith("log_every: must be a positive integer, got 0")
    assert config_error("steps: 2.5\n").endswith("steps: must be a positive integer, got '2.5'")
    assert config_error("steps: true\n").endswith("steps: must be a number, got True")
    assert config_error("static_graph: 1\n").endswith("'static_graph' must be true or false, got 1")
    assert config_error("precision: fp8\n").endswith("'precision' must be one of ['fp32', 'bf16', 'fp16'], got 'fp8'")
    assert config_error("checkpoint_dir: 5\n").endswith("'checkpoint_dir' must be a string, got 5")
    assert "unknown key 'learning_rate'" in config_error("learning_rate: 0.1\n")
    assert "unknown key 'backend'" in config_error("backend: gloo\n")  # the launch's business, not the file's
    assert "must be at least --global-batch-size 32" in config_error("num_sequences: 16\n")
    assert "must divide by world size x --grad-accum-steps = 12" in config_error("grad_accum_steps: 3\n")
    assert "must be divisible by the head count 3" in config_error("model_size: tiny\nn_head: 3\n")
    assert "fp16 needs a GPU" in config_error("precision: fp16\n")
    assert config_error("global_batch_size: 32\n") is None
    # the example config file is valid; a flag overrides it, the file overrides the defaults
    args = training.parse_args(["--config", str(CHAPTER / "ddp_training.yaml"), "--steps", "7"])
    assert (args.steps, args.checkpoint_every, args.resume) == (7, 20, "latest")
    assert training.world_size_error(args, SimpleNamespace(world_size=4, device=cpu)) is None
    # only rank 0 reads the file (the others get its settings by broadcast): a missing file elsewhere is no error
    monkeypatch.setenv("RANK", "1")
    assert training.parse_args(["--config", str(tmp_path / "missing.yaml")]).steps == 200

    # The other chapter scripts' counts and rates, the same way.
    spawn, scratch = load_script(CHAPTER / "ddp_spawn.py"), load_script(CHAPTER / "ddp_from_scratch.py")
    bench, validate = load_script(CHAPTER / "ddp_benchmark.py"), load_script(CHAPTER / "validate_distributed.py")
    for parse, argv, expected in [
        (spawn.parse_args, ["--nproc", "0"], "argument --nproc: must be a positive integer, got 0"),
        (spawn.parse_args, ["--nproc", "3"], "--nproc 3 must divide --global-batch-size 32"),
        (spawn.parse_args, ["--lr", "0"], "argument --lr: must be a positive number, got 0"),
        (scratch.parse_args, ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (scratch.parse_args, ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
        (scratch.parse_args, ["--bucket-cap-mb", "-1"], "argument --bucket-cap-mb: must be a number >= 0, got -1"),
        (scratch.parse_args, ["--bucket-mb", "1"], "unrecognized arguments: --bucket-mb 1"),  # the old name
        (bench.parse_args, ["--world-sizes", "1", "0"], "argument --world-sizes: must be a positive integer, got 0"),
        (bench.parse_args, ["--steps", "3"], "--steps 3 is too few for the scaling table's step times: it needs a "
                                             "timed step, at least --warmup-steps 2 + 2 = 4 steps"),
        (validate.parse_args, ["--numel", "0"], "argument --numel: must be a positive integer, got 0"),
    ]:
        assert expected in parse_error(monkeypatch, capsys, parse, argv)


def dead_pid() -> int:
    """The PID of a process that has already exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_auto_resume_skips_an_empty_checkpoint_and_removes_stale_temporaries(tmp_path):
    """A restart loop must not die on what a crash left behind: an empty newest ``step_*.pt`` is
    skipped with a warning (the previous good one is used), a torn temporary whose writer is dead is
    removed before the first save, and one whose writer still runs is left alone."""
    ck = tmp_path / "ck"
    flags = ["--model-size", "tiny", "--global-batch-size", "4", "--checkpoint-every", "2",
             "--checkpoint-dir", ck, "--log-dir", tmp_path / "logs", "--results", tmp_path / "r.jsonl"]
    python(TRAINING, *flags, "--steps", "2", env=job_env(tmp_path), timeout=240)
    (ck / "step_000004.pt").touch()  # a save that never got its bytes (a full disk, a bad copy)
    host = socket.gethostname()
    dead = ck / f"step_000004.pt.tmp.{host}.{dead_pid()}.abc123"
    live = ck / f"step_000004.pt.tmp.{host}.{os.getpid()}.def456"  # this test process: alive
    for tmp in (dead, live):
        tmp.write_bytes(b"half a checkpoint")
    out = python(TRAINING, *flags, "--steps", "4", env=job_env(tmp_path), timeout=240)
    assert f"skipping checkpoint {ck / 'step_000004.pt'} is empty (0 bytes)" in out.stdout
    assert f"resumed from {ck / 'step_000002.pt'} at step 2" in out.stdout
    assert f"removed {dead}" in out.stdout and not dead.exists()
    assert live.exists()
    assert torch.load(ck / "step_000004.pt", weights_only=True)["step"] == 4  # the empty file was replaced


def test_launch_ddp_counts_only_visible_gpus_and_checks_its_options(tmp_path):
    """`launch_ddp.sh` counts GPUs as the workers will see them: with CUDA_VISIBLE_DEVICES empty (as
    every CPU-suite job has it, on a GPU host too) it launches 4 CPU ranks, never one per hidden GPU."""
    launcher = CHAPTER / "launch_ddp.sh"
    env = job_env(tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    out = run(["bash", str(launcher), "--dry-run", str(TRAINING)], env=env)
    assert "no GPU: CPU + gloo" in out.stdout and "--nproc_per_node=4" in out.stdout
    out = run(["bash", str(launcher), "--dry-run", "--nnodes", "2", "--join-timeout", "45", str(TRAINING)], env=env)
    assert "--rdzv-conf=join_timeout=45" in out.stdout
    for options, expected in [(["--nnodes", "two"], "--nnodes must be an integer >= 1, got 'two'"),
                              (["--join-timeout", "0"], "--join-timeout must be an integer >= 1, got '0'"),
                              (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must be below --nnodes 2"),
                              (["--nproc", "0"], "--gpus/--nproc must be a positive integer or auto"),
                              (["--master-port", "x"], "--master-port must be an integer >= 1, got 'x'")]:
        result = run(["bash", str(launcher), "--dry-run", *options, str(TRAINING)], env=env, check=False)
        assert_one_line_error(result, expected)
    result = run(["bash", str(launcher), "--dry-run", "--master-port"], env=env, check=False)
    assert_one_line_error(result, "launcher option --master-port needs a value")


JOIN_TIMEOUT_S = 5


def start_two_of_three_nodes(folder: Path) -> tuple[list[subprocess.CompletedProcess], float]:
    """`launch_ddp.sh --nnodes 3`, but only 2 agents start; returns their results and the wall time."""
    port = free_port()
    argv = lambda rank: ["bash", str(CHAPTER / "launch_ddp.sh"), "--nnodes", "3", "--node-rank", str(rank),
                         "--master-port", str(port), "--join-timeout", str(JOIN_TIMEOUT_S), "--nproc", "1",
                         str(TRAINING), "--model-size", "tiny", "--steps", "1"]
    started = time.monotonic()
    # run()'s timeout is the bound: agents that waited for the default join timeout would hit it.
    with ThreadPoolExecutor(max_workers=2) as pool:
        agents = list(pool.map(lambda rank: run(argv(rank), env=job_env(folder), timeout=JOIN_TIMEOUT_S + 90,
                                                check=False), (0, 1)))
    return agents, time.monotonic() - started


def test_missing_node_ends_the_rendezvous_with_one_line(background):
    """Both agents end after the join timeout with a non-zero exit and one line saying why, instead
    of waiting silently for torchrun's default 600 s."""
    agents, took = background["missing_node"].result()
    print(f"both agents ended after {took:.1f} s (join timeout {JOIN_TIMEOUT_S} s)")
    for rank, agent in enumerate(agents):
        assert f"node {rank} of 3: waiting up to {JOIN_TIMEOUT_S} s" in agent.stdout
        assert agent.returncode != 0
        errors = [line for line in agent.stdout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "rendezvous" in errors[0], agent.stdout[-3000:]
    assert any(f"not all 3 nodes joined within {JOIN_TIMEOUT_S} s" in agent.stdout for agent in agents)


def worker_pids(agent_pid: int) -> dict[int, int]:
    """``{global rank: pid}`` of the workers a torchrun agent started (its children's RANK)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            env = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if "RANK" in env:
            ranks[int(env["RANK"])] = int(entry.name)
    return ranks


STOP_TIMEOUT_S = 5


def stop_a_rank(folder: Path) -> tuple[subprocess.CompletedProcess, int]:
    """A 2-rank training job whose rank 1 gets SIGSTOP once it has trained a step; returns the job's
    result and rank 1's PID."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAINING),
           "--model-size", "tiny", "--global-batch-size", "4", "--steps", "100000", "--checkpoint-every", "100000",
           "--log-every", "1", "--timeout-s", str(STOP_TIMEOUT_S), "--checkpoint-dir", str(folder / "ck"),
           "--log-dir", str(folder / "logs"), "--results", str(folder / "r.jsonl")]
    agent = subprocess.Popen(cmd, env=job_env(folder), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    rank1_log = folder / "logs" / "rank1.log"
    try:
        deadline = time.monotonic() + 300
        while not (rank1_log.exists() and "step 1/" in rank1_log.read_text()):  # rank 1 trained a step
            assert agent.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        rank1 = worker_pids(agent.pid)[1]
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, _ = agent.communicate(timeout=STOP_TIMEOUT_S + 30 + 120)
        print(f"job ended {time.monotonic() - stopped_at:.1f} s after SIGSTOP (--timeout-s {STOP_TIMEOUT_S})")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.communicate()
    return subprocess.CompletedProcess(cmd, agent.returncode, out, ""), rank1


def test_stopped_rank_ends_the_job_after_the_timeout_and_torchruns_grace(background):
    """A rank that stops responding (SIGSTOP: a hung node, a debugger) is not a crash: the others
    wait in their collective until --timeout-s, rank 0 then ends with one line, and torchrun's
    SIGTERM cannot stop a stopped process, so torchrun waits its 30 s grace and SIGKILLs it."""
    result, rank1 = background["stopped_rank"].result()
    out = result.stdout
    assert result.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: [rank 0] a collective timed out: a peer rank died, hung or never arrived")
    assert f"Timed out waiting {STOP_TIMEOUT_S * 1000}ms" in errors[0]
    # torchrun's SIGTERM (15) cannot end a stopped process; after its 30 s grace it sends SIGKILL (9).
    assert f"Sending process {rank1} closing signal SIGTERM" in out
    assert f"Unable to shutdown process {rank1} via 15, forcefully exiting via 9" in out


def test_recovery_table_in_readme_is_generated_from_the_record(tmp_path):
    """The README's recovery table is what `recovery_report.py` prints from the committed record
    (its render mark, recovery_report.readme_table, gives the same table), and every record line
    says what was run, where and when."""
    record = [json.loads(line) for line in (CHAPTER / "records" / "recovery_times.jsonl").read_text().splitlines()
              if line]
    assert record
    for entry in record:
        assert {"command", "machine", "torch_version", "date", "phases_s", "bit_identical",
                "max_abs_diff_vs_uninterrupted"} <= entry.keys()
    newest = [e for e in record if e["session"] == record[-1]["session"]]
    assert {e["config"] for e in newest} == {"default flags", "--find-unused-parameters"}
    assert all(e["bit_identical"] for e in newest if e["config"] == "--find-unused-parameters")
    printed = run(readme_argv("recovery_report.py"), env=job_env(tmp_path)).stdout.strip()
    report = load_script(CHAPTER / "recovery_report.py")
    assert printed == report.table(record)
    text = README.read_text()
    begin = "<!-- render: recovery_report.py:readme_table -->\n"
    assert text[text.index(begin) + len(begin):].startswith(printed + "\n"), (
        "run: python -m distkit.records render 01-ddp-basics")
