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
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _runs_gpu_tests(config) -> bool:
    markexpr = (config.getoption("markexpr", "") or "").replace(" ", "")
    return "gpu" in markexpr and "notgpu" not in markexpr


# The GPU suite runs in this order, most likely to find a defect first, so that a run cut short by its
# time box (a lent GPU is held for minutes) has already answered the questions that matter most.
# Node ids below tests/, matched as prefixes; every other GPU test follows in file order. Tests that
# need more GPUs than the machine has skip at once wherever they are.
GPU_ORDER = [
    # 1. the quick start (the reader's first command) at world size 1
    "test_ddp_mnist.py::test_ddp_mnist_on_one_gpu_with_nccl",
    # 2. each chapter's default command at world size 1
    "test_ch01_gpu.py::test_ddp_training_on_one_gpu_matches_single_process",
    "test_ch02_gpu.py::test_basics_on_one_gpu",
    "test_ch03_gpu.py::test_gpu_zero_stages_memory_and_equivalence[1]",
    "test_ch04_gpu.py::test_collective_ops_on_one_gpu",
    "test_ch05_gpu.py::test_tensor_parallel_on_one_gpu",
    "test_ch05_gpu.py::test_pipeline_schedules_on_one_gpu",
    "test_llama_gpu.py::test_ddp_training_trains_the_llama_on_gpus[1gpu]",
    "test_benchmarks_gpu.py::test_single_gpu_matrix_runs_on_nccl_and_matches_theory",
    # 3. the numbers a reading of the GPU path found wrong
    "test_gpu_numbers.py",
]
# Every GPU test has a timeout (pytest-timeout), so a hang costs that test and not the run. The tests
# below do several times the work of one small launch (compilations, the 1B model, a matrix of
# cells, several DeepSpeed engines), so their limit is longer.
GPU_TEST_TIMEOUT_S = 150
GPU_LONG_TESTS = {
    "test_llama_gpu.py::test_activation_checkpointing_and_compile_on_gpus": 240,
    "test_llama_gpu.py::test_llama_3_2_1b_counts_on_meta_and_steps_on_one_gpu": 240,
    "test_benchmarks_gpu.py::test_single_gpu_matrix_runs_on_nccl_and_matches_theory": 240,
    "test_benchmarks_gpu.py::test_planner_predicts_the_single_gpu_cells": 240,
    "test_ch03_gpu.py::test_gpu_zero_stages_memory_and_equivalence": 240,
    "test_ch03_gpu.py::test_gpu_train_resume_consolidate_and_generate": 240,
}


# A test started with less of the time box left than this would only be cut: it is skipped instead.
MIN_TEST_START_S = 20.0


def pytest_addoption(parser):
    parser.addoption("--time-box", type=float, default=None, metavar="SECONDS",
                     help="the session's time box (the GPU check's, on a lent GPU): no test runs past it: each "
                          "test's timeout is cut to what is left of the box, and a test with less than "
                          f"{MIN_TEST_START_S:.0f} s left is skipped, saying so")
    parser.addoption("--min-test-start", type=float, default=MIN_TEST_START_S, metavar="SECONDS",
                     help="under --time-box, the least time left to start a test with "
                          f"(default: {MIN_TEST_START_S:.0f})")
    parser.addoption("--gpu-part", choices=["first", "rest"], default=None,
                     help="the GPU check's parts of the GPU suite: 'first' the tests GPU_ORDER names, 'rest' "
                          "every other GPU test")
    parser.addoption("--gpu-plan", metavar="FILE", default=None,
                     help="write each selected test's node id and timeout (s), in run order, as JSON lines")


def pytest_configure(config):
    config.distkit_started = time.monotonic()
    # MFU's peak is measured for 0.2 s on every rank at the end of every transformer run; no test reads
    # it as a figure, and a 50th of that still times at least 3 matmuls (distkit.harness)
    os.environ.setdefault("DISTKIT_PEAK_SECONDS", "0.02")
    # The notebooks' kernels run with PYTHONHASHSEED=0 (distkit.notebooks: reproducible outputs). A
    # job's interpreter-start environment must equal the fork server's for the server to fork it, so
    # the whole session (the server, every job, the kernels) uses the same seed.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # Inductor compiles in a pool of worker processes by default, which on two cores costs more than
    # it saves: the tiny Llama's compiled run took 46 s with a cold cache, 29 s compiling in-process.
    # Set here, before the fork server starts, so every job and the server agree (an import-time variable).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if not _runs_gpu_tests(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA in this process


def gpu_rank(nodeid: str) -> int:
    """Where a GPU test runs in GPU_ORDER (len(GPU_ORDER) for the rest)."""
    name = nodeid.split("tests/", 1)[-1]
    return next((i for i, prefix in enumerate(GPU_ORDER) if name.startswith(prefix)), len(GPU_ORDER))


