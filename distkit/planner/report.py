"""Reports: the terminal table, the JSON and the plot of a plan's estimates."""
from __future__ import annotations

import math

from .. import theory
from ..models import is_moe
from .choose import Recommendation
from .costs import PARTS, compute_rate
from .inputs import Cluster, GiB, Plan
from .layouts import Estimate

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
            f"{plan.precision}, {plan.optimizer}, AC {plan.ac}"
            + (" (eager attention)" if plan.attention == "eager" else "")
            + "".join(f", {t}" for t, on in (("torch.compile", plan.compile),
                                             (f"Float8 {plan.float8_recipe}", plan.float8),
                                             ("compiled loss", plan.compiled_loss),
                                             ("async TP (N-D layouts with TP and SP)", plan.async_tp)) if on)
            + f" | {cl.gpus} x {cl.gpu.name} "
            f"({cl.nodes} node{'s' if cl.nodes > 1 else ''} of {cl.gpus_per_node})")


def _factors_text(cl, plan) -> str:
    """The measured factors on top of the efficiency, where any is not 1 (the GPU type's, compile's
    and Float8's on the FLOPs outside attention), and where the whole-step ratio was measured."""
    from .published_check import linear_speedup, technique_speedup

    parts = [f"x {cl.gpu.compute_factor:.3g} for the {cl.gpu.name}"] if cl.gpu.compute_factor != 1 else []
    if plan.compile or plan.float8:
        on = "+".join(t for t, flag in (("compile", plan.compile), (f"Float8 {plan.float8_recipe}", plan.float8))
                      if flag)
        where = ("Table 1's and torchtitan 3537666a's" if plan.float8 and plan.float8_recipe == "rowwise"
                 else "Table 1's")
        parts.append(f"x {linear_speedup(plan):.3g} outside attention for {on}, "
                     f"{where} x {technique_speedup(plan):.3g} on its whole step")
    return "".join(f" {p}" for p in parts)


def _layout_text(layout: dict) -> str:
    """``dp=8 tp=2 micro=1 accum=2``: the sizes that matter (1s left out, dp always shown); an N-D
    layout's axes by short names (``dpr=2 dps=16 tp=8 pp=2 1f1b micro=1 mbs=8``)."""
    if "dims" in layout:
        short = {"dp_replicate": "dpr", "dp_shard": "dps", "schedule": "", "sp": "sp", "microbatches": "mbs",
                 "interleaved_1f1b": "i1f1b"}
        parts = [short.get(v, v) if k == "schedule" else f"{short.get(k, k)}={v}"
                 for k, v in (kv.split("=") for kv in layout["dims"].split(","))]
        tail = [f"micro={layout['micro_batch']}"] + ([] if "microbatches" in layout["dims"] else
                                                     [f"mbs={layout['microbatches']}"] if "microbatches" in layout
                                                     else [f"accum={layout['accumulation']}"])
        return " ".join(parts + tail)
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
             + (", calibrated" if cl.cores else "") + _factors_text(cl, plan) + ")",
             "",
             f"{'strategy':<20} {'layout':<30} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'temp':>7} "
             f"{'peak':>7} {'alloc':>7} {'fits':>4} {'step s':>8} {'tok/s/GPU':>10}",
             f"{'':<20} {'':<30} {unit_name + ' per GPU (alloc: what the caching allocator reserves)':^55}"]
    for e in estimates:
        if not e.valid:
            lines.append(f"{e.name:<20} cannot run: {e.note}")
            continue
        m = e.memory_bytes
        lines.append(f"{e.name:<20} {_layout_text(e.layout):<30} " +
                     " ".join(f"{m[p] / unit:7.2f}" for p in (*PARTS, "peak", "reserved")) +
                     f" {'yes' if e.fits else 'no':>4} {e.step_time_s:8.3f} {e.tokens_per_s_per_gpu:10,.0f}")
    lines.append("")
    halved = sorted({e.layout["micro_batch"] for e in estimates if e.valid and "micro_batch" in e.layout}
                    - {plan.micro_batch})
    if halved:  # estimate() halves a micro-batch that does not split the batch or fit: said, not silent
        lines += [f"micro-batch {plan.micro_batch} was asked; layouts where it does not split the per-rank batch "
                  f"or does not fit use {' or '.join(map(str, halved))} (their micro= above)", ""]
    if rec.best:
        b = rec.best
        reserved = (f" (the caching allocator reserves about {b.memory_bytes['reserved'] / unit:.1f})"
                    if cl.reserve != 1 else "")
        lines.append(f"recommended: {b.name} ({_layout_text(b.layout)}): "
                     f"{b.memory_bytes['peak'] / unit:.1f} {unit_name} "
                     f"per GPU{reserved}, step {b.step_time_s:.3f} s, {b.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
        if rec.tie:
            lines.append(tie_text(rec.tie))
    elif not any(e.valid for e in estimates):  # "use more GPUs" may be false (512 sequences do not split over 6)
        lines.append(f"recommended: none: no strategy can run this job on {cl.gpus} GPUs (reasons below)")
    else:
        lines.append("recommended: nothing fits; use more GPUs, activation checkpointing, a smaller micro-batch"
                     + (" or --offload" if any(e.offload and e.fits for e in estimates) else ""))
    for name, why in rec.reasons.items():
        lines.append(f"  {name:<20} {why}")
    return "\n".join(lines)


def tie_text(tie: dict) -> str:
    """The tie in two lines: who is within the error of the fastest, and why the pick."""
    others = [name for name in tie["within"] if name != tie["fastest"]]
    return (f"tie: predicted within {tie['bound']:.0%} of the fastest, {tie['fastest']} (the planner's median "
            f"step-time error, its validation bound): {', '.join(others)}; the simplest is picked\n"
            f"  why: {tie['reason']}")


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
                 "activation_checkpointing": plan.ac, "offload": plan.offload,
                 "compile": plan.compile, "float8": plan.float8,
                 "float8_recipe": plan.float8_recipe if plan.float8 else None, "compiled_loss": plan.compiled_loss,
                 "async_tp": plan.async_tp},
        "cluster": {"gpu": cl.gpu.name, "gpus": cl.gpus, "gpus_per_node": cl.gpus_per_node,
                    "memory_bytes": cl.gpu.memory_bytes, "usable_bytes": cl.capacity_bytes,
                    "efficiency": cl.efficiency, "source": cl.gpu.source},
        "strategies": [e.to_json() for e in estimates],
        "recommended": rec.best.name if rec.best else None,
        "tie": rec.tie,
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
