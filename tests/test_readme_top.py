"""The top-level README's commands run as written (with small flags appended so they are quick)."""
import shlex

from launch import REPO, command_argv, job_env, readme_commands, run

# Appended to each README command in tests; argparse keeps the last value of a repeated flag.
SMALL_FLAGS = {"01-ddp-basics/ddp_mnist.py": "--epochs 1 --max-steps 3 --offline"}


def as_test_command(command: str, tmp_path) -> list[str]:
    """A README command with this interpreter, a private rendezvous port and small flags."""
    words = command_argv(command)
    script = next(w for w in words if w.endswith(".py") and not w.startswith("-"))
    assert script in SMALL_FLAGS, f"README command {command!r} has no small-flag entry in this test"
    return words + shlex.split(SMALL_FLAGS[script]) + [
        "--data-dir", str(tmp_path / "data"), "--results", str(tmp_path / "r.jsonl"),
        "--checkpoint", str(tmp_path / "m.pt"), "--log-file", str(tmp_path / "log.txt")]


def test_quick_start_commands_run(tmp_path):
    commands = readme_commands(REPO / "README.md")
    assert "torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py" in commands
    for command in commands:
        result = run(as_test_command(command, tmp_path), env=job_env(tmp_path), timeout=300)
        assert "done: test accuracy" in result.stdout, command
