"""Chapter 05: hybrid parallelism on a 2-D ``DeviceMesh`` -- FSDP2 x TP, and HSDP.

Large jobs combine strategies along mesh axes, each axis matched to the links it crosses:

    --mode 2d   mesh (dp, tp), e.g. 2 x 2 on 4 ranks       --mode hsdp   mesh (replicate, shard)

               tp=0   tp=1                                             shard=0  shard=1
      dp=0   [ r0  ,  r1 ]  <- TP pair: same data,             rep=0  [ r0   ,   r1  ]  <- FSDP group:
      dp=1   [ r2  ,  r3 ]     one layer split in two          rep=1  [ r2   ,   r3  ]     params sharded
               ^ FSDP groups: different data,                            ^ replicas: gradients
                 parameters sharded across dp                              all-reduced across rep

* **2d** (``fsdp_tp_2d``): tensor parallelism inside each row (chatty: activations every layer,
  so on GPUs it stays inside one NVLink node) and FSDP2 across rows (parameters and gradients only,
  once per layer per step, so it can cross slower links). Each rank holds 1/(dp*tp) of the weights.
* **hsdp** (``hsdp``): plain data parallelism, but FSDP shards only within a row and the rows are
  replicas that all-reduce gradients: ZeRO-3 memory savings inside a node, DDP-like traffic between.

Both train the small GPT or, with ``--arch llama``, Hugging Face's Llama (its TP plan by its own
module names in ``distkit/tp_plans.py``; FSDP2 wraps each ``model.layers.N``, then the root).

    torchrun --nproc_per_node=4 05-advanced/hybrid_parallelism.py --mode 2d --dp 2 --tp 2
    torchrun --nproc_per_node=4 05-advanced/hybrid_parallelism.py --mode hsdp --replicate 2 --shard 2
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import save_full_model
from distkit.flags import (
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    make_optimizer,
    positive_int,
    save_path,
    saved_at,
    saves_after,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task
from distkit.tp_plans import tp_plan


def parse_args():
    parser = ArgumentParser(
        description="Train the small GPT or the Llama on a 2-D device mesh: FSDP2 x tensor parallel (--mode 2d) "
                    "or hybrid-sharded data parallel (--mode hsdp). The mesh axes must multiply to "
                    "the number of ranks.",
        epilog="example: torchrun --nproc_per_node=4 05-advanced/hybrid_parallelism.py --mode 2d --dp 2 --tp 2")
    add_model_args(parser)
    parser.add_argument("--mode", choices=["2d", "hsdp"], default="2d",
                        help="2d = FSDP2 across --dp, TP across --tp; hsdp = FSDP2 within --shard, "
                             "replicas across --replicate (default: 2d)")
    parser.add_argument("--dp", type=positive_int, default=None,
                        help="2d: data-parallel (FSDP) size (default: ranks / tp)")
    parser.add_argument("--tp", type=positive_int, default=2, help="2d: tensor-parallel size (default: 2)")
    parser.add_argument("--replicate", type=positive_int, default=None,
                        help="hsdp: number of replicas (default: ranks / shard)")
    parser.add_argument("--shard", type=positive_int, default=2, help="hsdp: ranks that shard one replica (default: 2)")
    training = add_training_args(parser, helps={
        "global_batch_size": "sequences per optimizer step over all data-parallel ranks"})
    add_optimizer_arg(training)
    add_checkpoint_args(parser, save="checkpoints/hybrid_{mode}.pt", save_every=True)
    add_runtime_args(parser)
    return parser.parse_args()


def mesh_shape(args, world_size: int) -> tuple[tuple[int, int], tuple[str, str]]:
    """The mesh's sizes and axis names; their product must be the world size."""
    if args.mode == "2d":
        names, inner, outer = ("dp", "tp"), args.tp, args.dp
    else:
        names, inner, outer = ("replicate", "shard"), args.shard, args.replicate
    if outer is None:  # derive the outer axis when the inner one divides the world
        outer = world_size // inner if inner >= 1 and world_size % inner == 0 else 0
    if inner < 1 or outer < 1 or inner * outer != world_size:
        raise UsageError(f"mesh {names[0]} x {names[1]} = {outer} x {inner} = {outer * inner} ranks, "
                         f"but the job has {world_size}: the mesh axes must multiply to the world size")
    return (outer, inner), names


