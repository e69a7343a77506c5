"""Chapter 05: context parallelism (CP): the *sequence* split over ranks, attention computed in a ring.

Every other strategy keeps each sequence whole on a rank, so one sequence's activations (growing with
its length) must fit one device. CP gives each of cp ranks 1/cp of every sequence's tokens. Embeddings,
norms, MLPs and the loss work token by token, so they need nothing from other ranks; attention does:
a query must see the keys and values of every earlier token. Ring attention (Liu et al. 2023) moves
the keys/values instead of the queries: in step i rank r holds the K/V block of rank (r - i) mod cp,
attends its own queries to it while passing the block on to rank r + 1 (point to point), and after
cp steps every query has seen every key. Parameters are replicated, as in DDP: each rank's gradients
cover its tokens only and are averaged over the ranks after backward.

Online softmax makes the blocks add up exactly: a block gives a partial output O_b and the
log-sum-exp l_b of its scores, and two partials merge as l = log(e^l1 + e^l2),
O = O1 e^(l1 - l) + O2 e^(l2 - l), in any order. Backward goes round the ring again: K/V travel as in
forward, the gradients dK/dV accumulated for a block travel with it, and one last hop takes them home.

``--arch llama`` runs the same ring on the tiny Llama: Hugging Face's attention is swapped for
:class:`RingLlamaAttention` (its projections kept), the model is given every chunk's positions so RoPE
turns each token by its place in the whole sequence, and the grouped-query K/V (fewer heads than the
queries) travel the ring with their own heads, widened per block.

Causal attention makes the ring lopsided: query chunk i sees key chunks <= i only. With the sequence
cut into 2cp chunks, a contiguous split leaves the first rank almost idle and the last with most of
the work; the zig-zag split gives rank r chunks r and 2cp-1-r, an early and a late one, and every rank
the same work (cp = 4, chunk pairs computed per rank, a diagonal pair counted as one):

    contiguous  r0 [0 1]  r1 [2 3]  r2 [4 5]  r3 [6 7]   ->  3  7 11 15  (the ring waits for the slowest)
    zig-zag     r0 [0 7]  r1 [1 6]  r2 [2 5]  r3 [3 4]   ->  9  9  9  9

``--impl ring`` (default) is the ring written out here with ``dist.batch_isend_irecv``. ``--impl
torch`` runs PyTorch's own ``torch.distributed.tensor.experimental.context_parallel``: it shards the
input buffers zig-zag (its "head-tail" load balancer) and swaps ``scaled_dot_product_attention`` for a
ring version of SDPA's flash / memory-efficient / cuDNN *CUDA* kernels; on CPU it fails with no
sharding rule for ``_scaled_dot_product_flash_attention_for_cpu`` (torch 2.13), so this script
allows it on CUDA only.

    torchrun --nproc_per_node=2 05-advanced/context_parallel.py
    torchrun --nproc_per_node=4 05-advanced/context_parallel.py
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main, seed_everything, theory
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
from distkit.harness import Harness, RegionTimer
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args
from distkit.paths import check_outputs
from distkit.runtime import reduce_gradients
from distkit.text import make_task

LAYOUTS = ("zigzag", "contiguous")


def parse_args():
    parser = ArgumentParser(
        description="Train the small GPT with context parallelism: every rank holds all weights and 1/cp of "
                    "every sequence; attention runs as a ring. Each --layout runs in turn from the same weights.",
        epilog="example: torchrun --nproc_per_node=4 05-advanced/context_parallel.py --layout zigzag")
    add_model_args(parser)
    parser.add_argument("--impl", choices=["ring", "torch"], default="ring",
                        help="ring = the ring attention written here; torch = PyTorch's context_parallel() "
                             "(CUDA only; its own zig-zag split) (default: ring)")
    parser.add_argument("--layout", nargs="+", choices=LAYOUTS, default=None,
                        help="how the sequence's 2 x cp chunks are dealt to the ranks; several run in turn "
                             "(default: zigzag contiguous with --impl ring, zigzag with --impl torch)")
    training = add_training_args(parser, global_batch_size=8, helps={
        "global_batch_size": "sequences per optimizer step; every rank sees all of them, 1/cp of each"})
    add_optimizer_arg(training)
    add_checkpoint_args(parser, save="checkpoints/context_parallel_{layout}.pt", save_every=True)
    add_runtime_args(parser)
    return parser.parse_args()


def check_context_parallel(seq_len: int, cp: int, impl: str, layouts: list[str], device_type: str,
                           arch: str = "gpt") -> None:
    """One error line for what this script cannot run."""
    if seq_len % (2 * cp):
        raise UsageError(f"--seq-len {seq_len} is not divisible by 2 x {cp} ranks (each rank holds two of "
                         "the sequence's 2 x cp chunks)")
    if impl == "torch" and device_type != "cuda":
        raise UsageError("--impl torch: PyTorch's context_parallel() runs SDPA's CUDA kernels only (on CPU "
                         "it finds no sharding rule for the CPU flash kernel); use --impl ring here")
    if impl == "torch" and layouts != ["zigzag"]:
        raise UsageError("--impl torch balances the causal load itself (zig-zag): give --layout zigzag")
    if impl == "torch" and arch == "llama":  # not run on a GPU yet: HF's attention passes its own mask
        raise UsageError("--impl torch runs the small GPT only (the Llama's attention has not been tried under "
                         "PyTorch's context_parallel()); use --impl ring for --arch llama")


def chunks_of(rank: int, cp: int, layout: str) -> tuple[int, int]:
    """The two of the sequence's 2 x cp chunks that CP rank ``rank`` holds."""
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def shard_sequence(t: torch.Tensor, chunks: tuple[int, int], cp: int) -> torch.Tensor:
    """This rank's tokens of ``t`` (sequence along dim 1): its two chunks, one after the other."""
    size = t.shape[1] // (2 * cp)
    return torch.cat([t[:, c * size:(c + 1) * size] for c in chunks], dim=1)


