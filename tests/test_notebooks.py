"""Every chapter notebook executes top to bottom, headless, as a reader would run it, and its
committed ``.ipynb`` holds exactly the cells of its source, the percent-format ``notebook.py`` beside
it (``jupytext --sync notebook.py`` after editing). The notebooks assert the numbers they show
(against their records or theory), so a wrong outcome fails here as an error output."""
from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

from launch import REPO

NOTEBOOKS = sorted(p for pattern in ("0*/*.ipynb", "benchmarks/*.ipynb") for p in REPO.glob(pattern)
                   if ".ipynb_checkpoints" not in p.parts)


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(REPO)) for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch):
    # The kernel inherits this environment: one thread per rank, no progress bars, scratch in tmp.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DISTKIT_NO_PROGRESS", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors


def _cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(REPO)) for p in NOTEBOOKS])
def test_notebook_matches_its_percent_source(path: Path):
    source = path.with_suffix(".py")
    assert source.exists(), f"{path.name} has no paired source {source.name} (jupytext percent format)"
    assert _cells(jupytext.read(source)) == _cells(nbformat.read(path, as_version=4)), (
        f"{path.name} and {source.name} differ: run jupytext --sync {source.relative_to(REPO)}")
