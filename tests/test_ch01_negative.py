"""Negative controls for chapter 01's equivalence tests: the comparison with single-process training
must FAIL for the bugs it exists to catch, not only pass for the correct code.

Why a separate comparison: test_ch01_ddp.py checks the README runs with AdamW and gradient clipping
at 1.0. AdamW divides each update by sqrt(v) and clipping rescales every gradient above norm 1, so a
gradient twice too large (summed over 2 ranks instead of averaged, or an accumulated loss not divided
by k) moves the weights exactly as the right one does: deleting the division in
ddp_from_scratch.average_gradients passed that test. Here the worker trains with plain SGD (lr 0.5,
3 steps, 2 ranks, tiny GPT), where a doubled gradient doubles every update, and uses the script's
own ``average_gradients`` (per tensor and bucketed), so deleting its division now fails the
"correct" variant. The reference trainer is tests/workers/reference.py's, not taken from the scripts.

Measured on 2-core CPU, gloo (max |distributed - single process| over all weights; training moves
them by up to 7.1e-2): correct variants 1.2e-7; summed instead of averaged 6.6e-2; loss not divided
by k=2 under no_sync 6.6e-2; one of two micro-batches skipped 8.3e-2. The tolerance (the same 5e-5
as test_ch01_ddp.py) is 400x the correct runs' difference and 1,300x below the smallest bug.

The two workers (2 ranks each) run once, side by side, in a module fixture.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from ch01_common import TOLERANCE, WIDE
from launch import WORKERS, torchrun

JOBS = {"negative_controls": ["--cases", "ch01_scratch", "ch01_ddp", "accumulation"],
        "ch01_accumulation": []}


@pytest.fixture(scope="module")
def diffs(tmp_path_factory) -> dict[str, dict]:
    """``{worker: the differences it measured}``; each worker's output is printed (shown with -s)."""
    def launch(worker):
        folder = tmp_path_factory.mktemp(worker)
        result = torchrun(WORKERS / f"{worker}.py", *JOBS[worker], "--out", folder / "diffs.json",
                          nproc=2, tmp_path=folder)
        print(result.stdout[-1500:])
        return json.loads((folder / "diffs.json").read_text())

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(JOBS, pool.map(launch, JOBS)))


def test_wrong_gradient_averaging_and_accumulation_fail_the_tolerance(diffs):
    diffs = diffs["negative_controls"]
    correct = {"ch01_scratch": ["correct", "bucketed"], "ch01_ddp": ["correct"], "accumulation": ["accumulated"]}
    broken = {"ch01_scratch": ["summed"],  # division by the world size deleted
              "ch01_ddp": ["summed"],  # a DDP comm hook that all-reduces without dividing
              "accumulation": ["unscaled_loss", "skipped_micro_batch"]}  # no 1/k; a micro-batch lost
    for case, variants in correct.items():
        assert diffs[case]["moved"] > WIDE * TOLERANCE, case  # training moved the weights
        for variant in variants:
            assert diffs[case][variant] < TOLERANCE, (case, variant, diffs[case])
    for case, variants in broken.items():
        for variant in variants:
            assert diffs[case][variant] > WIDE * TOLERANCE, (case, variant, diffs[case])


def test_accumulation_in_ddp_training_matches_one_big_batch(diffs):
    """ddp_training.py's own ``accumulate_gradients`` (k micro-batches, all but the last under
    no_sync, each loss / k) on 2 ranks, plain SGD, no clipping: equal to one process taking the whole
    global batch per step. The bug this tolerance exists for: the ``/ k`` deleted from the script
    (the accumulated gradient k times too large). The worker deletes exactly that from the script's
    source and the result must fail. Measured on 2-core CPU, gloo (training moves the weights by
    1.1e-1): k=2 2.2e-8, k=4 6.0e-8; without the division 7.8e-2, 1,500x the tolerance."""
    diffs = diffs["ch01_accumulation"]
    assert diffs["moved"] > WIDE * TOLERANCE  # training moved the weights: the comparison is not empty
    assert diffs["k2"] < TOLERANCE and diffs["k4"] < TOLERANCE, diffs
    assert diffs["no_division_k2"] > WIDE * TOLERANCE, diffs
