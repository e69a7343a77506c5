"""The reader, played: every README's commands in one fresh clone, then the clone as the reader
leaves it (tests/spine.py plays them; each chapter's tests assert on what its commands printed and
wrote).

Every README command is played once per session (the chapters' tests read the runs they check,
tests/spine.py); this file asks for every chapter, the top README last, and checks the whole play:

* every README command was played once (but those tests/spine.py leaves out, each run by its own
  test) and ended well: exit 0, or one distinct ``error:`` line and no traceback from the
  repository's files (the promise for bad input; the READMEs show a few refusals on purpose; the
  debug lab's scenarios fail by design and only have to end);
* the clone's ``git status`` is empty afterwards: every output lies where git ignores it;
* no two chapters wrote the same file, so playing them side by side equals playing them in order;
* the top README's ``python -m distkit.records check``, played after every other command, passed in
  the clone: the committed records, tables and plots still match after everything the reader ran;
* every chapter ran at least one command fresh, every process a new interpreter as the reader's
  launcher starts it, nothing forked from the suite's fork server (whose pre-imported torch,
  FSDP, pipelining and DeepSpeed would hide an import a script forgot): chapter 01's quick start,
  the deepspeed launcher's resume in chapter 03, and one form per other chapter
  (``launcher="torchrun-fresh"``).

Each chapter's notebook executes in the clone after its chapter's commands (tests/test_notebooks.py).
``pytest -m reader`` runs the play with these checks and the notebooks alone (about 4 minutes on 2
cores).

Negative controls: a chapter whose commands all ran through the fork launcher is seen; a command
that ends in a traceback from a repository file fails the check a played command must pass
(:func:`test_a_command_ending_in_a_traceback_is_seen`); two chapters keeping the same ``--results``
are seen; a file the reader's run left where git does not ignore it shows in the clone's status
(tests/test_reader_path.py).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from launch import FORK_LAUNCHER, REPO, changed_files, chapter_commands
from spine import CHAPTERS, LEFT_OUT, Played, ended_well, exports, play_chapter
from test_reader_path import outputs, parsed_flags, script_and_args


@pytest.fixture(scope="module")
def whole_play(reader):
    """Every chapter played (by this worker, or read back from the one that played it), in order: the
    top README's last, so its ``records check`` runs after every other command."""
    return {chapter: play_chapter(chapter, reader) for chapter in CHAPTERS}


@pytest.mark.reader
def test_every_readme_command_was_played_and_ended_well(whole_play):
    for chapter, played in whole_play.items():
        expected = [c for c in chapter_commands(chapter) if not any(n in c for n in LEFT_OUT)]
        assert [run["command"] for run in played.runs] == expected, chapter
    problems = [problem for played in whole_play.values() for problem in played.problems()]
    assert problems == [], "\n".join(problems)


@pytest.mark.reader
def test_the_clone_is_left_as_the_reader_found_it(whole_play, reader):
    assert changed_files(reader.clone) == []
    assert (reader.clone / "runs" / "fsdp_strategies.jsonl").is_file()  # the reader's runs wrote there


def shared_outputs(plays: dict) -> dict[str, list[str]]:
    """The files that commands of two or more chapters wrote (each command's flags as played, parsed
    by its script's own parser, defaults included; folders left out: two chapters may put files of
    different names in ``runs/plots/``), with the chapters. A refusal writes nothing; the quick start
    is one run, shared by chapter 01 and the top README (its "played" is None)."""
    owners = defaultdict(set)
    for chapter, played in plays.items():
        for run in played.runs:
            found = script_and_args(run["played"]) if run["played"] and run["returncode"] == 0 else None
            if found is None:
                continue
            for path in outputs(parsed_flags(*found), found[0].name):
                if not path.endswith("/."):
                    owners[str(Path(path).relative_to(played.clone) if Path(path).is_absolute() else path)].add(chapter)
    return {path: sorted(chapters) for path, chapters in owners.items() if len(chapters) > 1}


@pytest.mark.reader
def test_no_two_chapters_write_the_same_file(whole_play):
    """Chapters are played side by side (tests/spine.py). That equals one reader going through them in
    order because what a command reads is committed or written above it in its own README
    (tests/test_reader_path.py) and no file is written by two chapters. Negative control: two
    chapters whose commands keep the same --results."""
    assert shared_outputs(whole_play) == {}
    clone = next(iter(whole_play.values())).clone

    def played(chapter, command):
        return Played(chapter, clone, [{"command": command, "played": command, "returncode": 0}])

    sweep = "torchrun --nproc_per_node=4 02-fsdp/fsdp_transformer.py --results runs/r.jsonl"
    overlap = "torchrun --nproc_per_node=4 05-advanced/communication_overlap.py --results runs/r.jsonl"
    assert shared_outputs({"02-fsdp": played("02-fsdp", sweep), "05-advanced": played("05-advanced", overlap)}) == {
        "runs/r.jsonl": ["02-fsdp", "05-advanced"]}


def ran_fresh(run: dict) -> bool:
    """A played command that ended well with no fork launcher in its argv: torchrun over fresh workers,
    a fresh ``python``, or a launcher of its own (the deepspeed runner, bash)."""
    return run["returncode"] == 0 and not any(FORK_LAUNCHER.name in str(word) for word in run["argv"])


def assert_one_fresh(played: Played) -> None:
    assert any(ran_fresh(run) for run in played.runs), f"{played.chapter}: no README command ran fresh"


@pytest.mark.reader
def test_every_chapter_runs_one_command_fresh(whole_play):
    """Negative control: chapter 05's play without its fresh command."""
    for played in whole_play.values():
        assert_one_fresh(played)
    chapter = whole_play["05-advanced"]
    forked = Played(chapter.chapter, chapter.clone, [run for run in chapter.runs if not ran_fresh(run)])
    assert len(forked.runs) == len(chapter.runs) - 1  # the pipeline's 2-rank command alone ran fresh
    with pytest.raises(AssertionError, match="no README command ran fresh"):
        assert_one_fresh(forked)


@pytest.mark.reader
def test_records_check_passes_after_the_reader(whole_play):
    run = whole_play["."].ok("-m distkit.records check")
    assert "every generated part matches its record" in run["stdout"], run["stdout"][-3000:]


def test_a_command_ending_in_a_traceback_is_seen(tmp_path):
    """The check a played command passes: exit 0 and a one-line refusal pass; a traceback from a
    repository file fails it, as does an exit with no error line."""
    clone = tmp_path / "clone"
    frame = f'  File "{clone}/03-deepspeed/zero_offload.py", line 156, in main'
    assert ended_well(0, "ok\n", clone) is None
    assert ended_well(2, "error: --steps 2 is too few\n", clone) is None
    assert ended_well(1, f"Traceback (most recent call last):\n{frame}\nTypeError: x\n", clone)
    assert ended_well(1, "Killed\n", clone)
    # the play runs chapter 01's restarts with the variable its README exports (without it they hang)
    assert exports(REPO / "01-ddp-basics" / "README.md")["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
