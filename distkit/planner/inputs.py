"""What the planner is asked about: the hardware (GPU types and links, :data:`GPUS`, a
:class:`Cluster`), the job (model, batch, precision: :class:`Plan`), and inputs made from other
inputs (a model resized to a parameter count, a cluster with overridden figures)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

from .. import theory
from ..errors import UsageError
from ..models import is_moe

# ----------------------------------------------------------------------------------------------
# Hardware: GPU types and links
# ----------------------------------------------------------------------------------------------

GiB = 2 ** 30


@dataclass(frozen=True)
class Link:
    """A link as the alpha-beta model sees it: ``bandwidth`` bus bytes/s one rank reaches on it
    (what nccl-tests calls busbw) and ``latency`` seconds per collective step."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class GPU:
    """One accelerator type. ``memory_bytes``: what the framework can allocate (before the usable
    fraction of :class:`Cluster`); ``peak_flops``: dense FLOP/s per precision (``bf16``: tensor
    cores; ``fp32``: plain FP32, which is what PyTorch matmuls use unless TF32 is allowed);
    ``hbm_bandwidth``: bytes/s of device memory (the optimizer step is bound by it);
    ``intra``/``inter``: default links inside a node and between nodes (per GPU);
    ``host_link``: bytes/s to CPU memory (offload); ``source``: where the numbers come from;
    ``compute_factor``: how much larger a fraction of its own peak this GPU reaches than an H100 on
    the same training job (the planner's efficiency is fitted on H100 runs; :data:`A100_VS_H100`)."""

    name: str
    memory_bytes: float
    peak_flops: dict
    hbm_bandwidth: float
    intra: Link
    inter: Link
    host_link: float
    gpus_per_node: int = 8
    source: str = ""
    compute_factor: float = 1.0


# Datasheet figures (NVIDIA product briefs; dense, i.e. without the 2:4-sparsity doubling), the
# memory as torch.cuda reports it, and achievable link speeds. Inside a node: ASSUMED 80% of one
# direction of the NVLink / PCIe link. Between nodes, one network port per GPU, at what NVIDIA's NCCL
# maintainers measure per port in a ring all-reduce across nodes: 400 Gb/s NDR "46-48GB/s per NIC"
# (https://github.com/NVIDIA/nccl-tests/issues/290) for the H100 and H200, 200 Gb/s HDR 24 GB/s
# ("192GB/s AllReduce BusBW" from a DGX-A100's 8 ports, https://github.com/NVIDIA/nccl/issues/812)
# for the A100; the L4's one 100 Gb/s port for the whole node is ASSUMED at 80%. Override any of
# them from the CLI.
_NV4 = Link(0.8 * 450e9, 10e-6)   # NVLink 4: 900 GB/s both directions
_NDR = Link(46e9, 20e-6)          # one 400 Gb/s InfiniBand NDR port (NCCL's per-port figure)
_HDR = Link(24e9, 20e-6)          # one 200 Gb/s InfiniBand HDR port (192 GB/s over 8 ports)

