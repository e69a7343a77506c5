"""Writes advanced.ipynb (outputs cleared): python 05-advanced/make_notebook.py"""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = [
    new_markdown_cell(
        "# Chapter 05: tensor, pipeline and 2-D parallelism at tiny size\n\n"
        "Each cell launches a chapter script with `torchrun` as a subprocess (4 CPU ranks on gloo, or 4 GPUs "
        "with NCCL) and reads the harness records it writes. Records and checkpoints go to a temporary "
        "folder. See README.md for what each strategy does."),
    new_code_cell(
        "import json, os, subprocess, sys, tempfile\n"
        "from pathlib import Path\n"
        "import matplotlib.pyplot as plt\n\n"
        "WORK = Path(tempfile.mkdtemp(prefix='ch05-'))\n"
        "ENV = dict(os.environ, OMP_NUM_THREADS='1', DISTKIT_NO_PROGRESS='1')\n\n"
        "def run(script, *args, nproc=4):\n"
        "    \"\"\"torchrun one chapter script; returns the records it appended.\"\"\"\n"
        "    results = WORK / f'{Path(script).stem}.jsonl'\n"
        "    results.unlink(missing_ok=True)\n"
        "    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',\n"
        "           script, *map(str, args), '--results', str(results)]\n"
        "    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True)\n"
        "    lines = [l for l in (out.stdout + out.stderr).splitlines() if l.startswith('[rank 0]') or 'error' in l]\n"
        "    print('\\n'.join(lines[-14:]))\n"
        "    if out.returncode:\n"
        "        raise RuntimeError(f'exit {out.returncode}: {out.stderr[-2000:]}')\n"
        "    return [json.loads(line) for line in results.read_text().splitlines()]"),
    new_markdown_cell("## Tensor parallelism\nEach rank holds a quarter of every block's weight matrices; "
                      "the harness counts 4 all-reduces per block per step."),
    new_code_cell(
        "tp = run('tensor_parallel.py', '--model-size', 'tiny', '--steps', 5, '--checkpoint', WORK / 'tp.pt')\n"
        "tp[0]['metrics']['comm_per_step']"),
    new_markdown_cell("## Pipeline parallelism: the bubble vs the number of micro-batches\n"
                      "Theory for p stages, m micro-batches, v stages per rank: (p-1)/(v·m+p-1). "
                      "The measured idle fraction includes the send/recv time, which on a loaded CPU "
                      "is large compared with the tiny model's compute."),
    new_code_cell(
        "pp = run('pipeline_parallel.py', '--model-size', 'tiny', '--n-layer', 8, '--steps', 5,\n"
        "         '--global-batch-size', 16, '--schedule', 'gpipe', '1f1b', 'interleaved_1f1b',\n"
        "         '--microbatches', 4, 8, 16, '--checkpoint', WORK / 'pp_{schedule}_{microbatches}.pt')\n"
        "fig, ax = plt.subplots(figsize=(6, 4))\n"
        "for i, schedule in enumerate(['gpipe', '1f1b', 'interleaved_1f1b']):\n"
        "    runs = sorted((r['config']['microbatches'], r['bubble']) for r in pp if r['config']['schedule'] == schedule)\n"
        "    ms = [m for m, _ in runs]\n"
        "    ax.plot(ms, [b['measured'] for _, b in runs], 'o-', color=f'C{i}', label=f'{schedule} measured')\n"
        "    ax.plot(ms, [b['theory'] for _, b in runs], '--', color=f'C{i}', label=f'{schedule} theory')\n"
        "ax.set(xlabel='micro-batches m', ylabel='idle fraction', ylim=(0, 1), title='pipeline bubble, 4 stages')\n"
        "ax.legend(fontsize=7); plt.show()"),
    new_markdown_cell("## 2-D: FSDP2 across `dp`, tensor parallel across `tp`"),
    new_code_cell(
        "hybrid = run('hybrid_parallelism.py', '--mode', '2d', '--dp', 2, '--tp', 2, '--model-size', 'tiny',\n"
        "             '--steps', 5, '--checkpoint', WORK / 'hybrid.pt')\n"
        "hybrid[0]['metrics']['model_state_bytes_per_rank']"),
    new_markdown_cell("## DDP bucket size sweep\nMany small buckets pay the per-call latency many times; "
                      "one huge bucket cannot start before backward ends."),
    new_code_cell(
        "sweep = run('communication_overlap.py', '--layers', 24, '--steps', 5, '--bucket-mb', 0.02, 0.1, 0.5, 25,\n"
        "            '--trace', WORK / 'trace.json')\n"
        "sizes = [r['config']['bucket_cap_mb'] for r in sweep]\n"
        "fig, ax = plt.subplots(figsize=(6, 4))\n"
        "ax.plot(sizes, [r['metrics']['samples_per_s'] for r in sweep], 'o-')\n"
        "ax.set(xscale='log', xlabel='bucket_cap_mb', ylabel='samples / s', title='DDP throughput vs bucket size')\n"
        "plt.show()"),
]
nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                        "language": "python"}})
nbformat.write(nb, Path(__file__).with_name("advanced.ipynb"))
