"""Chapter 01: a production DDP training template (the shared transformer on the token task).

What it adds to ddp_mnist.py, each piece in the open below:

* a config dataclass filled from flags and an optional YAML/JSON file, read on rank 0 and
  broadcast, so every rank trains with exactly the same settings;
* gradient accumulation with ``no_sync()`` (one all-reduce per optimizer step, not per micro-batch),
  AMP (bf16 autocast; fp16 + GradScaler on GPU), gradient clipping, an opt-in LR scaling rule,
  SyncBatchNorm and DDP's knobs;
* checkpoints every N steps, written atomically, holding everything an exact resume needs (model,
  optimizer, scheduler, epoch / step in epoch / data position, every rank's RNG), and automatic
  resume from the newest good one -- so ``torchrun --max-restarts`` can restart a crashed job;
* per-rank log files, a rank-0 progress bar, and ``@record`` so a crash names the failing rank.

    torchrun --standalone --nproc_per_node=4 01-ddp-basics/ddp_training.py
    torchrun --standalone --nproc_per_node=4 --max-restarts=3 01-ddp-basics/ddp_training.py --crash-at-step 30
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import signal
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import yaml
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, UsageError, add_runtime_args, distributed, run_main
from distkit.checkpoint import (temporary_prefix, atomic_save, load_model_state,
                                remove_stale_temporaries, safe_load)
from distkit.flags import check_value, non_negative_float, non_negative_int, positive_float, positive_int
from distkit.harness import Harness
from distkit.logs import progress, setup_logging
from distkit.models import GPT_PRESETS, TinyGPT, TokenTask, gpt_config, lm_loss, rank_slice


def opt(default, help, **argparse_kwargs):
    """A config field with its --help text and argparse type/choices next to its default. The type
    (a range-checked one from distkit.flags for numbers) checks the flag and the config file alike."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class TrainConfig:
    """Everything a run depends on. Flags override the config file, which overrides these defaults."""

    model_size: str = opt("small", "transformer size preset", choices=sorted(GPT_PRESETS))
    n_layer: int | None = opt(None, "override the preset's layer count", type=positive_int)
    n_embd: int | None = opt(None, "override the preset's width", type=positive_int)
    n_head: int | None = opt(None, "override the preset's head count", type=positive_int)
    seq_len: int | None = opt(None, "override the preset's sequence length", type=positive_int)
    vocab_size: int | None = opt(None, "override the preset's vocabulary", type=positive_int)
    steps: int = opt(200, "optimizer steps in total", type=positive_int)
    global_batch_size: int = opt(32, "sequences per optimizer step, summed over all ranks and micro-batches",
                                 type=positive_int)
    grad_accum_steps: int = opt(1, "micro-batches per optimizer step; all but the last skip the all-reduce",
                                type=positive_int)
    lr: float = opt(3e-3, "peak AdamW learning rate (before --lr-scaling)", type=positive_float)
    lr_scaling: str = opt("none", "scale --lr with the global batch: linear (x B/base) or sqrt "
                          "(x sqrt(B/base)), base = --base-batch-size", choices=["none", "linear", "sqrt"])
    base_batch_size: int = opt(32, "the global batch --lr was tuned for (used by --lr-scaling)", type=positive_int)
    lr_warmup_steps: int = opt(10, "linear LR warm-up steps, then cosine decay to 10%%", type=non_negative_int)
    weight_decay: float = opt(0.01, "AdamW weight decay", type=non_negative_float)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 = off)", type=non_negative_float)
    precision: str = opt("fp32", "fp32, bf16 (autocast, CPU or GPU) or fp16 (autocast + GradScaler, GPU)",
                         choices=["fp32", "bf16", "fp16"])
    sync_batchnorm: bool = opt(False, "convert BatchNorm layers to SyncBatchNorm (statistics over the "
                               "global batch); the transformer uses LayerNorm, so it has none")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB: fewer, larger all-reduces vs "
                               "earlier overlap with backward", type=positive_float)
    static_graph: bool = opt(False, "tell DDP the set of used parameters never changes (enables optimisations)")
    find_unused_parameters: bool = opt(False, "let DDP handle parameters that get no gradient (costs a graph walk)")
    gradient_as_bucket_view: bool = opt(False, "gradients alias DDP's buckets (saves one gradient-sized copy)")
    checkpoint_dir: str = opt("checkpoints/ddp_training", "where checkpoints go")
    checkpoint_every: int = opt(50, "save a checkpoint every N steps (and at the end)", type=positive_int)
    keep_checkpoints: int = opt(3, "how many recent checkpoints to keep", type=positive_int)
    resume: str = opt("auto", "auto = newest good checkpoint in --checkpoint-dir (an empty or unreadable "
                      "one is skipped with a warning); none; or a checkpoint path (must load)")
    log_every: int = opt(10, "log the loss every N steps", type=positive_int)
    log_dir: str = opt("runs/ddp_training", "per-rank log files (rank<N>.log), rank 0's train.log and "
                       "every rank's milestone timestamps (events.jsonl)")
    results: str = opt("runs/results.jsonl", "the harness appends this run's JSON record here")
    warmup_steps: int = opt(2, "untimed harness warm-up steps before measuring", type=non_negative_int)
    num_sequences: int = opt(4096, "sequences in the token task (one epoch; at least --global-batch-size)",
                             type=positive_int)
    crash_at_step: int | None = opt(None, "fault injection: --crash-rank SIGKILLs itself at this step "
                                    "(first attempt only, so a torchrun restart succeeds)", type=non_negative_int)
    crash_rank: int = opt(0, "which rank --crash-at-step kills", type=non_negative_int)
    crash_in_checkpoint_at_step: int | None = opt(
        None, "fault injection: rank 0 dies half-way through writing this step's checkpoint "
        "(first attempt only)", type=positive_int)


