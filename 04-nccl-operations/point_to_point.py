"""Chapter 04: point-to-point communication, a ring all-reduce built from it, and a deadlock.

Collectives involve every rank of a group; point-to-point moves one tensor from one rank to one other.
This script shows, on every rank in rank order:

1. blocking ``send``/``recv`` between rank pairs (0->1, 2->3, ...);
2. non-blocking ``isend``/``irecv`` around a ring (post both, then wait);
3. ``batch_isend_irecv``: a ring exchange in both directions in one batch (what pipeline schedules use);
4. a ring all-reduce written with nothing but send/recv, checked against ``dist.all_reduce``, with the
   bytes each rank sent compared to the nccl-tests bus factor 2(n-1)/n;
5. a deliberate deadlock (every rank receives first, so nobody sends), on a side group with a short
   timeout so it ends with an explanation instead of hanging.

    torchrun --standalone --nproc_per_node=4 04-nccl-operations/point_to_point.py
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.flags import positive_float, positive_int
from distkit.harness import RegionTimer, bus_factor


def parse_args():
    parser = ArgumentParser(description="Point-to-point send/recv, a ring all-reduce from point-to-point, "
                            "and a deadlock that ends on a timeout.",
                            epilog="example: torchrun --standalone --nproc_per_node=4 "
                                   "04-nccl-operations/point_to_point.py")
    parser.add_argument("--numel", type=positive_int, default=1_000_000,
                        help="elements of the ring all-reduce's float32 vector (default: 1000000 = 4 MB)")
    parser.add_argument("--iters", type=positive_int, default=3,
                        help="timed calls of the ring and of dist.all_reduce, after the checked warm-up "
                             "call (default: 3)")
    parser.add_argument("--deadlock-timeout-s", type=positive_float, default=3.0,
                        help="timeout of the side group the deadlock runs on (default: 3)")
    parser.add_argument("--no-deadlock", action="store_true", help="skip the deadlock demonstration")
    add_runtime_args(parser)
    return parser.parse_args()


def show(ctx, title, line):
    """Print every rank's ``line`` on rank 0, in rank order."""
    lines = [None] * ctx.world_size
    dist.gather_object(line, lines if ctx.is_main else None, dst=0)
    if ctx.is_main:
        print(f"\n== {title}")
        for rank, text in enumerate(lines):
            print(f"   rank {rank}: {text}")


