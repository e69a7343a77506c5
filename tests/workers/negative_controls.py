"""Worker: negative controls for the equivalence tests of chapters 01, 02 and 05.

Each case trains the tiny GPT from the same seed-0 weights with a distributed strategy, built from
the chapter script's own functions where it has them (``shard_model``, ``apply_tensor_parallel``,
``make_stage_module``), once correctly and once with a deliberate bug
(gradients summed instead of averaged, one rank's shard dropped, a micro-batch skipped, the loss not
scaled by 1/k). Rank 0 compares each result with a single-process reference trainer written here,
independently of the scripts, and writes ``{case: {variant: max |distributed - reference|}}`` to
``--out`` (and prints it). The test then asserts: correct under the tolerance, broken far above it.

SGD (lr 0.5, 3 steps): SGD moves a weight by lr x gradient, so a gradient twice too large moves it
twice as far. AdamW would hide that (its update is g / sqrt(v)). Chapters 01 and 02's own controls
are mutants of their scripts (tests/test_ch01_negative.py, tests/test_ch02_negative.py); their cases
here, ``ch01_ddp`` and ``ch02_full_shard``, are the tiny Llama's (tests/test_llama_equivalence.py),
and ``accumulation`` is chapter 05's no_sync loop (tests/test_ch05_negative.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.checkpoint import full_state_dict
from distkit.models import TinyGPT, TokenTask, build_model, lm_loss, model_config, rank_slice
from reference import train_one_process  # tests/workers/reference.py, beside this worker

REPO = Path(__file__).resolve().parents[2]
STEPS, LR, BATCH = 3, 0.5, 8


def load(relative: str):
    """Import a chapter script as a module (its functions, without running main)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


ARCH = "gpt"  # --arch: the tiny GPT or the tiny Llama (every case that does not cut TinyGPT's modules)


def new_model(n_layer: int = 2) -> TinyGPT:
    torch.manual_seed(0)  # the reference and every variant start from these weights
    return build_model(model_config(ARCH, "tiny", vocab_size=65, n_layer=n_layer))


def reference(n_layer: int = 2) -> tuple[dict, dict]:
    """One process, the whole global batch each step: (initial, final) state dicts."""
    model = new_model(n_layer)
    return train_one_process(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, BATCH)


def batches(ctx, model, dp_rank=None, dp_size=None, steps=STEPS):
    """This rank's slice of each step's global batch."""
    dp_rank = ctx.rank if dp_rank is None else dp_rank
    dp_size = ctx.world_size if dp_size is None else dp_size
    task = TokenTask(model.cfg, seed=0)
    for step in range(steps):
        inputs, targets = task.global_batch(step, BATCH)
        yield rank_slice(inputs, dp_rank, dp_size), rank_slice(targets, dp_rank, dp_size)


def drop_rank1_shard(ctx, model) -> None:
    """Bug: rank 1's piece of every sharded gradient is lost (as if its reduce-scatter output were
    never written): the rows it owns are not updated."""
    if ctx.rank == 1:
        for p in model.parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).zero_()


def summed_not_averaged(model, data_parallel_size: int) -> None:
    """Bug: the gradient a reduction leaves when it sums over the data-parallel ranks and never
    divides. (FSDP2's own knob for that, set_gradient_divide_factor(1.0), issues a PREMUL_SUM
    reduce-scatter, which gloo rejects; multiplying the averaged gradient back is the same result.)"""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(data_parallel_size)


