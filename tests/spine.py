"""The reader, played once for the whole suite: one fresh clone, each README command run once in it.

The clone is the quick start's (``conftest.first_command_run``: a fresh clone of this working tree
in which ``torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py`` ran as written). Each chapter's
README commands then run in it in the README's order (:func:`play_chapter`), from the clone's root,
with every README's ``export`` lines, at the size the chapter's tests check them: a command that a
chapter's ``*_common`` module gives a :class:`Form` in its ``PLAY`` gets that form's flags appended
(outputs the README names stay where it names them; the flags that only a test adds write under
``runs/played/``), every other command the generic small size of :func:`small`. The chapter's tests
assert on what the run printed and wrote (:class:`Played`) instead of launching the command again.

tests/test_reader_play.py checks the clone as the reader leaves it: every command ended well, its
``git status`` is empty, ``records check`` passes in it; tests/test_notebooks.py executes each
chapter's notebook there after its chapter's commands.

Chapters are played side by side (the suite's two workers each play the chapters their test files
need, one lock per chapter in the session's shared folder; a chapter played once is read back by
every other worker). That equals one reader going through them in order because what a command reads
is committed or written above it in its own README (tests/test_reader_path.py) and no two chapters
write the same file (tests/test_reader_play.py).

The jobs start as the suite's others do, forked from the session's fork server
(tests/fork_launcher.py), whose ``distkit`` is the working tree's, byte for byte the clone's (a server
of the clone's own would cost 20 CPU-seconds per worker; ``python`` commands that start a fresh
interpreter from the clone's root import the clone's); torchrun's restarts run under the real
torchrun (``Form.launcher``), scripts that start torchrun themselves find tests/bin/torchrun first on
``PATH`` and jobs started by the benchmarks scripts go through ``$DISTKIT_TORCHRUN``, as in every
other test.
"""
from __future__ import annotations

import fcntl
import json
import math
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from launch import (
    chapter_commands,
    chapter_documents,
    command_argv,
    job_env,
    launcher_argv,
    lookup_matches,
    own_processes,
    torchrun_on_path,
)

CHAPTERS = ["01-ddp-basics", "02-fsdp", "03-deepspeed", "04-nccl-operations", "05-advanced", "benchmarks", "."]
# flags that count steps: a tenth of the README's (at least 1), so resumes and crashes keep their order
STEP_FLAGS = {"--steps", "--save-every", "--crash-at-step", "--checkpoint-every", "--crash-in-checkpoint-at-step",
              "--log-every"}
# Commands the play leaves out, each run by its own test instead: SLURM's srun/sbatch
# (tests/test_slurm.py starts a cluster), the two-terminal two-node command (tests/test_ch01_ddp.py),
# the offline install pair (network and a wheel folder: tests/test_offline_install.py) and the
# maintainer's records run/render; benchmarks/README.md's `records check benchmarks`, which the top
# README's `records check` (the whole repository, played after every other command) runs within.
# (The GPU matrices are planned: --dry-run, below.)
LEFT_OUT = {"srun ": "SLURM", "sbatch ": "SLURM", "--nnodes=2": "two terminals",
            "distkit/offline.py": "network and a wheel folder",
            "records run": "maintainer", "records render": "maintainer",
            "records check benchmarks": "the top README's records check"}
FAILS_BY_DESIGN = ("debug_lab.py",)
PLAYED = "runs/played"  # where the flags a test adds write, in the clone
EXTENSIONS = f"{PLAYED}/torch_extensions"  # DeepSpeed's JIT-compiled ops would land here


@dataclass(frozen=True)
class Form:
    """How the play runs one README command: ``flags`` appended to it (``{out}`` is the command's own
    folder under the clone's ``runs/played/``, as an absolute path, as the tests name their temporary
    folders), under ``launcher`` (tests/launch.py's names), with ``nproc`` ranks instead of the
    README's where given."""
    flags: tuple = ()
    launcher: str = "fork"
    nproc: int | None = None


def exports(readme: Path) -> dict[str, str]:
    """The ``export NAME=value`` lines of a README's bash blocks."""
    found, in_bash = {}, False
    for raw in readme.read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if line.startswith("```"):
            in_bash = line == "```bash"
        elif in_bash and line.startswith("export ") and "=" in line:
            name, value = line[len("export "):].split("=", 1)
            found[name] = value
    return found