# Seconds each CPU-suite file takes on a 2-core machine (its tests added up; measured on 2026-11-28).
# The two workers take whole files, longest first (pyproject.toml's --no-loadscope-reorder keeps this
# order): a long file left for the end would run alone while the other worker idles. A file missing
# here runs last; a stale figure costs only time. A chapter's play (tests/spine.py) runs in the first
# of its files to start (the longest: test_ch01_tools, test_ch02_fsdp, test_ch03_deepspeed,
# test_ch04_readme, test_ch05_advanced, test_benchmarks), in place of the launches its tests made.
CPU_FILE_SECONDS = {
    "test_benchmarks.py": 140, "test_ch05_advanced.py": 117, "test_slurm.py": 116,
    "test_offline_install.py": 150, "test_ch03_deepspeed.py": 86, "test_ch01_tools.py": 73,
    "test_ch04_readme.py": 59, "test_ch02_fsdp.py": 59, "test_ch01_lesson.py": 57, "test_parity.py": 50,
    "test_ddp_mnist.py": 49, "test_ch01_ddp.py": 48, "test_ch05_cp_ep.py": 41, "test_ch02_ch05_more_lessons.py": 39,
    "test_ch01_ch03_more_lessons.py": 38, "test_ch02_hf.py": 38, "test_notebooks.py": 36, "test_reader_play.py": 35,
    "test_ch05_negative.py": 33, "test_planner.py": 32,
    "test_ch02_negative.py": 32, "test_ch05_lesson.py": 26, "test_gpu_check.py": 25, "test_jobs.py": 21,
    "test_step_peak.py": 10, "test_llama_equivalence.py": 22,
    "test_bad_input.py": 21, "test_ch02_ch03_lesson.py": 17, "test_records.py": 17, "test_ch05_ac.py": 16,
    "test_text_data.py": 13, "test_output_paths.py": 9, "test_data_and_harness.py": 9, "test_ch02_lora.py": 8,
}


def pytest_collection_modifyitems(config, items):
    if not _runs_gpu_tests(config):
        # stable: file order within a file's tests is kept
        items.sort(key=lambda item: -CPU_FILE_SECONDS.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1], 0))
        return
    part = config.getoption("gpu_part")
    if part is not None:  # the GPU check runs the suite in two parts, with measurements between them
        keep = [item for item in items if (gpu_rank(item.nodeid) < len(GPU_ORDER)) == (part == "first")]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    # In exclusive-process compute mode a CUDA context in this process makes every later job fail:
    # the tests that use CUDA here (marked cuda_in_pytest) then run after every other test.
    exclusive = os.environ.get("DISTKIT_GPU_EXCLUSIVE_PROCESS") == "1"
    items.sort(key=lambda item: (exclusive and item.get_closest_marker("cuda_in_pytest") is not None,
                                 gpu_rank(item.nodeid)))  # stable: file order within a rank
    for item in items:
        if item.get_closest_marker("timeout") is None:
            name = item.nodeid.split("tests/", 1)[-1]
            limit = next((s for prefix, s in GPU_LONG_TESTS.items() if name.startswith(prefix)), GPU_TEST_TIMEOUT_S)
            item.add_marker(pytest.mark.timeout(limit))


def pytest_collection_finish(session):
    """``--gpu-plan FILE``: the tests that will run (after every deselection), in order, with their timeouts."""
    plan = session.config.getoption("gpu_plan")
    if plan:
        import json

        Path(plan).write_text("".join(json.dumps({"test": item.nodeid, "timeout_s": timeout_of(item)}) + "\n"
                                      for item in session.items))


def timeout_of(item) -> float | None:
    """The test's pytest-timeout limit in seconds (its closest ``timeout`` marker), or None."""
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    return float(marker.args[0] if marker.args else marker.kwargs.get("timeout"))


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controlling process (or the only one)
        from launch import REPO, tree_state

        session.config.distkit_tree = tree_state(REPO)


