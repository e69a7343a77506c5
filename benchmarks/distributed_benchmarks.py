"""Run every strategy through the shared harness, side by side: a matrix of strategies x world sizes
x model sizes, each cell its own ``torchrun`` job running the chapter script that teaches it.

Every chapter script takes the same model and training flags (``distkit.models.add_model_args``,
``distkit.flags.add_training_args``: ``--model-size``, ``--steps``, ``--global-batch-size``,
``--warmup-steps``, ``--results``), so a cell is "script + the flags that pick the strategy" (the
table :data:`STRATEGY_COMMANDS`). The harness inside each script times the steps after the warm-up,
counts the collectives on an untimed step and records per-rank memory and the model; this runner
only launches, adds what it knows about the cell (``record["benchmark"]``: its launch command and
time, the model preset, grouping and placement) and keeps going when a cell fails (a record with
``"status": "failed"`` and the error line).

On a GPU machine a cell runs on NCCL when the machine has one GPU per rank; a cell with more ranks
than GPUs runs on CPU/gloo with the GPUs hidden from it, and its output line and record
(``benchmark.placement.note``) say so (``--gpu-only`` skips such cells instead).

    python benchmarks/distributed_benchmarks.py --quick                 # CI: tiny model, minutes
    python benchmarks/distributed_benchmarks.py --world-sizes 2 4 --model-size tiny small
    python benchmarks/distributed_benchmarks.py --strategies ddp fsdp_full_shard zero3 --world-sizes 8 \\
        --model-size medium large --bandwidth                           # a GPU node

Then ``python benchmarks/plot.py`` turns the results file into the comparison plots and table.
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from distkit import ArgumentParser, run_main
from distkit.flags import add_training_args, positive_float, positive_int
from distkit.harness import RECORD_SCHEMA, append_record, describe_model, read_records
from distkit.jobs import run_job
from distkit.logs import progress
from distkit.models import GPT_PRESETS, LLAMA_PRESETS, MODEL_PRESETS, model_config
from distkit.paths import check_outputs
from distkit.strategies import Strategy

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = "runs/benchmarks.jsonl"
DEFAULT_LAUNCHER = "python -m torch.distributed.run --standalone --nproc_per_node={nproc}"

# strategy -> (chapter script, flags that select the strategy, smallest world size). {scratch} is the
# cell's temporary folder, for what a script writes even when it saves no weights (--save none):
# ddp_training's checkpoints and logs, DeepSpeed's checkpoint. Most strategies also run on one rank
# (collectives over a group of one: a world-size-1 cell is what a single-GPU machine can run on
# NCCL); the 2 x 2 meshes need 4.
STRATEGY_COMMANDS: dict[Strategy, tuple[str, list[str], int]] = {
    Strategy.DDP: ("01-ddp-basics/ddp_training.py",
                   ["--resume", "none", "--checkpoint-dir", "{scratch}/ckpt", "--checkpoint-every", "1000000",
                    "--log-dir", "{scratch}/logs"], 1),
    Strategy.DDP_FROM_SCRATCH: ("01-ddp-basics/ddp_from_scratch.py", ["--save", "none"], 1),
    Strategy.FSDP_FULL_SHARD: ("02-fsdp/fsdp_transformer.py", ["--sharding", "full_shard"], 1),
    Strategy.FSDP_SHARD_GRAD_OP: ("02-fsdp/fsdp_transformer.py", ["--sharding", "shard_grad_op"], 1),
    Strategy.FSDP_NO_SHARD: ("02-fsdp/fsdp_transformer.py", ["--sharding", "no_shard"], 1),
    Strategy.FSDP_HYBRID_SHARD: ("02-fsdp/fsdp_transformer.py",
                                 ["--sharding", "hybrid_shard", "--hsdp-shard-size", "2"], 4),
    **{Strategy(zero): ("03-deepspeed/deepspeed_train.py",
                        ["--deepspeed_config", f"03-deepspeed/configs/{zero}_config.json",
                         "--checkpoint-dir", "{scratch}/ds", "--save", "none"], 1)
       for zero in ("zero1", "zero2", "zero3", "zero3_offload")},
    Strategy.TP: ("05-advanced/tensor_parallel.py", ["--save", "none"], 1),
    Strategy.TP_SP: ("05-advanced/tensor_parallel.py", ["--sequence-parallel", "--save", "none"], 1),
    **{Strategy(f"pp_{schedule}"): ("05-advanced/pipeline_parallel.py",
                                    ["--schedule", schedule, "--microbatches", "4", "--save", "none"]
                                    + (["--stages-per-rank", "2"] if schedule == "interleaved_1f1b" else []), 1)
       for schedule in ("gpipe", "1f1b", "interleaved_1f1b")},
    Strategy.FSDP_TP_2D: ("05-advanced/hybrid_parallelism.py",
                          ["--mode", "2d", "--tp", "2", "--save", "none"], 4),
    Strategy.HSDP: ("05-advanced/hybrid_parallelism.py", ["--mode", "hsdp", "--shard", "2", "--save", "none"], 4),
    # the ring over all ranks, one layout (the script's default runs both, one record each)
    Strategy.CP: ("05-advanced/context_parallel.py", ["--layout", "zigzag", "--save", "none"], 1),
    # the GPT with MOE_EXPERTS experts per block, top-2, split over all ranks (ep = ranks)
    Strategy.EP: ("05-advanced/expert_parallel.py",
                  ["--num-experts", "{experts}", "--top-k", "2", "--save", "none"], 1),
}
MOE_EXPERTS = 8  # experts per block of the ep cells: they split over 1, 2, 4 and 8 ranks

# Strategies whose script trains one architecture only: strategy -> (that --arch, why). The matrix
# records the other architectures' cells as skipped with this reason.
ONE_ARCH = {
    Strategy.EP: ("gpt", "expert_parallel.py builds the small GPT with mixture-of-experts MLPs (--arch gpt only)"),
}

# --quick: the tiny model (with 4 blocks so the interleaved pipeline has 2 stages per rank), 2 ranks
# (4 where the mesh needs 2 x 2), a small batch and the fewest steps that give a clean counted step:
# 2 warm-up steps (a run's second step still broadcasts: DDP its rebuilt bucket order, DeepSpeed
# ZeRO-3 its own bookkeeping), the counted step, 2 timed ones. Cells of one script that can train
# several strategies in one process share a launch (GROUPS) to save start-up time; a full run never
# groups.
QUICK_MODEL_SIZE, QUICK_N_LAYER = "tiny", 4
QUICK_STEPS, QUICK_BATCH = 5, 8
GROUPS = {
    "fsdp": ((Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP, Strategy.FSDP_NO_SHARD),
             "02-fsdp/fsdp_transformer.py",
             lambda names: ["--sharding", *[n.removeprefix("fsdp_") for n in names]]),
    "zero": ((Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3, Strategy.ZERO3_OFFLOAD),
             "03-deepspeed/zero_memory.py",
             # --record into the scratch folder: its default is chapter 03's committed record
             lambda names: ["--configs", *names, "--record", "{scratch}/zero_memory.jsonl"]),
    "pp": ((Strategy.PP_GPIPE, Strategy.PP_1F1B, Strategy.PP_INTERLEAVED_1F1B),
           "05-advanced/pipeline_parallel.py",
           lambda names: ["--schedule", *[n.removeprefix("pp_") for n in names], "--microbatches", "4",
                          "--stages-per-rank", "2", "--save", "none"]),
}


@dataclass(frozen=True)
class Placement:
    """Where a launch runs: the ``--backend``/``--device`` it gets, whether the GPUs are hidden from
    it, and why it runs somewhere else than asked (None when it runs as asked)."""

    backend: str
    device: str
    hide_gpus: bool = False
    note: str | None = None


@dataclass
class Cell:
    """One launch: a script, its world size and model, and the strategies it will record."""

    strategies: tuple[str, ...]
    script: str
    flags: list[str]
    world_size: int
    model_size: str
    n_layer: int | None = None  # the preset's block count when None
    placement: Placement = field(default_factory=lambda: Placement("auto", "auto"))
    arch: str = "gpt"


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Benchmark every distributed strategy with the shared harness: a matrix of "
                    "strategies x world sizes x model sizes, one torchrun job per cell, all records "
                    "in one JSON-lines results file (then run benchmarks/plot.py).",
        epilog="example: python benchmarks/distributed_benchmarks.py --world-sizes 2 4 --model-size tiny small")
    parser.add_argument("--quick", action="store_true",
                        help="small CI matrix: tiny model (4 blocks), 2 ranks unless --world-sizes says "
                             f"otherwise (4 for 2-D meshes), {QUICK_STEPS} steps and a global batch of "
                             f"{QUICK_BATCH} unless given, cells of one script share a launch")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGY_COMMANDS), metavar="NAME",
                        help=f"strategies to run (default: all): {' '.join(STRATEGY_COMMANDS)}")
    parser.add_argument("--world-sizes", nargs="+", type=positive_int, default=None, metavar="N",
                        help="ranks per cell (default: 2 4; --quick: 2); strategies that need a 2-D mesh "
                             "skip N < 4 (--quick runs them at 4)")
    parser.add_argument("--arch", nargs="+", default=["gpt"], choices=sorted(MODEL_PRESETS),
                        help="model architectures: the small GPT, the Hugging Face Llama (default: gpt)")
    parser.add_argument("--model-size", nargs="+", default=["tiny"], metavar="SIZE",
                        help="size presets of every --arch (default: tiny; gpt: "
                             f"{'/'.join(GPT_PRESETS)}; llama: {'/'.join(LLAMA_PRESETS)})")
    parser.add_argument("--n-layer", type=positive_int, default=None,
                        help="override the preset's block count in every cell (the pipeline needs at least "
                             "one block per stage, interleaved two per rank)")
    add_training_args(parser, steps=10, global_batch_size=16, lr=None, warmup_steps=2, results=DEFAULT_RESULTS,
                      helps={"steps": "optimizer steps per cell, incl. warm-up and the counted step "
                                      f"(--quick: {QUICK_STEPS} unless given)",
                             "global_batch_size": "sequences per step across all ranks; must divide by every "
                                                  "world size and by the 4 pipeline micro-batches "
                                                  f"(--quick: {QUICK_BATCH} unless given)",
                             "warmup_steps": "untimed warm-up steps per cell",
                             "results": "the records of every cell are appended here"})
    parser.set_defaults(steps=None, global_batch_size=None)  # None = not given: the mode's default below
    parser.add_argument("--cell-timeout-s", type=positive_float, default=900,
                        help="a cell running longer is killed and recorded as failed (default: 900)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also run the chapter-04 collective bandwidth sweep at every world size "
                             "(records go to the same results file)")
    parser.add_argument("--bandwidth-max-bytes", default="16M",
                        help="largest message of the bandwidth sweep (default: 16M)")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="passed to every cell (default: auto = NCCL on GPUs, else gloo)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="passed to every cell (default: auto)")
    parser.add_argument("--gpu-only", action="store_true",
                        help="on a GPU machine, skip the cells that need more GPUs than it has (one GPU per "
                             "NCCL rank) instead of running them on CPU/gloo")
    parser.add_argument("--launcher", default=DEFAULT_LAUNCHER, metavar="COMMAND",
                        help="how a cell's ranks are started; the script and its flags follow ({nproc}: the "
                             "cell's rank count; 'python': this interpreter; default: '%(default)s')")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if "{nproc}" not in args.launcher:
        parser.error(f"--launcher {args.launcher!r} must contain {{nproc}} (where the rank count goes)")
    unknown = [s for s in args.strategies if s not in STRATEGY_COMMANDS]
    if unknown:
        parser.error(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGY_COMMANDS)}")
    for arch in args.arch:
        missing = [size for size in args.model_size if size not in MODEL_PRESETS[arch]]
        if missing:
            parser.error(f"--arch {arch} has no --model-size {' '.join(missing)}; choose from "
                         f"{' '.join(MODEL_PRESETS[arch])}")
    if args.quick:
        args.model_size = [QUICK_MODEL_SIZE]
        args.n_layer = args.n_layer or QUICK_N_LAYER
    args.steps = args.steps or (QUICK_STEPS if args.quick else 10)
    args.global_batch_size = args.global_batch_size or (QUICK_BATCH if args.quick else 16)
    if args.steps <= args.warmup_steps + 1:
        parser.error(f"--steps {args.steps} leaves no timed step after {args.warmup_steps} warm-up "
                     "steps and the counted step; use at least --warmup-steps + 2")
    if args.world_sizes is None:
        args.world_sizes = [2] if args.quick else [2, 4]
    for n in args.world_sizes:
        if args.global_batch_size % n or args.global_batch_size % 4:
            parser.error(f"--global-batch-size {args.global_batch_size} must divide by every world size "
                         f"({n}) and by the 4 pipeline micro-batches")
    return args


def visible_gpus(args) -> int:
    """GPUs the cells may use: none when the run is told to stay on CPU/gloo."""
    if args.device == "cpu" or args.backend == "gloo" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def place(world: int, args, gpus: int) -> Placement | str:
    """Where a ``world``-rank launch runs, or the reason it cannot run (a string).

    NCCL needs one GPU per rank. With ``--backend``/``--device`` on auto, a launch with more ranks
    than this machine has GPUs runs on CPU/gloo instead (with the GPUs hidden from it, so every
    library in it, DeepSpeed's accelerator included, takes the CPU path) and says so in its record;
    ``--gpu-only`` skips it instead. A forced ``--backend nccl`` / ``--device cuda`` cannot fall back.
    """
    if gpus == 0 or world <= gpus:
        return Placement(args.backend, args.device)
    need = f"{world} ranks need {world} GPUs (one per NCCL rank), this machine has {gpus}"
    if args.backend == "nccl" or args.device == "cuda":
        return need
    if args.gpu_only:
        return f"{need} (--gpu-only)"
    return Placement("gloo", "cpu", hide_gpus=True, note=f"ran on CPU/gloo: {need}")


def plan_cells(args, gpus: int | None = None) -> tuple[list[Cell], list[dict]]:
    """The launches to make, and the records of the cells skipped (with their reason) before launching.

    ``gpus`` defaults to what this machine has (:func:`visible_gpus`); passing it makes the plan a
    pure function of the arguments (the tests do).
    """
    cells, skipped = [], []
    if gpus is None:
        gpus = visible_gpus(args)
    for arch, model_size in [(arch, size) for arch in args.arch for size in args.model_size]:
        cfg = model_config(arch, model_size, n_layer=args.n_layer)
        for world in args.world_sizes:
            placements = {}  # strategy -> (world size, placement) of every cell that runs
            for strategy in args.strategies:
                min_world = STRATEGY_COMMANDS[strategy][2]
                world_here = max(world, min_world) if args.quick else world
                where = place(world_here, args, gpus)
                if strategy in ONE_ARCH and arch != ONE_ARCH[strategy][0]:
                    reason = ONE_ARCH[strategy][1]
                elif world_here < min_world:
                    reason = f"needs at least {min_world} ranks" + (" (a 2 x 2 mesh)" if min_world == 4 else "")
                elif strategy == Strategy.CP and cfg.seq_len % (2 * world_here):
                    reason = (f"a ring of {world_here} ranks cuts each sequence into {2 * world_here} chunks; "
                              f"{model_size} has {cfg.seq_len} tokens")
                elif strategy == Strategy.EP and MOE_EXPERTS % world_here:
                    reason = f"{MOE_EXPERTS} experts per block do not split over {world_here} ranks"
                elif strategy == Strategy.PP_INTERLEAVED_1F1B and cfg.n_layer < 2 * world_here:
                    reason = (f"2 stages per rank x {world_here} ranks need {2 * world_here} blocks, "
                              f"{model_size} has {cfg.n_layer}")
                elif strategy.startswith("pp_") and cfg.n_layer < world_here:
                    reason = f"{world_here} pipeline stages need {world_here} blocks, {model_size} has {cfg.n_layer}"
                else:
                    reason = where if isinstance(where, str) else None
                if reason:
                    skipped.append(runner_record(strategy, world_here, "skipped", reason, cfg,
                                                 {"model_size": model_size, "arch": arch}))
                else:
                    placements[strategy] = (world_here, where)
            if args.quick:
                for members, script, make_flags in GROUPS.values():
                    together = tuple(s for s in members if s in placements)
                    if len(together) > 1:  # grouped strategies share one world size, so one placement
                        world_here, where = placements[together[0]]
                        cells.append(Cell(together, script, make_flags(together), world_here, model_size,
                                          args.n_layer, where, arch))
                        placements = {s: v for s, v in placements.items() if s not in together}
            for strategy, (world_here, where) in placements.items():
                script, flags, _ = STRATEGY_COMMANDS[strategy]
                cells.append(Cell((strategy,), script, list(flags), world_here, model_size, args.n_layer, where,
                                  arch))
    return cells, skipped


def runner_record(strategy: str, world_size: int, status: str, error: str, cfg, benchmark: dict,
                  **extra) -> dict:
    """The record of a cell that wrote none itself (skipped before launching, or failed): what the
    runner knows about it, in the fields a harness record has (``distkit.harness``, schema 2)."""
    return {"schema": RECORD_SCHEMA, "strategy": strategy, "world_size": world_size,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": describe_model(cfg),
            "status": status, "error": error, **extra, "benchmark": benchmark}


def launcher_argv(args, nproc: int) -> list[str]:
    """``--launcher`` for ``nproc`` ranks, as argv ('python' is this interpreter)."""
    return [sys.executable if a == "python" else a for a in shlex.split(args.launcher.format(nproc=nproc))]


def shown_command(cmd: list[str]) -> str:
    """A launched command as records and --dry-run show it: this interpreter written as 'python'."""
    return shlex.join(["python" if a == sys.executable else a for a in cmd])


def cell_command(cell: Cell, args, scratch: Path, results: Path) -> list[str]:
    flags = [f.format(scratch=scratch, experts=MOE_EXPERTS) for f in cell.flags]
    return [*launcher_argv(args, cell.world_size), cell.script, *flags, "--arch", cell.arch,
            "--model-size", cell.model_size,
            *(["--n-layer", str(cell.n_layer)] if cell.n_layer else []),
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
            "--global-batch-size", str(args.global_batch_size), "--results", str(results),
            "--backend", cell.placement.backend, "--device", cell.placement.device]


def launch(cmd: list[str], scratch: Path, timeout: float, hide_gpus: bool = False) -> tuple[int, str, float]:
    """Run one cell in a session of its own (its whole process tree, torchrun's workers included,
    ended on timeout: :func:`distkit.jobs.run_job`); returns (rc, output, seconds)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(scratch), DISTKIT_NO_PROGRESS="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks share the cores; one thread each
    if hide_gpus:  # a CPU/gloo cell on a GPU machine: nothing in it may pick the GPU by itself
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = run_job(cmd, timeout, cwd=REPO, env=env)
    # as a text-mode pipe reads it: \r\n and \r end lines as \n
    out = result.output.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    if result.cut:
        out += f"\nerror: cell timed out after {timeout:.0f} s (--cell-timeout-s)"
    return result.returncode, out, result.wall_s


def error_line(output: str) -> str:
    """The most telling line of a failed cell's output: its ``error:`` line, else the last
    exception line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("error:"):
            return line
    for line in reversed(lines):
        if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def run_cell(cell: Cell, args) -> list[dict]:
    """Launch one cell; return the records to append (its harness records, or failure records)."""
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        scratch = Path(tmp)
        cell_results = scratch / "records.jsonl"
        cmd = cell_command(cell, args, scratch, cell_results)
        rc, output, seconds = launch(cmd, scratch, args.cell_timeout_s, cell.placement.hide_gpus)
        records = read_records(cell_results) if cell_results.exists() else []
    shown = shown_command(cmd).replace(str(scratch), "$SCRATCH")
    cell_info = {"command": shown, "launch_s": round(seconds, 2), "arch": cell.arch, "model_size": cell.model_size,
                 "grouped_with": list(cell.strategies) if len(cell.strategies) > 1 else None,
                 # what the runner asked for; the record's own "backend"/"device" say what ran
                 "placement": {"backend": cell.placement.backend, "device": cell.placement.device,
                               "gpus_hidden": cell.placement.hide_gpus, "note": cell.placement.note}}
    for record in records:
        record.update(status="ok", benchmark=cell_info)
    found = {r["strategy"] for r in records}
    cfg = model_config(cell.arch, cell.model_size, n_layer=cell.n_layer)
    return records + [runner_record(strategy, cell.world_size, "failed",
                                    error_line(output) if rc else f"exit 0 but no {strategy} record was written",
                                    cfg, cell_info, exit_code=rc)
                      for strategy in cell.strategies if strategy not in found]


def run_bandwidth(world: int, args, results_file: Path, gpus: int) -> dict:
    """The chapter-04 bandwidth sweep at ``world`` ranks, its records appended to the results file:
    the collectives the strategies use (all_to_all: expert parallelism's dispatch and combine), which
    ``distkit.planner`` fits its alpha-beta times to."""
    where = place(world, args, gpus)
    if isinstance(where, str):
        return {"world_size": world, "ok": False, "error": f"skipped: {where}", "note": None, "seconds": 0.0}
    with tempfile.TemporaryDirectory(prefix="bench_bw_") as tmp:
        cmd = [*launcher_argv(args, world), "04-nccl-operations/bandwidth_test.py",
               "--collectives", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
               "--max-bytes", args.bandwidth_max_bytes, "--results", str(results_file),
               "--plot", str(Path(tmp) / "bw.png"), "--backend", where.backend, "--device", where.device]
        rc, output, seconds = launch(cmd, Path(tmp), args.cell_timeout_s, where.hide_gpus)
    return {"world_size": world, "ok": rc == 0, "error": None if rc == 0 else error_line(output),
            "note": where.note, "seconds": seconds}


def main(argv=None):
    args = parse_args(argv)
    results_file = Path(args.results)
    gpus = visible_gpus(args)
    cells, skipped = plan_cells(args, gpus)
    if args.dry_run:
        for cell in cells:
            if cell.placement.note:
                print(f"# {cell.placement.note}")
            prefix = ["CUDA_VISIBLE_DEVICES="] if cell.placement.hide_gpus else []
            print(shlex.join(prefix) + (" " if prefix else "")
                  + shown_command(cell_command(cell, args, Path("$SCRATCH"), results_file)))
        for entry in skipped:
            print(f"# skipped {entry['strategy']} at {entry['world_size']} ranks: {entry['error']}")
        return
    check_outputs(None, args, files=["results"])  # before the first cell, not after the last
    results_file.parent.mkdir(parents=True, exist_ok=True)
    on_cpu = sum(len(c.strategies) for c in cells if c.placement.hide_gpus)
    print(f"{len(cells)} launches ({sum(len(c.strategies) for c in cells)} cells, {len(skipped)} skipped) "
          f"-> {results_file}" + (f"; {on_cpu} cells run on CPU/gloo: more ranks than this machine's {gpus} "
                                  "GPU(s) (--gpu-only skips them)" if on_cpu else ""), flush=True)
    summary = []
    for entry in skipped:
        append_record(results_file, entry)
    for cell in progress(cells, 0, total=len(cells), desc="benchmark cells"):
        for record in run_cell(cell, args):
            append_record(results_file, record)
            summary.append(record)
            line = f"{record['strategy']:>20} | {record['world_size']} ranks | {cell.model_size:>6} | "
            if record["status"] == "ok":
                m = record["metrics"]
                step = m["step_time_s_median"]
                comm = sum(c["bytes"] for c in m["comm_per_step"].values())
                line += (f"step {step * 1e3:8.1f} ms | {m['tokens_per_s'] or 0:10,.0f} tokens/s | "
                         f"{comm / 2**20:7.3f} MiB/step")
            else:
                line += f"FAILED: {record['error']}"
            if cell.placement.note:
                line += f" | {cell.placement.note}"
            print(line, flush=True)
    if args.bandwidth:
        for world in sorted(set(args.world_sizes)):
            result = run_bandwidth(world, args, results_file, gpus)
            print(f"bandwidth sweep | {world} ranks | " + ("ok" if result["ok"] else f"FAILED: {result['error']}")
                  + (f" | {result['note']}" if result["note"] else ""), flush=True)
    failed = [r for r in summary if r["status"] != "ok"]
    print(f"{len(summary) - len(failed)} cells ok, {len(failed)} failed, {len(skipped)} skipped; "
          f"records in {results_file}; plots: python benchmarks/plot.py --results {results_file}", flush=True)


if __name__ == "__main__":
    run_main(main)
