"""Chapter 05's data paths and reported losses, observed: what each rank's model was really fed and
returned (tests/workers/observe.py).

* ``test_context_parallel_feeds_each_rank_its_two_chunks``: with ``--layout zigzag`` CP rank r's
  model gets, of every sequence, chunks r and 2cp-1-r of the 2cp equal chunks (an early and a late
  one: the causal work balanced), with the positions of exactly those tokens; with ``contiguous``,
  chunks 2r and 2r+1. Mutant: the zig-zag layout handing out contiguous chunks. The equivalence tests
  cannot see that bug (the weights stay one process's; only the load balance is lost), this test
  does.

* ``test_pipeline_first_stage_gets_each_micro_batch_in_order``: the first stage runs, each step,
  the forwards of micro-batches 0 .. m-1 of that step's global batch, with exactly their rows.
  Mutant: the previous step's batch fed.
* ``test_pipeline_loss_is_the_mean_over_micro_batches_of_the_last_stage``: each recorded loss is the
  mean over micro-batches of the token cross-entropy of the logits the last stage returned. Mutant:
  the micro-batch losses summed. The weights are unchanged by it, so no equivalence test sees it.

Written out here, not imported from the script: the chunk arithmetic (tests/README.md lists what else
is pinned, and by which control).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ch05_common import QUICK, STEPS
from distkit.harness import read_records
from distkit.models import TokenTask, model_config
from launch import REPO
from observed import TOKENS_PER_STEP, digest_rows, observe_jobs, pinned, rate_check, seen_calls

# the messages of the checks' decisive assertions: each negative control must fail its check's own
NOT_ITS_CHUNKS = "the model was fed other tokens than its two chunks"
NOT_THE_MICRO_BATCHES = "the first stage's forwards are not the micro-batches of each step, in order"
PP_LOSS_NOT_MEAN = "the recorded loss is not the mean of the last stage's micro-batch cross-entropies"
NOT_THE_WHOLE_BATCH = "the TP rank was not fed the whole global batch of each step"
TP_LOSS_NOT_THE_BATCHS = "the recorded loss is not the whole batch's cross-entropy"
NOT_ITS_ROWS = "not its own rows of each step's global batch"
NOT_ITS_TOKENS = "the experts computed other rows than the tokens routed to them"

CP_SCRIPT = REPO / "05-advanced" / "context_parallel.py"
CP = 2
CP_RUNS = {
    "correct": None,
    "zigzag_contiguous": ('(rank, 2 * cp - 1 - rank) if layout == "zigzag"',
                          '(2 * rank, 2 * rank + 1) if layout == "zigzag"'),
}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, CP_SCRIPT, "TinyGPT", CP_RUNS,
                        lambda folder: [*QUICK, "--results", folder / "r.jsonl"], nproc=CP)


def expected_cp_calls(layout: str, batch: int, rank: int) -> list[tuple[list[str], list[str]]]:
    """(token rows, position rows) of each forward call of CP rank ``rank`` under ``layout``: one
    per step, each sequence of the step's global batch cut into 2cp equal chunks."""
    cfg = model_config("gpt", "tiny")
    task, size = TokenTask(cfg, seed=0), cfg.seq_len // (2 * CP)
    chunks = {"zigzag": (rank, 2 * CP - 1 - rank), "contiguous": (2 * rank, 2 * rank + 1)}[layout]
    calls = []
    for step in range(STEPS):
        inputs, _ = task.global_batch(step, batch)
        positions = torch.arange(cfg.seq_len).expand_as(inputs)
        mine = [torch.cat([t[:, c * size:(c + 1) * size] for c in chunks], dim=1) for t in (inputs, positions)]
        calls.append((digest_rows(mine[0]), digest_rows(mine[1])))
    return calls


def check_cp_chunks(folder: Path) -> None:
    records = read_records(folder / "r.jsonl")
    layouts = [r["config"]["layout"] for r in records]
    assert layouts == ["zigzag", "contiguous"]  # the script's default: both, one after the other
    batch = records[0]["config"]["global_batch_size"]
    for rank in range(CP):
        got = [(call["rows"], call["more"][0]) for call in seen_calls(folder, rank)]
        want = [call for layout in layouts for call in expected_cp_calls(layout, batch, rank)]
        assert got == want, f"rank {rank}: {NOT_ITS_CHUNKS}"


def test_context_parallel_feeds_each_rank_its_two_chunks(cp_runs):
    pinned(cp_runs, check_cp_chunks, "zigzag_contiguous", match=NOT_ITS_CHUNKS)


# ==== pipeline_parallel.py: micro-batches into the first stage, the loss out of the last =============

