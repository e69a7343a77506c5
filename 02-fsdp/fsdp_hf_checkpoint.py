"""Chapter 02: load and save like a real job: a Hugging Face checkpoint in, FSDP2 training, a sharded
DCP checkpoint and a Hugging Face folder out.

1. Build the Llama on the ``meta`` device (shapes, no memory), ``fully_shard`` each decoder layer and
   the root, then ``to_empty``: each rank allocates only its own shards, never the whole model.
2. Rank 0 alone reads ``--hf-in`` (config.json + safetensors, as ``save_pretrained`` writes them);
   ``set_model_state_dict(..., broadcast_from_rank0=True)`` broadcasts each tensor and every rank
   keeps its shard. Buffers that are not in the checkpoint (RoPE's ``inv_freq``) are recomputed.
3. Train ``--steps`` steps on the synthetic token task (the harness measures them).
4. Save a sharded DCP checkpoint (``--checkpoint-dir``/dcp: to resume training) and export the weights
   as a Hugging Face folder (``--hf-out``: for ``from_pretrained``, inference, the hub).

No Hugging Face folder at hand (nothing is downloaded here)? ``--create-hf-in`` has rank 0 write a
random-weights one of the chosen size with ``save_pretrained`` when ``--hf-in`` does not exist:

    torchrun --nproc_per_node=4 02-fsdp/fsdp_hf_checkpoint.py --hf-in checkpoints/hf/llama-small --create-hf-in
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
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save, atomic_write_json, temporary_prefix
from distkit.flags import (
    add_checkpoint_args,
    add_training_args,
    check_global_batch,
    make_optimizer,
    positive_int,
    set_flag_default,
)
from distkit.harness import Harness, device_clock
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, import_transformers, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task

# What config.json must agree on with the flags (LlamaConfig attribute -> the flag that sets it).
CHECKED = {"vocab_size": "--vocab-size", "hidden_size": "--n-embd", "num_hidden_layers": "--n-layer",
           "num_attention_heads": "--n-head", "num_key_value_heads": "--n-kv-head",
           "intermediate_size": "--model-size", "rms_norm_eps": "--model-size",
           "tie_word_embeddings": "--tie-embeddings", "rope_parameters": "--model-size"}


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Load a Hugging Face Llama folder into FSDP2 (rank 0 reads, everyone gets its "
                    "shards), train, save a sharded DCP checkpoint and export a Hugging Face folder.",
        epilog="example: torchrun --nproc_per_node=4 02-fsdp/fsdp_hf_checkpoint.py --hf-in "
               "checkpoints/hf/llama-small --create-hf-in --steps 20")
    parser.add_argument("--hf-in", required=True, metavar="DIR",
                        help="Hugging Face folder to start from (config.json + model.safetensors)")
    parser.add_argument("--create-hf-in", action="store_true",
                        help="if --hf-in does not exist, rank 0 first writes a random-weights model of "
                             "the chosen size there with save_pretrained (nothing is downloaded)")
    parser.add_argument("--hf-out", default="checkpoints/fsdp_hf/hf", metavar="DIR",
                        help="the trained weights are exported here as a Hugging Face folder "
                             "(default: checkpoints/fsdp_hf/hf)")
    add_training_args(parser, steps=20, global_batch_size=32, lr=3e-3, warmup_steps=2,
                      results="runs/fsdp_hf_checkpoint.jsonl", zero_steps_allowed=True,
                      helps={"steps": "optimizer steps (0: export the loaded weights unchanged)",
                             "lr": "AdamW learning rate"})
    parser.add_argument("--log-every", type=positive_int, default=5, help="log the loss every N steps (default: 5)")
    group = add_checkpoint_args(parser, checkpoint_dir="checkpoints/fsdp_hf", helps={
        "checkpoint_dir": "the sharded DCP checkpoint (model + optimizer) is written to DIR/dcp"})
    group.add_argument("--dump-logits", default=None, metavar="PATH",
                       help="rank 0 saves the trained model's logits on the first global batch (to check an export)")
    add_model_args(parser)
    set_flag_default(parser, "arch", "llama", "the architecture; a Hugging Face Llama folder loads into "
                     "--arch llama only")
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    if args.arch != "llama":
        parser.error("Hugging Face Llama folders load into --arch llama only")
    model_config_from_args(args)  # a width that does not split into the heads: one error line
    return args


def replace_folder(staging, folder):
    """Swap a completely written folder in under its real name (a crash leaves no half folder there)."""
    shutil.rmtree(f"{folder}.old", ignore_errors=True)
    if os.path.exists(folder):
        os.replace(folder, f"{folder}.old")
    os.replace(staging, folder)
    shutil.rmtree(f"{folder}.old", ignore_errors=True)


def save_hf_folder(state, cfg, folder):
    """Rank 0: write ``state`` (full tensors in CPU memory) as a Hugging Face folder, atomically."""
    transformers = import_transformers()
    # The plain LlamaForCausalLM (not the chapters' LlamaLM subclass): config.json then names
    # "LlamaForCausalLM", which AutoModelForCausalLM and inference servers know. Built on meta (no
    # memory, no random init) and given the tensors themselves (assign=True: no copy).
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg.hf_config())
    if cfg.tie_embeddings:
        # One matrix under two names, but a gathered state dict may hold two copies of it; assigned
        # separately they would untie the model, and save_pretrained would write the matrix twice.
        # The same tensor under both names keeps one storage: written once, as Hugging Face does.
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state, assign=True)  # (non-persistent buffers are not expected keys)
    # Written under a temporary name (<name>.tmp.<host>.<pid>.d) and renamed when complete: a job
    # killed mid-write leaves that, never a half folder under the name from_pretrained is given.
    parent, name = os.path.split(os.path.abspath(folder))
    staging = os.path.join(parent, temporary_prefix(name) + "d")
    shutil.rmtree(staging, ignore_errors=True)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in the log
    model.save_pretrained(staging)  # config.json + model.safetensors (safetensors, never pickle)
    replace_folder(staging, folder)


def create_hf_folder(cfg, folder, seed):
    """--create-hf-in: a random-weights Llama of this size, as a downloaded folder would be."""
    torch.manual_seed(seed)
    save_hf_folder(build_model(cfg).state_dict(), cfg, folder)


def read_hf_folder(folder, cfg, expected):
    """Rank 0: the state dict of a Hugging Face folder, checked against this model (UsageError if not)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise UsageError(f"--hf-in {folder}: no such folder (--create-hf-in writes a random-weights one)")
    try:
        with open(config_path) as f:
            raw = json.load(f)
        hf = import_transformers().LlamaConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--hf-in {folder}: no readable config.json ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama":
        raise UsageError(f"--hf-in {folder}: config.json is not a Llama model's")
    want = cfg.hf_config()
    differing = [f"{key} {getattr(hf, key)} there, {getattr(want, key)} here ({flag})"
                 for key, flag in CHECKED.items() if getattr(hf, key) != getattr(want, key)]
    if differing:
        raise UsageError(f"--hf-in {folder} is another model than the flags say: {'; '.join(differing[:3])}")
    # One file, or a model.safetensors.index.json naming several (how large models are saved).
    index = os.path.join(folder, "model.safetensors.index.json")
    try:
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        state = {}
        for name in files:
            state.update(load_file(os.path.join(folder, name)))  # CPU memory, no pickle
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise UsageError(f"--hf-in {folder}: not a folder of safetensors weights "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
    if cfg.tie_embeddings and "lm_head.weight" not in state:  # a tied model saves the matrix once
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    found = {k: tuple(t.shape) for k, t in state.items()}
    if found != expected:
        differing = sorted(set(found) ^ set(expected)) or sorted(k for k in found if found[k] != expected[k])
        raise UsageError(f"--hf-in {folder}: its tensors do not fit this model (differs at {differing[:3]})")
    return state


def reinit_rope_buffers(model):
    """Recompute the rotary embedding's inverse frequencies, on every rank.

    They are *non-persistent* buffers: computed in __init__, never saved (not in the state dict, not
    in the safetensors file). Built on meta they were never computed, and to_empty gave them
    uninitialised memory that no checkpoint load overwrites: without this, attention would rotate
    queries and keys by garbage angles. A fresh module computes them exactly as transformers does.
    """
    rotary = model.model.rotary_emb
    fresh = type(rotary)(rotary.config)  # on the CPU (the default device here), like any HF init
    for name, buffer in fresh.named_buffers():
        getattr(rotary, name).copy_(buffer)
    rotary.attention_scaling = fresh.attention_scaling


def save_dcp(model, optimizer, folder, step, cfg, ctx):
    """Every rank writes its own shards (model + optimizer) into a staging folder; rank 0 swaps it in.

    The same layout as fsdp_checkpoint.py (trainer_state.json written last), so that script's
    ``--resume`` continues from it."""
    staging = f"{folder}.tmp"
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging)
    if ctx.is_main:
        atomic_write_json({"step": step, "world_size": ctx.world_size, "model": cfg.to_dict()},
                          os.path.join(staging, "trainer_state.json"))
        replace_folder(staging, folder)
    dist.barrier()


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        creates_hf_in = args.create_hf_in and not os.path.exists(args.hf_in)  # then --hf-in is written too
        check_outputs(ctx, args, files=["results", "dump_logits"],
                      dirs=["hf_out", "checkpoint_dir", *(["hf_in"] if creates_hf_in else [])])
        train(args, ctx)


