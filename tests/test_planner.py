"""The strategy planner (``distkit.planner``, ``benchmarks/plan.py``): its byte counts are
``distkit.theory``'s, cross-checked against the ZeRO paper and DeepSpeed's own estimators at real
shapes; its fits/doesn't-fit answer flips where the bytes say; its recommendation matches two cases
worked out by hand; the CLI's JSON has the documented schema and bad input is one line; and its
predictions for the committed CPU matrix are within the stated bounds. No job is launched."""
from __future__ import annotations
import __future__

import inspect
import json
import math
import os
import re
import statistics
from dataclasses import replace

import pytest

from benchmarks_common import BENCH, COMMITTED_RESULTS, PLANNER_LOOKUPS
from distkit import planner, predictors, theory
from distkit.errors import UsageError
from distkit.models import LlamaModelConfig, model_config, with_experts
from distkit.mutation import mutate
from distkit.strategies import MEASURED, PLANNED
from launch import assert_one_line_error, load_script, parse_args_result, python
from spine import play_chapter

GiB = 2 ** 30
LLAMA_1B = model_config("llama", "llama-3.2-1b")
LLAMA_8B = model_config("llama", "llama-3.1-8b")
# Llama-2-7B's published shape (32 layers, width 4096, 32 heads without GQA, MLP 11008, 32k vocab):
# 6,738,415,616 parameters, the "7B" of the ZeRO-era examples.
LLAMA_7B = LlamaModelConfig(vocab_size=32000, seq_len=4096, n_layer=32, n_embd=4096, n_head=32, n_kv_head=32,
                            intermediate_size=11008)


def psi(cfg) -> int:
    return sum(math.prod(s) for s in theory.param_shapes(cfg).values())


# ---------------------------------------------------------------- the fast path equals theory's


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_busiest_rank_prediction_equals_predict(arch):
    """``predictors.busiest_rank_prediction`` (linear in the ranks, what the planner calls) returns, for
    every strategy and 2, 3 and 4 ranks, exactly the state of :func:`predictors.predict`'s busiest rank
    and that rank's collectives. Shapes chosen so dim 0 does not divide by 3 or 4 (vocabulary 66,
    width 72: FSDP2's padding and ``torch.chunk``'s uneven shares). Expert parallelism runs on the
    same shape with 12 experts per block (12 split over 2, 3 and 4 ranks), at ep = n and, with 4
    ranks, ep 2 x dp 2. Bug caught: a fast path that gives rank 0 the average share (Ψ/n) or the
    padded one, or forgets the HSDP all-reduce. Negative control: the same call for rank 1 differs
    from rank 0 on these shapes."""
    cfg = model_config(arch, "tiny", vocab_size=66, n_embd=72, n_layer=4, **({"n_head": 6, "n_kv_head": 3}
                                                                             if arch == "llama" else {"n_head": 6}))
    shapes = theory.param_shapes(cfg)
    for n in (2, 3, 4):
        for strategy in MEASURED:
            if strategy in ("fsdp_hybrid_shard", "hsdp", "fsdp_tp_2d") and n != 4:
                continue
            if strategy in ("tp", "tp_sp") and n == 4:  # 6 heads do not split over 4 ranks
                continue
            if strategy == "fsdp_tp_2d" and arch == "llama":  # 3 kv heads do not split over tp=2
                continue
            cases = [({"tp": 2} if strategy == "fsdp_tp_2d" else {}, cfg)]
            if strategy == "ep":  # an MoE of this shape, experts over all ranks and, at 4, over 2 of them
                cases = [({"ep": ep}, with_experts(cfg, 12, 2)) for ep in ([n, 2] if n == 4 else [n])]
            for knobs, model in cases:
                want = predictors.predict(strategy, model, n, 12, knobs)
                got = predictors.busiest_rank_prediction(strategy, model, n, 12, knobs)
                totals = [sum(s.values()) for s in want["state_per_rank"]]
                assert sum(got["state"].values()) == max(totals), (strategy, n)
                assert got["state"] == want["state_per_rank"][got["rank"]], (strategy, n)
                assert got["comm"] == want["comm_per_rank"][got["rank"]], (strategy, n)
    rank0, _ = predictors.fsdp_rank_prediction(shapes, 4, 1, True, rank=0)
    rank3, _ = predictors.fsdp_rank_prediction(shapes, 4, 1, True, rank=3)
    assert rank0 != rank3  # the control: the fast path does tell ranks apart


# ---------------------------------------------------------------- cross-checks at real shapes


@pytest.mark.parametrize("cfg,expected_psi", [(LLAMA_1B, 1_235_814_400), (LLAMA_7B, 6_738_415_616),
                                              (LLAMA_8B, 8_030_261_248)])
def test_model_state_matches_zero_paper_and_deepspeed_estimators(cfg, expected_psi):
    """bf16 AdamW model state per GPU at 8 and 64 GPUs against the ZeRO paper (Rajbhandari et al.
    2020, figure 1: (2 + 2 + 12)Ψ split by stage) and DeepSpeed's own estimators.

    Paper, per GPU: DDP 16Ψ; ZeRO-1 4Ψ + 12Ψ/n; ZeRO-2 2Ψ + 14Ψ/n; ZeRO-3 and FSDP FULL_SHARD 16Ψ/n.
    The planner's (theory's partitions, with DeepSpeed's alignment to 2n elements and FSDP2's dim-0
    padding) must equal these to within that padding: 16 bytes x 2n elements for ZeRO, 16 bytes x n
    rows per parameter for FSDP. DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (no offload)
    is 2Ψ + 18Ψ/n: it also counts a 4-byte fp32 gradient partition (its comment: "2_grads_16bit +
    4_grads_32bit + 4_params_32bit + 8_optimizer_states"), so estimator - paper = 4Ψ/n exactly;
    ``estimate_zero3_model_states_mem_needs`` is 18Ψ/n + 4 x the largest layer (the gathered
    layer), so estimator - paper = 2Ψ/n + 4 x largest layer. The largest layer of a Llama is the
    embedding (vocab x width). Bug caught: a planner counting fp32 weights (4Ψ) under bf16, or
    forgetting the master copy (K = 8 instead of 12): each moves the total by Ψ/n or more, far past
    the padding slack."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p = psi(cfg)
    assert p == expected_psi
    plan = planner.Plan(cfg, global_batch=64)
    for n in (8, 64):
        cl = planner.cluster("h100", n)
        state = {}
        for name in ("ddp", "zero1", "zero2", "zero3", "fsdp_full_shard"):
            est = planner.estimate(plan, cl, name)
            state[name] = sum(est.memory_bytes[k] for k in ("params", "grads", "optimizer"))
        paper = {stage: sum(theory.zero_paper_bytes(p, n, stage).values()) for stage in range(4)}
        zero_slack = 16 * 2 * n
        assert state["ddp"] == 16 * p
        for stage in (1, 2, 3):
            assert abs(state[f"zero{stage}"] - paper[stage]) <= zero_slack, (stage, n)
        fsdp_slack = 16 * n * sum(math.prod(s[1:]) for s in theory.param_shapes(cfg).values())
        assert abs(state["fsdp_full_shard"] - paper[3]) <= fsdp_slack
        assert abs(state["fsdp_full_shard"] - paper[3]) / paper[3] < 1e-3
        _, ds2 = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=min(n, 8), num_nodes=max(1, n // 8),
                                                       cpu_offload=False)
        assert ds2 - paper[2] == pytest.approx(4 * p / n, abs=2)
        largest = cfg.vocab_size * cfg.n_embd
        _, ds3, _ = estimate_zero3_model_states_mem_needs(p, largest, num_gpus_per_node=min(n, 8),
                                                          num_nodes=max(1, n // 8), cpu_offload=False,
                                                          cpu_offload_params=False)
        assert ds3 - paper[3] == pytest.approx(2 * p / n + 4 * largest, abs=2)


def test_fp32_state_is_theory_and_precision_conversion():
    """fp32 AdamW state is theory's own count to the byte (4 + 4 + 8 per element held; DeepSpeed 12
    for its master partition); bf16 halves weights and gradients and keeps 12 bytes per optimizer
    element; SGD keeps one momentum (+ the master in bf16). Bug caught: the conversion applied
    twice or to the wrong part."""
    cfg = model_config("gpt", "small")
    p = psi(cfg)
    cl = planner.cluster("h100", 4)
    fp32 = planner.Plan(cfg, global_batch=8, precision="fp32")
    ddp = planner.estimate(fp32, cl, "ddp").memory_bytes
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (4 * p, 4 * p, 8 * p)
    z3 = planner.estimate(fp32, cl, "zero3").memory_bytes
    want = predictors.predict("zero3", cfg, 4, 8)["state_per_rank"][0]
    assert (z3["params"], z3["grads"], z3["optimizer"]) == (want["params"], want["grads"], want["optimizer"])
    sgd = planner.estimate(replace(fp32, precision="bf16", optimizer="sgd"), cl, "ddp").memory_bytes
    assert (sgd["params"], sgd["grads"], sgd["optimizer"]) == (2 * p, 2 * p, 8 * p)


# ---------------------------------------------------------------- fits: the boundary


def test_fits_flips_at_the_computed_boundary():
    """DDP of the Llama-3.2-1B shape, bf16 AdamW, micro-batch 1 of 2048 tokens, full AC. Worked out
    by hand: its peak is at the top of backward, before any gradient exists: weights 2Ψ + optimizer
    12Ψ + activations (16 block inputs, 2048 x 2048 x 2 B each = 128 MiB) + temporaries (DDP's
    gradient buckets 2Ψ and the LM head's working set 2048 x (12 x 128256 + 4 x 2048) B = 3.17 GB:
    bf16 logits and their gradient, fp32 log-probabilities and their gradient, two width-sized
    gradients). That is 16Ψ + 3.3 GB = 23.1 GB, more than the end of backward (18Ψ = 22.2 GB).
    With usable memory exactly that peak it fits; one byte less and it does not. Bug caught: a
    comparison against the raw memory instead of the usable fraction, a part left out, or the
    gradients counted at the top of backward (the total would grow by 2Ψ and the flip would move).
    On a GPU the flip is where the caching allocator's peak meets the usable memory: the state and
    DDP's buckets (allocated once) at their size, the activations and the head's working set (made
    and freed each step) times the reserve r."""
    cfg = LLAMA_1B
    p = psi(cfg)
    plan = planner.Plan(cfg, global_batch=8, ac="full")
    probe = planner.estimate(plan, planner.cluster("h100", 8), "ddp")
    act = 16 * 2048 * 2048 * 2
    head = 2048 * (12 * 128256 + 4 * 2048)
    peak = 2 * p + 12 * p + act + 2 * p + head
    assert probe.memory_bytes["activations"] == act
    assert probe.memory_bytes["temporaries"] == 2 * p + head
    assert probe.memory_bytes["peak"] == peak
    assert probe.memory_bytes["total"] == peak + 2 * p
    reserved = 2 * p + 12 * p + 2 * p + planner.FITTED_RESERVE * (act + head)
    assert probe.memory_bytes["reserved"] == pytest.approx(reserved, rel=1e-12)
    for cores, flip in ((None, reserved), (2, peak)):  # a GPU; CPU ranks (no caching allocator)
        gpu = replace(planner.GPUS["h100"], memory_bytes=math.ceil(flip))
        assert planner.estimate(plan, planner.Cluster(gpu, 8, 8, usable_memory=1.0, cores=cores), "ddp").fits
        gpu = replace(gpu, memory_bytes=math.ceil(flip) - 1)
        assert not planner.estimate(plan, planner.Cluster(gpu, 8, 8, usable_memory=1.0, cores=cores), "ddp").fits


# ---------------------------------------------------------------- recommendations worked by hand


def test_recommendation_small_model_fits_ddp():
    """A 1B model (Llama-3.2-1B shape) on 8 H100s, bf16: DDP needs 16Ψ + 2Ψ of buckets = 22.2 GB
    + about 3 GB of activations, far below 71 GiB usable, and of all data-parallel strategies it
    moves the fewest bytes with all of them hidden under backward; so every fitting strategy has the
    same compute and DDP or one of the equally-fast shardings wins, and no model-parallel layout
    (bubble, TP all-reduces on the critical path) is picked. By hand: the compute per GPU is
    (128 x 2048 / 8) tokens x 6.8e9 FLOPs/token... the same for all, so the winner is a
    data-parallel strategy and the pipelines are slower by their bubble. Bug caught: a planner that
    charges communication twice, or picks the smallest memory instead of the fastest."""
    plan = planner.Plan(LLAMA_1B, global_batch=128)
    cl = planner.cluster("h100", 8)
    estimates = planner.estimate_all(plan, cl)
    rec = planner.recommend(estimates, cl)
    assert rec.best is not None and rec.best.name in ("ddp", "zero1", "zero2", "fsdp_shard_grad_op")
    by = {e.name: e for e in estimates}
    assert by["ddp"].fits
    assert by["pp_1f1b"].step_time_s > rec.best.step_time_s
    assert "bubble" in rec.reasons["pp_gpipe"]


def test_recommendation_8b_on_8_gpus_excludes_ddp_and_offload():
    """An 8B model (Llama-3.1-8B shape) on 8 H100s (71.3 GiB usable), bf16 AdamW: DDP needs 16Ψ =
    128.5 GB of model state alone: does not fit (reason names the GiB). ZeRO-3 offload fits but is
    not picked without --offload; with nothing fitting on the GPU (a 16 GiB GPU) and --offload, the
    offload configuration is the answer. Bug caught: a recommendation that ignores the capacity or
    the offload permission."""
    plan = planner.Plan(LLAMA_8B, global_batch=64, ac="full")
    cl = planner.cluster("h100", 8)
    estimates = planner.estimate_all(plan, cl)
    rec = planner.recommend(estimates, cl)
    assert rec.best is not None and rec.best.name not in ("ddp", "zero3_offload")
    assert rec.reasons["ddp"].startswith("does not fit: 1")
    assert "offload" in rec.reasons["zero3_offload"]
    small = planner.override_cluster(cl, memory_gib=16)
    estimates = planner.estimate_all(plan, small)
    assert planner.recommend(estimates, small).best is None
    assert planner.recommend(estimates, small, allow_offload=True).best.name == "zero3_offload"


def test_an_overridden_gpu_is_labelled_as_what_it_is():
    """``--gpu h100 --gpu-memory-gib 24`` plans a 24 GiB GPU with the H100's other figures: the header
    and the JSON say so, instead of "H100 SXM 80GB" (seen failing before the label was fixed); the
    table's own H100, with nothing overridden, keeps its name. Overridden speeds are named too."""
    h100 = planner.cluster("h100", 8)
    assert h100.gpu.name == "H100 SXM 80GB" and planner.override_cluster(h100).gpu.name == h100.gpu.name
    small = planner.override_cluster(h100, memory_gib=24)
    assert small.gpu.name == "24 GiB GPU (H100 SXM 80GB's other figures)" and small.gpu.memory_bytes == 24 * 2**30
    fast = planner.override_cluster(h100, peak_tflops=500, inter_bw_gbps=50)
    assert fast.gpu.name == "H100 SXM 80GB, peak FLOP/s and inter-node link as given"
    done = python(BENCH / "plan.py", "--gpus", "8", "--gpu-memory-gib", "24", "--json", check=False)
    assert json.loads(done.stdout[done.stdout.index("{"):])["cluster"]["gpu"] == small.gpu.name


def test_a_halved_micro_batch_is_said():
    """A micro-batch that does not split the per-rank batch (3 of 64) or does not fit is halved by the
    planner; the report says which micro-batches the layouts use instead of printing the asked one
    alone. Negative control: a micro-batch every layout keeps (1) gets no such line."""
    cl = planner.cluster("h100", 8)
    for micro, said in ((3, True), (1, False)):
        plan = planner.Plan(LLAMA_8B, global_batch=512, micro_batch=micro)
        estimates = planner.estimate_all(plan, cl)
        text = planner.format_report(plan, cl, estimates, planner.recommend(estimates, cl))
        used = {e.layout["micro_batch"] for e in estimates if e.valid}
        assert (f"micro-batch {micro} was asked" in text) == said == (used != {micro}), text


