"""What chapter 01's test files share: paths, the equivalence tolerance and the check that applies it,
the small-run flags, the single-process reference of the scripts' optimizer step, and loading a
chapter script by path."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from distkit import seed_everything
from distkit.checkpoint import safe_load
from distkit.models import build_model, model_config
from launch import REPO, command_argv, job_env, readme_command
from spine import Form

CHAPTER = REPO / "01-ddp-basics"
README = CHAPTER / "README.md"
TRAINING = CHAPTER / "ddp_training.py"

# The README commands, as the needles each test finds its command with (launch.readme_command); the
# comment names the file that runs it. test_ch01_tools.py checks they cover every README command.
README_LOOKUPS = [
    (("ddp_mnist.py",), "srun"),  # test_ddp_mnist.py
    ("srun", "--ntasks=4"), ("srun", "--nodes=2"), "slurm_ddp.sbatch",  # test_slurm.py
    "ddp_from_scratch.py", "--config", "--crash-at-step", "--crash-in-checkpoint-at-step",
    "--nnodes=2",  # test_ch01_ddp.py
    "validate_distributed.py", "ddp_benchmark.py", "launch_ddp.sh", "ddp_spawn.py",
    "recovery_report.py",  # test_ch01_tools.py
]

STEPS, GLOBAL_BATCH = 8, 16


def tiny(steps: int) -> list[str]:
    """The tiny GPT, the global batch, ``steps`` steps."""
    return ["--model-size", "tiny", "--global-batch-size", str(GLOBAL_BATCH), "--steps", str(steps),
            "--timeout-s", "120"]


TINY = tiny(STEPS)  # the AdamW runs' (training_flags)
# The equivalence runs (the played ddp_training.py and ddp_from_scratch.py) train plain SGD without
# clipping, under the scripts' warm-up/cosine schedule: SGD moves a weight by lr x gradient, so a
# gradient N times too large (summed over the ranks instead of averaged, an accumulated loss not
# divided by k) moves it N times as far, where AdamW's g / sqrt(v) and clipping at 1.0 would divide
# the N out and the bug would pass.
SGD_LR, SGD_STEPS = 0.5, 3
SGD = ("--optimizer", "sgd", "--lr", str(SGD_LR), "--grad-clip", "0")
# TOLERANCE, per weight, on 2-core CPU, gloo. SGD (3 steps, training moves a weight by up to 2.0e-2):
# both played runs land 7.5e-9 from one process (summation order), the scripts' mutants
# (test_ch01_negative.py) 4.6e-2 (a gradient twice too large: summed over 2 ranks, or k = 2
# micro-batches not divided by k) to 6.9e-2 (summed over 4): 5e-5 is 6,000x above the correct runs
# and over 900x below the smallest bug. AdamW (8 steps, the restarts and two agents, the GPU and
# Llama suites): Adam's first steps (update ~ lr * g / |g|) amplify the rounding to a few 1e-6 (6.3e-6
# measured for the two agents' job); 5e-5 is about 8x that.
TOLERANCE = 5e-5
WIDE = 100  # a negative control's bug must exceed the tolerance by at least this factor


def training_flags(folder: Path) -> list[str]:
    """The tiny AdamW run every ddp_training.py restart test and the two agents share.

    --find-unused-parameters: DDP then never rebuilds its bucket layout. By default DDP re-orders its
    buckets after the first iteration; a resumed job's first iteration uses the initial order, so one
    step sums some gradients in another order (~1e-7) and the restart test could only be "close"
    (2e-6 measured), not bit-for-bit identical.
    """
    return [*TINY, "--find-unused-parameters", "--grad-accum-steps", "2", "--checkpoint-every", "2",
            "--log-every", "2", "--checkpoint-dir", str(folder / "ck"), "--log-dir", str(folder / "logs"),
            "--results", str(folder / "results.jsonl")]


def _played_training(*flags: str, launcher: str = "fork") -> Form:
    return Form((*map(str, training_flags(Path("{out}"))), *flags), launcher=launcher)


# How the reader's play (tests/spine.py) runs the README commands tests/test_ch01_ddp.py and
# tests/test_ch01_tools.py check there: the training and from-scratch runs on plain SGD for SGD_STEPS
# (the equivalence runs; test_ch01_negative.py runs mutants of both scripts with these forms), their
# files under the command's own folder; training_flags' AdamW run with rank 2 killed at step 5, and
# with rank 0 dying inside the step-6 checkpoint, each under the real torchrun, which restarts the
# workers; the scaling benchmark at 1 and 2 ranks; the launcher script's tiny run (it starts torchrun
# itself: tests/bin/torchrun, first on PATH).
PLAY = {"--config": Form((*tiny(SGD_STEPS), *SGD, "--grad-accum-steps", "2", "--checkpoint-dir", "{out}/ck",
                          "--log-dir", "{out}/logs", "--results", "{out}/results.jsonl")),
        "ddp_from_scratch.py": Form((*tiny(SGD_STEPS), *SGD, "--save", "{out}/scratch.pt",
                                     "--results", "{out}/scratch.jsonl")),
        "--crash-at-step": _played_training("--crash-at-step", "5", "--crash-rank", "2", launcher="torchrun"),
        "--crash-in-checkpoint-at-step": _played_training("--crash-in-checkpoint-at-step", "6", launcher="torchrun"),
        "validate_distributed.py": Form(),
        "launch_ddp.sh": Form(("--model-size", "tiny", "--steps", "3", "--global-batch-size", "4",
                               "--log-dir", "{out}/logs", "--results", "{out}/r.jsonl")),
        "ddp_benchmark.py": Form(("--world-sizes", "1", "2", "--model-size", "tiny", "--per-rank-batch", "4",
                                  "--steps", "4", "--results", "{out}/bench.jsonl", "--plot", "{out}/scaling.png"))}


def restart_env(folder: Path) -> dict:
    """torch.distributed.run shares its rendezvous TCPStore with the workers; after a restart the new
    gloo workers can read the dead workers' addresses from it (pytorch/pytorch#135712) and fail to
    connect. A separate store per rendezvous round avoids that; the README says the same."""
    return job_env(folder, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def lr_factor(step: int, warmup: int = 10, total: int = STEPS) -> float:
    """ddp_training.py's schedule, written again: linear warm-up, cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


