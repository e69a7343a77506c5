"""Chapter 04 on 2 ranks and with bad input: every collective checked against its definition on a
second world size, a deliberately wrong result reported as FAIL, and one-line errors for bad flags."""
from __future__ import annotations

import re

from launch import REPO, assert_one_line_error, python, torchrun

CHAPTER = REPO / "04-nccl-operations"


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
    assert_one_line_error(python(CHAPTER / "collective_ops.py", "--only", "allreduce", tmp_path=tmp_path,
                                 check=False), "unknown demo 'allreduce'")
    assert_one_line_error(python(CHAPTER / "bandwidth_test.py", "--max-bytes", "12Q", tmp_path=tmp_path,
                                 check=False), "--max-bytes '12Q'")
    # a world of one cannot do point-to-point: the process group starts, then a clear error ends it
    assert_one_line_error(python(CHAPTER / "point_to_point.py", tmp_path=tmp_path, check=False),
                          "point-to-point needs at least 2 ranks")
