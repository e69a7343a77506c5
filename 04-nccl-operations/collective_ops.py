"""Chapter 04: every collective operation, shown before and after on every rank, and checked.

Each rank r starts from a tensor it can print: ``[10r, 10r+1, ...]`` (rank 0: [0, 1, 2, 3], rank 1:
[10, 11, 12, 13] ...). Every demo runs one collective, gathers what each rank held before and after,
prints it in rank order, and compares the result with the mathematical definition computed locally
from all ranks' known inputs. A wrong result is a FAIL line (and exit code 1); a collective or dtype
the backend does not support is a SKIP line saying so, never a crash.

    torchrun --standalone --nproc_per_node=4 04-nccl-operations/collective_ops.py
    torchrun --standalone --nproc_per_node=2 04-nccl-operations/collective_ops.py --only all_reduce
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.flags import positive_int
from distkit.harness import CommCounter
from distkit.runtime import launched_rank

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}
DEMOS = ["all_reduce(SUM)", "all_reduce(AVG)", "all_reduce(MAX)", "broadcast", "reduce(SUM)", "all_gather(list)",
         "all_gather_single", "reduce_scatter(list)", "reduce_scatter_single", "gather", "scatter",
         "all_to_all(even)", "all_to_all(uneven)", "barrier", "objects"]
ROOT = 0  # the source/destination rank of rooted collectives (broadcast, reduce, gather, scatter)


def parse_args():
    parser = ArgumentParser(description="Run every torch.distributed collective on a tiny tensor, print "
                            "each rank's data before and after, and check it against the definition.",
                            epilog="example: torchrun --standalone --nproc_per_node=4 "
                                   "04-nccl-operations/collective_ops.py")
    parser.add_argument("--numel", type=positive_int, default=4,
                        help="elements per rank's tensor, 1 to 64 (default: 4)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="element type (default: float32)")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="run only demos whose name starts with one of these (e.g. all_reduce scatter)")
    parser.add_argument("--corrupt", metavar="NAME", default=None,
                        help="after the demo NAME (e.g. broadcast), the last rank alters one element of its "
                             "result, to show what a wrong collective result looks like (a FAIL line)")
    add_runtime_args(parser)
    args = parser.parse_args()
    unknown = [p for p in (args.only or []) if not any(d.startswith(p) for d in DEMOS)]
    if unknown or (args.corrupt is not None and args.corrupt not in DEMOS):
        parser.error(f"unknown demo {(unknown or [args.corrupt])[0]!r}; the demos are: {', '.join(DEMOS)}")
    if args.numel > 64:
        parser.error("--numel must be between 1 and 64 (the point is to read every element)")
    return args


def rank_input(rank, numel, dtype, device):
    """What rank ``rank`` holds before a collective: [10r, 10r+1, ...]. Every rank can compute it for
    every other rank, which is how the results are checked without trusting the collective. Built on
    ``device`` (``ctx.device``), as is every tensor handed to a collective below."""
    return (torch.arange(numel, device=device) + 10 * rank).to(dtype=dtype)


def fmt(value):
    """A tensor, list of tensors or object as one short line."""
    if isinstance(value, torch.Tensor):
        return "[" + ", ".join(f"{v:g}" for v in value.double().tolist()) + "]"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return "-" if value is None else repr(value)


def rounding_slack(dtype, n, expected, op):
    """How far a correct floating-point SUM (``op="sum"``) or AVG (``"avg"``) over ``n`` ranks may be
    from ``expected`` (the exact value, computed here in float64 and rounded once), element by element.

    Every input in this script is a non-negative integer, so each partial sum of an element lies
    between 0 and its full sum. While that sum is an integer the dtype holds exactly (up to 2/eps:
    2^24 in float32, 2048 in float16, 256 in bfloat16), every order of addition gives the exact
    result, and so does an average over a power-of-two rank count (scaling by 1/n is then exact):
    no slack at all. Beyond that, the library adds in its own order (ring, tree, NVLS; gloo
    sequentially) and rounds after each step, and NCCL's AVG scales each input by 1/n first: in
    float16 (eps 2^-10) and bfloat16 (eps 2^-7) the result can differ from ours in the last bit, e.g.
    AVG on 3, 5, 6 or 7 ranks, or bfloat16 sums above 256. The n-1 additions, the scaling and our own
    rounding each err by at most half an ulp: n x eps x |expected| bounds them all.
    """
    if not dtype.is_floating_point or expected is None:
        return 0.0
    want = expected.double().abs()
    eps = torch.finfo(dtype).eps
    full_sum = want * (n if op == "avg" else 1)
    exact = (full_sum <= 2 / eps) & (op == "sum" or n & (n - 1) == 0)
    return torch.where(exact, 0.0, n * eps * want)


def same(result, expected, slack=0.0):
    """Does ``result`` match ``expected``? Exactly, or within ``slack`` (see :func:`rounding_slack`)."""
    if expected is None:  # the definition leaves this rank's buffer unspecified
        return True
    if isinstance(expected, torch.Tensor):
        if not isinstance(result, torch.Tensor) or result.shape != expected.shape:
            return False
        slack = slack.cpu() if isinstance(slack, torch.Tensor) else slack
        return bool(((result.double().cpu() - expected.double().cpu()).abs() <= slack).all())
    if isinstance(expected, list) and expected and isinstance(expected[0], torch.Tensor):
        return len(result) == len(expected) and all(same(r, e) for r, e in zip(result, expected))
    return result == expected


class Demo:
    """Runs demos and keeps score. ``inputs[q]`` is rank q's starting tensor (known on every rank)."""

    def __init__(self, ctx, numel, dtype, only, corrupt):
        self.ctx, self.numel, self.dtype, self.only, self.corrupt = ctx, numel, dtype, only, corrupt
        self.inputs = [rank_input(q, numel, dtype, ctx.device) for q in range(ctx.world_size)]
        self.passed, self.failed, self.skipped = [], [], []

    def run(self, name, meaning, before, collective, expected, sums=None):
        """``collective()`` performs the operation on this rank and returns what this rank holds after.

        ``sums``: ``"sum"`` or ``"avg"`` when the result is an arithmetic reduction, compared within
        :func:`rounding_slack`; everything else (MAX, copies, gathers, transposes) must be exact."""
        if self.only and not any(name.startswith(prefix) for prefix in self.only):
            return
        error = None
        with CommCounter() as comm:
            try:
                after = collective()
            except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
                # Unsupported op/dtype combinations fail the same way on every rank, before any data
                # moves, so all ranks skip together instead of one rank waiting forever.
                after, error = None, str(exc).splitlines()[0][:160]
        if name == self.corrupt and self.ctx.rank == self.ctx.world_size - 1 and isinstance(after, torch.Tensor):
            after = after.clone()
            after.view(-1)[0] += 1  # a simulated bit of silent corruption
        slack = rounding_slack(self.dtype, self.ctx.world_size, expected, sums) if sums else 0.0
        ok = error is None and same(after, expected, slack)
        stats = comm.summary()
        row = (fmt(before), fmt(after), ok, error, fmt(expected))
        rows = [None] * self.ctx.world_size
        dist.gather_object(row, rows if self.ctx.is_main else None, dst=ROOT)
        if not self.ctx.is_main:
            return
        print(f"\n== {name}: {meaning}")
        width = max(len(r[0]) for r in rows)
        for rank, (b, a, _, _, _) in enumerate(rows):
            print(f"   rank {rank}: {b:<{width}}  ->  {a}")
        errors = {r[3] for r in rows if r[3]}
        bad = [rank for rank, r in enumerate(rows) if not r[2]]
        wire = ", ".join(f"{c} {s['bytes']:.0f} B payload / {s['bus_bytes']:.0f} B on the wire per rank"
                         for c, s in stats.items() if c != "barrier")
        if errors:
            self.skipped.append(name)
            print(f"   SKIP {name}: not supported by {self.ctx.backend} with {self.dtype}: {errors.pop()}")
        elif bad:
            self.failed.append(name)
            for rank in bad:
                print(f"   FAIL {name}: rank {rank} holds {rows[rank][1]}, expected {rows[rank][4]}")
        else:
            self.passed.append(name)
            print(f"   PASS {name}" + (f" ({wire})" if wire else ""))


