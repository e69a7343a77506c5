"""A single-process mixture-of-experts layer, written independently of 05-advanced/expert_parallel.py,
that the expert-parallel tests compare the distributed layer and training with.

It follows the rules the chapter states (top-k of the router's softmax; an expert takes at most
ceil(capacity_factor x T x k / E) of T tokens, first choices before second choices, earlier tokens
first; a token's output is the sum of its kept experts' outputs weighted by their probabilities;
Switch Transformer's E x sum f_i P_i) with a plain Python loop over the routing choices instead of
one-hot cumsums, sorts and all-to-alls. It takes the script's parameter names (``router.weight``,
``experts.<i>.fc_in.weight`` ...), so a state dict moves between the two.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from distkit.models import TinyGPT, TokenTask, lm_loss


class LoopMoE(nn.Module):
    """One MoE layer over all experts, in one process. ``kept`` after a forward: the routing choices
    each expert took (a list of E counts)."""

    def __init__(self, router: nn.Linear, experts: dict[str, nn.Module], top_k: int, capacity_factor: float):
        super().__init__()
        self.router, self.experts = router, nn.ModuleDict(experts)
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.aux_loss, self.kept = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        num_tokens, num_experts = len(tokens), len(self.experts)
        probs = torch.softmax(self.router(tokens), dim=-1)
        gate, chosen = torch.topk(probs, self.top_k, dim=-1)
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / num_experts)
        choices = chosen.tolist()
        taken = {e: [] for e in range(num_experts)}  # expert -> [(token, choice)] in arrival order
        for choice in range(self.top_k):
            for t in range(num_tokens):
                e = choices[t][choice]
                if len(taken[e]) < capacity:
                    taken[e].append((t, choice))
        out = torch.zeros_like(tokens)
        for e, pairs in taken.items():
            if pairs:
                rows, columns = torch.tensor(pairs).t()
                out = out.index_add(0, rows, self.experts[str(e)](tokens[rows]) * gate[rows, columns][:, None])
        picks = torch.tensor([sum(row.count(e) for row in choices) for e in range(num_experts)]) / chosen.numel()
        self.aux_loss = num_experts * (picks * probs.mean(dim=0)).sum()
        self.kept = [len(taken[e]) for e in range(num_experts)]
        return out.view_as(x)


def loop_moe_model(model: TinyGPT) -> TinyGPT:
    """``model`` (the script's MoE GPT, every expert present) with each MoE layer replaced by a
    :class:`LoopMoE` holding the same modules (so the same parameters and names)."""
    for block in model.blocks:
        moe = block.mlp
        block.mlp = LoopMoE(moe.router, dict(moe.experts.items()), moe.top_k, moe.capacity_factor)
    return model


def train_moe_one_process(model: TinyGPT, steps: int, batch: int, groups: int, lr: float,
                          aux_weight: float) -> tuple[dict, list[float], list]:
    """SGD on the whole global batch of each step, the batch cut into ``groups`` equal slices that
    route (and fill experts' capacity) separately, as ``groups`` ranks do: the loss is the mean over
    slices of (cross-entropy + aux_weight x the layers' load-balancing losses).

    Returns (final state dict, each step's mean cross-entropy, routing[step][slice][layer] = the
    choices each expert kept)."""
    task, optimizer = TokenTask(model.cfg, seed=0), torch.optim.SGD(model.parameters(), lr=lr)
    losses, routing = [], []
    for step in range(steps):
        inputs, targets = task.global_batch(step, batch)
        per = batch // groups
        optimizer.zero_grad()
        total, cross_entropy, kept = 0.0, 0.0, []
        for g in range(groups):
            ce = lm_loss(model(inputs[g * per:(g + 1) * per]), targets[g * per:(g + 1) * per])
            total = total + ce + aux_weight * sum(block.mlp.aux_loss for block in model.blocks)
            cross_entropy += ce.item() / groups
            kept.append([block.mlp.kept for block in model.blocks])
        (total / groups).backward()
        optimizer.step()
        losses.append(cross_entropy)
        routing.append(kept)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, routing
