"""One :class:`Estimate` for an N-D layout (:class:`~.dims.ParallelDims`): FSDP over dp_shard x cp,
replicas over dp_replicate, Megatron TP (with or without SP) inside, a pipeline of pp stages, a
context-parallel ring, MoE experts over ep ranks; and the search over every such layout (:func:`estimate_nd`).

Memory per GPU (bytes; w = 2 in bf16, 4 in fp32; Ψ_stage the busiest stage's parameters):

* model state: Ψ_stage / tp / (dp_shard x cp) x (w weights + w gradients + K optimizer bytes), the
  ZeRO paper's 2 + 2 + 12 per parameter in bf16 AdamW, as every other row counts it;
* activations: :func:`~.costs.activation_bytes` of ceil(L / stages) blocks at s / cp tokens, split
  over tp as its docstring says, times the micro-batches the first stage holds in flight (GPipe m,
  1F1B min(p, m), interleaved min(m, p (1 + (p - 1) / (v p))), Narayanan et al. 2021), plus each
  in-flight micro-batch's stage input and output (b s/cp h w, / tp with SP);
* the LM head (last stage): :func:`head_bytes` (loss parallel divides its vocabulary terms by tp);
* temporaries: with FSDP the gathered block and the prefetched next one (2 x block / tp x w), the
  pipeline's send and receive buffers, DDP's flat gradient copy when replicas are not sharded; with
  FSDP under a pipeline the whole stage gathered and its unsharded fp32 gradients
  (Ψ_stage / tp x (w + 4)), held across the micro-batches.

Time: compute = training FLOPs per GPU / achieved FLOP/s, the linear layers' at the fraction their
GEMMs' size reaches (:func:`~.gemm.matmul_factor`: b s/cp tokens, the layers split over tp); TP: 4
all-reduces (or all-gather + reduce-scatter pairs with SP, the same bus bytes) of b s/cp h w per
block per micro-batch, 6 with full AC's recomputed forward, on the critical path, less what Async TP
hides under the matmuls they feed or drain (:func:`~.async_tp.hidden_seconds`); FSDP: an all-gather
of the stage's shard forward and again backward, a reduce-scatter of its gradients, per micro-batch
without a pipeline (torchtitan keeps the gathered weights over a pipeline's micro-batches: once per
step with one), hidden under compute up to its length together with the replicas' all-reduce; the
CP ring's K/V hops hidden under attention (as :mod:`.layouts_cp_ep`); the pipeline's sends on the
critical path; the bubble (p - 1) / (v m + p - 1) of compute.

Expert parallelism (``ep``, an MoE model's experts over ranks borrowed from dp_shard x cp): what it
changes in the state, FSDP's gathers and the all-to-alls on the critical path is :mod:`.nd_ep`'s."""
from __future__ import annotations

import math
from dataclasses import replace

from .. import theory
from . import async_tp, nd_ep
from .costs import (
    _act_dtype_bytes,
    activation_bytes,
    collective_time,
    compute_rate,
    compute_seconds,
    core_share,
    head_working_set,
)
from .dims import ParallelDims, _micro_split, check_dims, enumerate_dims
from .inputs import Cluster, Plan, _block_params
from .layouts import Estimate, _finish, _invalid

ND = "nd"  # the name of the N-D row in a report


def head_bytes(plan: Plan, micro: int, tp: int = 1, loss_parallel: bool = True) -> float:
    """The LM head's working set during its backward, where the step peaks, for ``micro`` sequences of
    ``plan.model.seq_len`` tokens (T of them), vocabulary V, width h:

    * bf16: T (12 V + 4 h): bf16 logits and their gradient (2 + 2 bytes per vocabulary entry), fp32
      log-probabilities and their gradient (4 + 4), the head's input gradient and the final norm's
      (2 x 2 bytes per width entry);
    * fp32: T (16 V + 8 h);
    * with TP and loss parallel (torchtitan's default), every vocabulary-sized tensor is sharded over
      the tp ranks: T (12 V / tp + 4 h); without it each TP rank holds the whole vocabulary.

    :func:`~.costs.head_working_set` with the vocabulary split over the TP ranks (the CPU matrix
    measures it at tp = 1); a compiled loss keeps the logits and their gradient only
    (:func:`~.costs.vocab_bytes`)."""
    return head_working_set(plan, micro, tp if loss_parallel else 1)


_SPLITS: dict = {}


def _param_split(cfg) -> tuple[int, int]:
    """(all parameters, one block's): asked once per layout of a search, counted once per model."""
    key = (cfg.arch, tuple(sorted(cfg.to_dict().items())))
    if key not in _SPLITS:
        _SPLITS[key] = sum(math.prod(s) for s in theory.param_shapes(cfg).values()), _block_params(cfg)
    return _SPLITS[key]