# An A100 reaches a larger fraction of its bf16 peak than an H100 on the same job (likely because it has
# more memory bandwidth per FLOP/s: a step's non-matmul work costs it relatively less). Measured by
# MosaicML on the same software, models and settings on both: llm-foundry's
# scripts/train/benchmarking/README.md, tables "H100 80GB BF16" and "A100 80GB", every (model,
# sequence length) run on 8 GPUs in both with FULL_SHARD, models 1B to 30B: (H100 MFU %, A100 MFU %).
# The factor is the median ratio, A100_VS_H100 = 1.458 (30 pairs, range 1.32 to 1.75). No planner
# validation row was used: they are torchtitan's.
MOSAIC_MFU_PAIRS = {
    "30b s8192": (29.92, 39.38), "30b s4096": (35.86, 51.37), "30b s2048": (38.11, 55.3), "30b s1024": (38.76, 55.82),
    "13b s32768": (31.68, 51.69), "13b s16384": (35.55, 54.07), "13b s4096": (41.6, 57.62),
    "13b s2048": (39.79, 59.57), "13b s1024": (44.27, 59.48), "7b s65536": (28.59, 46.97),
    "7b s32768": (30.94, 49.46), "7b s8192": (37.14, 54.47), "7b s4096": (40.42, 54.84), "7b s2048": (46.44, 64.23),
    "7b s1024": (42.83, 58.01), "3b s65536": (26.81, 46.05), "3b s32768": (28.84, 47.18),
    "3b s16384": (36.34, 57.13), "3b s8192": (40.31, 59.34), "3b s4096": (42.31, 60.53), "3b s1024": (46.2, 62.73),
    "3b s512": (46.32, 63.71), "1b s65536": (26.34, 46.18), "1b s32768": (33.54, 55.52),
    "1b s16384": (35.22, 56.6), "1b s8192": (37.73, 56.69), "1b s4096": (40.26, 59.0), "1b s2048": (41.82, 59.86),
    "1b s1024": (41.95, 60.15), "1b s512": (43.21, 60.68),
}
A100_VS_H100 = round(statistics.median(a100 / h100 for h100, a100 in MOSAIC_MFU_PAIRS.values()), 3)


_NV3 = Link(0.8 * 300e9, 10e-6)   # NVLink 3: 600 GB/s both directions


GPUS: dict[str, GPU] = {
    "h100": GPU("H100 SXM 80GB", 79.2 * GiB, {"bf16": 989e12, "fp32": 67e12}, 3.35e12, _NV4,
                _NDR, 0.8 * 64e9, 8, "datasheet: H100 SXM5, 989 TFLOP/s bf16 dense, 67 fp32"),
    # PCIe card: its NVLink bridge joins pairs only, so 8 of them all-reduce over PCIe Gen5 (64 GB/s a
    # direction); one 400 Gb/s port per GPU between nodes assumed, as for the SXM
    "h100-pcie": GPU("H100 PCIe 80GB", 79.2 * GiB, {"bf16": 756e12, "fp32": 51e12}, 2.0e12, Link(0.8 * 64e9, 15e-6),
                     _NDR, 0.8 * 64e9, 8,
                     "datasheet: H100 PCIe, 756 TFLOP/s bf16 dense (1,513 with sparsity), 51 fp32, HBM2e 2.0 TB/s"),
    # torchtitan's calibration GPUs (its December 2024 H100 file, hardware section and footnote 2):
    # 96 GB HBM2e at 2.4 TB/s, the default 500 W limit, "the actual peak TFLOPs number is between SXM
    # and NVL, and we don't know its exact value": ASSUMED the middle of NVL's 835 (1,671 with sparsity)
    # and SXM's 989 dense bf16 TFLOP/s; the memory as the 80 GB card's 79.2 GiB scales
    "h100-500w": GPU("H100 96GB HBM2e 500 W", 95.0 * GiB, {"bf16": 912e12, "fp32": 63.5e12}, 2.4e12, _NV4,
                     _NDR, 0.8 * 64e9, 8,
                     "torchtitan's Grand Teton H100: peak between NVL (835) and SXM (989) TFLOP/s, assumed 912"),
    "h200": GPU("H200 SXM 141GB", 140.4 * GiB, {"bf16": 989e12, "fp32": 67e12}, 4.8e12, _NV4,
                _NDR, 0.8 * 64e9, 8, "datasheet: H200 SXM, 989 TFLOP/s bf16 dense, 67 fp32"),
    "a100-80gb": GPU("A100 SXM 80GB", 79.2 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 2.04e12, _NV3,
                     _HDR, 0.8 * 32e9, 8, "datasheet: A100 SXM4, 312 TFLOP/s bf16 dense, 19.5 fp32",
                     A100_VS_H100),
    "a100-40gb": GPU("A100 SXM 40GB", 39.4 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 1.56e12, _NV3,
                     _HDR, 0.8 * 32e9, 8, "datasheet: A100 SXM4, 312 TFLOP/s bf16 dense, 19.5 fp32",
                     A100_VS_H100),
    "l4": GPU("L4 24GB", 22.5 * GiB, {"bf16": 121e12, "fp32": 30.3e12}, 0.3e12, Link(0.8 * 32e9, 15e-6),
              Link(0.8 * 12.5e9 / 4, 30e-6), 0.8 * 32e9, 4,
              "datasheet: L4, 121 TFLOP/s bf16 dense (242 with sparsity), 30.3 fp32; PCIe Gen4, no NVLink"),
}


