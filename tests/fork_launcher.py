"""A single-node launcher with forked ranks: how most multi-process tests start their jobs.

``python tests/fork_launcher.py --nproc_per_node=N [--standalone] script.py [script flags]`` starts N
ranks of ``script.py`` with the environment torchrun gives a single-node job (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``
on a free loopback port, ``TORCHELASTIC_RESTART_COUNT=0``), so the script joins its process group
exactly as under torchrun. The difference is how a rank starts: it is *forked* from this process,
which has already imported torch and the modules the script imports at its top level (``distkit``,
``torch.distributed.fsdp``, ...), and runs the script with ``runpy`` as ``__main__`` (``sys.argv``
and ``sys.path[0]`` as ``python script.py`` sets them), instead of starting a fresh interpreter
that imports everything again.

Why: on the 2-core machines the suite runs on, a 4-rank ``torchrun`` job spends ~5 s importing
torch five times before a rank does anything, and FSDP, DTensor, DCP or the pipelining package
add 1-2 s per rank each; forked, the ranks start in well under a second.
Importing is not what these tests test. What only the real launcher does is tested under it
(``tests/launch.py``'s ``launcher="torchrun"``): restarts after ``kill -9``, two agents as two nodes,
the one-line error checks under torchrun; SLURM's ``srun`` starts its tasks for real too. Their
workers are ``fork_launcher.py --worker script``: a bare interpreter that has the server fork the
script's process with the worker's environment (``RANK`` and the rest, as torchrun or SLURM set
it), passes SIGTERM, SIGINT and SIGHUP on to it, and ends as it ended, by the same signal if one
killed it, so the launcher sees what it would see of the script's own interpreter. The reader's
first command runs with fresh interpreters end to end (``launcher="torchrun-fresh"``); with
``DISTKIT_FRESH=1`` every launch does: this script then becomes the real torchrun over fresh
interpreters, or the fresh interpreter itself (:func:`become_fresh`), and no server is started.

Like torchrun: when a rank fails, the others are terminated (SIGTERM, SIGKILL after 30 s) and the
launcher exits 1 after one summary line; when all succeed it exits 0. No restarts, one node.

The fork server. ``python tests/fork_launcher.py --serve SOCKET`` imports torch, its distributed
packages, ``distkit`` and ``transformers`` once and then waits on a Unix socket; the test session
starts one (``tests/conftest.py``) and names it in ``$FORK_LAUNCHER_SERVER``. A launch then costs a bare
interpreter start: this script, without importing torch, hands the job (argv, working directory,
environment and its own stdin/stdout/stderr) to the server, which forks a launcher for it that runs
exactly the steps above, and passes the job's exit code back. When this process is killed (a test's
timeout), the server's launcher sees the socket close and kills the ranks. A job whose
import-time environment (``TORCH_*``, ``CUDA_*``, ``OMP_*``, ``PYTHON*``, ...) differs from the
server's, or a server that cannot be reached, is launched here as before.
"""
from __future__ import annotations

import argparse
import ast
import faulthandler
import gc
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import time

from launch import free_port  # tests/launch.py: this script's folder is sys.path[0]

GRACE_S = 30  # torchrun's: SIGTERM, then SIGKILL after this long
SERVER_ENV = "FORK_LAUNCHER_SERVER"  # the fork server's socket, set by tests/conftest.py
FRESH_ENV = "DISTKIT_FRESH"  # "1": every launch a fresh interpreter (become_fresh), no server
# What the server imports once: torch's distributed packages the chapters use, and distkit.
SERVER_IMPORTS = ("torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
                  "torch.distributed.tensor", "torch.distributed.tensor.parallel",
                  "torch.distributed.checkpoint", "torch.distributed.pipelining",
                  "torch.distributed.elastic.multiprocessing.errors", "distkit", "distkit.checkpoint",
                  "distkit.comm_counter", "distkit.data", "distkit.errors", "distkit.flags",
                  "distkit.harness", "distkit.logs", "distkit.models", "distkit.provenance",
                  "distkit.records", "distkit.runtime", "distkit.theory", "distkit.predictors",
                  "distkit.predictors_model_parallel", "distkit.compare",
                  # torch's reference ops import the compiler stack on first use (1-2 s per rank): a model
                  # built on the meta device to predict bytes reaches it through nn.init.normal_
                  "torch._dynamo",
                  # the harness's memory tracker, built on the first instrumented step of every run
                  "torch.distributed._tools.mem_tracker", "torch.distributed._tools.fsdp2_mem_tracker")
