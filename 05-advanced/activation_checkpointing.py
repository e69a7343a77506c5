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

Memory is measured on one untimed step (step 1: the optimizer state exists from step 0) by
``torch.distributed._tools.mem_tracker.MemTracker`` (``FSDPMemTracker``, its FSDP2-aware subclass,
under FSDP): a ``TorchDispatchMode`` that sees every tensor created and sorts its storage into
parameters, gradients, optimizer state, activations (made in forward) and temporaries (made in
backward). The activations a block adds during its forward are printed next to
:func:`activation_bytes_per_layer`, the formula of Korthikanti et al. (2022) redone for this model.
Compiled configurations are not tracked: Dynamo does not compile code that runs under a dispatch
mode, and code it skipped once stays eager for the rest of the process.

    torchrun --nproc_per_node=4 05-advanced/activation_checkpointing.py --ac none full selective --compile off on
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save
from distkit.flags import add_checkpoint_args, add_training_args, non_negative_float, save_path
from distkit.harness import Harness, fresh_memory_peak
from distkit.logs import setup_logging
from distkit.models import (LlamaModelConfig, TokenTask, add_model_args, build_model, lm_loss,
                            model_config_from_args, rank_slice)

aten = torch.ops.aten
# Selective AC saves these ops' outputs (matmuls, attention kernels on every device) and recomputes
# every other op. The same idea as torchtitan's op-level selective AC.
SAVE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}
CATEGORIES = {"params": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param"),
              "grads": ("Gradient", "Sharded Grad", "Unsharded Grad"),
              "optimizer": ("Optstate", "OptState"), "activations": ("Activation",),
              "temporaries": ("Temp", "All Gather", "Reduce Scatter", "Inputs", "Other")}


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
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                        help="adamw (default), or sgd, whose update is proportional to the gradient")
    parser.add_argument("--dropout", type=non_negative_float, default=None,
                        help="override the small GPT's dropout (then AC must replay the same random masks)")
    add_training_args(parser, steps=20, global_batch_size=32, lr=1e-3, warmup_steps=2,
                      results="runs/activation_checkpointing.jsonl",
                      helps={"warmup_steps": "untimed steps before timing (>= 2: step 1 is the memory step)"})
    add_checkpoint_args(parser, save="none", helps={"save": "final weights; {ac} and {compile} are filled in"})
    add_model_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    args.compile = args.compile or ["on"]
    if args.warmup_steps < 2 or args.steps < 2:
        parser.error("--warmup-steps and --steps must be >= 2: step 1 is the memory-tracked step")
    if args.dropout is not None and args.dropout >= 1:
        parser.error(f"argument --dropout: must be < 1, got {args.dropout:g}")
    configs = len(set(args.ac)) * len(set(args.compile))
    one = save_path(args.save, ac="a", compile="off")
    if configs > 1 and one is not None and one == save_path(args.save, ac="b", compile="on"):
        parser.error(f"--save {args.save} names one file for {configs} configurations; put {{ac}} and "
                     "{compile} in it")
    return args


def activation_bytes_per_layer(cfg, micro_batch: int, ac: str) -> int:
    """Bytes one block keeps from its forward for its backward, fp32, dropout 0.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198, section 4.1): s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit training
    (s sequence, b micro-batch, h width, a heads). Their 34*sbh: LayerNorm inputs 4, QKV input 2,
    Q and K 4, V 2, output-projection input 2, MLP input 2, GELU input 8 (4h wide), GELU output 8,
    two 1-byte dropout masks 2. Their 5*a*s^2*b: softmax output 2, its dropout mask 1, dropout output 2.

    This model in fp32 with dropout 0: every 2-byte tensor takes 4 and the masks vanish, so the
    sbh terms are 2 * 32 = 64*sbh. PyTorch's attention (SDPA, flash-style on CPU and GPU) keeps no
    s x s matrix: it saves Q, K, V, its output O and one log-sum-exp per row and head (4*a*s*b
    bytes), and recomputes the scores in backward. O is the output projection's input, already
    counted (the kernel returns it in (b, s, heads, head_dim) layout, so no copy is made). Add
    LayerNorm's mean and 1/std (2 floats per token, 2 norms): 16*s*b. So none = 64*sbh + 4*asb + 16*sb.

    Full AC keeps the block's input only: 4*sbh (Korthikanti's 2sbh in 16-bit). Selective AC
    (:data:`SAVE_OPS`) keeps the input (1), the outputs of the matmuls (Q, K, V: 3, output projection
    1, MLP up 4 and down 1) and attention's output O (1) and log-sum-exp: 4*11*sbh + 4*asb, and
    recomputes the norms, GELU and residual adds in backward.

    The Llama (``--arch llama``, per token, 4 bytes each): each RMSNorm keeps its normalized input
    and its output (2h, plus 1/rms: 1 float), Q h, K and V h*g/a each (g key/value heads), O h, the
    residual sum h, the block output h, SwiGLU's gate, SiLU, up and product 4*I (I the MLP width), the
    log-sum-exp a: none = 4sb*(8h + 2hg/a + 4I + a + 2). Selective keeps the input, the q/k/v/o
    projections' and the MLP's three matmul outputs, and O: 4sb*(5h + 2hg/a + 2I + a).
    """
    s, b, h, a = cfg.seq_len, micro_batch, cfg.n_embd, cfg.n_head
    if isinstance(cfg, LlamaModelConfig):
        kv, mlp = 2 * h * cfg.n_kv_head // a, cfg.intermediate_size
        per_token = {"none": 8 * h + kv + 4 * mlp + a + 2, "full": h, "selective": 5 * h + kv + 2 * mlp + a}
    else:
        per_token = {"none": 16 * h + a + 4, "full": h, "selective": 11 * h + a}
    return 4 * s * b * per_token[ac]


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


