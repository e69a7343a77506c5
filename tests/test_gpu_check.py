"""The GPU check's parts that a CPU machine can prove; its whole run is rehearsed in
``tests/test_offline_install.py`` (``--rehearse``, in a fresh virtual environment after the offline install).

* ``python benchmarks/gpu_check.py`` (the top README's command) says "no GPU" in one line and exits 0;
* the lease: the stages' limits add up to 420 s (``--first-contact``: under 180 s), as the README's
  table says;
* the time box: no test runs past it (its timeout is cut to what is left, a test with too little left
  is skipped), shown on a slow test under ``tests/conftest.py``; control: the same run with the line
  that cuts the timeout removed runs past the box;
* the verdict: each way a pytest run can fail (a failed test, a usage error, an internal error, no
  test collected, a session-level failure, a run cut at its limit) is a problem and a non-zero exit,
  each shown by a real pytest run; a passing run is none;
* the preflight names what ``torch.compile`` lacks, and the check then drops the compiled runs and
  skips the tests that compile;
* the check asks torch nothing about the GPU itself (a CUDA context in its process would make every
  later job fail on an exclusive-process GPU): its profile hook sees no call into ``torch.cuda`` while
  it records a run; control: recording without the preflight's answers does call it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tomllib

from distkit import verdict
from distkit.mutation import mutated_source
from launch import REPO, job_env, load_script, readme_command

GPU_CHECK = "benchmarks/gpu_check.py"


def unused_plugins() -> list[str]:
    """pyproject.toml's ``-p no:NAME`` options: the plugins of this environment no test uses. The pytest
    runs below start outside the repository (no addopts there), and each would spend about 1.5 CPU-s
    loading them."""
    pytest_options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    addopts = shlex.split(pytest_options["addopts"])
    return [word for i, word in enumerate(addopts) if word.startswith("no:") and addopts[i - 1] == "-p"
            for word in ("-p", word)]


PYTEST = [sys.executable, "-m", "pytest", *unused_plugins()]


gpu_check = load_script(REPO / GPU_CHECK)


def test_the_gpu_check_says_no_gpu_in_one_line(tmp_path):
    command = readme_command(REPO / "README.md", GPU_CHECK)
    assert command == f"python {GPU_CHECK}"
    done = subprocess.run([sys.executable, GPU_CHECK, "--out", str(tmp_path / "out")], cwd=REPO, env=job_env(tmp_path),
                          capture_output=True, text=True, timeout=180)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0 and len(lines) == 1 and lines[0].startswith("no GPU"), done.stdout + done.stderr


# ------------------------------------------------------------------------------------------ the lease
def test_the_stages_add_up_to_the_lease_as_the_readme_says():
    """420 s for the whole check, under 180 s for --first-contact; the README's table lists every
    stage with its two limits, in order; a cut job's grace and pytest's close fit inside each stage."""
    stages = gpu_check.STAGES
    assert sum(s.full_s for s in stages) == gpu_check.LEASE_S == 420
    assert sum(s.first_s for s in stages) == gpu_check.FIRST_CONTACT_S < 180
    assert [s.name for s in stages][:3] == ["install", "preflight", "quick_start"]  # by value: these first
    assert stages[-1].name == "suite_rest" and stages[-1].full_s == 0  # the time the others leave
    for stage in stages:  # a cut job's grace (and a suite's close) fit inside its limit
        least = gpu_check.GRACE_S + (gpu_check.SUITE_CLOSE_S if stage.name.startswith("suite_") else 0)
        for share in (stage.full_s, stage.first_s):
            assert share == 0 or share > least, stage
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+|-) \|", readme, re.M)
    assert [(name, float(full), 0.0 if first == "-" else float(first)) for name, full, first in rows] == \
        [(s.name, s.full_s, s.first_s) for s in stages], rows


def test_each_stage_gets_its_share_and_the_last_what_is_left():
    started = time.monotonic() - 80  # the install and the preflight took 80 s of their 90
    lease = gpu_check.Lease(started, first_contact=False)
    assert lease.budget("quick_start") == 25
    left = lease.budget("suite_rest")
    assert 420 - 80 - 1 < left <= 420 - 80  # as if nothing ran after them: the rest may take it all
    late = gpu_check.Lease(time.monotonic() - 100, first_contact=False)  # 10 s over: taken from the next
    assert 14 < late.budget("quick_start") <= 15
    first = gpu_check.Lease(time.monotonic(), first_contact=True)
    assert [first.budget(s.name) for s in gpu_check.STAGES][:4] == pytest.approx([75, 15, 25, 60], abs=0.1)
    assert first.budget("llama_1b_ac") == 0 and first.budget("suite_rest") == 0


# -------------------------------------------------------------------------------------- the time box
SLOW_TEST = """
import time
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
def test_slow():
    time.sleep(5)


