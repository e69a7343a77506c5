"""Does it fit, which strategy, how fast: the chapters' formulas turned into a planner.

For a model (a :mod:`distkit.models` config), a batch, a precision and a cluster of GPUs, every
strategy of :data:`distkit.strategies.PLANNED` gets an :class:`Estimate`: memory per GPU in five
parts (parameters, gradients, optimizer state, activations, temporaries), whether it fits, a step
time (compute + exposed communication + pipeline bubble + optimizer step) and tokens/s per GPU.
:func:`recommend` picks the fastest configuration that fits, or, when others are predicted within the
step time's median error of it (:data:`STEP_MEDIAN_ERROR`, 20%), the simplest of those (DDP <
ZeRO/FSDP < TP < PP < CP), and says in one line why each other one lost.

Every byte count comes from the modules the chapters print their predictions from and the
benchmarks measure against: model state from :func:`~distkit.predictors.busiest_rank_prediction`
(the fp32 AdamW bytes the CPU matrix measures to the byte, converted to the plan's precision and
optimizer the ZeRO paper's way), collectives from the same call, activations from
:func:`~distkit.theory.activation_bytes_per_layer`, FLOPs from
:func:`~distkit.theory.training_flops_per_token`, the bubble from
:func:`~distkit.theory.pipeline_bubble`. What the planner adds is *time* and *placement*:

* compute = training FLOPs per GPU x the recompute of activation checkpointing / (achievable
  fraction x peak FLOP/s of the precision), the fraction fitted on torchtitan's published H100 runs
  (:data:`FITTED_EFFICIENCY`), torch.compile and Float8 speeding up the FLOPs outside attention, the
  linear layers at the fraction of the large-matrix rate their GEMMs reach at their size (from XLA's
  measured H100 table: :func:`~.gemm.matmul_factor`) (:func:`~.costs.compute_seconds`);
* communication = per collective call ``alpha + bus_bytes / beta`` (alpha-beta, Hockney), beta
  the intra-node link when the collective's group fits in a node, else the network ports of its GPUs
  in a node together (a ring across nodes), minus
  what the strategy can hide behind compute (DDP and ZeRO-1/2 overlap their gradient reduction with
  backward, FSDP and ZeRO-3 prefetch their gathers under forward and backward, tensor parallelism
  and the pipeline's sends sit on the critical path, but with Async TP what of TP's collectives its
  micro-pipeline hides under their matmuls, ZeRO-1/2's weight gather follows the step);
* the pipeline stretches compute by 1 / (1 - bubble).

GPU figures (:data:`GPUS`) are datasheet numbers (dense, no sparsity), NCCL's measured per-port
network bandwidth and stated assumptions for the links inside a node, labelled as such;
:func:`cpu_cluster` calibrates a CPU "cluster" from the
records this repository measures (collective alpha/beta from the bandwidth sweep, matmul FLOP/s and
a compute efficiency from the benchmark matrix), and :func:`validate` puts every prediction next to
the measurement of every matrix cell.

The modules, each importing only those above it:

* :mod:`.inputs`: GPUs, links, the :class:`Cluster`, the job (:class:`Plan`) and the limits of what
  is planned (:func:`check_job`), resized inputs;
* :mod:`.hf_config`: a model from a Hugging Face ``config.json`` (:func:`read_hf_config`);
* :mod:`.gemm`: a GEMM's time by its shape, and the fraction of the large-matrix rate a job's
  linear layers reach;
* :mod:`.costs`: memory in five parts, time per collective and of compute;
* :mod:`.layouts`: one :class:`Estimate` per layout of each family of strategies (data parallel, TP x
  FSDP, the pipelines), :mod:`.layouts_cp_ep` context and expert parallelism;
* :mod:`.nd_ep`: expert parallelism as an N-D axis (ep over dp_shard x cp ranks: experts' state,
  FSDP's gathers, the all-to-alls);
* :mod:`.dims`: N-D layouts (torchtitan's ``ParallelDims``: named axes, validated once, parsed from
  ``--layout``, enumerated); :mod:`.async_tp`: what Async TP hides of TP's collectives;
  :mod:`.nd`: the estimate of one, and the search over them;
* :mod:`.published`: torchtitan's published GPU runs as literal rows, calibration and validation
  apart; :mod:`.published_check`: the efficiency fitted on the first, every row predicted;
* :mod:`.choose`: overheads, the best layout per strategy, the recommendation, a record's estimate;
* :mod:`.calibration`: a CPU cluster calibrated from this machine's records;
* :mod:`.validation`: every matrix cell, predicted vs measured;
* :mod:`.report`: table, JSON and plot;
* :mod:`.decision`: the top README's decision guide, each row planned.

What ``benchmarks/plan.py``, the notebooks and the tests use is imported here.
"""
from .async_tp import layout_problem as async_tp_problem
from .calibration import CPU, cpu_cluster, fit_collectives, read_matrix, with_measured_speed
from .choose import (
    SEARCHED,
    STEP_MEDIAN_ERROR,
    Recommendation,
    estimate,
    estimate_all,
    estimate_record,
    plan_of_record,
    recommend,
    simplicity,
    with_overhead,
)
from .costs import PARTS, activation_bytes, collective_time, compute_rate, state_bytes
from .decision import decision_matrix
from .dims import AXES, SCHEDULES, ParallelDims, check_dims, enumerate_dims, fewest_batch_ranks, parse_layout
from .gemm import matmul_factor
from .hf_config import DEFAULT_SEQ_LEN as HF_DEFAULT_SEQ_LEN
from .hf_config import MODEL_TYPES as HF_MODEL_TYPES
from .hf_config import read_hf_config, uncounted_note, with_overrides
from .inputs import (
    AC_MODES,
    ATTENTION,
    FITTED_EFFICIENCY,
    FITTED_RESERVE,
    FLOAT8_RECIPES,
    GPU,
    GPU_NAME_PARTS,
    GPUS,
    MAX_GPUS,
    MAX_SEQUENCES,
    MIN_SEQ_LEN,
    OPTIMIZERS,
    PRECISIONS,
    Cluster,
    GiB,
    Link,
    Plan,
    check_job,
    check_whole_nodes,
    cluster,
    gpu_type,
    limits_text,
    override_cluster,
    with_params,
)
from .layouts import Estimate
from .nd import ND, estimate_dims, estimate_nd, head_bytes
from .published_check import published_table
from .report import describe, format_report, plot_estimates, report_json
from .validation import (
    VALIDATION_BOUNDS,
    validate,
    validation_bounds_text,
    validation_misses,
    validation_summary,
    validation_table,
)

