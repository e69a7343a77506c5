"""Chapter 05: pipeline parallelism (PP) with ``torch.distributed.pipelining``.

The transformer is cut into consecutive *stages* (rank 0: embeddings + first blocks, ..., last rank:
last blocks + final norm + LM head). A global batch is split into m micro-batches that flow through
the stages; activations travel forward and their gradients backward by point-to-point send/recv.
Nobody holds the whole model, and only a stage boundary's activations cross the network.

The price is the *bubble*: at the start and end of every step some stages wait for work.

    GPipe (all forwards, then all backwards), p = 4 stages, m = 4 micro-batches, F/B = fwd/bwd
    rank 0 | F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    rank 1 |    F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    rank 2 |       F0 F1 F2 F3 .  .  B3 B2 B1 B0
    rank 3 |          F0 F1 F2 F3 B3 B2 B1 B0           idle fraction = (p-1) / (m+p-1)

1F1B has the same bubble but starts backwards early, so a stage keeps at most p micro-batches of
activations alive instead of m. Interleaved 1F1B gives each rank v smaller stages (rank r holds
stages r, r+p, ...), which shrinks the bubble to (p-1) / (v*m + p-1) at the cost of v times more
sends. This script builds each stage by hand (``PipelineStage`` around a TinyGPT with the other
ranks' parts set to None, or with ``--arch llama`` a :class:`LlamaStage` of Hugging Face's Llama);
``torch.distributed.pipelining.pipeline()`` can instead trace a model and split it at marked points,
which is handy for models you cannot edit.

    torchrun --nproc_per_node=4 05-advanced/pipeline_parallel.py --schedule gpipe 1f1b --microbatches 4 8
    torchrun --nproc_per_node=4 05-advanced/pipeline_parallel.py --schedule interleaved_1f1b --n-layer 8
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main, seed_everything, theory
from distkit.checkpoint import atomic_save
from distkit.flags import (
    add_checkpoint_args,
    add_optimizer_arg,
    add_training_args,
    make_optimizer,
    positive_int,
    save_path,
    saved_at,
    saves_after,
)
from distkit.harness import Harness, RegionTimer, fresh_memory_peak
from distkit.logs import progress, setup_logging
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args
from distkit.paths import check_outputs
from distkit.text import make_task

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
STRATEGY = {"gpipe": "pp_gpipe", "1f1b": "pp_1f1b", "interleaved_1f1b": "pp_interleaved_1f1b"}


def parse_args():
    parser = ArgumentParser(
        description="Train the small GPT or the Llama split into pipeline stages, one (or, interleaved, several) "
                    "per rank. Several schedules / micro-batch counts run one after another, each from "
                    "the same initial weights, so their bubbles can be compared.",
        epilog="example: torchrun --nproc_per_node=4 05-advanced/pipeline_parallel.py --schedule gpipe 1f1b")
    add_model_args(parser)
    parser.add_argument("--schedule", nargs="+", choices=sorted(SCHEDULES), default=["1f1b"],
                        help="pipeline schedule(s) to run (default: 1f1b)")
    parser.add_argument("--microbatches", nargs="+", type=positive_int, default=[8],
                        help="micro-batches per step; several values are run in turn (default: 8)")
    parser.add_argument("--stages-per-rank", type=positive_int, default=2,
                        help="interleaved_1f1b only: stages (model chunks) per rank (default: 2)")
    training = add_training_args(parser, global_batch_size=32, helps={
        "steps": "optimizer steps per run",
        "global_batch_size": "sequences per optimizer step, split into micro-batches",
        "results": "one harness record per run appended here"})
    add_optimizer_arg(training)
    add_checkpoint_args(parser, save="checkpoints/pipeline_{schedule}_m{microbatches}.pt", save_every=True)
    add_runtime_args(parser)
    return parser.parse_args()


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it spends computing (forward and backward chunks).

    The schedule calls these two methods for the compute only (sends and receives happen around
    them), so ``step time - busy time`` is the time this rank waited: its share of the bubble.
    ``busy`` is a :class:`distkit.harness.RegionTimer` shared by this rank's stages: on a GPU these
    calls only *queue* kernels and return long before the kernels run, so the host clock around
    them would measure launch overhead, not compute; the timer records CUDA events on the stream
    instead (on CPU the work is synchronous and it reads ``time.perf_counter``).
    """

    busy: RegionTimer

    def forward_one_chunk(self, *args, **kwargs):
        with self.busy.region():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.busy.region():
            return super().backward_one_chunk(*args, **kwargs)


