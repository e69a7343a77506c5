"""Chapter 01 tools and bad input: every README command runs (small flags appended), the validation
script, the scaling benchmark, the launchers, and one clear error line for each bad input."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from distkit.checkpoint import atomic_save
from distkit.harness import read_records
from launch import REPO, assert_one_line_error, job_env, python, readme_commands, run
from test_ch01_ddp import README, readme_argv

CHAPTER = REPO / "01-ddp-basics"
TRAINING = CHAPTER / "ddp_training.py"
# Every README command must contain one of these; each is run by the test named next to it.
COVERED = {
    "ddp_mnist.py": "test_ddp_mnist_readme_command",
    "ddp_from_scratch.py": "test_ch01_ddp::test_ddp_and_ddp_from_scratch_match_single_process",
    "--config": "test_ch01_ddp (uninterrupted fixture)",
    "--crash-at-step": "test_ch01_ddp::test_killed_rank_restarts_and_ends_identical",
    "--crash-in-checkpoint-at-step": "test_ch01_ddp::test_kill_while_writing_checkpoint_keeps_previous_one",
    "--nnodes=2": "test_ch01_ddp::test_two_agents_as_two_nodes_match_one_agent",
    "validate_distributed.py": "test_validate_distributed",
    "ddp_benchmark.py": "test_scaling_benchmark",
    "launch_ddp.sh": "test_launchers",
    "ddp_spawn.py": "test_launchers",
    "recovery_report.py": "test_recovery_table_in_readme_is_generated_from_the_record",
}


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands(README)
    assert commands, "no commands found in the chapter README"
    for command in commands:
        assert any(key in command for key in COVERED), f"README command run by no test: {command}"
    for key in COVERED:
        assert any(key in c for c in commands), f"{key} is no longer in the README: update COVERED"


def test_ddp_mnist_readme_command(tmp_path):
    out = run([*readme_argv("ddp_mnist.py"), "--epochs", "1", "--max-steps", "6", "--offline",
               "--data-dir", str(tmp_path / "data"), "--checkpoint", str(tmp_path / "mnist.pt"),
               "--results", str(tmp_path / "r.jsonl"), "--log-file", str(tmp_path / "mnist.log")],
              env=job_env(tmp_path), timeout=600)
    assert "done: test accuracy" in out.stdout and (tmp_path / "mnist.pt").exists()


def test_validate_distributed(tmp_path):
    out = run(readme_argv("validate_distributed.py"), env=job_env(tmp_path), timeout=600)
    lines = out.stdout.splitlines()
    for check in ("process group", "device binding", "backend gloo", "all_reduce", "all_gather", "broadcast"):
        assert any(line.startswith("PASS") and check in line for line in lines), (check, out.stdout)
    assert not any(line.startswith("FAIL") for line in lines)
    assert "MASTER_ADDR=" in out.stdout and "all checks passed" in out.stdout


def test_scaling_benchmark(tmp_path):
    results, png = tmp_path / "bench.jsonl", tmp_path / "scaling.png"
    out = run([*readme_argv("ddp_benchmark.py"), "--world-sizes", "1", "2", "--model-size", "tiny",
               "--per-rank-batch", "4", "--steps", "4", "--results", str(results), "--plot", str(png)],
              env=job_env(tmp_path), timeout=600)
    records = read_records(results)
    assert sorted((r["config"]["scaling"], r["world_size"]) for r in records) == [
        ("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)]
    for r in records:  # strong: the global batch is fixed; weak: the per-rank batch is
        expected = 8 if r["config"]["scaling"] == "strong" else 4 * r["world_size"]
        assert r["config"]["global_batch_size"] == expected and r["metrics"]["tokens_per_s"] > 0
    assert "speedup" in out.stdout and png.stat().st_size > 10_000


def test_launchers(tmp_path):
    # launch_ddp.sh (the README command with 2 processes, tiny run) and ddp_spawn.py, side by side.
    argv = readme_argv("launch_ddp.sh")
    argv[argv.index("--nproc") + 1] = "2"
    script = [*argv, "--model-size", "tiny", "--steps", "3", "--global-batch-size", "4",
              "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "logs"),
              "--results", str(tmp_path / "r.jsonl")]
    spawn = [*readme_argv("ddp_spawn.py"), "--nproc", "2", "--steps", "2", "--model-size", "tiny"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        launched, spawned = pool.map(lambda cmd: run(cmd, env=job_env(tmp_path), timeout=600), (script, spawn))
    assert "--standalone --nproc_per_node=2" in launched.stdout and "done: loss" in launched.stdout
    assert "spawned 2 processes" in spawned.stdout and "done" in spawned.stdout
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


def load_script(name: str):
    """Import a chapter script as a module (its main() does not run), to call its argument parsing."""
    spec = importlib.util.spec_from_file_location(f"ch01_{name}", CHAPTER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


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
    process group) and, for ddp_training.py, the same check applies to config-file values."""
    training = load_script("ddp_training")
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
    ]:
        assert expected in parse_error(monkeypatch, capsys, training.parse_cli, argv)

    def config_error(text: str, world_size: int = 4, *flags: str) -> str:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        monkeypatch.setattr(sys, "argv", ["ddp_training.py", "--config", str(path), *flags])
        with pytest.raises(training.UsageError) as exc:
            training.build_config(training.parse_cli(), world_size)
        return str(exc.value)

    assert config_error("global_batch_size: 0\n").endswith("global_batch_size: must be a positive integer, got 0")
    assert config_error("grad_accum_steps: 0\n").endswith("grad_accum_steps: must be a positive integer, got 0")
    assert config_error("base_batch_size: -32\n").endswith("must be a positive integer, got -32")
    assert config_error("lr: -1\n").endswith("lr: must be a positive number, got -1")
    assert config_error("log_every: 0\n").endswith("log_every: must be a positive integer, got 0")
    assert config_error("steps: 2.5\n").endswith("steps: must be a positive integer, got '2.5'")
    assert config_error("static_graph: 1\n").endswith("'static_graph' must be true or false, got 1")
    assert config_error("precision: fp8\n").endswith("'precision' must be one of ['fp32', 'bf16', 'fp16'], got 'fp8'")
    assert "must be at least --global-batch-size 32" in config_error("num_sequences: 16\n")
    assert "must divide by world size x --grad-accum-steps = 12" in config_error("grad_accum_steps: 3\n")
    assert "--crash-rank 4 is not a rank of this 4-rank job" in config_error("crash_at_step: 3\ncrash_rank: 4\n")
    assert "must be divisible by the head count 3" in config_error("model_size: tiny\nn_head: 3\n")
    # the example config file is valid; a flag overrides it
    monkeypatch.setattr(sys, "argv", ["ddp_training.py", "--config", str(CHAPTER / "ddp_training.yaml"),
                                      "--steps", "7"])
    assert training.build_config(training.parse_cli(), 4).steps == 7

    # The other chapter scripts' counts and rates, the same way.
    spawn, scratch, bench = load_script("ddp_spawn"), load_script("ddp_from_scratch"), load_script("ddp_benchmark")
    validate = load_script("validate_distributed")
    for parse, argv, expected in [
        (spawn.parse_args, ["--nproc", "0"], "argument --nproc: must be a positive integer, got 0"),
        (spawn.parse_args, ["--nproc", "3"], "--nproc 3 must divide --global-batch-size 32"),
        (spawn.parse_args, ["--lr", "0"], "argument --lr: must be a positive number, got 0"),
        (scratch.parse_args, ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (scratch.parse_args, ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
        (scratch.parse_args, ["--bucket-mb", "-1"], "argument --bucket-mb: must be a number >= 0, got -1"),
        (bench.parse_args, ["--world-sizes", "1", "0"], "argument --world-sizes: must be a positive integer, got 0"),
        (bench.parse_args, ["--steps", "3"], "--steps 3 must be > --warmup-steps + 1 = 3"),
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


def test_missing_node_ends_the_rendezvous_with_one_line(tmp_path):
    """`--nnodes 3` but only 2 agents start: both end after the join timeout with a non-zero exit
    and one line saying why, instead of waiting silently for torchrun's default 600 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    join_timeout = 5
    argv = lambda rank: ["bash", str(CHAPTER / "launch_ddp.sh"), "--nnodes", "3", "--node-rank", str(rank),
                         "--master-port", str(port), "--join-timeout", str(join_timeout), "--nproc", "1",
                         str(TRAINING), "--model-size", "tiny", "--steps", "1"]
    started = time.monotonic()
    # run()'s timeout is the bound: agents that waited for the default join timeout would hit it.
    with ThreadPoolExecutor(max_workers=2) as pool:
        agents = list(pool.map(lambda rank: run(argv(rank), env=job_env(tmp_path), timeout=join_timeout + 60,
                                                check=False), (0, 1)))
    print(f"both agents ended after {time.monotonic() - started:.1f} s (join timeout {join_timeout} s)")
    for rank, agent in enumerate(agents):
        assert f"node {rank} of 3: waiting up to {join_timeout} s" in agent.stdout
        assert agent.returncode != 0
        errors = [line for line in agent.stdout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "rendezvous" in errors[0], agent.stdout[-3000:]
    assert any(f"not all 3 nodes joined within {join_timeout} s" in agent.stdout for agent in agents)


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


def test_stopped_rank_ends_the_job_after_the_timeout_and_torchruns_grace(tmp_path):
    """A rank that stops responding (SIGSTOP: a hung node, a debugger) is not a crash: the others
    wait in their collective until --timeout-s, rank 0 then ends with one line, and torchrun's
    SIGTERM cannot stop a stopped process, so torchrun waits its 30 s grace and SIGKILLs it."""
    timeout_s = 5
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAINING),
           "--model-size", "tiny", "--global-batch-size", "4", "--steps", "100000", "--checkpoint-every", "100000",
           "--timeout-s", str(timeout_s), "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "logs"),
           "--results", str(tmp_path / "r.jsonl")]
    agent = subprocess.Popen(cmd, env=job_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    events = tmp_path / "logs" / "events.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (events.exists() and '"first_step_done", "rank": 1' in events.read_text()):
            assert agent.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        rank1 = worker_pids(agent.pid)[1]
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, _ = agent.communicate(timeout=timeout_s + 30 + 90)
        print(f"job ended {time.monotonic() - stopped_at:.1f} s after SIGSTOP (--timeout-s {timeout_s})")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.communicate()
    assert agent.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: [rank 0] a collective timed out: a peer rank died, hung or never arrived")
    assert f"Timed out waiting {timeout_s * 1000}ms" in errors[0]
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
    report = load_script("recovery_report")
    assert printed == report.table(record)
    text = README.read_text()
    begin = "<!-- render: recovery_report.py:readme_table -->\n"
    assert text[text.index(begin) + len(begin):].startswith(printed + "\n"), (
        "run: python -m distkit.records render 01-ddp-basics")
