"""N-D layouts as torchtitan's ``ParallelDims`` names them: data parallel replicate x data parallel
shard (FSDP) x tensor parallel (with or without sequence parallelism) x pipeline (a schedule and a
micro-batch count) x context parallel, and for an MoE model expert parallel (ep ranks borrowed from
dp_shard x cp, as torchtitan's; :mod:`.nd_ep`), validated once against the model, the batch and the GPU
count (:func:`check_dims`), parsed from ``--layout dp_shard=32,tp=8`` (:func:`parse_layout`) and
enumerated for the search (:func:`enumerate_dims`).

The mesh is laid out as torchtitan's (outermost first): pp, dp_replicate, dp_shard, cp, tp. TP is
innermost, so a TP group is consecutive GPUs (inside a node when tp <= GPUs per node); a group
spans nodes when the product of its own size and of every axis inside it exceeds a node
(:meth:`ParallelDims.spans`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..errors import UsageError
from ..models import is_moe
from .costs import per_node
from .inputs import Cluster, Plan
from .nd_ep import ep_choices

AXES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first, as torchtitan's mesh


@dataclass(frozen=True)
class ParallelDims:
    """The size of each named axis (1: unused); ``sp``: sequence parallelism inside the TP group
    (torchtitan's default with TP); ``schedule`` and ``microbatches`` (None: as many as the
    micro-batch size makes) of the pipeline; ``loss_parallel``: the LM head's output stays sharded
    over the vocabulary on the TP ranks and the loss is computed on the shards (torchtitan's
    default with TP)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = True
    schedule: str = "1f1b"
    microbatches: int | None = None
    loss_parallel: bool = True

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def batch_ranks(self) -> int:
        """Ranks that see different sequences: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """The FSDP group: dp_shard x cp (torchtitan shards parameters over both)."""
        return self.dp_shard * self.cp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: 2 for the interleaved schedule, else 1."""
        return 2 if self.pp > 1 and self.schedule == "interleaved_1f1b" else 1

    def spans(self, axis: str, cl: Cluster) -> bool:
        """Whether one ``axis`` group (``"shard"``: dp_shard with cp) crosses a node: its GPUs are
        ``stride`` apart, the product of the axes inside it in :data:`MESH_ORDER`."""
        if axis == "shard":
            return self.dp_shard * self.cp * self.tp > cl.gpus_per_node
        if axis == "ep":  # ep ranks are consecutive in dp_shard x cp, tp apart
            return self.ep * self.tp > cl.gpus_per_node
        inner = MESH_ORDER[MESH_ORDER.index(axis):]
        return math.prod(getattr(self, a) for a in inner) > cl.gpus_per_node

    def in_node(self, axis: str, cl: Cluster) -> int:
        """How many GPUs of one ``axis`` group share a node (:func:`~.costs.per_node`): its size when
        it fits in one, else the node's GPUs over its ``stride`` (as in :meth:`spans`)."""
        if axis == "shard":
            group, stride = self.dp_shard * self.cp, self.tp
        elif axis == "ep":
            group, stride = self.ep, self.tp
        else:
            group = getattr(self, axis)
            stride = math.prod(getattr(self, a) for a in MESH_ORDER[MESH_ORDER.index(axis) + 1:])
        return per_node(group, stride, cl.gpus_per_node)

    def axes(self) -> dict:
        """The axes above 1 (dp_shard always), with sp and the schedule where they apply."""
        out = {a: getattr(self, a) for a in AXES if getattr(self, a) > 1 or a == "dp_shard"}
        if self.tp > 1:
            out["sp"] = self.sp
        if self.pp > 1:
            out["schedule"] = self.schedule
        return out

    def text(self) -> str:
        """``dp_shard=32,tp=8``: what ``--layout`` takes back."""
        parts = [f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) > 1 or a == "dp_shard"]
        if self.tp > 1 and not self.sp:
            parts.append("sp=off")
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
            if self.microbatches:
                parts.append(f"microbatches={self.microbatches}")
        return ",".join(parts)


def _divisors_note(what: str, values: list[int]) -> str:
    return f"{what}: {', '.join(map(str, values))}" if values else f"{what}: none"


