"""Chapter 05: expert parallelism (EP): a mixture-of-experts (MoE) layer with its experts spread over
ranks, and tokens sent to the experts they chose with ``all_to_all_single``.

An MoE layer replaces a block's MLP by E expert MLPs and a router (Shazeer et al. 2017; GShard,
Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021). The router scores every token against
every expert; the token goes to its top k experts and its output is their outputs weighted by the
router's probabilities. Parameters grow with E while the compute per token stays that of k MLPs.

Expert parallelism puts E / ep experts on each of ep ranks. Every rank routes its own tokens, then:

    dispatch  all_to_all_single: each rank sends each token to the rank owning its expert
              (uneven: as many rows to each rank as its experts were chosen; the counts go first)
    experts   each rank runs its experts on the tokens it received, from every rank
    combine   all_to_all_single back (the splits swapped): each token's expert outputs return home,
              weighted by the router's probabilities and added up

Backward runs the same two exchanges in reverse (the gradient of a dispatch is a combine).

Capacity: an expert takes at most C = ceil(capacity_factor x T x k / E) of a rank's T tokens (first
choices before second choices, earlier tokens first); the rest are *dropped* (the token skips that
expert; its residual connection carries it on). A load-balancing loss (Switch Transformer, eq. 4)
keeps the router from sending everything to a few experts: L_aux = E x sum_i f_i x P_i, f_i the
fraction of routing choices that picked expert i, P_i the mean router probability of expert i. It
is 1 when either is uniform, up to E when both pile onto one expert; f is a count (no gradient), so
its gradient lowers the probability of the experts that got most tokens.

EP composes with data parallelism on a 2-D mesh (dp, ep): ranks of one row hold different experts
and exchange tokens; ranks of one column hold the same experts and train on different data. Every
rank's loss covers its own tokens, so the replicated (dense) parameters' gradients are averaged over
all ranks; an expert's gradient already sums what every rank of its row sent it, so it is summed over
the *dp* column only, and divided by the number of ranks as well.

    torchrun --nproc_per_node=2 05-advanced/expert_parallel.py
    torchrun --nproc_per_node=4 05-advanced/expert_parallel.py --ep 2
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main, theory
from distkit.checkpoint import atomic_save
from distkit.flags import (
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    check_global_batch,
    make_optimizer,
    non_negative_float,
    positive_float,
    positive_int,
    require_steps,
    save_path,
)
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import MLP, TinyGPT, add_model_args, lm_loss, model_config_from_args, rank_slice
from distkit.paths import check_outputs
from distkit.runtime import reduce_gradients
from distkit.text import make_task


def parse_args():
    parser = ArgumentParser(
        description="Train the small GPT with a mixture-of-experts MLP in every block, the experts split over "
                    "--ep ranks and the job's ranks arranged as a (dp, ep) mesh.",
        epilog="example: torchrun --nproc_per_node=4 05-advanced/expert_parallel.py --ep 2")
    add_model_args(parser)
    moe = parser.add_argument_group("mixture of experts")
    moe.add_argument("--num-experts", type=positive_int, default=8, help="experts per MoE layer (default: 8)")
    moe.add_argument("--top-k", type=positive_int, default=2, help="experts each token goes to (default: 2)")
    moe.add_argument("--capacity-factor", type=positive_float, default=1.25,
                     help="an expert takes at most ceil(factor x tokens x k / experts) of a rank's tokens "
                          "(default: 1.25)")
    moe.add_argument("--aux-weight", type=non_negative_float, default=0.01,
                     help="weight of the load-balancing loss (default: 0.01, Switch Transformer's)")
    moe.add_argument("--ep", type=positive_int, default=None,
                     help="ranks that share one copy of the experts (default: all ranks); dp = ranks / ep")
    training = add_training_args(parser, helps={
        "global_batch_size": "sequences per optimizer step over all ranks (each rank routes its own slice)"})
    add_optimizer_arg(training)
    add_checkpoint_args(parser, save="checkpoints/expert_parallel.pt")
    add_runtime_args(parser)
    args = parser.parse_args()
    require_steps(parser, args, timed=False, why="the tokens each rank routes to each expert")
    return args


def check_moe(num_experts: int, top_k: int, ep: int, world_size: int) -> None:
    """The experts split evenly over the EP ranks, and a token cannot pick more experts than exist."""
    if top_k > num_experts:
        raise UsageError(f"--top-k {top_k} is larger than --num-experts {num_experts}")
    if world_size % ep:
        raise UsageError(f"--ep {ep} does not divide the {world_size} ranks (mesh dp x ep)")
    if num_experts % ep:
        raise UsageError(f"--num-experts {num_experts} is not divisible by --ep {ep}")


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E x sum_i f_i P_i (module docstring); ``probs`` (T, E) the
    router's probabilities, ``chosen`` (T, k) the experts picked (before any is dropped)."""
    f = torch.bincount(chosen.reshape(-1), minlength=num_experts).to(probs.dtype) / chosen.numel()
    return num_experts * (f * probs.mean(dim=0)).sum()


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


