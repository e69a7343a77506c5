"""Chapter 02: LoRA fine-tuning with FSDP2 (`fully_shard`) on a frozen, sharded Llama base.

LoRA (Hu et al. 2021) freezes every weight W of the base and learns a low-rank update for a few
chosen matrices: W x + (alpha / r) B A x, with A (r x d_in) random and B (d_out x r) zero at the
start, so the model begins exactly as the base. Hugging Face ``peft`` adds the A and B matrices
(``LoraConfig`` + ``get_peft_model``); FSDP2 then shards base and adapters alike, one unit per
decoder layer plus the root. Only the adapters are trained: only they get gradients, are
reduce-scattered, and have AdamW moments. The base's random weights (from --seed) stand in for a
pretrained checkpoint.

    torchrun --nproc_per_node=4 02-fsdp/fsdp_lora.py --steps 100 --save checkpoints/fsdp_lora/adapters.pt

``--save`` writes the adapters only (peft's ``get_peft_model_state_dict``, gathered to rank 0): a
file that, with the base, rebuilds the fine-tuned model; the script reloads it into a fresh base on
one process and checks it reproduces the trained model's logits.
"""
from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save, safe_load
from distkit.flags import (
    add_checkpoint_args,
    add_training_args,
    check_global_batch,
    make_optimizer,
    positive_float,
    positive_int,
    save_path,
    set_flag_default,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import (
    add_model_args,
    build_model,
    config_from_dict,
    import_transformers,
    lm_loss,
    model_config_from_args,
    rank_slice,
)
from distkit.paths import check_outputs
from distkit.predictors import fsdp_padded_numel
from distkit.text import make_task
from distkit.theory import param_shapes

import_transformers()  # before peft: it imports transformers, which needs the repository's workaround
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    parser = ArgumentParser(
        description="LoRA fine-tuning of a frozen Llama-architecture base sharded with FSDP2: only the "
                    "adapters are trained. Launch with torchrun; runs on CPU (gloo) or GPUs (NCCL).",
        epilog="example: torchrun --nproc_per_node=4 02-fsdp/fsdp_lora.py --lora-r 16 "
               "--target-modules q_proj k_proj v_proj o_proj --save checkpoints/fsdp_lora/adapters.pt")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora-r", type=positive_int, default=8, help="rank r of each adapter (default: 8)")
    lora.add_argument("--lora-alpha", type=positive_float, default=16.0,
                      help="the update is scaled by alpha / r (default: 16)")
    lora.add_argument("--target-modules", nargs="+", choices=TARGETS, default=["q_proj", "v_proj"],
                      help="the Linear layers of every decoder layer that get adapters (default: q_proj v_proj)")
    add_training_args(parser, steps=100, global_batch_size=16, lr=1e-2, warmup_steps=2,
                      results="runs/fsdp_lora.jsonl", helps={"lr": "AdamW learning rate of the adapters"})
    parser.add_argument("--log-every", type=positive_int, default=25, help="log the loss every N steps (default: 25)")
    add_checkpoint_args(parser, save="none", helps={
        "save": "rank 0 writes the trained adapters only (not the base) to this file; 'none' skips it"})
    add_model_args(parser, default_size="tiny")
    set_flag_default(parser, "arch", "llama", "the architecture; LoRA here adapts the Llama's q_proj/k_proj/... "
                     "layers: --arch llama only")
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    if args.arch != "llama":
        parser.error("--arch gpt: LoRA here adapts the Llama's q_proj/k_proj/... layers; use --arch llama")
    model_config_from_args(args)  # a width that does not split into the heads: one error line
    return args


def build_lora_model(cfg, args):
    """The frozen base with LoRA adapters on --target-modules, identical on every rank."""
    torch.manual_seed(args.seed)  # the "pretrained" base and the adapters' A start the same everywhere
    base = build_model(cfg)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=list(args.target_modules),
                      lora_dropout=0.0)  # no dropout: every rank and the single-process check agree exactly
    with warnings.catch_warnings():  # transformers 5 deprecates a name peft still asks for
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(base, lora)  # sets requires_grad=False on every base weight


def shard(model, mesh):
    """fully_shard each decoder layer, then the root (embeddings, final norm, LM head).

    A layer's unit holds its frozen q_proj.base_layer.weight AND the trainable lora_A / lora_B beside
    it. FSDP1 could not mix them in one flat parameter (use_orig_params=False) or paid full gradient
    memory for the frozen ones (use_orig_params=True); FSDP2 shards each parameter on its own, so a
    frozen one is all-gathered for compute but gets no gradient, no reduce-scatter and no gradient
    memory. What FSDP2 does require (torch's FSDPParamGroup._init_mp_dtypes) is that the *trainable*
    parameters of a unit share one dtype, and one reduce dtype under mixed precision.
    """
    for block in model.base_model.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # the root is needed first in backward
    return model


