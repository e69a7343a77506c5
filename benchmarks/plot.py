"""Comparison plots and a Markdown table from a benchmark results file (JSON lines).

    python benchmarks/plot.py --results runs/benchmarks.jsonl --out-dir runs/plots

Writes ``throughput.png`` (tokens/s by strategy and world size), ``memory.png`` (per-rank model
state, measured bars with the theory.py prediction as a marker, and, in its own panel, the measured
peak memory, which no formula here predicts), ``comm_bytes.png`` (bus bytes per step, measured vs
predicted), ``scaling.png`` (scaling efficiency from the smallest world size, one panel per family
of strategies), ``bandwidth.png`` (bus bandwidth vs message size, when the results hold chapter-04
sweeps) and ``summary.md``. Every PNG is stamped with the device, backend, world sizes, torch
version and date the numbers come from. When a cell was run several times the newest record counts.

One definition of speed (``distkit.harness``): a cell's step time is the median timed step of its
slowest rank, and its throughput is what one step processes / that step time. Records are read with
``distkit.harness.read_records``, which upgrades older (mean-based) records to it, so the table, the
plots and the scaling efficiencies all use the same numbers.

The README's tables and plots are drawn from the committed record ``records/results_cpu.jsonl`` by
the ``readme_*`` functions below (render marks of ``python -m distkit.records render benchmarks``).

A results file may hold cells that ran on different devices (``distributed_benchmarks.py`` on a
machine with fewer GPUs than a cell's ranks runs that cell on CPU/gloo): GPU and CPU numbers are
then never drawn in one panel nor compared in one scaling curve, and the table gets a column saying
where each cell ran.
"""
from __future__ import annotations

import functools
import os
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distkit import ArgumentParser, UsageError, run_main  # noqa: E402
from distkit.harness import read_records  # noqa: E402
from distkit.records import machine_label, save_figure  # noqa: E402

from distkit import theory  # noqa: E402

MIB = 2**20
PLOTS = ("throughput.png", "memory.png", "comm_bytes.png", "scaling.png", "bandwidth.png")
COMMITTED = Path(__file__).resolve().parent / "records" / "results_cpu.jsonl"
# Panels of scaling.png: few enough series per panel that colour and marker tell each one apart.
FAMILIES = {
    "data parallel (DDP, FSDP)": ("ddp", "ddp_from_scratch", "fsdp_no_shard", "fsdp_shard_grad_op",
                                  "fsdp_full_shard", "fsdp_hybrid_shard", "hsdp"),
    "ZeRO (DeepSpeed)": ("zero0", "zero1", "zero2", "zero3", "zero3_offload"),
    "model parallel (TP, PP, 2D)": ("tp", "tp_sp", "pp_gpipe", "pp_1f1b", "pp_interleaved_1f1b", "fsdp_tp_2d"),
}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


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
    if not records or not source:
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


# ------------------------------------------------------------------------ the numbers of a cell
# Every table, plot and notebook reads a cell's numbers through these, so they agree by construction.
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
    """Peak memory MiB of the rank with the highest peak (GPU: allocated; CPU: process RSS)."""
    return max(record["metrics"]["peak_memory_bytes_per_rank"]) / MIB


def predicted_state_mib(prediction: dict | None) -> float:
    return max(sum(s.values()) for s in prediction["state_per_rank"]) / MIB if prediction else float("nan")


def predicted_bus_mib(prediction: dict | None) -> float:
    return sum(c["bus_bytes"] for c in prediction["comm_per_rank"][0].values()) / MIB if prediction else float("nan")


