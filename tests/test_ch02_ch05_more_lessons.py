"""Five more scripts' data paths and reported numbers, observed: what each rank's model was really fed
and returned (tests/workers/observe.py), and every number the scripts report, recomputed here. Two
ranks, tiny models, two or three steps; one module fixture per script launches the script as it is
and its mutants (negative controls), two at a time.

05-advanced/gradient_accumulation.py (``--sync both``: no_sync, then every_micro_batch; k = 2
micro-batches of M = 2 sequences):

* ``test_accumulation_feeds_each_rank_its_k_micro_batches_in_order``: in each mode, at step s rank r's
  model runs exactly k forwards, micro-batch m being rows m*M ... (m+1)*M-1 of the rank's k*M rows
  (rows r*kM ... of global batch s, kMW sequences), in order, with autograd on. Mutant: the
  effective batch computed without the world size (each rank then feeds k micro-batches of M/W rows).
* ``test_accumulation_tokens_per_s_counts_the_effective_batch``: each mode's record has tokens/s =
  kMW x sequence length over the slowest rank's median step, and MFU from the formula. Mutant: the
  harness told one rank's tokens. The script reports no loss (its lesson is the bytes and the weights,
  pinned in test_ch05_advanced.py and test_ch05_negative.py), so there is none to recompute.

05-advanced/activation_checkpointing.py (``--ac none full selective``, DDP, 2 steps each):

* ``test_checkpointing_feeds_each_rank_its_own_rows``: in every AC mode, at step s rank r's TinyGPT
  gets rows r*B/W ... of global batch s. Mutant: every rank given rank 0's rows.
* ``test_checkpointed_attention_runs_again_in_backward_on_the_same_input``: what checkpointing shows
  in an observation. Under ``none`` each block's attention runs once per step; under ``full`` and
  ``selective`` it runs a second time during backward (after the step's forward has returned), in
  reverse layer order, on bit-identical input rows: the recompute. It is observed at the attention,
  not at the Block: non-reentrant checkpointing stops recomputing once the last tensor backward needs
  is back (torch's early stop, inside the block's MLP), so the Block's own forward never completes a
  second time and its forward hook fires once per step even under ``full``. Mutant: the checkpoint
  wrapper built but never put into ``model.blocks`` (AC silently off: the weights and losses stay
  right, so no equivalence test sees it).
* ``test_checkpointing_losses_are_the_observed_logits``: each recorded loss is the job's mean token
  cross-entropy of the observed logits, in every mode. Mutant: the all-reduced losses not divided by W.

05-advanced/communication_overlap.py (4 layers of width 16, one bucket size, 2 sweep steps):

* ``test_overlap_feeds_each_rank_its_share_of_the_batch``: every forward (2 warm-up, the profiled
  step, the sweep's steps) of rank r's model gets rows r*B/W..(r+1)*B/W-1 of the global batch
  ``randn(B, width)`` drawn from the job's seed. Mutants: each rank given the whole global batch;
  every rank given rank 0's rows.
* ``test_overlap_samples_per_s_is_the_step_times``: the record's samples/s is B over the slowest
  rank's median step, and the printed table row (all-reduces, samples/s, ms/step) is that record.
  Mutant: the harness told one rank's samples.

02-fsdp/fsdp_checkpoint.py (FSDP2, 2 steps saved as DCP, then resumed to step 4):

* ``test_fsdp_checkpoint_feeds_each_rank_its_own_rows``: mutant: rank 0's rows everywhere.
* ``test_fsdp_checkpoint_logged_losses_are_the_observed_logits``: each logged loss (4 decimals) is
  the job's mean cross-entropy of the observed logits. Mutant: not divided by W.
* ``test_fsdp_checkpoint_resume_goes_on_with_the_next_batches``: resumed from the correct run's DCP
  checkpoint (step 2) to step 4, each rank's model gets its rows of steps 2 and 3, the batches an
  uninterrupted run takes next. Mutant: the resumed run counts its batches from 0 again.

02-fsdp/fsdp_lora.py (FSDP2 + peft LoRA on the tiny Llama, 2 steps):

* ``test_lora_feeds_each_rank_its_own_rows``: the Llama under the adapters gets rank r's rows at every
  step. Mutant: rank 0's rows (inputs and targets) everywhere.
* ``test_lora_recorded_losses_are_the_observed_logits``: each recorded (step, loss) is the job's mean
  cross-entropy of the observed logits. Mutant: not divided by W. That only the adapters change is
  pinned in test_ch02_lora.py (``test_frozen_base_does_not_move``, with its mutant), not repeated here.

Written out here, not imported from the scripts: which rows a rank gets, the micro-batch split, the
losses and rates.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from distkit.harness import read_records
from distkit.models import model_config
from launch import REPO, job
from observed import (
    TOKENS_PER_STEP,
    check_mfu,
    check_tokens_per_s,
    cross_entropy,
    digest_rows,
    observe_jobs,
    pinned,
    rank_rows,
    seen_calls,
    slowest_median,
)

W = 2
GPT = model_config("gpt", "tiny")
LLAMA = model_config("llama", "tiny")

# the messages of the checks' decisive assertions: each negative control must fail its check's own
NOT_ITS_ROWS = "not its own rows of each step's global batch"
NOT_ITS_MICRO_BATCHES = "not its k micro-batches of M rows, in order"
LOSS_NOT_MEAN = "the loss is not the job's mean cross-entropy of the observed logits"
NOT_RECOMPUTED = "the attention calls between two steps are not the recomputes then the next forwards"
SAMPLES_PER_STEP = "the recorded samples per step are not the global batch's"
NOT_THE_NEXT_BATCHES = "the resumed run's forwards are not its rows of the batches after the saved step"


def mine(cfg, step: int, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) rank ``rank`` trains on at ``step`` of ``size`` sequences, on W ranks."""
    return rank_rows(cfg, step, size, rank, W)


