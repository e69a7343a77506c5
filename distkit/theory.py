"""What the textbooks predict for every strategy: per-rank model-state bytes and bytes communicated
per optimizer step, from the model's parameter shapes, the world size and the mesh. The one home of
every formula: chapter scripts print their predictions from it, and ``benchmarks/plot.py``, the
notebooks and the tests put the same predictions next to the harness's measurements.

One section per family of strategies (data parallel, ZeRO, FSDP, tensor parallel, pipeline), each
with its source, its **napkin formula** (public: ``ddp_bytes``, ``zero_paper_bytes``,
``megatron_tp_bytes_per_layer``, ``pipeline_bubble`` ...) and, beside it, its **implementation
model**: the same formula applied parameter by parameter, with what the real implementation does on
top (FSDP2 pads every parameter's dim 0 to a multiple of the shard group, DDP's buckets hold exactly
the gradients, DeepSpeed ZeRO-3 partitions each parameter to ``ceil(numel / n)`` elements, DTensor
shards split with ``torch.chunk`` sizes). Those details are why a prediction can match a
measurement to the byte, and why the napkin formula is still within a fraction of a percent for
models whose shapes divide evenly. :func:`predict` picks the family's model from :data:`PREDICTORS`.

Conventions, shared with :mod:`distkit.harness`: ``bytes`` is the payload of a collective (gathers:
the full output, reduce-scatter: the full input, as nccl-tests counts it) and ``bus_bytes`` the bytes
one rank puts on the wire, payload x the nccl-tests bus factor (NVIDIA/nccl-tests,
``doc/PERFORMANCE.md``: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
broadcast, reduce, send/recv 1), the one :func:`distkit.harness.bus_factor` for measurement and
prediction. Training is fp32 with AdamW (two moments) unless a function says otherwise.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .comm_counter import bus_factor
from .record_format import upgrade_record
from .models import GPTConfig, LlamaModelConfig, build_model, config_from_dict, dense_config, is_moe
from .strategies import MEASURED, Strategy
from .tp_plans import TP_PLANS


# ----------------------------------------------------------------------------------------------
# Shared: parameter shapes, shard sizes, and how a prediction is written down
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
    return 4 * sum(_numel(shape) for _, shape in _shapes(cfg.arch, tuple(sorted(cfg.to_dict().items())), True))


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
        experts = sum(_numel(shape) for name, shape in shapes.items() if ".experts." in name)
        active_experts = experts // cfg.num_experts * cfg.top_k
        shapes = {name: shape for name, shape in shapes.items() if ".experts." not in name}
    matmul_params = active_experts + sum(_numel(shape) for name, shape in shapes.items() if name not in embeddings)
    if getattr(cfg, "tie_embeddings", False):  # the LM head is the embedding matrix: it multiplies
        matmul_params += cfg.vocab_size * cfg.n_embd
    return 6 * matmul_params + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def chunk_sizes(length: int, parts: int) -> list[int]:
    """The sizes ``torch.chunk`` (and DTensor ``Shard``) gives each of ``parts`` ranks."""
    size = math.ceil(length / parts)
    return [max(0, min(size, length - r * size)) for r in range(parts)]


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def _stat(calls: float | None, payload: float, collective: str, group: int) -> dict:
    return {"calls": calls, "bytes": payload, "bus_bytes": payload * bus_factor(collective, group)}


def _add(comm: dict, collective: str, calls: float | None, payload: float, group: int) -> None:
    entry = comm.setdefault(collective, {"calls": 0, "bytes": 0.0, "bus_bytes": 0.0})
    entry["calls"] = None if calls is None or entry["calls"] is None else entry["calls"] + calls
    entry["bytes"] += payload
    entry["bus_bytes"] += payload * bus_factor(collective, group)


def _adamw_state(param_elems: float, grad_elems: float | None = None, bytes_per: int = 4) -> dict:
    """fp32 AdamW: 4 bytes of weight, 4 of gradient and 8 of moments per element held."""
    grad_elems = param_elems if grad_elems is None else grad_elems
    return {"params": param_elems * bytes_per, "grads": grad_elems * bytes_per,
            "optimizer": 2 * param_elems * bytes_per}


def _same_on_every_rank(n: int, state: dict, comm: dict) -> tuple[list[dict], list[dict]]:
    return [dict(state) for _ in range(n)], [comm for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# Data parallelism (DDP, DDP from scratch, ZeRO-0): every rank holds everything and all-reduces
# the gradients. Source: the nccl-tests bus factor above (a ring all-reduce moves 2(n-1)/n x payload).
# ----------------------------------------------------------------------------------------------

def ddp_bytes(psi: float, n: int, bytes_per_grad: int = 4) -> dict[str, float]:
    """Data parallelism's gradient all-reduce per step: payload Ψ x bytes, bus bytes x 2(n-1)/n."""
    payload = psi * bytes_per_grad
    return {"bytes": payload, "bus_bytes": payload * bus_factor("all_reduce", n)}


def _predict_ddp(strategy, shapes, cfg, n, batch, knobs):
    """Every rank holds 16Ψ bytes of fp32 AdamW state and all-reduces 4Ψ bytes of gradients. DDP's
    buckets are flat copies of the gradients (no padding); from scratch, one all-reduce per
    parameter tensor moves the same bytes."""
    psi = sum(_numel(s) for s in shapes.values())
    calls = len(shapes) if strategy == Strategy.DDP_FROM_SCRATCH else None
    comm = {"all_reduce": _stat(calls, 4 * psi, "all_reduce", n)}
    if strategy == Strategy.DDP and buffer_bytes(cfg):  # DDP broadcasts buffers before each forward (one per step)
        comm["broadcast"] = _stat(1, buffer_bytes(cfg), "broadcast", n)
    return _same_on_every_rank(n, _adamw_state(psi), comm)


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