def local_sum(demo):
    """The element-wise sum of every rank's input, in float64 rounded once: what a SUM must give."""
    return sum(t.double() for t in demo.inputs).to(demo.dtype)


def all_reduce_demos(demo):
    """all_reduce with SUM, AVG and MAX: every rank ends with the same reduction."""
    x, r, n, dtype = demo.inputs, demo.ctx.rank, demo.ctx.world_size, demo.dtype
    total = local_sum(demo)

    def all_reduce(op):
        t = x[r].clone()
        dist.all_reduce(t, op=op)  # in place: every rank's buffer becomes the reduction
        return t

    demo.run("all_reduce(SUM)", "every rank ends with the element-wise sum (DDP's gradient sync)",
             x[r], lambda: all_reduce(dist.ReduceOp.SUM), total, sums="sum")
    demo.run("all_reduce(AVG)", "the element-wise mean, on every rank",
             x[r], lambda: all_reduce(dist.ReduceOp.AVG), (total.double() / n).to(dtype), sums="avg")
    demo.run("all_reduce(MAX)", "the element-wise maximum, on every rank",
             x[r], lambda: all_reduce(dist.ReduceOp.MAX), torch.stack(x).amax(0))


def rooted_demos(demo):
    """broadcast (the root's buffer to everyone) and reduce (everyone's sum to the root)."""
    x, r = demo.inputs, demo.ctx.rank

    def broadcast():
        t = x[r].clone()
        dist.broadcast(t, src=ROOT)  # the root's buffer overwrites everyone's
        return t
    demo.run("broadcast", f"rank {ROOT}'s tensor is copied to every rank (initial weights)",
             x[r], broadcast, x[ROOT])

    def reduce():
        t = x[r].clone()
        dist.reduce(t, dst=ROOT, op=dist.ReduceOp.SUM)
        return t
    demo.run("reduce(SUM)", f"the sum lands on rank {ROOT} only (other buffers are scratch)",
             x[r], reduce, local_sum(demo) if r == ROOT else None, sums="sum")