def train(args, ctx):
    """Load the Hugging Face checkpoint into shards, train, export: the lesson top to bottom, as the
    README walks it."""
    log = setup_logging(ctx.rank)
    check_global_batch(args.global_batch_size, ctx.world_size)
    cfg = model_config_from_args(args)

    # 1. Shapes only: on meta, building even an 8B model takes no memory and no time.
    with torch.device("meta"):
        model = build_model(cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # HF names, full shapes

    # 2a. Rank 0 alone reads the files and holds the full weights in CPU memory; the others get {}.
    state = read_on_rank0(args, ctx, cfg, expected, log)

    # 1b. Shard while still on meta, then allocate: each rank materialises 1/N of every parameter.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=ctx.device)  # uninitialised memory: every value comes from the checkpoint

    # 2b. Rank 0 broadcasts one tensor at a time (copied to the shards' device first, so NCCL gets
    # GPU tensors); every rank keeps its own slice. Ranks != 0 pass an empty dict. Timed with
    # device_clock: on a GPU the copies, broadcasts and RoPE kernels run asynchronously, and a plain
    # clock would stop before they have.
    t0 = device_clock(ctx.device)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del state  # rank 0's full copy is no longer needed
    reinit_rope_buffers(model)
    log.info(f"loaded into {ctx.world_size} ranks' FSDP2 shards in {device_clock(ctx.device) - t0:.2f} s")

    # 3. Train (the optimizer is created after fully_shard: it holds, and shards state for, DTensors).
    optimizer = make_optimizer("adamw", model.parameters(), args.lr)
    harness = Harness(ctx, "fsdp_full_shard", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      config={"global_batch_size": args.global_batch_size,
                              "lr": args.lr, "precision": "fp32"})
    task = make_task(cfg, args)
    for step in progress(range(args.steps), ctx.rank, desc="train"):
        inputs, targets = task.global_batch(step, args.global_batch_size)
        inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)
        targets = rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
        with harness.step(samples=args.global_batch_size, tokens=args.global_batch_size * cfg.seq_len):
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            dist.all_reduce(loss := loss.detach().clone())
            log.info(f"step {step:4d} | loss {loss.item() / ctx.world_size:.4f}")
    harness.finish(args.results)
    if args.dump_logits:
        dump_logits(model, task, args, ctx)

    # 4a. Sharded checkpoint: every rank writes its shards in parallel; nobody holds the whole model.
    t0 = device_clock(ctx.device)
    dcp_dir = os.path.join(args.checkpoint_dir, "dcp")
    save_dcp(model, optimizer, dcp_dir, args.steps, cfg, ctx)
    if ctx.is_main:
        files = sorted(os.listdir(dcp_dir))
        size = sum(os.path.getsize(os.path.join(dcp_dir, f)) for f in files)
        log.info(f"sharded DCP checkpoint (model + optimizer, to resume): {dcp_dir} | {len(files)} files "
                 f"| {size:,} B | {device_clock(ctx.device) - t0:.2f} s")
    # 4b. Export: all-gather every shard (collective), each tensor moved to CPU memory on rank 0
    # at once (cpu_offload=True; the other ranks get an empty dict); rank 0 writes the folder.
    t0 = device_clock(ctx.device)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        save_hf_folder(full, cfg, args.hf_out)
        files = sorted(os.listdir(args.hf_out))
        size = sum(os.path.getsize(os.path.join(args.hf_out, f)) for f in files)
        log.info(f"Hugging Face folder (weights only, for from_pretrained): {args.hf_out} | "
                 f"{', '.join(files)} | {size:,} B | {device_clock(ctx.device) - t0:.2f} s")
    dist.barrier()


