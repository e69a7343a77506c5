"""The reader's path leaves the repository as it found it: every file a README command writes lies
where git ignores it (``runs/``, ``checkpoints/``, ``data/``, ...), never in a committed record.

For each bash command of every README, the script it runs is imported and its own argument parser
parses the command's flags (``argparse.ArgumentParser.parse_args`` is wrapped to stop the script right
after parsing, so nothing runs). Every output the parsed flags name (results, records, checkpoints,
logs, plots, exports, downloads; the defaults included) must be ignored by git (``git check-ignore``).
A negative control: a command that passes a committed record as ``--results`` fails the check.

And one reader is played for real: the quick start runs, as the README writes it, in a fresh clone of
this working tree (conftest.first_command_run), and the clone's ``git status`` is empty afterwards,
while the run's outputs exist in it (under ``runs/``, ``checkpoints/``, ``data/``). Negative control:
a file left where git does not ignore it shows in the same check.

Maintainer commands are the exception, named here: ``python -m distkit.records`` (recording and
rendering write the committed records and figures by design).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch import (
    QUICK_START_FILES,
    REPO,
    changed_files,
    chapter_documents,
    load_script,
    readme_commands,
    tree_changes,
    tree_state,
)

# the repository's documents for the reader (not a tool's, such as .pytest_cache/README.md, which comes
# and goes with a run): each chapter's README and its own documents, then the top README
FOLDERS_WITH_README = sorted(p.parent.name for p in REPO.glob("*/README.md") if not p.parent.name.startswith("."))
READMES = [doc for chapter in FOLDERS_WITH_README for doc in chapter_documents(chapter)] + [REPO / "README.md"]
# argparse destinations that name something a run writes
FILES = {"results", "record", "save", "log_file", "plot", "bandwidth_records", "export"}
FOLDERS = {"checkpoint_dir", "log_dir", "out_dir", "plots_dir", "out", "dest", "hf_out", "hf_in", "data_dir",
           "save_dir"}
MAINTAINER = ("-m distkit.records",)
# scripts whose --results names records they read, not write
READS_RESULTS = {"plot_results.py", "plot.py", "make_strategies_table.py"}


class Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        super().__init__("parsed")
        self.namespace = namespace


def script_and_args(command: str) -> tuple[Path, list[str]] | None:
    """The repository script a README command runs (after its launcher) and the script's flags;
    None for a command that runs none (sbatch, a shell loop)."""
    argv = shlex.split(command)
    for i, token in enumerate(argv):
        path = REPO / token
        if token.endswith(".py") and path.is_file():
            return path, argv[i + 1:]
        if token.endswith(".sh") and path.is_file():  # launch_ddp.sh NPROC... script.py flags
            return script_and_args(shlex.join(argv[i + 1:]))
    return None


def parsed_flags(script: Path, args: list[str]) -> argparse.Namespace:
    """What the script's own parser makes of ``args``, the script stopped right after parsing."""
    original = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args_=None, namespace=None):
        raise Parsed(original(self, args_, namespace))

    argv, cwd = sys.argv, os.getcwd()
    sys.argv = [str(script), *args]
    argparse.ArgumentParser.parse_args = stop_after_parsing
    try:
        os.chdir(REPO)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            module = load_script(script)
            for entry in ("parse_args", "main"):
                if hasattr(module, entry):
                    getattr(module, entry)()
    except Parsed as parsed:
        return parsed.namespace
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = argv
        os.chdir(cwd)
    raise AssertionError(f"{script.name} parsed no arguments")


def outputs(namespace: argparse.Namespace, script: str = "") -> list[str]:
    """Every path the parsed flags say the run writes (a template cut at its first ``{``; a folder
    as a file inside it, ``FOLDER/.``, which git's folder rules such as ``data/`` match)."""
    found = []
    for dest, value in vars(namespace).items():
        if dest == "results" and script in READS_RESULTS:
            continue
        for item in value if isinstance(value, list) else [value]:
            if dest in FILES | FOLDERS and isinstance(item, (str, os.PathLike)) and str(item) not in ("", "none"):
                path = str(item).split("{")[0] or "."
                found.append(f"{path.rstrip('/')}/." if dest in FOLDERS else path)
    return found


