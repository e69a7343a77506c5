"""Memory per rank, as the harness measures it (:mod:`distkit.harness` documents what each figure
means): the bytes of model state a rank holds (:func:`model_state_bytes`), MemTracker's peak by
category on the instrumented step (:func:`memory_tracker`, :func:`peak_by_category`), the CUDA peak
of a window of steps (:func:`fresh_memory_peak`, :func:`restart_cuda_peak`,
:func:`peak_memory_bytes`), the process's peak RSS on CPU, and the per-step peak the harness reads
(:func:`step_peak_meter`). Importable from :mod:`distkit.harness`.
"""
from __future__ import annotations

import copy
import functools
import resource
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from . import rehearsal


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        t = _local(t)
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def model_state_bytes(model: torch.nn.Module | None = None,
                      optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that *this rank* holds.

    DTensor parameters (FSDP2, tensor parallel) count their local shard only; tensors sharing one
    storage (tied weights) count once.
    """
    params = list(model.parameters()) if model is not None else []
    grads = [p.grad for p in params if p.grad is not None]
    states = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": _unique_bytes(params), "grads": _unique_bytes(grads),
            "optimizer": _unique_bytes(states)}


# MemTracker's categories (FSDPMemTracker's finer ones included), folded into the five the formulas
# speak of: communication buffers (FSDP2's all-gather / reduce-scatter outputs, DDP's gradient
# buckets), inputs and tensors registered from outside count as temporaries.
MEMORY_CATEGORIES = {"params": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param"),
                     "grads": ("Gradient", "Sharded Grad", "Unsharded Grad"),
                     "optimizer": ("Optstate", "OptState"), "activations": ("Activation",),
                     "temporaries": ("Temp", "All Gather", "Reduce Scatter", "Inputs", "Other")}


def is_compiled(modules: torch.nn.Module | Iterable[torch.nn.Module] | None) -> bool:
    """Whether any of these modules (or their submodules) runs ``torch.compile``d code."""
    if modules is None:
        return False
    for root in [modules] if isinstance(modules, torch.nn.Module) else modules:
        for module in root.modules():
            if getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod"):
                return True
    return False


def memory_tracker(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None,
                   externals: Iterable[Any] = ()):
    """A ``MemTracker`` for one training step of ``model`` (enter it around the step), with the
    model's parameters, buffers and gradients, the optimizer's state and ``externals`` (tensors,
    modules, optimizers created before the step) registered. An FSDP2 root gets
    ``FSDPMemTracker``, which also knows the sharded/unsharded parameters and the all-gather and
    reduce-scatter buffers.

    A step may run a model's forward several times (gradient accumulation, a pipeline stage per
    micro-batch); torch's trackers refuse a top-level module's second forward (they keep per-module
    statistics per iteration), so the module's statistics are forgotten first: only the step's peak
    by category is read, and it does not depend on them. Tensors created before the step and never
    registered are seen once an op writes them (in-place ops return them), e.g. DDP's gradient
    buckets; tensors only read are not seen."""
    from torch.distributed.fsdp import FSDPModule

    step_tracker, step_fsdp_tracker = _step_trackers()
    if isinstance(model, FSDPModule):
        tracker = step_fsdp_tracker(model, optimizer)
        rest = list(externals)
    else:
        tracker = step_tracker()
        rest = [x for x in (model, optimizer, *externals) if x is not None]
    if rest:
        tracker.track_external(*rest)
    return tracker


def _forget_if_called_again(tracker, module: torch.nn.Module) -> None:
    """Before a top-level forward: if this module already ran forward in the step, drop its
    per-module statistics (the tracker would refuse the second forward)."""
    if tracker._mod_tracker.is_bw:
        return
    if module in tracker._forwarded and module in tracker.memory_tracking:
        del tracker.memory_tracking[module]
    tracker._forwarded.add(module)


def _stats_by_name_class() -> type:
    """A new ``StatsByName`` class (see :func:`_step_trackers` for why each call makes one)."""
    from torch.utils.weak import WeakIdKeyDictionary

    class StatsByName(WeakIdKeyDictionary):
        """torch's per-module statistics (module -> stats), also indexed by the module's name."""

        def __init__(self):
            super().__init__()
            self.by_fqn: dict[str, list] = {}

        def __setitem__(self, module, stats):
            if module in self:
                self.__delitem__(module)
            super().__setitem__(module, stats)
            self.by_fqn.setdefault(stats.mod_fqn, []).append(stats)

        def __delitem__(self, module):
            self.by_fqn[self[module].mod_fqn].remove(self[module])
            super().__delitem__(module)

    return StatsByName


def _step_tracking_class() -> type:
    """A new ``StepTracking`` mixin class (see :func:`_step_trackers` for why each call makes one)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY as TOTAL

    stats_by_name = _stats_by_name_class()
    activation_kinds = MEMORY_CATEGORIES["activations"]

    class StepTracking:
        """What both step trackers add to torch's: the modules already forwarded in the step, and
        the activations' own high-water mark per device (their largest size at any moment of the
        step, which need not be the moment of the total's peak), noted after each op.

        After every op torch's tracker raises the peak of each module running now (the module
        tracker's parents) by walking every module it has seen; here those few are looked up by name
        instead (``StatsByName``): the same peaks, without a walk over the whole model per op,
        which was about a sixth of a small training step's CPU time."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.memory_tracking = stats_by_name()
            self._forwarded = weakref.WeakSet()
            self.activations_high_water: dict = {}

        def _update_peak_stats(self, peak_state):
            current = self._curr_mem_snap
            for name in self._mod_tracker.parents:
                for stats in self.memory_tracking.by_fqn.get(name, ()):
                    if peak_state not in stats.snapshots:
                        continue
                    for device, snapshot in current.items():
                        if stats.local_peak.get(device, 0) < snapshot[TOTAL]:
                            stats.local_peak[device] = snapshot[TOTAL]
                            stats.snapshots[peak_state][-1][device] = copy.deepcopy(snapshot)
            for device, snapshot in current.items():
                if self._peak_mem.get(device, 0) < snapshot[TOTAL]:
                    self._peak_mem[device] = snapshot[TOTAL]
                    self._peak_mem_snap[device] = copy.deepcopy(snapshot)
                size = sum(snapshot.get(kind, 0) for kind in activation_kinds)
                if size > self.activations_high_water.get(device, 0):
                    self.activations_high_water[device] = size

    return StepTracking


@functools.cache
def _step_trackers():
    """torch's two trackers, letting a top-level module run forward again within the step (imported
    on first use: ``torch.distributed._tools`` takes most of a second to import). Every call after
    ``cache_clear`` builds new classes, so a test that patches them leaves later trackers intact."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    step_tracking = _step_tracking_class()

    class StepMemTracker(step_tracking, MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                _forget_if_called_again(self, module)
            super()._pre_fw_hook(module, inputs)

    class StepFSDPMemTracker(step_tracking, FSDPMemTracker):
        def __enter__(self):
            # before FSDP's own pre-forward, which FSDPMemTracker wraps
            self._forget_handle = self._root_mod.register_forward_pre_hook(
                lambda module, args: _forget_if_called_again(self, module), prepend=True)
            return super().__enter__()

        def __exit__(self, *args):
            self._forget_handle.remove()
            return super().__exit__(*args)

    return StepMemTracker, StepFSDPMemTracker


def peak_by_category(tracker) -> dict[str, int]:
    """A tracker's peak snapshot, summed over devices and folded into :data:`MEMORY_CATEGORIES`,
    plus ``total`` (MemTracker's own total at the peak) and ``activations_high_water``: the
    activations' own largest size during the step (:func:`memory_tracker`'s trackers note it after
    every op). The two differ where the step peaks in backward, after some blocks' activations are
    freed: the planner's validation compares its activation bytes with the high-water mark; the
    peak's parts say what was alive together."""
    peak = {name: 0 for name in MEMORY_CATEGORIES} | {"total": 0}
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        for name, kinds in MEMORY_CATEGORIES.items():
            peak[name] += sum(snapshot.get(kind, 0) for kind in kinds)
        peak["total"] += snapshot["Total"]
    highs = getattr(tracker, "activations_high_water", None)
    if highs is not None:
        peak["activations_high_water"] = sum(highs.values())
    return peak


# The kernel keeps one RSS high-water mark per process, which a rehearsal's harness resets at every
# step (restart_rss_peak): what it had reached since the last reset_peak_rss is folded in here first,
# so that peak_rss_bytes still covers the whole window, as _cuda_window_peaks does for CUDA.
_rss_window_peak = 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size since the last :func:`reset_peak_rss` (Linux reports it
    in KiB); the per-step resets of :func:`restart_rss_peak` do not shorten that window."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _rss_window_peak)


def reset_peak_rss() -> bool:
    """Start a new CPU peak-RSS window, like ``torch.cuda.reset_peak_memory_stats`` on GPU.

    Hands freed heap memory back to the OS (glibc ``malloc_trim``), then resets the kernel's
    high-water mark (``/proc/self/clear_refs``), so :func:`peak_rss_bytes` afterwards reports the
    peak since this call (what is still resident now included). Use it between configurations run
    one after another in one process. Linux only; returns False where unsupported.
    """
    import ctypes
    import gc

    global _rss_window_peak
    gc.collect()
    _rss_window_peak = 0
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, AttributeError):
        return False
    return True