def small(command: str) -> list[str]:
    """The command's words at the generic small size: step counts divided by 10 (at least 1), the tiny
    model where the command names none, the offline MNIST sample, a few steps where it names none, two
    spawned processes; the matrices bigger than ``--quick`` planned (``--dry-run``: the quick matrix
    runs their cells' code)."""
    from test_reader_path import parsed_flags, script_and_args

    words, out = shlex.split(command), []
    for i, word in enumerate(words):
        previous = words[i - 1] if i else ""
        out.append(str(max(1, math.ceil(int(word) / 10))) if previous in STEP_FLAGS and word.isdigit() else word)
    found = script_and_args(command)
    if found is None:
        return out
    namespace, given = parsed_flags(*found), set(words)
    name = found[0].name
    if hasattr(namespace, "model_size") and "--model-size" not in given and getattr(namespace, "arch", "gpt") == "gpt":
        out += ["--model-size", "tiny"]
    if name == "ddp_spawn.py":  # mp.spawn starts fresh interpreters (its lesson: no launcher): two, not four
        out += ["--nproc", "2"]
    if name == "ddp_mnist.py":
        out += ["--offline", "--epochs", "1", "--max-steps", "4"]
    elif name == "distributed_benchmarks.py" and "--quick" not in given:
        out += ["--dry-run"]
    elif name == "parity.py":
        out += ["--steps", "2", "--held-out-every", "1"]
    elif hasattr(namespace, "steps") and "--steps" not in given and "--quick" not in given:
        out += ["--steps", "5"]
    return out


def ended_well(returncode: int, stdout: str, clone: Path) -> str | None:
    """None when a run ended as the repository promises (exit 0, or one distinct ``error:`` line and no
    traceback from its own files), else what went wrong."""
    if returncode == 0:
        return None
    lines = stdout.splitlines()
    errors = {line for line in lines if line.startswith("error:")}
    frames = [line for line in lines if line.strip().startswith("File ") and str(clone) in line]
    if len(errors) == 1 and not frames:
        return None
    return f"exit {returncode}: " + " | ".join([*sorted(errors), *frames[-2:]] or lines[-3:])


def left_running(folder: Path, returncode: int | None) -> list[str]:
    """After a job that failed: the command lines of live processes that name its folder (a rank left
    behind; the debug lab's stuck rank writes its log there), half a second after it ended."""
    if returncode == 0:
        return []
    time.sleep(0.5)
    return own_processes(str(folder))


def forms(chapter: str) -> dict:
    """The chapter's forms, ``{lookup: Form}`` (its tests' ``*_common`` module's ``PLAY``)."""
    import importlib

    module = {"01-ddp-basics": "ch01_common", "02-fsdp": "ch02_common", "03-deepspeed": "ch03_common",
              "04-nccl-operations": "ch04_common", "05-advanced": "ch05_common",
              "benchmarks": "benchmarks_common"}.get(chapter)
    return getattr(importlib.import_module(module), "PLAY", {}) if module else {}


def form_of(chapter: str, command: str) -> Form | None:
    found = [form for lookup, form in forms(chapter).items() if lookup_matches(command, lookup)]
    assert len(found) <= 1, f"{command}: {len(found)} forms"
    return found[0] if found else None


@dataclass
class Played:
    """What one chapter's play ran: per README command (in order) its argv, exit code, output and folder."""
    chapter: str
    clone: Path
    runs: list[dict]

    def of(self, lookup) -> dict:
        """The run of the one command ``lookup`` (a string, needles, or ``(needles, without)``) finds;
        ``run["out"]`` is its folder in the clone (absolute)."""
        found = [r for r in self.runs if lookup_matches(r["command"], lookup)]
        assert len(found) == 1, f"{self.chapter}: {len(found)} played commands match {lookup}"
        return {**found[0], "out": self.clone / found[0]["out"], "clone": self.clone}

    def ok(self, lookup) -> dict:
        """:meth:`of`, for a command that must have exited 0."""
        run = self.of(lookup)
        assert run["returncode"] == 0, f"exit {run['returncode']}: {run['command']}\n{run['stdout'][-3000:]}"
        return run

    def completed(self, lookup) -> subprocess.CompletedProcess:
        """:meth:`of` as a CompletedProcess (argv, exit code, output), for the checks that take one."""
        run = self.of(lookup)
        return subprocess.CompletedProcess(run["argv"], run["returncode"], run["stdout"], "")

    def problems(self) -> list[str]:
        return [f"{self.chapter}: {shlex.join(r['argv'][-12:])}: {r['problem']}" for r in self.runs if r["problem"]]