def all_gather_demos(demo):
    """all_gather into a list of tensors, then into one flat buffer."""
    x, r, n = demo.inputs, demo.ctx.rank, demo.ctx.world_size

    def all_gather_list():
        out = [torch.empty_like(x[r]) for _ in range(n)]
        dist.all_gather(out, x[r])
        return out
    demo.run("all_gather(list)", "every rank receives every rank's tensor, in rank order",
             x[r], all_gather_list, x)

    def all_gather_tensor():
        out = torch.empty(n * demo.numel, dtype=demo.dtype, device=demo.ctx.device)
        dist.all_gather_single(out, x[r])  # one flat buffer: what FSDP gathers parameters into
        return out
    demo.run("all_gather_single", "the same, into one flat buffer (FSDP's parameter gather)",
             x[r], all_gather_tensor, torch.cat(x))


def rank_chunks(demo):
    """Rank q's input cut into n chunks for reduce-scatter and scatter: chunk c of rank q = (c+1) x[q]."""
    x, n = demo.inputs, demo.ctx.world_size
    return [[x[q] * (c + 1) for c in range(n)] for q in range(n)]


def reduce_scatter_demos(demo, chunks):
    """reduce_scatter from a list of chunks, then from one flat buffer."""
    # reduce-scatter: rank q's input is n chunks; rank r receives the sum over ranks of chunk r.
    x, r, n = demo.inputs, demo.ctx.rank, demo.ctx.world_size
    chunk_sum = [sum(chunks[q][c].double() for q in range(n)).to(demo.dtype) for c in range(n)]

    def reduce_scatter_list():
        out = torch.empty_like(x[r])
        dist.reduce_scatter(out, [c.clone() for c in chunks[r]], op=dist.ReduceOp.SUM)
        return out
    demo.run("reduce_scatter(list)", "chunk c of every rank is summed onto rank c (ZeRO/FSDP grads)",
             chunks[r], reduce_scatter_list, chunk_sum[r], sums="sum")

    def reduce_scatter_tensor():
        out = torch.empty_like(x[r])
        dist.reduce_scatter_single(out, torch.cat(chunks[r]), op=dist.ReduceOp.SUM)
        return out
    demo.run("reduce_scatter_single", "the same from one flat buffer (FSDP's gradient reduce-scatter)",
             torch.cat(chunks[r]), reduce_scatter_tensor, chunk_sum[r], sums="sum")


def gather_scatter_demos(demo, chunks):
    """gather (every rank's tensor to the root) and scatter (one chunk of the root's list to each rank)."""
    x, r, n = demo.inputs, demo.ctx.rank, demo.ctx.world_size

    def gather():
        out = [torch.empty_like(x[r]) for _ in range(n)] if r == ROOT else None
        dist.gather(x[r], gather_list=out, dst=ROOT)
        return out
    demo.run("gather", f"rank {ROOT} receives every rank's tensor (collecting metrics)",
             x[r], gather, x if r == ROOT else None)

    def scatter():
        out = torch.empty_like(x[r])
        dist.scatter(out, scatter_list=chunks[ROOT] if r == ROOT else None, src=ROOT)
        return out
    demo.run("scatter", f"rank {ROOT} hands chunk c of its list to rank c (sharding a dataset index)",
             chunks[r] if r == ROOT else None, scatter, chunks[ROOT][r])


