"""Process set-up that every chapter shares: backend and device choice, the process group, seeding,
and one-line errors.

What is *not* here is the distributed lesson itself: chapter scripts still call
``init_process_group``-level concepts (ranks, barriers, collectives, DDP/FSDP wrapping) in the open.
This module only removes the boilerplate around them.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import random
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .errors import UsageError  # noqa: F401  (re-exported: scripts import it from here)
from .flags import positive_float
from .slurm import is_srun_task, srun_rank_hint, srun_task

DEFAULT_TIMEOUT_S = 300

# torch 2.13 renamed the flat-buffer collectives (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single; the old names now warn). torch 2.11, which many
# clusters still ship, has only the old names. The chapters call the new ones; on an older torch they
# are the old functions under the new names. This is the one place the two versions differ.
if not hasattr(dist, "all_gather_single"):
    dist.all_gather_single = dist.all_gather_into_tensor
if not hasattr(dist, "reduce_scatter_single"):
    dist.reduce_scatter_single = dist.reduce_scatter_tensor


def env_int(name: str, default: int) -> int:
    """An integer environment variable (as torchrun sets RANK, LOCAL_RANK, WORLD_SIZE ...)."""
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def launched_rank() -> int:
    """This process's global rank as the launcher set it, before any process group exists:
    torchrun's ``RANK``, else an ``srun`` task's ``SLURM_PROCID``, else 0."""
    if os.environ.get("RANK"):
        return env_int("RANK", 0)
    return srun_rank_hint(os.environ) or 0


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, once (from rank 0), not once per rank, and exits
    2. The usage block is for ``--help``: repeated above every error, it buries the one line that
    says what was wrong."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        if launched_rank() == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:
            _let_rank0_report_first()
        sys.exit(2)


def _let_rank0_report_first() -> None:
    """Delay a non-zero rank's exit on an error every rank found.

    torchrun (and the deepspeed launcher, and ``mp.spawn``) stop the whole group as soon as one rank
    exits, so a rank that exits first could get rank 0 killed before it prints the one line that
    explains the failure. Waiting costs nothing in the usual case: rank 0 prints, exits, and the
    launcher ends this rank during the wait. The wait is long because rank 0 can arrive seconds late
    when four ranks share two busy cores.
    """
    time.sleep(10.0)


def add_runtime_args(parser: argparse.ArgumentParser, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Flags every chapter script accepts: backend/device override, timeout, seed.

    ``timeout_s`` is the script's default for ``--timeout-s`` (a debugging lab wants seconds, not
    minutes); the help text states whichever default applies.
    """
    group = parser.add_argument_group("runtime")
    group.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                       help="communication backend; auto = nccl when every local rank gets its own GPU, "
                            "else gloo (default: auto)")
    group.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                       help="where tensors live; auto follows the backend (default: auto)")
    group.add_argument("--timeout-s", type=positive_float, default=timeout_s,
                       help="process-group timeout in seconds: a collective that waits longer "
                            f"(a dead or missing rank) ends the job (default: {timeout_s:g})")
    group.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def local_world_size_from_env() -> int:
    """How many ranks this node runs, as the launcher said.

    torchrun sets ``LOCAL_WORLD_SIZE``; the ``deepspeed`` launcher sets ``LOCAL_SIZE`` instead;
    :func:`use_launcher_env` sets ``LOCAL_WORLD_SIZE`` from SLURM's tasks on this node. Without any
    (``python script.py``) the node runs one rank.
    """
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return env_int("LOCAL_WORLD_SIZE", 1)
    return env_int("LOCAL_SIZE", 1)


def visible_gpu_count() -> int:
    """GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied); 0 on a CPU-only build."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend_and_device(backend: str = "auto", device: str = "auto",
                              local_world_size: int | None = None, gpu_count: int | None = None,
                              nccl_available: bool | None = None) -> tuple[str, str]:
    """Pick ``(backend, device_type)``.

    ``auto`` means NCCL on CUDA when CUDA is available and this node has at least one GPU per local
    rank, else gloo on CPU. Forcing NCCL or CUDA without one GPU per local rank raises
    :class:`UsageError`. ``local_world_size``, ``gpu_count`` and ``nccl_available`` default to what
    the launcher and this machine say; passing them makes the choice a pure function (its unit test
    does).
    """
    if local_world_size is None:
        local_world_size = local_world_size_from_env()
    gpus = visible_gpu_count() if gpu_count is None else gpu_count
    if nccl_available is None:
        nccl_available = dist.is_nccl_available()
    gpus_fit = gpus >= local_world_size

    if backend == "auto":
        if device == "cuda":
            backend = "nccl" if nccl_available else "gloo"
        elif device == "cpu":
            backend = "gloo"
        else:
            backend = "nccl" if (gpus_fit and gpus > 0 and nccl_available) else "gloo"
    if device == "auto":
        device = "cuda" if backend == "nccl" else "cpu"

    if backend == "nccl":
        if not nccl_available:
            raise UsageError("--backend nccl: this PyTorch build has no NCCL (CPU-only build); "
                             "use --backend gloo")
        if device != "cuda":
            raise UsageError("--backend nccl needs --device cuda (NCCL only moves GPU tensors)")
    if device == "cuda" and not gpus_fit:
        flag = "--backend nccl" if backend == "nccl" else "--device cuda"
        raise UsageError(f"{flag}: {local_world_size} local ranks need {local_world_size} GPUs but this "
                         f"machine has {gpus}; start fewer processes (--nproc_per_node={max(gpus, 1)}) "
                         "or use --backend gloo --device cpu")
    if backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("this PyTorch build has no gloo backend")
    return backend, device


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job, and what it computes on."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device
    timeout_s: float

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints summaries and writes files."""
        return self.rank == 0

    @property
    def device_ids(self) -> list[int] | None:
        """What DDP's ``device_ids`` wants: ``[this rank's GPU]`` on CUDA, ``None`` on CPU."""
        return [self.device.index] if self.device.type == "cuda" else None


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_world_of_one() -> None:
    """Set what torchrun would have set for a job of one process, rendezvousing on loopback.

    For a script started as ``python script.py``: it then runs the same code as rank 0 of 1.
    """
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_loopback_port()))


