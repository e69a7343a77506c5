"""Chapter 05's tables and plots, drawn from harness records: the pipeline bubble (measured vs theory,
and where the extra idle time goes), DDP throughput against ``bucket_cap_mb``, and what activation
checkpointing and torch.compile cost and save.

The README's figures come from the records committed in ``05-advanced/records/`` and are regenerated
(with every other generated part of the README) by::

    python -m distkit.records render 05-advanced

which calls :func:`pipeline_figures`, :func:`bucket_figures` and :func:`ac_decision`. To plot your own runs::

    python 05-advanced/plot_results.py --results runs/results.jsonl --out-dir runs/plots

(without ``--results``: the committed records). The newest record wins for each schedule/micro-batch
count and each bucket size. Every caption says where its records ran.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distkit import ArgumentParser  # noqa: E402
from distkit.harness import read_records  # noqa: E402
from distkit.paths import output_problems  # noqa: E402
from distkit.records import machine_label, save_figure  # noqa: E402

RECORDS = Path(__file__).resolve().parent / "records"
PIPELINE, PIPELINE_2RANKS, OVERLAP = "pipeline.jsonl", "pipeline_2ranks.jsonl", "overlap.jsonl"
AC = "activation_checkpointing.jsonl"
MIB = 2**20


def where(record: dict) -> str:
    return f"{machine_label(record['machine'], record['backend'])}, {record['world_size']} ranks"


def caption(record: dict, *files: str) -> str:
    links = ", ".join(f"[records/{f}](records/{f})" for f in files)
    return (f"<sub>Recorded on {where(record)}, torch {record['torch_version']}, "
            f"{record['timestamp'][:10]}: {links}.</sub>")


def newest(records: list[dict], script: str, key) -> dict:
    """The newest record of ``script`` for each key (files are appended in time order)."""
    return {key(r): r for r in records if r.get("config", {}).get("script") == script}


# ------------------------------------------------------------------------------------ pipeline
def bubble_row(record: dict) -> dict:
    """One pipeline run, averaged over its ranks. ``idle`` = time inside schedule.step() outside the
    compute chunks. With equal stages and free communication it would be exactly the bubble:
    compute x (p-1)/(v·m) (the schedule is (v·m+p-1) chunk slots, v·m of them busy). ``extra`` is
    what the run idled beyond that, per micro-batch."""
    cfg, bubble = record["config"], record["bubble"]
    p, v, m = cfg["pp"], cfg["stages_per_rank"], cfg["microbatches"]
    step = sum(bubble["schedule_s_per_rank"]) / p
    compute = sum(bubble["compute_s_per_rank"]) / p
    theory_idle = compute * (p - 1) / (v * m)
    return {"schedule": cfg["schedule"], "p": p, "m": m, "theory": bubble["theory"],
            "measured": bubble["measured"], "step_ms": 1e3 * step, "compute_ms": 1e3 * compute,
            "idle_ms": 1e3 * (step - compute), "extra_per_mb_ms": 1e3 * (step - compute - theory_idle) / m}


def pipeline_runs(records: list[dict]) -> list[dict]:
    runs = newest(records, "pipeline_parallel", lambda r: (r["world_size"], r["config"]["schedule"],
                                                          r["config"]["microbatches"]))
    order = {"gpipe": 0, "1f1b": 1, "interleaved_1f1b": 2}
    return [runs[k] for k in sorted(runs, key=lambda k: (-k[0], order[k[1]], k[2]))]


def plot_bubble(records: list[dict], path: Path) -> bool:
    runs = pipeline_runs(records)
    if not runs:
        return False
    rows = [bubble_row(r) for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    series = sorted({(r["p"], r["schedule"]) for r in rows}, key=lambda s: (-s[0], s[1]))
    for i, (p, schedule) in enumerate(series):
        mine = [r for r in rows if (r["p"], r["schedule"]) == (p, schedule)]
        ms, label = [r["m"] for r in mine], f"{schedule}, {p} ranks"
        left.plot(ms, [r["measured"] for r in mine], "o-", color=f"C{i}", label=f"{label} measured")
        left.plot(ms, [r["theory"] for r in mine], "--", color=f"C{i}", label=f"{label} theory")
        right.plot(ms, [r["extra_per_mb_ms"] for r in mine], "o-", color=f"C{i}", label=label)
    left.set(xlabel="micro-batches per step (m)", ylabel="idle fraction of schedule.step()", ylim=(0, 1),
             xscale="log", title="bubble: measured vs (p-1)/(v·m+p-1)")
    right.set(xlabel="micro-batches per step (m)", ylabel="ms per micro-batch", xscale="log",
              title="idle time beyond the theory bubble, per micro-batch")
    right.axhline(0, color="gray", linewidth=0.8)
    for ax in (left, right):
        ax.minorticks_off()
        ax.set_xticks(sorted({r["m"] for r in rows}), [str(m) for m in sorted({r["m"] for r in rows})])
        ax.title.set_fontsize(9)
        ax.legend(fontsize=6)
    fig.suptitle(f"Pipeline parallelism, fixed global batch: {machine_label(runs[0]['machine'], runs[0]['backend'])}",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    return True


def pipeline_figures(out_dir: Path) -> str:
    """README: the pipeline table and pipeline_bubble.png, from records/pipeline*.jsonl."""
    records = read_records(RECORDS / PIPELINE) + read_records(RECORDS / PIPELINE_2RANKS)
    plot_bubble(records, out_dir / "pipeline_bubble.png")
    lines = ["| ranks (p) | schedule | m | bubble theory | idle measured | step ms | compute ms | idle ms "
             "| compute ms per micro-batch | idle beyond theory, ms per micro-batch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in map(bubble_row, pipeline_runs(records)):
        lines.append(f"| {r['p']} | {r['schedule']} | {r['m']} | {r['theory']:.2f} | {r['measured']:.2f} | "
                     f"{r['step_ms']:.0f} | {r['compute_ms']:.0f} | {r['idle_ms']:.0f} | "
                     f"{r['compute_ms'] / r['m']:.1f} | "
                     f"{r['extra_per_mb_ms']:.1f} |")
    lines.append("")
    rows = [bubble_row(r) for r in pipeline_runs(records)]
    for p, schedule in dict.fromkeys((r["p"], r["schedule"]) for r in rows):
        mine = [r for r in rows if (r["p"], r["schedule"]) == (p, schedule)]
        a, b = mine[0], mine[-1]
        extra = [r["extra_per_mb_ms"] for r in mine]
        per_mb = [r["compute_ms"] / r["m"] for r in mine]
        lines.append(f"- {schedule}, {p} ranks, m = {a['m']} -> {b['m']}: idle fraction {a['measured']:.2f} -> "
                     f"{b['measured']:.2f} (theory {a['theory']:.2f} -> {b['theory']:.2f}); idle beyond the "
                     f"bubble {min(extra):.1f} to {max(extra):.1f} ms per micro-batch, against compute of "
                     f"{per_mb[0]:.1f} -> {per_mb[-1]:.1f} ms per micro-batch")
    first = read_records(RECORDS / PIPELINE)[0]
    two = read_records(RECORDS / PIPELINE_2RANKS)[0]
    return "\n".join(lines) + "\n\n![pipeline bubble](pipeline_bubble.png)\n\n" + \
        caption(first, PIPELINE) + "<br>" + caption(two, PIPELINE_2RANKS) + "\n"


# ------------------------------------------------------------------------------------- buckets
def plot_buckets(records: list[dict], path: Path) -> bool:
    runs = newest(records, "communication_overlap", lambda r: r["config"]["bucket_cap_mb"])
    if not runs:
        return False
    sizes = sorted(runs)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [runs[s]["metrics"]["samples_per_s"] for s in sizes], "o-")
    for s in sizes:
        calls = runs[s]["metrics"]["comm_per_step"].get("all_reduce", {}).get("calls", 0)
        ax.annotate(f"{calls:.0f} all-reduces", (s, runs[s]["metrics"]["samples_per_s"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))
    ax.set(xscale="log", xlabel="bucket_cap_mb", ylabel="samples / s", ylim=(0, None))
    ax.set_title(f"DDP throughput vs bucket size: {where(runs[sizes[0]])}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    return True


def bucket_figures(out_dir: Path) -> str:
    """README: the bucket-size table, a sentence naming the fastest size, and bucket_sweep.png."""
    records = read_records(RECORDS / OVERLAP)
    plot_buckets(records, out_dir / "bucket_sweep.png")
    runs = newest(records, "communication_overlap", lambda r: r["config"]["bucket_cap_mb"])
    lines = ["| bucket_cap_mb | all-reduces / step | samples / s | ms / step (median) |", "|---|---|---|---|"]
    for size in sorted(runs):
        m = runs[size]["metrics"]
        lines.append(f"| {size:g} | {m['comm_per_step']['all_reduce']['calls']:.0f} | {m['samples_per_s']:.0f} | "
                     f"{1e3 * m['step_time_s_median']:.1f} |")
    fastest = max(runs, key=lambda s: runs[s]["metrics"]["samples_per_s"])
    slowest = min(runs, key=lambda s: runs[s]["metrics"]["samples_per_s"])
    ratio = runs[fastest]["metrics"]["samples_per_s"] / runs[slowest]["metrics"]["samples_per_s"]
    sentence = (f"In this run the fastest bucket size was {fastest:g} MB, {ratio:.1f}x the throughput of "
                f"{slowest:g} MB.")
    return "\n".join(lines) + f"\n\n{sentence}\n\n![bucket sweep](bucket_sweep.png)\n\n" + \
        caption(runs[fastest], OVERLAP) + "\n"


# ------------------------------------------------------------------ activation checkpointing
def ac_rows(records: list[dict]) -> list[dict]:
    """One row per AC mode x compile of the newest run: rank 0's peak by category (None when not
    tracked: compiled), its median step, and both relative to eager without AC."""
    runs = newest(records, "activation_checkpointing", lambda r: (r["config"]["ac"], r["config"]["compile"]))
    base = runs.get(("none", False))
    rows = []
    for (ac, compiled), r in sorted(runs.items(), key=lambda kv: (["none", "selective", "full"].index(kv[0][0]),
                                                                   kv[0][1])):
        m = r["metrics"]
        peak = (m.get("peak_memory_by_category_per_rank") or [None])[0]
        rows.append({"ac": ac, "compile": compiled, "peak": peak, "step_s": m["step_time_s_median"],
                     "first_step_s": r["first_step_s"], "per_block": r["activation_bytes_per_layer"],
                     "formula": r["activation_bytes_per_layer_formula"], "record": r,
                     "step_vs_base": (m["step_time_s_median"] / base["metrics"]["step_time_s_median"] - 1
                                      if base else None)})
    return rows


def ac_decision(out_dir: Path) -> str:
    """README: what each AC mode and compile measured (memory by category, step time, first step)
    against eager without AC, from the committed records of the README's command."""
    rows = ac_rows(read_records(RECORDS / AC))
    base = next(r for r in rows if r["ac"] == "none" and not r["compile"])
    lines = ["| AC | compile | peak MiB | activations MiB | per block KiB (formula) | median step ms | "
             "step vs no AC, eager | first step s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        peak = row["peak"]
        mem = (f"{peak['total'] / MIB:.2f} | {peak['activations'] / MIB:.2f}" if peak else "n/a | n/a")
        block = f"{row['per_block'] / 1024:,.0f} ({row['formula'] / 1024:,.0f})" if row["per_block"] else \
            f"n/a ({row['formula'] / 1024:,.0f})"
        lines.append(f"| {row['ac']} | {'on' if row['compile'] else 'off'} | {mem} | {block} | "
                     f"{1e3 * row['step_s']:.1f} | {100 * row['step_vs_base']:+.0f}% | {row['first_step_s']:.1f} |")
    notes = []
    for row in rows:
        if row["peak"] and row is not base:
            freed = base["peak"]["total"] - row["peak"]["total"]
            notes.append(f"- **{row['ac']} AC** keeps {row['peak']['activations'] / MIB:.2f} MiB of activations "
                         f"instead of {base['peak']['activations'] / MIB:.2f}: the peak drops by {freed / MIB:.2f} MiB "
                         f"({100 * freed / base['peak']['total']:.0f}%) "
                         f"for {100 * row['step_vs_base']:+.0f}% step time.")
    compiled = [row for row in rows if row["compile"]]
    if compiled:
        best = min(compiled, key=lambda row: row["step_s"])
        label = "no AC" if best["ac"] == "none" else f"{best['ac']} AC"
        notes.append(f"- **Compiled**, the fastest was {label} at {100 * best['step_vs_base']:+.0f}% step time "
                     f"against eager without AC; compiling took the first step {best['first_step_s']:.0f} s, so it "
                     f"pays after about {best['first_step_s'] / max(base['step_s'] - best['step_s'], 1e-9):,.0f} "
                     f"steps." if best["step_s"] < base["step_s"] else
                     "- **Compiled**, no configuration beat eager without AC in this run.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n\n" + caption(base["record"], AC) + "\n"


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", nargs="+",
                        default=[str(RECORDS / f) for f in (PIPELINE, PIPELINE_2RANKS, OVERLAP)],
                        help="harness record files (default: the committed 05-advanced/records/*.jsonl)")
    parser.add_argument("--out-dir", default="runs/plots", help="where the PNGs go (default: runs/plots)")
    args = parser.parse_args(argv)
    missing = [f for f in args.results if not Path(f).exists()]
    if missing:
        parser.error(f"{missing[0]} does not exist: run pipeline_parallel.py / communication_overlap.py first")
    unwritable = output_problems(args, dirs=["out_dir"])
    if unwritable:
        parser.error(unwritable)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    records = [r for f in args.results for r in read_records(f)]
    out = Path(args.out_dir)
    for name, plot in (("pipeline_bubble.png", plot_bubble), ("bucket_sweep.png", plot_buckets)):
        print(f"wrote {out / name}" if plot(records, out / name) else f"skipped {name}: no matching records")


if __name__ == "__main__":
    main()
