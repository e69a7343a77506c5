"""Chapter 03: train the shared transformer with DeepSpeed ZeRO, stage chosen by a JSON config.

DeepSpeed wraps the model and optimizer in an *engine*: ``engine(x)`` runs the forward (gathering
ZeRO-3 parameter shards as layers need them), ``engine.backward(loss)`` reduces (stage 0-1) or
reduce-scatters (stage 2-3) the gradients, ``engine.step()`` updates this rank's partition and
re-assembles the weights. Checkpoints are written per rank with ``save_checkpoint`` and read back
with ``load_checkpoint``; at the end the ZeRO shards are consolidated into one fp32 state dict
(``zero_to_fp32``) that loads into the plain model, without DeepSpeed (``--save``).

    torchrun --nproc_per_node=4 03-deepspeed/deepspeed_train.py \\
        --deepspeed_config 03-deepspeed/configs/zero3_config.json
    deepspeed --num_gpus=4 03-deepspeed/deepspeed_train.py \\
        --deepspeed_config 03-deepspeed/configs/zero3_config.json --steps 300 --resume latest
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save
from distkit.deepspeed import (
    EVAL_BATCH,
    EVAL_STEP,
    check_batch,
    import_deepspeed,
    load_ds_config,
    release_engine,
    resolve_auto,
    strategy_name,
    zero_harness,
    zero_stage,
)
from distkit.flags import (
    add_checkpoint_args,
    add_training_args,
    non_negative_float,
    positive_int,
    save_path,
    saved_at,
    saves_after,
)
from distkit.harness import append_record, describe_model
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task


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
    training = add_training_args(parser, steps=200, global_batch_size=None, lr=3e-3,
                                 results="runs/ch03_results.jsonl",
                                 helps={"steps": "train until this optimizer step (a resumed run "
                                                 "continues from its checkpoint's step)",
                                        "lr": "AdamW learning rate"})
    # The global batch is the config's train_batch_size unless this flag overrides it.
    training.add_argument("--global-batch-size", type=positive_int, default=None,
                          help="sequences per optimizer step across all ranks (default: the config's "
                               "train_batch_size)")
    training.add_argument("--weight-decay", type=non_negative_float, default=0.01,
                          help="AdamW weight decay (default: 0.01, torch's default)")
    add_checkpoint_args(parser, save="checkpoints/ch03/{strategy}_fp32.pt",
                        checkpoint_dir="checkpoints/ch03/{strategy}", resume="none", save_every=True,
                        helps={"save_every": "also save every N steps: a checkpoint in --checkpoint-dir and "
                                             "--save's consolidated weights as FILE.stepN.pt"})
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)  # the deepspeed launcher passes it; LOCAL_RANK is used
    add_model_args(parser)
    add_runtime_args(parser)
    return parser.parse_args()


def checkpoint_to_resume(resume: str, checkpoint_dir: Path) -> tuple[Path, str] | None:
    """``--resume`` as DeepSpeed's ``load_checkpoint(load_dir, tag)`` takes it: ``none`` -> None,
    ``latest`` -> the tag named in ``checkpoint_dir/latest`` (DeepSpeed writes that file once
    every rank has saved), a PATH -> its folder's parent and name (e.g. checkpoints/ch03/zero3/step100)."""
    if resume == "none":
        return None
    if resume == "latest":
        latest = checkpoint_dir / "latest"
        if not latest.is_file():
            raise UsageError(f"--resume latest: no checkpoint in {checkpoint_dir} (no 'latest' file)")
        return checkpoint_dir, latest.read_text().strip()
    path = Path(resume)
    if not path.is_dir():
        raise UsageError(f"--resume {resume}: no such checkpoint folder (give none, latest or the path "
                         f"of one checkpoint, e.g. {checkpoint_dir / 'step100'})")
    return path.parent, path.name


def consolidate_fp32(engine, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """One fp32 state dict of the whole model, rebuilt from the ZeRO shards on disk (rank 0 only).

    Stages 1-3 keep the fp32 weights only as per-rank partitions in the optimizer files;
    ``zero_to_fp32`` stitches them together. Stage 0 has no partitions: the module is the model.
    """
    if zero_stage(engine.config) == 0:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)


def checkpoint_folder(template: str, strategy: str) -> Path:
    """``--checkpoint-dir`` with its ``{strategy}`` placeholder filled in."""
    try:
        return Path(template.format(strategy=strategy))
    except (KeyError, IndexError, ValueError) as exc:
        raise UsageError(f"--checkpoint-dir {template!r}: unknown placeholder {exc} "
                         "(known: {strategy})") from None


def resume_engine(engine, resume_from: tuple[Path, str] | None, log) -> int:
    """Load the checkpoint ``resume_from`` (folder, tag) into ``engine``; the step to go on from (0
    without one)."""
    if resume_from is None:
        return 0
    load_dir, tag = resume_from
    # Every rank reads its own shard of weights and optimizer state, plus the client state.
    try:
        loaded_path, client_state = engine.load_checkpoint(str(load_dir), tag=tag)
    except (RuntimeError, KeyError, ValueError, AssertionError) as exc:  # another model/stage/world
        raise UsageError(f"--resume: the checkpoint {load_dir / tag} does not fit this model, "
                         f"config or world size ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:150] if str(exc) else ''})") from None
    if loaded_path is None:
        raise UsageError(f"--resume: could not load a checkpoint from {load_dir / tag}")
    start_step = int(client_state["step"])
    log.info(f"resumed from {loaded_path} at step {start_step}")
    return start_step


