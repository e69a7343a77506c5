"""Comparison plots and a Markdown table from a benchmark results file (JSON lines).

    python benchmarks/plot.py --results runs/benchmarks.jsonl --out-dir runs/plots

Writes the PNGs of :data:`FIGURES` (throughput, memory per rank with the ``distkit.predictors``
prediction as a mark, bus bytes per step, scaling efficiency, and the bandwidth of the chapter-04
sweeps in the file), each stamped with where and when its numbers were measured, and
``summary.md``. When a cell ran several times the newest record counts; cells from different
devices are never drawn in one panel, and the table then says where each ran. Records are read with
``distkit.harness.read_records``, so every number follows the harness's one definition of step
time and throughput. The ``readme_*`` functions draw the README's tables and plots from the
committed ``records/results_cpu.jsonl`` (``python -m distkit.records render benchmarks``).
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
from distkit.cell_numbers import (  # noqa: E402  (read by the notebook and tests as plot.X too)
    PEAK_PARTS,
    bus_mib,
    efficiencies,
    mfu_percent,
    mixed,
    model_size,
    peak_label,
    peak_mib,
    peak_parts_mib,
    predicted_bus_mib,
    predicted_state_mib,
    prediction,
    state_mib,
    step_s,
    tokens_per_s,
    where,
)
from distkit.harness import read_records  # noqa: E402
from distkit.paths import check_outputs  # noqa: E402
from distkit.records import machine_label, save_figure  # noqa: E402
from distkit.strategies import MEASURED  # noqa: E402

COMMITTED = Path(__file__).resolve().parent / "records" / "results_cpu.jsonl"
# Panels of scaling.png: few enough series per panel that colour and marker tell each one apart.
FAMILIES = {
    "data parallel (DDP, FSDP)": ("ddp", "ddp_from_scratch", "fsdp_no_shard", "fsdp_shard_grad_op",
                                  "fsdp_full_shard", "fsdp_hybrid_shard", "hsdp"),
    "ZeRO (DeepSpeed)": ("zero0", "zero1", "zero2", "zero3", "zero3_offload"),
    "model parallel (TP, PP, 2D)": ("tp", "tp_sp", "pp_gpipe", "pp_1f1b", "pp_interleaved_1f1b", "fsdp_tp_2d"),
    "context / expert parallel (CP, EP)": ("cp", "ep"),
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
    cells, problems, bandwidth = {}, {}, {}
    for record in records:  # oldest first: later ones replace earlier ones
        strategy = record.get("strategy", "")
        if strategy.startswith("bandwidth"):  # a chapter-04 sweep, one record per collective
            if "rows" in record:
                bandwidth[(record.get("collective"), record["world_size"], record.get("device"))] = record
            continue
        key = (strategy, record.get("world_size"), model_size(record), where(record))
        ok = record.get("status", "ok") == "ok" and "metrics" in record
        (cells if ok else problems)[key] = record
        (problems if ok else cells).pop(key, None)
    order = {name: i for i, name in enumerate(MEASURED)}

    def sort(r):  # by model (a mixture of experts after the dense models), strategy, world size
        return "_moe " in model_size(r), model_size(r), order.get(r["strategy"], 99), r["world_size"]

    return sorted(cells.values(), key=sort), sorted(problems.values(), key=sort), list(bandwidth.values())


def provenance(records: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """Where (machine and backend), with which torch and on which dates ``records`` were measured."""
    places = list(dict.fromkeys(machine_label(r["machine"], r.get("backend")) for r in records if "machine" in r))
    torches = sorted({r.get("torch_version", "?") for r in records})
    dates = sorted({r["timestamp"][:10] for r in records if r.get("timestamp")})
    return places, torches, dates


def stamp(fig, records: list[dict], source: str) -> None:
    """Write where the numbers come from at the bottom of a figure."""
    if records and source:
        places, torches, dates = provenance(records)
        worlds = ", ".join(map(str, sorted({r["world_size"] for r in records})))
        fig.text(0.01, 0.005, f"{' + '.join(places)} | world sizes {worlds} | torch {', '.join(torches)} | "
                 f"{' .. '.join(dict.fromkeys([dates[0], dates[-1]])) if dates else '?'} | {source}",
                 fontsize=7, color="0.35", ha="left", va="bottom")


# ---------------------------------------------------------------------------------------- plots
def _bar_slots(records, keep=lambda r: True):
    """Where each cell's bar goes: strategies along x, one slot per world size within a strategy.
    Returns the strategies and, per world size, ``(j, world, xs, cells)`` (cells: records)."""
    strategies = list(dict.fromkeys(r["strategy"] for r in records))
    worlds = sorted({r["world_size"] for r in records})
    width = 0.8 / max(len(worlds), 1)
    slots = []
    for j, world in enumerate(worlds):
        cells = [(i, r) for i, s in enumerate(strategies) for r in records
                 if r["strategy"] == s and r["world_size"] == world and keep(r)]
        slots.append((j, world, [i + (j - (len(worlds) - 1) / 2) * width for i, _ in cells], [r for _, r in cells]))
    return strategies, width, slots


def _finish_bars(ax, strategies, ylabel, **legend):
    ax.set_xticks(range(len(strategies)), strategies, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, **legend)


def _grouped(ax, records, value, ylabel, predicted=None):
    """Bars per strategy, one colour per world size; optional predicted marks."""
    strategies, width, slots = _bar_slots(records)
    for j, world, xs, cells in slots:
        ax.bar(xs, [value(r) for r in cells], width=width * 0.95, label=f"{world} ranks measured")
        if predicted:
            ax.scatter(xs, [predicted(r) for r in cells], marker="_", s=180, linewidths=2.5, color="black",
                       zorder=3, label="distkit.theory prediction" if j == 0 else None)
    _finish_bars(ax, strategies, ylabel)


def _stacked(ax, records, parts, ylabel):
    """Stacked bars per strategy (one bar per world size): ``parts(r)`` -> {category: value}."""
    strategies, width, slots = _bar_slots(records, keep=parts)
    colours = dict(zip(PEAK_PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:gray")))
    for j, world, xs, cells in slots:
        bottom = [0.0] * len(cells)
        for name in PEAK_PARTS:
            heights = [parts(r)[name] for r in cells]
            ax.bar(xs, heights, width=width * 0.95, bottom=bottom, color=colours[name],
                   hatch="//" if j else None, edgecolor="white", linewidth=0.5,
                   label=f"{name}" if j == 0 else None)
            bottom = [b + h for b, h in zip(bottom, heights)]
    _finish_bars(ax, strategies, ylabel, ncol=5)


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


def _bars(records, source, title, value, ylabel, predicted=None):
    """One panel of bars per model (and device): ``value`` per strategy and world size."""
    groups = _by_model(records)
    fig, axes = _figure(len(groups), title)
    for ax, (size, rs) in zip(axes, groups.items()):
        _grouped(ax, rs, value, ylabel.format(size=size), predicted)
    stamp(fig, records, source)
    return fig


def figure_throughput(records, source=""):
    """Per model: tokens/s of the whole job, and tokens/s per device with MFU (model FLOPs per token
    x tokens/s per device / the device's peak FLOP/s, measured by the harness's matmul benchmark)."""
    groups = _by_model(records)
    fig, axes = _figure(2 * len(groups), "Throughput by strategy (higher is better; median step of the slowest rank)")
    for k, (size, rs) in enumerate(groups.items()):
        _grouped(axes[2 * k], rs, tokens_per_s, f"{size} model: tokens/s\n(whole job)")
        _grouped(axes[2 * k + 1], rs, mfu_percent, f"{size}: MFU %")
        axes[2 * k + 1].set_title("model FLOPs utilisation: 6N + 12Lsd FLOPs per token (MoE: N active) x tokens/s "
                                  "per device / peak FLOP/s measured on the device", fontsize=9)
    stamp(fig, records, source)
    return fig


def figure_comm(records, source=""):
    return _bars(records, source, "Bytes each rank puts on the wire per step (rank 0, bus bytes)", bus_mib,
                 "{size}: bus MiB per step", lambda r: predicted_bus_mib(prediction(r)))


def figure_memory(records, source=""):
    """Two quantities, two panels: the model state (measured bar, predicted mark: the formulas
    predict exactly this), and the measured peak memory, split into parameters, gradients,
    optimizer state, activations and temporaries where the harness tracked it (MemTracker)."""
    groups = _by_model(records)
    fig, axes = _figure(2 * len(groups), "Memory per rank")
    for k, (size, rs) in enumerate(groups.items()):
        _grouped(axes[2 * k], rs, state_mib,
                 f"{size}: model state, MiB\n(params + grads + optimizer,\nrank holding most)",
                 lambda r: predicted_state_mib(prediction(r)))
        axes[2 * k].set_title("model state each rank holds: measured (bars) vs distkit.theory (marks)", fontsize=9)
        label = peak_label(rs)
        if all(peak_parts_mib(r) for r in rs):  # by category: what each strategy keeps at its peak
            _stacked(axes[2 * k + 1], rs, peak_parts_mib, f"{size}: {label}, MiB\n(highest rank)")
            worlds = sorted({r["world_size"] for r in rs})
            axes[2 * k + 1].set_title(f"measured {label} per rank, by category at the peak"
                                      + (f" (bars left to right: {', '.join(map(str, worlds))} ranks; hatched: "
                                         f"more ranks)" if len(worlds) > 1 else ""), fontsize=9)
        else:
            rss = label == "peak RSS"
            _grouped(axes[2 * k + 1], rs, peak_mib, f"{size}: {label}, MiB\n(highest rank)")
            axes[2 * k + 1].set_title(f"measured {label} per rank"
                                      + (" (the whole process: Python, torch and the model state)" if rss else ""),
                                      fontsize=9)
    stamp(fig, records, source)
    return fig


def figure_scaling(records, source=""):
    """Throughput at N ranks / (throughput at the smallest N x N / N0): 1.0 = perfect scaling.

    One row of panels per model (and device), one panel per family of strategies, so that every
    curve in a panel has its own colour and marker; ticks only at the world sizes measured."""
    groups = _by_model(records)
    fig, axes = plt.subplots(len(groups), len(FAMILIES), figsize=(13, 4.4 * len(groups) + 0.8),
                             squeeze=False, sharey=True)
    fig.suptitle("Scaling efficiency relative to the smallest world size (1.0 = linear)")
    colours = plt.get_cmap("tab10").colors
    for row, (size, rs) in zip(axes, groups.items()):
        eff = efficiencies(rs)
        worlds = sorted({r["world_size"] for r in rs})
        for ax, (family, members) in zip(row, FAMILIES.items()):
            drawn = [s for s in members if s in eff]
            for i, strategy in enumerate(drawn):
                points = eff[strategy]
                ax.plot(sorted(points), [points[n] for n in sorted(points)], color=colours[i % len(colours)],
                        marker=MARKERS[i % len(MARKERS)], ls=LINESTYLES[i % len(LINESTYLES)], lw=1.6,
                        markersize=7, label=strategy)
            single = [s for s in members if s not in eff and any(r["strategy"] == s for r in rs)]
            ax.axhline(1.0, color="0.5", ls="--", lw=1)
            ax.set(xticks=worlds, xticklabels=[str(n) for n in worlds], ylim=(0, 1.1), xlabel="world size (ranks)")
            if len(worlds) > 1:
                ax.set_xlim(worlds[0] - 0.5, worlds[-1] + 0.5)
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
    fig, (ax,) = _figure(1, "Collective bus bandwidth vs message size (chapter 04 sweep)")
    colours = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green",
               "all_to_all": "tab:red"}
    worlds = sorted({r["world_size"] for r in bandwidth})
    for record in sorted(bandwidth, key=lambda r: (r["collective"], r["world_size"])):
        rows, k = record["rows"], worlds.index(record["world_size"])
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows],
                color=colours.get(record["collective"]), marker=MARKERS[k % len(MARKERS)],
                ls=LINESTYLES[k % len(LINESTYLES)], label=f"{record['collective']} | {record['world_size']} ranks")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)")
    ax.grid(alpha=0.3)
    if bandwidth:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no bandwidth records: run distributed_benchmarks.py --bandwidth", ha="center",
                transform=ax.transAxes)
    stamp(fig, bandwidth, source)
    return fig


# file -> the function that draws it (bandwidth.png from the sweeps, every other from the cells)
FIGURES = {"throughput.png": figure_throughput, "memory.png": figure_memory, "comm_bytes.png": figure_comm,
           "scaling.png": figure_scaling, "bandwidth.png": figure_bandwidth}
PLOTS = tuple(FIGURES)


def save(figure, records, path, source) -> None:
    """Draw ``figure(records, source)`` and save it reproducibly (the same records, the same bytes)."""
    fig = figure(records, source)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    save_figure(fig, path)


def per_device_and_mfu(record: dict) -> str:
    """``tokens/s per device | MFU %`` cells (``-`` for records written before the harness measured them)."""
    metrics = record["metrics"]
    per_device, mfu = metrics.get("tokens_per_s_per_device"), metrics.get("mfu")
    return f"{per_device:,.0f} | {100 * mfu:.2f}" if per_device and mfu else "- | -"


def peak_cell(record: dict) -> str:
    """``peak MiB | activations MiB`` cells: MemTracker's peak keeps decimals (a few MiB at tiny
    sizes), the RSS of older records does not need them."""
    parts = peak_parts_mib(record)
    if parts is None:
        return f"{peak_mib(record):,.0f} | -"
    return f"{peak_mib(record):.2f} | {parts['activations']:.2f}"


def summary_table(records: list[dict], problems: list[dict]) -> str:
    """Markdown: one row per cell, measured next to predicted, and the cells that failed."""
    split = mixed(records)  # then say where each cell ran: peak memory is GPU-allocated on one, RSS on the other
    lines = [f"| strategy | ranks | model | {'ran on | ' if split else ''}step ms | tokens/s | tokens/s/device | "
             "MFU % | model state MiB/rank (theory) | bus MiB/step rank 0 (theory) | peak MiB/rank | activations MiB |",
             f"|---|---:|---|{'---|' if split else ''}---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        p = prediction(r)
        p_state, p_bus = (f"{predicted_state_mib(p):.3f}", f"{predicted_bus_mib(p):.3f}") if p else ("-", "-")
        lines.append(f"| {r['strategy']} | {r['world_size']} | {model_size(r)} | {where(r) + ' | ' if split else ''}"
                     f"{step_s(r) * 1e3:.1f} | {tokens_per_s(r):,.0f} | {per_device_and_mfu(r)} | "
                     f"{state_mib(r):.3f} ({p_state}) | {bus_mib(r):.3f} ({p_bus}) | {peak_cell(r)} |")
    for r in problems:
        lines.append(f"| {r['strategy']} | {r.get('world_size', '?')} | {model_size(r)} | {'| ' if split else ''}"
                     f"{r.get('status', 'failed')}: {r.get('error', '')} | | | | | | | |")
    return "\n".join(lines) + "\n"


def write_all(results: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Every plot and the summary table for ``results``; returns the files written."""
    records, problems, bandwidth = load(results)
    if not records and not bandwidth:
        raise UsageError(f"results file {results} holds no successful benchmark record")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, figure in FIGURES.items():
        save(figure, bandwidth if figure is figure_bandwidth else records, out / name,
             f"data: {Path(results).name}")
    (out / "summary.md").write_text(summary_table(records, problems))
    return [out / name for name in (*PLOTS, "summary.md")]


