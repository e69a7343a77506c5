"""The planner against published GPU runs (:mod:`.published`): each row planned with its own layout
(:func:`~.nd.estimate_dims`), the time model's one free constant, the achievable fraction of the
bf16 peak, fitted on the calibration rows only (H100, torchtitan December 2024), then every row
predicted with it; :func:`published_table` prints them with their errors, calibration and
validation apart, and the summary (median and worst error of each).

What is fitted and what is measured, each from its source:

* ``efficiency`` (:func:`calibrate`): the fraction of the datasheet bf16 peak (989 TFLOP/s H100 SXM,
  312 A100: :data:`~.inputs.GPUS`) that the median calibration row needs on large matrices (each
  row's linear layers at the fraction of it their GEMMs' size reaches, :mod:`.gemm`, from XLA's
  measured H100 table, nothing fitted here); the A100 rows use the
  H100's fraction times the A100's ``compute_factor`` (:data:`~.inputs.A100_VS_H100`, from MosaicML's
  runs on both GPUs; no A100 row is fitted on);
* ``torch.compile`` and Float8 as measured factors (:data:`COMPILE_SPEEDUP`, :data:`FLOAT8_SPEEDUP`):
  the ratios of Table 1's rows (the same 8B job with and without each), on the compute rate, as
  ``plan.py --compile --float8`` plans any job (Table 1's job is compute-bound); Float8 rowwise by
  its own ratio on the same kind of job (:data:`FLOAT8_ROWWISE_SPEEDUP`: no calibration file measures
  it), and with tensorwise's memory factor;
* communication, overlap, the bubble and the CP ring: :mod:`.nd`'s terms with the link speeds of
  :data:`~.inputs.GPUS` (their sources there), nothing fitted; the rows that ran AsyncTP (Tables 4
  to 6, and the AsyncTP file's) as ``plan.py --async-tp`` plans any job (:mod:`.async_tp`, nothing
  fitted);
* memory: the published figure is torchtitan's peak of the CUDA caching allocator
  (``max_reserved``; the file's footnote: the maximum over GPUs), which holds cached blocks and
  splits besides the tensors the planner counts; the allocator's reserve on what a step makes and
  frees is fitted on the calibration rows' memory (:func:`calibrate_reserve`), and
  ``torch.compile`` and Float8 are measured factors on the blocks' saved activations
  (:func:`memory_factors`), fitted on Table 1's memory column (the same three rows as the
  speed-ups); the H200 rows check the memory model out of sample.

The rows counted in no error (:data:`~.published.EXCLUDED`) are planned and listed with their errors
and the reason, and summed apart, so that the table shows what including them would do."""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

from .costs import _flops_per_token, attention_flops_per_token
from .dims import ParallelDims
from .gemm import matmul_factor
from .inputs import A100_VS_H100, GiB, Plan, cluster
from .nd import estimate_dims
from .published import CALIBRATION, EXCLUDED, H100_FILE, MODELS, VALIDATION, Row

