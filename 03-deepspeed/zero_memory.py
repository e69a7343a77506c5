"""Chapter 03: ZeRO stages 0-3 (and 3 with CPU offload) on the same model and ranks, in one job.

For each config the script builds a fresh copy of the transformer (same seed), trains it a few steps
with DeepSpeed, and records with the shared harness the bytes of parameters, gradients and optimizer
state each rank holds. Rank 0 then writes one record (``--record``: command, machine, torch
version, date) holding a table that sets those measurements next to

* the formula for fp32 training with the run's optimizer (``--optimizer``: AdamW, or plain SGD) as
  DeepSpeed runs it (``distkit.theory.zero_fp32_state_bytes``),
* the ZeRO paper's mixed-precision formula (2Ψ + 2Ψ + KΨ, K = 12; ``distkit.theory.zero_paper_bytes``), and
* DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``,
  ``estimate_zero3_model_states_mem_needs``),

and checks that every stage ends with the same weights (max |difference| against the first config).
``readme_section`` draws the README's tables and plot from the committed record
(``03-deepspeed/records/zero_memory.jsonl``), never from a run:

    torchrun --nproc_per_node=4 03-deepspeed/zero_memory.py --record 03-deepspeed/records/zero_memory.jsonl
    python -m distkit.records render 03-deepspeed
"""
from __future__ import annotations

import os
import shlex
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main, theory
from distkit.checkpoint import atomic_save
from distkit.deepspeed import (
    check_batch,
    clean_slate,
    import_deepspeed,
    load_ds_config,
    release_engine,
    resolve_auto,
    strategy_name,
    zero_harness,
    zero_stage,
)
from distkit.flags import (
    OPTIMIZER_CLASSES,
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    make_optimizer,
    save_path,
)
from distkit.logs import setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.records import provenance, upsert
from distkit.text import make_task

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIGS = ["zero0", "zero1", "zero2", "zero3", "zero3_offload"]
# The committed record the README's memory tables and plot are drawn from (readme_section). A run
# writes it only when asked to (--record 03-deepspeed/records/zero_memory.jsonl).
RECORD = Path(__file__).resolve().parent / "records" / "zero_memory.jsonl"


def parse_args():
    parser = ArgumentParser(
        description="Run ZeRO stages 0-3 and ZeRO-3 + CPU offload on the same model in one job; "
                    "measure per-rank model-state bytes and compare with the formulas and "
                    "DeepSpeed's estimators, in one record that the README's tables and plot are "
                    "drawn from.",
        epilog="example: torchrun --nproc_per_node=4 03-deepspeed/zero_memory.py")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                        help="config names in 03-deepspeed/configs (<name>_config.json) or JSON paths "
                             f"(default: {' '.join(DEFAULT_CONFIGS)})")
    add_training_args(parser, steps=8, global_batch_size=32, lr=3e-3, results="runs/ch03_results.jsonl",
                      helps={"steps": "optimizer steps per config", "lr": "learning rate"})
    add_optimizer_arg(parser)
    parser.add_argument("--record", default="runs/ch03_zero_memory.jsonl", metavar="FILE",
                        help="the run's record (JSON Lines; the record named zero_memory in it is replaced). "
                             "The README's tables and plot are drawn from the committed "
                             "03-deepspeed/records/zero_memory.jsonl, which the maintainer re-records with "
                             "python -m distkit.records run --keep (default: runs/ch03_zero_memory.jsonl)")
    add_checkpoint_args(parser, save="none", helps={  # --save: one file per config
        "save": "rank 0 writes each config's final full fp32 weights here, {strategy} filled in "
                "(e.g. runs/ch03_params/{strategy}.pt); 'none' skips it"})
    add_model_args(parser)
    add_runtime_args(parser)
    parser.set_defaults(model_size="small")
    return parser.parse_args()


def config_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix == ".json" else CONFIG_DIR / f"{name}_config.json"


def full_weights(deepspeed, engine) -> dict[str, torch.Tensor]:
    """Every rank's copy of the full weights (ZeRO-3: all-gather the partitions for a moment), in
    host memory: kept on the GPU, each config's copy would count in the next configs' peaks."""
    params = dict(engine.module.named_parameters())
    if zero_stage(engine.config) == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
    return {name: p.detach().to("cpu", copy=True) for name, p in params.items()}