class MoE(nn.Module):
    """Router, top-k, capacity, experts. Before :meth:`shard` every expert is here; after it only this
    rank's, named by their global index (``experts.5.fc_in.weight``), so state dicts merge back."""

    def __init__(self, cfg, num_experts: int, top_k: int, capacity_factor: float):
        super().__init__()
        self.router = nn.Linear(cfg.n_embd, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(i): MLP(cfg) for i in range(num_experts)})
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.group, self.aux_loss, self.routing = None, None, []

    def shard(self, group) -> None:
        """Keep the experts this rank owns in ``group`` (the EP ranks of its mesh row)."""
        local = self.num_experts // dist.get_world_size(group)
        first = dist.get_rank(group) * local
        self.experts = nn.ModuleDict({str(i): self.experts[str(i)] for i in range(first, first + local)})
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        T, E, k = len(tokens), self.num_experts, self.top_k
        probs = self.router(tokens).softmax(dim=-1)
        gate, chosen = probs.topk(k, dim=-1)  # (T, k): each token's k experts and their probabilities
        self.aux_loss = load_balancing_loss(probs, chosen, E)
        # One routing choice per (choice, token), first choices first; each expert keeps its first C.
        expert_of, weight_of = chosen.t().reshape(-1), gate.t().reshape(-1)
        token_of = torch.arange(T, device=x.device).repeat(k)
        capacity = math.ceil(self.capacity_factor * T * k / E)
        place = (F.one_hot(expert_of, E).cumsum(dim=0) - 1).gather(1, expert_of[:, None]).squeeze(1)
        keep = place < capacity
        expert_of, token_of, weight_of = expert_of[keep], token_of[keep], weight_of[keep]
        order = expert_of.argsort(stable=True)  # grouped by expert, i.e. by the rank that owns it
        counts = torch.bincount(expert_of, minlength=E)  # what this rank sends to each expert
        out, received = self.dispatch_compute_combine(tokens[token_of[order]], counts)
        self.routing.append({"sent": counts.tolist(), "received": received.tolist(), "dropped": int((~keep).sum())})
        combined = torch.zeros_like(tokens).index_add(0, token_of[order], out * weight_of[order, None])
        return combined.view_as(x)

    def dispatch_compute_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send ``rows`` (grouped by expert, ``counts`` per expert) to their experts' ranks, run the
        experts, and bring the outputs back in the same order. Also returns the rows received,
        [source rank][this rank's expert]."""
        ep = dist.get_world_size(self.group)
        local = self.num_experts // ep
        received_counts = torch.empty_like(counts)  # [source rank][my expert]: rows coming my way
        dist.all_to_all_single(received_counts, counts, group=self.group)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = received_counts.view(ep, local).sum(dim=1).tolist()
        received = AllToAll.apply(rows, recv_splits, send_splits, self.group)  # dispatch
        # Arrived by source rank, then expert; regroup by expert to run each expert once.
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(received_counts)
        by_expert = expert_of_row.argsort(stable=True)
        per_expert = received_counts.view(ep, local).sum(dim=0).tolist()
        first = dist.get_rank(self.group) * local
        outputs = torch.cat([self.experts[str(first + j)](chunk)
                             for j, chunk in enumerate(received[by_expert].split(per_expert))])
        back = AllToAll.apply(outputs[by_expert.argsort()], send_splits, recv_splits, self.group)  # combine
        return back, received_counts.view(ep, local)


def build_moe_model(cfg, num_experts: int, top_k: int, capacity_factor: float) -> TinyGPT:
    """The small GPT with every block's MLP replaced by an MoE layer, initialised as TinyGPT is."""
    model = TinyGPT(cfg)
    for block in model.blocks:
        block.mlp = MoE(cfg, num_experts, top_k, capacity_factor)
        block.mlp.apply(TinyGPT._init_weights)
    return model


def make_harness(ctx, args, cfg, model, optimizer, param_count: int, dp: int, ep: int) -> Harness:
    """The harness that times the steps and counts their collectives, with the run's configuration."""
    return Harness(ctx, "ep", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                   param_count=param_count,
                   model_config={"arch": "gpt_moe", **cfg.to_dict(), "num_experts": args.num_experts,
                                 "top_k": args.top_k, "capacity_factor": args.capacity_factor},
                   config={"global_batch_size": args.global_batch_size,
                           "precision": "fp32", "mesh": {"dp": dp, "ep": ep}, "aux_weight": args.aux_weight,
                           "lr": args.lr, "optimizer": args.optimizer})


def log_routing(log, args, cfg, every_rank, losses, aux_losses) -> None:
    """The losses, and the last step's tokens per expert over all ranks with the choices dropped."""
    log.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, load-balancing loss per layer {aux_losses[0]:.3f} -> "
             f"{aux_losses[-1]:.3f} (1 = balanced, {args.num_experts} = one expert) after {args.steps} steps")
    last = [[sum(rank[-1][layer]["sent"][e] for rank in every_rank) for e in range(args.num_experts)]
            for layer in range(cfg.n_layer)]
    dropped = sum(rank[-1][layer]["dropped"] for rank in every_rank for layer in range(cfg.n_layer))
    routed = args.global_batch_size * cfg.seq_len * args.top_k * cfg.n_layer
    log.info("last step, tokens per expert (all ranks): " + " | ".join(
        f"layer {layer}: {' '.join(map(str, counts))}" for layer, counts in enumerate(last))
             + f" | dropped {dropped} of {routed} choices ({dropped / routed:.1%})")


