"""What chapter 01's test files share: paths, the equivalence tolerance, the small-run flags, the
single-process reference of ddp_training.py's optimizer, and loading a chapter script by path."""
from __future__ import annotations

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
TINY = ["--model-size", "tiny", "--global-batch-size", str(GLOBAL_BATCH), "--steps", str(STEPS),
        "--timeout-s", "120"]
# DDP averages gradients in a different order than one process sums them; AdamW's first steps
# (update ~ lr * g / |g|) amplify those float32 rounding differences to a few 1e-6. 5e-5 is 10x that.
# What this comparison cannot see: AdamW and clipping at 1.0 make the update independent of the
# gradient's scale, so a gradient summed instead of averaged (or an accumulated loss not divided by
# k) passes here. test_ch01_negative.py checks the same tolerance with SGD on the script's own
# average_gradients and proves those bugs exceed it (by 1,300x; correct runs 1.2e-7).
TOLERANCE = 5e-5
WIDE = 100  # a negative control's bug must exceed the tolerance by at least this factor



def training_flags(folder: Path) -> list[str]:
    """The tiny run every ddp_training.py equivalence and restart test shares.

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
# tests/test_ch01_tools.py check there: the tiny training run of training_flags (its files under the
# command's own folder); rank 2 killed at step 5 and rank 0 dying inside the step-6 checkpoint, each
# under the real torchrun, which restarts the workers; the scaling benchmark at 1 and 2 ranks; the
# launcher script's tiny run (it starts torchrun itself: tests/bin/torchrun, first on PATH).
PLAY = {"--config": _played_training(),
        "ddp_from_scratch.py": Form((*TINY, "--save", "{out}/scratch.pt", "--results", "{out}/scratch.jsonl")),
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


class ClippedScheduledAdamW:
    """What ddp_training.py's optimizer step does, for tests/workers/reference.py's one-process
    trainer: clip the gradient norm to 1.0, AdamW (lr 3e-3, weight decay 0.01), then the schedule."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())
        self.adamw = torch.optim.AdamW(self.params, lr=3e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.adamw, lr_factor)

    def zero_grad(self) -> None:
        self.adamw.zero_grad()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.adamw.step()
        self.scheduler.step()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def readme_argv(*needles: str, nproc: int | None = None, launcher: str = "fork") -> list[str]:
    """The one chapter-README command with every needle, as argv for this interpreter."""
    return command_argv(readme_command(README, *needles), nproc=nproc, launcher=launcher)


def final_params(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a training_flags() run's last checkpoint."""
    return safe_load(folder / "ck" / f"step_{STEPS:06d}.pt")["model"]


def single_process_params(arch: str = "gpt") -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch each step, ddp_training.py's optimizer step
    (tests/workers/reference.py's trainer, the one every equivalence test uses), for the tiny model
    of ``arch``."""
    from workers.reference import train_one_process

    seed_everything(0)  # the ranks' seed: the same initial weights
    model = build_model(model_config(arch, "tiny"))
    return train_one_process(model, ClippedScheduledAdamW(model), STEPS, GLOBAL_BATCH)[1]
