"""Does it fit, which strategy, how fast: the chapters' formulas turned into a planner.

For a model (a :mod:`distkit.models` config), a batch, a precision and a cluster of GPUs, every
strategy of the repository gets an :class:`Estimate`: memory per GPU in five parts (parameters,
gradients, optimizer state, activations, temporaries), whether it fits, a step time (compute +
exposed communication + pipeline bubble + optimizer step) and tokens/s per GPU. :func:`recommend`
picks the fastest configuration that fits and says in one line why each other one lost.

Every byte count comes from :mod:`distkit.theory`, the module the chapters print their predictions
from and the benchmarks measure against: model state from
:func:`~distkit.predictors.busiest_rank_prediction` (the fp32 AdamW bytes the CPU matrix measures to
the byte, converted to the plan's precision and optimizer the ZeRO paper's way), collectives from
the same call, activations from :func:`~distkit.theory.activation_bytes_per_layer`, FLOPs from
:func:`~distkit.theory.training_flops_per_token`, the bubble from
:func:`~distkit.theory.pipeline_bubble`. What the planner adds is *time* and *placement*:

* compute = training FLOPs per GPU x the recompute of activation checkpointing / (achievable
  fraction x peak FLOP/s of the precision);
* communication = per collective call ``alpha + bus_bytes / beta`` (alpha-beta, Hockney), beta
  the intra-node link when the collective's group fits in a node, else the inter-node one, minus
  what the strategy can hide behind compute (DDP and ZeRO-1/2 overlap their gradient reduction with
  backward, FSDP and ZeRO-3 prefetch their gathers under forward and backward, tensor parallelism
  and the pipeline's sends sit on the critical path, ZeRO-1/2's weight gather follows the step);
* the pipeline stretches compute by 1 / (1 - bubble).

GPU figures (:data:`GPUS`) are datasheet numbers (dense, no sparsity) and stated assumptions for
links and efficiency, labelled as such; :func:`cpu_cluster` calibrates a CPU "cluster" from the
records this repository measures (collective alpha/beta from the bandwidth sweep, matmul FLOP/s and
a compute efficiency from the benchmark matrix), and :func:`validate` puts every prediction next to
the measurement of every matrix cell.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from . import compare, predictors, theory
from .comm_counter import bus_factor
from .errors import UsageError
from .models import LlamaModelConfig, is_moe
from .strategies import PLANNED, Strategy

GiB = 2 ** 30

# ----------------------------------------------------------------------------------------------
# Hardware: GPU types and links
# ----------------------------------------------------------------------------------------------


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
    ``host_link``: bytes/s to CPU memory (offload); ``source``: where the numbers come from."""

    name: str
    memory_bytes: float
    peak_flops: dict
    hbm_bandwidth: float
    intra: Link
    inter: Link
    host_link: float
    gpus_per_node: int = 8
    source: str = ""


# Datasheet figures (NVIDIA product briefs; dense, i.e. without the 2:4-sparsity doubling), the
# memory as torch.cuda reports it, and ASSUMED achievable link speeds: 80% of one direction of the
# NVLink / PCIe link inside a node, and of one 400 (H100, H200) / 200 (A100) / 100 Gb/s (L4, for the
# whole node) network port per GPU between nodes. Override any of them from the CLI.
_NV4 = Link(0.8 * 450e9, 10e-6)   # NVLink 4: 900 GB/s both directions
_NV3 = Link(0.8 * 300e9, 10e-6)   # NVLink 3: 600 GB/s both directions
GPUS: dict[str, GPU] = {
    "h100": GPU("H100 SXM 80GB", 79.2 * GiB, {"bf16": 989e12, "fp32": 67e12}, 3.35e12, _NV4,
                Link(0.8 * 50e9, 20e-6), 0.8 * 64e9, 8, "datasheet: H100 SXM5, 989 TFLOP/s bf16 dense, 67 fp32"),
    "h200": GPU("H200 SXM 141GB", 140.4 * GiB, {"bf16": 989e12, "fp32": 67e12}, 4.8e12, _NV4,
                Link(0.8 * 50e9, 20e-6), 0.8 * 64e9, 8, "datasheet: H200 SXM, 989 TFLOP/s bf16 dense, 67 fp32"),
    "a100-80gb": GPU("A100 SXM 80GB", 79.2 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 2.04e12, _NV3,
                     Link(0.8 * 25e9, 20e-6), 0.8 * 32e9, 8, "datasheet: A100 SXM4, 312 TFLOP/s bf16 dense, 19.5 fp32"),
    "a100-40gb": GPU("A100 SXM 40GB", 39.4 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 1.56e12, _NV3,
                     Link(0.8 * 25e9, 20e-6), 0.8 * 32e9, 8, "datasheet: A100 SXM4, 312 TFLOP/s bf16 dense, 19.5 fp32"),
    "l4": GPU("L4 24GB", 22.5 * GiB, {"bf16": 121e12, "fp32": 30.3e12}, 0.3e12, Link(0.8 * 32e9, 15e-6),
              Link(0.8 * 12.5e9 / 4, 30e-6), 0.8 * 32e9, 4,
              "datasheet: L4, 121 TFLOP/s bf16 dense (242 with sparsity), 30.3 fp32; PCIe Gen4, no NVLink"),
}


# the planner's GPU type of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100")
GPU_NAME_PARTS = {"H100": "h100", "H200": "h200", "A100": "a100-80gb", "L4": "l4"}


def gpu_type(device_name: str) -> str | None:
    """The :data:`GPUS` key of a device as ``torch.cuda.get_device_name`` names it, or None."""
    return next((key for part, key in GPU_NAME_PARTS.items() if part in device_name), None)


@dataclass(frozen=True)
class Cluster:
    """GPUs of one type: ``gpus`` in all, ``gpus_per_node`` per node.

    ``efficiency``: the achievable fraction of the peak FLOP/s (0.35: torchtitan reports 33-39% MFU
    for Llama 3.1 8B under FSDP on 8 to 128 H100s, ``docs/performance.md``; an assumption
    elsewhere); ``usable_memory``: the fraction of the GPU's
    memory a job can fill (CUDA context, NCCL buffers, allocator fragmentation take the rest);
    ``overlap``: whether communication can run under compute (GPUs with NCCL: yes; CPU ranks that
    share their cores with gloo's threads: no). ``collectives``: measured alpha-beta per
    (collective, group size) (:func:`cpu_cluster`), which replace the links when given;
    ``cores``: CPU cores the ranks of a node share (compute then runs at cores / ranks of a core
    each), None for GPUs. ``overheads``: measured seconds per step that a strategy's framework
    code adds beyond its compute and collectives, at one rank per core (:func:`cpu_cluster`)."""

    gpu: GPU
    gpus: int
    gpus_per_node: int
    efficiency: float = 0.35
    usable_memory: float = 0.9
    overlap: bool = True
    collectives: dict | None = None
    cores: int | None = None
    overheads: dict | None = None

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
AC_MODES = ("none", "selective", "full")


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
    ``micro_batch`` as one replica's share of the batch holds)."""

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

    def __post_init__(self):
        for name, value, allowed in (("precision", self.precision, PRECISIONS),
                                     ("optimizer", self.optimizer, OPTIMIZERS), ("ac", self.ac, AC_MODES)):
            if value not in allowed:
                raise UsageError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.global_batch < 1 or self.micro_batch < 1:
            raise UsageError(f"global batch and micro-batch must be >= 1, got {self.global_batch}, {self.micro_batch}")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len


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
    if sp or ac == "selective":
        return 2 * h if ac == "none" else h
    return 6 * h + 2 if isinstance(cfg, LlamaModelConfig) else 4 * h + 4


def activation_bytes(plan: Plan, layers: float, micro_batch: int, tp: int = 1, sp: bool = False,
                     in_flight: float = 1.0) -> float:
    """Activations one GPU keeps alive at its memory peak, the top of backward (MemTracker finds it
    there: right after the LM head's backward, before any block's): ``layers`` blocks of
    ``micro_batch`` sequences (:func:`distkit.theory.activation_bytes_per_layer`, fp32; bf16 halves
    it), split over ``tp`` ranks as :func:`_replicated_per_token` says (all of it with sequence
    parallelism), times the ``in_flight`` micro-batches a pipeline stage holds. The loss's tensors
    are no longer activations then: see :func:`head_working_set`."""
    cfg = plan.model
    per_layer = theory.activation_bytes_per_layer(cfg, micro_batch, plan.ac)
    head = 0.0
    if tp > 1:
        replicated = min(per_layer, 4 * cfg.seq_len * micro_batch * _replicated_per_token(cfg, plan.ac, sp))
        per_layer = replicated + (per_layer - replicated) / tp
        # the replicated LM head's input and the loss's log-probabilities (split over TP ranks with
        # SP) are saved by DTensor ops inside the model: activations at the peak
        tokens = cfg.seq_len * micro_batch
        head = tokens * (4 * cfg.vocab_size / (tp if sp else 1) + 2 * cfg.n_embd * _act_dtype_bytes(plan))
    return layers * per_layer * in_flight * _act_dtype_bytes(plan) / 4 + head


