"""Checkpoint files written atomically and read safely.

A checkpoint is first written to a temporary file in the same folder, flushed to disk, and then
renamed over the final name: a crash (or SIGKILL) mid-write leaves the previous checkpoint intact
and at worst a stray ``*.tmp*`` file, never a truncated checkpoint under the real name. Loading uses
``weights_only=True`` so a checkpoint cannot run code.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch

from .runtime import UsageError


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Write a file atomically: ``write(f)`` fills a temporary file beside ``path``, which is then
    flushed, fsynced and renamed over ``path``. Readers see the old file or the new one, never half.

    The temporary is named ``<name>.tmp.<host>.<pid>.<random>`` so that a later start can tell a torn
    file left by a killed writer (:func:`remove_stale_temporaries`) from one a live writer is still
    filling. The result gets the usual permissions (0666 minus the umask), not ``mkstemp``'s 0600, so
    other users of a shared cluster folder can read it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path.name))
    try:
        os.fchmod(fd, 0o666 & ~_current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` through :func:`atomic_write`: a crash mid-save never leaves a torn checkpoint."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's unsharded weights on CPU. Collective when the model holds DTensors (tensor or 2-D
    parallel): every rank must call it, as ``full_tensor()`` all-gathers each shard; plain tensors are
    copied as they are."""
    import logging

    from torch.distributed.tensor import DTensor

    # Gathering a 2-D (FSDP x TP) shard takes two all-gathers; torch warns about that on every rank,
    # which is expected here, so keep the output readable.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
            for name, t in model.state_dict().items()}


def save_full_model(model: torch.nn.Module, path: str | None, cfg, strategy: str, ctx) -> None:
    """``{"model": full weights, "config", "strategy"}`` to ``path`` on rank 0 (nothing for None), as
    the chapter-05 scripts' ``--save`` writes it. Every rank must call it when the model holds
    DTensors (:func:`full_state_dict` gathers them)."""
    state = full_state_dict(model)
    if ctx.is_main and path:
        atomic_save({"model": state, "config": cfg.to_dict(), "strategy": strategy}, path)


def atomic_write_json(obj: Any, path: str | os.PathLike) -> Path:
    """``json.dump`` through :func:`atomic_write` (trainer state, metadata beside a checkpoint)."""
    return atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def _current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; set it straight back
    os.umask(mask)
    return mask


def temporary_prefix(name: str) -> str:
    """The start of an in-progress temporary's name for file ``name`` written by this process:
    ``<name>.tmp.<host>.<pid>.`` (``mkstemp`` adds a random suffix)."""
    return f"{name}.tmp.{socket.gethostname()}.{os.getpid()}."


def _writer_is_gone(tmp: Path, max_age_s: float) -> bool:
    """True when the process that was writing ``tmp`` cannot still be alive."""
    # name.tmp.<host>.<pid>.<random>: hosts may contain dots, the PID and mkstemp's suffix do not
    host, pid = None, None
    if ".tmp." in tmp.name:
        parts = tmp.name.split(".tmp.", 1)[1].rsplit(".", 2)
        if len(parts) == 3 and parts[1].isdigit():
            host, pid = parts[0], int(parts[1])
    if host == socket.gethostname() and pid is not None:
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, owned by someone else
            return False
        return False
    try:  # written on another node (shared folder) or unnamed: only an old file is surely stale
        return time.time() - tmp.stat().st_mtime > max_age_s
    except FileNotFoundError:
        return False


def remove_stale_temporaries(folder: str | os.PathLike, max_age_s: float = 3600.0) -> list[Path]:
    """Delete ``*.tmp*`` files that :func:`atomic_save` left in ``folder`` when its writer was killed.

    A file whose writer (named in it: host and PID) is still running is kept; one from another host
    is removed only when it is older than ``max_age_s``. Returns the removed paths. Call it on one
    rank at start-up, before the first save.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for tmp in sorted(folder.glob("*.tmp*")):
        if tmp.is_file() and _writer_is_gone(tmp, max_age_s):
            try:
                tmp.unlink()
                removed.append(tmp)
            except FileNotFoundError:
                pass
    return removed


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:150] if lines else "no details"


def safe_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(weights_only=True)``; an unreadable file raises a one-line :class:`UsageError`."""
    try:
        if os.path.getsize(path) == 0:
            raise UsageError(f"checkpoint {path} is empty (0 bytes): a save that never finished?")
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"checkpoint {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"checkpoint {path} is a folder, not a file") from None
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - corrupt zip, pickle error, unsafe global ...
        raise UsageError(f"checkpoint {path} is unreadable ({type(exc).__name__}: "
                         f"{_first_line(exc)})") from None


@contextmanager
def dcp_errors_as_usage_errors(checkpoint_dir: str | os.PathLike) -> Iterator[None]:
    """Turn a failed ``torch.distributed.checkpoint`` load into one :class:`UsageError` line.

    DCP gathers every rank's failure into a ``CheckpointException``, which derives from
    ``BaseException`` (not ``Exception``), so a plain ``except Exception`` lets it escape as a
    traceback. Every rank raises it, so the error is reported once.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        # failures maps a rank to (exception, traceback summary)
        errors = [err[0] if isinstance(err, tuple) else err
                  for err in getattr(exc, "failures", {}).values()]
        causes = [f"{type(err).__name__}: {_first_line(err)}" for err in errors]
        detail = causes[0] if causes else _first_line(exc)
        raise UsageError(f"DCP checkpoint {checkpoint_dir} does not fit this model or is damaged "
                         f"({detail[:200]})") from None


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
