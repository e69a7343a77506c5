"""Negative controls of chapter 02's equivalence checks (test_ch02_fsdp.py): broken copies of the
chapter's own scripts, run with the flags the reader's play gives the correct commands
(ch02_common.PLAY), must fail the very check the correct runs pass (ch02_common's
check_like_one_process, check_bf16_like_one_process: their own messages), and by far: each fails
the check with its tolerance widened (WIDE, BF16_WIDE, RESUME_WIDE times). Each mutant is the script
with one exact piece of its source replaced (tests/workers/ch05_mutant.py; the piece must occur
exactly once).

fsdp_transformer.py with the strategies sweep's flags (4 ranks, tiny GPT, vocab 65, plain SGD lr 0.5,
4 steps; each strategy of ``--sharding`` trains alone from the seed-0 weights, so a mutant given some
of the sweep's strategies trains each exactly as the sweep does):

* ``summed``: the loss times the world size, so each rank's gradient is N times its own and the mean
  FSDP and DDP take over the ranks becomes the sum: all five strategies on 4 ranks, FULL_SHARD and
  DDP on 2;
* ``dropped_shard``: rank 1 never calls ``optimizer.step()``, so its shard keeps its initial rows:
  FULL_SHARD and HYBRID_SHARD (SHARD_GRAD_OP holds FULL_SHARD's shards, only its blocks' resharding
  differs, and lands exactly where FULL_SHARD does: measured; under NO_SHARD and DDP every rank holds
  the whole model and rank 0's copy is the one saved: nothing to see there);
* ``replicas_not_reduced``: ``model.set_requires_all_reduce(False)`` after the root's ``fully_shard``,
  the HSDP all-reduce across the replicas switched off (FSDP2 keeps the partial reduction for a later
  step, and no gradient reaches the weights): HYBRID_SHARD on its 2 x 2 mesh;
* ``summed`` with the knob commands' flags: root wrap + activation checkpointing + CPU offload
  (FP32_ATOL), and bf16 mixed precision (BF16_RELATIVE).

Measured on 2-core CPU, gloo (max |run - single-process SGD|; training moves the weights by up to
1.2e-1, the correct runs land at 1.2e-7): summed 3.1e-1 on 4 ranks (1,560x FP32_ATOL) and 3.0e-1 on
2, under offload 3.1e-1; dropped shard 7.3e-2 (FULL_SHARD; 366x) and 1.2e-1 (HSDP); replicas not
reduced 1.2e-1 (576x); under bf16 the summed mutant's L2 error is 3.4 of the movement (22x
BF16_RELATIVE; correct bf16: 8.5e-3).

fsdp_checkpoint.py's ``--resume latest`` command with its played flags (2 ranks, AdamW lr 3e-3), from
a copy of the played 4-rank DCP save of step 3, trained to step 6 as the correct resume is: load_dcp
reading only the weights (``weights_only``: zero Adam moments, as a checkpoint without the optimizer
gives) or resetting Adam's step count (``step_reset``: step 1's bias correction again).
Adam normalises the update, so these bugs move the weights less: measured 1.4e-2 (70x FP32_ATOL) and
9.1e-3 (46x) against the correct resume's 2.3e-5; they must exceed RESUME_WIDE x FP32_ATOL.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ch02_common import (
    BF16,
    BF16_RELATIVE,
    CHAPTER,
    FP32_ATOL,
    OFFLOAD,
    PLAY,
    RESUME_LATEST,
    STEPS,
    STRATEGIES,
    SWEEP,
    check_bf16_like_one_process,
    check_like_one_process,
    check_ok,
    max_diff,
    readme_argv,
    reference_state,
    relative_error,
    run_all,
)
from launch import WORKERS
from spine import play_chapter

WIDE = 100  # an fp32 SGD bug must fail FP32_ATOL widened this many times
BF16_WIDE = 10  # a bf16 bug, BF16_RELATIVE widened this many times
RESUME_WIDE = 20  # an AdamW resume bug (Adam normalises the update: a smaller effect)

TRANSFORMER, CHECKPOINT = CHAPTER / "fsdp_transformer.py", CHAPTER / "fsdp_checkpoint.py"
LOSS = "loss = lm_loss(model(inputs).float(), targets)"
SUMMED = (LOSS, f"{LOSS} * ctx.world_size")
DROPPED_SHARD = ("optimizer.step()  # each rank updates only its own shard",
                 "if ctx.rank != 1: optimizer.step()  # rank 1's shard is never updated")
ROOT = "fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)"
REPLICAS_NOT_REDUCED = (ROOT, f"{ROOT}; model.set_requires_all_reduce(False)")
SET_STATE = 'set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])'
# dcp.load fills the state dicts in place, the optimizer's included: reading the model part alone is
# what restores the weights without the Adam state (its moments stay those of torch's zero-gradient
# initialisation)
WEIGHTS_ONLY = ("dcp.load(state, checkpoint_id=folder)", 'dcp.load({"model": state["model"]}, checkpoint_id=folder)')
STEP_RESET = (SET_STATE, f'{SET_STATE}; [s["step"].zero_() for s in optimizer.state.values()]')

DROPPED_IN = ["full_shard", "hybrid_shard"]
# name: (the README command, its mutation, the strategies it trains (None: the command's own), ranks
# (None: the README's)); the longest first, since two run at a time
MUTANTS = {"summed": (SWEEP, SUMMED, None, None),
           "dropped_shard": (SWEEP, DROPPED_SHARD, DROPPED_IN, None),
           "summed_2_ranks": (SWEEP, SUMMED, ["full_shard", "ddp"], 2),
           "replicas_not_reduced": (SWEEP, REPLICAS_NOT_REDUCED, ["hybrid_shard"], None),
           "offload_summed": (OFFLOAD, SUMMED, None, None),
           "bf16_summed": (BF16, SUMMED, None, None)}


def mutant_argv(lookup, script: Path, mutation: tuple, folder: Path, *extra, nproc: int | None = None) -> list:
    """The README command ``lookup`` with the play's flags (its outputs in ``folder``) and ``extra``,
    its script replaced by the mutant (tests/workers/ch05_mutant.py SCRIPT OLD NEW --)."""
    flags = [flag.replace("{out}", str(folder)) for flag in PLAY[lookup].flags]
    argv = readme_argv(lookup, *flags, *extra, nproc=nproc)
    at = next(i for i, word in enumerate(argv) if str(word).endswith(script.name))
    return [*argv[:at], WORKERS / "ch05_mutant.py", script, *mutation, "--", *argv[at + 1:]]


@pytest.fixture(scope="module")
def mutants(tmp_path_factory):
    """Every fsdp_transformer.py mutant above, two launches at a time: {name: output folder}. None
    needs the play: they can run while another worker plays the chapter."""
    tmp = tmp_path_factory.mktemp("ch02_mutants")
    jobs = {}
    for name, (lookup, mutation, strategies, nproc) in MUTANTS.items():
        folder = tmp / name
        # the sweep's README command writes runs/fsdp_strategies.jsonl: here the mutant's own folder
        extra = ("--results", folder / "r.jsonl", *(("--sharding", *strategies) if strategies else ()))
        jobs[name] = mutant_argv(lookup, TRANSFORMER, mutation, folder, *extra, nproc=nproc)
    results = run_all(jobs, tmp)
    for name, result in results.items():
        check_ok(result)  # a mutant that crashed would prove nothing
    return {name: tmp / name for name in MUTANTS}


def trained(folder: Path, strategy: str) -> dict:
    """The weights a run saved for ``strategy`` (the sweep's form under params/, the knobs' beside)."""
    path = folder / "params" / f"{strategy}.pt"
    return torch.load(path if path.exists() else folder / f"{strategy}.pt", weights_only=True)


def assert_each_fails_the_check(mutants, cases: list[tuple[str, str]]) -> None:
    """Each (mutant, strategy) run fails check_like_one_process's own message, even at WIDE x FP32_ATOL."""
    _, reference = reference_state(STEPS, optimizer="sgd")
    for name, strategy in cases:
        state = trained(mutants[name], strategy)
        print(f"{name} {strategy}: {max_diff(state, reference):.2e}")
        with pytest.raises(AssertionError, match=f"^{name} {strategy} differs from single-process SGD by "):
            check_like_one_process(state, reference, f"{name} {strategy}", atol=WIDE * FP32_ATOL)


