"""Deliberately broken variants of chapter code, for negative controls.

A mutation replaces one exact piece of a script's source. The piece must occur exactly once: if a
refactoring changed or duplicated it, the mutant would silently be the original (or break something
else), and the negative control would prove nothing, so that is an error.
"""
from __future__ import annotations

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
