# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Which strategy for my model and GPUs?
#
# This notebook loads benchmark records (by default the committed CPU matrix
# `records/results_cpu.jsonl`; set `RESULTS` to your own `runs/benchmarks.jsonl` after running
# `python benchmarks/distributed_benchmarks.py`), shows the comparison plots and table, checks every
# number it shows against the records and `theory.py`, and then answers "what fits?" for a parameter
# count and GPU memory you type in.
#
# CPU/gloo numbers show **memory and bytes** faithfully; their **speed** says little about GPUs.

# %%
from pathlib import Path

from IPython.display import Markdown, display

import plot      # benchmarks/plot.py (this notebook runs in benchmarks/)
from distkit import theory

# %matplotlib inline
import matplotlib.pyplot as plt  # noqa: E402 (after plot.py, which picks a file backend for scripts)

RESULTS = Path("records/results_cpu.jsonl")   # or Path("../runs/benchmarks.jsonl")
records, problems, bandwidth = plot.load(RESULTS)
first = records[0]
print(f"results: {RESULTS} | {len(records)} cells ok, {len(problems)} failed/skipped | "
      f"device {first['machine']['device_name']} | backend {first['backend']} | torch {first['torch_version']}")

# %% [markdown]
# ## The summary table (measured, with the `theory.py` prediction in brackets)
#
# Step time = the median timed step of the slowest rank; tokens/s = tokens one step processes / that
# step time (one definition, `distkit.harness`).

# %%
table = plot.summary_table(records, problems)
display(Markdown(table))

# %% [markdown]
# The table's throughput, recomputed here from each record's configuration (global batch x sequence
# length tokens per step) and median step time, not from the record's own `tokens_per_s`:

# %%
header, _, *lines = (line.strip("| ").split(" | ") for line in table.splitlines())
shown = {(row[0], row[1], row[2]): dict(zip(header, row)) for row in lines}
for r in records:
    tokens_per_step = r["config"]["global_batch_size"] * r["model"]["seq_len"]
    median_s = r["metrics"]["step_time_s_median"]
    row = shown[(r["strategy"], str(r["world_size"]), plot.model_size(r))]
    assert row["step ms"] == f"{median_s * 1e3:.1f}", (r["strategy"], row["step ms"])
    assert row["tokens/s"] == f"{tokens_per_step / median_s:,.0f}", (r["strategy"], row["tokens/s"])
print(f"step ms and tokens/s of all {len(records)} rows = global batch x seq len / median step")

# %% [markdown]
# ## The plots
#
# Throughput, memory per rank (top: model state, bars measured, black marks predicted; bottom: peak
# memory, measured only), bytes on the wire per step, scaling efficiency and the chapter-04 bandwidth
# sweep: the figures of the README, drawn here by the same `plot.py` functions. Each is stamped with
# where it was measured.

# %%
source = f"data: {RESULTS.name}"
for draw, data in ((plot.figure_throughput, records), (plot.figure_memory, records), (plot.figure_comm, records),
                   (plot.figure_scaling, records), (plot.figure_bandwidth, bandwidth)):
    draw(data, source).tight_layout(rect=(0, 0.03, 1, 0.97))   # as plot.write_all lays out the README's PNGs
    plt.show()

# %% [markdown]
# The scaling plot's efficiencies, recomputed from the throughputs: tokens/s at 4 ranks over twice
# the tokens/s at 2 ranks (linear scaling from 2 to 4 ranks doubles throughput).

# %%
eff = plot.efficiencies(records)
by_cell = {(r["strategy"], r["world_size"]): r for r in records}
for strategy, points in eff.items():
    if set(points) == {2, 4}:
        two, four = by_cell[(strategy, 2)], by_cell[(strategy, 4)]
        rate = lambda r: r["config"]["global_batch_size"] * r["model"]["seq_len"] / r["metrics"]["step_time_s_median"]  # noqa: E731
        assert abs(points[4] - rate(four) / (2 * rate(two))) < 1e-9, strategy
print({s: round(p[max(p)], 2) for s, p in eff.items()})

# %% [markdown]
# ## Does theory match the measurement?
#
# For every cell: the worst relative error of the per-rank model-state bytes and of the bytes of each
# collective (the issue's bars: 5% and 1%), and rank 0's bus bytes per step, measured and predicted.

# %%
STATE_TOLERANCE, BYTES_TOLERANCE = 0.05, 0.01
rows = ["| strategy | ranks | model state error | bytes error | rank-0 bus bytes/step measured | predicted |",
        "|---|---:|---:|---:|---:|---:|"]
