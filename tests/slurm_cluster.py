"""A real SLURM cluster on this one machine, for the tests and for trying the README's SLURM commands.

It runs the packaged daemons (Debian: ``apt-get install slurm-wlm munge``) as this user, on loopback,
with everything they write in one folder: ``munged`` with a fresh key and its own socket,
``slurmctld``, and two ``slurmd`` on one host (node ``<hostname>`` and node ``<hostname>-2``, each
offering this machine's CPUs). Partition ``one`` (the default) is the first node; partition ``two``
holds both, for the multi-node commands (``SLURM_PARTITION=two`` / ``SBATCH_PARTITION=two``). The
ports are free ones picked at start, so it never collides with a real cluster or another copy.

Settings a production cluster would not need: ``ProctrackType=proctrack/linuxproc`` and
``TaskPlugin=task/none`` (no cgroups in a container), ``EnforcePartLimits=ALL`` (a request no node
can ever hold is refused at once, with one line, instead of pending forever), ``OverSubscribe=FORCE:4``
(jobs share CPUs instead of queueing behind each other: the tests run two at a time), ``KillWait=5``,
``MinJobAge=2`` (a finished job leaves ``squeue`` after 2 s; ``sbatch --wait`` polls the job every
2 s then, not after 2, 10 and 42 s).

    python tests/slurm_cluster.py /tmp/slurm     # start one, print how to use it; Ctrl-C stops it
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "squeue", "sinfo")
INSTALL_HINT = "sudo apt-get install slurm-wlm munge   (Debian/Ubuntu: the packaged SLURM and munge)"


def _find(name: str) -> str | None:
    # the daemons live in /usr/sbin, which a normal user's PATH may lack
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def missing_binaries() -> list[str]:
    """The SLURM and munge programs this machine lacks (empty: a cluster can start)."""
    return [name for name in (*DAEMONS, *CLIENTS) if _find(name) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without any SLURM job's variables: a command
    run from inside an allocation would otherwise inherit its job, step and options."""
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))]:
        del env[key]
    return env


@dataclass
class Cluster:
    folder: Path
    host: str
    nodes: tuple[str, str]
    cpus: int
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        """``base`` with this cluster as the one SLURM's commands talk to."""
        env = client_env(base)
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def command(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A SLURM client command (scontrol, squeue, sinfo) against this cluster."""
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        """The daemons' log tails, for a failure message."""
        parts = []
        for path in sorted((self.folder / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop the daemons this object started, by PID (slurmd and slurmctld first, munged last)."""
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()


def write_config(folder: Path, host: str, nodes: tuple[str, str], cpus: int, user: str,
                 ctld_port: int, node_ports: tuple[int, int], munge_socket: Path) -> Path:
    lines = [
        "ClusterName=distkit-tests",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}/%n",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'log'}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "EnforcePartLimits=ALL",
        "ReturnToService=2",
        "KillWait=5",
        "MinJobAge=2",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SwitchType=switch/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
    ]
    for name, port in zip(nodes, node_ports):
        lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN")
    # OverSubscribe: up to 4 jobs share a CPU, so the tests' jobs run side by side instead of queueing
    lines.append(f"PartitionName=one Nodes={nodes[0]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4")
    lines.append(f"PartitionName=two Nodes={','.join(nodes)} MaxTime=INFINITE State=UP OverSubscribe=FORCE:4")
    conf = folder / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def start(folder: str | os.PathLike, timeout: float = 60) -> Cluster:
    """Start munged, slurmctld and two slurmd (foreground processes of this one) with their files in
    ``folder``; returns once both nodes are idle. Raises RuntimeError (with the logs) otherwise."""
    missing = missing_binaries()
    if missing:
        raise RuntimeError(f"not installed: {', '.join(missing)}; {INSTALL_HINT}")
    folder = Path(folder).resolve()
    for sub in ("munge", "state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / "munge").chmod(0o700)
    host = socket.gethostname().split(".")[0]
    nodes = (host, f"{host}-2")
    cluster = Cluster(folder, host, nodes, os.cpu_count() or 1)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = folder / "munge" / "munge.sock"
    conf = write_config(folder, host, nodes, cluster.cpus, getpass.getuser(), _free_port(),
                        (_free_port(), _free_port()), munge_socket)
    log = open(folder / "log" / "daemons.out", "ab")

    def launch(*argv):
        cluster.processes.append(subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, env=client_env()))

    try:
        # --force: munged refuses a socket folder under a world-writable /tmp otherwise
        launch(_find("munged"), "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
               f"--pid-file={folder / 'munge' / 'munged.pid'}", f"--log-file={folder / 'log' / 'munged.log'}",
               f"--seed-file={folder / 'munge' / 'munged.seed'}")
        _wait(lambda: munge_socket.exists(), timeout, "munged did not create its socket", cluster)
        launch(_find("slurmctld"), "-D", "-i", "-f", str(conf))
        for name in nodes:
            launch(_find("slurmd"), "-D", "-N", name, "-f", str(conf))

        def idle():
            out = cluster.command("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            return all(states.get(name) == "idle" for name in nodes)
        _wait(idle, timeout, "the nodes did not become idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    finally:
        log.close()
    return cluster


def _wait(ready, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [p.args[0] for p in cluster.processes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            reason = f"{', '.join(map(str, dead))} exited" if dead else f"after {timeout:g} s"
            raise RuntimeError(f"SLURM test cluster: {what} ({reason})\n{cluster.logs()}")
        time.sleep(0.2)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    try:
        running = start(sys.argv[1])
    except RuntimeError as exc:
        sys.exit(f"error: {exc}")
    print(f"SLURM is up: nodes {', '.join(running.nodes)} ({running.cpus} CPUs each), partitions one (default) "
          f"and two.\nIn another shell, from the repository root:\n  export SLURM_CONF={running.conf}\n"
          "  srun --ntasks=2 python 01-ddp-basics/ddp_mnist.py --epochs 1\nCtrl-C stops it.", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill PID` stops the daemons too
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
