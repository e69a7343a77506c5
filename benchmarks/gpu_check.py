"""The GPU check: the first thing to run on a lent GPU, bounded to a 7-minute lease, rehearsed on CPU.

    python benchmarks/gpu_check.py                          # one GPU: the whole check, at most 420 s
    python benchmarks/gpu_check.py --wheels wheels          # an offline node from a cold start, install included
    python benchmarks/gpu_check.py --first-contact          # a lease nearly spent: the first stages, under 3 minutes
    python benchmarks/gpu_check.py --rehearse --wheels W    # the same control flow on a CPU machine (CI runs it)

Stages, most valuable first, each a job with its own limit (:data:`STAGES`; the limits add up to the
lease, so the check ends inside it by construction, and a stage that ends early leaves its time to
the last one):

1. ``install`` (``--wheels``): the folder ``python distkit/offline.py download`` wrote, installed with
   no index; the check then starts again in a fresh interpreter, which finds the editable ``distkit``
   (an editable install is found through a ``.pth`` file read only when an interpreter starts);
2. ``preflight``: in a job of its own, the GPU, driver, CUDA and torch versions and the compute mode,
   and whether the node has what ``torch.compile`` needs (a C compiler, the Python headers): one line
   says what it lacks, and only what needs it is skipped. The check itself never touches CUDA (in
   exclusive-process mode its context would make every later job fail);
3. the quick start at world size 1, offline; 4. ``pytest -m gpu``, first part (the quick start, each
chapter's default command, the numbers a reading found wrong); 5.-6. tokens/s, MFU and peak memory of
the tiny Llama and of the 1B Llama under activation checkpointing, eager and compiled; 7. the copy
bandwidth; 8. the planner's one-GPU check; 9. the rest of the GPU suite in the time that is left.

Every limit ends the job's whole process tree (:mod:`distkit.jobs`: torchrun's workers live in
sessions of their own). Each measurement's output is an output record in ``outputs.jsonl``, each
measured run a harness record, and ``gpu_check.json`` sums it up. The exit code is 0 only when every
stage ended well: a failed or errored test, a pytest usage or internal error, no JUnit file, no test
collected, a session-level failure (the working tree changed), a cut stage or a failed measurement
each make it 1, and each is named on a ``problem:`` line. Without a GPU (and without ``--rehearse``)
it says so in one line and exits 0.

``--rehearse`` swaps only what needs CUDA itself (:mod:`distkit.rehearsal` names each swap) and runs
everything else as on the GPU, at small size.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEASE_S = 420          # a lent GPU is held about 15 minutes in all, start-up included: the check takes 7
FIRST_CONTACT_S = 175  # --first-contact: under 3 minutes
GRACE_S = 3.0          # a cut job gets SIGTERM, this long, then SIGKILL: inside its stage's limit
SUITE_CLOSE_S = 5.0    # pytest's own teardown and JUnit file after the box: inside the stage's limit
MIN_STAGE_S = 12.0     # a stage with less than this left is skipped, saying so


@dataclass(frozen=True)
class Stage:
    name: str
    full_s: float   # its limit in the whole check
    first_s: float  # its limit with --first-contact (0: not run)
    what: str


STAGES = (
    Stage("install", 75, 75, "--wheels only: the folder installed with no index, then a fresh interpreter"),
    Stage("preflight", 15, 15, "GPU, driver, CUDA, torch, compute mode; C compiler and Python headers"),
    Stage("quick_start", 25, 25, "torchrun --nproc_per_node=1 01-ddp-basics/ddp_mnist.py --offline"),
    Stage("suite_first", 110, 60, "pytest -m gpu: the quick start, each chapter's default command, the numbers "
                                   "a reading found wrong (MFU dtype, peak windows, labels, timers)"),
    Stage("llama_tiny_ac", 35, 0, "tiny Llama, AC none/full/selective x eager/compiled: tokens/s, MFU, peak"),
    Stage("llama_1b_ac", 105, 0, "llama-3.2-1b, AC none/full x eager/compiled: tokens/s, MFU, peak"),
    Stage("copy_bandwidth", 15, 0, "device-to-device copy bandwidth (read + write)"),
    Stage("planner_1gpu", 40, 0, "the large GPT under DDP, FSDP and TP on one GPU, next to the planner"),
    Stage("suite_rest", 0, 0, "pytest -m gpu: every other GPU test, in the time the stages above left"),
)
assert sum(s.full_s for s in STAGES) == LEASE_S and sum(s.first_s for s in STAGES) == FIRST_CONTACT_S


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


# Each measurement: its command (from the repository root) with {python}, {torchrun}, {out}, {device}
# (the device and backend flags) and {size} (the sizes on a GPU, or the rehearsal's small ones).
LLAMA_AC = "{torchrun} --nproc_per_node=1 05-advanced/activation_checkpointing.py --arch llama {device} {size}"
MEASUREMENTS = {
    "quick_start": ("{torchrun} --nproc_per_node=1 01-ddp-basics/ddp_mnist.py --offline --data-dir {out}/data "
                    "--results {out}/quick_start.jsonl --save {out}/ddp_mnist.pt --log-file {out}/ddp_mnist.log "
                    "{device} {size}"),
    "llama_tiny_ac": LLAMA_AC + " --results {out}/ac_llama.jsonl",
    "llama_1b_ac": LLAMA_AC + " --results {out}/ac_llama.jsonl",
    "copy_bandwidth": "{python} benchmarks/gpu_check.py --copy-bandwidth",
    "planner_1gpu": ("{python} benchmarks/distributed_benchmarks.py --world-sizes 1 {device} {size} "
                     "--results {out}/planner_cells.jsonl && {python} benchmarks/gpu_check.py "
                     "--validate-planner {out}/planner_cells.jsonl"),
}
SIZES = {  # name: (on a GPU, in the rehearsal)
    "quick_start": ("", "--epochs 1 --max-steps 4"),
    # The rehearsal does not compile: on a CPU with an empty cache that is 30-40 s of C++ builds, CI's
    # time for nothing the check's control flow needs; tests/test_step_peak.py compiles (on aot_eager) under the
    # rehearsal's swap (the compiled peak's window) and the preflight test drops --compile on by hand.
    "llama_tiny_ac": ("--ac none full selective --compile off on --model-size tiny --steps 10",
                      "--ac none selective --compile off --model-size tiny --steps 3 --warmup-steps 1 "
                      "--global-batch-size 4"),
    "llama_1b_ac": ("--ac none full --compile off on --model-size llama-3.2-1b --seq-len 1024 --global-batch-size 4 "
                    "--steps 6",
                    "--ac full --compile off --model-size tiny --seq-len 32 --global-batch-size 2 --steps 3 "
                    "--warmup-steps 1"),
    "copy_bandwidth": ("", ""),
    "planner_1gpu": ("--strategies ddp fsdp_full_shard tp --model-size large --n-layer 12 --global-batch-size 32 "
                     "--steps 8",
                     # one cell: the DDP cell the planner calibrates on, compared with its memory prediction
                     "--strategies ddp --model-size tiny --global-batch-size 4 --steps 3 --warmup-steps 1"),
}


def measurement_command(name: str, out: Path, rehearse: bool, compiles: bool) -> str:
    """The shell command of one measurement, the device swapped in a rehearsal and ``--compile on``
    dropped where the node cannot compile."""
    from distkit.rehearsal import SWAPS

    side = 1 if rehearse else 0
    device = f"--backend {SWAPS['backend'][side]} --device {SWAPS['device'][side]}"
    if name == "copy_bandwidth":
        device = ""
    size = SIZES[name][side]
    if not compiles:
        size = size.replace("--compile off on", "--compile off")
    return MEASUREMENTS[name].format(python=program("python"), torchrun=program("torchrun"), out=shlex.quote(str(out)),
                                     device=device, size=size).replace("  ", " ").strip()


# ------------------------------------------------------------------------------ jobs the check starts
def copy_bandwidth() -> None:
    """Copy bandwidth as nvbandwidth and the datasheets count it: bytes read plus bytes written per second,
    the best of several timed copies (the rehearsal's stand-in: a host-memory copy, rehearsal.SWAPS)."""
    import torch

    from distkit import rehearsal

    if rehearsal.active():
        size, iters = 64 * 2**20, 5
        src = torch.empty(size, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(iters):
            started = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - started)
        where = "host memory (rehearsal)"
    else:
        size, iters = 2**30, 20
        src = torch.empty(size, dtype=torch.uint8, device="cuda").random_()
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
        where = torch.cuda.get_device_name(0)
    assert torch.equal(dst, src)
    print(f"{where}: copy of {size / 2**20:.0f} MiB, best of {iters}: {best * 1e3:.3f} ms = "
          f"{2 * size / best / 1e12:.3f} TB/s (read + write)")


def validate_planner(results: str) -> None:
    """The planner against the one-GPU cells: the GPU's speed from the DDP cell, the others predicted.
    In a rehearsal the planner's H100 stands in for the GPU (rehearsal.SWAPS["gpu_identity"])."""
    from distkit import planner, rehearsal
    from distkit.harness import read_records

    if rehearsal.active():
        name = "NVIDIA H100 80GB HBM3 (rehearsal stand-in)"
    else:
        import torch

        name = torch.cuda.get_device_name(0)
    gpu = planner.gpu_type(name)
    if gpu is None:
        print(f"no planner GPU type for {name!r}; known: {', '.join(planner.GPU_NAME_PARTS)}")
        return
    records = read_records(results)
    cluster = planner.with_measured_speed(planner.cluster(gpu, 1), records, arch="gpt")
    print(planner.validation_table(planner.validate(records, cluster)))


def preflight(rehearse: bool) -> None:
    """One JSON line: the GPUs, the machine the records will name, the compute mode, and what
    ``torch.compile`` needs on GPU (triton builds its launcher with a C compiler and the Python
    headers; inductor's CPU code needs both too)."""
    import sysconfig

    import torch

    from distkit.timing import machine_info

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus and not rehearse else "cpu"
    machine = machine_info(torch.device(device))
    if device == "cuda":
        machine["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    compilers = [os.environ.get("CC"), "cc", "gcc", "clang"]
    compiler = next((shutil.which(c) for c in compilers if c and shutil.which(c)), None)
    include = sysconfig.get_paths().get("include") or ""
    print(json.dumps({"gpus": gpus, "device": device, "torch": torch.__version__, "machine": machine,
                      "compute_mode": compute_mode() if device == "cuda" else None, "compiler": compiler,
                      "python_headers": Path(include, "Python.h").is_file()}))


def compute_mode() -> str | None:
    """GPU 0's compute mode as nvidia-smi names it (Default, Exclusive_Process, Prohibited), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


# ----------------------------------------------------------------------------------- the stages
class Lease:
    """The check's clock: each stage's limit is its own share, capped so the shares of the stages after
    it stay whole; the last stage takes what is left."""

    def __init__(self, started: float, first_contact: bool):
        self.started, self.first_contact = started, first_contact
        self.total = FIRST_CONTACT_S if first_contact else LEASE_S

    def share(self, stage: Stage) -> float:
        return stage.first_s if self.first_contact else stage.full_s

    def budget(self, name: str) -> float:
        at = next(i for i, s in enumerate(STAGES) if s.name == name)
        later = sum(self.share(s) for s in STAGES[at + 1:])
        left = self.total - (time.monotonic() - self.started) - later
        own = self.share(STAGES[at])
        return max(0.0, left if own == 0 and not self.first_contact else min(own, left))

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def install(wheels: str, limit_s: float) -> dict:
    """``python distkit/offline.py install WHEELS`` as a job in its own session, ended whole at its limit
    (standard library only: nothing else is installed yet)."""
    command = [sys.executable, str(REPO / "distkit" / "offline.py"), "install", wheels]
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(1.0, limit_s - GRACE_S))
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pip starts no sessions of its own: its group is its tree
        output, _ = proc.communicate()
        status = "cut at its limit"
    print(output.rstrip())
    return {"name": "install", "status": status, "wall_s": round(time.monotonic() - started, 1),
            "command": shlex.join(command[1:])}


def restart_after_install(argv: list[str], started: float) -> None:
    """Start this check again in a fresh interpreter, which reads the editable install's ``.pth`` file,
    keeping the lease's clock (a monotonic clock is one per machine)."""
    os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv,
                              "--started-at", repr(started), "--installed"])


