"""Comparison plots and a Markdown table from a benchmark results file (JSON lines).

    python benchmarks/plot.py --results runs/benchmarks.jsonl --out-dir runs/plots

Writes ``throughput.png`` (tokens/s by strategy and world size), ``memory.png`` (per-rank model
state and peak memory, measured bars with the theory.py prediction as a marker), ``comm_bytes.png``
(bus bytes per step, measured vs predicted), ``scaling.png`` (scaling efficiency from the smallest
world size), ``bandwidth.png`` (bus bandwidth vs message size, when the results hold chapter-04
sweeps) and ``summary.md``. Every PNG is stamped with the device, backend, world sizes, torch
version and date the numbers come from. When a cell was run several times the newest record counts.

A results file may hold cells that ran on different devices (``distributed_benchmarks.py`` on a
machine with fewer GPUs than a cell's ranks runs that cell on CPU/gloo): GPU and CPU numbers are
then never drawn in one panel nor compared in one scaling curve, and the table gets a column saying
where each cell ran.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distkit import ArgumentParser, UsageError, run_main  # noqa: E402
from distkit.harness import read_records  # noqa: E402

import theory  # noqa: E402  (benchmarks/theory.py: the script's folder is on the import path)

MIB = 2**20
PLOTS = ("throughput.png", "memory.png", "comm_bytes.png", "scaling.png", "bandwidth.png")


def load(path: str | os.PathLike) -> tuple[list[dict], list[dict], list[dict]]:
    """(newest ok record per cell, failed/skipped cells, bandwidth records) of a results file."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"results file {path} does not exist; run benchmarks/distributed_benchmarks.py first")
    try:
        records = read_records(path)
    except ValueError as exc:
        raise UsageError(f"results file {path} is not JSON lines: {exc}") from None
    cells: dict[tuple, dict] = {}
    problems: dict[tuple, dict] = {}
    bandwidth: dict[tuple, dict] = {}
    for record in records:  # oldest first: later ones replace earlier ones
        strategy = record.get("strategy", "")
        if strategy.startswith("bandwidth_"):
            if "rows" in record:
                bandwidth[(strategy, record["world_size"], record.get("device"))] = record
            continue
        key = (strategy, record.get("world_size"), model_size(record), where(record))
        if record.get("status", "ok") == "ok" and "metrics" in record:
            cells[key] = record
            problems.pop(key, None)
        else:
            problems[key] = record
            cells.pop(key, None)
    order = {name: i for i, name in enumerate(theory.STRATEGIES)}
    sort = lambda r: (model_size(r), order.get(r["strategy"], 99), r["world_size"])  # noqa: E731
    return sorted(cells.values(), key=sort), sorted(problems.values(), key=sort), list(bandwidth.values())


def where(record: dict) -> str:
    """Where a cell ran, e.g. ``cuda/nccl`` or ``cpu/gloo`` (``?`` for a cell that never started)."""
    if "device" not in record:
        return "?"
    return f"{record['device']}/{record.get('backend', '?')}"


def mixed(records: list[dict]) -> bool:
    """True when the records come from more than one device/backend."""
    return len({where(r) for r in records if where(r) != "?"}) > 1


def model_size(record: dict) -> str:
    bench = record.get("benchmark") or {}
    return bench.get("model_size") or record.get("config", {}).get("model_size") or record.get("model_size", "?")


def stamp(fig, records: list[dict], source: str) -> None:
    """Write where the numbers come from at the bottom of a figure."""
    if not records:
        return
    first = records[0]
    devices = []
    for record in records:  # every device the numbers come from, in order of appearance
        machine = record.get("machine", {})
        device = machine.get("device_name", record.get("device", "?"))
        if record.get("device") == "cpu":
            device = f"{machine.get('cpu_cores', '?')}-core CPU ({machine.get('cpu', 'unknown CPU')})"
        if device not in devices:
            devices.append(device)
    device = " + ".join(devices)
    worlds = sorted({r["world_size"] for r in records})
    dates = sorted(r.get("timestamp", "")[:10] for r in records if r.get("timestamp"))
    backends = sorted({r.get("backend", "?") for r in records})
    text = (f"{device} | backend {'/'.join(backends)} | world sizes {', '.join(map(str, worlds))} | "
            f"torch {first.get('torch_version', '?')} | {dates[0] if dates else '?'}"
            f"{' .. ' + dates[-1] if dates and dates[-1] != dates[0] else ''} | {source}")
    fig.text(0.01, 0.005, text, fontsize=7, color="0.35", ha="left", va="bottom")