# Environment read while those import (threads, devices, paths, logging): a job that sets any of
# these differently from the server imports them itself, so it sees exactly what it asked for.
# Hugging Face's (HF_HUB_OFFLINE, HF_HOME, TRANSFORMERS_OFFLINE, ...) are read when transformers and
# huggingface_hub import, which the server does.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "CUDA", "NCCL", "GLOO", "OMP_", "MKL_", "KMP_", "PYTHON",
                        "LD_", "DS_", "DEEPSPEED", "HF_", "HUGGINGFACE_", "TRANSFORMERS_")
# ... except these, which nothing reads while importing, and which libraries leave in the
# environment of the process that starts a job: torch sets the inductor cache folder in any process
# that imported it, accelerate (through peft) leaves PYTORCH_NVML_BASED_CUDA_CHECK behind after
# asking whether CUDA is there (read by torch.cuda.is_available at call time), DeepSpeed reads its
# extension folder when it builds an op, and output buffering and .pyc writing change no imported
# state. tests/test_fork_launcher.py fails if jobs stop reaching the server.
IMPORT_TIME_EXCEPTIONS = ("TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCH_EXTENSIONS_DIR",
                          "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
LAUNCHER_SET_PREFIXES = ("TORCHELASTIC_",)


def _preimport(script: str) -> None:
    """Import the modules ``script`` imports at its top level, once, before the ranks are forked.
    Only a head start: a module that fails here is left for the rank to import (and fail) itself."""
    tree = ast.parse(open(script).read(), script)
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001
                pass
    finally:
        sys.path.pop(0)


def _rank(script: str, args: list[str], env: dict[str, str]) -> None:
    """In the forked child: become rank ``env['RANK']`` running ``python script args``; never returns."""
    code = 0
    try:
        # a rank still running when its launcher is told to stop (a test's timeout) prints where
        # each of its threads is, before it is killed: see run_job
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        os.environ.update(env)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a crashing rank shows its traceback, as under torchrun
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def _receive(client: socket.socket) -> bytes:
    """A forwarded signal (2 bytes) or b"" when the client is gone: Linux resets a Unix socket whose
    peer closed with data unread, and that is the same news as an orderly close."""
    try:
        return client.recv(2)
    except ConnectionResetError:
        return b""


def run_job(nproc: int, script: str, args: list[str], client: socket.socket | None = None,
            worker: bool = False) -> int:
    """Fork ``nproc`` ranks of ``script args`` with torchrun's environment and wait for them;
    returns the job's exit code (0, or 1 after one summary line). ``nproc`` 0: one process as
    ``python script args`` would run (no launcher environment), returning its exit code (``worker``:
    minus the signal that ended it, as ``subprocess`` reports it). ``client``: the socket of the
    process that asked the fork server for this job; if it closes, the ranks are killed; a signal it
    forwards (``--worker``) is passed on to them."""
    import torch.distributed  # noqa: F401  (imported once, here or by the server; every rank inherits it)

    _preimport(script)
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0",
              "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "TORCHELASTIC_RESTART_COUNT": "0",
              "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "fork_launcher"}
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything imported so far lives as long as the ranks: out of the collector's reach, so each
    # rank's gc.collect() (the harness calls it before every memory window) does not walk torch's and
    # transformers' objects again, and the pages the parent shares with the ranks stay shared.
    gc.freeze()
    ranks: dict[int, int] = {}
    for rank in range(max(nproc, 1)):
        pid = os.fork()
        if pid == 0:
            if client is not None:
                client.close()
            _rank(script, args, {} if nproc == 0 else {**common, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                        "ROLE_RANK": str(rank)})
        ranks[pid] = rank

    failed: tuple[int, int] | None = None
    deadline = None
    while ranks:
        if deadline is not None and time.monotonic() > deadline:
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
        message = _receive(client) if client is not None and select.select([client], [], [], 0)[0] else None
        if message and message[:1] == b"S" and len(message) == 2:
            for pid in ranks:  # a --worker client's launcher signalled it (torchrun stopping its workers)
                os.kill(pid, message[1])
        elif message == b"":
            # the launching process is gone (killed by a test's timeout): the ranks still running
            # show their stacks (a hang's diagnosis, in the test's output), then die
            print(f"fork_launcher: the job was stopped from outside; ranks {sorted(ranks.values())} were "
                  "still running, their threads' stacks:", file=sys.stderr, flush=True)
            for pid in ranks:
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
            client = None
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            select.select([client] if client is not None else [], [], [], 0.05)
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if nproc == 0:  # a plain `python script`: its own exit code (a signal as the shell shows it)
            return code if code >= 0 or worker else 128 - code
        if code != 0 and failed is None:
            failed = (rank, code)
            for other in ranks:  # as torchrun: one failed rank ends the job
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
    if failed:
        rank, code = failed
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(f"fork_launcher: rank {rank} failed ({how}); the job was stopped", file=sys.stderr, flush=True)
        return 1
    return 0


# ------------------------------------------------------------------------------------ fork server
def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)
            and k not in IMPORT_TIME_EXCEPTIONS and not k.startswith(LAUNCHER_SET_PREFIXES)}