def scores_of(q, k, causal: bool) -> torch.Tensor:
    """Scaled attention scores of one query chunk against one key chunk; on a diagonal pair a query
    sees the keys up to its own position only."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")) if causal else scores


def merge(out, lse, block_out, block_lse):
    """Online softmax: two partial results over disjoint keys -> the result over all of them."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new


def pass_along(tensor, group):
    """Start sending ``tensor`` to the next rank of the ring and receiving the previous rank's; returns
    (the buffer being received into, the requests to wait on)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, group=group, group_peer=(r + 1) % n),
           dist.P2POp(dist.irecv, received, group=group, group_peer=(r - 1) % n)]
    return received, dist.batch_isend_irecv(ops)


def around_the_ring(kv: torch.Tensor, group):
    """Yield (source rank, its K/V block) for each of the ring's steps: this rank's own first, then
    its predecessors'. Each block is sent on to the next rank while the caller computes with it."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for step in range(n):
        if step < n - 1:
            next_kv, requests = pass_along(kv, group)
        yield (r - step) % n, kv
        if step < n - 1:
            for request in requests:
                request.wait()
            kv = next_kv


def widen(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each of the K/V heads (dim 1) serves ``groups`` query heads in a row.
    The ring passes K/V with their own (fewer) heads; each block is widened only to compute."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`widen`: a K/V head's gradient is the sum over the query heads it served."""
    return grad if groups == 1 else grad.unflatten(1, (-1, groups)).sum(2)


def visible_pairs(rank: int, source: int, cp: int, layout: str):
    """(i, j, diagonal) for each of ``rank``'s query chunks i that sees ``source``'s key chunk j."""
    for i, q_chunk in enumerate(chunks_of(rank, cp, layout)):
        for j, k_chunk in enumerate(chunks_of(source, cp, layout)):
            if k_chunk <= q_chunk:  # a later chunk lies in every one of this chunk's queries' future
                yield i, j, k_chunk == q_chunk


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (two chunks of the sequence, dim 2) to the whole
    sequence's keys/values, passed around the ring of ``group``. ``layout`` says which chunks each
    rank holds; ``stats`` counts the chunk pairs this rank computes and times them. K/V may have
    fewer heads than Q (grouped-query attention, the Llama's): they travel as they are."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, stats):
        n, r, size = dist.get_world_size(group), dist.get_rank(group), q.shape[2] // 2
        groups = q.shape[1] // k.shape[1]
        chunk = lambda t, i: t[..., i * size:(i + 1) * size, :]  # noqa: E731 - chunk i of (B, H, S, D)
        outs, lses = [None, None], [None, None]
        for source, kv in around_the_ring(torch.stack([k, v]), group):
            with stats["timer"].region():
                for i, j, diagonal in visible_pairs(r, source, n, layout):
                    scores = scores_of(chunk(q, i), widen(chunk(kv[0], j), groups), diagonal)
                    lse = scores.logsumexp(dim=-1)
                    block = torch.exp(scores - lse[..., None]) @ widen(chunk(kv[1], j), groups)
                    outs[i], lses[i] = merge(outs[i], lses[i], block, lse)
                    stats["pairs"] += 1
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.stats = group, layout, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        n, r, size = dist.get_world_size(ctx.group), dist.get_rank(ctx.group), q.shape[2] // 2
        groups = q.shape[1] // k.shape[1]
        chunk = lambda t, i: t[..., i * size:(i + 1) * size, :]  # noqa: E731
        delta = (dout * out).sum(dim=-1, keepdim=True)  # rowsum(dO * O): softmax's backward needs it
        lse, scale = lse[..., None], q.shape[-1] ** -0.5
        dq, dkv = torch.zeros_like(q), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for source, kv in around_the_ring(torch.stack([k, v]), ctx.group):
            with ctx.stats["timer"].region():
                for i, j, diagonal in visible_pairs(r, source, n, ctx.layout):
                    k_j, v_j = widen(chunk(kv[0], j), groups), widen(chunk(kv[1], j), groups)
                    # the forward's softmax, recomputed; then softmax's backward
                    p = torch.exp(scores_of(chunk(q, i), k_j, diagonal) - chunk(lse, i))
                    ds = p * (chunk(dout, i) @ v_j.transpose(-2, -1) - chunk(delta, i)) * scale
                    chunk(dq, i).add_(ds @ k_j)
                    chunk(dkv[0], j).add_(fold(ds.transpose(-2, -1) @ chunk(q, i), groups))
                    chunk(dkv[1], j).add_(fold(p.transpose(-2, -1) @ chunk(dout, i), groups))
            if n > 1:  # dK/dV of the block travel with it; after the last step this hop takes them home
                dkv, requests = pass_along(dkv, ctx.group)
                for request in requests:
                    request.wait()
        return dq, dkv[0], dkv[1], None, None, None


class RingSelfAttention(nn.Module):
    """TinyGPT's attention with its own projections (same parameter names) and the ring in the middle."""

    def __init__(self, attn: nn.Module, group, layout: str, stats: dict):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
        self.head_dim, self.group, self.layout, self.stats = attn.head_dim, group, layout, stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = RingAttention.apply(q, k, v, self.group, self.layout, self.stats)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class RingLlamaAttention(nn.Module):
    """The Llama's attention (Hugging Face's ``LlamaAttention``: same projections, same parameter
    names) with the ring in the middle. The decoder layer hands it cos/sin for the positions the model
    was given, so RoPE rotates each token by its place in the whole sequence."""

    def __init__(self, attn: nn.Module, group, layout: str, stats: dict):
        super().__init__()
        # Hugging Face's own RoPE (transformers is loaded: the model was built), so the ring rotates q
        # and k exactly as the attention it replaces would
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.head_dim, self.group, self.layout, self.stats = attn.head_dim, group, layout, stats
        self.rope = apply_rotary_pos_emb

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **_) -> tuple[torch.Tensor, None]:
        batch, seq, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # k, v: n_kv_head heads
        q, k = self.rope(q, k, *position_embeddings)  # cos/sin of each token's place in the whole sequence
        y = RingAttention.apply(q, k, v, self.group, self.layout, self.stats)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1)), None  # (output, no attention weights)


