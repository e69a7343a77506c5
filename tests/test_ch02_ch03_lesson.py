"""Chapters 02 and 03's data paths and reported numbers, observed: what each rank's model was really
fed and returned (tests/workers/observe.py), and every number the scripts report, recomputed here.

fsdp_transformer.py (FSDP2 ``fully_shard``, 2 ranks):

* ``test_fsdp_feeds_each_rank_its_own_rows``: at step s rank r's model sees rows r*B/W ... of the
  token task's global batch s, and nothing else: sharding the model does not shard the data
  differently from DDP. Mutant: every rank given rank 0's rows (the data-parallel half of FSDP lost;
  the weights still agree across ranks, so only the loss would hint at it).
* ``test_fsdp_logged_losses_are_the_observed_logits``: each recorded loss is the job's mean token
  cross-entropy, recomputed from the logits each rank's model returned. Mutant: the all-reduced loss
  not divided by the world size.
* ``test_fsdp_tokens_per_s_and_mfu_are_the_step_times_and_the_formula``: tokens/s is B x sequence
  length over the slowest rank's median step; MFU follows from the FLOPs counted from the built model
  and the recorded peak. Mutant: the harness told one rank's tokens.

fsdp_basics.py (2 ranks): ``test_fsdp_basics_feeds_each_rank_its_own_rows`` (every step, the traced
step 0 included; mutant: rank 0's rows everywhere) and
``test_fsdp_basics_logged_losses_are_the_observed_logits`` (each logged loss, 4 decimals, is the
job's mean cross-entropy; mutant: not divided by W).

deepspeed_train.py (ZeRO-2, the script's default config, 2 ranks):

* ``test_deepspeed_feeds_each_rank_its_rows_and_evaluates_the_held_out_batch``: at step s rank r's
  engine sees its rows of global batch s; after training every rank evaluates the held-out batch
  (``EVAL_STEP``), with autograd off. Mutants: every rank given rank 0's rows; the evaluation run on
  the first training batch (a held-out loss that is not held out).
* ``test_deepspeed_reported_losses_are_the_observed_logits``: the recorded final loss is rank 0's
  last micro-batch cross-entropy and the eval loss the held-out batch's, both from the observed logits.
  Mutant: the evaluation on the first training batch (its loss is then a training loss).
* ``test_deepspeed_tokens_per_s_is_the_step_times``: as for FSDP. Mutant: one rank's tokens.

Written out here, not imported from the scripts: which rows a rank gets (tests/README.md lists what
else is pinned, and by which control).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from distkit.deepspeed import EVAL_BATCH, EVAL_STEP
from distkit.harness import read_records
from distkit.models import TokenTask, model_config
from launch import REPO
from observed import (
    TOKENS_PER_STEP,
    cross_entropy,
    digest_rows,
    observe_jobs,
    pinned,
    rank_rows,
    rate_check,
    seen_calls,
)

W, B, STEPS = 2, 8, 4
CFG = model_config("gpt", "tiny")

# the messages of the checks' decisive assertions: each negative control must fail its check's own
NOT_ITS_ROWS = "not its own rows of each step's global batch"
LOSS_NOT_MEAN = "the loss is not the job's mean cross-entropy of the observed logits"
NOT_HELD_OUT = "the evaluation forward is not the held-out batch's, without autograd"
EVAL_LOSS = "the recorded eval loss is not the held-out batch's cross-entropy"


def rows_of(step: int, rank: int, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) rank ``rank`` trains on at ``step`` (this file's model and world size)."""
    return rank_rows(CFG, step, batch, rank, W)


# ==== fsdp_transformer.py ==========================================================================