def make_stage_module(full, stage: int, num_stages: int) -> nn.Module:
    """The part of the model that pipeline stage ``stage`` runs.

    Blocks are spread as evenly as possible; stage 0 also keeps the embeddings and the last stage
    the final norm and LM head. Parameter names keep their full-model index, so the stages' state
    dicts merge back into the full model's. The small GPT: a copy with everything outside the stage
    set to None (TinyGPT skips missing parts). The Llama: a :class:`LlamaStage`.
    """
    n_layer = len(full.blocks)
    first, last = stage * n_layer // num_stages, (stage + 1) * n_layer // num_stages
    if full.cfg.arch == "llama":
        return LlamaStage(full, range(first, last), stage == 0, stage == num_stages - 1)
    module = copy.deepcopy(full)
    for index in range(n_layer):
        if not first <= index < last:
            module.blocks[index] = None
    if stage != 0:
        module.tok_emb = module.pos_emb = None
    if stage != num_stages - 1:
        module.ln_f = module.lm_head = None
    return module


class LlamaStage(nn.Module):
    """A pipeline stage of the Hugging Face Llama: ``model.embed_tokens`` (first stage), decoder
    layers ``model.layers.N`` for N in ``layers``, ``model.norm`` and ``lm_head`` (last stage), under
    the full model's parameter names.

    Its own forward, because ``LlamaModel.forward`` runs every layer: it does what that forward does
    for this stage's layers. Every layer needs the rotary position embeddings (cos, sin) of
    positions 0 .. seq-1, which the model computes once from ``model.rotary_emb`` (a module with no
    parameters) and passes to each layer: each stage computes them again for its own layers rather
    than sending them along with the activations. No attention mask: with none, the layers' SDPA
    attention is causal, as in the full model.
    """

    def __init__(self, full, layers: range, first: bool, last: bool):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = copy.deepcopy(full.model.embed_tokens) if first else None
        self.model.layers = nn.ModuleDict({str(i): copy.deepcopy(full.model.layers[i]) for i in layers})
        self.model.rotary_emb = copy.deepcopy(full.model.rotary_emb)
        self.model.norm = copy.deepcopy(full.model.norm) if last else None
        self.lm_head = copy.deepcopy(full.lm_head) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.model.embed_tokens is not None:  # tokens in; later stages receive hidden states
            x = self.model.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary = self.model.rotary_emb(x, positions)
        for layer in self.model.layers.values():
            x = layer(x, position_embeddings=rotary)
        if self.lm_head is not None:
            x = self.lm_head(self.model.norm(x))
        return x