def head_working_set(plan: Plan, micro_batch: int) -> float:
    """Temporaries alive during the LM head's backward, where the step peaks: the logits (held by
    the training loop), the loss's log-probabilities, their gradient and the logits' gradient (four
    ``b x s x vocab`` tensors, fp32; in bf16 the logits and their gradient are bf16), and the head's
    input gradient with the final norm's (two ``b x s x width``). Measured on the CPU matrix:
    ``tests/test_planner.py``."""
    cfg = plan.model
    tokens = cfg.seq_len * micro_batch
    if plan.precision == "bf16":
        return tokens * (12 * cfg.vocab_size + 4 * cfg.n_embd)
    return tokens * 4 * (4 * cfg.vocab_size + 2 * cfg.n_embd)


# ----------------------------------------------------------------------------------------------
# Time: alpha-beta communication, compute, overlap
# ----------------------------------------------------------------------------------------------

def collective_time(cluster: Cluster, collective: str, group: int, calls: float, bus_bytes: float,
                    spans_nodes: bool) -> float:
    """Seconds for ``calls`` calls of ``collective`` moving ``bus_bytes`` bus bytes in all over a
    ``group`` of ranks: ``calls x alpha + bus_bytes / beta``. Measured fits (``cluster.collectives``,
    the nearest group size) when the cluster has them; else the link (intra-node, or inter-node when
    the group spans nodes) with alpha = latency x ceil(log2 group) (a tree's depth: NCCL's small
    messages) and beta = the link's bus bandwidth."""
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
    else:
        link = cluster.gpu.inter if spans_nodes else cluster.gpu.intra
        alpha, beta = link.latency * math.ceil(math.log2(group)), link.bandwidth
    return calls * alpha + bus_bytes / beta


def _comm_seconds(cluster: Cluster, comm: dict, group: int, spans_nodes: bool, scale: float = 1.0,
                  calls_scale: float = 1.0, only: Iterable[str] | None = None) -> float:
    """Alpha-beta seconds of a theory ``comm`` dict ({collective: {calls, bytes, bus_bytes}}) over one
    group; ``scale`` multiplies the bytes (precision), ``calls_scale`` the calls (micro-batches).
    Calls theory leaves open (None: DDP's buckets, DeepSpeed's flat buffers) count as one per 25 MiB
    bucket."""
    total = 0.0
    for name, stat in comm.items():
        if name == "barrier" or (only is not None and name not in only):
            continue
        calls = stat["calls"] if stat["calls"] is not None else max(1, math.ceil(stat["bytes"] / (25 * 2 ** 20)))
        total += collective_time(cluster, name, group, calls * calls_scale, stat["bus_bytes"] * scale, spans_nodes)
    return total


def core_share(cluster: Cluster) -> float:
    """The share of a core one rank computes with: CPU ranks that outnumber a node's ``cores`` run
    at cores / ranks-per-node of one each; a GPU (no ``cores``) is all its own."""
    return min(1.0, cluster.cores / cluster.gpus_per_node) if cluster.cores else 1.0


def compute_rate(cluster: Cluster, plan: Plan) -> float:
    """Achieved FLOP/s of one GPU (one rank): efficiency x peak of the precision, at the rank's
    :func:`core_share` on CPU."""
    peak = cluster.gpu.peak_flops.get(plan.precision) or cluster.gpu.peak_flops["fp32"]
    return cluster.efficiency * peak * core_share(cluster)


def _flops_per_token(plan: Plan, lora: bool = False) -> float:
    """theory's ``6N + 12Lsd`` (model FLOPs), plus the forward that full AC recomputes (2N + 4Lsd:
    hardware FLOPs that the step takes time for), and for LoRA minus the frozen weights' gradient
    matmuls (2N: backward computes input gradients only)."""
    cfg = plan.model
    full = theory.training_flops_per_token(cfg)
    attention = 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
    matmul = full - attention
    flops = full
    if plan.ac == "full":
        flops += (matmul + attention) / 3
    if lora:
        flops -= matmul / 3
    return flops