class Scheduled:
    """What the scripts' optimizer step does, for tests/workers/reference.py's one-process trainer:
    clip the gradient norm to ``clip`` (None: no clipping), step, then the warm-up/cosine schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip: float | None, steps: int):
        self.optimizer, self.clip = optimizer, clip
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total=steps))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.scheduler.step()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def readme_argv(*needles: str, nproc: int | None = None, launcher: str = "fork") -> list[str]:
    """The one chapter-README command with every needle, as argv for this interpreter."""
    return command_argv(readme_command(README, *needles), nproc=nproc, launcher=launcher)


def final_params(folder: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The weights of a ddp_training.py run's last checkpoint (a training_flags() run's by default)."""
    return safe_load(folder / "ck" / f"step_{steps:06d}.pt")["model"]


@functools.lru_cache(maxsize=None)  # several tests compare against the same reference; nobody mutates it
def single_process_params(arch: str = "gpt", optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch each step (tests/workers/reference.py's
    trainer, the one every equivalence test uses), for the tiny model of ``arch``, with the scripts'
    optimizer step: by default theirs (AdamW at lr 3e-3, weight decay 0.01, the gradient norm
    clipped to 1.0); ``optimizer="sgd"``, the equivalence runs' (plain SGD at SGD_LR, no clipping:
    SGD). The warm-up/cosine schedule either way."""
    from workers.reference import train_one_process

    seed_everything(0)  # the ranks' seed: the same initial weights
    model = build_model(model_config(arch, "tiny"))
    if optimizer == "sgd":
        steps, step = SGD_STEPS, Scheduled(torch.optim.SGD(model.parameters(), lr=SGD_LR), None, SGD_STEPS)
    else:
        steps, step = STEPS, Scheduled(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), 1.0, STEPS)
    return train_one_process(model, step, steps, GLOBAL_BATCH)[1]


def check_like_one_process(trained: dict, reference: dict, what: str, optimizer: str = "SGD",
                           tolerance: float = TOLERANCE) -> None:
    """Chapter 01's equivalence check: every weight of ``trained`` within ``tolerance`` (TOLERANCE; a
    negative control passes a multiple of it) of ``reference``, one process's training."""
    diff = max_diff(trained, reference)
    assert diff < tolerance, f"{what} differs from single-process {optimizer} by {diff:.2e} > {tolerance:.0e}"