# Measured factors, H100_FILE Table 1 (Llama 3.1 8B, FSDP 8, local batch 2): FSDP 5,762 tokens/s per
# GPU, + torch.compile 6,667, + Float8 8,532.
COMPILE_SPEEDUP = 6667 / 5762
FLOAT8_SPEEDUP = 8532 / 6667
# Float8 rowwise, measured on top of compile: pytorch/torchtitan commit 3537666a ("[not for land yet]
# example of float8 with rowwise scaling", authored 2025-01-27, branch 20250127_float8_rowwise_example),
# its message's runs of Llama 3 8B on 8 H100s with train_configs/llama3_8b.toml and --training.compile:
# bf16 5,760 tokens/s per GPU, rowwise 6,424 with the torchao change the message links (6,412 on
# torchao's main branch), tensorwise with Float8 all-gathers 7,186. That config then (at 3ef63e81,
# 2025-01-23): FSDP over the 8 GPUs, local batch 1, seq_len 8192, selective op AC, and train.py
# leaves the loss eager. Its memory, 47.65 GiB = 50.16%, puts the GPUs at 95.0 GiB: Table 1's 96 GB
# H100s (the power limit is not stated). So it is Table 1's job at local batch 1, and the ratio is
# taken to carry to any job as Table 1's do, turned into a factor outside attention with Table 1's
# attention share (linear_speedup; at batch 1 the share is 0.2034 against 0.2039, which moves the
# planned ratio on that job by 0.01%). torchtitan b4ca1ee3 (2025-02-06) measured 6,420-6,429 on the
# same job, and 60e7129, the recipe as it landed, 6,468.
FLOAT8_ROWWISE_SPEEDUP = 6424 / 5760
# The whole-step ratio of each Float8 recipe (inputs.FLOAT8_RECIPES), both measured over compile.
FLOAT8_SPEEDUPS = {"tensorwise": FLOAT8_SPEEDUP, "rowwise": FLOAT8_ROWWISE_SPEEDUP}
# Goals for the validation rows (tokens/s median / worst, memory median / worst).
GOALS = {"tps": (0.15, 0.30), "memory": (0.10, 0.20)}


def row_plan(row: Row) -> tuple[Plan, ParallelDims]:
    """The job and layout of a row: its model at its sequence length, ``local_batch`` sequences per
    batch rank (one micro-batch; under a pipeline as many micro-batches as stages, torchtitan's
    default), bf16 AdamW, its AC, its torch.compile, Float8 (and recipe) and AsyncTP (as ``plan.py
    --compile --float8 RECIPE --async-tp`` plans them) and whether its loss was compiled."""
    cfg = replace(MODELS[row.model], seq_len=row.seq_len)
    dims = ParallelDims(**row.dims, schedule=row.schedule)
    micro = row.local_batch // dims.pp if dims.pp > 1 else row.local_batch
    plan = Plan(cfg, global_batch=row.local_batch * dims.batch_ranks, micro_batch=micro, ac=row.ac,
                compile=row.compile, float8=row.float8, float8_recipe=row.float8_recipe,
                compiled_loss=row.compiled_loss, async_tp=row.async_tp)
    return plan, dims


def _table1(compile_: bool, float8: bool) -> Row:
    return next(r for r in CALIBRATION if r.source.endswith("Table 1") and (r.compile, r.float8) == (compile_, float8))


# Measured memory, the same Table 1 rows (the memory column, GiB): FSDP 82.4, + torch.compile 77.0,
# + Float8 76.8. torchtitan compiles each TransformerBlock on its own (apply_compile in
# torchtitan/parallelisms/parallelize_llama.py) and swaps every nn.Linear but the output head for
# torchao's Float8Linear (torchtitan/float8.py: module_filter_fn fqn != "output"), so what either
# saves lies inside the blocks; the table does not say which of the blocks' tensors, and the planner
# takes it off their saved activations. The rows were measured with selective AC and no published
# pair measures full AC, under which a block keeps only its input (the checkpoint's input, which
# neither technique changes): no factor there. Float8 rowwise gets tensorwise's factor: torchtitan
# b4ca1ee3 (2025-02-06; per op AC no longer saves abs's output, which had kept a gathered weight's
# abs for backward under rowwise) measured both on FLOAT8_ROWWISE_SPEEDUP's job at 47.77 GiB, bf16
# at 47.65 (3537666a's 58.55 for rowwise was before that change).
_MEMORY_FACTORS: dict = {}


