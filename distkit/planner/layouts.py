"""One :class:`Estimate` per configuration: each family of strategies laid out on the cluster (data
parallel and sharded, TP x FSDP, the pipelines, context and expert parallelism), with its memory
per GPU, whether it fits, its step time and what of its communication is exposed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import predictors, theory
from ..strategies import Strategy
from .costs import (
    PARTS,
    _act_dtype_bytes,
    _comm_seconds,
    activation_bytes,
    compute_seconds,
    core_share,
    head_working_set,
    per_node,
    state_bytes,
)
from .inputs import Cluster, Plan, _block_params

# ----------------------------------------------------------------------------------------------
# One estimate per configuration
# ----------------------------------------------------------------------------------------------

@dataclass
class Estimate:
    """One configuration: ``name`` (the strategy), ``layout`` (dp/tp/pp/shard sizes, micro-batches),
    ``memory_bytes`` per GPU by :data:`PARTS` (+ ``total``), ``fits``, ``step_time_s`` and its parts
    (``compute_s``, ``comm_s`` (all communication), ``exposed_comm_s`` (what compute does not hide),
    ``bubble_s``, ``optimizer_s``), ``tokens_per_s_per_gpu``, ``note`` (why it cannot run, when it
    cannot: ``valid`` is then False)."""

    name: str
    layout: dict
    memory_bytes: dict
    fits: bool
    step_time_s: float
    tokens_per_s_per_gpu: float
    times: dict = field(default_factory=dict)
    valid: bool = True
    note: str = ""
    offload: bool = False
    lora: bool = False

    def to_json(self) -> dict:
        return {"name": self.name, "valid": self.valid, "fits": self.fits, "layout": self.layout,
                "memory_bytes": self.memory_bytes, "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "times_s": self.times, "note": self.note}


def _invalid(name: str, layout: dict, note: str) -> Estimate:
    return Estimate(name, layout, {p: math.nan for p in (*PARTS, "total", "peak", "reserved")}, False, math.inf, 0.0,
                    valid=False, note=note)


def peak_bytes(memory: dict, head: float, accumulating: bool) -> float:
    """The step's peak, the larger of its two high-water moments. Top of backward (where
    MemTracker finds the peak of every CPU matrix cell): parameters, optimizer state, every
    activation, the temporaries; no gradients yet (``zero_grad(set_to_none=True)``), unless
    earlier micro-batches of an accumulation left theirs. End of backward: every gradient, the
    activations freed, the buffers kept (the head's working set gone)."""
    top = memory["params"] + memory["optimizer"] + memory["activations"] + memory["temporaries"]
    if accumulating:
        top += memory["grads"]
    end = memory["params"] + memory["grads"] + memory["optimizer"] + memory["temporaries"] - head
    return max(top, end)


def reserved_bytes(memory: dict, head: float, accumulating: bool, held: float, reserve: float) -> float:
    """What the CUDA caching allocator holds at the step's peak (``torch.cuda.max_memory_reserved``,
    the figure torchtitan publishes), from the tensors counted at :func:`peak_bytes`' two moments:
    the model state and the ``held`` temporaries (allocated once per step and kept to its end: a
    pipeline stage's gathered weights and accumulated gradients, DDP's flat gradient copy) at their
    size, and everything made and freed inside forward and backward (activations, the loss's working
    set, the gathered blocks) times ``reserve``: the cached free blocks and the splits around them
    that the allocator keeps. ``reserve`` is fitted on torchtitan's published H100 runs
    (:data:`~.inputs.FITTED_RESERVE`); 1 on CPU ranks, which have no caching allocator."""
    state = memory["params"] + memory["optimizer"]
    top_state = state + (memory["grads"] if accumulating else 0.0) + held
    top = top_state + reserve * (memory["activations"] + memory["temporaries"] - held)
    end = state + memory["grads"] + held + reserve * (memory["temporaries"] - head - held)
    return max(top, end)


def fits_memory(memory: dict, cluster) -> bool:
    """Whether the step fits a GPU: what the caching allocator reserves at its peak
    (:func:`reserved_bytes`; the tensors themselves on CPU ranks) within the usable memory."""
    return memory["reserved"] <= cluster.capacity_bytes


def _finish(name, layout, plan, cluster, state, act, temp, compute_s, comm_s, exposed_s, bubble_s=0.0,
            optimizer_s=None, head=0.0, accumulating=False, held=0.0, **flags) -> Estimate:
    memory = {**state, "activations": act, "temporaries": temp}
    memory["total"] = sum(memory[p] for p in PARTS)
    memory["peak"] = peak_bytes(memory, head, accumulating)
    memory["reserved"] = reserved_bytes(memory, head, accumulating, held, cluster.reserve)
    if optimizer_s is None:  # read and write every state byte once: memory-bound
        optimizer_s = 2 * sum(state.values()) / cluster.gpu.hbm_bandwidth
    step = compute_s + bubble_s + exposed_s + optimizer_s
    times = {"compute_s": compute_s, "bubble_s": bubble_s, "comm_s": comm_s, "exposed_comm_s": exposed_s,
             "optimizer_s": optimizer_s}
    return Estimate(name, layout, memory, fits_memory(memory, cluster), step,
                    plan.tokens_per_step / cluster.gpus / step, times, **flags)


def _data_parallel_layout(plan: Plan, dp: int, name: str) -> tuple[dict, str | None]:
    per_replica = plan.global_batch / dp
    if per_replica < 1 or per_replica != int(per_replica):
        return {}, f"the global batch {plan.global_batch} does not split over {dp} data-parallel ranks"
    micro = min(plan.micro_batch, int(per_replica))
    if per_replica % micro:
        return {}, f"{int(per_replica)} sequences per rank do not split into micro-batches of {micro}"
    return {"dp": dp, "micro_batch": micro, "accumulation": int(per_replica) // micro}, None


def _dp_family(name: str, plan: Plan, cluster: Cluster) -> Estimate:
    """DDP, ZeRO-1/2/3 (+ offload), FSDP SHARD_GRAD_OP / FULL_SHARD / HYBRID_SHARD, LoRA with FSDP:
    every GPU a data-parallel rank, accumulation over micro-batches of ``plan.micro_batch``. One
    function for the whole family, and so a long one, because its members share the layout, the
    state and activation bytes and the compute time, and differ only in a few lines (the buffers each
    keeps at the top of backward, which collectives it can hide): side by side, they compare."""
    n, cfg = cluster.gpus, plan.model
    layout, problem = _data_parallel_layout(plan, n, name)
    if problem:
        return _invalid(name, {"dp": n}, problem)
    theory_name = {Strategy.LORA_FSDP: Strategy.FSDP_FULL_SHARD}.get(name, name)
    knobs = {}
    if name == Strategy.FSDP_HYBRID_SHARD:
        knobs["shard"] = cluster.gpus_per_node if n % cluster.gpus_per_node == 0 else n
        layout["shard"] = knobs["shard"]
    if name == Strategy.FSDP_NO_SHARD:
        knobs["shard"] = 1
    if name.startswith("zero3"):
        knobs["stage3_max_live_parameters"] = 1e9  # DeepSpeed's default window
    pred = predictors.busiest_rank_prediction(theory_name, cfg, n, plan.global_batch, knobs)
    psi = pred["param_count"]
    zero = name.startswith("zero") and name != Strategy.ZERO0
    state = state_bytes(pred["state"], plan, zero=zero)
    if name == Strategy.ZERO1:  # theory counts at the optimizer step; through backward ZeRO-1 holds every gradient
        state["grads"] = psi * (2 if plan.precision == "bf16" else 4)
    lora = name == Strategy.LORA_FSDP
    if lora:  # frozen base, sharded; adapters (r x (d_in + d_out) per adapted matrix) replicated-ish
        shapes = theory.param_shapes(cfg)
        adapters = sum(plan.lora_rank * (s[0] + s[1]) for k, s in shapes.items()
                       if len(s) == 2 and k.split(".")[-2] in plan.lora_targets)
        w = _act_dtype_bytes(plan)
        state = {"params": pred["state"]["params"] / 4 * w + adapters / n * 4,
                 "grads": adapters / n * 4,
                 "optimizer": adapters / n * {"adamw": 8, "sgd": 4}[plan.optimizer]}
        layout["adapter_params"] = adapters
    offload = name.endswith("_offload")
    micro, accum = layout["micro_batch"], layout["accumulation"]
    # fp32 gathers/reductions of theory; bf16 gathers move half, gradient reductions in bf16 too
    scale = 0.5 if plan.precision == "bf16" else 1.0
    shard_group = knobs.get("shard", n)
    gpn = cluster.gpus_per_node
    in_node = per_node(n, 1, gpn)
    comm = pred["comm"]
    compute_s = compute_seconds(cluster, plan, plan.tokens_per_step / n, lora, micro * cfg.seq_len)
    backward_s = compute_s * 2 / 3
    w = _act_dtype_bytes(plan)
    act = activation_bytes(plan, cfg.n_layer, micro)
    head = head_working_set(plan, micro)
    unit = _block_params(cfg)
    root = psi - unit * cfg.n_layer
    grad_w = 2 if plan.precision == "bf16" else 4
    if name in (Strategy.DDP, Strategy.DDP_FROM_SCRATCH):
        # DDP's buckets: a flat copy of every gradient (torch's default gradient_as_bucket_view=False);
        # the from-scratch version all-reduces each gradient in place
        temp = head + (state["grads"] if name == Strategy.DDP else 0)
        t_grad = _comm_seconds(cluster, comm, n, in_node, scale)
        exposed = max(0.0, t_grad - backward_s) if cluster.overlap else t_grad
        comm_s = t_grad
    elif name in (Strategy.ZERO1, Strategy.ZERO2):
        # DeepSpeed's flat gradient buffers: ZeRO-2 keeps the reduced partition (Ψ/n), ZeRO-1 two
        # partition-sized buffers (2Ψ/n, measured by MemTracker at 2 and 4 ranks on both models),
        # at most a bucket of reduce_bucket_size = 5e8 elements
        temp = head + min(2 * psi / n if name == Strategy.ZERO1 else psi / n, 5e8) * grad_w
        t_grad = _comm_seconds(cluster, comm, n, in_node, scale, only=("all_reduce", "reduce_scatter"))
        t_gather = _comm_seconds(cluster, comm, n, in_node, scale, only=("all_gather",))
        if name == Strategy.ZERO2:
            t_grad *= accum
        exposed = (max(0.0, t_grad - backward_s) if cluster.overlap else t_grad) + t_gather
        comm_s = t_grad + t_gather
    else:  # FSDP / ZeRO-3 / LoRA: gathers and reduce-scatters per micro-batch, prefetched under compute
        # At the top of backward: FULL_SHARD / HYBRID hold the root unit and the last block
        # unsharded (in the compute dtype) plus the all-gather buffer they came from (on GPUs the
        # prefetched next block's too); SHARD_GRAD_OP keeps every unit unsharded from forward to
        # backward. ZeRO-3 reduces into a gradient partition buffer. Gathered copies count as
        # temporaries here (MemTracker files them under parameters): "params" stays the held shard.
        gathers = 2 if cluster.overlap else 1
        if name.startswith("zero3"):
            temp = head + psi / n * grad_w
        elif name in (Strategy.FSDP_SHARD_GRAD_OP, Strategy.FSDP_NO_SHARD):
            temp = head + psi * w
        else:
            temp = head + (unit + root) * w + gathers * unit * w
        shard_in_node = per_node(shard_group, 1, gpn)
        t_shard = _comm_seconds(cluster, comm, shard_group, shard_in_node, scale, only=("all_gather", "reduce_scatter"))
        if lora:  # frozen base: gathers only (reduce-scatters carry the adapters' few gradients)
            t_shard = _comm_seconds(cluster, comm, shard_group, shard_in_node, scale, only=("all_gather",))
        # the replicas of a shard are shard_group ranks apart
        t_rep = _comm_seconds(cluster, comm, n // shard_group, per_node(n // shard_group, shard_group, gpn), 1.0,
                              only=("all_reduce",))
        t_total = (t_shard + t_rep) * accum
        first = t_shard * accum / max(2 * cfg.n_layer + 1, 1)  # the first gather is never hidden
        exposed = (max(first, t_total - compute_s) if cluster.overlap else t_total)
        comm_s = t_total
    optimizer_s = None
    if offload:  # gradients down, weights up over the host link; the optimizer runs on the CPU
        moved = (state["grads"] + state["params"])
        optimizer_s = moved / cluster.gpu.host_link + state["optimizer"] / 12 * 16 / 10e9
        if not cluster.cores:  # on CPU ranks the "host" memory is the same memory: nothing leaves
            state = {**state, "optimizer": 0.0}
    # DDP's buckets and DeepSpeed's flat gradient buffers are allocated once and reused every step;
    # FSDP's gathered units are made and freed each step
    held = temp - head if name in (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2) or name.startswith("zero3") else 0.0
    return _finish(name, layout, plan, cluster, state, act, temp, compute_s, comm_s, exposed, head=head,
                   accumulating=accum > 1, held=held,
                   optimizer_s=optimizer_s, offload=offload, lora=lora)


def _tp_fsdp(plan: Plan, cluster: Cluster, tp: int, sp: bool = False) -> Estimate:
    """Megatron TP over ``tp`` GPUs of a node (per block: 2 all-reduces of ``b x s x h`` forward, 2
    backward, on the critical path), FSDP FULL_SHARD of each TP shard over the ``gpus / tp``
    data-parallel ranks (theory's ``fsdp_tp_2d``; pure ``tp`` when they are 1)."""
    n, cfg = cluster.gpus, plan.model
    name = Strategy.FSDP_TP
    dp = n // tp
    layout, problem = _data_parallel_layout(plan, dp, name)
    if problem:
        return _invalid(name, {"tp": tp, "dp": dp}, problem)
    layout["tp"] = tp
    micro, accum = layout["micro_batch"], layout["accumulation"]
    if dp == 1:
        pred = predictors.busiest_rank_prediction(Strategy.TP_SP if sp else Strategy.TP, cfg, tp, plan.global_batch)
    else:
        pred = predictors.busiest_rank_prediction(Strategy.FSDP_TP_2D, cfg, n, plan.global_batch, {"tp": tp})
    state = state_bytes(pred["state"], plan)
    scale = 0.5 if plan.precision == "bf16" else 1.0
    tp_comm = pred["comm"] if dp == 1 else theory.megatron_tp_bytes(cfg, plan.global_batch // dp, tp)
    t_tp = _comm_seconds(cluster, tp_comm, tp, per_node(tp, 1, cluster.gpus_per_node), scale, calls_scale=accum)
    fsdp_comm = {k: v for k, v in pred["comm"].items() if k != "all_reduce"} if dp > 1 else {}
    # the data-parallel ranks of one TP shard are tp apart
    t_fsdp = _comm_seconds(cluster, fsdp_comm, dp, per_node(dp, tp, cluster.gpus_per_node), scale,
                           calls_scale=accum) * accum
    if dp == 1:  # pure TP: the replicated parameters' gradients are not reduced (theory: none)
        t_fsdp = 0.0
    compute_s = compute_seconds(cluster, plan, plan.tokens_per_step / n, gemm_tokens=micro * cfg.seq_len, tp=tp)
    exposed = t_tp + (max(0.0, t_fsdp - compute_s) if cluster.overlap else t_fsdp)
    w = _act_dtype_bytes(plan)
    act = activation_bytes(plan, cfg.n_layer, micro, tp=tp, sp=sp)
    if dp > 1:  # the 2-D script leaves the LM head to FSDP: its tensors are the head's working set
        act -= activation_bytes(plan, 0, micro, tp=tp, sp=sp)
    unit = _block_params(cfg) / tp
    # the logits and their gradient (the LM head is replicated: full vocabulary on every TP rank),
    # and with FSDP over dp the gathered TP shard of a block and its all-gather buffer
    temp = 2 * micro * cfg.seq_len * cfg.vocab_size * 4
    if dp > 1:
        temp += 2 * unit * w
    return _finish(name, layout, plan, cluster, state, act, temp, compute_s, t_tp + t_fsdp, exposed,
                   head=2 * micro * cfg.seq_len * cfg.vocab_size * 4, accumulating=accum > 1)


def _pipeline(plan: Plan, cluster: Cluster, schedule: str, pp: int, stages_per_rank: int = 2) -> Estimate:
    """``pp`` pipeline stages (one per GPU; interleaved: 2 per GPU) x ``gpus / pp`` data-parallel
    replicas that all-reduce their stage's gradients (DDP). Micro-batches of ``plan.micro_batch``;
    compute stretched by theory's bubble; in flight: GPipe all m micro-batches, 1F1B p, interleaved
    p x (1 + (p - 1) / (v p)) (Narayanan et al. 2021)."""
    n, cfg = cluster.gpus, plan.model
    name = Strategy(f"pp_{schedule}")
    dp = n // pp
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    if pp * v > cfg.n_layer:
        return _invalid(name, {"pp": pp}, f"{pp * v} stages need at least as many blocks ({cfg.n_layer})")
    per_replica = plan.global_batch / dp
    if per_replica != int(per_replica) or per_replica < 1:
        return _invalid(name, {"pp": pp, "dp": dp}, f"the global batch does not split over {dp} replicas")
    micro = min(plan.micro_batch, int(per_replica))
    m = plan.microbatches or int(per_replica) // micro
    micro = int(per_replica) // m
    if m * micro != per_replica:
        return _invalid(name, {"pp": pp, "dp": dp}, f"{int(per_replica)} sequences do not split into {m} micro-batches")
    knobs = {"microbatches": m, "stages_per_rank": v}
    pred = predictors.predict(name, cfg, pp, int(per_replica), knobs)
    scale = 0.5 if plan.precision == "bf16" else 1.0
    compute_s = compute_seconds(cluster, plan, plan.tokens_per_step / n, gemm_tokens=micro * cfg.seq_len)
    bubble = theory.pipeline_bubble(pp, m, v)
    # A stage idles for the bubble. On GPUs that time is lost: step = compute / (1 - bubble). CPU
    # ranks that share fewer cores than there are ranks (compute_s already runs each at its share of
    # a core) lend an idle stage's core to the busy ones, so the step is the longer of the critical
    # path at a whole core and the machine's total work over its cores.
    bubble_s = max(compute_s * core_share(cluster) / (1 - bubble), compute_s) - compute_s
    w = _act_dtype_bytes(plan)
    # The stage that decides the fit: the first holds the most micro-batches in flight (1F1B: p - r
    # on rank r, GPipe: all m everywhere), the last the LM head and its working set, another rank
    # may hold the most parameters. Estimate each and keep the largest peak.
    busiest = max(range(pp), key=lambda r: sum(pred["state_per_rank"][r].values()))
    candidates = []
    for rank in sorted({0, pp - 1, busiest}):
        state = state_bytes(pred["state_per_rank"][rank], plan)
        layout = {"pp": pp, "dp": dp, "microbatches": m, "micro_batch": micro, "stages_per_rank": v, "rank": rank}
        ahead = min(pp - rank, m)
        # (interleaved: its warm-up runs (v - 1) p + 2 (p - 1 - r) chunks of L / (p v) blocks before the
        # first backward, which is never more than all m micro-batches of both chunks)
        in_flight = {"gpipe": m, "1f1b": ahead, "interleaved_1f1b": min(m, ahead * (1 + (pp - 1) / (v * pp)))}[schedule]
        # + each in-flight micro-batch's stage input and output, held by the schedule until its backward
        act = (activation_bytes(plan, cfg.n_layer / pp, micro, in_flight=in_flight)
               + in_flight * 2 * micro * cfg.seq_len * cfg.n_embd * w)
        t_p2p = _comm_seconds(cluster, pred["comm_per_rank"][rank], 2, 1 if pp > cluster.gpus_per_node else 2, scale)
        grads = theory.ddp_bytes(state["params"] / (2 if plan.precision == "bf16" else 4), dp,
                                 2 if plan.precision == "bf16" else 4)
        t_dp = _comm_seconds(cluster, {"all_reduce": {"calls": None, **grads}}, dp,
                             per_node(dp, pp, cluster.gpus_per_node))  # the replicas of a stage: pp apart
        exposed = t_p2p + (max(0.0, t_dp - compute_s * 2 / 3) if cluster.overlap else t_dp)
        # the last stage's head working set, the send/receive buffers of a micro-batch's activation
        # and its gradient, and with data parallelism DDP's gradient buckets
        head = head_working_set(plan, micro) if rank == pp - 1 else 0.0
        temp = head + 2 * micro * cfg.seq_len * cfg.n_embd * w
        if dp > 1:
            temp += state["grads"]
        # 1F1B runs its first backward while later micro-batches are in flight: gradients then exist
        candidates.append(_finish(name, layout, plan, cluster, state, act, temp, compute_s, t_p2p + t_dp, exposed,
                                  bubble_s, head=head, accumulating=schedule != "gpipe"))
    worst = max(candidates, key=lambda e: e.memory_bytes["peak"])
    slowest = max(candidates, key=lambda e: e.step_time_s)
    worst.step_time_s, worst.tokens_per_s_per_gpu, worst.times = \
        slowest.step_time_s, slowest.tokens_per_s_per_gpu, slowest.times
    return worst
