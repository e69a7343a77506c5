"""Rank-aware logging and a rank-0 progress bar.

Every line carries ``[rank N]`` so interleaved output from several processes stays readable. Rank 0
logs at INFO; the other ranks log warnings and errors only (unless ``all_ranks=True``), so a 4-rank
run prints its progress once. Rank 0 can also copy its log into a file.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, TypeVar

T = TypeVar("T")
LOGGER_NAME = "distkit"


def setup_logging(rank: int, log_file: str | os.PathLike | None = None, all_ranks: bool = False,
                  per_rank_dir: str | os.PathLike | None = None) -> logging.Logger:
    """Configure and return the shared logger.

    Args:
        rank: this process's global rank (goes into every line).
        log_file: rank 0 also appends its log here.
        all_ranks: let every rank log at INFO, not only rank 0.
        per_rank_dir: every rank also writes ``rank<N>.log`` in this folder.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO if (rank == 0 or all_ranks) else logging.WARNING)
    fmt = logging.Formatter(f"[rank {rank}] %(message)s")
    stream = BarAwareHandler(sys.stdout)
    stream.setFormatter(fmt)
    logger.addHandler(stream)
    file_fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    if log_file is not None and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(file_fmt)
        logger.addHandler(handler)
    if per_rank_dir is not None:
        os.makedirs(per_rank_dir, exist_ok=True)
        handler = logging.FileHandler(os.path.join(per_rank_dir, f"rank{rank}.log"))
        handler.setFormatter(file_fmt)
        handler.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        stream.setLevel(logging.INFO if (rank == 0 or all_ranks) else logging.WARNING)
    return logger


class BarAwareHandler(logging.StreamHandler):
    """A stream handler that, while rank 0's progress bar is drawn, writes each line above the bar
    (``tqdm.write`` clears the bar, prints, redraws it): a log line printed mid-epoch would otherwise
    land on the bar's own line, glued to it, in the reader's terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        std = sys.modules.get("tqdm.std")  # imported only once a bar was made (progress())
        if std is None or not getattr(std.tqdm, "_instances", None):
            super().emit(record)
            return
        try:
            std.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # what logging.StreamHandler.emit does with a failure
            self.handleError(record)


def get_logger() -> logging.Logger:
    """The logger configured by :func:`setup_logging`."""
    return logging.getLogger(LOGGER_NAME)


def progress(iterable: Iterable[T], rank: int, **tqdm_kwargs) -> Iterable[T]:
    """A tqdm progress bar on rank 0; the plain iterable elsewhere (or with DISTKIT_NO_PROGRESS=1)."""
    if rank != 0 or os.environ.get("DISTKIT_NO_PROGRESS") == "1":
        return iterable
    from tqdm.auto import tqdm

    tqdm_kwargs.setdefault("dynamic_ncols", True)
    tqdm_kwargs.setdefault("leave", False)
    tqdm_kwargs.setdefault("file", sys.stderr)
    return tqdm(iterable, **tqdm_kwargs)
