"""Chapter 02: checkpoint an FSDP2 model two ways, and resume on a different number of ranks.

* **full state dict**: every shard is all-gathered into whole tensors, offloaded to CPU, and rank 0
  writes one ordinary ``torch.save`` file (atomically). Simple and portable, but rank 0 must hold
  the whole model and optimizer in memory, and everyone waits for one writer.
* **sharded (DCP)**: ``torch.distributed.checkpoint`` has every rank write only its own shards, in
  parallel, plus a metadata file that records which slice of which tensor is where. Loading
  reshards: a checkpoint written by 4 ranks loads into 2 (or 8), because each rank just reads the
  slices its new shards cover.

Both live in ``--checkpoint-dir`` (``DIR/full.pt`` and ``DIR/dcp/``); ``--resume latest`` takes the
newer, ``--resume PATH`` the one named (a folder is DCP, a file a full checkpoint):

    torchrun --nproc_per_node=4 02-fsdp/fsdp_checkpoint.py --steps 100                   # train, save both
    torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --steps 200 --resume latest   # 4 -> 2 ranks
    torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --steps 300 --resume checkpoints/fsdp/full.pt
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import (
    atomic_save,
    atomic_write_json,
    dcp_errors_as_usage_errors,
    remove_stale_temporaries,
    safe_load,
)
from distkit.flags import add_checkpoint_args, add_training_args, check_global_batch, make_optimizer, positive_int
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Train the small GPT with FSDP2, save a full and a sharded (DCP) checkpoint, and "
                    "resume from either, on any number of ranks.",
        epilog="example: torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --steps 200 --resume latest")
    add_training_args(
        parser, steps=100, global_batch_size=32, lr=3e-3, warmup_steps=None, results=None,
        zero_steps_allowed=True,  # 0 is meaningful here: save the initial model
        helps={"steps": "train until this global step (a resumed run continues from the saved step; "
                        "0 saves the initial model)", "lr": "AdamW learning rate"})
    parser.add_argument("--log-every", type=positive_int, default=25,
                        help="log the loss every N steps (default: 25)")
    checkpoints = add_checkpoint_args(parser, checkpoint_dir="checkpoints/fsdp", resume="none", helps={
        "resume": "start from: none, latest (the newer of DIR/dcp/ and DIR/full.pt in --checkpoint-dir) "
                  "or the PATH of one checkpoint: a DCP folder or a full .pt file"})
    checkpoints.add_argument("--checkpoint-format", choices=["both", "dcp", "full", "none"], default="both",
                             help="which checkpoints to write into --checkpoint-dir at the end: the "
                                  "sharded DIR/dcp/ folder, the one-file DIR/full.pt, both or none "
                                  "(default: both)")
    checkpoints.add_argument("--dump-loaded", default=None, metavar="PATH",
                             help="rank 0 saves the full model state right after loading (to check a resume)")
    add_model_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    model_config_from_args(args)  # a width that does not split into the heads: one error line
    return args


def dcp_folder(checkpoint_dir):
    """Where the sharded checkpoint lives in --checkpoint-dir."""
    return os.path.join(checkpoint_dir, "dcp")


def full_file(checkpoint_dir):
    """Where the one-file checkpoint lives in --checkpoint-dir."""
    return os.path.join(checkpoint_dir, "full.pt")


def dcp_is_complete(folder):
    return os.path.isfile(os.path.join(folder, "trainer_state.json"))  # written last


def resolve_resume(resume, checkpoint_dir):
    """``--resume`` as (format, path): ``("dcp", folder)`` or ``("full", file)``; None for ``none``.

    ``latest``: the newer of the complete checkpoints --checkpoint-dir holds (a ``both`` save writes
    the full file first and the DCP folder last, so after one the sharded checkpoint is taken). A
    PATH is a DCP folder if it is a folder, a full checkpoint if it is a file.
    """
    if resume == "none":
        return None
    if resume == "latest":
        dcp_dir, full = dcp_folder(checkpoint_dir), full_file(checkpoint_dir)
        found = []
        if dcp_is_complete(dcp_dir):
            found.append((os.path.getmtime(os.path.join(dcp_dir, "trainer_state.json")), 1, "dcp", dcp_dir))
        if os.path.isfile(full):
            found.append((os.path.getmtime(full), 0, "full", full))
        if found:
            return max(found)[2:]
        if os.path.isdir(dcp_dir) or os.path.isdir(f"{dcp_dir}.old"):
            return "dcp", dcp_dir  # an incomplete folder: read_trainer_state says what is missing
        raise UsageError(f"--resume latest: no checkpoint in {checkpoint_dir} (neither a complete "
                         f"{dcp_dir}/ nor {full})")
    if os.path.isdir(resume) or os.path.isdir(f"{resume}.old"):
        return "dcp", resume
    if os.path.exists(resume):
        return "full", resume
    raise UsageError(f"--resume {resume}: no such checkpoint (a DCP folder or a full .pt file)")


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
    meta = read_trainer_state(folder, cfg)  # every rank needs the step (rank 0 checked it first)
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
        check_outputs(ctx, args, files=["dump_loaded"],
                      dirs=["checkpoint_dir"] if args.checkpoint_format != "none" else [])
        train_and_checkpoint(args, ctx)


def train_and_checkpoint(args, ctx):
    """Resume (optionally), train to --steps, save the chosen checkpoints. One function on purpose: the
    checkpoint lesson (resume, train, save) reads top to bottom, as the README walks it."""
    log = setup_logging(ctx.rank)
    check_global_batch(args.global_batch_size, ctx.world_size)
    cfg = model_config_from_args(args)
    resume = decide_resume(args, ctx, cfg, log)  # (format, path) or None, agreed by every rank
    dcp_dir, full_path = dcp_folder(args.checkpoint_dir), full_file(args.checkpoint_dir)
    model = build_model(cfg).to(ctx.device)
    # An explicit mesh on this job's device type: fully_shard's default mesh would use the host's
    # accelerator whatever --device says (CUDA on any GPU host).
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer("adamw", model.parameters(), args.lr)

    start_step = 0
    if resume:
        kind, path = resume
        t0 = time.perf_counter()
        meta = load_dcp(model, optimizer, path, cfg) if kind == "dcp" else load_full(model, optimizer, path, ctx)
        start_step = meta["step"]
        saved_by = f" (saved by {meta['world_size']} ranks)" if "world_size" in meta else ""
        log.info(f"resumed from {kind} checkpoint {path} at step {start_step}{saved_by} into "
                 f"{ctx.world_size} ranks in {time.perf_counter() - t0:.2f} s")
        if args.dump_loaded:
            loaded = get_model_state_dict(model, options=FULL)
            if ctx.is_main:
                atomic_save(loaded, args.dump_loaded)
    model_name = f"{args.model_size} {'Llama' if cfg.arch == 'llama' else 'GPT'}"
    log.info(f"world size {ctx.world_size} | {model_name} | steps {start_step} -> {args.steps}")

    task = make_task(cfg, args)
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
    # The full file first, the DCP folder last: after a `both` save, `--resume latest` takes the
    # newer one, the sharded checkpoint.
    if args.checkpoint_format in ("both", "full"):
        t0 = time.perf_counter()
        save_full(model, optimizer, full_path, end_step, ctx)
        dist.barrier()
        if ctx.is_main:
            log.info(f"full checkpoint (rank 0 only): {full_path} | "
                     f"{os.path.getsize(full_path):,} B | {time.perf_counter() - t0:.2f} s")
    if args.checkpoint_format in ("both", "dcp"):
        t0 = time.perf_counter()
        save_dcp(model, optimizer, dcp_dir, end_step, cfg, ctx)
        if ctx.is_main:
            files = sorted(os.listdir(dcp_dir))
            log.info(f"sharded DCP checkpoint: {dcp_dir} | {len(files)} files "
                     f"({', '.join(files)}) | {folder_bytes(dcp_dir):,} B | "
                     f"{time.perf_counter() - t0:.2f} s")



def decide_resume(args, ctx, cfg, log):
    """What ``--resume`` names, as (format, path) or None, the same on every rank; and the temporaries
    of saves killed midway removed from every folder this run reads or writes."""
    # Rank 0 decides what --resume names (on a cluster the other ranks may not see a full file) and
    # checks a DCP folder's trainer state, then tells everyone: a missing checkpoint, or one of
    # another model, is one error on every rank at the same moment, before any model is built.
    verdict = [None, None]  # (problem, (format, path) or None)
    if ctx.is_main:
        try:
            verdict[1] = resolve_resume(args.resume, args.checkpoint_dir)
            if verdict[1] and verdict[1][0] == "dcp":
                read_trainer_state(verdict[1][1], cfg)
        except UsageError as exc:
            verdict[0] = str(exc)
    dist.broadcast_object_list(verdict, src=0, device=ctx.device)
    if verdict[0]:
        raise UsageError(verdict[0])
    resume = verdict[1]
    full_path = full_file(args.checkpoint_dir)
    if ctx.is_main:  # leftovers of writers killed mid-save (their PIDs are in the names)
        files = [full_path, args.dump_loaded, resume[1] if resume and resume[0] == "full" else None]
        folders = {os.path.dirname(os.path.abspath(p)) for p in files if p}
        folders.add(os.path.abspath(dcp_folder(args.checkpoint_dir)))
        if resume and resume[0] == "dcp":
            folders.add(os.path.abspath(resume[1]))
        removed = [path for folder in sorted(folders) for path in remove_stale_temporaries(folder)]
        if removed:
            log.info(f"removed {len(removed)} temporary file(s) left by an interrupted save: "
                     f"{', '.join(p.name for p in removed[:3])}")
    return resume


if __name__ == "__main__":
    run_main(main)