def memory_factors() -> dict[str, float]:
    """``{"compile": c, "float8": f}``: what each keeps of the blocks' saved activations, from Table 1's
    memory column (the comment above), the activations A the planner counts for that job (eager)
    and the allocator's reserve r (:func:`calibrate_reserve`: a tensor byte less frees r bytes of the
    published figure): c = 1 - (82.4 - 77.0) GiB / (r A), f = 1 - (77.0 - 76.8) GiB / (r c A)
    (Float8 was measured on top of compile). Nothing else is fitted to these rows; Table 3 (the
    same job on 128 GPUs) is not used and checks them."""
    if not _MEMORY_FACTORS:
        eager, comp, fp8 = _table1(False, False), _table1(True, False), _table1(True, True)
        plan, dims = row_plan(eager)
        act = estimate_dims(plan, cluster(eager.gpu, eager.gpus), dims).memory_bytes["activations"]
        act *= calibrate_reserve()
        c = 1 - (eager.memory_gib - comp.memory_gib) * GiB / act
        _MEMORY_FACTORS.update(compile=c, float8=1 - (comp.memory_gib - fp8.memory_gib) * GiB / (c * act))
    return dict(_MEMORY_FACTORS)


_RESERVE: dict = {}


def calibrate_reserve(rows=CALIBRATION) -> float:
    """The caching allocator's reserve r (:func:`~.layouts.reserved_bytes`): the median, over the
    ``rows`` that publish a memory and that no compile or Float8 memory factor touches (eager, or
    under full AC), of (published - held) / (counted - held), where held is what
    :func:`~.layouts.reserved_bytes` counts at its size (the model state, a pipeline stage's
    gathered weights and gradients) and counted the tensors at the peak; rounded to 3 decimals.
    Fitted on the calibration rows only, once per set of rows in a process."""
    key = tuple(r.label + r.source for r in rows)
    if key not in _RESERVE:
        ratios = []
        for row in rows:
            if row.memory_gib is None or (row.ac != "full" and (row.compile or row.float8)):
                continue  # no memory factor of compile or Float8 applies (memory_factor is 1)
            plan, dims = row_plan(row)
            est = estimate_dims(plan, cluster(row.gpu, row.gpus, allocator_reserve=1.0), dims)
            at_two = estimate_dims(plan, cluster(row.gpu, row.gpus, allocator_reserve=2.0), dims)
            counted = est.memory_bytes["peak"]
            # reserved is linear in the reserve where one moment is the peak at both values (the top
            # of backward, for every row here: tests/test_planner_memory.py recomputes each by hand)
            transient = at_two.memory_bytes["reserved"] - counted  # what the reserve multiplies
            ratios.append(1 + (row.memory_gib * GiB - counted) / transient)
        _RESERVE[key] = round(statistics.median(ratios), 3)
    return _RESERVE[key]


def memory_factor(job: Row | Plan) -> float:
    """The factor on the blocks' saved activations of ``job``'s techniques (:func:`memory_factors`);
    1 for eager runs and under full AC (the comment above :func:`memory_factors` says why). ``job``:
    a published row, or a plan (``plan.py --compile/--float8``, through :func:`~.costs.activation_bytes`).
    Both Float8 recipes keep the same factor (the comment above :func:`memory_factors`)."""
    if job.ac == "full" or not (job.compile or job.float8):
        return 1.0
    f = memory_factors()
    return (f["compile"] if job.compile else 1.0) * (f["float8"] if job.float8 else 1.0)


def float8_speedup(job: Row | Plan) -> float:
    """The measured whole-step ratio of ``job``'s Float8 recipe over its compiled bf16 run
    (:data:`FLOAT8_SPEEDUPS`); 1 without Float8."""
    return FLOAT8_SPEEDUPS[job.float8_recipe] if job.float8 else 1.0


def technique_speedup(job: Row | Plan) -> float:
    """What ``job``'s torch.compile and Float8 multiplied a whole step's speed by where they were
    measured (:data:`COMPILE_SPEEDUP` and its recipe's :func:`float8_speedup`); 1 for an eager job.
    The planner applies it to the FLOPs outside attention as :func:`linear_speedup`."""
    return (COMPILE_SPEEDUP if job.compile else 1.0) * float8_speedup(job)


_ATTENTION_SHARE: dict = {}


