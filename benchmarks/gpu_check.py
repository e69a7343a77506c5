"""The GPU check: on one GPU, the GPU test suite, then the single-GPU measurements, left as records.

    python benchmarks/gpu_check.py                                  # results under runs/gpu_check/
    python benchmarks/gpu_check.py --wheels wheels --out OUT        # an offline node, from a cold start

``--wheels`` first installs a folder that ``python distkit/offline.py download`` wrote (the node keeps
its own torch; see the top README, "On an offline GPU node"). Then, in this order, each step bounded so
the whole fits a short lease of one GPU:

1. ``pytest -m gpu`` with ``--time-box`` (the quick start first, then each chapter's default command
   at world size 1, then the rest; every test has its own timeout), its JUnit XML and log kept;
2. the quick start at world size 1 (``torchrun --nproc_per_node=1 01-ddp-basics/ddp_mnist.py``);
3. device-to-device copy bandwidth (bytes read plus bytes written, per second);
4. tokens/s, MFU and peak memory of the tiny Llama with activation checkpointing none/full/selective,
   eager and compiled (``05-advanced/activation_checkpointing.py``);
5. the planner's one-GPU check: the large GPT at world size 1 under every strategy one GPU runs,
   predicted by ``distkit.planner`` with the GPU's speed taken from the DDP cell;
6. the same as 4 for ``llama-3.2-1b`` (last: the longest, and the first cut when time runs out).

Every command's output is stored as an output record (``outputs.jsonl``: command, machine, torch,
date; ``python -m distkit.records``), every measured run as a harness record, and ``gpu_check.json``
sums it up with the GPU name, the driver, the CUDA and torch versions and each test's outcome and
time. Without a GPU it says so in one line and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the GPU suite's share of the time box; the measurements get the rest, in the order below
SUITE_BOX_S, MEASURE_BOX_S = 300, 210
LLAMA_AC = ("05-advanced/activation_checkpointing.py --arch llama --ac none full selective --compile off on "
            "--backend nccl")
PLANNER_STRATEGIES = ("ddp", "fsdp_full_shard", "fsdp_no_shard", "tp", "pp_1f1b")


def program(name: str) -> str:
    """``python`` / ``torchrun`` as a reader types them when they are this interpreter's, else full paths
    (the records show the commands)."""
    mine = Path(sys.executable).parent / name
    found = shutil.which(name)
    if found and mine.exists() and Path(found).resolve() == mine.resolve():
        return name
    if mine.exists():
        return shlex.quote(str(mine))
    return shlex.quote(sys.executable) + (" -m torch.distributed.run" if name == "torchrun" else "")


def measurements(out: Path) -> list[tuple[str, str, float]]:
    """(name, shell command from the repository root, its own time limit in s), in the order they run."""
    here, torchrun = program("python"), program("torchrun")
    return [
        ("quick_start_1gpu", f"{torchrun} --nproc_per_node=1 01-ddp-basics/ddp_mnist.py "
                             f"--results {out}/quick_start.jsonl --save {out}/ddp_mnist.pt", 90),
        ("copy_bandwidth", f"{here} benchmarks/gpu_check.py --copy-bandwidth", 30),
        ("llama_tiny_ac", f"{torchrun} --nproc_per_node=1 {LLAMA_AC} --model-size tiny "
                          f"--steps 10 --results {out}/ac_llama.jsonl", 120),
        ("planner_1gpu", f"{here} benchmarks/distributed_benchmarks.py --world-sizes 1 --strategies "
                         f"{' '.join(PLANNER_STRATEGIES)} --model-size large --n-layer 12 --global-batch-size 32 "
                         f"--steps 8 --results {out}/planner_cells.jsonl && {here} benchmarks/gpu_check.py "
                         f"--validate-planner {out}/planner_cells.jsonl", 150),
        ("llama_1b_ac", f"{torchrun} --nproc_per_node=1 {LLAMA_AC} --model-size llama-3.2-1b "
                        f"--seq-len 1024 --global-batch-size 4 --steps 6 --results {out}/ac_llama.jsonl", 300),
    ]


def copy_bandwidth(size_bytes: int = 2**30, iters: int = 20) -> None:
    """Device-to-device copy bandwidth as nvbandwidth and the datasheets count it: bytes read plus bytes
    written per second, the best of ``iters`` timed copies of ``size_bytes``."""
    import torch

    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    assert torch.equal(dst, src)
    print(f"{torch.cuda.get_device_name(0)}: device-to-device copy of {size_bytes / 2**30:.0f} GiB, best of "
          f"{iters}: {best * 1e3:.3f} ms = {2 * size_bytes / best / 1e12:.2f} TB/s (read + write)")


def validate_planner(results: str) -> None:
    """The planner against the one-GPU cells: the GPU's speed from the DDP cell, the others predicted."""
    import torch

    from distkit import planner
    from distkit.harness import read_records

    name = torch.cuda.get_device_name(0)
    gpu = planner.gpu_type(name)
    if gpu is None:
        print(f"no planner GPU type for {name!r}; known: {', '.join(planner.GPU_NAME_PARTS)}")
        return
    records = read_records(results)
    cluster = planner.with_measured_speed(planner.cluster(gpu, 1), records, arch="gpt")
    rows = planner.validate(records, cluster)
    print(planner.validation_table(rows))


