"""The measured strategies table of sharding_strategies.md and README.md, and its two plots, from
the committed harness records of one `fsdp_transformer.py --sharding ...` launch.

Each measured number sits next to the formula's prediction that the script stored in the same
record. Nothing in the table is typed by hand:

    python -m distkit.records render 02-fsdp     # README.md + sharding_strategies.md + both PNGs,
                                                 # from records/fsdp_strategies.jsonl
    python 02-fsdp/make_strategies_table.py --results runs/fsdp_strategies.jsonl   # your own run
                                                 # (README.md's command): the table, plots into runs/
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORD = HERE / "records" / "fsdp_strategies.jsonl"
ORDER = ["ddp", "fsdp_no_shard", "fsdp_shard_grad_op", "fsdp_full_shard", "fsdp_hybrid_shard"]
COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce"]
STATE = ["params", "grads", "optimizer"]
# What the harness measured as "peak memory" (the record's peak_memory_kind) -> the column header.
PEAK_LABEL = {"cpu_peak_rss": "peak RSS MiB (max rank)",
              "cpu_mem_tracker": "peak memory MiB (max rank, MemTracker)",
              "cuda_max_allocated": "peak GPU memory allocated MiB (max rank)"}
# Config keys that differ between the strategies of one launch; every other key (and the model,
# device, backend, world size) must match, or the table would set numbers of different runs side by
# side. Records written before schema 2 also kept the model in config (model_size, gpt,
# param_count); read_records puts it in the record's `model` field, so those keys are left out too.
PER_STRATEGY = {"sharding", "hsdp_shard_size"}
MODEL_IN_OLD_CONFIG = {"model_size", "gpt", "param_count"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(RECORD),
                        help="harness records from fsdp_transformer.py (default: the committed "
                             "02-fsdp/records/fsdp_strategies.jsonl)")
    parser.add_argument("--plots-dir", default="runs",
                        help="where strategies_memory.png and strategies_comm.png go (default: runs/)")
    return parser.parse_args(argv)


def newest_per_strategy(path):
    """The newest record of each strategy among the records of the newest run's kind."""
    from distkit.harness import read_records

    if not os.path.exists(path):
        raise SystemExit(f"error: {path} does not exist; run 02-fsdp/fsdp_transformer.py --sharding ... "
                         f"--results {path} first")
    records = [r for r in read_records(path) if r.get("config", {}).get("script") == "fsdp_transformer"]
    if not records:
        raise SystemExit(f"error: no fsdp_transformer records in {path}")
    # Only records of the same kind of run as the newest one: a results file that holds CPU and GPU
    # runs (or other world sizes, models, precisions) must not mix them in one table.
    newest = run_signature(records[-1])
    latest = {}
    for record in records:
        if run_signature(record) == newest:
            latest[record["strategy"]] = record
    return [latest[name] for name in ORDER if name in latest]


def run_signature(record):
    """What must be equal for two records to sit in one table."""
    config = {k: v for k, v in record["config"].items() if k not in PER_STRATEGY | MODEL_IN_OLD_CONFIG}
    return (record["device"], record["backend"], record["world_size"], sorted((record["model"] or {}).items()),
            record["metrics"].get("peak_memory_kind"), sorted(config.items(), key=str))


def model_label(record):
    """The model as the caption names it: its preset (`small` GPT) or, if it matches none, its shape."""
    from distkit.models import GPT_PRESETS

    model = {k: v for k, v in (record["model"] or {}).items() if k != "arch"}
    preset = next((name for name, cfg in GPT_PRESETS.items() if cfg.to_dict() == model), None)
    if preset:
        return f"`{preset}` GPT"
    return "GPT (" + ", ".join(f"{k} {v}" for k, v in model.items()) + ")"


def optimizer_label(record):
    """The optimizer the run trained with; records written before --optimizer existed trained AdamW."""
    from distkit.flags import OPTIMIZER_CLASSES  # --optimizer's names -> torch's, as captions name them

    return OPTIMIZER_CLASSES[record["config"].get("optimizer", "adamw")]


def peak_label(record):
    """The peak-memory column's header for what this record measured (GPU allocator vs process RSS)."""
    kind = record["metrics"].get("peak_memory_kind")
    return PEAK_LABEL.get(kind, "peak memory MiB (max rank)")


def kib(value):
    return f"{value / 1024:,.1f}"


def pair(measured, predicted):
    """'measured (predicted)' in KiB; a lone dash when neither exists."""
    if not measured and not predicted:
        return "-"
    return f"{kib(measured)} ({kib(predicted)})"


def bus_bytes(record):
    """Bytes rank 0 sent per step, all collectives (the harness's bus_bytes)."""
    return sum(v["bus_bytes"] for v in record["metrics"]["comm_per_step"].values())


def predicted_bus_bytes(record):
    """The formula's payloads turned into bytes on the wire with the same bus factors."""
    from distkit.harness import bus_factor

    pred = record["predicted"]
    group = {"all_gather": pred["shard_group_size"], "reduce_scatter": pred["shard_group_size"],
             "all_reduce": pred["replicas"]}
    return sum(v * bus_factor(c, group[c]) for c, v in pred["comm_bytes"].items())


