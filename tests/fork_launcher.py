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
(``tests/launch.py``'s ``launcher="torchrun"``): the reader's first command, restarts after
``kill -9``, two agents as two nodes, the one-line error checks, the launcher lessons.

Like torchrun: when a rank fails, the others are terminated (SIGTERM, SIGKILL after 30 s) and the
launcher exits 1 after one summary line; when all succeed it exits 0. No restarts, one node.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import runpy
import signal
import sys
import time

import torch  # noqa: F401  (imported once here; every forked rank inherits it)
import torch.distributed  # noqa: F401
from launch import free_port  # tests/launch.py: this script's folder is sys.path[0]

GRACE_S = 30  # torchrun's: SIGTERM, then SIGKILL after this long


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc_per_node", "--nproc-per-node", type=int, required=True)
    parser.add_argument("--standalone", action="store_true", help="accepted for torchrun compatibility")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    n = opts.nproc_per_node
    _preimport(opts.script)
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n),
              "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0",
              "ROLE_WORLD_SIZE": str(n), "ROLE_NAME": "default", "TORCHELASTIC_RESTART_COUNT": "0",
              "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "fork_launcher"}
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            _rank(opts.script, opts.args, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                           "ROLE_RANK": str(rank)})
        ranks[pid] = rank

    failed: tuple[int, int] | None = None
    deadline = None
    while ranks:
        if deadline is not None and time.monotonic() > deadline:
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
        pid, status = os.waitpid(-1, 0 if deadline is None else os.WNOHANG)
        if pid == 0:
            time.sleep(0.1)
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
