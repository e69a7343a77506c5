"""Time as the harness measures it (:mod:`distkit.harness` documents the method): the device's clock
(synchronised on a GPU), a step timer that skips warm-up steps, a timer of regions inside a step,
the device's peak FLOP/s in a given dtype, the throughput figures practitioners report, and the
machine the numbers came from. Importable from :mod:`distkit.harness`.
"""
from __future__ import annotations

import functools
import os
import platform
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished the work queued so far (CUDA is
    synchronised first): the clock to time code that launches kernels with. CUDA kernels run
    asynchronously, so a plain clock read after such code stops before its kernels have run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class RegionTimer:
    """Adds up the time spent inside ``with timer.region():`` blocks, measured on the device.

    On CUDA a region's time is the GPU time between two CUDA events recorded on the current stream,
    so a region that only *launches* kernels still gets the time those kernels ran; the events are
    read (one synchronisation) only when :attr:`total_s` is asked for. On CPU work is synchronous and
    ``time.perf_counter`` is exact.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._cpu_s = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextmanager
    def region(self) -> Iterator[None]:
        """Time the enclosed block and add it to the total."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self._cpu_s += time.perf_counter() - begin

    @property
    def total_s(self) -> float:
        """Seconds spent in all regions so far (synchronises CUDA once)."""
        if self._events:
            torch.cuda.synchronize(self.device)
            self._cpu_s += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        return self._cpu_s

    def reset(self) -> None:
        """Forget every region timed so far."""
        self._events.clear()
        self._cpu_s = 0.0


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on: device name, cores, host OS."""
    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cpu": cpu_name, "cpu_cores": cores, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
        # GPU figures depend on the CUDA runtime torch was built with and on the driver
        info["cuda"] = torch.version.cuda
        info["driver"] = nvidia_driver()
    else:
        info["device_name"] = f"{cores}-core CPU"
    return info


@functools.cache
def nvidia_driver() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it (None where nvidia-smi is missing)."""
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


class StepTimer:
    """Times steps after ``warmup_steps`` have passed; synchronises CUDA so GPU work is included."""

    def __init__(self, device: torch.device, warmup_steps: int = 2):
        self.device = device
        self.warmup_steps = warmup_steps
        self.seen = 0
        self.times: list[float] = []

    @contextmanager
    def time(self) -> Iterator[None]:
        """Time the enclosed step (recorded once past the warm-up)."""
        start = device_clock(self.device)
        yield
        elapsed = device_clock(self.device) - start
        if self.seen >= self.warmup_steps:
            self.times.append(elapsed)
        self.seen += 1


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None,
                       seconds: float | None = None) -> float:
    """The FLOP/s this device reaches on a square matmul in ``dtype`` (2 size^3 FLOPs each), the
    best of repeated timed runs within about ``seconds``: the denominator of MFU, measured where the
    job ran rather than quoted from a datasheet (on CPU, ranks that share cores measure their share).

    ``size`` defaults to 4096 on CUDA (large enough to reach the tensor cores' rate) and 384 on CPU;
    ``seconds`` to ``$DISTKIT_PEAK_SECONDS``, else 0.2 (the test suite, which never reads a peak as a
    figure, sets 0.02: at least 3 runs are always timed).
    """
    size = size or (4096 if device.type == "cuda" else 384)
    if seconds is None:
        seconds = float(os.environ.get("DISTKIT_PEAK_SECONDS", "0.2"))
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    timer = RegionTimer(device)
    best = float("inf")
    torch.mm(a, b)  # warm-up: kernel selection, first-touch of the output
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        timer.reset()
        with timer.region():
            torch.mm(a, b)
        best = min(best, timer.total_s)
        runs += 1
    return 2 * size ** 3 / best


def throughput_metrics(tokens_per_s: float | None, world_size: int, flops_per_token: float | None,
                       peak_flops_per_s: float | None) -> dict[str, float | None]:
    """Throughput as practitioners report it: tokens/s per device and MFU, the model FLOPs the job
    achieved per device (tokens/s per device x FLOPs per token) over the device's peak FLOP/s."""
    per_device = tokens_per_s / world_size if tokens_per_s else None
    mfu = (per_device * flops_per_token / peak_flops_per_s
           if per_device and flops_per_token and peak_flops_per_s else None)
    return {"tokens_per_s_per_device": per_device, "model_flops_per_token": flops_per_token,
            "peak_flops_per_s": peak_flops_per_s, "mfu": mfu}
