"""The two layouts that split a sequence's work other than by layers or matrices: context
parallelism (ring attention over a node's GPUs) and expert parallelism (a mixture of experts'
experts spread over a group), each with data parallelism across the rest of the GPUs."""
from __future__ import annotations

from dataclasses import replace

from .. import predictors, theory
from ..strategies import Strategy
from .costs import (
    _act_dtype_bytes,
    _comm_seconds,
    activation_bytes,
    compute_rate,
    compute_seconds,
    head_working_set,
    per_node,
    state_bytes,
)
from .inputs import Cluster, Plan
from .layouts import Estimate, _data_parallel_layout, _finish, _invalid, fits_memory


def _after_backward_peak(est: Estimate, cluster: Cluster, flat_bytes: float) -> Estimate:
    """``est`` with the moment after backward counted in its peak: every gradient, the optimizer
    state and a flat copy of ``flat_bytes`` gradients being averaged (the chapter scripts' one flat
    all-reduce per group of parameters, divided in place), the activations and the head's working
    set gone (the flat copy a transient of the caching allocator's, :func:`~.layouts.reserved_bytes`)."""
    m = est.memory_bytes
    m["peak"] = max(m["peak"], m["params"] + m["grads"] + m["optimizer"] + flat_bytes)
    m["reserved"] = max(m["reserved"], m["params"] + m["grads"] + m["optimizer"] + cluster.reserve * flat_bytes)
    est.fits = fits_memory(m, cluster)
    return est


