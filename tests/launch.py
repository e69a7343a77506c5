"""Helpers the tests use to launch real multi-process jobs (subprocesses, never mocks).

Three launchers: ``launcher="fork"`` (the default) starts a job with ``tests/fork_launcher.py``, which
gives the ranks torchrun's environment but forks them from one process that has already imported
torch (a 4-rank job starts ~5 s sooner on a 2-core machine). ``launcher="torchrun"`` runs the real
``python -m torch.distributed.run``: its agent, rendezvous, restarts and failure reports are
torchrun's own, and each worker it starts is ``tests/fork_launcher.py --worker script``, which has
the fork server fork the script's process with the worker's environment, passes torchrun's signals
on and ends as that process ended (by SIGKILL, if it was killed). Tests of what only torchrun does
(restarts after kill -9, several agents, one-line errors under torchrun) use it.
``launcher="torchrun-fresh"`` is torchrun with nothing between it and the script, every worker a
fresh interpreter: the reader's first command, played exactly as a reader runs it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
FORK_LAUNCHER = Path(__file__).resolve().parent / "fork_launcher.py"
LAUNCHERS = ("fork", "torchrun", "torchrun-fresh")


def launcher_argv(launcher: str) -> list[str]:
    """The argv prefix of a single-node launcher (see the module docstring); flags follow. For
    ``"torchrun"``, :func:`forked_workers` then puts the worker in front of the script."""
    if launcher == "fork":
        return [sys.executable, str(FORK_LAUNCHER)]
    if launcher in ("torchrun", "torchrun-fresh"):
        return [sys.executable, "-m", "torch.distributed.run"]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def torchrun_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``tests/bin`` first on ``PATH``: its ``torchrun`` is the real one, run by this
    interpreter (next on ``PATH``), whose workers fork as :func:`forked_workers` makes them; for
    scripts that call ``torchrun`` themselves (``launch_ddp.sh``, ``slurm_ddp.sbatch``)."""
    folders = [str(Path(__file__).resolve().parent / "bin"), str(Path(sys.executable).parent)]
    return {**env, "PATH": os.pathsep.join([*folders, env.get("PATH", "")])}


def forked_workers(argv: list[str]) -> list[str]:
    """A torchrun argv whose workers start as ``tests/fork_launcher.py --worker script ...`` (module
    docstring): the first ``.py`` word is the script, the words before it are torchrun's."""
    at = next(i for i, word in enumerate(argv) if word.endswith(".py") and not word.startswith("-"))
    return [*argv[:at], str(FORK_LAUNCHER), "--worker", *argv[at:]]


def forked_from_server(socket_path: str, script_name: str) -> int:
    """How many single processes of a script named ``script_name`` the fork server at ``socket_path``
    has forked so far (``--python`` and ``--worker`` jobs), read from its log."""
    log = (Path(socket_path).parent / "fork_server.log").read_text()
    return log.count(f"{script_name} as one python process")