def caption(records, source="records/fsdp_strategies.jsonl"):
    from distkit.records import machine_label

    first, cfg = records[0], records[0]["config"]
    return (f"Measured on {machine_label(first['machine'], first['backend'])}, {first['world_size']} ranks, "
            f"torch {first['torch_version']}, {first['timestamp'][:10]} ([{source}]({source})): "
            f"{model_label(first)} ({first['param_count']:,} parameters), global batch "
            f"{cfg['global_batch_size']}, {cfg['precision']}, {optimizer_label(first)}, {cfg['wrap']}-wise wrapping, "
            f"{first['metrics']['timed_steps']} timed steps. KiB on rank 0 as **measured (predicted)**; "
            "communication is the payload per step (nccl-tests convention), bus = bytes each rank "
            "sends on the wire.")


def table(records, source="records/fsdp_strategies.jsonl"):
    lines = [
        caption(records, source),
        "",
        f"| strategy | mesh (replicas x shard) | params | grads | optimizer | {peak_label(records[0])} | "
        "all-gather | reduce-scatter | all-reduce | bus KiB/step | bus vs DDP | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ddp_bus = next((bus_bytes(r) for r in records if r["strategy"] == "ddp"), None)
    for r in records:
        m, pred = r["metrics"], r["predicted"]
        state = m["model_state_bytes_per_rank"][0]
        comm = m["comm_per_step"]
        cells = [r["strategy"], f"{pred['replicas']} x {pred['shard_group_size']}"]
        cells += [pair(state[k], pred[k]) for k in STATE]
        cells.append(f"{max(m['peak_memory_bytes_per_rank']) / 2**20:,.0f}")
        cells += [pair(comm.get(c, {}).get("bytes", 0), pred["comm_bytes"].get(c, 0)) for c in COLLECTIVES]
        cells.append(kib(bus_bytes(r)))
        cells.append(f"{bus_bytes(r) / ddp_bus:.2f}x" if ddp_bus else "-")
        step = m["step_time_s_median"]
        cells.append(f"{step * 1e3:,.0f}" if step else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stacked(ax, names, layers, predicted, ylabel, title, where):
    """Stacked bars (measured, one layer per part) with the formula's total as a black mark on each.

    The y range covers the tallest bar and the tallest mark with room to spare, and the legend sits
    outside the axes, so no bar and no mark is hidden."""
    x = list(range(len(names)))
    bottom = [0.0] * len(names)
    for label, values in layers:
        ax.bar(x, values, bottom=bottom, label=f"{label} (measured)")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(x, predicted, marker="_", s=900, linewidths=2, color="black", zorder=3,
               label="formula (total)")
    ax.set_ylim(0, 1.12 * max(bottom + predicted))
    ax.set_xticks(x, names)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, markerscale=0.4)
    ax.text(1.01, 0.0, where, transform=ax.transAxes, fontsize=7, va="bottom")


def plot(records, out_dir):
    """strategies_memory.png and strategies_comm.png into out_dir (reproducible bytes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from distkit.records import machine_label, save_figure

    out_dir = Path(out_dir)
    names = [r["strategy"].replace("fsdp_", "") for r in records]
    first = records[0]
    where = f"{machine_label(first['machine'], first['backend'])}\n{first['world_size']} ranks"
    fig, ax = plt.subplots(figsize=(9, 4))
    stacked(ax, names,
            [(kind, [r["metrics"]["model_state_bytes_per_rank"][0][kind] / 1024 for r in records])
             for kind in STATE],
            [sum(r["predicted"][k] for k in STATE) / 1024 for r in records],
            "model state on rank 0 (KiB)",
            f"Params + grads + {optimizer_label(first)} state held by rank 0, {first['world_size']} ranks "
            f"({model_label(first).replace('`', '')}, fp32)", where)
    fig.tight_layout()
    save_figure(fig, out_dir / "strategies_memory.png")

    fig, ax = plt.subplots(figsize=(9, 4))
    stacked(ax, names,
            [(c, [r["metrics"]["comm_per_step"].get(c, {}).get("bus_bytes", 0) / 1024 for r in records])
             for c in COLLECTIVES],
            [predicted_bus_bytes(r) / 1024 for r in records],
            "bytes rank 0 sends per step (KiB)",
            "Bytes on the wire per training step (bus bytes: payload x bus factor)", where)
    fig.tight_layout()
    save_figure(fig, out_dir / "strategies_comm.png")


def strategies_figures(out_dir: Path) -> str:
    """Render mark of README.md and sharding_strategies.md: the table and both plots, from the
    committed record."""
    records = newest_per_strategy(RECORD)
    plot(records, out_dir)
    return (table(records) + "\n\n![model state per rank](strategies_memory.png)\n\n"
            "![bytes on the wire per step](strategies_comm.png)\n")


def main(argv=None):
    from distkit.paths import output_problems

    args = parse_args(argv)
    unwritable = output_problems(args, dirs=["plots_dir"])
    if unwritable:
        raise SystemExit(f"error: {unwritable}")
    records = newest_per_strategy(args.results)
    plot(records, args.plots_dir)
    print(table(records, source=os.path.relpath(args.results)))
    print(f"\n{len(records)} strategies from {args.results}; plots in {args.plots_dir}/")


if __name__ == "__main__":
    main()
