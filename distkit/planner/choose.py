"""Choosing: each strategy's framework overhead, the best layout of one strategy
(:func:`estimate`), every strategy (:func:`estimate_all`), the recommendation (:func:`recommend`),
and the planner's estimate of the layout a benchmark record ran (:func:`estimate_record`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

from .. import compare
from ..errors import UsageError
from ..models import is_moe
from ..strategies import PLANNED, Strategy
from .inputs import Cluster, GiB, Plan
from .layouts import Estimate, _dp_family, _invalid, _pipeline, _tp_fsdp
from .layouts_cp_ep import _context_parallel, _expert_parallel
from .nd import ND, estimate_nd

# a strategy the calibration never saw borrows its family's overhead
OVERHEAD_FAMILY = {Strategy.FSDP_HYBRID_SHARD: Strategy.FSDP_FULL_SHARD, Strategy.HSDP: Strategy.FSDP_FULL_SHARD,
                   Strategy.FSDP_TP_2D: Strategy.TP, Strategy.ZERO3_OFFLOAD: Strategy.ZERO3,
                   Strategy.PP_INTERLEAVED_1F1B: Strategy.PP_1F1B, Strategy.PP_GPIPE: Strategy.PP_1F1B,
                   Strategy.TP_SP: Strategy.TP, Strategy.FSDP_NO_SHARD: Strategy.FSDP_SHARD_GRAD_OP,
                   Strategy.FSDP_TP: Strategy.FSDP_TP_2D, ND: Strategy.FSDP_TP_2D}


# What a strategy's framework overhead grows with: its communication (a hook, a copy in and out per
# collective call), except for the two strategies whose parallelism is Python work per token:
# context parallelism's hand-written ring attention (a few small ops per chunk pair of every layer)
# and expert parallelism's routing (top-k, capacity, regrouping the rows per layer). Measured on the
# 2-core matrix, their extra time follows the compute a rank does (2 -> 4 ranks: about 0.8 and 0.6 x
# compute for EP, 3.8 and 2.5 for CP), not their communication (EP 3.0 and 0.5 x communication).
OVERHEAD_BASIS = {Strategy.CP: "compute_s", Strategy.EP: "compute_s"}


def overhead_basis(strategy: str) -> str:
    """The part of an estimate's time (``comm_s`` or ``compute_s``) whose seconds ``strategy``'s
    framework overhead is calibrated per (:data:`OVERHEAD_BASIS`)."""
    return OVERHEAD_BASIS.get(strategy, "comm_s")


def with_overhead(est: Estimate, cl: Cluster, strategy: str) -> Estimate:
    """``est`` plus the framework overhead the cluster measured for ``strategy`` (CPU calibration):
    its seconds per second of communication x this estimate's communication (a strategy's Python
    work grows with its collectives: one hook, one copy in and out, per call); for context and
    expert parallelism per second of compute instead (:data:`OVERHEAD_BASIS`)."""
    if not cl.overheads or not est.valid:
        return est
    strategy = strategy if strategy in cl.overheads else OVERHEAD_FAMILY.get(strategy, strategy)
    seconds = cl.overheads.get(strategy, 0.0) * est.times[overhead_basis(strategy)]
    est.times["framework_s"] = seconds
    est.step_time_s += seconds
    est.tokens_per_s_per_gpu *= (est.step_time_s - seconds) / est.step_time_s
    return est


# What the search ranks: every planned strategy, then the best N-D layout (:mod:`.nd`).
SEARCHED = (*PLANNED, ND)


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** i for i in range(1, int(math.log2(limit)) + 1)] if limit >= 2 else []


def _best(candidates: list[Estimate]) -> Estimate:
    """The fastest that fits, else the one that needs the least memory (so the reason says by how much)."""
    valid = [c for c in candidates if c.valid]
    if not valid:
        return candidates[0]
    fitting = [c for c in valid if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.step_time_s)
    return min(valid, key=lambda c: c.memory_bytes["peak"])


def estimate(plan: Plan, cluster: Cluster, strategy: str) -> Estimate:
    """The :class:`Estimate` of one of :data:`~distkit.strategies.PLANNED`. ``fsdp_tp`` tries every TP size that is a
    power of two within a node (and splits the heads), the pipelines every power-of-two stage count;
    every strategy also tries halving the micro-batch (more accumulation, fewer activations) when
    ``plan.micro_batch`` does not fit; the fastest that fits is kept (else the smallest)."""
    if strategy not in SEARCHED:
        raise UsageError(f"unknown strategy {strategy!r}; known: {', '.join(SEARCHED)}")
    micro = [plan.micro_batch]
    while micro[-1] > 1:
        micro.append(micro[-1] // 2)
    tried = []
    for m in micro:
        tried.append(_estimate_layouts(replace(plan, micro_batch=m), cluster, strategy))
        if tried[-1].valid and tried[-1].fits:
            break
    return _best(tried)


def _estimate_layouts(plan: Plan, cluster: Cluster, strategy: str) -> Estimate:
    cfg, n = plan.model, cluster.gpus
    if strategy == ND:  # every N-D layout no other row plans: 3+ axes, PP x FSDP, TP x CP, ...
        return with_overhead(estimate_nd(plan, cluster), cluster, ND)
    if strategy == Strategy.FSDP_TP:
        heads = [cfg.n_head, getattr(cfg, "n_kv_head", cfg.n_head)]
        sizes = [t for t in _powers_of_two(min(cluster.gpus_per_node, n))
                 if n % t == 0 and all(h % t == 0 for h in heads)]
        if not sizes:
            return _invalid(strategy, {}, "no TP size: needs 2+ GPUs in a node that split the heads")
        return _best([with_overhead(_tp_fsdp(plan, cluster, t), cluster, Strategy.FSDP_TP_2D if t < n else Strategy.TP)
                      for t in sizes])
    if strategy.startswith("pp_"):
        sizes = [p for p in _powers_of_two(n) if n % p == 0]
        if not sizes:  # say which: a pipeline of 3 stages exists, but the planner sizes them in powers of two
            return _invalid(strategy, {}, "a pipeline needs at least 2 GPUs" if n < 2 else
                            f"no pipeline size: the planner tries 2, 4, 8 ... stages, and none divides {n} GPUs")
        return _best([with_overhead(_pipeline(plan, cluster, strategy[3:], p), cluster, strategy) for p in sizes])
    if strategy == Strategy.CP:  # rings of powers of two within a node, each rank two of the 2cp chunks
        sizes = [c for c in _powers_of_two(min(cluster.gpus_per_node, n))
                 if n % c == 0 and cfg.seq_len % (2 * c) == 0]
        if not sizes:
            return _invalid(strategy, {}, f"no CP size: needs 2+ GPUs in a node whose ring cuts the {cfg.seq_len} "
                                          "tokens into 2 x cp equal chunks")
        return _best([with_overhead(_context_parallel(plan, cluster, c), cluster, strategy) for c in sizes])
    if strategy == Strategy.EP:  # expert groups of powers of two that split the experts
        if not is_moe(cfg):
            return _invalid(strategy, {}, "needs an MoE model (--experts)")
        sizes = [e for e in _powers_of_two(n) if n % e == 0 and cfg.num_experts % e == 0]
        if not sizes:
            return _invalid(strategy, {}, f"no EP size: needs 2+ GPUs that split the {cfg.num_experts} experts")
        return _best([with_overhead(_expert_parallel(plan, cluster, e), cluster, strategy) for e in sizes])
    return with_overhead(_dp_family(strategy, plan, cluster), cluster, strategy)


def estimate_all(plan: Plan, cluster: Cluster, strategies: Iterable[str] | None = None) -> list[Estimate]:
    """:func:`estimate` for every strategy, in :data:`SEARCHED` order (the strategies, then the best N-D
    layout)."""
    strategies = SEARCHED if strategies is None else strategies
    return [estimate(plan, cluster, s) for s in strategies]


# ----------------------------------------------------------------------------------------------
# The recommendation
# ----------------------------------------------------------------------------------------------

# How close two predicted steps must be to be no evidence for either: the step time's median error
# bound that the planner's validation holds it to (20%; the worst cell's is 50%, benchmarks/planner.md
# "Validated against the CPU matrix": the median is the figure a typical prediction earns).
STEP_MEDIAN_ERROR = 0.20


# Simpler first: what a strategy changes beyond replicating the model. Within one family the fastest
# is kept; expert parallelism splits the MoE layers inside a group, as TP splits layers in a node.
SIMPLICITY = {Strategy.DDP: (0, "DDP"), Strategy.FSDP_TP: (2, "TP"), Strategy.EP: (2, "EP"), Strategy.CP: (4, "CP"),
              ND: (5, "N-D")}


WHY_SIMPLER = {0: "nothing is sharded: every GPU runs the whole model, one all-reduce behind backward",
               1: "state is sharded but every layer stays whole and runs as written",
               2: "layers are split inside a node but the step keeps one schedule",
               3: "only the layer sequence is cut; no layer is rewritten",
               4: "one more axis (the sequence over a ring); layers and schedule stay as written"}


def simplicity(name: str) -> tuple[int, str]:
    """``(rank, family)`` of a strategy in the order DDP < ZeRO/FSDP < TP (and EP) < PP < CP < N-D."""
    if name in SIMPLICITY:
        return SIMPLICITY[name]
    return (3, "PP") if name.startswith("pp_") else (1, "ZeRO/FSDP")


@dataclass
class Recommendation:
    """``best``: the configuration to use (None when nothing fits); ``reasons``: strategy -> one line
    on why it was not chosen; ``tie``: when other candidates are predicted within ``bound`` (the step
    time's median error) of the fastest, ``{"bound", "fastest", "within", "picked", "reason"}``: the
    simplest of them was picked, and ``reason`` says why in one line; None for a clear win."""

    best: Estimate | None
    reasons: dict
    tie: dict | None = None


def _slower(ratio: float) -> str:
    """``0.3% slower`` for a near miss (``1.00x`` would read as no difference), ``1.38x slower`` beyond 10%."""
    return f"{ratio - 1:.1%} slower" if ratio < 1.1 else f"{ratio:.2f}x slower"


def _tie(pool: list[Estimate], bound: float) -> tuple[Estimate | None, dict | None]:
    """The pick among ``pool`` (eligible configurations): the fastest, unless others are within
    ``bound`` of it; then the simplest of those (the fastest of its family)."""
    if not pool:
        return None, None
    fastest = min(pool, key=lambda e: e.step_time_s)
    within = [e for e in pool if e.step_time_s <= fastest.step_time_s * (1 + bound)]
    if len(within) == 1:
        return fastest, None
    picked = min(within, key=lambda e: (simplicity(e.name)[0], e.step_time_s))
    rank, family = simplicity(picked.name)
    if picked is fastest:
        reason = f"{picked.name} is the fastest and of the simplest family among them ({family})"
    else:
        reason = (f"{picked.name} ({family}) before {fastest.name} ({simplicity(fastest.name)[1]}), "
                  f"{picked.step_time_s / fastest.step_time_s - 1:.2%} slower by the model: {WHY_SIMPLER[rank]}")
    tie = {"bound": bound, "fastest": str(fastest.name), "within": [str(e.name) for e in within],
           "picked": str(picked.name), "reason": reason}
    return picked, tie


def recommend(estimates: list[Estimate], cluster: Cluster, allow_offload: bool = False,
              tie_bound: float = STEP_MEDIAN_ERROR) -> Recommendation:
    """The top README's decision guide applied to numbers: among the configurations that run, fit
    and train the whole model (LoRA trains adapters only: another job, never picked for full
    training), the fastest; CPU offload only with ``allow_offload`` or when nothing else fits. When
    others are predicted within ``tie_bound`` of the fastest, the prediction cannot tell them apart,
    and the simplest of them is picked (:func:`simplicity`; ``tie_bound=0``: always the fastest)."""
    cap = cluster.capacity_bytes
    eligible = [e for e in estimates if e.valid and e.fits and not e.lora]
    on_gpu = [e for e in eligible if not e.offload]
    pool = eligible if allow_offload else on_gpu
    best, tie = _tie(pool, tie_bound)
    reasons = {}
    for e in estimates:
        if e is best:
            continue
        if not e.valid:
            reasons[e.name] = f"cannot run: {e.note}"
        elif not e.fits:
            reasons[e.name] = _no_fit(e, cap)
        elif e.lora:
            reasons[e.name] = "trains LoRA adapters only (fine-tuning a frozen base): a different job"
        elif e.offload and not allow_offload:
            reasons[e.name] = "fits, but CPU offload was not allowed (--offload)"
        elif best is not None and e.step_time_s < best.step_time_s:
            reasons[e.name] = (f"fits, {best.step_time_s / e.step_time_s:.2f}x faster by the model, within its "
                               f"{tie_bound:.0%} error: {best.name} is simpler")
        elif best is not None:
            reasons[e.name] = f"fits, {_slower(e.step_time_s / best.step_time_s)} ({_why_slower(e, best)})"
    return Recommendation(best, reasons, tie)


def _no_fit(e: Estimate, cap: float) -> str:
    """Why ``e`` does not fit: its tensors, or (when they would) what the caching allocator reserves."""
    m = e.memory_bytes
    if m["peak"] > cap:
        return f"does not fit: {m['peak'] / GiB:.1f} GiB per GPU > {cap / GiB:.1f} GiB usable"
    return (f"does not fit: its {m['peak'] / GiB:.1f} GiB of tensors would have the caching allocator reserve "
            f"about {m['reserved'] / GiB:.1f} GiB > {cap / GiB:.1f} GiB usable")


def _why_slower(e: Estimate, best: Estimate) -> str:
    """The part of the step that grew the most against the recommendation."""
    parts = {"exposed communication": "exposed_comm_s", "pipeline bubble": "bubble_s", "optimizer step": "optimizer_s",
             "compute": "compute_s"}
    label, _ = max(parts.items(), key=lambda kv: e.times.get(kv[1], 0) - best.times.get(kv[1], 0))
    return f"more {label}"


# ----------------------------------------------------------------------------------------------
# Validation: every matrix cell, predicted vs measured
# ----------------------------------------------------------------------------------------------

# A benchmark strategy -> the planner's estimate of it (layout fixed by the record, not chosen).
def plan_of_record(record: dict) -> Plan:
    """The :class:`Plan` a benchmark record ran: fp32 AdamW, its model and global batch, no AC, a
    data-parallel rank's share of the batch as one micro-batch (the pipeline: its micro-batches;
    context parallelism: a ring's whole share, 1/cp of each of its sequences on each rank)."""
    cfg = compare.config_of_record(record)
    config = record.get("config", {})
    batch = int(config["global_batch_size"])
    knobs = compare.knobs_of_record(record)
    dp = record["world_size"]
    if record["strategy"] in (Strategy.TP, Strategy.TP_SP) or record["strategy"].startswith("pp_"):
        dp = 1
    elif record["strategy"] == Strategy.FSDP_TP_2D:
        dp = record["world_size"] // int(knobs.get("tp", 2))
    elif record["strategy"] == Strategy.CP:
        dp = record["world_size"] // int(knobs.get("cp", record["world_size"]))
    return Plan(cfg, global_batch=batch, micro_batch=max(1, batch // dp), precision="fp32", optimizer="adamw",
                microbatches=knobs.get("microbatches"))


def estimate_record(record: dict, cl: Cluster) -> Estimate:
    """The planner's :class:`Estimate` of the cell a record measured, with the record's own layout
    (mesh, micro-batches, CP ring size, EP group size and, for expert parallelism, the routing the
    record counted) rather than the planner's choice."""
    plan = plan_of_record(record)
    strategy = record["strategy"]
    knobs = compare.knobs_of_record(record)
    n = record["world_size"]
    cl = replace(cl, gpus=n, gpus_per_node=n)
    if strategy in (Strategy.DDP, Strategy.DDP_FROM_SCRATCH, Strategy.FSDP_NO_SHARD):
        est = _dp_family(strategy, plan, cl)
    elif strategy == Strategy.ZERO0:
        est = _dp_family(Strategy.DDP, plan, cl)
    elif strategy in (Strategy.FSDP_HYBRID_SHARD, Strategy.HSDP):
        est = _dp_family(Strategy.FSDP_HYBRID_SHARD, plan, replace(cl, gpus_per_node=int(knobs.get("shard", 2))))
    elif strategy in (Strategy.TP, Strategy.TP_SP):
        est = _tp_fsdp(plan, cl, n, sp=strategy == Strategy.TP_SP)
    elif strategy == Strategy.FSDP_TP_2D:
        est = _tp_fsdp(plan, cl, int(knobs.get("tp", 2)))
    elif strategy.startswith("pp_"):
        est = _pipeline(plan, cl, strategy[3:], n * 1, stages_per_rank=int(knobs.get("stages_per_rank", 2)))
    elif strategy == Strategy.CP:
        est = _context_parallel(plan, cl, int(knobs.get("cp", n)))
    elif strategy == Strategy.EP:  # the record's routing: the rows each rank sent and received
        est = _expert_parallel(plan, cl, int(knobs.get("ep", n)), knobs.get("routing"))
    elif strategy in PLANNED:
        est = _dp_family(strategy, plan, cl)
    else:
        raise ValueError(f"no planner model for {strategy!r}")
    est.name = strategy
    return with_overhead(est, cl, strategy)