def _micro_split(plan: Plan, d: ParallelDims) -> tuple[int, int, str | None]:
    """(micro-batch, micro-batches per step, problem): one batch rank's sequences cut into
    micro-batches of ``plan.micro_batch`` (or into ``d.microbatches``)."""
    per = plan.global_batch // d.batch_ranks
    if d.microbatches:
        if per % d.microbatches:
            return 0, 0, (f"{per} sequences per batch rank do not split into {d.microbatches} micro-batches; "
                          f"try a divisor of {per}")
        return per // d.microbatches, d.microbatches, None
    micro = min(plan.micro_batch, per)
    if per % micro:
        return 0, 0, f"{per} sequences per batch rank do not split into micro-batches of {micro}"
    return micro, per // micro, None


def check_dims(plan: Plan, cl: Cluster, d: ParallelDims) -> str | None:
    """Why ``d`` cannot run ``plan`` on ``cl`` (one line that says what would work), or None. Checked
    once: the axes' product equals the GPU count; tp divides the heads and the key/value heads; the
    pipeline's stages (pp x chunks) are no more than the blocks (uneven stages are allowed: the
    busiest holds ceil(layers / stages)); the sequence splits into 2 x cp chunks (zig-zag ring); the
    batch splits over dp_replicate x dp_shard and into micro-batches; ep needs an MoE config and
    borrows its ranks from dp_shard x cp (:func:`~.nd_ep.ep_choices`: it divides them and the experts,
    a multiple of cp, torchtitan's rule), so it is not a factor of the GPU count."""
    cfg, n = plan.model, cl.gpus
    heads = (cfg.n_head, getattr(cfg, "n_kv_head", cfg.n_head))
    if any(h % d.tp for h in heads):
        ok = [t for t in range(1, n + 1) if n % t == 0 and all(h % t == 0 for h in heads)]
        return f"tp={d.tp} does not divide {heads[0]} heads / {heads[1]} kv-heads; " + _divisors_note("tp that do", ok)
    if d.pp * d.chunks > cfg.n_layer:
        return f"pp={d.pp} x {d.chunks} chunk(s) needs at least {d.pp * d.chunks} blocks, the model has {cfg.n_layer}"
    if d.cp > 1 and plan.attention == "eager":
        return f"cp={d.cp} runs ring attention, built on flash attention: plan it with --attention flash"
    if d.cp > 1 and cfg.seq_len % (2 * d.cp):
        ok = [c for c in range(2, n + 1) if n % c == 0 and cfg.seq_len % (2 * c) == 0][:8]
        return f"cp={d.cp} does not cut {cfg.seq_len} tokens into 2 x cp chunks; " + _divisors_note("cp that do", ok)
    if d.world != n:
        others = d.world // d.dp_shard
        fix = (f"; dp_shard={n // others} would" if n % others == 0 else
               f"; the other axes' product {others} must divide {n}")
        return f"layout {d.text()} uses {d.world} GPUs, not the {n} of the job (the axes multiply){fix}"
    if d.ep > 1 and not is_moe(cfg):
        return f"ep={d.ep} splits a mixture of experts' experts; this model is dense: give --experts N, or ep=1"
    if d.ep > 1 and d.ep not in ep_choices(cfg, d.shard, d.cp):
        ok = [e for e in ep_choices(cfg, d.shard, d.cp) if e > 1]
        multiple = f", and be a multiple of cp={d.cp}" if d.cp > 1 else ""
        return (f"ep={d.ep} must divide dp_shard x cp = {d.shard} (the ranks it borrows) and the "
                f"{cfg.num_experts} experts{multiple}; " + _divisors_note("ep that do", ok))
    if d.schedule not in SCHEDULES:
        return f"schedule {d.schedule!r} unknown; one of {', '.join(SCHEDULES)}"
    if plan.global_batch < d.batch_ranks:
        # only the batch ranks need sequences of their own: a TP, PP or CP group's GPUs share theirs
        return (f"the global batch {plan.global_batch} is fewer than dp_replicate x dp_shard = {d.batch_ranks} "
                f"batch ranks (the GPUs of a TP, PP or CP group share their sequences); give --global-batch "
                f"{d.batch_ranks} or more, or a layout with more tp, pp or cp and fewer batch ranks")
    if plan.global_batch % d.batch_ranks:
        return (f"the global batch {plan.global_batch} does not split over dp_replicate x dp_shard = "
                f"{d.batch_ranks} batch ranks")
    return _micro_split(plan, d)[2]