def _grouped(ax, records, value, ylabel, predicted=None, log=False):
    """Bars per strategy, one colour per world size; optional predicted markers."""
    strategies = list(dict.fromkeys(r["strategy"] for r in records))
    worlds = sorted({r["world_size"] for r in records})
    width = 0.8 / max(len(worlds), 1)
    for j, world in enumerate(worlds):
        xs, ys, ps = [], [], []
        for i, strategy in enumerate(strategies):
            for r in records:
                if r["strategy"] == strategy and r["world_size"] == world:
                    xs.append(i + (j - (len(worlds) - 1) / 2) * width)
                    ys.append(value(r))
                    ps.append(predicted(r) if predicted else None)
        ax.bar(xs, ys, width=width * 0.95, label=f"{world} ranks measured")
        if predicted:
            ax.scatter(xs, ps, marker="_", s=180, linewidths=2.5, color="black", zorder=3,
                       label="theory.py" if j == 0 else None)
    ax.set_xticks(range(len(strategies)))
    ax.set_xticklabels(strategies, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _by_model(records):
    """Panels: one per model size, and per device/backend when the records mix them."""
    split = mixed(records)
    groups = defaultdict(list)
    for r in records:
        groups[f"{model_size(r)} on {where(r)}" if split else model_size(r)].append(r)
    return groups


def _figure(n_rows, title):
    fig, axes = plt.subplots(n_rows, 1, figsize=(11, 4.2 * n_rows + 0.6), squeeze=False)
    fig.suptitle(title)
    return fig, [ax for row in axes for ax in row]


def _predictions(records):
    out = {}
    for r in records:
        try:
            out[id(r)] = theory.predict_record(r)
        except (ValueError, KeyError):  # a strategy theory does not model
            out[id(r)] = None
    return out


def plot_throughput(records, path, source):
    groups = _by_model(records)
    fig, axes = _figure(len(groups), "Throughput by strategy (higher is better)")
    for ax, (size, rs) in zip(axes, groups.items()):
        _grouped(ax, rs, lambda r: r["metrics"]["tokens_per_s"] or 0, f"{size} model: tokens/s")
    _save(fig, records, path, source)


def plot_memory(records, path, source):
    groups = _by_model(records)
    preds = _predictions(records)
    fig, axes = _figure(2 * len(groups), "Memory per rank: model state (params + grads + optimizer) and peak")
    for k, (size, rs) in enumerate(groups.items()):
        state = lambda r: max(sum(s.values()) for s in r["metrics"]["model_state_bytes_per_rank"]) / MIB  # noqa: E731
        pred = lambda r: (max(sum(s.values()) for s in preds[id(r)]["state_per_rank"]) / MIB  # noqa: E731
                          if preds[id(r)] else float("nan"))
        _grouped(axes[2 * k], rs, state, f"{size}: model state MiB (max rank)", pred)
        kind = rs[0]["metrics"].get("peak_memory_kind", "")
        _grouped(axes[2 * k + 1], rs, lambda r: max(r["metrics"]["peak_memory_bytes_per_rank"]) / MIB,
                 f"{size}: peak {'RSS' if 'rss' in kind else 'allocated'} MiB (max rank)", pred)
    _save(fig, records, path, source)


def plot_comm(records, path, source):
    groups = _by_model(records)
    preds = _predictions(records)
    fig, axes = _figure(len(groups), "Bytes each rank puts on the wire per step (rank 0, bus bytes)")
    for ax, (size, rs) in zip(axes, groups.items()):
        measured = lambda r: sum(c["bus_bytes"] for c in r["metrics"]["comm_per_step"].values()) / MIB  # noqa: E731
        pred = lambda r: (sum(c["bus_bytes"] for c in preds[id(r)]["comm_per_rank"][0].values()) / MIB  # noqa: E731
                          if preds[id(r)] else float("nan"))
        _grouped(ax, rs, measured, f"{size}: MiB per step", pred)
    _save(fig, records, path, source)


def plot_scaling(records, path, source):
    """Throughput at N ranks / (throughput at the smallest N x N / N0): 1.0 = perfect scaling."""
    groups = _by_model(records)
    fig, axes = _figure(len(groups), "Scaling efficiency relative to the smallest world size (1.0 = linear)")
    for ax, (size, rs) in zip(axes, groups.items()):
        by_strategy = defaultdict(dict)
        for r in rs:
            by_strategy[r["strategy"]][r["world_size"]] = r["metrics"]["tokens_per_s"] or 0
        for strategy, points in by_strategy.items():
            worlds = sorted(points)
            if len(worlds) < 2 or not points[worlds[0]]:
                continue
            base_n, base = worlds[0], points[worlds[0]]
            ax.plot(worlds, [points[n] / (base * n / base_n) for n in worlds], marker="o", label=strategy)
        ax.axhline(1.0, color="0.5", ls="--", lw=1)
        ax.set_xlabel("world size")
        ax.set_ylabel(f"{size}: efficiency")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=3)
        else:
            ax.text(0.5, 0.5, "needs records at two or more world sizes", ha="center", transform=ax.transAxes)
    _save(fig, records, path, source)


