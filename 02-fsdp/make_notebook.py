"""Write 02-fsdp/fsdp.ipynb (cells only, no outputs): `python 02-fsdp/make_notebook.py`."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell(
        "# FSDP sharding strategies, measured\n\n"
        "This notebook runs `fsdp_transformer.py` on 4 ranks (CPU/gloo, or one GPU each with NCCL) with "
        "every sharding strategy and DDP, at tiny size so it takes seconds, then plots what each rank "
        "holds and what each step sends, **measured** by the harness next to the **formula** "
        "(`sharding_strategies.md` explains the formulas)."),
    new_code_cell(
        "import json, os, subprocess, sys, tempfile\n"
        "from pathlib import Path\n\n"
        "results = Path(tempfile.mkdtemp()) / 'strategies.jsonl'\n"
        "cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=4',\n"
        "       'fsdp_transformer.py', '--sharding', 'full_shard', 'shard_grad_op', 'no_shard', 'hybrid_shard', 'ddp',\n"
        "       '--model-size', 'tiny', '--vocab-size', '65', '--steps', '5', '--log-every', '4',\n"
        "       '--results', str(results)]\n"
        "env = dict(os.environ, OMP_NUM_THREADS='1')  # 4 ranks may share few cores\n"
        "run = subprocess.run(cmd, env=env, capture_output=True, text=True)\n"
        "print('\\n'.join(line for line in run.stdout.splitlines() if 'loss' in line or 'state' in line))\n"
        "assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]"),
    new_markdown_cell(
        "Every strategy prints the same losses: same model, same data, only the placement of state and "
        "the traffic differ. Now the records (one per strategy):"),
    new_code_cell(
        "records = [json.loads(line) for line in results.read_text().splitlines()]\n"
        "names = [r['strategy'].replace('fsdp_', '') for r in records]\n"
        "for r in records:\n"
        "    state = r['metrics']['model_state_bytes_per_rank'][0]\n"
        "    comm = {k: int(v['bytes']) for k, v in r['metrics']['comm_per_step'].items()}\n"
        "    print(f\"{r['strategy']:<20} state/rank {sum(state.values()):>9,} B (formula \"\n"
        "          f\"{r['predicted']['params'] + r['predicted']['grads'] + r['predicted']['optimizer']:>9,})\"\n"
        "          f\"  comm/step {comm}  (formula {r['predicted']['comm_bytes']})\")"),
    new_code_cell(
        "%matplotlib inline\n"
        "import matplotlib.pyplot as plt\n\n"
        "fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))\n"
        "x = range(len(records))\n"
        "bottom = [0.0] * len(records)\n"
        "for kind in ('params', 'grads', 'optimizer'):\n"
        "    vals = [r['metrics']['model_state_bytes_per_rank'][0][kind] / 1024 for r in records]\n"
        "    ax1.bar(x, vals, bottom=bottom, label=kind)\n"
        "    bottom = [b + v for b, v in zip(bottom, vals)]\n"
        "ax1.scatter(x, [sum(r['predicted'][k] for k in ('params', 'grads', 'optimizer')) / 1024 for r in records],\n"
        "            marker='_', s=900, color='black', zorder=3, label='formula')\n"
        "ax1.set_xticks(list(x), names); ax1.set_ylabel('KiB per rank'); ax1.set_title('model state per rank')\n"
        "ax1.legend()\n\n"
        "collectives = ['all_gather', 'reduce_scatter', 'all_reduce']\n"
        "width = 0.25\n"
        "for i, c in enumerate(collectives):\n"
        "    measured = [r['metrics']['comm_per_step'].get(c, {}).get('bytes', 0) / 1024 for r in records]\n"
        "    predicted = [r['predicted']['comm_bytes'].get(c, 0) / 1024 for r in records]\n"
        "    pos = [j + (i - 1) * width for j in x]\n"
        "    ax2.bar(pos, measured, width, label=f'{c} measured')\n"
        "    ax2.scatter(pos, predicted, marker='_', s=200, color='black', zorder=3,\n"
        "                label='formula' if i == 0 else None)\n"
        "ax2.set_xticks(list(x), names); ax2.set_ylabel('KiB per step (payload)')\n"
        "ax2.set_title('bytes communicated per step'); ax2.legend(fontsize=8)\n"
        "fig.tight_layout()"),
    new_markdown_cell(
        "What to see: FULL_SHARD and SHARD_GRAD_OP hold a quarter of DDP's state per rank, HYBRID_SHARD "
        "(2x2 mesh) a half, NO_SHARD all of it. FULL_SHARD all-gathers about twice the parameters "
        "(forward and backward), SHARD_GRAD_OP once; HYBRID_SHARD adds an all-reduce of its half-shard "
        "across the two replicas. The black marks (formula, with dim-0 padding) sit on the bars."),
]

nb = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                        "language": "python"}})
path = Path(__file__).resolve().parent / "fsdp.ipynb"
nbformat.write(nb, path)
print(f"wrote {path}")
