"""Chapter 01 tools and bad input: every README command runs (small flags appended), the validation
script, the scaling benchmark, the launchers, and one clear error line for each bad input."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
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
        ([TRAINING, *common], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy_port)}, "already in use"),
        ([TRAINING, "--backend", "nccl", *common], {}, "no NCCL"),
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

    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            # validate_distributed reports a missing backend as a FAIL line with a hint, exit 1.
            validate = pool.submit(python, CHAPTER / "validate_distributed.py", "--backend", "nccl",
                                   env=job_env(tmp_path), timeout=240, check=False)
            results = list(pool.map(attempt, cases))
            validated = validate.result()
    finally:
        busy.close()
    for (argv, _, expected), result in zip(cases, results):
        assert_one_line_error(result, expected)
    assert validated.returncode == 1 and "FAIL  process group" in validated.stdout and "hint:" in validated.stdout
