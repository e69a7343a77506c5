"""Chapter 01 correctness: DDP and DDP-by-hand train the same model as one process; a killed rank,
a torn checkpoint and a two-agent (multi-node) job all end where an uninterrupted run ends.

Every job is launched from the command the chapter README shows (so the README cannot rot), with
small flags appended (argparse keeps the last value of a repeated flag): four of them are the
README's own commands, which the reader's play runs once (tests/spine.py); the two agents run here.
Each test asserts on the jobs it names.

The equivalence runs train plain SGD (ch01_common.SGD), under which a gradient of the wrong scale
moves every weight by that factor (AdamW and clipping would hide it); the check's negative controls
are the mutants of both scripts in test_ch01_negative.py. The restarts and the two agents train the
scripts' default, AdamW, with the same flags (ch01_common.training_flags): an exact resume must
restore Adam's moments, which plain SGD does not have, and the two agents' job is the uninterrupted
4-rank run the restarted ones must end at.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ch01_common import (
    CHAPTER,
    README,
    SGD_STEPS,
    STEPS,
    TOLERANCE,
    check_like_one_process,
    final_params,
    max_diff,
    readme_argv,
    restart_env,
    single_process_params,
    training_flags,
)
from distkit.checkpoint import safe_load
from distkit.harness import read_records
from launch import forked_workers, free_port, job, job_env, load_script, readme_command, run, run_jobs
from spine import play_chapter


def killed_rank(folder: Path) -> subprocess.CompletedProcess:
    """SIGKILL rank 2 at step 5 (first attempt only); torchrun restarts all four workers."""
    return run([*readme_argv("--crash-at-step", launcher="torchrun"), *training_flags(folder), "--crash-at-step", "5",
                "--crash-rank", "2"], env=restart_env(folder), timeout=900)


def torn_checkpoint(folder: Path) -> subprocess.CompletedProcess:
    """Rank 0 dies half-way through writing the step-6 checkpoint (2 ranks); torchrun restarts both."""
    return run([*readme_argv("--crash-in-checkpoint-at-step", launcher="torchrun"), *training_flags(folder),
                "--crash-in-checkpoint-at-step", "6"], env=restart_env(folder), timeout=900)


def two_agents(folder: Path) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents x 2 workers rendezvous over c10d on loopback, as two nodes would: 4 ranks,
    2 micro-batches per step, checkpoints every 2 steps, no faults. (Not command_argv: it would add
    --standalone, and each agent would rendezvous alone.)"""
    command = readme_command(README, "--nnodes=2").replace("127.0.0.1:29400", f"127.0.0.1:{free_port()}")
    argv = forked_workers([sys.executable, "-m", "torch.distributed.run", *command.split()[1:],
                           *training_flags(folder)])
    results: list[subprocess.CompletedProcess] = []
    agents = [threading.Thread(target=lambda: results.append(run(argv, env=job_env(folder), timeout=900,
                                                                 check=False))) for _ in range(2)]
    for agent in agents:
        agent.start()
    for agent in agents:
        agent.join()
    return results


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, reader) -> dict[str, tuple[Path, object]]:
    """Every job of this file: ``{name: (folder, result or the exception it raised)}``. The README's
    own commands as the reader's play ran them (tests/spine.py; ch01_common.PLAY: the equivalence
    runs ``equivalence`` and ``scratch``, the restarts with the flags of the functions above), the
    two agents here."""
    played = play_chapter("01-ddp-basics", reader)
    found = {}
    for name, lookup in (("equivalence", "--config"), ("scratch", "ddp_from_scratch.py"),
                         ("killed_rank", "--crash-at-step"), ("torn_checkpoint", "--crash-in-checkpoint-at-step")):
        done = played.completed(lookup)
        found[name] = played.of(lookup)["out"], (done if done.returncode == 0 else AssertionError(
            f"exit {done.returncode}: {done.args}\n{done.stdout[-6000:]}"))
    return {**found, **run_jobs({"two_agents": two_agents}, tmp_path_factory)}


def test_ddp_and_ddp_from_scratch_match_single_process(jobs):
    """The played runs (4 ranks, plain SGD; DDP with 2 micro-batches per step) end with one SGD
    process's weights."""
    clean, out = job(jobs, "equivalence")
    assert "done: loss" in out.stdout
    folder, scratch_run = job(jobs, "scratch")
    reference = single_process_params(optimizer="sgd")
    check_like_one_process(final_params(clean, SGD_STEPS), reference, "ddp_training.py")
    check_like_one_process(safe_load(folder / "scratch.pt")["model"], reference, "ddp_from_scratch.py")

    # Communication, as the harness counted it from the collectives that really ran.
    grad_bytes = sum(t.numel() * 4 for t in reference.values())
    ddp_record = read_records(clean / "results.jsonl")[-1]
    scratch_record = read_records(folder / "scratch.jsonl")[-1]
    assert ddp_record["strategy"] == "ddp" and scratch_record["strategy"] == "ddp_from_scratch"
    for rec in (ddp_record, scratch_record):  # the model lives in the record's model field only
        assert rec["model"]["arch"] == "gpt" and rec["model"]["n_layer"] == 2 and rec["param_count"] > 0
        assert {"global_batch_size", "precision"} <= rec["config"].keys() and rec["config"]["optimizer"] == "sgd"
        assert not {"model_size", "param_count", "model", "gpt"} & rec["config"].keys()
        assert rec["world_size"] == 4
    # The fp32 gradients exactly once per step: no_sync() skipped the first micro-batch's all-reduce,
    # and one 25 MiB bucket holds every gradient.
    ddp_comm = ddp_record["metrics"]["comm_per_step"]["all_reduce"]
    assert (ddp_comm["bytes"], ddp_comm["calls"]) == (grad_bytes, 1)
    scratch_comm = scratch_record["metrics"]["comm_per_step"]["all_reduce"]
    assert scratch_comm["bytes"] == grad_bytes and scratch_comm["calls"] == len(reference)
    assert "37 calls" in scratch_run.stdout