def train_one_config(deepspeed, ctx, args, cfg, task, path: Path):
    """Train a fresh model under one config; return (harness record on rank 0, final weights, weak
    reference to the engine)."""
    ds_config = load_ds_config(path, args.global_batch_size)
    check_batch(ds_config, ctx.world_size, path)
    torch.manual_seed(args.seed)  # identical initial weights for every config
    model = build_model(cfg)
    param_count = sum(p.numel() for p in model.parameters())
    resolve_auto(ds_config, ctx.device, param_count, ctx.world_size)  # buckets sized Ψ / N, not 2 GB
    if args.optimizer == "sgd":
        # ZeRO (stages 1-3) refuses a client optimizer outside DeepSpeed's tested list (Adam, AdamW,
        # Adagrad, ...) unless the config allows it. Plain SGD asks nothing of ZeRO that AdamW does
        # not: it updates this rank's fp32 partition with lr x its gradient, and has no state to shard.
        ds_config["zero_allow_untested_optimizer"] = True
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           dist_init_required=False)
    harness = zero_harness(ctx, engine, optimizer, ds_config, path, param_count=param_count,
                           warmup_steps=args.warmup_steps, lr=args.lr)
    harness.config["optimizer"] = args.optimizer  # beside zero_harness's lr
    batch = args.global_batch_size
    for step in range(args.steps):
        inputs, targets = task.global_batch(step, batch)
        inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(engine.device)
        targets = rank_slice(targets, ctx.rank, ctx.world_size).to(engine.device)
        with harness.step(samples=batch, tokens=batch * cfg.seq_len):
            loss = lm_loss(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
    record = harness.finish(args.results, extra={"final_loss": loss.item(), "steps": args.steps})
    # Only after the measurement: at ZeRO-3 gathering the weights materialises the whole model on
    # every rank for a moment, which no training step does.
    weights = full_weights(deepspeed, engine)
    release_engine(engine)  # freed for good by the next clean_slate's gc.collect()
    return record, weights, weakref.ref(engine)


def largest_layer_params(model: torch.nn.Module) -> int:
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def build_rows(records, weights_by_strategy, cfg, world_size, optimizer):
    """Table rows: measured bytes next to the formulas and DeepSpeed's estimators."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    psi = records[0]["param_count"]
    largest = largest_layer_params(build_model(cfg))
    reference_name = records[0]["strategy"]
    reference = weights_by_strategy[reference_name]
    rows = []
    for record in records:
        stage = record["config"]["zero_stage"]
        offloaded = record["strategy"].endswith("offload")
        per_rank = record["metrics"]["model_state_bytes_per_rank"]
        measured = {key: max(r[key] for r in per_rank) for key in ("params", "grads", "optimizer")}
        predicted = theory.zero_fp32_state_bytes(stage, psi, world_size, optimizer)
        estimator = None
        if stage == 2:
            estimator = estimate_zero2_model_states_mem_needs(psi, world_size, 1, cpu_offload=False)[1]
        elif stage == 3:
            # With offload the estimator's device figure is only the largest layer: the rest is in CPU RAM.
            estimator = estimate_zero3_model_states_mem_needs(
                psi, largest, world_size, 1, cpu_offload=offloaded, cpu_offload_params=offloaded,
                zero_init=False)[1]
        weights = weights_by_strategy[record["strategy"]]
        rows.append({
            "strategy": record["strategy"], "stage": stage, "offload": record["config"]["offload"],
            "measured": measured, "measured_total": sum(measured.values()),
            "predicted": predicted, "predicted_total": sum(predicted.values()),
            "ratio": sum(measured.values()) / sum(predicted.values()),
            "paper_mixed_precision_total": sum(theory.zero_paper_bytes(psi, world_size, stage).values()),
            "deepspeed_estimator_device_bytes": estimator,
            "peak_rss_bytes_max": max(record["metrics"]["peak_rss_bytes_per_rank"]),
            # GPU: torch.cuda.max_memory_allocated over the training steps (model state + buckets +
            # activations + gathered layers); CPU: what peak_memory_kind says (MemTracker's peak of
            # the instrumented step, or the process's peak RSS).
            "peak_memory_bytes_max": max(record["metrics"]["peak_memory_bytes_per_rank"]),
            "peak_memory_kind": record["metrics"]["peak_memory_kind"],
            "engine_settings": record["config"]["engine_settings"],
            "step_time_s_median": record["metrics"]["step_time_s_median"],
            "comm_per_step": record["metrics"]["comm_per_step"],
            "max_abs_diff_vs_" + reference_name: max((weights[k] - reference[k]).abs().max().item()
                                                     for k in reference),
        })
    return {"param_count": psi, "world_size": world_size, "largest_layer_params": largest,
            "reference": reference_name, "machine": records[0]["machine"]["device_name"],
            "backend": records[0]["backend"], "optimizer": optimizer, "rows": rows}


MIB = 2**20


def launch_command(world_size: int) -> str:
    """The command line of this run as a reader would type it (torchrun's own flags are not in
    sys.argv: the world size stands for them)."""
    script = shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    return f"torchrun --nproc_per_node={world_size} {script}" if world_size > 1 else f"python {script}"


def memory_table(table) -> str:
    """The measured model state per rank next to the formulas and DeepSpeed's estimators."""
    lines = ["| strategy | params | grads | optimizer | measured total | fp32 formula | measured / formula "
             "| paper (mixed precision) | DeepSpeed estimator | step time (s) | max diff vs "
             f"{table['reference']} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in table["rows"]:
        m = row["measured"]
        estimator = row["deepspeed_estimator_device_bytes"]
        step = row["step_time_s_median"]
        lines.append(
            f"| {row['strategy']} | {m['params'] / MIB:.3f} | {m['grads'] / MIB:.3f} | "
            f"{m['optimizer'] / MIB:.3f} | {row['measured_total'] / MIB:.3f} | "
            f"{row['predicted_total'] / MIB:.3f} | {row['ratio']:.3f} | "
            f"{row['paper_mixed_precision_total'] / MIB:.3f} | "
            f"{'-' if estimator is None else f'{estimator / MIB:.3f}'} | "
            f"{'-' if step is None else f'{step:.3f}'} | {row['max_abs_diff_vs_' + table['reference']]:.1e} |")
    return "\n".join(lines)


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def comm_table(table) -> str:
    """Collective calls and bytes per training step (rank 0), per strategy."""
    lines = ["| strategy | bucket / window size (elements) | " +
             " | ".join(f"{name} calls (MB)" for name in COLLECTIVES) + " |",
             "|---|---:|" + "---:|" * len(COLLECTIVES)]
    for row in table["rows"]:
        comm = row["comm_per_step"]
        cells = [f"{comm[name]['calls']:g} ({comm[name]['bytes'] / 1e6:.2f})" if name in comm else "-"
                 for name in COLLECTIVES]
        size = row["engine_settings"]["reduce_bucket_size"] if row["stage"] else None
        lines.append(f"| {row['strategy']} | {'-' if size is None else f'{size:,}'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def optimizer_name(table) -> str:
    """The optimizer the table's run trained with, as torch names it (a table without the field was
    recorded by a command without ``--optimizer``: the default, AdamW)."""
    return OPTIMIZER_CLASSES[table.get("optimizer", "adamw")]


def plot(table, path: Path, where: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from distkit.records import save_figure

    rows = table["rows"]
    names = [row["strategy"] for row in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rows)
    for key, color in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868")):
        values = [row["measured"][key] / MIB for row in rows]
        ax.bar([i - 0.2 for i in x], values, 0.4, bottom=bottom, color=color, label=f"measured {key}")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar([i + 0.2 for i in x], [row["predicted_total"] / MIB for row in rows], 0.4, color="#bbbbbb",
           edgecolor="black", label="fp32 formula (total)")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("model-state MiB per rank")
    ax.set_title(f"ZeRO model state per rank: Ψ = {table['param_count']:,}, N = {table['world_size']}, "
                 f"fp32 {optimizer_name(table)} ({where})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def render_record(record_path: Path, out_dir: Path) -> str:
    """The README's memory section body from one record file: tables, plot (``out_dir /
    zero_memory.png``) and the figures the prose quotes."""
    from distkit.records import machine_label, read_jsonl

    record = read_jsonl(record_path)[-1]
    table = record["table"]
    where = machine_label(record["machine"], record["backend"])
    plot(table, Path(out_dir) / "zero_memory.png", where)
    rss = [row["peak_rss_bytes_max"] / MIB for row in table["rows"]]
    state = [row["measured_total"] / MIB for row in table["rows"]]
    source = f"`{record['command']}`, {where}, torch {record['torch']}, {record['date']}"
    return "\n".join([
        f"Ψ = {table['param_count']:,} parameters, N = {table['world_size']} ranks, fp32, {optimizer_name(table)}, "
        f"{record['steps']} steps. Model-state bytes per rank in MiB (the largest rank); step time = median "
        f"timed step of the slowest rank, on a machine shared with other work.",
        "",
        memory_table(table),
        "",
        "![model state per rank](zero_memory.png)",
        "",
        "Collective calls per training step on rank 0 (counted by the harness; MB moved in brackets):",
        "",
        comm_table(table),
        "",
        f"Peak RSS per rank (the whole process: Python, torch, DeepSpeed and the model) was "
        f"{min(rss):.0f}-{max(rss):.0f} MiB, against {min(state):.1f}-{max(state):.1f} MiB of model state.",
        "",
        f"<sub>Recorded by {source}: [records/{record_path.name}](records/{record_path.name}).</sub>",
    ])


def readme_section(out_dir: Path) -> str:
    """Render mark of README.md: everything above, from the committed record."""
    return render_record(RECORD, out_dir)


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "record", "save"])
        log = setup_logging(ctx.rank)
        paths = [config_path(name) for name in args.configs]
        one_file = save_path(args.save, strategy="a") == save_path(args.save, strategy="b")
        if len(paths) > 1 and args.save != "none" and one_file:
            raise UsageError(f"--save {args.save}: several configs would overwrite one file; "
                             "put {strategy} in the path")
        for path in paths:  # check every config before training anything
            load_ds_config(path, args.global_batch_size)
        deepspeed = import_deepspeed(ctx.device)
        cfg = model_config_from_args(args)
        task = make_task(cfg, args)

        records, weights_by_strategy, previous = [], {}, None
        for path in paths:
            # Each config starts on a clean slate: the previous engine (a reference cycle) collected,
            # the CUDA cache emptied, the peak (GPU memory or CPU RSS) reset.
            clean_slate(ctx.device, previous, log)
            record, weights, previous = train_one_config(deepspeed, ctx, args, cfg, task, path)
            strategy = strategy_name(load_ds_config(path))
            if strategy in weights_by_strategy:
                raise UsageError(f"--configs: two configs are both {strategy}")
            weights_by_strategy[strategy] = weights
            if ctx.is_main:
                records.append(record)
                state = record["metrics"]["model_state_bytes_per_rank"][0]
                log.info(f"{strategy:>14}: rank 0 holds params {state['params']:,} B, grads "
                         f"{state['grads']:,} B, optimizer {state['optimizer']:,} B | loss "
                         f"{record['final_loss']:.4f}")
                out = save_path(args.save, strategy=strategy)
                if out is not None:
                    atomic_save(weights, out)
        dist.barrier()
        if ctx.is_main:
            table = build_rows(records, weights_by_strategy, cfg, ctx.world_size, args.optimizer)
            command = launch_command(ctx.world_size)
            # The machine as this run used it: a --device cpu run on a GPU host is labelled a CPU run.
            upsert(args.record, {"name": "zero_memory", **provenance(command, device=ctx.device),
                                 "backend": ctx.backend, "steps": args.steps, "table": table})
            if Path(args.record).resolve() == RECORD:
                log.info(f"wrote {args.record}; redraw the README table and plot with: "
                         f"python -m distkit.records render 03-deepspeed")
            else:
                log.info(f"wrote {args.record} (the README's tables and plot are drawn from "
                         f"{os.path.relpath(RECORD)})")


if __name__ == "__main__":
    run_main(main)
