"""What a configuration costs, part by part: memory per GPU in the five :data:`PARTS` (model state
from the predictors' bytes, activations, temporaries) and time (alpha-beta communication per
collective call, compute at the plan's precision, the share of a node's cores)."""
from __future__ import annotations

import math
from typing import Iterable

from .. import theory
from ..models import LlamaModelConfig
from .gemm import matmul_factor
from .inputs import Cluster, Plan

# ----------------------------------------------------------------------------------------------
# Memory: the five parts
# ----------------------------------------------------------------------------------------------

PARTS = ("params", "grads", "optimizer", "activations", "temporaries")


def state_bytes(fp32_state: dict, plan: Plan, zero: bool = False) -> dict[str, float]:
    """Convert :mod:`distkit.theory`'s fp32 AdamW state of one rank to the plan's precision and
    optimizer. fp32 AdamW is theory's own count (4 + 4 + 8 bytes per element held; DeepSpeed's
    ZeRO keeps a separate fp32 master partition even in fp32: 12). bf16 mixed precision counts the
    ZeRO paper's way: 2 bytes of weights and 2 of gradients per element held, and K bytes of
    optimizer state per partition element: 12 for AdamW (fp32 master, two moments), 8 for SGD
    (master, momentum). fp32 SGD keeps one momentum (4; ZeRO: plus the master copy, 8)."""
    k_theory = 12 if zero else 8
    elems = fp32_state["optimizer"] / k_theory
    if plan.precision == "fp32":
        k = {"adamw": 8, "sgd": 4}[plan.optimizer] + (4 if zero else 0)
        return {"params": fp32_state["params"], "grads": fp32_state["grads"], "optimizer": elems * k}
    k = {"adamw": 12, "sgd": 8}[plan.optimizer]
    return {"params": fp32_state["params"] / 2, "grads": fp32_state["grads"] / 2, "optimizer": elems * k}


def _act_dtype_bytes(plan: Plan) -> float:
    return 2.0 if plan.precision == "bf16" else 4.0


def _replicated_per_token(cfg, ac: str, sp: bool = False) -> int:
    """Floats per token of a block's saved activations that tensor parallelism does NOT split:
    without sequence parallelism the norms' inputs and outputs (the column-parallel layers' inputs
    are full on every TP rank) and their statistics; with it, the norms' outputs all-gathered for
    the column-parallel layers (2h: saved for their weight gradients). The rest (Q, K, V, attention
    output, the MLP's wide tensors) is split over the TP ranks. Full AC keeps the block input only
    (replicated; sequence-split with SP)."""
    h = cfg.n_embd
    if ac == "full":
        return 0 if sp else h
    if sp or ac in ("selective", "titan-op"):
        return 2 * h if ac == "none" else h
    return 6 * h + 2 if isinstance(cfg, LlamaModelConfig) else 4 * h + 4


