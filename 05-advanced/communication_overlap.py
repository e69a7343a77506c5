"""Chapter 05: how DDP hides communication under the backward pass, and how to measure it.

DDP does not wait for the whole backward to finish: gradients are grouped into buckets of about
``bucket_cap_mb`` (in reverse layer order, the order backward produces them), and as soon as a
bucket is full its all-reduce is launched *asynchronously* while backward continues on earlier
layers:

    backward  | L8 L7 | L6 L5 | L4 L3 | L2 L1 |
    comm      |       | AR b0 | AR b1 | AR b2 | AR b3 |     only the last bucket's all-reduce
                                                          is exposed after backward ends

Small buckets start communicating early but pay the per-call latency many times; one huge bucket
cannot start until backward is done. This script shows all three pieces:

1. a profiler trace of one DDP step (open it in chrome://tracing or https://ui.perfetto.dev) and the
   overlap fraction computed from it: communication time hidden under backward compute;
2. a ``bucket_cap_mb`` sweep with throughput per bucket size (one harness record each);
3. a hand-written async collective (``async_op=True`` then ``wait()``) overlapping independent
   compute, against the same work done one after the other.

On GPUs, ``CUDA_DEVICE_MAX_CONNECTIONS`` sets how many hardware queues CUDA streams map to;
Megatron-style tensor parallelism sets it to 1 so communication kernels are issued in program
order and overlap predictably with compute. It has no effect on CPU/gloo.

    torchrun --nproc_per_node=4 05-advanced/communication_overlap.py
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main, seed_everything
from distkit.flags import add_bucket_arg, add_training_args, positive_float, positive_int
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import rank_slice
from distkit.paths import check_outputs


def parse_args():
    parser = ArgumentParser(
        description="Profile DDP's communication/computation overlap, sweep bucket_cap_mb, and time an "
                    "async all-reduce overlapping independent compute.",
        epilog="example: torchrun --nproc_per_node=4 05-advanced/communication_overlap.py --bucket-cap-mb 0.1 1 25")
    parser.add_argument("--layers", type=positive_int, default=48,
                        help="linear layers of the model: many small tensors make per-call latency and "
                             "bucketing visible (default: 48, i.e. 96 parameter tensors)")
    parser.add_argument("--width", type=positive_int, default=128, help="width of each layer (default: 128)")
    add_bucket_arg(parser, [0.05, 0.25, 1.0, 25.0], sweep=True,
                   help_extra="; several values are swept, one harness record each")
    parser.add_argument("--profile-bucket-cap-mb", type=positive_float, default=0.25,
                        help="bucket_cap_mb of the profiled step (default: 0.25)")
    parser.add_argument("--trace", default="runs/ddp_overlap_trace.json",
                        help="rank 0's Chrome trace of one DDP step (default: runs/ddp_overlap_trace.json)")
    parser.add_argument("--async-mib", type=positive_float, default=4.0,
                        help="size of the tensor all-reduced in the async demo, MiB (default: 4)")
    add_training_args(parser, steps=12, global_batch_size=256, lr=0.01, helps={
        "steps": "steps per sweep point",
        "global_batch_size": "samples per step over all ranks (SGD on random inputs)",
        "results": "one harness record per bucket size appended here"})
    add_runtime_args(parser)
    return parser.parse_args()


def many_tensor_model(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def ddp_step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()  # buckets' all-reduces launch during this call
    optimizer.step()


def union(intervals):
    """Merge overlapping [start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def covered(intervals, cover) -> float:
    """Total length of ``intervals`` that lies inside ``cover`` (both already merged)."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in intervals for s2, e2 in cover)


def is_nccl_kernel(name: str) -> bool:
    """NCCL's GPU kernels are named ``ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)`` (older NCCL:
    ``ncclKernel_...``); the profiler may print a demangled ``void `` prefix."""
    return "nccl" in name.lower()


def overlap_from_trace(events: list[dict], device_type: str) -> dict[str, float]:
    """Communication time hidden under backward compute, from a Chrome trace's complete ("X") events.

    Read from the exported trace, not from ``prof.events()``: the two can disagree on a worker
    thread's span by a millisecond, and the trace is the file a reader opens. Both sides must come
    from the same timeline:

    * CPU/gloo: gloo runs each all-reduce on its own worker thread (``gloo:all_reduce`` events) while
      backward computes on the autograd thread (``autograd::engine::evaluate_function`` events):
      both are host spans, and the host is where the work happens.
    * GPU/NCCL: the host spans only *launch* work, so they say nothing about when it ran. Both sides
      are device events (``"cat": "kernel"``, what the GPU really executed): NCCL kernels on the
      communication stream against every other kernel (backward's compute; forward ends before the
      first bucket is ready and the optimizer waits for the last one, so only backward can overlap).

    hidden = |comm ∩ compute| / |comm|.
    """
    comm, compute = [], []
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        name, span = event.get("name", ""), (event["ts"], event["ts"] + event["dur"])  # microseconds
        if device_type == "cuda":
            if event.get("cat") != "kernel":
                continue  # host-side spans: launch times, not execution
            (comm if is_nccl_kernel(name) else compute).append(span)
        elif name.startswith("gloo:"):
            comm.append(span)
        elif name.startswith("autograd::engine::evaluate_function"):
            compute.append(span)
    comm, compute = union(comm), union(compute)
    comm_us = sum(e - s for s, e in comm)
    hidden_us = covered(comm, compute)
    return {"comm_ms": comm_us / 1e3, "hidden_ms": hidden_us / 1e3,
            "hidden_fraction": hidden_us / comm_us if comm_us else 0.0}


def profiled_trace(prof, path: str | None) -> list[dict]:
    """The profile's Chrome trace events, exported to ``path`` (rank 0's, kept) or to a scratch file."""
    with tempfile.TemporaryDirectory() as scratch:
        target = path or os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(target)
        with open(target) as f:
            return json.load(f)["traceEvents"]


def async_demo(ctx, mib: float, reps: int = 5) -> tuple[float, float]:
    """Median time of (all-reduce; matmul) one after the other vs overlapped with async_op=True."""
    payload = torch.ones(int(mib * 2**20 / 4), device=ctx.device)
    a = torch.randn(256, 256, device=ctx.device)

    def independent_compute():
        out = a
        for _ in range(20):
            out = torch.tanh(out @ a)
        return out

    def sync():
        # gloo: the host blocks until the data has crossed the network. NCCL: the host returns at
        # once, but the compute stream waits for the all-reduce before running what comes next.
        dist.all_reduce(payload)
        independent_compute()

    def overlapped():
        work = dist.all_reduce(payload, async_op=True)  # gloo: a worker thread; NCCL: its own stream
        independent_compute()             # does not touch `payload`, so it may run meanwhile
        work.wait()                       # only now do we need the reduced values (NCCL: stream wait)

    def finish_device_work():  # GPU kernels run after the calls return: wait for them at both ends
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    timings = {}
    for name, fn in (("sync", sync), ("async", overlapped)):
        samples = []
        for _ in range(reps + 1):
            dist.barrier()
            finish_device_work()
            start = time.perf_counter()
            fn()
            finish_device_work()
            samples.append(time.perf_counter() - start)
        timings[name] = sorted(samples[1:])[reps // 2]
    return timings["sync"], timings["async"]


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "trace"])
        log = setup_logging(ctx.rank)
        if args.global_batch_size % ctx.world_size:
            raise UsageError(f"--global-batch-size {args.global_batch_size} does not split over "
                             f"{ctx.world_size} ranks")
        # the global batch, drawn from the job's seed; each rank trains on its own slice of it, as DDP does
        batch = torch.randn(args.global_batch_size, args.width, generator=torch.Generator().manual_seed(args.seed))
        x = rank_slice(batch, ctx.rank, ctx.world_size).to(ctx.device)
        params = sum(p.numel() for p in many_tensor_model(args.layers, args.width).parameters())
        log.info(f"model: {args.layers} linear layers x {args.width} -> {2 * args.layers} tensors, "
                 f"{params * 4 / 2**20:.2f} MiB of fp32 gradients per step | {ctx.world_size} ranks, {ctx.backend}")

        # 1. Profile one step and compute how much of the all-reduce time backward hid.
        seed_everything(args.seed)
        model = DDP(many_tensor_model(args.layers, args.width).to(ctx.device), device_ids=ctx.device_ids,
                    bucket_cap_mb=args.profile_bucket_cap_mb)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        for _ in range(2):  # warm up: DDP rebuilds its buckets after the first step
            ddp_step(model, optimizer, x)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            ddp_step(model, optimizer, x)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)  # every kernel of the step inside the trace
        if ctx.is_main:
            os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
        overlap = overlap_from_trace(profiled_trace(prof, args.trace if ctx.is_main else None), ctx.device.type)
        per_rank = [None] * ctx.world_size
        dist.all_gather_object(per_rank, overlap)
        log.info(f"profiled step (bucket_cap_mb={args.profile_bucket_cap_mb}): trace {args.trace}")
        for rank, o in enumerate(per_rank):
            log.info(f"  rank {rank}: all-reduce busy {o['comm_ms']:.1f} ms, {o['hidden_ms']:.1f} ms under backward "
                     f"compute -> {o['hidden_fraction']:.0%} hidden")

        # 2. bucket_cap_mb sweep: same model and data, only the bucket size changes.
        log.info(f"{'bucket_cap_mb':>13} {'all-reduces/step':>16} {'samples/s':>10} {'ms/step':>8}")
        for bucket_mb in args.bucket_cap_mb:
            seed_everything(args.seed)
            model = DDP(many_tensor_model(args.layers, args.width).to(ctx.device), device_ids=ctx.device_ids,
                        bucket_cap_mb=bucket_mb)
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
            harness = Harness(ctx, "ddp", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                              model_config={"arch": "mlp", "layers": args.layers, "width": args.width},
                              config={"global_batch_size": args.global_batch_size,
                                      "precision": "fp32", "bucket_cap_mb": bucket_mb, "lr": args.lr})
            for _ in progress(range(args.steps), ctx.rank, desc=f"bucket {bucket_mb} MB"):
                with harness.step(samples=args.global_batch_size):
                    ddp_step(model, optimizer, x)
            record = harness.finish(args.results, extra={"sweep": "bucket_cap_mb"})
            if ctx.is_main:
                metrics = record["metrics"]
                calls = metrics["comm_per_step"].get("all_reduce", {}).get("calls", 0)
                rate, median = metrics["samples_per_s"], metrics["step_time_s_median"]
                log.info(f"{bucket_mb:>13g} {calls:>16.0f} {rate or 0:>10.0f} "
                         f"{(median or 0) * 1000:>8.1f}")

        # 3. A collective you launch yourself can overlap too.
        sync_s, async_s = async_demo(ctx, args.async_mib)
        log.info(f"all-reduce {args.async_mib:g} MiB + independent compute: one after the other "
                 f"{sync_s * 1000:.1f} ms, async_op=True + wait() {async_s * 1000:.1f} ms "
                 f"({1 - async_s / sync_s:.0%} saved)")
        if ctx.device.type == "cuda":
            log.info(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset (8)')}")
        else:
            log.info("CUDA_DEVICE_MAX_CONNECTIONS only matters on GPUs (CUDA stream queues); not used on CPU")
        log.info(f"records appended to {args.results}")


if __name__ == "__main__":
    run_main(main)
