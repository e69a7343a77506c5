"""Chapter 01: a production DDP training template (the shared transformer on the token task).

What it adds to ddp_mnist.py, each piece in the open below: flags whose defaults a YAML/JSON config
file can replace, read by rank 0 and broadcast so every rank trains with the same settings; gradient
accumulation with ``no_sync()`` (one all-reduce per optimizer step); AMP (bf16 autocast, fp16 +
GradScaler on GPU), clipping, an opt-in LR scaling rule and DDP's knobs; atomic checkpoints every N
steps holding everything an exact resume needs (model, optimizer, scheduler, data position, every
rank's RNG) and automatic resume from the newest good one, so ``torchrun --max-restarts`` can restart
a crashed job; per-rank log files; ``@record`` so a crash names the failing rank.

    torchrun --standalone --nproc_per_node=4 --max-restarts=3 01-ddp-basics/ddp_training.py \\
        --config 01-ddp-basics/ddp_training.yaml
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save, load_model_state, remove_stale_temporaries, safe_load
from distkit.flags import (
    add_bucket_arg,
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    check_value,
    make_optimizer,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.runtime import launched_rank
from distkit.text import make_task


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Production DDP template: the shared transformer on the token task with "
                            "gradient accumulation, AMP, atomic checkpoints and automatic resume. "
                            "Launch with torchrun.",
                            epilog="example: torchrun --standalone --nproc_per_node=4 --max-restarts=3 "
                                   "01-ddp-basics/ddp_training.py --config 01-ddp-basics/ddp_training.yaml")
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON file of flag values (keys: flag names, e.g. "
                        "global_batch_size); they replace the defaults, flags on the command line still win")
    add_model_args(parser)
    train = add_training_args(parser, steps=200, global_batch_size=32, lr=3e-3, grad_accum_steps=1, helps={
        "global_batch_size": "sequences per optimizer step, summed over all ranks and micro-batches",
        "grad_accum_steps": "micro-batches per optimizer step; all but the last skip the all-reduce",
        "lr": "peak learning rate (before --lr-scaling)"})
    add_optimizer_arg(train)
    for flag, kind, default, text in [
            ("--base-batch-size", positive_int, 32, "the global batch --lr was tuned for"),
            ("--lr-warmup-steps", non_negative_int, 10, "linear LR warm-up steps, then cosine decay to 10%%"),
            ("--weight-decay", non_negative_float, 0.01, "AdamW weight decay"),
            ("--grad-clip", non_negative_float, 1.0, "clip the global gradient norm to this; 0 = off"),
            ("--num-sequences", positive_int, 4096, "sequences in the token task: one epoch")]:
        train.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    train.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                       help="scale --lr with the global batch B: linear (x B/base) or sqrt (x sqrt(B/base)), "
                            "base = --base-batch-size (default: none)")
    train.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                       help="bf16 = autocast (CPU or GPU), fp16 = autocast + GradScaler (GPU) (default: fp32)")
    ddp = parser.add_argument_group("DDP")
    add_bucket_arg(ddp, 25.0, help_extra=": fewer, larger all-reduces vs earlier overlap with backward")
    for flag, text in [("--static-graph", "the set of used parameters never changes (enables optimisations)"),
                       ("--find-unused-parameters", "handle parameters that get no gradient (costs a graph walk)"),
                       ("--gradient-as-bucket-view", "gradients alias DDP's buckets (saves one gradient-sized copy)")]:
        ddp.add_argument(flag, action=argparse.BooleanOptionalAction, default=False, help=text + " (default: off)")
    checkpoints = add_checkpoint_args(parser, checkpoint_dir="checkpoints/ddp_training", resume="latest")
    logs = parser.add_argument_group("logging")
    for group, flag, default, text in [
            (checkpoints, "--checkpoint-every", 50, "save a checkpoint every N steps and at the end"),
            (checkpoints, "--keep-checkpoints", 3, "how many recent checkpoints to keep"),
            (logs, "--log-every", 10, "log the loss every N steps")]:
        group.add_argument(flag, type=positive_int, default=default, metavar="N", help=f"{text} (default: {default})")
    logs.add_argument("--log-dir", default="runs/ddp_training",
                      help="every rank's rank<N>.log and rank 0's train.log (default: runs/ddp_training)")
    parser.config_keys = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    add_runtime_args(parser)  # backend, device, timeout, seed: the launch's business, not the config file's
    return parser


def config_file_defaults(parser: ArgumentParser, path: str) -> dict:
    """The config file's values, each checked by its flag's own argparse type or choices."""
    try:
        text = Path(path).read_text()
        loaded = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - missing file, YAML/JSON syntax error
        raise UsageError(f"config file {path}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"config file {path} must be a mapping of flag names to values")
    defaults = {}
    for key, value in loaded.items():
        action = parser.config_keys.get(str(key).replace("-", "_"))
        if action is None:
            raise UsageError(f"config file {path}: unknown key '{key}' (known keys: {', '.join(parser.config_keys)})")
        if isinstance(action, argparse.BooleanOptionalAction) and not isinstance(value, bool):
            raise UsageError(f"config file {path}: '{key}' must be true or false, got {value!r}")
        if action.choices is not None and value not in action.choices:
            raise UsageError(f"config file {path}: '{key}' must be one of {list(action.choices)}, got {value!r}")
        if action.type is None and action.choices is None and not isinstance(value, (str, bool)):
            raise UsageError(f"config file {path}: '{key}' must be a string, got {value!r}")
        if action.type is not None and not (value is None and action.default is None):
            try:
                value = check_value(action.dest, value, action.type)
            except UsageError as exc:
                raise UsageError(f"config file {path}: {exc}") from None
        defaults[action.dest] = value
    return defaults


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags on every rank (a bad one is argparse's one line, before any process group). Rank 0 alone
    reads --config, whose values become the flags' defaults; share_args sends its settings everywhere."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config and launched_rank() == 0:
        parser.set_defaults(**config_file_defaults(parser, args.config))
        args = parser.parse_args(argv)  # the flags typed on the command line still win
    return args


def world_size_error(args: argparse.Namespace, ctx) -> str | None:
    """What only the job's size and device can tell is wrong with the settings (None: nothing)."""
    per_step = ctx.world_size * args.grad_accum_steps
    for wrong, message in [
            (args.global_batch_size % per_step, f"--global-batch-size {args.global_batch_size} must divide by "
                                                f"world size x --grad-accum-steps = {per_step}"),
            (args.num_sequences < args.global_batch_size, f"--num-sequences {args.num_sequences} must be at least "
             f"--global-batch-size {args.global_batch_size} (an epoch holds at least one step)"),
            (args.precision == "fp16" and ctx.device.type != "cuda",
             "--precision fp16 needs a GPU (GradScaler); use bf16 on CPU")]:
        if wrong:
            return message
    try:
        model_config_from_args(args)  # the width must split into the heads
    except UsageError as exc:
        return str(exc)
    return None


