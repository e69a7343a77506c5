"""The top README's commands: the quick start runs as written (on the offline sample), and its
output block is the recorded run of exactly that command.

Its ``records check`` over the whole repository is exactly ``tests/test_records.py::
test_every_figure_in_the_repository_matches_its_record``, and CONTRIBUTING.md's maintainer commands
are ``records run`` (its example is checked below) and ``render``, which rewrites committed files (a
test must not); those two are only found here (every command of either file has a lookup below, so a
new command cannot slip through untested).
"""
import shlex

from launch import QUICK_START_FILES, REPO, assert_readme_covered, readme_command

README = REPO / "README.md"
CONTRIBUTING = REPO / "CONTRIBUTING.md"
QUICK_START = "01-ddp-basics/ddp_mnist.py"
RECORDS_CHECK = "python -m distkit.records check"
# "On an offline GPU node" and the GPU check: tests/test_offline_install.py and tests/test_gpu_check.py
OFFLINE_COMMANDS = ["distkit/offline.py download", "distkit/offline.py install", "benchmarks/gpu_check.py"]
DECISION_MATRIX = "benchmarks/plan.py --decision-matrix"  # "Which one for my model?", checked below

# CONTRIBUTING.md's maintainer commands
RECORDS_RENDER = "python -m distkit.records render"
RECORD_RUN = "python -m distkit.records run"  # the recording example, checked below


def test_every_readme_command_has_a_test():
    assert_readme_covered(README, [QUICK_START, RECORDS_CHECK, *OFFLINE_COMMANDS, DECISION_MATRIX])
    assert readme_command(README, RECORDS_CHECK) == RECORDS_CHECK  # exactly, with no folder: the whole repository


def test_every_contributing_command_is_covered():
    assert_readme_covered(CONTRIBUTING, [RECORDS_RENDER, RECORD_RUN])
    assert readme_command(CONTRIBUTING, RECORDS_RENDER) == RECORDS_RENDER  # no folder: the whole repository


def test_quick_start_command_runs(first_command_run):
    """conftest.py runs this command once, as written, under the real torchrun in a fresh clone
    (--offline appended); tests/test_ddp_mnist.py checks the same run's accuracy and records."""
    command = readme_command(README, QUICK_START)
    assert command == "torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py"
    folder, result = first_command_run
    assert "done: test accuracy" in result.stdout and (folder / QUICK_START_FILES["model"]).exists(), \
        result.stdout[-2000:]


def test_the_quick_start_output_is_the_recorded_run_of_its_command():
    """The output block under the quick start is the record of exactly the README's command, a
    successful run, and the README names where it ran."""
    from distkit.records import find
    from distkit.shown_output import shown

    record = find(REPO / "records" / "outputs.jsonl", "ddp_mnist")
    assert record["command"] == readme_command(README, QUICK_START)
    assert record["returncode"] == 0 and "done: test accuracy" in record["output"]
    readme = README.read_text()
    block = readme[readme.index("<!-- output: records/outputs.jsonl ddp_mnist -->"):]
    assert shown(record) in block[:block.index("<!-- /output -->")]  # as distkit/shown_output.py shows it


def test_the_recording_example_records_the_chapters_own_command():
    """CONTRIBUTING.md's ``records run --keep`` example runs exactly chapter 02's README command
    (which writes under runs/), keeps that file as the committed record the chapter's table is drawn
    from, and is how that record was made (its output record holds the same command and keep)."""
    import shlex

    from distkit.records import find, parse_keep

    argv = shlex.split(readme_command(CONTRIBUTING, RECORD_RUN))
    rest = argv[argv.index("--") + 1:]
    into, name, keep = (argv[argv.index(flag) + 1] for flag in ("--into", "--name", "--keep"))
    chapter = readme_command(REPO / "02-fsdp" / "README.md", "fsdp_transformer.py --sharding")
    assert rest == [chapter]
    (source, target), = parse_keep([keep])
    assert f"--results {source}" in chapter and target == "02-fsdp/records/fsdp_strategies.jsonl"
    record = find(REPO / into, name)
    assert record["command"] == chapter and record["keep"] == [[source, target]]


def test_the_decision_matrix_prints_its_recorded_output(capsys):
    """The planner launches nothing and is deterministic: the README's command, run here in this process,
    prints exactly the recorded block (the torchvision note aside, on stderr). What the table's picks
    mean is checked in tests/test_planner.py (test_the_decision_matrix_picks_are_the_planners)."""
    from distkit.records import find
    from launch import load_script

    argv = shlex.split(readme_command(README, DECISION_MATRIX))  # run here, in this process
    load_script(REPO / "benchmarks" / "plan.py").main(argv[2:])
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    recorded = find(REPO / "records" / "outputs.jsonl", "decision_matrix")
    assert recorded["command"] == readme_command(README, DECISION_MATRIX)
    assert printed == [line.rstrip() for line in recorded["output"].splitlines() if not line.startswith("note:")]


def test_the_layout_and_the_package_docstring_name_every_distkit_module():
    """The top README's Layout and ``distkit/__init__.py``'s docstring name every module of the package
    (a new module that neither names fails here). Negative control: a module name that does not exist
    is missing from both."""
    import re

    import distkit

    layout = README.read_text().split("## Layout", 1)[1]
    modules = sorted(p.stem for p in (REPO / "distkit").glob("*.py") if p.stem != "__init__") + ["planner"]

    def unnamed(names):
        return [m for m in names if not re.search(rf"\b{m}\b", layout)
                or f"distkit.{m}" not in distkit.__doc__]

    assert unnamed(modules) == []
    assert unnamed(["no_such_module"]) == ["no_such_module"]
