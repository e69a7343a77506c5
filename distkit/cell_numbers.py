"""One benchmark cell, read from its record: which cell it is (model, device and backend) and its
numbers: step time, throughput, model-state, bus and peak memory MiB, MFU, the prediction beside it,
and scaling efficiency. Every table, plot and notebook of the benchmarks (``benchmarks/plot.py`` and,
through it, the benchmarks notebook) reads a cell through these, so they agree by construction."""
from __future__ import annotations

from collections import defaultdict

from .compare import predict_record
from .memory import MEMORY_CATEGORIES

MIB = 2**20


def where(record: dict) -> str:
    """Where a cell ran, e.g. ``cuda/nccl`` or ``cpu/gloo`` (``?`` for a cell that never started)."""
    return f"{record['device']}/{record.get('backend', '?')}" if "device" in record else "?"


def mixed(records: list[dict]) -> bool:
    """True when the records come from more than one device/backend."""
    return len({where(r) for r in records if where(r) != "?"}) > 1


def model_size(record: dict) -> str:
    """The cell's model preset: what the runner asked for (``benchmark.model_size``; records of
    older runs that skipped a cell kept it at the top level, chapter records in their config)."""
    bench = record.get("benchmark") or {}
    size = bench.get("model_size") or record.get("model_size") or record.get("config", {}).get("model_size", "?")
    arch = (record.get("model") or {}).get("arch", "gpt")
    # the small GPT's sizes keep their plain names; the Llama's and the mixture-of-experts GPT's
    # (expert parallelism's model: another model, so its own panel) say what they are
    return size if arch == "gpt" else f"{arch} {size}"


def step_s(record: dict) -> float:
    """Step time: the median timed step of the slowest rank (``distkit.harness``)."""
    return record["metrics"]["step_time_s_median"]


def tokens_per_s(record: dict) -> float:
    """Throughput: tokens one step processes / the step time (0 when the cell timed no step)."""
    return record["metrics"]["tokens_per_s"] or 0.0


def state_mib(record: dict) -> float:
    """Model-state MiB (params + grads + optimizer) of the rank that holds the most."""
    return max(sum(s.values()) for s in record["metrics"]["model_state_bytes_per_rank"]) / MIB


def bus_mib(record: dict) -> float:
    """Bus MiB rank 0 put on the wire in the counted step."""
    return sum(c["bus_bytes"] for c in record["metrics"]["comm_per_step"].values()) / MIB


def peak_mib(record: dict) -> float:
    """Peak memory MiB of the rank with the highest peak (GPU: allocated; CPU: MemTracker's tracked
    tensors, or the process RSS in records from before the harness tracked them)."""
    return max(record["metrics"]["peak_memory_bytes_per_rank"]) / MIB


PEAK_PARTS = tuple(MEMORY_CATEGORIES)  # params, grads, optimizer, activations, temporaries


def peak_parts_mib(record: dict) -> dict[str, float] | None:
    """MiB by category at the peak of the rank with the highest peak (MemTracker, see
    ``distkit.harness.MEMORY_CATEGORIES``), or None where the record has no categories."""
    metrics = record["metrics"]
    parts = metrics.get("peak_memory_by_category_per_rank") or []
    if not parts or any(p is None for p in parts):
        return None
    top = max(range(len(parts)), key=lambda rank: parts[rank]["total"])
    return {name: parts[top][name] / MIB for name in PEAK_PARTS}


def peak_label(records: list[dict]) -> str:
    """What the cells' peak memory is (one kind per panel: cells of one device)."""
    kinds = {r["metrics"].get("peak_memory_kind", "") for r in records}
    if kinds == {"cpu_mem_tracker"}:
        return "peak tensor memory (MemTracker)"
    if kinds == {"cuda_max_allocated"}:
        return "peak allocated"
    return "peak RSS" if all("rss" in k for k in kinds) else "peak memory"


def mfu_percent(record: dict) -> float:
    """Model FLOPs utilisation in % (NaN for records from before the harness measured it)."""
    mfu = record["metrics"].get("mfu")
    return 100 * mfu if mfu else float("nan")


def tokens_per_s_per_device(record: dict) -> float:
    return record["metrics"].get("tokens_per_s_per_device") or float("nan")


def prediction(record: dict) -> dict | None:
    """``distkit.predictors``' prediction for a record (None for a strategy it does not model)."""
    try:
        return predict_record(record)
    except (ValueError, KeyError):
        return None


def predicted_state_mib(prediction: dict | None) -> float:
    return max(sum(s.values()) for s in prediction["state_per_rank"]) / MIB if prediction else float("nan")


def predicted_bus_mib(prediction: dict | None) -> float:
    return sum(c["bus_bytes"] for c in prediction["comm_per_rank"][0].values()) / MIB if prediction else float("nan")


def efficiencies(records: list[dict]) -> dict[str, dict[int, float]]:
    """Scaling efficiency per strategy and world size: tokens/s at N / (tokens/s at N0 x N / N0),
    N0 the smallest world size measured for that strategy (1.0 = linear scaling). Strategies measured
    at one world size only have no curve. Records of one model and device (as ``benchmarks/plot.py``
    groups them)."""
    by_strategy: dict[str, dict[int, float]] = defaultdict(dict)
    for r in records:
        by_strategy[r["strategy"]][r["world_size"]] = tokens_per_s(r)
    out = {}
    for strategy, points in by_strategy.items():
        worlds = sorted(points)
        if len(worlds) >= 2 and points[worlds[0]]:
            base_n, base = worlds[0], points[worlds[0]]
            out[strategy] = {n: points[n] / (base * n / base_n) for n in worlds}
    return out
