"""Chapter 04 on GPUs (``pytest -m gpu``): every README command at small size on NCCL, world size 1
where one GPU can serve it, several ranks where the machine has the GPUs (one GPU cannot host several
NCCL ranks).

Every job sees the machine's GPUs (``job_env(gpu=True)``) and is forced onto NCCL (``--backend
nccl``), so a silent fall-back to gloo/CPU fails instead of passing. The assertions are outcomes:
collectives equal their definitions (float16/bfloat16 included, on the rank counts where their sums
round), the bandwidth records say nccl/cuda with CUDA-event timing and no wrong element, the
hand-written ring all-reduce matches NCCL's, and each debug-lab scenario ends by itself with its
message, the missing rank's wait really lasting the timeout and torchrun naming the crashed rank.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ch04_common import NCCL_TESTS_FACTOR, ROOT_CAUSE, readme_argv
from distkit.harness import read_records
from launch import assert_one_line_error, job_env, own_processes, require_gpus, run

pytestmark = pytest.mark.gpu
NCCL = ["--backend", "nccl"]


def run_on_gpus(name: str, nproc: int, *flags: str, folder: Path, expected_rc: int = 0, timeout: float = 600):
    result = run([*readme_argv(name, nproc), *NCCL, *flags], env=job_env(folder, gpu=True), timeout=timeout,
                 check=False)
    assert result.returncode == expected_rc, f"exit {result.returncode}\n{result.stdout[-5000:]}"
    return result.stdout


# ---------------------------------------------------------------- collective_ops.py

def test_collective_ops_on_one_gpu(tmp_path):
    require_gpus(1, "NCCL needs a GPU per rank")
    out = run_on_gpus("collective_ops", 1, folder=tmp_path)
    assert "world size 1 | backend nccl | device cuda | dtype float32" in out, out[-3000:]
    assert "15 passed, 0 failed, 0 skipped" in out, out[-3000:]
    assert "rank 0: [0, 1, 2, 3]  ->  [0, 1, 2, 3]" in out  # a sum over one rank is its input
    # a wrong result on a CUDA tensor is still seen (the check copies results off the GPU)
    out = run_on_gpus("collective_ops", 1, "--dtype", "bfloat16", "--corrupt", "broadcast", folder=tmp_path,
                      expected_rc=1)
    assert "   FAIL broadcast: rank 0 holds [1, 1, 2, 3], expected [0, 1, 2, 3]" in out, out[-3000:]
    assert "14 passed, 1 failed, 0 skipped" in out


@pytest.mark.parametrize("nproc,dtype,numel", [(3, "float16", "4"), (4, "bfloat16", "64"), (4, "float32", "4")])
def test_collective_ops_on_several_gpus(tmp_path, nproc, dtype, numel):
    # 3 ranks, float16: NCCL's AVG scales by 1/3 and rounds, last-bit different from the exact mean;
    # bfloat16 with 64 elements: sums beyond 256 round in NCCL's order. Both must PASS, not FAIL.
    require_gpus(nproc, "one GPU per NCCL rank")
    out = run_on_gpus("collective_ops", nproc, "--dtype", dtype, "--numel", numel, folder=tmp_path)
    assert f"world size {nproc} | backend nccl | device cuda | dtype {dtype}" in out, out[-3000:]
    assert "15 passed, 0 failed, 0 skipped" in out, out[-3000:]
    if (nproc, dtype) == (4, "float32"):
        assert "rank 3: [30, 31, 32, 33]  ->  [60, 64, 68, 72]" in out
        assert "PASS all_reduce(SUM) (all_reduce 16 B payload / 24 B on the wire per rank)" in out


# ---------------------------------------------------------------- point_to_point.py

@pytest.mark.parametrize("nproc", [2, 4])
def test_point_to_point_on_gpus(tmp_path, nproc):
    require_gpus(nproc, "point-to-point needs 2 ranks, one GPU each")
    out = run_on_gpus("point_to_point", nproc, "--numel", "100003", "--iters", "2", "--deadlock-timeout-s", "2",
                      folder=tmp_path)
    assert f"world size {nproc} | backend nccl | device cuda" in out, out[-3000:]
    assert "FAIL" not in out
    assert out.count(" PASS") == nproc // 2 + 3 * nproc, out[-3000:]  # receivers; ring; batch; ring all-reduce
    ring = re.findall(r"max \|ring - all_reduce\| = (\S+) \(tolerance (\S+)\) PASS \| sent (\d+) B = (\S+) x size"
                      r".*\| ring (\S+) ms, library (\S+) ms per call", out)
    assert len(ring) == nproc, out[-3000:]
    for diff, tolerance, _, ratio, ring_ms, library_ms in ring:
        assert float(diff) <= float(tolerance)
        assert ratio == f"{2 * (nproc - 1) / nproc:.4f}"
        assert float(ring_ms) > 0 and float(library_ms) > 0  # CUDA-event times, not just launches
    assert out.count("recv gave up after") == nproc  # the deadlock still runs on its gloo side group


def test_jobs_that_need_two_ranks_say_so_on_one_gpu(tmp_path):
    require_gpus(1, "NCCL needs a GPU")
    env = job_env(tmp_path, gpu=True)
    assert_one_line_error(run([*readme_argv("point_to_point", 1), *NCCL], env=env, check=False, timeout=300),
                          "point-to-point needs at least 2 ranks")
    assert_one_line_error(run([*readme_argv("debug_lab:crash", 1), *NCCL, "--log-dir", str(tmp_path / "lab")],
                              env=env, check=False, timeout=300), "the lab needs at least 2 ranks")


# ---------------------------------------------------------------- bandwidth_test.py

def bandwidth_records(path: Path) -> dict[str, dict]:
    return {r["strategy"]: r for r in read_records(path)}


def assert_bandwidth_record(record: dict, world_size: int) -> None:
    """A sweep that ran on NCCL and CUDA, timed with CUDA events, with every element right."""
    assert (record["backend"], record["device"], record["world_size"]) == ("nccl", "cuda", world_size)
    assert record["config"]["timer"] == "cuda_events"
    rows = record["rows"]
    assert rows and all(row["wrong"] == 0 for row in rows), rows
    assert all(row["time_us"] > 0 for row in rows)
    sizes = [row["size_bytes"] for row in rows]
    assert sizes == sorted(set(sizes))
    # one rank sends nothing on the wire: the harness's bus factor is 0 there
    factor = NCCL_TESTS_FACTOR[record["collective"]](world_size) if world_size > 1 else 0.0
    for row in rows:
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor, rel=1e-12)


def test_bandwidth_on_one_gpu(tmp_path):
    require_gpus(1, "NCCL needs a GPU per rank")
    results = tmp_path / "bw.jsonl"
    out = run_on_gpus("bandwidth_test", 1, "--max-bytes", "1M", "--iters", "3", "--warmup-iters", "1",
                      "--results", str(results), "--plot", str(tmp_path / "bw.png"), folder=tmp_path)
    records = bandwidth_records(results)
    # sendrecv needs two ranks; the six collectives all ran (none "not supported" on NCCL)
    assert set(records) == {f"bandwidth_{c}" for c in NCCL_TESTS_FACTOR if c != "sendrecv"}, out[-3000:]
    for record in records.values():
        assert_bandwidth_record(record, 1)
        assert record["rows"][-1]["size_bytes"] == 2**20
    assert "6 collectives, 0 wrong elements" in out
    assert (tmp_path / "bw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The GPU default sweep (no --max-bytes): the largest size comes from free GPU memory, agreed on
    # by all ranks, at most 4 GiB, x2 steps; bfloat16 buffers and checks must fit beside NCCL's.
    results = tmp_path / "bw_default.jsonl"
    out = run_on_gpus("bandwidth_test", 1, "--collectives", "all_reduce", "all_to_all", "--dtype", "bfloat16",
                      "--iters", "2", "--warmup-iters", "1", "--results", str(results),
                      "--plot", str(tmp_path / "bw_default.png"), folder=tmp_path)
    for record in bandwidth_records(results).values():
        assert_bandwidth_record(record, 1)
        sizes = [row["size_bytes"] for row in record["rows"]]
        assert sizes[0] == 1024 and sizes[-1] <= 4 * 2**30 and sizes[-1] >= 2**20, sizes
        assert all(b == 2 * a for a, b in zip(sizes, sizes[1:])), sizes
    assert "2 collectives, 0 wrong elements" in out


def test_bandwidth_on_several_gpus(tmp_path):
    require_gpus(2, "one GPU per NCCL rank")
    results = tmp_path / "bw.jsonl"
    # default sizes: each rank reads its own free memory and the ranks must agree, or they would hang
    out = run_on_gpus("bandwidth_test", 2, "--collectives", "all_reduce", "all_gather", "reduce_scatter",
                      "sendrecv", "--iters", "2", "--warmup-iters", "1", "--p2p-bytes", "16M",
                      "--results", str(results), "--plot", str(tmp_path / "bw.png"), folder=tmp_path)
    records = bandwidth_records(results)
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "sendrecv"):
        assert_bandwidth_record(records[f"bandwidth_{collective}"], 2)
    matrix = records["bandwidth_p2p_matrix"]["matrix_GBps"]  # on by default with several GPUs
    assert all((value > 0) == (i != j) for i, row in enumerate(matrix) for j, value in enumerate(row))
    assert "4 collectives, 0 wrong elements" in out


# ---------------------------------------------------------------- debug_lab.py

def test_debug_lab_scenarios_on_two_gpus(tmp_path):
    require_gpus(2, "the lab needs 2 ranks, one GPU each")
    timeout_s = 5
    for scenario in ("mismatch", "missing-rank", "crash"):
        folder = tmp_path / scenario
        folder.mkdir()
        out = run_on_gpus(f"debug_lab:{scenario}", 2, "--timeout-s", str(timeout_s), "--log-dir",
                          str(folder / "lab"), folder=folder, expected_rc=1, timeout=300)  # ends by itself
        assert f"scenario {scenario} | world size 2 | backend nccl" in out, out[-3000:]
        if scenario == "mismatch":  # gloo side groups, NCCL default group for the summary
            assert "error: collective mismatch: rank 0 runs ALLREDUCE [4]; rank 1 runs ALLREDUCE [3]" in out
        elif scenario == "missing-rank":
            # the NCCL all_reduce on GPU tensors waited the whole timeout (blocking wait), where a
            # host clock around a queued kernel used to report 0.0 s
            waited = re.search(r"rank 0: all_reduce timed out after (\S+) s", out)
            assert waited and float(waited.group(1)) >= 0.8 * timeout_s, out[-3000:]
            assert "Ranks 1 failed to pass monitoredBarrier" in out
        else:
            assert "[rank 0] step 1: all_reduce ok" in out, out[-3000:]  # no failure at step 1
            assert "[rank 1] step 3: simulated crash" in out
            assert ROOT_CAUSE.search(out) and ROOT_CAUSE.search(out).groups() == ("1", "3"), out[-3000:]
        time.sleep(0.5)
        assert not own_processes(str(folder)), own_processes(str(folder))
        assert sorted(p.name for p in (folder / "lab").glob("rank*.log")) == ["rank0.log", "rank1.log"]
