"""Where and how a record was made: the machine, the command, the torch version, the date.

:mod:`distkit.records` (output records, rendering, checks) and :mod:`distkit.notebooks` (executed
notebooks) both stamp what they write with these, and both serialise recorded runs on one machine
through :data:`LOCK_FILE`; this module imports neither.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1  # the output-record schema (distkit.records); harness records have their own
LOCK_FILE = Path(tempfile.gettempdir()) / "distkit-records.lock"


def machine() -> dict[str, Any]:
    """The machine this process runs on, as records store it (GPU name and count when CUDA is here)."""
    import torch

    from .harness import machine_info

    cuda = torch.cuda.is_available()
    return machine_info(torch.device("cuda" if cuda else "cpu"))


def machine_label(machine_dict: dict[str, Any], backend: str | None = None) -> str:
    """Where a record ran, for captions: ``"2-core CPU, gloo"`` or ``"4x NVIDIA H100 80GB HBM3, nccl"``."""
    name = machine_dict.get("device_name") or "unknown machine"
    gpus = machine_dict.get("gpu_count")
    label = f"{gpus}x {name}" if gpus else name
    return f"{label}, {backend}" if backend else label


def provenance(command: str) -> dict[str, Any]:
    """The fields every record starts with: schema, command, machine, torch version, date."""
    import torch

    return {"schema": SCHEMA_VERSION, "command": command, "machine": machine(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
