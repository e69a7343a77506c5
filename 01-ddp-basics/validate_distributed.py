"""Chapter 01: check that a machine (or a cluster allocation) is ready for distributed training.

Run it with the same launcher, node count and processes per node as your training job. Every rank
runs every check; rank 0 prints one PASS / FAIL / SKIP line per check (naming the ranks that failed)
with a hint at the usual cause of each failure, and the exit code is non-zero if anything failed.

    torchrun --standalone --nproc_per_node=4 01-ddp-basics/validate_distributed.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \
        01-ddp-basics/validate_distributed.py
"""
from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, run_main
from distkit.flags import positive_int
from distkit.runtime import init_distributed, launched_rank, shutdown_distributed

ENV_PREFIXES = ("MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "NCCL_", "TORCH_NCCL_", "GLOO_", "TORCHELASTIC_", "CUDA_VISIBLE_DEVICES",
                "TORCH_DISTRIBUTED_DEBUG", "OMP_NUM_THREADS")
HINTS = {
    "process group": "MASTER_ADDR/MASTER_PORT unreachable or busy, a firewall between nodes, or "
                     "ranks started with different --nnodes/--nproc_per_node",
    "device binding": "each rank must use GPU LOCAL_RANK: set CUDA_VISIBLE_DEVICES consistently and "
                      "call torch.cuda.set_device(local_rank) before init_process_group",
    "backend nccl": "CPU-only PyTorch build or no GPU: use --backend gloo, or install the CUDA wheel",
    "backend gloo": "PyTorch built without gloo (unusual): reinstall the official wheel",
    "all_reduce": "wrong results mean broken transport: try NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1, "
                  "check NCCL_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) names the right interface",
    "all_gather": "as for all_reduce; also check every rank runs the same code",
    "broadcast": "as for all_reduce; also check every rank runs the same code",
    "gpu peer access": "no NVLink/PCIe P2P between these GPUs (or IOMMU/ACS on): NCCL falls back "
                       "to host memory; NCCL_P2P_DISABLE=1 avoids hangs on broken P2P",
}


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Validate a distributed set-up: process group, device binding, backends, "
                    "collectives, GPU peer access. Prints PASS/FAIL per check; exits 1 on any FAIL.",
        epilog="example: torchrun --standalone --nproc_per_node=4 01-ddp-basics/validate_distributed.py")
    parser.add_argument("--numel", type=positive_int, default=1 << 16,
                        help="elements per tensor in the collective checks (default: 65536)")
    add_runtime_args(parser)
    return parser.parse_args(argv)


def print_environment(rank: int) -> None:
    if rank != 0:
        return
    print(f"host {socket.gethostname()} | torch {torch.__version__} | python {sys.version.split()[0]}")
    for key in sorted(os.environ):
        if key.startswith(ENV_PREFIXES):
            print(f"  {key}={os.environ[key]}")
    if not any(k.startswith("NCCL_") for k in os.environ):
        print("  (no NCCL_* variables set: NCCL uses its defaults)")


def report(name: str, ok_on_rank: bool | None, detail: str, ctx) -> bool:
    """Gather one check's result from every rank; rank 0 prints a single line. None = skipped."""
    outcomes = [None] * ctx.world_size
    dist.all_gather_object(outcomes, (ok_on_rank, detail))
    failed = [r for r, (ok, _) in enumerate(outcomes) if ok is False]
    skipped = all(ok is None for ok, _ in outcomes)
    if ctx.is_main:
        if skipped:
            print(f"SKIP  {name:<16} {detail}")
        elif failed:
            print(f"FAIL  {name:<16} ranks {failed}: {outcomes[failed[0]][1]}")
            print(f"      hint: {HINTS.get(name, '')}")
        else:
            print(f"PASS  {name:<16} {detail}")
    return not failed


