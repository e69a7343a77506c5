"""Worker: chapter 01's gradient accumulation against the one-process reference.

``ddp_training.accumulate_gradients`` (the script's own function: k micro-batches, all but the last
under ``no_sync()``, each loss divided by k) trains the tiny GPT for a few plain-SGD steps, with k = 2
and k = 4; then the same function with the ``/ len(chunks)`` deleted from ddp_training.py's source
(the bug the test must catch; tests/workers/mutation.py checks that the division occurs exactly
once). Rank 0 compares each result with tests/workers/reference.py's single-process trainer (the
whole global batch each step, SGD, no clipping) and writes ``{variant: max |distributed -
reference|, "moved": max |reference - initial|}`` to ``--out``.

Plain SGD because a gradient k times too large moves SGD's weights k times as far; AdamW (the
script's optimizer) divides the update by sqrt(v) and would hide the bug.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.models import TinyGPT, TokenTask, gpt_config, rank_slice
from mutation import mutated_source  # tests/workers/mutation.py, beside this worker
from reference import train_one_process  # tests/workers/reference.py, beside this worker

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "01-ddp-basics" / "ddp_training.py"
STEPS, LR, BATCH = 3, 0.5, 16
DIVISION = "/ len(chunks)"  # the line of accumulate_gradients the broken variant deletes


def load_training(broken: bool = False) -> types.ModuleType:
    """ddp_training.py as a module; ``broken``: with the division by k deleted from its source."""
    name = "ddp_training_no_division" if broken else "ddp_training"
    source = mutated_source(SCRIPT, DIVISION, "") if broken else SCRIPT.read_text()
    module = types.ModuleType(name)
    module.__file__ = str(SCRIPT)
    sys.modules[name] = module
    exec(compile(source, str(SCRIPT), "exec"), module.__dict__)
    return module


def new_model() -> TinyGPT:
    torch.manual_seed(0)  # the reference and every variant start from these weights
    return TinyGPT(gpt_config("tiny", vocab_size=65))


def reference() -> tuple[dict, dict]:
    """One process, the whole global batch per step, no accumulation: (initial, final) weights."""
    model = new_model()
    return train_one_process(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, BATCH)


def accumulated(ctx, accumulate_gradients, k: int) -> dict:
    """DDP on this rank's slice of each global batch, k micro-batches per step, via the script."""
    model = DDP(new_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    task = TokenTask(model.module.cfg, seed=0)
    for step in range(STEPS):
        inputs, targets = (rank_slice(t, ctx.rank, ctx.world_size) for t in task.global_batch(step, BATCH))
        optimizer.zero_grad()
        accumulate_gradients(model, inputs, targets, k)
        optimizer.step()
    return model.module.state_dict()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def case_accumulation(ctx, out: Path) -> None:
    initial, expected = reference()
    good, broken = load_training().accumulate_gradients, load_training(broken=True).accumulate_gradients
    results = {"moved": max_diff(initial, expected)}
    for variant, fn, k in (("k2", good, 2), ("k4", good, 4), ("no_division_k2", broken, 2)):
        state = accumulated(ctx, fn, k)
        results[variant] = max_diff(state, expected)
    if ctx.is_main:
        print("accumulation: " + ", ".join(f"{k} {v:.2e}" for k, v in results.items()), flush=True)
        out.write_text(json.dumps(results, indent=1))


def main():
    parser = ArgumentParser()
    parser.add_argument("--out", required=True)
    add_runtime_args(parser)
    args = parser.parse_args()
    with distributed(args) as ctx:
        case_accumulation(ctx, Path(args.out))


if __name__ == "__main__":
    run_main(main)
