"""The GPU check's CPU side: what can be checked of it on a machine without a GPU.

* ``python benchmarks/gpu_check.py`` (the top README's command) says "no GPU" in one line and exits 0;
* ``pytest -m gpu`` collects cleanly, in the order ``tests/conftest.py`` sets (the quick start first,
  then each chapter's default command), every GPU test with a timeout, and every entry of
  ``GPU_ORDER`` names a test that exists (a renamed test would otherwise drop silently to the end);
* ``--time-box`` skips what would start after the box, saying so; without it, the same tests skip
  for the reason they always do here (no GPU): the negative control.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

from conftest import GPU_LONG_TESTS, GPU_ORDER, gpu_rank
from launch import REPO, job_env, readme_command

GPU_CHECK = "benchmarks/gpu_check.py"


def pytest_gpu(*args: str, tmp_path) -> subprocess.CompletedProcess:
    """``pytest -m gpu ARGS`` in a fresh process, GPUs hidden (this machine's answer either way). Its
    temporary folder has a short path: the fork server's Unix socket lives there (108 bytes at most)."""
    basetemp = tempfile.mkdtemp(prefix="gpu-suite-")
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider",
                               "--basetemp", basetemp, *args], cwd=REPO,
                              env=job_env(tmp_path, DISTKIT_NO_FORK_SERVER="1"),  # it launches nothing here
                              capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)


def test_the_gpu_check_says_no_gpu_in_one_line(tmp_path):
    command = readme_command(REPO / "README.md", GPU_CHECK)
    assert command == f"python {GPU_CHECK}"
    done = subprocess.run([sys.executable, GPU_CHECK], cwd=REPO, env=job_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0 and len(lines) == 1 and lines[0].startswith("no GPU"), done.stdout + done.stderr


COLLECT = """
import sys, pytest
class Report:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("item", item.nodeid, item.get_closest_marker("timeout") is not None)
sys.exit(pytest.main(["-m", "gpu", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider", "--time-box", "0",
                      "--basetemp", sys.argv[1], *sys.argv[2:]], plugins=[Report()]))
"""
# The files that hold GPU tests (each marks them with the gpu marker): collecting only these is what
# `pytest -m gpu` selects anyway, without importing every other test module a second time.
GPU_FILES = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def test_the_gpu_suite_is_ordered_timed_and_boxed(tmp_path):
    """``pytest -m gpu --time-box 0``, run as a GPU node would run it, with each collected item's id and
    whether it has a timeout: the order, the timeouts, and every test skipped by the box (not for
    lack of a GPU: the box is checked before anything else)."""
    done = subprocess.run([sys.executable, "-c", COLLECT, str(tmp_path / "collect"), *GPU_FILES], cwd=REPO,
                          env=job_env(tmp_path, DISTKIT_NO_FORK_SERVER="1"), capture_output=True, text=True,
                          timeout=300)
    items = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("item ")]
    ids = [nodeid for nodeid, _ in items]
    assert done.returncode == 0 and len(ids) > 40, done.stdout[-3000:]
    assert [nodeid for nodeid, timed in items if timed != "True"] == []
    for prefix in [*GPU_ORDER, *GPU_LONG_TESTS]:
        assert any(i.split("tests/", 1)[-1].startswith(prefix) for i in ids), f"names no test: {prefix}"
    ranks = [gpu_rank(i) for i in ids]
    assert ranks == sorted(ranks), "collected out of GPU_ORDER"
    assert ids[0].endswith("test_ddp_mnist.py::test_ddp_mnist_on_one_gpu_with_nccl")  # the quick start first
    assert f"{len(ids)} skipped" in done.stdout and "time box (0 s) was spent" in done.stdout, done.stdout[-2000:]
    assert "needs 1 GPU" not in done.stdout and "this machine has 0" not in done.stdout


def test_without_a_box_the_gpu_tests_skip_for_want_of_a_gpu(tmp_path):
    """The box's negative control: the same kind of run without ``--time-box`` skips for the reason
    the GPU tests always skip here."""
    plain = pytest_gpu("tests/test_ch04_gpu.py", "-n", "0", "-rs", tmp_path=tmp_path)
    assert "time box" not in plain.stdout and "this machine has 0" in plain.stdout, plain.stdout[-2000:]
