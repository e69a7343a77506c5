"""What chapter 02's test files share: the tolerances and the equivalence checks that apply them, the
tiny model's flags, the single-process reference, the independent byte formulas, and a way to run
several launches at once.

The strategies sweep and the knob commands train with plain SGD (SGD_LR 0.5, STEPS 4; the play's
forms below): SGD moves a weight by lr x gradient, so a gradient N times too large moves it N times
as far, where AdamW's g / sqrt(v) would normalise the scale away and a sum over the ranks instead of
a mean would pass. Measured on 2-core CPU, gloo, 4 ranks, max |run - single-process SGD| (training
moves the weights by up to 1.2e-1): every strategy, and root wrap + activation checkpointing + CPU
offload, 1.2e-7 (summation order); the bugs, made in fsdp_transformer.py itself
(test_ch02_negative.py): gradients summed over the ranks instead of averaged 3.1e-1 (3.0e-1 on 2
ranks), rank 1 never stepping its shard 7.3e-2, HSDP without its all-reduce across the replicas
1.2e-1 (no gradient reaches the weights). FP32_ATOL = 2e-4 sits 1,700x above the correct runs and
360x below the smallest bug.

The scripts' default, AdamW at LR 3e-3, trains the basics, checkpoint and Hugging Face commands and
the GPU suite's runs, under the same FP32_ATOL: there what remains of a correct run is summation
order amplified by Adam where a gradient is near zero (DDP lands at 4e-5, 2e-4 is about 7% of one
Adam step; a correct resume lands at 2.3e-5), and a resume that reads the weights without the Adam
state lands 70x away (test_ch02_negative.py).

bf16 mixed precision is judged by the L2 error as a fraction of the L2 movement (untrained weights
score exactly 1) under BF16_RELATIVE = 0.15: with SGD the correct bf16 run scores 8.5e-3 and the
summed-gradient mutant 3.4 (22x the bound); with AdamW (the GPU suite) correct bf16 scores 5.4e-2,
and no max-abs bound could judge it there, its largest difference (1.1e-2) being as large as what 4
AdamW steps move the weights (1.2e-2).
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from distkit.models import TinyGPT, build_model, gpt_config, model_config
from launch import REPO, command_argv, job_env, lookup_command, run
from spine import Form
from workers.reference import train_one_process

CHAPTER = REPO / "02-fsdp"
README = CHAPTER / "README.md"
FP32_ATOL = 2e-4
BF16_RELATIVE = 0.15
LR = 3e-3  # AdamW's, the scripts' optimizer by default (basics, checkpoints, Hugging Face, the GPU suite)
SGD_LR = 0.5  # plain SGD's, in the sweep and the knobs: each step moves a weight by lr x gradient
SGD = ("--optimizer", "sgd", "--lr", str(SGD_LR))
# vocab 65 is not a multiple of 2 or 4: tok_emb and lm_head get padded rows, so the byte checks
# prove the padding is modelled.
TINY = ("--model-size", "tiny", "--vocab-size", "65", "--global-batch-size", "8")
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "ddp"]
RECORD = {"full_shard": "fsdp_full_shard", "shard_grad_op": "fsdp_shard_grad_op",
          "no_shard": "fsdp_no_shard", "hybrid_shard": "fsdp_hybrid_shard", "ddp": "ddp"}
STEPS = 4

# The README's commands, as the tests look them up (launch.readme_command needles); together they
# must cover the README (launch.assert_readme_covered).
BASICS = ("fsdp_basics.py",)
SWEEP = ("--sharding full_shard shard_grad_op no_shard hybrid_shard ddp",)
TABLE = ("make_strategies_table.py",)
OFFLOAD = ("--activation-checkpointing --cpu-offload",)
BF16 = ("--mixed-precision bf16",)
SAVE = ("fsdp_checkpoint.py --steps 100",)
RESUME_LATEST = ("fsdp_checkpoint.py", "--resume latest")
RESUME_FULL = ("fsdp_checkpoint.py", "--resume checkpoints/fsdp/full.pt")
HF_CHECKPOINT = ("fsdp_hf_checkpoint.py",)  # test_ch02_hf.py
LORA = ("fsdp_lora.py",)  # test_ch02_lora.py
TEXT = ("--data text",)  # test_text_data.py
LOOKUPS = [BASICS, SWEEP, TABLE, OFFLOAD, BF16, SAVE, RESUME_LATEST, RESUME_FULL, HF_CHECKPOINT, LORA, TEXT]

# How the reader's play (tests/spine.py) runs the commands tests/test_ch02_fsdp.py checks there: the
# tiny GPT with a vocabulary of 65, 4 steps (plain SGD in the sweep and the knobs, AdamW elsewhere),
# the trained weights saved under the command's own folder; the strategies sweep into the README's
# records, which the table command then reads; the three checkpoint commands in the README's folder,
# each resume dumping what it loaded (test_ch02_fsdp.py's `checkpoints` says what each leaves there);
# the Hugging Face job for 4 steps, dumping its logits (tests/test_ch02_hf.py); the LoRA fine-tune for
# 4 steps (tests/test_ch02_lora.py). test_ch02_negative.py runs broken copies of the scripts with the
# same forms.
_KNOB = Form((*TINY, *SGD, "--steps", str(STEPS), "--results", "{out}/r.jsonl", "--save", "{out}/{strategy}.pt"))
LORA_STEPS, LORA_BATCH = 4, 8  # tests/test_ch02_lora.py's run of the README's LoRA command
HF_STEPS = 4  # tests/test_ch02_hf.py's run of the README's Hugging Face command
PLAY = {BASICS: Form((*TINY, "--steps", "4", "--results", "{out}/b.jsonl", "--save", "{out}/basics.pt"),
                     launcher="torchrun-fresh"),  # fresh interpreters: no module the fork server imported
        SWEEP: Form((*TINY, *SGD, "--steps", str(STEPS), "--log-every", "1", "--save", "{out}/params/{strategy}.pt")),
        TABLE: Form(), OFFLOAD: _KNOB, BF16: _KNOB,
        SAVE: Form((*TINY, "--steps", "3", "--log-every", "1")),
        RESUME_LATEST: Form((*TINY, "--steps", "6", "--log-every", "1", "--checkpoint-format", "full",
                             "--dump-loaded", "{out}/loaded.pt")),
        RESUME_FULL: Form((*TINY, "--steps", "9", "--checkpoint-format", "none", "--dump-loaded",
                           "{out}/loaded_full.pt")),
        HF_CHECKPOINT: Form((*TINY, "--steps", str(HF_STEPS), "--log-every", "1", "--dump-logits", "{out}/logits.pt")),
        LORA: Form(("--steps", str(LORA_STEPS), "--global-batch-size", str(LORA_BATCH), "--log-every", "1",
                    "--results", "{out}/records.jsonl", "--save", "{out}/adapters.pt"))}


def command(lookup) -> str:
    """The one README command a lookup above names."""
    return lookup_command(README, lookup)


def readme_argv(lookup, *extra, nproc: int | None = None) -> list[str]:
    """A README command as argv (``nproc`` replaces its rank count), plus ``extra`` flags (argparse
    keeps the last value of a repeated flag)."""
    return [*command_argv(command(lookup), nproc), *map(str, extra)]


def run_readme(lookup, tmp_path: Path, *extra, nproc: int | None = None, timeout: float = 300):
    """Run a README command as written (or on ``nproc`` ranks), plus ``extra`` flags."""
    return run(readme_argv(lookup, *extra, nproc=nproc), timeout=timeout, env=job_env(tmp_path))


def run_all(jobs: dict[str, list], tmp_path: Path, parallel: int = 2, timeout: float = 400) -> dict:
    """Run independent launches ``{name: argv}`` ``parallel`` at a time (a single-process job uses
    one of the machine's cores; two overlap) and return ``{name: CompletedProcess}`` (output merged,
    exit code not checked: the caller asserts what each must end with)."""
    def one(item):
        name, argv = item
        folder = tmp_path / f"job_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        return name, run([*map(str, argv)], timeout=timeout, env=job_env(folder), check=False)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return dict(pool.map(one, jobs.items()))


def check_ok(result) -> str:
    """The output of a launch that must have succeeded."""
    assert result.returncode == 0, f"exit {result.returncode}: {result.args}\n{result.stdout[-6000:]}"
    return result.stdout


@functools.lru_cache(maxsize=None)  # several tests compare against the same run; nobody mutates it
def reference_state(steps: int, batch: int = 8, vocab: int = 65, arch: str = "gpt",
                    optimizer: str = "adamw") -> tuple[dict, dict]:
    """Single-process training on the same global batches, AdamW at LR or plain SGD at SGD_LR
    (``optimizer``): (initial, final) state dicts of the tiny model of ``arch``."""
    cfg = model_config(arch, "tiny", vocab_size=vocab)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = (torch.optim.SGD(model.parameters(), lr=SGD_LR) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=LR))
    return train_one_process(model, opt, steps, batch)


def check_like_one_process(trained: dict, reference: dict, what: str, optimizer: str = "SGD",
                           atol: float = FP32_ATOL) -> None:
    """Chapter 02's equivalence check of an fp32 run: every weight of ``trained`` within ``atol``
    (FP32_ATOL; a negative control passes a multiple of it) of single-process training."""
    diff = max_diff(trained, reference)
    assert diff <= atol, f"{what} differs from single-process {optimizer} by {diff:.2e} > {atol:.1e}"


def check_bf16_like_one_process(trained: dict, reference: dict, initial: dict, what: str,
                                bound: float = BF16_RELATIVE) -> None:
    """The same check for a bf16 run: its L2 error over the L2 movement of single-process SGD training
    (:func:`relative_error`) at most ``bound`` (BF16_RELATIVE)."""
    error = relative_error(trained, reference, initial)
    assert error <= bound, f"{what} differs from single-process SGD by {error:.3f} of the training movement > {bound}"


def dcp_weights(folder, like: dict) -> dict:
    """The model part of a DCP checkpoint, read in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state["model"]


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def relative_error(state: dict, expected: dict, initial: dict) -> float:
    """L2 |state - expected| / L2 |expected - initial| over all weights: the error as a fraction of
    what training moved (untrained weights score exactly 1)."""
    err = sum(((state[k].float() - expected[k].float()) ** 2).sum().item() for k in expected)
    moved = sum(((expected[k].float() - initial[k].float()) ** 2).sum().item() for k in expected)
    return (err / moved) ** 0.5


