"""Chapter 05: gradient accumulation with DDP, and what ``no_sync()`` saves.

When the batch you want does not fit in memory, run it as k micro-batches and add up their
gradients before one optimizer step:

    effective batch = micro-batch per rank x accumulation steps k x world size

Each micro-batch's loss is divided by k, so the summed gradient is the gradient of the mean loss
over the whole effective batch -- the same update as one k-times larger batch. DDP would all-reduce
the gradients after *every* backward; inside ``model.no_sync()`` it only accumulates locally, so
with ``no_sync()`` on the first k-1 micro-batches there is one all-reduce per optimizer step
instead of k:

    micro-batch      1         2         3         4 (last)
    sync every     bwd+AR    bwd+AR    bwd+AR    bwd+AR    step      k all-reduces of all gradients
    no_sync        bwd       bwd       bwd       bwd+AR    step      1 all-reduce

By default the script trains twice from the same initial weights -- with ``no_sync`` and with an
all-reduce every micro-batch -- and prints the bytes per optimizer step the harness counted for each,
and how far apart the two trained models are (they should be equal up to rounding).

    torchrun --nproc_per_node=4 05-advanced/gradient_accumulation.py --grad-accum-steps 4
"""
from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, add_runtime_args, distributed, run_main, seed_everything
from distkit.checkpoint import atomic_save
from distkit.flags import (
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    make_optimizer,
    positive_int,
    require_steps,
    save_path,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task


def parse_args():
    parser = ArgumentParser(
        description="Train the small GPT with DDP and gradient accumulation, with and without "
                    "no_sync(), and compare the communication per optimizer step.",
        epilog="example: torchrun --nproc_per_node=4 05-advanced/gradient_accumulation.py --grad-accum-steps 8")
    add_model_args(parser)
    training = add_training_args(parser, steps=10, global_batch_size=None, grad_accum_steps=4,
                                 helps={"results": "one harness record per mode appended here"})
    training.add_argument("--micro-batch-size", type=positive_int, default=4,
                          help="sequences per rank per micro-batch (default: 4)")
    add_optimizer_arg(training)
    parser.add_argument("--sync", choices=["no_sync", "every_micro_batch", "both"], default="both",
                        help="no_sync: all-reduce on the last micro-batch only; every_micro_batch: after "
                             "each backward; both: train once each and compare (default: both)")
    add_checkpoint_args(parser, save="checkpoints/gradient_accumulation_{sync}.pt")
    add_runtime_args(parser)
    args = parser.parse_args()
    require_steps(parser, args, timed=False, why="the bytes each optimizer step all-reduces")
    return args


def train(args, ctx, cfg, use_no_sync: bool):
    """Train from fresh weights; return (harness record on rank 0, trained state dict)."""
    k = args.grad_accum_steps
    effective_batch = args.micro_batch_size * k * ctx.world_size
    seed_everything(args.seed)  # both modes start from the same weights
    model = DDP(build_model(cfg).to(ctx.device), device_ids=ctx.device_ids)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    sync_name = "no_sync" if use_no_sync else "every_micro_batch"
    harness = Harness(ctx, "ddp", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      config={"global_batch_size": effective_batch,
                              "precision": "fp32", "grad_accum_steps": k,
                              "micro_batch_size": args.micro_batch_size, "sync": sync_name, "lr": args.lr,
                              "optimizer": args.optimizer})
    task = make_task(cfg, args)
    for step in progress(range(args.steps), ctx.rank, desc=sync_name):
        inputs, targets = task.global_batch(step, effective_batch)
        inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)    # this rank's k micro-batches
        targets = rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
        with harness.step(samples=effective_batch, tokens=effective_batch * cfg.seq_len):
            optimizer.zero_grad(set_to_none=True)
            for micro, (x, y) in enumerate(zip(inputs.chunk(k), targets.chunk(k))):
                last = micro == k - 1
                # Skip DDP's all-reduce on all but the last micro-batch: gradients just accumulate
                # in .grad; the last backward all-reduces the accumulated sum once.
                with model.no_sync() if use_no_sync and not last else contextlib.nullcontext():
                    loss = lm_loss(model(x), y) / k  # 1/k: the sum of k grads = grad of the mean
                    loss.backward()
            optimizer.step()
    record = harness.finish(args.results, extra={"sync": sync_name})
    return record, {name: t.detach().cpu() for name, t in model.module.state_dict().items()}


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        cfg = model_config_from_args(args)
        k = args.grad_accum_steps
        log.info(f"effective batch = micro-batch {args.micro_batch_size} x accumulation {k} x world size "
                 f"{ctx.world_size} = {args.micro_batch_size * k * ctx.world_size} sequences per optimizer step")
        modes = {"no_sync": [True], "every_micro_batch": [False], "both": [True, False]}[args.sync]
        results = {}
        for use_no_sync in modes:
            record, state = train(args, ctx, cfg, use_no_sync)
            if ctx.is_main:
                name = record["config"]["sync"]
                path = save_path(args.save, sync=name, strategy="ddp")
                if path:
                    atomic_save({"model": state, "config": cfg.to_dict(), "strategy": "ddp"}, path)
                results[name] = (record, state, path)
        if not ctx.is_main:
            return
        log.info(f"{'mode':<18} {'all-reduce calls':>16} {'MiB / step':>11} {'median step':>12}")
        for name, (record, _, _) in results.items():
            reduce = record["metrics"]["comm_per_step"].get("all_reduce", {"calls": 0, "bytes": 0})
            median = record["metrics"]["step_time_s_median"]
            log.info(f"{name:<18} {reduce['calls']:>16.0f} {reduce['bytes'] / 2**20:>11.2f} "
                     f"{(f'{median * 1000:.0f} ms' if median else 'n/a'):>12}")
        if len(results) == 2:
            a, b = results["no_sync"][1], results["every_micro_batch"][1]
            diff = max((a[n] - b[n]).abs().max().item() for n in a)
            saved = [results[n][0]["metrics"]["comm_per_step"]["all_reduce"]["bytes"] for n in results]
            log.info(f"no_sync moves {saved[1] / saved[0]:.1f}x fewer bytes (k = {k}); "
                     f"max |weight difference| between the two modes: {diff:.1e}")
        paths = ", ".join(r[2] for r in results.values() if r[2])
        log.info(f"saved {paths or 'nothing (--save none)'} | records appended to {args.results}")


if __name__ == "__main__":
    run_main(main)