def parse_cli() -> argparse.Namespace:
    """Flags on every rank (argparse is cheap); only flags the user typed end up in the namespace."""
    parser = ArgumentParser(
        description="Production DDP template: train the shared transformer on the token task with "
                    "gradient accumulation, AMP, atomic checkpoints and automatic resume. Launch with torchrun.",
        epilog="example: torchrun --standalone --nproc_per_node=4 --max-restarts=3 01-ddp-basics/ddp_training.py")
    parser.add_argument("--config", help="YAML or JSON file of TrainConfig keys; flags override it")
    group = parser.add_argument_group("training (TrainConfig)")
    for f in fields(TrainConfig):
        flag, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
        text = f"{meta.pop('help')} (default: {f.default})"
        if isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=text,
                               default=argparse.SUPPRESS)
        else:
            meta.setdefault("type", type(f.default))  # str fields; numbers name a distkit.flags type
            group.add_argument(flag, help=text, default=argparse.SUPPRESS, **meta)
    add_runtime_args(parser)
    return parser.parse_args()


def config_file_value(f, value, source: str):
    """One value from the config file, checked like its flag: type, range and choices."""
    if value is None and f.default is None:
        return None
    if isinstance(f.default, bool):
        if not isinstance(value, bool):
            raise UsageError(f"{source}: '{f.name}' must be true or false, got {value!r}")
        return value
    kind = f.metadata.get("type", type(f.default))
    if kind is str:
        if not isinstance(value, str):
            raise UsageError(f"{source}: '{f.name}' must be a string, got {value!r}")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise UsageError(f"{source}: '{f.name}' must be one of {f.metadata['choices']}, got {value!r}")
        return value
    try:
        return check_value(f.name, value, kind)
    except UsageError as exc:
        raise UsageError(f"{source}: {exc}") from None


