"""Chapter 02: checkpoint an FSDP2 model two ways, and resume on a different number of ranks.

* **full state dict**: every shard is all-gathered into whole tensors, offloaded to CPU, and rank 0
  writes one ordinary ``torch.save`` file (atomically). Simple and portable, but rank 0 must hold
  the whole model and optimizer in memory, and everyone waits for one writer.
* **sharded (DCP)**: ``torch.distributed.checkpoint`` has every rank write only its own shards, in
  parallel, plus a metadata file that records which slice of which tensor is where. Loading
  reshards: a checkpoint written by 4 ranks loads into 2 (or 8), because each rank just reads the
  slices its new shards cover.

    torchrun --nproc_per_node=4 02-fsdp/fsdp_checkpoint.py --steps 100                 # train, save both
    torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --steps 200 --resume dcp    # 4 -> 2 ranks
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import (atomic_save, atomic_write_json, dcp_errors_as_usage_errors,
                                remove_stale_temporaries, safe_load)
from distkit.flags import non_negative_int, positive_float, positive_int
from distkit.logs import progress, setup_logging
from distkit.models import (TinyGPT, TokenTask, add_gpt_args, gpt_config_from_args, lm_loss,
                            rank_slice)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Train the small GPT with FSDP2, save a full and a sharded (DCP) checkpoint, and "
                    "resume from either, on any number of ranks.",
        epilog="example: torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --steps 200 --resume dcp")
    parser.add_argument("--steps", type=non_negative_int, default=100,
                        help="train until this global step (a resumed run continues from the saved step; "
                             "0 saves the initial model) (default: 100)")
    parser.add_argument("--resume", choices=["none", "dcp", "full"], default="none",
                        help="start from the sharded (dcp) or the full checkpoint (default: none)")
    parser.add_argument("--save", choices=["both", "dcp", "full", "none"], default="both",
                        help="which checkpoints to write at the end (default: both)")
    parser.add_argument("--dcp-dir", default="checkpoints/fsdp_dcp",
                        help="folder of the sharded DCP checkpoint (default: checkpoints/fsdp_dcp)")
    parser.add_argument("--full-checkpoint", default="checkpoints/fsdp_full.pt",
                        help="file of the full checkpoint (default: checkpoints/fsdp_full.pt)")
    parser.add_argument("--dump-loaded", default=None, metavar="PATH",
                        help="rank 0 saves the full model state right after loading (to check a resume)")
    parser.add_argument("--global-batch-size", type=positive_int, default=32,
                        help="sequences per optimizer step across all ranks (default: 32)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--log-every", type=positive_int, default=25,
                        help="log the loss every N steps (default: 25)")
    add_gpt_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    gpt_config_from_args(args)  # a width that does not split into the heads: one error line
    return args


def read_trainer_state(folder, cfg):
    """The step (and who saved it) from a DCP folder's trainer_state.json, checked against this model."""
    meta_path = os.path.join(folder, "trainer_state.json")
    if not os.path.exists(meta_path):  # written last: its absence means no (complete) checkpoint
        hint = (f"; a save interrupted while swapping folders left the previous one in {folder}.old"
                if os.path.exists(os.path.join(f"{folder}.old", "trainer_state.json")) else "")
        raise UsageError(f"no complete DCP checkpoint in {folder} (trainer_state.json is missing){hint}")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: not JSON (a damaged or foreign file)
        raise UsageError(f"{meta_path} is unreadable ({type(exc).__name__}: {exc})") from None
    step = meta.get("step") if isinstance(meta, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"{meta_path} is not trainer state of fsdp_checkpoint.py (no valid 'step')")
    saved_model = meta.get("model")
    if saved_model is not None and saved_model != cfg.to_dict():
        differing = sorted(k for k in set(saved_model) | set(cfg.to_dict())
                           if saved_model.get(k) != cfg.to_dict().get(k))
        detail = ", ".join(f"{k} {saved_model.get(k)} there, {cfg.to_dict().get(k)} here" for k in differing[:3])
        raise UsageError(f"DCP checkpoint {folder} is from a different model ({detail})")
    return meta