# ------------------------------------------------------------- README render marks (committed record)
@functools.lru_cache(maxsize=1)
def _committed(mtime_ns: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    """The committed record, read once per process while the file is unchanged."""
    return load(COMMITTED)


def committed() -> tuple[list[dict], list[dict], list[dict]]:
    return _committed(COMMITTED.stat().st_mtime_ns)


def caption(records: list[dict], what: str = "cells") -> str:
    """Where and when the committed records ran, for the line under a table or plot."""
    places, torches, dates = provenance(records)
    when = " to ".join(dict.fromkeys([dates[0], dates[-1]]))
    rel = COMMITTED.relative_to(COMMITTED.parent.parent)
    return (f"<sub>Measured on {' + '.join(places)}, torch {', '.join(torches)}, {when}: "
            f"{len(records)} {what} of [{rel}]({rel}).</sub>\n")


def _readme_figure(name: str, alt: str, out_dir: Path) -> str:
    """Draw ``figures/name`` from the committed record; its image link and caption."""
    records, _, bandwidth = committed()
    drawn = bandwidth if name == "bandwidth.png" else records
    save(FIGURES[name], drawn, out_dir / "figures" / name, f"data: {COMMITTED.name}")
    return f"![{alt}](figures/{name})\n\n" + caption(drawn, "bandwidth sweeps" if drawn is bandwidth else "cells")


readme_throughput = functools.partial(_readme_figure, "throughput.png",
                                      "tokens per second by strategy and world size")
readme_memory = functools.partial(_readme_figure, "memory.png",
                                  "model state per rank, measured and predicted; peak memory")
readme_comm = functools.partial(_readme_figure, "comm_bytes.png", "bus bytes per step, measured and predicted")


def readme_table(out_dir: Path) -> str:
    """The summary table of the committed CPU matrix (measured, theory in brackets); the cells that
    could not run at a world size listed under it, one line per reason."""
    records, problems, _ = committed()
    skipped = [r for r in problems if r.get("status") == "skipped"]
    table = summary_table(records, [r for r in problems if r.get("status") != "skipped"])
    return table + skipped_lines(skipped) + "\n" + caption(records)


def skipped_lines(skipped: list[dict]) -> str:
    """One Markdown line per reason: ``Skipped, REASON: strategy at 2 ranks on tiny, llama tiny; ...``."""
    by_reason: dict[str, dict[tuple, list[str]]] = {}
    for r in skipped:
        cells = by_reason.setdefault(r.get("error", ""), {})
        cells.setdefault((r["strategy"], r.get("world_size")), []).append(model_size(r))
    return "".join(f"\nSkipped, {reason}: " + "; ".join(f"{strategy} at {ranks} ranks on {', '.join(models)}"
                                                      for (strategy, ranks), models in cells.items()) + ".\n"
                   for reason, cells in by_reason.items())


def readme_scaling(out_dir: Path) -> str:
    """scaling.png and, under it, the efficiencies it draws, highest first."""
    cells: dict[str, dict[str, tuple]] = {}  # strategy -> model -> (efficiency, from, to)
    models = []
    for size, rs in _by_model(committed()[0]).items():
        models.append(size)
        for strategy, points in efficiencies(rs).items():
            worlds = sorted(points)
            cells.setdefault(strategy, {})[size] = (points[worlds[-1]], worlds[0], worlds[-1])
    spans = {(n0, n1) for per_model in cells.values() for _, n0, n1 in per_model.values()}
    one_span = len(spans) == 1  # then the header says it once
    best = {s: max(e for e, _, _ in per_model.values()) for s, per_model in cells.items()}

    def cell(value) -> str:
        return "-" if value is None else f"{value[0]:.2f}" + ("" if one_span else f" ({value[1]} -> {value[2]})")
    span = f", {min(spans)[0]} -> {min(spans)[1]} ranks" if one_span else ""
    table = ["| strategy | " + " | ".join(f"{m}{span}" for m in models) + " |", "|---|" + "---:|" * len(models)]
    table += [f"| {s} | " + " | ".join(cell(cells[s].get(m)) for m in models) + " |"
              for s in sorted(cells, key=lambda s: -best[s])]
    return _readme_figure("scaling.png", "scaling efficiency by strategy", out_dir) + "\n" + "\n".join(table) + "\n"


def _size(n: int) -> str:
    """Bytes as the largest binary unit that divides them: ``16 MiB``, ``4 KiB``, ``8 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def readme_bandwidth(out_dir: Path) -> str:
    """bandwidth.png and the highest bus bandwidth each collective reached in the sweep."""
    table = ["| collective | ranks | highest bus bandwidth GB/s | at message size |", "|---|---:|---:|---:|"]
    for record in sorted(committed()[2], key=lambda r: (r["collective"], r["world_size"])):
        best = max(record["rows"], key=lambda row: row["busbw_GBps"])
        table.append(f"| {record['collective']} | {record['world_size']} | {best['busbw_GBps']:.2f} | "
                     f"{_size(best['size_bytes'])} |")
    return _readme_figure("bandwidth.png", "bus bandwidth vs message size", out_dir) + "\n" + "\n".join(table) + "\n"


def parse_args(argv=None):
    parser = ArgumentParser(description="Comparison plots (PNG) and a Markdown table from benchmark results.",
                            epilog="example: python benchmarks/plot.py --results runs/benchmarks.jsonl")
    parser.add_argument("--results", default="runs/benchmarks.jsonl",
                        help="JSON-lines results of distributed_benchmarks.py (default: runs/benchmarks.jsonl)")
    parser.add_argument("--out-dir", default="runs/plots",
                        help="where the PNGs and summary.md go (default: runs/plots)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_outputs(None, args, dirs=["out_dir"])  # before any plot is drawn
    for path in write_all(args.results, args.out_dir):
        print(f"wrote {path}")
    print((Path(args.out_dir) / "summary.md").read_text())


if __name__ == "__main__":
    run_main(main)