def job_env(rehearse: bool, node: dict) -> dict:
    """The environment of every job: the rehearsal's marker and hidden GPUs, and what the preflight
    found that the GPU suite must know."""
    from distkit import rehearsal

    env = dict(os.environ, PYTHONUNBUFFERED="1", DISTKIT_NO_PROGRESS="1")
    if rehearse:
        env[rehearsal.ENV] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Every GPU test skips for want of a GPU and launches nothing: the suite's fork server (which
        # imports torch, DeepSpeed and the chapters' libraries once for the jobs) would only cost its start.
        env["DISTKIT_NO_FORK_SERVER"] = "1"
    if not node.get("compiles", True):
        env["DISTKIT_NO_COMPILER"] = "1"  # tests/conftest.py skips the tests that compile
    if node.get("compute_mode") == "Exclusive_Process":
        env["DISTKIT_GPU_EXCLUSIVE_PROCESS"] = "1"  # tests/conftest.py runs in-process CUDA tests last
    return env


def run_preflight(rehearse: bool, limit_s: float) -> dict:
    """The preflight as a job (the check holds no CUDA context): its JSON line, with the stage's own
    step (``"step"``), or ``{"error": ...}``."""
    from distkit.jobs import run_job

    command = [sys.executable, str(Path(__file__).resolve()), "--preflight"] + (["--rehearse"] if rehearse else [])
    done = run_job(command, max(1.0, limit_s - GRACE_S), cwd=REPO, env=job_env(rehearse, {}), grace_s=GRACE_S)
    text = (done.output or b"").decode(errors="replace").strip()
    if done.cut or done.returncode != 0:
        last = text.splitlines()[-1] if text else ""
        return {"error": f"the preflight {'was cut at its limit' if done.cut else f'exited {done.returncode}'}: {last}"}
    node = json.loads(text.splitlines()[-1])
    node["compiles"] = bool(node["compiler"] and node["python_headers"])
    node["step"] = {"name": "preflight", "status": "ok", "wall_s": round(done.wall_s, 1),
                    "command": shlex.join(command[1:])}
    return node


