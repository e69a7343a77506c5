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
# # Chapter 04 · Collectives, pictured, checked and measured
#
# This notebook does three things, and checks each with `assert` cells (a failed assert is an error,
# so a wrong number stops the notebook):
#
# 1. draws what each collective does to the data of 4 ranks, then runs `collective_ops.py` through
#    `torchrun` and checks the printed results against the definitions computed here;
# 2. counts the bytes a ring all-reduce sends per rank, which gives the bus factor 2(n-1)/n;
# 3. runs `bandwidth_test.py` at small sizes and checks busbw/algbw in the JSON records it wrote
#    against the counted factors, then does the same for the README's committed sweep and plots it.
#
# Each rank's data is drawn as coloured blocks: the colour says which rank the data came from; a stripe
# of several colours is a reduction (a sum over ranks).

# %%
import os
import re
import subprocess
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from distkit.harness import read_records
from distkit.notebooks import torchrun_argv

N = 4
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DISTKIT_NO_PROGRESS="1")
TORCHRUN = torchrun_argv()  # torchrun (the test suite names its own launcher in $DISTKIT_TORCHRUN)


def torchrun(*args, timeout=240):
    """Run a chapter script on N ranks (a subprocess, as from a shell); its output, or an error."""
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={N}", *args]
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run.stdout


def blocks(ax, x0, rank_row, cells):
    """Draw one rank's buffer: each cell is a list of source ranks (several = reduced/summed)."""
    for i, sources in enumerate(cells):
        if not sources:
            ax.add_patch(Rectangle((x0 + i, rank_row), 1, 0.8, fill=False, ls=":", ec="gray"))
            continue
        h = 0.8 / len(sources)
        for k, s in enumerate(sources):
            ax.add_patch(Rectangle((x0 + i, rank_row + k * h), 1, h, color=COLORS[s], ec="white"))


def picture(ax, name, before, after):
    for r in range(N):
        blocks(ax, 0, N - 1 - r, before[r])
        blocks(ax, 6, N - 1 - r, after[r])
        ax.text(-0.3, N - 1 - r + 0.4, f"rank {r}", ha="right", va="center", fontsize=8)
    ax.annotate("", xy=(5.7, N / 2), xytext=(4.3, N / 2), arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-2, 10.5)
    ax.set_ylim(-0.3, N)
    ax.axis("off")
    ax.set_title(name, fontsize=10)


ALL = list(range(N))
own = [[[r]] * 1 for r in range(N)]                       # one block of rank r's data
chunks = [[[r]] * N for r in range(N)]                    # N chunks of rank r's data
pictures = {
    "all_reduce: everyone gets the sum": (own, [[ALL]] * N),
    "broadcast (root 0)": (own, [[[0]]] * N),
    "reduce (root 0)": (own, [[ALL]] + [[[]]] * (N - 1)),
    "all_gather: everyone gets every block": (own, [[[s] for s in ALL]] * N),
    "reduce_scatter: rank c gets the sum of chunk c": (chunks, [[ALL]] * N),
    "all_to_all: block d of rank s goes to rank d": (chunks, [[[s] for s in ALL]] * N),
}
fig, axes = plt.subplots(2, 3, figsize=(13, 5))
for ax, (name, (before, after)) in zip(axes.flat, pictures.items()):
    picture(ax, name, before, after)
fig.suptitle("before -> after, 4 ranks (colour = the rank the data came from; stacked = summed)")
plt.tight_layout()
plt.show()

# %% [markdown]
# In `reduce_scatter` and `all_to_all` each rank starts with 4 chunks; the difference is that
# reduce-scatter *sums* chunk c of all ranks onto rank c, while all-to-all *transposes*: rank d receives
# chunk d of every rank, unreduced. all_gather is what FSDP does before a layer's forward;
# reduce_scatter is what it does to the gradients after backward; all_reduce = reduce_scatter +
# all_gather, which is why its bus factor is twice theirs.
#
# ## The real collectives, checked against the definitions
#
# `collective_ops.py` starts rank r with `[10r, 10r+1, 10r+2, 10r+3]`. The cell below runs the
# all-reduce demos on 4 ranks, reads what every rank printed, and compares it with the sum, mean and
# maximum computed here in plain Python (not by the library, not by the script's own check).

# %%
out = torchrun("collective_ops.py", "--only", "all_reduce")
inputs = [[10 * r + i for i in range(4)] for r in range(N)]
expected = {"all_reduce(SUM)": [sum(col) for col in zip(*inputs)],
            "all_reduce(AVG)": [sum(col) / N for col in zip(*inputs)],
            "all_reduce(MAX)": [max(col) for col in zip(*inputs)]}
for demo, want in expected.items():
    section = out.split(f"== {demo}")[1].split("\n==")[0]
    results = re.findall(r"rank (\d): \[[^\]]*\]\s+->\s+\[([^\]]*)\]", section)
    print(f"{demo:16} every rank -> {results[0][1]}   (expected {want})")
    assert [int(r) for r, _ in results] == list(range(N)), section
    for _, got in results:
        assert [float(x) for x in got.split(",")] == want, (demo, got, want)

