"""Worker: train with fsdp_lora.py's own functions (``build_sharded``, ``rank_batch``,
``train_step``) for a few steps on every rank of the launch, once per variant, and write what the
tests check to ``--out`` (rank 0, ``torch.save``):

``{variant: {"state": full final state dict (base + adapters, CPU), "grads": per rank, per step 0
and 1, {adapter name: (non-zero elements of this rank's gradient shard, its elements)}, "base_grads":
per rank, the frozen parameters that got a gradient}}``.

Variants: ``correct`` (the script as it is) and the mutants of tests/test_ch02_lora.py (the script's
source with one piece replaced, tests/workers/mutation.py), run in this one process group.

    torchrun --nproc_per_node=4 tests/workers/ch02_lora.py --out FILE --variants correct same_batch
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.models import TokenTask, model_config_from_args
from mutation import mutated_source  # beside this worker

SCRIPT = Path(__file__).resolve().parents[2] / "02-fsdp" / "fsdp_lora.py"
# name -> (exact piece of fsdp_lora.py, its replacement). Each is a bug the equivalence test must catch.
MUTANTS = {
    # the base is trained too: it is unfrozen, so build_sharded puts it in the optimizer
    "base_trained": ("return get_peft_model(base, lora)", "return get_peft_model(base, lora).requires_grad_(True)"),
    # every rank trains on rank 0's share of the batch: the job sees a quarter (half) of the global batch
    "same_batch": ("rank_slice(t, ctx.rank, ctx.world_size)", "rank_slice(t, 0, ctx.world_size)"),
}


def script_module(variant: str) -> types.ModuleType:
    """fsdp_lora.py (or its mutant ``variant``) imported as a module, without running main."""
    source = SCRIPT.read_text() if variant == "correct" else mutated_source(SCRIPT, *MUTANTS[variant])
    module = types.ModuleType(f"fsdp_lora_{variant}")
    module.__file__ = str(SCRIPT)
    sys.modules[module.__name__] = module
    exec(compile(source, str(SCRIPT), "exec"), module.__dict__)
    return module


def grad_census(model) -> dict:
    """Per adapter parameter: (non-zero elements, elements) of this rank's local gradient shard."""
    census = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            grad = p.grad.to_local() if p.grad is not None else None
            census[name] = (int(grad.count_nonzero()), grad.numel()) if grad is not None else (0, -1)
    return census


def run_variant(variant: str, script_argv: list[str], steps: int, ctx) -> dict | None:
    script = script_module(variant)
    args = script.parse_args(script_argv)
    cfg = model_config_from_args(args)
    model, optimizer = script.build_sharded(cfg, args, ctx)
    task = TokenTask(cfg, seed=args.seed)
    grads = []
    for step in range(steps):
        inputs, targets = script.rank_batch(task, step, args, ctx)
        script.train_step(model, optimizer, inputs, targets)
        if step < 2:  # the gradients of this step are still on the parameters after optimizer.step
            grads.append(grad_census(model))
    base_grads = [name for name, p in model.named_parameters() if "lora_" not in name and p.grad is not None]
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    per_rank = [None] * ctx.world_size
    dist.all_gather_object(per_rank, {"grads": grads, "base_grads": base_grads})
    if not ctx.is_main:
        return None
    return {"state": state, "grads": [r["grads"] for r in per_rank],
            "base_grads": [r["base_grads"] for r in per_rank]}


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", nargs="+", default=["correct"], choices=["correct", *MUTANTS])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--script-args", default="--global-batch-size 8",
                        help="flags for fsdp_lora.py's parse_args (one string)")
    add_runtime_args(parser)
    args = parser.parse_args()
    with distributed(args) as ctx:
        results = {v: run_variant(v, args.script_args.split(), args.steps, ctx) for v in args.variants}
        if ctx.is_main:
            torch.save(results, args.out)


if __name__ == "__main__":
    run_main(main)
