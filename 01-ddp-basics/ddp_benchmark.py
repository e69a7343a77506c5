"""Chapter 01: strong and weak scaling of DDP over world sizes 1, 2, 4 (or up to the GPU count).

* strong scaling: the global batch is fixed; more ranks split it, so each does less work per step.
  Ideal: step time falls as 1/N, throughput rises N x.
* weak scaling: the per-rank batch is fixed; the global batch grows with N. Ideal: step time stays
  flat, throughput rises N x.

Run it with python: it launches one torchrun job per world size (each job measures both modes with
the harness and appends two records), then prints speedup and efficiency and writes a PNG.

    python 01-ddp-basics/ddp_benchmark.py                       # world sizes 1 2 4
    python 01-ddp-basics/ddp_benchmark.py --world-sizes 1 2 4 8 --model-size medium   # 8 GPUs
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import (
    ArgumentParser,
    UsageError,
    add_runtime_args,
    choose_backend_and_device,
    distributed,
    run_main,
    seed_everything,
)
from distkit.flags import add_training_args, positive_float, positive_int, require_steps
from distkit.harness import Harness, read_records
from distkit.logs import progress, setup_logging
from distkit.models import GPT_PRESETS, TinyGPT, TokenTask, gpt_config, lm_loss, rank_slice
from distkit.paths import check_outputs, shown_path

HERE = Path(__file__).resolve().parent


def visible_gpus() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES applied, so 0 when it hides them all), the
    count each job's own backend choice will see. Creates no CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_args(argv=None):
    gpus = visible_gpus()
    default_sizes = [n for n in (1, 2, 4, 8, 16) if n <= gpus] or [1, 2, 4]
    parser = ArgumentParser(
        description="Strong and weak scaling of DDP: one torchrun job per world size, harness "
                    "records, a table of throughput / speedup / efficiency, and a PNG plot.",
        epilog="example: python 01-ddp-basics/ddp_benchmark.py --world-sizes 1 2 4 --steps 12")
    parser.add_argument("--world-sizes", type=positive_int, nargs="+", default=default_sizes,
                        help=f"world sizes to measure (default here: {' '.join(map(str, default_sizes))})")
    parser.add_argument("--model-size", choices=sorted(GPT_PRESETS), default="small",
                        help="transformer preset (default: small)")
    parser.add_argument("--per-rank-batch", type=positive_int, default=8,
                        help="weak scaling: sequences per rank; strong scaling: the global batch is "
                             "this x the largest world size (default: 8)")
    add_training_args(parser, steps=12, global_batch_size=None, lr=3e-3, warmup_steps=2,
                      results="runs/ddp_benchmark.jsonl", helps={"steps": "steps per mode, warm-up included",
                                                                 "lr": "AdamW learning rate"})
    parser.add_argument("--plot", default="runs/ddp_scaling.png",
                        help="where the PNG goes (default: runs/ddp_scaling.png; the README's plot is drawn "
                             "from the committed record)")
    parser.add_argument("--job-timeout-s", type=positive_float, default=900,
                        help="give up on one world size's job after this long (default: 900)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the driver
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    require_steps(parser, args, timed=True, why="the scaling table's step times")
    return args


# ---- worker: runs under torchrun, measures both modes at this world size ----

def measure(ctx, args, mode: str, log) -> None:
    cfg = gpt_config(args.model_size)
    global_batch = args.per_rank_batch * (max(args.world_sizes) if mode == "strong" else ctx.world_size)
    if global_batch % ctx.world_size:
        raise UsageError(f"strong scaling: global batch {global_batch} does not divide by {ctx.world_size}")
    seed_everything(args.seed)
    model = DDP(TinyGPT(cfg).to(ctx.device), device_ids=ctx.device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    harness = Harness(ctx, "ddp", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      config={"scaling": mode, "run_id": args.run_id,
                              "global_batch_size": global_batch, "per_rank_batch": global_batch // ctx.world_size,
                              "precision": "fp32"})
    task = TokenTask(cfg, seed=args.seed)
    for step in progress(range(args.steps), ctx.rank, desc=f"{mode} x{ctx.world_size}"):
        inputs, targets = (rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device)
                           for t in task.global_batch(step, global_batch))
        with harness.step(samples=global_batch, tokens=global_batch * cfg.seq_len):
            optimizer.zero_grad(set_to_none=True)
            lm_loss(model(inputs), targets).backward()  # DDP all-reduces the gradients here
            optimizer.step()
    record = harness.finish(args.results)
    if ctx.is_main:
        log.info(f"{mode:>6} scaling | {ctx.world_size} ranks | global batch {global_batch} | "
                 f"{record['metrics']['tokens_per_s']:,.0f} tokens/s")


def worker(args) -> None:
    with distributed(args) as ctx:
        log = setup_logging(ctx.rank)
        for mode in ("strong", "weak"):
            measure(ctx, args, mode, log)


# ---- driver: one torchrun job per world size, then the table and the plot ----

def launch(args, world_size: int) -> None:
    # torchrun, as this interpreter's module; the test suite names its single-node fork launcher
    # (tests/fork_launcher.py, same flags) in DISTKIT_TORCHRUN, as for the notebooks
    torchrun = shlex.split(os.environ.get("DISTKIT_TORCHRUN", "")) or [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*torchrun, "--standalone", f"--nproc_per_node={world_size}",
           __file__, "--worker", "--run-id", args.run_id, "--world-sizes", *map(str, args.world_sizes),
           "--model-size", args.model_size, "--per-rank-batch", str(args.per_rank_batch),
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--lr", str(args.lr),
           "--results", args.results,
           "--backend", args.backend, "--device", args.device, "--timeout-s", str(args.timeout_s),
           "--seed", str(args.seed)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the cores: one thread each
    # Other jobs on the machine distort every number: show how busy it was when this job started.
    print(f"--- world size {world_size} | load average before the job {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores ---", flush=True)
    try:
        done = subprocess.run(cmd, env=env, timeout=args.job_timeout_s)
    except subprocess.TimeoutExpired:
        raise UsageError(f"the {world_size}-rank job took longer than --job-timeout-s {args.job_timeout_s:g}")
    if done.returncode != 0:
        raise UsageError(f"the {world_size}-rank job failed (exit {done.returncode}); see its output above")


def summarize(records: list[dict]) -> list[dict]:
    """Speedup and efficiency against the smallest world size of each mode."""
    rows = []
    for mode in ("strong", "weak"):
        mine = sorted((r for r in records if r["config"]["scaling"] == mode), key=lambda r: r["world_size"])
        base = mine[0]
        for r in mine:
            n = r["world_size"] / base["world_size"]
            speedup = r["metrics"]["tokens_per_s"] / base["metrics"]["tokens_per_s"]
            rows.append({"mode": mode, "ranks": r["world_size"], "global_batch": r["config"]["global_batch_size"],
                         "step_s": r["metrics"]["step_time_s_median"], "tokens_per_s": r["metrics"]["tokens_per_s"],
                         "speedup": speedup, "efficiency": speedup / n})
    return rows


def draw(rows: list[dict], path: str | Path, title: str) -> None:
    """Speedup and efficiency against ranks, saved reproducibly (same rows -> same PNG bytes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from distkit.records import save_figure

    fig, (ax_speed, ax_eff) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("strong", "o"), ("weak", "s")):
        mine = [r for r in rows if r["mode"] == mode]
        ranks = [r["ranks"] for r in mine]
        ax_speed.plot(ranks, [r["speedup"] for r in mine], marker=marker, label=f"{mode} scaling")
        ax_eff.plot(ranks, [100 * r["efficiency"] for r in mine], marker=marker, label=f"{mode} scaling")
    ranks = sorted({r["ranks"] for r in rows})
    ax_speed.plot(ranks, [n / ranks[0] for n in ranks], "k--", label="ideal")
    ax_eff.axhline(100, color="k", linestyle="--", label="ideal")
    ax_speed.set(xlabel="ranks", ylabel="throughput speedup (tokens/s)", xticks=ranks, title="speedup")
    ax_eff.set(xlabel="ranks", ylabel="efficiency (%)", xticks=ranks, ylim=(0, 110), title="efficiency")
    for ax in (ax_speed, ax_eff):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def newest_run(records: list[dict]) -> list[dict]:
    """The records of the last benchmark run in a results file (runs append; each has a run id)."""
    run_id = records[-1]["config"]["run_id"]
    return [r for r in records if r["config"].get("run_id") == run_id]


