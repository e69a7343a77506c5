"""The top README's decision guide as numbers: each row of its matrix (a model on some GPUs and the
strategy the guide names) planned, with the planner's pick, its predicted step and memory, the
runner-up, and where the two disagree, one line on why (:func:`decision_matrix`,
``benchmarks/plan.py --decision-matrix``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import theory
from ..models import GPTConfig, LlamaModelConfig, model_config
from .choose import estimate_all, recommend, simplicity
from .inputs import GiB, Plan, cluster
from .layouts import Estimate
from .nd import ND

# Every row on H100 80GB GPUs, 8 to a node (no row of the guide implies another), bf16 mixed precision,
# AdamW, full activation checkpointing (what a large model's recipe turns on first), and steps of 1M
# tokens (2^20) of the model's own sequence length, rounded up to split over the GPUs.
GPU, TOKENS, AC = "h100", 2 ** 20, "full"


@dataclass(frozen=True)
class Row:
    """One row of the guide: ``name``, ``gpus``, the guide's ``guide`` pick and the planner strategies
    that are that pick (``agrees``); ``model`` None where the planner cannot express the model
    (``note`` then says why); ``lora``: the job is fine-tuning with adapters."""

    name: str
    gpus: int
    guide: str
    agrees: tuple
    model: object = None
    lora: bool = False
    note: str = ""


# GPT-2 XL as the planner's GPT (learned positions, LayerNorm, biases, GELU MLP): its head is not tied
# to the embedding here, so it counts 1.64B parameters, 80M more than the released 1.56B.
GPT2_XL = GPTConfig(vocab_size=50257, seq_len=1024, n_layer=48, n_embd=1600, n_head=25)
# LLaMA (2023) 7B: 32 blocks of width 4096, 32 heads without grouped keys, MLP 11008, 32k vocabulary.
LLAMA_7B = LlamaModelConfig(vocab_size=32000, seq_len=2048, n_layer=32, n_embd=4096, n_head=32, n_kv_head=32,
                            intermediate_size=11008)
SHARDED = ("fsdp_full_shard", "fsdp_hybrid_shard", "zero3")  # one sharding, three names (a node: the same)


ROWS = (
    Row("ResNet-50", 8, "DDP", ("ddp",),
        note="not expressible: a CNN, and the planner's formulas are a decoder's (attention, MLP, LM head); "
             "by hand its 25.6M parameters hold 16 B x 25.6M = 0.41 GB of state, which fits any GPU: DDP stands"),
    Row("GPT-2 1.5B", 4, "FSDP FULL_SHARD", SHARDED, GPT2_XL),
    Row("LLaMA-7B", 8, "ZeRO-3", SHARDED, LLAMA_7B),
    Row("LLaMA-70B", 64, "3D (TP x PP x DP)", (ND,), model_config("llama", "llama-3.1-70b")),
    Row("LLM fine-tuning (Llama 3.1 8B)", 8, "FSDP + LoRA", ("lora_fsdp",), model_config("llama", "llama-3.1-8b"),
        lora=True),
)


def plan_of_row(row: Row) -> Plan:
    """The job a row plans: :data:`TOKENS` per step of the model's sequences, a batch that splits over
    the GPUs, bf16 AdamW, :data:`AC` activation checkpointing."""
    batch = math.ceil(max(1, round(TOKENS / row.model.seq_len)) / row.gpus) * row.gpus
    return Plan(row.model, global_batch=batch, ac=AC)


def plan_row(row: Row) -> dict:
    """One row planned: ``pick`` and ``runner_up`` (:class:`Estimate`), the recommendation's reasons
    and tie, and ``agrees``. A LoRA row picks the LoRA configuration (the job trains adapters) and
    its runner-up is full training's recommendation; the others pick what :func:`recommend` picks and
    their runner-up is the fastest other configuration that fits."""
    if row.model is None:
        return {"row": row}
    plan, cl = plan_of_row(row), cluster(GPU, row.gpus)
    estimates = estimate_all(plan, cl)
    rec = recommend(estimates, cl)
    if row.lora:
        pick = next(e for e in estimates if e.lora)
        runner_up = rec.best
    else:
        pick = rec.best
        others = [e for e in estimates if e.valid and e.fits and not e.lora and not e.offload and e is not pick]
        runner_up = min(others, key=lambda e: e.step_time_s) if others else None
    return {"row": row, "plan": plan, "cluster": cl, "estimates": estimates, "rec": rec, "pick": pick,
            "runner_up": runner_up, "agrees": verdict(row, pick, rec)}


def verdict(row: Row, pick: Estimate | None, rec) -> str:
    """``yes``: the planner picks the guide's strategy; ``tie``: the guide's strategy fits and is predicted
    within the planner's step-time error of the fastest (``rec.tie``), so the model cannot tell them apart
    and the pick is the simpler one; ``no``: the guide's strategy does not fit, or is clearly slower."""
    if pick is not None and pick.name in row.agrees:
        return "yes"
    if rec.tie and any(name in rec.tie["within"] for name in row.agrees):
        return "tie"
    return "no"