def track_memory(model, optimizer, strategy, blocks, step):
    """Run ``step()`` under MemTracker: (peak bytes by category, activation bytes each block added).

    The peak is MemTracker's snapshot at the moment the total peaked (in backward, or in the
    optimizer step when activations are small). FSDPMemTracker knows FSDP2's all-gathered weights
    and communication buffers; both count recomputed activations in backward as temporaries."""
    tracker = FSDPMemTracker(model, optimizer) if strategy == "fsdp" else MemTracker()
    if strategy != "fsdp":  # FSDPMemTracker registers them itself
        tracker.track_external(model, optimizer)
    added, handles = [], []

    def activations():
        return sum(snap.get("Activation", 0) for snap in tracker.get_tracker_snapshot().values())

    for block in blocks:  # registered after FSDP's own hooks: the block's weights are gathered by then
        handles.append(block.register_forward_pre_hook(lambda m, a: added.append(-activations())))
        handles.append(block.register_forward_hook(lambda m, a, o: added.__setitem__(-1, added[-1] + activations())))
    try:
        with tracker:
            step()
    finally:
        for handle in handles:
            handle.remove()
    peak = {}  # summed over devices (one here), MemTracker's categories folded into five
    for snap in tracker.get_tracker_snapshot("peak").values():
        for name, kinds in CATEGORIES.items():
            peak[name] = peak.get(name, 0) + sum(snap.get(k, 0) for k in kinds)
        peak["total"] = peak.get("total", 0) + snap["Total"]
    return peak, added


def train_one(ac, compiled, args, ctx, cfg, task, log, meshes):
    fresh_memory_peak(ctx.device)
    torch.manual_seed(args.seed)  # the same weights and dropout masks in every configuration
    model = build_model(cfg).to(ctx.device)
    apply_ac_and_compile(model, ac, compiled)
    blocks = list(model.blocks)
    model = wrap(model, args.strategy, ctx, meshes)
    optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[args.optimizer](model.parameters(), lr=args.lr)
    name = f"{args.strategy}_ac_{ac}" + ("_compiled" if compiled else "")
    # A TorchDispatchMode (the harness's collective counter, MemTracker) makes Dynamo skip a compiled
    # block's code, and skipped code stays eager for the rest of the process: compiled runs take
    # neither (communication does not change: DDP and FSDP2 run outside the compiled blocks).
    harness = Harness(ctx, name, model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      comm_steps=0 if compiled else 1,
                      config={"script": "activation_checkpointing", "ac": ac, "compile": compiled,
                              "sharding": args.strategy, "global_batch_size": args.global_batch_size,
                              "optimizer": args.optimizer, "lr": args.lr})
    losses, memory, first_step_s = [], None, None
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
            if step == 1 and not compiled:  # untimed (a warm-up step): tracking intercepts every op
                memory = track_memory(model, optimizer, args.strategy, blocks, lambda: losses.append(one_step()))
            else:
                losses.append(one_step())
        if step == 0:  # where compile happens; on GPU wait for the step's kernels too
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            first_step_s = time.perf_counter() - started
    peak, measured = (memory[0], sum(memory[1]) / len(memory[1])) if memory else (None, None)  # blocks' mean
    # the formula counts dropout-free blocks: with dropout the masks (and attention's) come on top
    formula = None if getattr(cfg, "dropout", 0) else activation_bytes_per_layer(cfg, args.global_batch_size // ctx.world_size, ac)
    loss = torch.stack([l.detach() for l in losses])
    dist.all_reduce(loss)
    path = save_path(args.save, ac=ac, compile="on" if compiled else "off")
    if path:  # a collective under FSDP (every rank gathers); the single-process names, on rank 0's CPU
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if ctx.is_main:
            atomic_save({"model": full}, path)
    return harness.finish(args.results, extra={
        "losses": (loss / ctx.world_size).tolist(), "peak_by_category_bytes": peak,
        "activation_bytes_per_layer": measured, "activation_bytes_per_layer_formula": formula,
        "first_step_s": first_step_s})


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        log = setup_logging(ctx.rank)
        if args.global_batch_size % ctx.world_size:
            raise UsageError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                             f"{ctx.world_size} ranks")
        cfg = model_config_from_args(args)
        if args.dropout is not None:
            if isinstance(cfg, LlamaModelConfig):
                raise UsageError("--dropout applies to --arch gpt only (the Llama has none)")
            cfg = dataclasses.replace(cfg, dropout=args.dropout)
        task = TokenTask(cfg, seed=args.seed)
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
        p, m = r["peak_by_category_bytes"] or {}, r["metrics"]
        step = f"{m['step_time_s_median'] * 1e3:7.1f}" if m["timed_steps"] else "    n/a"
        log.info(f"{r['config']['ac']:>9} {'on' if r['config']['compile'] else 'off':>7} | "
                 + " ".join(cell(p.get(k), mib, 6) for k in ("params", "grads", "optimizer", "activations",
                                                             "temporaries", "total"))
                 + f" | {cell(r['activation_bytes_per_layer'], 1024, 8)} "
                 + f"{cell(r['activation_bytes_per_layer_formula'], 1024, 8)} | {step} {r['first_step_s']:8.1f}")
    if any(r["config"]["compile"] for r in rows):
        log.info("compiled: n/a, MemTracker cannot see compiled blocks (Dynamo leaves code run under a "
                 "dispatch mode eager for good); on GPU the record's peak_memory_bytes measures them")


if __name__ == "__main__":
    run_main(main)
