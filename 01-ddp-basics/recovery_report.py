"""Chapter 01: how long a torchrun restart takes to recover, phase by phase, and whether it resumes exactly.

``--measure`` runs the README's restart command (4 ranks, rank 2 sends itself SIGKILL at step 60,
``torchrun --max-restarts=3`` restarts the group, which resumes from the step-50 checkpoint) with
default DDP flags and with ``--find-unused-parameters``, next to an uninterrupted run of each. The
crash comes from ``inject_faults.py`` beside it, which runs ``ddp_training.py`` with the fault
injected and every rank's milestone timestamps appended to ``<log-dir>/events.jsonl``; the recovery
phases come from those, and the final parameters are compared with the uninterrupted run's (plain
``ddp_training.py``, same flags). Each
crashed run appends one JSON line (command, machine, torch version, date, phases, exactness) to
``records/recovery_times.jsonl`` beside this script.

Without ``--measure`` it prints the README's table from that record; ``readme_table`` is the same
table for ``python -m distkit.records render 01-ddp-basics`` (the README's render mark):

    python 01-ddp-basics/recovery_report.py --measure      # runs 6 training jobs (minutes)
    python 01-ddp-basics/recovery_report.py                # the Markdown table, from the record
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distkit import ArgumentParser, UsageError, run_main
from distkit.flags import positive_int
from distkit.paths import check_outputs
from distkit.records import machine_label

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECORD = HERE / "records" / "recovery_times.jsonl"
# The README's restart command, ending sooner (--steps 64: resume at 50, 14 steps recomputed).
COMMAND = ("torchrun --standalone --nproc_per_node=4 --max-restarts=3 01-ddp-basics/inject_faults.py "
           "--crash-at-step 60 --crash-rank 2 --steps 64")
SCRIPT = "01-ddp-basics/ddp_training.py"  # what the uninterrupted runs start instead of the fault worker
CONFIGS = {"default flags": [], "--find-unused-parameters": ["--find-unused-parameters"]}
# (name, description, event that ends it); each phase starts where the previous one ended.
PHASES = [
    ("detection", "kill -9 -> the first surviving rank notices (its collective fails, or torchrun's "
                  "SIGTERM arrives)", "collective_failed"),
    ("restart", "torchrun stops the group, runs a new rendezvous round, starts new workers", "process_start"),
    ("startup", "interpreter start and imports", "main_entry"),
    ("rendezvous", "`init_process_group` of the new workers", "process_group_ready"),
    ("setup", "config broadcast, model, `DDP(...)` (broadcasts rank 0's weights)", "model_ready"),
    ("checkpoint load", "rank 0 picks the newest good checkpoint; every rank loads it", "checkpoint_loaded"),
    ("first step", "the first training step after the resume", "first_step_done"),
]


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def recovery_phases(events: list[dict]) -> dict[str, float]:
    """Seconds per phase of one crash and restart, from the events ``inject_faults.py`` wrote.

    The crash is the fault-injecting rank's ``fault_injected`` (attempt 0); detection ends when the
    first surviving rank noticed: its collective failed (``collective_failed``) or torchrun's SIGTERM
    reached it (``stop_signal``: a rank busy computing hears from torchrun first). Every later
    boundary is when the *last* rank of attempt 1 reached it (the job moves at its slowest rank).
    """
    def times(event: str, attempt: int) -> list[float]:
        return [e["t"] for e in events if e["event"] == event and e["attempt"] == attempt]

    kill = times("fault_injected", 0)
    detected = times("collective_failed", 0) + times("stop_signal", 0)
    if not kill or not detected:
        raise ValueError("the events hold no crash (fault_injected) or no detection "
                         "(collective_failed / stop_signal)")
    boundaries = [min(kill), min(detected)]
    for _, _, event in PHASES[1:]:
        reached = times(event, 1)
        if not reached:
            raise ValueError(f"the restarted attempt never recorded {event}")
        boundaries.append(max(reached))
    phases = {name: boundaries[i + 1] - boundaries[i] for i, (name, _, _) in enumerate(PHASES)}
    phases["total"] = boundaries[-1] - boundaries[0]
    return phases


def run_job(argv: list[str], folder: Path, env: dict) -> dict:
    """One training job in ``folder``; returns its final parameters and harness record."""
    from distkit.checkpoint import safe_load
    from distkit.harness import read_records

    flags = ["--checkpoint-dir", str(folder / "ck"), "--log-dir", str(folder / "logs"),
             "--results", str(folder / "results.jsonl")]
    head = [sys.executable, "-m", "torch.distributed.run"]
    done = subprocess.run(head + argv[1:] + flags, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"error: {shlex.join(argv)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                         f"{done.stderr[-3000:]}")
    final = sorted((folder / "ck").glob("step_*.pt"))[-1]
    return {"params": safe_load(final)["model"], "record": read_records(folder / "results.jsonl")[-1]}


def measure(repeats: int, record: Path) -> None:
    """Run every configuration's uninterrupted and crashed jobs; append one line per crashed run."""
    import torch

    session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "DISTKIT_NO_PROGRESS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="recovery_") as scratch:
        env["TMPDIR"] = scratch  # torchrun's own scratch folders
        for label, extra in CONFIGS.items():
            clean_argv = [SCRIPT if a.endswith("inject_faults.py") else a for a in shlex.split(COMMAND)
                          if a != "--max-restarts=3"]
            clean_argv = clean_argv[:clean_argv.index("--crash-at-step")] + clean_argv[
                clean_argv.index("--crash-rank") + 2:]
            clean = run_job(clean_argv + extra, Path(scratch) / f"{label}-clean", env)
            for attempt in range(repeats):
                folder = Path(scratch) / f"{label}-crash{attempt}"
                load = os.getloadavg()[0]
                crashed = run_job(shlex.split(COMMAND) + extra, folder, env)
                diff = max((crashed["params"][k].float() - clean["params"][k].float()).abs().max().item()
                           for k in clean["params"])
                rec = crashed["record"]
                entry = {
                    "session": session, "command": shlex.join(shlex.split(COMMAND) + extra), "config": label,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch_version": torch.__version__,
                    "machine": rec["machine"], "backend": rec["backend"], "device": rec["device"],
                    "world_size": rec["world_size"], "load_average_before": round(load, 2),
                    "resumed_from_step": rec["resumed_from_step"],
                    "phases_s": recovery_phases(read_jsonl(folder / "logs" / "events.jsonl")),
                    "max_abs_diff_vs_uninterrupted": diff,
                    "bit_identical": all(torch.equal(crashed["params"][k], clean["params"][k])
                                         for k in clean["params"]),
                }
                with open(record, "a") as f:
                    f.write(json.dumps(entry) + "\n")
                print(f"{label} run {attempt + 1}: recovery {entry['phases_s']['total']:.1f} s, "
                      f"max |diff| {diff:.1e}", flush=True)