def parse_layout(text: str, gpus: int) -> ParallelDims:
    """``dp_shard=32,tp=8`` (also ``tp_sp=8``, ``sp=on|off``, ``schedule=1f1b``, ``microbatches=16``)
    as :class:`ParallelDims`; an axis not given is 1, except dp_shard, which takes the GPUs left
    (torchtitan's dp_shard=-1). Malformed text: :class:`UsageError` in one line."""
    known = (*AXES, "tp_sp", "sp", "schedule", "microbatches", "loss_parallel")
    values: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in known:
            raise UsageError(f"--layout {text!r}: {item!r} is not AXIS=N; axes: {', '.join(known)}")
        value = value.strip()
        if key in ("sp", "loss_parallel"):
            if value not in ("on", "off"):
                raise UsageError(f"--layout: {key}= takes on or off, got {value!r}")
            values[key] = value == "on"
        elif key == "schedule":
            values[key] = {"interleaved": "interleaved_1f1b"}.get(value, value)
        else:
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"--layout: {key}= takes a positive integer, got {value!r}")
            values["tp" if key == "tp_sp" else key] = int(value)
            if key == "tp_sp":
                values["sp"] = True
    if "dp_shard" not in values:
        rest = math.prod(values.get(a, 1) for a in ("dp_replicate", "tp", "pp", "cp"))
        values["dp_shard"] = max(1, gpus // rest) if gpus % rest == 0 else 1
    return ParallelDims(**{f.name: values[f.name] for f in fields(ParallelDims) if f.name in values})


def _powers(limit: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


# The layouts the strategy families already plan (one axis, FSDP x one other, PP x DDP, CP x DDP):
# the N-D search leaves them to those rows.
_COVERED = ({"dp_shard"}, {"dp_replicate"}, {"dp_replicate", "dp_shard"}, {"tp"}, {"tp", "dp_shard"}, {"pp"},
            {"pp", "dp_replicate"}, {"cp"}, {"cp", "dp_replicate"})


def _searched(cl: Cluster):
    """The layouts the search tries: powers of two per axis (dp_shard takes the GPUs left), TP and
    TP x CP inside a node, sequence parallelism on with TP, each pipeline schedule."""
    n, gpn = cl.gpus, cl.gpus_per_node
    for tp in _powers(min(gpn, n)):
        for cp in _powers(min(gpn, n) // tp):
            for pp in _powers(n // (tp * cp)):
                for dpr in _powers(n // (tp * cp * pp)):
                    dps = n // (tp * cp * pp * dpr)
                    for schedule in (SCHEDULES if pp > 1 else ("1f1b",)):
                        yield ParallelDims(dp_replicate=dpr, dp_shard=dps, tp=tp, pp=pp, cp=cp, schedule=schedule)


def enumerate_dims(plan: Plan, cl: Cluster) -> list[ParallelDims]:
    """Every valid N-D layout the search ranks (:func:`_searched`), each with every ep of
    :func:`~.nd_ep.ep_choices` for an MoE model (1 for a dense one), leaving out the layouts another
    strategy row already plans (:data:`_COVERED`)."""
    out = []
    for base in _searched(cl):
        for ep in ep_choices(plan.model, base.shard, base.cp):
            d = replace(base, ep=ep)
            used = {a for a in AXES if getattr(d, a) > 1}
            if used in _COVERED or not used or check_dims(plan, cl, d):
                continue
            out.append(d)
    return out


def fewest_batch_ranks(plan: Plan, cl: Cluster) -> int:
    """The fewest batch ranks (dp_replicate x dp_shard) of any layout the planner builds for
    ``plan``'s model on ``cl`` (the search's, which include every strategy row's shape): the
    fewest sequences a step can have there. The other GPUs are TP, PP and CP groups, which share
    their sequences; how far they reach is set by the heads, the blocks and the sequence length.
    Each layout is checked with one sequence per batch rank (its smallest batch)."""
    return min(d.batch_ranks for d in _searched(cl)
               if check_dims(replace(plan, global_batch=d.batch_ranks, micro_batch=1), cl, d) is None)
