"""Worker: train MnistCNN with DDP on a fixed global batch stream; rank 0 saves the final parameters.

``--summed``: also train the same model once more with the negative control's bug, a DDP comm hook
that all-reduces (sums) the ranks' gradients and never divides by the world size, and save those
parameters too (``summed.pt``): test_ddp_equivalence.py requires them to fail its tolerance.

Also runs a few known collectives under the harness's CommCounter and saves what it counted, so the
test can check the counter against hand-computed sizes on a real multi-rank group.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, add_runtime_args, distributed, run_main, seed_everything
from distkit.harness import CommCounter
from distkit.models import MnistCNN, rank_slice


def global_batches(steps: int, global_batch: int):
    """The same pseudo-random images and labels in every process (and in the test)."""
    gen = torch.Generator().manual_seed(1234)
    images = torch.randn(steps, global_batch, 1, 28, 28, generator=gen)
    labels = torch.randint(10, (steps, global_batch), generator=gen)
    return images, labels


def summing_hook(state, bucket):
    """Bug as a DDP comm hook: all-reduce the bucket, never divide by the world size."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def train(ctx, steps: int, global_batch: int, seed: int, summed: bool = False) -> dict:
    """DDP on this rank's slice of each global batch, SGD with momentum; the final weights."""
    seed_everything(seed)  # the test's seed: same initial weights as its reference
    model = DDP(MnistCNN(dropout=0.0))
    if summed:
        model.register_comm_hook(None, summing_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images, labels = global_batches(steps, global_batch)
    for step in range(steps):
        x = rank_slice(images[step], ctx.rank, ctx.world_size)
        y = rank_slice(labels[step], ctx.rank, ctx.world_size)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.module.state_dict()


def main():
    parser = ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--out", required=True)
    parser.add_argument("--summed", action="store_true", help="also train with the summing bug")
    add_runtime_args(parser)
    args = parser.parse_args()
    with distributed(args) as ctx:
        params = train(ctx, args.steps, args.global_batch, args.seed)
        summed = train(ctx, args.steps, args.global_batch, args.seed, summed=True) if args.summed else None

        n = ctx.world_size
        with CommCounter() as comm:
            dist.all_reduce(torch.ones(1000))
            dist.all_gather_into_tensor(torch.empty(250 * n), torch.ones(250))
            dist.reduce_scatter_tensor(torch.empty(100), torch.ones(100 * n))
            dist.broadcast(torch.ones(64, dtype=torch.float64), src=0)
        if ctx.is_main:
            os.makedirs(args.out, exist_ok=True)
            torch.save(params, os.path.join(args.out, "params.pt"))
            if summed is not None:
                torch.save(summed, os.path.join(args.out, "summed.pt"))
            with open(os.path.join(args.out, "comm.json"), "w") as f:
                json.dump(comm.summary(), f)


if __name__ == "__main__":
    run_main(main)