# the planner's GPU type of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100")
GPU_NAME_PARTS = {"H100 PCIe": "h100-pcie", "H100": "h100", "H200": "h200", "A100": "a100-80gb", "L4": "l4"}


def gpu_type(device_name: str) -> str | None:
    """The :data:`GPUS` key of a device as ``torch.cuda.get_device_name`` names it, or None."""
    return next((key for part, key in GPU_NAME_PARTS.items() if part in device_name), None)


# The fraction of the bf16 peak a GPU reaches by default on large matrices (a job's linear layers
# reach gemm.matmul_factor of it at their size): the one constant of the time model fitted on
# published runs, torchtitan's December 2024 H100 rows at their own peak (published_check.calibrate,
# which tests/test_planner.py checks this equals; plan.py --published shows the fit and its errors).
FITTED_EFFICIENCY = 0.3773
# What the CUDA caching allocator reserves per byte of the tensors a step makes and frees (its
# cached blocks and splits): the second constant fitted on the same rows, on their memory column
# (published_check.calibrate_reserve; tests/test_planner.py checks this equals it).
FITTED_RESERVE = 1.253


@dataclass(frozen=True)
class Cluster:
    """GPUs of one type: ``gpus`` in all, ``gpus_per_node`` per node.

    ``efficiency``: the achievable fraction of the peak FLOP/s (:data:`FITTED_EFFICIENCY`, fitted on
    torchtitan's published H100 runs; times the GPU type's ``compute_factor``); ``usable_memory``: the
    fraction of the GPU's memory the caching allocator can reserve (the CUDA context, NCCL's buffers
    and a margin take the rest; torchtitan's published runs reserved up to 89% of theirs);
    ``allocator_reserve``: the allocator's factor on what a step makes and frees
    (:data:`FITTED_RESERVE`; :func:`~.layouts.reserved_bytes`);
    ``overlap``: whether communication can run under compute (GPUs with NCCL: yes; CPU ranks that
    share their cores with gloo's threads: no). ``collectives``: measured alpha-beta per
    (collective, group size) (:func:`cpu_cluster`), which replace the links when given;
    ``cores``: CPU cores the ranks of a node share (compute then runs at cores / ranks of a core
    each), None for GPUs. ``overheads``: measured seconds per step that a strategy's framework
    code adds beyond its compute and collectives, at one rank per core (:func:`cpu_cluster`)."""

    gpu: GPU
    gpus: int
    gpus_per_node: int
    efficiency: float = FITTED_EFFICIENCY
    usable_memory: float = 0.9
    overlap: bool = True
    collectives: dict | None = None
    cores: int | None = None
    overheads: dict | None = None
    allocator_reserve: float = FITTED_RESERVE

    @property
    def reserve(self) -> float:
        """The allocator's factor on a step's transient tensors (:func:`~.layouts.reserved_bytes`):
        ``allocator_reserve`` on GPUs, 1 on CPU ranks (``cores`` set), which cache nothing."""
        return 1.0 if self.cores else self.allocator_reserve

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def capacity_bytes(self) -> float:
        return self.gpu.memory_bytes * self.usable_memory