def not_ignored(paths: list[str]) -> list[str]:
    """Those of ``paths`` (relative to the repository root) that git would show as changes."""
    inside = [p for p in paths if Path(REPO, p).resolve().is_relative_to(REPO)]
    if not inside:
        return []
    done = subprocess.run(["git", "check-ignore", "--no-index", *inside], cwd=REPO, capture_output=True, text=True)
    ignored = set(done.stdout.splitlines())
    return [p for p in inside if p not in ignored]


def reader_commands() -> list[tuple[str, str]]:
    return [(str(readme.relative_to(REPO)), command) for readme in READMES for command in readme_commands(readme)
            if not any(m in command for m in MAINTAINER)]


def check_command(command: str) -> list[str]:
    found = script_and_args(command)
    if found is None:
        return []
    script, args = found
    return not_ignored(outputs(parsed_flags(script, args), script.name))


def test_every_readme_command_writes_only_where_git_ignores():
    problems = []
    for readme, command in reader_commands():
        bad = check_command(command)
        if bad:
            problems.append(f"{readme}: {command}\n    writes {bad}")
    assert not problems, "\n" + "\n".join(problems)
    assert len(reader_commands()) > 60  # every chapter's commands were read


def test_negative_control_a_committed_record_as_results_fails():
    command = ("torchrun --nproc_per_node=4 02-fsdp/fsdp_transformer.py --steps 30 "
               "--results 02-fsdp/records/fsdp_strategies.jsonl")
    assert check_command(command) == ["02-fsdp/records/fsdp_strategies.jsonl"]
    # and a default that points into the repository is seen too
    assert check_command("python 05-advanced/plot_results.py --out-dir 05-advanced") == ["05-advanced/."]


@pytest.mark.parametrize("path, ignored", [("runs/x.jsonl", True), ("checkpoints/a/b.pt", True),
                                           ("01-ddp-basics/records/outputs.jsonl", False)])
def test_git_check_ignore_reads_the_repository_rules(path, ignored):
    assert (not_ignored([path]) == []) == ignored


def test_the_quick_start_in_a_fresh_clone_leaves_it_as_it_was(first_command_run):
    clone, done = first_command_run
    assert "done: test accuracy" in done.stdout
    assert all((clone / path).exists() for path in QUICK_START_FILES.values()), sorted(p.name for p in clone.iterdir())
    assert changed_files(clone) == []


