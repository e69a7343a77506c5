"""The names of the strategies: one vocabulary for the harness's records, the formulas, the
benchmarks and the planner.

:class:`Strategy` is a :class:`enum.StrEnum`, so a member *is* its name: it compares equal to the
string a record stores (``Strategy.FSDP_TP_2D == "fsdp_tp_2d"``), prints and serializes as that
string, and a mistyped name fails where it is built (``Strategy("fsdp_tpp")`` raises ValueError).
The members are in the order plots and tables show them.

Two subsets, each in its own order:

* :data:`MEASURED`: every strategy the benchmark matrix measures and :mod:`distkit.predictors`
  predicts, one record per cell (``strategy`` field of ``*/records/*.jsonl``);
* :data:`PLANNED`: the planner's candidates (``benchmarks/plan.py``), in the order its report lists
  them. Two of them are the planner's own: ``fsdp_tp`` is FSDP x TP with the TP size searched (the
  best layout is a ``fsdp_tp_2d`` cell when TP is smaller than the GPUs, a ``tp`` cell when equal),
  ``lora_fsdp`` is LoRA adapters over FSDP (chapter 02's ``fsdp_lora.py``).

A record may also name a measurement that is not a strategy (chapter 04's ``bandwidth_*``, the
activation-checkpointing variants ``ddp_ac_*``, the parity run's ``one_process``): those stay plain
strings.
"""
from __future__ import annotations

from enum import StrEnum


class Strategy(StrEnum):
    """A distributed-training strategy, by the name records, formulas and the planner use."""

    DDP = "ddp"
    DDP_FROM_SCRATCH = "ddp_from_scratch"
    FSDP_NO_SHARD = "fsdp_no_shard"
    FSDP_SHARD_GRAD_OP = "fsdp_shard_grad_op"
    FSDP_FULL_SHARD = "fsdp_full_shard"
    FSDP_HYBRID_SHARD = "fsdp_hybrid_shard"
    HSDP = "hsdp"
    ZERO0 = "zero0"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    ZERO3_OFFLOAD = "zero3_offload"
    TP = "tp"
    TP_SP = "tp_sp"
    PP_GPIPE = "pp_gpipe"
    PP_1F1B = "pp_1f1b"
    PP_INTERLEAVED_1F1B = "pp_interleaved_1f1b"
    FSDP_TP_2D = "fsdp_tp_2d"
    FSDP_TP = "fsdp_tp"
    CP = "cp"
    EP = "ep"
    LORA_FSDP = "lora_fsdp"


S = Strategy

# Every strategy the benchmark matrix measures, in the order plots show them.
MEASURED: tuple[Strategy, ...] = (
    S.DDP, S.DDP_FROM_SCRATCH, S.FSDP_NO_SHARD, S.FSDP_SHARD_GRAD_OP, S.FSDP_FULL_SHARD, S.FSDP_HYBRID_SHARD,
    S.HSDP, S.ZERO0, S.ZERO1, S.ZERO2, S.ZERO3, S.ZERO3_OFFLOAD, S.TP, S.TP_SP, S.PP_GPIPE, S.PP_1F1B,
    S.PP_INTERLEAVED_1F1B, S.FSDP_TP_2D, S.CP, S.EP)

# The planner's candidates, in the order its report lists them.
PLANNED: tuple[Strategy, ...] = (
    S.DDP, S.ZERO1, S.ZERO2, S.ZERO3, S.ZERO3_OFFLOAD, S.FSDP_SHARD_GRAD_OP, S.FSDP_FULL_SHARD,
    S.FSDP_HYBRID_SHARD, S.FSDP_TP, S.PP_GPIPE, S.PP_1F1B, S.PP_INTERLEAVED_1F1B, S.CP, S.EP, S.LORA_FSDP)

del S