def efficiencies(records: list[dict]) -> dict[str, dict[int, float]]:
    """Scaling efficiency per strategy and world size: tokens/s at N / (tokens/s at N0 x N / N0),
    N0 the smallest world size measured for that strategy (1.0 = linear scaling). Strategies measured
    at one world size only have no curve. Records of one model and device (see :func:`_by_model`)."""
    by_strategy: dict[str, dict[int, float]] = defaultdict(dict)
    for r in records:
        by_strategy[r["strategy"]][r["world_size"]] = tokens_per_s(r)
    out = {}
    for strategy, points in by_strategy.items():
        worlds = sorted(points)
        if len(worlds) < 2 or not points[worlds[0]]:
            continue
        base_n, base = worlds[0], points[worlds[0]]
        out[strategy] = {n: points[n] / (base * n / base_n) for n in worlds}
    return out


# ---------------------------------------------------------------------------------------- plots
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
                       label="theory.py prediction" if j == 0 else None)
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


_PREDICTED: dict[int, tuple[dict, dict | None]] = {}


def prediction(record: dict) -> dict | None:
    """theory.py's prediction for a record (None for a strategy it does not model), computed once
    per record object: the table and two figures ask for the same ones."""
    hit = _PREDICTED.get(id(record))
    if hit is not None and hit[0] is record:
        return hit[1]
    try:
        predicted = theory.predict_record(record)
    except (ValueError, KeyError):  # a strategy theory does not model
        predicted = None
    _PREDICTED[id(record)] = (record, predicted)  # the record is kept, so its id stays its own
    return predicted


def _predictions(records):
    return {id(r): prediction(r) for r in records}


def figure_throughput(records, source=""):
    groups = _by_model(records)
    fig, axes = _figure(len(groups), "Throughput by strategy (higher is better; median step of the slowest rank)")
    for ax, (size, rs) in zip(axes, groups.items()):
        _grouped(ax, rs, tokens_per_s, f"{size} model: tokens/s (whole job)")
    stamp(fig, records, source)
    return fig


def figure_memory(records, source=""):
    """Two quantities, two panels: the model state (measured bar, theory.py mark: the formulas
    predict exactly this), and the measured peak memory (no mark: nothing here predicts it)."""
    groups = _by_model(records)
    preds = _predictions(records)
    fig, axes = _figure(2 * len(groups), "Memory per rank")
    for k, (size, rs) in enumerate(groups.items()):
        _grouped(axes[2 * k], rs, state_mib,
                 f"{size}: model state, MiB\n(params + grads + optimizer,\nrank holding most)",
                 lambda r: predicted_state_mib(preds[id(r)]))
        axes[2 * k].set_title("model state each rank holds: measured (bars) vs theory.py (marks)", fontsize=9)
        kind = rs[0]["metrics"].get("peak_memory_kind", "")
        label = "peak RSS" if "rss" in kind else "peak allocated"
        _grouped(axes[2 * k + 1], rs, peak_mib, f"{size}: {label}, MiB\n(highest rank)")
        axes[2 * k + 1].set_title(
            f"measured {label} per rank" + (" (the whole process: Python, torch and the model state)"
                                            if "rss" in kind else ""), fontsize=9)
    stamp(fig, records, source)
    return fig


def figure_comm(records, source=""):
    groups = _by_model(records)
    preds = _predictions(records)
    fig, axes = _figure(len(groups), "Bytes each rank puts on the wire per step (rank 0, bus bytes)")
    for ax, (size, rs) in zip(axes, groups.items()):
        _grouped(ax, rs, bus_mib, f"{size}: bus MiB per step", lambda r: predicted_bus_mib(preds[id(r)]))
    stamp(fig, records, source)
    return fig