def test_a_derived_batch_splits_over_the_gpus_and_nothing_fitting_exits_1():
    """``--gpus 3`` without a batch: the planner's own batch (2^20 tokens of 2,048 = 512 sequences)
    is rounded up to 513 so that it splits over 3 GPUs, and it says so; a strategy is recommended.
    An explicit ``--global-batch 512`` is kept as given (the negative control: nothing can split it,
    every strategy says why) and the exit code is 1, not 0."""
    derived = python(BENCH / "plan.py", "--gpus", "3", check=False)
    assert derived.returncode == 0, derived.stdout[-2000:]
    assert "global batch 513 sequences: 1,048,576 tokens of 2048 make 512, rounded up to split over 3 GPUs" \
        in derived.stdout and re.search(r"^recommended: \w+ \(dp=3 ", derived.stdout, re.M), derived.stdout[-2000:]
    given = python(BENCH / "plan.py", "--gpus", "3", "--global-batch", "512", check=False)
    assert given.returncode == 1 and "rounded" not in given.stdout, given.stdout[-2000:]
    assert "recommended: none" in given.stdout and "global batch 512 does not split over 3" in given.stdout


def test_context_parallel_fits_the_long_sequence_nothing_else_fits():
    """Llama-3.2-1B at 65,536 tokens per sequence on 8 H100s (71.3 GiB usable), bf16, full AC, 16
    sequences: every rank of DDP, ZeRO and FSDP holds whole sequences, and the LM head's working set
    of one, 65,536 x (12 x 128,256 + 4 x 2,048) bytes = 94.4 GiB, does not fit anywhere. Context
    parallelism splits each sequence over cp ranks; by hand at cp = 4 (16,384 tokens per rank):
    model state 16 x 1,235,814,400 bytes (DDP's, every rank a replica), activations 16 layers x
    16,384 x 2,048 x 2 bytes (full AC keeps the block input) = 1 GiB, temporaries the head's 16,384 x
    1,547,264 bytes = 23.6 GiB; the caching allocator reserves the state and r times the rest, which
    fits 71.3 GiB. At cp = 2 the tensors would fit (67.6 GiB) but the allocator's peak would not, so
    cp = 4 is the smallest ring that fits, and it is recommended: TP over 2 GPUs splits the head too,
    but its allocator peak (86 GiB) does not fit either. Among the strategy rows (the N-D search,
    which adds FSDP over the ring, is left out here); the N-D layout that fits splits the sequence
    too (cp > 1). Bugs caught: CP's activations or head not divided by cp, its state sharded as if
    CP were FSDP, or the fit decided on the tensors alone."""
    cfg = replace(LLAMA_1B, seq_len=65536)
    plan = planner.Plan(cfg, global_batch=16, ac="full")
    cl = planner.cluster("h100", 8)
    estimates = {e.name: e for e in planner.estimate_all(plan, cl, PLANNED)}
    nd = planner.estimate(plan, cl, "nd")
    assert nd.fits and nd.layout["cp"] > 1, nd.layout
    cp = estimates["cp"]
    assert cp.layout["cp"] == 4 and cp.layout["dp"] == 2 and cp.fits
    p = psi(cfg)
    r = planner.FITTED_RESERVE

    def by_hand(ring: int) -> tuple[float, float]:
        tokens = 65536 // ring
        state, act, temp = 16 * p, 16 * tokens * 2048 * 2, tokens * (12 * 128256 + 4 * 2048)
        return state + act + temp, state + r * (act + temp)
    assert (cp.memory_bytes["params"], cp.memory_bytes["grads"], cp.memory_bytes["optimizer"]) == (2 * p, 2 * p, 12 * p)
    assert cp.memory_bytes["activations"] == 16 * 16384 * 2048 * 2
    assert cp.memory_bytes["temporaries"] == 16384 * (12 * 128256 + 4 * 2048)
    assert cp.memory_bytes["reserved"] == pytest.approx(by_hand(4)[1], rel=1e-12)
    assert cp.memory_bytes["reserved"] <= cl.capacity_bytes
    tensors, reserved = by_hand(2)
    assert tensors <= cl.capacity_bytes < reserved  # cp = 2: the tensors fit, the allocator's peak does not
    ddp = estimates["ddp"].memory_bytes
    assert ddp["activations"] == 4 * cp.memory_bytes["activations"] and not estimates["ddp"].fits
    for name in ("ddp", "zero3", "fsdp_full_shard", "pp_1f1b", "fsdp_tp"):
        assert not estimates[name].fits, name
    assert planner.recommend(list(estimates.values()), cl).best.name == "cp"


