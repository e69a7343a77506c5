"""Chapter 05: activation checkpointing (AC) and torch.compile, measured.

Backward needs what forward computed: every block keeps its intermediate tensors (activations)
alive until backward has used them. AC keeps less and recomputes the rest in backward:

    none       every block stores what its backward needs                  (most memory, no recompute)
    full       each block stores only its input; backward re-runs the      (least memory, +1 forward)
               block's forward first (``checkpoint_wrapper``, non-reentrant ``torch.utils.checkpoint``)
    selective  torch's selective AC (``create_selective_checkpoint_contexts``): the outputs of the
               matmuls and of attention are saved, everything else (norms, GELU/SiLU, residual adds,
               copies) is recomputed: the cheap ops are recomputed, the expensive ones never are

``--compile`` compiles each block with ``torch.compile`` (in place, ``Block.compile()``: parameter
names do not change) after AC and before DDP/FSDP2 wrap it, as torchtitan orders them.

Memory is measured by the harness on its instrumented step (the first after the warm-up, when the
optimizer state exists) with ``torch.distributed._tools.mem_tracker.MemTracker`` (``FSDPMemTracker``,
its FSDP2-aware subclass, under FSDP): a ``TorchDispatchMode`` that sees every tensor created and
sorts its storage into parameters, gradients, optimizer state, activations (made in forward) and
temporaries (made in backward). The activations a block adds during its forward are printed next to
:func:`distkit.theory.activation_bytes_per_layer`, the formula of Korthikanti et al. (2022) redone for this model.
Compiled configurations are not tracked: Dynamo does not compile code that runs under a dispatch
mode, and code it skipped once stays eager for the rest of the process.

    torchrun --nproc_per_node=4 05-advanced/activation_checkpointing.py --ac none full selective --compile off on
        --results 05-advanced/records/activation_checkpointing.jsonl
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save
from distkit.flags import (
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    check_global_batch,
    make_optimizer,
    non_negative_float,
    save_path,
)
from distkit.harness import Harness, fresh_memory_peak, memory_tracker, peak_by_category
from distkit.logs import setup_logging
from distkit.models import LlamaModelConfig, add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.text import make_task
from distkit.theory import activation_bytes_per_layer

aten = torch.ops.aten
# Selective AC saves these ops' outputs (matmuls, attention kernels on every device) and recomputes
# every other op. The same idea as torchtitan's op-level selective AC.
SAVE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}
def parse_args(argv=None):
    parser = ArgumentParser(
        description="Train the transformer with DDP or FSDP2 under each activation-checkpointing mode, eager "
                    "or compiled, measuring memory by category (MemTracker) and step time (one record each).")
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp",
                        help="DDP, or FSDP2 fully_shard per block then the root (default: ddp)")
    parser.add_argument("--ac", nargs="+", choices=["none", "full", "selective"], default=["none", "full"],
                        help="activation-checkpointing modes to train one after another (default: none full)")
    parser.add_argument("--compile", nargs="*", choices=["off", "on"], default=["off"],
                        help="compile each block: off, on, or both ('off on'); a bare --compile means on. "
                             "Every --ac mode runs with each (default: off)")
    add_optimizer_arg(parser)
    parser.add_argument("--dropout", type=non_negative_float, default=None,
                        help="override the small GPT's dropout (then AC must replay the same random masks)")
    add_training_args(parser, steps=20, global_batch_size=32, lr=1e-3, warmup_steps=2,
                      results="runs/activation_checkpointing.jsonl",
                      helps={"warmup_steps": "untimed steps before the memory-tracked step and timing (>= 1: the "
                                           "optimizer state must exist when memory is tracked)"})
    add_checkpoint_args(parser, save="none", helps={"save": "final weights; {ac} and {compile} are filled in"})
    add_model_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    args.compile = args.compile or ["on"]
    if args.warmup_steps < 1 or args.steps < args.warmup_steps + 1:
        parser.error(f"--warmup-steps must be >= 1 and --steps >= --warmup-steps + 1 (the memory-tracked step "
                     f"follows the warm-up), got {args.warmup_steps} and {args.steps}")
    if args.dropout is not None and args.dropout >= 1:
        parser.error(f"argument --dropout: must be < 1, got {args.dropout:g}")
    configs = len(set(args.ac)) * len(set(args.compile))
    one = save_path(args.save, ac="a", compile="off")
    if configs > 1 and one is not None and one == save_path(args.save, ac="b", compile="on"):
        parser.error(f"--save {args.save} names one file for {configs} configurations; put {{ac}} and "
                     "{compile} in it")
    return args


def save_matmuls(ctx, op, *args, **kwargs):
    """Selective AC's policy: keep what is expensive to recompute, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac_and_compile(model, ac: str, compiled: bool) -> None:
    """Wrap every block in place: checkpoint (full or selective), then compile."""
    for i, block in enumerate(model.blocks):
        if ac == "full":
            # preserve_rng_state (the default): the recomputed forward draws the same dropout masks
            block = checkpoint_wrapper(block, preserve_rng_state=True)
        elif ac == "selective":
            block = checkpoint_wrapper(block, context_fn=functools.partial(
                create_selective_checkpoint_contexts, save_matmuls))
        if compiled:
            block.compile()  # in place: state-dict names stay those of the eager model
        model.blocks[i] = block


