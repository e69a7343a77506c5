"""Where and how a record was made: the machine, the command, the torch version, the date.

:mod:`distkit.records` (output records, rendering, checks) and :mod:`distkit.notebooks` (executed
notebooks) both stamp what they write with these, and both serialise recorded runs on one machine
through :data:`LOCK_FILE`; this module imports neither.
"""
from __future__ import annotations

import re
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1  # the output-record schema (distkit.records); harness records have their own
LOCK_FILE = Path(tempfile.gettempdir()) / "distkit-records.lock"


def machine(device: Any = None) -> dict[str, Any]:
    """The machine a run used, as records store it: with a CUDA ``device`` the GPU's name and count,
    with a CPU ``device`` the CPU's cores only, GPUs on the host or not (a ``--device cpu`` run on a
    GPU host ran on the CPU). ``device`` (a ``torch.device`` or its type) defaults to CUDA where
    CUDA is available, for callers that cannot know what ran."""
    import torch

    from .harness import machine_info

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return machine_info(torch.device(device))


# How the chapter scripts state their device: "[rank 0] world size 4 | backend gloo | device cpu |
# ..." or "... | device cuda:0 | ...". A flag in an error message ("use --device cpu") is not one.
_DEVICE_STATED = re.compile(r"(?<![-\w])device (cuda|cpu)\b")


def run_device(command: str, output: str, cuda_available: bool | None = None) -> str:
    """The device (``cpu`` or ``cuda``) a recorded command ran on, for its record's machine.

    Without CUDA on the host, ``cpu``. With it: what the command's own output states first (every
    chapter script's first line says ``device cpu`` or ``device cuda...``); else ``cpu`` when the
    command forces the CPU (``--device cpu`` or ``--backend gloo``, whose device follows the
    backend); else ``cuda``, since the scripts take the GPUs where there are any. Hide the GPUs
    (``CUDA_VISIBLE_DEVICES=``) to record a CPU run that says nothing. ``cuda_available`` defaults
    to this process's ``torch.cuda.is_available()``; passing it makes this a pure function."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return "cpu"
    stated = _DEVICE_STATED.search(output)
    if stated:
        return stated.group(1)
    try:
        words = shlex.split(command)
    except ValueError:  # unbalanced quotes: no flags to read
        words = []
    pairs = set(zip(words, words[1:])) | {tuple(w.split("=", 1)) for w in words if "=" in w}
    if ("--device", "cpu") in pairs or ("--backend", "gloo") in pairs:
        return "cpu"
    return "cuda"


def machine_label(machine_dict: dict[str, Any], backend: str | None = None) -> str:
    """Where a record ran, for captions: ``"2-core CPU, gloo"`` or ``"4x NVIDIA H100 80GB HBM3, nccl"``."""
    name = machine_dict.get("device_name") or "unknown machine"
    gpus = machine_dict.get("gpu_count")
    label = f"{gpus}x {name}" if gpus else name
    return f"{label}, {backend}" if backend else label


def provenance(command: str, device: Any = None, known_machine: dict[str, Any] | None = None,
               torch_version: str | None = None) -> dict[str, Any]:
    """The fields every record starts with: schema, command, machine (:func:`machine` of the
    ``device`` the run used), torch version, date. A caller that already knows the machine and the
    torch version (the GPU check's preflight) passes both, and torch is then not asked at all."""
    if known_machine is None or torch_version is None:
        import torch

        known_machine, torch_version = machine(device), torch.__version__
    return {"schema": SCHEMA_VERSION, "command": command, "machine": known_machine,
            "torch": torch_version, "date": time.strftime("%Y-%m-%d")}
