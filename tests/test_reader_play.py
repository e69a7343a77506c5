"""The reader, played: every README's commands, in the order a reader meets them, in one fresh clone.

``pytest -m reader`` (not in the default suite: 16 minutes on 2 cores, the longest command the benchmarks
README's CPU matrix). One clone of this working tree (``launch.fresh_clone``); the chapters' READMEs
in order, then ``benchmarks/`` and the
top README; in each, every bash command as written, with the README's ``export`` lines in its
environment, at a small size (:func:`small`: step counts divided by 10, the tiny model where the
command names none, the offline MNIST sample). Each command must end well: exit 0, or one distinct
``error:`` line and no traceback from the repository's files (the promise for bad input; the README
shows a few such refusals on purpose). The debug lab's scenarios fail by design and only have to end.
Afterwards the clone's ``git status`` is empty (every output lies where git ignores it) and
``records check`` passes in it.

Left out, each run by its own test instead: SLURM's ``srun``/``sbatch`` (tests/test_slurm.py starts
a cluster), the two-terminal two-node command (tests/test_ch01_ddp.py), the offline install pair
(network and a wheel folder: tests/test_offline_install.py), commands for GPUs only, and the
maintainer's ``records run``/``render``. The notebooks are executed by tests/test_notebooks.py.

Negative control (:func:`test_a_command_ending_in_a_traceback_is_seen`): a command that ends in a
traceback from a repository file fails the check a played command must pass.
"""
from __future__ import annotations

import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import REPO, changed_files, command_argv, fresh_clone, job_env, readme_commands
from test_reader_path import parsed_flags, script_and_args

ORDER = ["01-ddp-basics", "02-fsdp", "03-deepspeed", "04-nccl-operations", "05-advanced", "benchmarks", "."]
# flags that count steps: a tenth of the README's (at least 1), so resumes and crashes keep their order
STEP_FLAGS = {"--steps", "--save-every", "--crash-at-step", "--checkpoint-every", "--crash-in-checkpoint-at-step",
              "--log-every"}
LEFT_OUT = {"srun ": "SLURM", "sbatch ": "SLURM", "--nnodes=2": "two terminals", "--gpu-only": "GPUs only",
            "--world-sizes 2 4 8": "GPUs only", "distkit/offline.py": "network and a wheel folder",
            "records run": "maintainer", "records render": "maintainer"}
FAILS_BY_DESIGN = ("debug_lab.py",)


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
    """The command's words at a small size (module docstring)."""
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
    if name == "ddp_mnist.py":
        out += ["--offline", "--epochs", "1", "--max-steps", "4"]
    elif name == "parity.py":
        out += ["--steps", "2", "--held-out-every", "1"]
    elif hasattr(namespace, "steps") and "--steps" not in given and "--quick" not in given:
        out += ["--steps", "5"]
    return out


def ended_well(done: subprocess.CompletedProcess, clone: Path) -> str | None:
    """None when a run ended as the repository promises (exit 0, or one distinct ``error:`` line and no
    traceback from its own files), else what went wrong."""
    if done.returncode == 0:
        return None
    lines = done.stdout.splitlines()
    errors = {line for line in lines if line.startswith("error:")}
    frames = [line for line in lines if line.strip().startswith("File ") and str(clone) in line]
    if len(errors) == 1 and not frames:
        return None
    return f"exit {done.returncode}: " + " | ".join([*sorted(errors), *frames[-2:]] or lines[-3:])


def play(clone: Path, scratch: Path) -> list[str]:
    """Every README's commands in order in ``clone``; the problems found."""
    env = job_env(scratch, PYTHONPATH=str(clone))
    env.pop("DISTKIT_TORCHRUN", None)
    problems = []
    for chapter in ORDER:
        readme = REPO / chapter / "README.md"
        env.update(exports(readme))
        for command in readme_commands(readme):
            if any(needle in command for needle in LEFT_OUT):
                continue
            words = small(command)
            # torchrun's restarts are the lesson of the commands that ask for them: the real launcher there
            launcher = "torchrun-fresh" if "--max-restarts" in command else "fork"
            argv = command_argv(shlex.join(words), launcher=launcher)
            started = time.monotonic()
            try:
                done = subprocess.run(argv, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=900)
            except subprocess.TimeoutExpired:
                problems.append(f"{chapter}: {shlex.join(words)}: did not end in 900 s")
                continue
            print(f"{time.monotonic() - started:6.1f} s  {shlex.join(words)}", flush=True)  # pytest -s shows them
            wrong = None if any(name in command for name in FAILS_BY_DESIGN) else ended_well(done, clone)
            if wrong:
                problems.append(f"{chapter}: {shlex.join(words)}: {wrong}")
    return problems


@pytest.mark.reader
def test_every_readme_played_in_order_in_a_fresh_clone(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    problems = play(clone, tmp_path)
    assert problems == [], "\n".join(problems)
    assert changed_files(clone) == []
    check = subprocess.run([sys.executable, "-m", "distkit.records", "check"], cwd=clone,
                           env=job_env(tmp_path, PYTHONPATH=str(clone)), capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


def test_a_command_ending_in_a_traceback_is_seen(tmp_path):
    """The check a played command passes: exit 0 and a one-line refusal pass; a traceback from a
    repository file fails it, as does an exit with no error line."""
    clone = tmp_path / "clone"
    frame = f'  File "{clone}/03-deepspeed/zero_offload.py", line 156, in main'

    def done(code, out):
        return subprocess.CompletedProcess([], code, out, "")

    assert ended_well(done(0, "ok\n"), clone) is None
    assert ended_well(done(2, "error: --steps 2 is too few\n"), clone) is None
    assert ended_well(done(1, f"Traceback (most recent call last):\n{frame}\nTypeError: x\n"), clone)
    assert ended_well(done(1, "Killed\n"), clone)
    # the play runs chapter 01's restarts with the variable its README exports (without it they hang)
    assert exports(REPO / "01-ddp-basics" / "README.md")["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
