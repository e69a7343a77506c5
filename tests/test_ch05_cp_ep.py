"""Chapter 05: context parallelism (05-advanced/context_parallel.py) and expert parallelism
(05-advanced/expert_parallel.py). Every README command of both runs here (2 and 4 CPU ranks, gloo),
trains the same weights as one process, and moves the bytes its formula says.

Training equivalence: the README commands with the chapter's quick flags (ch05_common.QUICK: tiny GPT,
3 plain-SGD steps at lr 0.5, fp32; CP at 32 tokens per sequence). The saved weights must equal one
process training the same initial weights within ch05_common.TOLERANCE (1e-5 on every parameter).
CP's reference is the chapter's own (TinyGPT with SDPA on the whole sequences); EP's is
tests/workers/moe_reference.py (a router and a capacity loop written independently of the script,
every rank's slice routed separately, as the ranks do). Observed on 2-core CPU, gloo: CP 1.2e-7, EP
8e-9. The bugs the tolerance must catch, shown failing here by their own copies of the scripts
(tests/workers/ch05_mutant.py): CP ranks embedding their chunks as if they started at position 0;
EP experts' gradients reduced over every rank instead of the ranks holding the same experts. CP also
trains the tiny Llama (RoPE at each token's place in the sequence, grouped-query K/V widened per
block) to one process's weights (1.2e-7), with two broken copies: RoPE at local positions (3.9e-4, 39x
the tolerance: only angles across chunks are wrong) and a K/V head's gradient from one query head (4e-2).

Layer equivalence (tests/workers/ch05_cp_ep.py, one 4-rank launch): ring attention's output and
its q/k/v gradients against SDPA on the whole sequence, the MoE layer's output and its input, router
and expert gradients against the loop reference, for unit-variance inputs within LAYER_TOLERANCE
(1e-4; observed 7.6e-7 to 2.6e-6). The broken copies land 1.0 to 9.3 away (10,000x the tolerance):
the diagonal chunk pairs unmasked, future chunks attended, partial softmaxes added without
rescaling, dK/dV never sent home; the combine's rows in expert order, rows given to the wrong expert.

Bytes: the harness's counted collectives equal distkit.theory's formulas exactly (calls and bytes),
and the tests write the counts out once more by hand. Memory: MemTracker's activation bytes at the end
of forward, at cp = 1, 2, 4, times cp, within 2% of cp = 1's (observed: within 0.3%).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from ch05_common import CHAPTER, CP_QUICK, LOOKUPS, QUICK, TOLERANCE, launch, readme_command, reference
from distkit import UsageError, compare, theory
from distkit.harness import read_records
from distkit.models import model_config
from distkit.runtime import seed_everything
from launch import REPO, WORKERS, assert_one_line_error, job, load_script, parse_args_result, run_jobs, torchrun
from spine import flag_path, play_chapter
from workers.moe_reference import loop_moe_model, train_moe_one_process

LAYER_TOLERANCE = 1e-4
WIDE = 100  # a bug must miss by at least this factor times the tolerance
EP = dict(num_experts=8, top_k=2, capacity_factor=1.25, aux_weight=0.01, batch=16)  # the script's defaults


@pytest.fixture(scope="module")
def played(reader):
    """Chapter 05's README commands as the reader's play ran them (tests/spine.py, ch05_common.PLAY)."""
    return play_chapter("05-advanced", reader)


def run_readme(name: str, tmp_path, extra=(), **kwargs):
    needles, without = LOOKUPS[name]
    return launch(tmp_path, *needles, without=without, extra=extra, **kwargs)


def max_diff(checkpoint, expected: dict) -> float:
    state = torch.load(checkpoint, weights_only=True)["model"]
    assert set(state) == set(expected), set(state) ^ set(expected)
    return max((state[name] - ref).abs().max().item() for name, ref in expected.items())


# ------------------------------------------------------------------------------------ the layers
@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cp_ep_layers")
    out = tmp_path / "layers.json"
    result = torchrun(WORKERS / "ch05_cp_ep.py", "--out", out, nproc=4, tmp_path=tmp_path, timeout=400)
    print(result.stdout[-3000:])
    return json.loads(out.read_text())


def test_ring_attention_equals_attention_on_the_whole_sequence(layers):
    """Both layouts at cp = 2 and 4: output and q/k/v gradients equal SDPA's; every broken copy fails."""
    for cp in (2, 4):
        for layout in ("zigzag", "contiguous"):
            assert layers[f"cp{cp}_{layout}_correct"] < LAYER_TOLERANCE, (cp, layout)
            for bug in ("unmasked_diagonal", "future_not_skipped", "merge_not_rescaled", "dkv_not_sent_home"):
                assert layers[f"cp{cp}_{layout}_{bug}"] > WIDE * LAYER_TOLERANCE, (cp, layout, bug)