__all__ = ["AXES", "ND", "SCHEDULES", "SEARCHED", "ParallelDims", "check_dims", "enumerate_dims", "estimate_dims",
           "estimate_nd", "fewest_batch_ranks", "head_bytes", "parse_layout", "published_table", "async_tp_problem",
           "matmul_factor",
           "AC_MODES", "ATTENTION", "FITTED_EFFICIENCY", "FITTED_RESERVE", "FLOAT8_RECIPES",
           "CPU", "Cluster", "Estimate", "GPU", "GPUS", "GPU_NAME_PARTS", "GiB", "HF_DEFAULT_SEQ_LEN",
           "HF_MODEL_TYPES", "Link", "MAX_GPUS", "MAX_SEQUENCES", "MIN_SEQ_LEN", "OPTIMIZERS", "PARTS", "PRECISIONS",
           "Plan", "Recommendation", "STEP_MEDIAN_ERROR", "VALIDATION_BOUNDS", "activation_bytes", "check_job",
           "check_whole_nodes", "cluster", "collective_time", "compute_rate", "cpu_cluster", "decision_matrix",
           "describe", "estimate", "estimate_all", "estimate_record", "fit_collectives", "format_report", "gpu_type",
           "limits_text", "override_cluster", "plan_of_record", "plot_estimates", "read_hf_config", "read_matrix",
           "recommend", "report_json", "simplicity", "state_bytes", "uncounted_note", "validate",
           "validation_bounds_text", "validation_misses", "validation_summary", "validation_table",
           "with_measured_speed", "with_overhead", "with_overrides", "with_params"]
