# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 05: tensor, pipeline and 2-D parallelism at tiny size
#
# Each cell launches a chapter script with `torchrun` as a subprocess (4 CPU ranks on gloo, or 4 GPUs
# with NCCL), reads the harness records it writes and **asserts** what they must show: the
# collectives the formulas predict, the bubble theory, the memory split. Records and checkpoints go
# to a temporary folder. Timings depend on the machine and its load, so the plots are drawn from the
# records committed in `records/` (the ones the README's tables and plots come from), which the last
# cell checks too. See README.md for what each strategy does.

# %%
import json
import os
import subprocess
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from distkit.harness import read_records
from distkit.notebooks import torchrun_argv

WORK = Path(tempfile.mkdtemp(prefix="ch05-"))
ENV = dict(os.environ, OMP_NUM_THREADS="1", DISTKIT_NO_PROGRESS="1")
TORCHRUN = torchrun_argv()  # torchrun (the test suite names its own launcher in $DISTKIT_TORCHRUN)


def run(script, *args, nproc=4):
    """torchrun one chapter script; returns the records it appended."""
    results = WORK / f"{Path(script).stem}.jsonl"
    results.unlink(missing_ok=True)
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
           script, *map(str, args), "--results", str(results)]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"exit {out.returncode}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return [json.loads(line) for line in results.read_text().splitlines()]


# %% [markdown]
# ## Tensor parallelism
# Each rank holds a quarter of every block's weight matrices. Megatron's count: 4 all-reduces per
# block per step (2 forward, 2 backward), each of the activation size B·S·d·4 bytes in fp32.

# %%
tp = run("tensor_parallel.py", "--model-size", "tiny", "--steps", 3, "--warmup-steps", 1, "--save", WORK / "tp.pt")
comm = tp[0]["metrics"]["comm_per_step"]
print(comm)
n_layer, batch, seq, width = 2, 16, 32, 64  # the tiny GPT, the script's default global batch
assert comm["all_reduce"]["calls"] == 4 * n_layer
assert comm["all_reduce"]["bytes"] == 4 * n_layer * batch * seq * width * 4

# %% [markdown]
# ## Pipeline parallelism: the bubble vs the number of micro-batches
# Theory for p stages, m micro-batches, v stages per rank: (p-1)/(v·m+p-1). The measured idle
# fraction also contains each micro-batch's send/recv and schedule overhead, which the README's
# table separates from the bubble.

# %%
pp = run("pipeline_parallel.py", "--model-size", "tiny", "--n-layer", 8, "--steps", 3, "--warmup-steps", 1,
         "--global-batch-size", 16, "--schedule", "gpipe", "interleaved_1f1b",
         "--microbatches", 4, 8, "--save", WORK / "pp_{schedule}_{microbatches}.pt")
for r in pp:
    p, v, m = r["config"]["pp"], r["config"]["stages_per_rank"], r["config"]["microbatches"]
    assert r["bubble"]["theory"] == (p - 1) / (v * m + p - 1)
    assert 0 <= r["bubble"]["measured"] < 1
# Every run starts from the same weights and trains on the same batches: same losses.
assert all(abs(a - b) < 1e-5 for r in pp for a, b in zip(r["losses"], pp[0]["losses"]))
print("theory (p-1)/(v*m+p-1):",
      {(r["config"]["schedule"], r["config"]["microbatches"]): round(r["bubble"]["theory"], 3) for r in pp})

# %% [markdown]
# The README's 4-stage sweep (`records/pipeline.jsonl`, the `small` GPT with 8 layers, 8 steps): the
# measured idle fraction next to the theory.

# %%
committed_pp = read_records(Path("records") / "pipeline.jsonl")
fig, ax = plt.subplots(figsize=(6, 3.6))
for i, schedule in enumerate(sorted({r["config"]["schedule"] for r in committed_pp})):
    runs = sorted((r["config"]["microbatches"], r["bubble"]) for r in committed_pp
                  if r["config"]["schedule"] == schedule)
    ms = [m for m, _ in runs]
    ax.plot(ms, [b["measured"] for _, b in runs], "o-", color=f"C{i}", label=f"{schedule} measured")
    ax.plot(ms, [b["theory"] for _, b in runs], "--", color=f"C{i}", label=f"{schedule} theory")
