"""Write ddp_basics.ipynb (outputs cleared): python 01-ddp-basics/make_notebook.py

The notebook launches the chapter's scripts with torchrun as subprocesses (mp.spawn cannot start
workers defined in a notebook cell), then plots what they measured.
"""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Chapter 01: DDP basics, hands-on

This notebook launches the chapter's scripts at a small size (the `tiny` transformer, 30 steps) and
plots what they measured:

1. **loss curves for 1, 2 and 4 ranks** with the same global batch: DDP is single-process training
   on the global batch, split across processes, so the three curves lie on top of each other;
2. **DDP vs DDP-from-scratch**: the same model and ranks, timed by the shared harness. The
   from-scratch version issues one all-reduce per parameter tensor after backward; DDP packs the
   gradients into buckets and overlaps their all-reduce with backward.

Each job is a real `torchrun` subprocess (CPU + gloo here, NCCL on GPUs)."""),
    new_code_cell("""import json, os, subprocess, sys, tempfile
from pathlib import Path
import matplotlib.pyplot as plt

REPO = Path.cwd().parent          # the notebook runs from 01-ddp-basics/
OUT = Path(tempfile.mkdtemp(prefix="ch01_nb_"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DISTKIT_NO_PROGRESS": "1"}
SMALL = ["--model-size", "tiny", "--steps", "30", "--global-batch-size", "16", "--log-every", "10"]

def start(nproc, script, *args):
    \"\"\"Start `torchrun --standalone --nproc_per_node=nproc script args` in the background.\"\"\"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"01-ddp-basics/{script}", *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

def finish(job):
    \"\"\"Wait for a job, show its last lines, fail loudly if it failed.\"\"\"
    out, _ = job.communicate(timeout=600)
    print("\\n".join(out.strip().splitlines()[-3:]))
    assert job.returncode == 0, out[-3000:]

def torchrun(nproc, script, *args):
    finish(start(nproc, script, *args))

def records(path):
    return [json.loads(line) for line in open(path)]"""),
    new_markdown_cell("## 1. The same training on 1, 2 and 4 ranks"),
    new_code_cell("""def train(n):
    return start(n, "ddp_training.py", *SMALL, "--resume", "none", "--checkpoint-dir", OUT / f"ck{n}",
                 "--log-dir", OUT / f"logs{n}", "--results", OUT / f"ddp{n}.jsonl")

for job in [train(1), train(2)]:   # only their losses matter: run them side by side
    finish(job)
finish(train(4))                   # its timing is compared below: run it alone"""),
    new_code_cell("""ddp_runs = {n: records(OUT / f"ddp{n}.jsonl")[-1] for n in (1, 2, 4)}
fig, ax = plt.subplots(figsize=(7, 4))
for n, style in zip(sorted(ddp_runs), ("-", "--", ":")):
    ax.plot(ddp_runs[n]["loss_history"], style, linewidth=2, label=f"{n} rank(s)")
ax.set(xlabel="step", ylabel="training loss", title="DDP: same global batch (16), any number of ranks")
ax.legend(); ax.grid(alpha=0.3); plt.show()
gap = max(abs(a - b) for n in ddp_runs for a, b in zip(ddp_runs[n]["loss_history"], ddp_runs[1]["loss_history"]))
print(f"largest loss difference between world sizes: {gap:.2e} (float rounding only)")"""),
    new_markdown_cell("""## 2. DDP vs data parallelism by hand (4 ranks)

`ddp_from_scratch.py` broadcasts rank 0's weights once and then, after each backward, all-reduces
every gradient tensor separately. Same arithmetic, same result; the harness counts the collectives
that really ran and times the steps."""),
    new_code_cell("""torchrun(4, "ddp_from_scratch.py", *SMALL, "--save", OUT / "scratch.pt", "--results", OUT / "scratch.jsonl")
scratch, ddp = records(OUT / "scratch.jsonl")[-1], ddp_runs[4]
rows = []
for name, r in (("DDP (buckets, overlap)", ddp), ("from scratch (per tensor)", scratch)):
    comm = r["metrics"]["comm_per_step"]["all_reduce"]
    rows.append((name, r["metrics"]["step_time_s_median"], comm["calls"], comm["bytes"] / 2**20))
    print(f"{name:<27} median step {rows[-1][1]:.3f} s | all-reduce calls/step {comm['calls']:.0f} "
          f"| {rows[-1][3]:.2f} MiB/step")
fig, ax = plt.subplots(figsize=(6, 3))
ax.barh([r[0] for r in rows], [r[1] for r in rows], color=["tab:blue", "tab:orange"])
ax.set(xlabel="median step time (s)", title="4 ranks, tiny model: same bytes, different number of calls")
plt.tight_layout(); plt.show()"""),
    new_markdown_cell("""On this 2-core CPU machine each gloo all-reduce call costs several milliseconds whatever
its size, so the per-tensor version pays that latency once per parameter tensor (37 here); DDP pays it
once per bucket. On GPUs with NCCL the gap shrinks per call but overlap with backward matters more.
The chapter README shows the same comparison at the default model size."""),
]


def main() -> None:
    nb = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    path = Path(__file__).with_name("ddp_basics.ipynb")
    nbformat.write(nb, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
