"""Calibration on this machine: collective alpha/beta from the chapter-04 bandwidth sweep, matmul
FLOP/s and a compute efficiency from the benchmark matrix (:func:`cpu_cluster`)."""
from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Iterable

from ..comm_counter import bus_factor
from ..errors import UsageError
from ..strategies import Strategy
from .choose import estimate_record, overhead_basis
from .inputs import GPU, Cluster, Link

# ----------------------------------------------------------------------------------------------
# Calibration on this machine: collectives from the bandwidth sweep, compute from the matrix
# ----------------------------------------------------------------------------------------------

def read_matrix(path) -> list[dict]:
    """The records of a results file (:func:`distkit.harness.read_records`); a one-line error when
    it is missing or holds none."""
    from pathlib import Path

    from ..record_format import read_records

    if not Path(path).is_file():
        raise UsageError(f"no records file {path}")
    try:
        records = read_records(path)
    except (ValueError, AttributeError, TypeError) as exc:  # not JSON lines of records
        raise UsageError(f"{path} is not a file of JSON records ({exc})") from None
    if not records:
        raise UsageError(f"{path} holds no records")
    return records


def fit_collectives(records: list[dict]) -> dict:
    """``{(collective, ranks): (alpha_s, beta_bytes_per_s)}`` from bandwidth-sweep records
    (``04-nccl-operations/bandwidth_test.py``, also in a benchmark results file with ``--bandwidth``):
    per collective and rank count the least-squares line ``time = alpha + bus_bytes / beta`` through
    the sweep's (size x bus factor, time) points, weighted by 1/time^2 so small and large messages
    count alike (a relative fit)."""
    fits = {}
    for rec in records:
        if not str(rec.get("strategy", "")).startswith("bandwidth") or not rec.get("rows"):
            continue
        n = rec["world_size"]
        name = rec.get("collective") or rec["strategy"].removeprefix("bandwidth_")
        factor = bus_factor(name, n)
        pts = [(row["size_bytes"] * factor, row["time_us"] * 1e-6) for row in rec["rows"] if row.get("time_us")]
        if len(pts) < 2:
            continue
        w = [1 / t ** 2 for _, t in pts]
        sw = sum(w)
        mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
        my = sum(wi * y for wi, (_, y) in zip(w, pts)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
        slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, pts)) / sxx if sxx else 0.0
        slope = max(slope, 1e-15)
        alpha = max(my - slope * mx, 0.0)
        fits[(name, n)] = (alpha, 1 / slope)
    return fits


CPU = GPU("CPU rank (calibrated)", 0.0, {"fp32": 0.0}, 10e9, Link(1e9, 1e-3), Link(1e9, 1e-3), 10e9, 1,
          "calibrated from this machine's records")


def base_arch(arch: str) -> str:
    """The dense architecture a record's model is built on: ``gpt_moe`` -> ``gpt``."""
    return arch.removesuffix("_moe")


def _model_speed(records: list[dict], base: Cluster, arch: str | None, ranks: int,
                 calibration: Iterable[str]) -> float | None:
    """The compute efficiency of ``arch`` with ``ranks`` ranks on this machine: the fraction of the
    matmul rate that the ``calibration`` cells (plain data parallelism) of that model reach once
    their predicted communication is taken off, from the cells with the rank count nearest
    ``ranks`` (how many ranks share a core changes it: four ranks on two cores lose more to
    switching than two). An MoE model's speed is its dense base's (``gpt_moe``: the GPT's cells).
    None when no such cell exists."""
    cells = [r for r in records if r["strategy"] in calibration and r.get("model")
             and r.get("metrics", {}).get("step_time_s_median")
             and (arch is None or base_arch(r["model"]["arch"]) == base_arch(arch))]
    if not cells:
        return None
    nearest = min({r["world_size"] for r in cells}, key=lambda w: (abs(w - ranks), w))
    ratios = []
    for rec in cells:
        if rec["world_size"] != nearest:
            continue
        est = estimate_record(rec, base)
        spent = rec["metrics"]["step_time_s_median"] - est.step_time_s + est.times["compute_s"]
        if spent > 0:
            ratios.append(est.times["compute_s"] / spent)
    return statistics.median(ratios) if ratios else None


