"""Worker: run a chapter script against a mutant of ``distkit/harness.py`` (one piece of its source
replaced, :func:`distkit.mutation.mutated_source`), exactly as torchrun would run the script.

    torchrun --nproc_per_node=1 tests/workers/harness_mutant.py OLD NEW SCRIPT -- [script arguments]

The mutant is compiled under harness.py's own file name and installed as ``distkit.harness`` before
the script runs, so the script's ``from distkit.harness import ...`` gets it; the rest of distkit is
the repository's. Replacing the module (not a copy of the package first on ``PYTHONPATH``) works in a
rank forked from the tests' fork server, which has imported the real harness already, so the job
starts without importing torch again. ``OLD`` must occur exactly once in harness.py (one ``error:``
line otherwise). Used by tests/test_step_peak.py's negative control.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import distkit
from distkit.mutation import mutated_source


def install_mutant(old: str, new: str) -> None:
    """``distkit.harness`` becomes the harness with ``old`` replaced by ``new``."""
    path = Path(distkit.__file__).resolve().parent / "harness.py"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("distkit.harness", path))
    sys.modules["distkit.harness"] = module  # before it runs: its dataclasses look their module up there
    distkit.harness = module
    exec(compile(mutated_source(path, old, new), str(path), "exec"), module.__dict__)


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[3] != "--":
        sys.exit("error: usage: harness_mutant.py OLD NEW SCRIPT -- [script arguments]")
    old, new, script, _, *rest = argv
    install_mutant(old, new)
    sys.argv = [script, *rest]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