def test_zigzag_gives_every_rank_the_same_causal_work(layers):
    """Chunk pairs (query chunk i, key chunk j <= i) each rank computes per layer, counted by the ring
    itself: contiguous, rank r holds chunks 2r, 2r+1 and computes 4r + 3 (3 at home, 4 from each
    earlier rank); zig-zag, rank r holds r and 2cp-1-r and computes 2cp + 1 (3 at home, 2 per other)."""
    for cp in (2, 4):
        assert layers[f"cp{cp}_zigzag_pairs"] == [2 * cp + 1] * cp
        assert layers[f"cp{cp}_contiguous_pairs"] == [4 * r + 3 for r in range(cp)]
        for layout in ("zigzag", "contiguous"):
            assert theory.zigzag_attention_pairs(cp, layout) == layers[f"cp{cp}_{layout}_pairs"]


def test_moe_layer_equals_one_process_and_conserves_tokens(layers):
    """ep = 2 (dp 2 x ep 2) and ep = 4: outputs and every gradient equal the loop reference's; what each
    rank sent each expert is what the reference's experts kept, and what each expert's rank received
    from each source, count by count; some choices were dropped (the capacity is exercised)."""
    for ep in (2, 4):
        assert layers[f"ep{ep}_correct"] < LAYER_TOLERANCE, ep
        for bug in ("combine_unpermuted", "rows_not_regrouped"):
            assert layers[f"ep{ep}_{bug}"] > WIDE * LAYER_TOLERANCE, (ep, bug)
        routing = layers[f"ep{ep}_routing"]
        assert routing["pairwise_conserved"]
        assert routing["sent"] == routing["reference_kept"]
        # 4 ranks x 16 tokens x top-2 choices; capacity ceil(1.0 x 16 x 2 / 8) = 4 per expert and rank
        assert routing["dropped"] == 4 * 16 * 2 - sum(map(sum, routing["sent"])) > 0
        assert max(max(sent) for sent in routing["sent"]) == 4


# ---------------------------------------------------------------------------- context parallel
@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, played):
    """The README's 2- and 4-rank commands at the quick settings, as the reader's play ran them, and
    the 2-rank one on 1 rank (cp = 1): {cp: (records by layout, folder)}."""
    folder = tmp_path_factory.mktemp("cp1")
    run_readme("cp_2ranks", folder, nproc=1, extra=(*CP_QUICK, "--results", folder / "r.jsonl",
                                                    "--save", folder / "{layout}.pt"))
    runs = {1: ({r["config"]["layout"]: r for r in read_records(folder / "r.jsonl")}, folder)}
    for cp, name in ((2, "cp_2ranks"), (4, "cp_4ranks")):
        run = played.ok(LOOKUPS[name])
        runs[cp] = {r["config"]["layout"]: r for r in read_records(flag_path(run, "--results"))}, run["out"]
    return runs


def test_context_parallel_matches_single_process(cp_runs):
    """Both layouts at cp = 2 and 4: the weights and the losses of one process on whole sequences."""
    expected, losses = reference(8)
    for cp in (2, 4):
        records, folder = cp_runs[cp]
        assert set(records) == {"zigzag", "contiguous"}
        for layout, record in records.items():
            assert max_diff(folder / f"{layout}.pt", expected) < TOLERANCE, (cp, layout)
            assert record["losses"] == pytest.approx(losses, abs=1e-5)
            assert record["strategy"] == "cp" and record["config"]["cp"] == cp == record["world_size"]
            # every rank holds every weight (its gradient too: SGD keeps no state)
            assert {s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]} == {
                4 * sum(t.numel() for t in expected.values())}


