"""Chapter notebooks: executed from their percent-format source and committed with their outputs.

Each chapter has a notebook written as ``notebook.py`` (jupytext percent format: the file to edit and
review) and ``notebook.ipynb`` beside it, the same cells **executed**, so a reader browsing the
repository sees the plots and printed checks of a real run. ``python -m distkit.records render
[PATH ...]`` rewrites the ``.ipynb`` of every chapter folder under the paths (all of them without
paths) by running this module's :func:`write_executed`; ``python -m distkit.records check`` and
``tests/test_notebooks.py`` run :func:`problems`, which fails when

* a code cell of the ``.ipynb`` was never executed (no execution count, no output), or
* the cells of the ``.ipynb`` are not the cells of ``notebook.py``, or
* the outputs were produced from other cells than today's: the executed notebook stores the hash of
  the cells it ran (``metadata.distkit.source_sha256``), so a cell edited afterwards (in the ``.py``
  and synced into the ``.ipynb`` with ``jupytext --sync``, but not executed) is caught.

The kernel runs in the notebook's folder with ``OMP_NUM_THREADS=1`` (jobs share few cores),
``DISTKIT_NO_PROGRESS=1`` and a fixed hash seed. What it writes is made as reproducible as possible:
no execution timestamps, cell ids derived from the cells, PNGs without a version stamp (as
:func:`distkit.records.save_figure` writes them) at :data:`DPI` dots per inch. Figures in a notebook
are drawn from committed records, so they are the same on every run; what a notebook measures live
(it launches small jobs to check the scripts) it asserts and prints, but does not plot.

Command line (the same as ``records render``/``check`` restricted to notebooks)::

    python -m distkit.notebooks execute [PATH ...]   # re-execute and write notebook.ipynb
    python -m distkit.notebooks check [PATH ...]     # exit 1 when a notebook is stale or unexecuted
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SOURCE_NAME = "notebook.py"
NOTEBOOK_NAME = "notebook.ipynb"
METADATA_KEY = "distkit"
DPI = 80
TIMEOUT_S = 600  # per cell
# Folders never scanned for notebooks: scratch output, data, virtual environments.
_SKIP_DIRS = {"runs", "data", "checkpoints", "build", "node_modules", "site-packages", ".ipynb_checkpoints"}

# The kernel's IPython configuration: inline PNGs at DPI with no "Software" stamp (matplotlib's
# version), the same deterministic settings as distkit.records.save_figure.
_KERNEL_CONFIG = f"""
c.InlineBackend.rc = {{"figure.dpi": {DPI}}}
c.InlineBackend.figure_formats = {{"png"}}
c.InlineBackend.print_figure_kwargs = {{"bbox_inches": "tight", "metadata": {{"Software": None}}}}
"""


class NotebookError(Exception):
    """A notebook that failed to execute; the message names the cell and the error, on one line."""


# ------------------------------------------------------------------------------------------- finding
def torchrun_argv() -> list[str]:
    """The launcher a notebook's cells start their jobs with: torchrun, as this interpreter's module, or
    the single-node launcher ``$DISTKIT_TORCHRUN`` names (the test suite names its fork launcher,
    ``tests/fork_launcher.py``, which takes torchrun's flags)."""
    return shlex.split(os.environ.get("DISTKIT_TORCHRUN", "")) or [sys.executable, "-m", "torch.distributed.run"]


def sources(paths: list[str] | None = None) -> list[Path]:
    """The ``notebook.py`` of every chapter folder under ``paths`` (folders; or a notebook's own
    ``.py``/``.ipynb``); default: the whole repository. A Markdown file names no notebook."""
    roots = [Path(p) for p in paths] if paths else [REPO]
    found: list[Path] = []
    for root in roots:
        root = (root if root.is_absolute() else Path.cwd() / root).resolve()
        if root.is_file():
            if root.name in (SOURCE_NAME, NOTEBOOK_NAME):
                found.append(root.with_name(SOURCE_NAME))
            continue
        for path in sorted(root.rglob(SOURCE_NAME)):
            rel = path.relative_to(root).parts[:-1]
            if not any(p.startswith(".") or p in _SKIP_DIRS for p in rel):
                found.append(path)
    return sorted(dict.fromkeys(found))


# ------------------------------------------------------------------------------------------- hashing
def cells(nb) -> list[tuple[str, str]]:
    """What a notebook is made of for these checks: each cell's type and stripped source, in order."""
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def source_hash(nb) -> str:
    """The hash of a notebook's cells (not of outputs or metadata): what the outputs were made from."""
    return hashlib.sha256(json.dumps(cells(nb)).encode()).hexdigest()


def read_source(source: Path):
    """``notebook.py`` as a notebook (no outputs)."""
    import jupytext

    return jupytext.read(source)


# ----------------------------------------------------------------------------------------- executing
def kernel_env(ipython_dir: Path) -> dict[str, str]:
    """The kernel's environment: this one, plus one thread per process, no progress bars, a fixed
    hash seed, inline figures (never a headless ``MPLBACKEND=Agg`` that would show nothing) and an
    IPython profile holding the figure settings."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTKIT_NO_PROGRESS="1", PYTHONHASHSEED="0",
               IPYTHONDIR=str(ipython_dir), PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop("MPLBACKEND", None)
    return env


def _error_line(nb) -> str | None:
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                return f"cell {index}: {out.get('ename')}: {out.get('evalue')}"[:500]
    return None


def execute(source: Path, timeout_s: float = TIMEOUT_S):
    """Run the cells of ``source`` (a ``notebook.py``) top to bottom in a fresh kernel started in its
    folder and return the executed notebook, cleaned (:func:`clean`); :class:`NotebookError` if a
    cell fails."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    source = Path(source).resolve()
    nb = read_source(source)
    with tempfile.TemporaryDirectory(prefix="distkit-ipython-") as ipython_dir:
        profile = Path(ipython_dir) / "profile_default"
        profile.mkdir(parents=True)
        (profile / "ipython_kernel_config.py").write_text(_KERNEL_CONFIG)
        client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(source.parent)}})
        try:
            client.execute(env=kernel_env(Path(ipython_dir)), cwd=str(source.parent))
        except CellExecutionError as e:
            where = _error_line(nb) or str(e).strip().splitlines()[-1]
            raise NotebookError(f"{_rel(source)}: {where}") from None
    clean(nb)
    nb.metadata[METADATA_KEY] = _provenance(nb)
    return nb