def machine() -> dict:
    """The GPU and the software stack this check ran on (the harness's record of a machine)."""
    import torch

    from distkit.harness import machine_info

    return {**machine_info(torch.device("cuda", 0)),
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory}


def suite_outcomes(junit: Path) -> list[dict]:
    """Each test of the JUnit XML: its id, outcome (passed/failed/error/skipped) and seconds."""
    tests = []
    for case in ElementTree.parse(junit).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time", 0)), 1)})
    return tests


def run_suite(out: Path, box_s: float) -> dict:
    """``pytest -m gpu`` under a time box; its outcomes from the JUnit XML."""
    junit, log = out / "gpu_suite.xml", out / "gpu_suite.log"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "--time-box", str(box_s),
               "--junitxml", str(junit), "-q"]
    started = time.monotonic()
    with open(log, "w") as f:
        done = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    tests = suite_outcomes(junit) if junit.exists() else []
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "failed", "error", "skipped")}
    print(f"[gpu_check] suite: {counts} in {time.monotonic() - started:.0f} s (exit {done.returncode}); "
          f"log {log}")
    return {"command": shlex.join(command[1:]), "returncode": done.returncode,
            "wall_s": round(time.monotonic() - started, 1), "counts": counts, "tests": tests}


def run_measurements(out: Path, box_s: float) -> list[dict]:
    """Each measurement as an output record in ``out/outputs.jsonl``, while the time box lasts."""
    from distkit.records import RecordError, capture

    deadline, steps = time.monotonic() + box_s, []
    for name, command, limit in measurements(out):
        left = deadline - time.monotonic()
        if left < 10:
            steps.append({"name": name, "status": "skipped: the time box was spent"})
            continue
        try:
            record = capture(command, name, timeout_s=min(limit, left), into=out / "outputs.jsonl")
            status = "ok" if record["returncode"] == 0 else f"exit {record['returncode']}"
            steps.append({"name": name, "status": status, "wall_s": record["wall_s"]})
        except RecordError as e:
            steps.append({"name": name, "status": f"timed out: {e}"})
        print(f"[gpu_check] {name}: {steps[-1]['status']}")
    return steps


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="without a GPU: one line, exit 0")
    parser.add_argument("--out", default="runs/gpu_check", help="folder for the records (default: runs/gpu_check)")
    parser.add_argument("--wheels", help="first install this offline wheel folder (python distkit/offline.py install)")
    parser.add_argument("--suite-box", type=float, default=SUITE_BOX_S,
                        help=f"seconds after which no further GPU test starts (default: {SUITE_BOX_S})")
    parser.add_argument("--measure-box", type=float, default=MEASURE_BOX_S,
                        help=f"seconds for the measurements after the suite (default: {MEASURE_BOX_S})")
    parser.add_argument("--skip-suite", action="store_true", help="only the measurements")
    parser.add_argument("--copy-bandwidth", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--validate-planner", metavar="RESULTS", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def unwritable_folder(folder: Path) -> str | None:
    """Why the records cannot be written into ``folder``, or None. Standard library only, like the
    rest of this script before the wheel folder is installed (distkit.paths needs torch)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return f"cannot write there ({exc.strerror or exc})"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    problem = unwritable_folder(REPO / args.out)  # before the install, the suite and the measurements
    if problem:
        print(f"error: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    if args.wheels:
        done = subprocess.run([sys.executable, str(REPO / "distkit" / "offline.py"), "install", args.wheels])
        if done.returncode != 0:
            return done.returncode
        print(f"[gpu_check] installed {args.wheels} in {time.monotonic() - started:.0f} s")
    import torch

    if not torch.cuda.is_available():
        print("no GPU: torch.cuda.is_available() is False on this machine, so there is nothing to check")
        return 0
    if args.copy_bandwidth:
        copy_bandwidth()
        return 0
    if args.validate_planner:
        validate_planner(args.validate_planner)
        return 0
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary = {"machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"[gpu_check] {summary['machine']['device_name']} | driver {summary['machine']['driver']} | CUDA "
          f"{summary['machine']['cuda']} | torch {summary['machine']['torch']}")
    if not args.skip_suite:
        summary["suite"] = run_suite(out, args.suite_box)
    summary["measurements"] = run_measurements(out, args.measure_box)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[gpu_check] done in {summary['wall_s']:.0f} s; records in {out}")
    failed = summary.get("suite", {}).get("counts", {})
    return 1 if failed.get("failed") or failed.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
