"""Validation: every matrix cell, predicted vs measured (:func:`validate`), summarized and held to
:data:`VALIDATION_BOUNDS`."""
from __future__ import annotations

import statistics
from typing import Iterable

from .. import compare, predictors
from ..strategies import Strategy
from .calibration import base_arch, cpu_cluster
from .choose import estimate_record
from .inputs import Cluster

# ----------------------------------------------------------------------------------------------
# Validation: every matrix cell, predicted vs measured
# ----------------------------------------------------------------------------------------------

def validate(records: list[dict], cl: Cluster | None = None,
             calibration: Iterable[str] = (Strategy.DDP,)) -> list[dict]:
    """Predicted vs measured for every training cell of a benchmark results file (the CPU matrix):
    model-state bytes (theory's busiest rank: must be equal), activations (MemTracker's, from the
    record's ``peak_memory_by_category_per_rank``: their high-water mark in the step where the record
    has it, ``activations_high_water``; in records made before the harness noted it, their size at
    the step's peak), the peak itself (MemTracker's total),
    and the step time on a calibrated cluster. One row per cell with relative errors (``*_error``:
    predicted / measured - 1); ``calibration`` is True on the cells the time model was fitted to.

    Without ``cl`` the time is predicted out of sample: each architecture's cells on
    :func:`cpu_cluster` calibrated with that model's own ``calibration`` cells (its speed on this
    machine, the way one measures a model before planning it) and every other strategy's framework
    overhead from the *other* architecture's cells (with one architecture: the other world
    size's). A strategy with cells of one architecture only (context and expert parallelism run the
    GPT alone) has no other architecture to learn from: its overhead comes from its own cells at the
    other world size, still out of sample. The mixture-of-experts GPT counts as the GPT (its speed
    from the GPT's calibration cells: :func:`_model_speed`)."""
    calibration = tuple(calibration)
    rows = []
    if cl is None:
        cells = [r for r in records if r.get("model")]
        by_arch = len({base_arch(r["model"]["arch"]) for r in cells}) > 1
        key = (lambda r: base_arch(r["model"]["arch"])) if by_arch else (lambda r: r["world_size"])
        measured = [r for r in cells if (r.get("metrics") or {}).get("step_time_s_median")]
        one_arch = {s for s in {r["strategy"] for r in measured}
                    if len({key(r) for r in measured if r["strategy"] == s}) == 1} if by_arch else set()
        for group in sorted({key(r) for r in cells}):
            mine = [r for r in cells if key(r) == group]
            known = [r for r in records if not r.get("model") or key(r) != group or r["strategy"] in calibration]
            for arch, ranks in sorted({(r["model"]["arch"], r["world_size"]) for r in mine}):
                own_other_size = [r for r in mine if r["strategy"] in one_arch and r["world_size"] != ranks]
                fitted = cpu_cluster(known + own_other_size, ranks, arch, calibration)
                rows += validate([r for r in mine if (r["model"]["arch"], r["world_size"]) == (arch, ranks)],
                                 fitted, calibration)
        return rows
    for rec in records:
        metrics = rec.get("metrics") or {}
        if rec.get("status", "ok") != "ok" or not metrics.get("step_time_s_median") or not rec.get("model"):
            continue
        try:
            est = estimate_record(rec, cl)
        except ValueError:
            continue
        pred = predictors.busiest_rank_prediction(rec["strategy"], compare.config_of_record(rec), rec["world_size"],
                                              int(rec["config"]["global_batch_size"]), compare.knobs_of_record(rec))
        rank = est.layout.get("rank", pred["rank"])
        if rank != pred["rank"]:  # the planner's deciding rank (a pipeline's), compared there
            full = compare.predict_record(rec)["state_per_rank"][rank]
            pred = {**pred, "state": full}
        state_measured = sum(metrics["model_state_bytes_per_rank"][rank].values())
        by_cat = (metrics.get("peak_memory_by_category_per_rank") or [None] * (rank + 1))[rank]
        row = {"strategy": rec["strategy"], "world_size": rec["world_size"], "arch": rec["model"]["arch"],
               "rank": rank, "state_predicted": sum(pred["state"].values()), "state_measured": state_measured,
               "step_predicted_s": est.step_time_s, "step_measured_s": metrics["step_time_s_median"],
               "calibration": rec["strategy"] in calibration}
        if by_cat:
            row.update(activations_predicted=est.memory_bytes["activations"],
                       activations_measured=by_cat.get("activations_high_water", by_cat["activations"]),
                       peak_predicted=est.memory_bytes["peak"], peak_measured=by_cat["total"],
                       temporaries_predicted=est.memory_bytes["temporaries"],
                       temporaries_measured=by_cat["temporaries"])
        for key in ("state", "activations", "peak", "step"):
            p, m = row.get(f"{key}_predicted") or row.get(f"{key}_predicted_s"), \
                row.get(f"{key}_measured") or row.get(f"{key}_measured_s")
            row[f"{key}_error"] = p / m - 1 if p is not None and m else None
        rows.append(row)
    return rows