def table(records: list[dict]) -> str:
    """The README's Markdown: median seconds per phase and exactness, one column per configuration,
    from the newest measuring session in the record."""
    records = [r for r in records if r["session"] == records[-1]["session"]]
    labels = [label for label in CONFIGS if any(r["config"] == label for r in records)]
    mine = {label: [r for r in records if r["config"] == label] for label in labels}

    def median(label: str, key: str) -> str:
        return f"{statistics.median(r['phases_s'][key] for r in mine[label]):.2f} s"

    def exactness(label: str) -> str:
        if all(r["bit_identical"] for r in mine[label]):
            return "bit-identical"
        return f"max abs diff {max(r['max_abs_diff_vs_uninterrupted'] for r in mine[label]):.1e}"

    lines = ["| phase | " + " | ".join(f"`{label}`" if label.startswith("--") else label for label in labels) + " |",
             "|---|" + "---|" * len(labels)]
    for name, what, _ in PHASES:
        lines.append(f"| {name}: {what} | " + " | ".join(median(label, name) for label in labels) + " |")
    lines.append("| **total: kill -9 -> first step after the resume** | "
                 + " | ".join(f"**{median(label, 'total')}**" for label in labels) + " |")
    lines.append("| final parameters vs an uninterrupted run | "
                 + " | ".join(exactness(label) for label in labels) + " |")
    first = records[0]
    runs = ", ".join(f"{len(mine[label])} runs {label}" for label in labels)
    loads = [r["load_average_before"] for r in records]
    where = machine_label(first["machine"], first["backend"])
    lines += ["", f"Medians of {runs}; {first['world_size']} ranks on {where}, torch {first['torch_version']}, "
                  "measured "
                  f"{min(r['date'] for r in records)[:10]} (load average before each run "
                  f"{min(loads):g}-{max(loads):g}). Command: `{first['command']}` (+ the flag of each column)."]
    return "\n".join(lines)


def readme_table(out_dir: Path) -> str:
    """The README's recovery table, from the committed record (render mark; writes no file)."""
    return table(read_jsonl(RECORD)) + f"\n\n<sub>Record: [records/{RECORD.name}](records/{RECORD.name}).</sub>\n"


def parse_args(argv=None):
    parser = ArgumentParser(description="Recovery time of a torchrun restart, per phase, and the "
                                        "exactness of the resume; prints the README table.")
    parser.add_argument("--measure", action="store_true",
                        help="run the jobs and append to --record (else only print the table)")
    parser.add_argument("--repeats", type=positive_int, default=2,
                        help="crashed runs per configuration (default: 2)")
    parser.add_argument("--record", default=None,
                        help=f"the JSON-lines record (default: with --measure runs/{RECORD.name}, which the "
                             f"maintainer commits as records/{RECORD.name}; else the committed record)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.record is None:  # a reader's measurement goes under runs/; reading defaults to the committed one
        args.record = f"runs/{RECORD.name}" if args.measure else str(RECORD)

    def run() -> None:
        if args.measure:
            check_outputs(None, args, files=["record"])
            measure(args.repeats, Path(args.record))
        path = Path(args.record)
        if not path.is_file():
            raise UsageError(f"no record at {path}: run with --measure first")
        print(table(read_jsonl(path)))

    run_main(run)


if __name__ == "__main__":
    main()