FSDP_SCRIPT = REPO / "02-fsdp" / "fsdp_transformer.py"
FSDP_RUNS = {
    "correct": None,
    "rank0_rows": ("inputs = rank_slice(inputs, ctx.rank, ctx.world_size)",
                   "inputs = rank_slice(inputs, 0, ctx.world_size)"),
    "loss_not_averaged": ("global_loss.item() / ctx.world_size", "global_loss.item()"),
    "per_rank_tokens": ("tokens=tokens_per_step)", "tokens=tokens_per_step // ctx.world_size)"),
}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    # fully_shard swaps the model's class for FSDPTinyGPT: both names are observed
    return observe_jobs(tmp_path_factory, FSDP_SCRIPT, "TinyGPT,FSDPTinyGPT", FSDP_RUNS, lambda folder: [
        "--sharding", "full_shard", "--model-size", "tiny", "--global-batch-size", B, "--steps", STEPS,
        "--warmup-steps", 1, "--log-every", 1, "--results", folder / "r.jsonl"], nproc=W, outputs=True)


def check_fsdp_rows(folder: Path) -> None:
    for rank in range(W):
        calls = seen_calls(folder, rank)
        assert all(call["training"] and call["grad"] for call in calls)
        got = [call["rows"] for call in calls]
        assert got == [digest_rows(rows_of(step, rank)[0]) for step in range(STEPS)], f"rank {rank}: {NOT_ITS_ROWS}"


def check_fsdp_losses(folder: Path) -> None:
    (record,) = read_records(folder / "r.jsonl")
    calls = [seen_calls(folder, rank) for rank in range(W)]
    assert [step for step, _ in record["losses"]] == list(range(STEPS))
    for step, loss in record["losses"]:
        expected = sum(cross_entropy(calls[r][step], rows_of(step, r)[1]) for r in range(W)) / W
        assert abs(loss - expected) <= 1e-5, f"step {step}: {LOSS_NOT_MEAN}: recorded {loss}, recomputed {expected}"


def test_fsdp_feeds_each_rank_its_own_rows(fsdp_runs):
    pinned(fsdp_runs, check_fsdp_rows, "rank0_rows", match=NOT_ITS_ROWS)


def test_fsdp_logged_losses_are_the_observed_logits(fsdp_runs):
    pinned(fsdp_runs, check_fsdp_losses, "loss_not_averaged", match=LOSS_NOT_MEAN)


def test_fsdp_tokens_per_s_and_mfu_are_the_step_times_and_the_formula(fsdp_runs):
    pinned(fsdp_runs, rate_check(B * CFG.seq_len, CFG), "per_rank_tokens", match=TOKENS_PER_STEP)


# ==== deepspeed_train.py ===========================================================================

DS_SCRIPT = REPO / "03-deepspeed" / "deepspeed_train.py"
DS_RUNS = {
    "correct": None,
    "rank0_rows": ("inputs = rank_slice(inputs, ctx.rank, ctx.world_size)",
                   "inputs = rank_slice(inputs, 0, ctx.world_size)"),
    "eval_on_training_batch": ("task.global_batch(EVAL_STEP, EVAL_BATCH)", "task.global_batch(0, EVAL_BATCH)"),
    "per_rank_tokens": ("tokens=batch * cfg.seq_len)", "tokens=batch * cfg.seq_len // ctx.world_size)"),
}


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, DS_SCRIPT, "TinyGPT", DS_RUNS, lambda folder: [
        "--model-size", "tiny", "--global-batch-size", B, "--steps", STEPS, "--warmup-steps", 1,
        "--checkpoint-dir", folder / "ck", "--save", "none", "--results", folder / "r.jsonl"], nproc=W, outputs=True)


def ds_calls(folder: Path, rank: int) -> tuple[list[dict], list[dict]]:
    """A rank's training forwards and its evaluation forwards."""
    calls = seen_calls(folder, rank)
    return [c for c in calls if c["training"]], [c for c in calls if not c["training"]]


def check_ds_rows(folder: Path) -> None:
    held_out = TokenTask(CFG, seed=0).global_batch(EVAL_STEP, EVAL_BATCH)[0]
    for rank in range(W):
        training, evaluation = ds_calls(folder, rank)
        assert [c["rows"] for c in training] == [digest_rows(rows_of(step, rank)[0]) for step in range(STEPS)], \
            f"rank {rank}: {NOT_ITS_ROWS}"
        assert all(c["grad"] for c in training)
        (evaluated,) = evaluation
        assert evaluated["rows"] == digest_rows(held_out) and not evaluated["grad"], \
            f"rank {rank}: {NOT_HELD_OUT}"


