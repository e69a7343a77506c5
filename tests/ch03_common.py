"""What chapter 03's test files share (test_ch03_deepspeed.py, test_ch03_negative.py,
test_ch03_gpu.py): the tolerance, the small run's flags, the single-process reference, the formulas
the measured bytes are held to, and loading a chapter script as a module."""
from __future__ import annotations

import torch

from distkit import theory
from distkit.models import build_model, model_config
from launch import REPO
from spine import Form
from workers.reference import train_one_process

CHAPTER = REPO / "03-deepspeed"
README = CHAPTER / "README.md"
# ZeRO 0-3 (and offload) against single-process AdamW after a few steps at lr 3e-3, absolute per
# weight: the reduction sums in another order (about 1e-7 relative per step), which Adam's
# normalisation magnifies for near-zero gradients; observed 1e-6 to 1e-5. test_ch03_negative.py
# shows that the bugs this comparison exists for exceed it by far.
WEIGHT_TOL = 5e-5
LR = 3e-3
SMALL = ["--model-size", "tiny", "--global-batch-size", "16"]
STRATEGIES = ["zero0", "zero1", "zero2", "zero3", "zero3_offload"]

# The README's commands, as the lookups that find them (launch.readme_command)
TRAIN = ("torchrun", "deepspeed_train.py")
RESUME = ("deepspeed --num_gpus", "deepspeed_train.py")
INFERENCE = "deepspeed_inference.py"
OFFLOAD = "zero_offload.py"
MEMORY = "zero_memory.py"

# How the reader's play (tests/spine.py) runs them, so that tests/test_ch03_deepspeed.py checks what
# they printed and wrote. ZeRO-3 trains 6 steps on 2 ranks with a checkpoint every 3 (torchrun); the
# deepspeed launcher resumes from the step-3 checkpoint to step 6 again, into the same records
# (TRAINED: their shared folder); inference loads the uninterrupted run's consolidated weights.
TRAINED = "runs/played/03_deepspeed/trained"
_TRAIN_COMMON = (*SMALL, "--lr", str(LR), "--checkpoint-dir", f"{TRAINED}/ckpt",
                 "--results", f"{TRAINED}/results.jsonl")
PLAY = {TRAIN: Form((*_TRAIN_COMMON, "--steps", "6", "--save-every", "3", "--save", f"{TRAINED}/straight_fp32.pt"),
                    nproc=2),
        RESUME: Form((*_TRAIN_COMMON, "--steps", "6", "--resume", f"{TRAINED}/ckpt/step3",
                      "--save", f"{TRAINED}/resumed_fp32.pt"), nproc=2),
        INFERENCE: Form(("--load", f"{TRAINED}/straight_fp32.pt", "--new-tokens", "8", "--prompts", "2")),
        OFFLOAD: Form((*SMALL, "--steps", "3", "--warmup-steps", "1", "--results", "{out}/results.jsonl"), nproc=2),
        MEMORY: Form((*SMALL, "--steps", "4", "--lr", str(LR), "--save", "{out}/params/{strategy}.pt",
                      "--results", "{out}/results.jsonl"))}


def reference_weights(steps: int, batch: int, lr: float = LR, arch: str = "gpt") -> dict[str, torch.Tensor]:
    """Single-process AdamW (tests/workers/reference.py) on the global batches the distributed jobs
    trained on, from the seed-0 tiny model of ``arch`` the scripts build: the final weights."""
    torch.manual_seed(0)
    model = build_model(model_config(arch, "tiny"))
    _, final = train_one_process(model, torch.optim.AdamW(model.parameters(), lr=lr), steps, batch)
    return final


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def expected_state(stage: int, psi: int, n: int) -> dict[str, float]:
    """Per-rank model-state bytes at the optimizer step: the fp32 formula of distkit.theory, with
    one known gap. DeepSpeed's stage 1 reduces gradients bucket by bucket during backward and keeps
    only its partition, like stage 2 (the paper's stage 1 keeps full gradients, 4Ψ in fp32)."""
    expected = theory.zero_fp32_state_bytes(stage, psi, n)
    if stage == 1:
        expected["grads"] = 4 * psi / n
    return expected