def validation_summary(rows: list[dict]) -> dict:
    """Median and worst absolute relative error of each quantity over the cells (the step time over
    the predicted cells only: not those the time model was calibrated on)."""
    out = {}
    for key in ("state", "activations", "peak", "step"):
        errs = [abs(r[f"{key}_error"]) for r in rows if r.get(f"{key}_error") is not None
                and not (key == "step" and r.get("calibration"))]
        out[key] = {"cells": len(errs), "median": statistics.median(errs) if errs else None,
                    "worst": max(errs) if errs else None}
    return out


# The bounds on a prediction's relative error: model state exact, activations 10%, the peak
# 15%, the step time 50% in the worst cell (and 20% in the median, a bound on the summary).
VALIDATION_BOUNDS = {"state": 0.0, "activations": 0.10, "peak": 0.15, "step": 0.50}


def validation_bounds_text() -> str:
    """:data:`VALIDATION_BOUNDS` in words: "model state exact, activations 10%, peak 15%, step time 50%"."""
    names = {"state": "model state", "step": "step time"}
    return ", ".join(f"{names.get(key, key)} {f'{100 * bound:g}%' if bound else 'exact'}"
                     for key, bound in VALIDATION_BOUNDS.items())


def validation_misses(row: dict) -> list[str]:
    """The quantities of one validation row whose error leaves :data:`VALIDATION_BOUNDS` (the step
    time of a calibration cell is not a prediction)."""
    return [key for key, bound in VALIDATION_BOUNDS.items()
            if row.get(f"{key}_error") is not None and abs(row[f"{key}_error"]) > bound
            and not (key == "step" and row.get("calibration"))]


def validation_table(rows: list[dict], only_misses: bool = False) -> str:
    """The per-cell errors as a Markdown table (MiB, ms, signed %) and the summary; with
    ``only_misses`` only the cells with an error outside :data:`VALIDATION_BOUNDS`."""
    def pct(v):
        return "-" if v is None else f"{100 * v:+.1f}%"

    def mib(v):
        return "-" if v is None else f"{v / 2 ** 20:.3f}"

    lines = ["| strategy | model | ranks | model state MiB pred / meas | activations MiB pred / meas (err) | "
             "peak MiB pred / meas (err) | step ms pred / meas (err) |", "|---|---|---:|---|---|---|---|"]
    shown = [r for r in rows if validation_misses(r)] if only_misses else rows
    for r in shown:
        lines.append(f"| {r['strategy']} | {r['arch']} | {r['world_size']} | {mib(r['state_predicted'])} / "
                     f"{mib(r['state_measured'])} | {mib(r.get('activations_predicted'))} / "
                     f"{mib(r.get('activations_measured'))} ({pct(r.get('activations_error'))}) | "
                     f"{mib(r.get('peak_predicted'))} / {mib(r.get('peak_measured'))} ({pct(r.get('peak_error'))}) | "
                     f"{1e3 * r['step_predicted_s']:.1f} / {1e3 * r['step_measured_s']:.1f} "
                     + ("(calibration) |" if r.get("calibration") else f"({pct(r['step_error'])}) |"))
    s = validation_summary(rows)
    lines.append("")
    lines.append("; ".join(f"{k}: median {100 * v['median']:.1f}%, worst {100 * v['worst']:.1f}% ({v['cells']} cells"
                           + (", the calibration cells left out" if k == "step" else "") + ")"
                           for k, v in s.items() if v["cells"]))
    if only_misses:
        lines.append(f"{len(shown)} of {len(rows)} cells outside the bounds ({validation_bounds_text()})")
    return "\n".join(lines)