def build_sharded(cfg, args, ctx):
    """The LoRA model sharded over all ranks, and an AdamW over its adapters only."""
    model = build_lora_model(cfg, args).to(ctx.device)
    # An explicit mesh on this job's device type (fully_shard's default takes the host's GPU).
    shard(model, init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",)))
    # After sharding (the optimizer holds the DTensor shards), and only the adapters: the base
    # needs no AdamW moments, which is most of LoRA's memory saving.
    return model, make_optimizer("adamw", adapter_parameters(model), args.lr)


def adapter_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]


def local_bytes(tensors):
    """Bytes this rank stores: a DTensor (an FSDP shard) counts its local shard only."""
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def lora_state_bytes(model, optimizer):
    """This rank's model-state bytes split into the frozen base and the trainable adapters
    (``base_*`` / ``adapter_*``: params, grads, optimizer). The harness records the totals
    (``model_state_bytes_per_rank``); this split goes into a record field of its own
    (``lora_state_bytes_per_rank``), so summing either one never counts a byte twice."""
    split = {}
    for part, wanted in (("base", False), ("adapter", True)):
        params = [p for p in model.parameters() if p.requires_grad == wanted]
        moments = [v for p in params for v in optimizer.state.get(p, {}).values() if v.dim() > 0]
        split.update({f"{part}_params": local_bytes(params),
                      f"{part}_grads": local_bytes(p.grad for p in params if p.grad is not None),
                      f"{part}_optimizer": local_bytes(moments)})
    return split


def predicted_bytes(cfg, args, world_size):
    """Rank 0's bytes by the formulas (fp32; FSDP2 pads dim 0 to a multiple of N, so rank 0 holds
    ceil(rows / N) of each parameter). Frozen base: its parameters / N, no gradients, no optimizer
    state. Adapters: r (d_in + d_out) per adapted matrix / N, the same again as gradients, and two
    AdamW moments."""
    n, r = world_size, args.lora_r
    shapes = param_shapes(cfg)  # name -> shape of the base, from the config (meta device)
    base = sum(fsdp_padded_numel(s, n) for s in shapes.values()) // n * 4
    adapted = [s for name, s in shapes.items() if name.split(".")[-2] in args.target_modules]
    adapters = sum(fsdp_padded_numel((r, d_in), n) + fsdp_padded_numel((d_out, r), n)
                   for d_out, d_in in adapted) // n * 4
    return {"base_params": base, "base_grads": 0, "base_optimizer": 0, "adapter_params": adapters,
            "adapter_grads": adapters, "adapter_optimizer": 2 * adapters, "adapted_matrices": len(adapted)}


def rank_batch(task, step, args, ctx):
    """This rank's contiguous share of global batch ``step``."""
    inputs, targets = task.global_batch(step, args.global_batch_size)
    return [rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device) for t in (inputs, targets)]


def train_step(model, optimizer, inputs, targets):
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model(inputs), targets)
    loss.backward()  # all-gather each unit (base + adapters); reduce-scatter the adapters' gradients only
    optimizer.step()  # AdamW over this rank's adapter shards; the base is not in it
    return loss


def save_adapters(model, args, cfg, path, ctx):
    """Gather the adapters (collective), keep peft's adapter-only keys, rank 0 writes one file."""
    # ignore_frozen_params: the base is not gathered at all, only what was trained.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))
    if ctx.is_main:
        adapters = get_peft_model_state_dict(model, state_dict=full, save_embedding_layers=False)
        # What rebuilds the model around the adapters: the base (here: its config and seed; for a
        # real model, its checkpoint name) and the LoRA settings.
        atomic_save({"adapters": adapters, "model": {"arch": cfg.arch, **cfg.to_dict()}, "seed": args.seed,
                     "lora": {"r": args.lora_r, "alpha": args.lora_alpha,
                              "target_modules": list(args.target_modules)}}, path)