def tensor_parallel_blocks(model, tp_mesh) -> None:
    """Megatron TP of every block over the ``tp`` axis: tensor_parallel.py's plan without sequence
    parallelism (that script explains it). Column-parallel q/k/v and the MLP's input projections,
    row-parallel attention output and MLP output, one replicated input per attention and per MLP."""
    # The plan, module name -> ColwiseParallel() / RowwiseParallel(), is written once per
    # architecture in distkit/tp_plans.py (gpt_tp_plan; llama_tp_plan by Hugging Face's names).
    block_plan, _ = tp_plan(model.cfg.arch, sequence_parallel=False)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        cfg = model_config_from_args(args)
        shape, names = mesh_shape(args, ctx.world_size)
        mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
        strategy = "fsdp_tp_2d" if args.mode == "2d" else "hsdp"

        model = build_model(cfg).to(ctx.device)  # the same dense initial weights on every rank
        param_count = sum(p.numel() for p in model.parameters())  # before sharding: the whole model's
        if args.mode == "2d":
            splits = ({"--n-head": cfg.n_head, "--n-kv-head (the key/value heads)": cfg.n_kv_head,
                       "the MLP width (intermediate_size)": cfg.intermediate_size} if cfg.arch == "llama"
                      else {"--n-head": cfg.n_head, "the MLP width": cfg.mlp_ratio * cfg.n_embd})
            for name, value in splits.items():
                if value % args.tp:  # the heads and hidden units split evenly over the TP ranks
                    raise UsageError(f"{name} = {value} is not divisible by --tp {args.tp}")
            tensor_parallel_blocks(model, mesh["tp"])  # inner axis first
            shard_mesh, dp_size, dp_rank = mesh["dp"], shape[0], mesh.get_local_rank("dp")
        else:
            shard_mesh, dp_size, dp_rank = mesh, ctx.world_size, ctx.rank  # a 2-D mesh = HSDP
        # FSDP2 per block, then the root (embeddings, norm, head): each block's parameters are
        # all-gathered just before it runs and its gradients reduce-scattered just after.
        for block in model.blocks:
            fully_shard(block, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
        if args.global_batch_size % dp_size:
            raise UsageError(f"--global-batch-size {args.global_batch_size} does not split over "
                             f"{dp_size} data-parallel ranks")

        coords = {name: mesh.get_local_rank(name) for name in names}
        log.info(f"{strategy}: mesh {names[0]} x {names[1]} = {shape[0]} x {shape[1]}\n{mesh.mesh}")
        shown = "model.layers.0.mlp.up_proj.weight" if cfg.arch == "llama" else "blocks.0.mlp.fc_in.weight"
        weight = model.get_parameter(shown)
        log.info(f"rank 0 at {coords}: {shown} full {tuple(weight.shape)} "
                 f"placements {weight.placements} -> local {tuple(weight.to_local().shape)}")

        harness = Harness(ctx, strategy, model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                          param_count=param_count,  # the model field comes from model.cfg
                          config={"global_batch_size": args.global_batch_size,
                                  "precision": "fp32", "mesh": dict(zip(names, shape)), "lr": args.lr,
                                  "optimizer": args.optimizer})
        task = make_task(cfg, args)
        losses = []
        for step in progress(range(args.steps), ctx.rank, desc=strategy):
            inputs, targets = task.global_batch(step, args.global_batch_size)
            # Data parallel along the FSDP axis: TP partners (same dp index) read the same slice.
            inputs = rank_slice(inputs, dp_rank, dp_size).to(ctx.device)
            targets = rank_slice(targets, dp_rank, dp_size).to(ctx.device)
            with harness.step(samples=args.global_batch_size, tokens=args.global_batch_size * cfg.seq_len):
                optimizer.zero_grad(set_to_none=True)
                loss = lm_loss(model(inputs), targets)
                loss.backward()  # TP collectives + FSDP reduce-scatter (+ HSDP all-reduce across replicas)
                optimizer.step()
            global_loss = loss.detach().clone()  # mean over the data-parallel ranks, for the log
            torch.distributed.all_reduce(global_loss, group=mesh["dp"].get_group() if args.mode == "2d" else None)
            losses.append(global_loss.item() / dp_size)
            if saves_after(args, step):
                save_full_model(model, saved_at(save_path(args.save, mode=args.mode, strategy=strategy), step + 1),
                             cfg, strategy, ctx)

        record = harness.finish(args.results, extra={"losses": losses})
        path = save_path(args.save, mode=args.mode, strategy=strategy)
        save_full_model(model, path, cfg, strategy, ctx)
        if ctx.is_main:
            log.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps")
            log.info("collectives per step on rank 0 (harness):")
            for name, stat in record["metrics"]["comm_per_step"].items():
                log.info(f"  {name:<15} {stat['calls']:>4.0f} calls {stat['bytes'] / 2**20:8.2f} MiB payload "
                         f"{stat['bus_bytes'] / 2**20:8.2f} MiB on the wire")
            held = [s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]]
            log.info(f"parameter bytes held per rank: {held} (dense model: {param_count * 4})")
            log.info(f"saved {path or 'nothing (--save none)'} | record appended to {args.results}")


if __name__ == "__main__":
    run_main(main)