def zero_fp32_state_bytes(stage: int, psi: float, n: int) -> dict[str, float]:
    """Per-rank model-state bytes for fp32 training with AdamW the way DeepSpeed does it (chapter 03).

    The ZeRO paper counts mixed precision (:func:`zero_paper_bytes`). In fp32 the weights and
    gradients take 4 bytes each; DeepSpeed's ZeRO optimizer (stages 1-3) still keeps a separate
    fp32 master partition, so K stays 12. Stage 0 wraps nothing: AdamW updates the weights in
    place, K = 8. (:func:`deepspeed_prediction` adds DeepSpeed's padding, parameter by parameter.)
    """
    if stage == 0:
        return {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    return {"params": 4 * psi / (n if stage >= 3 else 1), "grads": 4 * psi / (n if stage >= 2 else 1),
            "optimizer": 12 * psi / n}


def deepspeed_prediction(stage: int, shapes: dict, n: int, stage3_window: int | None = None) -> tuple[dict, dict]:
    """DeepSpeed ZeRO with this repository's configs (fp32, torch AdamW as the client optimizer).

    State held at the optimizer step (what chapter 03's harness counts): the fp32 weights (stage 3:
    this rank's partition), the fp32 gradient partition handed to the optimizer, and K = 12 bytes of
    optimizer state per partition element: DeepSpeed keeps its own fp32 master partition even in
    fp32 training, plus AdamW's two moments. Stages 1-2 flatten all parameters into one buffer
    padded to a multiple of 2n elements (DeepSpeed's ``nccl_start_alignment_factor`` = 2); stage 3
    partitions each parameter to ``ceil(numel / n)`` elements.

    Communication per step: stages 1-2 all-reduce the full gradient buffer on these CPU/gloo runs
    (DeepSpeed reduces buckets with all-reduce, then each rank keeps its partition) and all-gather
    the updated weights; stage 3 reduce-scatters the gradients and all-gathers the weights in
    forward and again in backward (the paper's 3Ψ), except for what is still gathered when backward
    starts: the last W parameter elements of forward, W = ``stage3_max_live_parameters``
    (``stage3_window`` here, from the record's engine settings). So the weights are gathered
    2 - min(W, Ψ)/Ψ times: twice when W is 0, once when W holds the whole model (and when the
    record names no W: runs recorded before the chapter-03 configs set it used W = 1e9). Those
    configs size W to one rank's share, ceil(Ψ/N): 1.5 gathers on 2 ranks, 1.75 on 4 (measured on
    the tiny GPT, 2-core CPU, gloo: 1.505 and 1.763, the rest is module granularity, well inside the
    1% bar on total bytes). Bookkeeping all-reduces of one or two scalars (overflow flag, gradient
    norm) are not modelled (:data:`BOOKKEEPING_SLACK_BYTES`).
    """
    psi = sum(_numel(s) for s in shapes.values())
    comm: dict = {}
    if stage in (1, 2):
        align = 2 * n
        partition = math.ceil(psi / align) * align // n
        state = {"params": 4 * psi, "grads": 4 * partition, "optimizer": 12 * partition}
        _add(comm, "all_reduce", None, 4 * psi, n)
        _add(comm, "all_gather", None, 4 * partition * n, n)
    else:
        partition = sum(math.ceil(_numel(s) / n) for s in shapes.values())
        state = {"params": 4 * partition, "grads": 4 * partition, "optimizer": 12 * partition}
        gathers = 1.0 if stage3_window is None else 2.0 - min(stage3_window, psi) / psi
        _add(comm, "all_gather", None, gathers * 4 * partition * n, n)
        _add(comm, "reduce_scatter", None, 4 * partition * n, n)
    return state, comm


def _predict_zero(strategy, shapes, cfg, n, batch, knobs):
    """ZeRO-1/2/3 (and ZeRO-3 offload, whose bytes are the same): :func:`deepspeed_prediction`."""
    state, comm = deepspeed_prediction(int(strategy[4]), shapes, n, knobs.get("stage3_max_live_parameters"))
    return _same_on_every_rank(n, state, comm)


# ----------------------------------------------------------------------------------------------
# FSDP2 (``torch.distributed.fsdp.fully_shard``). Source: the FSDP2 design (pytorch/pytorch issue
# #114299): per-parameter sharding on dim 0, padded so every rank holds ceil(dim0 / n) rows; each
# unit all-gathers its parameters before forward (and again before backward when
# ``reshard_after_forward``) and reduce-scatters its gradients after backward; HSDP all-reduces the
# reduced shard across replicas. Napkin: FULL_SHARD = ZeRO-3 (3Ψ), SHARD_GRAD_OP = ZeRO-2 (2Ψ).
# ----------------------------------------------------------------------------------------------

def fsdp_padded_numel(shape: tuple[int, ...], shard_group: int) -> int:
    """Elements of a parameter after FSDP2 pads dim 0 up to a multiple of the shard-group size."""
    if not shape:
        return 1
    rows = math.ceil(shape[0] / shard_group) * shard_group
    return rows * math.prod(shape[1:])


def _units(shapes: dict[str, tuple[int, ...]]) -> tuple[list[list[str]], list[str]]:
    """FSDP units as the chapter scripts wrap them: one per transformer block (the small GPT's
    ``blocks.N``, the Llama's ``model.layers.N``), then the root."""
    blocks: dict[int, list[str]] = {}
    root = []
    for name in shapes:
        block = re.match(r"(?:blocks|model\.layers)\.(\d+)\.", name)
        if block:
            blocks.setdefault(int(block.group(1)), []).append(name)
        else:
            root.append(name)
    return [blocks[i] for i in sorted(blocks)], root


def _fsdp_comm(blocks: list[list[str]], root: list[str], padded: dict[str, int], shard: int, replicas: int,
               reshard_blocks: bool, gather_bytes: int) -> dict:
    """FSDP2's collectives per step, the same on every rank: each block unit's parameters all-gathered
    in forward and (when resharded after forward) again in backward, the root's once; every unit's
    gradients reduce-scattered in the shard group; with replicas, the shards all-reduced across them."""
    comm: dict = {}
    if shard > 1:
        gathers = 2 if reshard_blocks else 1
        for unit in blocks:
            _add(comm, "all_gather", gathers, gathers * gather_bytes * sum(padded[n] for n in unit), shard)
        _add(comm, "all_gather", 1, gather_bytes * sum(padded[n] for n in root), shard)
        for unit in [*blocks, root]:
            _add(comm, "reduce_scatter", 1, 4 * sum(padded[n] for n in unit), shard)
    if replicas > 1:
        for unit in [*blocks, root]:
            _add(comm, "all_reduce", 1, 4 * sum(padded[n] for n in unit) / shard, replicas)
    return comm


def fsdp_prediction(shapes, shard: int, replicas: int, reshard_blocks: bool,
                    local_shapes: dict | None = None, gather_bytes: int = 4,
                    wrap: str = "block") -> tuple[list[dict], dict]:
    """FSDP2 per block + root: state held by each rank of a shard group, and collectives per step.

    Each unit all-gathers its padded parameters before forward and, when resharded after forward,
    again before backward; its gradients are reduce-scattered (input = the padded full size) and,
    with replicas (HSDP), the reduced shard is all-reduced across them. A shard group of one rank
    runs no all-gather / reduce-scatter (NO_SHARD = all-reduce only). The root unit (embeddings,
    final norm, LM head) is never resharded after forward: its weights are the first needed in
    backward (FSDP2 skips the root's reshard by default; chapter 02 sets it explicitly).

    ``gather_bytes``: bytes per gathered element (2 when a bf16 ``MixedPrecisionPolicy`` casts the
    parameters before the all-gather; gradients are still reduced in fp32). ``wrap="root"``: one
    unit for the whole model (``fully_shard(model)`` alone), gathered once per step.
    ``local_shapes``: the shapes this rank's FSDP sees when they differ from ``shapes`` (a TP shard
    in a 2-D mesh).
    """
    shapes = local_shapes or shapes
    blocks, root = _units(shapes)
    if wrap == "root":
        blocks, root = [], list(shapes)
    padded = {name: fsdp_padded_numel(shape, shard) for name, shape in shapes.items()}
    # A rank's local shard is its torch.chunk share of dim 0: the padding rides along in the
    # collectives' buffers but is not part of the last ranks' stored shard.
    held = [sum(chunk_sizes(shape[0], shard)[r] * _numel(shape[1:]) if shape else 1
                for shape in shapes.values()) for r in range(shard)]
    comm = _fsdp_comm(blocks, root, padded, shard, replicas, reshard_blocks, gather_bytes)
    return [_adamw_state(h) for h in held], comm


def _predict_fsdp(strategy, shapes, cfg, n, batch, knobs):
    """FULL_SHARD / SHARD_GRAD_OP over all ranks, NO_SHARD as a shard group of one, HYBRID_SHARD /
    HSDP as ``shard``-rank groups replicated n / shard times (:func:`fsdp_prediction`)."""
    if strategy in (Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP):
        states, comm = fsdp_prediction(shapes, n, 1, reshard_blocks=strategy == Strategy.FSDP_FULL_SHARD)
        return states, [comm] * n
    if strategy == Strategy.FSDP_NO_SHARD:
        states, comm = fsdp_prediction(shapes, 1, n, reshard_blocks=False)
        return _same_on_every_rank(n, states[0], comm)
    shard = int(knobs.get("shard", 2))
    # Blocks are resharded after forward (HYBRID_SHARD = FULL_SHARD inside a replica); the root
    # never is (ch02 says so; ch05 uses fully_shard's default, which skips the root's reshard).
    by_shard_rank, comm = fsdp_prediction(shapes, shard, n // shard, reshard_blocks=True)
    # mesh (replicate, shard): rank r sits at shard coordinate r % shard
    return [by_shard_rank[r % shard] for r in range(n)], [comm] * n


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
        return {"all_reduce": _stat(4, 4 * act, "all_reduce", tp)}
    return {"all_gather": _stat(4, 4 * act, "all_gather", tp),
            "reduce_scatter": _stat(4, 4 * act, "reduce_scatter", tp)}


def megatron_tp_bytes(cfg: GPTConfig, batch: int, tp: int, sequence_parallel: bool = False) -> dict:
    """:func:`megatron_tp_bytes_per_layer` for all ``cfg.n_layer`` blocks of the GPT (fp32 activations)."""
    per_layer = megatron_tp_bytes_per_layer(batch, cfg.seq_len, cfg.n_embd, tp, sequence_parallel)
    return {name: {key: value * cfg.n_layer for key, value in stat.items()} for name, stat in per_layer.items()}


def _tp_leaves(part: int, style: type) -> frozenset[str]:
    """Last names of the modules the chapter-05 plans (:mod:`distkit.tp_plans`, the small GPT's and
    the Llama's with sequence parallelism) split with ``style``: ``part`` 0 in the blocks, 1 outside."""
    plans = [make(sequence_parallel=True)[part] for make in TP_PLANS.values()]
    return frozenset(name.rsplit(".", 1)[-1] for plan in plans for name, how in plan.items() if isinstance(how, style))


# The chapter-05 TP plan by module name (GQA's narrower k/v_proj split the same way, n_kv_head / tp
# heads per rank): q/k/v_proj, fc_in, gate/up_proj column-parallel; out_proj, fc_out, o_proj,
# down_proj row-parallel; under SP the embedding tables row-split and the LM head column-split.
_TP_COLUMN = _tp_leaves(0, ColwiseParallel)
_TP_ROW = _tp_leaves(0, RowwiseParallel)
_TP_EMBEDDINGS = _tp_leaves(1, RowwiseParallel)
_TP_SP_COLUMN = _tp_leaves(1, ColwiseParallel)


def _tp_local_numel(name: str, shape: tuple[int, ...], tp: int, rank: int, sequence_parallel: bool) -> int:
    """Elements TP rank ``rank`` holds of one parameter under the chapter-05 plan.

    Column-parallel (q/k/v_proj, fc_in, gate/up_proj; with SP also lm_head): weight and bias split
    on dim 0. Row-parallel (out_proj, fc_out, o_proj, down_proj; with SP also the embedding tables,
    which split by rows): weight split on dim 1 (embeddings: dim 0), bias replicated. Everything
    else (norms) is replicated.
    """
    leaf = name.split(".")[-2] if "." in name else name
    kind = name.rsplit(".", 1)[-1]
    if leaf in _TP_COLUMN or (sequence_parallel and leaf in _TP_SP_COLUMN):
        dim = 0
    elif leaf in _TP_ROW and kind == "weight":
        dim = 1
    elif sequence_parallel and leaf in _TP_EMBEDDINGS:
        dim = 0
    else:
        return _numel(shape)
    return chunk_sizes(shape[dim], tp)[rank] * _numel(shape) // shape[dim]


def _tp_local_shape(name: str, shape: tuple[int, ...], tp: int, rank: int) -> tuple[int, ...]:
    numel = _tp_local_numel(name, shape, tp, rank, sequence_parallel=False)
    if numel == _numel(shape):
        return shape
    leaf = name.split(".")[-2]
    if leaf in _TP_ROW:
        return (shape[0], numel // shape[0])
    return (numel // _numel(shape[1:]), *shape[1:])


def _tp_sp_extras(comm: dict, shapes: dict, cfg: GPTConfig, batch: int, tp: int) -> None:
    """Sequence parallelism outside the blocks, and the replicated parameters' gradients.

    tok_emb / pos_emb (the Llama: embed_tokens alone; its positions are rotary, no table) are
    row-parallel with a sequence-sharded output: a reduce-scatter forward (of the batch's and of the
    position table's activations), an all-gather of their gradients backward; the LM head gathers
    the sequence (all-gather forward, reduce-scatter backward) and its column-parallel logits are
    all-gathered (``batch x seq x vocab``).

    The norms' parameters (LayerNorm weight and bias, RMSNorm weight) see only their sequence
    shard, so their gradients come out of backward as ``Partial`` DTensors; the chapter-05 script
    all-reduces each once after backward (``reduce_partial_grads``): one all-reduce of its size per
    norm parameter. (Left Partial, the optimizer would all-reduce them inside its own ops, once per op
    that reads the gradient.)
    """
    for name, shape in shapes.items():
        leaf = name.split(".")[-2] if "." in name else name
        if leaf not in _TP_ROW and _tp_local_numel(name, shape, tp, 0, sequence_parallel=True) == _numel(shape):
            _add(comm, "all_reduce", 1, 4 * _numel(shape), tp)
    act = batch * cfg.seq_len * cfg.n_embd * 4
    tables, pos = (1, 0) if cfg.arch == "llama" else (2, cfg.seq_len * cfg.n_embd * 4)
    logits = batch * cfg.seq_len * cfg.vocab_size * 4
    _add(comm, "reduce_scatter", tables, act + pos, tp)
    _add(comm, "all_gather", tables, act + pos, tp)
    _add(comm, "all_gather", 2, act + logits, tp)
    _add(comm, "reduce_scatter", 1, act, tp)


def _predict_tp(strategy, shapes, cfg, n, batch, knobs):
    """Megatron tensor parallelism over all n ranks (:func:`megatron_tp_bytes`), with sequence
    parallelism for ``tp_sp``. With SP the embedding tables are row-sharded, but their gradients
    arrive as full replicated tensors (measured: DTensor's embedding backward returns Replicate)."""
    sp = strategy == Strategy.TP_SP
    states = [_adamw_state(sum(_tp_local_numel(k, s, n, r, sp) for k, s in shapes.items()),
                           sum(_numel(s) if sp and k.split(".")[-2] in _TP_EMBEDDINGS
                               else _tp_local_numel(k, s, n, r, sp) for k, s in shapes.items()))
              for r in range(n)]
    comm = megatron_tp_bytes(cfg, batch, n, sp)
    if sp:
        _tp_sp_extras(comm, shapes, cfg, batch, n)
    return states, [comm for _ in range(n)]


def _predict_fsdp_tp(strategy, shapes, cfg, n, batch, knobs):
    """2-D mesh (dp, tp): TP inside a group of ``tp`` ranks, FSDP2 over the dp ranks that hold the
    same TP shard; each dp group's batch is the global batch / dp."""
    tp = int(knobs.get("tp", 2))
    dp = n // tp
    states, comms = [], []
    for rank in range(n):
        local = {k: _tp_local_shape(k, s, tp, rank % tp) for k, s in shapes.items()}
        by_dp_rank, comm = fsdp_prediction(shapes, dp, 1, reshard_blocks=True, local_shapes=local)
        tp_comm = megatron_tp_bytes(cfg, batch // dp, tp)
        _add(comm, "all_reduce", tp_comm["all_reduce"]["calls"], tp_comm["all_reduce"]["bytes"], tp)
        states.append(by_dp_rank[rank // tp])  # mesh (dp, tp): rank r sits at dp coordinate r // tp
        comms.append(comm)
    return states, comms


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


def _pp_stage_names(shapes: dict, stage: int, num_stages: int, n_layer: int) -> list[str]:
    """Parameters of pipeline stage ``stage`` (blocks spread evenly; embeddings first, final norm
    and head last): the GPT's ``blocks.N`` / ``tok_emb``, ``pos_emb``, the Llama's
    ``model.layers.N`` / ``model.embed_tokens``."""
    first, last = stage * n_layer // num_stages, (stage + 1) * n_layer // num_stages
    names = []
    for name in shapes:
        block = re.match(r"(?:blocks|model\.layers)\.(\d+)\.", name)
        if block:
            if first <= int(block.group(1)) < last:
                names.append(name)
        elif name.startswith(("tok_emb", "pos_emb", "model.embed_tokens")):
            if stage == 0:
                names.append(name)
        elif stage == num_stages - 1:
            names.append(name)
    return names


def _predict_pipeline(strategy, shapes, cfg, n, batch, knobs):
    """Each rank holds its stages' parameters and, per micro-batch and stage boundary, sends one
    activation of a micro-batch forward and receives its gradient backward; interleaved 1F1B gives
    each rank ``stages_per_rank`` stages (r, r + n, ...)."""
    per_rank = int(knobs.get("stages_per_rank", 2)) if strategy == Strategy.PP_INTERLEAVED_1F1B else 1
    m = int(knobs.get("microbatches", 4))
    num_stages = n * per_rank
    micro_act = batch * cfg.seq_len * cfg.n_embd * 4 / m  # one fp32 activation of a micro-batch
    states, comms = [], []
    for rank in range(n):
        mine = [s for s in range(num_stages) if s % n == rank]
        names = [k for s in mine for k in _pp_stage_names(shapes, s, num_stages, cfg.n_layer)]
        states.append(_adamw_state(sum(_numel(shapes[k]) for k in names)))
        comm: dict = {}
        for s in mine:  # activations forward, their gradients backward, one per micro-batch
            if s < num_stages - 1:
                _add(comm, "send", m, m * micro_act, 2)
                _add(comm, "recv", m, m * micro_act, 2)
            if s > 0:
                _add(comm, "recv", m, m * micro_act, 2)
                _add(comm, "send", m, m * micro_act, 2)
        comms.append(comm)
    return states, comms


# ----------------------------------------------------------------------------------------------
# predict: the family's implementation model for one benchmark cell
# ----------------------------------------------------------------------------------------------

PREDICTORS = {
    Strategy.DDP: _predict_ddp, Strategy.DDP_FROM_SCRATCH: _predict_ddp, Strategy.ZERO0: _predict_ddp,
    Strategy.FSDP_NO_SHARD: _predict_fsdp, Strategy.FSDP_SHARD_GRAD_OP: _predict_fsdp,
    Strategy.FSDP_FULL_SHARD: _predict_fsdp, Strategy.FSDP_HYBRID_SHARD: _predict_fsdp, Strategy.HSDP: _predict_fsdp,
    Strategy.ZERO1: _predict_zero, Strategy.ZERO2: _predict_zero, Strategy.ZERO3: _predict_zero,
    Strategy.ZERO3_OFFLOAD: _predict_zero,
    Strategy.TP: _predict_tp, Strategy.TP_SP: _predict_tp,
    Strategy.PP_GPIPE: _predict_pipeline, Strategy.PP_1F1B: _predict_pipeline,
    Strategy.PP_INTERLEAVED_1F1B: _predict_pipeline,
    Strategy.FSDP_TP_2D: _predict_fsdp_tp,
}


def predict(strategy: str, cfg: GPTConfig, world_size: int, global_batch_size: int,
            knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted model-state bytes per rank and collectives per step per rank for one benchmark cell.

    Returns ``{"state_per_rank": [{"params", "grads", "optimizer"}, ...],
    "comm_per_rank": [{collective: {"calls", "bytes", "bus_bytes"}}, ...], "param_count": Ψ}``
    (bytes and bus bytes as the module docstring defines them). ``knobs``: ``shard`` (HSDP
    shard-group size), ``tp`` (2-D mesh TP size), ``microbatches``, ``stage3_max_live_parameters``
    (ZeRO-3's window of gathered parameters), ``stages_per_rank`` (interleaved pipeline), ``cp``
    (context-parallel group size), ``ep`` (expert-parallel group size) and ``routing`` (expert
    parallelism: rows each rank sent and received per MoE layer; balanced routing without it).
    """
    if strategy not in PREDICTORS:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(MEASURED)}")
    shapes = param_shapes(cfg)
    states, comms = PREDICTORS[strategy](strategy, shapes, cfg, world_size, global_batch_size, knobs or {})
    return {"strategy": strategy, "param_count": sum(_numel(s) for s in shapes.values()),
            "state_per_rank": states, "comm_per_rank": comms}


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
    (``SAVE_OPS`` of ``05-advanced/activation_checkpointing.py``) keeps the input (1), the outputs of the matmuls (Q, K, V: 3, output projection
    1, MLP up 4 and down 1) and attention's output O (1) and log-sum-exp: 4*11*sbh + 4*asb, and
    recomputes the norms, GELU and residual adds in backward.

    The Llama (``--arch llama``, per token, 4 bytes each): each RMSNorm keeps its normalized input
    and its output (2h, plus 1/rms: 1 float), Q h, K and V h*g/a each (g key/value heads), O h, the
    residual sum h, the block output h, SwiGLU's gate, SiLU, up and product 4*I (I the MLP width), the
    log-sum-exp a: none = 4sb*(8h + 2hg/a + 4I + a + 2). Selective keeps the input, the q/k/v/o
    projections' and the MLP's three matmul outputs, and O: 4sb*(5h + 2hg/a + 2I + a).
    """
    if is_moe(cfg):  # balanced routing: k rows per token each way
        return moe_activation_bytes_per_layer(cfg, micro_batch, ac)
    s, b, h, a = cfg.seq_len, micro_batch, cfg.n_embd, cfg.n_head
    if isinstance(cfg, LlamaModelConfig):
        kv, mlp = 2 * h * cfg.n_kv_head // a, cfg.intermediate_size
        per_token = {"none": 8 * h + kv + 4 * mlp + a + 2, "full": h, "selective": 5 * h + kv + 2 * mlp + a}
    else:
        per_token = {"none": 16 * h + a + 4, "full": h, "selective": 11 * h + a}
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


# ----------------------------------------------------------------------------------------------
# Records: the prediction for the cell a harness record measured, and the comparison
# ----------------------------------------------------------------------------------------------

def config_of_record(record: dict) -> GPTConfig | LlamaModelConfig:
    """The model config a harness record was trained with (its ``model`` field; see
    :func:`distkit.harness.upgrade_record` for records written before that field existed)."""
    model = upgrade_record(record).get("model") or {}
    if model.get("arch") not in ("gpt", "llama", "gpt_moe", "llama_moe"):
        raise ValueError(f"record of {record.get('strategy')!r} is not of a transformer: {record.get('model')}")
    return config_from_dict(model)


def knobs_of_record(record: dict) -> dict[str, Any]:
    """Strategy knobs (mesh shape, micro-batches ...) as :func:`predict` expects them; for expert
    parallelism also the rows each rank routed in the step the harness counted
    (``counted_routing_per_rank``, written by ``05-advanced/expert_parallel.py``): ``routing``,
    per rank, per MoE layer, (rows sent, rows received)."""
    config = record.get("config", {})
    knobs: dict[str, Any] = {}
    mesh = config.get("mesh") or {}
    if "tp" in mesh:
        knobs["tp"] = mesh["tp"]
    if "ep" in mesh:
        knobs["ep"] = mesh["ep"]
    if config.get("cp"):
        knobs["cp"] = config["cp"]
    if record.get("counted_routing_per_rank"):
        knobs["routing"] = [[(sum(layer["sent"]), sum(map(sum, layer["received"]))) for layer in rank]
                            for rank in record["counted_routing_per_rank"]]
    if "shard" in mesh:
        knobs["shard"] = mesh["shard"]
    if config.get("hsdp_shard_size"):
        knobs["shard"] = config["hsdp_shard_size"]
    for key in ("microbatches", "stages_per_rank"):
        if config.get(key):
            knobs[key] = config[key]
    window = (config.get("engine_settings") or {}).get("stage3_max_live_parameters")
    if window is not None:
        knobs["stage3_max_live_parameters"] = window
    return knobs


def predict_record(record: dict) -> dict[str, Any]:
    """:func:`predict` for the cell a harness record measured."""
    config = record.get("config", {})
    return predict(record["strategy"], config_of_record(record), record["world_size"],
                   int(config["global_batch_size"]), knobs_of_record(record))


# DeepSpeed adds one or two all-reduces of a scalar per step (overflow flag, gradient norm): 4-8
# bytes that theory does not model. Differences up to this many bytes per collective are ignored.
BOOKKEEPING_SLACK_BYTES = 16


def relative_error(measured: float, predicted: float, slack: float = 0.0) -> float:
    """|measured - predicted| / predicted, after forgiving ``slack`` bytes of difference
    (0 when they agree within the slack; inf when only the prediction is 0)."""
    diff = max(abs(measured - predicted) - slack, 0.0)
    if diff == 0:
        return 0.0
    return diff / predicted if predicted else math.inf


def compare_record(record: dict) -> dict[str, Any]:
    """Measured vs predicted for one record: total model-state bytes and bytes per collective,
    per rank, with the worst relative error of each."""
    pred = predict_record(record)
    metrics = record["metrics"]
    state_rows, comm_rows = [], []
    for rank, measured in enumerate(metrics["model_state_bytes_per_rank"]):
        want = pred["state_per_rank"][rank]
        state_rows.append({"rank": rank, "measured": sum(measured.values()), "predicted": sum(want.values()),
                           "measured_by_kind": measured, "predicted_by_kind": want})
    for rank, measured in enumerate(metrics.get("comm_per_step_per_rank") or [metrics["comm_per_step"]]):
        want = pred["comm_per_rank"][rank]
        for name in sorted(set(measured) | set(want)):
            if name == "barrier":
                continue
            got = measured.get(name, {}).get("bytes", 0.0)
            exp = want.get(name, {}).get("bytes", 0.0)
            comm_rows.append({"rank": rank, "collective": name, "measured": got, "predicted": exp,
                              "measured_bus": measured.get(name, {}).get("bus_bytes", 0.0),
                              "predicted_bus": want.get(name, {}).get("bus_bytes", 0.0)})
    total = lambda rows, key: sum(r[key] for r in rows if r["rank"] == 0)  # noqa: E731
    return {
        "strategy": record["strategy"], "world_size": record["world_size"],
        "state": state_rows, "comm": comm_rows,
        "state_error": max(relative_error(r["measured"], r["predicted"]) for r in state_rows),
        "comm_error": max([relative_error(r["measured"], r["predicted"], BOOKKEEPING_SLACK_BYTES)
                           for r in comm_rows] or [0.0]),
        "comm_bytes_rank0": {"measured": total(comm_rows, "measured"), "predicted": total(comm_rows, "predicted")},
    }


# ----------------------------------------------------------------------------------------------
# Planning at scale (``distkit.planner``): the busiest rank's share without listing every rank
# ----------------------------------------------------------------------------------------------

def fsdp_rank_prediction(shapes, shard: int, replicas: int, reshard_blocks: bool, rank: int = 0,
                         local_shapes: dict | None = None, gather_bytes: int = 4) -> tuple[dict, dict]:
    """:func:`fsdp_prediction` for the one rank ``rank`` of the shard group: the same state and the
    same collectives, in time linear in the parameters. ``fsdp_prediction`` lists every rank's
    share (parameters x shard group squared: two minutes for the Llama-3.1-8B shape over 512 ranks),
    which a planner asking "does rank 0 fit?" for 1 to 512 GPUs cannot wait for. Rank 0 holds the
    most: ``torch.chunk`` gives the first ranks ``ceil(rows / n)`` rows and the last ones the rest.
    ``tests/test_planner.py`` checks it equals ``fsdp_prediction`` rank by rank."""
    shapes = local_shapes or shapes
    blocks, root = _units(shapes)
    padded = {name: fsdp_padded_numel(shape, shard) for name, shape in shapes.items()}

    def rows(length: int) -> int:  # chunk_sizes(length, shard)[rank], without the list
        size = math.ceil(length / shard)
        return max(0, min(size, length - rank * size))

    held = sum(rows(shape[0]) * _numel(shape[1:]) if shape else 1 for shape in shapes.values())
    return _adamw_state(held), _fsdp_comm(blocks, root, padded, shard, replicas, reshard_blocks, gather_bytes)


def busiest_rank_prediction(strategy: str, cfg: GPTConfig | LlamaModelConfig, world_size: int,
                            global_batch_size: int, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`predict` for the rank holding the most model state (the one that decides whether a
    configuration fits): ``{"rank", "state": {"params", "grads", "optimizer"}, "comm": {...},
    "param_count"}``. The FSDP family (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HSDP,
    FSDP x TP) goes through :func:`fsdp_rank_prediction` for rank 0, which holds the most of every
    parameter; every other strategy through :func:`predict` itself (linear in the ranks)."""
    knobs = knobs or {}
    shapes = param_shapes(cfg)
    n = world_size
    psi = sum(_numel(s) for s in shapes.values())
    if strategy in (Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP, Strategy.FSDP_NO_SHARD,
                    Strategy.FSDP_HYBRID_SHARD, Strategy.HSDP):
        shard = {Strategy.FSDP_FULL_SHARD: n, Strategy.FSDP_SHARD_GRAD_OP: n, Strategy.FSDP_NO_SHARD: 1}.get(strategy)
        shard = shard or int(knobs.get("shard", 2))
        resharded = strategy not in (Strategy.FSDP_SHARD_GRAD_OP, Strategy.FSDP_NO_SHARD)
        state, comm = fsdp_rank_prediction(shapes, shard, n // shard, reshard_blocks=resharded)
        return {"rank": 0, "state": state, "comm": comm, "param_count": psi}
    if strategy == Strategy.FSDP_TP_2D:
        tp = int(knobs.get("tp", 2))
        dp = n // tp
        local = {k: _tp_local_shape(k, s, tp, 0) for k, s in shapes.items()}
        state, comm = fsdp_rank_prediction(shapes, dp, 1, reshard_blocks=True, local_shapes=local)
        tp_comm = megatron_tp_bytes(cfg, global_batch_size // dp, tp)
        _add(comm, "all_reduce", tp_comm["all_reduce"]["calls"], tp_comm["all_reduce"]["bytes"], tp)
        return {"rank": 0, "state": state, "comm": comm, "param_count": psi}
    pred = predict(strategy, cfg, n, global_batch_size, knobs)
    rank = max(range(n), key=lambda r: sum(pred["state_per_rank"][r].values()))
    return {"rank": rank, "state": pred["state_per_rank"][rank], "comm": pred["comm_per_rank"][rank],
            "param_count": psi}


# ----------------------------------------------------------------------------------------------
# Context parallelism (ring attention). Source: Liu, Zaharia, Abbeel, "Ring Attention with Blockwise
# Transformers for Near-Infinite Context", 2023 (arXiv:2310.01889): the sequence is split over cp
# ranks and each rank's key/value block travels the ring, cp - 1 hops in forward. Backward (as in
# chapter 05's context_parallel.py and ring-flash-attention): K/V travel the same cp - 1 hops again,
# and the gradients dK/dV accumulated for a block travel with it, plus one hop home: cp hops.
# ----------------------------------------------------------------------------------------------

def ring_attention_bytes(batch: int, seq_len: int, hidden: int, n_layer: int, cp: int,
                         bytes_per_element: int = 4) -> dict:
    """Point-to-point traffic of the by-hand ring attention per rank per training step.

    Every hop sends one rank's K and V (or dK and dV) as one tensor: 2 x batch x seq_len/cp x hidden
    elements (all heads). Per layer: cp - 1 hops forward, 2cp - 1 backward: 3cp - 2 sends and as many
    receives of that size. Zero with one rank (no ring).
    """
    if cp <= 1:
        return {}
    calls = (3 * cp - 2) * n_layer
    payload = 2 * batch * (seq_len // cp) * hidden * bytes_per_element
    return {"send": _stat(calls, calls * payload, "send", cp), "recv": _stat(calls, calls * payload, "recv", cp)}


def context_parallel_comm(cfg: GPTConfig, global_batch_size: int, cp: int) -> dict:
    """Collectives per step of ``05-advanced/context_parallel.py --impl ring`` on every rank: the
    ring (:func:`ring_attention_bytes`; every rank attends for the whole global batch) and one
    all-reduce of every (replicated, fp32) gradient over the cp ranks, as DDP would do in buckets."""
    comm = ring_attention_bytes(global_batch_size, cfg.seq_len, cfg.n_embd, cfg.n_layer, cp)
    psi = sum(_numel(shape) for shape in param_shapes(cfg).values())
    comm["all_reduce"] = _stat(1, 4 * psi, "all_reduce", cp)
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
        _add(comm, "all_to_all", 5, expert_parallel_bytes(hidden, sent, received, num_experts), ep)
    _add(comm, "all_reduce", 1, 4 * dense_numel, dp * ep)
    if dp > 1:
        _add(comm, "all_reduce", 1, 4 * expert_numel, dp)
    return comm


# ----------------------------------------------------------------------------------------------
# The predictors of context and expert parallelism for the benchmark matrix (registered in
# PREDICTORS here, below the formulas they use)
# ----------------------------------------------------------------------------------------------

def _predict_cp(strategy, shapes, cfg, n, batch, knobs):
    """Context parallelism (``05-advanced/context_parallel.py --impl ring``): every rank a full fp32
    AdamW replica (16 bytes per parameter, as DDP), a ring of ``cp`` ranks (default: all n) per
    group of sequences, and the gradients all-reduced over all n ranks. With n / cp > 1 replicas
    (data parallel x context parallel, the planner's layout) each ring attends its replica's share of
    the batch; the chapter script runs cp = n: one ring, the whole global batch. A K/V block is as
    wide as the key/value heads: the GPT's n_embd, a grouped-query Llama's n_embd x n_kv_head /
    n_head."""
    cp = int(knobs.get("cp", n))
    if n % cp or batch % (n // cp):
        raise ValueError(f"cp {cp} does not divide {n} ranks, or the batch {batch} the {n // cp} replicas")
    kv_width = cfg.n_embd * getattr(cfg, "n_kv_head", cfg.n_head) // cfg.n_head
    comm = ring_attention_bytes(batch // (n // cp), cfg.seq_len, kv_width, cfg.n_layer, cp)
    psi = sum(_numel(shape) for shape in shapes.values())
    comm["all_reduce"] = _stat(1, 4 * psi, "all_reduce", n)
    return _same_on_every_rank(n, _adamw_state(psi), comm)


def moe_param_split(shapes: dict[str, tuple[int, ...]], num_experts: int) -> tuple[int, list[int]]:
    """(dense parameters, parameters of each expert over all MoE layers) of an MoE model's shapes:
    expert E's parameters are those named ``...experts.E....``; everything else (attention, norms,
    routers, embeddings, head) is dense."""
    per_expert = [0] * num_experts
    dense = 0
    for name, shape in shapes.items():
        match = re.search(r"\.experts\.(\d+)\.", name)
        if match:
            per_expert[int(match.group(1))] += _numel(shape)
        else:
            dense += _numel(shape)
    return dense, per_expert


def _predict_ep(strategy, shapes, cfg, n, batch, knobs):
    """Expert parallelism (``05-advanced/expert_parallel.py``) on a (dp, ep) mesh, rank = dp index x
    ep + ep index: each rank holds the dense parameters and the num_experts / ep experts of its ep
    index (fp32 AdamW, 16 bytes per parameter held); collectives from :func:`expert_parallel_comm`
    with the rows it routed (``knobs["routing"]``, what the record counted: routing depends on the
    data) or, without them, balanced routing: each rank's T = batch / n x seq_len tokens send k T
    rows and receive k T (every expert gets T k / E of every rank, within its capacity when the
    capacity factor is at least 1: nothing dropped)."""
    if not is_moe(cfg):
        raise ValueError(f"expert parallelism needs a mixture-of-experts model (gpt_moe / llama_moe), got {cfg.arch}")
    ep = int(knobs.get("ep", n))
    if n % ep or cfg.num_experts % ep or batch % n:
        raise ValueError(f"ep {ep} must divide {n} ranks and {cfg.num_experts} experts, and {n} ranks the "
                         f"batch {batch}")
    dp, local = n // ep, cfg.num_experts // ep
    dense, per_expert = moe_param_split(shapes, cfg.num_experts)
    held = [sum(per_expert[j * local:(j + 1) * local]) for j in range(ep)]  # by ep index
    balanced = [(cfg.top_k * batch // n * cfg.seq_len,) * 2] * cfg.n_layer
    routing = knobs.get("routing") or [balanced] * n
    states, comms = [], []
    for rank in range(n):
        sent, received = zip(*routing[rank])
        states.append(_adamw_state(dense + held[rank % ep]))
        comms.append(expert_parallel_comm(cfg.n_embd, list(sent), list(received), cfg.num_experts, ep, dp,
                                          dense_numel=dense, expert_numel=held[rank % ep]))
    return states, comms


PREDICTORS.update({Strategy.CP: _predict_cp, Strategy.EP: _predict_ep})
