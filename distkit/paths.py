"""Output paths checked before the work: every file or folder a run will write is judged on rank 0
right after the process group is joined, so a bad ``--results``, ``--checkpoint-dir``, ``--save``,
``--log-dir`` ... ends the job with one ``error:`` line before the first step, not with a traceback
(and a peer's "lost the connection") once training is over.

    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"], dirs=["checkpoint_dir"])

A path passes when the run could write it: a file that is not a folder, a folder that is not a file,
in a folder that exists and takes new files, or whose missing folders can be created (the nearest
folder that exists takes new entries; the run creates the rest, as it always did). Nothing is
created here and nothing lingers: writability is probed with a nameless temporary file in the
nearest existing folder, which the operating system discards when it is closed (``os.access`` alone
says yes to root on a read-only place, and to any user on ``/proc``).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Iterable

from .errors import UsageError


def shown_path(path: str | os.PathLike) -> str:
    """A path as the reader would type it from here: relative when it is below the current folder (the
    README's commands name their paths so), absolute otherwise."""
    path = Path(path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


# ``--save none`` means no file (distkit.flags.save_path); other path flags have no such word.
_OFF_WORDS = {"save": ("none",)}


def output_problem(path: str | os.PathLike, folder: bool = False) -> str | None:
    """What stops a run from writing ``path`` (a file, or a folder when ``folder``), or None.

    Pure apart from reading the filesystem (and a probe file that vanishes on close): no process
    group, no folder created. ``{placeholders}`` a script fills in later are left as they are: their
    braces are ordinary characters, so the check sees the same existing folders the filled-in path
    will have (a placeholder in a folder's name stands for a folder the run creates).
    """
    path = os.path.abspath(os.fspath(path))
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        return f"is {_what(path)}, not a folder"
    if not folder and os.path.isdir(path):
        return "is a folder, not a file"
    if not folder and os.path.isfile(path) and not os.access(path, os.W_OK):
        return "the file exists and is not writable"
    target = path if folder else os.path.dirname(path)
    existing = target
    while not os.path.lexists(existing):  # the folders the run would create, up to one that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == target:
            return f"its folder {target} is {_what(existing)}"
        return f"cannot create the folder {target}: {existing} is {_what(existing)}"
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        return f"{existing} does not take new files ({exc.strerror or type(exc).__name__})"
    return None


def _what(path: str) -> str:
    return "a broken link" if not os.path.exists(path) else "a file"


def output_problems(args: argparse.Namespace, files: Iterable[str] = (), dirs: Iterable[str] = ()) -> str | None:
    """One line naming every output flag of ``args`` that cannot be written, or None.

    ``files`` / ``dirs`` are destinations of flags that name a file / a folder the run writes
    (``"results"`` for ``--results``); a flag that is unset (None or empty) or says ``none`` where
    that means "no output" is skipped.
    """
    problems = []
    for dests, folder in ((files, False), (dirs, True)):
        for dest in dests:
            value = getattr(args, dest)
            if value in (None, "") or value in _OFF_WORDS.get(dest, ()):
                continue
            problem = output_problem(value, folder=folder)
            if problem:
                problems.append(f"--{dest.replace('_', '-')} {value}: {problem}")
    return "; ".join(problems) or None


def check_outputs(ctx, args: argparse.Namespace, files: Iterable[str] = (), dirs: Iterable[str] = ()) -> None:
    """Rank 0 judges the output flags (:func:`output_problems`) and every rank learns the verdict;
    a problem is the same :class:`UsageError` on every rank, so ``run_main`` prints it once.

    Call it right after the process group is joined, before any work. ``ctx`` is the job's
    :class:`~distkit.runtime.DistContext`, or None in a script without a process group (it judges and
    raises alone). The verdict travels over the default group, which every backend has (NCCL: through
    this rank's GPU): a rank that judged for itself could disagree with rank 0 (a folder only rank 0's
    node sees) and leave the others waiting in a collective.
    """
    verdict = [output_problems(args, files, dirs) if ctx is None or ctx.is_main else None]
    if ctx is not None and ctx.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(verdict, src=0, device=ctx.device)
    if verdict[0]:
        raise UsageError(verdict[0])