def test_context_parallel_without_positions_fails(tmp_path):
    """The bug the equivalence test must catch, made in the script: each rank embeds its chunks as if
    they were the start of the sequence (positions 0, 1, ...). Attention itself is still exact."""
    nproc, script, args = readme_command(*LOOKUPS["cp_2ranks"][0], without=LOOKUPS["cp_2ranks"][1])
    torchrun(WORKERS / "ch05_mutant.py", REPO / script,
             "model(*(shard_sequence(t, chunks, cp) for t in (inputs, positions)))",
             "model(shard_sequence(inputs, chunks, cp))", "--", *args, *CP_QUICK, "--layout", "zigzag",
             "--results", tmp_path / "r.jsonl", "--save", tmp_path / "{layout}.pt", nproc=nproc, tmp_path=tmp_path)
    diff = max_diff(tmp_path / "zigzag.pt", reference(8)[0])
    print(f"positions not sharded: max |distributed - single| = {diff:.2e}")
    assert diff > WIDE * TOLERANCE


# How far past the tolerance each broken copy lands must be (observed on 2-core CPU, gloo): RoPE at
# local positions misses by 3.9e-4 only, 39x: q and k of one chunk are rotated alike, so only the
# angles between tokens of different chunks are wrong.
LLAMA_MISS = {"llama_without_positions": 10, "gqa_gradient_not_summed": WIDE}
LLAMA_BUGS = {
    # RoPE at each rank's local positions 0, 1, ... instead of the tokens' places in the sequence
    "llama_without_positions": ("model(*(shard_sequence(t, chunks, cp) for t in (inputs, positions)))",
                                "model(shard_sequence(inputs, chunks, cp))"),
    # a K/V head's gradient taken from its first query head only, not summed over the heads it serves
    "gqa_gradient_not_summed": ("grad.unflatten(1, (-1, groups)).sum(2)", "grad.unflatten(1, (-1, groups))[:, :, 0]"),
}


@pytest.fixture(scope="module")
def cp_llama_runs(tmp_path_factory):
    """The 4-rank README command on the tiny Llama (both layouts), and each broken copy at 2 ranks
    (zig-zag): {name: folder}."""
    def launch_one(name: str, folder: Path):
        flags = (*CP_QUICK, "--arch", "llama", "--results", folder / "r.jsonl", "--save", folder / "{layout}.pt")
        if name == "correct":
            return run_readme("cp_4ranks", folder, extra=flags)
        nproc, script, args = readme_command(*LOOKUPS["cp_2ranks"][0], without=LOOKUPS["cp_2ranks"][1])
        return torchrun(WORKERS / "ch05_mutant.py", REPO / script, *LLAMA_BUGS[name], "--", *args, *flags,
                        "--layout", "zigzag", nproc=nproc, tmp_path=folder)

    jobs = run_jobs({name: functools.partial(launch_one, name) for name in ("correct", *LLAMA_BUGS)},
                    tmp_path_factory)
    return {name: job(jobs, name)[0] for name in jobs}