def cluster(gpu: str | GPU, gpus: int, gpus_per_node: int | None = None, **overrides) -> Cluster:
    """A :class:`Cluster` of a :data:`GPUS` type (or a :class:`GPU`), fields overridden by keyword."""
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise UsageError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
        gpu = GPUS[gpu]
    per_node = gpus_per_node or min(gpu.gpus_per_node, gpus)
    if gpus < 1 or per_node < 1:
        raise UsageError(f"need at least one GPU, got --gpus {gpus} --gpus-per-node {per_node}")
    check_whole_nodes(gpus, per_node)
    return Cluster(gpu=gpu, gpus=gpus, gpus_per_node=min(per_node, gpus), **overrides)


def check_whole_nodes(gpus: int, per_node: int) -> None:
    """A job larger than one node fills whole nodes (the nodes are alike, and every layout here puts
    the same ranks on each); 8 GPUs in nodes of 3 would be a node and two thirds."""
    if gpus > per_node and gpus % per_node:
        raise UsageError(f"--gpus {gpus} does not fill whole nodes of {per_node} GPUs; give a multiple of "
                         f"{per_node} or a --gpus-per-node that divides {gpus}")


# ----------------------------------------------------------------------------------------------
# The job: model, batch, precision
# ----------------------------------------------------------------------------------------------

PRECISIONS = ("fp32", "bf16")


OPTIMIZERS = ("adamw", "sgd")


# Activation checkpointing per block: none; selective (this repository's op policy: every matmul's
# output and attention's kept, the rest recomputed); full (the block recomputed from its input);
# titan-op (torchtitan's selective op policy: every other matmul kept; theory.activation_bytes_per_layer)
AC_MODES = ("none", "selective", "full", "titan-op")
# Which attention kernel the activations assume: flash (SDPA's fused kernels, the default: no s x s
# matrix is kept) or eager (softmax(QK^T)V as separate ops: its probabilities are kept for backward).
ATTENTION = ("flash", "eager")
# Float8 recipes, by torchtitan's --float8.recipe_name: tensorwise (one scale per tensor: its Float8
# when no recipe is named, as its December 2024 H100 benchmark ran it) and rowwise (one scale per row:
# --float8.recipe_name="rowwise" in its June 2025 Async TP benchmark's commands). Each plans with its
# own measured speed-up (published_check.FLOAT8_SPEEDUPS).
FLOAT8_RECIPES = ("tensorwise", "rowwise")


# What the planner plans for; plan.py turns anything outside into one ``error:`` line. The floor:
# the shortest sequences its formulas were validated on (the CPU matrix trains 32-token sequences),
# below which a "sequence" is a handful of tokens no transformer recipe trains. The ceilings: 65,536
# sequences per step is 32x the largest published batch (Llama 3 405B's 16M tokens: 2,048 sequences
# of 8,192), so more is a typo, not a job; 512 GPUs is the range the planner is written for, one
# uniform link per GPU between nodes (beyond a few hundred GPUs the network's topology decides).
MIN_SEQ_LEN = 32


MAX_SEQUENCES = 65_536


MAX_GPUS = 512


def limits_text() -> str:
    """The limits of :func:`check_job` in words, for ``--help``."""
    return (f"sequences of at least {MIN_SEQ_LEN} tokens, at most {MAX_SEQUENCES:,} sequences per step, "
            f"1 to {MAX_GPUS} GPUs, and a step's sequences at least as many as the batch ranks "
            "(dp_replicate x dp_shard) of some layout: TP, PP and CP groups share their sequences")