def figure_scaling(records, source=""):
    """Throughput at N ranks / (throughput at the smallest N x N / N0): 1.0 = perfect scaling.

    One row of panels per model (and device), one panel per family of strategies, so that every
    curve in a panel has its own colour and marker; ticks only at the world sizes measured."""
    groups = _by_model(records)
    families = list(FAMILIES.items())
    fig, axes = plt.subplots(len(groups), len(families), figsize=(13, 4.4 * len(groups) + 0.8),
                             squeeze=False, sharey=True)
    fig.suptitle("Scaling efficiency relative to the smallest world size (1.0 = linear)")
    colours = plt.get_cmap("tab10").colors
    for row, (size, rs) in zip(axes, groups.items()):
        eff = efficiencies(rs)
        worlds = sorted({r["world_size"] for r in rs})
        for ax, (family, members) in zip(row, families):
            drawn = [s for s in members if s in eff]
            for i, strategy in enumerate(drawn):
                points = eff[strategy]
                ax.plot(sorted(points), [points[n] for n in sorted(points)], color=colours[i % len(colours)],
                        marker=MARKERS[i % len(MARKERS)], ls=LINESTYLES[i % len(LINESTYLES)], lw=1.6,
                        markersize=7, label=strategy)
            single = [s for s in members if s not in eff and any(r["strategy"] == s for r in rs)]
            ax.axhline(1.0, color="0.5", ls="--", lw=1)
            ax.set_xticks(worlds)
            ax.set_xticklabels([str(n) for n in worlds])
            if len(worlds) > 1:
                ax.set_xlim(worlds[0] - 0.5, worlds[-1] + 0.5)
            ax.set_ylim(0, 1.1)
            ax.set_xlabel("world size (ranks)")
            ax.set_title(f"{size}: {family}", fontsize=9)
            ax.grid(alpha=0.3)
            if drawn:
                ax.legend(fontsize=7, loc="upper right")
            if single:
                ax.text(0.02, 0.03, "one world size only (no curve): " + ", ".join(single), fontsize=7,
                        transform=ax.transAxes, color="0.3")
            if not drawn and not single:
                ax.text(0.5, 0.5, "no records", ha="center", transform=ax.transAxes)
        row[0].set_ylabel("efficiency (tokens/s vs linear)")
    stamp(fig, records, source)
    return fig


def figure_bandwidth(bandwidth, source=""):
    fig, axes = _figure(1, "Collective bus bandwidth vs message size (chapter 04 sweep)")
    ax = axes[0]
    colours = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green"}
    worlds = sorted({r["world_size"] for r in bandwidth})
    for record in sorted(bandwidth, key=lambda r: (r["strategy"], r["world_size"])):
        rows = record["rows"]
        k = worlds.index(record["world_size"])
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows],
                color=colours.get(record["collective"]), marker=MARKERS[k % len(MARKERS)],
                ls=LINESTYLES[k % len(LINESTYLES)], label=f"{record['collective']} | {record['world_size']} ranks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(alpha=0.3)
    if bandwidth:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no bandwidth records: run distributed_benchmarks.py --bandwidth", ha="center",
                transform=ax.transAxes)
    stamp(fig, bandwidth, source)
    return fig


def _save(fig, path):
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    save_figure(fig, path)  # reproducible bytes: the same records draw the same file


def plot_throughput(records, path, source):
    _save(figure_throughput(records, source), path)


def plot_memory(records, path, source):
    _save(figure_memory(records, source), path)


def plot_comm(records, path, source):
    _save(figure_comm(records, source), path)


def plot_scaling(records, path, source):
    _save(figure_scaling(records, source), path)


def plot_bandwidth(bandwidth, path, source):
    _save(figure_bandwidth(bandwidth, source), path)


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
        p = preds[id(r)]
        p_state = f"{predicted_state_mib(p):.3f}" if p else "-"
        p_bus = f"{predicted_bus_mib(p):.3f}" if p else "-"
        lines.append(f"| {r['strategy']} | {r['world_size']} | {model_size(r)} | "
                     + (f"{where(r)} | " if split else "") +
                     f"{step_s(r) * 1e3:.1f} | {tokens_per_s(r):,.0f} | {state_mib(r):.3f} ({p_state}) | "
                     f"{bus_mib(r):.3f} ({p_bus}) | {peak_mib(r):,.0f} |")
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