def test_context_parallel_trains_the_llama_like_one_process(cp_llama_runs):
    """The tiny Llama at cp = 4: RoPE rotates each token by its place in the whole sequence (the model
    is given every chunk's positions), and the grouped-query K/V (4 heads for 8 query heads) travel
    the ring with their own heads, widened per block and their gradients folded back. Weights and
    losses of one process; the ring's bytes are half the GPT-wide formula's (K/V 32 wide, not 64).
    Controls: RoPE at the local positions, and a K/V head's gradient from one query head only."""
    expected, losses = reference(8, "llama")
    folder = cp_llama_runs["correct"]
    records = {r["config"]["layout"]: r for r in read_records(folder / "r.jsonl")}
    assert set(records) == {"zigzag", "contiguous"}
    params = sum(t.numel() for t in expected.values())
    hops, kv = (3 * 4 - 2) * 2, 2 * 8 * (32 // 4) * (64 * 4 // 8) * 4
    by_hand = {"all_reduce": (1, 4 * params), "send": (hops, hops * kv), "recv": (hops, hops * kv)}
    cfg = model_config("llama", "tiny")
    assert {k: (v["calls"], v["bytes"]) for k, v in theory.context_parallel_comm(cfg, 8, 4).items()} == by_hand
    for layout, record in records.items():
        assert record["model"]["arch"] == "llama" and record["world_size"] == 4
        assert max_diff(folder / f"{layout}.pt", expected) < TOLERANCE, layout
        assert record["losses"] == pytest.approx(losses, abs=1e-5)
        for comm in record["metrics"]["comm_per_step_per_rank"]:
            assert {k: (v["calls"], v["bytes"]) for k, v in comm.items()} == by_hand, (layout, comm)
    for bug in LLAMA_BUGS:
        diff = max_diff(cp_llama_runs[bug] / "zigzag.pt", expected)
        print(f"{bug}: max |distributed - single| = {diff:.2e}")
        assert diff > LLAMA_MISS[bug] * TOLERANCE, bug


def test_context_parallel_bytes_equal_the_formula(cp_runs):
    """Per rank per step: 3cp - 2 sends (and receives) per layer of one rank's K and V, 2 x batch 8 x
    32/cp tokens x 64 wide x 4 bytes (cp - 1 forward, cp - 1 backward, and cp of dK/dV), and one
    all-reduce of every gradient; nothing else. On every rank, for both layouts."""
    cfg = model_config("gpt", "tiny")
    params = sum(t.numel() for t in reference(8)[0].values())
    for cp in (1, 2, 4):
        records, _ = cp_runs[cp]
        hops = (3 * cp - 2) * 2 if cp > 1 else 0  # 2 layers
        by_hand = {"all_reduce": (1, 4 * params)}
        if hops:
            kv = 2 * 8 * (32 // cp) * 64 * 4
            by_hand.update(send=(hops, hops * kv), recv=(hops, hops * kv))
        formula = {k: (v["calls"], v["bytes"]) for k, v in theory.context_parallel_comm(cfg, 8, cp).items()}
        assert formula == by_hand
        for record in records.values():
            for comm in record["metrics"]["comm_per_step_per_rank"]:
                assert {k: (v["calls"], v["bytes"]) for k, v in comm.items()} == by_hand, (cp, comm)


def test_context_parallel_activations_fall_as_1_over_cp(cp_runs):
    """What a rank keeps from forward for backward (MemTracker's Activation bytes at the end of
    forward, the harness's tracked step) is per token: 1/cp of cp = 1's. Measured on every rank."""
    kept = {cp: [b for r in records.values() for b in r["activations_after_forward_per_rank"]]
            for cp, (records, _) in cp_runs.items()}
    one = kept[1][0]
    for cp, values in kept.items():
        for value in values:
            assert value * cp == pytest.approx(one, rel=0.02), (cp, kept)


def test_torch_context_parallel_on_cpu_is_one_line(played):
    """PyTorch's context_parallel() needs SDPA's CUDA kernels: on CPU the README command stops with
    one line (as the play ran it)."""
    result = played.completed(LOOKUPS["cp_torch_on_cpu"])
    assert_one_line_error(result, "--impl torch: PyTorch's context_parallel() runs SDPA's CUDA kernels only")


def test_context_parallel_bad_input_is_one_line():
    cp = load_script(CHAPTER / "context_parallel.py")
    with pytest.raises(UsageError, match=r"^--seq-len 36 is not divisible by 2 x 4 ranks"):
        cp.check_context_parallel(36, 4, "ring", ["zigzag"], "cpu")
    with pytest.raises(UsageError, match=r"give --layout zigzag"):
        cp.check_context_parallel(32, 2, "torch", ["contiguous"], "cuda")
    with pytest.raises(UsageError, match=r"use --impl ring for --arch llama"):
        cp.check_context_parallel(32, 2, "torch", ["zigzag"], "cuda", "llama")
    cp.check_context_parallel(32, 4, "ring", ["zigzag", "contiguous"], "cpu")
    result = parse_args_result(cp, "--layout", "diagonal")
    assert result.returncode == 2
    assert_one_line_error(result, "argument --layout: invalid choice: 'diagonal'")


# ----------------------------------------------------------------------------- expert parallel
@pytest.fixture(scope="module")
def ep_runs(played):
    """The README's 2- and 4-rank commands at the quick settings, as the reader's play ran them:
    {ranks: (record, folder)}."""
    runs = {}
    for nproc, name in ((2, "ep_2ranks"), (4, "ep_4ranks")):
        run = played.ok(LOOKUPS[name])
        (record,) = read_records(flag_path(run, "--results"))
        runs[nproc] = record, run["out"]
    return runs


@pytest.fixture(scope="module")
def ep_reference():
    """One process, every rank's slice routed separately: {ranks: (initial, final, losses, routing)}."""
    script = load_script(CHAPTER / "expert_parallel.py")
    results = {}
    for groups in (2, 4):
        seed_everything(0)
        model = script.build_moe_model(model_config("gpt", "tiny"), EP["num_experts"], EP["top_k"],
                                       EP["capacity_factor"])
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        final, losses, routing = train_moe_one_process(loop_moe_model(model), 3, EP["batch"], groups, 0.5,
                                                       EP["aux_weight"])
        results[groups] = initial, final, losses, routing
    return results


def test_expert_parallel_matches_single_process(ep_runs, ep_reference):
    """ep = 2 on 2 ranks, dp 2 x ep 2 on 4: weights and losses of one process; each rank holds the
    dense weights and its share of the experts."""
    for nproc, (record, folder) in ep_runs.items():
        initial, final, losses, _ = ep_reference[nproc]
        diff = max_diff(folder / "ep.pt", final)
        assert diff < TOLERANCE, (nproc, diff)
        assert max_diff(folder / "ep.pt", initial) > WIDE * TOLERANCE  # training moved the weights
        assert record["losses"] == pytest.approx(losses, abs=1e-5)
        assert record["config"]["mesh"] == {"dp": nproc // 2, "ep": 2}
        dense = sum(t.numel() for k, t in final.items() if ".experts." not in k)
        experts = sum(t.numel() for k, t in final.items() if ".experts." in k)
        assert record["param_count"] == dense + experts
        held = [s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]]
        assert held == [4 * (dense + experts // 2)] * nproc


def test_expert_grads_reduced_over_every_rank_fail(tmp_path, ep_reference):
    """The bug the 4-rank equivalence must catch: experts' gradients all-reduced over all 4 ranks (the
    dense parameters' group) instead of the 2 that hold the same experts."""
    nproc, script, args = readme_command(*LOOKUPS["ep_4ranks"][0])
    torchrun(WORKERS / "ch05_mutant.py", REPO / script, "reduce_gradients(experts, dp_group,",
             "reduce_gradients(experts, dist.group.WORLD,", "--", *args, *QUICK,
             "--results", tmp_path / "r.jsonl", "--save", tmp_path / "ep.pt", nproc=nproc, tmp_path=tmp_path)
    diff = max_diff(tmp_path / "ep.pt", ep_reference[4][1])
    print(f"experts reduced over every rank: max |distributed - single| = {diff:.2e}")
    assert diff > WIDE * TOLERANCE


def test_expert_parallel_bytes_equal_the_formula(ep_runs, ep_reference):
    """Every rank, the harness's step (step 1): per MoE layer 5 all-to-alls (counts: 8 experts x 8
    bytes; dispatch and the combine's gradient: the rows it sent; combine and the dispatch's gradient:
    the rows its experts received), x 64 wide x 4 bytes; one all-reduce of the dense gradients, and
    with dp 2 one of its experts'. Rows from the reference's routing, not the script's; and
    compare.compare_record, given only the record (its counted routing), predicts every byte."""
    for nproc, (record, _) in ep_runs.items():
        _, final, _, routing = ep_reference[nproc]
        ep, dp, local = 2, nproc // 2, EP["num_experts"] // 2
        kept = routing[1]  # [slice = rank][layer][expert]
        dense = sum(t.numel() for k, t in final.items() if ".experts." not in k)
        for rank, comm in enumerate(record["metrics"]["comm_per_step_per_rank"]):
            row = range(rank - rank % ep, rank - rank % ep + ep)  # the ranks it exchanges tokens with
            mine = range((rank % ep) * local, (rank % ep + 1) * local)  # its experts
            sent = [sum(layer) for layer in kept[rank]]
            received = [sum(kept[s][layer][e] for s in row for e in mine) for layer in range(2)]
            expert_numel = sum(t.numel() for k, t in final.items() if any(f".experts.{e}." in k for e in mine))
            by_hand = {"all_to_all": (5 * 2, sum(8 * 8 + 2 * (s + r) * 64 * 4 for s, r in zip(sent, received))),
                       "all_reduce": (1 + (dp > 1), 4 * dense + (4 * expert_numel if dp > 1 else 0))}
            formula = theory.expert_parallel_comm(64, sent, received, EP["num_experts"], ep, dp, dense, expert_numel)
            assert {k: (v["calls"], v["bytes"]) for k, v in formula.items()} == by_hand
            assert {k: (v["calls"], v["bytes"]) for k, v in comm.items()} == by_hand, (nproc, rank)
        # the record says which routing the harness counted: theory predicts the cell from it alone
        assert record["counted_routing_per_rank"] == [rank[1] for rank in record["routing_per_rank"]]
        assert compare.compare_record(record)["comm_error"] == 0, nproc  # (its state: SGD here, theory's AdamW)


def test_expert_parallel_token_counts_are_conserved(ep_runs, ep_reference):
    """Every step and layer: each rank sent each expert what the reference's expert kept of its slice;
    the expert's rank received exactly that from it; the rest of the rank's k x T choices were dropped."""
    for nproc, (record, _) in ep_runs.items():
        routing, reference_kept, local = record["routing_per_rank"], ep_reference[nproc][3], EP["num_experts"] // 2
        for step in range(3):
            for layer in range(2):
                for rank in range(nproc):
                    mine = routing[rank][step][layer]
                    assert mine["sent"] == reference_kept[step][rank][layer]
                    assert mine["dropped"] == 2 * (EP["batch"] // nproc * 32) - sum(mine["sent"])  # k x T
                    row = rank - rank % 2
                    for source in range(2):
                        sent = routing[row + source][step][layer]["sent"]
                        assert mine["received"][source] == sent[(rank % 2) * local:(rank % 2 + 1) * local]


def test_load_balancing_loss_behaves_as_documented():
    """E x sum_i f_i P_i: 1 when the routing choices or the probabilities are uniform; E when everything
    goes to one expert with certainty; its gradient lowers the probability of the overloaded expert,
    and a step along it lowers the loss."""
    lb = load_script(CHAPTER / "expert_parallel.py").load_balancing_loss
    E, T = 4, 8
    uniform_probs, spread = torch.full((T, E), 1 / E), (torch.arange(T) % E)[:, None]
    assert lb(uniform_probs, spread, E).item() == pytest.approx(1.0, abs=1e-6)
    skewed = torch.softmax(torch.randn(T, E, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    assert lb(skewed, spread, E).item() == pytest.approx(1.0, abs=1e-6)  # f uniform: sum_i P_i = 1
    assert lb(uniform_probs, torch.zeros(T, 1, dtype=torch.long), E).item() == pytest.approx(1.0, abs=1e-6)
    collapsed = torch.zeros(T, E)
    collapsed[:, 0] = 1.0
    assert lb(collapsed, torch.zeros(T, 1, dtype=torch.long), E).item() == pytest.approx(E)
    top2 = torch.stack([torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long)], dim=1)
    assert lb(torch.full((T, E), 0.25), top2, E).item() == pytest.approx(1.0)  # top-k: f over T x k choices
    favour_0 = torch.tensor([2.0, 0, 0, 0])
    logits = (torch.randn(T, E, generator=torch.Generator().manual_seed(1)) + favour_0).requires_grad_()
    probs = logits.softmax(dim=-1)
    loss = lb(probs, probs.topk(1, dim=-1).indices, E)
    assert 1.0 < loss.item() < E
    loss.backward()
    assert logits.grad[:, 0].sum() > 0 and (logits.grad[:, 1:].sum(dim=0) < 0).all()  # descent: expert 0 down
    stepped = (logits - 1.0 * logits.grad).softmax(dim=-1)
    assert lb(stepped, probs.topk(1, dim=-1).indices, E) < loss


def test_expert_parallel_bad_input_is_one_line():
    ep = load_script(CHAPTER / "expert_parallel.py")
    cases = [((8, 9, 2, 4), "--top-k 9 is larger than --num-experts 8"),
             ((6, 2, 4, 4), "--num-experts 6 is not divisible by --ep 4"),
             ((8, 2, 3, 4), "--ep 3 does not divide the 4 ranks")]
    for arguments, message in cases:
        with pytest.raises(UsageError, match=f"^{message}"):
            ep.check_moe(*arguments)
    ep.check_moe(8, 2, 2, 4)
    for flags, message in ((("--capacity-factor", "0"), "argument --capacity-factor: must be a positive number, got 0"),
                           (("--ep", "0"), "argument --ep: must be a positive integer, got 0"),
                           (("--aux-weight", "-1"), "argument --aux-weight: must be a number >= 0, got -1")):
        result = parse_args_result(ep, *flags)
        assert result.returncode == 2
        assert_one_line_error(result, message)


# ---------------------------------------------------------------------------------- on a GPU
# pytest -m gpu (not yet run: no GPU was available where this was written). One GPU hosts one NCCL rank,
# so each script runs at world size 1 (a ring of one, all experts on the rank); tolerance 1e-4 as in
# tests/test_ch05_gpu.py (GPU kernels add in another order than the CPU reference).
GPU_TOLERANCE = 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("impl, arch", [("ring", "gpt"), ("torch", "gpt"), ("ring", "llama")])
def test_context_parallel_on_one_gpu(impl, arch, tmp_path):
    """The by-hand ring (on the GPT and the Llama) and PyTorch's context_parallel() (SDPA's CUDA
    kernels) on NCCL."""
    from launch import job_env, require_gpus

    require_gpus(1)
    run_readme("cp_2ranks", tmp_path, nproc=1, env=job_env(tmp_path, gpu=True),
               extra=(*CP_QUICK, "--impl", impl, "--arch", arch, "--layout", "zigzag", "--backend", "nccl",
                      "--results", tmp_path / "r.jsonl", "--save", tmp_path / "{layout}.pt"))
    assert max_diff(tmp_path / "zigzag.pt", reference(8, arch)[0]) < GPU_TOLERANCE
    (record,) = read_records(tmp_path / "r.jsonl")
    assert (record["backend"], record["device"]) == ("nccl", "cuda")


@pytest.mark.gpu
def test_expert_parallel_on_one_gpu(tmp_path):
    """The MoE layer's exchanges on NCCL (a group of one): the weights of one CPU process."""
    from launch import job_env, require_gpus

    require_gpus(1)
    run_readme("ep_2ranks", tmp_path, nproc=1, env=job_env(tmp_path, gpu=True),
               extra=(*QUICK, "--backend", "nccl", "--results", tmp_path / "r.jsonl", "--save", tmp_path / "ep.pt"))
    script = load_script(CHAPTER / "expert_parallel.py")
    seed_everything(0)
    model = script.build_moe_model(model_config("gpt", "tiny"), EP["num_experts"], EP["top_k"],
                                   EP["capacity_factor"])
    final, _, _ = train_moe_one_process(loop_moe_model(model), 3, EP["batch"], 1, 0.5, EP["aux_weight"])
    assert max_diff(tmp_path / "ep.pt", final) < GPU_TOLERANCE