def _stage_params(cfg, d: ParallelDims) -> tuple[float, float]:
    """(parameters of the busiest pipeline rank, of one block). Blocks are cut into pp x chunks stages,
    the busiest holding ceil(L / stages) per chunk; embedding and head (and final norm) sit on the
    first and last stage: the larger half of them counts."""
    total, block = _param_split(cfg)
    outside = total - block * cfg.n_layer
    stages = d.pp * d.chunks
    blocks = math.ceil(cfg.n_layer / stages) * d.chunks
    return block * blocks + (outside if d.pp == 1 else outside / 2), block


def _in_flight(d: ParallelDims, m: int) -> float:
    p, v = d.pp, d.chunks
    if p == 1:
        return 1.0
    return {"gpipe": m, "1f1b": min(p, m), "interleaved_1f1b": min(m, p * (1 + (p - 1) / (v * p)))}[d.schedule]


def _memory(plan: Plan, cl: Cluster, d: ParallelDims, micro: int,
            m: int) -> tuple[dict, float, float, float, float]:
    """(model state by part, activations, temporaries, the head's share of them, the share of them
    held from the step's first micro-batch to its end) of the GPU that
    decides the fit: the first stage's activations and the last stage's head, counted together (on
    one stage when pp = 1; a safe bound otherwise)."""
    cfg = plan.model
    w = _act_dtype_bytes(plan)
    stage, block = _stage_params(cfg, d)
    blocks = math.ceil(cfg.n_layer / (d.pp * d.chunks)) * d.chunks
    stage_exp, block_exp = nd_ep.stage_experts(cfg, d, blocks)
    held = nd_ep.held_params(stage, stage_exp, d)
    k_opt = {("bf16", "adamw"): 12, ("bf16", "sgd"): 8, ("fp32", "adamw"): 8, ("fp32", "sgd"): 4}
    state = {"params": held * w, "grads": held * w, "optimizer": held * k_opt[plan.precision, plan.optimizer]}
    local = replace(plan, model=replace(cfg, seq_len=cfg.seq_len // d.cp))
    in_flight = _in_flight(d, m)
    act = activation_bytes(local, blocks, micro, tp=d.tp, sp=d.sp, in_flight=in_flight)
    act -= activation_bytes(local, 0, micro, tp=d.tp, sp=d.sp)  # the head's part: counted in head_bytes
    io = micro * local.model.seq_len * cfg.n_embd * w / (d.tp if d.sp else 1)
    if d.pp > 1:
        act += in_flight * 2 * io
    head = head_bytes(local, micro, d.tp, d.loss_parallel)
    temp = head
    temp += 2 * nd_ep.gathered_params(block, block_exp, d) * w
    if d.pp > 1:
        temp += 2 * io
    if d.pp > 1 and d.shard > 1:
        # torchtitan does not reshard a stage's weights between a pipeline's micro-batches, and
        # torch.distributed.pipelining's stage defers FSDP's gradient reduce-scatter to the last one
        # (backward_maybe_with_nosync): the stage stays gathered (w bytes) and its unsharded
        # gradients accumulate in the fp32 reduce dtype (4 bytes) through the step
        kept = nd_ep.gathered_params(stage, stage_exp, d) * (w + 4)
    else:
        kept = 0.0
    if d.dp_replicate > 1 and d.shard == 1:
        kept += state["grads"]
    return state, act, temp + kept, head, kept


def _times(plan: Plan, cl: Cluster, d: ParallelDims, micro: int, m: int) -> dict:
    """Compute, each axis's communication and what of it is exposed, and the bubble (seconds). TP's
    collectives are all exposed, less what Async TP hides of each pair it fuses with a matmul
    (:func:`~.async_tp.hidden_seconds`): cut into tp chunks, a collective of C seconds and a matmul of
    M run as a two-stage pipeline that exposes max(C, M) - M + min(C, M) / tp (its derivation:
    :mod:`.async_tp`)."""
    cfg, n = plan.model, cl.gpus
    w = _act_dtype_bytes(plan)
    rate = compute_rate(cl, plan)  # eager: attention's speed (the CP ring hides under it)
    s_local = cfg.seq_len // d.cp
    compute_s = compute_seconds(cl, plan, plan.tokens_per_step / n, gemm_tokens=micro * s_local, tp=d.tp, ep=d.ep,
                                vocab_shards=d.tp if d.loss_parallel else 1)
    layers = math.ceil(cfg.n_layer / (d.pp * d.chunks)) * d.chunks
    act = micro * s_local * cfg.n_embd * w
    t_tp = tp_hidden = 0.0
    if d.tp > 1:
        calls = (6 if plan.ac == "full" else 4) * layers * m
        t_tp = collective_time(cl, "all_reduce", d.tp, calls, calls * 2 * act * (d.tp - 1) / d.tp, d.in_node("tp", cl))
        tp_hidden = async_tp.hidden_seconds(plan, cl, d, micro * s_local, w) * layers * m
    stage, block = _stage_params(cfg, d)
    shard_bytes = stage / d.tp * w
    stage_exp = nd_ep.stage_experts(cfg, d, layers)[0]
    t_fsdp = nd_ep.fsdp_seconds(cl, d, stage, stage_exp, layers, 1 if d.pp > 1 else m, w)
    t_ep = nd_ep.all_to_all_seconds(plan, cl, d, micro, m, layers, w)
    t_dpr = 0.0
    if d.dp_replicate > 1:
        grads = shard_bytes / d.shard
        t_dpr = collective_time(cl, "all_reduce", d.dp_replicate, max(1, math.ceil(grads / (25 * 2 ** 20))),
                                2 * grads * (d.dp_replicate - 1) / d.dp_replicate, d.in_node("dp_replicate", cl))
    t_cp = attention_s = 0.0
    if d.cp > 1:
        kv = 2 * micro * s_local * theory.kv_width(cfg) / d.tp * w
        hops = (3 * d.cp - 2) * layers * m
        t_cp = collective_time(cl, "send", 2, hops, hops * kv, 1 if d.spans("cp", cl) else 2)
        attention_s = plan.tokens_per_step / n * 6 * layers * cfg.n_embd * cfg.seq_len / rate
    t_pp = 0.0
    if d.pp > 1:
        calls = 2 * m * d.chunks
        t_pp = collective_time(cl, "send", 2, calls, calls * act / (d.tp if d.sp else 1),
                               1 if d.spans("pp", cl) else 2)
    hidden = (lambda t, under: max(0.0, t - under)) if cl.overlap else (lambda t, under: t)
    exposed = t_tp - tp_hidden + t_pp + t_ep + hidden(t_fsdp + t_dpr, compute_s) + hidden(t_cp, attention_s)
    bubble = theory.pipeline_bubble(d.pp, m, d.chunks) if d.pp > 1 else 0.0
    bubble_s = max(compute_s * core_share(cl) / (1 - bubble), compute_s) - compute_s
    return {"compute_s": compute_s, "comm_s": t_tp + t_fsdp + t_dpr + t_cp + t_pp + t_ep, "exposed_s": exposed,
            "bubble_s": bubble_s, "tp_s": t_tp, "tp_hidden_s": tp_hidden, "fsdp_s": t_fsdp, "dp_replicate_s": t_dpr,
            "cp_s": t_cp, "pp_s": t_pp,
            **({"ep_s": t_ep} if d.ep > 1 else {})}


def estimate_dims(plan: Plan, cl: Cluster, d: ParallelDims) -> Estimate:
    """The :class:`Estimate` of one layout (named :data:`ND`); invalid, with :func:`check_dims`'s one
    line as its note, when the layout cannot run this job."""
    layout = {"dp": d.batch_ranks, **d.axes()}
    problem = check_dims(plan, cl, d)
    if problem:
        return _invalid(ND, layout, problem)
    micro, m = _micro_split(plan, d)[:2]
    layout.update(micro_batch=micro, **({"microbatches": m} if d.pp > 1 else {"accumulation": m}))
    layout["dims"] = d.text()
    state, act, temp, head, held = _memory(plan, cl, d, micro, m)
    t = _times(plan, cl, d, micro, m)
    est = _finish(ND, layout, plan, cl, state, act, temp, t["compute_s"], t["comm_s"], t["exposed_s"], t["bubble_s"],
                  head=head, accumulating=m > 1, held=held)
    est.times.update({k: v for k, v in t.items() if k not in ("compute_s", "comm_s", "exposed_s", "bubble_s")})
    return est


def estimate_nd(plan: Plan, cl: Cluster) -> Estimate:
    """The best N-D layout of :func:`~.dims.enumerate_dims`: the fastest that fits, else the smallest
    (by what the caching allocator would reserve)."""
    candidates = [estimate_dims(plan, cl, d) for d in enumerate_dims(plan, cl)]
    if not candidates:
        return _invalid(ND, {}, "no N-D layout (3+ axes, PP x FSDP, ...) splits this model, batch and GPU count")
    fitting = [c for c in candidates if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.step_time_s)
    return min(candidates, key=lambda c: c.memory_bytes["reserved"])

