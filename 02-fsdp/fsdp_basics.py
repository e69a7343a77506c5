"""Chapter 02: what FSDP does to a model, made visible.

DDP (chapter 01) keeps a full copy of every parameter, gradient and optimizer state on every rank.
FSDP keeps only a 1/world_size *shard* of each on each rank, and rebuilds a layer's full weights
just in time:

    forward of block i:   all-gather block i's shards -> compute -> free the gathered copy (reshard)
    backward of block i:  all-gather again -> compute grads -> reduce-scatter them -> keep my shard
    optimizer step:       each rank updates only its own shard (Adam state is sharded too)

This script shards the transformer (the small GPT, or with ``--arch llama`` the Hugging Face Llama)
with FSDP2 ``fully_shard``, has every rank print the shard it holds of a few parameters next to their
full shapes, traces one training step (which collective runs when), then trains and appends a
harness record (``--save PATH``: the trained full weights too).

    torchrun --nproc_per_node=4 02-fsdp/fsdp_basics.py
    python 02-fsdp/fsdp_basics.py        # a world of one: the "shards" are the whole tensors
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.checkpoint import atomic_save
from distkit.flags import add_checkpoint_args, add_training_args, check_global_batch, positive_int, save_path
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.predictors import fsdp_prediction
from distkit.text import make_task
from distkit.theory import param_shapes

# What the root unit holds besides the blocks, per architecture (the names are each model's own).
ROOT_PARTS = {"gpt": "embeddings, ln_f, lm_head", "llama": "embed_tokens, norm, lm_head"}


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Shard the transformer (--arch gpt or llama) with FSDP2 fully_shard, show each "
                    "rank's shards, trace one step's all-gathers and reduce-scatters, then train.",
        epilog="example: torchrun --nproc_per_node=4 02-fsdp/fsdp_basics.py --steps 200")
    add_training_args(parser, steps=200, global_batch_size=32, lr=3e-3, warmup_steps=2,
                      results="runs/fsdp_basics.jsonl", helps={"lr": "AdamW learning rate"})
    parser.add_argument("--log-every", type=positive_int, default=50,
                        help="log the loss every N steps (default: 50)")
    add_checkpoint_args(parser, save="none")
    add_model_args(parser)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    model_config_from_args(args)  # a width that does not split into the heads: one error line
    return args


def describe(t):
    """Shape and storage of a parameter as this rank sees it right now."""
    if isinstance(t, DTensor):
        local = t.to_local()
        return f"DTensor shard {tuple(local.shape)} of {tuple(t.shape)}"
    return f"full Tensor {tuple(t.shape)}"


class CollectiveTrace(TorchDispatchMode):
    """Writes one line per collective as it is dispatched, tagged forward or backward."""

    def __init__(self, events, unit_names):
        super().__init__()
        self.events = events
        self.unit_names = unit_names  # gathered bytes -> which FSDP unit that is

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::") and name != "c10d::barrier":
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward "
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.events.append(f"  {phase}  {name.removeprefix('c10d::'):<22} {nbytes:>9,} B  "
                               f"{self.unit_names.get(nbytes, '')}")
        return func(*args, **(kwargs or {}))


def print_in_rank_order(lines, ctx):
    """Each rank prints its own lines; barriers keep the ranks' blocks in order."""
    for rank in range(ctx.world_size):
        if rank == ctx.rank:
            print("\n".join(f"[rank {ctx.rank}] {line}" for line in lines), flush=True)
        dist.barrier()


def shown_parameters(model):
    """The parameters the lesson shows, found in the model itself (either architecture): the first
    (the token embedding), the first block's first matrix (its attention's query projection) and
    first vector (its first norm), and the last (the LM head; a tied model's last is the final norm).
    Returns (their full names, the first block's name prefix, the first matrix's name inside it)."""
    names = {id(m): name for name, m in model.named_modules()}
    block_prefix = names[id(model.blocks[0])] + "."
    params = dict(model.named_parameters())
    in_block = [n for n in params if n.startswith(block_prefix)]
    matrix = next(n for n in in_block if params[n].dim() == 2)
    vector = next(n for n in in_block if params[n].dim() == 1)
    first, last = next(iter(params)), list(params)[-1]
    return [first, matrix, vector, last], block_prefix, matrix.removeprefix(block_prefix)


def gathered_bytes(shapes, world_size):
    """Bytes one FSDP unit's all-gather moves (and its fp32 reduce-scatter too): distkit.predictors'
    FSDP2 model, each parameter's dim 0 padded to a multiple of the world size. None alone (no
    collectives in a world of one)."""
    _, comm = fsdp_prediction(shapes, world_size, 1, reshard_blocks=False, wrap="root")  # one unit
    return int(comm["all_gather"]["bytes"]) if comm else None


