"""Expert parallelism as an axis of the N-D layouts (:class:`~.dims.ParallelDims` ``ep``), as
torchtitan's ``ParallelDims`` has it with the experts' tensor parallelism equal to tp (ETP = TP):
``ep`` borrows its ranks from the FSDP group dp_shard x cp (ep divides dp_shard x cp, is a multiple
of cp, and divides the experts; :func:`~.dims.check_dims`). Each MoE layer's experts are split over
the ep ranks (num_experts / ep each) and, inside an expert, over tp like the dense matrices.

FSDP on the experts (torchtitan's): the experts an ep rank holds are sharded again over the
dp_shard x cp / ep ranks that hold the same experts, so a GPU keeps experts / tp / ep / (dp_shard x
cp / ep) of their parameters, gradients and AdamW state: the same bytes as FSDP alone. What ep
changes is what FSDP gathers (a block's dense part and only its num_experts / ep experts, gathered
over dp_shard x cp / ep ranks instead of all experts over dp_shard x cp) and the all-to-alls that
send each token to the ranks holding its top-k experts. The non-expert parameters keep the other
axes' sharding (FSDP over dp_shard x cp, TP inside).

All-to-alls: per MoE layer and micro-batch, the five exchanges of
:func:`~distkit.theory.expert_parallel_bytes` (the counts per expert, dispatch and combine forward,
their gradients backward) over the ep ranks, with balanced routing: every GPU sends and receives
k T rows of width h for its T = micro x seq_len / cp tokens (with ETP = TP every TP rank routes the
whole sequence chunk of its group), on the critical path (a token's expert output is needed before
the block goes on). Full AC's recomputed forward would exchange again; not counted."""
from __future__ import annotations

from .. import theory
from ..models import is_moe
from .costs import _comm_seconds, collective_time

_EXPERTS: dict = {}


def expert_params(cfg) -> int:
    """Every expert's parameters over all blocks (0 for a dense model), counted once per model."""
    if not is_moe(cfg):
        return 0
    key = (cfg.arch, tuple(sorted(cfg.to_dict().items())))
    if key not in _EXPERTS:
        _EXPERTS[key] = sum(theory.moe_param_split(theory.param_shapes(cfg), cfg.num_experts)[1])
    return _EXPERTS[key]


def stage_experts(cfg, d, blocks: int) -> tuple[float, float]:
    """(experts' parameters of ``blocks`` blocks (the busiest stage's), of one block): every block of
    an MoE model holds the same experts."""
    block = expert_params(cfg) / cfg.n_layer
    return block * blocks, block


def held_params(params: float, experts: float, d) -> float:
    """Parameters one GPU holds of ``params`` (``experts`` of them the experts'): the dense ones
    / tp / (dp_shard x cp); the experts / tp / ep / (dp_shard x cp / ep) (FSDP on the experts)."""
    if d.ep == 1:
        return params / d.tp / d.shard
    return (params - experts) / d.tp / d.shard + experts / d.tp / d.ep / (d.shard // d.ep)


def gathered_params(params: float, experts: float, d) -> float:
    """Parameters FSDP gathers of ``params`` (a block, or a pipeline stage): the dense part / tp when
    dp_shard x cp > 1; the experts this GPU's ep rank holds (/ tp / ep) when they are sharded over
    dp_shard x cp / ep > 1 ranks (else they sit whole in the model state)."""
    dense = (params - experts) / d.tp if d.shard > 1 else 0.0
    if d.ep == 1:
        return params / d.tp if d.shard > 1 else 0.0
    return dense + (experts / d.tp / d.ep if d.shard // d.ep > 1 else 0.0)


def fsdp_groups(params: float, experts: float, d) -> list[tuple[int, float]]:
    """(group, parameters / tp it all-gathers and reduce-scatters): one group of dp_shard x cp without
    ep; with ep the dense part over dp_shard x cp and the ep rank's experts over dp_shard x cp / ep."""
    if d.ep == 1:
        return [(d.shard, params / d.tp)]
    return [(d.shard, (params - experts) / d.tp), (d.shard // d.ep, experts / d.tp / d.ep)]


def all_to_all_comm(plan, d, micro: int, m: int, layers: int, w: int) -> dict:
    """The all-to-alls of one step on one GPU (a theory comm dict): ``layers`` MoE layers x ``m``
    micro-batches of :func:`~distkit.theory.expert_parallel_bytes` with k x micro x s / cp rows sent
    and received, ``w`` bytes per element; empty without ep."""
    comm: dict = {}
    if d.ep > 1:
        cfg = plan.model
        rows = cfg.top_k * micro * (cfg.seq_len // d.cp)
        per_layer = theory.expert_parallel_bytes(cfg.n_embd, rows, rows, cfg.num_experts, bytes_per_element=w)
        theory.add_comm(comm, "all_to_all", 5 * layers * m, per_layer * layers * m, d.ep)
    return comm


def all_to_all_seconds(plan, cl, d, micro: int, m: int, layers: int, w: int) -> float:
    """Alpha-beta seconds of :func:`all_to_all_comm` over the ep group (its ranks are tp apart: it
    crosses a node when ep x tp exceeds one)."""
    comm = all_to_all_comm(plan, d, micro, m, layers, w)
    return _comm_seconds(cl, comm, d.ep, d.in_node("ep", cl)) if comm else 0.0


def fsdp_seconds(cl, d, params: float, experts: float, layers: int, rounds: int, w: int) -> float:
    """FSDP's all-gather forward and backward and reduce-scatter of ``params`` per round, over each
    group of :func:`fsdp_groups` (3 x layers calls and 3 x (g - 1) / g of the bytes per round)."""
    total = 0.0
    for group, held in fsdp_groups(params, experts, d):
        if group > 1:
            bus = 3 * held * w * (group - 1) / group * rounds
            total += collective_time(cl, "all_gather", group, 3 * layers * rounds, bus, d.in_node("shard", cl))
    return total


def ep_choices(cfg, shard: int, cp: int) -> list[int]:
    """The ep sizes a layout with FSDP group ``shard`` (dp_shard x cp) and ``cp`` may take: 1 (no ep),
    and the divisors of ``shard`` and of the experts that are multiples of cp (torchtitan's rule with
    ETP = TP: ep takes all of cp and part of dp_shard). [1] for a dense model."""
    if not is_moe(cfg):
        return [1]
    experts = cfg.num_experts
    return [1] + [e for e in range(2, experts + 1) if experts % e == 0 and shard % e == 0 and e % cp == 0]