def share_args(args: argparse.Namespace, ctx) -> argparse.Namespace:
    """Rank 0 broadcasts its settings (or what is wrong with them): no rank trains with others (a
    config file that differs between nodes, or is missing on one)."""
    payload = [(world_size_error(args, ctx) or vars(args)) if ctx.is_main else None]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str):
        raise UsageError(payload[0])
    return argparse.Namespace(**payload[0])


def scaled_lr(args) -> float:
    """Bigger batches average more samples per step; the linear / sqrt rules raise the LR to match."""
    ratio = args.global_batch_size / args.base_batch_size
    return args.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[args.lr_scaling]


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress_ = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_)))


# ---- checkpoints: everything an exact resume needs, written atomically by rank 0 ----

def rng_state(device: torch.device) -> dict:
    """This rank's generators (numpy's key as a tensor, which weights_only loading accepts); on CUDA
    this rank's GPU only (get_rng_state_all would open a context on every GPU of the node)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and isinstance(state.get("cuda"), torch.Tensor):
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(args, ctx, log, step, model, optimizer, scheduler, scaler, losses) -> None:
    """Every rank contributes its RNG state; rank 0 writes one file (the replicas are identical)."""
    rngs = [None] * ctx.world_size
    dist.all_gather_object(rngs, rng_state(ctx.device))
    if not ctx.is_main:
        return
    steps_per_epoch = args.num_sequences // args.global_batch_size
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
             "step": step, "epoch": step // steps_per_epoch, "step_in_epoch": step % steps_per_epoch,
             # the data "sampler": batch k of either task is a pure function of k, so its state is a position
             "data_position": {"sequences_consumed": step * args.global_batch_size,
                               "num_sequences": args.num_sequences},
             "rng_per_rank": rngs, "world_size": ctx.world_size, "config": vars(args), "loss_history": losses}
    path = Path(args.checkpoint_dir) / f"step_{step:06d}.pt"
    atomic_save(state, path)  # temporary file, fsync, rename: a crash never leaves half a step_*.pt
    for old in sorted(Path(args.checkpoint_dir).glob("step_*.pt"))[:-args.keep_checkpoints]:
        old.unlink()
    log.info(f"checkpoint {path}")


def find_resume_checkpoint(args, log) -> str | None:
    """Rank 0: ``none``; a PATH (must load); or ``latest``, the newest ``step_*.pt`` that loads. An empty
    or unreadable one is skipped with a warning: under ``torchrun --max-restarts`` every restart runs
    this code, and an error would fail them all alike (a save's temporaries never match step_*.pt)."""
    if args.resume == "none":
        return None
    if args.resume != "latest":
        safe_load(args.resume)  # one error line if it does not load
        return args.resume
    for path in sorted(Path(args.checkpoint_dir).glob("step_*.pt"), reverse=True):
        try:
            safe_load(path)
            return str(path)
        except UsageError as exc:
            log.warning(f"skipping {exc}; trying an older checkpoint")
    return None


def resume(args, ctx, log, model, optimizer, scheduler, scaler) -> tuple[int, list[float]]:
    """Restore every piece of state; returns (next step, loss history). Rank 0 decides (an error travels
    to every rank instead of leaving them waiting) after removing the torn temporaries of killed saves."""
    path = [None]
    if ctx.is_main:
        for stale in remove_stale_temporaries(args.checkpoint_dir):
            log.warning(f"removed {stale}: a temporary file left by a save that was killed mid-write")
        try:
            path[0] = find_resume_checkpoint(args, log)
        except UsageError as exc:
            path[0] = UsageError(str(exc))
    dist.broadcast_object_list(path, src=0)
    if isinstance(path[0], UsageError):
        raise path[0]
    if path[0] is None:
        return 0, []
    state = safe_load(path[0])  # every rank reads it: a shared filesystem, as clusters have
    load_model_state(model.module, state["model"], path[0])
    for part, holder in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        holder.load_state_dict(state[part])
    if state["world_size"] == ctx.world_size:
        set_rng_state(state["rng_per_rank"][ctx.rank], ctx.device)
    else:
        log.warning(f"checkpoint was written by {state['world_size']} ranks, now {ctx.world_size}: "
                    "RNG streams restart from the seed")
    log.info(f"resumed from {path[0]} at step {state['step']} (epoch {state['epoch']}, "
             f"step {state['step_in_epoch']} in epoch)")
    return state["step"], list(state["loss_history"])


def accumulate_gradients(model: DDP, inputs: torch.Tensor, targets: torch.Tensor, k: int, autocast=None,
                         scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """Forward and backward over ``k`` micro-batches of this rank's share; returns their mean loss.

    All but the last run under ``no_sync()``: gradients accumulate locally and DDP all-reduces once, in
    the last backward. Each loss is divided by k, so the sum is the gradient of the mean loss over the
    share (without it k times too large: tests/test_ch01_negative.py runs this script without it).
    """
    step_loss = torch.zeros((), device=inputs.device)
    chunks = list(zip(inputs.chunk(k), targets.chunk(k)))
    for i, (x, y) in enumerate(chunks):
        with nullcontext() if i == len(chunks) - 1 else model.no_sync():
            with autocast or nullcontext():
                loss = lm_loss(model(x), y) / len(chunks)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        step_loss += loss.detach()
    return step_loss


def train(args: argparse.Namespace) -> None:
    wall_start = time.perf_counter()
    with distributed(args) as ctx:
        args = share_args(args, ctx)
        check_outputs(ctx, args, files=["results"], dirs=["checkpoint_dir", "log_dir"])
        log = setup_logging(ctx.rank, os.path.join(args.log_dir, "train.log"), per_rank_dir=args.log_dir)
        gpt = model_config_from_args(args)
        micro = args.global_batch_size // ctx.world_size // args.grad_accum_steps
        log.info(f"world size {ctx.world_size} | backend {ctx.backend} | device {ctx.device.type} | "
                 f"global batch {args.global_batch_size} = {ctx.world_size} ranks x {args.grad_accum_steps} "
                 f"micro-batches x {micro} | lr {scaled_lr(args):g} | {args.precision}")

        model = build_model(gpt).to(ctx.device)  # same seed on every rank; DDP broadcasts rank 0's anyway
        model = DDP(model, device_ids=ctx.device_ids, bucket_cap_mb=args.bucket_cap_mb,
                    static_graph=args.static_graph, find_unused_parameters=args.find_unused_parameters,
                    gradient_as_bucket_view=args.gradient_as_bucket_view)
        optimizer = make_optimizer(args.optimizer, model.parameters(), scaled_lr(args), weight_decay=args.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, args.lr_warmup_steps, args.steps))
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.precision == "fp16")
        autocast = (nullcontext() if args.precision == "fp32" else torch.autocast(
            ctx.device.type, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float16))

        start_step, losses = resume(args, ctx, log, model, optimizer, scheduler, scaler)
        harness = Harness(ctx, "ddp", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                          config={"global_batch_size": args.global_batch_size,
                                  "precision": args.precision, "optimizer": args.optimizer,
                                  "grad_accum_steps": args.grad_accum_steps,
                                  "bucket_cap_mb": args.bucket_cap_mb, "static_graph": args.static_graph,
                                  "gradient_as_bucket_view": args.gradient_as_bucket_view})
        task = make_task(gpt, args, num_sequences=args.num_sequences)

        for step in progress(range(start_step, args.steps), ctx.rank, initial=start_step,
                             total=args.steps, desc="train"):
            inputs, targets = (rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device)
                               for t in task.global_batch(step, args.global_batch_size))
            with harness.step(samples=args.global_batch_size, tokens=args.global_batch_size * gpt.seq_len):
                optimizer.zero_grad(set_to_none=True)
                step_loss = accumulate_gradients(model, inputs, targets, args.grad_accum_steps, autocast, scaler)
                scaler.unscale_(optimizer)  # clip the true gradients, not fp16-scaled ones
                if args.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
            dist.all_reduce(step_loss)  # the job's mean loss, for logging (outside the measured step)
            losses.append(step_loss.item() / ctx.world_size)
            done = step + 1
            if done % args.log_every == 0 or done == args.steps:
                log.info(f"step {done}/{args.steps} | loss {losses[-1]:.4f} | lr {scheduler.get_last_lr()[0]:.2e}")
            if done % args.checkpoint_every == 0 or done == args.steps:
                save_checkpoint(args, ctx, log, done, model, optimizer, scheduler, scaler, losses)
        if start_step >= args.steps:
            log.info(f"checkpoint already at step {start_step} >= --steps {args.steps}: nothing to train "
                     "(pass --resume none or another --checkpoint-dir to start over)")
            return
        record_ = harness.finish(args.results, extra={"final_loss": losses[-1], "loss_history": losses,
                                                      "resumed_from_step": start_step})
        if ctx.is_main:
            rate = record_["metrics"]["tokens_per_s"]
            comm = record_["metrics"]["comm_per_step"].get("all_reduce", {})
            log.info(f"all-reduce per step: {comm.get('calls', 0):.0f} calls, {comm.get('bytes', 0) / 2**20:.2f} MiB "
                     f"| median step {record_['metrics']['step_time_s_median'] or 0:.3f} s")
            log.info(f"done: loss {losses[-1]:.4f} after {args.steps} steps (resumed at {start_step}) | "
                     f"wall time {time.perf_counter() - wall_start:.1f} s | "
                     f"{f'{rate:,.0f} tokens/s' if rate else 'too few steps to time'} | "
                     f"world size {ctx.world_size} | backend {ctx.backend} ({ctx.device.type})")


@record  # an uncaught exception is written where torchrun reports it, naming the failing rank
def main() -> None:
    run_main(lambda: train(parse_args()))


if __name__ == "__main__":
    main()