@contextlib.contextmanager
def running_fork_server(folder: Path, env: dict[str, str] | None = None):
    """Run the fork launcher's server (``tests/fork_launcher.py --serve``) with ``env`` (default
    :func:`job_env`'s; it forks only the jobs whose import-time environment equals it) while the
    block runs; yields its socket's path once it listens."""
    socket_path = str(Path(folder) / "fork.sock")
    log = open(Path(folder) / "fork_server.log", "w")
    server = subprocess.Popen([sys.executable, str(FORK_LAUNCHER), "--serve", socket_path], env=env or job_env(),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(socket_path):  # it listens before importing torch: a second at most
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start: see {log.name}")
            time.sleep(0.05)
        yield socket_path
    finally:
        stop(server, grace_s=10)
        log.close()


@contextlib.contextmanager
def fork_server(folder: Path):
    """Run the fork launcher's server while the block runs: it imports torch and distkit once, and
    every fork-launched job of this process and its children forks from it (``$FORK_LAUNCHER_SERVER``
    names its socket) instead of importing them again."""
    with running_fork_server(folder) as socket_path:
        os.environ["FORK_LAUNCHER_SERVER"] = socket_path
        try:
            yield socket_path
        finally:
            os.environ.pop("FORK_LAUNCHER_SERVER", None)


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """End a background process: SIGTERM, then SIGKILL if it is still there after ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def job_env(tmp_path: Path | None = None, gpu: bool = False, **extra: str) -> dict[str, str]:
    """Environment for a launched job: one thread per rank (4 ranks share 2 cores), no progress
    bars, torchrun's scratch folders inside the test's temp dir.

    CPU-suite jobs (``gpu=False``) see no GPU at all (``CUDA_VISIBLE_DEVICES=""``), so they take the
    gloo/CPU path whatever machine runs them; GPU-suite jobs (``gpu=True``) see the machine's GPUs.
    A SLURM job's variables are left out (pytest may run inside an allocation, and a script would
    take them for its own); the tests of SLURM launches set their own.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
    env.update(OMP_NUM_THREADS="1", DISTKIT_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif env.get("CUDA_VISIBLE_DEVICES") == "":  # hidden by conftest for the CPU suite
        del env["CUDA_VISIBLE_DEVICES"]
    if tmp_path is not None:
        scratch = Path(tmp_path) / "tmp"
        scratch.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(scratch)
    env.update(extra)
    return env


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """GPUs on this machine, counted in a fresh process (the test process itself hides them when
    it runs the CPU suite); none in the GPU check's rehearsal, whose device swap hides them."""
    from distkit import rehearsal

    if rehearsal.active():
        return 0
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
                            "if torch.cuda.is_available() else 0)"], env=job_env(gpu=True),
                           capture_output=True, text=True, timeout=120)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


def require_gpus(count: int, why: str = "") -> None:
    """Skip a GPU test that needs ``count`` GPUs on a machine with fewer, saying so."""
    import pytest

    have = gpu_count()
    if have < count:
        pytest.skip(f"needs {count} GPU(s), this machine has {have}" + (f": {why}" if why else ""))


# What the quick start (``torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py``) writes with its
# default flags, relative to where it runs (conftest.first_command_run: a fresh clone's root).
QUICK_START_FILES = {"results": "runs/results.jsonl", "model": "checkpoints/ddp_mnist.pt", "log": "runs/ddp_mnist.log",
               "data": "data"}


def quick_start_record(clone: Path) -> dict:
    """The quick start's record in the clone it ran in (conftest.first_command_run): the first line of
    its results file. The reader's play (tests/spine.py) runs later commands in the same clone, and
    those that keep the default ``--results`` append theirs after it, as they would for a reader."""
    from distkit.harness import read_records

    record = read_records(clone / QUICK_START_FILES["results"])[0]
    assert record["command"].split()[:1] == ["01-ddp-basics/ddp_mnist.py"], record["command"]
    return record


