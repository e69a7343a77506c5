"""Negative control for chapter 03's equivalence tests: the comparison of DeepSpeed ZeRO with
single-process training must FAIL for the bugs it exists to catch, not only pass for correct code.

Why a separate comparison: test_ch03_deepspeed.py checks the README scripts, which train with AdamW.
AdamW divides each update by sqrt(v), so gradients N times too large (summed over the ranks instead
of averaged, or micro-batch losses not divided by the accumulation steps) move the weights almost
exactly as the right ones do, and that test passes for them. Here the same engines (the chapter's
config files read and sized by distkit.deepspeed, ``deepspeed.initialize``, ``engine.backward`` /
``engine.step``) train with plain SGD, lr 0.5, 3 steps, 2 ranks, tiny GPT: a gradient scaled by N
moves every weight N times as far. The reference trainer is written in the worker
(tests/workers/ch03_negative.py), not taken from the chapter.

Measured on 2-core CPU, gloo (max |distributed - single process| over all weights; training moves
them by up to 7.1e-2): ZeRO 0, 1, 2, 3 and ZeRO-2 with 2 accumulation steps 1.2e-7; each rank's loss
x 2 (= gradients summed over 2 ranks, not averaged) at ZeRO-2 and ZeRO-3 6.6e-2; 2 micro-batches
without the 1/2 (``scale_wrt_gas=False``) 6.6e-2. The tolerance (WEIGHT_TOL of tests/ch03_common.py,
used by test_ch03_deepspeed, 5e-5) is 400x the correct runs' difference and 1,300x below the bugs'
effect: a doubled update moves a weight by as much again as training itself moved it (up to 7e-2
here).
"""
import json

from ch03_common import WEIGHT_TOL
from launch import WORKERS, job_env, torchrun

WIDE = 100  # a bug must exceed the tolerance by at least this factor
CORRECT = ["zero0", "zero1", "zero2", "zero3", "accumulated"]
BROKEN = ["summed_zero2", "summed_zero3", "unscaled_accumulation"]


def test_summed_gradients_and_unscaled_accumulation_fail_the_tolerance(tmp_path):
    out = tmp_path / "diffs.json"
    env = job_env(tmp_path, TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    result = torchrun(WORKERS / "ch03_negative.py", "--variants", *CORRECT, *BROKEN, "--out", out,
                      nproc=2, tmp_path=tmp_path, env=env, timeout=400)
    print(result.stdout[-800:])  # the measured differences, shown with -s
    assert not list((tmp_path / "torch_extensions").glob("*")), "no DeepSpeed op may be JIT-compiled"
    diffs = json.loads(out.read_text())
    assert diffs["moved"] > WIDE * WEIGHT_TOL  # training moved the weights far beyond the tolerance
    for variant in CORRECT:
        assert diffs[variant] < WEIGHT_TOL, (variant, diffs)
    for variant in BROKEN:
        assert diffs[variant] > WIDE * WEIGHT_TOL, (variant, diffs)
