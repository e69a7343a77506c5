"""What chapter 05's tests share (CPU suite, GPU suite, negative controls): the quick flags, the
equivalence tolerance, the single-process reference and the README commands they launch.

Equivalence: every strategy trains the tiny GPT for STEPS plain-SGD steps at lr LR in fp32, and its
saved weights must equal one process training the same initial weights on the whole global batch
within TOLERANCE (1e-5 absolute on every parameter). test_ch05_advanced.py's docstring says why SGD
and where the tolerance comes from; test_ch05_negative.py proves it catches the bugs it must.
"""
from __future__ import annotations

import shlex

import torch

from distkit.models import TokenTask, build_model, lm_loss, model_config
from distkit.runtime import seed_everything
from launch import REPO, torchrun
from launch import readme_command as find_command
from spine import Form
from workers.reference import train_one_process

CHAPTER = REPO / "05-advanced"
README = CHAPTER / "README.md"
STEPS, LR, TOLERANCE = 3, 0.5, 1e-5

# Every README command, as the lookup (needles, without) the test that runs it uses (the tests of
# test_ch05_advanced.py find their command by its key; test_every_readme_command_is_run_by_a_test
# proves together they cover the README).
LOOKUPS = {"tp": (("tensor_parallel.py",), "--sequence-parallel"),
           "tp_sp": (("tensor_parallel.py", "--sequence-parallel"), "--arch llama"),
           "tp_llama_sp": (("tensor_parallel.py", "--arch llama"), None),
           "pipeline": (("pipeline_parallel.py", "nproc_per_node=4"), None),
           "pipeline_2ranks": (("pipeline_parallel.py", "nproc_per_node=2"), None),
           "2d": (("hybrid_parallelism.py", "--mode 2d", "nproc_per_node=4"), None),
           "hsdp": (("hybrid_parallelism.py", "--mode hsdp", "nproc_per_node=4"), None),
           "mesh_error": (("hybrid_parallelism.py", "nproc_per_node=2"), None),
           "accumulation": (("gradient_accumulation.py",), None),
           "overlap": (("communication_overlap.py",), None),
           "plot": (("plot_results.py",), None),
           "activation_checkpointing": (("activation_checkpointing.py",), None),  # test_ch05_ac.py
           # test_ch05_cp_ep.py
           "cp_2ranks": (("context_parallel.py", "nproc_per_node=2"), "--impl"),
           "cp_4ranks": (("context_parallel.py", "nproc_per_node=4"), None),
           "cp_torch_on_cpu": (("context_parallel.py", "--impl torch"), None),
           "ep_2ranks": (("expert_parallel.py", "nproc_per_node=2"), None),
           "ep_4ranks": (("expert_parallel.py", "nproc_per_node=4"), None)}
QUICK = ("--model-size", "tiny", "--steps", STEPS, "--optimizer", "sgd", "--lr", LR, "--warmup-steps", "1")
CP_QUICK = (*QUICK, "--seq-len", 32)  # the tiny GPT's length: 2 x 4 chunks of 4 tokens at cp = 4
# activation_checkpointing.py: 4 sequences per rank, as activation_bytes_per_layer's micro-batch
AC_FLAGS = (*QUICK, "--warmup-steps", 2, "--global-batch-size", 8)
OUT_RESULTS = ("--results", "{out}/r.jsonl")  # for the commands whose README line names no --results


def _form(*flags, nproc=None, launcher="fork") -> Form:
    return Form(tuple(map(str, flags)), nproc=nproc, launcher=launcher)