def activation_bytes(plan: Plan, layers: float, micro_batch: int, tp: int = 1, sp: bool = False,
                     in_flight: float = 1.0) -> float:
    """Activations one GPU keeps alive at its memory peak, the top of backward (MemTracker finds it
    there: right after the LM head's backward, before any block's): ``layers`` blocks of
    ``micro_batch`` sequences (:func:`distkit.theory.activation_bytes_per_layer`, fp32; bf16 halves
    it), split over ``tp`` ranks as :func:`_replicated_per_token` says (all of it with sequence
    parallelism), times the ``in_flight`` micro-batches a pipeline stage holds. The loss's tensors
    are no longer activations then: see :func:`head_working_set`.

    Per block, by AC mode (theory's docstring derives each; s tokens, b sequences, h width, a heads,
    g kv-heads, I the MLP width, fp32 floats; bf16 halves them):

    * none: the Llama 4sb (8h + 2hg/a + 4I + a + 2), the GPT 4sb (16h + a + 4);
    * full (every block recomputed): the block input, 4sbh;
    * selective (op-level: the matmul outputs and attention's output saved, norms and activations
      recomputed): the Llama 4sb (5h + 2hg/a + 2I + a), the GPT 4sb (11h + a);
    * titan-op (torchtitan's selective op: every other matmul's output saved): the Llama
      4sb (4h + hg/a + I + a), the GPT 4sb (9h + a).

    The attention kernel (``plan.attention``): flash (the default; SDPA's fused kernel) keeps no s x s
    matrix, only a log-sum-exp per row and head. Eager attention keeps its softmax probabilities for
    backward, :func:`eager_attention_bytes` more per block without AC (Korthikanti et al.'s 5as/h term
    of sbh (34 + 5as/h), at dropout 0); selective and full AC recompute them."""
    cfg = plan.model
    per_layer = theory.activation_bytes_per_layer(cfg, micro_batch, plan.ac)
    if plan.attention == "eager" and plan.ac == "none":
        per_layer += eager_attention_bytes(cfg, micro_batch)  # split over tp below with the heads
    head = 0.0
    if tp > 1:
        replicated = min(per_layer, 4 * cfg.seq_len * micro_batch * _replicated_per_token(cfg, plan.ac, sp))
        per_layer = replicated + (per_layer - replicated) / tp
        # the replicated LM head's input and the loss's log-probabilities (split over TP ranks with
        # SP) are saved by DTensor ops inside the model: activations at the peak
        tokens = cfg.seq_len * micro_batch
        head = tokens * (4 * cfg.vocab_size / (tp if sp else 1) + 2 * cfg.n_embd * _act_dtype_bytes(plan))
    blocks = layers * per_layer * in_flight * _act_dtype_bytes(plan) / 4
    if plan.compile or plan.float8:  # what they keep of the blocks' saved activations, fitted on Table 1
        from .published_check import memory_factor  # imported here: that module plans with this one

        blocks *= memory_factor(plan)
    return blocks + head


def eager_attention_bytes(cfg, micro_batch: int, tp: int = 1) -> float:
    """What eager attention keeps per block beyond flash, in bytes of the activation dtype's width
    counted as Korthikanti et al. do (arXiv:2205.05198, section 4.1: 5 a s^2 b bytes in 16-bit, the
    softmax output 2, its dropout mask 1, the dropout's output 2). With dropout 0 (every model here)
    the mask and the dropout's output do not exist: the softmax output, a s^2 b elements, x 2 bytes.
    Returned in fp32 bytes (4 a s^2 b, as theory's counts are) before the caller's dtype scaling;
    split over ``tp`` (heads)."""
    return 4 * cfg.n_head * cfg.seq_len ** 2 * micro_batch / tp


def head_working_set(plan: Plan, micro_batch: int, vocab_shards: int = 1) -> float:
    """Temporaries alive during the LM head's backward, where the step peaks: the logits (held by
    the training loop), the loss's log-probabilities, their gradient and the logits' gradient (four
    ``b x s x vocab`` tensors, fp32; in bf16 the logits and their gradient are bf16), and the head's
    input gradient with the final norm's (two ``b x s x width``). Measured on the CPU matrix:
    ``tests/test_planner.py``. A compiled loss (``plan.compiled_loss``) is one fused function: it
    saves the logits in their own dtype and two floats per token (the row's max and log-sum-exp),
    and its backward writes the logits' gradient in that dtype, with no fp32 copy and no
    log-probabilities (seen in ``tests/test_planner_memory.py`` through the tensors it saves).
    ``vocab_shards``: the ranks its vocabulary-sized tensors are split over (loss parallel under TP)."""
    cfg = plan.model
    tokens = cfg.seq_len * micro_batch
    return tokens * (vocab_bytes(plan) * cfg.vocab_size / vocab_shards + 2 * _act_dtype_bytes(plan) * cfg.n_embd)


def vocab_bytes(plan: Plan) -> int:
    """Bytes per token and vocabulary entry of the loss's working set (:func:`head_working_set`):
    eager bf16 2 + 4 + 4 + 2, eager fp32 4 x 4; compiled, the logits and their gradient only."""
    w = int(_act_dtype_bytes(plan))
    return 2 * w if plan.compiled_loss else (12 if w == 2 else 16)