def linear_speedup(job: Row | Plan) -> float:
    """What ``job``'s torch.compile and Float8 multiply the speed of the FLOPs outside attention by
    (:func:`~.costs.compute_seconds`): the whole-step ratio S (:func:`technique_speedup`) with
    attention, a share A of that job's compute time, left at its eager speed: (1 - A) / (1 / S - A).
    A is attention's FLOPs over them all, the others counted at the fraction f of the large-matrix
    rate their GEMMs reach on that job's GPUs (:func:`~.gemm.matmul_factor`, 0.997 there), so that
    Table 1's job, planned, gains exactly its measured ratio."""
    s = technique_speedup(job)
    if s == 1.0:
        return 1.0
    if not _ATTENTION_SHARE:
        row = _table1(False, False)
        plan, _ = row_plan(row)
        attention = attention_flops_per_token(plan)
        f = matmul_factor(cluster(row.gpu, row.gpus), plan, plan.micro_batch * plan.model.seq_len)
        _ATTENTION_SHARE["A"] = attention / (attention + (_flops_per_token(plan) - attention) / f)
    a = _ATTENTION_SHARE["A"]
    return (1 - a) / (1 / s - a)


def predict(row: Row, efficiency: float) -> tuple[float, float]:
    """(tokens/s per GPU, peak GiB per GPU) the planner predicts for ``row`` at ``efficiency``, as it
    plans any job: its techniques speed up the FLOPs outside attention (:func:`linear_speedup`, through
    :func:`~.costs.compute_seconds`: attention, communication and the bubble stay as they are) and the blocks' saved
    activations (:func:`memory_factor`, through :func:`~.costs.activation_bytes`)."""
    plan, dims = row_plan(row)
    cl = cluster(row.gpu, row.gpus, efficiency=efficiency, allocator_reserve=calibrate_reserve())
    est = estimate_dims(plan, cl, dims)
    if not est.valid:
        raise ValueError(f"{row.label}: {est.note}")
    return est.tokens_per_s_per_gpu, est.memory_bytes["reserved"] / GiB


_FITTED: dict = {}


def calibrate(rows=CALIBRATION) -> float:
    """The efficiency in [0.2, 0.8] whose median absolute log error of tokens/s over ``rows`` is
    smallest: every 0.01 first, then a golden-section search to 1e-4 within 0.01 of the best of them
    (the error has more than one dip: the FSDP rows and the TP rows pull apart, and a median jumps
    from one row to another). Fitted once per set of rows in a process."""
    key = tuple(r.label + r.source for r in rows)
    if key not in _FITTED:
        _FITTED[key] = _fit(rows)
    return _FITTED[key]


def _fit(rows) -> float:
    def loss(e: float) -> float:
        return statistics.median(abs(math.log(predict(r, e)[0] / r.tps)) for r in rows)
    best = min((0.2 + i / 100 for i in range(61)), key=loss)
    lo, hi, g = best - 0.01, best + 0.01, (math.sqrt(5) - 1) / 2
    while hi - lo > 1e-4:
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if loss(a) <= loss(b) else (a, hi)
    return round((lo + hi) / 2, 4)


def compare(efficiency: float | None = None) -> list[dict]:
    """Every row predicted at the calibrated efficiency (or the one given): role (calibration,
    validation, or excluded: :data:`~.published.EXCLUDED`, with its ``reason``), source, label,
    measured and predicted tokens/s and memory, their relative errors."""
    eff = calibrate() if efficiency is None else efficiency
    out = []
    for role, rows in (("calibration", CALIBRATION), ("validation", VALIDATION), ("excluded", EXCLUDED)):
        for row in rows:
            tps, mem = predict(row, eff)
            out.append({"role": role, "source": row.source, "label": row.label, "efficiency": eff,
                        "tps": row.tps, "tps_pred": tps, "tps_err": tps / row.tps - 1,
                        "memory_gib": row.memory_gib, "memory_pred": mem,
                        "memory_err": None if row.memory_gib is None else mem / row.memory_gib - 1,
                        **({"reason": row.excluded} if role == "excluded" else {})})
    return out