def check_job(seq_len: int, gpus: int, sequences: int | None = None, tokens: int | None = None) -> None:
    """One-line :class:`UsageError` (saying what would work) when the planner cannot plan the job:
    ``seq_len`` below :data:`MIN_SEQ_LEN`, ``gpus`` above :data:`MAX_GPUS`, or the step's
    ``sequences`` (``tokens``: derived from a token count, not given in sequences) above
    :data:`MAX_SEQUENCES`. Fewer sequences than GPUs is no reason here: the GPUs of a TP, PP or CP
    group share their sequences, so whether any layout runs the batch depends on the model
    (:func:`~.dims.fewest_batch_ranks`)."""
    if seq_len < MIN_SEQ_LEN:
        raise UsageError(f"--seq-len {seq_len} is below the planner's floor of {MIN_SEQ_LEN} tokens (the shortest "
                         f"sequences its formulas were validated on); give --seq-len {MIN_SEQ_LEN} or more")
    if gpus > MAX_GPUS:
        raise UsageError(f"--gpus {gpus} is beyond the planner's {MAX_GPUS} GPUs (one uniform link per GPU between "
                         f"nodes; larger networks are decided by their topology); give --gpus {MAX_GPUS} or fewer")
    if sequences is None:
        return
    made = f"{tokens or 0:,} tokens of {seq_len} make {sequences:,} sequences per step"
    if sequences > MAX_SEQUENCES:
        if tokens:
            raise UsageError(f"{made}, more than the planner's {MAX_SEQUENCES:,} (32x the largest published batch); "
                             f"give --global-batch-tokens {MAX_SEQUENCES * seq_len:,} or fewer, or a longer --seq-len")
        raise UsageError(f"--global-batch {sequences:,} is more than the planner's {MAX_SEQUENCES:,} sequences per "
                         f"step (32x the largest published batch); give --global-batch {MAX_SEQUENCES:,} or fewer")


@dataclass(frozen=True)
class Plan:
    """What to train: ``model`` (a GPT or Llama config of :mod:`distkit.models`, or its mixture of
    experts, :func:`~distkit.models.with_experts`; its ``seq_len`` is the sequence length),
    ``global_batch`` sequences per optimizer step, ``micro_batch`` sequences per GPU per forward
    (the rest is gradient accumulation), ``precision`` fp32 or bf16 (mixed: bf16 weights,
    gradients and activations, fp32 master weights in the optimizer), ``optimizer`` adamw (two
    moments) or sgd (with momentum: one), ``ac`` activation checkpointing, ``offload`` whether
    CPU-offload configurations may be chosen, ``lora_rank`` and ``lora_targets`` the adapters of
    the LoRA row, ``microbatches`` for the pipeline (None: as many micro-batches of
    ``micro_batch`` as one replica's share of the batch holds), ``attention`` the kernel the
    activations assume (:data:`ATTENTION`; flash by default), ``compile`` / ``float8`` whether the
    job runs torch.compile'd blocks / Float8 linear layers (measured factors on the compute rate and
    the blocks' saved activations: :func:`~.published_check.technique_speedup`,
    :func:`~.published_check.memory_factor`), ``float8_recipe`` which Float8 (:data:`FLOAT8_RECIPES`:
    the recipes speed up by different measured ratios), ``compiled_loss`` whether the loss (the cast
    to fp32, log-softmax and NLL) runs as one compiled function (:func:`~.costs.head_working_set`),
    ``async_tp`` whether TP's all-gathers and reduce-scatters run micro-pipelined with their matmuls
    (torch's Async TP, a torch.compile pass: :mod:`.async_tp`)."""

    model: Any
    global_batch: int
    micro_batch: int = 1
    precision: str = "bf16"
    optimizer: str = "adamw"
    ac: str = "none"
    offload: bool = False
    lora_rank: int = 16
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    microbatches: int | None = None
    attention: str = "flash"
    compile: bool = False
    float8: bool = False
    float8_recipe: str = "tensorwise"
    compiled_loss: bool = False
    async_tp: bool = False

    def __post_init__(self):
        for name, value, allowed in (("precision", self.precision, PRECISIONS),
                                     ("optimizer", self.optimizer, OPTIMIZERS), ("ac", self.ac, AC_MODES),
                                     ("attention", self.attention, ATTENTION),
                                     ("float8_recipe", self.float8_recipe, FLOAT8_RECIPES)):
            if value not in allowed:
                raise UsageError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.global_batch < 1 or self.micro_batch < 1:
            raise UsageError(f"global batch and micro-batch must be >= 1, got {self.global_batch}, {self.micro_batch}")
        if self.ac == "titan-op" and is_moe(self.model):
            raise UsageError("--activation-checkpointing titan-op is torchtitan's policy for dense models; an MoE "
                             "model plans with none, selective or full")
        if self.float8 and self.precision != "bf16":
            raise UsageError("--float8 runs the linear layers of a bf16 job in Float8 (as its measured factors "
                             f"were); drop --precision {self.precision}")
        if self.float8_recipe != "tensorwise" and not self.float8:
            raise UsageError(f"float8_recipe {self.float8_recipe!r} is a recipe of Float8 linear layers: set float8 "
                             f"too (plan.py --float8 {self.float8_recipe})")
        if self.async_tp and not self.compile:
            raise UsageError("--async-tp is a torch.compile pass (Inductor's micro-pipeline TP; torchtitan: \"Async TP "
                             "requires --training.compile\"); add --compile")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len