def size_name(record: dict) -> str:
    """The preset a record's model is (its ``model`` field), or its shape when it is none of them."""
    shape = {k: v for k, v in (record["model"] or {}).items() if k != "arch"}
    names = [name for name, cfg in GPT_PRESETS.items() if cfg.to_dict() == shape]
    return names[0] if names else f"{shape.get('n_layer')}-layer, {shape.get('n_embd')}-wide"


def title(records: list[dict]) -> str:
    r = records[0]
    return f"DDP scaling: {size_name(r)} model, {r['backend']}, {r['machine']['device_name']}"


def readme_figures(out_dir: Path) -> str:
    """The README's scaling table and plot, from the committed run in records/ddp_benchmark.jsonl."""
    from distkit.records import machine_label

    records = newest_run(read_records(HERE / "records" / "ddp_benchmark.jsonl"))
    rows = summarize(records)
    draw(rows, Path(out_dir) / "ddp_scaling.png", title(records))
    r = records[0]
    lines = ["| mode | ranks | global batch | step (s) | tokens/s | speedup | efficiency |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {x['mode']} | {x['ranks']} | {x['global_batch']} | {x['step_s']:.3f} | {x['tokens_per_s']:,.0f} "
              f"| {x['speedup']:.2f}x | {100 * x['efficiency']:.0f}% |" for x in rows]
    where = machine_label(r["machine"], r["backend"])
    return ("\n".join(lines) + "\n\n![DDP strong and weak scaling: speedup and efficiency against ranks]"
            "(ddp_scaling.png)\n\n"
            f"<sub>{size_name(r)} model; step time = median timed step of the slowest rank; "
            f"speedup and efficiency against 1 rank; measured on {where}, "
            f"torch {r['torch_version']}, {r['timestamp'][:10]} (run {r['config']['run_id']} in "
            f"[records/ddp_benchmark.jsonl](records/ddp_benchmark.jsonl)).</sub>\n")


