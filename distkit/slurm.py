"""Who a process is when SLURM's ``srun`` started it: the SLURM side of :mod:`distkit.runtime`.

``srun --ntasks=4 python script.py`` starts four processes itself (no torchrun) and tells each one
who it is through ``SLURM_*`` variables instead of torchrun's ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK``. :func:`srun_task` reads them into the same five numbers:

========================  ==============================================================
rank                      ``SLURM_PROCID``
world size                ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``)
local rank                ``SLURM_LOCALID`` (with one GPU per task, it picks the GPU)
local world size          this node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (else
                          ``SLURM_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``); the
                          node is ``SLURM_NODEID``
rendezvous                the step's first host (``SLURM_STEP_NODELIST``, else
                          ``SLURM_JOB_NODELIST``), port :func:`rendezvous_port` of the job
                          and step ids; ``MASTER_ADDR`` / ``MASTER_PORT`` override both
========================  ==============================================================

Only the step id (``SLURM_STEP_ID``, or the older ``SLURM_STEPID``) tells an ``srun`` task apart:
a batch script also has ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``, but it is one process,
and ``python script.py`` there is a world of one.

Everything here is a pure function of the environment mapping it is given; nothing starts a
process (no ``scontrol show hostnames``: :func:`expand_hostlist` parses SLURM's compressed lists).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from .errors import UsageError

PORT_BASE, PORT_SPAN = 15000, 16384  # 15000-31383: below Linux's ephemeral ports (32768-60999)
# Every SLURM variable srun_task reads (a test removes them all to show what happens without them).
SLURM_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                   "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_TASKS_PER_NODE",
                   "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NODELIST",
                   "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: ``"a[1,3],b"`` -> ``["a[1,3]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in host list {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    parts.append(text[start:])
    return parts


def _expand_range(spec: str, whole: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]`` (zero padding kept from the lower bound)."""
    values = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise ValueError(f"bad range {item!r} in host list {whole!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"descending range {item!r} in host list {whole!r}")
        width = len(low) if low.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, expanded in order, as ``scontrol show hostnames`` does.

    ``"node[01-03],gpu7"`` -> ``node01 node02 node03 gpu7``; several bracket groups in one name
    combine (``"r[1-2]n[1-2]"`` -> ``r1n1 r1n2 r2n1 r2n2``). Raises ``ValueError`` on a malformed list.
    """
    if not text or not text.strip():
        raise ValueError("empty host list")
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        if not part:
            raise ValueError(f"empty host name in host list {text!r}")
        expanded = [""]
        for match in re.finditer(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            literal, spec = match.group(1), match.group(2)
            choices = [literal] if spec is None else [literal + v for v in _expand_range(spec, text)]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        hosts.extend(expanded)
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed tasks-per-node list: ``"4(x2),2"`` -> ``[4, 4, 2]`` (one entry per node).

    Raises ``ValueError`` on a malformed list.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"bad tasks-per-node entry {item!r} in {text!r} (expected N or N(xK))")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def rendezvous_port(job_id: int, step_id: int) -> int:
    """The port every task of one ``srun`` step derives alike: 15000 + (job id x 16 + step id) mod
    16384. Different jobs and different steps of a job (up to 16 at once) get different ports;
    ``MASTER_PORT`` overrides it."""
    return PORT_BASE + (job_id * 16 + step_id) % PORT_SPAN


@dataclass(frozen=True)
class SrunTask:
    """One task of an ``srun`` step, in torchrun's terms."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    job_id: int
    step_id: int

    def torchrun_env(self) -> dict[str, str]:
        """The variables torchrun would have set for this process (rendezvous included)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}

    def describe(self) -> str:
        """What the first log line says about this launch."""
        nodes = f"{self.nodes} node" + ("s" if self.nodes != 1 else "")
        return (f"srun (SLURM job {self.job_id}, step {self.step_id}: {self.world_size} tasks on {nodes}, "
                f"{self.local_world_size} on this node) | rendezvous {self.master_addr}:{self.master_port}")


def is_srun_task(environ: Mapping[str, str]) -> bool:
    """True in a process ``srun`` started (its step id is set); False in a batch script, an
    ``salloc`` shell or outside SLURM."""
    return bool(environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID"))


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return name, value
    return None


def _int(environ: Mapping[str, str], *names: str, minimum: int = 0) -> int:
    found = _first(environ, *names)
    if found is None:
        raise UsageError(f"srun task without {' or '.join(names)}: cannot tell this process's place in "
                         "the job (SLURM's variables are incomplete; launch with srun or torchrun)")
    name, value = found
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise UsageError(f"{name}={value!r} is not an integer >= {minimum}")
    return number


def srun_rank_hint(environ: Mapping[str, str]) -> int | None:
    """``SLURM_PROCID`` of an ``srun`` task as an int, or None; never raises (for messages printed
    before the environment is checked)."""
    if not is_srun_task(environ):
        return None
    try:
        return int(environ.get("SLURM_PROCID", ""))
    except ValueError:
        return None


def srun_task(environ: Mapping[str, str], default_addr: str | None = None,
              default_port: int | None = None) -> SrunTask | None:
    """This process's place in its ``srun`` step, or None when ``srun`` did not start it.

    ``MASTER_ADDR`` / ``MASTER_PORT`` in ``environ`` win over the derived rendezvous;
    ``default_addr`` / ``default_port`` replace the derived ones (a one-task step needs no shared
    address: the caller passes loopback and a free port). Inconsistent variables raise
    :class:`UsageError` with one line naming the variable.
    """
    if not is_srun_task(environ):
        return None
    step_id = _int(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    rank = _int(environ, "SLURM_PROCID")
    world_size = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
    local_rank = _int(environ, "SLURM_LOCALID")
    job_id = _int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if rank >= world_size:
        raise UsageError(f"SLURM_PROCID={rank} but the step has {world_size} tasks")

    per_node = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is None:
        raise UsageError("srun task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: no host to "
                         "rendezvous at")
    try:
        hosts = expand_hostlist(nodelist[1])
    except ValueError as exc:
        raise UsageError(f"{nodelist[0]}: {exc}") from None
    if per_node is not None:
        try:
            tasks_per_node = parse_tasks_per_node(per_node[1])
        except ValueError as exc:
            raise UsageError(f"{per_node[0]}: {exc}") from None
    else:  # only the uniform --ntasks-per-node count
        uniform = _int(environ, "SLURM_NTASKS_PER_NODE", minimum=1)
        tasks_per_node = [uniform] * len(hosts)
        per_node = ("SLURM_NTASKS_PER_NODE", str(uniform))
    if sum(tasks_per_node) != world_size:
        raise UsageError(f"{per_node[0]}={per_node[1]!r} adds up to {sum(tasks_per_node)} tasks, "
                         f"but the step has {world_size}")
    node_rank = _int(environ, "SLURM_NODEID") if len(tasks_per_node) > 1 else 0
    if node_rank >= len(tasks_per_node):
        raise UsageError(f"SLURM_NODEID={node_rank} but {per_node[0]}={per_node[1]!r} lists "
                         f"{len(tasks_per_node)} nodes")
    local_world_size = tasks_per_node[node_rank]
    if local_rank >= local_world_size:
        raise UsageError(f"SLURM_LOCALID={local_rank} but node {node_rank} runs {local_world_size} tasks")

    master_addr = environ.get("MASTER_ADDR") or default_addr or hosts[0]
    port_text = environ.get("MASTER_PORT")
    if port_text:
        try:
            master_port = int(port_text)
        except ValueError:
            raise UsageError(f"MASTER_PORT={port_text!r} is not a port number") from None
    else:
        master_port = default_port if default_port is not None else rendezvous_port(job_id, step_id)
    return SrunTask(rank, world_size, local_rank, local_world_size, node_rank, len(tasks_per_node),
                    master_addr, master_port, job_id, step_id)