PP_SCRIPT = REPO / "05-advanced" / "pipeline_parallel.py"
PP, MICRO = 2, 2
PP_RUNS = {
    "correct": None,
    "previous_batch": ("inputs, targets = task.global_batch(step, args.global_batch_size)",
                       "inputs, targets = task.global_batch(max(step - 1, 0), args.global_batch_size)"),
    "loss_summed": ("torch.stack(micro_losses).mean()", "torch.stack(micro_losses).sum()"),
}


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, PP_SCRIPT, "TinyGPT", PP_RUNS, lambda folder: [
        *QUICK, "--schedule", "gpipe", "--microbatches", MICRO, "--results", folder / "r.jsonl"],
        nproc=PP, outputs=True)


def pp_micro_batches(batch: int):
    """(inputs, targets) of each (step, micro-batch): the step's global batch in MICRO equal parts."""
    task, size = TokenTask(model_config("gpt", "tiny"), seed=0), batch // MICRO
    out = {}
    for step in range(STEPS):
        inputs, targets = task.global_batch(step, batch)
        for m in range(MICRO):
            out[step, m] = inputs[m * size:(m + 1) * size], targets[m * size:(m + 1) * size]
    return out


def pp_calls(folder: Path, rank: int) -> list[dict]:
    """The stage's forwards of the training steps. torch's PipelineStage, given no example inputs
    (as here), first runs one forward of the first micro-batch to learn the shapes it will send
    (torch 2.13: ``_forward_metadata_inference``): it comes before the first step and is left out."""
    calls = seen_calls(folder, rank)
    extra = len(calls) - STEPS * MICRO
    assert extra in (0, 1), f"rank {rank}: {len(calls)} forwards for {STEPS} steps of {MICRO} micro-batches"
    if extra and rank == 0:  # the inference forward ran on the first micro-batch, like the first step
        assert calls[0]["rows"] == calls[1]["rows"]
    return calls[extra:]


def check_first_stage_rows(folder: Path) -> None:
    """The first stage (rank 0) runs every micro-batch forward, in order, with exactly its rows."""
    (record,) = read_records(folder / "r.jsonl")
    expected = pp_micro_batches(record["config"]["global_batch_size"])
    got = [call["rows"] for call in pp_calls(folder, 0)]
    assert got == [digest_rows(expected[step, m][0]) for step in range(STEPS) for m in range(MICRO)], \
        NOT_THE_MICRO_BATCHES


def check_pipeline_losses(folder: Path) -> None:
    """Each step's recorded loss is the mean over micro-batches of the token cross-entropy of the
    logits the last stage returned (the pipeline's loss is that mean: its gradients are averaged)."""
    (record,) = read_records(folder / "r.jsonl")
    expected = pp_micro_batches(record["config"]["global_batch_size"])
    calls = pp_calls(folder, PP - 1)
    for step in range(STEPS):
        losses = [torch.nn.functional.cross_entropy(torch.tensor(calls[step * MICRO + m]["outputs"]).flatten(0, 1),
                                                    expected[step, m][1].flatten()).item() for m in range(MICRO)]
        assert abs(record["losses"][step] - sum(losses) / MICRO) <= 1e-5, \
            f"step {step}: {PP_LOSS_NOT_MEAN}: recorded {record['losses'][step]}, micro-batches {losses}"


def test_pipeline_first_stage_gets_each_micro_batch_in_order(pp_runs):
    pinned(pp_runs, check_first_stage_rows, "previous_batch", match=NOT_THE_MICRO_BATCHES)


def test_pipeline_loss_is_the_mean_over_micro_batches_of_the_last_stage(pp_runs):
    pinned(pp_runs, check_pipeline_losses, "loss_summed", match=PP_LOSS_NOT_MEAN)


# ==== tensor_parallel.py: every TP rank the whole batch =============================================

TP_SCRIPT = REPO / "05-advanced" / "tensor_parallel.py"
TP, TP_BATCH = 2, 8
TP_RUNS = {
    "correct": None,
    # a data-parallel habit: each rank its own batch (seeded by its rank); the collectives still run
    "batch_per_rank": ("task.global_batch(step, args.global_batch_size)  # the same batch on every rank",
                       "task.global_batch(step * ctx.world_size + ctx.rank, args.global_batch_size)"),
    "loss_over_ranks": ("losses.append(loss.item())", "losses.append(loss.item() / tp)"),
    "tokens_per_rank_summed": ("tokens=inputs.numel())", "tokens=inputs.numel() * tp)"),
}


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, TP_SCRIPT, "TinyGPT", TP_RUNS, lambda folder: [
        *QUICK, "--global-batch-size", TP_BATCH, "--save", "none", "--results", folder / "r.jsonl"],
        nproc=TP, outputs=True)


