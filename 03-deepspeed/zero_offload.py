"""Chapter 03: ZeRO-Offload -- move the optimizer (and ZeRO-3's parameter partitions) to CPU memory.

The script trains the same model twice in one job, with ZeRO-3 and with ZeRO-3 + offload, and shows
for each piece of model state *where* it lives and *when* it moves:

    piece of state                    ZeRO-3              ZeRO-3 + offload_param/offload_optimizer
    parameter partition (Ψ/N)         accelerator         host RAM; copied up and all-gathered per layer
    fp32 gradient partition (Ψ/N)     accelerator         host RAM; reduce-scattered, then copied down
    fp32 master + Adam m, v (3Ψ/N)    accelerator         host RAM; the optimizer step runs on the CPU

With offload, the accelerator only ever holds the layers being computed (gathered for a moment)
plus activations. On a GPU the saving is measured by ``torch.cuda.max_memory_allocated``. On the
CPU accelerator the "accelerator" *is* host RAM: nothing can move, the placement column shows
where DeepSpeed's offload buffers are, and what remains measurable is the cost in step time.

    torchrun --nproc_per_node=4 03-deepspeed/zero_offload.py
"""
from __future__ import annotations

import weakref
from pathlib import Path

import torch

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.deepspeed import (
    check_batch,
    clean_slate,
    import_deepspeed,
    load_ds_config,
    release_engine,
    resolve_auto,
    zero_harness,
    zero_stage,
)
from distkit.flags import add_training_args, require_steps
from distkit.harness import peak_memory_bytes
from distkit.logs import setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def parse_args():
    parser = ArgumentParser(
        description="Train with ZeRO-3 and with ZeRO-3 + CPU offload; show where parameters, "
                    "gradients and optimizer state live, what the accelerator saves and what it costs.",
        epilog="example: torchrun --nproc_per_node=4 03-deepspeed/zero_offload.py")
    parser.add_argument("--baseline-config", default=str(CONFIG_DIR / "zero3_config.json"),
                        help="config without offload (default: configs/zero3_config.json)")
    parser.add_argument("--offload-config", default=str(CONFIG_DIR / "zero3_offload_config.json"),
                        help="config with offload (default: configs/zero3_offload_config.json)")
    add_training_args(parser, steps=20, global_batch_size=32, lr=3e-3, results="runs/ch03_results.jsonl",
                      helps={"steps": "optimizer steps per config", "lr": "AdamW learning rate"})
    add_model_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args()
    require_steps(parser, args, timed=True, why="the step time offload costs")
    return args


def placement(engine, client_optimizer) -> dict[str, tuple[str, int]]:
    """(device, bytes) of each piece of this rank's model state, read from the tensors themselves."""
    partitions = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]  # below stage 3: full
    masters = [p for group in client_optimizer.param_groups for p in group["params"]]
    adam = [v for s in client_optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]
    grads = [p.grad for p in masters if p.grad is not None]

    def describe(tensors):
        devices = sorted({str(t.device) for t in tensors}) or ["-"]
        return ",".join(devices), sum(t.numel() * t.element_size() for t in tensors)

    return {"parameter partition": describe(partitions), "fp32 gradient partition": describe(grads),
            "fp32 master weights": describe(masters), "Adam exp_avg + exp_avg_sq": describe(adam)}