def wrap(model, strategy: str, ctx, meshes: dict):
    """DDP, or FSDP2: each block one unit, then the root (kept gathered: backward needs it first)."""
    if strategy == "ddp":
        return DDP(model, device_ids=ctx.device_ids)
    if "mesh" not in meshes:  # one mesh (one process group) for every configuration
        meshes["mesh"] = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=meshes["mesh"])
    return fully_shard(model, mesh=meshes["mesh"], reshard_after_forward=False)


def watch_block_activations(tracker, blocks) -> tuple[list[int], list]:
    """Hooks that record the activation bytes each block adds in its forward, read from the
    tracker's running snapshot (registered after FSDP's own hooks: the block's weights are gathered
    by then). Returns (the list being filled, the hook handles to remove)."""
    added, handles = [], []

    def activations():
        return sum(snap.get("Activation", 0) for snap in tracker.get_tracker_snapshot().values())

    for block in blocks:
        handles.append(block.register_forward_pre_hook(lambda m, a: added.append(-activations())))
        handles.append(block.register_forward_hook(lambda m, a, o: added.__setitem__(-1, added[-1] + activations())))
    return added, handles


def track_memory(model, optimizer, blocks, step):
    """Run ``step()`` under the harness's memory tracker (:func:`distkit.harness.memory_tracker`)
    outside a harness: (peak bytes by category, activation bytes each block added)."""
    tracker = memory_tracker(model, optimizer)
    added, handles = watch_block_activations(tracker, blocks)
    try:
        with tracker:
            step()
    finally:
        for handle in handles:
            handle.remove()
    return peak_by_category(tracker), added


