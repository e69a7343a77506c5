"""Counting what really runs: the collectives, by kind, with their bytes on the wire, and the
matrix multiplications, by the dtype they run in.

:class:`CommCounter` is a ``TorchDispatchMode``: while active it sees every ``c10d`` operation
(DDP's C++ bucket all-reduce, FSDP's all-gather and reduce-scatter, DTensor's functional
collectives, DeepSpeed's calls) with its tensors and process group, and adds up their sizes. The
harness (:mod:`distkit.harness`) runs one on its communication-counting step.

Each collective's ``bytes`` is the payload (the tensor handed to the collective; the *total*
buffer for gathers/scatters, as nccl-tests counts it) and ``bus_bytes`` the bytes each rank sends
on the wire in a ring/bandwidth-optimal algorithm: payload x :func:`bus_factor`.

:class:`MatmulCounter`, on the same step, adds up the FLOPs of the matrix multiplications and
attention kernels by the dtype of their operands: the dtype the training computes in, which the
harness measures the device's peak FLOP/s in (the denominator of MFU). It sees what autocast,
FSDP's ``MixedPrecisionPolicy`` or a DeepSpeed bf16/fp16 engine really hand the kernels, since a
dispatch mode runs below autocast's casts.
"""
from __future__ import annotations

import functools
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# op name (as the dispatcher names it) -> (collective, how to find payload tensors)
# "in": the payload is the input tensor(s); "out": the output (gathers: the full gathered buffer);
# "in_total": for reduce-scatter the payload is the full input buffer.
_C10D_OPS = {
    "c10d::allreduce_": ("all_reduce", "arg0"),
    "c10d::allreduce_coalesced_": ("all_reduce", "arg0"),
    "c10d::broadcast_": ("broadcast", "arg0"),
    "c10d::reduce_": ("reduce", "arg0"),
    "c10d::allgather_": ("all_gather", "arg0"),  # output lists: sum of the gathered list
    "c10d::_allgather_base_": ("all_gather", "arg0"),
    "c10d::allgather_coalesced_": ("all_gather", "arg0"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "arg0"),
    "c10d::reduce_scatter_": ("reduce_scatter", "arg1"),  # input lists
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "arg1"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "arg1"),
    "c10d::alltoall_": ("all_to_all", "arg1"),
    "c10d::alltoall_base_": ("all_to_all", "arg1"),
    "c10d::gather_": ("gather", "arg1"),
    "c10d::scatter_": ("scatter", "arg0"),
    "c10d::send": ("send", "arg0"),
    "c10d::recv_": ("recv", "arg0"),
    "c10d::recv_any_source_": ("recv", "arg0"),
    "c10d::barrier": ("barrier", None),
}
# DTensor / functional collectives (same convention)
_FUNCTIONAL_OPS = {
    "_c10d_functional::all_reduce": ("all_reduce", "arg0"),
    "_c10d_functional::all_reduce_": ("all_reduce", "arg0"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "arg0"),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "out"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "arg0"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "arg0"),
    "_c10d_functional::all_to_all_single": ("all_to_all", "arg0"),
    "_c10d_functional::broadcast": ("broadcast", "arg0"),
    "_c10d_functional::broadcast_": ("broadcast", "arg0"),
}


def _has_dtensor(types) -> bool:
    """Whether an op's tensor types include a DTensor. DTensor's module is imported only where a
    script uses it (it costs a plain DDP rank about 0.7 s at start): without it there is no DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(issubclass(t, module.DTensor) for t in types)


def bus_factor(collective: str, group_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: wire bytes per rank = payload bytes x this factor."""
    n = group_size
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "send", "recv"):
        return 1.0
    return 0.0


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def _group_size(args: tuple, kwargs: dict) -> int:
    """Size of the process group a dispatched collective runs on.

    c10d ops carry the group as a boxed ``ProcessGroup``; functional collectives carry its name as
    their last string argument.
    """
    values = (*args, *kwargs.values())
    for obj in values:
        if isinstance(obj, torch.ScriptObject):
            return dist.ProcessGroup.unbox(obj).size()
    names = [obj for obj in values if isinstance(obj, str)]
    if names:
        return dist.distributed_c10d._resolve_process_group(names[-1]).size()
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class CollectiveStats:
    """Calls and bytes of one kind of collective."""

    calls: int = 0
    bytes: int = 0
    bus_bytes: float = 0.0

    def as_dict(self, steps: int = 1) -> dict:
        return {"calls": self.calls / steps, "bytes": self.bytes / steps,
                "bus_bytes": self.bus_bytes / steps}


