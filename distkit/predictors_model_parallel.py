"""Model-parallel predictors, beside :mod:`distkit.predictors` (which picks among them): tensor
parallelism (which parameters the chapter-05 plans split, and what sequence parallelism adds),
pipeline parallelism (stages and their boundary traffic), context parallelism (the ring) and expert
parallelism (the all-to-alls), plus the two helpers every family writes its prediction with. The
same implementation-model conventions as :mod:`distkit.predictors`: bytes, bus bytes and fp32 AdamW
as :mod:`distkit.theory` defines them.
"""
from __future__ import annotations

import re

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .models import GPTConfig, is_moe
from .strategies import Strategy
from .theory import (
    add_comm,
    chunk_sizes,
    comm_entry,
    expert_parallel_comm,
    kv_width,
    megatron_tp_bytes,
    moe_param_split,
    numel,
    ring_attention_bytes,
)
from .tp_plans import TP_PLANS

# ----------------------------------------------------------------------------------------------
# How a prediction is written down: fp32 AdamW state per rank, collectives per rank
# ----------------------------------------------------------------------------------------------

def adamw_state(param_elems: float, grad_elems: float | None = None, bytes_per: int = 4) -> dict:
    """fp32 AdamW: 4 bytes of weight, 4 of gradient and 8 of moments per element held."""
    grad_elems = param_elems if grad_elems is None else grad_elems
    return {"params": param_elems * bytes_per, "grads": grad_elems * bytes_per,
            "optimizer": 2 * param_elems * bytes_per}


def same_on_every_rank(n: int, state: dict, comm: dict) -> tuple[list[dict], list[dict]]:
    return [dict(state) for _ in range(n)], [comm for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: which parameters the chapter-05 plans split, and the collectives outside
# the blocks that sequence parallelism adds
# ----------------------------------------------------------------------------------------------

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
        return numel(shape)
    return chunk_sizes(shape[dim], tp)[rank] * numel(shape) // shape[dim]


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int, rank: int) -> tuple[int, ...]:
    held = _tp_local_numel(name, shape, tp, rank, sequence_parallel=False)
    if held == numel(shape):
        return shape
    leaf = name.split(".")[-2]
    if leaf in _TP_ROW:
        return (shape[0], held // shape[0])
    return (held // numel(shape[1:]), *shape[1:])


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
        if leaf not in _TP_ROW and _tp_local_numel(name, shape, tp, 0, sequence_parallel=True) == numel(shape):
            add_comm(comm, "all_reduce", 1, 4 * numel(shape), tp)
    act = batch * cfg.seq_len * cfg.n_embd * 4
    tables, pos = (1, 0) if cfg.arch == "llama" else (2, cfg.seq_len * cfg.n_embd * 4)
    logits = batch * cfg.seq_len * cfg.vocab_size * 4
    add_comm(comm, "reduce_scatter", tables, act + pos, tp)
    add_comm(comm, "all_gather", tables, act + pos, tp)
    add_comm(comm, "all_gather", 2, act + logits, tp)
    add_comm(comm, "reduce_scatter", 1, act, tp)


def predict_tp(strategy, shapes, cfg, n, batch, knobs):
    """Megatron tensor parallelism over all n ranks (:func:`~distkit.theory.megatron_tp_bytes`), with sequence
    parallelism for ``tp_sp``. With SP the embedding tables are row-sharded, but their gradients
    arrive as full replicated tensors (measured: DTensor's embedding backward returns Replicate)."""
    sp = strategy == Strategy.TP_SP
    states = [adamw_state(sum(_tp_local_numel(k, s, n, r, sp) for k, s in shapes.items()),
                           sum(numel(s) if sp and k.split(".")[-2] in _TP_EMBEDDINGS
                               else _tp_local_numel(k, s, n, r, sp) for k, s in shapes.items()))
              for r in range(n)]
    comm = megatron_tp_bytes(cfg, batch, n, sp)
    if sp:
        _tp_sp_extras(comm, shapes, cfg, batch, n)
    return states, [comm for _ in range(n)]



# ----------------------------------------------------------------------------------------------
# Pipeline parallelism: each rank its stages' parameters, one activation per micro-batch and boundary
# ----------------------------------------------------------------------------------------------

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


def predict_pipeline(strategy, shapes, cfg, n, batch, knobs):
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
        states.append(adamw_state(sum(numel(shapes[k]) for k in names)))
        comm: dict = {}
        for s in mine:  # activations forward, their gradients backward, one per micro-batch
            if s < num_stages - 1:
                add_comm(comm, "send", m, m * micro_act, 2)
                add_comm(comm, "recv", m, m * micro_act, 2)
            if s > 0:
                add_comm(comm, "recv", m, m * micro_act, 2)
                add_comm(comm, "send", m, m * micro_act, 2)
        comms.append(comm)
    return states, comms


# ----------------------------------------------------------------------------------------------
# Context and expert parallelism
# ----------------------------------------------------------------------------------------------

def predict_cp(strategy, shapes, cfg, n, batch, knobs):
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
    comm = ring_attention_bytes(batch // (n // cp), cfg.seq_len, kv_width(cfg), cfg.n_layer, cp)
    psi = sum(numel(shape) for shape in shapes.values())
    comm["all_reduce"] = comm_entry(1, 4 * psi, "all_reduce", n)
    return same_on_every_rank(n, adamw_state(psi), comm)


def predict_ep(strategy, shapes, cfg, n, batch, knobs):
    """Expert parallelism (``05-advanced/expert_parallel.py``) on a (dp, ep) mesh, rank = dp index x
    ep + ep index: each rank holds the dense parameters and the num_experts / ep experts of its ep
    index (fp32 AdamW, 16 bytes per parameter held); collectives from :func:`~distkit.theory.expert_parallel_comm`
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
        states.append(adamw_state(dense + held[rank % ep]))
        comms.append(expert_parallel_comm(cfg.n_embd, list(sent), list(received), cfg.num_experts, ep, dp,
                                          dense_numel=dense, expert_numel=held[rank % ep]))
    return states, comms