def test_after():
    pass
"""
BOX_S = 3


def boxed_run(tmp_path: Path, conftest_dir: Path) -> tuple[subprocess.CompletedProcess, float, list[dict]]:
    """A slow GPU-marked test (timeout 300 s) and a quick one under ``tests/conftest.py`` (loaded from
    ``conftest_dir`` as a plugin) with a 3 s box: (run, wall seconds, outcomes)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_boxed.py").write_text(SLOW_TEST)
    junit = tmp_path / "boxed.xml"
    env = job_env(tmp_path, DISTKIT_NO_FORK_SERVER="1",
                  PYTHONPATH=os.pathsep.join([str(conftest_dir), str(REPO / "tests")]))
    started = time.monotonic()
    done = subprocess.run([*PYTEST, "-p", "conftest", "-p", "no:cacheprovider", "-m", "gpu",
                           "-n", "0", "--time-box", str(BOX_S), "--min-test-start", "1", "--junitxml", str(junit),
                           "-q", "-rs", str(project)], cwd=project, env=env, capture_output=True, text=True,
                          timeout=120)
    return done, time.monotonic() - started, verdict.suite_outcomes(junit)


def assert_nothing_ran_past_the_box(done, wall: float, outcomes: list[dict]) -> None:
    slow = next(t for t in outcomes if t["test"].endswith("test_slow"))
    assert slow["seconds"] <= BOX_S, f"a test ran past the time box: {slow}\n{done.stdout[-2000:]}"
    after = next(t for t in outcomes if t["test"].endswith("test_after"))
    assert after["outcome"] == "skipped" and "time box" in after["reason"], after
    assert slow["outcome"] == "failed" and "Timeout" in done.stdout, done.stdout[-2000:]


def test_no_test_runs_past_the_time_box(tmp_path):
    done, wall, outcomes = boxed_run(tmp_path, REPO / "tests")
    assert_nothing_ran_past_the_box(done, wall, outcomes)
    assert wall < BOX_S + 15, wall  # pytest's start and close around the box


def test_control_a_box_that_only_skips_lets_a_test_run_past_it(tmp_path):
    """The same run with tests/conftest.py's one line that cuts a test's timeout to the box replaced by
    ``pass``."""
    mutant = tmp_path / "mutant"
    mutant.mkdir()
    (mutant / "conftest.py").write_text(mutated_source(
        REPO / "tests" / "conftest.py",
        "            item.add_marker(pytest.mark.timeout(max(1, int(left))), append=False)\n", "            pass\n"))
    done, wall, outcomes = boxed_run(tmp_path, mutant)
    with pytest.raises(AssertionError, match="a test ran past the time box"):
        assert_nothing_ran_past_the_box(done, wall, outcomes)


# ------------------------------------------------------------------------------------------ the verdict
VERDICT_CASES = {  # name: (test file, conftest, extra pytest arguments, the problem it must name)
    "passes": ("def test_ok():\n    pass\n", "", [], None),
    "a failed test": ("def test_bad():\n    assert False\n", "", [], "1 failed"),
    "a usage error": ("def test_ok():\n    pass\n", "", ["--no-such-option"], "a pytest usage error"),
    "an internal error": ("def test_ok():\n    pass\n",
                          "def pytest_collection_modifyitems(items):\n    raise RuntimeError('broken plugin')\n", [],
                          "pytest's internal error"),
    "no test collected": ("x = 1\n", "", [], "no test collected"),
    "a session-level failure": ("def test_ok():\n    pass\n",
                                "def pytest_sessionfinish(session, exitstatus):\n    session.exitstatus = 1\n", [],
                                "a session-level check failed"),
    "a cut run": ("import time\n\ndef test_hangs():\n    time.sleep(60)\n", "", [], "cut at its limit"),
}


