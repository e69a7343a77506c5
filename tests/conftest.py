"""Keeps the CPU suite on the CPU on any machine.

`pytest` (the default, ``-m 'not gpu'``) hides every GPU from the test process itself and, through
``launch.job_env``, from every job it launches: the CPU-path tests then check the gloo/CPU path
even on a GPU host. `pytest -m gpu` leaves the GPUs visible.

It starts the fork launcher's server for the session (``tests/fork_launcher.py``: fork-launched jobs
fork from one process that imported torch once), and holds the one launch two test files share
(fixtures here need no import between tests).
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _runs_gpu_tests(config) -> bool:
    markexpr = (config.getoption("markexpr", "") or "").replace(" ", "")
    return "gpu" in markexpr and "notgpu" not in markexpr


def pytest_configure(config):
    if not _runs_gpu_tests(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA in this process


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject.toml): two for the CPU suite (on a 2-core machine two test
    files at once finish in about 60% of the time of one after the other: their jobs wait on
    process starts, rendezvous and gloo as much as they compute), none for the GPU suite (its tests
    measure GPU memory and time on the one GPU they share)."""
    return 0 if _runs_gpu_tests(config) else 2


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory):
    from launch import fork_server

    with fork_server(tmp_path_factory.mktemp("fork_server")) as socket_path:
        yield socket_path


@pytest.fixture(scope="session")
def first_command_run(tmp_path_factory):
    """The reader's first command, ``torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py`` (the top
    README's quick start and chapter 01's first command), run once per session under the real torchrun
    on the offline MNIST sample with its default epochs; outputs inside a temporary folder.

    Returns ``(folder, CompletedProcess)``: ``folder`` holds ``results.jsonl``, ``model.pt``,
    ``log.txt``. tests/test_readme_top.py and tests/test_ddp_mnist.py both assert on this one run.
    """
    from launch import REPO, command_argv, job_env, readme_command, run

    folder = tmp_path_factory.mktemp("first_command")
    command = readme_command(REPO / "README.md", "01-ddp-basics/ddp_mnist.py")
    done = run(command_argv(command, launcher="torchrun") + [
        "--offline", "--data-dir", str(folder / "data"), "--results", str(folder / "results.jsonl"),
        "--save", str(folder / "model.pt"), "--log-file", str(folder / "log.txt")],
        env=job_env(folder), timeout=600)
    return folder, done