def preflight_line(node: dict) -> str:
    m = node["machine"]
    where = (f"{m['device_name']} | driver {m.get('driver')} | CUDA {m.get('cuda')} | compute mode "
             f"{node.get('compute_mode')}" if node["device"] == "cuda" else f"{m['device_name']} (rehearsal)")
    lacks = [what for what, have in (("a C compiler (cc, gcc or clang)", node["compiler"]),
                                     ("the Python headers (Python.h)", node["python_headers"])) if not have]
    line = f"[gpu_check] preflight: {where} | torch {node['torch']}"
    if lacks:
        line += (f"\n[gpu_check] preflight: this node lacks {' and '.join(lacks)}: torch.compile cannot build "
                 "its kernels' launchers, so the compiled runs and the tests that compile are skipped")
    return line


def run_measurement(name: str, out: Path, budget: float, rehearse: bool, node: dict) -> dict:
    """One measurement, recorded in ``out/outputs.jsonl`` with the preflight's machine (the check never
    asks torch about the GPU itself)."""
    from distkit.records import RecordError, capture

    command = measurement_command(name, out, rehearse, node["compiles"])
    try:
        record = capture(command, name, timeout_s=max(1.0, budget - GRACE_S), into=out / "outputs.jsonl",
                         machine=node["machine"], torch_version=node["torch"], cuda_available=not rehearse,
                         grace_s=GRACE_S, env=job_env(rehearse, node))
        status = "ok" if record["returncode"] == 0 else f"exit {record['returncode']}"
        step = {"name": name, "status": status, "wall_s": record["wall_s"], "command": command}
    except RecordError:
        step = {"name": name, "status": "cut at its limit", "wall_s": round(budget, 1), "command": command}
    return step