def check_ds_losses(folder: Path) -> None:
    (record,) = read_records(folder / "r.jsonl")
    training, (evaluated,) = ds_calls(folder, 0)
    assert record["final_loss"] == pytest.approx(cross_entropy(training[-1], rows_of(STEPS - 1, 0)[1]), abs=1e-5)
    held_out = TokenTask(CFG, seed=0).global_batch(EVAL_STEP, EVAL_BATCH)[1]
    assert record["eval_loss"] == pytest.approx(cross_entropy(evaluated, held_out), abs=1e-5), \
        f"{EVAL_LOSS}: recorded {record['eval_loss']}, recomputed {cross_entropy(evaluated, held_out)}"


def test_deepspeed_feeds_each_rank_its_rows_and_evaluates_the_held_out_batch(ds_runs):
    # two controls, two assertions of the check: the training rows, then the evaluated batch
    pinned(ds_runs, check_ds_rows, "rank0_rows", match=NOT_ITS_ROWS)
    pinned(ds_runs, check_ds_rows, "eval_on_training_batch", match=NOT_HELD_OUT)


def test_deepspeed_reported_losses_are_the_observed_logits(ds_runs):
    pinned(ds_runs, check_ds_losses, "eval_on_training_batch", match=EVAL_LOSS)


def test_deepspeed_tokens_per_s_is_the_step_times(ds_runs):
    pinned(ds_runs, rate_check(B * CFG.seq_len), "per_rank_tokens", match=TOKENS_PER_STEP)


# ==== fsdp_basics.py (chapter 02's first script) ===================================================

BASICS_SCRIPT = REPO / "02-fsdp" / "fsdp_basics.py"
BASICS_STEPS = 6
BASICS_RUNS = {
    "correct": None,
    "rank0_rows": ("rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device),",
                   "rank_slice(inputs, 0, ctx.world_size).to(ctx.device),"),
    "loss_not_averaged": ("loss.item() / ctx.world_size:.4f", "loss.item():.4f"),
}


@pytest.fixture(scope="module")
def basics_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, BASICS_SCRIPT, "TinyGPT,FSDPTinyGPT", BASICS_RUNS, lambda folder: [
        "--model-size", "tiny", "--global-batch-size", B, "--steps", BASICS_STEPS, "--warmup-steps", 1,
        "--log-every", 1, "--results", folder / "r.jsonl"], nproc=W, outputs=True)


def check_basics_rows(folder: Path) -> None:
    """Every step (the traced step 0 included) rank r's model gets its own rows of the global batch."""
    for rank in range(W):
        got = [call["rows"] for call in seen_calls(folder, rank)]
        assert got == [digest_rows(rows_of(step, rank)[0]) for step in range(BASICS_STEPS)], \
            f"rank {rank}: {NOT_ITS_ROWS}"


def check_basics_losses(folder: Path, out: str) -> None:
    """Each logged loss (4 decimals) is the job's mean token cross-entropy of the observed logits."""
    logged = {int(s): float(v) for s, v in re.findall(r"\] step +(\d+) \| loss ([\d.]+)", out)}
    assert sorted(logged) == list(range(BASICS_STEPS)), logged
    calls = [seen_calls(folder, rank) for rank in range(W)]
    for step, loss in logged.items():
        expected = sum(cross_entropy(calls[r][step], rows_of(step, r)[1]) for r in range(W)) / W
        assert abs(loss - expected) <= 5e-5 + 1e-6, \
            f"step {step}: {LOSS_NOT_MEAN}: logged {loss}, recomputed {expected}"


def test_fsdp_basics_feeds_each_rank_its_own_rows(basics_runs):
    pinned(basics_runs, check_basics_rows, "rank0_rows", match=NOT_ITS_ROWS)


def test_fsdp_basics_logged_losses_are_the_observed_logits(basics_runs):
    pinned(basics_runs, check_basics_losses, "loss_not_averaged", output=True, match=LOSS_NOT_MEAN)