def load_dcp(model, optimizer, folder, cfg):
    """Read a sharded checkpoint into this job's shards, whatever world size wrote it."""
    meta = read_trainer_state(folder, cfg)  # every rank reads it, so every rank fails alike
    # get_state_dict gives the *sharded* layout of this job; dcp.load fills it in place from files
    # that may have been cut for another world size.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    # A checkpoint that does not fit (saved by another model before trainer_state.json named the
    # model, or a missing or damaged shard file) fails on every rank inside dcp.load with a
    # CheckpointException, a BaseException that `except Exception` would let through as a wall of
    # tracebacks.
    with dcp_errors_as_usage_errors(folder):
        dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta


def check_full_checkpoint(ckpt, model, path):
    """Raise a UsageError unless ``ckpt`` is a full checkpoint of this script for this model."""
    if not isinstance(ckpt, dict) or not {"model", "optim", "step"} <= set(ckpt):
        raise UsageError(f"{path} is not a checkpoint of fsdp_checkpoint.py")
    step = ckpt["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"{path} is not a checkpoint of fsdp_checkpoint.py (step {step!r})")
    if not isinstance(ckpt["model"], dict) or not isinstance(ckpt["optim"], dict) or not all(
            isinstance(t, torch.Tensor) for t in ckpt["model"].values()):
        raise UsageError(f"{path} is not a checkpoint of fsdp_checkpoint.py (model/optim are not state dicts)")
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # global shapes
    found = {name: tuple(t.shape) for name, t in ckpt["model"].items()}
    if found != expected:
        differing = sorted(set(found) ^ set(expected)) or sorted(k for k in found if found[k] != expected[k])
        raise UsageError(f"full checkpoint {path} is from a different model (differs at {differing[:3]})")


def load_full(model, optimizer, path, ctx):
    """Rank 0 reads the one-file checkpoint; set_*_state_dict broadcast and shard it to everyone."""
    # Only rank 0 touches the file (on a real cluster the others may not even see it). It checks the
    # file before the collective load and tells everyone: a problem found inside the load would
    # leave the other ranks waiting in a broadcast until the timeout.
    verdict = [None, 0]  # (problem, step)
    ckpt = {"model": {}, "optim": {}}
    if ctx.is_main:
        try:
            ckpt = safe_load(path)  # to CPU memory: a full checkpoint may not fit on one GPU
            check_full_checkpoint(ckpt, model, path)
            verdict[1] = ckpt["step"]
        except UsageError as exc:
            verdict[0] = str(exc)
    # broadcast_object_list pickles into a tensor on `device`: this rank's GPU under NCCL.
    dist.broadcast_object_list(verdict, src=0, device=ctx.device)
    if verdict[0]:
        raise UsageError(verdict[0])
    # Two calls, not set_state_dict: given an empty model dict (ranks != 0), set_state_dict would
    # treat the call as optimizer-only on those ranks and skip the model broadcast rank 0 is in.
    # Rank 0's tensors are on the CPU; torch copies each one to the device of the model's (or the
    # optimizer's) shards before broadcasting it, so NCCL gets GPU tensors.
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, ckpt["model"], options=from_rank0)
    set_optimizer_state_dict(model, optimizer, ckpt["optim"], options=from_rank0)
    return {"step": int(verdict[1])}


def save_dcp(model, optimizer, folder, step, cfg, ctx):
    """Every rank writes its own shards in parallel into a fresh folder; rank 0 then swaps it in.

    Writing beside the old checkpoint and renaming at the end means a crash mid-save leaves the
    previous checkpoint whole (the same idea as atomic_save, for a folder written by many ranks).
    """
    staging = f"{folder}.tmp"
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging)
    if ctx.is_main:  # dcp.save returns on every rank once all shards and the metadata are written
        # Recording the model's shape lets a resume name the difference before DCP reads a byte.
        atomic_write_json({"step": step, "world_size": ctx.world_size, "model": cfg.to_dict()},
                         os.path.join(staging, "trainer_state.json"))
        shutil.rmtree(f"{folder}.old", ignore_errors=True)
        if os.path.exists(folder):
            os.replace(folder, f"{folder}.old")
        os.replace(staging, folder)
        shutil.rmtree(f"{folder}.old", ignore_errors=True)
    dist.barrier()