def job_loss(calls: list[list[dict]], index: int, cfg, step: int, size: int) -> float:
    """The job's loss of one step: the mean over ranks of their forward ``index``'s cross-entropy."""
    return sum(cross_entropy(calls[r][index], mine(cfg, step, size, r)[1]) for r in range(W)) / W


def logged_losses(out: str) -> dict[int, float]:
    """``[rank 0] step    N | loss X`` lines of a script's output."""
    return {int(s): float(v) for s, v in re.findall(r"\] step +(\d+) \| loss ([\d.]+)", out)}


# ==== gradient_accumulation.py ======================================================================

GA_SCRIPT = REPO / "05-advanced" / "gradient_accumulation.py"
GA_K, GA_M, GA_STEPS = 2, 2, 2
GA_BATCH = GA_K * GA_M * W  # the effective batch: kMW sequences per optimizer step
GA_MODES = ("no_sync", "every_micro_batch")  # --sync both trains them in this order
GA_RUNS = {
    "correct": None,
    "batch_without_world_size": ("effective_batch = args.micro_batch_size * k * ctx.world_size",
                                 "effective_batch = args.micro_batch_size * k"),
    "per_rank_tokens": ("tokens=effective_batch * cfg.seq_len)",
                        "tokens=effective_batch * cfg.seq_len // ctx.world_size)"),
}


@pytest.fixture(scope="module")
def ga_runs(tmp_path_factory):
    # warm-up 0: step 0 is the harness's instrumented step, step 1 its one timed step
    return observe_jobs(tmp_path_factory, GA_SCRIPT, "TinyGPT", GA_RUNS, lambda folder: [
        "--model-size", "tiny", "--steps", GA_STEPS, "--warmup-steps", 0, "--grad-accum-steps", GA_K,
        "--micro-batch-size", GA_M, "--optimizer", "sgd", "--sync", "both", "--save", "none",
        "--results", folder / "r.jsonl"], nproc=W)


