"""The reader, played: every README's commands, in one fresh clone (tests/spine.py).

Chapter by chapter, the play runs each README's bash commands as written, with the README's
``export`` lines, at the size the chapter's tests check them (tests/spine.py's forms, or its generic
small size); each chapter's tests assert on what its commands printed and wrote. Here, the whole
play: each command ended well (exit 0, or one distinct ``error:`` line and no traceback from the
repository's files: the promise for bad input; the README shows a few refusals on purpose; the debug
lab's scenarios fail by design and only have to end), the clone's ``git status`` is empty afterwards
(every output lies where git ignores it) and ``records check`` passes in it.

``pytest -m reader`` plays the chapters whose tests are not yet written against the play.

Negative controls: a command that ends in a traceback from a repository file fails the check a played
command must pass (:func:`test_a_command_ending_in_a_traceback_is_seen`).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from launch import REPO, changed_files, job_env
from spine import CHAPTERS, ended_well, exports, play_chapter


@pytest.mark.reader
def test_every_readme_played_in_order_in_a_fresh_clone(reader, tmp_path):
    problems = [problem for chapter in CHAPTERS for problem in play_chapter(chapter, reader).problems()]
    assert problems == [], "\n".join(problems)
    assert changed_files(reader.clone) == []
    check = subprocess.run([sys.executable, "-m", "distkit.records", "check"], cwd=reader.clone,
                           env=job_env(tmp_path, PYTHONPATH=str(reader.clone)), capture_output=True, text=True,
                           timeout=600)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


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