# How the reader's play (tests/spine.py) runs each README command, so that the chapter's tests check
# what it printed and wrote: the equivalence settings (QUICK: plain SGD, 3 steps), the weights saved
# under the command's own folder. The activation-checkpointing command runs FSDP2 on 2 ranks, full AC,
# eager and compiled (one graph: tests/test_ch05_ac.py says why), instead of three AC modes compiled.
# The 2-rank pipeline runs with fresh interpreters end to end, as a reader's torchrun starts them
# (the fork server's pre-imported torch.distributed.pipelining would hide an import the script forgot).
PLAY = {LOOKUPS["tp"]: _form(*QUICK, "--global-batch-size", 16, *OUT_RESULTS, "--save", "{out}/{strategy}.pt"),
        LOOKUPS["tp_sp"]: _form(*QUICK, "--global-batch-size", 16, *OUT_RESULTS, "--save", "{out}/{strategy}.pt"),
        LOOKUPS["tp_llama_sp"]: _form(*QUICK, "--global-batch-size", 16, *OUT_RESULTS,
                                      "--save", "{out}/{strategy}.pt"),
        LOOKUPS["pipeline"]: _form(*QUICK, "--n-layer", 8, "--global-batch-size", 16, "--microbatches", 4,
                                   "--save", "{out}/{schedule}_m{microbatches}.pt"),
        LOOKUPS["pipeline_2ranks"]: _form(*QUICK, "--global-batch-size", 16, "--microbatches", 2, 4,
                                          "--save", "{out}/{schedule}_m{microbatches}.pt", launcher="torchrun-fresh"),
        LOOKUPS["2d"]: _form(*QUICK, "--global-batch-size", 16, *OUT_RESULTS, "--save", "{out}/{mode}.pt"),
        LOOKUPS["hsdp"]: _form(*QUICK, "--global-batch-size", 16, *OUT_RESULTS, "--save", "{out}/{mode}.pt"),
        LOOKUPS["mesh_error"]: Form(),  # refused before any work: as written
        LOOKUPS["accumulation"]: _form(*QUICK, "--grad-accum-steps", 4, "--micro-batch-size", 2, *OUT_RESULTS,
                                       "--save", "{out}/{sync}.pt"),
        LOOKUPS["overlap"]: _form("--layers", 16, "--steps", 3, "--warmup-steps", 1, "--bucket-cap-mb", 0.02, 25,
                                  "--async-mib", 1, "--trace", "{out}/trace.json"),
        LOOKUPS["plot"]: Form(),
        LOOKUPS["activation_checkpointing"]: _form(*AC_FLAGS, "--strategy", "fsdp", "--ac", "full", "--compile",
                                                   "off", "on", "--save", "{out}/{ac}_{compile}.pt", nproc=2),
        LOOKUPS["cp_2ranks"]: _form(*CP_QUICK, "--save", "{out}/{layout}.pt"),
        LOOKUPS["cp_4ranks"]: _form(*CP_QUICK, "--save", "{out}/{layout}.pt"),
        LOOKUPS["cp_torch_on_cpu"]: _form(*CP_QUICK, "--save", "none"),
        LOOKUPS["ep_2ranks"]: _form(*QUICK, "--save", "{out}/ep.pt"),
        LOOKUPS["ep_4ranks"]: _form(*QUICK, "--save", "{out}/ep.pt")}


def reference(global_batch: int, arch: str = "gpt", **overrides) -> tuple[dict, list[float]]:
    """Single-process SGD on the whole global batch from the scripts' seed-0 initial weights
    (``train_one_process``): the final state dict and the loss of every step. ``arch``: the tiny
    GPT or the tiny Llama (``--arch llama --model-size tiny``), built by ``build_model``."""
    cfg = model_config(arch, "tiny", **overrides)
    seed_everything(0)
    model = build_model(cfg)
    # The loss of each step, read off the forward pass train_one_process runs on that step's batch
    # (the step's targets are TokenTask's, as the trainer uses them).
    task, losses = TokenTask(cfg, seed=0), []
    model.register_forward_hook(lambda module, inputs, logits: losses.append(
        lm_loss(logits, task.global_batch(len(losses), global_batch)[1]).item()))
    _, final = train_one_process(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, global_batch)
    assert len(losses) == STEPS
    return final, losses


def readme_command(*needles: str, without: str | None = None) -> tuple[int, str, list[str]]:
    """The README command containing every needle (and not ``without``), as (nproc, script, args)."""
    command = find_command(README, *needles, without=without)
    words = shlex.split(command)
    assert words[0] == "torchrun", command
    nproc = int(next(w for w in words if w.startswith("--nproc_per_node=")).split("=")[1])
    script_at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return nproc, words[script_at], words[script_at + 1:]


def launch(tmp_path, *needles: str, without: str | None = None, extra=(), check=True, **kwargs):
    """Run the README command with these needles as written, ``extra`` flags appended (argparse keeps
    the last value of a repeated flag)."""
    nproc, script, args = readme_command(*needles, without=without)
    return torchrun(REPO / script, *args, *extra, nproc=kwargs.pop("nproc", nproc), tmp_path=tmp_path,
                    check=check, timeout=kwargs.pop("timeout", 400), **kwargs)
