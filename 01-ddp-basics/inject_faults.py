"""Chapter 01: ``ddp_training.py`` with a fault injected from outside, and its recovery timed.

The training script itself has no fault-injection code. This wrapper imports it by path, wraps a few
of its functions, and runs its ``main`` with the remaining flags (every ddp_training.py flag works):

* ``--crash-at-step N --crash-rank R``: rank R sends itself SIGKILL as it starts step N;
* ``--crash-in-checkpoint-at-step N``: rank 0 writes half of step N's checkpoint the way
  ``atomic_save`` writes (a temporary named with this host and PID), then SIGKILLs itself.

Both fire on the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``), so a ``torchrun
--max-restarts`` restart runs clean and resumes. Every rank also appends its milestones with Unix
timestamps to ``<--log-dir>/events.jsonl`` (process start, process group ready, model ready,
checkpoint loaded, first step, the fault, a failed collective, torchrun's SIGTERM), from which
``01-ddp-basics/recovery_report.py`` computes the recovery phases.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=4 --max-restarts=3 \\
        01-ddp-basics/inject_faults.py --crash-at-step 60 --crash-rank 2 --steps 70
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "ddp_training.py"


class Events:
    """Appends ``{"event", "rank", "attempt", "t"}`` JSON lines to ``<log_dir>/events.jsonl``;
    ``attempt`` is torchrun's restart count."""

    def __init__(self, log_dir: str, rank: int):
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.path, self.rank = Path(log_dir) / "events.jsonl", rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def __call__(self, event: str, t: float | None = None) -> None:
        line = json.dumps({"event": event, "rank": self.rank, "attempt": self.attempt,
                           "t": time.time() if t is None else t})
        with open(self.path, "a") as f:  # one short append per line: ranks do not interleave
            f.write(line + "\n")

    def process_start(self) -> None:
        """When the OS created this process (Linux /proc, ~10 ms resolution)."""
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        self("process_start", time.time() - (uptime_s - ticks / os.sysconf("SC_CLK_TCK")))

    def stamp_stop_signal(self) -> None:
        """Record when torchrun's SIGTERM (it stops the group when one worker dies) arrives, then die
        of it as without this handler: a rank busy computing hears from torchrun before any collective."""
        def handler(signum, frame):
            self("stop_signal")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        signal.signal(signal.SIGTERM, handler)


def first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def load_script():
    spec = importlib.util.spec_from_file_location("ddp_training", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddp_training"] = module
    spec.loader.exec_module(module)
    return module


def instrument(module, faults: argparse.Namespace, started_at: float) -> None:
    """Wrap the script's functions: milestones around them, the faults inside them."""
    import torch

    from distkit.checkpoint import temporary_prefix

    run = {}  # what the wrapped functions learn: events, ctx, log, start step

    original_share, original_resume = module.share_args, module.resume
    original_distributed, original_save = module.distributed, module.atomic_save

    def share_args(args, ctx):
        group_ready_at = time.time()
        args = original_share(args, ctx)
        if faults.crash_at_step is not None and faults.crash_rank >= ctx.world_size:
            raise module.UsageError(f"--crash-rank {faults.crash_rank} is not a rank of this "
                                    f"{ctx.world_size}-rank job")
        events = run["events"] = Events(args.log_dir, ctx.rank)
        events.process_start()
        events("main_entry", started_at)
        events("process_group_ready", group_ready_at)
        events.stamp_stop_signal()
        run["ctx"] = ctx
        return args

    def resume(args, ctx, log, *state):
        run["events"]("model_ready")
        run["start"], losses = original_resume(args, ctx, log, *state)
        run["log"] = log
        run["events"]("checkpoint_loaded")
        return run["start"], losses

    class Harness(module.Harness):
        @contextmanager
        def step(self, *a, **kw):
            step, ctx = run["start"] + self._steps, run["ctx"]
            if step == faults.crash_at_step and ctx.rank == faults.crash_rank and first_attempt():
                run["log"].warning(f"fault injection: rank {ctx.rank} sends itself SIGKILL at step {step}")
                run["events"]("fault_injected")
                os.kill(os.getpid(), signal.SIGKILL)
            with super().step(*a, **kw):
                yield
            if self._steps == 1:
                run["events"]("first_step_done")

    def atomic_save(state, path):
        path = Path(path)
        if path.name == f"step_{faults.crash_in_checkpoint_at_step or 0:06d}.pt" and first_attempt():
            # Half a temporary file, named as atomic_save names it (host and PID), then SIGKILL.
            buffer = io.BytesIO()
            torch.save(state, buffer)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path.name))
            os.write(fd, buffer.getvalue()[: len(buffer.getvalue()) // 2])
            os.fsync(fd)
            run["log"].warning(f"fault injection: rank 0 killed while writing {tmp}")
            run["events"]("fault_injected")
            os.kill(os.getpid(), signal.SIGKILL)
        return original_save(state, path)

    @contextmanager
    def distributed(args):
        with original_distributed(args) as ctx:
            try:
                yield ctx
            except RuntimeError:  # a peer died or hung: the recovery measurement's "detection"
                if "events" in run:
                    run["events"]("collective_failed")
                raise

    module.share_args, module.resume, module.Harness = share_args, resume, Harness
    module.atomic_save, module.distributed = atomic_save, distributed


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=0)
    parser.add_argument("--crash-in-checkpoint-at-step", type=int, default=None)
    faults, rest = parser.parse_known_args()
    sys.argv = [sys.argv[0], *rest]  # the script parses the rest
    module = load_script()
    instrument(module, faults, started_at=time.time())  # interpreter up, the script's imports (torch) done
    module.main()


if __name__ == "__main__":
    main()
