"""Run a command under a time limit, and end its whole process tree when the limit cuts it.

A job's process group is not all of its processes: torchrun starts each worker with
``start_new_session=True``, so SIGKILL to torchrun, or to its process group, leaves the workers
running, and a worker that ignores SIGTERM outlives torchrun's own forwarding of it. A job cut at its
limit must not keep the GPU (the next job would find its memory taken) nor append to a result file
after the cut (a record would then mix a failed run into the next one). So :func:`end_tree` lists the
tree by parentage before it signals anything, and ends every process in it and the process group of
each.

Standard library and psutil only, no relative imports: the file loads by its path without torch
(``tests/launch.py``, whose light launcher processes never import torch).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import psutil

GRACE_S = 5.0
DRAIN_S = 3.0  # how long the final read waits for the pipe to close: a survivor can hold it open forever
KILL_WAIT_S = 5.0  # after SIGKILL; only a process in uninterruptible sleep takes longer


@dataclass
class JobResult:
    """What :func:`run_job` returns."""

    returncode: int          # the job's exit status; 124 when it was cut at its limit
    output: bytes | None     # stdout+stderr merged, in order (None when `stdout` was given)
    wall_s: float
    cut: bool                # True when the limit ended it
    ended: list[int]         # pids that end_tree signalled at the cut (empty otherwise)


def run_job(command: list[str] | str, limit_s: float | None, *, cwd=None, env=None, stdout=None,
            grace_s: float = GRACE_S, first_signal: int = signal.SIGTERM) -> JobResult:
    """Run ``command`` (a string runs as ``bash -c command``) in a session of its own, stdout and
    stderr merged into ``stdout`` (an open file; ``output`` is then None) or captured as bytes. At
    ``limit_s`` seconds (None: no limit) its whole tree is ended (:func:`end_tree`) and it returns
    124, ``cut``. Output still unread when the job has ended is waited for DRAIN_S seconds at most:
    a process the job left behind, or one that SIGKILL cannot end, may hold the pipe open forever."""
    argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE if stdout is None else stdout,
                            stderr=subprocess.STDOUT, start_new_session=True)
    chunks: list[bytes] = []
    reader = None
    if stdout is None:
        # A thread reads the pipe so that the last read can be bounded (DRAIN_S), and so that a job
        # writing more than a pipe holds never blocks while we wait for it.
        reader = threading.Thread(target=_read_all, args=(proc.stdout, chunks), daemon=True)
        reader.start()
    cut, ended = False, []
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        cut, ended = True, end_tree(proc.pid, grace_s, first_signal)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=DRAIN_S)  # end_tree reaped the leader, unless SIGKILL could not end it
    except BaseException:
        end_tree(proc.pid, grace_s=1.0)  # our caller is being stopped (Ctrl-C): the job goes with it
        raise
    if reader is not None:
        reader.join(DRAIN_S)
    output = b"".join(list(chunks)) if reader is not None else None
    return JobResult(124 if cut else proc.returncode, output, time.perf_counter() - started, cut, ended)


def _read_all(pipe, chunks: list[bytes]) -> None:
    try:
        while chunk := os.read(pipe.fileno(), 1 << 16):
            chunks.append(chunk)
    finally:
        pipe.close()


def end_tree(pid: int, grace_s: float = GRACE_S, first_signal: int = signal.SIGTERM) -> list[int]:
    """End the process ``pid`` and every process below it, with their process groups (never ours).

    The tree is listed before any signal: once a parent dies its children are re-parented and can no
    longer be found from it. ``first_signal`` goes to the leader's group and to every process listed
    and its group; after up to ``grace_s`` seconds the tree is listed again from every process still
    alive (one started meanwhile is found from its parent), then all of them and their groups get
    SIGKILL. psutil's Process objects refuse to signal a pid that was reused. The leader is reaped
    when it is our child. Returns the pids signalled."""
    try:
        leader = psutil.Process(pid)
        leader_group = os.getpgid(pid)
    except (psutil.Error, ProcessLookupError):
        return []
    known = _with_descendants({pid: leader})
    groups = _signal(known, {leader_group}, first_signal)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in known.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    known = _with_descendants(known)
    # the groups of processes that died in the grace too: a member outside the tree may still be in one
    _signal(known, groups, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while any(_alive(p) for p in known.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # our child: collect it now, or it stays a zombie
    return sorted(known)


def _with_descendants(known: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    """``known`` and every live descendant of each of its live processes (ourselves left out)."""
    found = dict(known)
    for proc in list(known.values()):
        if _alive(proc):
            with contextlib.suppress(psutil.Error):
                found.update((child.pid, child) for child in proc.children(recursive=True))
    found.pop(os.getpid(), None)
    return found


def _signal(known: dict[int, psutil.Process], groups: set[int], sig: int) -> set[int]:
    """``sig`` to every group in ``groups``, to every live process of ``known`` and to its group;
    returns the groups signalled."""
    groups = set(groups)
    for proc in known.values():
        if _alive(proc):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(proc.pid))
    groups.discard(os.getpgrp())  # a tree process left in our own group is signalled by pid alone
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    for proc in known.values():
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
    return groups


def _alive(proc: psutil.Process) -> bool:
    """Running, and still the process we listed (not a reused pid); a zombie has ended."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
