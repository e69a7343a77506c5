"""Worker: the negative control for chapter 03's equivalence tests (DeepSpeed ZeRO vs one process).

test_ch03_deepspeed.py compares the README scripts with single-process AdamW. AdamW divides each
update by sqrt(v), so gradients N times too large (summed over the ranks instead of averaged)
move the weights almost exactly as the right ones do: that comparison cannot see the bug. Here the
same engines train with plain SGD, whose update is lr x gradient, so a gradient scaled by N moves
every weight N times as far.

Each variant trains the tiny GPT from the same seed-0 weights through ``deepspeed.initialize`` with
the chapter's own config files (``03-deepspeed/configs/zero{0,1,2,3}_config.json``, read, checked
and sized by ``distkit.deepspeed`` as the scripts do) and ``torch.optim.SGD`` as the client optimizer (no
JIT-compiled op). Variants:

* ``zero0`` ... ``zero3``: correct, one micro-batch per step;
* ``accumulated``: ZeRO-2 with 2 micro-batches per step (``gradient_accumulation_steps`` 2), where
  ``engine.backward`` divides each micro-batch's loss by 2;
* ``summed_zero2`` / ``summed_zero3`` (bug): each rank's loss multiplied by the world size, which is
  what a reduction that sums instead of averaging leaves (the gradient of the global batch x N);
* ``unscaled_accumulation`` (bug): as ``accumulated`` but ``engine.backward(loss,
  scale_wrt_gas=False)``, so the two micro-batches' gradients add up to twice the batch gradient.

Rank 0 compares each result with a single-process SGD trainer written here, independently of the
chapter's code, and writes ``{variant: max |distributed - reference|, "moved": max |final - initial|}``
to ``--out`` (and prints it).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit import deepspeed as ds_setup
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss, rank_slice
from reference import train_one_process  # tests/workers/reference.py, beside this worker

CONFIG_DIR = Path(__file__).resolve().parents[2] / "03-deepspeed" / "configs"

STEPS, LR, BATCH = 3, 0.5, 8
VARIANTS = {  # name: (config, gradient accumulation steps, loss factor, scale_wrt_gas)
    "zero0": ("zero0", 1, 1, True),
    "zero1": ("zero1", 1, 1, True),
    "zero2": ("zero2", 1, 1, True),
    "zero3": ("zero3", 1, 1, True),
    "accumulated": ("zero2", 2, 1, True),
    "summed_zero2": ("zero2", 1, "world", True),
    "summed_zero3": ("zero3", 1, "world", True),
    "unscaled_accumulation": ("zero2", 2, 1, False),
}


def new_model() -> TinyGPT:
    torch.manual_seed(0)  # the reference and every variant start from these weights
    return TinyGPT(gpt_config("tiny", vocab_size=65, n_layer=2))


def reference() -> tuple[dict, dict]:
    """One process, plain SGD on the whole global batch each step: (initial, final) weights."""
    model = new_model()  # TinyGPT has no buffers: its state dict holds exactly its parameters
    return train_one_process(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, BATCH)


def train(deepspeed, ctx, variant: str) -> dict:
    """One engine, as the chapter's scripts build it; the full weights after STEPS steps."""
    config_name, accumulation, factor, scale_wrt_gas = VARIANTS[variant]
    config = ds_setup.load_ds_config(CONFIG_DIR / f"{config_name}_config.json", BATCH)
    config["gradient_accumulation_steps"] = accumulation
    config["zero_allow_untested_optimizer"] = True  # ZeRO refuses a non-Adam client optimizer without it
    model = new_model()
    ds_setup.resolve_auto(config, ctx.device, sum(p.numel() for p in model.parameters()), ctx.world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    loss_factor = ctx.world_size if factor == "world" else factor
    task = TokenTask(model.cfg, seed=0)
    for step in range(STEPS):
        inputs, targets = task.global_batch(step, BATCH)
        mine = zip(rank_slice(inputs, ctx.rank, ctx.world_size).chunk(accumulation),
                   rank_slice(targets, ctx.rank, ctx.world_size).chunk(accumulation))
        for x, y in mine:  # engine.step() only updates at the last micro-batch of a step
            loss = lm_loss(engine(x), y) * loss_factor
            engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
            engine.step()
    params = dict(engine.module.named_parameters())
    if ds_setup.zero_stage(engine.config) == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            weights = {k: p.detach().clone() for k, p in params.items()}
    else:
        weights = {k: p.detach().clone() for k, p in params.items()}
    ds_setup.release_engine(engine)
    return weights


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", required=True)
    add_runtime_args(parser)
    args = parser.parse_args()
    with distributed(args) as ctx:
        deepspeed = ds_setup.import_deepspeed(ctx.device)
        initial, final = reference()
        diffs = {"moved": max_diff(initial, final)}
        for variant in args.variants:
            diffs[variant] = max_diff(train(deepspeed, ctx, variant), final)
        dist.barrier()
        if ctx.is_main:
            Path(args.out).write_text(json.dumps(diffs, indent=1))
            print(json.dumps({k: f"{v:.1e}" for k, v in diffs.items()}), flush=True)


if __name__ == "__main__":
    run_main(main)
