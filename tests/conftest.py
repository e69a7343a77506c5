"""Keeps the CPU suite on the CPU on any machine.

`pytest` (the default, ``-m 'not gpu'``) hides every GPU from the test process itself and, through
``launch.job_env``, from every job it launches: the CPU-path tests then check the gloo/CPU path
even on a GPU host. `pytest -m gpu` leaves the GPUs visible.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    markexpr = (config.getoption("markexpr", "") or "").replace(" ", "")
    runs_gpu_tests = "gpu" in markexpr and "notgpu" not in markexpr
    if not runs_gpu_tests:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA in this process