def test_expert_parallel_needs_an_moe_and_splits_its_experts(monkeypatch):
    """The small GPT (width 128, 4 blocks) with 8 experts top-2 on 8 H100s, bf16: by hand an expert is
    4 x (128 x 512 + 512 + 512 x 128 + 128) = 526,848 parameters over the blocks and the dense part
    (attention, norms, 4 routers of 8 x 128, embeddings, head) 344,320. Expert parallelism over ep
    GPUs holds the dense part and 8 / ep experts at 16 bytes each (bf16 AdamW); DDP on the same MoE
    holds all 8. Each token's active experts are 2 (FLOPs), so the compute is that of 2 MLPs, not 8
    (at the large-matrix rate: the size of this model's GEMMs, which differs between the layouts, is
    :func:`test_a_gemms_time_is_the_roofline_and_a_latency_from_xlas_h100_table`'s).
    For the dense GPT, ep cannot run: "needs an MoE model (--experts)". Bugs caught: experts
    replicated under ep, or counted at 1/ep also under DDP; all experts' FLOPs charged."""
    from distkit.planner import costs
    monkeypatch.setattr(costs, "matmul_factor", lambda *args, **kwargs: 1.0)
    dense_cfg = model_config("gpt", "small")
    cfg = with_experts(dense_cfg, 8, 2)
    expert, dense = 4 * (128 * 512 + 512 + 512 * 128 + 128), 344_320
    assert psi(cfg) == dense + 8 * expert
    plan = planner.Plan(cfg, global_batch=64)
    cl = planner.cluster("h100", 8)
    ep = planner.estimate(plan, cl, "ep")
    assert ep.valid and ep.layout["ep"] in (2, 4, 8) and ep.layout["dp"] == 8 // ep.layout["ep"]
    state = sum(ep.memory_bytes[k] for k in ("params", "grads", "optimizer"))
    assert state == 16 * (dense + 8 // ep.layout["ep"] * expert)
    ddp = planner.estimate(plan, cl, "ddp")
    assert sum(ddp.memory_bytes[k] for k in ("params", "grads", "optimizer")) == 16 * (dense + 8 * expert)
    assert ep.times["compute_s"] == pytest.approx(ddp.times["compute_s"])  # the same active FLOPs
    dense_compute = planner.estimate(planner.Plan(dense_cfg, global_batch=64), cl, "ddp").times["compute_s"]
    extra = theory.training_flops_per_token(cfg) - theory.training_flops_per_token(dense_cfg)
    assert extra == 6 * (4 * 8 * 128 + 4 * 131_712)  # per block a router and a second active MLP
    assert ep.times["compute_s"] / dense_compute == pytest.approx(
        theory.training_flops_per_token(cfg) / theory.training_flops_per_token(dense_cfg))
    assert ep.times["exposed_comm_s"] > 0  # the all-to-alls sit on the critical path
    no_moe = planner.estimate(planner.Plan(dense_cfg, global_batch=64), cl, "ep")
    assert not no_moe.valid and no_moe.note == "needs an MoE model (--experts)"


# ---------------------------------------------------------------- ties within the planner's error


# the benchmarks README's first example: Llama 3.1 8B on 8 H100s, 8k sequences, selective AC
TIED = ["--model", "llama-3.1-8b", "--seq-len", "8192", "--global-batch", "16", "--micro-batch", "2",
        "--activation-checkpointing", "selective", "--gpus", "8", "--gpu", "h100"]
# the strategy rows only, on a slow network (a 40 Gb/s port per GPU): the N-D search finds a layout
# within 12% of the pipeline here (a tie)
CLEAR = ["--model", "llama-3.1-70b", "--gpus", "64", "--seq-len", "2048", "--activation-checkpointing", "full",
         "--inter-bw-gbps", "5", "--strategies", *PLANNED]


NOT_THE_TIE_PICK = "the recommendation is not the tie rule's pick"


def check_tie(plan, argv: list[str], capsys) -> dict:
    """What the report and the JSON say about a tie, checked against the estimates: a tie is said
    exactly when another eligible configuration is predicted within 20% (the step time's median
    error bound) of the fastest; the pick is then the simplest family among them (DDP < ZeRO/FSDP <
    TP < PP < CP < N-D), its fastest member; JSON and table agree. Returns the JSON's tie (or None)."""
    plan_main(plan, [*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    plan_main(plan, argv)
    text = capsys.readouterr().out
    order = {"ddp": 0, "fsdp_tp": 2, "ep": 2, "cp": 4, "nd": 5}
    rank = {s["name"]: order.get(s["name"], 3 if s["name"].startswith("pp_") else 1) for s in out["strategies"]}
    eligible = {s["name"]: s["step_time_s"] for s in out["strategies"] if s["valid"] and s["fits"]
                and s["name"] not in ("lora_fsdp", "zero3_offload")}
    fastest = min(eligible, key=eligible.get)
    within = {n for n, t in eligible.items() if t <= 1.2 * eligible[fastest]}
    picked = min((n for n in eligible if n in within), key=lambda n: (rank[n], eligible[n]))  # the first of equals
    assert out["recommended"] == picked and f"recommended: {picked} (" in text, \
        f"{NOT_THE_TIE_PICK}: {out['recommended']} recommended, the rule picks {picked}"
    if len(within) == 1:
        assert out["tie"] is None and "tie:" not in text
        return None
    tie = out["tie"]
    assert tie["fastest"] == fastest and set(tie["within"]) == within and tie["picked"] == picked
    assert tie["bound"] == planner.STEP_MEDIAN_ERROR == 0.20
    line = next(ln for ln in text.splitlines() if ln.startswith("tie: "))
    assert f"within 20% of the fastest, {fastest} (the planner's median step-time error" in line
    assert f"  why: {tie['reason']}" in text.splitlines()
    return tie


def plan_with_tie_bound(bound: float):
    """plan.py whose planner recommends with another tie bound (a broken variant for the controls)."""
    broken = load_script(BENCH / "plan.py")
    broken.planner = type(planner)("planner_with_another_bound")
    broken.planner.__dict__.update(planner.__dict__)
    broken.planner.recommend = lambda *a, **k: planner.recommend(*a, **{**k, "tie_bound": bound})
    return broken


def test_a_tie_within_the_error_picks_the_simpler(capsys):
    """Llama 3.1 8B on 8 H100s with 8k sequences (the benchmarks README's first example): the best N-D
    layout (FSDP over a CP ring of 2) is the fastest by 0.14%, FSDP FULL_SHARD, ZeRO-3 and TP x FSDP
    within 4% of it, far inside the planner's 20% median error, so the report says it is a tie and
    picks FSDP FULL_SHARD (ZeRO/FSDP before TP and N-D), with the reason in one line; the JSON carries
    the same. Negative control: the planner with no error bound (``tie_bound=0``) recommends the N-D
    layout and the check fails on it."""
    plan = load_script(BENCH / "plan.py")
    tie = check_tie(plan, TIED, capsys)
    assert tie["fastest"] == "nd" and tie["picked"] == "fsdp_full_shard" and "fsdp_tp" in tie["within"]
    assert tie["reason"].startswith("fsdp_full_shard (ZeRO/FSDP) before nd (N-D), 0.1")
    assert "every layer stays whole" in tie["reason"]
    with pytest.raises(AssertionError, match=NOT_THE_TIE_PICK):
        check_tie(plan_with_tie_bound(0), TIED, capsys)


def test_a_clear_win_says_no_tie(capsys):
    """A 70B Llama on 64 H100s whose nodes are joined by a slow network (5 GB/s per GPU), 2k
    sequences, full AC, among the strategy rows: the 1F1B pipeline, which sends only activations
    between nodes, is predicted 2.4x faster than anything else that fits (FSDP gathers every
    layer's weights across them), far outside the error: it is recommended and
    no tie is said. Negative control: an error bound of 300% (a broken bound) calls it a tie and picks
    FSDP, and the check fails."""
    plan = load_script(BENCH / "plan.py")
    assert check_tie(plan, CLEAR, capsys) is None
    plan_main(plan, [*CLEAR, "--json"])
    assert json.loads(capsys.readouterr().out)["recommended"] == "pp_1f1b"
    with pytest.raises(AssertionError, match=NOT_THE_TIE_PICK):
        check_tie(plan_with_tie_bound(3.0), CLEAR, capsys)


# ---------------------------------------------------------------- the guide's decision matrix


MATRIX_ROWS = {"GPT-2 1.5B": (model_config("gpt", "small", vocab_size=50257, seq_len=1024, n_layer=48, n_embd=1600,
                                           n_head=25), 4, False),
               "LLaMA-7B": (replace(LLAMA_7B, seq_len=2048), 8, False),
               "LLaMA-70B": (model_config("llama", "llama-3.1-70b"), 64, False),
               "LLM fine-tuning (Llama 3.1 8B)": (LLAMA_8B, 8, True)}


NOT_THE_PLANNERS_PICK = "the printed pick, step and memory are not the planner's for the stated job"


def check_matrix_picks(text: str) -> None:
    """Every expressible row of the printed matrix names the pick, step and memory the planner gives
    when called directly on the job the header states (H100s, bf16 AdamW, full AC, 2^20 tokens per
    step rounded up to split over the GPUs): its recommendation, or for the LoRA row its LoRA
    estimate; ResNet-50 is said to be not expressible."""
    rows = {line[:31].strip(): line[31:].split() for line in text.splitlines()[3:9] if line.strip()}
    assert rows["ResNet-50"][2:4] == ["not", "expressible"]
    for name, (cfg, gpus, lora) in MATRIX_ROWS.items():
        batch = math.ceil(round(2 ** 20 / cfg.seq_len) / gpus) * gpus
        cl = planner.cluster("h100", gpus)
        estimates = planner.estimate_all(planner.Plan(cfg, global_batch=batch, ac="full"), cl)
        pick = next(e for e in estimates if e.lora) if lora else planner.recommend(estimates, cl).best
        assert rows[name][0] == str(gpus) and rows[name][1] == f"{psi(cfg) / 1e9:.2f}B", name
        assert rows[name][2:7] == [pick.name, f"{pick.step_time_s:.2f}", "s", f"{pick.memory_bytes['peak'] / GiB:.1f}",
                                   "GiB"], f"{name}: {NOT_THE_PLANNERS_PICK}: {rows[name]}"


def test_the_decision_matrix_picks_are_the_planners(capsys, monkeypatch):
    """``plan.py --decision-matrix``: each row's pick is the planner's own answer for that job; the rows
    that disagree with the guide get a line, the 3-D row is the planner's best N-D layout (with three
    axes or more), and
    ResNet-50 is not expressible. Negative control: rows planned with selective instead of full
    activation checkpointing (a matrix that plans another job than the one its header states) fail the
    check."""
    plan = load_script(BENCH / "plan.py")
    plan.main(["--decision-matrix"])
    text = capsys.readouterr().out
    check_matrix_picks(text)
    assert "LLaMA-70B: the guide's 3D (TP x PP x DP) as nd: fits" in text and "ResNet-50: not expressible" in text
    check_matrix_verdicts(text)

    monkeypatch.setattr(planner.decision, "AC", "selective")
    plan.main(["--decision-matrix"])
    with pytest.raises(AssertionError, match=NOT_THE_PLANNERS_PICK):
        check_matrix_picks(capsys.readouterr().out)
    # the verdict's control: a matrix that forgets ties (verdict's tie branch removed) says "no" where
    # a guide strategy fits within the planner's error
    monkeypatch.undo()
    source = inspect.getsource(planner.decision.verdict)
    namespace = dict(vars(planner.decision))
    exec(compile(mutate(source, "    if rec.tie and", "    if False and", "verdict"), "decision.py", "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    monkeypatch.setattr(planner.decision, "verdict", namespace["verdict"])
    plan.main(["--decision-matrix"])
    with pytest.raises(AssertionError, match=NOT_THE_VERDICT):
        check_matrix_verdicts(capsys.readouterr().out)


NOT_THE_VERDICT = "the agrees column is not the verdict the estimates give"


def check_matrix_verdicts(text: str) -> None:
    """Each row's agrees column is :func:`matrix_verdict`'s, and a row that disagrees or ties says why."""
    for row in planner.decision.ROWS:
        agrees = row.name + " " * (31 - len(row.name))
        line = next(ln for ln in text.splitlines() if ln.startswith(agrees))
        if line.endswith((" no", " tie")):
            assert f"  {row.name}: " in text, row.name
        if line.endswith((" yes", " no", " tie")) and row.model is not None:
            assert line.split()[-1] == matrix_verdict(row), f"{row.name}: {NOT_THE_VERDICT}: {line}"


def matrix_verdict(row) -> str:
    """The agrees column, recomputed from the estimates: ``yes`` when the row's pick is the guide's
    strategy, ``tie`` when a guide strategy fits within 20% (the planner's step-time error) of the
    fastest fitting configuration the recommendation considered, ``no`` otherwise."""
    plan, cl = planner.decision.plan_of_row(row), planner.cluster("h100", row.gpus)
    estimates = planner.estimate_all(plan, cl)
    pick = next(e for e in estimates if e.lora) if row.lora else planner.recommend(estimates, cl).best
    if pick.name in row.agrees:
        return "yes"
    pool = [e for e in estimates if e.valid and e.fits and not e.lora and not e.offload]
    fastest = min(e.step_time_s for e in pool)
    return "tie" if any(e.name in row.agrees and e.step_time_s <= 1.2 * fastest for e in pool) else "no"


# ---------------------------------------------------------------- the CLI


def test_cli_json_schema(capsys):
    """``plan.py --json`` prints per strategy ``name``, ``fits``, ``memory_bytes`` with the five parts
    (and their total, the tensors' peak and the caching allocator's, above it and below the
    reserve factor times it), ``step_time_s``, ``tokens_per_s_per_gpu``; the recommendation is one of them
    and the table view of the same input names it."""
    plan = load_script(BENCH / "plan.py")
    argv = ["--model", "llama-3.2-1b", "--gpus", "4", "--gpu", "l4", "--global-batch", "16",
            "--activation-checkpointing", "full"]
    plan.main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    names = [s["name"] for s in out["strategies"]]
    assert names == list(planner.SEARCHED)  # every strategy, then the best N-D layout
    for s in out["strategies"]:
        assert {"name", "fits", "memory_bytes", "step_time_s", "tokens_per_s_per_gpu"} <= set(s)
        if s["valid"]:
            parts = s["memory_bytes"]
            assert set(parts) == {*planner.PARTS, "total", "peak", "reserved"}
            assert parts["total"] == pytest.approx(sum(parts[p] for p in planner.PARTS))
            assert parts["peak"] < parts["reserved"] < planner.FITTED_RESERVE * parts["peak"]  # a GPU
            assert s["tokens_per_s_per_gpu"] == pytest.approx(16 * 2048 / 4 / s["step_time_s"])
    assert out["recommended"] in names
    plan.main(argv)
    assert f"recommended: {out['recommended']}" in capsys.readouterr().out


def plan_main(plan, argv: list[str]) -> None:
    """plan.py's main in this process; a plan where nothing fits exits 1 after its report."""
    try:
        plan.main(argv)
    except SystemExit as exc:
        assert exc.code == 1, exc.code


def test_cli_experts_make_a_mixture_of_experts(capsys):
    """``--experts 8 --top-k 2`` on the Llama-3.1-8B shape (Mixtral's layout): every block's SwiGLU
    MLP becomes 8 of itself. By hand: one MLP is 3 x 4,096 x 14,336 = 176,160,768 parameters and a
    router 8 x 4,096, so the model has 8,030,261,248 + 32 x (7 x 176,160,768 + 32,768) =
    47,491,321,856 parameters, 13,668,454,400 of them active (the dense part and 2 experts per
    block); the ep strategy runs and is described by its layout."""
    plan = load_script(BENCH / "plan.py")
    plan_main(plan, ["--model", "llama-3.1-8b", "--experts", "8", "--top-k", "2", "--gpus", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["model"]["arch"] == "llama_moe" and out["plan"]["model"]["num_experts"] == 8
    mlp = 3 * 4096 * 14336
    total = 8_030_261_248 + 32 * (7 * mlp + 8 * 4096)
    cfg = with_experts(LLAMA_8B, 8, 2)
    assert psi(cfg) == total == 47_491_321_856
    plan_main(plan, ["--model", "llama-3.1-8b", "--experts", "8", "--top-k", "2", "--gpus", "64", "--strategies", "ep"])
    printed = capsys.readouterr().out
    active = total - 6 * 32 * mlp  # 6 of the 8 experts idle for a token
    assert f"{total / 1e9:.2f}B params" in printed and f"8 experts top-2: {active / 1e9:.2f}B active" in printed
    assert re.search(r"^ep +dp=\d+ ep=\d+ ", printed, re.M), printed
    by_name = {s["name"]: s for s in out["strategies"]}
    assert by_name["ep"]["valid"] and by_name["ep"]["layout"]["ep"] >= 2


def test_cli_plot(tmp_path):
    plan = load_script(BENCH / "plan.py")
    path = tmp_path / "plan.png"
    plan.main(["--model", "gpt-small", "--gpus", "2", "--global-batch", "8", "--plot", str(path), "--json"])
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize("args,expected", [
    (["--gpus", "0"], "argument --gpus: must be a positive integer"),
    (["--gpu", "tpu"], "argument --gpu: invalid choice"),
    (["--usable-memory", "1.5"], "--usable-memory: must be at most 1"),
    (["--gpu", "cpu"], "--gpu cpu needs --calibrate"),
    (["--kv-heads", "4", "--model", "gpt-small"], "--kv-heads and --intermediate-size describe a Llama"),
    (["--gpu", "cpu", "--calibrate", "/nonexistent.jsonl"], "no records file /nonexistent.jsonl"),
    (["--validate", str(BENCH / "README.md")], "is not a file of JSON records"),
    (["--top-k", "2"], "--top-k routes tokens to experts: give --experts N too"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3 is larger than --experts 2"),
    (["--experts", "0"], "argument --experts: must be a positive integer, got 0"),
    (["--layout", "tp=3"], "tp=3 does not divide 32 heads / 8 kv-heads; tp that do: 1, 2, 4, 8"),
    (["--layout", "dp_shard=2,tp=2"], "uses 4 GPUs, not the 8 of the job (the axes multiply); dp_shard=4 would"),
    (["--layout", "pp=64", "--gpus", "64", "--global-batch", "64"], "pp=64 x 1 chunk(s) needs at least 64 blocks"),
    (["--layout", "cp=8", "--seq-len", "40"], "cp=8 does not cut 40 tokens into 2 x cp chunks; cp that do: 2"),
    (["--layout", "tp=8", "--strategies", "ddp"], "--layout pins one layout"),
    (["--layout", "tq=2"], "'tq=2' is not AXIS=N"),
])
def test_cli_bad_input_is_one_line(args, expected):
    """Bad flags end in one ``error:`` line and exit 2: argparse's own, or a ``UsageError`` raised by
    the planner that ``run_main`` prints. Run in this process (the same code path as the script:
    nothing before them starts a process or touches a tensor)."""
    plan = load_script(BENCH / "plan.py")
    result = parse_args_result(plan, *args)
    if result.returncode == 0:  # the flags parse: main raises the UsageError run_main prints as one line
        with pytest.raises(UsageError, match=re.escape(expected)):
            plan.main(args)
        return
    assert result.returncode == 2
    assert_one_line_error(result, expected)


def test_cli_bad_input_as_a_script():
    """End to end, once: the script started as a process turns the planner's UsageError into one
    ``error:`` line and exit 2 (``run_main``)."""
    result = python(BENCH / "plan.py", "--kv-heads", "4", "--model", "gpt-small", check=False)
    assert result.returncode == 2
    assert_one_line_error(result, "--kv-heads and --intermediate-size describe a Llama")


# ---------------------------------------------------------------- inputs the planner cannot plan


REFUSED = [
    (["--seq-len", "10"], "--seq-len 10 is below the planner's floor of 32 tokens"),
    (["--gpus", "1024"], "--gpus 1024 is beyond the planner's 512 GPUs"),
    (["--global-batch", "100000"], "--global-batch 100,000 is more than the planner's 65,536 sequences per step"),
    (["--global-batch-tokens", "1000000000"], "1,000,000,000 tokens of 2048 make 488,281 sequences per step, more"),
    (["--model", "llama-3.2-1b", "--gpus", "512", "--seq-len", "2048", "--global-batch-tokens", "4096"],
     "the global batch 2 is fewer than the 4 batch ranks (dp_replicate x dp_shard) of every layout on 512 GPUs"),
]


def assert_refused_with_a_fix(plan, args: list[str], expected: str) -> None:
    """``args`` end in the planner's one-line UsageError containing ``expected``, and the first fix it
    names (``give --flag N``) plans: the line says what would work, and it does."""
    with pytest.raises(UsageError, match=re.escape(expected)) as refused:
        plan.main(args)
    flag, value = re.search(r"give (--[a-z-]+) ([\d,]+)", str(refused.value)).groups()
    fixed = list(args)
    if flag in fixed:
        fixed[fixed.index(flag) + 1] = value.replace(",", "")
    else:
        fixed += [flag, value.replace(",", "")]
    if flag == "--global-batch" and "--global-batch-tokens" in fixed:
        del fixed[fixed.index("--global-batch-tokens"):fixed.index("--global-batch-tokens") + 2]
    plan_main(plan, [*fixed, "--strategies", "zero3", "--json"])


@pytest.mark.parametrize("args,expected", REFUSED)
def test_inputs_the_planner_cannot_plan_are_refused_in_one_line(args, expected, capsys):
    """A sequence shorter than 32 tokens, more than 512 GPUs, more than 65,536 sequences per step (given,
    or made from tokens), or a step with fewer sequences than any layout's batch ranks: one line that
    says what would work, and what it says works. ``--seq-len 10`` used to plan 52,429 micro-batches."""
    assert_refused_with_a_fix(load_script(BENCH / "plan.py"), args, expected)


def test_a_batch_smaller_than_the_gpus_runs_where_tp_pp_cp_groups_share_sequences(capsys):
    """Only the batch ranks (dp_replicate x dp_shard) need sequences of their own: the GPUs of a TP,
    PP or CP group share theirs. 65,536 tokens of 8,192 make 8 sequences, fewer than 64 GPUs, and
    Llama 3.1 70B with ``--layout tp=8`` plans them: dp_shard takes the GPUs left, 64 / 8 = 8 batch
    ranks, 8 / 8 = 1 sequence each, no accumulation. The search plans them too: every layout it
    finds valid has batch ranks dividing 8, so no data-parallel-only row (64 ranks) runs. Negative
    control: ``--layout dp_shard=64`` (64 batch ranks for 8 sequences) is refused in one line naming
    the batch that would run, and that batch runs; before, the 8 sequences were refused for being
    fewer than the GPUs, whatever the layout."""
    plan = load_script(BENCH / "plan.py")
    job = ["--model", "llama-3.1-70b", "--seq-len", "8192", "--global-batch-tokens", "65536", "--gpus", "64"]
    sequences, gpus, tp = 65536 // 8192, 64, 8
    plan_main(plan, [*job, "--layout", f"tp={tp}", "--json"])
    out = json.loads(capsys.readouterr().out)
    (nd,) = out["strategies"]
    assert out["plan"]["global_batch"] == sequences == 8 and nd["valid"], nd
    assert nd["layout"]["dp"] == nd["layout"]["dp_shard"] == gpus // tp == 8 and nd["layout"]["tp"] == tp, nd
    assert nd["layout"]["micro_batch"] == sequences // (gpus // tp) == 1 and nd["layout"]["accumulation"] == 1, nd
    plan_main(plan, [*job, "--json"])
    out = json.loads(capsys.readouterr().out)
    valid = [s for s in out["strategies"] if s["valid"]]
    assert valid and out["recommended"] in {s["name"] for s in valid}, out["recommended"]
    assert all(sequences % s["layout"]["dp"] == 0 for s in valid), [s["layout"] for s in valid]
    assert not any(s["valid"] for s in out["strategies"] if s["name"] in ("ddp", "zero3", "fsdp_full_shard"))
    with pytest.raises(UsageError) as refused:
        plan.main([*job, "--layout", "dp_shard=64"])
    line = str(refused.value)
    assert "\n" not in line and "the global batch 8 is fewer than dp_replicate x dp_shard = 64 batch ranks" in line
    assert "give --global-batch 64 or more" in line, line
    plan_main(plan, [*job[:-4], "--gpus", "64", "--global-batch", "64", "--layout", "dp_shard=64", "--json"])
    assert json.loads(capsys.readouterr().out)["strategies"][0]["valid"]


def test_a_batch_no_layout_can_run_is_one_error_line():
    """Llama 3.2 1B on 512 GPUs: TP divides 32 heads and 8 kv-heads and stays in a node (tp <= 8, with
    CP: tp x cp <= 8), a pipeline has at most 16 stages (16 blocks), so at most 8 x 16 = 128 GPUs
    share sequences and every layout has at least 512 / 128 = 4 batch ranks. A batch of 2 (given, or
    4,096 tokens of 2,048) is one ``error:`` line naming 4; 4 sequences plan, on a layout whose batch
    ranks are 4 (the negative control: the batch the line names is not refused)."""
    job = ["--model", "llama-3.2-1b", "--seq-len", "2048", "--gpus", "512"]
    fewest = 512 // (8 * 16)
    for batch in (["--global-batch", "2"], ["--global-batch-tokens", "4096"]):
        result = python(BENCH / "plan.py", *job, *batch, check=False)
        assert result.returncode == 2, result.stdout[-2000:]
        assert_one_line_error(result, f"the global batch 2 is fewer than the {fewest} batch ranks")
        assert f"give --global-batch {fewest} or more" in result.stdout, result.stdout[-2000:]
    cfg = model_config("llama", "llama-3.2-1b", seq_len=2048)
    assert planner.fewest_batch_ranks(planner.Plan(cfg, global_batch=2), planner.cluster("h100", 512)) == fewest
    fixed = python(BENCH / "plan.py", *job, "--global-batch", str(fewest), "--json", check=False)
    out = json.loads(fixed.stdout[fixed.stdout.index("{"):])
    best = next(s for s in out["strategies"] if s["name"] == out["recommended"])
    assert best["layout"]["dp"] == fewest, best["layout"]


def test_a_refused_input_is_one_line_without_usage_as_a_script():
    """End to end: the line, exit 2, and no usage block."""
    result = python(BENCH / "plan.py", "--seq-len", "10", check=False)
    assert result.returncode == 2 and "usage:" not in result.stdout
    assert_one_line_error(result, "--seq-len 10 is below the planner's floor of 32 tokens")


def test_negative_control_without_the_floor_seq_len_10_plans(monkeypatch, capsys):
    """The floor removed (a broken variant), ``--seq-len 10 --global-batch 64`` plans 64 sequences of
    10 tokens and the check above fails on it; with the floor it is refused. The limits at their
    edges (32 tokens; 512 GPUs and 65,536 sequences) plan."""
    plan = load_script(BENCH / "plan.py")
    short = (["--seq-len", "10", "--global-batch", "64"], "--seq-len 10 is below the planner's floor of 32 tokens")
    assert_refused_with_a_fix(plan, *short)
    monkeypatch.setattr(planner.inputs, "MIN_SEQ_LEN", 1)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        assert_refused_with_a_fix(plan, *short)
    monkeypatch.undo()
    capsys.readouterr()
    for edge in (["--seq-len", "32"], ["--gpus", "512", "--global-batch", "65536"]):
        plan_main(plan, [*edge, "--strategies", "zero3", "--json"])
        assert json.loads(capsys.readouterr().out)["strategies"][0]["valid"]


# ---------------------------------------------------------------- presets and Hugging Face configs


@pytest.mark.parametrize("name,published", [("llama-3.2-3b", 3.21e9), ("llama-3.1-70b", 70.6e9),
                                            ("llama-3.1-405b", 405e9)])
def test_llama_3_presets_have_their_published_size(name, published):
    """The named shapes beside llama-3.2-1b and llama-3.1-8b (Meta's model cards: 3.21B, 70.6B, 405B)
    are ``--model`` choices and count their published parameters within 1%."""
    assert name in load_script(BENCH / "plan.py").MODELS
    assert abs(psi(model_config("llama", name)) / published - 1) < 0.01


# config.json values of three released models (their Hugging Face repositories), and the parameter
# counts their model cards publish: Llama-3.1-8B 8.03B, Qwen2.5-7B 7.61B, Mixtral-8x7B 46.7B
HF_CONFIGS = {
    "Llama-3.1-8B": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                      "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0,
                      "max_position_embeddings": 131072, "rms_norm_eps": 1e-05}, 8.03e9),
    "Qwen2.5-7B": ({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                    "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06}, 7.61e9),
    "Mixtral-8x7B": ({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "head_dim": 128,
                      "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                      "rms_norm_eps": 1e-05}, 46.7e9),
}


def count_hf_params(c: dict) -> int:
    """Parameters of a config.json's model, counted here from its fields: per block q and o (width^2
    each), k and v (width x key/value width), Qwen2's q/k/v biases, the SwiGLU MLP (3 x width x
    intermediate) per expert with Mixtral's router, two RMSNorms; the embedding, the head unless tied,
    the final norm."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv_width = c.get("num_key_value_heads", heads) * (h // heads)
    experts = c.get("num_local_experts", 1)
    block = 2 * h * h + 2 * h * kv_width + 3 * h * c["intermediate_size"] * experts + 2 * h
    block += (h + 2 * kv_width if c["model_type"] == "qwen2" else 0) + (experts * h if experts > 1 else 0)
    return c["num_hidden_layers"] * block + c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2) + h


def planned_params_of_hf_configs(tmp_path) -> dict:
    counts = {}
    for name, (config, _) in HF_CONFIGS.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        counts[name] = psi(planner.read_hf_config(str(path)))
    return counts


def test_hf_configs_give_their_published_parameter_counts(tmp_path, monkeypatch, capsys):
    """``--hf-config`` of Llama-3.1-8B, Qwen2.5-7B and Mixtral-8x7B (the real config.json fields,
    written to a file): the planner's parameter count is within 1% of the published one, and equals
    the count made here from the config's fields, but for Qwen2's q/k/v biases, which the planner does
    not count and says so on stderr. Mixtral plans as 8 experts top-2. Negative control: the same
    configs read with num_key_value_heads ignored (every head its own key/value head) miss the
    published counts by more than 1%, each of them."""
    counts = planned_params_of_hf_configs(tmp_path)
    for name, (config, published) in HF_CONFIGS.items():
        assert abs(count_hf_params(config) / published - 1) < 0.01, name
        assert abs(counts[name] / published - 1) < 0.01, name
        biases = config["num_hidden_layers"] * (3584 + 2 * 512) if name == "Qwen2.5-7B" else 0
        assert counts[name] == count_hf_params(config) - biases, name
    plan = load_script(BENCH / "plan.py")
    plan_main(plan, ["--hf-config", str(tmp_path / "Mixtral-8x7B.json"), "--gpus", "64", "--json"])
    model = json.loads(capsys.readouterr().out)["plan"]["model"]
    assert (model["arch"], model["num_experts"], model["top_k"], model["seq_len"]) == ("llama_moe", 8, 2, 2048)
    plan_main(plan, ["--hf-config", str(tmp_path / "Qwen2.5-7B.json"), "--strategies", "zero3"])
    assert "note: qwen2's q/k/v biases (129,024 parameters" in capsys.readouterr().err
    monkeypatch.setattr(planner.hf_config, "FIELDS", {k: v for k, v in planner.hf_config.FIELDS.items()
                                                       if k != "n_kv_head"} | {"n_kv_head": "no_such_key"})
    ignored = planned_params_of_hf_configs(tmp_path)
    for name, (_, published) in HF_CONFIGS.items():
        assert abs(ignored[name] / published - 1) > 0.01, name


@pytest.mark.parametrize("content,expected", [
    (None, "cannot read it"),
    ("not json", "not a JSON config.json"),
    ('{"model_type": "gpt2", "n_embd": 768}', "model_type 'gpt2' is not one the planner reads (llama, mistral"),
    ('{"model_type": "llama", "hidden_size": 4096}', "num_hidden_layers must be a positive integer, got None"),
    ('{"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128, '
     '"num_hidden_layers": 28, "num_key_value_heads": 8, "intermediate_size": 3072, "vocab_size": 151936}',
     "head_dim 128 is not hidden_size / num_attention_heads (64)"),
])
def test_a_bad_hf_config_is_one_line(tmp_path, content, expected):
    """An unreadable file, one that is not JSON, an unknown model_type, a missing size, and a head
    width the planner's Llama shape cannot hold (Qwen3-0.6B's 128-wide heads on a 1,024 width) each
    end in one line naming the file."""
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=re.escape(expected)) as refused:
        load_script(BENCH / "plan.py").main(["--hf-config", str(path)])
    assert str(refused.value).startswith(f"--hf-config {path}: ") and "\n" not in str(refused.value)


# ---------------------------------------------------------------- validated against the CPU matrix


# PLANNER_MATRIX=path checks a freshly recorded matrix (distributed_benchmarks.py --bandwidth) instead
MATRIX = os.environ.get("PLANNER_MATRIX", str(COMMITTED_RESULTS))


def _matrix_rows():
    return planner.validate(planner.read_matrix(MATRIX))


@pytest.fixture(scope="module")
def committed_rows():
    return _matrix_rows()


# The one cell of the committed matrix where the activations miss the 10% bound: DeepSpeed ZeRO-3
# with CPU offload on the GPT at 4 ranks (+31%; its peak is within 4%). That matrix predates the
# harness's activation high-water mark, so it measured the activations alive at the step's peak, and
# this step peaks in backward, after some blocks' activations are freed, while the offload machinery
# holds buffers MemTracker files under temporaries. Listed at its measured size, so any other cell
# leaving the bound, or this one growing, still fails; the repeat recording (high-water marks) has
# no exception: test_the_repeat_recording_meets_the_memory_bounds_in_every_cell.
KNOWN_ACTIVATION_MISSES = {("zero3_offload", "gpt", 4): 0.32}
KNOWN_PEAK_MISSES: dict = {}


def test_predictions_of_the_committed_matrix_stay_in_the_issue_bounds(committed_rows):
    """Every training cell of the committed CPU matrix (``benchmarks/records/results_cpu.jsonl``):
    the model-state bytes the planner counts (theory's busiest rank) equal the measured ones to the
    byte; where the records carry MemTracker's peak by category, the predicted activations are within
    10% of the measured ones and the predicted peak within 15% of MemTracker's total.
    Bugs caught: a strategy's buffer or its gathered parameters forgotten, the LM head's working set
    counted as activations, the wrong rank compared. Negative control below."""
    assert committed_rows, "no training cell in the matrix"
    for row in committed_rows:
        assert row["state_error"] == 0, row
    tracked = [r for r in committed_rows if r.get("activations_error") is not None]
    assert len(tracked) == len(committed_rows), "cells without MemTracker's peak by category: re-record the matrix"
    for row in tracked:
        cell = (row["strategy"], row["arch"], row["world_size"])
        assert abs(row["activations_error"]) <= KNOWN_ACTIVATION_MISSES.get(cell, 0.10), row
        assert abs(row["peak_error"]) <= KNOWN_PEAK_MISSES.get(cell, 0.15), row


REPEAT = BENCH / "records" / "results_cpu_repeat.jsonl"


def test_the_repeat_recording_meets_the_memory_bounds_in_every_cell():
    """The matrix recorded a second time (``benchmarks/records/results_cpu_repeat.jsonl``), each record
    with the activations' high-water mark: model state equal to the byte, activations within 10% of
    the high-water mark and the peak within 15% of MemTracker's total in every cell, no exception.
    Bugs caught: as above, and the validation reading the activations at the peak instead of their
    high-water mark (the ZeRO-3 offload cell at 4 ranks then misses by about 30%)."""
    records = planner.read_matrix(REPEAT)
    cells = [r for r in records if r.get("model") and r.get("status", "ok") == "ok" and r.get("metrics")]
    assert len(cells) == 66
    for rec in cells:
        for part in rec["metrics"]["peak_memory_by_category_per_rank"]:
            assert part["activations"] <= part["activations_high_water"], rec["strategy"]
    rows = planner.validate(records)
    assert len(rows) == len(cells)
    for row in rows:
        assert row["state_error"] == 0, row
        assert abs(row["activations_error"]) <= 0.10, row
        assert abs(row["peak_error"]) <= 0.15, row
    # negative control: the same records without their high-water marks (activations at the peak)
    for rec in cells:
        for part in rec["metrics"]["peak_memory_by_category_per_rank"]:
            del part["activations_high_water"]
    misses = [(r["strategy"], r["arch"], r["world_size"]) for r in planner.validate(records)
              if abs(r["activations_error"]) > 0.10]
    assert misses == [("zero3_offload", "gpt", 4)]


def test_only_misses_lists_the_cells_outside_the_bounds(capsys):
    """``plan.py --validate FILE --only-misses`` prints exactly the cells whose error leaves a bound
    (computed here from each row's predicted and measured values), and the count. On the committed
    matrix that is the one ZeRO-3 offload cell; on the repeat recording the cells whose step time
    misses 50%."""
    for path in (MATRIX, REPEAT):
        rows = planner.validate(planner.read_matrix(path))
        expected = set()
        for r in rows:
            off = (r["state_predicted"] != r["state_measured"]
                   or abs(r["activations_predicted"] / r["activations_measured"] - 1) > 0.10
                   or abs(r["peak_predicted"] / r["peak_measured"] - 1) > 0.15
                   or (not r["calibration"] and abs(r["step_predicted_s"] / r["step_measured_s"] - 1) > 0.50))
            if off:
                expected.add((r["strategy"], r["arch"], str(r["world_size"])))
        load_script(BENCH / "plan.py").main(["--validate", str(path), "--only-misses"])
        printed = capsys.readouterr().out.splitlines()
        listed = {tuple(line.split(" | ")[:3]) for line in (ln.strip("| ") for ln in printed)
                  if line and not line.startswith(("strategy", "---", "state:")) and " | " in line}
        assert listed == expected, printed
        assert printed[-1].startswith(f"{len(expected)} of {len(rows)} cells outside the bounds")
    assert expected, "the repeat recording has cells outside the step-time bound (README says so)"


def test_negative_control_double_counted_activations_leave_the_bound(committed_rows, monkeypatch):
    """The same check with a plausible planner bug, every saved tensor counted twice (once as an
    op's output, once as the next op's input), must leave the activation bound on every cell."""
    assert all(r.get("activations_error") is not None for r in committed_rows), "re-record the matrix"
    original = theory.activation_bytes_per_layer
    monkeypatch.setattr(theory, "activation_bytes_per_layer", lambda cfg, b, ac: 2 * original(cfg, b, ac))
    rows = [r for r in _matrix_rows() if r.get("activations_error") is not None]
    assert rows and all(abs(r["activations_error"]) > 0.10 for r in rows), rows


def test_step_time_predictions_within_the_issue_bounds(committed_rows):
    """Step time, predicted out of sample (each strategy's framework overhead from the other
    architecture's cells; the model's speed from its own DDP cells, which are calibration and not
    counted): median error within 20%, worst within 50%, and every cell predicted."""
    predicted = [r for r in committed_rows if not r["calibration"]]
    assert {r["strategy"] for r in committed_rows if r["calibration"]} == {"ddp"}
    # one calibration cell per model and rank count (the MoE GPT's are the GPT's)
    models = {(r["arch"].removesuffix("_moe"), r["world_size"]) for r in committed_rows}
    assert len(predicted) == len(committed_rows) - len(models)
    summary = planner.validation_summary(committed_rows)["step"]
    assert summary["cells"] == len(predicted)
    assert summary["median"] <= 0.20 and summary["worst"] <= 0.50, planner.validation_table(committed_rows)


def test_negative_control_time_model_without_collective_latency_leaves_the_bound(monkeypatch):
    """The same check with a plausible planner bug, each collective charged for its bytes only (no
    per-call latency alpha: the term that decides small messages on gloo, and NCCL's small
    all-reduces), must leave the time bound: DDP from scratch (one all-reduce per parameter) and
    sequence parallelism (three collectives per block) are then predicted far too fast."""
    original = planner.collective_time
    monkeypatch.setattr(planner.costs, "collective_time", lambda cl, coll, group, calls, bus, spans:
                        original(cl, coll, group, 0, bus, spans))
    summary = planner.validation_summary(_matrix_rows())["step"]
    assert summary["worst"] > 0.50, summary


# ---------------------------------------------------------------- the README's commands


@pytest.mark.parametrize("name", sorted(PLANNER_LOOKUPS))
def test_readme_planner_commands_print_their_recorded_output(name, reader):
    """Each planner command of the README, as the reader's play ran it (as written, from the clone's
    root: tests/spine.py), printed exactly the output recorded for its block (the torchvision note
    aside, a line of stderr): a planner change that alters an answer without re-recording the README
    fails here, not only in ``distkit.records check``."""
    run = play_chapter("benchmarks", reader).ok(PLANNER_LOOKUPS[name])
    assert run["played"] == run["command"]  # the words as written
    recorded = next(json.loads(line) for line in (BENCH / "records" / "outputs.jsonl").read_text().splitlines()
                    if json.loads(line)["name"] == name)
    assert recorded["command"] == run["command"] or recorded["command"].endswith(run["command"].split(" ", 2)[2])
    want = [line.rstrip() for line in recorded["output"].splitlines() if not line.startswith("note:")]
    assert [line.rstrip() for line in run["stdout"].splitlines() if not line.startswith("note:")] == want


def test_params_picks_the_block_count():
    """``--params 7e9`` on the Llama-3.1-8B shape keeps its width and vocabulary and takes the block
    count whose parameter count comes closest: (7e9 - embeddings, head and final norm) / one block =
    (7e9 - 1,050,677,248) / 218,112,000 = 27.3 -> 27 blocks, 6,939,701,248 parameters (within half a
    block of the request). Bug caught: the embeddings counted per block, or the count rounded the
    wrong way."""
    cfg = planner.with_params(LLAMA_8B, 7e9)
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size) == (27, 4096, 128256)
    assert psi(cfg) == 6_939_701_248
    block = (psi(LLAMA_8B) - psi(cfg)) // (32 - 27)
    assert abs(psi(cfg) - 7e9) <= block / 2


# ---------------------------------------------------------------- N-D layouts (--layout, the nd row)


LLAMA_70B = model_config("llama", "llama-3.1-70b")
LLAMA_405B = model_config("llama", "llama-3.1-405b")
# Llama 3.1 70B by hand: a block is q and o (8192 x 8192 each), k and v (8192 x 1024: 8 kv-heads of 128),
# the SwiGLU MLP (3 x 8192 x 28672) and two norms; outside the blocks the embedding and the untied head
# (128256 x 8192 each) and the final norm.
BLOCK_70B = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
OUTSIDE_70B = 2 * 128256 * 8192 + 8192


def nd_axes(layout: dict) -> int:
    return sum(layout.get(a, 1) > 1 for a in ("dp_replicate", "dp_shard", "tp", "pp", "cp"))


def test_nd_layouts_are_enumerated_and_each_is_valid():
    """Llama 3.1 405B on 512 H100s: the search enumerates 3- and 4-axis layouts (TP x PP x FSDP among
    them); each, checked here from its axes, multiplies to 512 GPUs, has tp dividing the 128 heads and
    8 kv-heads with TP x CP inside a node of 8, at most 126 pipeline stages, 8192 tokens in 2 x cp
    chunks, a batch of 2048 that splits over dp_replicate x dp_shard; none is a layout another row
    already plans (FSDP alone, HSDP, TP x FSDP, PP x DDP, CP x DDP). Negative controls: layouts that
    break each rule are refused by ``check_dims`` in one line."""
    plan, cl = planner.Plan(LLAMA_405B, global_batch=2048, ac="selective"), planner.cluster("h100", 512)
    dims = planner.enumerate_dims(plan, cl)
    covered = [{"dp_shard"}, {"dp_replicate", "dp_shard"}, {"tp", "dp_shard"}, {"pp", "dp_replicate"},
               {"cp", "dp_replicate"}, {"tp"}, {"pp"}, {"cp"}, {"dp_replicate"}]
    for d in dims:
        assert d.dp_replicate * d.dp_shard * d.tp * d.pp * d.cp == 512, d
        assert 128 % d.tp == 0 and 8 % d.tp == 0 and d.tp * d.cp <= 8, d
        assert d.pp * (2 if d.schedule == "interleaved_1f1b" else 1) <= 126 and 8192 % (2 * d.cp) == 0, d
        assert 2048 % (d.dp_replicate * d.dp_shard) == 0, d
        assert {a for a in ("dp_replicate", "dp_shard", "tp", "pp", "cp") if getattr(d, a) > 1} not in covered, d
    axes = {nd_axes(vars(d)) for d in dims}
    assert {3, 4} <= axes, axes
    assert any(d.tp == 8 and d.pp > 1 and d.dp_shard > 1 for d in dims)
    bad = {planner.ParallelDims(dp_shard=3, tp=8, pp=2): "not the 512 of the job",
           planner.ParallelDims(dp_shard=16, tp=32): "tp=32 does not divide",
           planner.ParallelDims(dp_shard=2, pp=256): "needs at least 256 blocks",
           planner.ParallelDims(dp_shard=128, pp=2, cp=2, schedule="zb"): "schedule 'zb' unknown",
           planner.ParallelDims(dp_shard=1, dp_replicate=1, tp=8, pp=64): None}
    for d, expected in bad.items():
        problem = planner.check_dims(plan, cl, d)
        assert (problem is None) if expected is None else (expected in problem and "\n" not in problem), (d, problem)
    assert planner.check_dims(replace(plan, global_batch=96), cl, planner.ParallelDims(dp_shard=64, tp=8)) \
        == "the global batch 96 does not split over dp_replicate x dp_shard = 64 batch ranks"
    assert planner.check_dims(replace(plan, global_batch=48), cl, planner.ParallelDims(dp_shard=64, tp=8)) \
        .startswith("the global batch 48 is fewer than dp_replicate x dp_shard = 64 batch ranks")


def test_405b_on_256_gpus_gets_the_fastest_nd_layout_that_fits():
    """Llama 3.1 405B, 2048 sequences of 8192, full AC, 256 H100s: no strategy row fits (ZeRO-3's
    tensors would, the caching allocator's peak for them would not), so the recommendation is the
    fastest N-D layout that does: FSDP over 128 x CP 2, by the model (its FSDP gathers, over all 8
    ports of each node, hide under compute). With selective AC nothing fits 512 of them. Negative
    control: on 512 GPUs with full AC, ZeRO-3 fits at a step within the tie bound, and the simpler
    family wins the tie: the N-D pick is the model's, not forced."""
    plan, cl = planner.Plan(LLAMA_405B, global_batch=2048, ac="full"), planner.cluster("h100", 256)
    estimates = planner.estimate_all(plan, cl)
    best = planner.recommend(estimates, cl).best
    assert best.name == "nd" and best.fits and nd_axes(best.layout) >= 2, best.layout
    assert (best.layout["dp_shard"], best.layout["cp"]) == (128, 2)
    assert not any(e.valid and e.fits for e in estimates if e is not best and not e.lora and not e.offload)
    zero3 = next(e for e in estimates if e.name == "zero3").memory_bytes
    assert zero3["peak"] <= cl.capacity_bytes < zero3["reserved"]
    wider = planner.cluster("h100", 512)
    assert planner.recommend(planner.estimate_all(replace(plan, ac="selective"), wider), wider).best is None
    assert planner.recommend(planner.estimate_all(plan, wider), wider).best.name != "nd"


NOT_THE_HAND_COUNT = "the pinned layout's weights and gradients are not the hand count"


def check_pinned_state(memory: dict) -> None:
    """``--layout dp_shard=2,tp=8,pp=4`` for Llama 3.1 70B on 64 GPUs: the busiest stage holds 80 / 4 =
    20 blocks and half of what is outside them; TP splits it 8 ways, FSDP 2: 2 bytes of bf16 weight,
    2 of gradient, 12 of AdamW state per parameter held (the ZeRO paper's 2 + 2 + 12)."""
    held = (20 * BLOCK_70B + OUTSIDE_70B / 2) / 8 / 2
    assert memory["params"] == pytest.approx(2 * held) and memory["grads"] == pytest.approx(2 * held), \
        f"{NOT_THE_HAND_COUNT}: params {memory['params']}, grads {memory['grads']}, by hand {2 * held} each"
    assert memory["optimizer"] == pytest.approx(12 * held)


def test_a_pinned_layout_is_planned_alone_and_counts_its_state_by_hand(capsys, monkeypatch):
    """``plan.py --layout dp_shard=2,tp=8,pp=4`` plans that one layout (one ``nd`` row, its axes in the
    layout column) and its model state is the hand count of :func:`check_pinned_state` (the 70B's 70.55B
    parameters recomputed from its shapes as literals). Negative control: a stage count that ignores
    the pipeline (every GPU holding all 80 blocks) fails the same check."""
    assert 80 * BLOCK_70B + OUTSIDE_70B == psi(LLAMA_70B) == 70_553_706_496
    plan = load_script(BENCH / "plan.py")
    argv = ["--model", "llama-3.1-70b", "--gpus", "64", "--global-batch", "128", "--layout", "dp_shard=2,tp=8,pp=4"]
    plan_main(plan, [*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in out["strategies"]] == ["nd"]
    check_pinned_state(out["strategies"][0]["memory_bytes"])
    plan_main(plan, argv)
    assert re.search(r"^nd +dps=2 tp=8 pp=4 1f1b micro=1 mbs=64 ", capsys.readouterr().out, re.M)
    whole = planner.nd._stage_params
    monkeypatch.setattr(planner.nd, "_stage_params", lambda cfg, d: whole(cfg, replace(d, pp=1)))
    plan_main(plan, [*argv, "--json"])
    with pytest.raises(AssertionError, match=NOT_THE_HAND_COUNT):
        check_pinned_state(json.loads(capsys.readouterr().out)["strategies"][0]["memory_bytes"])


def test_loss_parallel_shards_the_heads_vocabulary_terms():
    """The LM head's working set (``head_bytes``): at tp = 1 it is the measured one
    (``head_working_set``, checked on the CPU matrix); under TP with loss parallel every vocabulary-sized
    tensor is split: T (12 V / tp + 4 h) bytes in bf16, recomputed here for 8B, 2 x 8192 tokens, tp 8.
    Negative control: loss parallel off keeps the whole vocabulary on every TP rank (T (12 V + 4 h)),
    which is not that count."""
    plan = planner.Plan(replace(LLAMA_8B, seq_len=8192), global_batch=16, micro_batch=2)
    tokens, vocab, h = 2 * 8192, 128256, 4096
    assert planner.head_bytes(plan, 2) == planner.costs.head_working_set(plan, 2)
    assert planner.head_bytes(plan, 2, tp=8) == tokens * (12 * vocab / 8 + 4 * h)
    assert planner.head_bytes(plan, 2, tp=8, loss_parallel=False) == tokens * (12 * vocab + 4 * h)
    assert planner.head_bytes(plan, 2, tp=8, loss_parallel=False) != tokens * (12 * vocab / 8 + 4 * h)


# ---------------------------------------------------------------- against published GPU runs


@pytest.fixture(scope="module")
def published():
    from distkit.planner import published_check
    return published_check, published_check.compare()


# check_published_bounds's message for each bound missed
CALIBRATION_BOUND = "calibration tokens/s outside median <= 8%, worst <= 25%"
VALIDATION_BOUND = "validation tokens/s outside median <= 15%, worst <= 30%"
MEMORY_BOUND = "memory outside median <= 10%, worst <= 20%"


def check_published_bounds(rows: list[dict]) -> None:
    """The errors ``plan.py --published`` reports, recomputed here from each row's prediction and
    published figure, within the bounds the README states: tokens/s on the validation rows within
    the goal, median <= 15% and worst <= 30%; on the calibration rows median <= 8% and worst <= 25%
    (the measured errors, rounded up); memory, the caching allocator's peak, within its goal on
    every row that publishes one, median <= 10% and worst <= 20%. All three are checked, and the
    failure's message names each bound missed (a control matches the one it is for)."""
    def err(pred, meas):
        return abs(pred / meas - 1)
    cal = sorted(err(r["tps_pred"], r["tps"]) for r in rows if r["role"] == "calibration")
    val = sorted(err(r["tps_pred"], r["tps"]) for r in rows if r["role"] == "validation")
    mem = sorted(err(r["memory_pred"], r["memory_gib"]) for r in rows if r["memory_gib"] is not None)
    median = statistics.median
    missed = []
    if not (median(cal) <= 0.08 and cal[-1] <= 0.25):
        missed.append(f"{CALIBRATION_BOUND}: median {median(cal):.2%}, worst {cal[-1]:.2%}")
    if not (median(val) <= 0.15 and val[-1] <= 0.30):
        missed.append(f"{VALIDATION_BOUND}: median {median(val):.2%}, worst {val[-1]:.2%}")
    if not (median(mem) <= 0.10 and mem[-1] <= 0.20):
        missed.append(f"{MEMORY_BOUND}: median {median(mem):.2%}, worst {mem[-1]:.2%}")
    assert not missed, "; ".join(missed)


def test_published_rows_are_apart_and_predicted_within_the_stated_bounds(published):
    """The calibration rows all come from torchtitan's H100 December 2024 file, the validation rows from
    its docs/performance.md (A100s), Trainy's H200 file and the PyTorch team's AsyncTP file (the
    calibration file's H100s, June 2025), and no run is in both; the efficiency is fitted on the
    calibration rows alone (refitting on every row gives another value), and it is plan.py's default
    (``FITTED_EFFICIENCY``); every row is predicted within :func:`check_published_bounds`. The
    AsyncTP file's Float8 rowwise rows are planned and counted in no error
    (:func:`test_exactly_the_four_float8_rowwise_rows_are_excluded_and_why`). The table's summary
    line is recomputed from its rows. Negative control: the same rows predicted with the efficiency
    doubled (twice the matmul speed) fail the bounds."""
    pc, rows = published
    from distkit.planner.published import (
        A100_FILE,
        ASYNC_FILE,
        CALIBRATION,
        H100_FILE,
        H200_FILE,
        VALIDATION,
    )
    assert all(r.source.startswith(H100_FILE) and r.gpu == "h100-500w" for r in CALIBRATION)
    assert all((r.source.startswith(A100_FILE) and r.gpu == "a100-80gb") or
               (r.source.startswith(H200_FILE) and r.gpu == "h200") or
               (r.source.startswith(ASYNC_FILE) and r.gpu == "h100-500w") for r in VALIDATION)
    assert sum(r.gpu == "h200" for r in VALIDATION) == 2
    assert sum(r.source.startswith(ASYNC_FILE) for r in VALIDATION) == 8
    assert not {r.label for r in CALIBRATION} & {r.label for r in VALIDATION}
    eff = rows[0]["efficiency"]
    assert eff == pc.calibrate() != pc.calibrate(CALIBRATION + VALIDATION)
    assert eff == planner.FITTED_EFFICIENCY  # plan.py's default is the fitted fraction
    check_published_bounds(rows)
    s = pc.summary(rows)
    cal = [abs(r["tps_pred"] / r["tps"] - 1) for r in rows if r["role"] == "calibration"]
    assert s["tps_calibration"] == (statistics.median(cal), max(cal), 18)
    table = pc.published_table(rows)
    assert f"calibration median {statistics.median(cal):.1%}, worst {max(cal):.1%} (18 rows)" in table
    with pytest.raises(AssertionError, match=re.escape(CALIBRATION_BOUND)):
        check_published_bounds(pc.compare(2 * eff))


def test_the_a100_reaches_a_larger_fraction_of_its_peak_by_mosaics_measured_factor(published, monkeypatch):
    """The A100's ``compute_factor`` is the median A100 / H100 MFU ratio of MosaicML's matched runs,
    recomputed here from the pairs; a compute-bound A100 row's compute time is the H100 fraction's
    divided by it. Negative control: the A100 at the H100's fraction (factor 1, as before) misses the
    validation bounds (median 37%)."""
    import dataclasses

    from distkit.planner import inputs

    pc, rows = published
    ratios = sorted(a100 / h100 for h100, a100 in inputs.MOSAIC_MFU_PAIRS.values())
    assert len(ratios) == 30 and inputs.A100_VS_H100 == round((ratios[14] + ratios[15]) / 2, 3) == 1.458
    assert inputs.GPUS["a100-80gb"].compute_factor == inputs.GPUS["a100-40gb"].compute_factor == 1.458
    assert inputs.GPUS["h100"].compute_factor == 1.0
    a100 = inputs.cluster("a100-80gb", 64, efficiency=0.3)
    bf16 = planner.Plan(LLAMA_8B, global_batch=64)
    assert planner.compute_rate(a100, bf16) == pytest.approx(0.3 * 1.458 * 312e12, rel=1e-12)
    monkeypatch.setitem(inputs.GPUS, "a100-80gb", dataclasses.replace(inputs.GPUS["a100-80gb"], compute_factor=1.0))
    with pytest.raises(AssertionError, match=re.escape(VALIDATION_BOUND)):
        check_published_bounds(pc.compare(rows[0]["efficiency"]))


def test_a_ring_across_nodes_runs_on_every_port_of_a_node_in_its_group(published, monkeypatch):
    """Across nodes NCCL runs a ring channel through each GPU's own network port, so a group with k
    GPUs in each node moves its bus bytes at k ports' speed, at most the link inside the node: NVIDIA
    measures 192 GB/s all-reduce bus bandwidth between DGX-A100s of 8 x 200 Gb/s ports
    (github.com/NVIDIA/nccl/issues/812), 8 x the 24 GB/s the planner takes for one HDR port. One
    GPU per node, a send or an all-to-all: one port. Which GPUs of an axis share a node follows the
    mesh order (tp innermost).
    Negative control: every collective across nodes on one port (the model before) misses the
    validation bounds: Llama 2 70B at local batch 1 is then bound by FSDP's gathers, 32% slow."""
    from distkit.planner import costs, inputs

    a100, h100 = inputs.cluster("a100-80gb", 64), inputs.cluster("h100", 64)
    assert planner.collective_time(a100, "all_reduce", 64, 0, 192e9, 8) == pytest.approx(1.0)
    assert planner.collective_time(a100, "all_gather", 8, 0, 24e9, 1) == pytest.approx(1.0)  # a GPU per node
    assert planner.collective_time(a100, "send", 2, 0, 24e9, 1) == pytest.approx(1.0)
    assert planner.collective_time(a100, "all_to_all", 64, 0, 24e9, 8) == pytest.approx(1.0)
    assert planner.collective_time(a100, "all_gather", 8, 0, 240e9, 8) == pytest.approx(1.0)  # NVLink 3, in a node
    assert planner.collective_time(h100, "all_gather", 64, 0, 360e9, 8) == pytest.approx(1.0)  # 8 x 46 > NVLink
    dims = planner.ParallelDims
    assert dims(dp_shard=64).in_node("shard", h100) == 8
    assert dims(dp_shard=8, tp=8).in_node("shard", h100) == 1 and dims(dp_shard=8, tp=8).in_node("tp", h100) == 8
    assert dims(dp_shard=16, cp=2, tp=2).in_node("shard", h100) == 4
    assert dims(dp_replicate=2, dp_shard=32).in_node("dp_replicate", h100) == 1
    assert dims(dp_shard=8, tp=8, pp=8).in_node("pp", planner.cluster("h100", 512)) == 1
    pc, rows = published
    check_published_bounds(rows)
    monkeypatch.setattr(costs, "RING_COLLECTIVES", ())
    one_port = pc.compare(rows[0]["efficiency"])
    worst = min(one_port, key=lambda r: r["tps_pred"] / r["tps"] if r["role"] == "validation" else 1)
    assert worst["label"].startswith("llama-2-70b") and worst["tps_pred"] / worst["tps"] < 0.7, worst
    with pytest.raises(AssertionError, match=re.escape(VALIDATION_BOUND)):
        check_published_bounds(one_port)


def test_the_calibration_gpus_are_torchtitans_500_w_h100s(published, monkeypatch):
    """The calibration rows ran on H100s of 96 GB HBM2e at 2.4 TB/s, limited to 500 W, whose bf16
    peak "is between SXM and NVL" (the file's hardware section and footnote): ``h100-500w`` takes the
    middle of NVL's 835 and SXM's 989 dense TFLOP/s, and the efficiency fitted on those rows is a
    fraction of that peak; every other GPU gets the same fraction of its own. The README's
    sensitivity: taken as SXMs at 989 (a peak the source says they do not reach), the fraction refits
    lower, every validation row on another GPU is predicted about 8% slower (the AsyncTP rows, on
    the changed GPU itself, within 2%) and the validation median error grows (13.3% to 15.0%)."""
    import dataclasses

    from distkit.planner import inputs

    gpu = inputs.GPUS["h100-500w"]
    assert gpu.peak_flops["bf16"] == (835e12 + 989e12) / 2 and gpu.hbm_bandwidth == 2.4e12
    assert gpu.memory_bytes == 95.0 * planner.GiB and gpu.compute_factor == 1.0
    pc, rows = published
    assert {r["efficiency"] for r in rows} == {pc.calibrate()}
    monkeypatch.setitem(inputs.GPUS, "h100-500w", dataclasses.replace(gpu, peak_flops={**gpu.peak_flops,
                                                                                        "bf16": 989e12}))
    monkeypatch.setattr(pc, "_FITTED", {})
    monkeypatch.setattr(pc, "_ATTENTION_SHARE", {})
    as_sxm = pc.compare(pc.calibrate())
    for middle, sxm in zip(rows, as_sxm):
        if middle["role"] == "validation":
            low, high = (0.98, 1.0) if "h100-500w" in middle["label"] else (0.91, 0.94)
            assert low < sxm["tps_pred"] / middle["tps_pred"] < high, middle["label"]
    val = [abs(r["tps_pred"] / r["tps"] - 1) for r in as_sxm if r["role"] == "validation"]
    assert statistics.median(val) > 1.1 * pc.summary(rows)["tps_validation"][0]


def test_torchtitans_selective_op_ac_keeps_every_other_matmul(published, monkeypatch):
    """torchtitan's selective op AC ("Saves output of all compute ops, except every second mm"): a
    Llama block keeps its input, q, v, attention's output and log-sum-exp, the MLP's gate and down
    projections, 4sb (4h + hg/a + I + a) bytes in fp32 floats, and recomputes k, the output and the
    up projection in backward: 2 (h hg/a + h^2 + h I) FLOPs per token per block more. The published
    rows that ran it are planned with it. Negative control: the same rows planned with this
    repository's selective AC (every matmul kept) miss the memory bound (the H200 rows 50% high)."""
    import dataclasses

    h, kv, inter, a, s, b = 4096, 4096 * 8 // 32, 14336, 32, LLAMA_8B.seq_len, 2
    assert theory.activation_bytes_per_layer(LLAMA_8B, b, "titan-op") == 4 * s * b * (4 * h + kv + inter + a)
    gpt = model_config("gpt", "small")
    assert theory.activation_bytes_per_layer(gpt, 1, "titan-op") == 4 * gpt.seq_len * (9 * gpt.n_embd + gpt.n_head)
    from distkit.planner import costs
    extra = costs._flops_per_token(planner.Plan(LLAMA_8B, 8, ac="titan-op")) - \
        costs._flops_per_token(planner.Plan(LLAMA_8B, 8, ac="none"))
    assert extra == 2 * 32 * h * (kv + h + inter)
    with pytest.raises(UsageError, match="titan-op is torchtitan's policy for dense models"):
        planner.Plan(with_experts(LLAMA_8B, 8, 2), 8, ac="titan-op")
    from distkit.planner.published import CALIBRATION, VALIDATION
    assert {r.ac for r in CALIBRATION + VALIDATION} == {"none", "full", "titan-op"}
    pc, rows = published
    check_published_bounds(rows)

    def as_selective(table):
        return tuple(dataclasses.replace(r, ac="selective") if r.ac == "titan-op" else r for r in table)
    monkeypatch.setattr(pc, "CALIBRATION", as_selective(CALIBRATION))
    monkeypatch.setattr(pc, "VALIDATION", as_selective(VALIDATION))
    monkeypatch.setattr(pc, "_MEMORY_FACTORS", {})
    selective = pc.compare(pc.calibrate(pc.CALIBRATION))
    assert max(r["memory_err"] for r in selective if r["label"].startswith("llama-3.1-8b 32xh200")) > 0.45
    with pytest.raises(AssertionError, match=re.escape(MEMORY_BOUND)):
        check_published_bounds(selective)


def test_compile_and_float8_leave_attention_at_its_eager_speed(published, monkeypatch):
    """Float8 converts the linear layers and torch.compile calls the same attention kernel, so the
    published rows' compile/Float8 speed-up applies to the FLOPs outside attention
    (:func:`~distkit.planner.published_check.linear_speedup`). Negative control: Table 1's whole-step
    ratio on every FLOP, attention included, predicts the long-sequence CP rows far too fast (8B at
    262k tokens 50% and more) and misses the calibration bound."""
    from distkit.planner import costs, nd
    from distkit.planner.published_check import technique_speedup

    pc, rows = published
    check_published_bounds(rows)

    def whole_step(cl, plan, tokens, lora=False, **gemms):
        rate = costs.compute_rate(cl, plan) * technique_speedup(plan)
        return tokens * costs._flops_per_token(plan, lora) / rate
    monkeypatch.setattr(nd, "compute_seconds", whole_step)
    monkeypatch.setattr(pc, "_FITTED", {})
    old = pc.compare(pc.calibrate())
    (longest,) = [r for r in old if r["label"].startswith("llama-3.1-8b") and "s=262144" in r["label"]]
    assert longest["tps_err"] > 0.5, longest
    with pytest.raises(AssertionError, match=re.escape(CALIBRATION_BOUND)):
        check_published_bounds(old)


NOT_THE_HAND_PEAK = "the predicted peak is not the hand count's"


def check_technique_memory(pred_gib: float, eager: planner.Estimate, kept: float) -> None:
    """A compile/Float8 row's predicted peak, by hand: the eager layout's parameters and optimizer
    state (no gradients at the top of backward: one micro-batch) plus the caching allocator's
    reserve r times what the step makes and frees, ``kept`` of the blocks' saved activations and the
    temporaries; the activations of Llama 3.1 8B under torchtitan's selective op AC (titan-op) at
    s = 8192, b = 2 in bf16: 32 blocks x 2 s b (4h + hg/a + I + a) bytes = 32 x 2 x 16,384 x 31,776
    (31.03 GiB)."""
    act = 32 * 2 * 16384 * (4 * 4096 + 4096 * 8 // 32 + 14336 + 32)
    assert eager.memory_bytes["activations"] == act
    m = eager.memory_bytes
    r = planner.FITTED_RESERVE
    want = m["params"] + m["optimizer"] + r * (kept * act + m["temporaries"])
    assert pred_gib * planner.GiB == pytest.approx(want, rel=1e-12), \
        f"{NOT_THE_HAND_PEAK}: {pred_gib * planner.GiB} bytes, by hand {want}"


def test_compile_and_float8_lower_the_predicted_memory_by_table_1s_factors(published):
    """torch.compile and Float8 keep factors c and f of the blocks' saved activations A, fitted on
    Table 1's memory column (82.4 GiB eager, 77.0 compiled, 76.8 with Float8 too) through the
    allocator's reserve r: by hand c = 1 - 5.4 GiB / (r A), f = 1 - 0.2 GiB / (r c A); the
    compile+Float8 row's peak is recomputed from
    the parts and c f A (:func:`check_technique_memory`), 5.6 GiB below the eager row's, as
    measured. Out of sample, Table 3 (the same job on 128 GPUs, not fitted on) drops 5.2 GiB from
    eager to compile+Float8, predicted within 0.5 GiB. Full AC rows keep their eager memory (no
    pair measures full AC). Negative controls: the peak with the factors applied twice, and with
    them not applied (the eager peak), each fail the hand check."""
    pc, rows = published
    from distkit.planner.published import CALIBRATION
    gib = planner.GiB
    t1 = {(r.compile, r.float8): r for r in CALIBRATION if r.source.endswith("Table 1")}
    t3 = {(r.compile, r.float8): r for r in CALIBRATION if r.source.endswith("Table 3")}
    plan, dims = pc.row_plan(t1[False, False])
    eager = planner.estimate_dims(plan, planner.cluster("h100", 8), dims)
    act = eager.memory_bytes["activations"]
    r = planner.FITTED_RESERVE
    c = 1 - 5.4 * gib / (r * act)
    f = 1 - 0.2 * gib / (r * c * act)
    assert pc.memory_factors() == pytest.approx({"compile": c, "float8": f}, rel=1e-12)
    assert 0.85 < c < 0.87 and 0.99 < f < 0.995
    eff = rows[0]["efficiency"]
    both = pc.predict(t1[True, True], eff)[1]
    check_technique_memory(both, eager, c * f)
    check_technique_memory(pc.predict(t1[True, False], eff)[1], eager, c)
    assert pc.predict(t1[False, False], eff)[1] - both == pytest.approx(82.4 - 76.8)
    drop3 = pc.predict(t3[False, False], eff)[1] - pc.predict(t3[True, True], eff)[1]
    assert abs(drop3 - (67.0 - 61.8)) < 0.5, drop3
    for row in (r for r in CALIBRATION if r.ac == "full" and r.compile):
        p, d = pc.row_plan(row)
        plain = planner.estimate_dims(p, planner.cluster(row.gpu, row.gpus), d).memory_bytes["reserved"] / gib
        assert pc.memory_factor(row) == 1.0 and pc.predict(row, eff)[1] == pytest.approx(plain), row.label
    twice = eager.memory_bytes["reserved"] - r * (1 - (c * f) ** 2) * act
    for wrong in (twice / gib, eager.memory_bytes["reserved"] / gib):
        with pytest.raises(AssertionError, match=NOT_THE_HAND_PEAK):
            check_technique_memory(wrong, eager, c * f)


NOT_THE_SOFTMAX = "eager attention's extra activations are not a x s^2 x b bf16 elements over tp"


def check_eager_term(flash: planner.Estimate, eager: planner.Estimate, tp: int) -> None:
    """Eager attention keeps the softmax probabilities: by hand, per block a x s^2 x b bf16 elements
    (2 bytes), Korthikanti's 5as/h term at dropout 0, split over the tp ranks with the heads."""
    extra = 32 * 32 * 2048 ** 2 * 1 * 2 / tp  # 32 blocks, 32 heads, s = 2048, b = 1
    added = eager.memory_bytes["activations"] - flash.memory_bytes["activations"]
    assert added == pytest.approx(extra), f"{NOT_THE_SOFTMAX}: {added} bytes added, by hand {extra}"


def test_eager_attention_keeps_the_softmax_and_ac_drops_it():
    """Llama 3.1 8B, 2,048 tokens, micro-batch 1, bf16 on 8 H100s: ``attention="eager"`` adds 32 x 32 x
    2048^2 x 2 bytes = 8 GiB of activations to FSDP without AC, 4 GiB to TP 2 x FSDP; selective and
    full AC add nothing (they recompute attention); CP refuses eager attention in one line (ring
    attention runs on flash). Negative control: the term counted as a x s x b (s instead of s^2)
    fails the same check."""
    cl = planner.cluster("h100", 8)
    for ac in ("none", "selective", "full"):
        plan = planner.Plan(LLAMA_8B, global_batch=16, ac=ac)
        for name, tp in (("fsdp_full_shard", 1), ("fsdp_tp", 2)):
            flash = planner.estimate(plan, cl, name)
            eager = planner.estimate(replace(plan, attention="eager"), cl, name)
            assert flash.layout.get("tp", 1) == eager.layout.get("tp", 1) == tp
            if ac == "none":
                check_eager_term(flash, eager, tp)
            else:
                assert eager.memory_bytes["activations"] == flash.memory_bytes["activations"], (ac, name)
    cp = planner.estimate(planner.Plan(LLAMA_8B, global_batch=16, attention="eager"), cl, "cp")
    assert not cp.valid and "flash attention" in cp.note
    plan = planner.Plan(LLAMA_8B, global_batch=16)
    wrong = replace(planner.estimate(plan, cl, "fsdp_full_shard"))
    wrong.memory_bytes = {**wrong.memory_bytes,
                          "activations": wrong.memory_bytes["activations"] + 32 * 32 * 2048 * 2}
    with pytest.raises(AssertionError, match=re.escape(NOT_THE_SOFTMAX)):
        check_eager_term(planner.estimate(plan, cl, "fsdp_full_shard"), wrong, 1)


# ---------------------------------------------------------------- expert parallelism as an N-D axis

GPT_MOE = with_experts(model_config("gpt", "small"), 8, 2)  # width 128, 4 blocks, 4 heads, s = 64
EXPERTS_MOE = 4 * 8 * (128 * 512 + 512 + 512 * 128 + 128)  # 4 blocks x 8 experts of 131,712 parameters


def test_nd_search_enumerates_ep_where_it_divides_dp_shard_x_cp_and_the_experts():
    """The small GPT with 8 experts on 16 H100s (a node of 8): ep borrows ranks from dp_shard x cp, so
    for each other-axes layout the ep the search tries are the divisors of dp_shard x cp that divide
    8 experts and are multiples of cp, by hand: dp_shard=16 -> 2, 4, 8 (ep=1 is the fsdp row's
    layout); dp_shard=8, cp=2 -> 1, 2, 4, 8; dp_shard=4, tp=4 -> 2, 4 (ep=1: the fsdp_tp row's);
    dp_shard=4, cp=4 -> 1, 4, 8 (2 is no multiple of cp, 16 no divisor of 8 experts); dp_shard=2, tp=4,
    cp=2 -> 1, 2, 4. The dense GPT gets no ep. Negative controls, each refused in one line by
    plan.py's --layout: ep=16 on dp_shard=8 (divides neither), ep=8 on dp_shard=4 x tp=4, ep=3, ep=2
    with cp=4, ep on the dense model."""
    cl = planner.cluster("h100", 16)
    found: dict = {}
    for d in planner.dims.enumerate_dims(planner.Plan(GPT_MOE, global_batch=64), cl):
        if d.pp == 1 and d.dp_replicate == 1:
            found.setdefault((d.dp_shard, d.tp, d.cp), set()).add(d.ep)
    assert found[16, 1, 1] == {2, 4, 8} and found[8, 1, 2] == {1, 2, 4, 8} and found[4, 4, 1] == {2, 4}
    assert found[4, 1, 4] == {1, 4, 8} and found[2, 4, 2] == {1, 2, 4}
    dense = planner.dims.enumerate_dims(planner.Plan(model_config("gpt", "small"), global_batch=64), cl)
    assert dense and {d.ep for d in dense} == {1}
    plan = load_script(BENCH / "plan.py")
    job = ["--model", "gpt-small", "--seq-len", "64", "--gpus", "16", "--global-batch", "64"]
    for layout, expected in [
        ("dp_shard=8,tp=2,ep=16", "ep=16 must divide dp_shard x cp = 8 (the ranks it borrows) and the 8 experts; "
                                  "ep that do: 2, 4, 8"),
        ("dp_shard=8,tp=2,ep=3", "ep=3 must divide dp_shard x cp = 8"),
        ("dp_shard=4,tp=4,ep=8", "ep=8 must divide dp_shard x cp = 4 (the ranks it borrows) and the 8 experts; "
                                 "ep that do: 2, 4"),
        ("dp_shard=4,cp=4,ep=2", "and be a multiple of cp=4; ep that do: 4, 8"),
    ]:
        with pytest.raises(UsageError, match=re.escape(expected)):
            plan.main([*job, "--experts", "8", "--top-k", "2", "--layout", layout])
    with pytest.raises(UsageError, match=re.escape("ep=2 splits a mixture of experts' experts; this model is dense")):
        plan.main([*job, "--layout", "dp_shard=16,ep=2"])


def test_a_pinned_ep_layout_holds_its_experts_over_ep_and_sends_the_all_to_alls_by_hand(monkeypatch):
    """``dp_shard=8,tp=2,ep=4`` for the small GPT with 8 experts top-2 on 16 H100s, 64 sequences of 64
    tokens, bf16 AdamW, micro-batch 1 (8 per batch rank, so 8 micro-batches). By hand:

    * experts: 4 x 8 x 131,712 = 4,214,784 parameters; a GPU holds / tp 2 / ep 4 / (8 / 4) FSDP =
      263,424, at 2 + 2 + 12 bytes = 4,214,784 bytes of expert state; the dense 344,320 / 2 / 8 = 21,520
      at 16 bytes: model state 4,559,104 bytes;
    * FSDP gathers a block's experts of its ep rank only: two blocks in flight hold
      2 x 2 bytes x 1,053,696 / 2 / 4 experts' parameters, 1,580,544 bytes fewer than with ep=1
      (all 8 experts gathered: 2 x 2 x 1,053,696 / 2);
    * all-to-alls: per layer and micro-batch theory's 8 x 8 count bytes + 2 x (128 + 128) x 128 x 2
      bytes (k T = 2 x 64 rows sent and received, width 128, bf16) = 131,136; 4 layers x 8
      micro-batches: 4,196,352 bytes in 160 calls, bus bytes x 3/4 over the 4 ep ranks, in a node:
      160 x alpha x 2 + bus / beta on the critical path.

    Negative controls (each fails the same checks): experts held without the ep divisor (FSDP over
    dp_shard x cp / ep only); FSDP gathering every expert (ep ignored by the gather)."""
    cl = planner.cluster("h100", 16)
    plan = planner.Plan(GPT_MOE, global_batch=64)
    d = planner.dims.parse_layout("dp_shard=8,tp=2,ep=4", 16)
    assert (d.dp_shard, d.tp, d.ep, d.world) == (8, 2, 4, 16)
    expert_state = 16 * EXPERTS_MOE / 2 / 4 / (8 // 4)
    assert expert_state == 4_214_784
    assert 16 * planner.nd_ep.held_params(EXPERTS_MOE, EXPERTS_MOE, d) == expert_state

    def check(est, flat):
        state = sum(est.memory_bytes[k] for k in ("params", "grads", "optimizer"))
        assert state == pytest.approx(expert_state + 16 * 344_320 / 2 / 8) == 4_559_104, \
            f"model state {state} bytes, not the hand count's 4,559,104"
        fewer = flat.memory_bytes["temporaries"] - est.memory_bytes["temporaries"]
        assert fewer == pytest.approx(2 * 2 * (1_053_696 / 2 - 1_053_696 / 2 / 4)) == 1_580_544, \
            f"gathered weights {fewer} bytes fewer than with ep=1, not the hand count's 1,580,544"

    est, flat = planner.nd.estimate_dims(plan, cl, d), planner.nd.estimate_dims(plan, cl, replace(d, ep=1))
    check(est, flat)
    comm = planner.nd_ep.all_to_all_comm(plan, d, 1, 8, 4, 2)["all_to_all"]
    per_layer = 8 * 8 + 2 * (2 * 64 + 2 * 64) * 128 * 2
    assert per_layer == theory.expert_parallel_bytes(128, 128, 128, 8, bytes_per_element=2) == 131_136
    assert (comm["calls"], comm["bytes"], comm["bus_bytes"]) == (160, 4 * 8 * per_layer, 4 * 8 * per_layer * 3 / 4)
    link = cl.gpu.intra
    assert est.times["ep_s"] == pytest.approx(160 * link.latency * 2 + 4 * 8 * per_layer * 3 / 4 / link.bandwidth)
    assert "ep_s" not in flat.times
    nd_ep = planner.nd_ep
    held, gathered = nd_ep.held_params, nd_ep.gathered_params
    for name, broken, message in [
            ("held_params", lambda p, e, d: (p - e) / d.tp / d.shard + e / d.tp / (d.shard // d.ep), "^model state "),
            ("gathered_params", lambda p, e, d: gathered(p, e, replace(d, ep=1)), "^gathered weights ")]:
        with monkeypatch.context() as patch:
            patch.setattr(nd_ep, name, broken)
            with pytest.raises(AssertionError, match=message):
                check(planner.nd.estimate_dims(plan, cl, d), planner.nd.estimate_dims(plan, cl, replace(d, ep=1)))
    assert nd_ep.held_params is held


def test_compile_and_float8_flags_scale_the_compute_and_the_saved_activations(capsys):
    """``plan.py --compile --float8``: the FLOPs outside attention sped up by S' = (1 - A) / (1 / S - A),
    S = 8,532 / 5,762 (Table 1's whole-step ratio) and A the attention share of Table 1's job's compute
    time (12 L h s against 6N + titan-op's recompute at the fraction f of the large-matrix rate its
    GEMMs reach on its GPUs, by hand), so that job's compute time on its GPUs shrinks by S exactly
    and a longer sequence's by less (attention runs at its eager speed); the blocks' saved
    activations times the memory factors fitted on the same rows (none under full AC, where a block
    keeps only its input); the header names both. Negative controls: an eager plan keeps rate and
    activations; Float8 on an fp32 job is one error line."""
    from distkit.planner import costs
    from distkit.planner.published_check import linear_speedup, memory_factors

    cl = planner.cluster("h100-500w", 8, efficiency=0.3)  # Table 1's GPUs
    eager = planner.Plan(LLAMA_8B, global_batch=16, ac="selective")
    both = planner.Plan(LLAMA_8B, global_batch=16, ac="selective", compile=True, float8=True)
    assert planner.compute_rate(cl, both) == planner.compute_rate(cl, eager) == pytest.approx(0.3 * 912e12, rel=1e-12)
    h, L, s = 4096, 32, 8192
    matmul_params = 8_030_261_248 - 128256 * h  # every matrix but the embedding table
    recompute = 2 * L * h * (h * 8 // 32 + h + 14336)
    table1 = [planner.Plan(replace(LLAMA_8B, seq_len=s), 16, micro_batch=2, ac="titan-op", compile=c, float8=c)
              for c in (False, True)]
    f = planner.matmul_factor(cl, table1[0], 2 * s)
    assert 0.99 < f < 1
    share = 12 * L * h * s / ((6 * matmul_params + recompute) / f + 12 * L * h * s)
    assert linear_speedup(both) == pytest.approx((1 - share) / (5762 / 8532 - share), rel=1e-9)
    assert costs.compute_seconds(cl, table1[0], 1e6) / costs.compute_seconds(cl, table1[1], 1e6) == \
        pytest.approx(8532 / 5762, rel=1e-9)
    longer = [replace(p, model=replace(LLAMA_8B, seq_len=4 * s)) for p in table1]
    assert 1 < costs.compute_seconds(cl, longer[0], 1e6) / costs.compute_seconds(cl, longer[1], 1e6) < 8532 / 5762
    f = memory_factors()
    kept = costs.activation_bytes(both, 32, 1) / costs.activation_bytes(eager, 32, 1)
    assert kept == pytest.approx(f["compile"] * f["float8"], rel=1e-12) and 0.84 < kept < 0.87
    full = [planner.Plan(LLAMA_8B, global_batch=16, ac="full", compile=c, float8=c) for c in (False, True)]
    assert costs.activation_bytes(full[1], 32, 1) == costs.activation_bytes(full[0], 32, 1)
    plan = load_script(BENCH / "plan.py")
    argv = ["--model", "llama-3.1-8b", "--seq-len", "8192", "--global-batch", "16", "--gpus", "8",
            "--strategies", "fsdp_full_shard"]
    for flags in ([], ["--compile", "--float8"]):
        plan_main(plan, [*argv, *flags, "--json"])
        out = json.loads(capsys.readouterr().out)
        (row,) = out["strategies"]
        assert (out["plan"]["compile"], out["plan"]["float8"]) == ((True, True) if flags else (False, False))
        if not flags:
            eager_row = row
    activations = row["memory_bytes"]["activations"], eager_row["memory_bytes"]["activations"]
    assert activations[0] == pytest.approx(activations[1] * kept, rel=1e-9)
    plan_main(plan, [*argv, "--compile", "--float8"])
    header = capsys.readouterr().out.splitlines()[:2]
    assert "torch.compile, Float8 tensorwise" in header[0] and f"x {linear_speedup(both):.3g} outside attention " \
        f"for compile+Float8 tensorwise, Table 1's x {8532 / 5762:.3g} on its whole step" in header[1], header
    with pytest.raises(UsageError, match="--float8 runs the linear layers of a bf16 job"):
        plan.main([*argv, "--float8", "--precision", "fp32"])


# Float8 rowwise's source, torchtitan commit 3537666a's message: Llama 3 8B on 8 H100s (FSDP 8, local
# batch 1 of 8,192 tokens, selective op AC, compiled), tokens/s per GPU bf16 5,760, rowwise 6,424.
ROWWISE_BF16, ROWWISE_TPS = 5760, 6424


def rowwise_job(recipe: str | None, batch: int = 1) -> planner.Plan:
    """That job (``batch`` 1; 2 is Table 1's), compiled, in bf16 (``recipe`` None) or Float8."""
    return planner.Plan(replace(LLAMA_8B, seq_len=8192), 8 * batch, micro_batch=batch, ac="titan-op", compile=True,
                        float8=recipe is not None, float8_recipe=recipe or "tensorwise")


NOT_ROWWISE_RATIO = "bf16 / rowwise compute time is not 6,424 / 5,760"


def check_rowwise_ratios() -> None:
    """On the rowwise commit's job, compute time by recipe: bf16 / rowwise = 6,424 / 5,760 and rowwise /
    tensorwise = (8,532 / 6,667) / (6,424 / 5,760), within 0.02% (its attention share, at local batch 1,
    is not Table 1's); on Table 1's job (batch 2) exactly."""
    from distkit.planner import costs

    cl = planner.cluster("h100-500w", 8, efficiency=0.3)
    rowwise, tensorwise = ROWWISE_TPS / ROWWISE_BF16, 8532 / 6667
    for batch, rel in ((1, 2e-4), (2, 1e-9)):
        t = {r: costs.compute_seconds(cl, rowwise_job(r, batch), 1e6) for r in (None, "rowwise", "tensorwise")}
        assert t[None] / t["rowwise"] == pytest.approx(rowwise, rel=rel), \
            f"batch {batch}: {NOT_ROWWISE_RATIO}: {t[None] / t['rowwise']} vs {rowwise}"
        assert t["rowwise"] / t["tensorwise"] == pytest.approx(tensorwise / rowwise, rel=rel), (batch, t)


def test_float8_rowwise_speeds_up_by_its_measured_ratio(capsys, monkeypatch):
    """``--float8 rowwise``: the whole-step ratio 6,424 / 5,760 over compiled bf16 (torchtitan 3537666a's
    Llama 3 8B runs), turned into a factor outside attention as Table 1's are: with compile's
    6,667 / 5,762, S = 1.1571 x 1.1153 and S' = (1 - A) / (1 / S - A), A the attention share of Table
    1's job by hand (as in the flags test above), 1.394 against tensorwise's 1.689. On the commit's own
    job a rowwise plan computes 6,424 / 5,760 faster than bf16 and (8,532 / 6,667) / (6,424 / 5,760)
    slower than tensorwise (:func:`check_rowwise_ratios`); through ``plan.py`` its tokens/s lie between
    theirs, the header and JSON name the recipe, and its saved activations are tensorwise's (the same
    memory factor). Negative control: the recipe ignored (rowwise planned at tensorwise's ratio)
    fails the ratios."""
    from distkit.planner import published_check as pc

    assert pc.FLOAT8_ROWWISE_SPEEDUP == 6424 / 5760 and pc.FLOAT8_SPEEDUPS == {
        "tensorwise": 8532 / 6667, "rowwise": 6424 / 5760}
    cl = planner.cluster("h100-500w", 8, efficiency=0.3)
    h, L, s = 4096, 32, 8192
    matmul_params = 8_030_261_248 - 128256 * h
    recompute = 2 * L * h * (h * 8 // 32 + h + 14336)
    f = planner.matmul_factor(cl, rowwise_job(None, 2), 2 * s)
    share = 12 * L * h * s / ((6 * matmul_params + recompute) / f + 12 * L * h * s)
    whole = 6667 / 5762 * (6424 / 5760)
    assert pc.linear_speedup(rowwise_job("rowwise")) == pytest.approx((1 - share) / (1 / whole - share), rel=1e-9)
    assert 1.39 < pc.linear_speedup(rowwise_job("rowwise")) < 1.40 < 1.68 < pc.linear_speedup(rowwise_job("tensorwise"))
    check_rowwise_ratios()
    from distkit.planner import costs
    assert costs.activation_bytes(rowwise_job("rowwise"), 32, 1) == costs.activation_bytes(rowwise_job("tensorwise"),
                                                                                             32, 1)
    plan = load_script(BENCH / "plan.py")
    argv = ["--model", "llama-3.1-8b", "--seq-len", "8192", "--global-batch", "8", "--gpus", "8", "--gpu",
            "h100-500w", "--activation-checkpointing", "titan-op", "--strategies", "fsdp_full_shard", "--compile"]
    tps = {}
    for flags in ([], ["--float8", "rowwise"], ["--float8"]):
        plan_main(plan, [*argv, *flags, "--json"])
        out = json.loads(capsys.readouterr().out)
        tps[" ".join(flags)] = out["strategies"][0]["tokens_per_s_per_gpu"]
        assert out["plan"]["float8_recipe"] == {0: None, 1: "tensorwise", 2: "rowwise"}[len(flags)], out["plan"]
    assert tps[""] < tps["--float8 rowwise"] < tps["--float8"], tps
    plan_main(plan, [*argv, "--float8", "rowwise"])
    header = capsys.readouterr().out.splitlines()[:2]
    assert "torch.compile, Float8 rowwise" in header[0] and "for compile+Float8 rowwise, Table 1's and torchtitan " \
        f"3537666a's x {whole:.3g} on its whole step" in header[1], header
    monkeypatch.setitem(pc.FLOAT8_SPEEDUPS, "rowwise", pc.FLOAT8_SPEEDUP)
    with pytest.raises(AssertionError, match=NOT_ROWWISE_RATIO):
        check_rowwise_ratios()


@pytest.mark.parametrize("args,expected", [
    (["--float8", "blockwise"], "argument --float8: invalid choice: 'blockwise'"),
    (["--float8", "rowwise", "--precision", "fp32"], "--float8 runs the linear layers of a bf16 job"),
    (["--float8", "--precision", "fp32"], "--float8 runs the linear layers of a bf16 job"),
])
def test_a_float8_recipe_the_planner_cannot_plan_is_one_error_line(args, expected):
    """``--float8 [RECIPE]``: a recipe other than tensorwise or rowwise is argparse's one ``error:`` line,
    Float8 in an fp32 job the planner's (its factors were measured in bf16 jobs). A ``Plan`` given a
    recipe without Float8 is refused too, in one line naming the flag that plans it. Controls: the
    old ``--float8`` still parses as tensorwise, ``--float8 rowwise`` as rowwise."""
    plan = load_script(BENCH / "plan.py")
    job = ["--model", "llama-3.1-8b", "--gpus", "8", "--strategies", "fsdp_full_shard"]
    result = parse_args_result(plan, *job, *args)
    if result.returncode == 0:
        with pytest.raises(UsageError, match=re.escape(expected)):
            plan.main([*job, *args])
    else:
        assert result.returncode == 2
        assert_one_line_error(result, expected)
    with pytest.raises(UsageError, match=re.escape("set float8 too (plan.py --float8 rowwise)")) as refused:
        planner.Plan(LLAMA_8B, 8, float8_recipe="rowwise")
    assert "\n" not in str(refused.value)
    with pytest.raises(UsageError, match="float8_recipe must be one of tensorwise, rowwise"):
        planner.Plan(LLAMA_8B, 8, float8=True, float8_recipe="blockwise")
    assert plan.parse_args([*job, "--float8"]).float8 == "tensorwise"
    assert plan.parse_args([*job, "--float8", "rowwise"]).float8 == "rowwise"


# The June 2025 Async TP file's Float8 rowwise runs, the rows counted in no error: label, tokens/s.
ROWWISE_EXCLUDED = {
    "llama-3.1-70b 256xh100-500w dp_shard=32 tp=8 s=8192 b=16 compile+float8-rowwise+compiled-loss": 599.6,
    "llama-3.1-70b 256xh100-500w dp_shard=32 tp=8 s=8192 b=16 compile+float8-rowwise+asynctp+compiled-loss": 624.8,
    "llama-3.1-8b 64xh100-500w dp_shard=8 tp=8 s=8192 b=12 compile+float8-rowwise+compiled-loss": 3708.5,
    "llama-3.1-8b 64xh100-500w dp_shard=8 tp=8 s=8192 b=12 compile+float8-rowwise+asynctp+compiled-loss": 3914.9,
}


NOT_THE_FOUR = "the excluded rows are not the four Float8 rowwise runs"


def check_exclusions(rows: list[dict]) -> None:
    """Exactly :data:`ROWWISE_EXCLUDED` is excluded, each row planned (its prediction and error) with
    the reason: the file's note on its TP rowwise baseline, and each run gaining at most 0.4% over the
    bf16 run of its job (the 8B's slower), where the recipe gains 11.5% on FSDP. Every other row is a
    calibration or validation row: 18 of each."""
    from distkit.planner.published import ASYNC_FILE, CALIBRATION, VALIDATION
    from distkit.planner.published_check import FLOAT8_ROWWISE_SPEEDUP

    excluded = {r["label"]: r for r in rows if r["role"] == "excluded"}
    assert {label: r["tps"] for label, r in excluded.items()} == ROWWISE_EXCLUDED, \
        f"{NOT_THE_FOUR}: {sorted(excluded)}"
    measured = {r["label"]: r["tps"] for r in rows}
    for label, r in excluded.items():
        assert r["source"].startswith(ASYNC_FILE) and r["tps_err"] == pytest.approx(r["tps_pred"] / r["tps"] - 1)
        assert "the low baseline performance of the vanilla TP float8 rowwise training is being addressed" \
            in r["reason"]
        assert r["tps"] / measured[label.replace("float8-rowwise+", "")] < 1.004 and FLOAT8_ROWWISE_SPEEDUP > 1.115
    roles = [r["role"] for r in rows]
    assert (roles.count("calibration"), roles.count("validation"), len(rows)) == (len(CALIBRATION), len(VALIDATION),
                                                                                   18 + 18 + 4), roles


def test_exactly_the_four_float8_rowwise_rows_are_excluded_and_why(published):
    """The Async TP file's four Float8 rowwise runs are planned (with ``--float8 rowwise``: each between
    its job's bf16 and tensorwise predictions) and shown with their errors, and they alone are
    counted in no error (:func:`check_exclusions`); the summary gives the validation's tokens/s with
    them too, recomputed here (median 13.3%, worst 45%: the 8B rows 39% and 45% fast), and the table
    prints the reason. Negative controls: the worst validation row moved among the excluded fails the
    pin; the four counted as validation rows miss the validation bound (worst 45% > 30%)."""
    pc, rows = published
    check_exclusions(rows)
    check_published_bounds(rows)
    pred = {r["label"]: r["tps_pred"] for r in rows}
    for label in ROWWISE_EXCLUDED:
        assert pred[label.replace("float8-rowwise+", "")] < pred[label] < pred[label.replace("-rowwise", "")], label
    s = pc.summary(rows)
    errors = [abs(r["tps_err"]) for r in rows if r["role"] in ("validation", "excluded")]
    assert s["tps_with_excluded"] == (statistics.median(errors), max(errors), 22)
    assert s["tps_validation"][2] == 18 and s["tps_with_excluded"][1] > 0.3 > s["tps_validation"][1]
    table = pc.published_table(rows)
    reason = next(r["reason"] for r in rows if r["role"] == "excluded")
    assert f'excluded: 4 rows, planned, counted only in the figures "with the excluded rows" below: {reason}' in table
    assert "with the excluded rows: median {:.1%}, worst {:.1%} (22 rows)".format(*s["tps_with_excluded"]) in table
    worst = max((r for r in rows if r["role"] == "validation"), key=lambda r: abs(r["tps_err"]))
    with pytest.raises(AssertionError, match=NOT_THE_FOUR):
        check_exclusions([{**r, "role": "excluded", "reason": reason} if r is worst else r for r in rows])
    with pytest.raises(AssertionError, match=re.escape(VALIDATION_BOUND)):
        check_published_bounds([{**r, "role": "validation"} if r["role"] == "excluded" else r for r in rows])


def test_the_gpu_table_has_the_pcie_h100_by_its_datasheet():
    """``--gpu h100-pcie``: the PCIe card's dense bf16 peak is half its sparse 1,513 TFLOP/s, its HBM2e
    2.0 TB/s, and 8 of them all-reduce over PCIe (its NVLink bridge joins pairs only); a CUDA device
    named "NVIDIA H100 PCIe" is planned as it. Control: the SXM's name maps to the SXM."""
    pcie, sxm = planner.GPUS["h100-pcie"], planner.GPUS["h100"]
    assert pcie.peak_flops["bf16"] == 1513e12 / 2 // 1e12 * 1e12 and pcie.hbm_bandwidth == 2.0e12
    assert pcie.intra.bandwidth < sxm.intra.bandwidth / 5 and pcie.compute_factor == 1.0
    assert planner.gpu_type("NVIDIA H100 PCIe") == "h100-pcie" and planner.gpu_type("NVIDIA H100 80GB HBM3") == "h100"


# ---------------------------------------------------------------- matmul efficiency by size


def gemm_by_hand(m: float, n: float, k: float, peak: float, hbm: float, w: float = 2.0) -> tuple[float, float]:
    """(seconds at the plateau F / P, seconds) of an m x k by k x n GEMM: t0 + max(F / P, B / W) with the
    constants :func:`test_a_gemms_time_is_the_roofline_and_a_latency_from_xlas_h100_table` solves, P and
    W the same fractions of ``peak`` and ``hbm`` as on the H100."""
    from distkit.planner import gemm

    t0, p_frac, w_frac = gemm.constants()
    flops, moved = 2 * m * n * k, w * (m * k + k * n + m * n)
    return flops / (p_frac * peak), t0 + max(flops / (p_frac * peak), moved / (w_frac * hbm))


def test_a_gemms_time_is_the_roofline_and_a_latency_from_xlas_h100_table():
    """A GEMM takes t0 + max(F / P, B / W): three entries of XLA's measured bf16 table for the H100
    (sm_90) fix the constants, by hand here: 256^3 at 6.45 TFLOP/s and 4096 x 4096 x 256 at 392 are
    memory-bound (their times differ by their bytes over W: W = 2.24 TB/s, then t0 = 5.0 us), 4096^3
    at 783 compute-bound (P = 806 TFLOP/s, 0.815 of the SXM's 989), and each is on the branch it was
    solved on. Five other entries of the table are predicted within 14%. Negative controls: the
    form without the call time t0 (1024^3 predicted 3x fast), and without the memory term (2048 x
    512 x 2048, a k projection's shape, 16% fast) miss them."""
    from distkit.planner import gemm

    assert gemm.XLA_TABLE.startswith("tensorflow/tensorflow third_party/xla/xla/service/gpu/model/"
                                      "matmul_interpolator_data.h at commit 372d578b")

    def measured(shape):
        return 2 * math.prod(shape) / {**gemm.FIT_POINTS, **gemm.CHECKS}[shape]

    def moved(m, n, k):
        return 2 * (m * k + k * n + m * n)
    small, big, thin = (256, 256, 256), (4096, 4096, 4096), (4096, 4096, 256)
    w = (moved(*thin) - moved(*small)) / (measured(thin) - measured(small))
    t0 = measured(small) - moved(*small) / w
    p = 2 * 4096 ** 3 / (measured(big) - t0)
    assert gemm.constants() == pytest.approx((t0, p / 989e12, w / 3.35e12), rel=1e-12)
    assert 4.9e-6 < t0 < 5.1e-6 and 805e12 < p < 808e12 and 2.2e12 < w < 2.3e12
    for shape, memory_bound in ((small, True), (thin, True), (big, False)):
        assert (moved(*shape) / w > 2 * math.prod(shape) / p) == memory_bound, shape
    cl, job = planner.cluster("h100", 8), planner.Plan(LLAMA_1B, 8)
    for shape in gemm.CHECKS:
        assert abs(gemm.gemm_seconds(cl, job, *shape) / measured(shape) - 1) < 0.14, shape
        assert gemm_by_hand(*shape, 989e12, 3.35e12)[1] == pytest.approx(gemm.gemm_seconds(cl, job, *shape))
    no_latency = gemm_by_hand(1024, 1024, 1024, 989e12, 3.35e12)[1] - t0
    no_memory = t0 + gemm_by_hand(2048, 512, 2048, 989e12, 3.35e12)[0]
    assert no_latency < measured((1024, 1024, 1024)) / 3 and no_memory < 0.86 * measured((2048, 512, 2048))


def matmul_factor_by_hand(gemms: list[tuple], peak: float, hbm: float) -> float:
    """(sum F / P) / (sum t) over ``gemms`` (m, n, k, count), :func:`gemm_by_hand`."""
    times = [(count * gemm_by_hand(m, n, k, peak, hbm)[0], count * gemm_by_hand(m, n, k, peak, hbm)[1])
             for m, n, k, count in gemms]
    return sum(t for t, _ in times) / sum(t for _, t in times)


def llama_gemms(cfg, tokens: int, tp: int = 1) -> list[tuple]:
    """The Llama's GEMMs, written out: per block q (h x h / tp), k and v (h x kv / tp), o (h / tp x h),
    gate and up (h x I / tp), down (I / tp x h), and the LM head (h x vocabulary / tp), at ``tokens``
    rows."""
    h, kv, inter, t = cfg.n_embd, theory.kv_width(cfg), cfg.intermediate_size, tokens
    block = [(t, h / tp, h), (t, kv / tp, h), (t, kv / tp, h), (t, h, h / tp), (t, inter / tp, h), (t, inter / tp, h),
             (t, h, inter / tp)]
    return [(*shape, cfg.n_layer) for shape in block] + [(t, cfg.vocab_size / tp, h, 1)]


def test_small_gemms_slow_small_jobs_and_narrow_tp_shards(monkeypatch):
    """A job's linear layers run at the FLOP-weighted fraction of the large-matrix rate their GEMMs
    reach, recomputed here from the written-out shapes: Llama 3.2 1B at 2,048 tokens per micro-batch
    on an H100 0.92 (its k and v projections, 2048 x 512 x 2048, are memory- and call-bound), Llama
    3.1 8B at Table 1's 16,384 tokens on its H100s 0.997 (the plateau the calibration rows sit on),
    the 8B's TP shards over 8 GPUs at 8,192 tokens 0.89; an L4 (assumed: the H100's fractions of its
    own peak and HBM bandwidth, its own latency) reaches 0.99 on the 1B at 8,192 tokens, its slow
    tensor cores making the call time and the memory small beside the compute; CPU ranks 1 (their
    calibration measures their own matmuls). In a plan: a 1B on 4 x 24 GB GPUs with 2k sequences,
    context parallelism over 4 cuts each sequence into 512-token GEMMs, and its compute is that
    much longer than ZeRO-2's (1.24x), by hand; the best N-D layout no longer splits the sequences (it
    did at the plateau). Negative control: the factor set to 1 (the large-matrix rate for every size) misses
    the hand count and brings the N-D layout's CP back."""
    from distkit.planner import costs, gemm

    llama_8b = replace(LLAMA_8B, seq_len=8192)
    cases = [("h100", LLAMA_1B, 2048, 1, 989e12, 3.35e12, (0.91, 0.92)),
             ("h100-500w", llama_8b, 16384, 1, 912e12, 2.4e12, (0.995, 0.998)),
             ("h100", llama_8b, 8192, 8, 989e12, 3.35e12, (0.88, 0.89)),
             ("l4", LLAMA_1B, 8192, 1, 121e12, 0.3e12, (0.989, 0.991))]
    for gpu, cfg, tokens, tp, peak, hbm, (low, high) in cases:
        factor = gemm.matmul_factor(planner.cluster(gpu, 8), planner.Plan(cfg, 8), tokens, tp, 1, tp)
        assert factor == pytest.approx(matmul_factor_by_hand(llama_gemms(cfg, tokens, tp), peak, hbm), rel=1e-12)
        assert low < factor < high, (gpu, factor)
    cpu = replace(planner.cluster("h100", 8), cores=2)
    assert gemm.matmul_factor(cpu, planner.Plan(LLAMA_1B, 8), 2048) == 1.0

    def plan_1b():
        job = planner.Plan(replace(LLAMA_1B, seq_len=2048), 512)
        cl = planner.override_cluster(planner.cluster("h100", 4), memory_gib=24)
        return job, cl, {e.name: e for e in planner.estimate_all(job, cl)}
    job, cl, est = plan_1b()
    f = {t: gemm.matmul_factor(cl, job, t) for t in (512, 2048)}
    assert f[512] == pytest.approx(matmul_factor_by_hand(llama_gemms(job.model, 512), 989e12, 3.35e12), rel=1e-12)
    att = costs.attention_flops_per_token(job)
    rest = costs._flops_per_token(job) - att
    assert est["cp"].layout["cp"] == 4 and est["zero2"].layout["micro_batch"] == 1
    by_hand = (rest / f[512] + att) / (rest / f[2048] + att)
    assert est["cp"].times["compute_s"] / est["zero2"].times["compute_s"] == pytest.approx(by_hand, rel=1e-9)
    assert 1.2 < by_hand < 1.3 and "cp" not in est["nd"].layout["dims"]
    monkeypatch.setattr(costs, "matmul_factor", lambda *args, **kwargs: 1.0)
    _, _, plateau = plan_1b()
    assert plateau["cp"].times["compute_s"] / plateau["zero2"].times["compute_s"] != pytest.approx(by_hand, rel=1e-3)
    assert "cp=2" in plateau["nd"].layout["dims"]
