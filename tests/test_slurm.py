"""SLURM for real: chapter 01's srun and sbatch commands on a running scheduler.

The first half needs no SLURM: the parsers of SLURM's compressed lists and what ``distkit`` makes of
a task's variables (``distkit.slurm``, ``distkit.runtime.use_launcher_env``), inconsistent ones
included. The second half starts a real one-host cluster once for the module (the README's
``python tests/slurm_cluster.py DIR``: munged, slurmctld and two slurmd on loopback; skipped only
where the packages are not installed, which ``.ci/run`` installs) and runs the chapter README's
SLURM commands with small flags appended:

* ``srun -n 4`` and a two-node ``srun`` of ``ddp_mnist.py`` train one job each whose
  test accuracy and parameters equal the torchrun launch of the same flags, bit for bit (same seed,
  same shards, same gloo reduction order: nothing may differ; the torchrun launches go through
  ``tests/fork_launcher.py``, torchrun's environment with forked ranks, as most tests' do); the
  negative control, the same ``srun`` with the SLURM variables distkit reads removed, runs two
  worlds of one (the original bug);
* ``sbatch --wait`` of ``slurm_ddp.sbatch`` (two nodes, CPU overrides) trains and checkpoints;
  requeued with ``scontrol requeue`` once its step-4 checkpoint exists, it runs again, resumes from a
  checkpoint and ends bit-identical to an uninterrupted torchrun of the same flags;
* a bad allocation and inconsistent SLURM variables each end with one line and a non-zero exit.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ch01_common import CHAPTER, README, TINY, readme_argv
from distkit.checkpoint import safe_load
from distkit.errors import UsageError
from distkit.harness import read_records
from distkit.slurm import SLURM_VARIABLES, expand_hostlist, parse_tasks_per_node, rendezvous_port, srun_task
from launch import (
    FORK_LAUNCHER,
    REPO,
    assert_one_line_error,
    job,
    job_env,
    readme_command,
    run,
    run_jobs,
    stop,
    torchrun,
    torchrun_on_path,
)
from slurm_cluster import INSTALL_HINT, missing_binaries

MNIST = CHAPTER / "ddp_mnist.py"
HOST = socket.gethostname().split(".")[0]  # the test cluster's first node (tests/slurm_cluster.py)
STEPS = 40  # the sbatch runs: enough steps after the step-4 checkpoint for the requeue to land mid-run

# ------------------------------------------------------------------------ SLURM's lists, no cluster


@pytest.mark.parametrize("text, hosts", [
    ("vm", ["vm"]),
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("n[1,3-4,10]", ["n1", "n3", "n4", "n10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("vm,vm-2", ["vm", "vm-2"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "a[]", "a[1-", "a]", "a,,b", "a[3-1]", "a[x]", "a[1-2[3]]"])
def test_expand_hostlist_rejects_malformed(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [("4", [4]), ("2,1", [2, 1]), ("4(x2)", [4, 4]),
                                          ("4(x2),2", [4, 4, 2]), ("1,3(x3),2", [1, 3, 3, 3, 2])])
def test_parse_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "4(x)", "x", "4(2)", "4,", "-1"])
def test_parse_tasks_per_node_rejects_malformed(text):
    with pytest.raises(ValueError):
        parse_tasks_per_node(text)


def test_rendezvous_port_differs_by_job_and_step():
    ports = {rendezvous_port(job, step) for job in range(1, 101) for step in range(16)}
    assert len(ports) == 1600 and min(ports) >= 15000 and max(ports) < 32768  # below ephemeral ports
    assert rendezvous_port(7, 0) == 15000 + 7 * 16


# ------------------------------------------------------------- a task's variables, no cluster


def srun_env(**overrides) -> dict[str, str]:
    """What srun sets in task 5 of ``srun --nodes=2 --ntasks-per-node=4`` (job 1234, step 3); the
    names are those SLURM 22.05 sets, the values made up."""
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "3", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_TASKS_PER_NODE": "4(x2)",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_srun_task_reads_slurm_variables():
    task = srun_task(srun_env())
    assert (task.rank, task.world_size, task.local_rank, task.local_world_size) == (5, 8, 1, 4)
    assert (task.node_rank, task.nodes, task.master_addr) == (1, 2, "gpu07")
    assert task.master_port == rendezvous_port(1234, 3)
    assert task.torchrun_env() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                   "GROUP_RANK": "1", "MASTER_ADDR": "gpu07",
                                   "MASTER_PORT": str(rendezvous_port(1234, 3))}
    # MASTER_ADDR / MASTER_PORT override; an uneven step; the job-level names of older SLURMs
    task = srun_task(srun_env(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert (task.master_addr, task.master_port) == ("10.0.0.1", 29500)
    uneven = srun_task(srun_env(SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_STEP_NUM_TASKS="3", SLURM_PROCID="2",
                                SLURM_LOCALID="0"))
    assert (uneven.world_size, uneven.local_world_size, uneven.node_rank) == (3, 1, 1)
    old = srun_task(srun_env(SLURM_STEP_ID=None, SLURM_STEPID="3", SLURM_STEP_NUM_TASKS=None,
                             SLURM_STEP_TASKS_PER_NODE=None, SLURM_STEP_NODELIST=None))
    assert (old.rank, old.world_size, old.local_world_size, old.master_addr) == (5, 8, 4, "gpu07")
    uniform = srun_task(srun_env(SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None,
                                 SLURM_NTASKS_PER_NODE="4"))
    assert (uniform.local_world_size, uniform.nodes) == (4, 2)


def test_not_an_srun_task():
    # a batch script (or salloc's shell) also has SLURM_PROCID=0 and the job's task count, but no step
    assert srun_task(srun_env(SLURM_STEP_ID=None, SLURM_PROCID="0")) is None
    assert srun_task({}) is None


@pytest.mark.parametrize("overrides, message", [
    ({"SLURM_PROCID": None}, "srun task without SLURM_PROCID"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer >= 0"),
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 but the step has 8 tasks"),
    ({"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": None}, "without SLURM_STEP_NUM_TASKS or SLURM_NTASKS"),
    ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS='0' is not an integer >= 1"),
    ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID=4 but node 1 runs 4 tasks"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x3)"}, "adds up to 12 tasks, but the step has 8"),
    ({"SLURM_STEP_TASKS_PER_NODE": "four"}, "SLURM_STEP_TASKS_PER_NODE: bad tasks-per-node entry"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 but SLURM_STEP_TASKS_PER_NODE='4(x2)' lists 2 nodes"),
    ({"SLURM_STEP_NODELIST": "gpu[07-"}, "SLURM_STEP_NODELIST: unbalanced '['"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "no host to rendezvous at"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port number"),
])
def test_inconsistent_slurm_variables_are_one_line(overrides, message):
    with pytest.raises(UsageError) as error:
        srun_task(srun_env(**overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.fixture
def environ():
    """os.environ without any launcher's variables; restored afterwards."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("SLURM_") or k in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")]:
        del os.environ[key]
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_use_launcher_env(environ, capsys):
    from distkit.runtime import launched_rank, local_world_size_from_env, use_launcher_env

    # srun per task: torchrun's variables from SLURM's, rank 0 names the launcher
    environ.update(srun_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"))
    assert launched_rank() == 0
    assert use_launcher_env() == "srun"
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"], environ["LOCAL_WORLD_SIZE"]) == \
        ("0", "8", "0", "4")
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("gpu07", str(rendezvous_port(1234, 3)))
    assert local_world_size_from_env() == 4
    assert capsys.readouterr().out == (f"[rank 0] launcher: srun (SLURM job 1234, step 3: 8 tasks on 2 nodes, "
                                       f"4 on this node) | rendezvous gpu07:{rendezvous_port(1234, 3)}\n")
    # torchrun inside an srun task (srun per node + torchrun): torchrun's variables win
    environ.update(RANK="6", WORLD_SIZE="16", LOCAL_RANK="2", LOCAL_WORLD_SIZE="8", MASTER_PORT="29400")
    assert launched_rank() == 6 and use_launcher_env() == "torchrun"
    assert (environ["WORLD_SIZE"], environ["MASTER_PORT"]) == ("16", "29400") and capsys.readouterr().out == ""
    # other ranks are silent; launched_rank (used before any check) knows the rank already
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        del environ[key]
    environ.update(SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NODEID="1")
    assert launched_rank() == 5 and use_launcher_env() == "srun" and environ["RANK"] == "5"
    assert capsys.readouterr().out == ""


def test_use_launcher_env_outside_srun(environ, capsys):
    from distkit.runtime import use_launcher_env

    # one-task step: a world of one on loopback (no shared port needed)
    environ.update(srun_env(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0",
                            SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="gpu07"))
    assert use_launcher_env() == "srun" and environ["WORLD_SIZE"] == "1" and environ["MASTER_ADDR"] == "127.0.0.1"
    assert "1 tasks on 1 node" in capsys.readouterr().out
    # a batch script of a 4-task job running python directly: a world of one, and a note saying so
    for key in [k for k in environ if k.startswith("SLURM_") or k in ("RANK", "MASTER_ADDR", "MASTER_PORT")]:
        del environ[key]
    environ.update(SLURM_JOB_ID="77", SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0")
    assert use_launcher_env() == "none" and environ["WORLD_SIZE"] == "1"
    assert "this SLURM job has 4 tasks but srun did not start this process" in capsys.readouterr().err


# --------------------------------------------------------------------------- a real cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The README's ``python tests/slurm_cluster.py DIR``, started once for this module and stopped by
    its PID (it stops its daemons on SIGTERM). Yields the folder; ``cluster_env`` talks to it."""
    missing = missing_binaries()
    if missing:
        message = f"SLURM is not installed ({', '.join(missing)} missing): {INSTALL_HINT}"
        if os.environ.get("DISTKIT_REQUIRE_SLURM") == "1":  # CI (.ci/run) installs it: never skip there
            pytest.fail(message)
        pytest.skip(message)
    folder = tmp_path_factory.mktemp("slurm")
    log = folder / "cluster.out"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "slurm_cluster.py"), str(folder / "cluster")],
                                stdout=out, stderr=subprocess.STDOUT, env=job_env(folder))
    try:
        deadline = time.monotonic() + 90
        while "SLURM is up" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the SLURM test cluster did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield folder / "cluster"
    finally:
        stop(proc, grace_s=60)


def cluster_env(cluster: Path, folder: Path, **extra: str) -> dict[str, str]:
    """A job's environment (launch.job_env) talking to the test cluster; ``torchrun`` on PATH is the
    real one run by this interpreter, its workers forked (launch.torchrun_on_path; the sbatch script
    calls it)."""
    return torchrun_on_path(job_env(folder, SLURM_CONF=str(cluster / "slurm.conf"), **extra))


def scontrol(cluster: Path, *args: str) -> str:
    done = subprocess.run(["scontrol", *args], env=cluster_env(cluster, cluster), capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def srun_argv(command: str, *flags) -> list[str]:
    """A README srun command as argv: ``python`` is this interpreter, each task a fork-launcher worker
    (``tests/fork_launcher.py --worker``: the fork server forks the script's process with the task's
    environment, SLURM's variables included; tests/launch.py's docstring)."""
    python = [sys.executable, str(FORK_LAUNCHER), "--worker"]
    return [part for word in shlex.split(command) for part in (python if word == "python" else [word])] + list(
        map(str, flags))


def mnist_flags(folder: Path) -> list:
    """test_ddp_mnist.py's quick run: one epoch of 4 steps on the offline sample."""
    return ["--offline", "--data-dir", folder / "data", "--epochs", "1", "--max-steps", "4",
            "--results", folder / "r.jsonl", "--save", folder / "m.pt", "--log-file", folder / "log.txt"]


def overcommit(tasks: int) -> dict[str, str]:
    """srun refuses more tasks than the node has CPUs; on a smaller machine (2 cores here) the tests
    overcommit, as the README says."""
    return {"SLURM_OVERCOMMIT": "1"} if (os.cpu_count() or 1) < tasks else {}


SRUN4 = ("srun", "--ntasks=4")
SRUN_TWO_NODES = ("srun", "--nodes=2")
SBATCH = ("slurm_ddp.sbatch",)


def training_flags(folder: Path) -> list[str]:
    """ddp_training.py's tiny run, checkpoints every 2 steps (--find-unused-parameters: DDP keeps one
    bucket order, so a resumed run repeats the arithmetic exactly; see ch01_common.training_flags)."""
    return [*TINY, "--steps", str(STEPS), "--find-unused-parameters", "--grad-accum-steps", "2",
            "--checkpoint-every", "2", "--log-every", "10", "--checkpoint-dir", str(folder / "ck"),
            "--log-dir", str(folder / "logs"), "--results", str(folder / "results.jsonl")]


def sbatch_argv(folder: Path) -> list[str]:
    """The README's sbatch command, waiting for the job, its log in ``folder``, tiny training flags."""
    argv = shlex.split(readme_command(README, *SBATCH))
    script = argv.index("01-ddp-basics/slurm_ddp.sbatch")
    return [*argv[:script], "--wait", f"--output={folder / 'slurm-%j.out'}", argv[script], *training_flags(folder)]


def job_log(folder: Path) -> str:
    (path,) = folder.glob("slurm-*.out")
    return path.read_text()


def submitted_id(text: str) -> str:
    match = re.search(r"Submitted batch job (\d+)", text)
    assert match, text[-3000:]
    return match.group(1)


def requeued_job(cluster: Path, folder: Path) -> subprocess.CompletedProcess:
    """``sbatch --wait`` of the script; once its step-4 checkpoint exists, ``scontrol requeue`` (SLURM
    kills the job and queues it again, same id). A requeued job waits 2 minutes before it is eligible
    (SLURM's rule); ``scontrol update StartTime=now`` lifts that wait, as an admin can."""
    env = cluster_env(cluster, folder, SBATCH_PARTITION="two")
    proc = subprocess.Popen(sbatch_argv(folder), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()
        job_id = submitted_id(first)
        checkpoint = folder / "ck" / "step_000004.pt"
        deadline = time.monotonic() + 300
        while not checkpoint.exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"no step-4 checkpoint: {first}"
            time.sleep(0.05)
        scontrol(cluster, "requeue", job_id)
        while "JobState=PENDING" not in scontrol(cluster, "show", "job", job_id):
            assert time.monotonic() < deadline, scontrol(cluster, "show", "job", job_id)
            time.sleep(0.2)
        scontrol(cluster, "update", f"JobId={job_id}", "StartTime=now")
        out, _ = proc.communicate(timeout=600)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, first + out, "")


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Every job of the cluster tests, two at a time: ``{name: (folder, result or its exception)}``."""
    srun4 = readme_command(README, *SRUN4)
    two_nodes = readme_command(README, *SRUN_TWO_NODES)
    # the negative control needs no 4 processes to show two worlds where one was meant
    srun2 = srun4.replace("--ntasks=4", "--ntasks=2")
    # the SLURM variables distkit reads, removed inside each task: what distkit did before it read them
    strip = " ".join(f"env -u {name}" if i == 0 else f"-u {name}" for i, name in enumerate(SLURM_VARIABLES))
    specs = {
        "requeued": lambda f: requeued_job(cluster, f),
        # the uninterrupted reference: the README's torchrun command of ddp_training.py, 2 ranks, same flags
        "uninterrupted": lambda f: run([*readme_argv("--config", nproc=2), *training_flags(f)], env=job_env(f),
                                       timeout=600),
        "srun4": lambda f: run(srun_argv(srun4, *mnist_flags(f)), env=cluster_env(cluster, f, **overcommit(4)),
                               timeout=600),
        "torchrun4": lambda f: torchrun(MNIST, *mnist_flags(f), nproc=4, tmp_path=f, timeout=600),
        "two_nodes": lambda f: run(srun_argv(two_nodes, *mnist_flags(f)),
                                   env=cluster_env(cluster, f, SLURM_PARTITION="two"), timeout=600),
        "worlds_of_one": lambda f: run(srun_argv(srun2.replace("python", f"{strip} python"), *mnist_flags(f)),
                                       env=cluster_env(cluster, f), timeout=600),
    }
    return run_jobs(specs, tmp_path_factory)


def accuracy(out: str) -> float:
    return float(re.search(r"done: test accuracy ([\d.]+)%", out).group(1))


def assert_same_training(srun_folder: Path, torchrun_folder: Path, world_size: int) -> None:
    """One job of ``world_size`` ranks, and the same model as the torchrun launch: the record's test
    accuracy and every saved parameter equal, bit for bit."""
    (record,) = read_records(srun_folder / "r.jsonl")
    (reference,) = read_records(torchrun_folder / "r.jsonl")
    assert record["world_size"] == reference["world_size"] == world_size
    assert record["test_accuracy"] == reference["test_accuracy"]
    model, expected = safe_load(srun_folder / "m.pt"), safe_load(torchrun_folder / "m.pt")
    assert model["world_size"] == world_size and model["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(model["model"][name], tensor), name


@pytest.mark.parametrize("name, reference, tasks, where", [
    ("srun4", "torchrun4", 4, "4 tasks on 1 node, 4 on this node"),
    ("two_nodes", "torchrun4", 4, "4 tasks on 2 nodes, 2 on this node"),
])
def test_srun_per_task_trains_one_job_like_torchrun(jobs, name, reference, tasks, where):
    folder, out = job(jobs, name)
    torchrun_folder, torchrun_out = job(jobs, reference)
    # the job's first line (srun's own lines, "srun: job N queued and waiting for resources", aside)
    first = next(line for line in out.stdout.splitlines() if not line.startswith("srun: "))
    match = re.fullmatch(rf"\[rank 0\] launcher: srun \(SLURM job (\d+), step (\d+): {where}\) "
                         rf"\| rendezvous {re.escape(HOST)}:(\d+)", first)
    assert match, out.stdout[-3000:]
    assert int(match.group(3)) == rendezvous_port(int(match.group(1)), int(match.group(2)))
    assert out.stdout.count("[rank 0] world size") == 1 and f"world size {tasks} | backend gloo (cpu)" in out.stdout
    assert "launcher:" not in torchrun_out.stdout  # torchrun's runs print what they always printed
    assert accuracy(out.stdout) == accuracy(torchrun_out.stdout)
    assert_same_training(folder, torchrun_folder, tasks)


def test_negative_control_without_slurm_variables_runs_worlds_of_one(jobs):
    """The same srun with the variables distkit reads removed in each task: two separate one-process
    jobs, both writing the same files (the bug the srun tests above would catch)."""
    folder, out = job(jobs, "worlds_of_one")
    assert "launcher: srun" not in out.stdout
    assert out.stdout.count("[rank 0] world size 1 |") == 2, out.stdout[-3000:]
    records = read_records(folder / "r.jsonl")
    assert [r["world_size"] for r in records] == [1, 1]
    assert safe_load(folder / "m.pt")["world_size"] == 1


def final_params(folder: Path) -> dict[str, torch.Tensor]:
    return safe_load(folder / "ck" / f"step_{STEPS:06d}.pt")["model"]


def test_sbatch_trains_checkpoints_and_resumes_after_requeue(jobs):
    """``sbatch --wait`` on two nodes, requeued once its step-4 checkpoint exists: run 1 trained and
    checkpointed on both nodes, SLURM killed it and started run 2 (same job id), which resumed from a
    checkpoint and ended bit-identical to an uninterrupted torchrun of the same flags."""
    folder, out = job(jobs, "requeued")
    clean, _ = job(jobs, "uninterrupted")
    log = job_log(folder)
    job_id = submitted_id(out.stdout)
    # SLURM's own word for where each run ran: the script prints SLURM_JOB_NODELIST and, from
    # SLURM_RESTART_COUNT, which run it is
    for run_number in (1, 2):
        assert f"job {job_id} run {run_number} on {HOST},{HOST}-2: 2 node(s) x 1 worker(s)" in log, log[-3000:]
    first_run, second_run = log.split(f"job {job_id} run 2 on")
    assert "world size 2 | backend gloo" in first_run and "step_000004.pt" in first_run
    assert "DUE TO JOB REQUEUE" in first_run and "done: loss" not in first_run
    resumed = re.search(rf"resumed from {re.escape(str(folder / 'ck'))}/step_(\d+)\.pt at step (\d+)", second_run)
    assert resumed and 4 <= int(resumed.group(2)) < STEPS, log[-3000:]  # it stopped mid-run
    assert "done: loss" in second_run and f"after {STEPS} steps (resumed at {int(resumed.group(2))})" in second_run
    (record,) = read_records(folder / "results.jsonl")  # only the run that finished writes one
    assert record["world_size"] == 2
    # the whole state came back (optimizer, scheduler, RNG, data position): the same arithmetic
    clean_params, params = final_params(clean), final_params(folder)
    assert all(torch.equal(params[k], clean_params[k]) for k in clean_params)


def one_slurm_line(result: subprocess.CompletedProcess, prefix: str) -> str:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith(prefix), result.stdout
    return lines[0]


def test_bad_allocation_is_one_line(cluster, tmp_path):
    """More tasks than the node has CPUs, more nodes than the partition has: SLURM refuses at once
    (the cluster enforces partition limits) with one line; nothing waits in the queue."""
    env = cluster_env(cluster, tmp_path, SBATCH_PARTITION="two")
    start = time.monotonic()
    srun = readme_command(README, *SRUN4).replace("--ntasks=4", "--ntasks=64")
    line = one_slurm_line(run(srun_argv(srun, *mnist_flags(tmp_path)), env=env, check=False, timeout=60),
                          "srun: error: Unable to allocate resources")
    assert "More processors requested than permitted" in line
    sbatch = sbatch_argv(tmp_path)
    sbatch[sbatch.index("--nodes=2")] = "--nodes=3"
    line = one_slurm_line(run(sbatch, env=env, check=False, timeout=60), "sbatch: error: Batch job submission failed")
    assert "Node count specification invalid" in line
    assert time.monotonic() - start < 30


def test_inconsistent_slurm_variables_in_a_real_task(cluster, tmp_path):
    """A task whose SLURM_PROCID is gone: distkit's one line, exit 2 (srun passes it on)."""
    command = readme_command(README, *SRUN4).replace("--ntasks=4", "--ntasks=1")
    result = run(srun_argv(command.replace("python", "env -u SLURM_PROCID python"), *mnist_flags(tmp_path)),
                 env=cluster_env(cluster, tmp_path), check=False, timeout=120)
    assert_one_line_error(result, "srun task without SLURM_PROCID")
    assert result.returncode == 2


def test_hostlist_parser_agrees_with_scontrol(cluster):
    for text in ["vm", "node[01-03],gpu7", "a[8-11]", "n[1,3-4,10]", "rack[1-2]-n[01-02]", f"{HOST},{HOST}-2"]:
        assert scontrol(cluster, "show", "hostnames", text).split() == expand_hostlist(text), text
