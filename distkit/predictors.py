"""Per-strategy predictors: the model-state bytes each rank holds and the bytes each rank
communicates per optimizer step, for every strategy of :data:`distkit.strategies.MEASURED`, from
the model's parameter shapes, the world size and the mesh. Chapter scripts print them, and
``benchmarks/plot.py``, the notebooks and the tests put them next to the harness's measurements
(:mod:`distkit.compare`); the planner asks :func:`busiest_rank_prediction`.

Each family's **implementation model** is its napkin formula (:mod:`distkit.theory`) applied
parameter by parameter, with what the real implementation does on top: FSDP2 pads every parameter's
dim 0 to a multiple of the shard group, DDP's buckets hold exactly the gradients, DeepSpeed ZeRO-3
partitions each parameter to ``ceil(numel / n)`` elements, DTensor shards split with ``torch.chunk``
sizes, tensor parallelism splits what the chapter-05 plans (:mod:`distkit.tp_plans`) say. Those
details are why a prediction can match a measurement to the byte, and why the napkin formula is
still within a fraction of a percent for models whose shapes divide evenly. :func:`predict` picks
the family's model from :data:`PREDICTORS`; the model-parallel families (TP, PP, CP, EP) are
written in :mod:`distkit.predictors_model_parallel`. Bytes, bus bytes and fp32 AdamW as
:mod:`distkit.theory` defines them.
"""
from __future__ import annotations

import math
import re
from typing import Any

from .models import GPTConfig, LlamaModelConfig
from .predictors_model_parallel import (
    adamw_state,
    predict_cp,
    predict_ep,
    predict_pipeline,
    predict_tp,
    same_on_every_rank,
    tp_local_shape,
)
from .strategies import MEASURED, Strategy
from .theory import (
    add_comm,
    buffer_bytes,
    chunk_sizes,
    comm_entry,
    megatron_tp_bytes,
    numel,
    param_shapes,
)

# ----------------------------------------------------------------------------------------------
# Data parallelism (DDP, DDP from scratch, ZeRO-0): the gradients as they are, no padding
# ----------------------------------------------------------------------------------------------

def _predict_ddp(strategy, shapes, cfg, n, batch, knobs):
    """Every rank holds 16Ψ bytes of fp32 AdamW state and all-reduces 4Ψ bytes of gradients. DDP's
    buckets are flat copies of the gradients (no padding); from scratch, one all-reduce per
    parameter tensor moves the same bytes."""
    psi = sum(numel(s) for s in shapes.values())
    calls = len(shapes) if strategy == Strategy.DDP_FROM_SCRATCH else None
    comm = {"all_reduce": comm_entry(calls, 4 * psi, "all_reduce", n)}
    if strategy == Strategy.DDP and buffer_bytes(cfg):  # DDP broadcasts buffers before each forward (one per step)
        comm["broadcast"] = comm_entry(1, buffer_bytes(cfg), "broadcast", n)
    return same_on_every_rank(n, adamw_state(psi), comm)


# ----------------------------------------------------------------------------------------------
# ZeRO (DeepSpeed) as this repository configures it: fp32, DeepSpeed's own padding and window
# ----------------------------------------------------------------------------------------------

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
    norm) are not modelled (:data:`distkit.compare.BOOKKEEPING_SLACK_BYTES`).
    """
    psi = sum(numel(s) for s in shapes.values())
    comm: dict = {}
    if stage in (1, 2):
        align = 2 * n
        partition = math.ceil(psi / align) * align // n
        state = {"params": 4 * psi, "grads": 4 * partition, "optimizer": 12 * partition}
        add_comm(comm, "all_reduce", None, 4 * psi, n)
        add_comm(comm, "all_gather", None, 4 * partition * n, n)
    else:
        partition = sum(math.ceil(numel(s) / n) for s in shapes.values())
        state = {"params": 4 * partition, "grads": 4 * partition, "optimizer": 12 * partition}
        gathers = 1.0 if stage3_window is None else 2.0 - min(stage3_window, psi) / psi
        add_comm(comm, "all_gather", None, gathers * 4 * partition * n, n)
        add_comm(comm, "reduce_scatter", None, 4 * partition * n, n)
    return state, comm


def _predict_zero(strategy, shapes, cfg, n, batch, knobs):
    """ZeRO-1/2/3 (and ZeRO-3 offload, whose bytes are the same): :func:`deepspeed_prediction`."""
    state, comm = deepspeed_prediction(int(strategy[4]), shapes, n, knobs.get("stage3_max_live_parameters"))
    return same_on_every_rank(n, state, comm)


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
            add_comm(comm, "all_gather", gathers, gathers * gather_bytes * sum(padded[n] for n in unit), shard)
        add_comm(comm, "all_gather", 1, gather_bytes * sum(padded[n] for n in root), shard)
        for unit in [*blocks, root]:
            add_comm(comm, "reduce_scatter", 1, 4 * sum(padded[n] for n in unit), shard)
    if replicas > 1:
        for unit in [*blocks, root]:
            add_comm(comm, "all_reduce", 1, 4 * sum(padded[n] for n in unit) / shard, replicas)
    return comm


def fsdp_prediction(shapes, shard: int, replicas: int, reshard_blocks: bool,
                    local_shapes: dict | None = None, gather_bytes: int = 4,
                    wrap: str = "block", optimizer: str = "adamw") -> tuple[list[dict], dict]:
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
    in a 2-D mesh). ``optimizer``: ``"adamw"`` holds two fp32 moments per element held, plain
    ``"sgd"`` (no momentum) no state at all.
    """
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    shapes = local_shapes or shapes
    blocks, root = _units(shapes)
    if wrap == "root":
        blocks, root = [], list(shapes)
    padded = {name: fsdp_padded_numel(shape, shard) for name, shape in shapes.items()}
    # A rank's local shard is its torch.chunk share of dim 0: the padding rides along in the
    # collectives' buffers but is not part of the last ranks' stored shard.
    held = [sum(chunk_sizes(shape[0], shard)[r] * numel(shape[1:]) if shape else 1
                for shape in shapes.values()) for r in range(shard)]
    comm = _fsdp_comm(blocks, root, padded, shard, replicas, reshard_blocks, gather_bytes)
    states = [adamw_state(h) for h in held]
    if optimizer == "sgd":
        states = [{**state, "optimizer": 0} for state in states]
    return states, comm