@pytest.mark.parametrize("case", list(VERDICT_CASES))
def test_every_way_a_suite_run_fails_is_a_problem(case, tmp_path):
    """The check's own pytest runner (``run_pytest``) on a real pytest run of each kind; the verdict
    (``problems_of``) is non-zero for each failure and zero for the passing run."""
    source, conftest, extra, expected = VERDICT_CASES[case]
    (tmp_path / "test_case.py").write_text(source)
    if conftest:
        (tmp_path / "conftest.py").write_text(conftest)
    junit, log = tmp_path / "case.xml", tmp_path / "case.log"
    command = [*PYTEST, "-p", "no:cacheprovider", "-p", "no:xdist", "--junitxml", str(junit),
               "-q", *extra, str(tmp_path)]
    env = {k: v for k, v in job_env(tmp_path).items() if k != "PYTHONPATH"}
    step = verdict.run_pytest("first", command, junit, log, 4 if case == "a cut run" else 60, tmp_path, env,
                                rehearse=True, grace_s=1)
    problems = verdict.problems_of({"stages": [step], "check_cuda_calls": []})
    if expected is None:
        assert problems == [] and step["counts"]["passed"] == 1, (problems, log.read_text()[-2000:])
    else:
        assert any(expected in p for p in problems), (problems, log.read_text()[-2000:])


# ------------------------------------------------------------------------------------- the preflight
def test_the_preflight_names_what_compile_lacks_and_the_check_skips_only_that(tmp_path):
    """A PATH with no C compiler: the preflight's one line names it; the compiled runs leave the
    measurements and the tests that compile skip, saying why."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env = {**job_env(tmp_path), "PATH": str(bare)}
    env.pop("CC", None)
    done = subprocess.run([str(bare / "python"), GPU_CHECK, "--preflight", "--rehearse"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    node = json.loads(done.stdout.strip().splitlines()[-1])
    assert node["compiler"] is None and node["python_headers"] is True, node
    node["compiles"] = False
    line = gpu_check.preflight_line(node)
    assert "lacks a C compiler (cc, gcc or clang)" in line and "Python headers" not in line.split("lacks")[1], line
    for name in ("llama_tiny_ac", "llama_1b_ac"):
        for rehearse in (False, True):
            command = gpu_check.measurement_command(name, tmp_path, rehearse, compiles=False)
            assert "--compile off on" not in command and "on" not in command.split("--compile")[-1].split("--")[0]
    assert "--compile off on" in gpu_check.measurement_command("llama_tiny_ac", tmp_path, False, compiles=True)
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_compiles.py").write_text("import pytest\n\npytestmark = pytest.mark.gpu\n\n\n"
                                              "@pytest.mark.compiles\ndef test_compiles():\n    pass\n\n\n"
                                              "def test_eager():\n    pass\n")
    run = subprocess.run([*PYTEST, "-p", "conftest", "-p", "no:cacheprovider", "-m", "gpu",
                          "-n", "0", "-rs", "-q", str(project)], cwd=project, capture_output=True, text=True,
                         env=job_env(tmp_path, DISTKIT_NO_FORK_SERVER="1", PYTHONPATH=str(REPO / "tests"),
                                     DISTKIT_NO_COMPILER=gpu_check.job_env(False, node)["DISTKIT_NO_COMPILER"]),
                         timeout=120)
    assert "1 passed, 1 skipped" in run.stdout and "lacks a C compiler or the Python headers" in run.stdout, \
        run.stdout[-2000:]


# ------------------------------------------------------------------------------- no CUDA in the check
def test_the_check_records_a_run_without_asking_torch_about_the_gpu(tmp_path):
    from distkit.records import capture

    node = {"machine": {"device_name": "2-core CPU"}, "torch": "2.13.0"}
    watch = verdict.CudaWatch()
    watch.start()
    try:
        record = capture("echo device cpu", "probe", into=tmp_path / "outputs.jsonl", machine=node["machine"],
                         torch_version=node["torch"], cuda_available=False)
    finally:
        watch.stop()
    assert watch.calls == [] and record["machine"] == node["machine"] and record["backend"] == "gloo", watch.calls
    # control: the same record made without the preflight's answers asks torch.cuda
    control = verdict.CudaWatch()
    control.start()
    try:
        capture("echo device cpu", "probe", into=tmp_path / "outputs.jsonl")
    finally:
        control.stop()
    assert control.calls and all(call.startswith("torch.cuda") for call in control.calls), control.calls


# ------------------------------------------------------------------------- the quick start, offline
@contextlib.contextmanager
def stalled_proxy():
    """An HTTP proxy on loopback that accepts every connection and never answers: a network that stalls
    rather than refuses (a download without a timeout then waits for ever). Yields (its URL, the
    connections it accepted)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []

    def accept():
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", held
    finally:
        server.close()
        for conn in held:
            conn.close()