def _receive_all(conn: socket.socket, data: bytes, size: int) -> bytes:
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client closed the connection")
        data += chunk
    return data


def _launch_for_client(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In a child of the server: become the launcher of the client's job; never returns."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # computed from the server's TMPDIR while importing
        try:
            conn.sendall(b"R")
        except OSError:  # the client is already gone (killed while asking): no job to run
            os._exit(1)
        code = run_job(request["nproc"], request["script"], request["args"], client=conn,
                       worker=request.get("worker", False))
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        _log_cpu(request)
        try:
            conn.sendall(struct.pack("!i", code))
        except OSError:
            pass
        os._exit(min(abs(code), 255))


def _log_cpu(request: dict) -> None:
    """With ``$DISTKIT_JOB_CPU_LOG`` set (in the job's environment): append one JSON line to that file,
    the CPU seconds this job took (this launcher's and its ranks', user + system) with the test that
    started it, so the suite's time budget can be read per test (CONTRIBUTING.md, "How the
    test suite works"). Nothing is written otherwise."""
    path = request["env"].get("DISTKIT_JOB_CPU_LOG")
    if not path:
        return
    import resource

    own, ranks = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + ranks.ru_utime + ranks.ru_stime
    line = {"test": request["env"].get("PYTEST_CURRENT_TEST", ""), "script": request["script"],
            "args": request["args"][:8], "nproc": request["nproc"], "cpu_s": round(cpu, 2)}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass


def _preload_deepspeed(env: dict[str, str]) -> None:
    """DeepSpeed, imported as the chapter 03 scripts import it, when this server sees no GPU (the CPU
    suite hides them): DeepSpeed picks its accelerator once, at import, so on a machine with visible
    GPUs the choice is left to each job (``--device cpu`` or not). Also the modules DeepSpeed imports
    inside ``deepspeed.initialize``: its optimizer check imports the Muon optimizer, which calls
    ``torch.compile`` at import and so loads the inductor, about 2 s per rank of every job."""
    if env.get("CUDA_VISIBLE_DEVICES") != "":
        return
    try:
        import torch

        importlib.import_module("distkit.deepspeed").import_deepspeed(torch.device("cpu"))
        importlib.import_module("deepspeed.runtime.engine")
        for name in ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_config",
                     "deepspeed.module_inject.auto_ep_layer"):
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a job then imports (and fails on) it itself
        print(f"fork server: cannot import deepspeed: {exc}", file=sys.stderr, flush=True)


