"""Every chapter notebook is committed executed, from its current cells, and still executes.

Each chapter's notebook is written as ``notebook.py`` (jupytext percent format) and committed as
``notebook.ipynb`` *with the outputs of a real run* (``python -m distkit.records render``, see
``distkit.notebooks``). These tests prove that

(a) the ``.ipynb`` holds exactly the cells of its ``notebook.py``;
(b) every code cell of the committed ``.ipynb`` was executed, and the outputs were produced by the
    current cells: the executed notebook stores the hash of the cells it ran, and a cell edited
    afterwards (without re-executing) fails the check, as the negative controls below show;
(c) the notebook executes top to bottom, headless, as a reader would run it: in the reader's clone
    (tests/spine.py), after its chapter's README commands ran there, its kernel and its jobs started
    by the suite's fork launcher (the kernel as ipykernel's launcher run with ``--python``, the jobs
    through ``$DISTKIT_TORCHRUN``), and shows the same kinds of output (text, figures) in the same
    cells as the committed one. The notebooks assert the numbers they show (against their records or
    theory), so a wrong outcome fails here as an error.
"""
from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
from pathlib import Path

import pytest

from distkit import notebooks
from launch import REPO, changed_files, forked_from_server, launcher_argv
from spine import play_chapter

SOURCES = notebooks.sources([str(REPO)])
IDS = [str(p.parent.relative_to(REPO)) for p in SOURCES]


def ipykernel_launcher() -> str:
    """ipykernel's launcher script, looked up when a notebook runs: a node installed without the notebook
    tools (``offline.py download --no-notebooks``) still collects this file in ``pytest -m gpu``."""
    return str(Path(importlib.util.find_spec("ipykernel_launcher").origin))


def _formats():
    """jupytext and nbformat, imported by the tests that use them: importing nbformat (jsonschema's
    format checkers) costs as much as importing torch, and every pytest worker collects this file."""
    import jupytext
    import nbformat

    return jupytext, nbformat


def test_every_chapter_has_a_notebook():
    chapters = {p.name for p in REPO.iterdir() if p.is_dir() and (p.name[:2].isdigit() or p.name == "benchmarks")}
    assert {p.parent.name for p in SOURCES} == chapters


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_notebook_matches_its_percent_source(source: Path):
    jupytext, nbformat = _formats()
    target = source.with_name(notebooks.NOTEBOOK_NAME)
    assert target.exists(), f"{source.name} has no executed {target.name}: run python -m distkit.records render"
    assert notebooks.cells(jupytext.read(source)) == notebooks.cells(nbformat.read(target, as_version=4)), (
        f"{target.name} and {source.name} differ: run python -m distkit.records render "
        f"{source.parent.relative_to(REPO)}")


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_committed_notebook_was_executed_from_its_current_cells(source: Path):
    assert notebooks.problems_of(source) == []


def _output_kinds(nb) -> list[tuple[int, list[str]]]:
    """Per code cell, the kinds of output it shows: printed text and the MIME types of displays and
    results (not stderr: a library warning may come and go)."""
    kinds = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        shown = set()
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                if out.get("name") == "stdout":
                    shown.add("stdout")
            else:
                shown.add("+".join(sorted(out.get("data", {}))) or out["output_type"])
        kinds.append((index, sorted(shown)))
    return kinds