def fresh_clone(dest: Path) -> Path:
    """What ``git clone`` of this working tree gives a reader: its tracked files and the files git
    does not ignore, as they are now (uncommitted edits included), committed in a new repository at
    ``dest`` with the working tree's .gitignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not in a clone of it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    git = ["git", "-c", "user.name=reader", "-c", "user.email=reader@example.com", "-C", str(dest)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fresh clone"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    return dest


def changed_files(clone: Path) -> list[str]:
    """``git status --porcelain`` of ``clone``: every file a run added, changed or removed outside
    what git ignores (empty when the run left the repository as it was)."""
    out = subprocess.run(["git", "-C", str(clone), "status", "--porcelain", "--untracked-files=all"],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def tree_state(repo: Path) -> dict[str, str]:
    """What ``git status`` shows in ``repo``, as {porcelain line: hash of that file's content}: a file
    already changed before and written again reads as a change too."""
    import hashlib

    state = {}
    for line in changed_files(repo):
        path = repo / line[3:].split(" -> ")[-1].strip('"')
        digest = hashlib.sha1(path.read_bytes()).hexdigest() if path.is_file() else "-"
        state[line] = digest
    return state


def tree_changes(before: dict[str, str], repo: Path) -> list[str]:
    """The porcelain lines of ``repo`` that are new or whose file changed since ``before``
    (:func:`tree_state`)."""
    after = tree_state(repo)
    return sorted(line for line, digest in after.items() if before.get(line) != digest)


@functools.lru_cache(maxsize=None)
def jobs():
    """distkit/jobs.py (``end_tree``), loaded by its path on first use: ``import distkit.jobs`` would
    import torch (distkit/__init__.py) into fork_launcher.py's light processes, which import this module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("distkit_jobs", REPO / "distkit" / "jobs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up there
    spec.loader.exec_module(module)
    return module


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command in a session of its own; on timeout end its whole process tree, torchrun's
    workers included (no stray ranks: :func:`jobs`).

    Returns the CompletedProcess with stdout and stderr merged into ``.stdout``. With ``check``, a
    non-zero exit fails the test and shows the output's tail.
    """
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import psutil

        # The tree is listed before SIGUSR1, which ends torchrun (it has no handler for it): its
        # workers, in sessions of their own, could no longer be found from it afterwards.
        tree = []
        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(proc.pid).children(recursive=True)
        # SIGUSR1 first: ranks forked by tests/fork_launcher.py print their threads' stacks (the
        # hang's diagnosis, kept in the message below); anything else in the group just ends
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(1.5)
        # Then every process of the job, with its own tree. The stacks are printed by now: a short
        # grace, for what a process prints as SIGTERM ends it.
        jobs().end_tree(proc.pid, grace_s=2.0)
        for process in tree:
            if process.is_running():  # False for a pid reused since the listing
                jobs().end_tree(process.pid, grace_s=2.0)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {shlex.join(cmd)}\n{out[-8000:]}") from None
    except BaseException:
        # the test itself is being stopped (its pytest-timeout, Ctrl-C): take the job's ranks with it,
        # or they would hold the GPU (and the port) for the tests after this one
        jobs().end_tree(proc.pid, grace_s=1.0)
        raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {shlex.join(cmd)}\n{out[-6000:]}")
    return result


def torchrun(script: str | Path, *args: str, nproc: int = 4, tmp_path: Path | None = None,
             timeout: float = 300, check: bool = True, env: dict | None = None,
             launcher_args: tuple[str, ...] = (), launcher: str = "fork") -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=N script args`` with this interpreter (by default
    through the fork launcher, see the module docstring).

    ``--standalone`` rendezvouses on a free loopback port, so tests never collide on a port.
    """
    cmd = [*launcher_argv(launcher), "--standalone", f"--nproc_per_node={nproc}",
           *launcher_args, str(script), *map(str, args)]
    if launcher == "torchrun":
        cmd = forked_workers(cmd)
    return run(cmd, timeout=timeout, env=env or job_env(tmp_path), check=check)


def python(script: str | Path, *args: str, tmp_path: Path | None = None, timeout: float = 300,
           check: bool = True, env: dict | None = None, launcher: str = "fork") -> subprocess.CompletedProcess:
    """``python script args`` (a world of one process, or a script that launches its own): by default
    forked by the fork launcher (``--python``: no launcher environment, the script's own exit code),
    ``launcher="python"`` a fresh interpreter."""
    prefix = [*launcher_argv("fork"), "--python"] if launcher == "fork" else [sys.executable]
    return run([*prefix, str(script), *map(str, args)], timeout=timeout, env=env or job_env(tmp_path), check=check)


def free_port() -> int:
    """A loopback port nobody listens on right now (for launchers that need one named)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_argv(command: str, nproc: int | None = None, launcher: str = "fork") -> list[str]:
    """A command as a README writes it, as argv for this interpreter.

    ``torchrun`` becomes ``launcher`` with ``--standalone`` (a private loopback port per test; by
    default the fork launcher, ``"torchrun"`` or ``"torchrun-fresh"`` for the real one), the ``deepspeed``
    launcher its runner module on a free port, ``python script`` the script forked by the fork server
    as ``python script`` runs it (``fork_launcher.py --python``; this interpreter, fresh, with
    ``"torchrun-fresh"``), ``python -m module`` this interpreter. ``nproc`` replaces the command's
    ``--nproc_per_node=`` / ``--num_gpus=`` count.
    """
    argv = shlex.split(command)
    if nproc is not None:
        argv = [re.sub(r"^--(nproc_per_node|num_gpus)=\d+$", rf"--\g<1>={nproc}", a) for a in argv]
    if argv[0] == "torchrun":
        argv = [*launcher_argv(launcher), "--standalone", *argv[1:]]
        return forked_workers(argv) if launcher == "torchrun" else argv
    if argv[0] == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", f"--master_port={free_port()}", *argv[1:]]
    if argv[0] == "python":
        if launcher == "torchrun-fresh" or argv[1] == "-m":
            return [sys.executable, *argv[1:]]
        return [*launcher_argv("fork"), "--python", *argv[1:]]
    return argv


def assert_one_line_error(result: subprocess.CompletedProcess, expected: str) -> None:
    """A bad input ended with a non-zero exit, one ``error:`` line containing ``expected``, and no
    traceback from the repository's own code (torchrun's own failure summary may follow)."""
    assert result.returncode != 0, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors, f"no 'error:' line in output:\n{result.stdout[-3000:]}"
    assert any(expected in line for line in errors), errors
    assert len(set(errors)) == 1, f"expected one distinct error line, got {errors}"
    own_frames = [line for line in result.stdout.splitlines()
                  if line.strip().startswith("File ") and str(REPO) in line]
    assert not own_frames, "traceback from repository code:\n" + "\n".join(own_frames)


# A chapter's documents for the reader, in reading order: its README.md, then a document of its own
# for a topic the README sends the reader to (the planner). Their commands are the chapter's.
DOCUMENTS = {"benchmarks": ("README.md", "planner.md")}


def chapter_documents(chapter: str) -> list[Path]:
    """The reader's documents of ``chapter`` (a folder of the repository, ``.`` for the top), in order."""
    return [REPO / chapter / name for name in DOCUMENTS.get(chapter, ("README.md",))]


