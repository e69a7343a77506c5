"""The suite's own launcher (tests/fork_launcher.py) does what the tests rely on.

Most tests start their jobs through it, and the suite's time depends on those jobs forking from the
session's fork server rather than importing torch again. These tests prove, with real jobs:
a job launched through the server gets torchrun's environment and its collectives work; a job whose
import-time environment differs from the server's is launched by the client itself, with the same
result; a failing rank ends the job with exit code 1; and when the launching process is killed (a
test's timeout) the ranks the server forked for it die too, leaving nothing behind. A worker that a
real launcher (torchrun, srun) starts as ``--worker`` forks from the server, gets its launcher's
SIGTERM, and ends by the signal that ended the script (each with a control). A server whose
``distkit`` is not the tree under test's refuses to start.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import FORK_LAUNCHER, forked_from_server, job_env, launcher_argv, python, torchrun

# These pin the fork server's behaviour; with DISTKIT_FRESH=1 nothing launches through it.
pytestmark = pytest.mark.skipif(os.environ.get("DISTKIT_FRESH") == "1", reason="DISTKIT_FRESH=1: no fork server")

JOB = """\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
sys.stdout.write(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
                 f"sum {total.item():g} args {sys.argv[1:]}\\n")  # one write: ranks share the pipe
sys.stdout.flush()
if "--fail" in sys.argv and dist.get_rank() == 1:
    raise SystemExit(3)
if "--hang" in sys.argv:
    open(os.path.join(os.environ["OUT"], f"pid{dist.get_rank()}"), "w").write(str(os.getpid()))
    time.sleep(600)
dist.destroy_process_group()
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return script


def _server_log(fork_server: str) -> str:
    return (Path(fork_server).parent / "fork_server.log").read_text()


def _ranks_say(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith("rank "))


def test_a_job_forks_from_the_server_with_torchruns_environment(fork_server, job, tmp_path):
    # A process that imported torch carries TORCHINDUCTOR_CACHE_DIR into its jobs' environment, one
    # that imported peft PYTORCH_NVML_BASED_CUDA_CHECK: neither may keep them off the server (each
    # once kept every job of the suite off it).
    env = job_env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTORCH_NVML_BASED_CUDA_CHECK="1")
    out = torchrun(job, "a", "b", nproc=3, env=env, timeout=120).stdout
    expected = [f"rank {r}/3 local {r} sum 6 args ['a', 'b']" for r in range(3)]
    assert _ranks_say(out) == expected, out
    assert f"launching {job} on 3 ranks" in _server_log(fork_server)


def test_a_job_with_another_import_time_environment_launches_itself(fork_server, job, tmp_path):
    out = torchrun(job, nproc=2, env=job_env(tmp_path, TORCH_CPP_LOG_LEVEL="ERROR"), timeout=120).stdout
    assert _ranks_say(out) == [f"rank {r}/2 local {r} sum 3 args []" for r in range(2)], out
    assert f"not launching {job}: its environment differs in ['TORCH_CPP_LOG_LEVEL']" in _server_log(fork_server)


def test_a_failed_rank_fails_the_job(job, tmp_path):
    result = torchrun(job, "--fail", nproc=2, tmp_path=tmp_path, check=False, timeout=120)
    assert result.returncode == 1, result.stdout
    assert "fork_launcher: rank 1 failed (exit code 3); the job was stopped" in result.stdout


def test_killing_the_launching_process_kills_the_ranks(fork_server, job, tmp_path):
    argv = [*launcher_argv("fork"), "--nproc_per_node=2", str(job), "--hang"]
    client = subprocess.Popen(argv, env=job_env(tmp_path, OUT=str(tmp_path)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT, start_new_session=True)
    pid_files = [tmp_path / f"pid{r}" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in pid_files):
        assert client.poll() is None and time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in pid_files]
    os.killpg(client.pid, signal.SIGKILL)  # what launch.run does to a test that times out
    client.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "ranks outlived the killed launcher"
    assert f"launching {job} on 2 ranks" in _server_log(fork_server)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie waiting to be reaped is dead
    except FileNotFoundError:
        return False


