"""The top-level README's commands run as written (with small flags appended so they are quick).

Its two records commands are the exception: ``render`` rewrites committed files (a test must not),
and ``check`` over the whole repository is exactly ``tests/test_records.py::
test_every_figure_in_the_repository_matches_its_record``; here they are only checked to be those two
commands, so that a new command in the README cannot slip through untested.
"""
import shlex

from launch import REPO, command_argv, job_env, readme_commands, run

# Appended to each README command in tests; argparse keeps the last value of a repeated flag.
SMALL_FLAGS = {"01-ddp-basics/ddp_mnist.py": "--epochs 1 --max-steps 3 --offline"}
RECORDS_COMMANDS = ["python -m distkit.records render", "python -m distkit.records check"]


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
    assert [c for c in commands if "distkit.records" in c] == RECORDS_COMMANDS
    for command in commands:
        if command in RECORDS_COMMANDS:
            continue  # see the module docstring: tests/test_records.py runs the check
        result = run(as_test_command(command, tmp_path), env=job_env(tmp_path), timeout=300)
        assert "done: test accuracy" in result.stdout, command


def test_the_quick_start_output_is_the_recorded_run_of_its_command():
    """The output block under the quick start is the record of exactly the README's command, a
    successful run, and the README names where it ran."""
    from distkit.records import find

    record = find(REPO / "records" / "outputs.jsonl", "ddp_mnist")
    assert record["command"] == "torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py"
    assert record["returncode"] == 0 and "done: test accuracy" in record["output"]
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("<!-- output: records/outputs.jsonl ddp_mnist -->"):]
    assert record["output"] in block[:block.index("<!-- /output -->")]
