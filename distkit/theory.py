"""The textbook formulas: what the papers predict for each family of strategies, in the closed forms
the chapters print next to their measurements (``ddp_bytes``, ``zero_paper_bytes``,
``zero_fp32_state_bytes``, ``megatron_tp_bytes_per_layer``, ``pipeline_bubble``,
``ring_attention_bytes``, ``kv_width``, ``expert_parallel_bytes``, ``activation_bytes_per_layer``,
``training_flops_per_token``, ``mixed_precision_state_per_gpu`` ...), each below its source, and the
model's parameter shapes they are applied to (:func:`param_shapes`, built on the meta device).

The same formulas applied parameter by parameter, with what each implementation does on top (FSDP2's
dim-0 padding, DeepSpeed's partitions, DTensor's shard sizes), are the per-strategy predictors of
:mod:`distkit.predictors`; :mod:`distkit.compare` puts a harness record next to its prediction.

Conventions, shared with :mod:`distkit.harness`: ``bytes`` is the payload of a collective (gathers:
the full output, reduce-scatter: the full input, as nccl-tests counts it) and ``bus_bytes`` the bytes
one rank puts on the wire, payload x the nccl-tests bus factor (NVIDIA/nccl-tests,
``doc/PERFORMANCE.md``: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
broadcast, reduce, send/recv 1), the one :func:`distkit.harness.bus_factor` for measurement and
prediction. Collectives per step are written ``{collective: {"calls", "bytes", "bus_bytes"}}``
(:func:`comm_entry`, :func:`add_comm`). Training is fp32 with AdamW (two moments) unless a function
says otherwise.
"""
from __future__ import annotations

import functools
import math
import re

import torch

from .comm_counter import bus_factor
from .models import GPTConfig, LlamaModelConfig, build_model, config_from_dict, dense_config, is_moe
from .strategies import Strategy

# ----------------------------------------------------------------------------------------------
# Shared: parameter shapes, shard sizes, and how a collective is written down
# ----------------------------------------------------------------------------------------------