def _predict_fsdp(strategy, shapes, cfg, n, batch, knobs):
    """FULL_SHARD / SHARD_GRAD_OP over all ranks, NO_SHARD as a shard group of one, HYBRID_SHARD /
    HSDP as ``shard``-rank groups replicated n / shard times (:func:`fsdp_prediction`)."""
    if strategy in (Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP):
        states, comm = fsdp_prediction(shapes, n, 1, reshard_blocks=strategy == Strategy.FSDP_FULL_SHARD)
        return states, [comm] * n
    if strategy == Strategy.FSDP_NO_SHARD:
        states, comm = fsdp_prediction(shapes, 1, n, reshard_blocks=False)
        return same_on_every_rank(n, states[0], comm)
    shard = int(knobs.get("shard", 2))
    # Blocks are resharded after forward (HYBRID_SHARD = FULL_SHARD inside a replica); the root
    # never is (ch02 says so; ch05 uses fully_shard's default, which skips the root's reshard).
    by_shard_rank, comm = fsdp_prediction(shapes, shard, n // shard, reshard_blocks=True)
    # mesh (replicate, shard): rank r sits at shard coordinate r % shard
    return [by_shard_rank[r % shard] for r in range(n)], [comm] * n


def _predict_fsdp_tp(strategy, shapes, cfg, n, batch, knobs):
    """2-D mesh (dp, tp): TP inside a group of ``tp`` ranks, FSDP2 over the dp ranks that hold the
    same TP shard; each dp group's batch is the global batch / dp."""
    tp = int(knobs.get("tp", 2))
    dp = n // tp
    states, comms = [], []
    for rank in range(n):
        local = {k: tp_local_shape(k, s, tp, rank % tp) for k, s in shapes.items()}
        by_dp_rank, comm = fsdp_prediction(shapes, dp, 1, reshard_blocks=True, local_shapes=local)
        tp_comm = megatron_tp_bytes(cfg, batch // dp, tp)
        add_comm(comm, "all_reduce", tp_comm["all_reduce"]["calls"], tp_comm["all_reduce"]["bytes"], tp)
        states.append(by_dp_rank[rank // tp])  # mesh (dp, tp): rank r sits at dp coordinate r // tp
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
    Strategy.TP: predict_tp, Strategy.TP_SP: predict_tp,
    Strategy.PP_GPIPE: predict_pipeline, Strategy.PP_1F1B: predict_pipeline,
    Strategy.PP_INTERLEAVED_1F1B: predict_pipeline,
    Strategy.FSDP_TP_2D: _predict_fsdp_tp,
    Strategy.CP: predict_cp, Strategy.EP: predict_ep,
}


def predict(strategy: str, cfg: GPTConfig, world_size: int, global_batch_size: int,
            knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted model-state bytes per rank and collectives per step per rank for one benchmark cell.

    Returns ``{"state_per_rank": [{"params", "grads", "optimizer"}, ...],
    "comm_per_rank": [{collective: {"calls", "bytes", "bus_bytes"}}, ...], "param_count": Ψ}``
    (bytes and bus bytes as :mod:`distkit.theory` defines them). ``knobs``: ``shard`` (HSDP
    shard-group size), ``tp`` (2-D mesh TP size), ``microbatches``, ``stage3_max_live_parameters``
    (ZeRO-3's window of gathered parameters), ``stages_per_rank`` (interleaved pipeline), ``cp``
    (context-parallel group size), ``ep`` (expert-parallel group size) and ``routing`` (expert
    parallelism: rows each rank sent and received per MoE layer; balanced routing without it).
    """
    if strategy not in PREDICTORS:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(MEASURED)}")
    shapes = param_shapes(cfg)
    states, comms = PREDICTORS[strategy](strategy, shapes, cfg, world_size, global_batch_size, knobs or {})
    return {"strategy": strategy, "param_count": sum(numel(s) for s in shapes.values()),
            "state_per_rank": states, "comm_per_rank": comms}


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

    held = sum(rows(shape[0]) * numel(shape[1:]) if shape else 1 for shape in shapes.values())
    return adamw_state(held), _fsdp_comm(blocks, root, padded, shard, replicas, reshard_blocks, gather_bytes)


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
    psi = sum(numel(s) for s in shapes.values())
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
        local = {k: tp_local_shape(k, s, tp, 0) for k, s in shapes.items()}
        state, comm = fsdp_rank_prediction(shapes, dp, 1, reshard_blocks=True, local_shapes=local)
        tp_comm = megatron_tp_bytes(cfg, global_batch_size // dp, tp)
        add_comm(comm, "all_reduce", tp_comm["all_reduce"]["calls"], tp_comm["all_reduce"]["bytes"], tp)
        return {"rank": 0, "state": state, "comm": comm, "param_count": psi}
    pred = predict(strategy, cfg, n, global_batch_size, knobs)
    rank = max(range(n), key=lambda r: sum(pred["state_per_rank"][r].values()))
    return {"rank": rank, "state": pred["state_per_rank"][rank], "comm": pred["comm_per_rank"][rank],
            "param_count": psi}