def save_checkpoint(engine, checkpoint_dir: Path, step: int, log) -> str:
    """Save the engine's checkpoint after ``step`` steps under the tag ``step<step>``; return the tag."""
    tag = f"step{step}"
    # Collective: every rank writes its partition (zero_pp_rank_*), rank 0 the module file.
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"step": step})
    log.info(f"saved checkpoint {checkpoint_dir / tag}")
    return tag


def save_during_training(ctx, engine, checkpoint_dir: Path, step: int, fp32_out, strategy: str, log) -> str:
    """A checkpoint during training and, with ``--save``, rank 0's consolidated fp32 copy of it."""
    tag = save_checkpoint(engine, checkpoint_dir, step, log)
    dist.barrier()  # every shard is on disk before rank 0 reads them all
    if ctx.is_main and fp32_out is not None:
        atomic_save({"model": consolidate_fp32(engine, checkpoint_dir, tag), "strategy": strategy,
                     "steps": step}, saved_at(fp32_out, step))
        log.info(f"consolidated fp32 state dict -> {saved_at(fp32_out, step)}")
    return tag


def evaluate(engine, task) -> float:
    """The loss on the evaluation batch, through the engine (ZeRO-3 gathers weights for the forward on
    every rank)."""
    engine.eval()
    eval_inputs, eval_targets = task.global_batch(EVAL_STEP, EVAL_BATCH)
    with torch.no_grad():
        return lm_loss(engine(eval_inputs.to(engine.device)), eval_targets.to(engine.device)).item()


def log_done(log, args, record, eval_loss: float) -> None:
    """The run's summary: eval loss, rank 0's model state bytes by kind, throughput."""
    metrics = record["metrics"]
    state = metrics["model_state_bytes_per_rank"][0]
    rate = metrics["tokens_per_s"] or 0.0
    log.info(f"done: eval loss {eval_loss:.4f} after {args.steps} steps | rank 0 model state "
             f"{sum(state.values()) / 2**20:.2f} MiB (params {state['params'] / 2**20:.2f}, grads "
             f"{state['grads'] / 2**20:.2f}, optimizer {state['optimizer'] / 2**20:.2f}) | "
             f"{rate:,.0f} tokens/s | record -> {args.results}")


def main():
    """Initialise the engine, train (checkpointing as asked), report: deepspeed.initialize, then the
    engine's own loop, as the README walks it."""
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"], dirs=["checkpoint_dir"])
        log = setup_logging(ctx.rank)
        ds_config = load_ds_config(args.deepspeed_config, args.global_batch_size)
        micro_batch = check_batch(ds_config, ctx.world_size, args.deepspeed_config)
        strategy = strategy_name(ds_config)
        checkpoint_dir = checkpoint_folder(args.checkpoint_dir, strategy)
        fp32_out = save_path(args.save, strategy=strategy)
        resume_from = checkpoint_to_resume(args.resume, checkpoint_dir)
        deepspeed = import_deepspeed(ctx.device)

        cfg = model_config_from_args(args)
        task = make_task(cfg, args)
        torch.manual_seed(args.seed)
        model = build_model(cfg)  # same seed on every rank -> same initial weights
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

        start_step = resume_engine(engine, resume_from, log)
        harness = zero_harness(ctx, engine, optimizer, ds_config, args.deepspeed_config,
                               param_count=param_count, warmup_steps=args.warmup_steps, lr=args.lr)

        engine.train()
        batch = ds_config["train_batch_size"]
        last_tag, loss_value, losses = None, float("nan"), []
        for step in progress(range(start_step, args.steps), ctx.rank, desc=strategy):
            inputs, targets = task.global_batch(step, batch)
            inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(engine.device)
            targets = rank_slice(targets, ctx.rank, ctx.world_size).to(engine.device)
            with harness.step(samples=batch, tokens=batch * cfg.seq_len):
                loss = lm_loss(engine(inputs), targets)
                engine.backward(loss)  # gradients reduced (stage 0-1) or reduce-scattered (2-3)
                engine.step()          # each rank updates its partition; weights re-assembled
            loss_value = loss.item()
            job_loss = loss.detach().clone()  # the job's mean loss, outside the measured step
            dist.all_reduce(job_loss)
            losses.append(job_loss.item() / ctx.world_size)
            if ctx.is_main and (step + 1) % 50 == 0:
                log.info(f"step {step + 1}/{args.steps} | loss {loss_value:.4f} (rank 0's micro-batch)")
            if saves_after(args, step):
                last_tag = save_during_training(ctx, engine, checkpoint_dir, step + 1, fp32_out, strategy, log)
        # The measurement ends with the training steps: the final checkpoint and the evaluation (the
        # whole eval batch on every rank) are not training steps. The record gets the eval loss and is
        # written once the evaluation has run.
        record = harness.finish(None, extra={"eval_loss": None, "final_loss": loss_value, "losses": losses,
                                             "steps": args.steps, "resumed_from": start_step})
        if last_tag != f"step{args.steps}":
            last_tag = save_checkpoint(engine, checkpoint_dir, args.steps, log)
        eval_loss = evaluate(engine, task)

        dist.barrier()  # every shard is on disk before rank 0 reads them all
        if ctx.is_main and fp32_out is not None:
            state_dict = consolidate_fp32(engine, checkpoint_dir, last_tag)
            atomic_save({"model": state_dict, "model_config": describe_model(cfg), "strategy": strategy,
                         "steps": args.steps, "eval_loss": eval_loss, "seed": args.seed}, fp32_out)
            log.info(f"consolidated fp32 state dict ({len(state_dict)} tensors) -> {fp32_out}")
        if ctx.is_main:
            record["eval_loss"] = eval_loss
            append_record(args.results, record)
            log_done(log, args, record, eval_loss)
        release_engine(engine)


if __name__ == "__main__":
    run_main(main)
