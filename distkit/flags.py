"""Range-checked argparse types, so a bad number is rejected where its flag is defined.

``parser.add_argument("--steps", type=positive_int)`` turns ``--steps 0`` into argparse's own
one-line ``error: argument --steps: must be a positive integer, got 0`` (printed once, by rank 0,
through :class:`distkit.ArgumentParser`) before any process group exists. Values that come from a
config file instead of the command line go through :func:`check_value` with the same types.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable


def _number(kind: Callable[[str], Any], text: str, what: str, in_range: Callable[[Any], bool]):
    """Parse ``text`` as ``kind`` and check ``in_range``; argparse's one-line error otherwise."""
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    if not in_range(value):
        shown = format(value, "g") if isinstance(value, float) else value
        raise argparse.ArgumentTypeError(f"must be {what}, got {shown}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (steps, batch sizes, ranks, intervals)."""
    return _number(int, text, "a positive integer", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (warm-up steps, "0 = off" intervals)."""
    return _number(int, text, "an integer >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, timeouts, sizes in MiB)."""
    return _number(float, text, "a positive number", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (weight decay, clipping where 0 means off)."""
    return _number(float, text, "a number >= 0", lambda v: v >= 0)


def check_value(name: str, value: Any, kind: Callable[[str], Any]) -> Any:
    """Apply one of the types above to a value that did not come from the command line (a config
    file); raises :class:`distkit.UsageError` naming the key."""
    from .runtime import UsageError

    if isinstance(value, bool):  # YAML's true/false is an int subclass in Python: never a count
        raise UsageError(f"{name}: must be a number, got {value!r}")
    try:
        return kind(str(value))
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{name}: {exc}") from None