def plot_bandwidth(bandwidth, path, source):
    fig, axes = _figure(1, "Collective bus bandwidth vs message size (chapter 04 sweep)")
    ax = axes[0]
    for record in sorted(bandwidth, key=lambda r: (r["strategy"], r["world_size"])):
        rows = record["rows"]
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o",
                label=f"{record['collective']} | {record['world_size']} ranks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(alpha=0.3)
    if bandwidth:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no bandwidth records: run distributed_benchmarks.py --bandwidth", ha="center",
                transform=ax.transAxes)
    _save(fig, bandwidth, path, source)


def _save(fig, records, path, source):
    stamp(fig, records, source)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(records: list[dict], problems: list[dict]) -> str:
    """Markdown: one row per cell, measured next to predicted, and the cells that failed."""
    split = mixed(records)
    lines = ["| strategy | ranks | model | step ms | tokens/s | model state MiB/rank (theory) | "
             "bus MiB/step rank 0 (theory) | peak MiB/rank |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    if split:  # say where each cell ran; peak memory is GPU-allocated on one, process RSS on the other
        lines = [lines[0].replace("| model |", "| model | ran on |"), lines[1].replace("|---|---:|---|", "|---|---:|---|---|", 1)]
    preds = _predictions(records)
    for r in records:
        m, p = r["metrics"], preds[id(r)]
        state = max(sum(s.values()) for s in m["model_state_bytes_per_rank"]) / MIB
        bus = sum(c["bus_bytes"] for c in m["comm_per_step"].values()) / MIB
        p_state = f"{max(sum(s.values()) for s in p['state_per_rank']) / MIB:.3f}" if p else "-"
        p_bus = f"{sum(c['bus_bytes'] for c in p['comm_per_rank'][0].values()) / MIB:.3f}" if p else "-"
        step = m["step_time_s_median"]
        lines.append(f"| {r['strategy']} | {r['world_size']} | {model_size(r)} | "
                     + (f"{where(r)} | " if split else "") +
                     f"{step * 1e3:.1f} | {m['tokens_per_s'] or 0:,.0f} | {state:.3f} ({p_state}) | "
                     f"{bus:.3f} ({p_bus}) | {max(m['peak_memory_bytes_per_rank']) / MIB:,.0f} |")
    for r in problems:
        lines.append(f"| {r['strategy']} | {r.get('world_size', '?')} | {model_size(r)} | "
                     + ("| " if split else "") +
                     f"{r.get('status', 'failed')}: {r.get('error', '')} | | | | |")
    return "\n".join(lines) + "\n"


def write_all(results: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Every plot and the summary table for ``results``; returns the files written."""
    records, problems, bandwidth = load(results)
    if not records and not bandwidth:
        raise UsageError(f"results file {results} holds no successful benchmark record")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = f"data: {Path(results).name}"
    plot_throughput(records, out / "throughput.png", source)
    plot_memory(records, out / "memory.png", source)
    plot_comm(records, out / "comm_bytes.png", source)
    plot_scaling(records, out / "scaling.png", source)
    plot_bandwidth(bandwidth, out / "bandwidth.png", source)
    (out / "summary.md").write_text(summary_table(records, problems))
    return [out / name for name in (*PLOTS, "summary.md")]


def main(argv=None):
    parser = ArgumentParser(description="Comparison plots (PNG) and a Markdown table from benchmark results.",
                            epilog="example: python benchmarks/plot.py --results runs/benchmarks.jsonl")
    parser.add_argument("--results", default="runs/benchmarks.jsonl",
                        help="JSON-lines results of distributed_benchmarks.py (default: runs/benchmarks.jsonl)")
    parser.add_argument("--out-dir", default="runs/plots", help="where the PNGs and summary.md go (default: runs/plots)")
    args = parser.parse_args(argv)
    for path in write_all(args.results, args.out_dir):
        print(f"wrote {path}")
    print((Path(args.out_dir) / "summary.md").read_text())


if __name__ == "__main__":
    run_main(main)
