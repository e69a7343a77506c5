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

Output: a table per collective in the nccl-tests layout, one JSON record per collective (the
harness's record, ``distkit.harness.make_record``: command, machine, torch version; plus the
collective, its rows and the run's start time) and a PNG of busbw vs size stamped with device,
backend and world size. With several GPUs (or ``--p2p-matrix``) also a send/recv bandwidth matrix
between every pair of ranks. ``readme_figures`` redraws the README's plot and tables from the
committed record ``records/bandwidth_cpu_gloo_4ranks.jsonl`` (``python -m distkit.records render
04-nccl-operations``).

    torchrun --standalone --nproc_per_node=4 04-nccl-operations/bandwidth_test.py
    torchrun --standalone --nproc_per_node=8 04-nccl-operations/bandwidth_test.py --max-bytes 8G
"""
from __future__ import annotations

import sys
import time
from argparse import ArgumentTypeError, BooleanOptionalAction
from pathlib import Path

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.flags import non_negative_int, positive_int
from distkit.harness import append_record, bus_factor, machine_info, make_record, read_records
from distkit.paths import check_outputs
from distkit.records import machine_label, save_figure

COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "sendrecv"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
CHECK_SLICE = 2**24  # elements compared at a time by the #wrong check (bounds its extra memory)
README_RECORD = Path(__file__).resolve().parent / "records" / "bandwidth_cpu_gloo_4ranks.jsonl"


def factor(collective: str, n: int) -> float:
    """busbw / algbw for ``collective`` on ``n`` ranks (the harness calls sendrecv's factor "send")."""
    return bus_factor("send" if collective == "sendrecv" else collective, n)


def byte_size(text: str) -> int:
    """argparse type: a message size of at least one byte, written like 4096, 64K, 64M or 2G (nccl-tests
    style: K, M, G are powers of 1024)."""
    number = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = number[-1] if number and number[-1] in UNITS else ""
    try:
        size = int(float(number[:len(number) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise ArgumentTypeError(f"{text!r}: write bytes like 4096, 64K, 64M or 2G") from None
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
    add = parser.add_argument
    add("--collectives", nargs="+", choices=COLLECTIVES, default=COLLECTIVES,
        help="which collectives to test (default: all)")
    add("--min-bytes", type=byte_size, default="1K", help="smallest message, e.g. 1K (default: 1K)")
    add("--max-bytes", type=byte_size, default=None, help="largest message (default: 16M on CPU; on GPU 4G, or "
        "less when the GPU with the least free memory is short of it)")
    add("--step-factor", type=step_factor, default=None,
        help="multiply the size by this between rows (default: 4 on CPU, 2 on GPU)")
    add("--iters", type=positive_int, default=20, help="timed iterations per size (default: 20)")
    add("--warmup-iters", type=non_negative_int, default=5, help="untimed iterations before (default: 5)")
    add("--dtype", choices=sorted(DTYPES), default="float32", help="element type (default: float32)")
    add("--p2p-matrix", action=BooleanOptionalAction, default=None, help="also measure send/recv bandwidth "
        "between every pair of ranks (default: on when there are several GPUs)")
    add("--p2p-bytes", type=byte_size, default=None, help="message size of the pair matrix (default: 4M CPU, 256M GPU)")
    add("--results", default="runs/bandwidth.jsonl",
        help="JSON-lines file the records are appended to (default: runs/bandwidth.jsonl)")
    add("--plot", default=None, help="PNG of busbw vs size (default: runs/bandwidth_<device>_<backend>_<n>ranks.png)")
    add_runtime_args(parser)
    return parser.parse_args()


def size_sweep(args, ctx, elem):
    """The message sizes in bytes, each a whole number of elements divisible by the world size."""
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
    top, low, step = int(agreed.item()), args.min_bytes, args.step_factor or (2 if gpu else 4)
    if top < low:
        where = "--max-bytes" if args.max_bytes is not None else "the size the GPU memory allows"
        raise UsageError(f"--min-bytes ({low} B) is larger than {where} ({top} B)")
    unit, sizes = elem * ctx.world_size, []
    while low <= top:
        aligned = max(unit, low // unit * unit)
        if aligned not in sizes:
            sizes.append(aligned)
        low *= step
    return sizes


def make_case(collective, count, dtype, ctx):
    """The call to time, and a function returning #wrong after one run on fresh data.

    Rank q's input element i is (q+1) * pattern[i] with pattern = 1..7 repeating, so every result is
    a small integer multiple of the pattern. Everything is built in ``dtype`` on ``ctx.device``: an
    int64 index vector of ``count`` elements would take 2-8x the message on the GPU. A case holds the
    pattern, the collective's buffers and, while checking, one expected result: about 4-5x the message.
    """
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    block, total, left = count // n, n * (n + 1) // 2, (r - 1) % n  # total: sum over ranks of (q+1)
    pattern = torch.arange(1, 8, dtype=dtype, device=dev).repeat(-(-count // 7))[:count]
    mine = pattern[r * block:(r + 1) * block]  # the pattern at this rank's block position
    empty = lambda numel: torch.empty(numel, dtype=dtype, device=dev)  # noqa: E731
    inp = empty(block if collective == "all_gather" else count)  # in place: inp is also the result
    out = inp if collective in ("all_reduce", "broadcast", "reduce") else empty(
        block if collective == "reduce_scatter" else count)

    def by_block(source):
        """n blocks, block q = source(q) x (q+1), computed exactly as rank q computes its input."""
        result = empty(count)
        for q in range(n):
            torch.mul(source(q), q + 1, out=result[q * block:(q + 1) * block])
        return result

    def sendrecv():  # everyone sends to the right and receives from the left at once
        ops = [dist.P2POp(dist.isend, inp, (r + 1) % n), dist.P2POp(dist.irecv, out, left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    call = {"all_reduce": lambda: dist.all_reduce(inp), "all_gather": lambda: dist.all_gather_single(out, inp),
            "reduce_scatter": lambda: dist.reduce_scatter_single(out, inp),
            "all_to_all": lambda: dist.all_to_all_single(out, inp), "broadcast": lambda: dist.broadcast(inp, src=0),
            "reduce": lambda: dist.reduce(inp, dst=0), "sendrecv": sendrecv}[collective]
    # What this rank must hold afterwards, by the collective's definition:
    expected = {"all_reduce": lambda: pattern * total,
                # output block q came from rank q: the pattern there times (q+1)
                "all_gather": lambda: by_block(lambda q: pattern[q * block:(q + 1) * block]),
                "reduce_scatter": lambda: mine * total,
                # block s of the output is block r of rank s's input: this rank's pattern block times (s+1)
                "all_to_all": lambda: by_block(lambda s: mine),
                "broadcast": lambda: pattern,
                "reduce": (lambda: pattern * total) if r == 0 else None,  # only the root's buffer is defined
                "sendrecv": lambda: pattern * (left + 1)}[collective]
    rtol = summation_rtol(dtype, n) if collective in REDUCING else 0.0

    def wrong():
        torch.mul(mine if collective == "all_gather" else pattern, r + 1, out=inp)
        call()
        return 0 if expected is None else count_wrong(out, expected(), rtol)
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
    n, elem, rows = ctx.world_size, dtype.itemsize, []
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
        rows.append({"size_bytes": size, "count": size // elem, "time_us": seconds * 1e6, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * factor(collective, n), "wrong": bad})
    return rows


def print_table(collective, rows, ctx, args):
    redop = "sum" if collective in REDUCING else "none"
    root = "0" if collective in ("broadcast", "reduce") else "-1"
    print(f"\n# {collective} | {ctx.world_size} ranks | {ctx.backend} on {ctx.device.type} | {args.dtype} "
          f"| {args.warmup_iters} warm-up + {args.iters} timed iterations | bus factor "
          f"{factor(collective, ctx.world_size):.4f}")
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
        for dst in (d for d in range(n) if d != src):
            call = {src: lambda: dist.send(buf, dst=dst), dst: lambda: dist.recv(buf, src=src)}.get(
                r, lambda: None)  # idle ranks only join the barrier
            seconds = timed(call, ctx, args.iters, args.warmup_iters)
            if r == dst:
                matrix[src, dst] = size / seconds / 1e9
    dist.all_reduce(matrix)  # each entry was filled by exactly one rank
    if ctx.is_main:
        print(f"\n# send/recv bandwidth matrix, GB/s (row: sender, column: receiver), {size} B messages")
        print("       " + "".join(f"{f'rank {j}':>9}" for j in range(n)))
        for i in range(n):
            print(f"rank {i:<2}" + "".join(f"{'-' if i == j else f'{matrix[i, j]:.2f}':>9}" for j in range(n)))
    return matrix.cpu().tolist()


def human_size(size: float) -> str:
    unit = next((u for u in ("G", "M", "K") if size >= UNITS[u]), "")
    return f"{size / UNITS[unit]:g}{unit}"


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
    ax.set(xlabel="message size (bytes, nccl-tests definition)", ylabel="bus bandwidth (GB/s)")
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
    return [r for r in records if r.get("run_started") == records[-1].get("run_started")]


def readme_figures(out_dir):
    """The README's plot and tables, from the committed record of a sweep (``distkit.records`` render
    mark): busbw vs size as a PNG, then time per call and busbw per size for every collective."""
    records = last_sweep(README_RECORD)
    first, name = records[0], README_RECORD.with_suffix(".png").name
    save_figure(draw(records), Path(out_dir) / name)

    def table(field, fmt):
        lines = ["| size | " + " | ".join(f"`{r['collective']}`" for r in records) + " |",
                 "|---:|" + "---:|" * len(records)]
        lines += [f"| {human_size(row['size_bytes'])} | " + " | ".join(fmt(r["rows"][i][field]) for r in records)
                  + " |" for i, row in enumerate(first["rows"])]
        return "\n".join(lines) + "\n"
    where, cfg = machine_label(first["machine"], first["backend"]), first["config"]
    rel = README_RECORD.relative_to(README_RECORD.parent.parent)
    caption = (f"<sub>Measured on {where}, {first['world_size']} ranks, {cfg['dtype']}, {cfg['warmup_iters']} "
               f"warm-up + {cfg['iters']} timed calls per size, torch {first['torch_version']}, "
               f"{first['timestamp'][:10]}: [{rel}]({rel}), from `{first['command']}` "
               "(launched with torchrun).</sub>\n")
    return (f"![busbw vs message size, {where}, {first['world_size']} ranks]({name})\n\n"
            f"Time per call (µs, mean over ranks):\n\n{table('time_us', lambda v: f'{v:,.0f}')}\n"
            f"busbw (GB/s):\n\n{table('busbw_GBps', lambda v: f'{v:.3g}')}\n{caption}")


def main():
    args = parse_args()
    dtype = DTYPES[args.dtype]
    with distributed(args) as ctx:
        n, cuda = ctx.world_size, ctx.device.type == "cuda"
        args.plot = args.plot or f"runs/bandwidth_{ctx.device.type}_{ctx.backend}_{n}ranks.png"
        check_outputs(ctx, args, files=["results", "plot"])
        sizes = size_sweep(args, ctx, dtype.itemsize)
        if ctx.is_main:
            print(f"# bandwidth test | {n} ranks | backend {ctx.backend} | {machine_info(ctx.device)['device_name']} "
                  f"| sizes {sizes[0]} B .. {sizes[-1]} B ({len(sizes)} sizes)")
        # One record per collective, in the harness's schema; run_started tells one run's records from the next.
        run_started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        config = {"dtype": args.dtype, "iters": args.iters, "warmup_iters": args.warmup_iters,
                  "timer": "cuda_events" if cuda else "perf_counter"}
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
            busbw = [r["busbw_GBps"] for r in rows]
            records.append(make_record(
                ctx, f"bandwidth_{collective}", config={**config, "bus_factor": factor(collective, n)},
                metrics={"peak_busbw_GBps": max(busbw), "avg_busbw_GBps": sum(busbw) / len(busbw),
                         "wrong": sum(r["wrong"] for r in rows)},
                extra={"collective": collective, "run_started": run_started, "rows": rows}))
            append_record(args.results, records[-1])

        if (args.p2p_matrix if args.p2p_matrix is not None else cuda) and n > 1:
            size = args.p2p_bytes or (256 if cuda else 4) * 2**20
            matrix = p2p_matrix(ctx, size, args)
            if ctx.is_main:
                append_record(args.results, make_record(
                    ctx, "bandwidth_p2p_matrix", config={**config, "size_bytes": size},
                    metrics={"min_GBps": min(v for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j)},
                    extra={"run_started": run_started, "matrix_GBps": matrix}))

        if ctx.is_main and records:
            save_figure(draw(records), args.plot)
            print(f"\n# {len(records)} collectives, {wrong} wrong elements | records appended to {args.results} "
                  f"| plot {args.plot}")

    if wrong:  # like nccl-tests, a data error fails the run whatever the speed
        if ctx.is_main:
            print(f"error: {wrong} elements differed from the collective's definition", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
