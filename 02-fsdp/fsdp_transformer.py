"""Chapter 02: train the transformer with FSDP2 (`fully_shard`) under each sharding strategy.

One launch trains one configuration per `--sharding` value (same model, same data, same seed) and
appends one harness record for each, so the strategies can be compared side by side:

    full_shard     FSDP1 FULL_SHARD    1D mesh, reshard_after_forward=True  (gather in fwd AND bwd)
    shard_grad_op  FSDP1 SHARD_GRAD_OP 1D mesh, reshard_after_forward=False (gather once, keep for bwd)
    no_shard       FSDP1 NO_SHARD      2D mesh (world x 1): nothing sharded, gradients all-reduced
    hybrid_shard   FSDP1 HYBRID_SHARD  2D mesh (replicas x shard group): shard inside, all-reduce across
    ddp            the chapter-01 baseline (DistributedDataParallel) for comparison

The other knobs of a real FSDP job are flags: per-block or root-only wrapping, bf16 mixed precision
(`MixedPrecisionPolicy`), activation checkpointing and `CPUOffloadPolicy`.

    torchrun --nproc_per_node=4 02-fsdp/fsdp_transformer.py \\
        --sharding full_shard shard_grad_op no_shard hybrid_shard ddp
    torchrun --nproc_per_node=4 02-fsdp/fsdp_transformer.py --mixed-precision bf16 --activation-checkpointing
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save
from distkit.flags import (
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    check_global_batch,
    make_optimizer,
    positive_int,
    save_path,
    saved_at,
    saves_after,
)
from distkit.harness import Harness, fresh_memory_peak
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.predictors import fsdp_padded_numel, fsdp_prediction
from distkit.text import generate, make_task
from distkit.theory import param_shapes

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "ddp"]
SAMPLE_PROMPT, SAMPLE_BYTES = "The ", 120  # --data text: the sample printed after training
RECORD_NAME = {"full_shard": "fsdp_full_shard", "shard_grad_op": "fsdp_shard_grad_op",
               "no_shard": "fsdp_no_shard", "hybrid_shard": "fsdp_hybrid_shard", "ddp": "ddp"}


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Train the small GPT with FSDP2 fully_shard under one or more sharding strategies "
                    "(one harness record each). Launch with torchrun; runs on CPU (gloo) or GPUs (NCCL).",
        epilog="example: torchrun --nproc_per_node=4 02-fsdp/fsdp_transformer.py "
               "--sharding full_shard hybrid_shard --steps 50")
    parser.add_argument("--sharding", nargs="+", choices=STRATEGIES, default=["full_shard"],
                        help="strategies to train one after another (default: full_shard)")
    parser.add_argument("--hsdp-shard-size", type=positive_int, default=2,
                        help="hybrid_shard: ranks per shard group; replicas = world / this (default: 2)")
    parser.add_argument("--wrap", choices=["block", "root"], default="block",
                        help="block: each transformer block is its own FSDP unit, then the root; "
                             "root: one unit for the whole model (default: block)")
    parser.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: compute in bf16 params, reduce gradients in fp32 (default: fp32)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward instead of storing them")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep sharded params, grads and optimizer state in CPU memory (CPUOffloadPolicy)")
    add_training_args(parser, steps=200, global_batch_size=32, lr=3e-3, warmup_steps=2,
                      results="runs/fsdp_transformer.jsonl",
                      helps={"steps": "optimizer steps per strategy", "lr": "learning rate"})
    add_optimizer_arg(parser)
    parser.add_argument("--log-every", type=positive_int, default=50,
                        help="log the loss every N steps (default: 50)")
    add_checkpoint_args(parser, save="none", save_every=True)
    add_model_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    model_config_from_args(args)  # a width that does not split into the heads: one error line
    # Filled in for two made-up strategies before any training: an unknown {placeholder} is one
    # error line, and a path without {strategy} would be overwritten by each strategy in turn.
    one, other = save_file(args, "one"), save_file(args, "other")
    if one is not None and one == other and len(set(args.sharding)) > 1:
        parser.error(f"--save {args.save} names one file for {len(set(args.sharding))} strategies; "
                     "put {strategy} in it (e.g. checkpoints/fsdp_{strategy}.pt)")
    return args


def save_file(args, strategy):
    """The file --save names for ``strategy`` (its {strategy} placeholder filled), or None."""
    return save_path(args.save, strategy=strategy)


def mesh_shape(strategy, ctx, hsdp_shard_size):
    """The shape of the device mesh FSDP2 shards over. 2D meshes are (replicate, shard): HSDP and
    NO_SHARD."""
    if strategy == "hybrid_shard":
        if ctx.world_size % hsdp_shard_size:
            raise UsageError(f"--hsdp-shard-size {hsdp_shard_size} does not divide the world size "
                             f"{ctx.world_size}")
        return (ctx.world_size // hsdp_shard_size, hsdp_shard_size)
    if strategy == "no_shard":  # shard groups of one rank: every rank keeps everything (DDP-like)
        return (ctx.world_size, 1)
    return (ctx.world_size,)


def build_mesh(shape, ctx, meshes):
    """The mesh of ``shape`` on this job's device type, built once per launch.

    Always on ``ctx.device.type`` (never fully_shard's default mesh, which takes the host's
    accelerator whatever --device says). Kept in ``meshes`` because every 2D mesh creates process
    groups (NCCL communicators with their own GPU buffers), and strategies run one after another
    would otherwise create a fresh set each.
    """
    if shape not in meshes:
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        meshes[shape] = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    return meshes[shape]


def shard_model(model, strategy, mesh, args, ctx):
    """Apply fully_shard bottom-up: each block (its own all-gather/reduce-scatter unit), then the root."""
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if args.mixed_precision == "bf16" else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if args.cpu_offload else OffloadPolicy()
    # FULL_SHARD frees a block's gathered weights after its forward and gathers them again in backward;
    # SHARD_GRAD_OP keeps them until backward has used them (more memory, one all-gather fewer).
    reshard = strategy in ("full_shard", "hybrid_shard")
    if args.wrap == "block":
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                        offload_policy=offload)
    # The root unit (embeddings, final norm, LM head) is needed first in backward: never reshard it.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)
    return model


def predicted_bytes(cfg, strategy, args, world_size):
    """What the textbook formulas predict per rank (distkit.predictors, FSDP2's dim-0 padding included).

    P = parameter bytes (fp32), s = shard-group size, r = replicas. Sharded state is P/s each for
    params and grads, and 2P/s for AdamW's two moments (none for plain SGD). Communication payloads
    per step: all-gather = P (x2 for units resharded after forward: gathered in forward and again in
    backward), reduce-scatter = P, all-reduce across replicas = P/s; DDP all-reduces P.
    NO_SHARD is a shard group of one on a (world x 1) mesh, DDP the same state with no mesh.
    """
    if strategy == "hybrid_shard":
        shards, replicas = args.hsdp_shard_size, world_size // args.hsdp_shard_size
    elif strategy in ("ddp", "no_shard"):
        shards, replicas = 1, world_size
    else:
        shards, replicas = world_size, 1
    shapes = param_shapes(cfg)
    states, comm = fsdp_prediction(shapes, shards, replicas, strategy in ("full_shard", "hybrid_shard"),
                                   gather_bytes=2 if args.mixed_precision == "bf16" else 4, wrap=args.wrap,
                                   optimizer=args.optimizer)
    comm_bytes = {name: int(stat["bytes"]) for name, stat in comm.items()}
    if strategy in ("ddp", "no_shard", "hybrid_shard") and "all_reduce" not in comm_bytes:
        # theory counts no all-reduce over one replica, but DDP all-reduces even alone and FSDP2
        # all-reduces over a 2D mesh's replicate dim whatever its size (payload P/s, 0 bytes on the wire)
        comm_bytes["all_reduce"] = sum(fsdp_padded_numel(s, shards) for s in shapes.values()) // shards * 4
    return {**states[0], "comm_bytes": comm_bytes, "shard_group_size": shards, "replicas": replicas}


def save_full_weights(model, path, ctx):
    """Gather every shard into full tensors (collective: all ranks call it; a CPU-offloaded shard is
    first copied to the mesh's device, so NCCL sees GPU tensors), moved to CPU memory on rank 0 only:
    the file then loads anywhere, and no GPU holds the whole model."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        atomic_save(full, path)


def train_one(strategy, args, ctx, task, cfg, log, meshes):
    """Build, wrap and train one configuration; returns the harness record (rank 0) or None."""
    # Each configuration's peak, not the previous one's: the caller dropped the previous model and
    # optimizer, but FSDP's hooks keep them in reference cycles until the garbage collector runs.
    # Collect, hand cached GPU blocks back, then reset the peak (GPU: max_memory_allocated; CPU:
    # peak RSS), before this configuration allocates anything.
    fresh_memory_peak(ctx.device)
    torch.manual_seed(args.seed)  # identical initial weights in every configuration and on every rank
    model = build_model(cfg).to(ctx.device)
    if args.activation_checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    predicted = predicted_bytes(cfg, strategy, args, ctx.world_size)
    if strategy == "ddp":
        if args.mixed_precision != "fp32" or args.cpu_offload:
            raise UsageError("--mixed-precision bf16 and --cpu-offload are FSDP options; drop them for ddp")
        model = DDP(model, device_ids=ctx.device_ids)
    else:
        mesh = build_mesh(mesh_shape(strategy, ctx, args.hsdp_shard_size), ctx, meshes)
        shard_model(model, strategy, mesh, args, ctx)
    # Created after sharding, the optimizer sees the DTensor shards: its state is sharded too.
    # torch.optim.AdamW (or plain SGD), its foreach kernels chosen for any device (distkit.flags)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    # The model's configuration and parameter count go into the record's own fields (the harness
    # reads them from the model's cfg), not into config.
    config = {"global_batch_size": args.global_batch_size,
              "precision": args.mixed_precision, "optimizer": args.optimizer, "lr": args.lr, "wrap": args.wrap,
              "activation_checkpointing": args.activation_checkpointing,
              "cpu_offload": args.cpu_offload, "sharding": strategy,
              "hsdp_shard_size": args.hsdp_shard_size if strategy == "hybrid_shard" else None}
    harness = Harness(ctx, RECORD_NAME[strategy], model=model, optimizer=optimizer,
                      warmup_steps=args.warmup_steps, config=config)
    tokens_per_step = args.global_batch_size * cfg.seq_len
    losses = []
    for step in progress(range(args.steps), ctx.rank, total=args.steps, desc=strategy):
        inputs, targets = task.global_batch(step, args.global_batch_size)
        inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)
        targets = rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
        with harness.step(samples=args.global_batch_size, tokens=tokens_per_step):
            optimizer.zero_grad(set_to_none=True)
            # logits are bf16 under mixed precision: take the loss in fp32 (a no-op in fp32 runs)
            loss = lm_loss(model(inputs).float(), targets)
            loss.backward()  # FSDP: all-gather (if resharded) -> grads -> reduce-scatter, unit by unit
            optimizer.step()  # each rank updates only its own shard
        if step % args.log_every == 0 or step == args.steps - 1:
            global_loss = loss.detach().float().clone()
            dist.all_reduce(global_loss)  # outside harness.step: not part of the counted traffic
            losses.append((step, global_loss.item() / ctx.world_size))
            log.info(f"{strategy:>13} | step {step:4d} | loss {losses[-1][1]:.4f}")
        if saves_after(args, step) and save_file(args, strategy):
            save_full_weights(model, saved_at(save_file(args, strategy), step + 1), ctx)

    if save_file(args, strategy):
        save_full_weights(model, save_file(args, strategy), ctx)
    record = harness.finish(args.results, extra={"predicted": predicted, "losses": losses})
    if args.data == "text":
        # What the model learned, as text: every rank runs the sharded forward (its all-gathers are
        # collective), rank 0 prints the greedy continuation of a prompt.
        model.eval()
        sample = generate(model, SAMPLE_PROMPT, SAMPLE_BYTES, cfg.seq_len, ctx.device)
        log.info(f"{strategy:>13} | sample after {args.steps} steps: {sample!r}")
    return record


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        check_global_batch(args.global_batch_size, ctx.world_size)
        cfg = model_config_from_args(args)
        task = make_task(cfg, args)
        model_name = f"{args.model_size} {'Llama' if cfg.arch == 'llama' else 'GPT'}"
        log.info(f"world size {ctx.world_size} | backend {ctx.backend} | {model_name} | "
                 f"global batch {args.global_batch_size} | {args.mixed_precision}")
        meshes = {}
        for strategy in args.sharding:
            # train_one's model, optimizer and harness are gone once it returns (only the record,
            # plain numbers, comes back); the next call collects them before measuring anew.
            record = train_one(strategy, args, ctx, task, cfg, log, meshes)
            if ctx.is_main:
                m, pred = record["metrics"], record["predicted"]
                state = m["model_state_bytes_per_rank"][0]
                comm = {k: v["bytes"] for k, v in m["comm_per_step"].items()}
                log.info(f"{strategy:>13} | rank-0 state: params {state['params']:,} B grads "
                         f"{state['grads']:,} B optimizer {state['optimizer']:,} B "
                         f"(predicted {pred['params']:,} / {pred['grads']:,} / {pred['optimizer']:,})")
                speed = (f"median step {m['step_time_s_median'] * 1e3:.1f} ms" if m["timed_steps"]
                         else "no timed steps")
                log.info(f"{strategy:>13} | bytes/step {comm} (predicted {pred['comm_bytes']}) | {speed}")
        if ctx.is_main:
            log.info(f"records appended to {args.results}")


if __name__ == "__main__":
    run_main(main)
