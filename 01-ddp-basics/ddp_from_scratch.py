"""Chapter 01: data parallelism by hand -- what DistributedDataParallel does for you.

Two collectives are the whole idea:

1. at the start, ``broadcast`` every parameter from rank 0, so all replicas start identical;
2. after every backward, ``all_reduce`` every gradient (a sum over ranks) and divide by the world
   size, so every rank holds the gradient of the *global* batch and takes the same optimizer step.

This version does step 2 naively: one all-reduce per parameter tensor, after backward has finished.
DDP does the same arithmetic, but packs gradients into ~25 MiB buckets (a few big all-reduces
instead of one per tensor) and launches each bucket's all-reduce while backward is still computing
the remaining gradients. The README compares both with the harness's measured numbers.

    torchrun --standalone --nproc_per_node=4 01-ddp-basics/ddp_from_scratch.py
    torchrun --standalone --nproc_per_node=4 01-ddp-basics/ddp_from_scratch.py --bucket-cap-mb 25
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save
from distkit.flags import (
    add_bucket_arg,
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    make_optimizer,
    non_negative_float,
    non_negative_int,
    positive_int,
    save_path,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task


def parse_args():
    parser = ArgumentParser(
        description="Data-parallel training without DDP: broadcast the initial weights, then "
                    "all-reduce and average every gradient by hand. Launch with torchrun.",
        epilog="example: torchrun --standalone --nproc_per_node=4 01-ddp-basics/ddp_from_scratch.py")
    add_model_args(parser)
    train = add_training_args(parser, steps=200, global_batch_size=32, lr=3e-3, helps={
        "global_batch_size": "sequences per step over all ranks; each rank takes 1/world size",
        "lr": "peak learning rate"})
    add_optimizer_arg(train)
    train.add_argument("--lr-warmup-steps", type=non_negative_int, default=10,
                       help="linear LR warm-up, then cosine decay to 10%% (default: 10)")
    train.add_argument("--weight-decay", type=non_negative_float, default=0.01,
                       help="AdamW weight decay (default: 0.01)")
    train.add_argument("--grad-clip", type=non_negative_float, default=1.0,
                       help="clip the gradient norm (0 = off; default: 1.0)")
    train.add_argument("--log-every", type=positive_int, default=20, help="log the loss every N steps (default: 20)")
    add_bucket_arg(parser, 0.0, help_extra=": 0 = one all-reduce per parameter tensor; >0 = flatten gradients "
                   "into buckets of this size first, as DDP does (but still after backward)")
    add_checkpoint_args(parser, save="checkpoints/ddp_from_scratch.pt")
    add_runtime_args(parser)
    return parser.parse_args()


def broadcast_parameters(model: torch.nn.Module) -> None:
    """Make every replica a copy of rank 0's (the seeds match anyway; this makes it a guarantee)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def average_gradients(model: torch.nn.Module, world_size: int, bucket_bytes: int) -> None:
    """Sum every gradient over the ranks and divide by the world size."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if bucket_bytes <= 0:
        for grad in grads:  # one collective per tensor: each pays the full per-call latency
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            grad.div_(world_size)
        return
    bucket, size = [], 0
    for i, grad in enumerate(grads):
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes or i == len(grads) - 1:
            flat = _flatten_dense_tensors(bucket)  # one contiguous buffer -> one all-reduce
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(world_size)
            for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(averaged)
            bucket, size = [], 0


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak (the same schedule as ddp_training.py)."""
    if step < warmup:
        return (step + 1) / warmup
    progress_ = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_)))


def main():
    args = parse_args()
    wall_start = time.perf_counter()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        gpt = model_config_from_args(args)
        if args.global_batch_size % ctx.world_size:
            raise UsageError(f"--global-batch-size {args.global_batch_size} must divide by the world "
                             f"size {ctx.world_size}")
        model = build_model(gpt).to(ctx.device)
        broadcast_parameters(model)
        optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr, weight_decay=args.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, args.lr_warmup_steps, args.steps))
        param_count = sum(p.numel() for p in model.parameters())
        bucketed = f"{args.bucket_cap_mb:g} MiB buckets" if args.bucket_cap_mb > 0 else "one all-reduce per tensor"
        log.info(f"world size {ctx.world_size} | backend {ctx.backend} | {param_count:,} parameters in "
                 f"{len(list(model.parameters()))} tensors | {bucketed}")
        harness = Harness(ctx, "ddp_from_scratch", model=model, optimizer=optimizer,
                          warmup_steps=args.warmup_steps,
                          config={"global_batch_size": args.global_batch_size,
                                  "precision": "fp32", "optimizer": args.optimizer,
                                  "bucket_cap_mb": args.bucket_cap_mb})
        task = make_task(gpt, args)
        losses = []
        for step in progress(range(args.steps), ctx.rank, desc="train"):
            inputs, targets = (rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device)
                               for t in task.global_batch(step, args.global_batch_size))
            with harness.step(samples=args.global_batch_size, tokens=args.global_batch_size * gpt.seq_len):
                optimizer.zero_grad(set_to_none=True)
                loss = lm_loss(model(inputs), targets)
                loss.backward()  # purely local: no communication happens here (unlike DDP)
                average_gradients(model, ctx.world_size, int(args.bucket_cap_mb * 2**20))
                if args.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                optimizer.step()
                scheduler.step()
            loss = loss.detach()
            dist.all_reduce(loss)  # for the log only, outside the measured step
            losses.append(loss.item() / ctx.world_size)
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                log.info(f"step {step + 1}/{args.steps} | loss {losses[-1]:.4f}")

        record = harness.finish(args.results, extra={"final_loss": losses[-1], "loss_history": losses})
        save = save_path(args.save)
        if ctx.is_main:
            if save:
                atomic_save({"model": model.state_dict(), "step": args.steps}, save)
            rate = record["metrics"]["tokens_per_s"]
            comm = record["metrics"]["comm_per_step"].get("all_reduce", {})
            log.info(f"all-reduce per step: {comm.get('calls', 0):.0f} calls, {comm.get('bytes', 0) / 2**20:.2f} MiB "
                     f"| median step {record['metrics']['step_time_s_median'] or 0:.3f} s"
                     + (f" | saved {save}" if save else ""))
            log.info(f"done: loss {losses[-1]:.4f} | wall time {time.perf_counter() - wall_start:.1f} s | "
                     f"{f'{rate:,.0f} tokens/s' if rate else 'too few steps to time'} | world size "
                     f"{ctx.world_size} | backend {ctx.backend} ({ctx.device.type})")


if __name__ == "__main__":
    run_main(main)
