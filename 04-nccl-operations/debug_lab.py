"""Chapter 04 debugging lab: three classic distributed failures, each ending on its own in seconds.

    torchrun --standalone --nproc_per_node=4 04-nccl-operations/debug_lab.py --scenario mismatch
    torchrun --standalone --nproc_per_node=4 04-nccl-operations/debug_lab.py --scenario missing-rank
    torchrun --standalone --nproc_per_node=4 04-nccl-operations/debug_lab.py --scenario crash

* ``mismatch``: the last rank calls all_reduce with a different shape than the others. With
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` every collective is first checked across ranks (op, shape, dtype)
  and the job stops with a message naming both sides; without it the same bug returns a silently
  wrong result on some ranks and a timeout on the others.
* ``missing-rank``: the last rank never reaches the all_reduce (stuck elsewhere). The process-group
  timeout ends the wait; ``monitored_barrier`` then names the missing rank.
* ``crash``: the last rank dies in the middle of training. The survivors' next collective fails (the
  peer's sockets closed, or the timeout fired); they wait to be stopped, so torchrun names the dead
  rank and its exit code as the first failure.

The failing collectives of ``missing-rank`` and ``crash`` run on the job's own backend with tensors on
``ctx.device`` (NCCL and GPU tensors on a GPU job). ``mismatch`` and the roll call run on gloo side
groups whatever the backend: a mismatched NCCL all_reduce can read past a buffer, and
``monitored_barrier`` exists only on gloo.

Every scenario exits non-zero on purpose. Each rank also writes ``rank<N>.log`` under ``--log-dir``:
per-rank logs are the first thing to read when one rank misbehaves.
"""
from __future__ import annotations

import datetime
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.logs import setup_logging
from distkit.paths import check_outputs

SCENARIOS = ("mismatch", "missing-rank", "crash")
LAB_TIMEOUT_S = 10


def parse_args():
    parser = ArgumentParser(description="Run a deliberately broken distributed program and watch how it "
                            "ends: a collective mismatch, a missing rank, or a crashing rank.",
                            epilog="example: torchrun --standalone --nproc_per_node=4 04-nccl-operations/"
                                   "debug_lab.py --scenario mismatch")
    parser.add_argument("--scenario", choices=SCENARIOS, required=True, help="which failure to stage")
    parser.add_argument("--log-dir", default="runs/debug_lab", help="per-rank logs go here (default: runs/debug_lab)")
    add_runtime_args(parser, timeout_s=LAB_TIMEOUT_S)  # a lab should fail in seconds, not in 5 minutes
    return parser.parse_args()


def short(exc: BaseException, limit: int = 160) -> str:
    """First line of an error without gloo's source-file prefix, cut at a sentence end near ``limit``."""
    text = re.sub(r"^\[[^\]]*\] ", "", str(exc).splitlines()[0])
    if len(text) > limit:
        text = text[:limit].rsplit(". ", 1)[0] + "."
    return text


def group(timeout_s, debug_level):
    """A new gloo group created under ``debug_level``: DETAIL wraps it in the collective checker."""
    dist.set_debug_level(debug_level)
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def mismatch(ctx, log):
    n, r = ctx.world_size, ctx.rank
    # The bug: one rank's tensor has another shape. (Shorter, not longer: a rank that receives more
    # bytes than its own shape allows makes gloo's transport thread abort the whole process, seen on
    # 2 and 3 ranks, which would end the lab before it can report.)
    numel = 3 if r == n - 1 else 4

    # 1. With DETAIL: before running it, each collective's fingerprint is compared across ranks.
    # CPU tensors on purpose, also on a GPU job: both groups of this scenario are gloo side groups.
    checked = group(ctx.timeout_s, dist.DebugLevel.DETAIL)
    try:
        dist.all_reduce(torch.ones(numel), group=checked)
        detail = "all_reduce returned (not detected?)"
    except RuntimeError as exc:
        text = str(exc)
        ops = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(.*?OpType=(\w+), "
                         r"TensorShape=(\[[^\]]*\])", text)
        detail = ("; ".join(f"rank {rk} runs {op} {shape}" for rk, op, shape in ops)
                  if "Detected mismatch" in text else short(exc))
    log.info(f"DETAIL: {detail}")

    # 2. The same bug without the checker: what you get by default. (Half the timeout, so the ranks
    # that hang here are back before the default group's gather below gives up on them.)
    unchecked = group(ctx.timeout_s / 2, dist.DebugLevel.OFF)
    tensor, start = torch.ones(numel), time.perf_counter()
    try:
        dist.all_reduce(tensor, group=unchecked)
        verdict = "right" if bool((tensor == n).all()) else "WRONG, and nothing complains"
        plain = f"returned {tensor.tolist()} after {time.perf_counter() - start:.1f} s ({verdict})"
    except RuntimeError as exc:
        plain = f"failed after {time.perf_counter() - start:.1f} s: {short(exc, 90)}"
    log.info(f"OFF: {plain}")

    outcomes = [None] * n
    dist.all_gather_object(outcomes, (detail, plain))  # the default group is healthy: only side groups broke
    if ctx.is_main:
        print(f"\nWith TORCH_DISTRIBUTED_DEBUG=DETAIL, rank 0 sees: {outcomes[0][0]}")
        print("Without it (debug level OFF), the same all_reduce:")
        for rank, (_, plain) in enumerate(outcomes):
            print(f"   rank {rank}: {plain}")
        print("Every rank must call the same collectives in the same order with the same shapes. DETAIL "
              "costs an extra\ncheck per collective: turn it on to find the bug, off to train.")
        print(f"error: collective mismatch: {outcomes[0][0]}", file=sys.stderr)
    return 1