def build_config(cli: argparse.Namespace, world_size: int) -> TrainConfig:
    """Defaults <- config file <- flags, then validated. Runs on rank 0 only."""
    values = {}
    if cli.config:
        try:
            text = Path(cli.config).read_text()
            loaded = json.loads(text) if cli.config.endswith(".json") else yaml.safe_load(text)
        except Exception as exc:  # noqa: BLE001 - missing file, YAML/JSON syntax error
            raise UsageError(f"config file {cli.config}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        if not isinstance(loaded, dict):
            raise UsageError(f"config file {cli.config} must be a mapping of TrainConfig keys")
        known = {f.name: f for f in fields(TrainConfig)}
        for key, value in loaded.items():
            key = str(key).replace("-", "_")
            if key not in known:
                raise UsageError(f"config file {cli.config}: unknown key '{key}' "
                                 f"(known keys: {', '.join(known)})")
            values[key] = config_file_value(known[key], value, f"config file {cli.config}")
    # Flags were range-checked by argparse (their distkit.flags types) before any process group existed.
    values.update({f.name: getattr(cli, f.name) for f in fields(TrainConfig) if hasattr(cli, f.name)})
    cfg = TrainConfig(**values)
    per_step = world_size * cfg.grad_accum_steps
    if cfg.global_batch_size % per_step:
        raise UsageError(f"--global-batch-size {cfg.global_batch_size} must divide by world size x "
                         f"--grad-accum-steps = {per_step}")
    if cfg.num_sequences < cfg.global_batch_size:
        raise UsageError(f"--num-sequences {cfg.num_sequences} must be at least --global-batch-size "
                         f"{cfg.global_batch_size} (an epoch holds at least one step)")
    if cfg.crash_at_step is not None and cfg.crash_rank >= world_size:
        raise UsageError(f"--crash-rank {cfg.crash_rank} is not a rank of this {world_size}-rank job")
    # raises the one-line error when the width does not split into the heads
    gpt_config(cfg.model_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
               seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    return cfg


def share_config(cli: argparse.Namespace, ctx) -> TrainConfig:
    """Rank 0 builds the config and broadcasts it (or its error), so no rank can disagree."""
    payload = [None]
    if ctx.is_main:
        try:
            payload[0] = asdict(build_config(cli, ctx.world_size))
        except UsageError as exc:
            payload[0] = {"error": str(exc)}
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise UsageError(payload[0]["error"])
    return TrainConfig(**payload[0])


def scaled_lr(cfg: TrainConfig) -> float:
    """Bigger batches average more samples per step; the linear / sqrt rules raise the LR to match."""
    ratio = cfg.global_batch_size / cfg.base_batch_size
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress_ = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_)))


# ---- checkpoints: everything an exact resume needs, written atomically by rank 0 ----