def test_summed_gradients_fail_the_equivalence_check(mutants):
    """Gradients summed over the ranks instead of averaged: every strategy on 4 ranks, FULL_SHARD and
    DDP on 2, and under root wrap + activation checkpointing + CPU offload."""
    cases = [("summed", s) for s in STRATEGIES] + [("summed_2_ranks", s) for s in ("full_shard", "ddp")]
    assert_each_fails_the_check(mutants, [*cases, ("offload_summed", "full_shard")])


def test_dropped_shards_and_unreduced_replicas_fail_the_equivalence_check(mutants):
    """Rank 1's shard never stepped (FULL_SHARD, HSDP), HSDP's replicas never all-reduced."""
    assert_each_fails_the_check(mutants, [("dropped_shard", s) for s in DROPPED_IN]
                                + [("replicas_not_reduced", "hybrid_shard")])


def test_summed_gradients_under_bf16_fail_the_relative_check(mutants):
    initial, reference = reference_state(STEPS, optimizer="sgd")
    state = trained(mutants["bf16_summed"], "full_shard")
    print(f"bf16_summed: {relative_error(state, reference, initial):.3f} of the movement")
    message = "^bf16_summed differs from single-process SGD by .* of the training movement"
    with pytest.raises(AssertionError, match=message):
        check_bf16_like_one_process(state, reference, initial, "bf16_summed", bound=BF16_WIDE * BF16_RELATIVE)