def tp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return TokenTask(model_config("gpt", "tiny"), seed=0).global_batch(step, TP_BATCH)


def check_tp_rows(folder: Path) -> None:
    """Every TP rank's model gets the whole global batch of each step: the ranks split the weights,
    not the data."""
    for rank in range(TP):
        assert [c["rows"] for c in seen_calls(folder, rank)] == [digest_rows(tp_batch(s)[0]) for s in range(STEPS)], \
            f"rank {rank}: {NOT_THE_WHOLE_BATCH}"


def check_tp_losses(folder: Path) -> None:
    """Each recorded loss is the token cross-entropy of the whole batch's logits, which every rank
    returns whole (the LM head is not split here)."""
    (record,) = read_records(folder / "r.jsonl")
    for rank in range(TP):
        calls = seen_calls(folder, rank)
        for step in range(STEPS):
            logits = torch.tensor(calls[step]["outputs"], dtype=torch.float64)
            expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tp_batch(step)[1].flatten()).item()
            assert abs(record["losses"][step] - expected) <= 1e-5, \
                f"rank {rank}, step {step}: {TP_LOSS_NOT_THE_BATCHS}: recorded {record['losses'][step]}, " \
                f"recomputed {expected}"


def test_tensor_parallel_gives_every_rank_the_whole_batch(tp_runs):
    pinned(tp_runs, check_tp_rows, "batch_per_rank", match=NOT_THE_WHOLE_BATCH)


def test_tensor_parallel_loss_is_the_whole_batchs_cross_entropy(tp_runs):
    pinned(tp_runs, check_tp_losses, "loss_over_ranks", match=TP_LOSS_NOT_THE_BATCHS)


def test_tensor_parallel_tokens_per_s_counts_the_batch_once(tp_runs):
    cfg = model_config("gpt", "tiny")
    pinned(tp_runs, rate_check(TP_BATCH * cfg.seq_len, cfg), "tokens_per_rank_summed", match=TOKENS_PER_STEP)


# ==== hybrid_parallelism.py --mode 2d: data parallel along dp, the same rows along tp ================

HYBRID_SCRIPT = REPO / "05-advanced" / "hybrid_parallelism.py"
HYBRID_RUNS = {
    "correct": None,
    # the data sliced along the wrong mesh axis: TP partners read different rows, replicas the same
    "tp_axis_slices_data": ('mesh.get_local_rank("dp")', 'mesh.get_local_rank("tp")'),
}


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    # fully_shard swaps the root's class for FSDPTinyGPT
    return observe_jobs(tmp_path_factory, HYBRID_SCRIPT, "FSDPTinyGPT", HYBRID_RUNS, lambda folder: [
        *QUICK, "--mode", "2d", "--dp", 2, "--tp", 2, "--global-batch-size", TP_BATCH, "--save", "none",
        "--results", folder / "r.jsonl"], nproc=4)


def check_hybrid_rows(folder: Path) -> None:
    """On the (dp, tp) = (2, 2) mesh, rank r sits at dp index r // 2: ranks 0 and 1 (TP partners) read
    the first half of each global batch, ranks 2 and 3 the second."""
    half = TP_BATCH // 2
    for rank in range(4):
        dp_index = rank // 2
        want = [digest_rows(tp_batch(s)[0][dp_index * half:(dp_index + 1) * half]) for s in range(STEPS)]
        assert [c["rows"] for c in seen_calls(folder, rank)] == want, f"rank {rank}: {NOT_ITS_ROWS}"


def test_fsdp_tp_slices_the_data_along_dp_only(hybrid_runs):
    pinned(hybrid_runs, check_hybrid_rows, "tp_axis_slices_data", match=NOT_ITS_ROWS)


# ==== hybrid_parallelism.py --mode hsdp: every rank of the (replicate, shard) mesh its own rows ======

HSDP_RUNS = {
    "correct": None,
    # the data sliced along the replicate axis only, as 2d slices along dp: shard partners read the
    # same rows (each step trains on half the global batch)
    "sliced_by_replica": ("shard_mesh, dp_size, dp_rank = mesh, ctx.world_size, ctx.rank",
                          'shard_mesh, dp_size, dp_rank = mesh, shape[0], mesh.get_local_rank("replicate")'),
}


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    return observe_jobs(tmp_path_factory, HYBRID_SCRIPT, "FSDPTinyGPT", HSDP_RUNS, lambda folder: [
        *QUICK, "--mode", "hsdp", "--replicate", 2, "--shard", 2, "--global-batch-size", TP_BATCH,
        "--save", "none", "--results", folder / "r.jsonl"], nproc=4)