def _cell(e: Estimate | None) -> str:
    if e is None:
        return "-"
    return f"{e.name} {e.step_time_s:.2f} s {e.memory_bytes['peak'] / GiB:.1f} GiB"


def _why(planned: dict) -> str:
    """One line on a disagreement, with the numbers: what the guide's strategies got from the planner."""
    row, rec, pick = planned["row"], planned["rec"], planned["pick"]
    if not row.agrees:
        return f"{row.name}: {row.note}; its pick, {pick.name}, is the best of the layouts it has"
    guide = [e for e in planned["estimates"] if e.name in row.agrees]
    best = min(guide, key=lambda e: (not (e.valid and e.fits), e.step_time_s))
    said = rec.reasons.get(best.name, "")
    if rec.tie and best.name in rec.tie["within"]:
        family = simplicity(pick.name)[1]
        if family == simplicity(best.name)[1]:
            said += f"; both are {family}, and {pick.name} is that family's fastest by the model"
        elif best.step_time_s < pick.step_time_s:  # its reason already says that the pick is simpler
            said += f"; {pick.name} ({family}) fits at {pick.memory_bytes['peak'] / GiB:.1f} GiB"
        else:
            said += (f"; {pick.name} ({family}) fits too, at {pick.memory_bytes['peak'] / GiB:.1f} GiB, and is "
                     f"simpler, within the {rec.tie['bound']:.0%} error")
    return f"{row.name}: the guide's {row.guide} as {best.name}: {said}"


def decision_matrix() -> str:
    """The matrix as a text table and the lines on its disagreements."""
    plans = [plan_row(row) for row in ROWS]
    lines = [f"The guide's decision matrix, planned: H100 80GB GPUs, 8 per node; bf16 AdamW, {AC} activation "
             f"checkpointing, steps of {TOKENS:,} tokens.", "",
             f"{'row':<31} {'GPUs':>4}  {'params':>7}  {'planner pick: step, memory/GPU':<38} "
             f"{'runner-up':<38} {'guide':<18} agrees"]
    for p in plans:
        row = p["row"]
        if row.model is None:
            lines.append(f"{row.name:<31} {row.gpus:>4}  {'25.6M':>7}  {'not expressible':<38} {'-':<38} "
                         f"{row.guide:<18} -")
            continue
        params = sum(math.prod(s) for s in theory.param_shapes(row.model).values())
        lines.append(f"{row.name:<31} {row.gpus:>4}  {params / 1e9:6.2f}B  {_cell(p['pick']):<38} "
                     f"{_cell(p['runner_up']):<38} {row.guide:<18} {p['agrees']}")
    lines += ["", "tie: the guide's strategy fits and is predicted within the planner's step-time error of the "
              "pick, which is the simpler of them.", "", "Where the pick is not the guide's, and what cannot be said:"]
    for p in plans:
        row = p["row"]
        if row.model is None:
            lines.append(f"  {row.name}: {row.note}")
        elif p["agrees"] != "yes":
            lines.append(f"  {_why(p)}")
    lines += ["", "Models: GPT-2 1.5B is GPT-2 XL (48 x 1600, 25 heads, 50,257 tokens, 1,024 per sequence) with an "
              "untied head; LLaMA-7B the 2023 shape; LLaMA-70B the Llama 3.1 70B preset (8,192 per sequence); "
              "the fine-tuning row compares LoRA (rank 16) with full training of the same model."]
    return "\n".join(lines)
