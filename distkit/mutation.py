"""Deliberately broken variants of chapter code, for negative controls.

A negative control proves a check can fail: the same script, with one realistic bug, must fail it.
A mutation replaces one exact piece of a script's source. The piece must occur exactly once: if a
refactoring changed or duplicated it, the mutant would silently be the original (or break something
else), and the negative control would prove nothing, so that is an error.

    python -m torch.distributed.run --nproc_per_node=2 distkit/mutation.py SCRIPT OLD NEW -- [script arguments]

runs the mutant as torchrun would run the script (the tests' workers and ``benchmarks/parity.py``
use it).
"""
from __future__ import annotations

import sys
from pathlib import Path


def mutate(source: str, old: str, new: str, where: str = "source") -> str:
    """``source`` with its one occurrence of ``old`` replaced by ``new`` (``SystemExit`` otherwise)."""
    count = source.count(old)
    if count != 1:
        raise SystemExit(f"error: {old!r} occurs {count} times in {where}, expected exactly once")
    return source.replace(old, new)


def mutated_source(path: str | Path, old: str, new: str) -> str:
    """The text of the script at ``path`` with one mutation applied (see :func:`mutate`)."""
    return mutate(Path(path).read_text(), old, new, where=str(path))


def run_mutant(script: str | Path, old: str, new: str, argv: list[str]) -> None:
    """Run the mutant of ``script`` in this process as ``python script argv...`` would run it."""
    path = Path(script).resolve()
    source = mutated_source(path, old, new)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))
    exec(compile(source, str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})


if __name__ == "__main__":
    # Run as a file, this folder is sys.path[0]; its modules (deepspeed.py, ...) would shadow packages
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    args = sys.argv[1:]
    if len(args) < 4 or args[3] != "--":
        sys.exit("error: usage: python -m distkit.mutation SCRIPT OLD NEW -- [script arguments]")
    run_mutant(args[0], args[1], args[2], args[4:])
