"""Chapter 01: train an MNIST CNN with DistributedDataParallel (DDP).

Every process (rank) holds a full copy of the model and trains on its own slice of each epoch
(DistributedSampler). During backward, DDP all-reduces the gradients so every rank applies the same
averaged update and the copies never drift apart. Evaluation is sharded too, and per-rank counts are
all-reduced into one global test accuracy.

    torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py          # 4 CPU processes or 4 GPUs
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_mnist.py --epochs 1
    python 01-ddp-basics/ddp_mnist.py                                # a world of one
    srun --ntasks=4 python 01-ddp-basics/ddp_mnist.py                # SLURM: one task per rank
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from distkit import ArgumentParser, DistContext, UsageError, add_runtime_args, run_main
from distkit.checkpoint import atomic_save
from distkit.data import prepare_mnist
from distkit.flags import (
    add_checkpoint_args,
    add_training_args,
    non_negative_int,
    positive_float,
    positive_int,
    save_path,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import MnistCNN
from distkit.paths import check_outputs
from distkit.runtime import choose_backend_and_device, local_world_size_from_env, seed_everything, use_launcher_env


def parse_args():
    parser = ArgumentParser(
        description="Train a CNN on MNIST with DistributedDataParallel. Launch with torchrun; "
                    "each process is one rank. Runs on CPU (gloo) or one GPU per rank (NCCL).",
        epilog="example: torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py --epochs 3")
    parser.add_argument("--epochs", type=positive_int, default=3,
                        help="passes over the training set (default: 3)")
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="samples per rank per step; the global batch is this x world size (default: 64)")
    parser.add_argument("--gamma", type=positive_float, default=0.7,
                        help="learning-rate decay per epoch (default: 0.7)")
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="stop each epoch after this many steps (quick runs and tests; default: full epoch)")
    parser.add_argument("--num-workers", type=non_negative_int, default=None,
                        help="DataLoader worker processes per rank (default: 2 on a GPU, where loading "
                             "must keep up with the GPU; 0 on CPU, where ranks already share the cores)")
    parser.add_argument("--data-dir", default="data", help="where MNIST is stored or downloaded (default: data)")
    parser.add_argument("--offline", action="store_true",
                        help="do not try to download; use the files in --data-dir or the 5k offline sample")
    parser.add_argument("--log-file", default="runs/ddp_mnist.log",
                        help="rank 0's log file (default: runs/ddp_mnist.log)")
    # --batch-size above is per rank (this script's lesson); the shared flags add --lr, --warmup-steps, --results
    add_training_args(parser, steps=None, global_batch_size=None, lr=1.0, helps={"lr": "Adadelta learning rate"})
    add_checkpoint_args(parser, save="checkpoints/ddp_mnist.pt")
    add_runtime_args(parser)
    return parser.parse_args()


def train_one_epoch(model, loader, optimizer, harness, ctx, epoch, max_steps):
    """One pass over this rank's shard; returns this rank's (loss sum, correct, samples)."""
    model.train()
    # On ctx.device: it is all-reduced later, and an NCCL group only takes GPU tensors.
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    steps = len(loader) if max_steps is None else min(len(loader), max_steps)
    bar = progress(loader, ctx.rank, total=steps, desc=f"epoch {epoch}")
    for step, (images, labels) in enumerate(bar):
        if step >= steps:
            break
        images, labels = images.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
        with harness.step(samples=len(images) * ctx.world_size):
            optimizer.zero_grad(set_to_none=True)
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            loss.backward()  # DDP all-reduces (averages) gradients across ranks here, bucket by bucket
            optimizer.step()
        # Accumulated on the device: no .item() per step, which would wait for the GPU every step.
        totals += torch.stack([loss.detach().double() * len(labels),
                               (logits.argmax(1) == labels).sum().double(),
                               torch.full((), float(len(labels)), dtype=torch.float64, device=ctx.device)])
        if ctx.rank == 0 and hasattr(bar, "set_postfix") and (step % 20 == 0 or step == steps - 1):
            bar.set_postfix(loss=f"{loss.item():.4f}")  # .item() waits for the GPU: not every step
    return totals


@torch.no_grad()
def evaluate(model, test_set, ctx, batch_size):
    """Global test (loss, accuracy): each rank scores every world_size-th sample, then all-reduce."""
    # Not DistributedSampler: it pads the last shard with repeated samples, which would count some
    # test digits twice. A strided Subset scores every sample exactly once.
    shard = Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size))
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for images, labels in DataLoader(shard, batch_size=4 * batch_size):
        images, labels = images.to(ctx.device), labels.to(ctx.device)
        logits = model(images)
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(),
                               (logits.argmax(1) == labels).sum().double(),
                               torch.full((), float(len(labels)), dtype=torch.float64, device=ctx.device)])
    dist.all_reduce(totals)  # sum of per-rank counts = counts over the whole test set
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


def join_process_group(args) -> DistContext:
    """How a process joins the job: the one thing this chapter teaches, written out.

    Every later script calls ``distkit.distributed(args)``, which does exactly these steps (plus
    one-line errors for more failure cases) and tears the group down at the end.
    """
    # torchrun starts one process per rank and tells each who it is through the environment.
    # srun per task says the same in SLURM_* variables: use_launcher_env copies them into torchrun's
    # (and prints "launcher: srun ..."); plain `python ddp_mnist.py` becomes rank 0 of a world of one.
    use_launcher_env()
    rank = int(os.environ["RANK"])              # this process among all processes of the job
    local_rank = int(os.environ["LOCAL_RANK"])  # among the processes on this machine: picks the GPU
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = local_world_size_from_env()
    # NCCL when every local rank gets its own GPU, else gloo on CPU (--backend/--device force one).
    backend, device_type = choose_backend_and_device(args.backend, args.device, local_world_size)
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL binds this rank's GPU
    # Rendezvous: every rank connects to MASTER_ADDR:MASTER_PORT (torchrun sets them) and waits
    # for all world_size ranks. The timeout bounds how long any collective waits for a lost peer.
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=args.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    except RuntimeError as exc:  # a busy or unreachable rendezvous address
        raise UsageError(f"could not join the process group: {str(exc).splitlines()[0]}") from None
    seed_everything(args.seed)  # same seed on every rank -> same initial weights and shuffles
    return DistContext(rank, local_rank, world_size, local_world_size, backend, device, args.timeout_s)


def main():
    args = parse_args()
    wall_start = time.perf_counter()
    ctx = join_process_group(args)
    finished = False
    try:
        train(args, ctx, wall_start)
        finished = True
    finally:
        # Leaving the job: after a clean run every rank meets at a barrier first (a gloo rank that
        # exits while a peer still sends can abort the peer); after a failure the peers may be
        # gone, so the group is only destroyed.
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def train(args, ctx: DistContext, wall_start: float) -> None:
    """Data, model, DDP, the epochs, the checkpoint and the record: the rest of the script."""
    check_outputs(ctx, args, files=["log_file", "results", "save"])  # before the first byte is written
    log = setup_logging(ctx.rank, args.log_file)
    log.info(f"world size {ctx.world_size} | backend {ctx.backend} | device {ctx.device.type} "
             f"| per-rank batch {args.batch_size} -> global batch {args.batch_size * ctx.world_size}")
    train_set, test_set, source = prepare_mnist(args.data_dir, ctx, offline=args.offline)

    # Each rank sees a different 1/world_size of the shuffled training set every epoch.
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=True, seed=args.seed)
    on_gpu = ctx.device.type == "cuda"
    workers = args.num_workers if args.num_workers is not None else (2 if on_gpu else 0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=on_gpu, persistent_workers=workers > 0)

    # Same seed on every rank -> same initial weights; DDP also broadcasts rank 0's weights.
    model = MnistCNN().to(ctx.device)
    model = DDP(model, device_ids=ctx.device_ids)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    harness = Harness(ctx, "ddp", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      model_config={"arch": "mnist_cnn"},
                      config={"batch_size_per_rank": args.batch_size,
                              "epochs": args.epochs, "data": source})

    test_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on every rank
        start = time.perf_counter()
        totals = train_one_epoch(model, loader, optimizer, harness, ctx, epoch, args.max_steps)
        dist.all_reduce(totals)  # per-rank sums -> global sums
        train_loss, train_acc = totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()
        test_loss, test_acc = evaluate(model, test_set, ctx, args.batch_size)
        scheduler.step()
        log.info(f"epoch {epoch}/{args.epochs} | train loss {train_loss:.4f} acc {train_acc:.2%} "
                 f"| test loss {test_loss:.4f} acc {test_acc:.2%} | {time.perf_counter() - start:.1f} s")

    save = save_path(args.save)
    if ctx.is_main and save:  # one copy is enough: every rank holds identical weights
        atomic_save({"model": model.module.state_dict(), "test_accuracy": test_acc,
                     "world_size": ctx.world_size}, save)
    record = harness.finish(args.results, extra={"test_accuracy": test_acc, "data": source})
    if ctx.is_main:
        wall = time.perf_counter() - wall_start
        rate = record["metrics"]["samples_per_s"]
        rate_text = f"{rate:.0f} samples/s" if rate else "too few steps to time"
        log.info(f"{f'saved {save} | ' if save else ''}record appended to {args.results}")
        log.info(f"done: test accuracy {test_acc:.2%} | wall time {wall:.1f} s | {rate_text} "
                 f"| world size {ctx.world_size} | backend {ctx.backend} ({ctx.device.type})")


if __name__ == "__main__":
    run_main(main)