def _rss_high_water_bytes() -> int:
    """The kernel's RSS high-water mark of this process (``VmHWM``, in KiB there), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM line")


def restart_rss_peak() -> None:
    """Reset the kernel's RSS high-water mark to what is resident now (``/proc/self/clear_refs``),
    keeping the window's peak for :func:`peak_rss_bytes`. Unlike :func:`reset_peak_rss` it neither
    collects garbage nor trims the heap: called as every step begins, that would cost each step a
    collection and change the memory the step starts from."""
    global _rss_window_peak
    _rss_window_peak = max(_rss_window_peak, _rss_high_water_bytes())
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def fresh_memory_peak(device: torch.device) -> None:
    """Start a new peak-memory window on a clean slate: free what nothing references any more, then
    reset the high-water mark.

    Call it between configurations run one after another in one process, after dropping the
    previous model/optimizer/engine. Garbage collection comes first because engines hold reference
    cycles (optimizer step hooks point back at their engine) that plain ``del`` does not free. On CUDA
    the caching allocator's free blocks are returned too, so ``max_memory_allocated`` afterwards
    counts only what the next configuration allocates (plus anything still alive).
    """
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        _cuda_window_peaks.pop(_cuda_index(device), None)
    else:
        reset_peak_rss()


# CUDA has one peak statistic per device, which the harness resets at every step to measure the step
# alone: what it had reached since the last fresh_memory_peak is folded in here first, so that
# peak_memory_bytes still covers the whole window (scripts read it for their own figures).
_cuda_window_peaks: dict[int, int] = {}


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def restart_cuda_peak(device: torch.device) -> None:
    """Reset CUDA's peak statistic (it restarts at what is allocated now), keeping the window's peak
    for :func:`peak_memory_bytes`."""
    index = _cuda_index(device)
    _cuda_window_peaks[index] = max(_cuda_window_peaks.get(index, 0), torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory since the last :func:`fresh_memory_peak`: ``torch.cuda.max_memory_allocated`` on
    CUDA (the harness's per-step resets included), this process's peak RSS on CPU. The harness's own
    record reports the peak of its steps alone (:meth:`Harness.local_metrics`)."""
    if device.type == "cuda":
        return max(_cuda_window_peaks.get(_cuda_index(device), 0), torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


@dataclass(frozen=True)
class StepPeakMeter:
    """How the harness reads one step's peak memory: ``begin()`` as the step begins, ``end()`` as it
    ends, returning (peak bytes, the allocator's reserved peak or None); ``kind`` is the record's
    ``peak_memory_kind``."""

    kind: str
    begin: Callable[[], None]
    end: Callable[[], tuple[int, int | None]]


def step_peak_meter(device: torch.device) -> StepPeakMeter | None:
    """The per-step peak meter on ``device``, chosen here alone:

    * CUDA: ``torch.cuda.max_memory_allocated`` (:func:`restart_cuda_peak` as the step begins: the
      statistic restarts at what is allocated then, so state held across steps counts), with the
      caching allocator's reserved peak (fragmentation and cache included);
    * the CPU in a GPU-check rehearsal (:func:`distkit.rehearsal.active`): the stand-in that
      ``rehearsal.SWAPS["step_peak_memory"]`` names, the process's RSS high-water mark
      (:func:`restart_rss_peak` as the step begins, ``VmHWM`` as it ends), no reserved figure. It runs
      the GPU's per-step control flow; its bytes include the interpreter's and are no GPU figure;
    * otherwise None: a plain CPU run meters no step (its record keeps MemTracker's peak).
    """
    if device.type == "cuda":
        return StepPeakMeter("cuda_max_allocated", functools.partial(restart_cuda_peak, device),
                             lambda: (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)))
    if rehearsal.active():
        return StepPeakMeter("rehearsal_peak_rss", restart_rss_peak, lambda: (_rss_high_water_bytes(), None))
    return None