def train(deepspeed, ctx, args, cfg, task, config_path: str, log):
    """Train one config; return (record on rank 0, placement, accelerator peak, weak reference to
    the engine, which must be dead once the caller has collected garbage)."""
    ds_config = load_ds_config(config_path, args.global_batch_size)
    check_batch(ds_config, ctx.world_size, config_path)
    torch.manual_seed(args.seed)
    model = build_model(cfg)
    param_count = sum(p.numel() for p in model.parameters())
    resolve_auto(ds_config, ctx.device, param_count, ctx.world_size)  # pin_memory, overlap_comm, buckets
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # With offload_optimizer + a torch optimizer ("zero_force_ds_cpu_optimizer": false), DeepSpeed
    # keeps the fp32 partitions on the CPU and runs torch's AdamW there (no DeepSpeedCPUAdam build).
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           dist_init_required=False)
    # The harness starts the accelerator's peak window here, once the engine holds its state: on a
    # GPU everything ZeRO keeps on the device (or, with offload, does not) counts in the peak.
    harness = zero_harness(ctx, engine, optimizer, ds_config, config_path, param_count=param_count,
                           warmup_steps=args.warmup_steps, lr=args.lr)
    where = {}

    def snapshot(opt, *_):
        if not where:  # the first step only: placement never changes, and timed steps stay untouched
            where.update(placement(engine, opt))  # inside the optimizer step: grads still attached
    optimizer.register_step_post_hook(snapshot)

    batch = args.global_batch_size
    for step in range(args.steps):
        inputs, targets = task.global_batch(step, batch)
        inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(engine.device)
        targets = rank_slice(targets, ctx.rank, ctx.world_size).to(engine.device)
        with harness.step(samples=batch, tokens=batch * cfg.seq_len):
            loss = lm_loss(engine(inputs), targets)
            engine.backward(loss)  # grads reduce-scattered; with offload copied into host partitions
            engine.step()          # AdamW on the (host) partition; updated partition -> parameters
    accelerator_peak = peak_memory_bytes(ctx.device) if ctx.device.type == "cuda" else None
    record = harness.finish(args.results, extra={"final_loss": loss.item(), "steps": args.steps,
                                                 "placement": where,
                                                 "accelerator_peak_bytes_rank0": accelerator_peak})
    # destroy() releases DeepSpeed's hooks and buffers (and release_engine the module ZeRO-3 leaves
    # on a global stack); the engine itself is still held by a reference cycle (engine -> optimizer
    # -> step hooks -> engine) that only the garbage collector frees: the caller collects before
    # the next config's peak window opens.
    release_engine(engine)
    return record, where, accelerator_peak, weakref.ref(engine)


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results"])
        log = setup_logging(ctx.rank)
        for path in (args.baseline_config, args.offload_config):
            load_ds_config(path, args.global_batch_size)
        deepspeed = import_deepspeed(ctx.device)
        accelerator = deepspeed.get_accelerator().device_name()
        cfg = model_config_from_args(args)
        task = make_task(cfg, args)
        results, previous = [], None
        for path in (args.baseline_config, args.offload_config):
            if zero_stage(load_ds_config(path)) != 3:
                log.warning(f"{path} is not ZeRO-3: the parameter partition row is the full weights")
            # A clean slate for each config: collect the previous engine, return its cached GPU
            # blocks, reset the peak. Otherwise the first engine's device memory is still allocated
            # while the second one runs, and "saved by offload" comes out near zero.
            clean_slate(ctx.device, previous, log)
            *result, previous = train(deepspeed, ctx, args, cfg, task, path, log)
            results.append(tuple(result))
        if not ctx.is_main:
            return
        log.info(f"DeepSpeed accelerator: {accelerator} | rank 0 of {ctx.world_size} | "
                 f"{results[0][0]['param_count']:,} parameters")
        for record, where, peak in results:
            offload = record["config"]["offload"]
            on_host = {"parameter partition": offload["offload_param"] != "none"}
            for key in ("fp32 gradient partition", "fp32 master weights", "Adam exp_avg + exp_avg_sq"):
                on_host[key] = offload["offload_optimizer"] != "none"
            moved = sum(nbytes for key, (_, nbytes) in where.items() if on_host[key])
            metrics = record["metrics"]
            log.info(f"{record['strategy']}: step time {metrics['step_time_s_median']:.3f} s | "
                     f"final loss {record['final_loss']:.4f} | offload {offload}")
            for key, (device, nbytes) in where.items():
                side = "host (offloaded)" if on_host[key] else "accelerator"
                log.info(f"    {key:<27} {nbytes:>10,} B  on {device:<6} -> {side}")
            log.info(f"    model state kept off the accelerator: {moved:,} B per rank"
                     + (f" | accelerator peak {peak:,} B" if peak is not None else ""))
        base, off = results[0][0]["metrics"], results[1][0]["metrics"]
        if accelerator == "cpu":
            log.info("the CPU accelerator computes in host RAM: offloading moves bytes between two "
                     "buffers of the same memory, so it saves nothing here and costs "
                     f"{off['step_time_s_median'] / base['step_time_s_median']:.2f}x step time")
        else:
            log.info(f"accelerator peak memory saved by offload: {results[0][2] - results[1][2]:,} B per "
                     f"rank | step time x{off['step_time_s_median'] / base['step_time_s_median']:.2f}")


if __name__ == "__main__":
    run_main(main)