def execute_and_compare(source: Path, server: str, tmp_path: Path, monkeypatch) -> None:
    """Execute ``source`` headless as a reader would, its kernel and its jobs forked from the fork
    server at ``server``, and compare it with its committed notebook: the cells it ran, and the kinds
    of output each shows."""
    jupytext, nbformat = _formats()
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's and its jobs' scratch
    # The notebooks' jobs start through the suite's fork launcher, as every other test's do (the
    # committed outputs ran under torchrun: `python -m distkit.records render`)
    monkeypatch.setenv("DISTKIT_TORCHRUN", shlex.join(launcher_argv("fork")))
    monkeypatch.setenv("FORK_LAUNCHER_SERVER", server)
    # ... and so does the kernel: the "python3" kernel found first on JUPYTER_PATH is ipykernel's own
    # launcher run by the fork launcher (`--python`), which has torch and distkit imported already (the
    # committed outputs came from a fresh kernel)
    spec = tmp_path / "jupyter" / "kernels" / "python3" / "kernel.json"
    spec.parent.mkdir(parents=True)
    spec.write_text(json.dumps({"argv": [*launcher_argv("fork"), "--python", ipykernel_launcher(), "-f",
                                         "{connection_file}"], "display_name": "Python 3", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    kernels = forked_from_server(server, "ipykernel_launcher.py")
    executed = notebooks.execute(source)         # raises NotebookError naming the failed cell
    assert forked_from_server(server, "ipykernel_launcher.py") == kernels + 1
    committed = nbformat.read(source.with_name(notebooks.NOTEBOOK_NAME), as_version=4)
    key = notebooks.METADATA_KEY
    assert executed.metadata[key]["source_sha256"] == committed.metadata.get(key, {}).get("source_sha256")
    assert _output_kinds(executed) == _output_kinds(committed), (
        "a fresh run shows other outputs than the committed notebook: run python -m distkit.records render "
        f"{source.parent.name}")


@pytest.mark.notebook
@pytest.mark.reader
@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_notebook_executes_in_the_readers_clone(source: Path, reader, fork_server, tmp_path: Path, monkeypatch):
    """The clone's notebook, executed after its chapter's README commands ran there (the reader's
    order: the commands, then the notebook; tests/spine.py), with the environment of the played jobs.
    It leaves the clone's ``git status`` empty, as the commands do (tests/test_reader_play.py)."""
    chapter = str(source.parent.relative_to(REPO))
    play_chapter(chapter, reader)
    for name, value in reader.env.items():
        monkeypatch.setenv(name, value)
    execute_and_compare(reader.clone / chapter / source.name, fork_server, tmp_path, monkeypatch)
    assert changed_files(reader.clone) == []


# ------------------------------------------------------------------------------- negative controls
@pytest.fixture
def chapter_copy(tmp_path: Path) -> Path:
    """A copy of one chapter's committed notebook pair (the check reads nothing else)."""
    source = REPO / "04-nccl-operations" / notebooks.SOURCE_NAME
    copy = tmp_path / "chapter" / notebooks.SOURCE_NAME
    copy.parent.mkdir()
    shutil.copy(source, copy)
    shutil.copy(source.with_name(notebooks.NOTEBOOK_NAME), copy.with_name(notebooks.NOTEBOOK_NAME))
    assert notebooks.problems_of(copy) == []
    return copy


def _edit_first_code_cell(text: str) -> str:
    marker = "\n# %%\n"
    at = text.index(marker) + len(marker)
    return text[:at] + "EDITED_AFTER_EXECUTION = 1\n" + text[at:]


def test_a_cell_edited_after_execution_fails_the_check(chapter_copy: Path):
    """The edit is synced into the .ipynb (as ``jupytext --sync`` would), keeping the old outputs."""
    jupytext, nbformat = _formats()
    chapter_copy.write_text(_edit_first_code_cell(chapter_copy.read_text()))
    target = chapter_copy.with_name(notebooks.NOTEBOOK_NAME)
    nb = nbformat.read(target, as_version=4)
    edited = jupytext.read(chapter_copy)
    for cell, new in zip(nb.cells, edited.cells):
        cell.source = new.source
    nbformat.write(nb, target)
    found = notebooks.problems_of(chapter_copy)
    assert len(found) == 1 and "not produced by its current cells" in found[0], found


def test_an_edited_source_without_render_fails_the_check(chapter_copy: Path):
    chapter_copy.write_text(_edit_first_code_cell(chapter_copy.read_text()))
    found = notebooks.problems_of(chapter_copy)
    assert len(found) == 1 and "cells differ" in found[0], found


def test_a_notebook_without_outputs_fails_the_check(chapter_copy: Path):
    jupytext, nbformat = _formats()
    target = chapter_copy.with_name(notebooks.NOTEBOOK_NAME)
    nb = nbformat.read(target, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, target)
    found = notebooks.problems_of(chapter_copy)
    assert len(found) == 1 and "never executed" in found[0], found