def check_ga_micro_batches(folder: Path) -> None:
    for rank in range(W):
        calls = seen_calls(folder, rank)
        assert all(c["training"] and c["grad"] for c in calls)
        want = []
        for _ in GA_MODES:  # both modes train from step 0 on the same batches
            for step in range(GA_STEPS):
                rows = mine(GPT, step, GA_BATCH, rank)[0]
                want += [digest_rows(rows[m * GA_M:(m + 1) * GA_M]) for m in range(GA_K)]
        assert [c["rows"] for c in calls] == want, f"rank {rank}: {NOT_ITS_MICRO_BATCHES}"


def check_ga_rates(folder: Path) -> None:
    records = read_records(folder / "r.jsonl")
    assert [r["config"]["sync"] for r in records] == list(GA_MODES)
    for record in records:
        check_tokens_per_s(record, GA_BATCH * GPT.seq_len)
        check_mfu(record, GPT, GA_BATCH * GPT.seq_len)


def test_accumulation_feeds_each_rank_its_k_micro_batches_in_order(ga_runs):
    pinned(ga_runs, check_ga_micro_batches, "batch_without_world_size", match=NOT_ITS_MICRO_BATCHES)


def test_accumulation_tokens_per_s_counts_the_effective_batch(ga_runs):
    pinned(ga_runs, check_ga_rates, "per_rank_tokens", match=TOKENS_PER_STEP)


# ==== activation_checkpointing.py ===================================================================

AC_SCRIPT = REPO / "05-advanced" / "activation_checkpointing.py"
AC_B, AC_STEPS = 8, 2
AC_MODES = ("none", "full", "selective")
AC_RUNS = {
    "correct": None,
    "rank0_rows": ("rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device)",
                   "rank_slice(t, 0, ctx.world_size).to(ctx.device)"),
    # the classic slip: the wrapper made, the model left holding the plain block
    "ac_not_installed": ("model.blocks[i] = block", "model.blocks[i] = model.blocks[i]"),
    "loss_not_averaged": ('"losses": (loss / ctx.world_size).tolist()', '"losses": loss.tolist()'),
}


@pytest.fixture(scope="module")
def ac_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, AC_SCRIPT, "TinyGPT,CausalSelfAttention", AC_RUNS, lambda folder: [
        "--model-size", "tiny", "--ac", *AC_MODES, "--steps", AC_STEPS, "--warmup-steps", 1,
        "--global-batch-size", AC_B, "--optimizer", "sgd", "--results", folder / "r.jsonl"], nproc=W, outputs=True)


def ac_calls(folder: Path, rank: int, name: str) -> list[dict]:
    return [c for c in seen_calls(folder, rank) if c["class"] == name]


def check_ac_rows(folder: Path) -> None:
    for rank in range(W):
        got = [c["rows"] for c in ac_calls(folder, rank, "TinyGPT")]
        want = [digest_rows(mine(GPT, step, AC_B, rank)[0]) for _ in AC_MODES for step in range(AC_STEPS)]
        assert got == want, f"rank {rank}: {NOT_ITS_ROWS}"


def check_ac_recompute(folder: Path) -> None:
    """Between the end of step g's forward (its TinyGPT call) and the next, a rank's attentions are
    step g's recomputes (n_layer, in reverse layer order, the same rows as step g's forwards) when
    step g checkpoints, then step g+1's n_layer forwards."""
    layers = GPT.n_layer
    modes = [mode for mode in AC_MODES for _ in range(AC_STEPS)]  # the mode of each global step g
    for rank in range(W):
        groups, calls = [[]], seen_calls(folder, rank)
        for call in calls:
            assert call["training"] and call["grad"]
            if call["class"] == "TinyGPT":
                groups.append([])
            else:
                groups[-1].append(call["rows"])
        assert len(groups) == len(modes) + 1
        forwards = []
        for g, group in enumerate(groups):
            recomputed = layers if g and modes[g - 1] != "none" else 0
            assert len(group) == recomputed + (layers if g < len(modes) else 0), \
                f"rank {rank}, modes {modes[g - 1:g + 1]}: {NOT_RECOMPUTED}: {len(group)} calls, " \
                f"{recomputed} of them recomputes"
            if recomputed:
                assert group[:recomputed] == forwards[-1][::-1], f"rank {rank}, step {g - 1}: not its forward's input"
            forwards.append(group[recomputed:])