def use_launcher_env() -> str:
    """Make torchrun's variables describe this process, whichever way it was started; returns the
    launcher's name.

    * ``torchrun`` (or any launcher that sets ``RANK``: the ``deepspeed`` launcher, ``mp.spawn``
      workers): nothing to do. It wins over SLURM's variables, so ``srun`` per node + torchrun
      (``slurm_ddp.sbatch``) works as before.
    * ``srun`` per task (``srun --ntasks=4 python script.py``): ``RANK``, ``WORLD_SIZE``,
      ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` from ``SLURM_PROCID``, the step's task count, ``SLURM_LOCALID``
      and the tasks on this node; ``MASTER_ADDR`` / ``MASTER_PORT`` (unless set) the step's first
      host and a port derived from the job and step ids (:mod:`distkit.slurm`). Rank 0 prints
      ``launcher: srun ...`` as the job's first line. A one-task step rendezvouses on loopback.
    * neither (``python script.py``): a world of one on loopback (:func:`use_world_of_one`).
    """
    if os.environ.get("RANK"):
        return "torchrun"
    if is_srun_task(os.environ):
        task = srun_task(os.environ)
        if task.world_size == 1:  # nobody to meet: loopback and a free port, unless MASTER_* say otherwise
            task = srun_task(os.environ, default_addr="127.0.0.1", default_port=_free_loopback_port())
        os.environ.update(task.torchrun_env())
        if task.rank == 0:
            print(f"[rank 0] launcher: {task.describe()}", flush=True)
        return "srun"
    tasks = os.environ.get("SLURM_NTASKS", "")
    if tasks.isdigit() and int(tasks) > 1:  # a batch script or salloc shell of a multi-task job
        print(f"note: this SLURM job has {tasks} tasks but srun did not start this process: it runs "
              "as a world of one (start one process per task with srun)", file=sys.stderr, flush=True)
    use_world_of_one()
    return "none"


def init_distributed(*, backend: str = "auto", device: str = "auto",
                     timeout_s: float = DEFAULT_TIMEOUT_S, seed: int = 0) -> DistContext:
    """Create the default process group from torchrun's environment variables.

    ``backend`` / ``device``: ``"auto"`` or a forced choice (see :func:`choose_backend_and_device`);
    ``timeout_s``: how long a collective may wait for a peer; ``seed``: the same on every rank.
    Started by ``srun`` (one task per rank), SLURM's variables say the same
    (:func:`use_launcher_env`); run without a launcher (``python script.py``), the script becomes a
    world of one process that rendezvouses on loopback. Each rank binds GPU ``LOCAL_RANK`` when the
    device is CUDA. Chapter 01's ``ddp_mnist.py`` writes these steps out in the open.
    """
    use_launcher_env()
    rank, local_rank = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
    world_size, local_world_size = env_int("WORLD_SIZE", 1), local_world_size_from_env()

    backend, device_type = choose_backend_and_device(backend, device, local_world_size)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init, so NCCL binds this rank's GPU
    else:
        device = torch.device("cpu")

    timeout_s = float(timeout_s)
    init_kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                       timeout=datetime.timedelta(seconds=timeout_s))
    if device_type == "cuda":
        init_kwargs["device_id"] = device
    try:
        dist.init_process_group(**init_kwargs)
    except RuntimeError as exc:  # rendezvous problems: a busy port, an unreachable master
        message = str(exc).splitlines()[0]
        if "address already in use" in message.lower() or "EADDRINUSE" in message:
            raise UsageError(f"rendezvous port {os.environ.get('MASTER_PORT')} is already in use; "
                             "pick another --master_port (or use --standalone)") from None
        raise UsageError(f"could not join the process group: {message}") from None
    seed_everything(seed)
    return DistContext(rank, local_rank, world_size, local_world_size, backend, device, timeout_s)


# Every process group that destroy_process_group let go of, still referenced: see destroy_groups.
_RETIRED_GROUPS: list = []