def dump_logits(model, task, args, ctx):
    """The first global batch through the sharded model, its logits gathered on rank 0 and written to
    ``--dump-logits``, to compare with the exported folder's logits."""
    inputs = rank_slice(task.global_batch(0, args.global_batch_size)[0], ctx.rank, ctx.world_size)
    with torch.no_grad():
        logits = model(inputs.to(ctx.device))
    gathered = [torch.empty_like(logits) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, logits)
    if ctx.is_main:
        atomic_save({"inputs": task.global_batch(0, args.global_batch_size)[0],
                     "logits": torch.cat(gathered).cpu()}, args.dump_logits)


def read_on_rank0(args, ctx, cfg, expected, log) -> dict:
    """The Hugging Face folder's full state dict on rank 0 (created first with --create-hf-in), {} on
    the other ranks; a problem with the folder is one error on every rank."""
    # On a cluster the others may not even see the files. Rank 0 checks everything first and tells
    # everyone the verdict: a problem found inside the collective load would leave the others waiting
    # in a broadcast.
    verdict, state = [None], {}
    if ctx.is_main:
        try:
            if args.create_hf_in and not os.path.exists(args.hf_in):
                create_hf_folder(cfg, args.hf_in, args.seed)
                log.info(f"created a random-weights Hugging Face folder: {args.hf_in}")
            t0 = time.perf_counter()
            state = read_hf_folder(args.hf_in, cfg, expected)
            tensors = {t.data_ptr(): t for t in state.values()}.values()  # a tied matrix, under two names, once
            log.info(f"read {args.hf_in} on rank 0 only: {len(tensors)} tensors, "
                     f"{sum(t.numel() for t in tensors):,} parameters in {time.perf_counter() - t0:.2f} s")
        except UsageError as exc:
            verdict[0] = str(exc)
    dist.broadcast_object_list(verdict, src=0, device=ctx.device)  # NCCL: through this rank's GPU
    if verdict[0]:
        raise UsageError(verdict[0])
    return state


if __name__ == "__main__":
    run_main(main)
