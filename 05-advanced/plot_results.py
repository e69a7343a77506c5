"""Plot chapter 05's measurements from harness records: the pipeline bubble (measured vs theory)
against the micro-batch count, and DDP throughput against ``bucket_cap_mb``.

    python 05-advanced/plot_results.py --results runs/results.jsonl --out-dir 05-advanced

Reads the records that pipeline_parallel.py and communication_overlap.py appended (the newest record
wins for each schedule/micro-batch count and each bucket size) and writes ``pipeline_bubble.png``
and ``bucket_sweep.png``. The machine the numbers came from is written in each title.
"""
from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distkit.harness import read_records  # noqa: E402


def where(record: dict) -> str:
    return (f"{record['machine']['device_name']}, {record['backend']}, "
            f"{record['world_size']} ranks")


def plot_bubble(records: list[dict], path: str) -> bool:
    runs = {}
    for r in records:
        if r.get("config", {}).get("script") == "pipeline_parallel" and r["bubble"]["measured"] is not None:
            runs[(r["config"]["schedule"], r["config"]["microbatches"])] = r
    if not runs:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for (schedule, color) in zip(sorted({s for s, _ in runs}), ("C0", "C1", "C2")):
        points = sorted((m, r) for (s, m), r in runs.items() if s == schedule)
        ms = [m for m, _ in points]
        ax.plot(ms, [r["bubble"]["measured"] for _, r in points], "o-", color=color, label=f"{schedule} measured")
        ax.plot(ms, [r["bubble"]["theory"] for _, r in points], "--", color=color, label=f"{schedule} theory")
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("idle fraction of schedule.step()")
    ax.set_ylim(0, 1)
    ax.set_title(f"Pipeline bubble: {where(next(iter(runs.values())))}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_buckets(records: list[dict], path: str) -> bool:
    runs = {r["config"]["bucket_cap_mb"]: r for r in records
            if r.get("config", {}).get("script") == "communication_overlap"}
    if not runs:
        return False
    sizes = sorted(runs)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [runs[s]["metrics"]["samples_per_s"] for s in sizes], "o-")
    for s in sizes:
        calls = runs[s]["metrics"]["comm_per_step"].get("all_reduce", {}).get("calls", 0)
        ax.annotate(f"{calls:.0f} all-reduces", (s, runs[s]["metrics"]["samples_per_s"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("samples / s")
    ax.set_title(f"DDP throughput vs bucket size: {where(runs[sizes[0]])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="runs/results.jsonl", help="harness records (default: runs/results.jsonl)")
    parser.add_argument("--out-dir", default="05-advanced", help="where the PNGs go (default: 05-advanced)")
    args = parser.parse_args()
    if not os.path.exists(args.results):
        parser.error(f"{args.results} does not exist: run pipeline_parallel.py / communication_overlap.py first")
    records = read_records(args.results)
    os.makedirs(args.out_dir, exist_ok=True)
    for name, plot in (("pipeline_bubble.png", plot_bubble), ("bucket_sweep.png", plot_buckets)):
        path = os.path.join(args.out_dir, name)
        print(f"wrote {path}" if plot(records, path) else f"skipped {name}: no matching records in {args.results}")


if __name__ == "__main__":
    main()