def chapter_commands(chapter: str) -> list[str]:
    """Every command of the chapter's documents (:func:`readme_commands`), in reading order."""
    return [command for document in chapter_documents(chapter) for command in readme_commands(document)]


_COMMAND_START = re.compile(r"^(torchrun|python|deepspeed|bash|srun|sbatch)\s")


def readme_commands(readme: Path) -> list[str]:
    """Shell commands a reader is told to run: lines in ```bash blocks that start with torchrun,
    python, deepspeed, bash, srun or sbatch (continuation backslashes joined, comments dropped)."""
    commands, in_block, pending = [], False, ""
    for raw in readme.read_text().splitlines():
        line = raw.strip()
        if line.startswith("```"):
            in_block = line in ("```bash", "```sh", "```shell", "```console")
            pending = ""
            continue
        if not in_block or line.startswith("#"):
            continue
        line = line.split(" #")[0].rstrip()
        if pending:
            line = pending + " " + line
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        if _COMMAND_START.match(line):
            commands.append(line)
    return commands


def readme_command(readme: Path, *needles: str, without: str | None = None) -> str:
    """The one command of ``readme`` that contains every needle (and not ``without``).

    Every chapter's tests find the README commands they run this way, so a README edit that renames
    a flag or duplicates a command fails the test that runs it.
    """
    found = [c for c in readme_commands(readme)
             if all(n in c for n in needles) and (without is None or without not in c)]
    assert len(found) == 1, f"expected one command of {readme.name} with {needles}, found {found}"
    return found[0]