def missing_rank(ctx, log):
    n, r = ctx.world_size, ctx.rank
    # Created while everyone is still here: making a group is itself a collective over all ranks.
    roll_call = group(ctx.timeout_s, dist.DebugLevel.OFF)
    if r == n - 1:
        log.warning("stuck outside the collective (think: a hung data loader or a filesystem read)")
        time.sleep(100 * ctx.timeout_s)  # torchrun ends this process when the others fail
        return 1
    start = time.perf_counter()
    try:
        # On the job's backend and device. With TORCH_NCCL_BLOCKING_WAIT=1 (set in main) an NCCL
        # collective waits on the host like a gloo one, so the clock below measures the wait itself,
        # not just the kernel launch.
        dist.all_reduce(torch.ones(4, device=ctx.device))
        outcome = "all_reduce returned (unexpected)"
    except RuntimeError as exc:  # gloo: "Timed out waiting ...ms for recv operation to complete";
        # NCCL: "Watchdog caught collective operation timeout: WorkNCCL(... OpType=ALLREDUCE ...)"
        outcome = f"all_reduce timed out after {time.perf_counter() - start:.1f} s: {short(exc, 80)}"
    log.info(outcome)
    # Who is missing? monitored_barrier (gloo only) waits for every rank and names the absent ones.
    try:
        dist.monitored_barrier(group=roll_call, timeout=datetime.timedelta(seconds=ctx.timeout_s), wait_all_ranks=True)
        culprit = "monitored_barrier passed (unexpected)"
    except RuntimeError as exc:
        culprit = short(exc)
    if ctx.is_main:
        print(f"\nrank 0: {outcome}\nrank 0: monitored_barrier says: {culprit}")
        print("The timeout (--timeout-s, init_process_group(timeout=...)) turned an endless hang into an error; "
              "monitored_barrier\nnamed the rank to investigate (py-spy dump --pid <its pid> shows where it is stuck).")
        print(f"error: [rank 0] a peer never joined the all_reduce; {culprit}", file=sys.stderr)
    return 1


def crash(ctx, log):
    n, r = ctx.world_size, ctx.rank
    for step in range(1, 6):
        if r == n - 1 and step == 3:
            print(f"[rank {r}] step {step}: simulated crash (os._exit(3), as if a kernel or an assert failed)",
                  flush=True)
            os._exit(3)  # dies without goodbye: no barrier, no destroy_process_group
        tensor, start = torch.ones(1024, device=ctx.device), time.perf_counter()
        try:
            dist.all_reduce(tensor)
            # Reading the sum makes the step really finished on any backend (a GPU would otherwise
            # still be running, or waiting for, the kernel when the log says "ok").
            total = tensor[0].item()
        except RuntimeError as exc:
            message = (f"step {step}: all_reduce failed after {time.perf_counter() - start:.1f} s: "
                       f"{short(exc)}")
            log.info(message)
            if ctx.is_main:
                print(f"\nrank 0: {message}\nThe survivors noticed instead of hanging: the dead rank's sockets "
                      "closed, or the timeout fired.\nThey wait for torchrun, which stops them and reports the "
                      "first failure: the crashed rank and its exit code 3.")
                print(f"error: [rank 0] lost a peer at step {step}; it crashed (see its exit code above)",
                      file=sys.stderr, flush=True)
            # Let torchrun stop this rank instead of exiting first: its summary then names the rank
            # that really crashed as the first failure (survivors that exit at once can get there
            # first and be reported as the root cause). Bounded, in case nobody stops us.
            sys.stdout.flush()
            time.sleep(ctx.timeout_s)
            return 1
        log.info(f"step {step}: all_reduce ok" if total == n else f"step {step}: all_reduce gave {total:g}, not {n}")
    return 0


def main():
    args = parse_args()
    # An NCCL collective returns once its kernel is queued; a missing or dead peer then surfaces only
    # in NCCL's background watchdog, which takes the process down after the timeout before this
    # script can say anything. With TORCH_NCCL_BLOCKING_WAIT=1 each NCCL collective waits on the host
    # and raises the timeout (or the peer's failure) here, where the lab times and reports it. It is
    # read when the process group is created, so it is set first; gloo ignores it. (No watchdog also
    # means no flight-recorder dump: for that, see nccl_debugging.md.)
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    with distributed(args) as ctx:
        if ctx.world_size < 2:
            raise UsageError("the lab needs at least 2 ranks (torchrun --nproc_per_node=4 ...)")
        check_outputs(ctx, args, dirs=["log_dir"])
        log = setup_logging(ctx.rank, per_rank_dir=args.log_dir, all_ranks=False)
        if ctx.is_main:
            print(f"scenario {args.scenario} | world size {ctx.world_size} | backend {ctx.backend} "
                  f"| timeout {ctx.timeout_s:g} s | per-rank logs in {args.log_dir}/", flush=True)
        code = {"mismatch": mismatch, "missing-rank": missing_rank, "crash": crash}[args.scenario](ctx, log)
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave at once: the process group holds half-finished operations a clean shutdown would wait on.
        os._exit(code)


if __name__ == "__main__":
    run_main(main)