def pytest_sessionfinish(session, exitstatus):
    """The suite plays every README command (each is run by some test) and must leave the working tree
    as it found it, as a reader's path must: a file written where git does not ignore it, or a
    committed file changed, fails the session here, named (tests/test_reader_path.py checks the
    check)."""
    before = getattr(session.config, "distkit_tree", None)
    if before is None:
        return
    from launch import REPO, tree_changes

    changed = tree_changes(before, REPO)
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = ("error: the test session changed the repository's working tree (outside what git ignores): "
                   + ", ".join(changed))
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(message, red=True)
        else:
            print(message)
        if session.exitstatus == 0:
            session.exitstatus = 1


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under ``--time-box``, no test runs past the box: its timeout is cut to what is left of the box
    before pytest-timeout arms it (this wrapper runs first), and a test with less than
    ``--min-test-start`` left (or whose box is spent) is skipped in its setup."""
    box = item.config.getoption("time_box")
    if box is not None:
        left = box - (time.monotonic() - item.config.distkit_started)
        limit, least = timeout_of(item), item.config.getoption("min_test_start")
        item.distkit_box_left = left
        if left >= min(least, limit or least) and (limit is None or limit > left):
            item.add_marker(pytest.mark.timeout(max(1, int(left))), append=False)
    yield


def pytest_runtest_setup(item):
    box = item.config.getoption("time_box")
    left = getattr(item, "distkit_box_left", None)
    if box is not None and left is not None:
        limit, least = timeout_of(item), item.config.getoption("min_test_start")
        if left <= 0:
            pytest.skip(f"the session's time box ({box:.0f} s) was spent before this test started")
        if left < min(least, limit or least):
            pytest.skip(f"{left:.0f} s of the session's time box ({box:.0f} s) was left, too little to start it")
    if os.environ.get("DISTKIT_NO_COMPILER") == "1" and item.get_closest_marker("compiles") is not None:
        pytest.skip("this machine lacks a C compiler or the Python headers, which torch.compile needs")


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject.toml): two for the CPU suite (on a 2-core machine two test
    files at once finish in about 60% of the time of one after the other: their jobs wait on
    process starts, rendezvous and gloo as much as they compute), none for the GPU suite (its tests
    measure GPU memory and time on the one GPU they share)."""
    return 0 if _runs_gpu_tests(config) else 2


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory):
    """The session's fork server (tests/fork_launcher.py). ``DISTKIT_NO_FORK_SERVER=1`` leaves it out:
    a nested session that launches nothing (collecting the GPU suite, skipping it) would only pay
    for its imports. ``DISTKIT_FRESH=1`` leaves it out too: every job then starts as a reader starts
    it, a fresh interpreter under the real torchrun (tests/fork_launcher.py's ``become_fresh``)."""
    from launch import fork_server

    if os.environ.get("DISTKIT_NO_FORK_SERVER") == "1" or os.environ.get("DISTKIT_FRESH") == "1":
        yield None
        return
    with fork_server(tmp_path_factory.mktemp("fork_server")) as socket_path:
        yield socket_path


@pytest.fixture(scope="session")
def first_command_run(tmp_path_factory, worker_id):
    """The reader's first command, ``torchrun --nproc_per_node=4 01-ddp-basics/ddp_mnist.py`` (the top
    README's quick start and chapter 01's first command), run once per session the way a reader runs
    it: in a fresh clone of this working tree (its tracked and not-ignored files, committed in a new
    repository), from the clone's root, under the real torchrun with fresh interpreters as workers
    (``launcher="torchrun-fresh"``), with the clone's own distkit, its
    default epochs and default output paths. Only ``--offline`` is added (this machine has no network).

    Returns ``(clone, CompletedProcess)``; ``QUICK_START`` (tests/launch.py) names the files the run
    wrote inside the clone. tests/test_reader_path.py, tests/test_readme_top.py,
    tests/test_ddp_mnist.py and tests/test_ch01_lesson.py assert on this one run (read only). Under
    xdist the first worker that needs it runs it in the session's shared temporary folder, and the
    others wait for it and read it there.
    """
    import fcntl
    import json
    import subprocess

    from launch import REPO, command_argv, fresh_clone, job_env, readme_command, run

    def launch(folder):
        clone = fresh_clone(folder / "clone")
        command = readme_command(REPO / "README.md", "01-ddp-basics/ddp_mnist.py")
        return clone, run(command_argv(command, launcher="torchrun-fresh") + ["--offline"], cwd=clone,
                          env=job_env(folder, PYTHONPATH=str(clone)), timeout=600)

    if worker_id == "master":  # no xdist: this process is the session
        return launch(tmp_path_factory.mktemp("first_command"))
    shared = tmp_path_factory.getbasetemp().parent  # this session's folder, above every worker's
    folder, done_file = shared / "first_command", shared / "first_command.json"
    with open(shared / "first_command.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done_file.exists():
            folder.mkdir(exist_ok=True)
            _, done = launch(folder)
            done_file.write_text(json.dumps({"args": done.args, "stdout": done.stdout}))
    saved = json.loads(done_file.read_text())
    return folder / "clone", subprocess.CompletedProcess(saved["args"], 0, saved["stdout"], "")


@pytest.fixture(scope="session")
def reader(first_command_run, tmp_path_factory, worker_id):
    """The reader played once for the whole suite (tests/spine.py): the quick start's clone, the folder
    the session's workers share and the environment of the played jobs. Chapters are played on
    demand: ``spine.play_chapter(chapter, reader)``."""
    from spine import Reader, reader_env

    clone, quick_start = first_command_run
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    return Reader(clone, shared, reader_env(clone, tmp_path_factory.mktemp("played")), quick_start)