def ring_all_reduce(tensor, ctx):
    """Sum ``tensor`` over all ranks in place using only point-to-point messages; return bytes sent.

    Phase 1 (reduce-scatter, n-1 steps): cut the vector into n chunks; at step s rank r sends chunk
    (r-s) to its right neighbour and adds the chunk arriving from its left into chunk (r-s-1). After
    n-1 steps rank r holds the complete sum of chunk (r+1). Phase 2 (all-gather, n-1 steps): the
    complete chunks travel once around the ring, overwriting the partial ones. Each rank sends
    2(n-1) chunks of size S/n: 2(n-1)/n x S bytes, whatever n is -- why ring all-reduce scales.
    """
    n, r = ctx.world_size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    chunks = list(torch.tensor_split(tensor, n))  # views: writing a chunk writes the tensor
    sent = 0

    def exchange(send_chunk, recv_into):
        nonlocal sent
        # Posting the send and the receive together is what keeps a ring from deadlocking.
        ops = [dist.P2POp(dist.isend, send_chunk, right), dist.P2POp(dist.irecv, recv_into, left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        sent += send_chunk.numel() * send_chunk.element_size()

    for step in range(n - 1):  # reduce-scatter
        incoming = (r - step - 1) % n
        buffer = torch.empty_like(chunks[incoming])
        exchange(chunks[(r - step) % n], buffer)
        chunks[incoming] += buffer
    for step in range(n - 1):  # all-gather
        exchange(chunks[(r + 1 - step) % n], chunks[(r - step) % n])
    return sent


def deadlock(ctx, timeout_s):
    """Every rank waits to receive from its left neighbour before sending to its right: nobody sends.

    It runs on a side gloo group with a short timeout, whatever the job's backend: on NCCL a timed-out
    operation makes the watchdog abort the whole process, so the safe demonstration always uses gloo.
    Its tensors are therefore CPU tensors on purpose, not ``ctx.device``: gloo's send/recv move host
    memory.
    """
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    n, r = ctx.world_size, ctx.rank
    side_device = torch.device("cpu")  # the side group is gloo (see above)
    inbox, outbox = torch.zeros(4, device=side_device), torch.full((4,), float(r), device=side_device)
    start = time.perf_counter()
    try:
        dist.recv(inbox, src=(r - 1) % n, group=side)  # blocks: the left neighbour is blocked too
        dist.send(outbox, dst=(r + 1) % n, group=side)
        outcome = "received (unexpected: no deadlock)"
    except RuntimeError as exc:
        # gloo: "Timed out waiting ...ms for recv operation to complete"; a rank whose neighbour gave
        # up a moment earlier may see "Connection closed by peer" instead: either way, nobody sent.
        reason = str(exc).splitlines()[0].split("] ", 1)[-1].split(". ")[0]
        outcome = f"recv gave up after {time.perf_counter() - start:.1f} s ({reason[:80]})"
    dist.barrier()  # on the default group, which is healthy: the deadlock only stalled the side group
    dist.destroy_process_group(side)
    return outcome


def send_recv_pairs(ctx, payload):
    """1. Blocking send/recv: even ranks send ``payload`` to the next odd rank. Both calls block until matched."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    if r % 2 == 0 and r + 1 < n:
        dist.send(payload, dst=r + 1)
        line = f"sent {payload.tolist()} to rank {r + 1}"
    elif r % 2 == 1:
        inbox = torch.empty(3, device=dev)
        dist.recv(inbox, src=r - 1)
        ok = torch.equal(inbox, torch.arange(3, device=dev) + 100 * (r - 1))
        line = f"received {inbox.tolist()} from rank {r - 1} {'PASS' if ok else 'FAIL'}"
    else:
        line = "no partner (odd world size)"
    show(ctx, "send/recv: even rank r sends to rank r+1 (blocking, matched pairs)", line)


def isend_irecv_ring(ctx, payload):
    """2. isend/irecv around a ring: post both, then wait. A blocking send-then-recv ring could stall."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    # Even ranks post the send first, odd ranks the receive. gloo would not mind either order, but
    # on NCCL single (unbatched) sends and receives of one process group share one stream and
    # connect two GPUs on first use, so a ring in which every rank sends first can wait on itself;
    # the alternation breaks that cycle on any ring size (batch_isend_irecv in 3 has no such issue).
    right, left = (r + 1) % n, (r - 1) % n
    inbox = torch.empty(3, device=dev)
    post_send = lambda: dist.isend(payload, dst=right)  # noqa: E731
    post_recv = lambda: dist.irecv(inbox, src=left)  # noqa: E731
    requests = [post_send(), post_recv()] if r % 2 == 0 else [post_recv(), post_send()]
    for request in requests:
        request.wait()  # until wait() returns, neither buffer may be touched
    ok = torch.equal(inbox, torch.arange(3, device=dev) + 100 * left)
    show(ctx, "isend/irecv ring: send to r+1, receive from r-1 (non-blocking)",
         f"got {inbox.tolist()} from rank {left} {'PASS' if ok else 'FAIL'}")


def batch_exchange(ctx):
    """3. batch_isend_irecv: both directions at once, as one batch of P2P operations."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    right, left = (r + 1) % n, (r - 1) % n
    from_left, from_right = torch.empty(1, device=dev), torch.empty(1, device=dev)
    me = torch.tensor([float(r)], device=dev)
    ops = [dist.P2POp(dist.isend, me, right), dist.P2POp(dist.isend, me, left),
           dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    ok = (from_left.item(), from_right.item()) == (left, right)
    show(ctx, "batch_isend_irecv: exchange ranks with both neighbours in one batch",
         f"left neighbour says {from_left.item():g}, right neighbour says {from_right.item():g} "
         f"{'PASS' if ok else 'FAIL'}")


def ring_versus_library(ctx, numel, iters):
    """4. Ring all-reduce from point-to-point vs the library all_reduce, on the same random vector."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    torch.manual_seed(1000 + r)
    data = torch.randn(numel, device=dev)
    expected, mine = data.clone(), data.clone()
    dist.all_reduce(expected)
    sent = ring_all_reduce(mine, ctx)
    max_diff = (mine - expected).abs().max().item()
    # Timing. The checked calls above were the warm-up: they paid the one-time costs (NCCL
    # connects a pair of GPUs on their first send/recv). On a GPU a call returns once its
    # kernels are queued, so a host clock would time the launch only: RegionTimer records CUDA
    # events around each call and reads them after a synchronisation (perf_counter on CPU).
    library, ring = RegionTimer(dev), RegionTimer(dev)
    for _ in range(iters):
        scratch = data.clone()
        with library.region():
            dist.all_reduce(scratch)
        scratch = data.clone()
        with ring.region():
            ring_all_reduce(scratch, ctx)
    library_s, ring_s = library.total_s / iters, ring.total_s / iters
    tolerance = 1e-5 * n  # fp32 sums in another order: a few ulp of values of size ~sqrt(n)
    size = data.numel() * data.element_size()
    show(ctx, f"ring all-reduce from send/recv vs dist.all_reduce ({size / 1e6:.1f} MB float32)",
         f"max |ring - all_reduce| = {max_diff:.2e} (tolerance {tolerance:.0e}) "
         f"{'PASS' if max_diff <= tolerance else 'FAIL'} | sent {sent} B = {sent / size:.4f} x size "
         f"(bus factor 2(n-1)/n = {bus_factor('all_reduce', n):.4f}) "
         f"| ring {ring_s * 1e3:.1f} ms, library {library_s * 1e3:.1f} ms per call "
         f"(mean of {iters} after a warm-up)")


def main():
    """Each point-to-point pattern in turn, in the order the README teaches them."""
    args = parse_args()
    with distributed(args) as ctx:
        n, r, dev = ctx.world_size, ctx.rank, ctx.device
        if n < 2:
            raise UsageError("point-to-point needs at least 2 ranks: torchrun --nproc_per_node=2 (or 4) ...")
        if ctx.is_main:
            print(f"world size {n} | backend {ctx.backend} | device {dev.type}")

        payload = torch.arange(3, dtype=torch.float32, device=dev) + 100 * r
        send_recv_pairs(ctx, payload)
        isend_irecv_ring(ctx, payload)
        batch_exchange(ctx)
        ring_versus_library(ctx, args.numel, args.iters)

        # 5. The classic deadlock, made safe by a timeout.
        if not args.no_deadlock:
            show(ctx, f"deadlock: every rank calls recv(from r-1) before send(to r+1) "
                      f"(side group, timeout {args.deadlock_timeout_s:g} s)",
                 deadlock(ctx, args.deadlock_timeout_s))
            if ctx.is_main:
                print("   Nobody sends because everybody is still waiting to receive: a cycle of waits. "
                      "Fixes: post both\n   at once (isend/irecv or batch_isend_irecv, as in 2-4), or "
                      "order them (even ranks send first,\n   odd ranks receive first). Blocking sends "
                      "in a cycle deadlock the same way on NCCL once messages are\n   too large to "
                      "buffer; a timeout turns the silent hang into an error you can read.")


if __name__ == "__main__":
    run_main(main)