def check_collectives(ctx, numel: int) -> list[tuple[str, bool, str]]:
    """all_reduce / all_gather / broadcast with known answers, checked on every rank."""
    n, r, device = ctx.world_size, ctx.rank, ctx.device
    results = []
    x = torch.full((numel,), float(r + 1), device=device)
    dist.all_reduce(x)  # sum of 1..n
    expected = n * (n + 1) / 2
    results.append(("all_reduce", bool(torch.all(x == expected)), f"sum of 1..{n} = {expected:g} on every rank"))

    gathered = [torch.empty(numel, device=device) for _ in range(n)]
    dist.all_gather(gathered, torch.full((numel,), float(r), device=device))
    ok = all(bool(torch.all(t == i)) for i, t in enumerate(gathered))
    results.append(("all_gather", ok, f"rank i's tensor arrives at slot i on all {n} ranks"))

    ok = True
    for src in sorted({0, n - 1}):  # from the first and the last rank
        y = torch.full((numel,), 42.0 + src, device=device) if r == src else torch.zeros(numel, device=device)
        dist.broadcast(y, src=src)
        ok &= bool(torch.all(y == 42.0 + src))
    results.append(("broadcast", ok, f"from rank 0 and rank {n - 1} to all ranks"))
    return results


def check_device(ctx) -> tuple[bool, str]:
    """Each rank on its own GPU LOCAL_RANK (or on the CPU with gloo)."""
    if ctx.device.type != "cuda":
        return True, f"{ctx.world_size} ranks on CPU ({os.cpu_count()} cores here)"
    mine = (socket.gethostname(), torch.cuda.current_device())
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    unique = len(set(everyone)) == len(everyone)
    ok = mine[1] == ctx.local_rank and unique
    return ok, (f"rank {ctx.rank} -> cuda:{mine[1]} ({torch.cuda.get_device_name()})" if ok else
                f"rank {ctx.rank} on cuda:{mine[1]}, LOCAL_RANK {ctx.local_rank}, GPUs shared: {not unique}")


def check_peer_access(ctx) -> tuple[bool | None, str]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return None, f"needs 2+ GPUs on a node ({gpus} here)"
    missing = [(a, b) for a in range(gpus) for b in range(gpus)
               if a != b and not torch.cuda.can_device_access_peer(a, b)]
    return not missing, (f"all {gpus} GPUs reach each other" if not missing else f"no P2P for {missing[:4]}")


def validate(args) -> None:
    rank = launched_rank()
    print_environment(rank)
    try:
        ctx = init_distributed(backend=args.backend, device=args.device, timeout_s=args.timeout_s,
                               seed=args.seed)
    except UsageError as exc:  # nothing to gather with: every rank reports for itself
        hint = HINTS["backend nccl"] if "NCCL" in str(exc) or "GPU" in str(exc) else HINTS["process group"]
        print(f"FAIL  process group    [rank {rank}] {exc}\n      hint: {hint}", flush=True)
        raise SystemExit(1)
    ok = True
    try:
        ok &= report("process group", True, f"{ctx.world_size} ranks joined, backend {ctx.backend}, "
                     f"timeout {ctx.timeout_s:g} s", ctx)
        ok &= report("device binding", *check_device(ctx), ctx)
        ok &= report("backend gloo", dist.is_gloo_available(), "available", ctx)
        nccl = dist.is_nccl_available()
        needs_nccl = ctx.backend == "nccl"
        ok &= report("backend nccl", nccl if needs_nccl or torch.cuda.is_available() else None,
                     ("available" if nccl else "not in this build") if needs_nccl or torch.cuda.is_available()
                     else "not needed: no GPU, training uses gloo", ctx)
        for name, passed, detail in check_collectives(ctx, args.numel):
            ok &= report(name, passed, detail, ctx)
        ok &= report("gpu peer access", *check_peer_access(ctx), ctx)
    finally:
        shutdown_distributed(success=True)
    if rank == 0:
        print("all checks passed" if ok else "some checks FAILED (see hints above)")
    if not ok:
        raise SystemExit(1)


def main(argv=None) -> None:
    validate(parse_args(argv))


if __name__ == "__main__":
    run_main(main)