def kept_activations(harness: Harness, kept: int | None) -> int | None:
    """On the harness's memory-tracked step, the activation bytes alive at the end of forward (what
    backward will need: it grows with the tokens a rank holds), by MemTracker; else ``kept``."""
    if harness.memory_tracker is None:
        return kept
    return sum(snap.get("Activation", 0) for snap in harness.memory_tracker.get_tracker_snapshot().values())


def train(args, ctx, cfg, mesh, layout: str) -> dict:
    """Train one layout from the seed's weights; returns the harness record (rank 0) or None."""
    cp = ctx.world_size
    seed_everything(args.seed)
    model = build_model(cfg).to(ctx.device)  # the same weights on every rank
    stats = {"pairs": 0, "timer": RegionTimer(ctx.device)}
    if args.impl == "ring" and cfg.arch == "llama":
        for block in model.blocks:
            block.self_attn = RingLlamaAttention(block.self_attn, mesh.get_group(), layout, stats)
    elif args.impl == "ring":
        for block in model.blocks:
            block.attn = RingSelfAttention(block.attn, mesh.get_group(), layout, stats)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    harness = Harness(ctx, "cp", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      config={"global_batch_size": args.global_batch_size,
                              "precision": "fp32", "cp": cp, "impl": args.impl, "layout": layout,
                              "lr": args.lr, "optimizer": args.optimizer})
    task, losses, kept = make_task(cfg, args), [], None
    chunks = chunks_of(ctx.rank, cp, layout)
    for step in progress(range(args.steps), ctx.rank, desc=f"cp {layout}"):
        inputs, targets = task.global_batch(step, args.global_batch_size)  # whole sequences, all ranks
        positions = torch.arange(cfg.seq_len).expand_as(inputs)  # where each token sits in its sequence
        # (copies: torch's context_parallel() shards its buffers in place)
        inputs, targets, positions = (t.to(ctx.device).clone() for t in (inputs, targets, positions))
        with harness.step(samples=args.global_batch_size, tokens=inputs.numel()):
            optimizer.zero_grad(set_to_none=True)
            if args.impl == "ring":  # this rank's two chunks of every sequence, and where they sit in it
                loss = lm_loss(model(*(shard_sequence(t, chunks, cp) for t in (inputs, positions))),
                               shard_sequence(targets, chunks, cp))
                kept = kept_activations(harness, kept)
                loss.backward()
            else:  # PyTorch shards the buffers in place (zig-zag) and runs SDPA as a ring inside
                with context_parallel(mesh, buffers=[inputs, targets, positions], buffer_seq_dims=[1, 1, 1],
                                      no_restore_buffers={inputs, targets, positions}):
                    loss = lm_loss(model(inputs, positions), targets)
                    kept = kept_activations(harness, kept)
                    loss.backward()
            reduce_gradients(model.parameters(), dist.group.WORLD, ctx.world_size)  # each rank: its tokens only
            optimizer.step()
        total = loss.detach().clone()  # the mean over this rank's tokens; every rank has as many
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
        if saves_after(args, step) and ctx.is_main:
            path = saved_at(save_path(args.save, layout=layout, impl=args.impl), step + 1)
            save_full_model(model, path, cfg, "cp", ctx)  # rank 0 alone: every rank holds the whole model

    forwards = args.steps * cfg.n_layer
    work = [None] * ctx.world_size  # chunk pairs per attention forward, attention compute ms per step
    dist.all_gather_object(work, (stats["pairs"] / forwards, stats["timer"].total_s * 1000 / args.steps, kept))
    record = harness.finish(args.results, extra={
        "losses": losses, "chunks_per_rank": [list(chunks_of(r, cp, layout)) for r in range(cp)],
        "attention_pairs_per_rank": [w[0] for w in work], "attention_ms_per_rank": [w[1] for w in work],
        "activations_after_forward_per_rank": [w[2] for w in work]})
    if ctx.is_main:
        path = save_path(args.save, layout=layout, impl=args.impl)
        save_full_model(model, path, cfg, "cp", ctx)
        record["saved"] = path
    return record


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        cfg = model_config_from_args(args)
        cp = ctx.world_size
        layouts = args.layout or (list(LAYOUTS) if args.impl == "ring" else ["zigzag"])
        check_context_parallel(cfg.seq_len, cp, args.impl, layouts, ctx.device.type, cfg.arch)
        mesh = init_device_mesh(ctx.device.type, (cp,), mesh_dim_names=("cp",))
        log.info(f"cp: {cp} ranks | impl {args.impl} | {cfg.seq_len} tokens per sequence, "
                 f"{cfg.seq_len // cp} per rank | global batch {args.global_batch_size}")
        records = [train(args, ctx, cfg, mesh, layout) for layout in layouts]
        if not ctx.is_main:
            return
        # The ring's sends (K/V forward and backward, dK/dV backward) and the gradient all-reduce.
        formula = theory.context_parallel_comm(cfg, args.global_batch_size, cp)
        for record in records:
            layout, metrics = record["config"]["layout"], record["metrics"]
            log.info(f"{layout:<10} loss {record['losses'][0]:.4f} -> {record['losses'][-1]:.4f} | ranks' chunks "
                     + " ".join(f"r{r}{tuple(c)}" for r, c in enumerate(record["chunks_per_rank"])))
            if args.impl == "ring":
                pairs, ms = record["attention_pairs_per_rank"], record["attention_ms_per_rank"]
                log.info(f"  attention work per rank: chunk pairs {' '.join(f'{p:g}' for p in pairs)} "
                         f"(slowest / mean {max(pairs) / (sum(pairs) / cp):.2f}) | "
                         f"compute ms/step {' '.join(f'{m:.0f}' for m in ms)}")
            kept = [a / 2**20 if a is not None else float("nan") for a in record["activations_after_forward_per_rank"]]
            peak = [p / 2**20 for p in metrics["peak_memory_bytes_per_rank"]]
            log.info(f"  per rank (MiB, MemTracker): activations after forward {' '.join(f'{a:.3f}' for a in kept)} | "
                     f"step peak {' '.join(f'{p:.2f}' for p in peak)}")
            for name, got in metrics["comm_per_step"].items():
                want = formula.get(name, {"calls": 0, "bytes": 0})
                log.info(f"  {name:<11} {got['calls']:>4.0f} calls {got['bytes'] / 2**20:8.3f} MiB   vs formula "
                         f"{want['calls']:>4} calls {want['bytes'] / 2**20:8.3f} MiB")
        step_ms = " ".join(f"{r['config']['layout']} {r['metrics']['step_time_s_median'] * 1000:.0f}"
                           for r in records if r["metrics"]["step_time_s_median"])
        saved = [r["saved"] for r in records if r["saved"]]
        log.info(f"saved {', '.join(saved) or 'nothing (--save none)'} | records appended to {args.results}"
                 + (f" | median step ms: {step_ms}" if step_ms else ""))


if __name__ == "__main__":
    run_main(main)
