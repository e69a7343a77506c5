"""Matrix multiplies by size: how much of the large-matrix rate a GEMM of a given shape reaches, and
the GEMMs of a training step (each linear layer at a micro-batch's tokens, split over the TP ranks).

A GEMM of an m x k by a k x n matrix (F = 2 m n k FLOPs; B = w (m k + k n + m n) bytes read and
written, w bytes per element) takes

    t = t0 + max(F / P, B / W)

seconds: a time per call t0 (the launch, the first and the last wave of thread blocks), then
whichever of the tensor cores (P FLOP/s on large matrices) and the memory (W bytes/s) bounds it, the
roofline model. Its three constants are solved exactly from three measured entries of XLA's table of
bf16 GEMMs on an H100 (:data:`XLA_TABLE`, :data:`FIT_POINTS`): 256^3, where the call time is nearly
all of it; 4096^3, compute-bound; 4096 x 4096 x 256, memory-bound (the thin k re-reads little but
writes a 4096 x 4096 result). Five other entries of the same table check it (:data:`CHECKS`: within
14%); over all 125 two-dimensional entries (b = 1) of the table its time is within 7% at the median
and 33% at the worst, too short where two dimensions are 256 or 512 and the third 2048 or 4096: so few
output tiles leave most of the 132 SMs idle, which the form does not count (a narrow TP shard's
weight-gradient GEMM, a width x 128 result summed over every token, is of that kind, and is taken
as fast as its forward here).
The table's GPU is an SXM H100: its 783 TFLOP/s at 4096^3 exceed the PCIe card's 756 datasheet peak.

The planner's compute rate (a fitted fraction of the peak) is fitted on published runs whose GEMMs
are large, so it stands for the large-matrix plateau, t = F / P; a job's linear layers run at
:func:`matmul_factor` of it, (sum F / P) / (sum t) over its GEMMs weighted by their FLOPs: a 1B Llama
at 2,048 tokens per micro-batch on an H100 reaches 0.92 of the plateau (its k and v projections,
2048 x 512 x 2048, are memory- and call-bound), Llama 3.1 8B at 16,384 tokens (torchtitan's Table 1
job) 0.997, the 8B's TP shards over 8 GPUs at 8,192 tokens 0.89 (k and v 128 wide).

Other GPUs and precisions (ASSUMED; the table measures the H100 in bf16 only): P and W the same
fractions of the GPU's datasheet peak (of the plan's precision) and HBM bandwidth as on the H100
(0.815 and 0.668), t0 the same, w the precision's element size: an L4 (121 TFLOP/s, 0.3 TB/s) runs
the 1B at 8,192 tokens at 0.99 of its plateau, its slow tensor cores leaving the call time and the
memory traffic small beside the compute. On CPU ranks the factor is 1: the CPU matrix's calibration
measures its own matmuls."""
from __future__ import annotations

import functools

from .. import theory
from ..models import config_from_dict
from .inputs import Cluster, Plan

XLA_TABLE = ("tensorflow/tensorflow third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h at commit "
             "372d578bb861cc5804e56d37d93aec931a59762c, key sm_90, entries with b: 1, flops bf16xbf16->bf16")
# Measured bf16 FLOP/s of an (m, n, k) GEMM on the H100 (XLA_TABLE): the three the constants are
# solved from (latency-, compute- and memory-bound, in that order), and five that check them.
FIT_POINTS = {(256, 256, 256): 6452775384615, (4096, 4096, 4096): 783328793548203,
              (4096, 4096, 256): 392162828341855}
CHECKS = {(2048, 2048, 2048): 631984593290170, (2048, 512, 2048): 347714321243523,
          (4096, 512, 4096): 649964784503632, (4096, 1024, 4096): 738474431911967,
          (1024, 1024, 1024): 236298816901408}
# The table's H100 (an SXM, above): datasheet 989 TFLOP/s dense bf16 and 3.35 TB/s HBM3.
H100_PEAK, H100_HBM = 989e12, 3.35e12


def _flops_bytes(m: float, n: float, k: float, w: float = 2.0) -> tuple[float, float]:
    return 2 * m * n * k, w * (m * k + k * n + m * n)


