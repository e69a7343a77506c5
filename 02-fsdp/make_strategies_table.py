"""Build the measured strategies table in sharding_strategies.md and its two plots from harness records.

Reads the records that `fsdp_transformer.py --sharding ...` appended (the newest record of each
strategy), puts each measured number next to the formula's prediction that the script stored in the
same record, and rewrites the part of the markdown files (sharding_strategies.md and README.md)
between the table markers. Nothing in the
table is typed by hand.

    python 02-fsdp/make_strategies_table.py       # reads runs/fsdp_strategies.jsonl
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
START, END = "<!-- strategies-table:start -->", "<!-- strategies-table:end -->"
ORDER = ["ddp", "fsdp_no_shard", "fsdp_shard_grad_op", "fsdp_full_shard", "fsdp_hybrid_shard"]
COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce"]
# What the harness measured as "peak memory" (the record's peak_memory_kind) -> the column header.
PEAK_LABEL = {"cpu_peak_rss": "peak RSS MiB (max rank)",
              "cuda_max_allocated": "peak GPU memory allocated MiB (max rank)"}
# Config keys that differ between the strategies of one launch; every other key (and the device,
# backend, world size) must match, or the table would set numbers of different runs side by side.
PER_STRATEGY = {"sharding", "hsdp_shard_size", "param_count"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="runs/fsdp_strategies.jsonl",
                        help="harness records from fsdp_transformer.py (default: runs/fsdp_strategies.jsonl)")
    parser.add_argument("--markdown", nargs="+",
                        default=[str(HERE / "sharding_strategies.md"), str(HERE / "README.md")],
                        help="markdown files whose table section is rewritten "
                             "(default: the chapter's sharding_strategies.md and README.md)")
    parser.add_argument("--plots-dir", default=str(HERE),
                        help="where strategies_memory.png and strategies_comm.png go (default: 02-fsdp/)")
    return parser.parse_args()


def newest_per_strategy(path):
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
    config = {k: v for k, v in record["config"].items() if k not in PER_STRATEGY}
    return (record["device"], record["backend"], record["world_size"],
            record["metrics"].get("peak_memory_kind"), sorted(config.items(), key=str))


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


def table(records):
    first = records[0]
    cfg = first["config"]
    lines = [
        f"Measured on {first['machine']['device_name']} ({first['machine']['cpu']}), {first['backend']}, "
        f"{first['world_size']} ranks, torch {first['torch_version']}, {first['timestamp'][:10]}: "
        f"`{cfg['model_size']}` GPT ({cfg['param_count']:,} parameters), global batch "
        f"{cfg['global_batch_size']}, {cfg['precision']}, AdamW, {cfg['wrap']}-wise wrapping, "
        f"{first['metrics']['timed_steps']} timed steps. KiB on rank 0 as **measured (predicted)**; "
        "communication is the payload per step (nccl-tests convention), bus = bytes each rank "
        "sends on the wire.",
        "",
        f"| strategy | mesh (replicas x shard) | params | grads | optimizer | {peak_label(first)} | "
        "all-gather | reduce-scatter | all-reduce | bus KiB/step | bus vs DDP | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ddp_bus = None
    for r in records:
        if r["strategy"] == "ddp":
            ddp_bus = sum(v["bus_bytes"] for v in r["metrics"]["comm_per_step"].values())
    for r in records:
        m, pred = r["metrics"], r["predicted"]
        state = m["model_state_bytes_per_rank"][0]
        comm = m["comm_per_step"]
        bus = sum(v["bus_bytes"] for v in comm.values())
        cells = [r["strategy"], f"{pred['replicas']} x {pred['shard_group_size']}"]
        cells += [pair(state[k], pred[k]) for k in ("params", "grads", "optimizer")]
        cells.append(f"{max(m['peak_memory_bytes_per_rank']) / 2**20:,.0f}")
        cells += [pair(comm.get(c, {}).get("bytes", 0), pred["comm_bytes"].get(c, 0)) for c in COLLECTIVES]
        cells.append(kib(bus))
        cells.append(f"{bus / ddp_bus:.2f}x" if ddp_bus else "-")
        step = m["step_time_s_median"]
        cells.append(f"{step * 1e3:,.0f}" if step else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records, plots_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["strategy"].replace("fsdp_", "") for r in records]
    x = range(len(records))
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(records)
    for kind in ("params", "grads", "optimizer"):
        values = [r["metrics"]["model_state_bytes_per_rank"][0][kind] / 1024 for r in records]
        ax.bar(x, values, bottom=bottom, label=f"{kind} (measured)")
        bottom = [b + v for b, v in zip(bottom, values)]
    predicted = [sum(r["predicted"][k] for k in ("params", "grads", "optimizer")) / 1024 for r in records]
    ax.scatter(x, predicted, marker="_", s=900, color="black", zorder=3, label="formula")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("KiB per rank")
    ax.set_title(f"Model state per rank, {records[0]['world_size']} ranks ({records[0]['config']['model_size']} GPT)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(plots_dir, "strategies_memory.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(records)
    for collective in COLLECTIVES:
        values = [r["metrics"]["comm_per_step"].get(collective, {}).get("bus_bytes", 0) / 1024 for r in records]
        ax.bar(x, values, bottom=bottom, label=f"{collective} (measured)")
        bottom = [b + v for b, v in zip(bottom, values)]
    from distkit.harness import bus_factor
    predicted = []
    for r in records:
        pred = r["predicted"]
        group = {"all_gather": pred["shard_group_size"], "reduce_scatter": pred["shard_group_size"],
                 "all_reduce": pred["replicas"]}
        predicted.append(sum(v * bus_factor(c, group[c]) for c, v in pred["comm_bytes"].items()) / 1024)
    ax.scatter(x, predicted, marker="_", s=900, color="black", zorder=3, label="formula")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("bus KiB per rank per step")
    ax.set_title("Bytes each rank sends per training step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(plots_dir, "strategies_comm.png"), dpi=110)
    plt.close(fig)


def main():
    args = parse_args()
    records = newest_per_strategy(args.results)
    generated = f"{START}\n<!-- generated by make_strategies_table.py from {os.path.basename(args.results)}; " \
                f"do not edit -->\n{table(records)}\n{END}"
    for markdown in args.markdown:
        text = Path(markdown).read_text()
        if START not in text or END not in text:
            raise SystemExit(f"error: {markdown} has no {START} ... {END} section to fill")
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: generated, text, flags=re.S)
        Path(markdown).write_text(text)
    os.makedirs(args.plots_dir, exist_ok=True)
    plot(records, args.plots_dir)
    print(f"wrote the table of {len(records)} strategies into {', '.join(args.markdown)} "
          f"and 2 plots into {args.plots_dir}")


if __name__ == "__main__":
    main()