def distkit_problem() -> str | None:
    """None when the ``distkit`` this process would import is the tree under test's (the repository
    this file is in); else the one line that says which it would import instead. A server started as
    a script finds ``distkit`` on ``PYTHONPATH`` or through an editable install, which may be another
    checkout's: its jobs would then run code the tests never read."""
    spec = importlib.util.find_spec("distkit")
    tree = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distkit")
    found = os.path.dirname(os.path.realpath(spec.origin)) if spec and spec.origin else None
    if found == os.path.realpath(tree):
        return None
    return (f"error: the fork server would import distkit from {found}, not from the tree under test "
            f"({tree}): put the tree first on PYTHONPATH, or install it (pip install -e)")


def serve(path: str) -> None:
    """The fork server: listen on ``path``, import torch and distkit once, then fork one launcher
    per request (see the module docstring). Runs until terminated; refuses to start, in one line,
    when its ``distkit`` is not the tree under test's (:func:`distkit_problem`)."""
    problem = distkit_problem()
    if problem:
        print(problem, file=sys.stderr, flush=True)
        raise SystemExit(2)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)  # before importing: an early client waits in the backlog, not in vain
    own_env = _import_time_env(dict(os.environ))  # as started (importing sets e.g. TORCHINDUCTOR_CACHE_DIR)
    for name in SERVER_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a job then imports (and fails on) it itself
            print(f"fork server: cannot import {name}: {exc}", file=sys.stderr, flush=True)
    _preload_deepspeed(own_env)
    try:  # Hugging Face transformers and its Llama (a lazy module: the class imports the modeling code),
        # through distkit's torchvision workaround; the class is cached, so ranks inherit it built
        importlib.import_module("distkit.models")._llama_class()
    except Exception as exc:  # noqa: BLE001
        print(f"fork server: cannot import transformers: {exc}", file=sys.stderr, flush=True)
    try:  # the offline MNIST sample, parsed once here (distkit.data keeps it) instead of in every MNIST job
        data = importlib.import_module("distkit.data")
        sample = data.offline_sample_path()
        if sample is not None:
            data.read_offline_sample(sample)
    except Exception as exc:  # noqa: BLE001 - a job then reads (and fails on) it itself
        print(f"fork server: cannot read the MNIST sample: {exc}", file=sys.stderr, flush=True)
    listener.settimeout(1.0)
    children: set[int] = set()
    while True:
        for pid in list(children):  # reap finished launchers
            if os.waitpid(pid, os.WNOHANG)[0]:
                children.discard(pid)
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            data = _receive_all(conn, data, 4)
            data = _receive_all(conn, data, 4 + struct.unpack("!I", data[:4])[0])
            request = json.loads(data[4:])
            theirs = _import_time_env(request["env"])
            if len(fds) != 3 or theirs != own_env:
                differ = sorted(k for k in set(theirs) | set(own_env) if theirs.get(k) != own_env.get(k))
                print(f"fork server: not launching {request['script']}: its environment differs in "
                      f"{differ or 'its streams'}; the client launches it itself", flush=True)
                conn.sendall(b"F")
                continue
            how = f"on {request['nproc']} ranks" if request["nproc"] else "as one python process"
            print(f"fork server: launching {request['script']} {how}", flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _launch_for_client(conn, request, fds)
            children.add(pid)
        except (OSError, ValueError, ConnectionError):
            pass
        finally:
            conn.close()
            for fd in fds:
                os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def through_server(path: str, nproc: int, script: str, args: list[str], worker: bool = False) -> int | None:
    """Ask the fork server at ``path`` to run the job with this process's stdin/stdout/stderr,
    working directory and environment; its exit code, or None if this process must launch it.
    ``worker``: SIGTERM, SIGINT and SIGHUP sent to this process are passed on to the rank, and the
    code is minus the signal that ended the rank, if one did."""
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    if worker:  # a stop that arrives before the job runs waits for it (or for the fallback) instead
        # of killing this client half-way through the request, with the server's reply unread
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        return _through_server(path, nproc, script, args, worker, stops)
    finally:
        if worker:  # a stop held back is delivered now: forwarded to the rank, or ends this process
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


def _through_server(path: str, nproc: int, script: str, args: list[str], worker: bool, stops) -> int | None:
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        payload = json.dumps({"nproc": nproc, "script": script, "args": args, "cwd": os.getcwd(),
                              "env": dict(os.environ), "worker": worker}).encode()
        streams = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
        socket.send_fds(conn, [struct.pack("!I", len(payload)) + payload], streams)
        if conn.recv(1) != b"R":
            return None
    except OSError:
        return None
    if worker:
        def forward(signum, _frame):
            try:
                conn.sendall(b"S" + bytes([signum]))
            except OSError:
                pass

        for signum in stops:
            signal.signal(signum, forward)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # forwarded from here on
    try:
        return struct.unpack("!i", _receive_all(conn, b"", 4))[0]
    except ConnectionError:
        print("fork_launcher: the fork server's launcher ended without an exit code", file=sys.stderr)
        return 1


def main(argv: list[str]) -> int:
    # allow_abbrev off: a script flag after the script (ddp_spawn.py --nproc) is never taken for ours
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--serve", metavar="SOCKET", help="run the fork server on this Unix socket")
    parser.add_argument("--nproc_per_node", "--nproc-per-node", type=int)
    parser.add_argument("--python", action="store_true",
                        help="run the script as `python script args` would, in one forked process")
    parser.add_argument("--worker", action="store_true",
                        help="be one worker that a launcher (torchrun, srun) started with its environment: "
                             "the script runs in a process forked by the fork server (if it can, else this "
                             "process becomes `python script args`); signals are passed on, and this "
                             "process ends as the script's process ended, by the same signal if one")
    parser.add_argument("--standalone", action="store_true", help="accepted for torchrun compatibility")
    parser.add_argument("script", nargs="?")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    if opts.serve:
        serve(opts.serve)
        return 0
    if opts.python or opts.worker:
        opts.nproc_per_node = 0
    if opts.nproc_per_node is None or opts.script is None:
        parser.error("--nproc_per_node (or --python, --worker) and a script are required")
    if os.environ.get(FRESH_ENV) == "1":
        become_fresh(opts.nproc_per_node, opts.script, opts.args)
    if opts.worker:
        return worker(opts.script, opts.args)
    if os.environ.get(SERVER_ENV):
        code = through_server(os.environ[SERVER_ENV], opts.nproc_per_node, opts.script, opts.args)
        if code is not None:
            return code
    return run_job(opts.nproc_per_node, opts.script, opts.args)


def become_fresh(nproc: int, script: str, args: list[str]) -> None:
    """``$DISTKIT_FRESH=1``: this process becomes what a reader runs, a fresh interpreter for the script
    (``--python``, ``--worker``) or the real torchrun over fresh ones; never returns. Nothing a server
    imported beforehand can then hide a missing import or a teardown that hangs."""
    sys.stdout.flush()
    sys.stderr.flush()
    if nproc:
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={nproc}", script, *args])
    os.execv(sys.executable, [sys.executable, "-u", script, *args])


def worker(script: str, args: list[str]) -> int:
    """``--worker``: see ``main``'s help. Where the server cannot take it (none named, or an import-time
    environment of its own, such as a fresh clone's ``PYTHONPATH``), this process becomes the
    worker the launcher meant to start: ``python -u script args``, same PID."""
    if os.environ.get(SERVER_ENV):
        code = through_server(os.environ[SERVER_ENV], 0, script, args, worker=True)
        if code is not None:
            if code < 0:  # the rank died by a signal: so does this process, for its launcher to see
                if -code != signal.SIGKILL:
                    signal.signal(-code, signal.SIG_DFL)
                sys.stdout.flush()
                os.kill(os.getpid(), -code)
            return code
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-u", script, *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
