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
# # FSDP sharding strategies, measured and checked against the formulas
#
# This notebook runs `fsdp_transformer.py` on 4 ranks (CPU/gloo here; one GPU each with NCCL on a
# GPU machine) with every sharding strategy and DDP, at tiny size so it takes seconds. The harness
# counts the bytes of the real tensors each rank holds and of every collective call. We compute
# what the textbook formulas predict **here, from the model's parameter shapes** (not from the
# script), and `assert` that the measurements equal them. Then we do the same for the committed
# record behind the chapter's table and plots (`records/fsdp_strategies.jsonl`, the `small` GPT).
#
# Notation (see `sharding_strategies.md`): `P` = parameter bytes, `s` = ranks in a shard group,
# `r` = replicas. Each rank keeps `P/s` of parameters, `P/s` of gradients and `2P/s` of AdamW
# state. Per step: all-gather `P` per gathering (twice for units resharded after forward, once for
# the root unit and under SHARD_GRAD_OP), reduce-scatter `P`, all-reduce `P/s` across replicas.
# FSDP2 pads dim 0 of every parameter to a multiple of `s`.

# %%
import math
import os
import subprocess
import tempfile
from pathlib import Path

from distkit.compare import config_of_record
from distkit.harness import bus_factor, read_records
from distkit.models import GPTConfig, TinyGPT
from distkit.notebooks import torchrun_argv

TORCHRUN = torchrun_argv()  # torchrun (the test suite names its own launcher in $DISTKIT_TORCHRUN)
results = Path(tempfile.mkdtemp()) / "strategies.jsonl"
cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=4",
       "fsdp_transformer.py", "--sharding", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "ddp",
       "--model-size", "tiny", "--vocab-size", "65", "--global-batch-size", "8", "--steps", "5",
       "--log-every", "4", "--results", str(results)]
env = dict(os.environ, OMP_NUM_THREADS="1")  # 4 ranks may share few cores
run = subprocess.run(cmd, env=env, capture_output=True, text=True)
assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
print("\n".join(line for line in run.stdout.splitlines() if "loss" in line))

# %% [markdown]
# Every strategy trains the same model on the same data: the losses must be the same (up to the
# summation order of the reductions, far below the 4 printed decimals).

# %%
records = read_records(results)
names = [r["strategy"] for r in records]
assert names == ["fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_no_shard", "fsdp_hybrid_shard", "ddp"], names
final_losses = {r["strategy"]: r["losses"][-1][1] for r in records}
print(final_losses)
assert max(final_losses.values()) - min(final_losses.values()) < 1e-4, final_losses


# %% [markdown]
# The formulas, written here from the model's parameter shapes. Units: one per transformer block,
# then the root (embeddings, final norm, LM head), which is never resharded after forward.

