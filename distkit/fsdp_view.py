"""What FSDP2 did to a model, shown: each rank's shards, and one training step traced collective by
collective. Chapter 02's ``fsdp_basics.py`` shards a model and calls these two; the sharding is its
lesson, this module is the evidence.

* :func:`print_shards`: every rank prints, in rank order, its shard of four parameters next to their
  full shapes, and how much of the model it holds.
* :func:`trace_one_step`: one training step with hooks on block 0 and a dispatch-level trace of every
  collective, each labelled with the FSDP unit whose bytes it moves (from :mod:`distkit.predictors`'
  FSDP2 model, so a label that stops matching shows the prediction is off).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .models import lm_loss
from .predictors import fsdp_prediction
from .theory import param_shapes

# What the root unit holds besides the blocks, per architecture (the names are each model's own).
ROOT_PARTS = {"gpt": "embeddings, ln_f, lm_head", "llama": "embed_tokens, norm, lm_head"}


def describe(t) -> str:
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


def print_in_rank_order(lines, ctx) -> None:
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


def print_shards(model, ctx) -> None:
    """Every rank, in rank order: its shard of the shown parameters next to their full shapes (a
    DTensor's ``shape`` is the full one, ``to_local()`` what this rank holds), and its share of all
    parameter values."""
    shown, _, _ = shown_parameters(model)
    params = dict(model.named_parameters())
    lines, width = [], max(28, *map(len, shown))
    for name in shown:
        full, local = tuple(params[name].shape), params[name].to_local()
        full_bytes = torch.Size(full).numel() * local.element_size()
        lines.append(f"{name:<{width}} full {str(full):<10} -> my shard "
                     f"{str(tuple(local.shape)):<10} {local.numel() * local.element_size():>7,} of "
                     f"{full_bytes:>7,} B")
    mine = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    lines.append(f"all parameters: I hold {mine:,} of {total:,} values ({mine / total:.0%})")
    print_in_rank_order(lines, ctx)


def gathered_bytes(shapes, world_size):
    """Bytes one FSDP unit's all-gather moves (and its fp32 reduce-scatter too): distkit.predictors'
    FSDP2 model, each parameter's dim 0 padded to a multiple of the world size. None alone (no
    collectives in a world of one)."""
    _, comm = fsdp_prediction(shapes, world_size, 1, reshard_blocks=False, wrap="root")  # one unit
    return int(comm["all_gather"]["bytes"]) if comm else None


def trace_one_step(model, optimizer, inputs, targets, ctx):
    """Run one training step with hooks on block 0 and a collective trace; returns (trace lines,
    the global loss)."""
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