for record in records:
    c = theory.compare_record(record)
    bus = sum(x["measured_bus"] for x in c["comm"] if x["rank"] == 0)
    bus_predicted = sum(x["predicted_bus"] for x in c["comm"] if x["rank"] == 0)
    rows.append(f"| {record['strategy']} | {record['world_size']} | {c['state_error']:.3%} | {c['comm_error']:.3%} "
                f"| {bus:,.0f} | {bus_predicted:,.0f} |")
    assert c["state_error"] <= STATE_TOLERANCE, (record["strategy"], record["world_size"], c["state_error"])
    assert c["comm_error"] <= BYTES_TOLERANCE, (record["strategy"], record["world_size"], c["comm_error"])
    # the bus bytes the plot draws are the record's, and theory predicts them within the bar
    assert abs(bus / 2**20 - plot.bus_mib(record)) < 1e-9
    assert abs(bus - bus_predicted) <= BYTES_TOLERANCE * bus_predicted + 2 * theory.BOOKKEEPING_SLACK_BYTES, record["strategy"]
display(Markdown("\n".join(rows)))

# %% [markdown]
# ## What fits? Enter your model and your GPUs
#
# Model-state bytes per GPU for mixed-precision AdamW (ZeRO paper: 2 + 2 + 12 bytes per parameter),
# split the way each strategy splits them. Activations, buffers and fragmentation come on top: a
# strategy "fits" here when its model state takes at most `budget` of the GPU's memory. This is
# theory (formulas), not a measurement.

# %%
params = 7e9          # parameters of your model
gpus = 8              # GPUs in the job
gpu_memory_gib = 80   # memory of one GPU
budget = 0.7          # share of GPU memory you allow for model state (the rest: activations ...)

strategies = ["ddp", "zero1", "zero2", "fsdp_shard_grad_op", "zero3", "fsdp_full_shard", "fsdp_hybrid_shard",
              "zero3_offload", "tp", "pp_1f1b", "fsdp_tp_2d"]
per_gpu = {s: theory.mixed_precision_state_per_gpu(s, params, gpus, shard_group=min(gpus, 8)) for s in strategies}
rows = ["| strategy | model state per GPU (GiB) | fits? |", "|---|---:|---|"]
for s in strategies:
    fits = per_gpu[s] <= budget * gpu_memory_gib * 2**30
    rows.append(f"| {s} | {per_gpu[s] / 2**30:,.1f} | {'yes' if fits else 'no'} |")
display(Markdown("\n".join(rows)))
# The ZeRO paper's formulas, by hand: 16 bytes/param replicated; stage 1 splits the 12 optimizer
# bytes, stage 2 also the 2 gradient bytes, stage 3 everything.
assert per_gpu["ddp"] == 16 * params
assert per_gpu["zero1"] == 4 * params + 12 * params / gpus
assert per_gpu["zero2"] == 2 * params + 14 * params / gpus
assert per_gpu["zero3"] == per_gpu["fsdp_full_shard"] == 16 * params / gpus

# %% [markdown]
# What it costs in communication, per GPU and step, relative to DDP's gradient all-reduce
# (from the measured cells above: bus bytes of each strategy / bus bytes of DDP at the same world
# size and model), next to the same ratio of the `theory.py` predictions:

# %%
ddp = {(r["world_size"], plot.model_size(r)): r for r in records if r["strategy"] == "ddp"}
rows = ["| strategy | ranks | bus bytes / DDP's, measured | theory.py |", "|---|---:|---:|---:|"]
for r in records:
    base = ddp.get((r["world_size"], plot.model_size(r)))
    if base:
        measured = plot.bus_mib(r) / plot.bus_mib(base)
        predicted = (plot.predicted_bus_mib(theory.predict_record(r))
                     / plot.predicted_bus_mib(theory.predict_record(base)))
        rows.append(f"| {r['strategy']} | {r['world_size']} | {measured:.2f} | {predicted:.2f} |")
        assert abs(measured - predicted) <= 0.02 * predicted, (r["strategy"], measured, predicted)
display(Markdown("\n".join(rows)))

# %% [markdown]
# **Reading it:** start from the cheapest strategy that fits. DDP if the 16 bytes/parameter fit;
# ZeRO-1/2 (or FSDP SHARD_GRAD_OP) next: less memory at about DDP's wire bytes on a
# bandwidth-optimal ring (DeepSpeed on CPU/gloo moves more, see the ratio above); ZeRO-3 / FSDP
# FULL_SHARD when even that does not fit (up to 1.5x DDP's bytes: weights gathered again in
# backward); HSDP when the inter-node link is the bottleneck; tensor parallelism inside a node when
# a single layer's activations or weights are too big (its bytes grow with the batch, not the
# parameters); pipeline parallelism across nodes when bandwidth is scarce (it sends only activations
# at stage boundaries, but idles (p-1)/(m+p-1) of each step).