# ------------------------------------------------------------- README render marks (committed record)
@functools.cache
def _committed() -> tuple[list[dict], list[dict], list[dict]]:
    """The committed record, read once per process while the file is unchanged (every readme_*
    function draws from it)."""
    return _load_once(COMMITTED, COMMITTED.stat().st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _load_once(path: Path, mtime_ns: int) -> tuple[list[dict], list[dict], list[dict]]:
    return load(path)


def caption(records: list[dict], what: str = "cells") -> str:
    """Where and when the committed records ran, for the line under a table or plot."""
    places = list(dict.fromkeys(machine_label(r["machine"], r.get("backend")) for r in records))
    torches = sorted({r.get("torch_version", "?") for r in records})
    dates = sorted({r["timestamp"][:10] for r in records if r.get("timestamp")})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    rel = COMMITTED.relative_to(COMMITTED.parent.parent)
    return (f"<sub>Measured on {' + '.join(places)}, torch {', '.join(torches)}, {when}: "
            f"{len(records)} {what} of [{rel}]({rel}).</sub>")


def _figure_markdown(out_dir: Path, name: str, alt: str, plot, records: list[dict], what: str = "cells") -> str:
    """Draw ``plot(records, ...)`` into ``figures/name`` and return its image link and caption."""
    plot(records, out_dir / "figures" / name, f"data: {COMMITTED.name}")
    return f"![{alt}](figures/{name})\n\n{caption(records, what)}\n"


def readme_table(out_dir: Path) -> str:
    """The summary table of the committed CPU matrix (measured, theory in brackets)."""
    records, problems, _ = _committed()
    return summary_table(records, problems) + "\n" + caption(records) + "\n"


def readme_throughput(out_dir: Path) -> str:
    records, _, _ = _committed()
    return _figure_markdown(out_dir, "throughput.png", "tokens per second by strategy and world size",
                            plot_throughput, records)


def readme_memory(out_dir: Path) -> str:
    records, _, _ = _committed()
    return _figure_markdown(out_dir, "memory.png", "model state per rank, measured and predicted; peak memory",
                            plot_memory, records)


def readme_comm(out_dir: Path) -> str:
    records, _, _ = _committed()
    return _figure_markdown(out_dir, "comm_bytes.png", "bus bytes per step, measured and predicted",
                            plot_comm, records)


def readme_scaling(out_dir: Path) -> str:
    """scaling.png and, under it, the efficiencies it draws, highest first."""
    records, _, _ = _committed()
    text = _figure_markdown(out_dir, "scaling.png", "scaling efficiency by strategy",
                            plot_scaling, records)
    rows = []
    for size, rs in _by_model(records).items():
        for strategy, points in efficiencies(rs).items():
            worlds = sorted(points)
            rows.append((points[worlds[-1]], size, strategy, worlds[0], worlds[-1]))
    table = ["| strategy | model | from | to | efficiency |", "|---|---|---:|---:|---:|"]
    table += [f"| {s} | {size} | {n0} | {n1} | {e:.2f} |" for e, size, s, n0, n1 in sorted(rows, reverse=True)]
    return text + "\n" + "\n".join(table) + "\n"


def _size(n: int) -> str:
    """Bytes as the largest binary unit that divides them: ``16 MiB``, ``4 KiB``, ``8 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def readme_bandwidth(out_dir: Path) -> str:
    """bandwidth.png and the highest bus bandwidth each collective reached in the sweep."""
    _, _, bandwidth = _committed()
    text = _figure_markdown(out_dir, "bandwidth.png", "bus bandwidth vs message size",
                            plot_bandwidth, bandwidth,
                            "bandwidth sweeps")
    table = ["| collective | ranks | highest bus bandwidth GB/s | at message size |", "|---|---:|---:|---:|"]
    for record in sorted(bandwidth, key=lambda r: (r["collective"], r["world_size"])):
        best = max(record["rows"], key=lambda row: row["busbw_GBps"])
        table.append(f"| {record['collective']} | {record['world_size']} | {best['busbw_GBps']:.2f} | "
                     f"{_size(best['size_bytes'])} |")
    return text + "\n" + "\n".join(table) + "\n"


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