def param_shapes(cfg: GPTConfig | LlamaModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the model ``cfg`` describes (the small GPT or the Llama,
    dense or with mixture-of-experts MLPs), built on the meta device: no memory, exact."""
    return dict(_shapes(cfg.arch, tuple(sorted(cfg.to_dict().items()))))


# a block's MLP parameter: the GPT's blocks.N.mlp.*, the Llama's model.layers.N.mlp.*
_MLP_PARAM = re.compile(r"^((?:blocks|model\.layers)\.\d+\.mlp\.)(.+)$")


@functools.lru_cache(maxsize=64)
def _shapes(arch: str, cfg_items: tuple, buffers: bool = False) -> tuple[tuple[str, tuple[int, ...]], ...]:
    # cached per configuration: a table of many records asks for the same few models again and again
    cfg = config_from_dict({"arch": arch, **dict(cfg_items)})
    if is_moe(cfg):
        return _moe_shapes(cfg, buffers)
    with torch.device("meta"):
        model = build_model(cfg)
    tensors = model.named_buffers() if buffers else model.named_parameters()
    return tuple((name, tuple(t.shape)) for name, t in tensors)


def _moe_shapes(cfg, buffers: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The dense model's shapes with each block's MLP replaced, in place, by the mixture of experts
    of ``05-advanced/expert_parallel.py``: ``mlp.router.weight`` (num_experts x n_embd, no bias),
    then ``mlp.experts.E.<the MLP's own parameter names>`` for E = 0 .. num_experts - 1 (the order
    ``named_parameters`` gives the script's model)."""
    dense = dense_config(cfg)
    table = _shapes(dense.arch, tuple(sorted(dense.to_dict().items())), buffers)
    if buffers:
        return table
    out: list[tuple[str, tuple[int, ...]]] = []
    mlp: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # block prefix -> its MLP's (name, shape)
    for name, shape in table:
        match = _MLP_PARAM.match(name)
        if not match:
            out.append((name, shape))
            continue
        prefix = match.group(1)
        if prefix not in mlp:  # the router and the experts take the MLP's place
            mlp[prefix] = []
            out.append((prefix, ()))
        mlp[prefix].append((match.group(2), shape))
    result = []
    for name, shape in out:
        if name not in mlp:
            result.append((name, shape))
            continue
        result.append((f"{name}router.weight", (cfg.num_experts, cfg.n_embd)))
        result += [(f"{name}experts.{e}.{leaf}", leaf_shape)
                   for e in range(cfg.num_experts) for leaf, leaf_shape in mlp[name]]
    return tuple(result)


def buffer_bytes(cfg: GPTConfig | LlamaModelConfig) -> int:
    """fp32 bytes of the model's buffers (the Llama's rotary frequencies; the GPT has none): what DDP
    broadcasts from rank 0 before every forward (``broadcast_buffers=True``, its default)."""
    return 4 * sum(numel(shape) for _, shape in _shapes(cfg.arch, tuple(sorted(cfg.to_dict().items())), True))


def moe_param_split(shapes: dict[str, tuple[int, ...]], num_experts: int) -> tuple[int, list[int]]:
    """(dense parameters, parameters of each expert over all MoE layers) of an MoE model's shapes:
    expert E's parameters are those named ``...experts.E....``; everything else (attention, norms,
    routers, embeddings, head) is dense."""
    per_expert = [0] * num_experts
    dense = 0
    for name, shape in shapes.items():
        match = re.search(r"\.experts\.(\d+)\.", name)
        if match:
            per_expert[int(match.group(1))] += numel(shape)
        else:
            dense += numel(shape)
    return dense, per_expert


def chunk_sizes(length: int, parts: int) -> list[int]:
    """The sizes ``torch.chunk`` (and DTensor ``Shard``) gives each of ``parts`` ranks."""
    size = math.ceil(length / parts)
    return [max(0, min(size, length - r * size)) for r in range(parts)]


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of this shape (1 for a scalar)."""
    return math.prod(shape) if shape else 1


def comm_entry(calls: float | None, payload: float, collective: str, group: int) -> dict:
    """One collective's ``{"calls", "bytes", "bus_bytes"}`` over a group of ``group`` ranks."""
    return {"calls": calls, "bytes": payload, "bus_bytes": payload * bus_factor(collective, group)}


def add_comm(comm: dict, collective: str, calls: float | None, payload: float, group: int) -> None:
    """Add ``calls`` calls moving ``payload`` bytes of ``collective`` to ``comm`` (calls None: unknown)."""
    entry = comm.setdefault(collective, {"calls": 0, "bytes": 0.0, "bus_bytes": 0.0})
    entry["calls"] = None if calls is None or entry["calls"] is None else entry["calls"] + calls
    entry["bytes"] += payload
    entry["bus_bytes"] += payload * bus_factor(collective, group)


# ----------------------------------------------------------------------------------------------
# Compute: model FLOPs per token, the numerator of MFU
# ----------------------------------------------------------------------------------------------

def training_flops_per_token(cfg: GPTConfig | LlamaModelConfig) -> float:
    """Model FLOPs of one training step per token: ``6 N + 12 L d s``.

    Source: Kaplan et al. 2020 (6N: a multiply-add per parameter per token, forward 2N and backward
    4N) with the attention term of PaLM (Chowdhery et al. 2022, appendix B), as torchtitan and
    nanoGPT count it. ``N`` is the parameters that multiply (every matrix and the LM head; not the
    embedding tables, which are looked up); ``12 L d s`` is attention's scores and weighted sum
    (2 matmuls of 2 s d FLOPs per token per layer, forward + backward = 3x), counted over the whole
    sequence as the convention has it (a causal kernel skips about half). Hardware FLOPs that
    activation recomputation adds are not model FLOPs, so checkpointing does not change this.

    A mixture of experts (``gpt_moe``, ``llama_moe``) multiplies each token by its *active*
    parameters: every dense matrix, the router, and ``top_k`` of the ``num_experts`` experts (the
    Switch Transformer / Mixtral count), so N = the dense model's N + router + (top_k - 1) MLPs per
    block. Choices dropped at an expert's capacity still count, as the causal half does: model
    FLOPs are the model's, not what a given routing computed.
    """
    shapes = param_shapes(cfg)
    embeddings = {"tok_emb.weight", "pos_emb.weight", "model.embed_tokens.weight"}
    active_experts = 0
    if is_moe(cfg):  # of the experts' parameters, a token multiplies top_k / num_experts
        experts = sum(numel(shape) for name, shape in shapes.items() if ".experts." in name)
        active_experts = experts // cfg.num_experts * cfg.top_k
        shapes = {name: shape for name, shape in shapes.items() if ".experts." not in name}
    matmul_params = active_experts + sum(numel(shape) for name, shape in shapes.items() if name not in embeddings)
    if getattr(cfg, "tie_embeddings", False):  # the LM head is the embedding matrix: it multiplies
        matmul_params += cfg.vocab_size * cfg.n_embd
    return 6 * matmul_params + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len


# ----------------------------------------------------------------------------------------------
# Data parallelism (DDP, DDP from scratch, ZeRO-0): every rank holds everything and all-reduces
# the gradients. Source: the nccl-tests bus factor above (a ring all-reduce moves 2(n-1)/n x payload).
# ----------------------------------------------------------------------------------------------

def ddp_bytes(psi: float, n: int, bytes_per_grad: int = 4) -> dict[str, float]:
    """Data parallelism's gradient all-reduce per step: payload Ψ x bytes, bus bytes x 2(n-1)/n."""
    payload = psi * bytes_per_grad
    return {"bytes": payload, "bus_bytes": payload * bus_factor("all_reduce", n)}


# ----------------------------------------------------------------------------------------------
# ZeRO (DeepSpeed). Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
# Trillion Parameter Models", SC 2020 (arXiv:1910.02054), section 3 and figure 1: mixed-precision
# Adam keeps 2Ψ bytes of fp16 weights, 2Ψ of fp16 gradients and KΨ of optimizer state (K = 12: fp32
# master weights, momentum, variance); stage 1 partitions the K term, stage 2 also the gradients,
# stage 3 also the weights: (2 + 2 + K)Ψ, 4Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N, (4 + K)Ψ/N. Section 7: stages
# 1-2 move 2Ψ elements per step like data parallelism, stage 3 3Ψ (the weights gathered again in
# backward).
# ----------------------------------------------------------------------------------------------

def zero_paper_bytes(psi: float, n: int, stage: int, k: float = 12) -> dict[str, float]:
    """Per-GPU model-state bytes of mixed-precision Adam under ZeRO ``stage`` (ZeRO paper, fig. 1).

    ``psi`` parameters, ``n`` data-parallel ranks; 2 bytes of fp16 weights, 2 of fp16 gradients,
    ``k`` bytes of optimizer state per parameter (12 for Adam: fp32 master, momentum, variance).
    Stage 0 is plain data parallelism: 16Ψ for Adam.
    """
    params, grads, optimizer = 2 * psi, 2 * psi, k * psi
    if stage >= 1:
        optimizer /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return {"params": params, "grads": grads, "optimizer": optimizer}


def zero_fp32_state_bytes(stage: int, psi: float, n: int, optimizer: str = "adamw") -> dict[str, float]:
    """Per-rank model-state bytes for fp32 training the way DeepSpeed does it (chapter 03), with
    ``optimizer`` (``--optimizer``: ``adamw``, or plain ``sgd``) as the client optimizer.

    The ZeRO paper counts mixed precision (:func:`zero_paper_bytes`). In fp32 the weights and
    gradients take 4 bytes each. The optimizer keeps its moments per element (AdamW: ``exp_avg`` and
    ``exp_avg_sq``, 8 bytes; SGD without momentum: none), and DeepSpeed's ZeRO optimizer (stages
    1-3) adds a separate fp32 master partition even in fp32 training: K = 12 for AdamW, 4 for SGD,
    over N. Stage 0 wraps nothing: the optimizer updates the weights in place and holds only its
    moments, K = 8 or 0. (:func:`distkit.predictors.deepspeed_prediction` adds DeepSpeed's padding,
    parameter by parameter.)
    """
    moment_bytes = {"adamw": 8, "sgd": 0}  # per element; torch's SGD keeps no state at momentum 0
    if optimizer not in moment_bytes:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {', '.join(moment_bytes)}")
    moments = moment_bytes[optimizer]
    if stage == 0:
        return {"params": 4 * psi, "grads": 4 * psi, "optimizer": moments * psi}
    return {"params": 4 * psi / (n if stage >= 3 else 1), "grads": 4 * psi / (n if stage >= 2 else 1),
            "optimizer": (4 + moments) * psi / n}


# ----------------------------------------------------------------------------------------------
# Tensor parallelism. Source: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter
# Language Models Using Model Parallelism", 2019 (arXiv:1909.08053), section 3 and figure 4: per
# transformer layer two all-reduces in the forward pass (after attention and after the MLP, operator
# g) and two in the backward pass (operator f), each of the activations b x s x h. Korthikanti et
# al., "Reducing Activation Recomputation in Large Transformer Models", 2022 (arXiv:2205.05198),
# section 4.2.2: with sequence parallelism each all-reduce becomes a reduce-scatter plus an
# all-gather of the same size.
# ----------------------------------------------------------------------------------------------

def megatron_tp_bytes_per_layer(batch: int, seq_len: int, hidden: int, tp: int,
                                sequence_parallel: bool = False, bytes_per_element: int = 4) -> dict:
    """Tensor-parallel collectives of one transformer layer per step (forward + backward).

    Megatron: 2 all-reduces forward + 2 backward of the ``batch x seq x hidden`` activations.
    With sequence parallelism: 4 all-gathers + 4 reduce-scatters of the same (full) size, the same
    bus bytes as the all-reduces (an all-reduce is a reduce-scatter followed by an all-gather).
    """
    act = batch * seq_len * hidden * bytes_per_element
    if not sequence_parallel:
        return {"all_reduce": comm_entry(4, 4 * act, "all_reduce", tp)}
    return {"all_gather": comm_entry(4, 4 * act, "all_gather", tp),
            "reduce_scatter": comm_entry(4, 4 * act, "reduce_scatter", tp)}


def megatron_tp_bytes(cfg: GPTConfig, batch: int, tp: int, sequence_parallel: bool = False) -> dict:
    """:func:`megatron_tp_bytes_per_layer` for all ``cfg.n_layer`` blocks of the GPT (fp32 activations)."""
    per_layer = megatron_tp_bytes_per_layer(batch, cfg.seq_len, cfg.n_embd, tp, sequence_parallel)
    return {name: {key: value * cfg.n_layer for key, value in stat.items()} for name, stat in per_layer.items()}


# ----------------------------------------------------------------------------------------------
# Pipeline parallelism. Source: Huang et al., "GPipe", 2019 (arXiv:1811.06965) and Narayanan et al.,
# "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021
# (arXiv:2104.04473), section 2.2: with p stages and m micro-batches the idle fraction of a step is
# (p - 1) / (m + p - 1); interleaving v model chunks per rank shrinks it to (p - 1) / (v m + p - 1).
# ----------------------------------------------------------------------------------------------

def pipeline_bubble(stages: int, microbatches: int, chunks_per_rank: int = 1) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (v m + p - 1) (GPipe; Narayanan et al. 2021)."""
    p, m, v = stages, microbatches, chunks_per_rank
    return (p - 1) / (v * m + p - 1)


# ----------------------------------------------------------------------------------------------
# Context parallelism (ring attention). Source: Liu, Zaharia, Abbeel, "Ring Attention with Blockwise
# Transformers for Near-Infinite Context", 2023 (arXiv:2310.01889): the sequence is split over cp
# ranks and each rank's key/value block travels the ring, cp - 1 hops in forward. Backward (as in
# chapter 05's context_parallel.py and ring-flash-attention): K/V travel the same cp - 1 hops again,
# and the gradients dK/dV accumulated for a block travel with it, plus one hop home: cp hops.
# ----------------------------------------------------------------------------------------------

def kv_width(cfg: GPTConfig | LlamaModelConfig) -> int:
    """The width of one token's keys (or values): all heads' for the GPT, n_kv_head x head_dim under
    grouped-query attention (the Llama's), what a ring passes on for each token."""
    return cfg.n_embd * getattr(cfg, "n_kv_head", cfg.n_head) // cfg.n_head


def ring_attention_bytes(batch: int, seq_len: int, kv_width: int, n_layer: int, cp: int,
                         bytes_per_element: int = 4) -> dict:
    """Point-to-point traffic of the by-hand ring attention per rank per training step.

    Every hop sends one rank's K and V (or dK and dV) as one tensor: 2 x batch x seq_len/cp x kv_width
    elements (:func:`kv_width`: the K/V travel with their own heads). Per layer: cp - 1 hops forward,
    2cp - 1 backward: 3cp - 2 sends and as many receives of that size. Zero with one rank (no ring).
    """
    if cp <= 1:
        return {}
    calls = (3 * cp - 2) * n_layer
    payload = 2 * batch * (seq_len // cp) * kv_width * bytes_per_element
    return {"send": comm_entry(calls, calls * payload, "send", cp),
            "recv": comm_entry(calls, calls * payload, "recv", cp)}


def context_parallel_comm(cfg: GPTConfig | LlamaModelConfig, global_batch_size: int, cp: int) -> dict:
    """Collectives per step of ``05-advanced/context_parallel.py --impl ring`` on every rank: the
    ring (:func:`ring_attention_bytes`; every rank attends for the whole global batch) and one
    all-reduce of every (replicated, fp32) gradient over the cp ranks, as DDP would do in buckets."""
    comm = ring_attention_bytes(global_batch_size, cfg.seq_len, kv_width(cfg), cfg.n_layer, cp)
    psi = sum(numel(shape) for shape in param_shapes(cfg).values())
    comm["all_reduce"] = comm_entry(1, 4 * psi, "all_reduce", cp)
    return comm


def zigzag_attention_pairs(cp: int, layout: str = "zigzag") -> list[int]:
    """Causal attention work per rank, in (query chunk, key chunk) pairs computed per layer forward,
    with the sequence cut into 2cp chunks: chunk pair (i, j) is computed when j <= i (a diagonal pair
    with a mask). ``zigzag`` (rank r holds chunks r and 2cp-1-r): 2cp + 1 on every rank;
    ``contiguous`` (rank r holds 2r and 2r+1): 4r + 3, so the last rank does 4cp - 1."""
    held = [(r, 2 * cp - 1 - r) if layout == "zigzag" else (2 * r, 2 * r + 1) for r in range(cp)]
    return [sum(1 for q in mine for other in held for k in other if k <= q) for mine in held]


# ----------------------------------------------------------------------------------------------
# Expert parallelism. Source: Lepikhin et al., "GShard", 2020 (arXiv:2006.16668), section 2.2, and
# Fedus et al., "Switch Transformers", 2021 (arXiv:2101.03961), section 2.2: each MoE layer sends
# every routed token to its expert's rank and back with two all-to-alls forward (dispatch, combine),
# and the backward pass runs both again in reverse.
# ----------------------------------------------------------------------------------------------

def expert_parallel_bytes(hidden: int, sent_rows: int, received_rows: int, num_experts: int,
                          bytes_per_element: int = 4, count_bytes: int = 8) -> int:
    """All-to-all payload of one MoE layer on one rank per training step (05-advanced/expert_parallel.py).

    ``sent_rows``: the routing choices this rank kept (after capacity) and sends to the experts,
    its own included (``all_to_all_single``'s input holds every destination's rows);
    ``received_rows``: the rows its experts receive. Five exchanges: the counts per expert
    (``num_experts`` int64), the dispatch (sent rows of ``hidden`` elements), the combine (the
    received rows go back), and backward the combine's gradient (sent rows) and the dispatch's
    (received rows): (E x 8) + 2 (sent + received) x hidden x 4 bytes. With balanced routing and no
    token dropped, sent = received = k T for T tokens per rank: about 4 k T hidden x 4 bytes per layer.
    """
    return count_bytes * num_experts + 2 * (sent_rows + received_rows) * hidden * bytes_per_element


def expert_parallel_comm(hidden: int, sent_rows: list[int], received_rows: list[int], num_experts: int,
                         ep: int, dp: int, dense_numel: int, expert_numel: int) -> dict:
    """Collectives of one training step on one rank of 05-advanced/expert_parallel.py: per MoE layer
    (``sent_rows`` / ``received_rows``, one entry per layer) 5 all-to-alls of
    :func:`expert_parallel_bytes` over the ep ranks; one all-reduce of the dense (replicated)
    gradients over all dp x ep ranks; one of this rank's experts' gradients over the dp ranks that
    hold the same experts (none when dp = 1)."""
    comm: dict = {}
    for sent, received in zip(sent_rows, received_rows):
        add_comm(comm, "all_to_all", 5, expert_parallel_bytes(hidden, sent, received, num_experts), ep)
    add_comm(comm, "all_reduce", 1, 4 * dense_numel, dp * ep)
    if dp > 1:
        add_comm(comm, "all_reduce", 1, 4 * expert_numel, dp)
    return comm


# ----------------------------------------------------------------------------------------------
# Choosing a strategy from a parameter count: model state per GPU, mixed precision
# ----------------------------------------------------------------------------------------------

# strategy -> how it splits mixed-precision AdamW's (2 + 2 + K)Ψ model state over n GPUs:
#   "replicated"  (4 + K)Ψ on every GPU
#   "zero1"       the ZeRO paper's stage 1: 4Ψ + KΨ/n          (optimizer state split)
#   "zero2"       the ZeRO paper's stage 2: 2Ψ + (2 + K)Ψ/n    (and the gradients)
#   "sharded"     (4 + K)Ψ / n  (everything split n ways: ZeRO-3/FSDP, or the layers by TP/PP/2-D)
#   "shard_group" (4 + K)Ψ / shard group (HSDP: sharded inside a group, replicated across groups)
#   "offload"     4Ψ / n        (ZeRO-3 offload: only the fp16 weights' and gradients' partitions
#                                stay on the GPU, the optimizer state lives in CPU memory)
MIXED_PRECISION_SPLIT = {
    Strategy.DDP: "replicated", Strategy.DDP_FROM_SCRATCH: "replicated", Strategy.FSDP_NO_SHARD: "replicated",
    Strategy.ZERO0: "replicated",
    Strategy.ZERO1: "zero1", Strategy.ZERO2: "zero2", Strategy.FSDP_SHARD_GRAD_OP: "zero2",
    Strategy.ZERO3: "sharded", Strategy.FSDP_FULL_SHARD: "sharded", Strategy.TP: "sharded", Strategy.TP_SP: "sharded",
    Strategy.PP_GPIPE: "sharded", Strategy.PP_1F1B: "sharded", Strategy.PP_INTERLEAVED_1F1B: "sharded",
    Strategy.FSDP_TP_2D: "sharded",
    Strategy.FSDP_HYBRID_SHARD: "shard_group", Strategy.HSDP: "shard_group",
    Strategy.ZERO3_OFFLOAD: "offload",
}


def mixed_precision_state_per_gpu(strategy: str, psi: float, n: int, *, tp: int = 1,
                                  shard_group: int | None = None, k: float = 12) -> float:
    """Model-state bytes per GPU for mixed-precision AdamW (16 bytes/parameter unsharded), split as
    :data:`MIXED_PRECISION_SPLIT` says.

    For choosing a strategy from a parameter count (the notebook's "what fits?"): activations,
    buffers and fragmentation come on top. ``n`` is the number of GPUs; ``shard_group`` the HSDP
    shard-group size (default n). ``tp`` (the TP group of a 2-D mesh) does not change the result:
    TP and FSDP together still split the model state n ways.
    """
    if strategy not in MIXED_PRECISION_SPLIT:
        raise ValueError(f"unknown strategy {strategy!r}")
    full = (4 + k) * psi
    split = MIXED_PRECISION_SPLIT[strategy]
    if split == "replicated":
        return full
    if split in ("zero1", "zero2"):
        return sum(zero_paper_bytes(psi, n, int(split[-1]), k).values())
    if split == "sharded":
        return full / n
    if split == "shard_group":
        return full / (shard_group or n)
    return 4 * psi / n  # offload


# ----------------------------------------------------------------------------------------------
# Activations: what one block keeps from forward for backward
# ----------------------------------------------------------------------------------------------

def activation_bytes_per_layer(cfg, micro_batch: int, ac: str) -> int:
    """Bytes one block keeps from its forward for its backward, fp32, dropout 0.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198, section 4.1): s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit training
    (s sequence, b micro-batch, h width, a heads). Their 34*sbh: LayerNorm inputs 4, QKV input 2,
    Q and K 4, V 2, output-projection input 2, MLP input 2, GELU input 8 (4h wide), GELU output 8,
    two 1-byte dropout masks 2. Their 5*a*s^2*b: softmax output 2, its dropout mask 1, dropout output 2.

    This model in fp32 with dropout 0: every 2-byte tensor takes 4 and the masks vanish, so the
    sbh terms are 2 * 32 = 64*sbh. PyTorch's attention (SDPA, flash-style on CPU and GPU) keeps no
    s x s matrix: it saves Q, K, V, its output O and one log-sum-exp per row and head (4*a*s*b
    bytes), and recomputes the scores in backward. O is the output projection's input, already
    counted (the kernel returns it in (b, s, heads, head_dim) layout, so no copy is made). Add
    LayerNorm's mean and 1/std (2 floats per token, 2 norms): 16*s*b. So none = 64*sbh + 4*asb + 16*sb.

    Full AC keeps the block's input only: 4*sbh (Korthikanti's 2sbh in 16-bit). Selective AC
    (``SAVE_OPS`` of ``05-advanced/activation_checkpointing.py``) keeps the input (1), the outputs
    of the matmuls (Q, K, V: 3, output projection 1, MLP up 4 and down 1) and attention's output O
    (1) and log-sum-exp: 4*11*sbh + 4*asb, and
    recomputes the norms, GELU and residual adds in backward.

    The Llama (``--arch llama``, per token, 4 bytes each): each RMSNorm keeps its normalized input
    and its output (2h, plus 1/rms: 1 float), Q h, K and V h*g/a each (g key/value heads), O h, the
    residual sum h, the block output h, SwiGLU's gate, SiLU, up and product 4*I (I the MLP width), the
    log-sum-exp a: none = 4sb*(8h + 2hg/a + 4I + a + 2). Selective keeps the input, the q/k/v/o
    projections' and the MLP's three matmul outputs, and O: 4sb*(5h + 2hg/a + 2I + a).

    ``titan-op`` is torchtitan's selective op AC: the same save list, but only every other matmul
    of a block is saved ("Saves output of all compute ops, except every second mm", its
    apply_ac): q, v, the MLP's gate and down projections kept, k, the output projection and the up
    projection recomputed. The Llama keeps 4sb*(4h + hg/a + I + a) (input, q, v, O and its
    log-sum-exp, gate, down), the GPT 4sb*(9h + a) (input, qkv, O, the MLP's first matmul).
    """
    if is_moe(cfg):  # balanced routing: k rows per token each way
        return moe_activation_bytes_per_layer(cfg, micro_batch, ac)
    s, b, h, a = cfg.seq_len, micro_batch, cfg.n_embd, cfg.n_head
    if isinstance(cfg, LlamaModelConfig):
        kv, mlp = 2 * h * cfg.n_kv_head // a, cfg.intermediate_size
        per_token = {"none": 8 * h + kv + 4 * mlp + a + 2, "full": h, "selective": 5 * h + kv + 2 * mlp + a,
                     "titan-op": 4 * h + kv // 2 + mlp + a}
    else:
        per_token = {"none": 16 * h + a + 4, "full": h, "selective": 11 * h + a, "titan-op": 9 * h + a}
    return 4 * s * b * per_token[ac]


def _mlp_kept_per_row(cfg, ac: str) -> int:
    """Floats a dense MLP keeps per token beyond its input (which the norm before it keeps): the
    GPT's GELU input and output (8h; selective: fc_in's and fc_out's outputs, 5h), the Llama's
    gate, SiLU, up and product (4I; selective: the three matmul outputs, 2I + h); none with full AC."""
    h = cfg.n_embd
    if ac == "full":
        return 0
    if isinstance(cfg, LlamaModelConfig):
        return 4 * cfg.intermediate_size if ac == "none" else 2 * cfg.intermediate_size + h
    return 8 * h if ac == "none" else 5 * h


def moe_activation_bytes_per_layer(cfg, micro_batch: int, ac: str = "none", received_rows: float | None = None,
                                   sent_rows: float | None = None) -> float:
    """Bytes one mixture-of-experts block keeps from its forward for its backward, fp32
    (``05-advanced/expert_parallel.py``'s layer; measured by MemTracker within 3% on the matrix's
    tiny GPT-MoE cells, and tensor by tensor with ``saved_tensors_hooks``).

    The dense block's (:func:`activation_bytes_per_layer`) without its MLP's inner tensors
    (:func:`_mlp_kept_per_row`), plus, per token, the router's probabilities (E floats), its top-k
    indices (k int64: 2k) and the capacity mask (k bools: k/4); per row an expert received: the
    regrouped copy the expert reads (h), the expert's own inner tensors, and two int64 regrouping
    indices (4); per row this rank sent and got back: the returned row and its gate-weighted copy
    (2h: the multiply and the scatter-add back into the tokens each keep theirs), the gate weight
    (1) and three int64 indices (6). Rows default to balanced routing, k per token each way (no
    choice dropped). Full AC keeps the block's input only, as the dense block."""
    dense = dense_config(cfg)
    base = activation_bytes_per_layer(dense, micro_batch, ac)
    if ac == "full":
        return base
    tokens = micro_batch * cfg.seq_len
    received = cfg.top_k * tokens if received_rows is None else received_rows
    sent = cfg.top_k * tokens if sent_rows is None else sent_rows
    inner = _mlp_kept_per_row(dense, ac)
    per_token = -inner + cfg.num_experts + 2 * cfg.top_k + cfg.top_k / 4
    return base + 4 * (tokens * per_token + received * (cfg.n_embd + inner + 4) + sent * (2 * cfg.n_embd + 7))
