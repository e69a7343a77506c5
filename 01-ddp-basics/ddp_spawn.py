"""Chapter 01: the same DDP training, launched with ``torch.multiprocessing.spawn`` instead of torchrun.

For environments where torchrun is unavailable (some notebooks-as-a-service, IDE run buttons, a
single ``python`` entry point in a container). The script itself does what torchrun would: pick a
free rendezvous port, start one process per rank, and give each its RANK / LOCAL_RANK / WORLD_SIZE.
What you lose: restarts on failure (``--max-restarts``), multi-node rendezvous, and the per-rank
failure summary. Prefer torchrun whenever you can.

    python 01-ddp-basics/ddp_spawn.py                 # 4 processes (or one per GPU)
    python 01-ddp-basics/ddp_spawn.py --nproc 2 --steps 50
"""
from __future__ import annotations

import os
import socket
import sys

import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.flags import add_training_args, positive_int
from distkit.logs import setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.text import make_task


def parse_args(argv=None):
    # GPUs this process may use (CUDA_VISIBLE_DEVICES applied; 0 when it hides them all), the same
    # count distkit's backend choice sees in each worker. No CUDA context is created here.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = ArgumentParser(description="DDP training started with torch.multiprocessing.spawn (no torchrun).",
                            epilog="example: python 01-ddp-basics/ddp_spawn.py --nproc 2 --steps 50")
    parser.add_argument("--nproc", type=positive_int, default=gpus or 4,
                        help=f"processes to spawn (default here: {gpus or 4}: one per GPU, else 4)")
    add_model_args(parser)
    add_training_args(parser, steps=100, global_batch_size=32, lr=3e-3, warmup_steps=None, results=None,
                      helps={"lr": "AdamW learning rate"})
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    if args.global_batch_size % args.nproc:
        parser.error(f"--nproc {args.nproc} must divide --global-batch-size {args.global_batch_size}")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(local_rank: int, args, port: int) -> None:
    """Runs in each spawned process; ``mp.spawn`` passes the process index first."""
    # What torchrun would have exported for us (single node: global rank = local rank).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc))
    run_main(lambda: train(args))


def train(args) -> None:
    with distributed(args) as ctx:
        log = setup_logging(ctx.rank)
        cfg = model_config_from_args(args)
        model = DDP(build_model(cfg).to(ctx.device), device_ids=ctx.device_ids)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        task = make_task(cfg, args)
        log.info(f"spawned {ctx.world_size} processes | backend {ctx.backend} | {args.steps} steps")
        for step in range(args.steps):
            inputs, targets = (rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device)
                               for t in task.global_batch(step, args.global_batch_size))
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs), targets)
            loss.backward()  # DDP all-reduces the gradients, exactly as under torchrun
            optimizer.step()
            if (step + 1) % max(1, args.steps // 5) == 0 or step + 1 == args.steps:
                log.info(f"step {step + 1}/{args.steps} | loss on rank 0's shard {loss.item():.4f}")
        log.info("done")


def main(argv=None) -> None:
    cli = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned CPU ranks share the cores
    # spawn (not fork): each rank starts a fresh interpreter, as CUDA requires. join=True waits and
    # raises in the parent when a worker fails; the worker has already printed its one error line
    # (run_main), so the parent only passes its exit code on instead of adding a traceback.
    try:
        mp.spawn(worker, args=(cli, free_port()), nprocs=cli.nproc, join=True)
    except mp.ProcessExitedException as exc:
        sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)
    except mp.ProcessRaisedException as exc:  # a bug in a worker: keep its traceback, once
        print(str(exc).strip(), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