def test_a_plain_python_script_runs_forked_with_its_own_exit_code(fork_server, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import os, sys\n"
                      "print('rank' in {k.lower() for k in os.environ}, sys.argv[1:], __name__, flush=True)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    for code in (0, 3):
        result = python(script, code, tmp_path=tmp_path, check=False, timeout=120)
        assert result.returncode == code and result.stdout.strip() == f"False ['{code}'] __main__", result.stdout
    assert forked_from_server(fork_server, str(script)) >= 1


def test_a_job_logs_its_cpu_time_only_when_asked(fork_server, job, tmp_path):
    """``$DISTKIT_JOB_CPU_LOG`` (CONTRIBUTING.md, "How the test suite works"): one line per job with
    the test that started it and the CPU seconds of its launcher and ranks; without it, no file."""
    log = tmp_path / "cpu.jsonl"
    torchrun(job, nproc=2, env=job_env(tmp_path), timeout=120)
    assert not log.exists()
    torchrun(job, nproc=2, env=job_env(tmp_path, DISTKIT_JOB_CPU_LOG=str(log)), timeout=120)
    (line,) = [json.loads(text) for text in log.read_text().splitlines()]
    assert line["test"].startswith("tests/test_fork_launcher.py::test_a_job_logs_its_cpu_time")
    assert line["nproc"] == 2 and Path(line["script"]).name == "job.py" and line["cpu_s"] > 0


WORKER = """\
import os, signal, sys, time
def stop(signum, frame):
    print(f"pid {os.getpid()} got signal {signum}", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
print(f"pid {os.getpid()} rank {os.environ.get('RANK')} args {sys.argv[1:]}", flush=True)
if "--kill-myself" in sys.argv:
    os.kill(os.getpid(), signal.SIGKILL)
if "--wait" in sys.argv:
    open(os.environ["READY"], "w").close()
    time.sleep(600)
"""


def _worker(tmp_path: Path, *args: str, mode: str = "--worker", **env: str) -> subprocess.Popen:
    """``fork_launcher.py --worker worker.py ARGS`` as torchrun or srun starts a worker: RANK set."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.Popen([*launcher_argv("fork"), mode, str(script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=job_env(tmp_path, RANK="1", READY=str(tmp_path / "ready"), **env))


def test_a_torchrun_worker_forks_from_the_server_and_ends_as_its_script_ended(fork_server, job, tmp_path):
    """``launcher="torchrun"``: the real torchrun, whose workers are ``--worker`` clients. The script
    runs in a process the server forked (not the client's PID); a rank that kills itself with SIGKILL
    ends its client by SIGKILL too, which is what torchrun reports and restarts on. Control: the
    ``--python`` client, a plain script's launcher, reports the same death as exit code 137."""
    out = torchrun(job, "a", nproc=2, env=job_env(tmp_path), timeout=120, launcher="torchrun").stdout
    assert _ranks_say(out) == [f"rank {r}/2 local {r} sum 3 args ['a']" for r in range(2)], out
    assert forked_from_server(fork_server, str(job)) == 2
    killed = _worker(tmp_path, "--kill-myself")
    out, _ = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, out
    assert "rank 1 args ['--kill-myself']" in out and f"pid {killed.pid} " not in out  # forked, not this PID
    plain = _worker(tmp_path, "--kill-myself", mode="--python")
    plain.communicate(timeout=120)
    assert plain.returncode == 128 + signal.SIGKILL


def test_a_worker_passes_its_launchers_sigterm_to_the_script(fork_server, tmp_path):
    """torchrun stops its workers with SIGTERM (then SIGKILL after a grace): the script gets the
    SIGTERM and ends its own way (here exit code 7), with no stack dump from the fork server."""
    worker = _worker(tmp_path, "--wait")
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
        assert worker.poll() is None and time.monotonic() < deadline, worker.stdout.read()
        time.sleep(0.05)
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 7 and f"got signal {int(signal.SIGTERM)}" in out, out
    assert "stopped from outside" not in out


def test_a_worker_the_server_cannot_take_becomes_the_script(fork_server, tmp_path):
    """Another import-time environment (a fresh clone's PYTHONPATH, say): the client execs
    ``python -u script`` in its own process, the one its launcher started and watches."""
    worker = _worker(tmp_path, "--exec", TORCH_CPP_LOG_LEVEL="ERROR")
    out, _ = worker.communicate(timeout=120)
    assert worker.returncode == 0 and f"pid {worker.pid} rank 1 args ['--exec']" in out, out


def _stop_before_the_answer(tmp_path: Path, launcher: Path = FORK_LAUNCHER) -> tuple[bytes, int]:
    """A ``--worker`` client of ``launcher`` asks a stand-in fork server (a socket of this test) for a
    job; SIGTERM reaches the client before the server answers; then the server answers "R" and reads
    what the client sends. Returns (those bytes, the client's exit code)."""
    import socket
    import struct
    import threading

    tmp_path.mkdir(exist_ok=True)
    path = str(tmp_path / "server")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    asked, answered, got = threading.Event(), threading.Event(), []

    def serve():
        conn, _ = listener.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        for fd in fds:
            os.close(fd)
        asked.set()
        answered.wait(30)
        try:
            conn.sendall(b"R")
            conn.settimeout(10)
            got.append(conn.recv(2))
            conn.sendall(struct.pack("!i", -signal.SIGTERM))  # the rank ended by the forwarded signal
        except OSError:
            got.append(b"")
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = subprocess.Popen([sys.executable, str(launcher), "--worker", "no_such_script.py"],
                              env={**os.environ, "FORK_LAUNCHER_SERVER": path,  # its `import launch`
                                   "PYTHONPATH": str(FORK_LAUNCHER.parent)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    assert asked.wait(60)
    client.send_signal(signal.SIGTERM)  # before the answer: torchrun stopping a worker that just started
    time.sleep(0.5)
    answered.set()
    thread.join(30)
    client.wait(30)
    listener.close()
    return got[0], client.returncode


def test_a_stop_before_the_server_answers_is_forwarded_and_a_reset_client_is_a_gone_one(tmp_path):
    """A worker client that torchrun stops before the fork server has answered holds the signal and
    forwards it once the job runs (the rank ends by it, and so does the client); and a launcher whose
    client closed with the answer unread (Linux resets that socket) takes it as the client gone, not
    as an error with a traceback in the job's output. Controls: the client without its signal mask
    dies at once and forwards nothing; a plain ``recv`` on the reset socket raises."""
    import socket

    import fork_launcher

    assert _stop_before_the_answer(tmp_path / "held") == (b"S" + bytes([signal.SIGTERM]), -signal.SIGTERM)
    source = FORK_LAUNCHER.read_text()
    mask = "        signal.pthread_sigmask(signal.SIG_BLOCK, stops)\n"
    assert source.count(mask) == 1
    unmasked = tmp_path / "unmasked" / "fork_launcher.py"
    unmasked.parent.mkdir()
    unmasked.write_text(source.replace(mask, "        pass\n"))
    assert _stop_before_the_answer(tmp_path / "unmasked", unmasked) == (b"", -signal.SIGTERM)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.sendall(b"R")
    theirs.close()  # the answer unread
    control, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    control.sendall(b"R")
    other.close()
    assert fork_launcher._receive(ours) == b""
    with pytest.raises(ConnectionResetError):
        control.recv(2)


def test_the_server_refuses_a_distkit_that_is_not_the_tree_under_test(tmp_path):
    """A server whose ``distkit`` would come from elsewhere (here: a copy first on ``PYTHONPATH``; in
    life an editable install of another checkout) refuses in one line, exit 2, before it listens or
    imports anything. Control: this process's distkit, the tree's (the one the session's server was
    started with), passes the same check."""
    import shutil

    import fork_launcher

    copy = tmp_path / "other"
    shutil.copytree(Path(fork_launcher.__file__).resolve().parent.parent / "distkit", copy / "distkit")
    sock = tmp_path / "s.sock"
    done = subprocess.run([sys.executable, str(FORK_LAUNCHER), "--serve", str(sock)], capture_output=True, text=True,
                          env=job_env(tmp_path, PYTHONPATH=str(copy)), timeout=60)
    tree = Path(fork_launcher.__file__).resolve().parent.parent / "distkit"
    assert done.returncode == 2 and done.stderr.startswith(
        f"error: the fork server would import distkit from {copy / 'distkit'}, not from the tree under test ({tree})"
    ) and done.stderr.count("\n") == 1, done.stderr
    assert not sock.exists()
    assert fork_launcher.distkit_problem() is None


def test_hugging_face_variables_are_import_time():
    """transformers and huggingface_hub read their variables when they import, which the server does:
    a job that sets one differently starts fresh
    (test_a_job_with_another_import_time_environment_launches_itself shows the rule)."""
    import fork_launcher

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HUGGINGFACE_HUB_CACHE": "/x", "HOME": "/h"}
    assert fork_launcher._import_time_env(env) == {k: v for k, v in env.items() if k != "HOME"}


FRESH_PROBE = """\
import sys
fresh = "torch" not in sys.modules  # a forked rank inherits the server's imported torch
import torch.distributed as dist
dist.init_process_group("gloo")
sys.stdout.write(f"rank {dist.get_rank()} {'fresh' if fresh else 'forked'}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def test_fresh_mode_starts_every_rank_as_a_fresh_interpreter(fork_server, tmp_path):
    """``DISTKIT_FRESH=1``: the same launch through the suite's launcher runs the real torchrun over fresh
    interpreters (nothing imported before the script's first line), as a reader's run is. Control: the
    launch without it forks both ranks from the session's server."""
    script = tmp_path / "probe.py"
    script.write_text(FRESH_PROBE)

    def ranks(**extra) -> list[str]:
        out = torchrun(script, nproc=2, env=job_env(tmp_path, **extra), timeout=180).stdout
        return sorted(line for line in out.splitlines() if line.startswith("rank "))

    assert ranks(DISTKIT_FRESH="1") == ["rank 0 fresh", "rank 1 fresh"]
    assert ranks() == ["rank 0 forked", "rank 1 forked"]