@functools.lru_cache(maxsize=1)
def constants() -> tuple[float, float, float]:
    """(t0 seconds, P / the H100's peak, W / its HBM bandwidth), solved from :data:`FIT_POINTS`: the
    256^3 and the 4096 x 4096 x 256 entries are memory-bound (B / W above F / P), so their times differ
    by their bytes over W, which gives W, then t0; the 4096^3 entry is compute-bound, which gives P."""
    (small, big, thin) = FIT_POINTS
    t = {shape: _flops_bytes(*shape)[0] / flops for shape, flops in FIT_POINTS.items()}
    w_bw = (_flops_bytes(*thin)[1] - _flops_bytes(*small)[1]) / (t[thin] - t[small])
    t0 = t[small] - _flops_bytes(*small)[1] / w_bw
    p = _flops_bytes(*big)[0] / (t[big] - t0)
    return t0, p / H100_PEAK, w_bw / H100_HBM


def gemm_seconds(cl: Cluster, plan: Plan, m: float, n: float, k: float) -> float:
    """t0 + max(F / P, B / W) of one GEMM on ``cl``'s GPU in ``plan``'s precision (the module's
    docstring)."""
    t0, p_frac, w_frac = constants()
    peak = cl.gpu.peak_flops.get(plan.precision) or cl.gpu.peak_flops["fp32"]
    flops, moved = _flops_bytes(m, n, k, 2.0 if plan.precision == "bf16" else 4.0)
    return t0 + max(flops / (p_frac * peak), moved / (w_frac * cl.gpu.hbm_bandwidth))


ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "fc_out")  # the layers whose input TP splits


def _block_linears(cfg) -> tuple[tuple[str, str, int, int, bool], ...]:
    """(part, side, in, out, expert) of each weight matrix of one block: part "attn" or "mlp", side
    "in" for the column-parallel layers (their input all-gathered under SP), "out" for the
    row-parallel ones (their output reduce-scattered); one expert's matrices for an MoE (the router,
    num_experts x width, is left out: it is not split and its FLOPs are a few per million)."""
    return _linears(cfg.arch, tuple(sorted(cfg.to_dict().items())))


@functools.lru_cache(maxsize=64)
def _linears(arch: str, items: tuple) -> tuple[tuple[str, str, int, int, bool], ...]:
    out = []
    for name, shape in theory.param_shapes(config_from_dict({"arch": arch, **dict(items)})).items():
        block = name.startswith(("blocks.0.", "model.layers.0."))
        if not block or len(shape) != 2 or ".router." in name or (".experts." in name and ".experts.0." not in name):
            continue
        part = "attn" if ".attn." in name or ".self_attn." in name else "mlp"
        side = "out" if name.split(".")[-2] in ROW_PARALLEL else "in"
        out.append((part, side, shape[1], shape[0], ".experts." in name))
    return tuple(out)


def block_gemms(plan: Plan, tokens: int, tp: int = 1, ep: int = 1) -> list[tuple[str, str, float, float, float, float]]:
    """(part, side, m, n, k, count) of one block's forward GEMMs for ``tokens`` tokens: m the tokens,
    k the layer's input width, n its output width, the TP-split one divided by ``tp``. An MoE's
    experts (balanced routing) get tokens x top_k x ep / num_experts rows each, num_experts / ep of
    them per GPU. Backward's two GEMMs per layer (input and weight gradient) have the same FLOPs and
    bytes, so the forward shapes weight them too."""
    cfg = plan.model
    rows = []
    for part, side, d_in, d_out, expert in _block_linears(cfg):
        n, k = (d_out, d_in / tp) if side == "out" else (d_out / tp, d_in)
        m, count = tokens, 1.0
        if expert:
            m, count = max(1.0, tokens * cfg.top_k * ep / cfg.num_experts), cfg.num_experts / ep
        rows.append((part, side, m, n, k, count))
    return rows


def matmul_factor(cl: Cluster, plan: Plan, tokens: int, tp: int = 1, ep: int = 1, vocab_shards: int = 1) -> float:
    """What fraction of the large-matrix rate the job's linear layers reach: (sum F / P) / (sum t)
    over every block's GEMMs and the LM head's (tokens x width by width x vocabulary / vocab_shards),
    each weighted by its count (:func:`gemm_seconds`); 1 on CPU ranks (the module's docstring)."""
    if cl.cores:
        return 1.0
    cfg = plan.model
    gemms = [(m, n, k, count * cfg.n_layer) for _, _, m, n, k, count in block_gemms(plan, tokens, tp, ep)]
    gemms.append((tokens, cfg.vocab_size / vocab_shards, cfg.n_embd, 1.0))
    p_frac = constants()[1]
    peak = cl.gpu.peak_flops.get(plan.precision) or cl.gpu.peak_flops["fp32"]
    plateau = sum(count * 2 * m * n * k / (p_frac * peak) for m, n, k, count in gemms)
    return plateau / sum(count * gemm_seconds(cl, plan, m, n, k) for m, n, k, count in gemms)
