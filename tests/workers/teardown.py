"""Worker: does a rank's process group outlive the model after the teardown?

Each rank trains a DDP-wrapped linear layer for one step, tears the group down, then returns from
the function that owns the model: the model, and DDP's Reducer with it, are freed. Rank 0 then
prints how many of gloo's worker threads (``pt_gloo_runloop``) are still running.

``--teardown distkit``: :func:`distkit.runtime.shutdown_distributed`, which keeps every group
referenced until the process ends. ``--teardown plain``: ``dist.barrier()`` and
``dist.destroy_process_group()`` only; the Reducer then holds the group's last reference, and freeing
the model runs the group's destructor, which joins those threads with the GIL held (the hazard:
a worker thread still freeing the last collective's tensors needs the GIL, and the rank never
exits). The destructor running is what can be observed every time; the deadlock itself needs an
unlucky thread schedule: a gloo worker still dropping its last work when the destructor joins it
(here, 4 of 120 plain teardowns hung when launched three at a time on 2 cores). The plain
teardown waits a second before freeing the model, so that it shows the destructor running without
hanging in it.

The Reducer holds the group's last reference only once ``torch.distributed.fsdp`` has been imported
(as the suite's fork server does before forking ranks, and scripts that use FSDP or DCP do);
without it something else keeps the group alive past the model (a fresh ``torchrun`` of
ddp_training.py, which imports neither, shows 2 threads after the plain teardown too). The worker
imports it, so both teardowns are compared in the setting where the hang was seen.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401  (see the module docstring)
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit.runtime import exit_without_finalizers, init_distributed, shutdown_distributed


def gloo_worker_threads() -> int:
    """This process's threads named as gloo's per-group worker threads."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                count += comm.read().strip() == "pt_gloo_runloop"
        except FileNotFoundError:  # the thread ended while we looked
            pass
    return count


def train_and_tear_down(teardown: str) -> int:
    ctx = init_distributed(backend="gloo", device="cpu", timeout_s=60, seed=0)
    model = DDP(torch.nn.Linear(8, 8))
    model(torch.randn(4, 8, device=ctx.device)).sum().backward()
    while_alive = gloo_worker_threads()
    if teardown == "distkit":
        shutdown_distributed()
    else:
        dist.barrier()
        dist.destroy_process_group()
        # give gloo's worker threads a moment to drop the works they ran, so that freeing the model
        # shows the destructor running without (usually) deadlocking in it
        time.sleep(1.0)
    return while_alive  # returning frees the model and its Reducer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teardown", choices=["distkit", "plain"], required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    while_alive = train_and_tear_down(args.teardown)
    gc.collect()
    if rank == 0:
        print(f"gloo worker threads: {while_alive} while training, {gloo_worker_threads()} after the model was freed",
              flush=True)
    exit_without_finalizers(0)


if __name__ == "__main__":
    main()