def save_full(model, optimizer, path, step, ctx):
    """All-gather every shard (collective), offload to CPU; rank 0 alone writes one file."""
    # cpu_offload=True: each gathered tensor moves to CPU memory at once, on rank 0 only (the others
    # get an empty dict), so neither a GPU nor the other ranks ever hold the whole model.
    model_state, optim_state = get_state_dict(model, optimizer, options=FULL)
    if ctx.is_main:
        atomic_save({"model": model_state, "optim": optim_state, "step": step}, path)


def folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        train_and_checkpoint(args, ctx)


def train_and_checkpoint(args, ctx):
    """Resume (optionally), train to --steps, save the chosen checkpoints."""
    log = setup_logging(ctx.rank)
    if args.global_batch_size % ctx.world_size:
        raise UsageError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"{ctx.world_size} ranks")
    cfg = gpt_config_from_args(args)
    if ctx.is_main:  # leftovers of writers killed mid-save (their PIDs are in the names)
        folders = {os.path.dirname(os.path.abspath(p)) for p in (args.full_checkpoint, args.dump_loaded) if p}
        removed = [path for folder in sorted(folders | {args.dcp_dir})
                   for path in remove_stale_temporaries(folder)]
        if removed:
            log.info(f"removed {len(removed)} temporary file(s) left by an interrupted save: "
                     f"{', '.join(p.name for p in removed[:3])}")
    model = TinyGPT(cfg).to(ctx.device)
    # An explicit mesh on this job's device type: fully_shard's default mesh would use the host's
    # accelerator whatever --device says (CUDA on any GPU host).
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start_step = 0
    if args.resume != "none":
        t0 = time.perf_counter()
        meta = (load_dcp(model, optimizer, args.dcp_dir, cfg) if args.resume == "dcp"
                else load_full(model, optimizer, args.full_checkpoint, ctx))
        start_step = meta["step"]
        saved_by = f" (saved by {meta['world_size']} ranks)" if "world_size" in meta else ""
        log.info(f"resumed from {args.resume} checkpoint at step {start_step}{saved_by} into "
                 f"{ctx.world_size} ranks in {time.perf_counter() - t0:.2f} s")
        if args.dump_loaded:
            loaded = get_model_state_dict(model, options=FULL)
            if ctx.is_main:
                atomic_save(loaded, args.dump_loaded)
    log.info(f"world size {ctx.world_size} | {args.model_size} GPT | steps {start_step} -> {args.steps}")

    task = TokenTask(cfg, seed=args.seed)
    for step in progress(range(start_step, args.steps), ctx.rank, desc="train"):
        inputs, targets = task.global_batch(step, args.global_batch_size)
        inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)
        targets = rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            dist.all_reduce(loss := loss.detach().clone())
            log.info(f"step {step:4d} | loss {loss.item() / ctx.world_size:.4f}")

    end_step = max(start_step, args.steps)
    if args.save in ("both", "dcp"):
        t0 = time.perf_counter()
        save_dcp(model, optimizer, args.dcp_dir, end_step, cfg, ctx)
        if ctx.is_main:
            files = sorted(os.listdir(args.dcp_dir))
            log.info(f"sharded DCP checkpoint: {args.dcp_dir} | {len(files)} files "
                     f"({', '.join(files)}) | {folder_bytes(args.dcp_dir):,} B | "
                     f"{time.perf_counter() - t0:.2f} s")
    if args.save in ("both", "full"):
        t0 = time.perf_counter()
        save_full(model, optimizer, args.full_checkpoint, end_step, ctx)
        dist.barrier()
        if ctx.is_main:
            log.info(f"full checkpoint (rank 0 only): {args.full_checkpoint} | "
                     f"{os.path.getsize(args.full_checkpoint):,} B | {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    run_main(main)
