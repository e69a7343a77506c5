"""The one exception type for problems with the reader's input or machine (see :func:`distkit.run_main`)."""
from __future__ import annotations


class UsageError(Exception):
    """A problem with the reader's input or machine, reported as one line and a non-zero exit.

    Raise it for bad flags, missing data, unusable devices or incompatible checkpoints;
    :func:`run_main` turns it into ``error: ...``. ``every_rank=True`` (the default) means all ranks
    raise the same error, so only rank 0 prints it; pass ``False`` when one rank alone found it.
    """

    def __init__(self, message: str, every_rank: bool = True):
        super().__init__(message)
        self.every_rank = every_rank
