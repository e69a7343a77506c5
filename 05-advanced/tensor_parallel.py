"""Chapter 05: Megatron-style tensor parallelism (TP) of the transformer, optionally with sequence
parallelism (SP) for the norms, built from DTensor and ``torch.distributed.tensor.parallel``.

Every rank sees the *whole* global batch; what is split is each layer's weight matrices. In a block,
the first linear of the MLP (``fc_in``) and the attention projections (``q/k/v_proj``) are split by
output columns, so each rank computes some of the hidden units / some of the heads with no
communication; the second linear (``fc_out`` / ``out_proj``) is split by input rows, so each rank
produces a partial sum of the full output, and one all-reduce adds the partial sums:

    x ──► [ W_in  = (W_in_0 | W_in_1 | ...) ]  column-parallel: rank r computes h_r = gelu(x W_in_r)
          [ W_out = (W_out_0 ; W_out_1 ; ...) ] row-parallel:    rank r computes h_r W_out_r (partial)
          all-reduce(sum over r)  ──► y       forward: 1 all-reduce per MLP, 1 per attention
                                              backward: 1 all-reduce per MLP input, 1 per attention input

With ``--sequence-parallel`` the parts *between* those matmuls (LayerNorms, residual adds, dropout)
stop being computed redundantly: activations stay split along the sequence, and each all-reduce
becomes a reduce-scatter (leaving the block) plus an all-gather (entering the next matmul) -- the
same bus bytes, but the replicated activations and norm work shrink by the TP degree.

``--arch llama`` cuts the Hugging Face Llama the same way (its plan is beside the GPT's in
``distkit/tp_plans.py``: ``self_attn.q/k/v_proj`` and ``mlp.gate_proj/up_proj`` column-parallel,
``self_attn.o_proj`` and ``mlp.down_proj`` row-parallel, the RMSNorms ``input_layernorm``/
``post_attention_layernorm``/``model.norm`` sequence parallel); grouped-query attention needs the
key/value heads to divide by the TP degree too.

    torchrun --nproc_per_node=4 05-advanced/tensor_parallel.py
    torchrun --nproc_per_node=4 05-advanced/tensor_parallel.py --sequence-parallel
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main, theory
from distkit.checkpoint import save_full_model
from distkit.flags import (
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    make_optimizer,
    save_path,
    saved_at,
    saves_after,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args
from distkit.paths import check_outputs
from distkit.text import make_task
from distkit.tp_plans import tp_plan


def parse_args():
    parser = ArgumentParser(
        description="Train the small GPT or the Llama with tensor parallelism over all ranks (every rank holds "
                    "1/world_size of each block's weights and sees the whole batch).",
        epilog="example: torchrun --nproc_per_node=4 05-advanced/tensor_parallel.py --sequence-parallel")
    add_model_args(parser)
    training = add_training_args(parser, helps={
        "global_batch_size": "sequences per optimizer step; every TP rank sees all of them"})
    add_optimizer_arg(training)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="also split norms, residuals and embeddings along the sequence (SP)")
    add_checkpoint_args(parser, save="checkpoints/tensor_parallel_{strategy}.pt", save_every=True)
    add_runtime_args(parser)
    return parser.parse_args()


def reduce_partial_grads(model) -> int:
    """Sum the gradients that sequence parallelism leaves as partial sums, once per step.

    With SP the norms (and the row-parallel layers' biases) see only their rank's part of the
    sequence, so their weights' gradients come out of backward as ``Partial`` DTensors: each rank
    holds its share of the sum. Left that way, every optimizer op that reads one all-reduces it
    again (AdamW's update reads the gradient three times: three all-reduces per parameter per
    step). Returns how many gradients were reduced."""
    reduced = 0
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
            reduced += 1
    return reduced


def check_divisible(cfg, tp: int, sequence_parallel: bool) -> None:
    """Every split dimension must divide by the TP degree, or ranks would hold unequal shards."""
    if cfg.arch == "llama":  # grouped-query attention: q heads AND key/value heads split over the ranks
        needs = {"--n-head": cfg.n_head, "--n-kv-head (the key/value heads)": cfg.n_kv_head,
                 "the MLP width (intermediate_size)": cfg.intermediate_size}
    else:
        needs = {"--n-head": cfg.n_head, "the MLP width (4 x --n-embd)": cfg.mlp_ratio * cfg.n_embd}
    if sequence_parallel:
        needs.update({"--seq-len": cfg.seq_len, "--vocab-size": cfg.vocab_size})
    for name, value in needs.items():
        if value % tp:
            raise UsageError(f"{name} = {value} is not divisible by the tensor-parallel degree {tp}")


def apply_tensor_parallel(model, tp_mesh, sequence_parallel: bool) -> None:
    """Shard every block Megatron-style; with SP, also the norms, embeddings and LM head."""
    # The plan is one dict per architecture, module name -> ColwiseParallel() / RowwiseParallel() /
    # SequenceParallel(), in distkit/tp_plans.py (gpt_tp_plan, llama_tp_plan; the reasons for each
    # layout are written beside it). Inside a block: column-parallel in, row-parallel out, one
    # replicated input per attention and per MLP; with SP the activations between the matmuls stay
    # split along the sequence, Shard(1).
    block_plan, model_plan = tp_plan(model.cfg.arch, sequence_parallel)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    if sequence_parallel:  # outside the blocks: embeddings, final norm and LM head
        parallelize_module(model, tp_mesh, model_plan)


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        cfg = model_config_from_args(args)
        tp = ctx.world_size
        check_divisible(cfg, tp, args.sequence_parallel)
        strategy = "tp_sp" if args.sequence_parallel else "tp"

        # A 1-D mesh named "tp": every rank is one tensor-parallel shard.
        tp_mesh = init_device_mesh(ctx.device.type, (tp,), mesh_dim_names=("tp",))
        model = build_model(cfg).to(ctx.device)  # same seed on every rank -> the same dense weights
        param_count = sum(p.numel() for p in model.parameters())  # before sharding: the whole model's
        apply_tensor_parallel(model, tp_mesh, args.sequence_parallel)
        optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)

        first_block = {id(p) for p in model.blocks[0].parameters()}  # blocks.0. / model.layers.0.
        shapes = {name: (tuple(p.to_local().shape), tuple(p.shape)) for name, p in model.named_parameters()
                  if id(p) in first_block and isinstance(p, DTensor)}
        all_shapes = [None] * ctx.world_size
        dist.all_gather_object(all_shapes, shapes)
        log.info(f"{strategy}: {tp} ranks | {param_count:,} parameters | global batch {args.global_batch_size}")
        for name, (local, full) in shapes.items():
            log.info(f"  {name:<{max(map(len, shapes))}} full {str(full):<12} local per rank: "
                     + ", ".join(f"r{r} {all_shapes[r][name][0]}" for r in range(ctx.world_size)))

        harness = Harness(ctx, strategy, model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                          param_count=param_count,  # the model field comes from model.cfg
                          config={"global_batch_size": args.global_batch_size,
                                  "precision": "fp32", "tp": tp, "sequence_parallel": args.sequence_parallel,
                                  "lr": args.lr, "optimizer": args.optimizer})
        task = make_task(cfg, args)
        losses = []
        for step in progress(range(args.steps), ctx.rank, desc=strategy):
            inputs, targets = task.global_batch(step, args.global_batch_size)  # the same batch on every rank
            inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
            with harness.step(samples=args.global_batch_size, tokens=inputs.numel()):
                optimizer.zero_grad(set_to_none=True)
                loss = lm_loss(model(inputs), targets)
                loss.backward()  # DTensor inserts the TP collectives of the backward pass
                if args.sequence_parallel:
                    reduce_partial_grads(model)
                optimizer.step()
            losses.append(loss.item())
            if saves_after(args, step):
                save_full_model(model, saved_at(save_path(args.save, strategy=strategy), step + 1), cfg, strategy, ctx)

        record = harness.finish(args.results, extra={"losses": losses})
        path = save_path(args.save, strategy=strategy)
        save_full_model(model, path, cfg, strategy, ctx)
        if ctx.is_main:
            log.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps")
            measured = record["metrics"]["comm_per_step"]
            # Megatron's formula (distkit.theory): 4 collectives per block of batch x seq x n_embd fp32
            formula = theory.megatron_tp_bytes(cfg, args.global_batch_size, tp, args.sequence_parallel)
            log.info("collectives per step (harness)   vs   formula (blocks only)")
            for name, want in formula.items():
                got = measured.get(name, {"calls": 0, "bytes": 0})
                log.info(f"  {name:<15} {got['calls']:>4.0f} calls {got['bytes'] / 2**20:8.2f} MiB   vs   "
                         f"{want['calls']:>4} calls {want['bytes'] / 2**20:8.2f} MiB")
            for name, got in measured.items():
                if name not in formula:
                    log.info(f"  {name:<15} {got['calls']:>4.0f} calls {got['bytes'] / 2**20:8.2f} MiB   "
                             "(embeddings, LM head and norm gradients)")
            step_time = record["metrics"]["step_time_s_median"]
            log.info(f"saved {path or 'nothing (--save none)'} | record appended to {args.results}"
                     + (f" | median step {step_time * 1000:.0f} ms" if step_time else ""))


if __name__ == "__main__":
    run_main(main)