def destroy_groups() -> None:
    """``dist.destroy_process_group()`` (every group shut down and forgotten by torch.distributed),
    keeping one reference to each group until the process ends.

    Why: a gloo group's C++ destructor joins its worker threads, and a worker may still be freeing
    the last collective it ran, which takes the GIL to release a tensor Python created. When the
    group's last reference is one a C++ object holds (DDP's Reducer, freed with the model after the
    teardown, when the script's function returns), that destructor runs with the GIL held and the
    two threads wait for each other forever: seen as a finished rank that never exits, about 1 in 50
    two-rank launches on a busy 2-core machine (the class of bug of pytorch/pytorch#56297). Kept
    referenced here, no group is destructed while the process runs; scripts end with
    :func:`exit_without_finalizers`, which runs no destructors.
    """
    _RETIRED_GROUPS.extend(dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()


def shutdown_distributed(success: bool = True) -> None:
    """Tear the process group down (every group: :func:`destroy_groups`).

    After a clean run every rank meets at a barrier first: without it, gloo ranks that exit while a
    peer is still sending sometimes abort with ``terminate called without an active exception``.
    After a failure no barrier is attempted (the peers may be gone); the group is just destroyed.
    """
    if not dist.is_initialized():
        return
    if success:
        dist.barrier()
    destroy_groups()


@contextmanager
def distributed(args: argparse.Namespace) -> Iterator[DistContext]:
    """``with distributed(args) as ctx:`` -- init the process group, always tear it down.

    ``args`` holds the flags :func:`add_runtime_args` defines (backend, device, timeout, seed).
    """
    ctx = init_distributed(backend=args.backend, device=args.device, timeout_s=args.timeout_s, seed=args.seed)
    ok = False
    try:
        yield ctx
        ok = True
    finally:
        shutdown_distributed(success=ok)


def reduce_gradients(params, group, world_size: int) -> None:
    """Sum the gradients of ``params`` over ``group`` with one all-reduce of a flat copy (none when
    ``group`` is None) and divide them by ``world_size``, the job's ranks: each rank's loss is the
    mean over its own tokens. The copy is divided in place, so one flat copy exists meanwhile.
    Chapter 05's context parallelism averages every gradient over all ranks with it; its expert
    parallelism sums the dense and the expert gradients over different groups."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= world_size
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(piece.view_as(grad))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) alike on every rank."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass


def _is_collective_error(exc: BaseException) -> bool:
    # gloo errors raised inside DDP's backward hooks arrive as plain RuntimeErrors naming gloo.
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return _is_collective_error(exc) and ("timeout" in text or "timed out" in text)


def _is_peer_gone(exc: BaseException) -> bool:
    text = str(exc).lower()
    return _is_collective_error(exc) and any(
        key in text for key in ("connection closed by peer", "connection reset", "broken pipe"))


def run_main(main: Callable[[], object]) -> None:
    """Run a script's ``main`` and turn expected failures into one line and a non-zero exit.

    * :class:`UsageError` -> ``error: <message>`` (printed once, by rank 0 when the error is
      everyone's, or by the rank that raised it), exit code 2;
    * a collective that timed out or lost its peer -> one line naming the rank and the timeout,
      exit code 1;
    * anything else is a bug: its traceback is kept.

    A run that ends normally leaves through :func:`exit_without_finalizers`.
    """
    try:
        main()
        exit_without_finalizers(0)
    except UsageError as exc:
        if not exc.every_rank:
            print(f"error: [rank {launched_rank()}] {exc}", file=sys.stderr, flush=True)
        elif launched_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        else:
            _let_rank0_report_first()
        _abandon_process_group()
        exit_without_finalizers(2)
    except RuntimeError as exc:  # dist.DistError, or gloo's RuntimeError from inside backward
        rank = launched_rank()
        if _is_timeout(exc):
            print(f"error: [rank {rank}] a collective timed out: a peer rank died, hung or never "
                  f"arrived ({str(exc).splitlines()[0][:200]})", file=sys.stderr, flush=True)
        elif _is_peer_gone(exc):
            print(f"error: [rank {rank}] lost the connection to a peer rank (it probably crashed)",
                  file=sys.stderr, flush=True)
        else:
            raise
        _abandon_process_group()
        exit_without_finalizers(1)
    except KeyboardInterrupt:
        _abandon_process_group()
        exit_without_finalizers(130)
    except SystemExit as exc:  # sys.exit(n) inside main: keep its code, skip the finalizers too
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        exit_without_finalizers(exc.code if isinstance(exc.code, int) else int(exc.code is not None))


def exit_without_finalizers(code: int) -> None:
    """Flush logs and standard streams, then end the process at once with ``code``.

    Interpreter shutdown destroys leftover C++ objects (gloo work items and pairs still referenced
    from Python) in no particular order; on gloo this occasionally aborts a finished rank with
    ``terminate called without an active exception`` even after a barrier and
    ``destroy_process_group``, more often on a loaded machine. Every file and the process group are
    already closed here, so the OS can reclaim the rest.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _abandon_process_group() -> None:
    try:
        if dist.is_initialized():
            destroy_groups()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