class CommCounter(TorchDispatchMode):
    """Counts every collective dispatched while active (``with CommCounter() as comm: ...``).

    ``comm.stats`` maps a collective name (``all_reduce``, ``all_gather`` ...) to
    :class:`CollectiveStats`. Tensor bytes are exact (numel x element size), so padding of flat
    shards or a bucketed gradient buffer shows up as it really is.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, CollectiveStats] = defaultdict(CollectiveStats)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A mode sees an op before tensor subclasses do, and DTensor runs the collectives an op
        # needs (a Partial gradient read by the optimizer, a redistribution) inside its own
        # dispatch, where this mode is switched off: let DTensor go first, so its local ops and
        # collectives come back through here (MemTracker does the same).
        if _has_dtensor(types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        entry = _C10D_OPS.get(name) or _FUNCTIONAL_OPS.get(name)
        if entry is not None:
            collective, where = entry
            if where is None:
                payload = 0
            elif where == "out":
                payload = _tensor_bytes(out)
            else:
                payload = _tensor_bytes(args[int(where[3:])])
            size = _group_size(args, kwargs)
            stat = self.stats[collective]
            stat.calls += 1
            stat.bytes += payload
            stat.bus_bytes += payload * bus_factor(collective, size)
        return out

    def summary(self, steps: int = 1) -> dict[str, dict]:
        """Per-step averages: ``{collective: {"calls", "bytes", "bus_bytes"}}``."""
        return {name: stat.as_dict(steps) for name, stat in sorted(self.stats.items())}


def _attention_flops(query: torch.Tensor, key: torch.Tensor, key_seq_dim: int, backward: bool) -> int:
    """An attention kernel's matmul FLOPs, as torch's flop counter counts them: forward, the scores
    (Q K^T) and the output (P V), 2 b h s_q s_k d each; backward five such products (the scores
    recomputed, then the gradients of P, V, Q and K). Counted from the query's size, so grouped-query
    attention (fewer key/value heads) needs no special case."""
    return (10 if backward else 4) * query.numel() * key.shape[key_seq_dim]


@functools.cache
def _matmul_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas of the ops that do a training step's matrix multiplications, by op packet:
    torch's own (``torch.utils.flop_counter``) for mm, addmm, bmm and baddbmm, and
    :func:`_attention_flops` for the attention kernels (torch 2.11's own formulas reject grouped-query
    shapes). Convolutions and fp8 ``_scaled_mm`` are left out: the peak is measured with a plain
    matmul in the dtype found."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    formulas = {packet: flop_counter.flop_registry[packet] for packet in
                (aten.mm, aten.addmm, aten.bmm, aten.baddbmm) if packet in flop_counter.flop_registry}
    # (batch, heads, seq, dim) kernels and (batch, seq, heads, dim) ones; backward ops take the
    # output's gradient first, then query and key
    layouts = {-2: ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"],
               1: ["_flash_attention", "_efficient_attention"]}
    for seq_dim, names in layouts.items():
        for name in names:
            forward = name + ("_forward" if seq_dim == 1 else "")
            for op_name, backward in ((forward, False), (name + "_backward", True)):
                packet = getattr(aten, op_name, None)
                if packet is not None:
                    formulas[packet] = _attention_formula(1 if backward else 0, seq_dim, backward)
    return formulas


def _attention_formula(first: int, seq_dim: int, backward: bool) -> Callable[..., int]:
    """The formula of one attention op: its query is argument ``first``, its key the next."""
    def formula(*args, **kwargs) -> int:
        return _attention_flops(args[first], args[first + 1], seq_dim, backward)
    return formula


class MatmulCounter(TorchDispatchMode):
    """Adds up the FLOPs of every matrix multiplication (and attention kernel) dispatched while
    active, by the dtype of its operands: ``with MatmulCounter() as mm: ...``, then
    ``mm.flops_by_dtype`` (``{torch.bfloat16: ...}``) and :meth:`dominant_dtype`.

    The operand is the first multiplied tensor (addmm's and baddbmm's first argument is the term
    added, e.g. a bias). DTensors are let through as :class:`CommCounter` lets them, so a sharded
    model's local matmuls are counted with their local shapes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops_by_dtype: dict[torch.dtype, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _has_dtensor(types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)
        formula = _matmul_formulas().get(packet)
        if formula is not None:
            operand = args[1] if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm) else args[0]
            self.flops_by_dtype[operand.dtype] += int(formula(*args, **kwargs, out_val=out))
        return out

    def dominant_dtype(self) -> torch.dtype | None:
        """The dtype that did the most multiplication FLOPs, or None when none ran."""
        counted = {dtype: flops for dtype, flops in self.flops_by_dtype.items() if flops > 0}
        return max(counted, key=counted.get) if counted else None
