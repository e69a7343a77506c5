"""Chapter 04: a bandwidth test for every collective, reported the way nccl-tests reports it.

For each collective and each message size: warm-up iterations, a barrier, timed iterations (CUDA
events on GPU, ``time.perf_counter`` on CPU), the time averaged over ranks, then

* ``algbw = size / time``, with *size* the total buffer as nccl-tests defines it (the gathered output
  of all_gather, the full input of reduce_scatter, the whole send buffer of all_to_all);
* ``busbw = algbw x factor``: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
  broadcast, reduce, sendrecv 1 (``distkit.harness.bus_factor``, the same definition the harness uses
  to count bytes). busbw is comparable with the link speed whatever the collective and rank count;
* ``#wrong``: elements that differ from the definition in a separate, untimed run on fresh data
  (exactly; for sums whose partial results a low-precision dtype cannot hold exactly, beyond the
  rounding that summation order allows).

Output: a table per collective in the nccl-tests layout, one JSON record per collective (through the
harness's ``append_record``, with the command, machine, torch version and the run's start time) and a
PNG of busbw vs size stamped with device, backend and world size. With several GPUs (or
``--p2p-matrix``) also a send/recv bandwidth matrix between every pair of ranks. ``readme_figures``
redraws the README's plot and tables from the committed record ``records/bandwidth_cpu_gloo_4ranks.jsonl``
(``python -m distkit.records render 04-nccl-operations``).

    torchrun --standalone --nproc_per_node=4 04-nccl-operations/bandwidth_test.py
    torchrun --standalone --nproc_per_node=8 04-nccl-operations/bandwidth_test.py --max-bytes 8G
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from argparse import ArgumentTypeError, BooleanOptionalAction
from pathlib import Path

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.flags import non_negative_int, positive_int
from distkit.harness import append_record, bus_factor, machine_info, read_records
from distkit.records import SCHEMA_VERSION, machine_label, save_figure

COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "sendrecv"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
HARNESS_NAME = {"sendrecv": "send"}  # distkit.harness names the point-to-point factor "send"
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
CHECK_SLICE = 2**24  # elements compared at a time by the #wrong check (bounds its extra memory)
README_RECORD = Path(__file__).resolve().parent / "records" / "bandwidth_cpu_gloo_4ranks.jsonl"


def parse_size(text: str) -> int:
    """'64M' -> 67108864 (nccl-tests style: K, M, G are powers of 1024); None when unreadable."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in UNITS else ""
    try:
        return int(float(text[:len(text) - len(unit)]) * UNITS[unit])
    except ValueError:
        return None


def byte_size(text: str) -> int:
    """argparse type: a message size of at least one byte, written like 4096, 64K, 64M or 2G."""
    size = parse_size(text)
    if size is None:
        raise ArgumentTypeError(f"{text!r}: write bytes like 4096, 64K, 64M or 2G")
    if size < 1:
        raise ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def step_factor(text: str) -> int:
    """argparse type: the factor between consecutive sizes, an integer >= 2."""
    value = positive_int(text)
    if value < 2:
        raise ArgumentTypeError(f"must be an integer >= 2, got {value}")
    return value