def all_to_all_demos(demo):
    """all_to_all_single with equal blocks, then with a different block size per pair of ranks."""
    r, n, dtype, dev = demo.ctx.rank, demo.ctx.world_size, demo.dtype, demo.ctx.device

    # all-to-all: rank s sends block d of its input to rank d -- a transpose of the (s, d) blocks.
    def block(src, dst, size):
        return torch.full((size,), 10 * src + dst, dtype=dtype, device=dev)
    even = [torch.cat([block(s, d, 2) for d in range(n)]) for s in range(n)]

    def all_to_all_even():
        out = torch.empty_like(even[r])
        dist.all_to_all_single(out, even[r])
        return out
    demo.run("all_to_all(even)", "block d of rank s goes to rank d (MoE token dispatch; 10s+d marks it)",
             even[r], all_to_all_even, torch.cat([block(s, r, 2) for s in range(n)]))

    def uneven_size(src, dst):  # how many elements rank src sends to rank dst
        return 1 + (src + 2 * dst) % 3

    def all_to_all_uneven():
        send = torch.cat([block(r, d, uneven_size(r, d)) for d in range(n)])
        out_splits = [uneven_size(s, r) for s in range(n)]  # each pair agrees on the block size
        out = torch.empty(sum(out_splits), dtype=dtype, device=dev)
        dist.all_to_all_single(out, send, output_split_sizes=out_splits,
                               input_split_sizes=[uneven_size(r, d) for d in range(n)])
        return out
    demo.run("all_to_all(uneven)", "the same with a different block size per (sender, receiver) pair",
             torch.cat([block(r, d, uneven_size(r, d)) for d in range(n)]), all_to_all_uneven,
             torch.cat([block(s, r, uneven_size(s, r)) for s in range(n)]))


def barrier_demo(demo):
    """barrier: the last rank arrives late, and nobody leaves before it."""
    r, n = demo.ctx.rank, demo.ctx.world_size

    def barrier():
        dist.barrier()  # everyone leaves together ...
        start = time.perf_counter()
        if r == n - 1:
            time.sleep(0.3)  # ... then the last rank is late for the next barrier
        dist.barrier()
        return round(time.perf_counter() - start >= 0.25)  # nobody leaves before the late rank arrives
    demo.run("barrier", f"no rank passes until all arrive (rank {n - 1} arrives 0.3 s late; "
             "1 = this rank waited for it)", None, barrier, 1)


def objects_demo(demo, dtype_name):
    """broadcast_object_list and all_gather_object: picklable Python objects instead of tensors."""
    r, n = demo.ctx.rank, demo.ctx.world_size

    def objects():
        config = [{"lr": 3e-4, "run": "demo"} if r == ROOT else None]
        dist.broadcast_object_list(config, src=ROOT)  # pickled, sent as bytes
        names = [None] * n
        dist.all_gather_object(names, f"rank{r}:{dtype_name}")
        return (config[0]["run"], names[-1])
    demo.run("objects", "broadcast_object_list + all_gather_object move picklable Python objects",
             None, objects, ("demo", f"rank{n - 1}:{dtype_name}"))


def main():
    """Every collective in turn, each with its check, in the order the README teaches them."""
    args = parse_args()
    with distributed(args) as ctx:
        n, dev = ctx.world_size, ctx.device
        demo = Demo(ctx, args.numel, DTYPES[args.dtype], args.only, args.corrupt)
        if ctx.is_main:
            print(f"world size {n} | backend {ctx.backend} | device {dev.type} | dtype {args.dtype} "
                  f"| rank r starts with [10r, 10r+1, ...]")
        all_reduce_demos(demo)
        rooted_demos(demo)
        all_gather_demos(demo)
        chunks = rank_chunks(demo)
        reduce_scatter_demos(demo, chunks)
        gather_scatter_demos(demo, chunks)
        all_to_all_demos(demo)
        barrier_demo(demo)
        objects_demo(demo, args.dtype)

        if ctx.is_main:
            print(f"\n{len(demo.passed)} passed, {len(demo.failed)} failed, {len(demo.skipped)} skipped "
                  f"(not supported here) on {n} ranks ({ctx.backend}, {dev.type})")
        verdict = [demo.failed]  # only rank 0 judged; every rank must agree on the exit code
        dist.broadcast_object_list(verdict, src=ROOT)
    if verdict[0]:
        if launched_rank() == 0:
            print(f"error: {len(verdict[0])} collective(s) gave a wrong result: {', '.join(verdict[0])}",
                  file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
