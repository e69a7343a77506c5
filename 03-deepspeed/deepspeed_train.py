"""Chapter 03: train the shared transformer with DeepSpeed ZeRO, stage chosen by a JSON config.

DeepSpeed wraps the model and optimizer in an *engine*: ``engine(x)`` runs the forward (gathering
ZeRO-3 parameter shards as layers need them), ``engine.backward(loss)`` reduces (stage 0-1) or
reduce-scatters (stage 2-3) the gradients, ``engine.step()`` updates this rank's partition and
re-assembles the weights. Checkpoints are written per rank with ``save_checkpoint`` and read back
with ``load_checkpoint``; at the end the ZeRO shards are consolidated into one fp32 state dict
(``zero_to_fp32``) that loads into the plain ``TinyGPT``.

    torchrun --nproc_per_node=4 03-deepspeed/deepspeed_train.py --deepspeed_config 03-deepspeed/configs/zero3_config.json
    deepspeed --num_gpus=4 03-deepspeed/deepspeed_train.py --deepspeed_config 03-deepspeed/configs/zero2_config.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save
from distkit.flags import non_negative_float, non_negative_int, positive_float, positive_int
from distkit.logs import progress, setup_logging
from distkit.models import (TinyGPT, TokenTask, add_gpt_args, gpt_config_from_args, lm_loss,
                            rank_slice)

from ds_common import (EVAL_BATCH, EVAL_STEP, check_batch, import_deepspeed, load_ds_config,
                       release_engine, resolve_auto, strategy_name, zero_harness, zero_stage)


def parse_args():
    parser = ArgumentParser(
        description="Train the shared transformer with DeepSpeed ZeRO (stage 0-3, optional CPU offload). "
                    "Launch with torchrun or the deepspeed launcher; runs on CPU (gloo) or GPUs (NCCL).",
        epilog="example: torchrun --nproc_per_node=4 03-deepspeed/deepspeed_train.py "
               "--deepspeed_config 03-deepspeed/configs/zero3_config.json")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                        default="03-deepspeed/configs/zero2_config.json",
                        help="DeepSpeed JSON config; its zero_optimization block picks the stage "
                             "(default: 03-deepspeed/configs/zero2_config.json)")
    parser.add_argument("--steps", type=positive_int, default=200, help="optimizer steps to reach (default: 200)")
    parser.add_argument("--global-batch-size", type=positive_int, default=None,
                        help="sequences per optimizer step across all ranks (default: the config's "
                             "train_batch_size)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.01,
                        help="AdamW weight decay (default: 0.01, torch's default)")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=2, help="untimed harness warm-up steps (default: 2)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="DeepSpeed checkpoint folder (default: checkpoints/ch03/<strategy>)")
    parser.add_argument("--save-every", type=non_negative_int, default=0,
                        help="also save a checkpoint every N steps (default: only at the end)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                        help="continue from a checkpoint in --checkpoint-dir: the latest one, or TAG "
                             "(e.g. step100)")
    parser.add_argument("--fp32-out", default=None,
                        help="consolidated fp32 state dict of the final model "
                             "(default: checkpoints/ch03/<strategy>_fp32.pt)")
    parser.add_argument("--results", default="runs/ch03_results.jsonl",
                        help="harness records are appended here (default: runs/ch03_results.jsonl)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)  # the deepspeed launcher passes it; LOCAL_RANK is used
    add_gpt_args(parser)
    add_runtime_args(parser)
    return parser.parse_args()


def consolidate_fp32(engine, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """One fp32 state dict of the whole model, rebuilt from the ZeRO shards on disk (rank 0 only).

    Stages 1-3 keep the fp32 weights only as per-rank partitions in the optimizer files;
    ``zero_to_fp32`` stitches them together. Stage 0 has no partitions: the module is the model.
    """
    if zero_stage(engine.config) == 0:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)


def main():
    args = parse_args()
    with distributed(args) as ctx:
        log = setup_logging(ctx.rank)
        ds_config = load_ds_config(args.deepspeed_config, args.global_batch_size)
        micro_batch = check_batch(ds_config, ctx.world_size, args.deepspeed_config)
        strategy = strategy_name(ds_config)
        checkpoint_dir = Path(args.checkpoint_dir or f"checkpoints/ch03/{strategy}")
        fp32_out = Path(args.fp32_out or f"checkpoints/ch03/{strategy}_fp32.pt")
        deepspeed = import_deepspeed(ctx.device)

        cfg = gpt_config_from_args(args)
        task = TokenTask(cfg, seed=args.seed)
        torch.manual_seed(args.seed)
        model = TinyGPT(cfg)  # same seed on every rank -> same initial weights
        param_count = sum(p.numel() for p in model.parameters())
        # "auto" buckets are sized from the model (Ψ / N elements, not DeepSpeed's 2 GB default);
        # "auto" overlap and pinning follow the device (on for CUDA, off for CPU).
        resolve_auto(ds_config, ctx.device, param_count, ctx.world_size)
        # A torch optimizer as the client optimizer: DeepSpeed wraps it (ZeRO partitions its state)
        # instead of JIT-compiling FusedAdam / DeepSpeedCPUAdam.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        # The process group already exists (distkit): DeepSpeed adopts it instead of creating one.
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                               dist_init_required=False)
        log.info(f"{strategy} | world size {ctx.world_size} | backend {ctx.backend} | device "
                 f"{engine.device} | {param_count:,} parameters | global batch "
                 f"{ds_config['train_batch_size']} = {ctx.world_size} ranks x {micro_batch}")

        start_step = 0
        if args.resume is not None:
            tag = None if args.resume == "latest" else args.resume
            if not (checkpoint_dir / "latest").exists() and tag is None:
                raise UsageError(f"--resume: no checkpoint in {checkpoint_dir} (no 'latest' file)")
            if tag is not None and not (checkpoint_dir / tag).is_dir():
                raise UsageError(f"--resume {tag}: {checkpoint_dir / tag} does not exist")
            # Every rank reads its own shard of weights and optimizer state, plus the client state.
            try:
                loaded_path, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag)
            except (RuntimeError, KeyError, ValueError, AssertionError) as exc:  # another model/stage/world
                raise UsageError(f"--resume: the checkpoint in {checkpoint_dir} does not fit this model, "
                                 f"config or world size ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:150] if str(exc) else ''})") from None
            if loaded_path is None:
                raise UsageError(f"--resume: could not load a checkpoint from {checkpoint_dir}")
            start_step = int(client_state["step"])
            log.info(f"resumed from {loaded_path} at step {start_step}")

        harness = zero_harness(ctx, args, engine, optimizer, ds_config, args.deepspeed_config, param_count)

        def save(step: int) -> str:
            tag = f"step{step}"
            # Collective: every rank writes its partition (zero_pp_rank_*), rank 0 the module file.
            engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"step": step})
            log.info(f"saved checkpoint {checkpoint_dir / tag}")
            return tag

        engine.train()
        batch = ds_config["train_batch_size"]
        last_tag, loss_value = None, float("nan")
        for step in progress(range(start_step, args.steps), ctx.rank, desc=strategy):
            inputs, targets = task.global_batch(step, batch)
            inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(engine.device)
            targets = rank_slice(targets, ctx.rank, ctx.world_size).to(engine.device)
            with harness.step(samples=batch, tokens=batch * cfg.seq_len):
                loss = lm_loss(engine(inputs), targets)
                engine.backward(loss)  # gradients reduced (stage 0-1) or reduce-scattered (2-3)
                engine.step()          # each rank updates its partition; weights re-assembled
            loss_value = loss.item()
            if ctx.is_main and (step + 1) % 50 == 0:
                log.info(f"step {step + 1}/{args.steps} | loss {loss_value:.4f} (rank 0's micro-batch)")
            if args.save_every and (step + 1) % args.save_every == 0:
                last_tag = save(step + 1)
        if last_tag != f"step{args.steps}":
            last_tag = save(args.steps)

        # Evaluate through the engine (ZeRO-3 gathers weights for the forward on every rank).
        engine.eval()
        eval_inputs, eval_targets = task.global_batch(EVAL_STEP, EVAL_BATCH)
        with torch.no_grad():
            eval_loss = lm_loss(engine(eval_inputs.to(engine.device)), eval_targets.to(engine.device)).item()

        dist.barrier()  # every shard is on disk before rank 0 reads them all
        if ctx.is_main:
            state_dict = consolidate_fp32(engine, checkpoint_dir, last_tag)
            atomic_save({"model": state_dict, "gpt_config": cfg.to_dict(), "strategy": strategy,
                         "steps": args.steps, "eval_loss": eval_loss, "seed": args.seed}, fp32_out)
            log.info(f"consolidated fp32 state dict ({len(state_dict)} tensors) -> {fp32_out}")
        record = harness.finish(args.results, extra={"eval_loss": eval_loss, "final_loss": loss_value,
                                                      "steps": args.steps, "resumed_from": start_step})
        if ctx.is_main:
            metrics = record["metrics"]
            state = metrics["model_state_bytes_per_rank"][0]
            rate = metrics["tokens_per_s"] or 0.0
            log.info(f"done: eval loss {eval_loss:.4f} after {args.steps} steps | rank 0 model state "
                     f"{sum(state.values()) / 2**20:.2f} MiB (params {state['params'] / 2**20:.2f}, grads "
                     f"{state['grads'] / 2**20:.2f}, optimizer {state['optimizer'] / 2**20:.2f}) | "
                     f"{rate:,.0f} tokens/s | record -> {args.results}")
        release_engine(engine)


if __name__ == "__main__":
    run_main(main)