def flag_path(run: dict, flag: str) -> Path:
    """The path a played run's last ``flag`` names (argparse keeps the last), in the clone."""
    argv = run["argv"]
    return run["clone"] / argv[len(argv) - argv[::-1].index(flag)]


@dataclass
class Reader:
    """The played clone, the folder the session's workers share and the environment of its jobs."""
    clone: Path
    shared: Path
    env: dict
    quick_start: subprocess.CompletedProcess


def reader_env(clone: Path, scratch: Path) -> dict:
    """The environment of every played job: the session's fork server (module docstring), the suite's
    launcher for jobs that scripts start, tests/bin's torchrun first on ``PATH``, an empty folder for
    DeepSpeed's compiled ops (an op it built would show there), and every README's exports (a reader
    who exported once keeps them)."""
    env = torchrun_on_path(job_env(scratch, DISTKIT_TORCHRUN=shlex.join(launcher_argv("fork")),
                                   TORCH_EXTENSIONS_DIR=str(clone / EXTENSIONS)))
    for chapter in CHAPTERS:
        for document in chapter_documents(chapter):
            env.update(exports(document))
    env.pop("PYTEST_CURRENT_TEST", None)  # the test that asked first; each played job names its chapter
    return env


def play_chapter(chapter: str, reader: Reader) -> Played:
    """The chapter's README commands, run once per session in the clone (module docstring): the first
    worker to ask plays them, under the chapter's lock; the others wait for it and read its runs."""
    slug = re.sub(r"\W", "_", chapter)
    done = reader.shared / f"played_{slug}.json"
    with open(reader.shared / f"played_{slug}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(_play(chapter, reader)))
    return Played(chapter, reader.clone, json.loads(done.read_text()))


def _play(chapter: str, reader: Reader) -> list[dict]:
    runs, slug = [], re.sub(r"\W", "_", chapter)
    for index, command in enumerate(chapter_commands(chapter)):
        if any(needle in command for needle in LEFT_OUT):
            continue
        out = f"{PLAYED}/{slug}/{index:02d}"
        if "01-ddp-basics/ddp_mnist.py" in command:  # the quick start: the clone's own run
            done = reader.quick_start
            runs.append({"command": command, "played": None, "argv": list(done.args), "returncode": done.returncode,
                         "stdout": done.stdout, "seconds": None, "out": out, "problem": None, "left_running": []})
            continue
        form = form_of(chapter, command)
        if form is None:
            words, launcher, nproc = small(command), "fork", None
        else:
            words = shlex.split(command) + [str(f).replace("{out}", str(reader.clone / out)) for f in form.flags]
            launcher, nproc = form.launcher, form.nproc
        argv = command_argv(shlex.join(words), nproc=nproc, launcher=launcher)
        (reader.clone / out).mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=reader.clone, stdout=subprocess.PIPE,
                                  env={**reader.env, "PYTEST_CURRENT_TEST": f"play {chapter}"},  # its job log line
                                  stderr=subprocess.STDOUT, text=True, timeout=900)
            code, stdout = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:  # its output so far: bytes, whatever text= said
            code, stdout = None, (exc.stdout or b"").decode(errors="replace")
        seconds = time.monotonic() - started
        print(f"{seconds:6.1f} s  {shlex.join(words)}", flush=True)  # pytest -s shows them
        if code is None:
            problem = "did not end in 900 s"
        elif any(name in command for name in FAILS_BY_DESIGN):
            problem = None
        else:
            problem = ended_well(code, stdout, reader.clone)
        runs.append({"command": command, "played": shlex.join(words), "argv": argv, "returncode": code,
                     "stdout": stdout, "seconds": seconds,
                     "out": out, "problem": problem, "left_running": left_running(reader.clone / out, code)})
    return runs
