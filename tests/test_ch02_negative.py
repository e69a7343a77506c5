"""Negative controls for chapter 02's equivalence tests (test_ch02_fsdp.py): the same comparison with
single-process training, run on deliberately broken FSDP training, must fail the tolerance.

The worker (2 ranks, tiny GPT, vocab 65 so dim 0 is padded) shards the model with
fsdp_transformer.py's own ``mesh_shape``/``build_mesh``/``shard_model`` and trains with plain SGD
(lr 0.5, 3 steps): under AdamW a gradient twice too large would move the weights the same. Bugs:
gradients summed over the ranks instead of averaged (what a reduce-scatter that never divides
leaves), and rank 1's gradient shard dropped (its rows never updated).

Measured on 2-core CPU, gloo (max |FSDP - single process|; training moves weights by up to 7.1e-2):
correct full_shard / shard_grad_op / no_shard 1.2e-7; summed 6.6e-2; dropped shard 5.4e-2. FP32_ATOL
(2e-4) sits 1,700x above the correct runs and 270x below the smallest bug.

bf16 (MixedPrecisionPolicy, the chapter's AdamW lr 3e-3, 4 steps): its max-abs difference from the
fp32 reference (1.1e-2) is as large as what training moves the weights (1.2e-2), so no max-abs bound
can tell bf16 training from no training. The test therefore compares the L2 error as a fraction of
the L2 movement (untrained weights score exactly 1): correct bf16 5.2e-2, bf16 with rank 1's shard
dropped 0.75. BF16_RELATIVE (0.15) is 3x the correct run's and 5x below that bug.
"""
import json

from launch import WORKERS, torchrun
from test_ch02_fsdp import BF16_RELATIVE, FP32_ATOL

WIDE = 100  # an fp32 bug must exceed the tolerance by at least this factor


def test_summed_gradients_and_dropped_shards_fail_the_tolerance(tmp_path):
    out = tmp_path / "diffs.json"
    result = torchrun(WORKERS / "negative_controls.py", "--cases", "ch02_full_shard", "ch02_shard_grad_op",
                      "ch02_no_shard", "ch02_bf16", "--out", out, nproc=2, tmp_path=tmp_path)
    print(result.stdout[-1500:])  # the measured differences, shown with -s
    diffs = json.loads(out.read_text())
    for case in ("ch02_full_shard", "ch02_shard_grad_op", "ch02_no_shard"):
        assert diffs[case]["moved"] > WIDE * FP32_ATOL, case
        assert diffs[case]["correct"] <= FP32_ATOL, (case, diffs[case])
        assert diffs[case]["summed"] > WIDE * FP32_ATOL, (case, diffs[case])
    assert diffs["ch02_full_shard"]["dropped_shard"] > WIDE * FP32_ATOL, diffs["ch02_full_shard"]

    bf16 = diffs["ch02_bf16"]
    assert bf16["correct_relative"] <= BF16_RELATIVE, bf16
    assert bf16["dropped_shard_relative"] > 3 * BF16_RELATIVE, bf16
