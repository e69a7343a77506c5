"""Writes 03-deepspeed/deepspeed.ipynb (outputs cleared). Run: python 03-deepspeed/make_notebook.py"""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Chapter 03: ZeRO stages side by side

This notebook runs `zero_memory.py` once with 4 ranks on a small transformer: ZeRO stages 0, 1, 2, 3
and ZeRO-3 with CPU offload train the same model one after the other in one `torchrun` job. It then
plots, from the harness records, **the model-state bytes each rank holds** (parameters, gradients,
optimizer state) and **the step time of each stage**.

What to look for: every stage trains the same weights (last column of the table); the memory per
rank falls stage by stage (optimizer state first, then gradients, then parameters) while the step
time grows, because each stage adds communication (and offload adds copies)."""),
    new_code_cell("""import os, subprocess, sys, tempfile
from pathlib import Path

REPO = Path.cwd().parent          # the notebook runs in 03-deepspeed/
OUT = Path(tempfile.mkdtemp(prefix="ch03_nb_"))
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
       "03-deepspeed/zero_memory.py", "--model-size", "tiny", "--steps", "6", "--global-batch-size", "16",
       "--out-dir", str(OUT), "--results", str(OUT / "results.jsonl")]
env = dict(os.environ, OMP_NUM_THREADS="1", DISTKIT_NO_PROGRESS="1")
proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
print("\\n".join(line for line in proc.stdout.splitlines() if line.startswith(("[rank 0]", "|", "Ψ"))))
assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]"""),
    new_code_cell("""import json
from distkit.harness import read_records

records = read_records(OUT / "results.jsonl")
table = json.loads((OUT / "zero_memory.json").read_text())
for r in records:
    per_rank = [sum(s.values()) for s in r["metrics"]["model_state_bytes_per_rank"]]
    print(f"{r['strategy']:>14}: model state per rank {[f'{b / 2**20:.3f} MiB' for b in per_rank]}, "
          f"step {r['metrics']['step_time_s_median'] * 1e3:.0f} ms")"""),
    new_code_cell("""import matplotlib.pyplot as plt

names = [r["strategy"] for r in records]
world = records[0]["world_size"]
fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4))
width = 0.8 / world
colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
for rank in range(world):
    bottom = [0.0] * len(records)
    for key, color in colors.items():
        values = [r["metrics"]["model_state_bytes_per_rank"][rank][key] / 2**20 for r in records]
        ax_mem.bar([i - 0.4 + width * (rank + 0.5) for i in range(len(records))], values, width,
                   bottom=bottom, color=color, label=key if rank == 0 else None, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, values)]
ax_mem.plot(range(len(records)), [row["predicted_total"] / 2**20 for row in table["rows"]], "k_",
            markersize=30, label="fp32 formula")
ax_mem.set_xticks(range(len(records)), names)
ax_mem.set_ylabel("MiB per rank (one bar per rank)")
ax_mem.set_title("model state per rank")
ax_mem.legend()
ax_time.bar(names, [r["metrics"]["step_time_s_median"] * 1e3 for r in records], color="#8172b2")
ax_time.set_ylabel("median step time (ms)")
ax_time.set_title(f"step time ({records[0]['machine']['device_name']}, {records[0]['backend']}, {world} ranks)")
fig.tight_layout()
plt.show()"""),
    new_markdown_cell("""On a GPU machine the same cell shows `cuda` and NCCL; with `--model-size small` or larger the
ratios stay the same and the bars grow with Ψ. The chapter README explains every gap between the
measured bars and the formulas (the CPU timings here are taken on a shared machine, so compare the
stages with each other, not with other runs)."""),
]

if __name__ == "__main__":
    nb = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    path = Path(__file__).resolve().parent / "deepspeed.ipynb"
    nbformat.write(nb, path)
    print(f"wrote {path}")
