"""Checkpoint files written atomically and read safely.

A checkpoint is first written to a temporary file in the same folder, flushed to disk, and then
renamed over the final name: a crash (or SIGKILL) mid-write leaves the previous checkpoint intact
and at worst a stray ``*.tmp*`` file, never a truncated checkpoint under the real name. Loading uses
``weights_only=True`` so a checkpoint cannot run code.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .runtime import UsageError


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def safe_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(weights_only=True)``; an unreadable file raises a one-line :class:`UsageError`."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"checkpoint {path} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - corrupt zip, pickle error, unsafe global ...
        raise UsageError(f"checkpoint {path} is unreadable ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:150]})") from None


def load_model_state(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Load a state dict, turning a shape/key mismatch (a checkpoint of another model) into one line."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    wrong_shape = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    if missing or unexpected or wrong_shape:
        detail = "; ".join(part for part in (
            f"missing {missing[:3]}" if missing else "",
            f"unexpected {unexpected[:3]}" if unexpected else "",
            f"shape differs for {wrong_shape[:3]}" if wrong_shape else "") if part)
        raise UsageError(f"checkpoint {source} is from a different model ({detail})")
    model.load_state_dict(state_dict)