def with_measured_speed(cl: Cluster, records: list[dict], arch: str | None = None,
                        calibration: Iterable[str] = (Strategy.DDP,)) -> Cluster:
    """``cl`` with the compute efficiency its ``calibration`` cells measured (the model's speed on
    this machine, :func:`_model_speed`) instead of an assumed one: how a GPU's planner is calibrated
    from a one-GPU benchmark run. One line of error when the records hold no such cell."""
    speed = _model_speed(records, replace(cl, efficiency=1.0), arch, cl.gpus, tuple(calibration))
    if speed is None:
        raise UsageError(f"no {'/'.join(calibration)} cell{' of the ' + arch if arch else ''} among the records "
                         "to measure the model's speed")
    return replace(cl, efficiency=speed)


def cpu_cluster(records: list[dict], ranks: int, arch: str | None = None,
                calibration: Iterable[str] = (Strategy.DDP,)) -> Cluster:
    """This machine as a cluster of ``ranks`` CPU ranks, calibrated from its own records:

    * collectives' alpha/beta from the bandwidth sweeps (:func:`fit_collectives`);
    * the matmul FLOP/s of one core from the matrix's measured ``peak_flops_per_s`` (each rank
      measured its share of the cores: x ranks / cores);
    * the model's speed: the compute efficiency (the fraction of that matmul rate a step reaches:
      per-operation Python and small kernels keep it low for the tiny models) of the
      ``calibration`` cells of ``arch`` (any model when None or unrecorded) at the nearest rank
      count (:func:`_model_speed`);
    * each other strategy's framework overhead (hooks, DTensor dispatch, DeepSpeed's
      bookkeeping), in seconds per second of its predicted communication (context and expert
      parallelism: of its compute, :data:`OVERHEAD_BASIS`), from its cells (each against its own
      model's speed);
    * no overlap (gloo and compute share the cores); memory unbounded (the machine's RAM is not
      what the matrix tests)."""
    import os

    fits = fit_collectives(records)
    if not fits:
        raise UsageError("no bandwidth sweeps among the records: run distributed_benchmarks.py --bandwidth "
                         "(or 04-nccl-operations/bandwidth_test.py) to calibrate the collectives")
    calibration = tuple(calibration)
    train = [r for r in records if r.get("model") and r.get("metrics", {}).get("step_time_s_median")]
    cores = next((r["machine"].get("cpu_cores") for r in records if r.get("machine", {}).get("cpu_cores")),
                 os.cpu_count() or 1)
    per_core = [r["metrics"]["peak_flops_per_s"] * min(r["world_size"], cores) / cores
                for r in train if r["metrics"].get("peak_flops_per_s")]
    peak = statistics.median(per_core) if per_core else 20e9
    gpu = replace(CPU, memory_bytes=math.inf, peak_flops={"fp32": peak, "bf16": peak})
    base = Cluster(gpu, ranks, ranks, efficiency=1.0, usable_memory=1.0, overlap=False, collectives=fits,
                   cores=cores)
    speed = _model_speed(train, base, arch, ranks, calibration) or _model_speed(train, base, None, ranks, calibration)
    speeds: dict[tuple, float] = {}  # each model's speed at each rank count, measured once
    extra: dict[str, list[float]] = {}
    for rec in train:
        if rec["strategy"] in calibration:
            continue
        key = (base_arch(rec["model"]["arch"]), rec["world_size"])
        if key not in speeds:
            speeds[key] = _model_speed(train, base, *key, calibration) or speed or 0.1
        own = speeds[key]
        try:
            est = estimate_record(rec, replace(base, efficiency=own))
        except ValueError:
            continue
        basis = est.times[overhead_basis(rec["strategy"])]
        if basis:
            unexplained = rec["metrics"]["step_time_s_median"] - est.step_time_s
            extra.setdefault(rec["strategy"], []).append(unexplained / basis)
    overheads = {k: max(0.0, statistics.median(v)) for k, v in extra.items()}
    return replace(base, efficiency=speed or 0.1, overheads=overheads)