def lookup_parts(lookup) -> tuple[tuple, str | None]:
    """``(needles, without)`` of a lookup: a string (one needle), a tuple of needles, or
    ``(needles_tuple, without)``."""
    if isinstance(lookup, str):
        return (lookup,), None
    if len(lookup) == 2 and isinstance(lookup[0], tuple):
        return lookup[0], lookup[1]
    return tuple(lookup), None


def lookup_matches(command: str, lookup) -> bool:
    """Whether ``command`` holds every needle of a lookup (:func:`lookup_parts`) and not its ``without``."""
    needles, without = lookup_parts(lookup)
    return all(n in command for n in needles) and (without is None or without not in command)


def lookup_command(readme: Path, lookup) -> str:
    """The one command of ``readme`` that a lookup (:func:`lookup_parts`) names."""
    needles, without = lookup_parts(lookup)
    return readme_command(readme, *needles, without=without)


def assert_readme_covered(readme: Path, lookups: list) -> None:
    """Every command of ``readme`` is matched by exactly one lookup, and every lookup by exactly one
    command. A lookup is a string (a needle), a tuple of needles, or ``(needles_tuple, without)``,
    exactly as the tests pass them to :func:`readme_command`; so a command added to a README without
    a test, or a lookup that no longer finds its command, fails."""
    commands = readme_commands(readme)
    assert commands, f"{readme} shows no command"
    for command in commands:
        hits = [lookup for lookup in lookups if lookup_matches(command, lookup)]
        assert len(hits) == 1, f"README command matched by {len(hits)} tests' lookups {hits}: {command}"
    for lookup in lookups:
        hits = [command for command in commands if lookup_matches(command, lookup)]
        assert len(hits) == 1, f"lookup {lookup} finds {len(hits)} README commands: {hits}"


def load_script(path: Path, name: str | None = None):
    """A chapter script imported by its path, as a module: its functions and ``parse_args``, without
    running ``main``. Each call imports it afresh (a test may change module state), registered in
    ``sys.modules`` as ``name`` (default: ``script_<folder>_<stem>``) so dataclasses and pickling work."""
    import importlib.util

    path = Path(path)
    name = name or "script_" + re.sub(r"\W", "_", f"{path.parent.name}_{path.stem}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_args_result(module, *args: str) -> subprocess.CompletedProcess:
    """A script's ``parse_args()`` on ``args``, in this process, as a CompletedProcess (exit code and
    everything printed) for :func:`assert_one_line_error`.

    A bad flag is rejected by argparse before the script starts a process group or touches a tensor,
    so running the parser here checks the same code path, line and exit code as launching the
    script, without starting an interpreter and importing torch for every case.
    """
    import contextlib
    import io

    out, argv = io.StringIO(), sys.argv
    sys.argv = [module.__file__, *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            module.parse_args()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), "")


def run_jobs(specs: dict, tmp_path_factory) -> dict:
    """Run every job of a test file two at a time (the jobs of one file share a module fixture):
    ``specs`` maps a name to a function of a fresh folder; returns ``{name: (folder, result or the
    AssertionError it raised)}``, so a failed job fails the tests that use it (:func:`job`), not
    the others. Each job's wall time is printed (shown with ``pytest -s``)."""
    from concurrent.futures import ThreadPoolExecutor

    folders = {name: tmp_path_factory.mktemp(name) for name in specs}

    def attempt(name):
        start = time.monotonic()
        try:
            result = specs[name](folders[name])
        except AssertionError as exc:
            result = exc
        print(f"{name}: {time.monotonic() - start:.1f} s")
        return result

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(specs, pool.map(attempt, specs)))
    return {name: (folders[name], results[name]) for name in specs}


def job(jobs: dict, name: str):
    """``(folder, result)`` of a job that :func:`run_jobs` ran; re-raises its failure."""
    folder, result = jobs[name]
    if isinstance(result, BaseException):
        raise result
    return folder, result


def own_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a path only this test uses)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text:
            found.append(text)
    return found