def parse_args():
    parser = ArgumentParser(description="Sweep message sizes for each collective and report time, algbw, "
                            "busbw (nccl-tests definitions) and wrong elements; write JSON records and a plot.",
                            epilog="example: torchrun --standalone --nproc_per_node=4 04-nccl-operations/"
                                   "bandwidth_test.py --max-bytes 16M")
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=COLLECTIVES,
                        help="which collectives to test (default: all)")
    parser.add_argument("--min-bytes", type=byte_size, default="1K", help="smallest message, e.g. 1K (default: 1K)")
    parser.add_argument("--max-bytes", type=byte_size, default=None,
                        help="largest message (default: 16M on CPU; on GPU 4G, or less when the GPU "
                             "with the least free memory is short of it)")
    parser.add_argument("--step-factor", type=step_factor, default=None,
                        help="multiply the size by this between rows (default: 4 on CPU, 2 on GPU)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed iterations per size (default: 20)")
    parser.add_argument("--warmup-iters", type=non_negative_int, default=5,
                        help="untimed iterations before (default: 5)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="element type (default: float32)")
    parser.add_argument("--p2p-matrix", action=BooleanOptionalAction, default=None,
                        help="also measure send/recv bandwidth between every pair of ranks "
                             "(default: on when there are several GPUs)")
    parser.add_argument("--p2p-bytes", type=byte_size, default=None,
                        help="message size of the pair matrix (default: 4M CPU, 256M GPU)")
    parser.add_argument("--results", default="runs/bandwidth.jsonl",
                        help="JSON-lines file the records are appended to (default: runs/bandwidth.jsonl)")
    parser.add_argument("--plot", default=None,
                        help="PNG of busbw vs size (default: runs/bandwidth_<device>_<backend>_<n>ranks.png)")
    add_runtime_args(parser)
    return parser.parse_args()


def size_sweep(args, ctx, elem):
    """The message sizes in bytes, each a whole number of elements divisible by the world size.

    Every rank gets the same list: the largest size is agreed on by all ranks (see below)."""
    gpu = ctx.device.type == "cuda"
    if args.max_bytes is not None:
        top = args.max_bytes
    elif gpu:  # a few GiB; a case holds about 5 buffers of the message size (make_case): stay under 1/6
        top = min(4 * 2**30, torch.cuda.mem_get_info(ctx.device)[0] // 6)
    else:  # the bandwidth regime starts at a few MiB on CPU; larger sizes only take longer
        top = 16 * 2**20
    # Each rank read its own GPU's free memory, which differs from GPU to GPU (other processes, NCCL's
    # buffers). Ranks with different size lists would soon call different collectives and hang, so
    # they agree on the smallest limit.
    agreed = torch.tensor([top], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    top = int(agreed.item())
    low, factor = args.min_bytes, args.step_factor or (2 if gpu else 4)
    if top < low:
        where = "--max-bytes" if args.max_bytes is not None else "the size the GPU memory allows"
        raise UsageError(f"--min-bytes ({low} B) is larger than {where} ({top} B)")
    unit = elem * ctx.world_size
    sizes, size = [], low
    while size <= top:
        aligned = max(unit, size // unit * unit)
        if aligned not in sizes:
            sizes.append(aligned)
        size *= factor
    return sizes


def make_case(collective, count, dtype, ctx):
    """Buffers, the call to time, and a function returning #wrong after one run on fresh data.

    Rank q's input element i is (q+1) * pattern[i] with pattern = 1..7 repeating, so every result is
    a small integer multiple of the pattern. Everything is built in ``dtype`` on ``ctx.device``: an
    int64 index vector of ``count`` elements would take 2-8x the message on the GPU. A case holds the
    pattern, the collective's buffers and, while checking, one expected result: about 4-5x the message.
    """
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    block = count // n
    pattern = torch.arange(1, 8, dtype=dtype, device=dev).repeat(-(-count // 7))[:count]
    mine = pattern[r * block:(r + 1) * block]  # the pattern at this rank's block position

    def by_block(source):
        """n blocks, block q = source(q) x (q+1), computed exactly as rank q computes its input."""
        out = torch.empty(count, dtype=dtype, device=dev)
        for q in range(n):
            torch.mul(source(q), q + 1, out=out[q * block:(q + 1) * block])
        return out
    total = n * (n + 1) // 2  # sum over ranks of (q+1)
    right, left = (r + 1) % n, (r - 1) % n

    if collective == "all_reduce":
        buf = torch.empty(count, dtype=dtype, device=dev)
        call = lambda: dist.all_reduce(buf)  # noqa: E731
        fill, result, expected = lambda: torch.mul(pattern, r + 1, out=buf), lambda: buf, lambda: pattern * total
    elif collective == "all_gather":
        inp, out = torch.empty(block, dtype=dtype, device=dev), torch.empty(count, dtype=dtype, device=dev)
        call = lambda: dist.all_gather_single(out, inp)  # noqa: E731
        fill, result = lambda: torch.mul(mine, r + 1, out=inp), lambda: out
        # output block q came from rank q: the pattern there times (q+1)
        expected = lambda: by_block(lambda q: pattern[q * block:(q + 1) * block])  # noqa: E731
    elif collective == "reduce_scatter":
        inp, out = torch.empty(count, dtype=dtype, device=dev), torch.empty(block, dtype=dtype, device=dev)
        call = lambda: dist.reduce_scatter_single(out, inp)  # noqa: E731
        fill, result = lambda: torch.mul(pattern, r + 1, out=inp), lambda: out
        expected = lambda: mine * total  # noqa: E731
    elif collective == "all_to_all":
        inp, out = torch.empty(count, dtype=dtype, device=dev), torch.empty(count, dtype=dtype, device=dev)
        call = lambda: dist.all_to_all_single(out, inp)  # noqa: E731
        fill, result = lambda: torch.mul(pattern, r + 1, out=inp), lambda: out
        # block s of the output is block r of rank s's input: this rank's pattern block times (s+1)
        expected = lambda: by_block(lambda s: mine)  # noqa: E731
    elif collective in ("broadcast", "reduce"):
        buf = torch.empty(count, dtype=dtype, device=dev)
        call = (lambda: dist.broadcast(buf, src=0)) if collective == "broadcast" else (lambda: dist.reduce(buf, dst=0))
        fill, result = lambda: torch.mul(pattern, r + 1, out=buf), lambda: buf
        if collective == "broadcast":
            expected = lambda: pattern  # noqa: E731
        else:  # only the root's buffer is defined
            expected = (lambda: pattern * total) if r == 0 else None
    else:  # sendrecv: everyone sends to the right and receives from the left at once
        inp, out = torch.empty(count, dtype=dtype, device=dev), torch.empty(count, dtype=dtype, device=dev)

        def call():
            ops = [dist.P2POp(dist.isend, inp, right), dist.P2POp(dist.irecv, out, left)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        fill, result, expected = lambda: torch.mul(pattern, r + 1, out=inp), lambda: out, lambda: pattern * (left + 1)

    rtol = summation_rtol(dtype, n) if collective in REDUCING else 0.0

    def wrong():
        fill()
        call()
        if expected is None:
            return 0
        return count_wrong(result(), expected(), rtol)
    return call, wrong


def summation_rtol(dtype, n):
    """Relative error a correct sum over ``n`` ranks may show in ``dtype`` (0: it must be exact).

    The largest partial sum is 7 x (1+2+...+n). While that is an integer the dtype holds exactly
    (up to 2/eps: 2^24 in float32, 2^11 in float16, 2^8 in bfloat16) every order of summation gives
    the exact result. Beyond it -- bfloat16 from 9 ranks, float16 from 24 -- each of the n-1 additions
    may round by half an ulp, in an order the library picks (ring, tree, NVLS), and the expected value
    is rounded once more: n x eps bounds both.
    """
    eps = torch.finfo(dtype).eps
    return 0.0 if 7 * n * (n + 1) // 2 <= 2 / eps else n * eps


def count_wrong(result, expected, rtol):
    """Elements of ``result`` that differ from ``expected`` (by more than ``rtol`` relative when it is
    not 0), compared a slice at a time so the check needs little memory beyond the two buffers."""
    bad = torch.zeros((), dtype=torch.int64, device=result.device)
    for got, want in zip(result.split(CHECK_SLICE), expected.split(CHECK_SLICE)):
        if rtol == 0:
            bad += (got != want).sum()
        else:
            got, want = got.double(), want.double()
            bad += ((got - want).abs() > rtol * want.abs()).sum()
    return int(bad.item())


def timed(call, ctx, iters, warmup):
    """Average seconds per call on this rank: warm-up, a barrier, then ``iters`` back-to-back calls."""
    for _ in range(warmup):
        call()
    dist.barrier()  # everyone starts the timed loop together, so nobody times a peer's lateness
    if ctx.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(ctx.device)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - begin) / iters


def run_collective(collective, sizes, args, ctx, dtype):
    """Rows of the sweep for one collective (or None when the backend cannot run it)."""
    n, elem = ctx.world_size, dtype.itemsize
    rows = []
    for size in sizes:
        try:
            call, wrong = make_case(collective, size // elem, dtype, ctx)
            seconds = timed(call, ctx, args.iters, args.warmup_iters)
            bad = wrong()
            call = wrong = None  # free this size's buffers before the next, larger one is allocated
        except torch.OutOfMemoryError:
            # Only this rank may have run out: carrying on would leave the others waiting in a
            # collective it never joins. End the job with one line instead.
            raise UsageError(f"{collective}: out of memory at {size} B messages; pass a smaller "
                             "--max-bytes", every_rank=False) from None
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            # e.g. a dtype this backend cannot reduce: every rank fails alike before sending anything
            if ctx.is_main:
                print(f"# {collective}: not supported by {ctx.backend} with {args.dtype}: "
                      f"{str(exc).splitlines()[0][:120]}")
            return None
        totals = torch.tensor([seconds, bad], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(totals)  # time: average over ranks; #wrong: summed over ranks
        seconds, bad = totals[0].item() / n, int(totals[1].item())
        algbw = size / seconds / 1e9
        rows.append({"size_bytes": size, "count": size // elem, "time_us": seconds * 1e6,
                     "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(HARNESS_NAME.get(collective, collective), n), "wrong": bad})
    return rows


def print_table(collective, rows, ctx, args):
    redop = "sum" if collective in ("all_reduce", "reduce_scatter", "reduce") else "none"
    root = "0" if collective in ("broadcast", "reduce") else "-1"
    print(f"\n# {collective} | {ctx.world_size} ranks | {ctx.backend} on {ctx.device.type} | {args.dtype} "
          f"| {args.warmup_iters} warm-up + {args.iters} timed iterations | bus factor "
          f"{bus_factor(HARNESS_NAME.get(collective, collective), ctx.world_size):.4f}")
    print(f"#{'size':>11} {'count':>13} {'type':>9} {'redop':>7} {'root':>7} {'time':>10} {'algbw':>8} "
          f"{'busbw':>8} {'#wrong':>7}")
    print(f"#{'(B)':>11} {'(elements)':>13} {'':>9} {'':>7} {'':>7} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
    for row in rows:
        print(f"{row['size_bytes']:>12} {row['count']:>13} {args.dtype:>9} {redop:>7} {root:>7} "
              f"{row['time_us']:>10.1f} {row['algbw_GBps']:>8.3f} {row['busbw_GBps']:>8.3f} {row['wrong']:>7}")
    print(f"# Avg bus bandwidth    : {sum(r['busbw_GBps'] for r in rows) / len(rows):.4f} GB/s")


def p2p_matrix(ctx, size, args):
    """GB/s of blocking send/recv from rank i to rank j, one pair at a time, measured on the receiver."""
    n, r = ctx.world_size, ctx.rank
    buf = torch.ones(size, dtype=torch.uint8, device=ctx.device)  # bytes: any --p2p-bytes is exact
    matrix = torch.zeros(n, n, dtype=torch.float64, device=ctx.device)
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            if r == src:
                call = lambda: dist.send(buf, dst=dst)  # noqa: E731
            elif r == dst:
                call = lambda: dist.recv(buf, src=src)  # noqa: E731
            else:
                call = lambda: None  # noqa: E731  (idle ranks only join the barrier)
            seconds = timed(call, ctx, args.iters, args.warmup_iters)
            if r == dst:
                matrix[src, dst] = size / seconds / 1e9
    dist.all_reduce(matrix)  # each entry was filled by exactly one rank
    return matrix.cpu()


def human_size(size: float) -> str:
    for unit in ("G", "M", "K"):
        if size >= UNITS[unit]:
            return f"{size / UNITS[unit]:g}{unit}"
    return f"{size:g}"


def draw(records):
    """busbw vs size, one line per collective, drawn from the records alone (same records, same figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    first = records[0]
    fig, ax = plt.subplots(figsize=(8, 5))
    for record in records:
        rows = record["rows"]
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o",
                label=record["collective"])
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["size_bytes"] for r in first["rows"]])  # the measured sizes, not every power of 2
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: human_size(x)))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if all(r["busbw_GBps"] > 0 for record in records for r in record["rows"]):
        ax.set_yscale("log")  # small messages are 100-1000x slower: a linear axis hides them
    ax.set_xlabel("message size (bytes, nccl-tests definition)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"busbw vs size: {machine_label(first['machine'], first['backend'])}, "
                 f"{first['world_size']} ranks, {first['config']['dtype']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, f"{first['machine']['cpu']} | torch {first['torch_version']} | "
             f"{first['timestamp'][:10]} | {first['config']['iters']} iters after "
             f"{first['config']['warmup_iters']} warm-up", fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def last_sweep(path):
    """The collective records of the last run in a results file (records are appended run after run)."""
    records = [r for r in read_records(path) if r.get("collective")]
    if not records:
        raise ValueError(f"{path} holds no bandwidth records")
    run = records[-1].get("run_started")
    return [r for r in records if r.get("run_started") == run]


def readme_figures(out_dir):
    """The README's plot and tables, from the committed record of a sweep (``distkit.records`` render
    mark): busbw vs size as a PNG, then time per call and busbw per size for every collective."""
    records = last_sweep(README_RECORD)
    first = records[0]
    name = README_RECORD.with_suffix(".png").name
    save_figure(draw(records), Path(out_dir) / name)
    sizes = [row["size_bytes"] for row in first["rows"]]
    header = "| size | " + " | ".join(f"`{r['collective']}`" for r in records) + " |\n"
    rule = "|---:|" + "---:|" * len(records) + "\n"

    def table(field, fmt):
        lines = [header, rule]
        for i, size in enumerate(sizes):
            lines.append(f"| {human_size(size)} | " + " | ".join(fmt(r["rows"][i][field]) for r in records) + " |\n")
        return "".join(lines)
    where = machine_label(first["machine"], first["backend"])
    rel = README_RECORD.relative_to(README_RECORD.parent.parent)
    caption = (f"<sub>Measured on {where}, {first['world_size']} ranks, {first['config']['dtype']}, "
               f"{first['config']['warmup_iters']} warm-up + {first['config']['iters']} timed calls per size, "
               f"torch {first['torch_version']}, {first['timestamp'][:10]}: [{rel}]({rel}), from "
               f"`{first['command']}` (launched with torchrun).</sub>\n")
    return (f"![busbw vs message size, {where}, {first['world_size']} ranks]({name})\n\n"
            f"Time per call (µs, mean over ranks):\n\n{table('time_us', lambda v: f'{v:,.0f}')}\n"
            f"busbw (GB/s):\n\n{table('busbw_GBps', lambda v: f'{v:.3g}')}\n{caption}")


def main():
    args = parse_args()
    dtype = DTYPES[args.dtype]
    with distributed(args) as ctx:
        n = ctx.world_size
        sizes = size_sweep(args, ctx, dtype.itemsize)
        machine = machine_info(ctx.device)
        if ctx.is_main:
            print(f"# bandwidth test | {n} ranks | backend {ctx.backend} | {machine['device_name']} "
                  f"| sizes {sizes[0]} B .. {sizes[-1]} B ({len(sizes)} sizes)")
        # provenance for every record of this run; run_started tells one run's records from the next
        command = shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])
        run_started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        records, wrong = [], 0
        for collective in args.collectives:
            if collective == "sendrecv" and n < 2:
                if ctx.is_main:
                    print("# sendrecv: needs at least 2 ranks, skipped")
                continue
            rows = run_collective(collective, sizes, args, ctx, dtype)
            wrong += sum(r["wrong"] for r in rows or [])  # identical on every rank (all-reduced)
            if rows is None or not ctx.is_main:
                continue
            print_table(collective, rows, ctx, args)
            record = {"schema": SCHEMA_VERSION, "command": command, "run_started": run_started,
                      "strategy": f"bandwidth_{collective}", "collective": collective, "world_size": n,
                      "backend": ctx.backend, "device": ctx.device.type, "machine": machine,
                      "torch_version": torch.__version__, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "config": {"dtype": args.dtype, "iters": args.iters, "warmup_iters": args.warmup_iters,
                                 "bus_factor": bus_factor(HARNESS_NAME.get(collective, collective), n), "timer":
                                 "cuda_events" if ctx.device.type == "cuda" else "perf_counter"},
                      "rows": rows,
                      "metrics": {"peak_busbw_GBps": max(r["busbw_GBps"] for r in rows),
                                  "avg_busbw_GBps": sum(r["busbw_GBps"] for r in rows) / len(rows),
                                  "wrong": sum(r["wrong"] for r in rows)}}
            append_record(args.results, record)
            records.append(record)

        want_matrix = args.p2p_matrix if args.p2p_matrix is not None else (ctx.device.type == "cuda" and n > 1)
        if want_matrix and n > 1:
            size = args.p2p_bytes or parse_size("256M" if ctx.device.type == "cuda" else "4M")
            matrix = p2p_matrix(ctx, size, args)
            if ctx.is_main:
                print(f"\n# send/recv bandwidth matrix, GB/s (row: sender, column: receiver), {size} B messages")
                print("       " + "".join(f"{f'rank {j}':>9}" for j in range(n)))
                for i in range(n):
                    print(f"rank {i:<2}" + "".join(f"{'-' if i == j else f'{matrix[i, j]:.2f}':>9}" for j in range(n)))
                append_record(args.results, {
                    "schema": SCHEMA_VERSION, "command": command, "run_started": run_started,
                    "strategy": "bandwidth_p2p_matrix", "world_size": n, "backend": ctx.backend,
                    "device": ctx.device.type, "machine": machine, "torch_version": torch.__version__,
                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "config": {"size_bytes": size, "iters": args.iters}, "matrix_GBps": matrix.tolist()})

        if ctx.is_main and records:
            path = args.plot or f"runs/bandwidth_{ctx.device.type}_{ctx.backend}_{n}ranks.png"
            save_figure(draw(records), path)
            print(f"\n# {len(records)} collectives, {wrong} wrong elements | records appended to {args.results} "
                  f"| plot {path}")

    if wrong:  # like nccl-tests, a data error fails the run whatever the speed
        if ctx.is_main:
            print(f"error: {wrong} elements differed from the collective's definition", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