def rng_state(device: torch.device) -> dict:
    """This rank's random generators (numpy's key as a tensor so weights_only loading accepts it).

    On CUDA only this rank's own GPU generator: ``get_rng_state_all()`` would make every rank create
    a context on every GPU of the node (hundreds of MiB each, on GPUs that belong to other ranks).
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and isinstance(state.get("cuda"), torch.Tensor):
        torch.cuda.set_rng_state(state["cuda"], device)


def first_attempt() -> bool:
    """torchrun counts restarts; fault injection fires only before the first one."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def save_checkpoint(cfg, ctx, log, step, model, optimizer, scheduler, scaler, losses) -> None:
    """Every rank contributes its RNG state; rank 0 writes one file (the replicas are identical)."""
    rngs = [None] * ctx.world_size
    dist.all_gather_object(rngs, rng_state(ctx.device))
    if not ctx.is_main:
        return
    steps_per_epoch = cfg.num_sequences // cfg.global_batch_size
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
             "step": step, "epoch": step // steps_per_epoch, "step_in_epoch": step % steps_per_epoch,
             # the data "sampler": TokenTask batch k is a pure function of k, so its state is a position
             "data_position": {"sequences_consumed": step * cfg.global_batch_size,
                               "num_sequences": cfg.num_sequences},
             "rng_per_rank": rngs, "world_size": ctx.world_size, "config": asdict(cfg),
             "loss_history": losses}
    path = Path(cfg.checkpoint_dir) / f"step_{step:06d}.pt"
    if cfg.crash_in_checkpoint_at_step == step and first_attempt():
        # Simulate a crash mid-write, the way atomic_save writes: half a temp file (named like
        # atomic_save's, with this host and PID, so the next start can tell its writer is dead).
        buffer = io.BytesIO()
        torch.save(state, buffer)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path.name))
        os.write(fd, buffer.getvalue()[: len(buffer.getvalue()) // 2])
        os.fsync(fd)
        log.warning(f"fault injection: rank 0 killed while writing {tmp}")
        os.kill(os.getpid(), signal.SIGKILL)
    atomic_save(state, path)
    for old in sorted(Path(cfg.checkpoint_dir).glob("step_*.pt"))[:-cfg.keep_checkpoints]:
        old.unlink()
    log.info(f"checkpoint {path}")


def find_resume_checkpoint(cfg: TrainConfig, log) -> str | None:
    """Rank 0: the checkpoint to resume from.

    ``auto`` skips an empty or unreadable ``step_*.pt`` with a warning and takes the next older one:
    under ``torchrun --max-restarts`` every restart runs this same code, so an error here would
    fail every restart the same way. (Temporaries of an interrupted save never match ``step_*.pt``;
    an empty or torn file under the real name comes from outside, e.g. a copy or a full disk.)
    An explicit ``--resume PATH`` must load, else one error line.
    """
    if cfg.resume == "none":
        return None
    if cfg.resume != "auto":
        safe_load(cfg.resume)
        return cfg.resume
    for path in sorted(Path(cfg.checkpoint_dir).glob("step_*.pt"), reverse=True):
        try:
            safe_load(path)
            return str(path)
        except UsageError as exc:
            log.warning(f"skipping {exc}; trying an older checkpoint")
    return None


def resume(cfg, ctx, log, model, optimizer, scheduler, scaler) -> tuple[int, list[float]]:
    """Restore every piece of state; returns (next step, loss history)."""
    path = [None]
    if ctx.is_main:  # rank 0 decides; an error travels to every rank instead of leaving them waiting
        # A save killed mid-write leaves a torn temporary behind; remove those whose writer is gone
        # (before this run's first save, so never one of ours).
        for stale in remove_stale_temporaries(cfg.checkpoint_dir):
            log.warning(f"removed {stale}: a temporary file left by a save that was killed mid-write")
        try:
            path[0] = find_resume_checkpoint(cfg, log)
        except UsageError as exc:
            path[0] = UsageError(str(exc))
    dist.broadcast_object_list(path, src=0)
    if isinstance(path[0], UsageError):
        raise path[0]
    if path[0] is None:
        return 0, []
    state = safe_load(path[0])  # every rank reads it: a shared filesystem, as clusters have
    load_model_state(model.module, state["model"], path[0])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    if state["world_size"] == ctx.world_size:
        set_rng_state(state["rng_per_rank"][ctx.rank], ctx.device)
    else:
        log.warning(f"checkpoint was written by {state['world_size']} ranks, now {ctx.world_size}: "
                    "RNG streams restart from the seed")
    log.info(f"resumed from {path[0]} at step {state['step']} (epoch {state['epoch']}, "
             f"step {state['step_in_epoch']} in epoch)")
    return state["step"], list(state["loss_history"])


# ---- milestone timestamps, so a restart's recovery time can be measured phase by phase ----

def process_start_time() -> float | None:
    """When the OS created this process (Unix time, ~10 ms resolution), from Linux's /proc; else None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Events:
    """Appends ``{"event", "rank", "attempt", "t"}`` JSON lines to ``<log_dir>/events.jsonl``.

    ``attempt`` is torchrun's restart count. ``recovery_report.py`` turns a crashed run's events
    into recovery phases (detection, restart, rendezvous, checkpoint load, first step).
    """

    def __init__(self, log_dir: str, rank: int):
        self.path, self.rank = Path(log_dir) / "events.jsonl", rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def __call__(self, event: str, t: float | None = None) -> None:
        line = json.dumps({"event": event, "rank": self.rank, "attempt": self.attempt,
                           "t": time.time() if t is None else t})
        with open(self.path, "a") as f:  # one short append per line: ranks do not interleave
            f.write(line + "\n")

    def stamp_stop_signal(self) -> None:
        """Record when torchrun's SIGTERM (it stops the whole group when one worker dies) arrives,
        then die of it exactly as without this handler. A rank busy computing when a peer dies
        gets this signal before its next collective could fail."""
        def handler(signum, frame):
            self("stop_signal")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        signal.signal(signal.SIGTERM, handler)


def accumulate_gradients(model: DDP, inputs: torch.Tensor, targets: torch.Tensor, k: int, autocast=None,
                         scaler: torch.amp.GradScaler | None = None, device: torch.device | None = None) -> torch.Tensor:
    """One optimizer step's forward and backward passes over ``k`` micro-batches of this rank's share.

    All but the last micro-batch run under ``no_sync()``: their gradients accumulate locally, and
    DDP all-reduces (averages over ranks) once, in the last backward. Each micro-batch loss is
    divided by k, so the accumulated gradient is the gradient of the mean loss over the whole share
    (without it, k times too large; tests/test_ch01_negative.py checks both). Returns that mean loss.
    """
    device = device or inputs.device
    step_loss = torch.zeros((), device=device)
    chunks = list(zip(inputs.chunk(k), targets.chunk(k)))
    for i, (x, y) in enumerate(chunks):
        with nullcontext() if i == len(chunks) - 1 else model.no_sync():
            with autocast or nullcontext():
                loss = lm_loss(model(x.to(device)), y.to(device)) / len(chunks)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        step_loss += loss.detach()
    return step_loss


def train(cli: argparse.Namespace, started_at: float) -> None:
    wall_start = time.perf_counter()
    with distributed(cli) as ctx:
        group_ready_at = time.time()
        cfg = share_config(cli, ctx)
        log = setup_logging(ctx.rank, os.path.join(cfg.log_dir, "train.log"), per_rank_dir=cfg.log_dir)
        events = Events(cfg.log_dir, ctx.rank)
        if process_start_time() is not None:
            events("process_start", process_start_time())
        events("main_entry", started_at)  # interpreter up, torch imported
        events("process_group_ready", group_ready_at)
        events.stamp_stop_signal()
        gpt = gpt_config(cfg.model_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                         seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
        if cfg.precision == "fp16" and ctx.device.type != "cuda":
            raise UsageError("--precision fp16 needs a GPU (GradScaler); use bf16 on CPU")
        micro = cfg.global_batch_size // ctx.world_size // cfg.grad_accum_steps
        log.info(f"world size {ctx.world_size} | backend {ctx.backend} | device {ctx.device.type} | "
                 f"global batch {cfg.global_batch_size} = {ctx.world_size} ranks x {cfg.grad_accum_steps} "
                 f"micro-batches x {micro} | lr {scaled_lr(cfg):g} | {cfg.precision}")

        model = TinyGPT(gpt).to(ctx.device)  # same seed on every rank; DDP broadcasts rank 0's anyway
        if cfg.sync_batchnorm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DDP(model, device_ids=ctx.device_ids,
                    bucket_cap_mb=cfg.bucket_cap_mb, static_graph=cfg.static_graph,
                    find_unused_parameters=cfg.find_unused_parameters,
                    gradient_as_bucket_view=cfg.gradient_as_bucket_view)
        optimizer = torch.optim.AdamW(model.parameters(), lr=scaled_lr(cfg), weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, cfg.lr_warmup_steps, cfg.steps))
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")
        autocast = (nullcontext() if cfg.precision == "fp32" else torch.autocast(
            ctx.device.type, dtype=torch.bfloat16 if cfg.precision == "bf16" else torch.float16))

        events("model_ready")
        start_step, losses = resume(cfg, ctx, log, model, optimizer, scheduler, scaler)
        events("checkpoint_loaded")
        param_count = sum(p.numel() for p in model.parameters())
        harness = Harness(ctx, "ddp", model=model, optimizer=optimizer, warmup_steps=cfg.warmup_steps,
                          config={"script": "ddp_training", "model_size": cfg.model_size,
                                  "global_batch_size": cfg.global_batch_size, "precision": cfg.precision,
                                  "param_count": param_count, "grad_accum_steps": cfg.grad_accum_steps,
                                  "bucket_cap_mb": cfg.bucket_cap_mb, "static_graph": cfg.static_graph,
                                  "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
                                  "model": gpt.to_dict()})
        task = TokenTask(gpt, num_sequences=cfg.num_sequences, seed=cli.seed)

        try:
            for step in progress(range(start_step, cfg.steps), ctx.rank, initial=start_step,
                                 total=cfg.steps, desc="train"):
                if cfg.crash_at_step == step and ctx.rank == cfg.crash_rank and first_attempt():
                    log.warning(f"fault injection: rank {ctx.rank} sends itself SIGKILL at step {step}")
                    events("fault_injected")
                    os.kill(os.getpid(), signal.SIGKILL)
                inputs, targets = (rank_slice(t, ctx.rank, ctx.world_size)
                                   for t in task.global_batch(step, cfg.global_batch_size))
                with harness.step(samples=cfg.global_batch_size, tokens=cfg.global_batch_size * gpt.seq_len):
                    optimizer.zero_grad(set_to_none=True)
                    step_loss = accumulate_gradients(model, inputs, targets, cfg.grad_accum_steps, autocast,
                                                     scaler, ctx.device)
                    scaler.unscale_(optimizer)  # clip the true gradients, not fp16-scaled ones
                    if cfg.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    scaler.step(optimizer)
                    scaler.update()
                    scheduler.step()
                dist.all_reduce(step_loss)  # the job's mean loss, for logging (outside the measured step)
                losses.append(step_loss.item() / ctx.world_size)
                if step == start_step:
                    events("first_step_done")
                done = step + 1
                if done % cfg.log_every == 0 or done == cfg.steps:
                    log.info(f"step {done}/{cfg.steps} | loss {losses[-1]:.4f} | lr {scheduler.get_last_lr()[0]:.2e}")
                if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                    save_checkpoint(cfg, ctx, log, done, model, optimizer, scheduler, scaler, losses)
        except RuntimeError:  # a peer died or hung (the recovery measurement's "detection")
            events("collective_failed")
            raise

        if start_step >= cfg.steps:
            log.info(f"checkpoint already at step {start_step} >= --steps {cfg.steps}: nothing to train "
                     "(pass --resume none or another --checkpoint-dir to start over)")
            return
        record_ = harness.finish(cfg.results, extra={"final_loss": losses[-1], "loss_history": losses,
                                                     "resumed_from_step": start_step})
        if ctx.is_main:
            rate = record_["metrics"]["tokens_per_s"]
            comm = record_["metrics"]["comm_per_step"].get("all_reduce", {})
            log.info(f"all-reduce per step: {comm.get('calls', 0):.0f} calls, {comm.get('bytes', 0) / 2**20:.2f} MiB "
                     f"| median step {record_['metrics']['step_time_s_median'] or 0:.3f} s")
            log.info(f"done: loss {losses[-1]:.4f} after {cfg.steps} steps (resumed at {start_step}) | "
                     f"wall time {time.perf_counter() - wall_start:.1f} s | "
                     f"{f'{rate:,.0f} tokens/s' if rate else 'too few steps to time'} | "
                     f"world size {ctx.world_size} | backend {ctx.backend} ({ctx.device.type})")


@record  # an uncaught exception is written where torchrun reports it, naming the failing rank
def main() -> None:
    started_at = time.time()
    cli = parse_cli()
    run_main(lambda: train(cli, started_at))


if __name__ == "__main__":
    main()