def run_suite(part: str, out: Path, budget: float, rehearse: bool, node: dict) -> dict:
    """``pytest -m gpu`` (one part of it) under a time box inside the stage's limit; no test starts
    whose timeout would run past the box (tests/conftest.py shortens it or skips the test)."""
    junit, log, plan = (out / f"gpu_suite_{part}.{ext}" for ext in ("xml", "log", "plan.jsonl"))
    box = budget - GRACE_S - SUITE_CLOSE_S
    # only the files that hold GPU tests: the others' imports are not the GPU suite's to pay for
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "--gpu-part", part,
               "--time-box", f"{box:.0f}", "--gpu-plan", str(plan), "--junitxml", str(junit), "-q", "-rs", *files]
    from distkit.verdict import run_pytest

    return run_pytest(part, command, junit, log, budget - GRACE_S, REPO, job_env(rehearse, node), rehearse,
                      grace_s=GRACE_S)


def run_stages(args: argparse.Namespace, lease: Lease, out: Path, node: dict) -> list[dict]:
    """Every stage after the preflight, in :data:`STAGES` order, each within its budget."""
    steps = []
    for stage in STAGES[2:]:
        budget = lease.budget(stage.name)
        if lease.share(stage) == 0 and (lease.first_contact or stage.name != "suite_rest"):
            continue
        if budget < min(MIN_STAGE_S, lease.share(stage) or MIN_STAGE_S):
            steps.append({"name": stage.name, "status": f"skipped: {budget:.0f} s of the lease left for it"})
        elif stage.name.startswith("suite_"):
            steps.append(run_suite(stage.name.removeprefix("suite_"), out, budget, args.rehearse, node))
        else:
            steps.append(run_measurement(stage.name, out, budget, args.rehearse, node))
        print(f"[gpu_check] {stage.name}: {steps[-1]['status'] if not stage.name.startswith('suite_') else 'done'} "
              f"({lease.elapsed():.0f} s of {lease.total} s)")
    return steps


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        f"stages and their limits (s; whole check {LEASE_S}, --first-contact {FIRST_CONTACT_S}): "
        + "; ".join(f"{s.name} {s.full_s:g}/{s.first_s:g}" for s in STAGES)
        + ". Without a GPU (and without --rehearse): one line, exit 0."))
    parser.add_argument("--out", default="runs/gpu_check", help="folder for the records (default: runs/gpu_check)")
    parser.add_argument("--wheels", help="first install this offline wheel folder (python distkit/offline.py install)")
    parser.add_argument("--first-contact", action="store_true",
                        help=f"only the first stages, in {FIRST_CONTACT_S} s: for a lease that is nearly spent")
    parser.add_argument("--rehearse", action="store_true",
                        help="on a CPU machine: the whole control flow, CUDA's parts swapped (distkit/rehearsal.py), "
                             "small sizes")
    parser.add_argument("--started-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--installed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--copy-bandwidth", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--validate-planner", metavar="RESULTS", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def unwritable_folder(folder: Path) -> str | None:
    """Why the records cannot be written into ``folder``, or None. Standard library only, like the
    rest of this script before the wheel folder is installed."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return f"cannot write there ({exc.strerror or exc})"
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.preflight or args.copy_bandwidth or args.validate_planner:  # jobs the check starts
        preflight(args.rehearse) if args.preflight else copy_bandwidth() if args.copy_bandwidth \
            else validate_planner(args.validate_planner)
        return 0
    lease = Lease(args.started_at if args.started_at is not None else time.monotonic(), args.first_contact)
    out = (REPO / args.out).resolve()
    problem = unwritable_folder(out)  # before the install, the suite and the measurements
    if problem:
        print(f"error: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    if args.wheels and not args.installed:
        step = install(args.wheels, lease.budget("install"))
        (out / "install.json").write_text(json.dumps(step) + "\n")
        if step["status"] != "ok":
            print(f"error: the install of {args.wheels}: {step['status']}", file=sys.stderr)
            return 1
        print(f"[gpu_check] installed {args.wheels} in {step['wall_s']:.0f} s; starting again in a fresh interpreter")
        sys.stdout.flush()
        restart_after_install(argv, lease.started)
    return check(args, lease, out)


def check(args: argparse.Namespace, lease: Lease, out: Path) -> int:
    """Everything after the install, in the interpreter that can import ``distkit``."""
    from distkit.verdict import CudaWatch, problems_of

    node = run_preflight(args.rehearse, lease.budget("preflight"))
    if "error" in node:
        print(f"error: {node['error']}", file=sys.stderr)
        return 1
    if node["device"] == "cpu" and not args.rehearse:
        print("no GPU: torch.cuda.is_available() is False on this machine, so there is nothing to check "
              "(--rehearse runs the check's control flow on the CPU)")
        return 0
    print(preflight_line(node))
    watch = CudaWatch()
    watch.start()
    try:
        steps = run_stages(args, lease, out, node)
    finally:
        watch.stop()
    import distkit

    installed = out / "install.json"
    summary = {"distkit": str(Path(distkit.__file__).parent), "machine": node["machine"], "torch": node["torch"],
               "compute_mode": node["compute_mode"],
               "compiles": node["compiles"], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "form": "first_contact" if args.first_contact else "full", "lease_s": lease.total,
               "stages": ([json.loads(installed.read_text())] if args.installed and installed.exists() else [])
               + [node["step"], *steps], "check_cuda_calls": watch.calls}
    if args.rehearse:
        from distkit.rehearsal import SWAPS

        summary["rehearsal"] = {key: {"gpu": gpu, "rehearsal": cpu} for key, (gpu, cpu) in SWAPS.items()}
    summary["problems"] = problems_of(summary)
    summary["wall_s"] = round(lease.elapsed(), 1)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    for problem in summary["problems"]:
        print(f"problem: {problem}")
    verdict = "ok" if not summary["problems"] else f"{len(summary['problems'])} problem(s)"
    print(f"[gpu_check] {verdict} in {summary['wall_s']:.0f} s of {lease.total} s; records in {out}")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