def test_a_file_left_where_git_does_not_ignore_shows_in_the_status(tmp_path):
    """Negative control of the clone's check (here and in tests/test_reader_play.py), in a repository
    of its own with this one's .gitignore (the played clone is shared by the session's workers): an
    output written beside the script instead of under runs/ shows; one under runs/ does not."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(tmp_path)]
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "results.jsonl").write_text("{}\n")
    assert changed_files(tmp_path) == []
    (tmp_path / "01-ddp-basics").mkdir()
    (tmp_path / "01-ddp-basics" / "results.jsonl").write_text("{}\n")
    assert changed_files(tmp_path) == ["?? 01-ddp-basics/results.jsonl"]


def test_the_session_check_sees_what_a_run_leaves_behind(tmp_path):
    """The whole suite runs every README command (each chapter's coverage test names the test that
    runs it), and conftest.pytest_sessionfinish fails the session if the working tree then differs
    from its state at the start (``tree_state``/``tree_changes``). What that check sees, in a small
    repository: a new file outside what git ignores, a committed file rewritten, and a file that was
    already changed before the session and is written again; not an output under ``runs/``. Negative
    control: an untouched tree shows nothing."""
    repo = tmp_path / "repo"
    (repo / "records").mkdir(parents=True)
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "records" / "r.jsonl").write_text("{}\n")
    (repo / "edited.txt").write_text("committed\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "start"], check=True)
    (repo / "edited.txt").write_text("changed before the session\n")
    before = tree_state(repo)
    assert tree_changes(before, repo) == []
    (repo / "runs").mkdir()
    (repo / "runs" / "out.jsonl").write_text("{}\n")
    assert tree_changes(before, repo) == []  # ignored: where README commands write
    (repo / "records" / "r.jsonl").write_text('{"a": 1}\n')
    (repo / "stray.jsonl").write_text("{}\n")
    (repo / "edited.txt").write_text("written again by a test\n")
    assert tree_changes(before, repo) == [" M edited.txt", " M records/r.jsonl", "?? stray.jsonl"]


# argparse destinations that name something a run reads (files or folders); an explicit --resume latest reads
# --checkpoint-dir (the default latest of ddp_training.py starts afresh when there is nothing to resume)
INPUTS = {"resume", "load", "hf_in", "hf_config", "deepspeed_config", "config", "offload_config", "baseline_config",
          "bandwidth_records", "have", "wheels"}


def inputs(namespace: argparse.Namespace, script: str = "", args: list[str] = ()) -> list[str]:
    """Every path the parsed flags say the run reads: the INPUTS flags' values (``--hf-in`` unless
    ``--create-hf-in`` makes it), ``--results`` of a script that reads records, and
    ``--checkpoint-dir`` under an explicit ``--resume latest``."""
    found = []
    for dest, value in vars(namespace).items():
        reads = (dest in INPUTS and not (dest == "hf_in" and getattr(namespace, "create_hf_in", False))) \
            or (dest == "results" and script in READS_RESULTS)
        for item in value if isinstance(value, list) else [value]:
            if reads and isinstance(item, (str, os.PathLike)) and str(item) not in ("", "none", "latest", "auto"):
                found.append(str(item))
    if "--resume" in args and namespace.resume == "latest" and getattr(namespace, "checkpoint_dir", None):
        found.append(str(namespace.checkpoint_dir))
    return found


def unmet_inputs(commands: list[str]) -> list[str]:
    """Walking ``commands`` in order, as a reader does: each input that is neither in the repository
    nor written by an earlier command (a file it names, or inside a folder it names; a ``{template}``
    matches any filling) is reported as ``command: path``."""
    written: list[str] = []
    problems = []
    for command in commands:
        found = script_and_args(command)
        if found is None:
            continue
        script, args = found
        namespace = parsed_flags(script, args)
        for path in inputs(namespace, script.name, args):
            template = path.split("{")[0]
            made = any(path == w or template.startswith(w.rstrip(".").rstrip("/") + "/") or w.startswith(template)
                       for w in written if w)
            if not (made or (REPO / path).exists() or Path(path).is_absolute() and Path(path).exists()):
                problems.append(f"{command}: reads {path}, which no earlier command writes")
        written += [w.removesuffix("/.") for w in outputs(namespace, script.name)]
    return problems


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_each_readme_command_reads_only_what_is_committed_or_written_before(readme):
    """A reader runs a README's commands top to bottom: a command that reads a file (records to
    plot, a checkpoint to resume or load, a config) finds it in the repository or written by a
    command above it, as the README's order has it."""
    commands = [c for c in readme_commands(readme) if not any(m in c for m in MAINTAINER)]
    assert unmet_inputs(commands) == []


def test_negative_control_a_command_reading_what_nothing_wrote_is_seen():
    """The failure a reader met: the strategies table from a results file no command above wrote;
    the same pair in the right order, and a committed input, pass."""
    table = "python 02-fsdp/make_strategies_table.py --results runs/my_strategies.jsonl"
    sweep = "torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --steps 3 --results runs/my_strategies.jsonl"
    assert unmet_inputs([table]) == [f"{table}: reads runs/my_strategies.jsonl, which no earlier command writes"]
    assert len(unmet_inputs([table, sweep])) == 1 and unmet_inputs([sweep, table]) == []
    committed = "python 02-fsdp/make_strategies_table.py --results 02-fsdp/records/fsdp_strategies.jsonl"
    assert unmet_inputs([committed]) == []