def _context_parallel(plan: Plan, cluster: Cluster, cp: int) -> Estimate:
    """Context parallelism (``05-advanced/context_parallel.py``: ring attention) over ``cp`` GPUs of a
    node x ``gpus / cp`` data-parallel replicas. Every GPU holds the whole model state (as DDP,
    theory's ``cp`` prediction) and 1/cp of each of its replica's micro-batch sequences: the
    activations of s/cp tokens per sequence (theory's per-layer bytes at that length), plus, without
    activation checkpointing, the copy of the ring's heads-major attention output that the output
    projection keeps as its input (h per token; SDPA returns O in the projection's layout), and the
    LM head's working set for its s/cp tokens.

    Time: compute is the tokens' FLOPs over all GPUs (zig-zag balances the causal attention). The
    ring passes one rank's K and V per hop, 3cp - 2 hops per layer per micro-batch (cp - 1 forward,
    2cp - 1 backward with dK/dV); a hop's send and receive run at once, so its time is one send's
    (alpha-beta, a group of 2: neighbours). On GPUs each hop hides under the attention of the block
    in hand: exposed = ring - attention compute (its 12 L s d FLOPs per token, half of which a causal
    kernel computes), never below 0; without overlap (CPU) all of it. The gradient all-reduce over
    all GPUs is DDP's (hidden under backward on GPUs). After backward the chapter script averages
    the gradients through one flat copy (:func:`_after_backward_peak`)."""
    n, cfg = cluster.gpus, plan.model
    name, dp = Strategy.CP, n // cp
    if plan.attention == "eager":
        return _invalid(name, {"cp": cp, "dp": dp}, "ring attention is built on flash attention (--attention flash)")
    layout, problem = _data_parallel_layout(plan, dp, name)
    if problem:
        return _invalid(name, {"cp": cp, "dp": dp}, problem)
    layout["cp"] = cp
    micro, accum = layout["micro_batch"], layout["accumulation"]
    pred = predictors.busiest_rank_prediction(Strategy.CP, cfg, n, plan.global_batch, {"cp": cp})
    state = state_bytes(pred["state"], plan)
    scale = 0.5 if plan.precision == "bf16" else 1.0
    w = _act_dtype_bytes(plan)
    compute_s = compute_seconds(cluster, plan, plan.tokens_per_step / n, gemm_tokens=micro * cfg.seq_len // cp)
    attention_s = plan.tokens_per_step / n * 6 * cfg.n_layer * cfg.n_embd * cfg.seq_len / compute_rate(cluster, plan)
    t_ring = _comm_seconds(cluster, pred["comm"], 2, 1 if cp > cluster.gpus_per_node else 2, scale, calls_scale=accum,
                           only=("send",))
    t_grad = _comm_seconds(cluster, pred["comm"], n, per_node(n, 1, cluster.gpus_per_node), scale,
                           only=("all_reduce",))
    if cluster.overlap:
        exposed = max(0.0, t_ring - attention_s) + max(0.0, t_grad - compute_s * 2 / 3)
    else:
        exposed = t_ring + t_grad
    local = replace(plan, model=replace(cfg, seq_len=cfg.seq_len // cp))  # what one rank holds of a sequence
    tokens = micro * local.model.seq_len
    act = activation_bytes(local, cfg.n_layer, micro)
    if plan.ac == "none":  # the output projection's input: a copy of the ring's heads-major output
        act += cfg.n_layer * tokens * cfg.n_embd * w
    head = head_working_set(local, micro)
    est = _finish(name, layout, plan, cluster, state, act, head, compute_s, t_ring + t_grad, exposed, head=head,
                  accumulating=accum > 1)
    return _after_backward_peak(est, cluster, state["grads"])


def _expert_parallel(plan: Plan, cluster: Cluster, ep: int, routing: list | None = None) -> Estimate:
    """Expert parallelism (``05-advanced/expert_parallel.py``) for an MoE model (``--experts``): a
    (dp, ep) mesh, ``ep`` GPUs sharing one copy of the experts, each holding num_experts / ep of them
    with their gradients and optimizer state, the dense parameters (attention, norms, routers,
    embeddings) replicated on all GPUs (theory's ``ep`` prediction). Every GPU routes its own share
    of the batch: its activations are theory's MoE block bytes for the rows it sends and receives,
    balanced routing in a plan (k rows per token each way), a record's own routing when ``routing``
    is given (per rank, per layer, (sent, received); the estimate is then the rank that received
    the most rows, the one deciding the fit).

    Time: compute is the active parameters' FLOPs (theory's FLOPs per token). Each MoE layer runs 5
    all-to-alls over the ep group per micro-batch (the counts, dispatch and combine forward and both
    again backward), on the critical path: a token's expert output is needed before the block goes
    on (alpha-beta with the all_to_all collective; a CPU calibration without an all_to_all sweep uses
    all_reduce's fit). The dense gradients are all-reduced over all GPUs and the experts' over the dp
    GPUs holding the same experts, as DDP does (hidden under backward on GPUs). After backward the
    chapter script averages each group through one flat copy (:func:`_after_backward_peak`)."""
    n, cfg = cluster.gpus, plan.model
    name, dp = Strategy.EP, n // ep
    layout, problem = _data_parallel_layout(plan, n, name)
    if problem:
        return _invalid(name, {"ep": ep, "dp": dp}, problem)
    layout.update(dp=dp, ep=ep)
    micro, accum = layout["micro_batch"], layout["accumulation"]
    knobs = {"ep": ep, **({"routing": routing} if routing else {})}
    pred = predictors.predict(Strategy.EP, cfg, n, plan.global_batch, knobs)
    rank = 0
    if routing:
        rank = max(range(n), key=lambda r: sum(received for _, received in routing[r]))
        layout["rank"] = rank
    state = state_bytes(pred["state_per_rank"][rank], plan)
    comm = pred["comm_per_rank"][rank]
    scale = 0.5 if plan.precision == "bf16" else 1.0
    w = _act_dtype_bytes(plan)
    compute_s = compute_seconds(cluster, plan, plan.tokens_per_step / n, gemm_tokens=micro * cfg.seq_len, ep=ep)
    t_a2a = _comm_seconds(cluster, comm, ep, per_node(ep, 1, cluster.gpus_per_node), scale, calls_scale=accum,
                          only=("all_to_all",))
    dense, per_expert = theory.moe_param_split(theory.param_shapes(cfg), cfg.num_experts)
    held_experts = sum(per_expert[:cfg.num_experts // ep])
    grad_w = 2 if plan.precision == "bf16" else 4
    t_dense = _comm_seconds(cluster, {"all_reduce": {"calls": None, **theory.ddp_bytes(dense, n, grad_w)}}, n,
                            per_node(n, 1, cluster.gpus_per_node))
    t_experts = _comm_seconds(cluster, {"all_reduce": {"calls": None, **theory.ddp_bytes(held_experts, dp, grad_w)}},
                              dp, per_node(dp, ep, cluster.gpus_per_node)) if dp > 1 else 0.0
    t_grad = t_dense + t_experts
    exposed = t_a2a + (max(0.0, t_grad - compute_s * 2 / 3) if cluster.overlap else t_grad)
    if routing:  # the rows this rank routed, layer by layer (a record: one micro-batch)
        act = sum(theory.moe_activation_bytes_per_layer(cfg, micro, plan.ac, received, sent)
                  for sent, received in routing[rank]) * w / 4
    else:
        act = activation_bytes(plan, cfg.n_layer, micro)
    head = head_working_set(plan, micro)
    est = _finish(name, layout, plan, cluster, state, act, head, compute_s, t_a2a + t_grad, exposed, head=head,
                  accumulating=accum > 1)
    return _after_backward_peak(est, cluster, max(dense, held_experts) * grad_w)