def check_hsdp_rows(folder: Path) -> None:
    """On the (replicate, shard) = (2, 2) mesh HSDP is data parallelism over all 4 ranks (FSDP only
    decides where the weights live): rank r reads the r-th quarter of each global batch, so the
    shard partners 0 and 1 read different rows."""
    quarter = TP_BATCH // 4
    for rank in range(4):
        want = [digest_rows(tp_batch(s)[0][rank * quarter:(rank + 1) * quarter]) for s in range(STEPS)]
        assert [c["rows"] for c in seen_calls(folder, rank)] == want, f"rank {rank}: {NOT_ITS_ROWS}"


def test_hsdp_gives_every_rank_its_own_rows(hsdp_runs):
    pinned(hsdp_runs, check_hsdp_rows, "sliced_by_replica", match=NOT_ITS_ROWS)


# ==== expert_parallel.py: each token to the experts it chose, on the ranks that own them =============

EP_SCRIPT = REPO / "05-advanced" / "expert_parallel.py"
EP, EXPERTS, TOP_K, CAPACITY_FACTOR = 2, 8, 2, 1.25  # the script's defaults
EP_RUNS = {
    "correct": None,
    # arrivals are ordered by source rank, then expert: run without regrouping, experts get others' rows
    "not_regrouped": ("by_expert = expert_of_row.argsort(stable=True)", "by_expert = torch.arange(len(expert_of_row))"),
    "capacity_off_by_one": ("keep = place < capacity", "keep = place <= capacity"),
}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    # the MoE layer's input and router weight at each call, and each expert MLP's rows
    return observe_jobs(tmp_path_factory, EP_SCRIPT, "MoE,MLP", EP_RUNS, lambda folder: [
        *QUICK, "--global-batch-size", TP_BATCH, "--save", "none", "--results", folder / "r.jsonl"],
        nproc=EP, options=("--inputs", "--param", "router.weight"))


def expected_expert_rows(moe_calls: list[dict]) -> dict[int, list[str]]:
    """Per expert, the digests of the token rows it must receive in one MoE forward, given that
    forward's call on every rank (``moe_calls[source rank]``): each rank routes each of its tokens to
    its top-k experts by the router's probabilities; an expert keeps at most
    ceil(factor x T x k / E) of a rank's routing choices, first choices before second, earlier
    tokens first; the owner receives them by source rank, each rank's in that order."""
    rows = {e: [] for e in range(EXPERTS)}
    for call in moe_calls:
        x = torch.tensor(call["inputs"], dtype=torch.float64).to(torch.float32)
        tokens = x.reshape(-1, x.shape[-1])
        router = torch.tensor(call["param"], dtype=torch.float64).to(torch.float32)
        chosen = (tokens @ router.t()).softmax(dim=-1).topk(TOP_K, dim=-1).indices  # (T, k)
        capacity = math.ceil(CAPACITY_FACTOR * len(tokens) * TOP_K / EXPERTS)
        taken = {e: [] for e in range(EXPERTS)}
        for choice in range(TOP_K):
            for t in range(len(tokens)):
                e = int(chosen[t, choice])
                if len(taken[e]) < capacity:
                    taken[e].append(t)
        for e in range(EXPERTS):
            rows[e] += digest_rows(tokens[taken[e]]) if taken[e] else []
    return rows


def check_routing(folder: Path) -> None:
    """Every expert computes exactly the tokens routed to it, on the rank that owns it (experts
    E/ep x r ... on rank r)."""
    calls = [seen_calls(folder, rank) for rank in range(EP)]
    moe = [[c for c in rank_calls if c["class"] == "MoE"] for rank_calls in calls]
    mlp = [[c for c in rank_calls if c["class"] == "MLP"] for rank_calls in calls]
    local = EXPERTS // EP
    n_layer = model_config("gpt", "tiny").n_layer
    assert [len(m) for m in moe] == [STEPS * n_layer] * EP  # one MoE forward per layer and step on every rank
    assert [len(m) for m in mlp] == [STEPS * n_layer * local] * EP
    for i in range(STEPS * n_layer):
        want = expected_expert_rows([moe[rank][i] for rank in range(EP)])
        for rank in range(EP):
            got = [c["rows"] for c in mlp[rank][i * local:(i + 1) * local]]
            assert got == [want[rank * local + j] for j in range(local)], \
                f"MoE forward {i}, rank {rank}: {NOT_ITS_TOKENS}"


def test_expert_parallel_sends_each_token_to_its_chosen_experts(ep_runs):
    pinned(ep_runs, check_routing, "not_regrouped", "capacity_off_by_one", match=NOT_ITS_TOKENS)
