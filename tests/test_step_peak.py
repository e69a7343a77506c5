"""A compiled model's peak memory is that of its compiled steps: the harness's instrumented step runs
it eager (``torch.compiler.set_stance("force_eager")``), so that step is read but not counted; an
eager model's peak counts every step. On CUDA the per-step meter is ``max_memory_allocated``; here it
is the GPU check's rehearsal stand-in (``distkit.rehearsal``, key ``step_peak_memory``: the process's
RSS high-water mark, reset as each step begins), which runs the same control flow on the CPU.

One launch of ``05-advanced/activation_checkpointing.py`` in a rehearsal, 1 rank, gloo, the tiny
Llama, 4 steps (step 0 warm-up, step 1 instrumented, steps 2-3 timed), ``--ac none --compile off on``:
the compiled record leaves step 1 out of ``peak_memory_steps`` and counts every other step, its
``peak_memory_bytes`` is the largest counted reading of ``peak_memory_step_bytes``; the eager record
counts every step. Negative control, the same launch against a harness mutant that counts every
step (tests/workers/harness_mutant.py installs it as ``distkit.harness`` in the job): the check fails
with "the compiled peak counts a force_eager step".

The compile runs on ``aot_eager`` (tests/workers/compiled_with.py): which steps count depends only on
whether the model is compiled and which step runs under ``force_eager``, not on the backend, and
inductor's C++ build of this model (54 s on a cold cache, CI's, on this 2-core machine; far more
under the suite's load) would be most of the file's time. Inductor's own compiled path on CPU runs
in tests/test_ch05_ac.py (the chapter's AC command, eager and compiled).
A plain CPU run (no rehearsal) meters no step, so its record keeps the fields it had (checked in
this process, on a one-layer model).
"""
from __future__ import annotations

import pytest
import torch

from distkit import rehearsal
from distkit.harness import Harness, read_records
from distkit.runtime import DistContext
from launch import REPO, WORKERS, job, job_env, run_jobs, torchrun

SCRIPT = REPO / "05-advanced" / "activation_checkpointing.py"
STEPS, WARMUP = 4, 1  # the harness's one instrumented step is step WARMUP
FLAGS = ("--arch", "llama", "--model-size", "tiny", "--steps", STEPS, "--warmup-steps", WARMUP,
         "--global-batch-size", 2, "--ac", "none", "--compile", "off", "on")
# The realistic bug: every step counted, the compiled model's eager instrumented step included.
COUNT_EVERY_STEP = ("counted = not (instrumented and is_compiled(self._state_module()))", "counted = True")
EAGER_STEP_COUNTED = "the compiled peak counts a force_eager step"


def launch(folder, mutant: bool = False) -> dict[bool, dict]:
    """The script in a rehearsal, compiled on ``aot_eager`` (``mutant``: against the harness that
    counts every step); its records by ``config.compile``."""
    env = job_env(folder, **{rehearsal.ENV: "1"})
    results = folder / "r.jsonl"
    command = (WORKERS / "compiled_with.py", "aot_eager", SCRIPT, "--")
    if mutant:
        command = (WORKERS / "harness_mutant.py", *COUNT_EVERY_STEP, command[0], "--", *command[1:])
    torchrun(*command, *FLAGS, "--results", results, nproc=1, env=env, timeout=300)
    return {record["config"]["compile"]: record for record in read_records(results)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_jobs({"harness": launch, "mutant": lambda folder: launch(folder, mutant=True)}, tmp_path_factory)


def check_peak_window(records: dict[bool, dict]) -> None:
    """The eager record counts every step; the compiled one every step but its instrumented (eager)
    one, and its peak is the largest counted reading. Each reading of a metered step is kept."""
    assert set(records) == {False, True}, records.keys()
    for compiled, record in sorted(records.items()):
        metrics = record["metrics"]
        assert metrics["peak_memory_kind"] == "rehearsal_peak_rss", metrics["peak_memory_kind"]
        (readings,), (counted,) = metrics["peak_memory_step_bytes_per_rank"], metrics["peak_memory_steps_per_rank"]
        assert [step for step, _, _ in readings] == list(range(STEPS)), readings
        assert counted == [step for step, _, kept in readings if kept], (counted, readings)
        if compiled and WARMUP in counted:
            raise AssertionError(f"{EAGER_STEP_COUNTED}: step {WARMUP} is in the peak's steps {counted}")
        expected = [step for step in range(STEPS) if not (compiled and step == WARMUP)]
        assert counted == expected, (compiled, counted)
        assert metrics["peak_memory_bytes_per_rank"] == [max(b for step, b, kept in readings if kept)], readings


def test_compiled_peak_counts_compiled_steps_only(jobs):
    _, records = job(jobs, "harness")
    check_peak_window(records)


def test_control_counting_every_step_fails(jobs):
    # They fail only if the job ran the mutant (the repository's harness writes records that pass).
    _, records = job(jobs, "mutant")
    with pytest.raises(AssertionError, match=EAGER_STEP_COUNTED):
        check_peak_window(records)


def test_plain_cpu_run_meters_no_step(monkeypatch):
    """Outside a rehearsal the record has no per-step fields and MemTracker's peak; inside one, the
    same loop meters every step."""
    def metrics() -> dict:
        ctx = DistContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo",
                          device=torch.device("cpu"), timeout_s=60)
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        harness = Harness(ctx, "probe", model=model, optimizer=optimizer, warmup_steps=1)
        for _ in range(3):
            with harness.step(samples=4):
                model(torch.ones(4, 8)).sum().backward()
                optimizer.step()
        return harness.finish()["metrics"]

    monkeypatch.delenv(rehearsal.ENV, raising=False)
    plain = metrics()
    assert plain["peak_memory_kind"] == "cpu_mem_tracker"
    assert not {key for key in plain if key.startswith("peak_memory_step")}, sorted(plain)
    monkeypatch.setenv(rehearsal.ENV, "1")
    rehearsed = metrics()
    assert rehearsed["peak_memory_kind"] == "rehearsal_peak_rss"
    assert rehearsed["peak_memory_steps_per_rank"] == [[0, 1, 2]]
