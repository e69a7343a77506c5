"""Chapter 01 correctness: DDP and DDP-by-hand train the same model as one process; a killed rank,
a torn checkpoint and a two-agent (multi-node) job all end where an uninterrupted run ends.

Every job is launched from the command the chapter README shows (so the README cannot rot), with
small flags appended (argparse keeps the last value of a repeated flag).
"""
from __future__ import annotations

import importlib.util
import json
import math
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from distkit import seed_everything
from distkit.checkpoint import safe_load
from distkit.harness import read_records
from distkit.models import TinyGPT, TokenTask, gpt_config, lm_loss
from launch import REPO, free_port, job_env, readme_commands, run

README = REPO / "01-ddp-basics" / "README.md"
STEPS, GLOBAL_BATCH = 8, 16
TINY = ["--model-size", "tiny", "--global-batch-size", str(GLOBAL_BATCH), "--steps", str(STEPS),
        "--timeout-s", "120"]
# DDP averages gradients in a different order than one process sums them; AdamW's first steps
# (update ~ lr * g / |g|) amplify those float32 rounding differences to a few 1e-6. 5e-5 is 10x that.
# What this comparison cannot see: AdamW and clipping at 1.0 make the update independent of the
# gradient's scale, so a gradient summed instead of averaged (or an accumulated loss not divided by
# k) passes here. test_ch01_negative.py checks the same tolerance with SGD on the script's own
# average_gradients and proves those bugs exceed it (by 1,300x; correct runs 1.2e-7).
TOLERANCE = 5e-5


def readme_argv(fragment: str) -> list[str]:
    """The one README command containing ``fragment``, as argv for this interpreter."""
    matches = sorted({c for c in readme_commands(README) if fragment in c})
    assert len(matches) == 1, f"README commands containing {fragment!r}: {matches}"
    argv = shlex.split(matches[0])
    head = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "python": [sys.executable]}
    return head.get(argv[0], argv[:1]) + argv[1:]


def training_flags(folder: Path) -> list[str]:
    # --find-unused-parameters: DDP then never rebuilds its bucket layout. By default DDP re-orders
    # its buckets after the first iteration; a resumed job's first iteration uses the initial order,
    # so one step sums some gradients in another order (~1e-7) and the restart test could only be
    # "close" (2e-6 measured), not bit-for-bit identical.
    return [*TINY, "--find-unused-parameters", "--grad-accum-steps", "2", "--checkpoint-every", "2", "--log-every", "2",
            "--checkpoint-dir", str(folder / "ck"), "--log-dir", str(folder / "logs"),
            "--results", str(folder / "results.jsonl")]


