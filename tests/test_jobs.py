"""A job cut at its time limit leaves no process behind and writes nothing after the cut.

``distkit/jobs.py`` runs every timed job of the repository (recorded runs, benchmark cells, the
tests' launches). Here it runs tests/workers/hung_job.py under the real torchrun (fresh
interpreters: torchrun's own process layout, each worker in a session of its own): rank 0 hangs in a
gloo barrier, rank 1 ignores SIGTERM and has a child of its own, and each rank would append a "late"
line to the results file some seconds after the cut. The check (:func:`assert_nothing_after_cut`):
every process of the job (torchrun's agent, both workers, rank 1's child) is gone, and once the late
lines were due the results file holds only the lines written before the cut.

Negative control: the same job through a mutant of jobs.py whose ``end_tree`` kills the leader's
process group alone; torchrun's workers, in sessions of their own, survive it, and the same check
fails. The survivors do write their late lines, so the file half of the check is not vacuous either.
"""
from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path

import psutil
import pytest

from distkit.mutation import mutated_source
from launch import REPO, WORKERS, job_env

JOBS = REPO / "distkit" / "jobs.py"
LIMIT_S = 8.0  # the pid files appear 2-4 s after the launch (written before torch is imported)
GRACE_S = 2.0  # rank 1 ignores SIGTERM: the SIGKILL comes this long after the cut
LATE_S = 10.0  # from each rank's start: past the cut and its grace, so a late line comes after the cut
RANK_FILES = ("rank0.pid", "rank1.pid")
PID_FILES = ("agent.pid", *RANK_FILES, "child.pid")
STARTED = ["started rank 0", "started rank 1"]
# The mutant's end_tree: SIGKILL to the leader's process group, nothing else (a plain job killer's way)
GROUP_ONLY = ("    known = _with_descendants({pid: leader})\n",
              "    os.killpg(pid, signal.SIGKILL)\n    return [pid]\n")


def load_jobs(name: str, source: str) -> types.ModuleType:
    """jobs.py (or a mutant of it) loaded from its text, without the distkit package."""
    module = types.ModuleType(name)
    module.__file__ = str(JOBS)
    sys.modules[name] = module  # dataclasses look their module up there
    exec(compile(source, str(JOBS), "exec"), module.__dict__)
    return module


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has ended; it waits for its new parent to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_hung_job(jobs: types.ModuleType, tmp_path: Path):
    """The hung job run by ``jobs.run_job`` at LIMIT_S: its result, the pids it recorded, when its
    late lines were due, and its results file."""
    pid_dir, results = tmp_path / "pids", tmp_path / "results.txt"
    pid_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKERS / "hung_job.py"), str(pid_dir), str(results), str(LATE_S)]
    cut_at = time.time() + LIMIT_S
    result = jobs.run_job(cmd, LIMIT_S, cwd=REPO, env=job_env(tmp_path), grace_s=GRACE_S)
    returned = time.time()
    output = (result.output or b"").decode(errors="replace")[-3000:]
    assert result.cut and result.returncode == 124, output
    # every process existed when the cut came: a job cut before it started would pass vacuously
    unwritten = [name for name in PID_FILES
                 if not (pid_dir / name).exists() or (pid_dir / name).stat().st_mtime > cut_at]
    assert not unwritten, f"{unwritten} not written before the cut, {LIMIT_S:g} s after the launch:\n{output}"
    pids = {name: int((pid_dir / name).read_text()) for name in PID_FILES}
    starts = [(pid_dir / name).stat().st_mtime for name in RANK_FILES]
    assert min(starts) + LATE_S > returned, "the late lines were due before the cut ended: raise LATE_S"
    return result, pids, max(starts) + LATE_S + 1.0, results


def assert_nothing_after_cut(pids: dict[str, int], results: Path, late_at: float) -> None:
    """The check: no process of the job is left, and once the late lines were due (``late_at``) the
    results file holds only the lines written before the cut."""
    left = {name: pid for name, pid in pids.items() if running(pid)}
    if left:
        raise AssertionError(f"processes left after the cut: {left}")
    time.sleep(max(0.0, late_at - time.time()))
    lines = sorted(results.read_text().splitlines())
    if lines != STARTED:
        raise AssertionError(f"the results file got lines after the cut: {lines}")


def end_survivors(pid_dir: Path) -> None:
    """End every process of the job still running (each is a tree of its own by now): the negative
    control's survivors, or a failed test's."""
    jobs = load_jobs("jobs_cleanup", JOBS.read_text())
    for pid_file in pid_dir.glob("*.pid"):
        if running(pid := int(pid_file.read_text())):
            jobs.end_tree(pid, grace_s=0.0)


def test_jobs_loads_by_path_without_torch():
    code = (f"import importlib.util, sys\nspec = importlib.util.spec_from_file_location('jobs', {str(JOBS)!r})\n"
            "jobs = importlib.util.module_from_spec(spec); sys.modules['jobs'] = jobs; spec.loader.exec_module(jobs)\n"
            "r = jobs.run_job('echo out; echo err >&2; exit 3', 30)\n"
            "assert (r.output, r.returncode, r.cut, r.ended) == (b'out\\nerr\\n', 3, False, []), r\n"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def cut_jobs(tmp_path_factory):
    """The hung job run side by side by jobs.py and by the mutant (each waits on its limit, so together
    they take the time of one): {"real": ..., "mutant": ...}, each (result, pids, late_at, results)."""
    from concurrent.futures import ThreadPoolExecutor

    modules = {"real": load_jobs("jobs_under_test", JOBS.read_text()),
               "mutant": load_jobs("jobs_group_only", mutated_source(JOBS, *GROUP_ONLY))}
    folders = {name: tmp_path_factory.mktemp(name) for name in modules}
    try:
        with ThreadPoolExecutor(len(modules)) as pool:
            futures = {name: pool.submit(run_hung_job, module, folders[name]) for name, module in modules.items()}
            yield {name: future.result() for name, future in futures.items()}
    finally:
        for folder in folders.values():
            end_survivors(folder / "pids")


def test_a_cut_torchrun_job_leaves_no_process_and_no_late_line(cut_jobs):
    result, pids, late_at, results = cut_jobs["real"]
    assert set(pids.values()) <= set(result.ended), f"end_tree did not list {pids}: {result.ended}"
    assert_nothing_after_cut(pids, results, late_at)


def test_negative_control_killing_the_leaders_group_alone_leaves_the_workers(cut_jobs):
    result, pids, late_at, results = cut_jobs["mutant"]
    with pytest.raises(AssertionError, match="processes left after the cut"):
        assert_nothing_after_cut(pids, results, late_at)
    # A rank mid-rendezvous when torchrun's agent (its store) died can fail and exit; every rank
    # still running writes after the cut, which the file half of the check then sees.
    left = [name for name in RANK_FILES if running(pids[name])]
    time.sleep(max(0.0, late_at - time.time()))
    lines = results.read_text().splitlines()
    output = (result.output or b"").decode(errors="replace")[-3000:]
    assert {f"late rank {name[4]}" for name in left} <= set(lines), f"{left} running, lines {lines}:\n{output}"