def trace_one_step(model, optimizer, inputs, targets, ctx):
    """Run one step with hooks on block 0 and a collective trace; returns (trace lines, global loss)."""
    _, block_prefix, matrix = shown_parameters(model)
    blocks_prefix = block_prefix.removesuffix("0.")  # "blocks." (GPT) or "model.layers." (Llama)
    shapes = param_shapes(model.cfg)
    unit_names = {gathered_bytes({n: s for n, s in shapes.items() if n.startswith(block_prefix)},
                                 ctx.world_size): "<- a block's unit",
                  gathered_bytes({n: s for n, s in shapes.items() if not n.startswith(blocks_prefix)},
                                 ctx.world_size): f"<- root unit ({ROOT_PARTS[model.cfg.arch]})"}
    events = []
    block = model.blocks[0]
    owner_path, attribute = matrix.rsplit(".", 1)
    owner, label = block.get_submodule(owner_path), ".".join(matrix.split(".")[-2:])  # q_proj.weight
    weight = lambda: getattr(owner, attribute)  # noqa: E731 - FSDP swaps this attribute in and out
    # Forward hooks run in registration order; fully_shard registered its own (all-gather before,
    # reshard after) earlier, so these see the parameter as FSDP left it.
    handles = [
        block.register_forward_pre_hook(
            lambda *_: events.append(f"  block 0 forward starts:  {label} is {describe(weight())}")),
        block.register_forward_hook(
            lambda *_: events.append(f"  block 0 forward ends:    {label} is {describe(weight())}")),
    ]
    events.append(f"  before the step:          {label} is {describe(weight())}")
    with CollectiveTrace(events, unit_names):
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs), targets)
        events.append("  --- loss.backward() ---")
        loss.backward()
        events.append(f"  after backward: {label}.grad is {describe(weight().grad)}")
        optimizer.step()
    for handle in handles:
        handle.remove()
    dist.all_reduce(loss := loss.detach().clone())
    return events, loss.item() / ctx.world_size


def main(argv=None):
    args = parse_args(argv)
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        shard_trace_and_train(args, ctx)


def shard_trace_and_train(args, ctx):
    """Shard the model, show the shards, trace one step, train, write the record."""
    log = setup_logging(ctx.rank)
    check_global_batch(args.global_batch_size, ctx.world_size)
    cfg = model_config_from_args(args)
    path = save_path(args.save)
    model = build_model(cfg).to(ctx.device)  # same seed on every rank: same full weights to cut from
    shown, _, _ = shown_parameters(model)  # names taken before sharding (fully_shard keeps them)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    # The ranks FSDP shards over, on the device this job computes on. Passed explicitly: without
    # a mesh, fully_shard builds one for the host's accelerator (CUDA on any GPU machine), which
    # would move a `--device cpu` job's parameters to a GPU, or send rank 5 of 8 CPU ranks on a
    # 4-GPU host to a GPU that does not exist.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    # Bottom-up: each block becomes one FSDP unit (one all-gather, one reduce-scatter); the root
    # call takes what is left (embeddings, final norm, LM head). Parameters become DTensors
    # sharded on dim 0, and each rank frees the rows it does not own.
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    params = dict(model.named_parameters())
    lines, width = [], max(28, *map(len, shown))
    for name in shown:
        local = params[name].to_local()
        full_bytes = torch.Size(full_shapes[name]).numel() * local.element_size()
        lines.append(f"{name:<{width}} full {str(full_shapes[name]):<10} -> my shard "
                     f"{str(tuple(local.shape)):<10} {local.numel() * local.element_size():>7,} of "
                     f"{full_bytes:>7,} B")
    mine = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    lines.append(f"all parameters: I hold {mine:,} of {total:,} values ({mine / total:.0%})")
    print_in_rank_order(lines, ctx)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    task = make_task(cfg, args)

    def batch(step):
        inputs, targets = task.global_batch(step, args.global_batch_size)
        return (rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device),
                rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device))

    events, first_loss = trace_one_step(model, optimizer, *batch(0), ctx)
    log.info(f"one training step, as rank 0 sees it ({len(model.blocks)} blocks + root = "
             f"{len(model.blocks) + 1} FSDP units):\n" + "\n".join(events))
    log.info(f"step    0 | loss {first_loss:.4f}")

    harness = Harness(ctx, "fsdp_full_shard", model=model, optimizer=optimizer,
                      warmup_steps=args.warmup_steps,
                      config={"script": "fsdp_basics", "global_batch_size": args.global_batch_size,
                              "precision": "fp32", "lr": args.lr, "wrap": "block"})
    tokens_per_step = args.global_batch_size * cfg.seq_len
    for step in progress(range(1, args.steps), ctx.rank, total=args.steps - 1, desc="train"):
        inputs, targets = batch(step)
        with harness.step(samples=args.global_batch_size, tokens=tokens_per_step):
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            dist.all_reduce(loss := loss.detach().clone())
            log.info(f"step {step:4d} | loss {loss.item() / ctx.world_size:.4f}")
    record = harness.finish(args.results)
    if path:
        # Collective: every shard is all-gathered; rank 0 alone keeps the full tensors, in CPU memory.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if ctx.is_main:
            atomic_save(full, path)
    if ctx.is_main:
        m = record["metrics"]
        comm = ", ".join(f"{k} {v['calls']:.0f} calls {v['bytes']:,.0f} B"
                         for k, v in m["comm_per_step"].items()) or "no collectives (one rank)"
        speed = (f"median step {m['step_time_s_median'] * 1e3:.0f} ms | {m['tokens_per_s']:,.0f} tokens/s"
                 if m["timed_steps"] else "no timed steps (raise --steps)")
        log.info(f"per step: {comm} | {speed} | record appended to {args.results}")
        if path:
            log.info(f"trained full weights saved to {path}")


if __name__ == "__main__":
    run_main(main)
