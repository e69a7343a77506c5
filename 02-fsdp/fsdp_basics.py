"""Chapter 02: what FSDP does to a model, made visible.

DDP (chapter 01) keeps a full copy of every parameter, gradient and optimizer state on every rank.
FSDP keeps only a 1/world_size *shard* of each on each rank, and rebuilds a layer's full weights
just in time:

    forward of block i:   all-gather block i's shards -> compute -> free the gathered copy (reshard)
    backward of block i:  all-gather again -> compute grads -> reduce-scatter them -> keep my shard
    optimizer step:       each rank updates only its own shard (Adam state is sharded too)

This script shards the transformer (the small GPT, or with ``--arch llama`` the Hugging Face Llama)
with FSDP2 ``fully_shard``, has every rank print the shard it holds of a few parameters next to their
full shapes, traces one training step (which collective runs when), then trains and appends a
harness record (``--save PATH``: the trained full weights too).

    torchrun --nproc_per_node=4 02-fsdp/fsdp_basics.py
    python 02-fsdp/fsdp_basics.py        # a world of one: the "shards" are the whole tensors
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distkit import ArgumentParser, add_runtime_args, distributed, fsdp_view, run_main
from distkit.checkpoint import atomic_save
from distkit.flags import (
    add_checkpoint_args,
    add_training_args,
    check_global_batch,
    make_optimizer,
    positive_int,
    save_path,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Shard the transformer (--arch gpt or llama) with FSDP2 fully_shard, show each "
                    "rank's shards, trace one step's all-gathers and reduce-scatters, then train.",
        epilog="example: torchrun --nproc_per_node=4 02-fsdp/fsdp_basics.py --steps 200")
    add_training_args(parser, steps=200, global_batch_size=32, lr=3e-3, warmup_steps=2,
                      results="runs/fsdp_basics.jsonl", helps={"lr": "AdamW learning rate"})
    parser.add_argument("--log-every", type=positive_int, default=50,
                        help="log the loss every N steps (default: 50)")
    add_checkpoint_args(parser, save="none")
    add_model_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    model_config_from_args(args)  # a width that does not split into the heads: one error line
    return args


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        shard_trace_and_train(args, ctx)


def shard_trace_and_train(args, ctx):
    """Shard the model, show the shards, trace one step, train, write the record."""
    log = setup_logging(ctx.rank)
    check_global_batch(args.global_batch_size, ctx.world_size)
    cfg = model_config_from_args(args)
    path = save_path(args.save)
    model = build_model(cfg).to(ctx.device)  # same seed on every rank: same full weights to cut from

    # The ranks FSDP shards over, on the device this job computes on. Passed explicitly: without
    # a mesh, fully_shard builds one for the host's accelerator (CUDA on any GPU machine), which
    # would move a `--device cpu` job's parameters to a GPU, or send rank 5 of 8 CPU ranks on a
    # 4-GPU host to a GPU that does not exist.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    # Bottom-up: each block becomes one FSDP unit (one all-gather, one reduce-scatter); the root
    # call takes what is left (embeddings, final norm, LM head). Parameters become DTensors
    # sharded on dim 0, and each rank frees the rows it does not own.
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp_view.print_shards(model, ctx)  # each rank's shard of four parameters, in rank order

    optimizer = make_optimizer("adamw", model.parameters(), args.lr)
    task = make_task(cfg, args)

    def batch(step):
        inputs, targets = task.global_batch(step, args.global_batch_size)
        return (rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device),
                rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device))

    # step 0, traced: which collective runs when, and what block 0's weight is at each moment
    events, first_loss = fsdp_view.trace_one_step(model, optimizer, *batch(0), ctx)
    log.info(f"one training step, as rank 0 sees it ({len(model.blocks)} blocks + root = "
             f"{len(model.blocks) + 1} FSDP units):\n" + "\n".join(events))
    log.info(f"step    0 | loss {first_loss:.4f}")

    harness = Harness(ctx, "fsdp_full_shard", model=model, optimizer=optimizer,
                      warmup_steps=args.warmup_steps,
                      config={"global_batch_size": args.global_batch_size,
                              "precision": "fp32", "lr": args.lr, "wrap": "block"})
    tokens_per_step = args.global_batch_size * cfg.seq_len
    for step in progress(range(1, args.steps), ctx.rank, total=args.steps - 1, desc="train"):
        inputs, targets = batch(step)
        with harness.step(samples=args.global_batch_size, tokens=tokens_per_step):
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            dist.all_reduce(loss := loss.detach().clone())
            log.info(f"step {step:4d} | loss {loss.item() / ctx.world_size:.4f}")
    record = harness.finish(args.results)
    if path:
        # Collective: every shard is all-gathered; rank 0 alone keeps the full tensors, in CPU memory.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if ctx.is_main:
            atomic_save(full, path)
    if ctx.is_main:
        m = record["metrics"]
        comm = ", ".join(f"{k} {v['calls']:.0f} calls {v['bytes']:,.0f} B"
                         for k, v in m["comm_per_step"].items())
        if not comm:  # one rank has no peers; otherwise no step was counted (too few --steps)
            comm = "no collectives (one rank)" if ctx.world_size == 1 else "no step counted (raise --steps)"
        speed = (f"median step {m['step_time_s_median'] * 1e3:.0f} ms | {m['tokens_per_s']:,.0f} tokens/s"
                 if m["timed_steps"] else "no timed steps (raise --steps)")
        log.info(f"per step: {comm} | {speed} | record appended to {args.results}")
        if path:
            log.info(f"trained full weights saved to {path}")


if __name__ == "__main__":
    run_main(main)