# %% [markdown]
# ## Counting the bytes: where 2(n-1)/n comes from
#
# A ring all-reduce cuts the buffer of S bytes into n chunks. Reduce-scatter: n-1 steps, in each every
# rank sends one chunk to its right neighbour, which adds it to its own. All-gather: n-1 more steps
# passing the finished chunks around. The cell simulates exactly that on n lists and counts what each
# rank sends.

# %%
def ring_all_reduce_sent(n, count):
    """Simulated ring all-reduce on n ranks of ``count`` numbers: (results, elements sent per rank)."""
    data = [[float(100 * r + i) for i in range(count)] for r in range(n)]
    size = count // n
    chunk = lambda buf, c: buf[c * size:(c + 1) * size]  # noqa: E731
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            # rank r sends chunk (r - step) mod n (reduce-scatter) or (r + 1 - step) mod n (all-gather)
            moves = []
            for r in range(n):
                c = (r - step) % n if phase == "reduce-scatter" else (r + 1 - step) % n
                moves.append(((r + 1) % n, c, chunk(data[r], c)))
                sent[r] += size
            for dst, c, payload in moves:
                mine = chunk(data[dst], c)
                new = [a + b for a, b in zip(mine, payload)] if phase == "reduce-scatter" else payload
                data[dst][c * size:(c + 1) * size] = new
    return data, sent


for n in (2, 4, 8):
    count = 8 * n
    results, sent = ring_all_reduce_sent(n, count)
    total = [sum(100 * r + i for r in range(n)) for i in range(count)]
    assert all(res == total for res in results), n       # the ring computed the sum on every rank
    factor = max(sent) / count
    print(f"n = {n}: each rank sent {max(sent)} of {count} elements = {factor:.4f} x S; "
          f"2(n-1)/n = {2 * (n - 1) / n:.4f}")
    assert factor == 2 * (n - 1) / n

# %% [markdown]
# The same counting gives (n-1)/n for reduce-scatter or all-gather alone (one phase) and for
# all-to-all (each rank keeps 1 of its n blocks and sends the others); broadcast, reduce and
# send/recv move the whole buffer once per link: factor 1. `bandwidth_test.py` reports busbw =
# algbw x factor; the cells below check its records against these counted factors.
#
# ## A small bandwidth sweep
#
# Four ranks, 1 KiB to 1 MiB, four collectives, a few iterations (seconds, not a benchmark). The
# README's sweep is larger; its record is committed in `records/`.

# %%
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "sendrecv": lambda n: 1.0}
assert FACTOR["all_reduce"](4) == max(ring_all_reduce_sent(4, 32)[1]) / 32   # the count above

out_dir = Path(tempfile.mkdtemp(prefix="ch04_nb_"))
results = out_dir / "bandwidth.jsonl"
out = torchrun("bandwidth_test.py", "--collectives", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
               "--max-bytes", "1M", "--iters", "3", "--warmup-iters", "1",
               "--results", str(results), "--plot", str(out_dir / "bandwidth.png"))


def check_records(records):
    """busbw/algbw = the counted factor and algbw = size/time on every row; no wrong element."""
    for rec in records:
        rows, n = rec["rows"], rec["world_size"]
        ratios = sorted({round(r["busbw_GBps"] / r["algbw_GBps"], 12) for r in rows})
        print(f"{rec['collective']:>15}: busbw/algbw = {ratios} (counted factor {FACTOR[rec['collective']](n):.4f}), "
              f"#wrong = {sum(r['wrong'] for r in rows)}")
        for r in rows:
            assert abs(r["busbw_GBps"] / r["algbw_GBps"] - FACTOR[rec["collective"]](n)) < 1e-9, (rec["collective"], r)
            assert abs(r["algbw_GBps"] - r["size_bytes"] / r["time_us"] / 1e3) <= 1e-9 * r["algbw_GBps"]
            assert r["wrong"] == 0


records = read_records(results)
assert [r["collective"] for r in records] == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
check_records(records)

# %% [markdown]
# The README's sweep, committed in `records/bandwidth_cpu_gloo_4ranks.jsonl`, must obey the same
# factors (its plot and tables are drawn from it by `python -m distkit.records render 04-nccl-operations`).
# The plot below is drawn from that record, not from the short run above: bandwidths depend on the
# machine and its load, and a plot in this notebook should show the same run every time it is opened.

# %%
committed = [r for r in read_records(Path("records") / "bandwidth_cpu_gloo_4ranks.jsonl") if r.get("collective")]
assert {r["collective"] for r in committed} == set(FACTOR)
check_records(committed)

fig, ax = plt.subplots(figsize=(7, 4))
for rec in committed:
    rows = rec["rows"]
    ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=rec["collective"])
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("message size (bytes)")
ax.set_ylabel("busbw (GB/s)")
ax.set_title(f"{committed[0]['machine']['device_name']}, {committed[0]['backend']}, {committed[0]['world_size']} ranks "
             f"(committed record, {committed[0]['timestamp'][:10]})")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# What to look for in the plot: at small sizes every collective costs about the same fixed time
# (latency: time barely grows, so busbw climbs in proportion to size); at large sizes busbw flattens at
# what the link and the copies allow (bandwidth regime). On this CPU machine with gloo the plateau is
# set by memory copies through loopback sockets; on GPUs NCCL's is set by NVLink or the network, which
# is the point of comparing busbw with the link speed.
