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
# number it shows against the records and `theory.py`, and then answers "what fits on my GPUs, which
# strategy, how fast?" with the planner for a model and cluster you type in.
#
# CPU/gloo numbers show **memory and bytes** faithfully; their **speed** says little about GPUs.

# %%
import math
from pathlib import Path

import plot  # benchmarks/plot.py (this notebook runs in benchmarks/)
from IPython.display import Markdown, display

from distkit import compare, theory

# isort: split
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
# collective (the bars: 5% and 1%), and rank 0's bus bytes per step, measured and predicted.

# %%
STATE_TOLERANCE, BYTES_TOLERANCE = 0.05, 0.01
rows = ["| strategy | ranks | model state error | bytes error | rank-0 bus bytes/step measured | predicted |",
        "|---|---:|---:|---:|---:|---:|"]
for record in records:
    c = compare.compare_record(record)
    bus = sum(x["measured_bus"] for x in c["comm"] if x["rank"] == 0)
    bus_predicted = sum(x["predicted_bus"] for x in c["comm"] if x["rank"] == 0)
    rows.append(f"| {record['strategy']} | {record['world_size']} | {c['state_error']:.3%} | {c['comm_error']:.3%} "
                f"| {bus:,.0f} | {bus_predicted:,.0f} |")
    assert c["state_error"] <= STATE_TOLERANCE, (record["strategy"], record["world_size"], c["state_error"])
    assert c["comm_error"] <= BYTES_TOLERANCE, (record["strategy"], record["world_size"], c["comm_error"])
    # the bus bytes the plot draws are the record's, and theory predicts them within the bar
    assert abs(bus / 2**20 - plot.bus_mib(record)) < 1e-9
    slack = 2 * compare.BOOKKEEPING_SLACK_BYTES
    assert abs(bus - bus_predicted) <= BYTES_TOLERANCE * bus_predicted + slack, record["strategy"]
display(Markdown("\n".join(rows)))

# %% [markdown]
# ## What fits on my GPUs, which strategy, how fast? The planner
#
# `distkit.planner` (the library behind `python benchmarks/plan.py`) turns the same `theory.py`
# formulas into an answer for a model and a cluster: per strategy, memory per GPU in five parts
# (parameters, gradients, optimizer state, activations, temporaries), whether the step's peak fits
# in the usable memory, a predicted step time and tokens/s per GPU, and the fastest configuration
# that fits, with one line on why each other one lost. Change the inputs and re-run the cell. The
# GPU figures are datasheet numbers and stated assumptions (`planner.GPUS`); the README's
# "Planning" section shows how close the same model comes to this machine's measured matrix.

# %%
from distkit import planner
from distkit.models import model_config

model = model_config("llama", "llama-3.1-8b")   # or model_config("gpt", "small"), or planner.with_params(model, 7e9)
gpus, gpu_type = 8, "h100"                      # planner.GPUS: h100, h200, a100-80gb, a100-40gb, l4
plan = planner.Plan(model, global_batch=64, micro_batch=1, precision="bf16", optimizer="adamw", ac="full")
cluster = planner.cluster(gpu_type, gpus)

estimates = planner.estimate_all(plan, cluster)
recommendation = planner.recommend(estimates, cluster)
print(planner.format_report(plan, cluster, estimates, recommendation))
display(planner.plot_estimates(estimates, cluster, title=planner.describe(plan, cluster)))

# %% [markdown]
# Checked against the ZeRO paper by hand (Rajbhandari et al. 2020: 2 + 2 + 12 bytes per parameter
# in mixed-precision AdamW): DDP holds all 16 bytes per parameter, ZeRO-1 splits the 12 optimizer
# bytes over the GPUs, ZeRO-2 the gradients too, ZeRO-3 everything (DeepSpeed pads its partitions
# to 2n elements, so "equal" means within 16 bytes x 2n).

# %%
psi = sum(math.prod(shape) for shape in theory.param_shapes(model).values())
state = {e.name: sum(e.memory_bytes[p] for p in ("params", "grads", "optimizer")) for e in estimates if e.valid}
paper = {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / gpus, "zero2": 2 * psi + 14 * psi / gpus,
         "zero3": 16 * psi / gpus}
for name, bytes_by_paper in paper.items():
    assert abs(state[name] - bytes_by_paper) <= 16 * 2 * gpus, (name, state[name], bytes_by_paper)
    print(f"{name:6} {state[name] / 2**30:7.2f} GiB per GPU = the paper's {bytes_by_paper / 2**30:7.2f} GiB")
assert recommendation.best is None or (recommendation.best.fits and not recommendation.best.lora)

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
        predicted = (plot.predicted_bus_mib(compare.predict_record(r))
                     / plot.predicted_bus_mib(compare.predict_record(base)))
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