def assert_the_quick_start_ran_offline(result, connections: list, name: str) -> None:
    """The quick start ended well and asked nothing of the network (its proxy saw no connection)."""
    if connections:
        raise AssertionError(f"the quick start asked the network ({name}): {len(connections)} connection(s)")
    output = (result.output or b"").decode(errors="replace") if result else ""
    if result is None or result.cut or result.returncode != 0 or "done: test accuracy" not in output:
        raise AssertionError(f"the quick start did not end ({name}):\n{output[-2000:]}")


def test_the_quick_start_stage_runs_behind_a_stalled_network(tmp_path):
    """The check's quick start, as the rehearsal runs it, behind a proxy that never answers: it trains on
    the offline sample, ends, and never connects. Control, run beside it: the same command without
    ``--offline`` connects to the proxy (where a stalled network would hold it for ever: torchvision's
    download has no timeout); it is ended once it has."""
    from concurrent.futures import ThreadPoolExecutor

    from distkit.jobs import end_tree, run_job

    command = gpu_check.measurement_command("quick_start", tmp_path / "out", rehearse=True, compiles=True)
    assert " --offline " in command
    mutant = command.replace(" --offline ", " ").replace(str(tmp_path / "out"), str(tmp_path / "mutant"))

    def behind(proxy: str) -> dict:
        return job_env(tmp_path, http_proxy=proxy, https_proxy=proxy, HTTP_PROXY=proxy, HTTPS_PROXY=proxy,
                       no_proxy="", NO_PROXY="")

    with stalled_proxy() as (first, first_connections), stalled_proxy() as (second, second_connections), \
            ThreadPoolExecutor(1) as pool:
        offline = pool.submit(run_job, command, 90, cwd=REPO, env=behind(first))
        online = subprocess.Popen(["bash", "-c", mutant], cwd=REPO, env=behind(second), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not second_connections and online.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            end_tree(online.pid, grace_s=1)
        offline = offline.result()
        asked = list(second_connections)
    assert_the_quick_start_ran_offline(offline, first_connections, "--offline")
    with pytest.raises(AssertionError, match="the quick start asked the network"):
        assert_the_quick_start_ran_offline(None, asked, "without --offline")  # ended by us once it asked


# ------------------------------------------------------------------------------ exclusive-process mode
IN_PROCESS_FIRST = """
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.cuda_in_pytest
def test_uses_cuda_here():
    pass


def test_launches_a_job():
    pass
"""


def planned_order(tmp_path: Path, **env: str) -> list[str]:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "test_order.py").write_text(IN_PROCESS_FIRST)
    plan = tmp_path / "plan.jsonl"
    subprocess.run([*PYTEST, "-p", "conftest", "-p", "no:cacheprovider", "-m", "gpu", "-n", "0",
                    "--collect-only", "-q", "--gpu-plan", str(plan), str(project)], cwd=project, timeout=120,
                   env=job_env(tmp_path, DISTKIT_NO_FORK_SERVER="1", PYTHONPATH=str(REPO / "tests"), **env),
                   capture_output=True, check=True)
    return [json.loads(line)["test"].rsplit("::", 1)[1] for line in plan.read_text().splitlines()]


def test_on_an_exclusive_process_gpu_the_tests_using_cuda_in_pytest_run_last(tmp_path):
    """A CUDA context in the pytest process would make every later job fail on such a GPU; the check's
    preflight sets DISTKIT_GPU_EXCLUSIVE_PROCESS and tests/conftest.py orders them last. Control:
    without it, file order."""
    assert planned_order(tmp_path, DISTKIT_GPU_EXCLUSIVE_PROCESS="1") == ["test_launches_a_job", "test_uses_cuda_here"]
    assert planned_order(tmp_path) == ["test_uses_cuda_here", "test_launches_a_job"]