@pytest.fixture(scope="module")
def resumed(reader, tmp_path_factory):
    """The two fsdp_checkpoint.py mutants resumed (two launches at once) from a copy of the played
    4-rank DCP save of step 3, as the play's ``--resume latest`` command: {name: final checkpoint}."""
    played = play_chapter("02-fsdp", reader)
    played.ok(RESUME_LATEST)  # the save, then the correct resume, ran
    tmp = tmp_path_factory.mktemp("ch02_resume_mutants")
    jobs = {}
    for name, mutation in (("weights_only", WEIGHTS_ONLY), ("step_reset", STEP_RESET)):
        folder = tmp / name
        shutil.copytree(played.clone / "checkpoints" / "fsdp" / "dcp", folder / "ckpt" / "dcp")
        jobs[name] = mutant_argv(RESUME_LATEST, CHECKPOINT, mutation, folder, "--checkpoint-dir", folder / "ckpt")
    for result in run_all(jobs, tmp).values():
        assert "resumed from dcp checkpoint" in check_ok(result)
    return SimpleNamespace(**{name: tmp / name / "ckpt" / "full.pt" for name in jobs})


def test_resume_without_the_adam_state_fails_the_resume_check(resumed):
    _, reference = reference_state(6)  # AdamW, 6 uninterrupted steps: the correct resume's reference
    for name in ("weights_only", "step_reset"):
        final = torch.load(getattr(resumed, name), weights_only=True)
        assert final["step"] == 6, name
        print(f"{name}: {max_diff(final['model'], reference):.2e}")
        with pytest.raises(AssertionError, match=f"^{name} differs from single-process AdamW by "):
            check_like_one_process(final["model"], reference, name, optimizer="AdamW", atol=RESUME_WIDE * FP32_ATOL)