def test_killed_rank_restarts_and_ends_identical(jobs):
    """Rank 2 killed at step 5: the restart resumes from the step-4 checkpoint and finishes bit-for-bit
    equal to the uninterrupted run (the two agents': the same 4 global ranks, flags and data)."""
    clean, _ = job(jobs, "two_agents")
    folder, out = job(jobs, "killed_rank")
    assert "rank 2 sends itself SIGKILL at step 5" in out.stdout
    assert f"resumed from {folder / 'ck' / 'step_000004.pt'} at step 4" in out.stdout
    resumed, uninterrupted_params = final_params(folder), final_params(clean)
    # CPU kernels are deterministic and the whole state (optimizer, scheduler, RNG, data position)
    # is restored, so the arithmetic is repeated exactly: identical, not merely close.
    assert all(torch.equal(resumed[k], uninterrupted_params[k]) for k in uninterrupted_params)
    # What this equality catches: a resume that loses any state (optimizer moments, scheduler, RNG,
    # data position) or any step changes the arithmetic. The comparison can see a lost step: the
    # uninterrupted run's own weights two steps before the end differ from its final ones far
    # beyond float rounding (two AdamW steps at lr 0.7-0.8 x 3e-3 move a weight by up to ~4e-3;
    # a resume from the wrong checkpoint that stopped at --steps would land there).
    two_short = safe_load(clean / "ck" / f"step_{STEPS - 2:06d}.pt")["model"]
    assert max_diff(two_short, uninterrupted_params) > 10 * TOLERANCE
    restarted = safe_load(folder / "ck" / f"step_{STEPS:06d}.pt")
    assert restarted["loss_history"] == safe_load(clean / "ck" / f"step_{STEPS:06d}.pt")["loss_history"]

    # The milestone timestamps every rank recorded turn into the recovery phases that
    # recovery_report.py measures: each phase present, none negative, adding up to the total.
    events = [json.loads(line) for line in (folder / "logs" / "events.jsonl").read_text().splitlines()]
    rank2 = {(e["event"], e["attempt"]) for e in events if e["rank"] == 2}
    assert rank2 >= {("fault_injected", 0), ("first_step_done", 1)}
    noticed = {e["rank"] for e in events if e["event"] in ("collective_failed", "stop_signal")}
    assert noticed and 2 not in noticed  # survivors noticed; the killed rank could not
    report = load_script(CHAPTER / "recovery_report.py")
    phases = report.recovery_phases(events)
    assert [name for name in phases] == [name for name, _, _ in report.PHASES] + ["total"]
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert math.isclose(sum(v for k, v in phases.items() if k != "total"), phases["total"], rel_tol=1e-9)


def test_kill_while_writing_checkpoint_keeps_previous_one(jobs):
    """The torn temp file never takes the real name, the restart removes it (its writer is dead),
    resumes from step 4, and training still ends at the right weights."""
    clean, _ = job(jobs, "two_agents")
    folder, out = job(jobs, "torn_checkpoint")
    killed_line = next(line for line in out.stdout.splitlines() if "rank 0 killed while writing" in line)
    torn = Path(killed_line.split("killed while writing ")[1].strip())
    assert torn.name.startswith("step_000006.pt.tmp.")  # atomic_save's naming: host and writer PID
    assert f"removed {torn}: a temporary file left by a save that was killed mid-write" in out.stdout
    assert not torn.exists() and not list((folder / "ck").glob("*.tmp*"))
    assert f"resumed from {folder / 'ck' / 'step_000004.pt'} at step 4" in out.stdout
    assert safe_load(folder / "ck" / "step_000004.pt")["step"] == 4
    # 2 ranks here vs 4 in the clean run: same arithmetic, different summation order.
    assert max_diff(final_params(folder), final_params(clean)) < TOLERANCE


def test_two_agents_as_two_nodes_match_one_agent(jobs):
    """The two agents' job trains what one AdamW process trains, and exactly what one 4-rank agent
    does: the killed-rank job's, whose restart test_killed_rank_restarts_and_ends_identical proves
    exact."""
    folder, results = job(jobs, "two_agents")
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    assert any("world size 4" in r.stdout for r in results)
    check_like_one_process(final_params(folder), single_process_params(), "the two agents' job", optimizer="AdamW")
    # Same 4 global ranks, same data per rank, same gloo reduction: identical to one 4-rank agent.
    one_agent, _ = job(jobs, "killed_rank")
    assert max_diff(final_params(folder), final_params(one_agent)) == 0.0