def driver(args) -> None:
    check_outputs(None, args, files=["results", "plot"])  # before the first job, not after the last
    args.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    # One backend and device for every world size, chosen for the largest: with "auto" each job
    # would choose alone, and on a 2-GPU node a 1- and 2-rank NCCL job would be compared with a
    # 4-rank gloo/CPU job in one table. Forcing NCCL with too few GPUs fails here, before any job;
    # the table's title names the backend and device every job used.
    args.backend, args.device = choose_backend_and_device(
        args.backend, args.device, max(args.world_sizes), gpu_count=visible_gpus())
    for world_size in args.world_sizes:
        launch(args, world_size)
    records = [r for r in read_records(args.results) if r["config"].get("run_id") == args.run_id]
    if {(r["backend"], r["device"]) for r in records} != {(args.backend, args.device)}:
        raise UsageError(f"a job ran on another backend/device than {args.backend}/{args.device}")
    rows = summarize(records)
    machine = records[0]["machine"]["device_name"]
    print(f"\nDDP scaling, {args.model_size} model, {records[0]['backend']} on {machine} "
          f"(torch {records[0]['torch_version']})")
    print(f"{'mode':<7}{'ranks':>6}{'global batch':>14}{'step (s)':>10}{'tokens/s':>11}{'speedup':>9}"
          f"{'efficiency':>12}")
    for r in rows:
        print(f"{r['mode']:<7}{r['ranks']:>6}{r['global_batch']:>14}{r['step_s']:>10.3f}"
              f"{r['tokens_per_s']:>11,.0f}{r['speedup']:>8.2f}x{100 * r['efficiency']:>11.0f}%")
    draw(rows, args.plot, title(records))
    print(f"records: {args.results} (run {args.run_id}) | plot: {shown_path(args.plot)}")


def main(argv=None) -> None:
    """The driver launches one job per world size and prints the table; each job runs as ``--worker``."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    run_main(main)