# %%
def formula(cfg: GPTConfig, strategy: str, world: int, hsdp_shard_size: int = 2) -> dict:
    """Bytes per rank (rank 0, which holds full-size chunks) and payload bytes per step, fp32."""
    s = {"fsdp_full_shard": world, "fsdp_shard_grad_op": world,
         "fsdp_hybrid_shard": hsdp_shard_size}.get(strategy, 1)
    model = TinyGPT(cfg)

    def padded(params):  # dim 0 rounded up to a multiple of s, times the other dims
        return sum(math.ceil(p.shape[0] / s) * s * p[0].numel() for p in params)

    blocks = padded(model.blocks.parameters())
    root = padded(p for n, p in model.named_parameters() if not n.startswith("blocks."))
    P = 4 * (blocks + root)
    comm = {}
    if s > 1:
        gathers = 2 if strategy in ("fsdp_full_shard", "fsdp_hybrid_shard") else 1
        comm["all_gather"] = 4 * (gathers * blocks + root)
        comm["reduce_scatter"] = P
    if strategy in ("ddp", "fsdp_no_shard", "fsdp_hybrid_shard"):
        comm["all_reduce"] = P // s
    groups = {"all_gather": s, "reduce_scatter": s, "all_reduce": world // s}
    bus = sum(v * bus_factor(c, groups[c]) for c, v in comm.items())
    return {"state": {"params": P // s, "grads": P // s, "optimizer": 2 * P // s}, "comm": comm, "bus": bus}


def check(records):
    """Print measured vs formula for each strategy, and assert they are equal."""
    for r in records:
        cfg = config_of_record(r)
        want = formula(cfg, r["strategy"], r["world_size"], r["config"]["hsdp_shard_size"] or 2)
        state = r["metrics"]["model_state_bytes_per_rank"][0]
        comm = {k: int(v["bytes"]) for k, v in r["metrics"]["comm_per_step"].items()}
        bus = sum(v["bus_bytes"] for v in r["metrics"]["comm_per_step"].values())
        print(f"{r['strategy']:<19} state on rank 0 {sum(state.values()):>10,} B "
              f"(formula {sum(want['state'].values()):>10,})  comm/step {comm}")
        assert state == want["state"], (r["strategy"], state, want["state"])
        assert comm == want["comm"], (r["strategy"], comm, want["comm"])
        assert math.isclose(bus, want["bus"], rel_tol=1e-9), (r["strategy"], bus, want["bus"])


check(records)

# %% [markdown]
# The committed record behind the chapter's table and plots (a 4-rank run of the `small` GPT,
# recorded with `python -m distkit.records run`): the same formulas, the same equality.

# %%
committed = read_records("records/fsdp_strategies.jsonl")
print("recorded on", committed[0]["machine"]["device_name"], committed[0]["backend"],
      committed[0]["timestamp"][:10], "|", config_of_record(committed[0]))
check(committed)
ddp_state = next(sum(r["metrics"]["model_state_bytes_per_rank"][0].values()) for r in committed
                 if r["strategy"] == "ddp")
for r in committed:  # a quarter of DDP's state under FULL_SHARD on 4 ranks (up to padding), a half under 2x2 HSDP
    share = sum(r["metrics"]["model_state_bytes_per_rank"][0].values()) / ddp_state
    print(f"{r['strategy']:<19} {share:.3f} of DDP's model state per rank")
    expected = {"fsdp_full_shard": 1 / 4, "fsdp_shard_grad_op": 1 / 4, "fsdp_hybrid_shard": 1 / 2}.get(r["strategy"], 1)
    assert abs(share - expected) < 0.01, (r["strategy"], share)

# %%
# %matplotlib inline
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
x = range(len(committed))
labels = [r["strategy"].replace("fsdp_", "") for r in committed]
bottom = [0.0] * len(committed)
for kind in ("params", "grads", "optimizer"):
    vals = [r["metrics"]["model_state_bytes_per_rank"][0][kind] / 1024 for r in committed]
    ax1.bar(x, vals, bottom=bottom, label=f"{kind} (measured)")
    bottom = [b + v for b, v in zip(bottom, vals)]
want_state = [sum(formula(config_of_record(r), r["strategy"], r["world_size"])["state"].values()) / 1024
              for r in committed]
ax1.scatter(x, want_state, marker="_", s=600, linewidths=2, color="black", zorder=3, label="formula")
ax1.set_ylim(0, 1.15 * max(bottom + want_state))
ax1.set_xticks(list(x), labels)
ax1.set_ylabel("model state on rank 0 (KiB)")
ax1.set_title("model state per rank")
ax1.legend(fontsize=8, markerscale=0.5)

bus = [sum(v["bus_bytes"] for v in r["metrics"]["comm_per_step"].values()) / 1024 for r in committed]
want_bus = [formula(config_of_record(r), r["strategy"], r["world_size"])["bus"] / 1024 for r in committed]
ax2.bar(x, bus, label="measured")
ax2.scatter(x, want_bus, marker="_", s=600, linewidths=2, color="black", zorder=3, label="formula")
ax2.set_ylim(0, 1.15 * max(bus + want_bus))
ax2.set_xticks(list(x), labels)
ax2.set_ylabel("bytes rank 0 sends per step (KiB)")
ax2.set_title("bytes on the wire per step")
ax2.legend(fontsize=8, markerscale=0.5)
fig.tight_layout()
assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(bus, want_bus))
assert 1.4 < bus[labels.index("full_shard")] / bus[labels.index("ddp")] <= 1.5  # theory: 3(N-1)/N over 2(N-1)/N

# %% [markdown]
# What to see: FULL_SHARD and SHARD_GRAD_OP hold a quarter of DDP's state per rank, HYBRID_SHARD
# (2x2 mesh) a half, NO_SHARD all of it. FULL_SHARD all-gathers the block parameters twice (forward
# and backward) and the root once, so it sends a little under 1.5x DDP's bytes; SHARD_GRAD_OP
# gathers once and sends what DDP sends; HYBRID_SHARD adds an all-reduce of its half-shard across
# the two replicas. The black marks (formula, with dim-0 padding) sit on the bars.