def summary(rows: list[dict]) -> dict:
    """Median and worst absolute error: tokens/s of the calibration and of the validation rows, and
    memory of each, over the rows that publish it but the two that :func:`memory_factors` is fitted
    on (Table 1's compile rows: their predicted drop from the eager row is the measured one by
    construction). The excluded rows count in none of these; ``tps_with_excluded`` is the
    validation's tokens/s with them, so what leaving them out changes is in plain view."""
    def stats(errors):
        errors = [abs(e) for e in errors]
        return (statistics.median(errors), max(errors), len(errors)) if errors else (math.nan, math.nan, 0)

    def memory(role):
        return stats(r["memory_err"] for r in rows
                     if r["role"] == role and r["memory_err"] is not None and not _memory_fitted(r))
    return {"tps_calibration": stats(r["tps_err"] for r in rows if r["role"] == "calibration"),
            "tps_validation": stats(r["tps_err"] for r in rows if r["role"] == "validation"),
            "tps_with_excluded": stats(r["tps_err"] for r in rows if r["role"] in ("validation", "excluded")),
            "memory_calibration": memory("calibration"), "memory_validation": memory("validation")}


def _memory_fitted(r: dict) -> bool:
    return r["source"].endswith("Table 1") and r["label"] != _table1(False, False).label


def published_table(rows: list[dict] | None = None) -> str:
    """Markdown: one line per row (calibration first, the excluded rows last), then the summary
    against :data:`GOALS`, and the validation's tokens/s with the excluded rows too."""
    rows = compare() if rows is None else rows
    lines = [f"efficiency fitted on the {sum(r['role'] == 'calibration' for r in rows)} calibration rows: "
             f"{rows[0]['efficiency']:.4f} of the bf16 peak (x{A100_VS_H100} on an A100: MosaicML's A100/H100 "
             f"MFU ratio); compile x{COMPILE_SPEEDUP:.3f}, Float8 "
             f"x{FLOAT8_SPEEDUP:.3f} (Table 1's ratios), Float8 rowwise x{FLOAT8_ROWWISE_SPEEDUP:.3f} (torchtitan "
             f"3537666a's); their memory: x{memory_factors()['compile']:.3f}, "
             f"x{memory_factors()['float8']:.4f} (either recipe) of the blocks' activations outside full AC "
             "(Table 1's)", "",
             "| role | source | run | tok/s/GPU meas | pred | err | memory GiB meas | pred | err |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        src = r["source"].replace(H100_FILE, "H100 202412").replace("pytorch/torchtitan ", "")
        mem = ("-", f"{r['memory_pred']:.1f}", "-") if r["memory_gib"] is None else \
            (f"{r['memory_gib']:.1f}", f"{r['memory_pred']:.1f}", f"{r['memory_err']:+.1%}")
        lines.append(f"| {r['role']} | {src} | {r['label']} | {r['tps']:,.0f} | {r['tps_pred']:,.0f} | "
                     f"{r['tps_err']:+.1%} | {' | '.join(mem)} |")
    s = summary(rows)
    excluded = [r for r in rows if r["role"] == "excluded"]
    if excluded:
        lines += ["", f"excluded: {len(excluded)} rows, planned, counted only in the figures \"with the excluded "
                  "rows\" below: " + "; ".join(sorted({r["reason"] for r in excluded}))]
    lines += ["", "tokens/s: calibration median {:.1%}, worst {:.1%} ({} rows); validation median {:.1%}, worst {:.1%} "
              "({} rows), goal {:.0%} / {:.0%}".format(*s["tps_calibration"], *s["tps_validation"], *GOALS["tps"])
              + ("; with the excluded rows: median {:.1%}, worst {:.1%} ({} rows)".format(*s["tps_with_excluded"])
                 if excluded else ""),
              "memory, the allocator's peak (Table 1's 2 compile rows, which fit compile and Float8, left out): "
              "calibration median {:.1%}, worst {:.1%} ({} rows); validation median {:.1%}, worst {:.1%} ({} rows), "
              "goal {:.0%} / {:.0%}".format(*s["memory_calibration"], *s["memory_validation"], *GOALS["memory"])]
    return "\n".join(lines)