def check_ac_losses(folder: Path) -> None:
    records = read_records(folder / "r.jsonl")
    assert [r["config"]["ac"] for r in records] == list(AC_MODES)
    calls = [ac_calls(folder, rank, "TinyGPT") for rank in range(W)]
    for i, record in enumerate(records):
        assert len(record["losses"]) == AC_STEPS
        for step, loss in enumerate(record["losses"]):
            expected = job_loss(calls, i * AC_STEPS + step, GPT, step, AC_B)
            assert abs(loss - expected) <= 1e-5, \
                f"{record['config']['ac']} step {step}: {LOSS_NOT_MEAN}: recorded {loss}, recomputed {expected}"


def test_checkpointing_feeds_each_rank_its_own_rows(ac_runs):
    pinned(ac_runs, check_ac_rows, "rank0_rows", match=NOT_ITS_ROWS)


def test_checkpointed_attention_runs_again_in_backward_on_the_same_input(ac_runs):
    pinned(ac_runs, check_ac_recompute, "ac_not_installed", match=NOT_RECOMPUTED)


def test_checkpointing_losses_are_the_observed_logits(ac_runs):
    pinned(ac_runs, check_ac_losses, "loss_not_averaged", match=LOSS_NOT_MEAN)


# ==== communication_overlap.py ======================================================================

CO_SCRIPT = REPO / "05-advanced" / "communication_overlap.py"
CO_B, CO_WIDTH, CO_STEPS, CO_BUCKET = 8, 16, 2, 25
CO_RUNS = {
    "correct": None,
    "whole_batch_per_rank": ("x = rank_slice(batch, ctx.rank, ctx.world_size)", "x = batch"),
    "rank0_rows": ("x = rank_slice(batch, ctx.rank, ctx.world_size)", "x = rank_slice(batch, 0, ctx.world_size)"),
    "per_rank_samples": ("harness.step(samples=args.global_batch_size)",
                         "harness.step(samples=args.global_batch_size // ctx.world_size)"),
}


@pytest.fixture(scope="module")
def co_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, CO_SCRIPT, "Sequential", CO_RUNS, lambda folder: [
        "--layers", 4, "--width", CO_WIDTH, "--bucket-cap-mb", CO_BUCKET, "--steps", CO_STEPS,
        "--warmup-steps", 0, "--global-batch-size", CO_B, "--async-mib", 0.01,
        "--trace", folder / "trace.json", "--results", folder / "r.jsonl"], nproc=W)