def train_one(ac, compiled, args, ctx, cfg, task, log, meshes):
    fresh_memory_peak(ctx.device)
    torch.manual_seed(args.seed)  # the same weights and dropout masks in every configuration
    model = build_model(cfg).to(ctx.device)
    apply_ac_and_compile(model, ac, compiled)
    blocks = list(model.blocks)
    model = wrap(model, args.strategy, ctx, meshes)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    name = f"{args.strategy}_ac_{ac}" + ("_compiled" if compiled else "")
    # The harness tracks memory by category on its instrumented step (the first after warm-up: the
    # optimizer state exists by then), except for compiled blocks (that step runs them eager, whose
    # memory is not the compiled blocks'); it counts communication either way.
    harness = Harness(ctx, name, model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      config={"ac": ac, "compile": compiled,
                              "sharding": args.strategy, "global_batch_size": args.global_batch_size,
                              "optimizer": args.optimizer, "lr": args.lr})
    losses, added, first_step_s = [], [], None
    for step in range(args.steps):
        inputs, targets = (rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device)
                           for t in task.global_batch(step, args.global_batch_size))

        def one_step():
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            return loss

        started = time.perf_counter()
        with harness.step(samples=args.global_batch_size, tokens=args.global_batch_size * cfg.seq_len):
            handles = []
            if harness.memory_tracker is not None:  # the instrumented step: watch each block too
                added, handles = watch_block_activations(harness.memory_tracker, blocks)
            losses.append(one_step())
            for handle in handles:
                handle.remove()
        if step == 0:  # where compile happens; on GPU wait for the step's kernels too
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            first_step_s = time.perf_counter() - started
    measured = sum(added) / len(added) if added else None  # the blocks' mean
    # the formula counts dropout-free blocks: with dropout the masks (and attention's) come on top
    per_rank = args.global_batch_size // ctx.world_size
    formula = None if getattr(cfg, "dropout", 0) else activation_bytes_per_layer(cfg, per_rank, ac)
    loss = torch.stack([l.detach() for l in losses])
    dist.all_reduce(loss)
    path = save_path(args.save, ac=ac, compile="on" if compiled else "off")
    if path:  # a collective under FSDP (every rank gathers); the single-process names, on rank 0's CPU
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if ctx.is_main:
            atomic_save({"model": full}, path)
    return harness.finish(args.results, extra={
        "losses": (loss / ctx.world_size).tolist(),
        "activation_bytes_per_layer": measured, "activation_bytes_per_layer_formula": formula,
        "first_step_s": first_step_s})


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        check_global_batch(args.global_batch_size, ctx.world_size)
        cfg = model_config_from_args(args)
        if args.dropout is not None:
            if isinstance(cfg, LlamaModelConfig):
                raise UsageError("--dropout applies to --arch gpt only (the Llama has none)")
            cfg = dataclasses.replace(cfg, dropout=args.dropout)
        task = make_task(cfg, args)
        log.info(f"world size {ctx.world_size} | {args.strategy} | {args.arch} {args.model_size} | "
                 f"global batch {args.global_batch_size} | {args.optimizer}")
        meshes, rows = {}, []
        for ac, compile_flag in itertools.product(args.ac, args.compile):
            record = train_one(ac, compile_flag == "on", args, ctx, cfg, task, log, meshes)
            if ctx.is_main:
                rows.append(record)
                log.info(f"ac {ac:>9} | compile {compile_flag:>3} | loss {record['losses'][-1]:.4f}")
        if ctx.is_main:
            print_table(rows, log)
            log.info(f"records appended to {args.results}")


def print_table(rows, log):
    mib = 2.0 ** 20
    log.info("peak memory on rank 0 by category (MiB, MemTracker) | activations per block (KiB) | "
             "median step time, first step (compiles)")
    log.info(f"{'ac':>9} {'compile':>7} | {'params':>6} {'grads':>6} {'optim':>6} {'acts':>6} {'temps':>6} "
             f"{'total':>6} | {'measured':>8} {'formula':>8} | {'ms':>7} {'step 0 s':>8}")
    def cell(value, scale, width):
        return f"{'n/a':>{width}}" if value is None else f"{value / scale:{width}.{1 if scale == 1024 else 2}f}"

    for r in rows:
        m = r["metrics"]
        p = m["peak_memory_by_category_per_rank"][0] or {}
        step = f"{m['step_time_s_median'] * 1e3:7.1f}" if m["timed_steps"] else "    n/a"
        log.info(f"{r['config']['ac']:>9} {'on' if r['config']['compile'] else 'off':>7} | "
                 + " ".join(cell(p.get(k), mib, 6) for k in ("params", "grads", "optimizer", "activations",
                                                             "temporaries", "total"))
                 + f" | {cell(r['activation_bytes_per_layer'], 1024, 8)} "
                 + f"{cell(r['activation_bytes_per_layer_formula'], 1024, 8)} | {step} {r['first_step_s']:8.1f}")
    if any(r["config"]["compile"] for r in rows):
        log.info("compiled: n/a, the memory-tracked step runs compiled blocks eager (a dispatch mode would keep "
                 "them eager for good), and eager memory is not theirs; on GPU the record's peak_memory_bytes "
                 "measures them")


if __name__ == "__main__":
    run_main(main)