def full_state(model) -> dict:
    """The unsharded weights on every rank (collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------- chapter 01

def summing_hook(state, bucket):
    """Bug as a DDP comm hook: all-reduce the bucket, never divide by the world size."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def case_ddp(ctx, variant):
    """DDP, optionally with k=2 micro-batches under no_sync (as ddp_training.py and
    gradient_accumulation.py do): loss / k on each micro-batch, one all-reduce per step."""
    k = 2
    model = DDP(new_model())
    if variant == "summed":
        model.register_comm_hook(None, summing_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(ctx, model.module):
        optimizer.zero_grad()
        if variant in ("correct", "summed"):
            lm_loss(model(x), y).backward()
        else:
            chunks = list(zip(x.chunk(k), y.chunk(k)))
            for i, (xm, ym) in enumerate(chunks):
                last = i == k - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = lm_loss(model(xm), ym)
                    if variant == "skipped_micro_batch" and i == 0:
                        loss = loss * 0  # bug: the first micro-batch contributes nothing
                    (loss if variant == "unscaled_loss" else loss / k).backward()  # bug: no 1/k
        optimizer.step()
    return model.module.state_dict()


# ---------------------------------------------------------------- chapter 02

def case_fsdp(ctx, variant, strategy):
    """fsdp_transformer.py's shard_model (per-block units, then the root) on a 1D or (world x 1) mesh."""
    fsdp = load("02-fsdp/fsdp_transformer.py")
    args = fsdp.parse_args(["--vocab-size", "65"])
    shape = fsdp.mesh_shape(strategy, ctx, args.hsdp_shard_size)
    mesh = fsdp.build_mesh(shape, ctx, {})
    model = fsdp.shard_model(new_model(), strategy, mesh, args, ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(ctx, model):
        optimizer.zero_grad()
        lm_loss(model(x).float(), y).backward()
        if variant == "summed":
            summed_not_averaged(model, ctx.world_size)
        if variant == "dropped_shard":
            drop_rank1_shard(ctx, model)
        optimizer.step()
    return full_state(model)


# ---------------------------------------------------------------- chapter 05

def case_tp(ctx, variant, sequence_parallel=False):
    """tensor_parallel.py's apply_tensor_parallel over every rank; every rank reads the whole batch."""
    tp = load("05-advanced/tensor_parallel.py")
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = new_model()
    tp.apply_tensor_parallel(model, mesh, sequence_parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(ctx, model, dp_rank=0, dp_size=1):
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        if variant == "dropped_shard":
            drop_rank1_shard(ctx, model)
        optimizer.step()
    return full_state_dict(model)


def case_hybrid(ctx, variant, mode):
    """hybrid_parallelism.py's layout on a 2 x (world/2) mesh: 2d = FSDP over dp x TP over tp
    (the script's apply_tensor_parallel, then fully_shard per block and root); hsdp = fully_shard
    on the 2-D (replicate, shard) mesh."""
    tp = load("05-advanced/tensor_parallel.py")
    names = ("dp", "tp") if mode == "2d" else ("replicate", "shard")
    mesh = init_device_mesh(ctx.device.type, (2, ctx.world_size // 2), mesh_dim_names=names)
    model = new_model()
    if mode == "2d":
        tp.apply_tensor_parallel(model, mesh["tp"], sequence_parallel=False)
        shard_mesh, dp_rank, dp_size = mesh["dp"], mesh.get_local_rank("dp"), 2
    else:
        shard_mesh, dp_rank, dp_size = mesh, ctx.rank, ctx.world_size
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(ctx, model, dp_rank=dp_rank, dp_size=dp_size):
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        if variant == "summed":
            summed_not_averaged(model, dp_size)
        if variant == "dropped_shard":
            drop_rank1_shard(ctx, model)
        optimizer.step()
    return full_state_dict(model)


def case_pp(ctx, variant, microbatches=4):
    """pipeline_parallel.py's make_stage_module, one stage per rank, GPipe; rank 0 gathers the
    stages' weights (names keep their full-model index)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp = load("05-advanced/pipeline_parallel.py")
    full = new_model(n_layer=ctx.world_size)
    stage_module = pp.make_stage_module(full, ctx.rank, ctx.world_size)
    stage = PipelineStage(stage_module, ctx.rank, ctx.world_size, ctx.device)
    calls = [0]

    def loss_fn(logits, targets):
        loss = lm_loss(logits, targets)
        calls[0] += 1
        if variant == "skipped_micro_batch" and calls[0] % microbatches == 2:
            loss = loss * 0  # bug: the second micro-batch of each step contributes nothing
        return loss

    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=LR)
    for x, y in batches(ctx, full, dp_rank=0, dp_size=1):
        optimizer.zero_grad()
        if ctx.rank == 0:
            schedule.step(x)
        elif ctx.rank == ctx.world_size - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
    pieces = [None] * ctx.world_size
    dist.all_gather_object(pieces, {k: v.detach() for k, v in stage_module.state_dict().items()})
    return {k: v for piece in pieces for k, v in piece.items()}


CASES = {
    "ch01_ddp": (case_ddp, ["correct", "summed"], {}),
    "accumulation": (case_ddp, ["accumulated", "unscaled_loss", "skipped_micro_batch"], {}),
    "ch02_full_shard": (lambda c, v: case_fsdp(c, v, "full_shard"), ["correct", "summed", "dropped_shard"], {}),
    "ch05_tp": (case_tp, ["correct", "dropped_shard"], {}),
    "ch05_tp_sp": (lambda c, v: case_tp(c, v, sequence_parallel=True), ["correct", "dropped_shard"], {}),
    "ch05_2d": (lambda c, v: case_hybrid(c, v, "2d"), ["correct", "dropped_shard"], {}),
    "ch05_hsdp": (lambda c, v: case_hybrid(c, v, "hsdp"), ["correct", "dropped_shard"], {}),
    "ch05_pp": (case_pp, ["correct", "skipped_micro_batch"], {"n_layer": "world"}),
}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def main():
    parser = ArgumentParser()
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    add_runtime_args(parser)
    args = parser.parse_args()
    global ARCH
    ARCH = args.arch
    with distributed(args) as ctx:
        results = {}
        for name in args.cases:
            run, variants, ref_kwargs = CASES[name]
            n_layer = ctx.world_size if ref_kwargs.get("n_layer") == "world" else 2
            initial, expected = reference(n_layer=n_layer)
            results[name] = {"moved": max_diff(initial, expected)}  # what training itself changes
            for variant in variants:
                state = run(ctx, variant)
                if ctx.is_main:
                    results[name][variant] = max_diff(state, expected)
            if ctx.is_main:
                print(f"{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in results[name].items()), flush=True)
        if ctx.is_main:
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_main(main)