def _provenance(nb) -> dict[str, Any]:
    """What the executed notebook stores about its run: the hash of its cells and where it ran
    (no date: re-executing the same cells on the same machine writes the same metadata)."""
    import torch

    from .provenance import machine, machine_label

    return {"source_sha256": source_hash(nb), "executed_on": machine_label(machine()),
            "torch": torch.__version__}


def clean(nb) -> None:
    """Drop what changes from run to run without meaning anything: timestamps, widget state,
    random cell ids (replaced by ids derived from the position and the source)."""
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("papermill", None)
    for index, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
        digest = hashlib.sha256(f"{index}\0{cell.cell_type}\0{cell.source}".encode()).hexdigest()
        cell["id"] = digest[:8]
        outputs = []
        for out in cell.get("outputs", []):
            out.get("metadata", {}).pop("execution", None)
            # one print split over two messages or not depends on timing: join consecutive streams
            if (outputs and out.get("output_type") == "stream" and outputs[-1].get("output_type") == "stream"
                    and outputs[-1].get("name") == out.get("name")):
                outputs[-1]["text"] += out["text"]
            else:
                outputs.append(out)
        if cell.cell_type == "code":
            cell["outputs"] = outputs


def write(nb, path: Path) -> None:
    """Write an executed notebook as ``.ipynb`` (the jupytext pairing metadata as ``jupytext`` keeps it)."""
    import jupytext

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    text = jupytext.writes(nb, fmt="ipynb")
    tmp.write_text(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def write_executed(source: Path, timeout_s: float = TIMEOUT_S) -> Path:
    """Execute ``source`` and write ``notebook.ipynb`` beside it (only when every cell ran without
    error: a failed run leaves the committed notebook as it was). Holds the records lock, so a
    notebook's jobs never run while a recorded run measures."""
    import fcntl

    from .provenance import LOCK_FILE

    with open(LOCK_FILE, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{_rel(source)}: waiting for a recorded run to finish ({LOCK_FILE})", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        nb = execute(source, timeout_s)
    target = Path(source).with_name(NOTEBOOK_NAME)
    write(nb, target)
    return target


# ------------------------------------------------------------------------------------------ checking
def problems_of(source: Path) -> list[str]:
    """Why the committed ``notebook.ipynb`` beside ``source`` is not the executed ``notebook.py``
    (empty when it is)."""
    import nbformat

    source = Path(source)
    target = source.with_name(NOTEBOOK_NAME)
    rel = _rel(target)
    if not target.exists():
        return [f"{rel}: missing (run: python -m distkit.records render {_rel(source.parent)})"]
    nb = nbformat.read(target, as_version=4)
    found = []
    if cells(nb) != cells(read_source(source)):
        found.append(f"{rel}: its cells differ from {source.name} "
                     f"(run: python -m distkit.records render {_rel(source.parent)})")
    unexecuted = [i for i, cell in enumerate(nb.cells)
                  if cell.cell_type == "code" and cell.source.strip()
                  and cell.get("execution_count") is None and not cell.get("outputs")]
    if unexecuted:
        found.append(f"{rel}: code cells {unexecuted} were never executed "
                     f"(run: python -m distkit.records render {_rel(source.parent)})")
    errors = _error_line(nb)
    if errors:
        found.append(f"{rel}: committed with an error output ({errors})")
    stored = nb.metadata.get(METADATA_KEY, {}).get("source_sha256")
    if stored != source_hash(nb):
        found.append(f"{rel}: its outputs were not produced by its current cells "
                     f"({'no source hash' if stored is None else 'a cell changed since it was executed'}; "
                     f"run: python -m distkit.records render {_rel(source.parent)})")
    return found


def problems(paths: list[str] | None = None) -> list[str]:
    """:func:`problems_of` for every notebook under ``paths``."""
    return [p for source in sources(paths) for p in problems_of(source)]


def _rel(path: Path) -> Path:
    path = Path(path).resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


# --------------------------------------------------------------------------------------------- CLI
def render(paths: list[str] | None = None, log=print) -> list[str]:
    """Re-execute and write every notebook under ``paths``; the failures, one line each (a failed
    notebook keeps its committed ``.ipynb``; the others are still written)."""
    failures = []
    for source in sources(paths):
        started = time.perf_counter()
        try:
            target = write_executed(source)
        except NotebookError as e:
            failures.append(str(e))
            log(f"notebook failed: {e}")
            continue
        log(f"executed {_rel(target)} ({time.perf_counter() - started:.0f} s)")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distkit.notebooks",
                                     description="Execute chapter notebooks and check the committed ones.")
    parser.add_argument("command", choices=["execute", "check"])
    parser.add_argument("paths", nargs="*", help="chapter folders (default: the whole repository)")
    args = parser.parse_args(argv)
    if args.command == "execute":
        return 1 if render(args.paths) else 0
    found = problems(args.paths)
    for p in found:
        print(p)
    if not found:
        print("every notebook was executed from its current cells")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
