"""Worker: a 2-rank job that hangs, for tests/test_jobs.py (what a time limit must end).

    torchrun --standalone --nproc_per_node=2 tests/workers/hung_job.py PID_DIR RESULTS LATE_S

Each rank writes its pid to ``PID_DIR/rank{R}.pid`` (rank 0 also torchrun's, its parent, to
``agent.pid``) and appends ``started rank R`` to ``RESULTS``; a daemon thread appends ``late rank R``
``LATE_S`` seconds later, unless the rank was ended first. Rank 1 ignores SIGTERM (as a rank stuck
where no signal handler runs would) and starts a child process of its own (its pid in ``child.pid``).
The pid files are written before torch is imported, so that every process of the job exists a few
seconds after the launch even on a busy machine. Both ranks then join a gloo group; rank 0 waits in
a barrier that rank 1 never reaches, and rank 1 sleeps.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def write_pid(path: Path, pid: int) -> None:
    # renamed into place: the test never reads a half-written file
    path.with_suffix(".tmp").write_text(str(pid))
    os.replace(path.with_suffix(".tmp"), path)


def append_line(results: Path, line: str) -> None:
    with open(results, "a") as f:
        f.write(line + "\n")


def write_late(results: Path, rank: int, late_s: float) -> None:
    time.sleep(late_s)
    append_line(results, f"late rank {rank}")


def main() -> None:
    pid_dir, results, late_s = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    rank = int(os.environ["RANK"])
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the SIGKILL after the grace ends it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        write_pid(pid_dir / "child.pid", child.pid)
    else:
        write_pid(pid_dir / "agent.pid", os.getppid())
    write_pid(pid_dir / f"rank{rank}.pid", os.getpid())
    append_line(results, f"started rank {rank}")
    threading.Thread(target=write_late, args=(results, rank, late_s), daemon=True).start()

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if rank == 0:
        dist.barrier()  # rank 1 never arrives: a real hang, in gloo
    else:
        time.sleep(600)


if __name__ == "__main__":
    main()
