"""A finished rank exits: distkit's teardown never lets a process group be destructed while the
process runs (tests/workers/teardown.py).

The bug this guards against was a CI failure: a two-rank ddp_training.py job, forked by the suite's
fork server, printed its last line and then one rank never exited. Its stacks (gdb, reproduced 3
times in about 140 launches on a busy 2-core machine): the main thread in
``ProcessGroupGloo::~ProcessGroupGloo`` joining gloo's worker thread, called from
``Reducer::~Reducer`` as the function holding the DDP model returned, with the GIL held; the worker
thread in ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject``, waiting for the
GIL. ``destroy_process_group`` had dropped torch.distributed's references, so DDP's Reducer held the
group's last one. The fix, :func:`distkit.runtime.destroy_groups`, keeps a reference to every group
until the process ends with ``os._exit``.

The deadlock needs an unlucky schedule, so the test observes what makes it possible: whether freeing
the model runs the group's destructor (gloo's worker threads end). Negative control: the plain
``barrier`` + ``destroy_process_group`` teardown, where they do (and which hung in 4 of 120 launches
three at a time, before the worker waited a second before freeing the model). Both run where the
Reducer holds the group's last reference: with ``torch.distributed.fsdp`` imported, as in the fork
server (tests/workers/teardown.py says why).
"""
from __future__ import annotations

import re

import pytest

from launch import WORKERS, torchrun


def worker_threads(teardown: str, tmp_path) -> tuple[int, int]:
    out = torchrun(WORKERS / "teardown.py", "--teardown", teardown, nproc=2, tmp_path=tmp_path, timeout=120).stdout
    match = re.search(r"gloo worker threads: (\d+) while training, (\d+) after the model was freed", out)
    assert match, out[-3000:]
    return int(match.group(1)), int(match.group(2))


def test_distkit_teardown_keeps_the_groups_alive_until_the_process_ends(tmp_path):
    while_alive, after = worker_threads("distkit", tmp_path)
    assert while_alive > 0
    assert after == while_alive, "freeing the model destructed the process group while the GIL was held"


@pytest.mark.parametrize("teardown", ["plain"])
def test_negative_control_plain_destroy_leaves_the_group_to_the_reducer(teardown, tmp_path):
    while_alive, after = worker_threads(teardown, tmp_path)
    assert while_alive > 0 and after == 0, (while_alive, after)