def restart_env(folder: Path) -> dict:
    # torch.distributed.run shares its rendezvous TCPStore with the workers; after a restart the
    # new gloo workers can read the dead workers' addresses from it (pytorch/pytorch#135712) and
    # fail to connect. A separate store per rendezvous round avoids that; the README says the same.
    return job_env(folder, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def final_params(folder: Path) -> dict[str, torch.Tensor]:
    return safe_load(folder / "ck" / f"step_{STEPS:06d}.pt")["model"]


def lr_factor(step: int, warmup: int = 10, total: int = STEPS) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def single_process_params() -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch each step, same optimizer and schedule."""
    seed_everything(0)
    cfg = gpt_config("tiny")
    model, task = TinyGPT(cfg), TokenTask(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    for step in range(STEPS):
        inputs, targets = task.global_batch(step, GLOBAL_BATCH)
        optimizer.zero_grad()
        lm_loss(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """ddp_training.py with 4 ranks, 2 micro-batches per step, checkpoints every 2 steps, no faults."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    out = run([*readme_argv("--config"), *training_flags(folder)], env=job_env(folder), timeout=600)
    assert "done: loss" in out.stdout
    return folder


def test_ddp_and_ddp_from_scratch_match_single_process(uninterrupted, tmp_path):
    scratch = run([*readme_argv("ddp_from_scratch.py"), *TINY, "--save", str(tmp_path / "scratch.pt"),
                   "--results", str(tmp_path / "scratch.jsonl")], env=job_env(tmp_path), timeout=600)
    reference = single_process_params()
    ddp = final_params(uninterrupted)
    by_hand = safe_load(tmp_path / "scratch.pt")["model"]
    assert max_diff(ddp, reference) < TOLERANCE
    assert max_diff(by_hand, reference) < TOLERANCE
    assert max_diff(by_hand, ddp) < TOLERANCE

    # Communication, as the harness counted it from the collectives that really ran.
    grad_bytes = sum(t.numel() * 4 for t in reference.values())
    ddp_record = read_records(uninterrupted / "results.jsonl")[-1]
    scratch_record = read_records(tmp_path / "scratch.jsonl")[-1]
    assert ddp_record["strategy"] == "ddp" and scratch_record["strategy"] == "ddp_from_scratch"
    for rec in (ddp_record, scratch_record):
        assert {"model_size", "global_batch_size", "precision", "param_count"} <= rec["config"].keys()
        assert rec["world_size"] == 4
    # The fp32 gradients exactly once per step: no_sync() skipped the first micro-batch's all-reduce.
    # With --find-unused-parameters DDP also all-reduces one int32 "was it used" flag per parameter.
    ddp_comm = ddp_record["metrics"]["comm_per_step"]["all_reduce"]
    assert ddp_comm["bytes"] == grad_bytes + 4 * len(reference)
    assert ddp_comm["calls"] == 2  # one 25 MiB bucket holds every gradient, plus the flags
    scratch_comm = scratch_record["metrics"]["comm_per_step"]["all_reduce"]
    assert scratch_comm["bytes"] == grad_bytes and scratch_comm["calls"] == len(reference)
    assert "37 calls" in scratch.stdout


def test_killed_rank_restarts_and_ends_identical(uninterrupted, tmp_path):
    """SIGKILL rank 2 at step 5 (first attempt only); torchrun restarts all four workers, they resume
    from the step-4 checkpoint, and finish bit-for-bit equal to the uninterrupted run."""
    out = run([*readme_argv("--crash-at-step"), *training_flags(tmp_path), "--crash-at-step", "5",
               "--crash-rank", "2"], env=restart_env(tmp_path), timeout=600)
    assert "rank 2 sends itself SIGKILL at step 5" in out.stdout
    assert f"resumed from {tmp_path / 'ck' / 'step_000004.pt'} at step 4" in out.stdout
    resumed, clean = final_params(tmp_path), final_params(uninterrupted)
    # CPU kernels are deterministic and the whole state (optimizer, scheduler, RNG, data position)
    # is restored, so the arithmetic is repeated exactly: identical, not merely close.
    assert all(torch.equal(resumed[k], clean[k]) for k in clean)
    # What this equality catches: a resume that loses any state (optimizer moments, scheduler, RNG,
    # data position) or any step changes the arithmetic. The comparison can see a lost step: the
    # uninterrupted run's own weights two steps before the end differ from its final ones far
    # beyond float rounding (two AdamW steps at lr 0.7-0.8 x 3e-3 move a weight by up to ~4e-3;
    # a resume from the wrong checkpoint that stopped at --steps would land there).
    two_short = safe_load(uninterrupted / "ck" / f"step_{STEPS - 2:06d}.pt")["model"]
    assert max_diff(two_short, clean) > 10 * TOLERANCE
    restarted = safe_load(tmp_path / "ck" / f"step_{STEPS:06d}.pt")
    assert restarted["loss_history"] == safe_load(uninterrupted / "ck" / f"step_{STEPS:06d}.pt")["loss_history"]

    # The milestone timestamps every rank recorded turn into the recovery phases that
    # recovery_report.py measures: each phase present, none negative, adding up to the total.
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    rank2 = {(e["event"], e["attempt"]) for e in events if e["rank"] == 2}
    assert rank2 >= {("fault_injected", 0), ("first_step_done", 1)}
    noticed = {e["rank"] for e in events if e["event"] in ("collective_failed", "stop_signal")}
    assert noticed and 2 not in noticed  # survivors noticed; the killed rank could not
    spec = importlib.util.spec_from_file_location("recovery_report", REPO / "01-ddp-basics" / "recovery_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    phases = report.recovery_phases(events)
    assert [name for name in phases] == [name for name, _, _ in report.PHASES] + ["total"]
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert math.isclose(sum(v for k, v in phases.items() if k != "total"), phases["total"], rel_tol=1e-9)


def test_kill_while_writing_checkpoint_keeps_previous_one(uninterrupted, tmp_path):
    """Rank 0 dies half-way through writing the step-6 checkpoint: the torn temp file never takes
    the real name, the restart removes it (its writer is dead), resumes from step 4, and training
    still ends at the right weights."""
    out = run([*readme_argv("--crash-in-checkpoint-at-step"), *training_flags(tmp_path),
               "--crash-in-checkpoint-at-step", "6"], env=restart_env(tmp_path), timeout=600)
    killed_line = next(line for line in out.stdout.splitlines() if "rank 0 killed while writing" in line)
    torn = Path(killed_line.split("killed while writing ")[1].strip())
    assert torn.name.startswith("step_000006.pt.tmp.")  # atomic_save's naming: host and writer PID
    assert f"removed {torn}: a temporary file left by a save that was killed mid-write" in out.stdout
    assert not torn.exists() and not list((tmp_path / "ck").glob("*.tmp*"))
    assert f"resumed from {tmp_path / 'ck' / 'step_000004.pt'} at step 4" in out.stdout
    assert safe_load(tmp_path / "ck" / "step_000004.pt")["step"] == 4
    # 2 ranks here vs 4 in the clean run: same arithmetic, different summation order.
    assert max_diff(final_params(tmp_path), final_params(uninterrupted)) < TOLERANCE


def test_two_agents_as_two_nodes_match_one_agent(uninterrupted, tmp_path):
    """Two torchrun agents x 2 workers rendezvous over c10d on loopback, as two nodes would."""
    argv = [a.replace("127.0.0.1:29400", f"127.0.0.1:{free_port()}") for a in readme_argv("--nnodes=2")]
    argv += training_flags(tmp_path)
    results: list[subprocess.CompletedProcess] = []
    agents = [threading.Thread(target=lambda: results.append(run(argv, env=job_env(tmp_path), timeout=600,
                                                                 check=False))) for _ in range(2)]
    for agent in agents:
        agent.start()
    for agent in agents:
        agent.join()
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    assert any("world size 4" in r.stdout for r in results)
    # Same 4 global ranks, same data per rank, same gloo reduction: identical to one 4-rank agent.
    assert max_diff(final_params(tmp_path), final_params(uninterrupted)) == 0.0