def log_comm_vs_formula(log, args, cfg, record, every_rank, dense, experts, param_count: int,
                        mesh_shape: tuple[int, int]) -> None:
    """The collectives the harness counted on rank 0 next to theory's formula for the same routed
    tokens, what data parallelism alone would move, and the parameter bytes each rank holds."""
    dp, ep = mesh_shape
    # The instrumented step's routing on rank 0 gives the formula's token counts.
    instrumented = every_rank[0][args.warmup_steps]
    sent = [sum(layer["sent"]) for layer in instrumented]
    received = [sum(map(sum, layer["received"])) for layer in instrumented]
    formula = theory.expert_parallel_comm(cfg.n_embd, sent, received, args.num_experts, ep, dp,
                                          dense_numel=sum(p.numel() for p in dense),
                                          expert_numel=sum(p.numel() for p in experts))
    log.info("collectives per step on rank 0 (harness)   vs   formula (its routed token counts)")
    comm = record["metrics"]["comm_per_step"]
    for name, got in comm.items():
        want = formula.get(name, {"calls": 0, "bytes": 0})
        log.info(f"  {name:<11} {got['calls']:>4.0f} calls {got['bytes'] / 2**20:8.3f} MiB   vs   "
                 f"{want['calls']:>4} calls {want['bytes'] / 2**20:8.3f} MiB")
    dp_only = theory.ddp_bytes(param_count, dp * ep)["bus_bytes"]  # every expert on every rank
    log.info(f"on the wire per rank and step: {sum(c['bus_bytes'] for c in comm.values()) / 2**20:.2f} MiB; "
             f"data parallelism alone would all-reduce every expert's gradient: {dp_only / 2**20:.2f} MiB")
    held = [s["params"] for s in record["metrics"]["model_state_bytes_per_rank"]]
    log.info(f"parameter bytes held per rank: {held} (whole model: {param_count * 4})")


