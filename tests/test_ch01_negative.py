"""Negative controls of chapter 01's equivalence check (test_ch01_ddp.py): broken copies of the
chapter's own scripts, run with the flags the reader's play gives the correct commands
(ch01_common.PLAY: 3 steps, global batch 16, plain SGD at lr 0.5 under the scripts' warm-up/cosine
schedule, no clipping), must fail the very check the correct runs pass
(ch01_common.check_like_one_process, its own message), and by far: each fails it with the tolerance
widened WIDE = 100 times. Each mutant is the script with one exact piece of its source replaced
(tests/workers/ch05_mutant.py; the piece must occur exactly once), run on the README's 4 ranks and on
2 (a factor of 2, the smallest):

* ``scratch_summed``: ddp_from_scratch.py's ``average_gradients`` with its division by the world
  size deleted (the played run sends one all-reduce per tensor), so every rank steps with the sum of
  the ranks' gradients, N times the global batch's mean;
* ``training_unscaled``: ddp_training.py's ``accumulate_gradients`` without the ``/ len(chunks)``
  (the played run accumulates k = 2 micro-batches per step), so the gradient is k times too large;
* ``bucketed_summed``: ddp_from_scratch.py's bucketed path (``--bucket-cap-mb 0.01``: 10 KiB buckets,
  several per step) with its ``flat.div_(world_size)`` deleted. No README command runs that path at
  the tiny size, so its correct run is here too, with the same flags: it must pass the check.

Measured on 2-core CPU, gloo (max |run - single-process SGD|; 3 steps move a weight by up to
2.0e-2, the correct played runs land 7.5e-9 away): scratch_summed 6.9e-2 on 4 ranks and 4.6e-2 on
2; training_unscaled 4.6e-2 on 4 and on 2 (a factor k = 2 either way); bucketed_summed as
scratch_summed, while the unmutated bucketed run passes. The smallest is 920x
TOLERANCE (5e-5), so the check fails even at WIDE x TOLERANCE.

The six mutant runs and the correct bucketed run go two at a time in a module fixture; none needs
the play.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ch01_common import (
    CHAPTER,
    PLAY,
    SGD_STEPS,
    TOLERANCE,
    WIDE,
    check_like_one_process,
    final_params,
    max_diff,
    readme_argv,
    single_process_params,
)
from distkit.checkpoint import safe_load
from launch import WORKERS, job, job_env, run, run_jobs

SCRATCH, TRAINING = CHAPTER / "ddp_from_scratch.py", CHAPTER / "ddp_training.py"
BUCKETS = ("--bucket-cap-mb", "0.01")  # about 10 KiB: the tiny GPT's gradients in several buckets
# name: (the README command's lookup, its script, the one replacement, flags after the play's)
MUTATIONS: dict = {
    "scratch_summed": ("ddp_from_scratch.py", SCRATCH, ("grad.div_(world_size)", "pass  # summed, never divided"),
                       ()),
    "training_unscaled": ("--config", TRAINING, ("loss = lm_loss(model(x), y) / len(chunks)",
                                                 "loss = lm_loss(model(x), y)"), ()),
    "bucketed_summed": ("ddp_from_scratch.py", SCRATCH, ("flat.div_(world_size)", "pass  # summed, never divided"),
                        BUCKETS),
}
CORRECT_BUCKETED = ("ddp_from_scratch.py", SCRATCH, None, BUCKETS)  # the script as it is, bucketed
RANKS = (4, 2)  # the README's, as played, and the smallest factor


def launch_mutant(folder: Path, name: str, nproc: int):
    """The README command of mutant ``name`` on ``nproc`` ranks with the play's flags (its outputs in
    ``folder``), its script replaced by the mutant (tests/workers/ch05_mutant.py SCRIPT OLD NEW --)."""
    lookup, script, mutation, extra = CORRECT_BUCKETED if name == "bucketed" else MUTATIONS[name]
    argv = readme_argv(lookup, nproc=nproc)
    at = next(i for i, word in enumerate(argv) if word.endswith(f"{CHAPTER.name}/{script.name}"))
    flags = [flag.replace("{out}", str(folder)) for flag in PLAY[lookup].flags]
    if mutation is None:  # the script as it is
        return run([*argv, *flags, *extra], env=job_env(folder), timeout=600)
    return run([*argv[:at], str(WORKERS / "ch05_mutant.py"), str(script), *mutation, "--", *argv[at + 1:], *flags,
                *extra], env=job_env(folder), timeout=600)


@pytest.fixture(scope="module")
def mutants(tmp_path_factory):
    """Every mutant at both world sizes, two launches at a time: {f"{name}_{n}": (folder, result)}."""
    jobs = {f"{name}_{n}": (lambda folder, name=name, n=n: launch_mutant(folder, name, n))
            for name in MUTATIONS for n in RANKS}
    jobs["bucketed_4"] = lambda folder: launch_mutant(folder, "bucketed", 4)
    return run_jobs(jobs, tmp_path_factory)


def trained(mutants, key: str) -> dict:
    """The weights a mutant's run ended with (as test_ch01_ddp.py reads the correct runs')."""
    folder, _ = job(mutants, key)
    return final_params(folder, SGD_STEPS) if key.startswith("training") else safe_load(folder / "scratch.pt")["model"]


def test_bucketed_averaging_trains_like_one_process(mutants):
    """The bucketed path, unmutated, with the bucketed mutant's flags: within TOLERANCE."""
    reference = single_process_params(optimizer="sgd")
    check_like_one_process(trained(mutants, "bucketed_4"), reference, "bucketed on 4 ranks")


@pytest.mark.parametrize("name", MUTATIONS)
def test_gradient_scale_bugs_fail_the_equivalence_check(mutants, name):
    reference = single_process_params(optimizer="sgd")
    for n in RANKS:
        state = trained(mutants, f"{name}_{n}")
        print(f"{name} on {n} ranks: {max_diff(state, reference):.2e}")  # shown with -s
        with pytest.raises(AssertionError, match=f"^{name} on {n} ranks differs from single-process SGD by "):
            check_like_one_process(state, reference, f"{name} on {n} ranks", tolerance=WIDE * TOLERANCE)