# ----------------------------------------------------------------------------------------------
# Time: alpha-beta communication, compute, overlap
# ----------------------------------------------------------------------------------------------

# The collectives NCCL runs as rings (or trees) over every GPU of the group: across nodes, each of a
# node's GPUs in the group drives its own network port (one port per GPU, rail-aligned), so the
# bus bandwidth is the ports of a node together, at most the link inside it. NVIDIA's measurement:
# "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure 192GB/s AllReduce
# BusBW" (https://github.com/NVIDIA/nccl/issues/812, 2023). A send, a receive or an all-to-all's
# part that leaves the node goes through the sending GPU's own port.
RING_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def per_node(group: int, stride: int, gpus_per_node: int) -> int:
    """How many GPUs of one ``group`` (its ranks ``stride`` apart) share a node: the whole group when
    it fits in one, else ``gpus_per_node // stride`` (at least 1)."""
    return min(group, max(1, gpus_per_node // stride))


def collective_time(cluster: Cluster, collective: str, group: int, calls: float, bus_bytes: float,
                    in_node: int) -> float:
    """Seconds for ``calls`` calls of ``collective`` moving ``bus_bytes`` bus bytes in all over a
    ``group`` of ranks, ``in_node`` of which share each node (:func:`per_node`; ``group`` when the
    group fits in a node): ``calls x alpha + bus_bytes / beta``. Measured fits
    (``cluster.collectives``, the nearest group size) when the cluster has them; else the link with
    alpha = latency x ceil(log2 group) (a tree's depth: NCCL's small messages) and beta = the link's
    bus bandwidth: inside a node its link; across nodes, for the :data:`RING_COLLECTIVES`, ``in_node``
    network ports together (at most the link inside the node), else one port."""
    if group <= 1 or (calls == 0 and bus_bytes == 0):
        return 0.0
    if cluster.collectives:
        # A point-to-point send or receive is what an all-to-all between two ranks does (one message
        # each way): its measured fit at 2 ranks, when the sweep has it; else the all-reduce's.
        if collective in ("send", "recv"):
            name, group = "all_to_all", 2
        else:
            name = "all_reduce" if collective == "broadcast" else collective
        fits = {g: v for (c, g), v in cluster.collectives.items() if c == name} or \
               {g: v for (c, g), v in cluster.collectives.items() if c == "all_reduce"}
        alpha, beta = fits[min(fits, key=lambda g: (abs(g - group), -g))]
    elif in_node >= group:
        link = cluster.gpu.intra
        alpha, beta = link.latency * math.ceil(math.log2(group)), link.bandwidth
    else:
        link = cluster.gpu.inter
        ports = in_node if collective in RING_COLLECTIVES else 1
        alpha = link.latency * math.ceil(math.log2(group))
        beta = min(ports * link.bandwidth, cluster.gpu.intra.bandwidth)
    return calls * alpha + bus_bytes / beta


def _comm_seconds(cluster: Cluster, comm: dict, group: int, in_node: int, scale: float = 1.0,
                  calls_scale: float = 1.0, only: Iterable[str] | None = None) -> float:
    """Alpha-beta seconds of a theory ``comm`` dict ({collective: {calls, bytes, bus_bytes}}) over one
    group (``in_node`` of its GPUs per node); ``scale`` multiplies the bytes (precision),
    ``calls_scale`` the calls (micro-batches). Calls theory leaves open (None: DDP's buckets,
    DeepSpeed's flat buffers) count as one per 25 MiB bucket."""
    total = 0.0
    for name, stat in comm.items():
        if name == "barrier" or (only is not None and name not in only):
            continue
        calls = stat["calls"] if stat["calls"] is not None else max(1, math.ceil(stat["bytes"] / (25 * 2 ** 20)))
        total += collective_time(cluster, name, group, calls * calls_scale, stat["bus_bytes"] * scale, in_node)
    return total


def core_share(cluster: Cluster) -> float:
    """The share of a core one rank computes with: CPU ranks that outnumber a node's ``cores`` run
    at cores / ranks-per-node of one each; a GPU (no ``cores``) is all its own."""
    return min(1.0, cluster.cores / cluster.gpus_per_node) if cluster.cores else 1.0


def compute_rate(cluster: Cluster, plan: Plan) -> float:
    """Achieved FLOP/s of one GPU (one rank), eager: efficiency x the GPU type's ``compute_factor`` (1
    on an H100, where the efficiency is fitted) x peak of the precision, at the rank's
    :func:`core_share` on CPU. torch.compile and Float8: :func:`compute_seconds`."""
    peak = cluster.gpu.peak_flops.get(plan.precision) or cluster.gpu.peak_flops["fp32"]
    return cluster.efficiency * cluster.gpu.compute_factor * peak * core_share(cluster)


def attention_flops_per_token(plan: Plan) -> float:
    """The attention part of :func:`_flops_per_token`: theory's 12 L d s, and the forward (4 L d s)
    that full AC recomputes."""
    attention = _attention_flops(plan.model)
    return attention * 4 / 3 if plan.ac == "full" else attention


def _attention_flops(cfg) -> int:
    """theory's attention term of the model FLOPs per token, 12 L d s (scores and weighted sum,
    forward and backward)."""
    return 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def compute_seconds(cluster: Cluster, plan: Plan, tokens: float, lora: bool = False, gemm_tokens: int | None = None,
                    tp: int = 1, ep: int = 1, vocab_shards: int = 1) -> float:
    """Seconds one GPU computes ``tokens`` tokens of ``plan``: attention's FLOPs at
    :func:`compute_rate`, the rest (the matmuls of the linear layers and what surrounds them) at that
    rate times what torch.compile and Float8 make of them (:func:`~.published_check.linear_speedup`)
    and times the fraction of the large-matrix rate the layers' GEMMs reach at their size
    (:func:`~.gemm.matmul_factor`: ``gemm_tokens`` per micro-batch, by default the plan's
    micro-batch of sequences, the layers split over ``tp`` ranks, the experts over ``ep``, the LM
    head's vocabulary over ``vocab_shards``). Float8 converts the linear layers only and compile
    leaves the attention kernel a call to the same kernel, so attention runs at its eager speed."""
    rate = compute_rate(cluster, plan)
    attention = attention_flops_per_token(plan)
    rest = _flops_per_token(plan, lora) - attention
    if plan.compile or plan.float8:
        from .published_check import linear_speedup  # imported here: that module plans with this one

        rest /= linear_speedup(plan)
    rest /= matmul_factor(cluster, plan, gemm_tokens or plan.micro_batch * plan.model.seq_len, tp, ep, vocab_shards)
    return tokens * (rest + attention) / rate


def _flops_per_token(plan: Plan, lora: bool = False) -> float:
    """theory's ``6N + 12Lsd`` (model FLOPs), plus the forward that full AC recomputes (2N + 4Lsd:
    hardware FLOPs that the step takes time for) or the matmuls that ``titan-op`` recomputes (every
    other one of a block: the Llama's k, output and up projections, the GPT's two output
    projections), and for LoRA minus the frozen weights' gradient matmuls (2N: backward computes
    input gradients only)."""
    cfg = plan.model
    full = theory.training_flops_per_token(cfg)
    attention = _attention_flops(cfg)
    matmul = full - attention
    flops = full
    if plan.ac == "full":
        flops += (matmul + attention) / 3
    elif plan.ac == "titan-op":
        h = cfg.n_embd
        if isinstance(cfg, LlamaModelConfig):
            flops += 2 * cfg.n_layer * h * (theory.kv_width(cfg) + h + cfg.intermediate_size)
        else:
            flops += 2 * cfg.n_layer * 5 * h * h
    if lora:
        flops -= matmul / 3
    return flops