def expected_bytes(strategy: str, world: int, shard_size: int, gather_bytes: int = 4, cfg=None,
                   pad: bool = True, block_gathers: int | None = None, optimizer: str = "adamw") -> dict:
    """Textbook FSDP traffic and state per rank for the tiny GPT, written independently of the script
    (and of distkit.theory, which the script prints its predictions from).

    Units: one per block, then the root (the rest). Each parameter's dim 0 is padded to a multiple of
    the shard-group size s. All-gather payload = padded unit size, twice per block unit when resharded
    after forward (forward + backward), once for the root (never resharded) and for SHARD_GRAD_OP.
    Reduce-scatter payload = all padded gradients. All-reduce = the shard across replicas (P/s),
    issued by DDP and by every 2D (replicate, shard) mesh even when a group is one rank (world 1).
    ``cfg`` (default: the tests' tiny GPT, vocab 65) is the model; ``pad=False`` and ``block_gathers``
    give the deliberately wrong formulas of the negative control. Optimizer state: AdamW's two fp32
    moments per element held (2P/s), plain SGD's (``optimizer="sgd"``, no momentum) nothing.
    """
    model = TinyGPT(cfg or gpt_config("tiny", vocab_size=65))
    s = {"full_shard": world, "shard_grad_op": world, "hybrid_shard": shard_size}.get(strategy, 1)

    def padded(params):
        rows = (lambda d0: math.ceil(d0 / s) * s) if pad else (lambda d0: d0)
        return sum(rows(p.shape[0]) * p[0].numel() for p in params)

    blocks = padded(model.blocks.parameters())
    root = padded(p for n, p in model.named_parameters() if not n.startswith("blocks."))
    every = blocks + root
    comm = {}
    if s > 1:
        gathers = 2 if strategy in ("full_shard", "hybrid_shard") else 1
        gathers = gathers if block_gathers is None else block_gathers
        comm["all_gather"] = (gathers * blocks + root) * gather_bytes
        comm["reduce_scatter"] = every * 4
    if strategy in ("ddp", "no_shard", "hybrid_shard"):
        comm["all_reduce"] = every // s * 4
    state = every // s * 4
    moments = {"adamw": 2, "sgd": 0}[optimizer]
    return {"comm": comm, "state": {"params": state, "grads": state, "optimizer": moments * state}}


def shard_bytes(strategy: str, rank: int, world: int, shard_size: int) -> int:
    """Parameter bytes rank ``rank`` holds: its torch.chunk piece of dim 0 of every parameter
    (chunks of ceil(d0/s) rows; the last ranks get fewer rows or none, the padding is not data)."""
    s = {"full_shard": world, "shard_grad_op": world, "hybrid_shard": shard_size}.get(strategy, 1)
    index = rank % s  # meshes are (replicate, shard), row-major: rank = replica * s + index
    total = 0
    for p in TinyGPT(gpt_config("tiny", vocab_size=65)).parameters():
        rows = math.ceil(p.shape[0] / s)
        mine = max(0, min(rows, p.shape[0] - index * rows))
        total += mine * p[0].numel() * 4
    return total