def main():
    """Build the (dp, ep) mesh, place the experts, train, report the exchanges."""
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        cfg = model_config_from_args(args)
        ep = args.ep or ctx.world_size
        check_moe(args.num_experts, args.top_k, ep, ctx.world_size)
        check_global_batch(args.global_batch_size, ctx.world_size)
        dp = ctx.world_size // ep
        mesh = init_device_mesh(ctx.device.type, (dp, ep), mesh_dim_names=("dp", "ep"))

        model = build_moe_model(cfg, args.num_experts, args.top_k, args.capacity_factor).to(ctx.device)
        param_count = sum(p.numel() for p in model.parameters())  # before sharding: every expert
        moe_layers = [block.mlp for block in model.blocks]
        for moe in moe_layers:
            moe.shard(mesh["ep"].get_group())
        experts = [p for name, p in model.named_parameters() if ".experts." in name]
        dense = [p for name, p in model.named_parameters() if ".experts." not in name]
        optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
        log.info(f"ep: mesh dp x ep = {dp} x {ep} | {args.num_experts} experts per layer, {args.num_experts // ep} "
                 f"per rank, top-{args.top_k}, capacity factor {args.capacity_factor:g} | {param_count:,} parameters "
                 f"({sum(p.numel() for p in dense):,} dense) | global batch {args.global_batch_size}")

        harness = make_harness(ctx, args, cfg, model, optimizer, param_count, dp, ep)
        task, losses, aux_losses, routing = make_task(cfg, args), [], [], []
        dp_group = mesh["dp"].get_group() if dp > 1 else None
        for step in progress(range(args.steps), ctx.rank, desc="ep"):
            inputs, targets = task.global_batch(step, args.global_batch_size)
            inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)  # every rank its own tokens
            targets = rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
            with harness.step(samples=args.global_batch_size, tokens=args.global_batch_size * cfg.seq_len):
                optimizer.zero_grad(set_to_none=True)
                loss = lm_loss(model(inputs), targets)
                aux = sum(moe.aux_loss for moe in moe_layers)
                (loss + args.aux_weight * aux).backward()  # the exchanges run again, reversed
                reduce_gradients(dense, dist.group.WORLD, ctx.world_size)  # replicated everywhere
                reduce_gradients(experts, dp_group, ctx.world_size)  # replicated down the dp column only
                optimizer.step()
            routing.append([moe.routing.pop() for moe in moe_layers])
            total = torch.stack([loss.detach(), aux.detach()])
            dist.all_reduce(total)
            losses.append(total[0].item() / ctx.world_size)
            aux_losses.append(total[1].item() / ctx.world_size / len(moe_layers))

        # The full model on rank 0: dense weights from anywhere, each expert from the rank of row 0 owning it.
        state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
        shards = [None] * ep
        mine = {name: t for name, t in state.items() if ".experts." in name}
        dist.all_gather_object(shards, mine, group=mesh["ep"].get_group())
        every_rank = [None] * ctx.world_size
        dist.all_gather_object(every_rank, routing)
        # the step whose collectives the harness counted (the first after the warm-up): theory's
        # prediction of the all-to-all bytes needs its routing (distkit.compare.knobs_of_record)
        counted = [rank[args.warmup_steps] for rank in every_rank] if args.steps > args.warmup_steps else None
        record = harness.finish(args.results, extra={"losses": losses, "aux_losses": aux_losses,
                                                     "routing_per_rank": every_rank,
                                                     "counted_routing_per_rank": counted})
        if not ctx.is_main:
            return
        path = save_path(args.save)
        if path:
            full = {n: t for n, t in state.items() if ".experts." not in n}
            for shard in shards:
                full.update(shard)
            atomic_save({"model": full, "config": record["model"], "strategy": "ep"}, path)
        log_routing(log, args, cfg, every_rank, losses, aux_losses)
        log_comm_vs_formula(log, args, cfg, record, every_rank, dense, experts, param_count, (dp, ep))
        step_s = record["metrics"]["step_time_s_median"]
        log.info(f"saved {path or 'nothing (--save none)'} | record appended to {args.results}"
                 + (f" | median step {step_s * 1000:.0f} ms" if step_s else ""))


if __name__ == "__main__":
    run_main(main)