where, when = committed_pp[0]["machine"]["device_name"], committed_pp[0]["timestamp"][:10]
ax.set(xlabel="micro-batches m", ylabel="idle fraction", ylim=(0, 1),
       title=f"pipeline bubble, 4 stages ({where}, {when})")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## 2-D: FSDP2 across `dp`, tensor parallel across `tp`
# Each rank holds about a quarter of the weights (half by TP, half of that by FSDP).

# %%
hybrid = run("hybrid_parallelism.py", "--mode", "2d", "--dp", 2, "--tp", 2, "--model-size", "tiny",
             "--steps", 3, "--warmup-steps", 1, "--save", WORK / "hybrid.pt")
held = [s["params"] for s in hybrid[0]["metrics"]["model_state_bytes_per_rank"]]
dense = hybrid[0]["param_count"] * 4
print(f"parameter bytes per rank {held}, dense model {dense}")
assert max(held) < dense / 3 and sum(held) >= dense  # a quarter each (norms are replicated over tp)

# %% [markdown]
# ## DDP bucket size sweep
# Many small buckets pay the per-call latency many times; one huge bucket cannot start before backward
# ends. 16 layers x 128 x 128 fp32 weights = 1 MiB: a 25 MB bucket holds every gradient.

# %%
sweep = run("communication_overlap.py", "--layers", 16, "--steps", 4, "--warmup-steps", 1,
            "--bucket-cap-mb", 0.02, 0.25, 25, "--trace", WORK / "trace.json")
sizes = [r["config"]["bucket_cap_mb"] for r in sweep]
calls = [r["metrics"]["comm_per_step"]["all_reduce"]["calls"] for r in sweep]
print("all-reduce calls per step by bucket_cap_mb:", dict(zip(sizes, calls)))
assert calls == sorted(calls, reverse=True) and calls[-1] == 1

# %% [markdown]
# ## The committed records behind the README
# The README's pipeline and bucket tables are drawn by `plot_results.py` from `records/*.jsonl`
# (`python -m distkit.records render 05-advanced`). Their theory column and bucket counts must hold.

# %%
import plot_results  # noqa: E402

# %matplotlib inline

committed = read_records(Path("records") / "pipeline.jsonl") + read_records(Path("records") / "pipeline_2ranks.jsonl")
for row in map(plot_results.bubble_row, plot_results.pipeline_runs(committed)):
    v = 2 if row["schedule"] == "interleaved_1f1b" else 1
    assert abs(row["theory"] - (row["p"] - 1) / (v * row["m"] + row["p"] - 1)) < 1e-12, row
    assert 0 <= row["measured"] < 1 and row["compute_ms"] < row["step_ms"], row
    print(row)
overlap = {r["config"]["bucket_cap_mb"]: r for r in read_records(Path("records") / "overlap.jsonl")}
counts = [overlap[s]["metrics"]["comm_per_step"]["all_reduce"]["calls"] for s in sorted(overlap)]
print(dict(zip(sorted(overlap), counts)))
assert counts == sorted(counts, reverse=True) and counts[-1] == 1  # bigger buckets, fewer calls
first = next(iter(overlap.values()))
fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(sorted(overlap), [overlap[s]["metrics"]["samples_per_s"] for s in sorted(overlap)], "o-")
for s, c in zip(sorted(overlap), counts):
    ax.annotate(f"{c:.0f} call(s)", (s, overlap[s]["metrics"]["samples_per_s"]), fontsize=8,
                textcoords="offset points", xytext=(6, -4))
ax.margins(x=0.2, y=0.15)
ax.set(xscale="log", xlabel="bucket_cap_mb", ylabel="samples / s",
       title=f"DDP throughput vs bucket size ({first['machine']['device_name']}, {first['timestamp'][:10]})")
plt.show()
