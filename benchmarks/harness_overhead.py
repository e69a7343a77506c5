"""How much does the benchmark harness add to a training step? Measure it: the same DDP training loop
with and without ``with harness.step(...)``, alternating in one process so both see the same machine
load (separate launches on a shared machine vary by tens of percent).

    python benchmarks/harness_overhead.py                       # a world of one, CPU or GPU
    torchrun --nproc_per_node=2 benchmarks/harness_overhead.py  # with real all-reduces

Each round runs ``--steps`` plain steps, then ``--steps`` steps inside the harness (or the reverse,
every other round); a step's time is taken from outside the harness in both cases, so the harness's
own bookkeeping is included. The harness's warm-up and counted steps are excluded, as the harness
excludes them from what it reports. Then the bookkeeping alone is timed over 1000 empty steps: on a
loaded machine the two medians differ by noise far larger than the harness's cost.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import ArgumentParser, add_runtime_args, distributed, run_main
from distkit.flags import add_training_args, positive_int
from distkit.harness import Harness
from distkit.models import add_model_args, build_model, lm_loss, model_config_from_args, rank_slice
from distkit.text import make_task


def parse_args():
    parser = ArgumentParser(description="Step time of one DDP training loop with and without the harness.",
                            epilog="example: python benchmarks/harness_overhead.py --model-size small")
    add_model_args(parser, default_size="tiny")
    parser.add_argument("--rounds", type=positive_int, default=6, help="alternating rounds (default: 6)")
    add_training_args(parser, steps=20, global_batch_size=16, lr=1e-3, warmup_steps=2, results=None,
                      helps={"steps": "timed steps per round and mode"})
    add_runtime_args(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    with distributed(args) as ctx:
        cfg = model_config_from_args(args)
        model = build_model(cfg).to(ctx.device)
        model = DDP(model, device_ids=ctx.device_ids)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        task = make_task(cfg, args)
        harness = Harness(ctx, "ddp", model=model, optimizer=optimizer, warmup_steps=args.warmup_steps)
        sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
        step_index = 0

        def train_step():
            nonlocal step_index
            inputs, targets = task.global_batch(step_index, args.global_batch_size)
            inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)
            targets = rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
            lm_loss(model(inputs), targets).backward()
            optimizer.step()
            step_index += 1

        def timed(with_harness: bool) -> list[float]:
            times = []
            for _ in range(args.steps):
                sync()
                start = time.perf_counter()
                if with_harness:
                    with harness.step(samples=args.global_batch_size):
                        train_step()
                else:
                    train_step()
                sync()
                times.append(time.perf_counter() - start)
            return times

        for _ in range(harness.warmup_steps + harness.comm_steps):  # the harness's untimed steps
            with harness.step(samples=args.global_batch_size):
                train_step()
        for _ in range(3):
            train_step()
        plain, wrapped = [], []
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for with_harness in order:
                (wrapped if with_harness else plain).extend(timed(with_harness))
        harness.finish(None)
        # The harness's own cost, free of run-to-run noise: empty timed steps of a second harness.
        probe = Harness(ctx, "probe", warmup_steps=0, comm_steps=0)
        start = time.perf_counter()
        for _ in range(1000):
            with probe.step(samples=1):
                pass
        bookkeeping = (time.perf_counter() - start) / 1000
        if ctx.is_main:
            base, with_h = statistics.median(plain), statistics.median(wrapped)
            print(f"{args.model_size} model | {ctx.world_size} rank(s) | {ctx.device.type} | "
                  f"{args.rounds} rounds x {args.steps} steps per mode")
            print(f"median step without harness: {base * 1e3:8.3f} ms")
            print(f"median step with harness:    {with_h * 1e3:8.3f} ms")
            print(f"harness overhead: {(with_h - base) / base:+.2%} "
                  f"(mean-based: {(statistics.mean(wrapped) - statistics.mean(plain)) / statistics.mean(plain):+.2%}; "
                  "the difference of two noisy medians)")
            print(f"harness bookkeeping per timed step: {bookkeeping * 1e6:.1f} us = {bookkeeping / base:.4%} "
                  "of the median step")


if __name__ == "__main__":
    run_main(main)
