"""Chapter 04: every command in 04-nccl-operations/README.md runs (with flags that keep it quick, once,
in the reader's play: tests/spine.py) and does what the chapter says: collectives match their
definitions on 4 ranks, the point-to-point ring all-reduce equals all_reduce, the bandwidth test
reports nccl-tests factors with no wrong elements, and each debug-lab scenario ends on its own with
the expected message and nothing left running."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from ch04_common import BANDWIDTH_RECORD, LOOKUPS, NCCL_TESTS_FACTOR, README, ROOT_CAUSE
from launch import assert_readme_covered, readme_command
from spine import play_chapter

# busbw/algbw is one multiplication, exact to ~1e-16; the closest wrong factor (1 instead of (n-1)/n,
# or (n-1)/n instead of 2(n-1)/n) is off by 1/(n-1) or more relative, 14% even at 8 ranks.
FACTOR_RTOL = 1e-9
# assert_busbw_is_the_counted_factor's two messages (its controls match them)
NOT_THE_FACTOR = "busbw/algbw is not the collective's bus factor"
NOT_S_OVER_TIME = "algbw is not S / time"


def check_collective_ops(out: str, folder: Path, clone: Path) -> None:
    passes = re.findall(r"^   PASS (\S+)", out, flags=re.M)
    assert len(passes) == 15 and "FAIL" not in out and "SKIP" not in out, out[-3000:]
    assert "15 passed, 0 failed, 0 skipped" in out
    assert "rank 3: [30, 31, 32, 33]  ->  [60, 64, 68, 72]" in out  # all_reduce(SUM), shown per rank
    # the harness's CommCounter saw nccl-tests wire bytes: 16 B all-reduced on 4 ranks -> 24 B
    assert "PASS all_reduce(SUM) (all_reduce 16 B payload / 24 B on the wire per rank)" in out


def result_lines(out: str, demo: str) -> list[list[int]]:
    """Each rank's printed result of one collective_ops.py demo, in rank order."""
    section = out.split(f"== {demo}:")[1].split("\n==")[0]
    found = re.findall(r"^   rank (\d): .*  ->  \[([^\]]*)\]$", section, flags=re.M)
    assert [int(r) for r, _ in found] == list(range(4)), section
    return [[int(x) for x in values.split(", ")] for _, values in found]


def check_collective_ops_subset(out: str, folder: Path, clone: Path) -> None:
    passes = re.findall(r"^   PASS (\S+)", out, flags=re.M)
    assert passes == ["reduce(SUM)", "reduce_scatter(list)", "reduce_scatter_single", "all_to_all(even)",
                      "all_to_all(uneven)"], out[-3000:]
    assert "5 passed, 0 failed, 0 skipped" in out
    # The definitions, computed here from the inputs the README states (rank r: [10r, 10r+1, ...]):
    # reduce_scatter_single gives rank c chunk c of the sum, and chunk c of rank r's input is
    # (c+1) x [10r, ..., 10r+3], so rank c ends with (c+1) x the element-wise sum over ranks
    column_sums = [sum(10 * r + i for r in range(4)) for i in range(4)]
    assert result_lines(out, "reduce_scatter_single") == [[(c + 1) * v for v in column_sums] for c in range(4)]
    # all_to_all(even): rank s sends block d (two copies of 10s+d) to rank d, in sender order
    assert result_lines(out, "all_to_all(even)") == [[10 * s + d for s in range(4) for _ in (0, 1)]
                                                    for d in range(4)]


def check_point_to_point(out: str, folder: Path, clone: Path) -> None:
    assert out.count(" PASS") == 3 * 4 - 2 + 4, out[-3000:]  # send/recv: 2 receivers; rings: 4+4; ring AR: 4
    assert "FAIL" not in out
    ring = re.findall(r"max \|ring - all_reduce\| = (\S+) \(tolerance (\S+)\) PASS \| sent (\d+) B = (\S+) x size",
                      out)
    assert len(ring) == 4, out[-3000:]
    for diff, tol, _, ratio in ring:
        assert float(diff) <= float(tol) == 4e-5
        assert ratio == "1.5000"  # 2(n-1)/n for n = 4
    assert out.count("recv gave up after") == 4, out[-3000:]  # every rank, ended by the timeout
    assert "Nobody sends because everybody is still waiting to receive" in out