def pipeline_shape(args, cfg, schedule_name: str, microbatches: int, pp: int) -> tuple[int, int]:
    """Stages per rank and stages in all for ``schedule_name`` on ``pp`` ranks, once the model, the
    batch and the micro-batch count are checked to fit them."""
    per_rank = args.stages_per_rank if schedule_name == "interleaved_1f1b" else 1
    num_stages = pp * per_rank
    if cfg.n_layer < num_stages:
        raise UsageError(f"{num_stages} pipeline stages need at least {num_stages} blocks, the model has "
                         f"{cfg.n_layer}; pass --n-layer {num_stages} (or fewer ranks / --stages-per-rank)")
    if args.global_batch_size % microbatches:
        raise UsageError(f"--global-batch-size {args.global_batch_size} does not split into "
                         f"{microbatches} equal micro-batches")

    if schedule_name == "1f1b" and microbatches < pp:  # torch's Schedule1F1B needs m >= p
        raise UsageError(f"1F1B needs at least as many micro-batches as stages ({pp}); got {microbatches}")
    rounds = max(1, microbatches // pp)
    if schedule_name == "interleaved_1f1b" and microbatches % rounds:
        raise UsageError(f"interleaved 1F1B needs the micro-batch count to be a multiple of "
                         f"{rounds} (micro-batches // stages); got {microbatches}")
    return per_rank, num_stages


def train_one_run(args, ctx, cfg, schedule_name: str, microbatches: int, log):
    """Train from fresh initial weights with one schedule; return (record, gathered state dict): split
    into stages, build the schedule, step it, gather, in the order the README walks them."""
    pp = ctx.world_size
    per_rank, num_stages = pipeline_shape(args, cfg, schedule_name, microbatches, pp)

    # A clean slate for this run's peak memory: the previous run's stages, optimizer and schedule
    # are unreachable now (gc collects their reference cycles, CUDA's cache is emptied).
    fresh_memory_peak(ctx.device)
    seed_everything(args.seed)  # every run starts from the same weights
    full = build_model(cfg)
    param_count = sum(p.numel() for p in full.parameters())
    # Looped placement: rank r holds stages r, r + pp, r + 2 pp ... (what interleaving expects).
    my_stages = [index for index in range(num_stages) if index % pp == ctx.rank]
    stages = [TimedStage(make_stage_module(full, index, num_stages).to(ctx.device), index, num_stages, ctx.device)
              for index in my_stages]
    del full
    busy, step_clock = RegionTimer(ctx.device), RegionTimer(ctx.device)
    for stage in stages:
        stage.busy = busy
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = make_optimizer(args.optimizer, params, args.lr)

    # The loss is computed on the last stage for every micro-batch; with the default
    # scale_grads=True the schedule divides gradients by m, i.e. the step's loss is the MEAN of the
    # micro-batch losses, exactly the full-batch mean loss of single-process training.
    if schedule_name == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=lm_loss)
    else:
        schedule = SCHEDULES[schedule_name](stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    holds_first, holds_last = 0 in my_stages, num_stages - 1 in my_stages
    last_rank = (num_stages - 1) % pp

    strategy = STRATEGY[schedule_name]
    # This rank's model state is its stages'; the record's parameter count is the whole model's.
    harness = Harness(ctx, strategy, optimizer=optimizer, warmup_steps=args.warmup_steps,
                      model_config=cfg, param_count=param_count,
                      state_modules=[stage.submod for stage in stages],
                      config={"global_batch_size": args.global_batch_size,
                              "precision": "fp32", "pp": pp, "stages_per_rank": per_rank,
                              "microbatches": microbatches, "schedule": schedule_name, "lr": args.lr,
                              "optimizer": args.optimizer})
    task = make_task(cfg, args)
    losses, bubbles, spans = [], [], []  # spans: (schedule.step seconds, compute seconds) per timed step
    for step in progress(range(args.steps), ctx.rank, desc=f"{schedule_name} m={microbatches}"):
        inputs, targets = task.global_batch(step, args.global_batch_size)
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        busy_before, step_before = busy.total_s, step_clock.total_s
        with harness.step(samples=args.global_batch_size, tokens=inputs.numel()):
            optimizer.zero_grad(set_to_none=True)
            micro_losses = [] if holds_last else None
            # Only the first stage gets the batch and only the last stage the targets; the schedule
            # splits them into micro-batches and runs its forward/backward order.
            with step_clock.region():  # the schedule's span: compute chunks + waiting for peers
                schedule.step(*([inputs] if holds_first else []),
                              target=targets if holds_last else None, losses=micro_losses)
            optimizer.step()
        if step >= args.warmup_steps + harness.comm_steps:  # timed steps only
            # Both clocks measure the same way (CUDA events on GPU, perf_counter on CPU); reading
            # total_s synchronises once, outside the timed step.
            elapsed, computing = step_clock.total_s - step_before, busy.total_s - busy_before
            bubbles.append(1 - computing / elapsed)
            spans.append((elapsed, computing))
        # The loss exists on the last stage only: send its mean to everyone so rank 0 can print it.
        loss = torch.stack(micro_losses).mean().detach() if holds_last else torch.zeros((), device=ctx.device)
        dist.broadcast(loss, src=last_rank)
        losses.append(loss.item())
        if saves_after(args, step):
            path = save_path(args.save, strategy=strategy, schedule=schedule_name, microbatches=microbatches)
            state = gathered_state(stages, pp)
            if ctx.is_main and path:
                atomic_save({"model": state, "config": cfg.to_dict(), "strategy": strategy}, saved_at(path, step + 1))

    bubble = bubble_of_run(bubbles, spans, pp, microbatches, per_rank)
    state = gathered_state(stages, pp)
    record = harness.finish(args.results, extra={"losses": losses, "bubble": bubble})
    return record, state


def bubble_of_run(bubbles: list, spans: list, pp: int, microbatches: int, per_rank: int) -> dict:
    """Each rank's measured idle fraction (gathered: collective); the schedule's theory for equal stages.

    The mean seconds per step inside schedule.step() and inside compute chunks are kept too: their
    difference is the idle time, which the README splits into the bubble and per-micro-batch costs.
    """
    my_bubble = sum(bubbles) / len(bubbles) if bubbles else None
    my_spans = [sum(s[i] for s in spans) / len(spans) for i in (0, 1)] if spans else [None, None]
    gathered = [None] * pp
    dist.all_gather_object(gathered, (my_bubble, *my_spans))
    all_bubbles = [g[0] for g in gathered]
    measured = [b for b in all_bubbles if b is not None]
    return {"measured_per_rank": all_bubbles,
            "measured": sum(measured) / len(measured) if measured else None,
            "theory": theory.pipeline_bubble(pp, microbatches, per_rank),  # (p-1) / (v m + p-1)
            "schedule_s_per_rank": [g[1] for g in gathered], "compute_s_per_rank": [g[2] for g in gathered]}


def gathered_state(stages, pp: int) -> dict:
    """The whole model's weights on every rank: each rank's stages, gathered (collective)."""
    pieces = [None] * pp
    dist.all_gather_object(pieces, {k: v.detach().cpu() for stage in stages
                                    for k, v in stage.submod.state_dict().items()})
    return {k: v for piece in pieces for k, v in piece.items()}


def main():
    args = parse_args()
    with distributed(args) as ctx:
        check_outputs(ctx, args, files=["results", "save"])
        log = setup_logging(ctx.rank)
        cfg = model_config_from_args(args)
        log.info(f"{ctx.world_size} pipeline ranks | {cfg.n_layer} blocks | global batch "
                 f"{args.global_batch_size} | backend {ctx.backend}")
        summary = []
        for schedule_name in args.schedule:
            for microbatches in args.microbatches:
                record, state = train_one_run(args, ctx, cfg, schedule_name, microbatches, log)
                if not ctx.is_main:
                    continue
                path = save_path(args.save, strategy=record["strategy"], schedule=schedule_name,
                                 microbatches=microbatches)
                if path:
                    atomic_save({"model": state, "config": cfg.to_dict(), "strategy": record["strategy"]}, path)
                    summary.append(path)
                bubble, losses = record["bubble"], record["losses"]
                per_rank_mb = [s["params"] / 2**20 for s in record["metrics"]["model_state_bytes_per_rank"]]
                sendrecv = record["metrics"]["comm_per_step"].get("send", {"calls": 0, "bytes": 0})
                measured = f"{bubble['measured']:.2f}" if bubble["measured"] is not None else "n/a"
                log.info(f"{record['strategy']:<20} m={microbatches:<3} loss {losses[0]:.4f} -> {losses[-1]:.4f} | "
                         f"bubble measured {measured} vs theory {bubble['theory']:.2f} | "
                         f"rank 0 sends {sendrecv['calls']:.0f} x/step ({sendrecv['bytes'] / 2**20:.2f} MiB) | "
                         f"params per rank (MiB) " + " ".join(f"{mb:.2f}" for mb in per_rank_mb))
        if ctx.is_main:
            log.info(f"saved {', '.join(summary) or 'nothing (--save none)'} | records appended to {args.results}")


if __name__ == "__main__":
    run_main(main)