# ----------------------------------------------------------------------------------------------
# One estimate per configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    """One configuration: ``name`` (the strategy), ``layout`` (dp/tp/pp/shard sizes, micro-batches),
    ``memory_bytes`` per GPU by :data:`PARTS` (+ ``total``), ``fits``, ``step_time_s`` and its parts
    (``compute_s``, ``comm_s`` (all communication), ``exposed_comm_s`` (what compute does not hide),
    ``bubble_s``, ``optimizer_s``), ``tokens_per_s_per_gpu``, ``note`` (why it cannot run, when it
    cannot: ``valid`` is then False)."""

    name: str
    layout: dict
    memory_bytes: dict
    fits: bool
    step_time_s: float
    tokens_per_s_per_gpu: float
    times: dict = field(default_factory=dict)
    valid: bool = True
    note: str = ""
    offload: bool = False
    lora: bool = False

    def to_json(self) -> dict:
        return {"name": self.name, "valid": self.valid, "fits": self.fits, "layout": self.layout,
                "memory_bytes": self.memory_bytes, "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "times_s": self.times, "note": self.note}


def _invalid(name: str, layout: dict, note: str) -> Estimate:
    return Estimate(name, layout, {p: math.nan for p in (*PARTS, "total", "peak")}, False, math.inf, 0.0, valid=False,
                    note=note)


def peak_bytes(memory: dict, head: float, accumulating: bool) -> float:
    """The step's peak, the larger of its two high-water moments. Top of backward (where
    MemTracker finds the peak of every CPU matrix cell): parameters, optimizer state, every
    activation, the temporaries; no gradients yet (``zero_grad(set_to_none=True)``), unless
    earlier micro-batches of an accumulation left theirs. End of backward: every gradient, the
    activations freed, the buffers kept (the head's working set gone)."""
    top = memory["params"] + memory["optimizer"] + memory["activations"] + memory["temporaries"]
    if accumulating:
        top += memory["grads"]
    end = memory["params"] + memory["grads"] + memory["optimizer"] + memory["temporaries"] - head
    return max(top, end)


def _finish(name, layout, plan, cluster, state, act, temp, compute_s, comm_s, exposed_s, bubble_s=0.0,
            optimizer_s=None, head=0.0, accumulating=False, **flags) -> Estimate:
    memory = {**state, "activations": act, "temporaries": temp}
    memory["total"] = sum(memory[p] for p in PARTS)
    memory["peak"] = peak_bytes(memory, head, accumulating)
    if optimizer_s is None:  # read and write every state byte once: memory-bound
        optimizer_s = 2 * sum(state.values()) / cluster.gpu.hbm_bandwidth
    step = compute_s + bubble_s + exposed_s + optimizer_s
    times = {"compute_s": compute_s, "bubble_s": bubble_s, "comm_s": comm_s, "exposed_comm_s": exposed_s,
             "optimizer_s": optimizer_s}
    return Estimate(name, layout, memory, memory["peak"] <= cluster.capacity_bytes, step,
                    plan.tokens_per_step / cluster.gpus / step, times, **flags)


def _data_parallel_layout(plan: Plan, dp: int, name: str) -> tuple[dict, str | None]:
    per_replica = plan.global_batch / dp
    if per_replica < 1 or per_replica != int(per_replica):
        return {}, f"the global batch {plan.global_batch} does not split over {dp} data-parallel ranks"
    micro = min(plan.micro_batch, int(per_replica))
    if per_replica % micro:
        return {}, f"{int(per_replica)} sequences per rank do not split into micro-batches of {micro}"
    return {"dp": dp, "micro_batch": micro, "accumulation": int(per_replica) // micro}, None


def _dp_family(name: str, plan: Plan, cluster: Cluster) -> Estimate:
    """DDP, ZeRO-1/2/3 (+ offload), FSDP SHARD_GRAD_OP / FULL_SHARD / HYBRID_SHARD, LoRA with FSDP:
    every GPU a data-parallel rank, accumulation over micro-batches of ``plan.micro_batch``."""
    n, cfg = cluster.gpus, plan.model
    layout, problem = _data_parallel_layout(plan, n, name)
    if problem:
        return _invalid(name, {"dp": n}, problem)
    theory_name = {Strategy.LORA_FSDP: Strategy.FSDP_FULL_SHARD}.get(name, name)
    knobs = {}
    if name == Strategy.FSDP_HYBRID_SHARD:
        knobs["shard"] = cluster.gpus_per_node if n % cluster.gpus_per_node == 0 else n
        layout["shard"] = knobs["shard"]
    if name == Strategy.FSDP_NO_SHARD:
        knobs["shard"] = 1
    if name.startswith("zero3"):
        knobs["stage3_max_live_parameters"] = 1e9  # DeepSpeed's default window
    pred = predictors.busiest_rank_prediction(theory_name, cfg, n, plan.global_batch, knobs)
    psi = pred["param_count"]
    zero = name.startswith("zero") and name != Strategy.ZERO0
    state = state_bytes(pred["state"], plan, zero=zero)
    if name == Strategy.ZERO1:  # theory counts at the optimizer step; through backward ZeRO-1 holds every gradient
        state["grads"] = psi * (2 if plan.precision == "bf16" else 4)
    lora = name == Strategy.LORA_FSDP
    if lora:  # frozen base, sharded; adapters (r x (d_in + d_out) per adapted matrix) replicated-ish
        shapes = theory.param_shapes(cfg)
        adapters = sum(plan.lora_rank * (s[0] + s[1]) for k, s in shapes.items()
                       if len(s) == 2 and k.split(".")[-2] in plan.lora_targets)
        w = _act_dtype_bytes(plan)
        state = {"params": pred["state"]["params"] / 4 * w + adapters / n * 4,
                 "grads": adapters / n * 4,
                 "optimizer": adapters / n * {"adamw": 8, "sgd": 4}[plan.optimizer]}
        layout["adapter_params"] = adapters
    offload = name.endswith("_offload")
    micro, accum = layout["micro_batch"], layout["accumulation"]
    # fp32 gathers/reductions of theory; bf16 gathers move half, gradient reductions in bf16 too
    scale = 0.5 if plan.precision == "bf16" else 1.0
    shard_group = knobs.get("shard", n)
    spans = n > cluster.gpus_per_node
    comm = pred["comm"]
    compute_s = plan.tokens_per_step / n * _flops_per_token(plan, lora) / compute_rate(cluster, plan)
    backward_s = compute_s * 2 / 3
    w = _act_dtype_bytes(plan)
    act = activation_bytes(plan, cfg.n_layer, micro)
    head = head_working_set(plan, micro)
    unit = _block_params(cfg)
    root = psi - unit * cfg.n_layer
    grad_w = 2 if plan.precision == "bf16" else 4
    if name in (Strategy.DDP, Strategy.DDP_FROM_SCRATCH):
        # DDP's buckets: a flat copy of every gradient (torch's default gradient_as_bucket_view=False);
        # the from-scratch version all-reduces each gradient in place
        temp = head + (state["grads"] if name == Strategy.DDP else 0)
        t_grad = _comm_seconds(cluster, comm, n, spans, scale)
        exposed = max(0.0, t_grad - backward_s) if cluster.overlap else t_grad
        comm_s = t_grad
    elif name in (Strategy.ZERO1, Strategy.ZERO2):
        # DeepSpeed's flat gradient buffers: ZeRO-2 keeps the reduced partition (Ψ/n), ZeRO-1 two
        # partition-sized buffers (2Ψ/n, measured by MemTracker at 2 and 4 ranks on both models),
        # at most a bucket of reduce_bucket_size = 5e8 elements
        temp = head + min(2 * psi / n if name == Strategy.ZERO1 else psi / n, 5e8) * grad_w
        t_grad = _comm_seconds(cluster, comm, n, spans, scale, only=("all_reduce", "reduce_scatter"))
        t_gather = _comm_seconds(cluster, comm, n, spans, scale, only=("all_gather",))
        if name == Strategy.ZERO2:
            t_grad *= accum
        exposed = (max(0.0, t_grad - backward_s) if cluster.overlap else t_grad) + t_gather
        comm_s = t_grad + t_gather
    else:  # FSDP / ZeRO-3 / LoRA: gathers and reduce-scatters per micro-batch, prefetched under compute
        # At the top of backward: FULL_SHARD / HYBRID hold the root unit and the last block
        # unsharded (in the compute dtype) plus the all-gather buffer they came from (on GPUs the
        # prefetched next block's too); SHARD_GRAD_OP keeps every unit unsharded from forward to
        # backward. ZeRO-3 reduces into a gradient partition buffer. Gathered copies count as
        # temporaries here (MemTracker files them under parameters): "params" stays the held shard.
        gathers = 2 if cluster.overlap else 1
        if name.startswith("zero3"):
            temp = head + psi / n * grad_w
        elif name in (Strategy.FSDP_SHARD_GRAD_OP, Strategy.FSDP_NO_SHARD):
            temp = head + psi * w
        else:
            temp = head + (unit + root) * w + gathers * unit * w
        t_shard = _comm_seconds(cluster, comm, shard_group, shard_group > cluster.gpus_per_node, scale,
                                only=("all_gather", "reduce_scatter"))
        if lora:  # frozen base: gathers only (reduce-scatters carry the adapters' few gradients)
            t_shard = _comm_seconds(cluster, comm, shard_group, shard_group > cluster.gpus_per_node, scale,
                                    only=("all_gather",))
        t_rep = _comm_seconds(cluster, comm, n // shard_group, True, 1.0, only=("all_reduce",))
        t_total = (t_shard + t_rep) * accum
        first = t_shard * accum / max(2 * cfg.n_layer + 1, 1)  # the first gather is never hidden
        exposed = (max(first, t_total - compute_s) if cluster.overlap else t_total)
        comm_s = t_total
    optimizer_s = None
    if offload:  # gradients down, weights up over the host link; the optimizer runs on the CPU
        moved = (state["grads"] + state["params"])
        optimizer_s = moved / cluster.gpu.host_link + state["optimizer"] / 12 * 16 / 10e9
        if not cluster.cores:  # on CPU ranks the "host" memory is the same memory: nothing leaves
            state = {**state, "optimizer": 0.0}
    return _finish(name, layout, plan, cluster, state, act, temp, compute_s, comm_s, exposed, head=head,
                   accumulating=accum > 1,
                   optimizer_s=optimizer_s, offload=offload, lora=lora)


def _tp_fsdp(plan: Plan, cluster: Cluster, tp: int, sp: bool = False) -> Estimate:
    """Megatron TP over ``tp`` GPUs of a node (per block: 2 all-reduces of ``b x s x h`` forward, 2
    backward, on the critical path), FSDP FULL_SHARD of each TP shard over the ``gpus / tp``
    data-parallel ranks (theory's ``fsdp_tp_2d``; pure ``tp`` when they are 1)."""
    n, cfg = cluster.gpus, plan.model
    name = Strategy.FSDP_TP
    dp = n // tp
    layout, problem = _data_parallel_layout(plan, dp, name)
    if problem:
        return _invalid(name, {"tp": tp, "dp": dp}, problem)
    layout["tp"] = tp
    micro, accum = layout["micro_batch"], layout["accumulation"]
    if dp == 1:
        pred = predictors.busiest_rank_prediction(Strategy.TP_SP if sp else Strategy.TP, cfg, tp, plan.global_batch)
    else:
        pred = predictors.busiest_rank_prediction(Strategy.FSDP_TP_2D, cfg, n, plan.global_batch, {"tp": tp})
    state = state_bytes(pred["state"], plan)
    scale = 0.5 if plan.precision == "bf16" else 1.0
    tp_comm = pred["comm"] if dp == 1 else theory.megatron_tp_bytes(cfg, plan.global_batch // dp, tp)
    t_tp = _comm_seconds(cluster, tp_comm, tp, tp > cluster.gpus_per_node, scale, calls_scale=accum)
    fsdp_comm = {k: v for k, v in pred["comm"].items() if k != "all_reduce"} if dp > 1 else {}
    t_fsdp = _comm_seconds(cluster, fsdp_comm, dp, n > cluster.gpus_per_node, scale, calls_scale=accum) * accum
    if dp == 1:  # pure TP: the replicated parameters' gradients are not reduced (theory: none)
        t_fsdp = 0.0
    compute_s = plan.tokens_per_step / n * _flops_per_token(plan) / compute_rate(cluster, plan)
    exposed = t_tp + (max(0.0, t_fsdp - compute_s) if cluster.overlap else t_fsdp)
    w = _act_dtype_bytes(plan)
    act = activation_bytes(plan, cfg.n_layer, micro, tp=tp, sp=sp)
    if dp > 1:  # the 2-D script leaves the LM head to FSDP: its tensors are the head's working set
        act -= activation_bytes(plan, 0, micro, tp=tp, sp=sp)
    unit = _block_params(cfg) / tp
    # the logits and their gradient (the LM head is replicated: full vocabulary on every TP rank),
    # and with FSDP over dp the gathered TP shard of a block and its all-gather buffer
    temp = 2 * micro * cfg.seq_len * cfg.vocab_size * 4
    if dp > 1:
        temp += 2 * unit * w
    return _finish(name, layout, plan, cluster, state, act, temp, compute_s, t_tp + t_fsdp, exposed,
                   head=2 * micro * cfg.seq_len * cfg.vocab_size * 4, accumulating=accum > 1)


def _pipeline(plan: Plan, cluster: Cluster, schedule: str, pp: int, stages_per_rank: int = 2) -> Estimate:
    """``pp`` pipeline stages (one per GPU; interleaved: 2 per GPU) x ``gpus / pp`` data-parallel
    replicas that all-reduce their stage's gradients (DDP). Micro-batches of ``plan.micro_batch``;
    compute stretched by theory's bubble; in flight: GPipe all m micro-batches, 1F1B p, interleaved
    p x (1 + (p - 1) / (v p)) (Narayanan et al. 2021)."""
    n, cfg = cluster.gpus, plan.model
    name = Strategy(f"pp_{schedule}")
    dp = n // pp
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    if pp * v > cfg.n_layer:
        return _invalid(name, {"pp": pp}, f"{pp * v} stages need at least as many blocks ({cfg.n_layer})")
    per_replica = plan.global_batch / dp
    if per_replica != int(per_replica) or per_replica < 1:
        return _invalid(name, {"pp": pp, "dp": dp}, f"the global batch does not split over {dp} replicas")
    micro = min(plan.micro_batch, int(per_replica))
    m = plan.microbatches or int(per_replica) // micro
    micro = int(per_replica) // m
    if m * micro != per_replica:
        return _invalid(name, {"pp": pp, "dp": dp}, f"{int(per_replica)} sequences do not split into {m} micro-batches")
    knobs = {"microbatches": m, "stages_per_rank": v}
    pred = predictors.predict(name, cfg, pp, int(per_replica), knobs)
    scale = 0.5 if plan.precision == "bf16" else 1.0
    compute_s = plan.tokens_per_step / n * _flops_per_token(plan) / compute_rate(cluster, plan)
    bubble = theory.pipeline_bubble(pp, m, v)
    # A stage idles for the bubble. On GPUs that time is lost: step = compute / (1 - bubble). CPU
    # ranks that share fewer cores than there are ranks (compute_s already runs each at its share of
    # a core) lend an idle stage's core to the busy ones, so the step is the longer of the critical
    # path at a whole core and the machine's total work over its cores.
    bubble_s = max(compute_s * core_share(cluster) / (1 - bubble), compute_s) - compute_s
    w = _act_dtype_bytes(plan)
    # The stage that decides the fit: the first holds the most micro-batches in flight (1F1B: p - r
    # on rank r, GPipe: all m everywhere), the last the LM head and its working set, another rank
    # may hold the most parameters. Estimate each and keep the largest peak.
    busiest = max(range(pp), key=lambda r: sum(pred["state_per_rank"][r].values()))
    candidates = []
    for rank in sorted({0, pp - 1, busiest}):
        state = state_bytes(pred["state_per_rank"][rank], plan)
        layout = {"pp": pp, "dp": dp, "microbatches": m, "micro_batch": micro, "stages_per_rank": v, "rank": rank}
        ahead = min(pp - rank, m)
        # (interleaved: its warm-up runs (v - 1) p + 2 (p - 1 - r) chunks of L / (p v) blocks before the
        # first backward, which is never more than all m micro-batches of both chunks)
        in_flight = {"gpipe": m, "1f1b": ahead, "interleaved_1f1b": min(m, ahead * (1 + (pp - 1) / (v * pp)))}[schedule]
        # + each in-flight micro-batch's stage input and output, held by the schedule until its backward
        act = (activation_bytes(plan, cfg.n_layer / pp, micro, in_flight=in_flight)
               + in_flight * 2 * micro * cfg.seq_len * cfg.n_embd * w)
        t_p2p = _comm_seconds(cluster, pred["comm_per_rank"][rank], 2, pp > cluster.gpus_per_node, scale)
        grads = theory.ddp_bytes(state["params"] / (2 if plan.precision == "bf16" else 4), dp,
                                 2 if plan.precision == "bf16" else 4)
        t_dp = _comm_seconds(cluster, {"all_reduce": {"calls": None, **grads}}, dp, n > cluster.gpus_per_node)
        exposed = t_p2p + (max(0.0, t_dp - compute_s * 2 / 3) if cluster.overlap else t_dp)
        # the last stage's head working set, the send/receive buffers of a micro-batch's activation
        # and its gradient, and with data parallelism DDP's gradient buckets
        head = head_working_set(plan, micro) if rank == pp - 1 else 0.0
        temp = head + 2 * micro * cfg.seq_len * cfg.n_embd * w
        if dp > 1:
            temp += state["grads"]
        # 1F1B runs its first backward while later micro-batches are in flight: gradients then exist
        candidates.append(_finish(name, layout, plan, cluster, state, act, temp, compute_s, t_p2p + t_dp, exposed,
                                  bubble_s, head=head, accumulating=schedule != "gpipe"))
    worst = max(candidates, key=lambda e: e.memory_bytes["peak"])
    slowest = max(candidates, key=lambda e: e.step_time_s)
    worst.step_time_s, worst.tokens_per_s_per_gpu, worst.times = \
        slowest.step_time_s, slowest.tokens_per_s_per_gpu, slowest.times
    return worst


def _after_backward_peak(est: Estimate, cluster: Cluster, flat_bytes: float) -> Estimate:
    """``est`` with the moment after backward counted in its peak: every gradient, the optimizer
    state and a flat copy of ``flat_bytes`` gradients being averaged (the chapter scripts' one flat
    all-reduce per group of parameters, divided in place), the activations and the head's working
    set gone."""
    m = est.memory_bytes
    m["peak"] = max(m["peak"], m["params"] + m["grads"] + m["optimizer"] + flat_bytes)
    est.fits = m["peak"] <= cluster.capacity_bytes
    return est


def _context_parallel(plan: Plan, cluster: Cluster, cp: int) -> Estimate:
    """Context parallelism (``05-advanced/context_parallel.py``: ring attention) over ``cp`` GPUs of a
    node x ``gpus / cp`` data-parallel replicas. Every GPU holds the whole model state (as DDP,
    theory's ``cp`` prediction) and 1/cp of each of its replica's micro-batch sequences: the
    activations of s/cp tokens per sequence (theory's per-layer bytes at that length), plus, without
    activation checkpointing, the copy of the ring's heads-major attention output that the output
    projection keeps as its input (h per token; SDPA returns O in the projection's layout), and the
    LM head's working set for its s/cp tokens.

    Time: compute is the tokens' FLOPs over all GPUs (zig-zag balances the causal attention). The
    ring passes one rank's K and V per hop, 3cp - 2 hops per layer per micro-batch (cp - 1 forward,
    2cp - 1 backward with dK/dV); a hop's send and receive run at once, so its time is one send's
    (alpha-beta, a group of 2: neighbours). On GPUs each hop hides under the attention of the block
    in hand: exposed = ring - attention compute (its 12 L s d FLOPs per token, half of which a causal
    kernel computes), never below 0; without overlap (CPU) all of it. The gradient all-reduce over
    all GPUs is DDP's (hidden under backward on GPUs). After backward the chapter script averages
    the gradients through one flat copy (:func:`_after_backward_peak`)."""
    n, cfg = cluster.gpus, plan.model
    name, dp = Strategy.CP, n // cp
    layout, problem = _data_parallel_layout(plan, dp, name)
    if problem:
        return _invalid(name, {"cp": cp, "dp": dp}, problem)
    layout["cp"] = cp
    micro, accum = layout["micro_batch"], layout["accumulation"]
    pred = predictors.busiest_rank_prediction(Strategy.CP, cfg, n, plan.global_batch, {"cp": cp})
    state = state_bytes(pred["state"], plan)
    scale = 0.5 if plan.precision == "bf16" else 1.0
    w = _act_dtype_bytes(plan)
    compute_s = plan.tokens_per_step / n * _flops_per_token(plan) / compute_rate(cluster, plan)
    attention_s = plan.tokens_per_step / n * 6 * cfg.n_layer * cfg.n_embd * cfg.seq_len / compute_rate(cluster, plan)
    t_ring = _comm_seconds(cluster, pred["comm"], 2, cp > cluster.gpus_per_node, scale, calls_scale=accum,
                           only=("send",))
    t_grad = _comm_seconds(cluster, pred["comm"], n, n > cluster.gpus_per_node, scale, only=("all_reduce",))
    if cluster.overlap:
        exposed = max(0.0, t_ring - attention_s) + max(0.0, t_grad - compute_s * 2 / 3)
    else:
        exposed = t_ring + t_grad
    local = replace(plan, model=replace(cfg, seq_len=cfg.seq_len // cp))  # what one rank holds of a sequence
    tokens = micro * local.model.seq_len
    act = activation_bytes(local, cfg.n_layer, micro)
    if plan.ac == "none":  # the output projection's input: a copy of the ring's heads-major output
        act += cfg.n_layer * tokens * cfg.n_embd * w
    head = head_working_set(local, micro)
    est = _finish(name, layout, plan, cluster, state, act, head, compute_s, t_ring + t_grad, exposed, head=head,
                  accumulating=accum > 1)
    return _after_backward_peak(est, cluster, state["grads"])


def _expert_parallel(plan: Plan, cluster: Cluster, ep: int, routing: list | None = None) -> Estimate:
    """Expert parallelism (``05-advanced/expert_parallel.py``) for an MoE model (``--experts``): a
    (dp, ep) mesh, ``ep`` GPUs sharing one copy of the experts, each holding num_experts / ep of them
    with their gradients and optimizer state, the dense parameters (attention, norms, routers,
    embeddings) replicated on all GPUs (theory's ``ep`` prediction). Every GPU routes its own share
    of the batch: its activations are theory's MoE block bytes for the rows it sends and receives,
    balanced routing in a plan (k rows per token each way), a record's own routing when ``routing``
    is given (per rank, per layer, (sent, received); the estimate is then the rank that received
    the most rows, the one deciding the fit).

    Time: compute is the active parameters' FLOPs (theory's FLOPs per token). Each MoE layer runs 5
    all-to-alls over the ep group per micro-batch (the counts, dispatch and combine forward and both
    again backward), on the critical path: a token's expert output is needed before the block goes
    on (alpha-beta with the all_to_all collective; a CPU calibration without an all_to_all sweep uses
    all_reduce's fit). The dense gradients are all-reduced over all GPUs and the experts' over the dp
    GPUs holding the same experts, as DDP does (hidden under backward on GPUs). After backward the
    chapter script averages each group through one flat copy (:func:`_after_backward_peak`)."""
    n, cfg = cluster.gpus, plan.model
    name, dp = Strategy.EP, n // ep
    layout, problem = _data_parallel_layout(plan, n, name)
    if problem:
        return _invalid(name, {"ep": ep, "dp": dp}, problem)
    layout.update(dp=dp, ep=ep)
    micro, accum = layout["micro_batch"], layout["accumulation"]
    knobs = {"ep": ep, **({"routing": routing} if routing else {})}
    pred = predictors.predict(Strategy.EP, cfg, n, plan.global_batch, knobs)
    rank = 0
    if routing:
        rank = max(range(n), key=lambda r: sum(received for _, received in routing[r]))
        layout["rank"] = rank
    state = state_bytes(pred["state_per_rank"][rank], plan)
    comm = pred["comm_per_rank"][rank]
    scale = 0.5 if plan.precision == "bf16" else 1.0
    w = _act_dtype_bytes(plan)
    compute_s = plan.tokens_per_step / n * _flops_per_token(plan) / compute_rate(cluster, plan)
    t_a2a = _comm_seconds(cluster, comm, ep, ep > cluster.gpus_per_node, scale, calls_scale=accum,
                          only=("all_to_all",))
    dense, per_expert = theory.moe_param_split(theory.param_shapes(cfg), cfg.num_experts)
    held_experts = sum(per_expert[:cfg.num_experts // ep])
    grad_w = 2 if plan.precision == "bf16" else 4
    t_dense = _comm_seconds(cluster, {"all_reduce": {"calls": None, **theory.ddp_bytes(dense, n, grad_w)}}, n,
                            n > cluster.gpus_per_node)
    t_experts = _comm_seconds(cluster, {"all_reduce": {"calls": None, **theory.ddp_bytes(held_experts, dp, grad_w)}},
                              dp, True) if dp > 1 else 0.0
    t_grad = t_dense + t_experts
    exposed = t_a2a + (max(0.0, t_grad - compute_s * 2 / 3) if cluster.overlap else t_grad)
    if routing:  # the rows this rank routed, layer by layer (a record: one micro-batch)
        act = sum(theory.moe_activation_bytes_per_layer(cfg, micro, plan.ac, received, sent)
                  for sent, received in routing[rank]) * w / 4
    else:
        act = activation_bytes(plan, cfg.n_layer, micro)
    head = head_working_set(plan, micro)
    est = _finish(name, layout, plan, cluster, state, act, head, compute_s, t_a2a + t_grad, exposed, head=head,
                  accumulating=accum > 1)
    return _after_backward_peak(est, cluster, max(dense, held_experts) * grad_w)


def _block_params(cfg) -> int:
    """Parameters of one transformer block (an FSDP unit as the chapters wrap it)."""
    return sum(math.prod(s) for k, s in theory.param_shapes(cfg).items()
               if k.startswith(("blocks.0.", "model.layers.0.")))


# a strategy the calibration never saw borrows its family's overhead
OVERHEAD_FAMILY = {Strategy.FSDP_HYBRID_SHARD: Strategy.FSDP_FULL_SHARD, Strategy.HSDP: Strategy.FSDP_FULL_SHARD,
                   Strategy.FSDP_TP_2D: Strategy.TP, Strategy.ZERO3_OFFLOAD: Strategy.ZERO3,
                   Strategy.PP_INTERLEAVED_1F1B: Strategy.PP_1F1B, Strategy.PP_GPIPE: Strategy.PP_1F1B,
                   Strategy.TP_SP: Strategy.TP, Strategy.FSDP_NO_SHARD: Strategy.FSDP_SHARD_GRAD_OP,
                   Strategy.FSDP_TP: Strategy.FSDP_TP_2D}


# What a strategy's framework overhead grows with: its communication (a hook, a copy in and out per
# collective call), except for the two strategies whose parallelism is Python work per token:
# context parallelism's hand-written ring attention (a few small ops per chunk pair of every layer)
# and expert parallelism's routing (top-k, capacity, regrouping the rows per layer). Measured on the
# 2-core matrix, their extra time follows the compute a rank does (2 -> 4 ranks: about 0.8 and 0.6 x
# compute for EP, 3.8 and 2.5 for CP), not their communication (EP 3.0 and 0.5 x communication).
OVERHEAD_BASIS = {Strategy.CP: "compute_s", Strategy.EP: "compute_s"}


def overhead_basis(strategy: str) -> str:
    """The part of an estimate's time (``comm_s`` or ``compute_s``) whose seconds ``strategy``'s
    framework overhead is calibrated per (:data:`OVERHEAD_BASIS`)."""
    return OVERHEAD_BASIS.get(strategy, "comm_s")


def with_overhead(est: Estimate, cl: Cluster, strategy: str) -> Estimate:
    """``est`` plus the framework overhead the cluster measured for ``strategy`` (CPU calibration):
    its seconds per second of communication x this estimate's communication (a strategy's Python
    work grows with its collectives: one hook, one copy in and out, per call); for context and
    expert parallelism per second of compute instead (:data:`OVERHEAD_BASIS`)."""
    if not cl.overheads or not est.valid:
        return est
    strategy = strategy if strategy in cl.overheads else OVERHEAD_FAMILY.get(strategy, strategy)
    seconds = cl.overheads.get(strategy, 0.0) * est.times[overhead_basis(strategy)]
    est.times["framework_s"] = seconds
    est.step_time_s += seconds
    est.tokens_per_s_per_gpu *= (est.step_time_s - seconds) / est.step_time_s
    return est


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** i for i in range(1, int(math.log2(limit)) + 1)] if limit >= 2 else []


def _best(candidates: list[Estimate]) -> Estimate:
    """The fastest that fits, else the one that needs the least memory (so the reason says by how much)."""
    valid = [c for c in candidates if c.valid]
    if not valid:
        return candidates[0]
    fitting = [c for c in valid if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.step_time_s)
    return min(valid, key=lambda c: c.memory_bytes["peak"])


def estimate(plan: Plan, cluster: Cluster, strategy: str) -> Estimate:
    """The :class:`Estimate` of one of :data:`~distkit.strategies.PLANNED`. ``fsdp_tp`` tries every TP size that is a
    power of two within a node (and splits the heads), the pipelines every power-of-two stage count;
    every strategy also tries halving the micro-batch (more accumulation, fewer activations) when
    ``plan.micro_batch`` does not fit; the fastest that fits is kept (else the smallest)."""
    if strategy not in PLANNED:
        raise UsageError(f"unknown strategy {strategy!r}; known: {', '.join(PLANNED)}")
    micro = [plan.micro_batch]
    while micro[-1] > 1:
        micro.append(micro[-1] // 2)
    tried = []
    for m in micro:
        tried.append(_estimate_layouts(replace(plan, micro_batch=m), cluster, strategy))
        if tried[-1].valid and tried[-1].fits:
            break
    return _best(tried)


def _estimate_layouts(plan: Plan, cluster: Cluster, strategy: str) -> Estimate:
    cfg, n = plan.model, cluster.gpus
    if strategy == Strategy.FSDP_TP:
        heads = [cfg.n_head, getattr(cfg, "n_kv_head", cfg.n_head)]
        sizes = [t for t in _powers_of_two(min(cluster.gpus_per_node, n))
                 if n % t == 0 and all(h % t == 0 for h in heads)]
        if not sizes:
            return _invalid(strategy, {}, "no TP size: needs 2+ GPUs in a node that split the heads")
        return _best([with_overhead(_tp_fsdp(plan, cluster, t), cluster, Strategy.FSDP_TP_2D if t < n else Strategy.TP)
                      for t in sizes])
    if strategy.startswith("pp_"):
        sizes = [p for p in _powers_of_two(n) if n % p == 0]
        if not sizes:  # say which: a pipeline of 3 stages exists, but the planner sizes them in powers of two
            return _invalid(strategy, {}, "a pipeline needs at least 2 GPUs" if n < 2 else
                            f"no pipeline size: the planner tries 2, 4, 8 ... stages, and none divides {n} GPUs")
        return _best([with_overhead(_pipeline(plan, cluster, strategy[3:], p), cluster, strategy) for p in sizes])
    if strategy == Strategy.CP:  # rings of powers of two within a node, each rank two of the 2cp chunks
        sizes = [c for c in _powers_of_two(min(cluster.gpus_per_node, n))
                 if n % c == 0 and cfg.seq_len % (2 * c) == 0]
        if not sizes:
            return _invalid(strategy, {}, f"no CP size: needs 2+ GPUs in a node whose ring cuts the {cfg.seq_len} "
                                          "tokens into 2 x cp equal chunks")
        return _best([with_overhead(_context_parallel(plan, cluster, c), cluster, strategy) for c in sizes])
    if strategy == Strategy.EP:  # expert groups of powers of two that split the experts
        if not is_moe(cfg):
            return _invalid(strategy, {}, "needs an MoE model (--experts)")
        sizes = [e for e in _powers_of_two(n) if n % e == 0 and cfg.num_experts % e == 0]
        if not sizes:
            return _invalid(strategy, {}, f"no EP size: needs 2+ GPUs that split the {cfg.num_experts} experts")
        return _best([with_overhead(_expert_parallel(plan, cluster, e), cluster, strategy) for e in sizes])
    return with_overhead(_dp_family(strategy, plan, cluster), cluster, strategy)


def estimate_all(plan: Plan, cluster: Cluster, strategies: Iterable[str] = PLANNED) -> list[Estimate]:
    """:func:`estimate` for every strategy, in :data:`~distkit.strategies.PLANNED` order."""
    return [estimate(plan, cluster, s) for s in strategies]


# ----------------------------------------------------------------------------------------------
# The recommendation
# ----------------------------------------------------------------------------------------------


@dataclass
class Recommendation:
    """``best``: the fastest estimate that fits (None when nothing does); ``reasons``: strategy ->
    one line on why it was not chosen."""

    best: Estimate | None
    reasons: dict


def recommend(estimates: list[Estimate], cluster: Cluster, allow_offload: bool = False) -> Recommendation:
    """The top README's decision guide applied to numbers: among the configurations that run, fit
    and train the whole model (LoRA trains adapters only: another job, never picked for full
    training), the fastest; CPU offload only with ``allow_offload`` or when nothing else fits."""
    cap = cluster.capacity_bytes
    eligible = [e for e in estimates if e.valid and e.fits and not e.lora]
    on_gpu = [e for e in eligible if not e.offload]
    pool = eligible if allow_offload else on_gpu
    best = min(pool, key=lambda e: e.step_time_s) if pool else None
    reasons = {}
    for e in estimates:
        if e is best:
            continue
        if not e.valid:
            reasons[e.name] = f"cannot run: {e.note}"
        elif not e.fits:
            reasons[e.name] = (f"does not fit: {e.memory_bytes['peak'] / GiB:.1f} GiB per GPU > "
                               f"{cap / GiB:.1f} GiB usable")
        elif e.lora:
            reasons[e.name] = "trains LoRA adapters only (fine-tuning a frozen base): a different job"
        elif e.offload and not allow_offload:
            reasons[e.name] = "fits, but CPU offload was not allowed (--offload)"
        elif best is not None:
            reasons[e.name] = (f"fits, {e.step_time_s / best.step_time_s:.2f}x slower "
                               f"({_why_slower(e, best)})")
    return Recommendation(best, reasons)


def _why_slower(e: Estimate, best: Estimate) -> str:
    """The part of the step that grew the most against the recommendation."""
    parts = {"exposed communication": "exposed_comm_s", "pipeline bubble": "bubble_s", "optimizer step": "optimizer_s",
             "compute": "compute_s"}
    label, _ = max(parts.items(), key=lambda kv: e.times.get(kv[1], 0) - best.times.get(kv[1], 0))
    return f"more {label}"


# ----------------------------------------------------------------------------------------------
# Inputs made from other inputs: a parameter count, overridden hardware
# ----------------------------------------------------------------------------------------------


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
    """``cl`` with the values the reader gave instead of the table's (None keeps the table's)."""
    gpu = cl.gpu
    if memory_gib:
        gpu = replace(gpu, memory_bytes=memory_gib * GiB)
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


# ----------------------------------------------------------------------------------------------
# Calibration on this machine: collectives from the bandwidth sweep, compute from the matrix
# ----------------------------------------------------------------------------------------------


def read_matrix(path) -> list[dict]:
    """The records of a results file (:func:`distkit.harness.read_records`); a one-line error when
    it is missing or holds none."""
    from pathlib import Path

    from .record_format import read_records

    if not Path(path).is_file():
        raise UsageError(f"no records file {path}")
    try:
        records = read_records(path)
    except (ValueError, AttributeError, TypeError) as exc:  # not JSON lines of records
        raise UsageError(f"{path} is not a file of JSON records ({exc})") from None
    if not records:
        raise UsageError(f"{path} holds no records")
    return records


def fit_collectives(records: list[dict]) -> dict:
    """``{(collective, ranks): (alpha_s, beta_bytes_per_s)}`` from bandwidth-sweep records
    (``04-nccl-operations/bandwidth_test.py``, also in a benchmark results file with ``--bandwidth``):
    per collective and rank count the least-squares line ``time = alpha + bus_bytes / beta`` through
    the sweep's (size x bus factor, time) points, weighted by 1/time^2 so small and large messages
    count alike (a relative fit)."""
    fits = {}
    for rec in records:
        if not str(rec.get("strategy", "")).startswith("bandwidth") or not rec.get("rows"):
            continue
        n = rec["world_size"]
        name = rec.get("collective") or rec["strategy"].removeprefix("bandwidth_")
        factor = bus_factor(name, n)
        pts = [(row["size_bytes"] * factor, row["time_us"] * 1e-6) for row in rec["rows"] if row.get("time_us")]
        if len(pts) < 2:
            continue
        w = [1 / t ** 2 for _, t in pts]
        sw = sum(w)
        mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
        my = sum(wi * y for wi, (_, y) in zip(w, pts)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
        slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, pts)) / sxx if sxx else 0.0
        slope = max(slope, 1e-15)
        alpha = max(my - slope * mx, 0.0)
        fits[(name, n)] = (alpha, 1 / slope)
    return fits


CPU = GPU("CPU rank (calibrated)", 0.0, {"fp32": 0.0}, 10e9, Link(1e9, 1e-3), Link(1e9, 1e-3), 10e9, 1,
          "calibrated from this machine's records")


def _base_arch(arch: str) -> str:
    """The dense architecture a record's model is built on: ``gpt_moe`` -> ``gpt``."""
    return arch.removesuffix("_moe")


def _model_speed(records: list[dict], base: Cluster, arch: str | None, ranks: int,
                 calibration: Iterable[str]) -> float | None:
    """The compute efficiency of ``arch`` with ``ranks`` ranks on this machine: the fraction of the
    matmul rate that the ``calibration`` cells (plain data parallelism) of that model reach once
    their predicted communication is taken off, from the cells with the rank count nearest
    ``ranks`` (how many ranks share a core changes it: four ranks on two cores lose more to
    switching than two). An MoE model's speed is its dense base's (``gpt_moe``: the GPT's cells).
    None when no such cell exists."""
    cells = [r for r in records if r["strategy"] in calibration and r.get("model")
             and r.get("metrics", {}).get("step_time_s_median")
             and (arch is None or _base_arch(r["model"]["arch"]) == _base_arch(arch))]
    if not cells:
        return None
    nearest = min({r["world_size"] for r in cells}, key=lambda w: (abs(w - ranks), w))
    ratios = []
    for rec in cells:
        if rec["world_size"] != nearest:
            continue
        est = estimate_record(rec, base)
        spent = rec["metrics"]["step_time_s_median"] - est.step_time_s + est.times["compute_s"]
        if spent > 0:
            ratios.append(est.times["compute_s"] / spent)
    return statistics.median(ratios) if ratios else None


def with_measured_speed(cl: Cluster, records: list[dict], arch: str | None = None,
                        calibration: Iterable[str] = (Strategy.DDP,)) -> Cluster:
    """``cl`` with the compute efficiency its ``calibration`` cells measured (the model's speed on
    this machine, :func:`_model_speed`) instead of an assumed one: how a GPU's planner is calibrated
    from a one-GPU benchmark run. One line of error when the records hold no such cell."""
    speed = _model_speed(records, replace(cl, efficiency=1.0), arch, cl.gpus, tuple(calibration))
    if speed is None:
        raise UsageError(f"no {'/'.join(calibration)} cell{' of the ' + arch if arch else ''} among the records "
                         "to measure the model's speed")
    return replace(cl, efficiency=speed)


def cpu_cluster(records: list[dict], ranks: int, arch: str | None = None,
                calibration: Iterable[str] = (Strategy.DDP,)) -> Cluster:
    """This machine as a cluster of ``ranks`` CPU ranks, calibrated from its own records:

    * collectives' alpha/beta from the bandwidth sweeps (:func:`fit_collectives`);
    * the matmul FLOP/s of one core from the matrix's measured ``peak_flops_per_s`` (each rank
      measured its share of the cores: x ranks / cores);
    * the model's speed: the compute efficiency (the fraction of that matmul rate a step reaches:
      per-operation Python and small kernels keep it low for the tiny models) of the
      ``calibration`` cells of ``arch`` (any model when None or unrecorded) at the nearest rank
      count (:func:`_model_speed`);
    * each other strategy's framework overhead (hooks, DTensor dispatch, DeepSpeed's
      bookkeeping), in seconds per second of its predicted communication (context and expert
      parallelism: of its compute, :data:`OVERHEAD_BASIS`), from its cells (each against its own
      model's speed);
    * no overlap (gloo and compute share the cores); memory unbounded (the machine's RAM is not
      what the matrix tests)."""
    import os

    fits = fit_collectives(records)
    if not fits:
        raise UsageError("no bandwidth sweeps among the records: run distributed_benchmarks.py --bandwidth "
                         "(or 04-nccl-operations/bandwidth_test.py) to calibrate the collectives")
    calibration = tuple(calibration)
    train = [r for r in records if r.get("model") and r.get("metrics", {}).get("step_time_s_median")]
    cores = next((r["machine"].get("cpu_cores") for r in records if r.get("machine", {}).get("cpu_cores")),
                 os.cpu_count() or 1)
    per_core = [r["metrics"]["peak_flops_per_s"] * min(r["world_size"], cores) / cores
                for r in train if r["metrics"].get("peak_flops_per_s")]
    peak = statistics.median(per_core) if per_core else 20e9
    gpu = replace(CPU, memory_bytes=math.inf, peak_flops={"fp32": peak, "bf16": peak})
    base = Cluster(gpu, ranks, ranks, efficiency=1.0, usable_memory=1.0, overlap=False, collectives=fits,
                   cores=cores)
    speed = _model_speed(train, base, arch, ranks, calibration) or _model_speed(train, base, None, ranks, calibration)
    speeds: dict[tuple, float] = {}  # each model's speed at each rank count, measured once
    extra: dict[str, list[float]] = {}
    for rec in train:
        if rec["strategy"] in calibration:
            continue
        key = (_base_arch(rec["model"]["arch"]), rec["world_size"])
        if key not in speeds:
            speeds[key] = _model_speed(train, base, *key, calibration) or speed or 0.1
        own = speeds[key]
        try:
            est = estimate_record(rec, replace(base, efficiency=own))
        except ValueError:
            continue
        basis = est.times[overhead_basis(rec["strategy"])]
        if basis:
            unexplained = rec["metrics"]["step_time_s_median"] - est.step_time_s
            extra.setdefault(rec["strategy"], []).append(unexplained / basis)
    overheads = {k: max(0.0, statistics.median(v)) for k, v in extra.items()}
    return replace(base, efficiency=speed or 0.1, overheads=overheads)


# ----------------------------------------------------------------------------------------------
# Validation: every matrix cell, predicted vs measured
# ----------------------------------------------------------------------------------------------

# A benchmark strategy -> the planner's estimate of it (layout fixed by the record, not chosen).
def plan_of_record(record: dict) -> Plan:
    """The :class:`Plan` a benchmark record ran: fp32 AdamW, its model and global batch, no AC, a
    data-parallel rank's share of the batch as one micro-batch (the pipeline: its micro-batches;
    context parallelism: a ring's whole share, 1/cp of each of its sequences on each rank)."""
    cfg = compare.config_of_record(record)
    config = record.get("config", {})
    batch = int(config["global_batch_size"])
    knobs = compare.knobs_of_record(record)
    dp = record["world_size"]
    if record["strategy"] in (Strategy.TP, Strategy.TP_SP) or record["strategy"].startswith("pp_"):
        dp = 1
    elif record["strategy"] == Strategy.FSDP_TP_2D:
        dp = record["world_size"] // int(knobs.get("tp", 2))
    elif record["strategy"] == Strategy.CP:
        dp = record["world_size"] // int(knobs.get("cp", record["world_size"]))
    return Plan(cfg, global_batch=batch, micro_batch=max(1, batch // dp), precision="fp32", optimizer="adamw",
                microbatches=knobs.get("microbatches"))


def estimate_record(record: dict, cl: Cluster) -> Estimate:
    """The planner's :class:`Estimate` of the cell a record measured, with the record's own layout
    (mesh, micro-batches, CP ring size, EP group size and, for expert parallelism, the routing the
    record counted) rather than the planner's choice."""
    plan = plan_of_record(record)
    strategy = record["strategy"]
    knobs = compare.knobs_of_record(record)
    n = record["world_size"]
    cl = replace(cl, gpus=n, gpus_per_node=n)
    if strategy in (Strategy.DDP, Strategy.DDP_FROM_SCRATCH, Strategy.FSDP_NO_SHARD):
        est = _dp_family(strategy, plan, cl)
    elif strategy == Strategy.ZERO0:
        est = _dp_family(Strategy.DDP, plan, cl)
    elif strategy in (Strategy.FSDP_HYBRID_SHARD, Strategy.HSDP):
        est = _dp_family(Strategy.FSDP_HYBRID_SHARD, plan, replace(cl, gpus_per_node=int(knobs.get("shard", 2))))
    elif strategy in (Strategy.TP, Strategy.TP_SP):
        est = _tp_fsdp(plan, cl, n, sp=strategy == Strategy.TP_SP)
    elif strategy == Strategy.FSDP_TP_2D:
        est = _tp_fsdp(plan, cl, int(knobs.get("tp", 2)))
    elif strategy.startswith("pp_"):
        est = _pipeline(plan, cl, strategy[3:], n * 1, stages_per_rank=int(knobs.get("stages_per_rank", 2)))
    elif strategy == Strategy.CP:
        est = _context_parallel(plan, cl, int(knobs.get("cp", n)))
    elif strategy == Strategy.EP:  # the record's routing: the rows each rank sent and received
        est = _expert_parallel(plan, cl, int(knobs.get("ep", n)), knobs.get("routing"))
    elif strategy in PLANNED:
        est = _dp_family(strategy, plan, cl)
    else:
        raise ValueError(f"no planner model for {strategy!r}")
    est.name = strategy
    return with_overhead(est, cl, strategy)


def validate(records: list[dict], cl: Cluster | None = None,
             calibration: Iterable[str] = (Strategy.DDP,)) -> list[dict]:
    """Predicted vs measured for every training cell of a benchmark results file (the CPU matrix):
    model-state bytes (theory's busiest rank: must be equal), activations (MemTracker's, from the
    record's ``peak_memory_by_category_per_rank``: their high-water mark in the step where the record
    has it, ``activations_high_water``; in records made before the harness noted it, their size at
    the step's peak), the peak itself (MemTracker's total),
    and the step time on a calibrated cluster. One row per cell with relative errors (``*_error``:
    predicted / measured - 1); ``calibration`` is True on the cells the time model was fitted to.

    Without ``cl`` the time is predicted out of sample: each architecture's cells on
    :func:`cpu_cluster` calibrated with that model's own ``calibration`` cells (its speed on this
    machine, the way one measures a model before planning it) and every other strategy's framework
    overhead from the *other* architecture's cells (with one architecture: the other world
    size's). A strategy with cells of one architecture only (context and expert parallelism run the
    GPT alone) has no other architecture to learn from: its overhead comes from its own cells at the
    other world size, still out of sample. The mixture-of-experts GPT counts as the GPT (its speed
    from the GPT's calibration cells: :func:`_model_speed`)."""
    calibration = tuple(calibration)
    rows = []
    if cl is None:
        cells = [r for r in records if r.get("model")]
        by_arch = len({_base_arch(r["model"]["arch"]) for r in cells}) > 1
        key = (lambda r: _base_arch(r["model"]["arch"])) if by_arch else (lambda r: r["world_size"])
        measured = [r for r in cells if (r.get("metrics") or {}).get("step_time_s_median")]
        one_arch = {s for s in {r["strategy"] for r in measured}
                    if len({key(r) for r in measured if r["strategy"] == s}) == 1} if by_arch else set()
        for group in sorted({key(r) for r in cells}):
            mine = [r for r in cells if key(r) == group]
            known = [r for r in records if not r.get("model") or key(r) != group or r["strategy"] in calibration]
            for arch, ranks in sorted({(r["model"]["arch"], r["world_size"]) for r in mine}):
                own_other_size = [r for r in mine if r["strategy"] in one_arch and r["world_size"] != ranks]
                fitted = cpu_cluster(known + own_other_size, ranks, arch, calibration)
                rows += validate([r for r in mine if (r["model"]["arch"], r["world_size"]) == (arch, ranks)],
                                 fitted, calibration)
        return rows
    for rec in records:
        metrics = rec.get("metrics") or {}
        if rec.get("status", "ok") != "ok" or not metrics.get("step_time_s_median") or not rec.get("model"):
            continue
        try:
            est = estimate_record(rec, cl)
        except ValueError:
            continue
        pred = predictors.busiest_rank_prediction(rec["strategy"], compare.config_of_record(rec), rec["world_size"],
                                              int(rec["config"]["global_batch_size"]), compare.knobs_of_record(rec))
        rank = est.layout.get("rank", pred["rank"])
        if rank != pred["rank"]:  # the planner's deciding rank (a pipeline's), compared there
            full = compare.predict_record(rec)["state_per_rank"][rank]
            pred = {**pred, "state": full}
        state_measured = sum(metrics["model_state_bytes_per_rank"][rank].values())
        by_cat = (metrics.get("peak_memory_by_category_per_rank") or [None] * (rank + 1))[rank]
        row = {"strategy": rec["strategy"], "world_size": rec["world_size"], "arch": rec["model"]["arch"],
               "rank": rank, "state_predicted": sum(pred["state"].values()), "state_measured": state_measured,
               "step_predicted_s": est.step_time_s, "step_measured_s": metrics["step_time_s_median"],
               "calibration": rec["strategy"] in calibration}
        if by_cat:
            row.update(activations_predicted=est.memory_bytes["activations"],
                       activations_measured=by_cat.get("activations_high_water", by_cat["activations"]),
                       peak_predicted=est.memory_bytes["peak"], peak_measured=by_cat["total"],
                       temporaries_predicted=est.memory_bytes["temporaries"],
                       temporaries_measured=by_cat["temporaries"])
        for key in ("state", "activations", "peak", "step"):
            p, m = row.get(f"{key}_predicted") or row.get(f"{key}_predicted_s"), \
                row.get(f"{key}_measured") or row.get(f"{key}_measured_s")
            row[f"{key}_error"] = p / m - 1 if p is not None and m else None
        rows.append(row)
    return rows


def validation_summary(rows: list[dict]) -> dict:
    """Median and worst absolute relative error of each quantity over the cells (the step time over
    the predicted cells only: not those the time model was calibrated on)."""
    out = {}
    for key in ("state", "activations", "peak", "step"):
        errs = [abs(r[f"{key}_error"]) for r in rows if r.get(f"{key}_error") is not None
                and not (key == "step" and r.get("calibration"))]
        out[key] = {"cells": len(errs), "median": statistics.median(errs) if errs else None,
                    "worst": max(errs) if errs else None}
    return out


# The bounds on a prediction's relative error: model state exact, activations 10%, the peak
# 15%, the step time 50% in the worst cell (and 20% in the median, a bound on the summary).
VALIDATION_BOUNDS = {"state": 0.0, "activations": 0.10, "peak": 0.15, "step": 0.50}


def validation_bounds_text() -> str:
    """:data:`VALIDATION_BOUNDS` in words: "model state exact, activations 10%, peak 15%, step time 50%"."""
    names = {"state": "model state", "step": "step time"}
    return ", ".join(f"{names.get(key, key)} {f'{100 * bound:g}%' if bound else 'exact'}"
                     for key, bound in VALIDATION_BOUNDS.items())


def validation_misses(row: dict) -> list[str]:
    """The quantities of one validation row whose error leaves :data:`VALIDATION_BOUNDS` (the step
    time of a calibration cell is not a prediction)."""
    return [key for key, bound in VALIDATION_BOUNDS.items()
            if row.get(f"{key}_error") is not None and abs(row[f"{key}_error"]) > bound
            and not (key == "step" and row.get("calibration"))]


def validation_table(rows: list[dict], only_misses: bool = False) -> str:
    """The per-cell errors as a Markdown table (MiB, ms, signed %) and the summary; with
    ``only_misses`` only the cells with an error outside :data:`VALIDATION_BOUNDS`."""
    def pct(v):
        return "-" if v is None else f"{100 * v:+.1f}%"

    def mib(v):
        return "-" if v is None else f"{v / 2 ** 20:.3f}"

    lines = ["| strategy | model | ranks | model state MiB pred / meas | activations MiB pred / meas (err) | "
             "peak MiB pred / meas (err) | step ms pred / meas (err) |", "|---|---|---:|---|---|---|---|"]
    shown = [r for r in rows if validation_misses(r)] if only_misses else rows
    for r in shown:
        lines.append(f"| {r['strategy']} | {r['arch']} | {r['world_size']} | {mib(r['state_predicted'])} / "
                     f"{mib(r['state_measured'])} | {mib(r.get('activations_predicted'))} / "
                     f"{mib(r.get('activations_measured'))} ({pct(r.get('activations_error'))}) | "
                     f"{mib(r.get('peak_predicted'))} / {mib(r.get('peak_measured'))} ({pct(r.get('peak_error'))}) | "
                     f"{1e3 * r['step_predicted_s']:.1f} / {1e3 * r['step_measured_s']:.1f} "
                     + ("(calibration) |" if r.get("calibration") else f"({pct(r['step_error'])}) |"))
    s = validation_summary(rows)
    lines.append("")
    lines.append("; ".join(f"{k}: median {100 * v['median']:.1f}%, worst {100 * v['worst']:.1f}% ({v['cells']} cells"
                           + (", the calibration cells left out" if k == "step" else "") + ")"
                           for k, v in s.items() if v["cells"]))
    if only_misses:
        lines.append(f"{len(shown)} of {len(rows)} cells outside the bounds ({validation_bounds_text()})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Reports: terminal table, JSON, plot
# ----------------------------------------------------------------------------------------------


def describe(plan: Plan, cl: Cluster) -> str:
    """The plan and the cluster in one line (an MoE says its experts and its active parameters)."""
    cfg = plan.model
    shapes = theory.param_shapes(cfg)
    psi = sum(math.prod(s) for s in shapes.values())
    experts = ""
    if is_moe(cfg):
        dense, per_expert = theory.moe_param_split(shapes, cfg.num_experts)
        active = dense + cfg.top_k * per_expert[0]
        experts = f", {cfg.num_experts} experts top-{cfg.top_k}: {active / 1e9:.2f}B active"
    return (f"{cfg.arch} {psi / 1e9:.2f}B params ({cfg.n_layer} layers, width {cfg.n_embd}{experts}), "
            f"seq {cfg.seq_len}, "
            f"global batch {plan.global_batch} ({plan.tokens_per_step:,} tokens), micro-batch {plan.micro_batch}, "
            f"{plan.precision}, {plan.optimizer}, AC {plan.ac} | {cl.gpus} x {cl.gpu.name} "
            f"({cl.nodes} node{'s' if cl.nodes > 1 else ''} of {cl.gpus_per_node})")


def _layout_text(layout: dict) -> str:
    """``dp=8 tp=2 micro=1 accum=2``: the sizes that matter (1s left out, dp always shown)."""
    names = {"dp": "dp", "shard": "shard", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "micro_batch": "micro",
             "microbatches": "mbs", "accumulation": "accum"}
    return " ".join(f"{short}={layout[key]}" for key, short in names.items()
                    if key in layout and (key in ("dp", "micro_batch") or layout[key] not in (None, 1)))


def format_report(plan: Plan, cl: Cluster, estimates: list[Estimate], rec: Recommendation) -> str:
    """The terminal table and the recommendation."""
    big = any(e.valid and e.memory_bytes["peak"] >= GiB for e in estimates)
    unit, unit_name = (GiB, "GiB") if big else (2 ** 20, "MiB")
    if math.isfinite(cl.capacity_bytes):
        capacity = (f"usable memory per GPU {cl.capacity_bytes / GiB:.1f} GiB ({cl.usable_memory:.0%} of "
                    f"{cl.gpu.memory_bytes / GiB:.1f}); ")
    else:
        capacity = "memory not bounded; "
    rate = compute_rate(cl, plan)
    lines = [describe(plan, cl),
             capacity + f"compute {rate / 1e12:,.3g} TFLOP/s per GPU ({cl.efficiency:.0%} of the peak"
             + (", calibrated" if cl.cores else "") + ")",
             "",
             f"{'strategy':<20} {'layout':<30} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'temp':>7} "
             f"{'peak':>7} {'fits':>4} {'step s':>8} {'tok/s/GPU':>10}",
             f"{'':<20} {'':<30} {unit_name + ' per GPU':^47}"]
    for e in estimates:
        if not e.valid:
            lines.append(f"{e.name:<20} cannot run: {e.note}")
            continue
        m = e.memory_bytes
        lines.append(f"{e.name:<20} {_layout_text(e.layout):<30} " +
                     " ".join(f"{m[p] / unit:7.2f}" for p in (*PARTS, "peak")) +
                     f" {'yes' if e.fits else 'no':>4} {e.step_time_s:8.3f} {e.tokens_per_s_per_gpu:10,.0f}")
    lines.append("")
    if rec.best:
        b = rec.best
        lines.append(f"recommended: {b.name} ({_layout_text(b.layout)}): "
                     f"{b.memory_bytes['peak'] / unit:.1f} {unit_name} "
                     f"per GPU, step {b.step_time_s:.3f} s, {b.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    elif not any(e.valid for e in estimates):  # "use more GPUs" may be false (512 sequences do not split over 6)
        lines.append(f"recommended: none: no strategy can run this job on {cl.gpus} GPUs (reasons below)")
    else:
        lines.append("recommended: nothing fits; use more GPUs, activation checkpointing, a smaller micro-batch"
                     + (" or --offload" if any(e.offload and e.fits for e in estimates) else ""))
    for name, why in rec.reasons.items():
        lines.append(f"  {name:<20} {why}")
    return "\n".join(lines)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def report_json(plan: Plan, cl: Cluster, estimates: list[Estimate], rec: Recommendation) -> dict:
    """``{"plan", "cluster", "strategies": [Estimate.to_json()...], "recommended", "reasons"}``, with
    infinities and NaNs (configurations that cannot run) as null."""
    cfg = plan.model
    return _clean({
        "plan": {"model": {"arch": cfg.arch, **cfg.to_dict()}, "global_batch": plan.global_batch,
                 "micro_batch": plan.micro_batch, "precision": plan.precision, "optimizer": plan.optimizer,
                 "activation_checkpointing": plan.ac, "offload": plan.offload},
        "cluster": {"gpu": cl.gpu.name, "gpus": cl.gpus, "gpus_per_node": cl.gpus_per_node,
                    "memory_bytes": cl.gpu.memory_bytes, "usable_bytes": cl.capacity_bytes,
                    "efficiency": cl.efficiency, "source": cl.gpu.source},
        "strategies": [e.to_json() for e in estimates],
        "recommended": rec.best.name if rec.best else None,
        "reasons": rec.reasons,
    })


def plot_estimates(estimates: list[Estimate], cl: Cluster, path=None, title: str = ""):
    """Two panels: memory per GPU per strategy (stacked parts) against the GPU's usable capacity,
    and predicted tokens/s per GPU (configurations that do not fit in gray). Saved to ``path`` when
    given; the matplotlib ``Figure`` is returned either way (a notebook displays it)."""
    from matplotlib.figure import Figure

    shown = [e for e in estimates if e.valid]
    names = [e.name for e in shown]
    fig = Figure(figsize=(max(8, 0.7 * len(shown)), 8))
    top, bottom = fig.subplots(2, 1, sharex=True)
    bottom_acc = [0.0] * len(shown)
    for part in PARTS:
        values = [e.memory_bytes[part] / GiB for e in shown]
        top.bar(names, values, bottom=bottom_acc, label=part)
        bottom_acc = [a + v for a, v in zip(bottom_acc, values)]
    if math.isfinite(cl.capacity_bytes):
        top.axhline(cl.capacity_bytes / GiB, color="black", linestyle="--", label=f"usable ({cl.gpu.name})")
    top.set_ylabel("GiB per GPU")
    top.legend(fontsize=8, ncol=3)
    top.set_title(title, fontsize=8)
    bottom.bar(names, [e.tokens_per_s_per_gpu for e in shown],
               hatch=None, color=["tab:green" if e.fits else "lightgray" for e in shown])
    bottom.set_ylabel("predicted tokens/s per GPU\n(gray: does not fit)")
    bottom.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
