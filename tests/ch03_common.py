"""What chapter 03's test files share (test_ch03_deepspeed.py, test_ch03_gpu.py,
test_llama_equivalence.py, test_gpu_numbers.py): the tolerances, the small run's flags, the
single-process reference and the formulas the measured bytes are held to."""
from __future__ import annotations

import torch

from distkit.models import build_model, model_config
from launch import REPO
from spine import Form
from workers.reference import train_one_process

CHAPTER = REPO / "03-deepspeed"
README = CHAPTER / "README.md"
# ZeRO against single-process AdamW after a few steps at lr 3e-3 (deepspeed_train.py, and the
# AdamW runs of zero_memory.py: the Llama's, the GPU's), absolute per weight: the reduction sums in
# another order (about 1e-7 relative per step), which Adam's normalisation magnifies for near-zero
# gradients; observed 1e-6 to 1e-5. A lost or repeated step moves a weight by up to lr = 3e-3, far
# beyond it; a gradient of the wrong scale does not (AdamW divides it out): that is what SGD_TOL's
# comparison is for.
WEIGHT_TOL = 5e-5
LR = 3e-3
# zero_memory.py as the play runs it: plain SGD at SGD_LR, whose update is lr x the gradient, so a
# gradient N times too large moves every weight N times as far. Its weights must be one process's
# within SGD_TOL (test_ch03_deepspeed.py's module docstring gives the measured numbers). It trains
# the tiny GPT with one block (MEMORY_LAYERS), not two: the play's run and its two mutants each build
# five engines, and one block takes a third off each run's CPU time.
SGD_LR, SGD_TOL = 0.5, 1e-5
MEMORY_LAYERS = 1
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
# zero_memory.py trains on the README's 4 ranks with plain SGD; its negative controls
# (test_ch03_deepspeed.py) run mutants of it with exactly this form's flags.
TRAINED = "runs/played/03_deepspeed/trained"
_TRAIN_COMMON = (*SMALL, "--lr", str(LR), "--checkpoint-dir", f"{TRAINED}/ckpt",
                 "--results", f"{TRAINED}/results.jsonl")
PLAY = {TRAIN: Form((*_TRAIN_COMMON, "--steps", "6", "--save-every", "3", "--save", f"{TRAINED}/straight_fp32.pt"),
                    nproc=2),
        RESUME: Form((*_TRAIN_COMMON, "--steps", "6", "--resume", f"{TRAINED}/ckpt/step3",
                      "--save", f"{TRAINED}/resumed_fp32.pt"), nproc=2),
        INFERENCE: Form(("--load", f"{TRAINED}/straight_fp32.pt", "--new-tokens", "8", "--prompts", "2")),
        OFFLOAD: Form((*SMALL, "--steps", "3", "--warmup-steps", "1", "--results", "{out}/results.jsonl"), nproc=2),
        MEMORY: Form((*SMALL, "--n-layer", str(MEMORY_LAYERS), "--steps", "3", "--warmup-steps", "1",
                      "--optimizer", "sgd", "--lr", str(SGD_LR), "--save", "{out}/params/{strategy}.pt",
                      "--results", "{out}/results.jsonl"))}


def reference_weights(steps: int, batch: int, lr: float = LR, arch: str = "gpt", optimizer: str = "adamw",
                      **overrides) -> dict[str, torch.Tensor]:
    """Single-process training (tests/workers/reference.py) with torch's AdamW or plain SGD
    (``optimizer``, as ``--optimizer`` names them) on the global batches the distributed jobs trained
    on, from the seed-0 tiny model of ``arch`` (with the config fields ``overrides``, as the model
    flags give them) the scripts build: the final weights."""
    torch.manual_seed(0)
    model = build_model(model_config(arch, "tiny", **overrides))
    make = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    _, final = train_one_process(model, make(model.parameters(), lr=lr), steps, batch)
    return final


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def expected_state(stage: int, psi: int, n: int, optimizer: str = "adamw") -> dict[str, float]:
    """Per-rank model-state bytes at the optimizer step of fp32 ZeRO as DeepSpeed holds them, written
    out here rather than taken from distkit.theory: the working weights, 4Ψ (stage 3: this rank's
    4Ψ/N); the gradients, 4Ψ at stage 0, else this rank's partition, 4Ψ/N (DeepSpeed's stage 1
    reduces bucket by bucket during backward and keeps only its partition, like stage 2: the paper's
    stage 1 keeps all 4Ψ); the optimizer's moments per element (AdamW's exp_avg and exp_avg_sq: 8
    bytes; plain SGD at momentum 0: none), at stages 1-3 over this rank's partition together with
    the fp32 master partition (4 bytes) ZeRO keeps even in fp32."""
    moments = {"adamw": 8, "sgd": 0}[optimizer]
    if stage == 0:
        return {"params": 4 * psi, "grads": 4 * psi, "optimizer": moments * psi}
    return {"params": 4 * psi / (n if stage == 3 else 1), "grads": 4 * psi / n,
            "optimizer": (4 + moments) * psi / n}
