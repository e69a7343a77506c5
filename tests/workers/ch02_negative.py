"""Worker: every negative control of chapter 02's equivalence tests, in one 4-rank launch (the world
size test_ch02_fsdp.py trains at): the FSDP cases of negative_controls.py (FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD with SGD; bf16 with AdamW) and those it does not cover: HSDP (2 x 2 mesh),
root wrapping + activation checkpointing + CPU offload, and the exactness of a DCP resume.

Everything is built with the chapter scripts' own functions (fsdp_transformer.py's ``mesh_shape``,
``build_mesh``, ``shard_model``; fsdp_checkpoint.py's ``save_dcp``, ``load_dcp``). Rank 0 compares
each result with the single-process reference trainer (tests/workers/reference.py) and writes
``{case: {variant: max |distributed - reference|, variant_relative: L2 error / L2 movement}}`` to
``--out``.

* hsdp / offload: SGD (lr 0.5, 3 steps, as negative_controls.py: a gradient twice too large moves a
  weight twice as far). Bugs: gradients summed over the ranks instead of averaged, rank 1's gradient
  shard dropped, and for HSDP the all-reduce across the replicas switched off
  (``set_requires_all_reduce(False)``, the knob for gradient accumulation under HSDP: FSDP2 then
  keeps the partial reduction for a later step and no gradient reaches the weights).
* resume: AdamW lr 3e-3 as test_ch02_fsdp.py: train 3 steps, save with ``save_dcp``, load into a
  fresh model and optimizer, train to step 6, compare with 6 uninterrupted steps. Bugs: only the
  weights restored (fresh Adam moments, as a checkpoint without the optimizer gives), and the Adam
  step count reset to 0 (the bias correction of step 1 applied again).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

# Beside this worker (a script's own folder is on sys.path): negative_controls.py's helpers (load,
# new_model, batches, the bugs, its chapter-02 cases) and the one reference trainer.
import negative_controls as nc
from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.models import TokenTask, lm_loss
from reference import train_one_process

ADAMW_LR, SAVE_AT, RESUME_TO = 3e-3, 3, 6


def reference(adamw: bool, steps: int) -> tuple[dict, dict]:
    """One process, the whole global batch each step: (initial, final) state dicts."""
    model = nc.new_model()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=ADAMW_LR) if adamw
                 else torch.optim.SGD(model.parameters(), lr=nc.LR))
    return train_one_process(model, optimizer, steps, nc.BATCH)


def sharded(ctx, strategy: str, flags: list[str], meshes: dict):
    """A seed-0 tiny GPT wrapped exactly as fsdp_transformer.py's train_one wraps it."""
    fsdp = nc.load("02-fsdp/fsdp_transformer.py")
    args = fsdp.parse_args(["--vocab-size", "65", *flags])
    model = nc.new_model()
    if args.activation_checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    mesh = fsdp.build_mesh(fsdp.mesh_shape(strategy, ctx, args.hsdp_shard_size), ctx, meshes)
    return fsdp.shard_model(model, strategy, mesh, args, ctx)


def strip_wrapper(state: dict) -> dict:
    """checkpoint_wrapper adds a prefix to the block parameter names; the reference has none."""
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in state.items()}


def case_sgd(ctx, variant, strategy, flags, meshes):
    model = sharded(ctx, strategy, flags, meshes)
    if variant == "replicas_not_reduced":
        model.set_requires_all_reduce(False)  # bug: no all-reduce across the HSDP replicas
    optimizer = torch.optim.SGD(model.parameters(), lr=nc.LR)
    for x, y in nc.batches(ctx, model):
        optimizer.zero_grad()
        lm_loss(model(x).float(), y).backward()
        if variant == "summed":
            nc.summed_not_averaged(model, ctx.world_size)
        if variant == "dropped_shard":
            nc.drop_rank1_shard(ctx, model)
        optimizer.step()
    return strip_wrapper(nc.full_state(model))


def train(ctx, model, optimizer, steps):
    task = TokenTask(model.cfg, seed=0)
    for step in steps:
        inputs, targets = task.global_batch(step, nc.BATCH)
        optimizer.zero_grad()
        lm_loss(model(nc.rank_slice(inputs, ctx.rank, ctx.world_size)),
                nc.rank_slice(targets, ctx.rank, ctx.world_size)).backward()
        optimizer.step()


def case_resume(ctx, variant, meshes, folder):
    """fsdp_checkpoint.py's save_dcp at step 3, then load_dcp (or a broken load) and train to 6."""
    ckpt = nc.load("02-fsdp/fsdp_checkpoint.py")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = sharded(ctx, "full_shard", [], meshes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    train(ctx, model, optimizer, range(SAVE_AT))
    ckpt.save_dcp(model, optimizer, folder, SAVE_AT, model.cfg, ctx)

    model = sharded(ctx, "full_shard", [], meshes)  # fresh weights and optimizer, as after a restart
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    if variant == "weights_only":  # bug: the optimizer state is not restored
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(model, state["model"])
    else:
        ckpt.load_dcp(model, optimizer, folder, model.cfg)
        if variant == "step_reset":  # bug: Adam's step count starts again at 0
            for param_state in optimizer.state.values():
                param_state["step"].zero_()
    train(ctx, model, optimizer, range(SAVE_AT, RESUME_TO))
    return nc.full_state(model)


NC_CASES = ["ch02_full_shard", "ch02_shard_grad_op", "ch02_no_shard", "ch02_bf16"]


def main():
    parser = ArgumentParser()
    parser.add_argument("--out", required=True)
    add_runtime_args(parser)
    args = parser.parse_args()
    with distributed(args) as ctx:
        meshes: dict = {}
        folder = [tempfile.mkdtemp(prefix="ch02_dcp_") if ctx.is_main else None]
        dist.broadcast_object_list(folder, src=0)
        # name -> (run(variant), variants, reference (initial, final))
        cases = {name: (lambda v, fn=nc.CASES[name][0]: fn(ctx, v), nc.CASES[name][1],
                        lambda name=name: nc.reference(adamw=nc.CASES[name][2].get("adamw", False)))
                 for name in NC_CASES}
        cases.update({
            "ch02_hsdp": (lambda v: case_sgd(ctx, v, "hybrid_shard", [], meshes),
                          ["correct", "summed", "dropped_shard", "replicas_not_reduced"],
                          lambda: reference(False, nc.STEPS)),
            "ch02_offload": (lambda v: case_sgd(ctx, v, "full_shard",
                                                ["--wrap", "root", "--activation-checkpointing", "--cpu-offload"],
                                                meshes),
                             ["correct", "summed", "dropped_shard"], lambda: reference(False, nc.STEPS)),
            "ch02_resume": (lambda v: case_resume(ctx, v, meshes, folder[0] + f"/{v}"),
                            ["correct", "weights_only", "step_reset"], lambda: reference(True, RESUME_TO)),
        })
        results = {}
        for name, (run, variants, make_reference) in cases.items():
            initial, expected = make_reference()
            results[name] = {"moved": nc.max_diff(initial, expected)}
            for variant in variants:
                state = run(variant)
                if ctx.is_main:
                    results[name][variant] = nc.max_diff(state, expected)
                    results[name][f"{variant}_relative"] = nc.relative_error(state, expected, initial)
            if ctx.is_main:
                print(f"{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in results[name].items()), flush=True)
        if ctx.is_main:
            shutil.rmtree(folder[0], ignore_errors=True)
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_main(main)
