"""The GPU check rehearsed on a CPU machine: everything it swaps, named in one place.

``python benchmarks/gpu_check.py --rehearse`` runs the GPU check's whole control flow where there is no
GPU (CI, a laptop): the offline install into a fresh virtual environment, the import of ``distkit``
after it, the GPU suite's collection, order and time box, every measurement command at world size 1,
the records, the summary and the exit code. Only what needs CUDA itself is swapped, and each swap is
listed in :data:`SWAPS` and applied where its key is read:

* ``device``/``backend``: the measurement commands' ``--device``/``--backend`` (benchmarks/gpu_check.py);
* ``step_peak_memory``: :func:`distkit.memory.step_peak_meter`, the harness's per-step peak window;
* ``copy_bandwidth``: benchmarks/gpu_check.py's ``--copy-bandwidth``;
* ``gpu_identity``: the check's preflight (what the records say the machine was);
* ``sizes``: the measurements' models and step counts (CI's minutes, not a lease's).

CUDA events need no swap of their own: :mod:`distkit.timing` takes them on a CUDA device and
``time.perf_counter`` on the CPU, so the device swap brings the timer's with it.

The check sets :data:`ENV` for every job it starts in a rehearsal; code that swaps reads
:func:`active`. Standard library only: the check reads this before anything heavy is imported.
"""
from __future__ import annotations

import os

ENV = "DISTKIT_GPU_REHEARSAL"

# key: (what the GPU check uses on a GPU, what stands in for it in the rehearsal)
SWAPS: dict[str, tuple[str, str]] = {
    "device": ("cuda", "cpu"),
    "backend": ("nccl", "gloo"),
    "step_peak_memory": ("torch.cuda.max_memory_allocated, its peak statistic reset as each step begins",
                         "the process's resident-set high-water mark (VmHWM), reset as each step begins"),
    "copy_bandwidth": ("a 1 GiB device-to-device copy timed with CUDA events",
                       "a 64 MiB host-memory copy timed with time.perf_counter"),
    "gpu_identity": ("the GPU's name, count, memory and compute mode, the driver and CUDA versions",
                     "the CPU's name and cores"),
    "sizes": ("the check's models and step counts", "the tiny models and a few steps each"),
}


def active() -> bool:
    """True inside a rehearsal (a job the GPU check started with ``--rehearse``)."""
    return os.environ.get(ENV) == "1"


def swapped(key: str) -> str:
    """What stands in for ``key`` now: the rehearsal's value inside a rehearsal, the GPU's otherwise."""
    gpu, cpu = SWAPS[key]
    return cpu if active() else gpu
