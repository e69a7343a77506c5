"""Chapter 04 on 2 ranks and with bad input: every collective checked against its definition on a
second world size, a deliberately wrong result reported as FAIL, low-precision sums judged by their
rounding (not failed for a last-bit difference, still failed for a real error), the bandwidth test's
#wrong check, and one-line errors for bad flags."""
from __future__ import annotations

import functools
import re

import pytest
import torch

from ch04_common import CHAPTER
from launch import assert_one_line_error, load_script, parse_args_result, python, torchrun
from workers import ch04_ring_model as ring_model


@functools.cache
def chapter_module(name: str):
    """A chapter script imported as a module, once per test session."""
    return load_script(CHAPTER / f"{name}.py")


def test_every_collective_on_two_ranks_and_a_wrong_result_fails(tmp_path):
    # The last rank corrupts one element of its broadcast result: that demo, and only it, must FAIL.
    result = torchrun(CHAPTER / "collective_ops.py", "--corrupt", "broadcast", nproc=2, tmp_path=tmp_path,
                      timeout=180, check=False)
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    passes = re.findall(r"^   PASS (\S+)", out, flags=re.M)
    assert len(passes) == 14 and "broadcast" not in passes, out[-3000:]
    assert "   FAIL broadcast: rank 1 holds [1, 1, 2, 3], expected [0, 1, 2, 3]" in out
    assert "14 passed, 1 failed, 0 skipped" in out
    assert "error: 1 collective(s) gave a wrong result: broadcast" in out
    # 2-rank results are the definitions for n = 2 (rank 1 starts with [10, 11, 12, 13])
    assert "rank 1: [10, 11, 12, 13]  ->  [10, 12, 14, 16]" in out  # all_reduce(SUM)
    assert "PASS all_reduce(SUM) (all_reduce 16 B payload / 16 B on the wire per rank)" in out  # 2(n-1)/n = 1


def test_bad_input_gives_one_error_line(tmp_path):
    # a world of one cannot do point-to-point: the process group starts, then a clear error ends it
    assert_one_line_error(python(CHAPTER / "point_to_point.py", tmp_path=tmp_path, check=False),
                          "point-to-point needs at least 2 ranks")


def test_bad_flags_are_one_argparse_line_where_defined():
    # argparse rejects these before any process group exists: one line each, exit code 2. The
    # parsers run in this process (launch.parse_args_result): the same code and output as a launch.
    cases = [
        ("collective_ops.py", ["--only", "allreduce"], "unknown demo 'allreduce'"),
        ("bandwidth_test.py", ["--max-bytes", "12Q"], "argument --max-bytes: '12Q': write bytes like"),
        ("collective_ops.py", ["--numel", "0"], "argument --numel: must be a positive integer, got 0"),
        ("point_to_point.py", ["--deadlock-timeout-s", "0"],
         "argument --deadlock-timeout-s: must be a positive number, got 0"),
        ("bandwidth_test.py", ["--iters", "0"], "argument --iters: must be a positive integer, got 0"),
        ("bandwidth_test.py", ["--step-factor", "1"], "argument --step-factor: must be an integer >= 2, got 1"),
        ("bandwidth_test.py", ["--min-bytes", "0"], "argument --min-bytes: must be at least 1 byte, got '0'"),
        ("debug_lab.py", ["--scenario", "crash", "--timeout-s", "-1"],
         "argument --timeout-s: must be a positive number, got -1"),
    ]
    for script, args, expected in cases:
        result = parse_args_result(chapter_module(script.removesuffix(".py")), *args)
        assert result.returncode == 2, (script, args, result.stdout[-2000:])
        assert_one_line_error(result, expected)
    # the lab's --help tells the default it really uses (10 s), not the shared 300 s
    result = parse_args_result(chapter_module("debug_lab"), "--help")
    help_text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "(default: 10)" in help_text and "(default: 300)" not in help_text


def test_bfloat16_sums_judged_by_their_rounding_and_a_real_error_still_fails(tmp_path):
    # bfloat16 holds integers exactly only up to 256. With --numel 64 the reduce-scatter sums on 4 ranks
    # pass 256, gloo's sequential additions round differently from the exact sum: that used to be a FAIL.
    # Element 0 of all_reduce(SUM) is 60, exact in bfloat16: the last rank's +1 there must still FAIL.
    result = torchrun(CHAPTER / "collective_ops.py", "--dtype", "bfloat16", "--numel", "64",
                      "--corrupt", "all_reduce(SUM)", nproc=4, tmp_path=tmp_path, timeout=240, check=False)
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert "14 passed, 1 failed, 0 skipped" in out, out[-3000:]
    assert re.search(r"^   FAIL all_reduce\(SUM\): rank 3 holds \[61, 64, ", out, flags=re.M), out[-3000:]
    passes = re.findall(r"^   PASS (\S+)", out, flags=re.M)
    assert {"reduce_scatter(list)", "reduce_scatter_single", "all_reduce(AVG)", "reduce(SUM)"} <= set(passes)