def load_adapters(path, device="cpu"):
    """A fresh base + adapters in one process, with the adapters of ``path`` (weights_only load)."""
    ckpt = safe_load(path)
    if not isinstance(ckpt, dict) or not {"adapters", "model", "seed", "lora"} <= set(ckpt):
        raise UsageError(f"{path} is not an adapter checkpoint of fsdp_lora.py")
    lora = ckpt["lora"]
    args = argparse.Namespace(seed=ckpt["seed"], lora_r=lora["r"], lora_alpha=lora["alpha"],
                              target_modules=lora["target_modules"])
    model = build_lora_model(config_from_dict(ckpt["model"]), args).to(device)
    result = set_peft_model_state_dict(model, ckpt["adapters"])
    if result.unexpected_keys:
        raise UsageError(f"{path} holds adapters this model lacks: {result.unexpected_keys[:3]}")
    return model


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        check_global_batch(args.global_batch_size, ctx.world_size)
        cfg = model_config_from_args(args)
        path = save_path(args.save)
        model, optimizer = build_sharded(cfg, args, ctx)
        total = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
        trainable = sum(p.numel() for p in adapter_parameters(model))
        log.info(f"world size {ctx.world_size} | backend {ctx.backend} | {args.model_size} Llama | LoRA r "
                 f"{args.lora_r} alpha {args.lora_alpha:g} on {', '.join(args.target_modules)} | global "
                 f"batch {args.global_batch_size}")
        log.info(f"parameters: {trainable:,} trainable (the adapters) of {total:,} ({100 * trainable / total:.2f}%)")
        config = {"global_batch_size": args.global_batch_size, "lr": args.lr,
                  "lora_r": args.lora_r, "lora_alpha": args.lora_alpha, "target_modules": list(args.target_modules),
                  "trainable_params": trainable, "sharding": "full_shard"}
        harness = Harness(ctx, "fsdp_lora", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                          config=config, param_count=total)
        task, losses = make_task(cfg, args), []
        for step in progress(range(args.steps), ctx.rank, total=args.steps, desc="lora"):
            inputs, targets = rank_batch(task, step, args, ctx)
            with harness.step(samples=args.global_batch_size, tokens=args.global_batch_size * cfg.seq_len):
                loss = train_step(model, optimizer, inputs, targets)
            if step % args.log_every == 0 or step == args.steps - 1:
                dist.all_reduce(loss := loss.detach().clone())  # outside harness.step: not counted
                losses.append((step, loss.item() / ctx.world_size))
                log.info(f"step {step:4d} | loss {losses[-1][1]:.4f}")
        # After the last step every rank holds its gradients and AdamW moments: split its bytes into
        # base and adapters, and gather the split for the record (a collective: every rank calls it).
        split = [None] * ctx.world_size
        dist.all_gather_object(split, lora_state_bytes(model, optimizer))
        predicted = predicted_bytes(cfg, args, ctx.world_size)
        record = harness.finish(args.results, extra={"lora_state_bytes_per_rank": split,
                                                     "predicted": predicted, "losses": losses})
        if ctx.is_main:
            report(record, predicted, trainable, total, ctx.world_size, log)

        if path:
            save_adapters(model, args, cfg, path, ctx)
            probe = task.global_batch(0, 2)[0].to(ctx.device)  # the same two sequences on every rank
            with torch.no_grad():
                logits = model(probe)  # collective: every rank runs the sharded forward
            if ctx.is_main:
                with torch.no_grad():
                    reloaded = load_adapters(path, ctx.device)(probe)
                keys = torch.load(path, weights_only=True)["adapters"]
                log.info(f"saved {path}: {len(keys)} tensors, all lora_A/lora_B, "
                         f"{sum(t.nbytes for t in keys.values()):,} B of weights")
                log.info(f"reloaded into a fresh base + adapters on one process: max |logits difference| "
                         f"{(reloaded - logits).abs().max().item():.1e}")


def report(record, predicted, trainable, total, world_size, log):
    """Rank 0's measured bytes next to the formulas, and what full fine-tuning would hold."""
    state = record["lora_state_bytes_per_rank"][0]
    log.info(f"rank-0 frozen base: params {state['base_params']:,} B, grads {state['base_grads']:,} B, "
             f"optimizer {state['base_optimizer']:,} B (formula: params / {world_size} = "
             f"{predicted['base_params']:,} B, no grads, no optimizer state)")
    log.info(f"rank-0 adapters: params {state['adapter_params']:,} B, grads {state['adapter_grads']:,} B, "
             f"optimizer {state['adapter_optimizer']:,} B (formula: r(d_in+d_out) x "
             f"{predicted['adapted_matrices']} matrices / {world_size} = {predicted['adapter_params']:,} B, "
             f"the same as grads, 2x as AdamW moments)")
    comm = record["metrics"]["comm_per_step"]  # empty when no step came after the warm-up
    if comm:
        log.info(f"per step: all-gather {int(comm['all_gather']['bytes']):,} B (base + adapters), "
                 f"reduce-scatter {int(comm['reduce_scatter']['bytes']):,} B (the adapters' gradients only)")
    lora_state = sum(record["metrics"]["model_state_bytes_per_rank"][0].values())  # params + grads + optimizer
    full_ft = 16 * total // world_size  # params + grads + two AdamW moments, fp32, all sharded
    log.info(f"model state per rank: {lora_state:,} B with LoRA vs {full_ft:,} B (16 B x {total:,} params "
             f"/ {world_size}) for full fine-tuning under FSDP: {full_ft / lora_state:.1f}x less")
    peak = record["metrics"]["peak_memory_by_category_per_rank"][0]  # MemTracker's, on the instrumented step
    if peak:
        log.info(f"rank-0 peak memory of one step: {peak['total']:,} B = activations {peak['activations']:,} + "
                 f"params {peak['params']:,} (shards + gathered layers) + temporaries {peak['temporaries']:,} + "
                 f"optimizer {peak['optimizer']:,} + grads {peak['grads']:,} at that moment: LoRA shrank the "
                 f"model state, not the activations")


if __name__ == "__main__":
    run_main(main)