def assert_busbw_is_the_counted_factor(records: list[dict]) -> None:
    """Every row of every collective record: busbw/algbw equals the bytes a rank sends in the
    simulated algorithm per byte of S, and algbw = S / time."""
    for record in records:
        factor = NCCL_TESTS_FACTOR[record["collective"]](record["world_size"])
        for row in record["rows"]:
            assert row["busbw_GBps"] / row["algbw_GBps"] == pytest.approx(factor, rel=FACTOR_RTOL), \
                f"{record['collective']}: {NOT_THE_FACTOR} {factor}: {row}"
            assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / row["time_us"] / 1e3, rel=1e-9), \
                f"{record['collective']}: {NOT_S_OVER_TIME}: {row}"


def check_bandwidth(out: str, folder: Path, clone: Path) -> None:
    # the README's own --results path, in the clone
    results = clone / "runs" / "bandwidth_cpu_gloo_4ranks.jsonl"
    records = [json.loads(line) for line in results.read_text().splitlines()]
    by_strategy = {r["strategy"]: r for r in records}
    assert set(by_strategy) == {f"bandwidth_{c}" for c in NCCL_TESTS_FACTOR} | {"bandwidth_p2p_matrix"}
    assert_busbw_is_the_counted_factor([r for r in records if "collective" in r])
    for collective in NCCL_TESTS_FACTOR:
        record = by_strategy[f"bandwidth_{collective}"]
        assert record["world_size"] == 4 and record["backend"] == "gloo"
        # provenance, as every record carries: what ran, one start time for the whole run
        assert record["schema"] == 2 and "04-nccl-operations/bandwidth_test.py" in record["command"]
        assert record["run_started"] == records[0]["run_started"]
        assert record["model"] is None and record["config"]["bus_factor"] == NCCL_TESTS_FACTOR[collective](4)
        assert record["metrics"]["wrong"] == 0
        assert [row["size_bytes"] for row in record["rows"]] == [1024, 4096, 16384]
        assert all(row["wrong"] == 0 for row in record["rows"])
    matrix = by_strategy["bandwidth_p2p_matrix"]["matrix_GBps"]
    assert all((value > 0) == (i != j) for i, row in enumerate(matrix) for j, value in enumerate(row))
    png = (folder / "bw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "#       size         count      type   redop    root       time    algbw    busbw  #wrong" in out
    assert "7 collectives, 0 wrong elements" in out


def test_committed_sweep_has_the_counted_factors_and_wrong_factors_fail():
    """The README's committed sweep passes the factor check; the same records with the bugs the check
    exists for (all_reduce counted as one pass of the ring, i.e. without its all-gather half; a gather
    counted as a full copy; all_gather counted like all_reduce) fail it, and so does an algbw taken
    from one rank's input instead of the whole buffer."""
    records = [r for r in map(json.loads, BANDWIDTH_RECORD.read_text().splitlines()) if "collective" in r]
    assert {r["collective"] for r in records} == set(NCCL_TESTS_FACTOR)
    assert_busbw_is_the_counted_factor(records)
    n = records[0]["world_size"]
    for collective, wrong_factor in (("all_reduce", (n - 1) / n), ("broadcast", (n - 1) / n),
                                     ("all_gather", 2 * (n - 1) / n), ("all_to_all", 1.0)):
        broken = copy.deepcopy(records)
        for record in broken:
            if record["collective"] == collective:
                for row in record["rows"]:
                    row["busbw_GBps"] = row["algbw_GBps"] * wrong_factor
        with pytest.raises(AssertionError, match=f"^{collective}: {re.escape(NOT_THE_FACTOR)}"):
            assert_busbw_is_the_counted_factor(broken)
    # algbw from one rank's input instead of nccl-tests' size S (the gathered output): the factor
    # still matches, the rate does not
    broken = copy.deepcopy(records)
    for record in broken:
        if record["collective"] == "all_gather":
            for row in record["rows"]:
                row["algbw_GBps"] /= n
                row["busbw_GBps"] /= n
    with pytest.raises(AssertionError, match=f"^all_gather: {re.escape(NOT_S_OVER_TIME)}"):
        assert_busbw_is_the_counted_factor(broken)


def check_mismatch(out: str, folder: Path, clone: Path) -> None:
    assert "error: collective mismatch: rank 0 runs ALLREDUCE [4]; rank 3 runs ALLREDUCE [3]" in out, out[-3000:]
    assert "Without it (debug level OFF)" in out


def check_missing_rank(out: str, folder: Path, clone: Path) -> None:
    assert "rank 0: all_reduce timed out after" in out, out[-3000:]
    assert "Ranks 3 failed to pass monitoredBarrier" in out


def check_crash(out: str, folder: Path, clone: Path) -> None:
    assert "[rank 3] step 3: simulated crash" in out, out[-3000:]
    # rank 3 reached step 3 only after rank 0 finished step 2, so rank 0 had logged step 1 by then
    assert "[rank 0] step 1: all_reduce ok" in out
    # Rank 0 reports the lost peer when it notices before torchrun (polling every 0.1 s) stops it:
    # usually, not always on a loaded machine. When it does, it is about step 3.
    lost = re.findall(r"^error: \[rank 0\] lost a peer at step (\d+)", out, flags=re.M)
    assert lost in ([], ["3"]), lost
    # torchrun names the rank that crashed, with its exit code, as the first failure (not a survivor)
    assert ROOT_CAUSE.search(out) and ROOT_CAUSE.search(out).groups() == ("3", "3"), out[-2500:]


# README command -> (expected exit, checker); the flags the play appends: ch04_common.PLAY
CASES = {
    "collective_ops": (0, check_collective_ops),
    "collective_ops:only": (0, check_collective_ops_subset),
    "point_to_point": (0, check_point_to_point),
    "bandwidth_test": (0, check_bandwidth),
    "debug_lab:mismatch": (1, check_mismatch),
    "debug_lab:missing-rank": (1, check_missing_rank),
    "debug_lab:crash": (1, check_crash),
}


def test_readme_commands_are_all_covered():
    """Every README command is found by exactly one lookup, and each lookup is a case checked below."""
    assert_readme_covered(README, list(LOOKUPS.values()))
    assert sorted(LOOKUPS) == sorted(CASES)
    for needles, without in LOOKUPS.values():  # as the README writes them: 4 ranks, a private rendezvous
        command = readme_command(README, *needles, without=without)
        assert command.startswith("torchrun --standalone --nproc_per_node=4 "), command


@pytest.fixture(scope="module")
def played(reader):
    return play_chapter("04-nccl-operations", reader)


@pytest.mark.parametrize("name", list(CASES))
def test_readme_command(name: str, played):
    """The command as the reader's play ran it (tests/spine.py). The lab's scenarios end by themselves
    (timeouts of 2-3 s) and leave no rank behind."""
    expected_rc, check = CASES[name]
    run = played.of(LOOKUPS[name])
    assert run["returncode"] == expected_rc, f"exit {run['returncode']}\n{run['stdout'][-4000:]}"
    check(run["stdout"], run["out"], played.clone)
    if expected_rc:  # a failing job must not leave a rank behind (the lab's stuck rank included)
        assert run["left_running"] == [], run["left_running"]
        assert sorted(p.name for p in (run["out"] / "lab").glob("rank*.log")) == [f"rank{i}.log" for i in range(4)]
