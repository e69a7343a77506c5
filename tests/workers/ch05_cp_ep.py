"""Worker (4 ranks): the layers of chapter 05's context_parallel.py and expert_parallel.py against
single-process computations, each with deliberately broken copies of the script (negative controls).

    torchrun --nproc_per_node=4 tests/workers/ch05_cp_ep.py --out RESULT.json

Ring attention (``RingAttention`` of context_parallel.py) at cp = 2 (two rings, ranks 0-1 and 2-3)
and cp = 4, with the zig-zag and the contiguous layout: every rank's output and the gradients of
its queries, keys and values, against ``F.scaled_dot_product_attention(is_causal=True)`` on the
whole sequence and autograd (one process, computed on every rank). The layout each rank must hold is
written out here, not taken from the script. Broken copies: the diagonal chunk pairs unmasked,
future chunks not skipped, partial results merged without rescaling, dK/dV never sent home.

The MoE layer (``MoE`` of expert_parallel.py) at ep = 4 and at ep = 2 (dp 2 x ep 2): each rank
routes its own tokens (a router scaled up so experts overflow their capacity and drop tokens); the
outputs, the input gradients, the router's gradient (summed over every rank) and each expert's
gradient (summed over the ranks holding it) against ``LoopMoE`` (tests/workers/moe_reference.py)
run on every rank's tokens in one process. Token counts: what each rank sent each expert, what each
expert's rank received from it, and what the reference's experts kept. Broken copies: the combine
returns rows in expert order instead of arrival order; received rows not regrouped by expert.

Rank 0 writes ``{check: value}`` to ``--out``: max differences (all ranks' maximum) and counts.
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.harness import RegionTimer
from distkit.models import model_config
from moe_reference import LoopMoE  # tests/workers/, beside this worker
from mutation import mutated_source

CHAPTER = Path(__file__).resolve().parents[2] / "05-advanced"

CP_MUTANTS = {
    "unmasked_diagonal": ("yield i, j, k_chunk == q_chunk", "yield i, j, False"),
    "future_not_skipped": ("if k_chunk <= q_chunk:  # a later chunk", "if True:  # a later chunk"),
    "merge_not_rescaled": ("return out * torch.exp(lse - new)[..., None] + "
                           "block_out * torch.exp(block_lse - new)[..., None], new", "return out + block_out, new"),
    "dkv_not_sent_home": ("if n > 1:  # dK/dV of the block travel", "if False:  # dK/dV of the block travel"),
}
EP_MUTANTS = {
    "combine_unpermuted": ("outputs[by_expert.argsort()]", "outputs"),
    "rows_not_regrouped": ("received[by_expert].split(per_expert)", "received.split(per_expert)"),
}


def script(name: str, old: str | None = None, new: str | None = None) -> types.ModuleType:
    """A chapter script as a module, optionally with one piece of its source replaced."""
    path = CHAPTER / name
    module = types.ModuleType(f"mutant_{path.stem}")
    module.__file__ = str(path)
    source = path.read_text() if old is None else mutated_source(path, old, new)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def groups_of(size: int, world: int) -> tuple:
    """Consecutive blocks of ``size`` ranks (every rank must create every group): this rank's block,
    and the group of ranks at this rank's position in every block."""
    rank = dist.get_rank()
    blocks = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    columns = [dist.new_group(list(range(c, world, size))) for c in range(size)]
    return blocks[rank // size], columns[rank % size]


def all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def ring_attention_diff(module, cp: int, group, layout: str) -> tuple[float, float]:
    """max |ring - SDPA| over the output and the three input gradients; the chunk pairs computed."""
    torch.manual_seed(1234)
    B, H, S, D = 2, 2, 8 * cp, 8
    q, k, v, dout = (torch.randn(B, H, S, D) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=True).backward(dout)
    ref_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    r, size = dist.get_rank(group), S // (2 * cp)
    chunks = (r, 2 * cp - 1 - r) if layout == "zigzag" else (2 * r, 2 * r + 1)  # what rank r must hold
    index = torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    stats = {"pairs": 0, "timer": RegionTimer(torch.device("cpu"))}
    out = module.RingAttention.apply(*mine, group, layout, stats)
    out.backward(dout[:, :, index])
    diff = max([(out - ref_out[:, :, index]).abs().max().item()]
               + [(m.grad - f.grad[:, :, index]).abs().max().item() for m, f in zip(mine, full)])
    return all_max(diff), stats["pairs"]


def moe_check(module, ep: int, ep_group, dp_group, world: int) -> dict:
    """The MoE layer with experts over ``ep_group`` against LoopMoE on every rank's tokens."""
    cfg, num_experts, top_k, capacity_factor = model_config("gpt", "tiny"), 8, 2, 1.0
    torch.manual_seed(0)
    moe = module.MoE(cfg, num_experts, top_k, capacity_factor)
    with torch.no_grad():  # a confident, uneven router: some experts overflow and drop choices
        moe.router.weight.normal_(0, 0.5)
    full = module.MoE(cfg, num_experts, top_k, capacity_factor)  # a container for every expert
    reference = LoopMoE(full.router, dict(full.experts.items()), top_k, capacity_factor)
    reference.load_state_dict(moe.state_dict())  # the same weights, all experts
    xs = [torch.randn(2, 8, cfg.n_embd, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    ws = [torch.randn(2, 8, cfg.n_embd, generator=torch.Generator().manual_seed(200 + r)) for r in range(world)]
    ref_x = [x.clone().requires_grad_() for x in xs]
    ref_out, kept = [], []
    for x, w in zip(ref_x, ws):  # every rank's tokens route (and fill capacity) separately
        ref_out.append(reference(x))
        kept.append(reference.kept)
        (ref_out[-1] * w).sum().backward()

    rank = dist.get_rank()
    moe.shard(ep_group)
    x = xs[rank].clone().requires_grad_()
    out = moe(x)
    (out * ws[rank]).sum().backward()
    diff = max((out - ref_out[rank]).abs().max().item(), (x.grad - ref_x[rank].grad).abs().max().item())
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # every rank's tokens went through the one (replicated) router
    diff = max(diff, (router_grad - reference.router.weight.grad).abs().max().item())
    for name, param in moe.experts.named_parameters():
        grad = param.grad.clone()
        if dp_group is not None:  # the other copies of this expert saw the other rows' tokens
            dist.all_reduce(grad, group=dp_group)
        diff = max(diff, (grad - reference.experts.get_parameter(name).grad).abs().max().item())

    routing = moe.routing[-1]
    gathered = [None] * world
    dist.all_gather_object(gathered, routing)
    local, ep_rank = num_experts // ep, rank % ep
    first_in_row = rank - ep_rank
    # what each rank of my row sent to my experts == what I received from it, source by source
    pairwise = all(gathered[first_in_row + s]["sent"][ep_rank * local + j] == routing["received"][s][j]
                   for s in range(ep) for j in range(local))
    return {"diff": all_max(diff), "pairwise_conserved": bool(all_max(0.0 if pairwise else 1.0) == 0.0),
            "sent": [g["sent"] for g in gathered], "reference_kept": kept,
            "dropped": sum(g["dropped"] for g in gathered)}


def main():
    parser = ArgumentParser()
    parser.add_argument("--out", required=True)
    add_runtime_args(parser)
    args = parser.parse_args()
    with distributed(args) as ctx:
        world = ctx.world_size
        rings = {cp: groups_of(cp, world)[0] for cp in (2, world)}
        ep_groups = {ep: groups_of(ep, world) for ep in (2, world)}
        results = {}
        cp_variants = {"correct": script("context_parallel.py")}
        cp_variants.update({name: script("context_parallel.py", *edit) for name, edit in CP_MUTANTS.items()})
        for name, module in cp_variants.items():
            for cp, group in rings.items():
                for layout in ("zigzag", "contiguous"):
                    diff, pairs = ring_attention_diff(module, cp, group, layout)
                    results[f"cp{cp}_{layout}_{name}"] = diff
                    if name == "correct":
                        gathered = [None] * world
                        dist.all_gather_object(gathered, pairs)
                        results[f"cp{cp}_{layout}_pairs"] = gathered[:cp]
        ep_variants = {"correct": script("expert_parallel.py")}
        ep_variants.update({name: script("expert_parallel.py", *edit) for name, edit in EP_MUTANTS.items()})
        for name, module in ep_variants.items():
            for ep, (ep_group, dp_group) in ep_groups.items():
                check = moe_check(module, ep, ep_group, dp_group if ep < world else None, world)
                results[f"ep{ep}_{name}"] = check["diff"]
                if name == "correct":
                    results[f"ep{ep}_routing"] = {k: v for k, v in check.items() if k != "diff"}
        if ctx.is_main:
            Path(args.out).write_text(json.dumps(results, indent=1))
            for key, value in results.items():
                if isinstance(value, float):
                    print(f"{key}: {value:.2e}", flush=True)


if __name__ == "__main__":
    run_main(main)
