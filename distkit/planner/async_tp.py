"""Async TP (torch's micro-pipelined tensor parallelism, torchtitan's
``--parallelism.enable_async_tensor_parallel``): how much of sequence parallelism's all-gathers and
reduce-scatters it hides under the matmuls they feed or drain.

What it overlaps. With SP every block gathers its normed input before the column-parallel layers
(q, k, v; the MLP's gate and up) and reduce-scatters the row-parallel layers' output (o; down).
torch.compile's Inductor pass (``torch/_inductor/fx_passes/micro_pipeline_tp.py``, switched on by
``torch._inductor.config._micro_pipeline_tp``, which is why torchtitan refuses it without compile)
replaces an all-gather whose result feeds matmuls by ``fused_all_gather_matmul`` and a
reduce-scatter whose input is one matmul's output by ``fused_matmul_reduce_scatter``. Per block and
micro-batch that is, forward (and again in full AC's recomputed forward), all four: the gather into
the "in" layers, the scatter out of the "out" layer, for attention and for the MLP. Backward runs
the same collectives mirrored: the output gradient of an "out" layer is gathered before its
input-gradient matmul (fused), and the input gradient of the "in" layers is reduce-scattered; that
one is fused only where a single layer produced it: the Llama's q, k and v (or gate and up) add
their input gradients first, and the pass fuses a matmul's output, not a sum (``_find_producer_matmul``),
so those two stay exposed (the GPT's MLP, one ``fc_in``, is fused). An MoE's MLP input goes to the
router and the token dispatch first: its collectives stay exposed.

What a fused pair exposes. The fused op cuts the collective (C seconds alone) and the matmul (M
seconds alone) into tp chunks, one per rank, and runs chunk i's transfer (copy engines, over NVLink)
while chunk i - 1 multiplies: a two-stage pipeline of tp steps of c = C / tp and m = M / tp. It
takes c + m + (tp - 1) max(c, m) (one chunk fills it, one drains it), so beyond the matmul it exposes

    max(C, M) - M + min(C, M) / tp:

all of the collective's excess over the matmul when it is the longer, and one chunk's transfer (the
fill, or the drain: the all-gather's local copy into symmetric memory and its barrier, the
reduce-scatter's final sum of the received chunks) when it is the shorter. Without Async TP the
whole C is exposed, as :mod:`.nd` counts it. C is an all-gather or reduce-scatter of the micro-batch's
b s h activations (w bytes each, (tp - 1) / tp of them on the bus) over the TP group; M the pair's
GEMMs at their own size (:func:`~.gemm.gemm_seconds`, the kernels alone, not the step's average
rate), divided under Float8 by its recipe's measured whole-step ratio
(:func:`~.published_check.float8_speedup`: its GEMMs in Float8 run faster still on the tensor
cores, its casts take some back). Async TP's memory (symmetric-memory buffers outside the caching
allocator) is not modelled."""
from __future__ import annotations

from .costs import collective_time
from .dims import ParallelDims
from .gemm import block_gemms, gemm_seconds
from .inputs import Cluster, Plan


def exposed(c: float, m: float, tp: int) -> float:
    """Seconds a tp-chunk pipeline of a collective of ``c`` seconds and a matmul of ``m`` seconds
    runs beyond the matmul: max(c, m) - m + min(c, m) / tp (the module's docstring)."""
    return max(c, m) - m + min(c, m) / tp


def layout_problem(plan: Plan, d: ParallelDims) -> str | None:
    """Why Async TP cannot run on the pinned layout ``d`` (one line saying what would), or None."""
    if not plan.async_tp:
        return None
    if d.tp == 1:
        return "--async-tp overlaps tensor parallelism's collectives with its matmuls: give the layout a tp > 1"
    if not d.sp:
        return ("--async-tp splits sequence parallelism's all-gathers and reduce-scatters: drop sp=off "
                "(torchtitan's TP runs with SP)")
    return None


def fused_pairs(plan: Plan, tokens: int, tp: int) -> list[tuple[str, bool, list]]:
    """(collective, whether it is the forward's, the GEMMs (m, n, k, count) it is fused with) for one
    block and micro-batch of ``tokens`` tokens, forward and backward, as the module's docstring lists
    them."""
    gemms = block_gemms(plan, tokens, tp)
    moe = any(count != 1 for *_, count in gemms)
    pairs = []
    for part in ("attn", "mlp"):
        if part == "mlp" and moe:
            continue
        into = [(m, n, k, c) for p, side, m, n, k, c in gemms if p == part and side == "in"]
        out = [(m, n, k, c) for p, side, m, n, k, c in gemms if p == part and side == "out"]
        pairs += [("all_gather", True, into), ("reduce_scatter", True, out), ("all_gather", False, out)]
        if len(into) == 1:  # backward's reduce-scatter of one layer's input gradient
            pairs.append(("reduce_scatter", False, into))
    return pairs


def hidden_seconds(plan: Plan, cl: Cluster, d: ParallelDims, tokens: int, w: float) -> float:
    """Seconds of TP communication Async TP hides per block and micro-batch: over the fused pairs
    (:func:`fused_pairs`; the forward's twice under full AC, which recomputes it), C - :func:`exposed`
    (C, M, tp). 0 without Async TP, on a layout without TP and SP, and on CPU ranks (no overlap)."""
    from .published_check import float8_speedup  # imported here: that module plans with this one

    if not (plan.async_tp and d.tp > 1 and d.sp and cl.overlap):
        return 0.0
    c = {op: collective_time(cl, op, d.tp, 1, tokens * plan.model.n_embd * w * (d.tp - 1) / d.tp, d.in_node("tp", cl))
         for op in ("all_gather", "reduce_scatter")}
    speed = float8_speedup(plan)
    hidden = 0.0
    for op, forward, gemms in fused_pairs(plan, tokens, d.tp):
        m = sum(count * gemm_seconds(cl, plan, *shape) for *shape, count in gemms) / speed
        hidden += (2 if forward and plan.ac == "full" else 1) * (c[op] - exposed(c[op], m, d.tp))
    return hidden