def check_co_rows(folder: Path) -> None:
    batch = torch.randn(CO_B, CO_WIDTH, generator=torch.Generator().manual_seed(0))  # the job's seed
    for rank in range(W):
        rows = digest_rows(batch[rank * CO_B // W:(rank + 1) * CO_B // W])
        calls = seen_calls(folder, rank)
        # 2 warm-up + profiled + the sweep's steps
        assert [c["rows"] for c in calls] == [rows] * (3 + CO_STEPS), f"rank {rank}: {NOT_ITS_ROWS}"


def check_co_rate(folder: Path, out: str) -> None:
    (record,) = read_records(folder / "r.jsonl")
    metrics = record["metrics"]
    step_s = slowest_median(metrics)
    assert metrics["samples_per_step"] == CO_B, \
        f"{SAMPLES_PER_STEP}: recorded {metrics['samples_per_step']}, the global batch has {CO_B}"
    assert metrics["samples_per_s"] == pytest.approx(CO_B / step_s, rel=1e-12)
    (row,) = re.findall(rf"\] +{CO_BUCKET} +(\d+) +(\d+) +([\d.]+)\n", out)
    calls = metrics["comm_per_step"]["all_reduce"]["calls"]
    assert (int(row[0]), int(row[1]), float(row[2])) == (calls, round(CO_B / step_s), round(step_s * 1000, 1))


def test_overlap_feeds_each_rank_its_share_of_the_batch(co_runs):
    pinned(co_runs, check_co_rows, "whole_batch_per_rank", "rank0_rows", match=NOT_ITS_ROWS)


def test_overlap_samples_per_s_is_the_step_times(co_runs):
    pinned(co_runs, check_co_rate, "per_rank_samples", output=True, match=SAMPLES_PER_STEP)


# ==== fsdp_checkpoint.py ============================================================================

CK_SCRIPT = REPO / "02-fsdp" / "fsdp_checkpoint.py"
CK_B, CK_STEPS = 8, 2
CK_RUNS = {
    "correct": None,
    "rank0_rows": ("inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)",
                   "inputs = rank_slice(inputs, 0, ctx.world_size).to(ctx.device)"),
    "loss_not_averaged": ("loss.item() / ctx.world_size:.4f", "loss.item():.4f"),
}


@pytest.fixture(scope="module")
def ck_runs(tmp_path_factory):
    # fully_shard swaps the model's class for FSDPTinyGPT: both names are observed. Each run saves a
    # sharded checkpoint at step CK_STEPS, which the correct one's resume below starts from.
    return observe_jobs(tmp_path_factory, CK_SCRIPT, "TinyGPT,FSDPTinyGPT", CK_RUNS, lambda folder: [
        "--model-size", "tiny", "--global-batch-size", CK_B, "--steps", CK_STEPS, "--log-every", 1,
        "--checkpoint-dir", folder / "ck", "--checkpoint-format", "dcp"], nproc=W, outputs=True)


# A resume must go on with the batches an uninterrupted run takes after the saved step: the data
# position is the step, restored from the checkpoint's trainer state.
CK_RESUMED_STEPS = 4
CK_RESUME_RUNS = {
    "correct": None,
    "restarts_the_data": ("inputs, targets = task.global_batch(step, args.global_batch_size)",
                          "inputs, targets = task.global_batch(step - start_step, args.global_batch_size)"),
}


@pytest.fixture(scope="module")
def ck_resume_runs(tmp_path_factory, ck_runs):
    saved, _ = job(ck_runs, "correct")
    return observe_jobs(tmp_path_factory, CK_SCRIPT, "TinyGPT,FSDPTinyGPT", CK_RESUME_RUNS, lambda folder: [
        "--model-size", "tiny", "--global-batch-size", CK_B, "--steps", CK_RESUMED_STEPS, "--log-every", 1,
        "--resume", saved / "ck" / "dcp", "--checkpoint-dir", folder / "ck", "--checkpoint-format", "none"],
        nproc=W, outputs=True)


def check_ck_rows(folder: Path) -> None:
    for rank in range(W):
        calls = seen_calls(folder, rank)
        assert all(c["training"] and c["grad"] for c in calls)
        assert [c["rows"] for c in calls] == [digest_rows(mine(GPT, s, CK_B, rank)[0]) for s in range(CK_STEPS)], \
            f"rank {rank}: {NOT_ITS_ROWS}"


def check_ck_losses(folder: Path, out: str) -> None:
    logged = logged_losses(out)
    assert sorted(logged) == list(range(CK_STEPS)), logged
    calls = [seen_calls(folder, rank) for rank in range(W)]
    for step, loss in logged.items():
        expected = job_loss(calls, step, GPT, step, CK_B)
        assert abs(loss - expected) <= 5e-5 + 1e-6, \
            f"step {step}: {LOSS_NOT_MEAN}: logged {loss}, recomputed {expected}"


def test_fsdp_checkpoint_feeds_each_rank_its_own_rows(ck_runs):
    pinned(ck_runs, check_ck_rows, "rank0_rows", match=NOT_ITS_ROWS)


def test_fsdp_checkpoint_logged_losses_are_the_observed_logits(ck_runs):
    pinned(ck_runs, check_ck_losses, "loss_not_averaged", output=True, match=LOSS_NOT_MEAN)


def check_ck_resumed_rows(folder: Path, out: str) -> None:
    """Resumed at step CK_STEPS: each rank's forwards get its rows of steps CK_STEPS.. only."""
    assert f"at step {CK_STEPS}" in out, out[-2000:]
    for rank in range(W):
        calls = seen_calls(folder, rank)
        assert [c["rows"] for c in calls] == [digest_rows(mine(GPT, s, CK_B, rank)[0])
                                              for s in range(CK_STEPS, CK_RESUMED_STEPS)], \
            f"rank {rank}: {NOT_THE_NEXT_BATCHES}"


def test_fsdp_checkpoint_resume_goes_on_with_the_next_batches(ck_resume_runs):
    pinned(ck_resume_runs, check_ck_resumed_rows, "restarts_the_data", output=True, match=NOT_THE_NEXT_BATCHES)


# ==== fsdp_lora.py ==================================================================================

LORA_SCRIPT = REPO / "02-fsdp" / "fsdp_lora.py"
LORA_B, LORA_STEPS = 8, 2
LORA_RUNS = {
    "correct": None,
    "rank0_rows": ("rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device) for t in (inputs, targets)",
                   "rank_slice(t, 0, ctx.world_size).to(ctx.device) for t in (inputs, targets)"),
    "loss_not_averaged": ("losses.append((step, loss.item() / ctx.world_size))", "losses.append((step, loss.item()))"),
}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    # peft's wrapper calls the Llama (LlamaLM) with the tokens; its logits are what the loss is of.
    # --warmup-steps = --steps: no memory-tracked step, nothing here reads it
    return observe_jobs(tmp_path_factory, LORA_SCRIPT, "LlamaLM", LORA_RUNS, lambda folder: [
        "--global-batch-size", LORA_B, "--steps", LORA_STEPS, "--warmup-steps", LORA_STEPS, "--log-every", 1,
        "--results", folder / "r.jsonl"], nproc=W, outputs=True)


def check_lora_rows(folder: Path) -> None:
    for rank in range(W):
        calls = seen_calls(folder, rank)
        assert all(c["training"] and c["grad"] for c in calls)
        want = [digest_rows(mine(LLAMA, s, LORA_B, rank)[0]) for s in range(LORA_STEPS)]
        assert [c["rows"] for c in calls] == want, f"rank {rank}: {NOT_ITS_ROWS}"


def check_lora_losses(folder: Path) -> None:
    (record,) = read_records(folder / "r.jsonl")
    assert [step for step, _ in record["losses"]] == list(range(LORA_STEPS))
    calls = [seen_calls(folder, rank) for rank in range(W)]
    for step, loss in record["losses"]:
        expected = job_loss(calls, step, LLAMA, step, LORA_B)
        assert abs(loss - expected) <= 1e-5, f"step {step}: {LOSS_NOT_MEAN}: recorded {loss}, recomputed {expected}"


def test_lora_feeds_each_rank_its_own_rows(lora_runs):
    pinned(lora_runs, check_lora_rows, "rank0_rows", match=NOT_ITS_ROWS)


def test_lora_recorded_losses_are_the_observed_logits(lora_runs):
    pinned(lora_runs, check_lora_losses, "loss_not_averaged", match=LOSS_NOT_MEAN)