def simulated_sums(values: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The sum of ``values`` as a library may compute it in ``dtype``: rounding after every addition,
    in three orders (forward as a ring, backward, pairwise as a tree)."""
    forward = values[0].to(dtype)
    for v in values[1:]:
        forward = forward + v.to(dtype)
    backward = values[-1].to(dtype)
    for v in reversed(values[:-1]):
        backward = backward + v.to(dtype)
    level = [v.to(dtype) for v in values]
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return [forward, backward, level[0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_bandwidth_wrong_check_allows_rounding_only_where_sums_are_inexact(dtype):
    bw = chapter_module("bandwidth_test")
    pattern = (torch.arange(7 * 64) % 7 + 1).double()  # the test's pattern 1..7
    for n in range(2, 33):
        inputs = [pattern * (q + 1) for q in range(n)]  # rank q's input
        expected = (pattern * (n * (n + 1) // 2)).to(dtype)
        rtol = bw.summation_rtol(dtype, n)
        exact = 7 * n * (n + 1) // 2 <= 2 / torch.finfo(dtype).eps
        assert (rtol == 0) == exact
        for got in simulated_sums(inputs, dtype):
            assert bw.count_wrong(got, expected, rtol) == 0, (dtype, n)
            if exact:  # then even the smallest error counts: one element off by one
                bad = got.clone()
                bad[3] += 1
                assert bw.count_wrong(bad, expected, rtol) == 1
            else:  # a gross error still counts
                bad = got.clone()
                bad[3] *= 1.5
                assert bw.count_wrong(bad, expected, rtol) == 1
    # bfloat16 stops being exact after 8 ranks, float16 after 23: the documented limits
    if dtype == torch.bfloat16:
        assert bw.summation_rtol(dtype, 8) == 0 < bw.summation_rtol(dtype, 9)
    if dtype == torch.float16:
        assert bw.summation_rtol(dtype, 23) == 0 < bw.summation_rtol(dtype, 24)


def test_collective_ops_rounding_slack_covers_averages_on_odd_rank_counts():
    ops = chapter_module("collective_ops")
    for dtype in (torch.float16, torch.bfloat16):
        for n in range(2, 9):
            inputs = [ops.rank_input(q, 64, torch.float64, torch.device("cpu")) for q in range(n)]
            exact_sum = sum(inputs)
            for op, expected in (("sum", exact_sum.to(dtype)), ("avg", (exact_sum / n).to(dtype))):
                slack = ops.rounding_slack(dtype, n, expected, op)
                for got in simulated_sums(inputs if op == "sum" else
                                          # NCCL's AVG: every input scaled by 1/n (rounded), then summed
                                          [(v.to(dtype) * torch.tensor(1 / n, dtype=dtype)).double()
                                           for v in inputs], dtype):
                    assert ops.same(got, expected, slack), (dtype, n, op)
            # where a sum is exact in the dtype there is no slack: an element off by one fails
            sum_slack = ops.rounding_slack(dtype, n, exact_sum.to(dtype), "sum")
            exact = exact_sum <= 2 / torch.finfo(dtype).eps
            assert bool((sum_slack[exact] == 0).all()) and bool((sum_slack[~exact] > 0).all())
            if exact[0]:
                bad = exact_sum.to(dtype).clone()
                bad[0] += 1
                assert not ops.same(bad, exact_sum.to(dtype), sum_slack)


def test_bandwidth_bus_factors_equal_the_bytes_a_ring_sends_for_every_rank_count():
    # The factors bandwidth_test.py multiplies algbw by, against bytes counted in simulated runs of
    # each collective's algorithm (tests/workers/ch04_ring_model.py), for 2 to 8 ranks: a factor
    # right at 4 ranks only (e.g. a hard-coded 1.5) fails here.
    bw = chapter_module("bandwidth_test")
    assert sorted(bw.COLLECTIVES) == sorted(ring_model.COLLECTIVES)
    for n in range(2, 9):
        for collective in bw.COLLECTIVES:
            reported = bw.factor(collective, n)
            assert reported == pytest.approx(float(ring_model.bus_factor(collective, n)), rel=1e-12), (collective, n)


def test_ring_model_checks_its_results_and_counts_what_each_rank_sends():
    # The model is only a derivation if its algorithms are right: every rank's result equals the
    # definition (run() asserts it) and the counts are the per-step chunk sizes added up.
    for n in (2, 3, 5):
        _, sent, size = ring_model.run("all_reduce", n, count=n * 4)
        assert sent == [2 * (n - 1) * 4] * n and size == n * 4  # 2(n-1) steps of one 4-element chunk
    # negative control: a reduce-scatter ring stopped one step early leaves partial sums, which the
    # definition check must reject (else the counted bytes could come from a wrong algorithm)
    n, wire = 4, ring_model.Wire(4)
    inputs = [[1000 * r + i for i in range(8)] for r in range(n)]
    short = ring_model.ring_reduce_scatter(wire, inputs, steps=n - 2)
    total = [sum(col) for col in zip(*inputs)]
    assert short != [total[c * 2:(c + 1) * 2] for c in range(n)]
    assert ring_model.ring_reduce_scatter(ring_model.Wire(4), inputs) == [total[c * 2:(c + 1) * 2] for c in range(n)]