# ----------------------------------------------------------------------------------------------
# Inputs made from other inputs: a parameter count, overridden hardware
# ----------------------------------------------------------------------------------------------

def _block_params(cfg) -> int:
    """Parameters of one transformer block (an FSDP unit as the chapters wrap it)."""
    return sum(math.prod(s) for k, s in theory.param_shapes(cfg).items()
               if k.startswith(("blocks.0.", "model.layers.0.")))


def with_params(cfg, params: float):
    """``cfg`` with as many blocks as bring its parameter count closest to ``params`` (width, heads
    and vocabulary kept): the way to ask about "a 7B model" of a known family."""
    fixed = sum(math.prod(s) for k, s in theory.param_shapes(cfg).items()
                if not k.startswith(("blocks.", "model.layers.")))
    per_block = _block_params(cfg)
    layers = max(1, round((params - fixed) / per_block))
    return replace(cfg, n_layer=layers)


def override_cluster(cl: Cluster, *, memory_gib=None, peak_tflops=None, precision="bf16", efficiency=None,
                     usable_memory=None, intra_bw_gbps=None, intra_latency_us=None, inter_bw_gbps=None,
                     inter_latency_us=None, collectives=None, gpus_per_node=None) -> Cluster:
    """``cl`` with the values the reader gave instead of the table's (None keeps the table's). The GPU is
    then labelled as what it is: ``--gpu h100 --gpu-memory-gib 24`` plans a 24 GiB GPU with the H100's
    other figures, not an "H100 SXM 80GB"."""
    gpu = cl.gpu
    given = [what for what, value in (("peak FLOP/s", peak_tflops),
                                      ("intra-node link", intra_bw_gbps or intra_latency_us),
                                      ("inter-node link", inter_bw_gbps or inter_latency_us)) if value]
    if memory_gib:
        gpu = replace(gpu, memory_bytes=memory_gib * GiB, name=f"{memory_gib:g} GiB GPU ({gpu.name}'s other figures)")
    if given:
        gpu = replace(gpu, name=f"{gpu.name}, {' and '.join(given)} as given")
    if peak_tflops:
        gpu = replace(gpu, peak_flops={**gpu.peak_flops, precision: peak_tflops * 1e12})
    if intra_bw_gbps or intra_latency_us:
        gpu = replace(gpu, intra=Link((intra_bw_gbps or gpu.intra.bandwidth / 1e9) * 1e9,
                                      (intra_latency_us or gpu.intra.latency * 1e6) / 1e6))
    if inter_bw_gbps or inter_latency_us:
        gpu = replace(gpu, inter=Link((inter_bw_gbps or gpu.inter.bandwidth / 1e9) * 1e9,
                                      (inter_latency_us or gpu.inter.latency * 1e6) / 1e6))
    changes = {k: v for k, v in (("efficiency", efficiency), ("usable_memory", usable_memory),
                                 ("collectives", collectives)) if v is not None}
    if gpus_per_node:
        check_whole_nodes(cl.gpus, gpus_per_node)
        changes["gpus_per_node"] = min(gpus_per_node, cl.gpus)
    return replace(cl, gpu=gpu, **changes)
