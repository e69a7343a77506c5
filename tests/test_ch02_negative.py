"""Negative controls for chapter 02's equivalence tests (test_ch02_fsdp.py): the same comparison with
single-process training, run on deliberately broken FSDP training, must fail the tolerance.

Every equivalence test of test_ch02_fsdp.py and the control that proves it can fail, all in one
4-rank launch of tests/workers/ch02_negative.py (the world size the equivalence tests train at):

* every strategy = single process, FP32_ATOL (full_shard, shard_grad_op, no_shard: negative_controls.py's
  cases; hybrid_shard on a 2x2 mesh: ch02_negative.py; ddp: test_ch01_negative.py, the same torch DDP);
* root wrapping + activation checkpointing + CPU offload = single process, FP32_ATOL;
* bf16 within BF16_RELATIVE;
* DCP resume: continued training = uninterrupted training, FP32_ATOL. The other resume check
  (loaded == saved) and the byte checks are exact equalities: a single changed bit or byte fails
  them, there is no tolerance to justify; test_measured_bytes_match_the_formulas shows that formulas
  without the padding or with one all-gather too few are caught.

SGD (lr 0.5, 3 steps; under AdamW a gradient twice too large would move the weights the same),
4 ranks, tiny GPT, vocab 65 so dim 0 is padded. Bugs: gradients summed over the ranks instead of
averaged (what a reduce-scatter that never divides leaves), rank 1's gradient shard dropped (its rows
never updated), HSDP's all-reduce across replicas switched off.

Measured on 2-core CPU, gloo, 4 ranks (max |FSDP - single process|; training moves weights by up to
7.1e-2): correct runs 1.2e-7 in every strategy, HSDP and offload included; summed 3.0e-1 (6.6e-2
on 2 ranks); dropped shard 4.7e-2 to 5.4e-2; HSDP without the replica all-reduce 7.1e-2. FP32_ATOL
(2e-4) sits 1,700x above the correct runs and over 200x below the smallest bug.

Resume (AdamW lr 3e-3, 3 steps saved, 3 more after the load; training moves weights by 1.8e-2):
correct 1.9e-5 (summation order through Adam), weights restored without the optimizer 1.5e-2, Adam
step count reset 9.1e-3. FP32_ATOL is 10x above the correct resume and 45x below the smaller bug.

bf16 (MixedPrecisionPolicy, the chapter's AdamW lr 3e-3, 4 steps): its max-abs difference from the
fp32 reference (1.0e-2) is as large as what training moves the weights (1.2e-2), so no max-abs bound
can tell bf16 training from no training. The test therefore compares the L2 error as a fraction of
the L2 movement (untrained weights score exactly 1): correct bf16 5.4e-2, bf16 with rank 1's shard
dropped 0.54 on 4 ranks (0.75 on 2, where a dropped shard is half the rows). BF16_RELATIVE (0.15) is
2.8x the correct run's and 3.6x below that bug.
"""
import json

import pytest

from ch02_common import BF16_RELATIVE, FP32_ATOL
from launch import WORKERS, torchrun

WIDE = 100  # an SGD fp32 bug must exceed the tolerance by at least this factor
RESUME_WIDE = 20  # an Adam resume bug (Adam normalises the update: smaller effect) by this factor


@pytest.fixture(scope="module")
def diffs(tmp_path_factory):
    """One 4-rank launch of every chapter-02 negative control; {case: {variant: difference}}."""
    tmp = tmp_path_factory.mktemp("ch02_negative")
    out = tmp / "diffs.json"
    result = torchrun(WORKERS / "ch02_negative.py", "--out", out, nproc=4, tmp_path=tmp, timeout=600)
    print(result.stdout[-3000:])  # the measured differences, shown with -s
    return json.loads(out.read_text())


def test_summed_gradients_and_dropped_shards_fail_the_tolerance(diffs):
    for case in ("ch02_full_shard", "ch02_shard_grad_op", "ch02_no_shard"):
        assert diffs[case]["moved"] > WIDE * FP32_ATOL, case
        assert diffs[case]["correct"] <= FP32_ATOL, (case, diffs[case])
        assert diffs[case]["summed"] > WIDE * FP32_ATOL, (case, diffs[case])
    assert diffs["ch02_full_shard"]["dropped_shard"] > WIDE * FP32_ATOL, diffs["ch02_full_shard"]

    bf16 = diffs["ch02_bf16"]
    assert bf16["correct_relative"] <= BF16_RELATIVE, bf16
    assert bf16["dropped_shard_relative"] > 3 * BF16_RELATIVE, bf16


def test_hsdp_offload_and_resume_bugs_fail_the_tolerance(diffs):
    """HSDP on a 2x2 mesh, root wrap + activation checkpointing + CPU offload, DCP resume."""
    for case, bugs in (("ch02_hsdp", ("summed", "dropped_shard", "replicas_not_reduced")),
                       ("ch02_offload", ("summed", "dropped_shard"))):
        assert diffs[case]["moved"] > WIDE * FP32_ATOL, case
        assert diffs[case]["correct"] <= FP32_ATOL, (case, diffs[case])
        for bug in bugs:
            assert diffs[case][bug] > WIDE * FP32_ATOL, (case, bug, diffs[case])
    resume = diffs["ch02_resume"]
    assert resume["correct"] <= FP32_ATOL, resume
    assert resume["weights_only"] > RESUME_WIDE * FP32_ATOL, resume
    assert resume["step_reset"] > RESUME_WIDE * FP32_ATOL, resume
